"""The geometries of the 8-bit dequantizers (per-token and per-group in :mod:`cupyquant.groupwise`,
MXFP8 in :mod:`cupyquant.mx`) and the planner that picks one.

"rows" is each family's row kernel (group_dequantize, mx_dequantize: a thread per 8 elements of a
row, any alignment). The flat geometry (``kernels/flat_dequant.cuh``) reads the codes as whole
16-byte words of a flat 1-D grid without a loop, "flat16" one word (16 elements) a thread and
"flat32" two; it needs the codes and the output 16-byte aligned, and takes any K.
"""

from __future__ import annotations

import numpy as np

from ._scales import magic
from ._sizes import ceil_div

#: The dequantizer geometries, as :data:`GEOMETRY` names them.
GEOMETRIES = ("rows", "flat16", "flat32")
#: Internal override of the planner, for tests and A/B timing: a name of GEOMETRIES, or None (the
#: planner's choice). Read at every call and part of the plan's key, so it may change between calls.
#: A flat geometry asked for where the arrays are not 16-byte aligned gives "rows".
GEOMETRY: str | None = None
#: Threads of a flat block (flat_dequant.cuh FLAT_THREADS).
FLAT_THREADS = 256
#: 16-byte words a thread takes in each flat geometry (the kernels' WORDS).
WORDS = {"flat16": 1, "flat32": 2}
#: The planner takes "flat32" from this many of its blocks per SM up (fewer, larger threads than
#: the row kernel's: below about one wave of blocks the row kernel's 4x as many threads spread the
#: work over more SMs), "rows" below.
FLAT_FROM_BLOCKS_PER_SM = 2

#: The kernels' FlatRows argument (flat_dequant.cuh).
FLAT_ROWS = np.dtype(
    [("n", np.int64), ("K", np.int64), ("k_magic", np.uint64), ("k_shift", np.int32)],
    align=True,
)


def flat_rows(rows: int, K: int) -> np.void:
    """The FlatRows argument of ``rows`` rows of ``K`` codes: their count, K, and the magic number of
    the division by K (:func:`cupyquant._scales.magic`)."""
    return np.array((rows * K, K, *magic(K)), dtype=FLAT_ROWS)[()]


def planned_geometry(n: int, aligned: bool, sms: int) -> str:
    """The planner's geometry for ``n`` codes on ``sms`` SMs: "flat32" where the codes and the
    output are 16-byte aligned (``aligned``) and its grid has at least FLAT_FROM_BLOCKS_PER_SM
    blocks per SM, else "rows"."""
    blocks = ceil_div(n, 16 * FLAT_THREADS * WORDS["flat32"])
    return "flat32" if aligned and blocks >= FLAT_FROM_BLOCKS_PER_SM * sms else "rows"


def geometry(n: int, aligned: bool, sms: int) -> str:
    """:data:`GEOMETRY` where set (a flat one only where ``aligned``, else "rows"), else the
    planner's; a GEOMETRY that names no geometry raises ValueError."""
    forced = GEOMETRY
    if forced is None:
        return planned_geometry(n, aligned, sms)
    if forced not in GEOMETRIES:
        raise ValueError(f"_flat.GEOMETRY must be one of {GEOMETRIES} or None, got {forced!r}")
    return forced if aligned or forced == "rows" else "rows"


def flat_grid(n: int, geometry_: str) -> tuple:
    """(grid, block) of a flat kernel over ``n`` codes."""
    per_block = 16 * FLAT_THREADS * WORDS[geometry_]
    return (ceil_div(n, per_block),), (FLAT_THREADS,)
