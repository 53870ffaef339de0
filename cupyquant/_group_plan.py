"""The planner of :mod:`cupyquant.groupwise`: which per-token kernel and how many warps a row
(token_quantize_few, token_quantize_regs, token_quantize), which SiLU*Mul path, and the 2-D grid
of the row kernels. Plain arithmetic on sizes, no CuPy. The override knobs the planner takes as
arguments (``TOKEN_PATH``, ``TOKEN_FEW_UNITS``, ``SILU_PATH``) live in :mod:`cupyquant.groupwise`,
which reads them at every call; ``_SMALL_GRID_THREADS`` is read here, by :func:`quantize_threads`,
at every call.
"""

from __future__ import annotations

from ._sizes import ceil_div

#: Warps per row of token_quantize_regs (kernels/groupwise.cu): a lane holds 128 bytes of the row.
_TOKEN_WARPS = (1, 2, 4, 8, 16, 32)
_TOKEN_BLOCK = 256  # the block of token_quantize, and of token_quantize_regs up to 8 warps per row


def _token_row_max(itemsize: int, warps: int) -> int:
    """The longest row that ``warps`` warps hold in registers: 128 bytes a lane, in 8-element units."""
    return 32 * warps * (128 // (8 * itemsize)) * 8


#: Up to this many rows, a row gets a wide team (see _token_team).
_TOKEN_FEW_ROWS = 256


def _token_team(K: int, itemsize: int, rows: int):
    """The warps per row of token_quantize_regs for rows of K elements, or None past the longest.

    Many rows: the fewest warps that hold a row (128 bytes a lane), so that each lane keeps the
    most bytes in flight; at 64 registers a thread that is what feeds the memory system (H100,
    16384 x 2048 bf16 to FP8: 38 us at 128 bytes a lane, 64 us at 32). Few rows: up to a whole
    block (8 warps) on each row, at least 32 bytes a lane, so that the row's arithmetic is spread
    over more warps (128 x 4096: 3.5 us against 3.9)."""
    narrow = next((w for w in _TOKEN_WARPS if K <= _token_row_max(itemsize, w)), None)
    if narrow is None or rows > _TOKEN_FEW_ROWS:
        return narrow
    wide = next(w for w in _TOKEN_WARPS if w == 8 or K <= _token_row_max(itemsize, w) // 4)
    return max(narrow, wide)


#: 8-element units a thread of token_quantize_few holds (kernels/groupwise.cu): a block of at most
#: 1024 threads then takes a row of up to 8192 or 16384 elements in one round of loads.
_FEW_UNITS = (1, 2)
_FEW_BLOCK_MAX = 1024
#: Up to this many rows the planner gives per-token quantization token_quantize_few, a block per
#: row, where the row fits (see _token_few); above, token_quantize_regs or token_quantize. On an
#: H200 (bf16, K 4096 and 7168) the few-rows kernel is 1.29-1.75x the team kernel up to 256 rows
#: and 0.90-0.99x at 1024.
_TOKEN_FEW_KERNEL_ROWS = 256
#: The per-token kernels: "few" (token_quantize_few) and "regs" (token_quantize_regs, or the two-pass
#: token_quantize where a row is too long or not 16-byte aligned).
TOKEN_PATHS = ("few", "regs")


def _token_few(K: int, rows: int, path: str | None = None, units: int | None = None):
    """(units a thread, threads a block) of token_quantize_few for ``rows`` rows of K elements, or
    None for the other per-token kernels: with ``path`` None for at most _TOKEN_FEW_KERNEL_ROWS
    rows, with "few" for any number; the fewest units (or ``units``) with which a block of at most
    1024 threads, whole warps, holds the row.

    With few rows a call's time is its fixed chain of dependent steps, not its bytes: a block per
    row issues all of the row's loads at once (a thread's units, 16 or 32 bytes of a 16-bit type,
    in one round), and the row's max takes one barrier and two warp reductions."""
    if path not in (None, *TOKEN_PATHS):
        raise ValueError(f"groupwise.TOKEN_PATH must be one of {TOKEN_PATHS} or None, got {path!r}")
    if units not in (None, *_FEW_UNITS):
        raise ValueError(f"groupwise.TOKEN_FEW_UNITS must be one of {_FEW_UNITS} or None, got {units!r}")
    if path == "regs" or (path is None and rows > _TOKEN_FEW_KERNEL_ROWS):
        return None
    for u in _FEW_UNITS if units is None else (units,):
        threads = 32 * max(1, ceil_div(ceil_div(K, 8 * u), 32))
        if threads <= _FEW_BLOCK_MAX:
            return u, threads
    return None


#: The fused SiLU*Mul quantizer's two ways to its float32 intermediate r, the same r bit for bit
#: (kernels/groupwise.cu): "per_element" (silu_mul: rcp.rn's exponent test and branch around each
#: element's reciprocal, so a thread's 16 elements run one after another) and "batched"
#: (silu_mul16: one exponent test for the thread's 16 reciprocals, taken by ptxas's own rcp.rn fast
#: path where every one of them allows it, and no branch between them).
SILU_PATHS = ("per_element", "batched")


def _silu_batched(rows: int, path: str | None = None) -> bool:
    """Whether silu_mul_quantize takes the batched path over ``rows`` rows: ``path`` if given (a
    name of SILU_PATHS), else always. With few rows a call is its per-thread chain (one or two warps
    a scheduler), which the batched path shortens; with many, other warps hide more of the chain,
    and the batched path's 4-blocks-an-SM register budget (54-64 registers against 46-48) costs some
    occupancy, yet it stays ahead: on an H200 (bf16 to FP8, group 128, H 2048-16384) it is 1.41-1.60x
    the per-element path at 1 and 16 rows, 1.08-1.40x at 128, 1.09-1.34x at 1024, 1.04-1.14x at
    4096 and 1.06-1.09x at 16384."""
    if path not in (None, *SILU_PATHS):
        raise ValueError(f"groupwise.SILU_PATH must be one of {SILU_PATHS} or None, got {path!r}")
    return path != "per_element"


#: Threads of a group_quantize / silu_mul_quantize block where blocks of 256 would leave SMs idle
#: (see quantize_threads): on an H200 at 16 rows of 2048-16384 (bf16, group-128) they take 0.03-0.19 us
#: off a 1.3-2.5 us call (SiLU*Mul at 16 x 4096: 2.34 us against 2.53), and are within 2% of 256
#: at 128 and 1024 rows.
_SMALL_GRID_THREADS = 128


def quantize_threads(rows: int, units: int, sms: int) -> int:
    """Threads of a block of the 2-D group quantizers over ``rows`` rows of ``units`` 16-element
    pieces: 256, or _SMALL_GRID_THREADS where 256-thread blocks would number fewer than the ``sms``
    SMs (the call is then its per-thread chain of arithmetic; smaller blocks spread the threads over
    more SMs, so fewer warps share each SM's schedulers)."""
    return _SMALL_GRID_THREADS if ceil_div(rows * units, 256) < sms else 256


def grid2d(rows: int, units: int, threads: int = 256) -> tuple:
    """(grid, block) of the 2-D row kernels: blockDim (bx, by), bx the largest power of two up to
    ``threads`` that divides the ``units`` (16- or 8-element pieces) of a row, so that no group
    straddles two block rows, and by = threads / bx rows per block."""
    bx = threads
    while units % bx:
        bx //= 2
    by = threads // bx
    return (ceil_div(rows, by), units // bx), (bx, by)
