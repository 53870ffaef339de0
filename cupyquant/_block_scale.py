"""What the MX (:mod:`cupyquant.mx`) and NVFP4 (:mod:`cupyquant.nvfp4`) ops share: the plans and
launches of the block-scaled quantizer and dequantizer of ``kernels/block_scale.cuh``, which each
family instantiates in its own ``.cu`` file. The scale layouts are :mod:`cupyquant._scales`'.

Conversions use the GPU's instructions where it has them (FP8 on sm_89+, FP4 and UE8M0 on the
Blackwell family-specific targets) and exact software paths elsewhere, with the same bytes; setting
the environment variable ``CUPYQUANT_SOFTWARE_CONVERSIONS=1`` (read at import) forces the software
paths.
"""

from __future__ import annotations

import math
import os

import cupy
import numpy as np

from . import _device, _dtypes, _flat, _jit, _plans, _scales, _validate
from ._launch import ARG, Launch
from ._sizes import MAX_GRID_X, MAX_GRID_YZ, VECTOR_BYTES, ceil_div

THREADS = 256  # THREADS in block_scale.cuh
TILE_K = 256  # TILE_K in block_scale.cuh: elements per tile row (tiles are 128 rows high)
TILE_ROWS = 128
#: Threads of a block of the small geometry (block_scale.cuh SMALL_THREADS)
SMALL_THREADS = 128
#: The quantizer's geometries (block_scale.cuh): "tile", a block per 128 x 256 tile, each thread 8
#: segments of 16 elements in two rounds of loads; "small", a thread per segment, all its loads in
#: flight at once, and the swizzled layout's padding rows zeroed by blocks that load nothing;
#: "wide", a thread per segment in four rows 32 apart (one 16-byte chunk of swizzled scales), its
#: NVFP4 codes formed mostly in float32 arithmetic (nvfp4_fast_codes) instead of integer
#: instructions, the grid covering whole 128-row tiles.
GEOMETRIES = ("tile", "small", "wide")
#: Rows each thread of the wide geometry takes (block_scale.cuh WIDE_ROWS), 32 apart
WIDE_ROWS = 4
#: The planner gives the 4-bit formats the tile geometry from this many tiles per SM up, the small
#: one below; 8-bit (MXFP8) takes the small one at every size. On the H200 (bf16 in, swizzled
#: or dense scales) the small geometry is 1.14-1.56x the tile's speed for MXFP8 from 2048 to 16384
#: rows of 4096 and 7168; for MXFP4 and NVFP4 1.01-1.55x up to 7.8 tiles an SM (8192 x 4096) and
#: 0.93-1.04x from 13.6 (8192 x 7168) up.
SMALL_BELOW_TILES_PER_SM_FP4 = 8
#: NVFP4 takes the wide geometry from WIDE_FROM_ROWS rows and WIDE_FROM_BLOCKS_PER_SM of its blocks
#: (8192 elements each) per SM up. On the H200 (bf16, swizzled scales) it is 1.32-1.43x the speed of
#: the others from 4096 rows of 4096 and 7168 (93-95% of copy at 16384 rows, where the tile geometry
#: reaches 67-71%) and 1.05x at 1024 x 7168 (6.8 blocks an SM), and 0.86x at 1024 x 4096 (3.9).
#: Below 1024 rows it computes mostly the zero rows of its 128-row tiles (0.65-0.95x the small one).
WIDE_FROM_ROWS = 1024
WIDE_FROM_BLOCKS_PER_SM = 6
#: Internal override of the planner, for tests and A/B timing: a name of GEOMETRIES, or None (the
#: planner's choice). Read at every call and part of the plan's key, so it may change between calls.
GEOMETRY: str | None = None
#: Pieces of 8 elements a warp of the dequantizer takes of a row (block_scale.cuh's PIECES x 32 lanes)
DEQUANT_PIECES = 32 * 4
#: MXFP8 dequantization of at most this many rows of FLAT_FEW_ROWS_FROM_K codes or more takes the
#: flat geometry whatever its size: the row kernel gives such a row one or two blocks of 7-8 warps,
#: and on an H200 (bf16 out, swizzled scales) flat16 takes 0.9 us at 1 row of 16384 against 1.2,
#: 1.1 against 1.4 at 16 rows, 1.0 against 1.1 at 1 row of 7168, the same at 16 rows of 7168; at
#: 4096 the row kernel is the faster (1.0 against 1.1 us).
FLAT_FEW_ROWS = 16
FLAT_FEW_ROWS_FROM_K = 4097

#: Force the software conversions (tests set this to check them against the hardware ones).
FORCE_SOFTWARE = os.environ.get("CUPYQUANT_SOFTWARE_CONVERSIONS", "") not in ("", "0")

QUANT_ARGS = np.dtype(
    [
        ("rows", np.int64),
        ("K", np.int64),
        ("row_stride", np.int64),
        ("q_row", np.int64),
        ("n_blocks", np.int64),
        ("n_units", np.int64),
        ("n_ktiles", np.int64),
        ("swizzled", np.int32),
        ("floor_rule", np.int32),
        ("gs_mode", np.int32),
        ("gs_arg", np.float32),
        ("gs_ptr", np.uint64),
        ("gs_out", np.uint64),
        ("row_blocks", np.int64),
    ],
    align=True,
)
DEQUANT_ARGS = np.dtype(
    [
        ("rows", np.int64),
        ("K", np.int64),
        ("q_row", np.int64),
        ("n_blocks", np.int64),
        ("swizzled", np.int32),
        ("gs_ptr", np.uint64),
    ],
    align=True,
)


def planned_geometry(rows: int, K: int, sms: int, bits: int, nvfp4: bool = False) -> str:
    """The planner's geometry for ``rows`` rows of ``K`` elements of ``bits``-bit codes on ``sms``
    SMs: "small" for 8-bit codes; for NVFP4 "wide" from WIDE_FROM_ROWS rows and
    WIDE_FROM_BLOCKS_PER_SM wide blocks an SM; else, for 4-bit codes, "small" where the tile grid
    would give the SMs fewer than SMALL_BELOW_TILES_PER_SM_FP4 tiles each, "tile" from there."""
    if bits == 8:
        return "small"
    wide_blocks = ceil_div(rows, TILE_ROWS) * TILE_ROWS * ceil_div(K, 16) // (WIDE_ROWS * SMALL_THREADS)
    if nvfp4 and rows >= WIDE_FROM_ROWS and wide_blocks >= WIDE_FROM_BLOCKS_PER_SM * sms:
        return "wide"
    tiles = ceil_div(rows, TILE_ROWS) * ceil_div(K, TILE_K)
    return "small" if tiles < SMALL_BELOW_TILES_PER_SM_FP4 * sms else "tile"


def small_launch_shape(rows: int, n_units: int, block: int, swizzled: bool):
    """(grid, block, row_blocks) of the small geometry (block_scale.cuh small_quantize), or None
    where its grid would pass CUDA's limits. A row is ``n_units * 4 * block / 16`` segments; a
    block takes ``bx`` of them (the largest power of two up to SMALL_THREADS that divides that) in
    ``SMALL_THREADS / bx`` rows. With swizzled scales and a partial last tile of 128 rows, the blocks
    past ``row_blocks`` zero its padding rows, a thread per 16 bytes of each of the ``n_units``
    512-byte units."""
    segs = n_units * 4 * (block // 16)
    bx = SMALL_THREADS
    while segs % bx:
        bx //= 2
    by = SMALL_THREADS // bx
    gy = segs // bx
    row_blocks = ceil_div(rows, by)
    pad_blocks = ceil_div(ceil_div(n_units * 32, SMALL_THREADS), gy) if swizzled and rows % TILE_ROWS else 0
    if gy > MAX_GRID_YZ or row_blocks + pad_blocks > MAX_GRID_X:
        return None
    return (row_blocks + pad_blocks, gy), (bx, by), row_blocks


def wide_launch_shape(rows: int, n_units: int, block: int):
    """(grid, block) of the wide geometry (block_scale.cuh wide_quantize), or None where its grid
    would pass CUDA's limits. Blocks of SMALL_THREADS threads, ``bx`` along a row as in
    :func:`small_launch_shape`, ``by = SMALL_THREADS / bx`` (at most 32) row offsets of a 128-row
    tile, each thread taking its segment in the WIDE_ROWS rows 32 apart from its offset: ``32 / by``
    blocks per tile, whole tiles."""
    segs = n_units * 4 * (block // 16)
    bx = SMALL_THREADS
    while segs % bx:
        bx //= 2
    by = SMALL_THREADS // bx
    gx, gy = ceil_div(rows, TILE_ROWS) * (TILE_ROWS // WIDE_ROWS // by), segs // bx
    if gy > MAX_GRID_YZ or gx > MAX_GRID_X:
        return None
    return (gx, gy), (bx, by)


class QuantPlan:
    """A checked block-quantizer call: the launch (None when there is nothing to launch; arguments
    x, q, the scales, then NVFP4's global scale to read and to write, fields of the argument
    struct), its geometry, the outputs' shapes, the input's type, and the overlap check of caller
    buffers."""

    __slots__ = ("launch", "geometry", "q_shape", "s_shape", "in_t", "disjoint")

    def __init__(self, family, name, ftargs, x, fmt, block, scale_layout, out, scale_out, floor_rule, gs, nv, geometry):
        self.in_t = _validate.float_input(x, "x")
        _scales.check_block_layout(scale_layout)
        rows, K, row_stride = _validate.rows_view(x, "x")
        device = x.data.device_id
        self.q_shape = _scales.packed_shape(x.shape, fmt.bits)
        self.s_shape = _scales.block_scale_shape(x.shape, block, scale_layout)
        if out is not None:
            _validate.out_array(out, "out", self.q_shape, np.uint8, device, inputs=(("x", x),))
        if scale_out is not None:
            _validate.scale_out(scale_out, self.s_shape, np.uint8, device, inputs=(("out", out), ("x", x)))
        self.disjoint = _validate.Disjoint((("x", x), ("out", out), ("scale_out", scale_out)), 1)
        n_blocks, n_ktiles = ceil_div(K, block), ceil_div(K, TILE_K)
        n_units, swizzled = ceil_div(n_blocks, 4), scale_layout == "swizzled"
        if geometry is None:
            geometry = planned_geometry(rows, K, _device.sm_count(device), fmt.bits, nv)
        small = small_launch_shape(rows, n_units, block, swizzled) if geometry == "small" and rows and K else None
        wide = wide_launch_shape(rows, n_units, block) if geometry == "wide" and rows and K else None
        self.geometry = "small" if small is not None else "wide" if wide is not None else "tile"
        a = np.array(
            (rows, K, row_stride, K if fmt.bits == 8 else ceil_div(K, 2), n_blocks, n_units, n_ktiles,
             swizzled, floor_rule, gs[0], gs[1], 0, 0, 0 if small is None else small[2]),
            dtype=QUANT_ARGS,
        )[()]  # fmt: skip
        self.launch = None
        if rows and K:
            vec = (
                K % 16 == 0
                and x.data.ptr % VECTOR_BYTES == 0
                and (row_stride * x.itemsize) % VECTOR_BYTES == 0
                and (out is None or out.data.ptr % (16 if fmt.bits == 8 else 8) == 0)
            )
            if small is not None:
                name, grid, threads = name + "_small", small[0], small[1]
            elif wide is not None:
                name, (grid, threads) = name + "_wide", wide
            else:
                grid, threads = (ceil_div(rows, TILE_ROWS) * n_ktiles,), (THREADS,)
            k = _jit.kernel(device, family, name, self.in_t.ctype, *ftargs, vec, not FORCE_SOFTWARE)
            fields = ((3, "gs_ptr"), (3, "gs_out")) if nv else ()
            self.launch = Launch(k, grid, threads, (ARG, ARG, ARG, a), pdl=_device.caps(device).pdl, fields=fields)


_QUANT_PLANS = _plans.Plans()


def plan_quantize(family, name, ftargs, x, fmt, block, scale_layout, out, scale_out, floor_rule=0, gs=None):
    """The plan of a block quantizer ``name<in, *ftargs, VEC, HW>`` of ``family`` (a block_quantize
    instance; ``name + "_small"`` or ``name + "_wide"``, a small_quantize or wide_quantize instance,
    where the geometry is "small" or "wide"),
    memoized per signature; ``gs``: NVFP4's (ScaleSource, value) of the global scale (None for MX).
    The geometry is :data:`GEOMETRY`'s where set, else the planner's. Nothing is allocated."""
    geometry = GEOMETRY
    if geometry is not None and geometry not in GEOMETRIES:
        raise ValueError(f"_block_scale.GEOMETRY must be one of {GEOMETRIES} or None, got {geometry!r}")
    key = (family, name, ftargs, _validate.array_key(x), block, scale_layout, floor_rule, gs, geometry)
    key += (_validate.array_key(out), _validate.array_key(scale_out))
    plan = _QUANT_PLANS.lookup(key)
    if plan is None:
        nv = gs is not None
        plan = _QUANT_PLANS.keep(
            key,
            QuantPlan(
                family,
                name,
                ftargs,
                x,
                fmt,
                block,
                scale_layout,
                out,
                scale_out,
                floor_rule,
                gs or (0, 0.0),
                nv,
                geometry,
            ),
        )
    if out is not None or scale_out is not None:
        plan.disjoint.check(
            (x.data.ptr, 0 if out is None else out.data.ptr, 0 if scale_out is None else scale_out.data.ptr)
        )
    return plan


def _dequant_plan(family, name, targs, q, out_t, out, nv: bool, flat):
    """(launch or None, overlap check): arguments q.data, the scales, y, then NVFP4's global scale
    (a field of the argument struct). ``flat``: the name of the family's flat kernel
    (``flat<out, F, PIECES, SWIZZLED>``, kernels/flat_dequant.cuh) where it has one, launched where
    :func:`cupyquant._flat.geometry` picks a flat geometry."""
    fmt = q.format
    shape = q.shape
    K = shape[-1] if shape else 0
    rows = math.prod(shape[:-1])
    device = q.data.data.device_id
    if out is not None:
        _validate.out_array(out, "out", q.shape, out_t.dtype, device, inputs=(("q.data", q.data),))
    disjoint = _validate.Disjoint((("q.data", q.data), ("out", out)), 1)
    if not (rows and K):
        return None, disjoint
    a = np.array(
        (rows, K, K if fmt.bits == 8 else ceil_div(K, 2), ceil_div(K, q.scheme.block[0]),
         q.scheme.scale_layout == "swizzled", 0),
        dtype=DEQUANT_ARGS,
    )[()]  # fmt: skip
    y_aligned = out is None or out.data.ptr % VECTOR_BYTES == 0
    pdl = _device.caps(device).pdl
    if flat is not None:
        aligned = _flat.flat_aligned(q.data.data.ptr, 0 if out is None else out.data.ptr)
        few_long = rows <= FLAT_FEW_ROWS and K >= FLAT_FEW_ROWS_FROM_K
        geometry = _flat.geometry(rows * K, aligned, _device.sm_count(device), q.scale.size, few_long)
        if geometry != "rows":
            k = _jit.kernel(device, family, flat, *targs, _flat.PIECES[geometry], q.scheme.scale_layout == "swizzled")
            grid, block = _flat.flat_grid(rows * K, geometry)
            return Launch(k, grid, block, (ARG, ARG, ARG, a, _flat.flat_rows(rows, K)), pdl=pdl), disjoint
    # pieces of 8 elements: 4 (FP4) or 8 (FP8) bytes in, 8 elements out per load/store
    vec = K % 8 == 0 and q.data.data.ptr % (4 if fmt.bits == 4 else 8) == 0 and y_aligned
    k = _jit.kernel(device, family, name, *targs, vec)
    spans = ceil_div(K, 8 * DEQUANT_PIECES)
    warps = min(8, spans)
    fields = ((3, "gs_ptr"),) if nv else ()
    grid, block = (rows, ceil_div(spans, warps)), (32, warps)
    return Launch(k, grid, block, (ARG, ARG, ARG, a), pdl=pdl, fields=fields), disjoint


_DEQUANT_PLANS = _plans.Plans()


def dequantize(
    family: str, name: str, targs, q, out_t: _dtypes.InputType, out, nv: bool = False, flat: str | None = None
) -> cupy.ndarray:
    """The body of the MX and NVFP4 dequantizers: the plan of ``name<targs..., VEC>`` of ``family``
    or of its flat kernel ``flat<targs..., PIECES, SWIZZLED>`` (memoized per signature, the flat
    geometry's knob :data:`cupyquant._flat.GEOMETRY` part of it), the overlap check of ``out``, the
    output, one launch; ``nv``: NVFP4, whose kernel also reads ``q.global_scale``."""
    data = q.data
    key = (family, name, targs, q.scheme, q.shape, _validate.array_key(data), nv, _validate.array_key(out))
    key += (flat, _flat.GEOMETRY)
    plan = _DEQUANT_PLANS.lookup(key)
    if plan is None:
        plan = _DEQUANT_PLANS.keep(key, _dequant_plan(family, name, targs, q, out_t, out, nv, flat))
    launch, disjoint = plan
    if out is not None:
        disjoint.check((data.data.ptr, out.data.ptr))
    with _validate.on_device_of(data):
        y = cupy.empty(q.shape, dtype=out_t.dtype) if out is None else out
        if launch is not None:
            if nv:
                launch(data, q.scale, y, q.global_scale)
            else:
                launch(data, q.scale, y)
    return y
