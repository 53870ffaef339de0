"""The geometries of the 8-bit dequantizers (per-token and per-group in :mod:`cupyquant.groupwise`,
MXFP8 in :mod:`cupyquant.mx`) and the planner that picks one.

"rows" is each family's row kernel (group_dequantize, mx_dequantize: a thread per 8 elements of a
row, any alignment). The flat geometry (``kernels/flat_dequant.cuh``) reads the codes as whole
pieces of 8 (one 8-byte load, a 16-byte store of bf16) on a flat 1-D grid without a loop, "flat16"
two pieces a thread and "flat32" four; it needs the codes 8-byte and the output 16-byte aligned,
and takes any K.
"""

from __future__ import annotations

import numpy as np

from ._scales import magic
from ._sizes import ceil_div

#: The dequantizer geometries, as :data:`GEOMETRY` names them.
GEOMETRIES = ("rows", "flat16", "flat32")
#: Internal override of the planner, for tests and A/B timing: a name of GEOMETRIES, or None (the
#: planner's choice). Read at every call and part of the plan's key, so it may change between calls.
#: A flat geometry asked for where the arrays are not aligned for it gives "rows".
GEOMETRY: str | None = None
#: Threads of a flat block (flat_dequant.cuh FLAT_THREADS).
FLAT_THREADS = 256
#: Pieces of 8 codes a thread takes in each flat geometry (the kernels' PIECES).
PIECES = {"flat16": 2, "flat32": 4}
#: The flat geometry the planner takes: on an H200 "flat16" reaches 95-96% of copy at 16384 x
#: 4096..8192 where "flat32" (48 registers, 62% theoretical occupancy) reaches 93-94% and the row
#: kernel 86-92%.
PLANNED_FLAT = "flat16"
#: The planner takes PLANNED_FLAT from this many of its blocks per SM up, "rows" below: on an H200
#: flat16 is 1.02-1.10x the row kernel from 1024 rows of 4096 (7.8 blocks per SM) up, and 0.9-1.1x
#: at 256 rows of 7168 or 8192 (3.4-3.9 blocks per SM).
FLAT_FROM_BLOCKS_PER_SM = 4

#: The flat kernels take fewer elements than this, with fewer scale words or bytes (their index
#: arithmetic is 32-bit, the row of an element a multiply by a magic number exact below 2^31); the
#: row kernel takes larger tensors.
FLAT_MAX_ELEMENTS = 1 << 31
#: The kernels' FlatRows argument (flat_dequant.cuh).
FLAT_ROWS = np.dtype(
    [("n", np.int64), ("K", np.int64), ("k_magic", np.uint64), ("k_shift", np.int32)],
    align=True,
)


def flat_rows(rows: int, K: int) -> np.void:
    """The FlatRows argument of ``rows`` rows of ``K`` codes: their count, K, and the magic number of
    the division by K (:func:`cupyquant._scales.magic`)."""
    return np.array((rows * K, K, *magic(K)), dtype=FLAT_ROWS)[()]


def flat_aligned(q_ptr: int, y_ptr: int) -> bool:
    """Whether codes at ``q_ptr`` and an output at ``y_ptr`` suit the flat kernels (8-byte loads,
    16-byte stores)."""
    return q_ptr % 8 == 0 and y_ptr % 16 == 0


def planned_geometry(n: int, aligned: bool, sms: int) -> str:
    """The planner's geometry for ``n`` codes on ``sms`` SMs: PLANNED_FLAT where the codes and the
    output are aligned for it (``aligned``: :func:`flat_aligned`) and its grid has at least
    FLAT_FROM_BLOCKS_PER_SM blocks per SM, else "rows"."""
    blocks = ceil_div(n, 8 * FLAT_THREADS * PIECES[PLANNED_FLAT])
    return PLANNED_FLAT if aligned and blocks >= FLAT_FROM_BLOCKS_PER_SM * sms else "rows"


def geometry(n: int, aligned: bool, sms: int, scale_span: int = 0, prefer_flat: bool = False) -> str:
    """:data:`GEOMETRY` where set, else the planner's (PLANNED_FLAT at any size where the caller
    says ``prefer_flat``); a flat one only where ``aligned`` and both ``n`` and ``scale_span`` (the
    scale array's words or bytes, padding included) are below FLAT_MAX_ELEMENTS, else "rows". A
    GEOMETRY that names no geometry raises ValueError."""
    forced = GEOMETRY
    if forced is not None and forced not in GEOMETRIES:
        raise ValueError(f"_flat.GEOMETRY must be one of {GEOMETRIES} or None, got {forced!r}")
    if not aligned or max(n, scale_span) >= FLAT_MAX_ELEMENTS:
        return "rows"
    if forced is None:
        return PLANNED_FLAT if prefer_flat else planned_geometry(n, aligned, sms)
    return forced


def flat_grid(n: int, geometry_: str) -> tuple:
    """(grid, block) of a flat kernel over ``n`` codes."""
    per_block = 8 * FLAT_THREADS * PIECES[geometry_]
    return (ceil_div(n, per_block),), (FLAT_THREADS,)
