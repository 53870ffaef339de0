"""Size arithmetic shared by the ops, the reference and the kernels' launch shapes (no CuPy)."""

from __future__ import annotations

#: The widest vector load or store of the kernels, in bytes: a view is read through them only where
#: its address and row stride are multiples of it.
VECTOR_BYTES = 16
#: The largest grid y and z dimensions (the x dimension goes to 2^31 - 1).
MAX_GRID_YZ = 65535
#: The largest grid x dimension.
MAX_GRID_X = (1 << 31) - 1


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, ``b > 0``."""
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    """The least multiple of ``b`` that is at least ``a``."""
    return -(-a // b) * b
