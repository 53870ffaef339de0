"""What the MX (:mod:`cupyquant.mx`) and NVFP4 (:mod:`cupyquant.nvfp4`) ops share: the scale
layouts' shape, the argument checks, and the launches of the block-scaled quantizer and dequantizer
of ``kernels/block_scale.cuh``, which each family instantiates in its own ``.cu`` file.

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

from . import _dtypes, _jit, _validate

#: Compute capabilities whose family-specific target has the FP4 and UE8M0 conversion instructions.
SPECIFIC_TARGETS = ("100", "101", "103", "110", "120", "121")
THREADS = 256  # THREADS in block_scale.cuh
TILE_K = 256  # TILE_K in block_scale.cuh: elements per tile row (tiles are 128 rows high)
MX_BLOCK = 32
NV_BLOCK = 16
LAYOUTS = ("dense", "swizzled")

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


def block_scale_shape(shape: tuple[int, ...], block_size: int = 32, scale_layout: str = "dense") -> tuple[int, ...]:
    """The shape of the uint8 scale array that :func:`quantize_mx` (``block_size=32``) or
    :func:`quantize_nvfp4` (``block_size=16``) writes for a tensor of ``shape``: ``shape[:-1] +
    (ceil(K / block_size),)`` dense, ``(round_up(rows, 128), round_up(ceil(K / block_size), 4))``
    swizzled, with ``rows`` the product of ``shape[:-1]``.

    Raises
    ------
    TypeError
        ``shape`` is not a tuple of integers.
    ValueError
        An empty ``shape`` or a negative dimension; ``block_size`` not 32 or 16; an unsupported
        ``scale_layout``.
    """
    shape = _validate.shape_tuple(shape)
    if not shape:
        raise ValueError("shape must have at least one dimension")
    if block_size not in (MX_BLOCK, NV_BLOCK):
        raise ValueError(f"block_size={block_size!r} is not supported; expected 32 (MX) or 16 (NVFP4)")
    if scale_layout not in LAYOUTS:
        raise ValueError(f"scale_layout={scale_layout!r} is not supported; expected one of {LAYOUTS}")
    kb = -(-shape[-1] // block_size)
    if scale_layout == "dense":
        return shape[:-1] + (kb,)
    rows = math.prod(shape[:-1])
    return (-(-rows // 128) * 128, -(-kb // 4) * 4)


def data_shape(shape, bits: int) -> tuple:
    return tuple(shape) if bits == 8 else tuple(shape[:-1]) + (-(-shape[-1] // 2),)


def prepare(x, fmt, block: int, scale_layout, out, scale_out) -> tuple:
    """Shared validation: (in_t, rows, K, row_stride, device, q_shape, s_shape); nothing is
    allocated or launched."""
    in_t = _validate.float_input(x, "x")
    if scale_layout not in LAYOUTS:
        raise ValueError(f"scale_layout={scale_layout!r} is not supported; expected one of {LAYOUTS}")
    rows, K, row_stride = _validate.rows_view(x, "x")
    device = x.data.device_id
    q_shape = data_shape(x.shape, fmt.bits)
    s_shape = block_scale_shape(x.shape, block, scale_layout)
    if out is not None:
        _validate.out_array(out, "out", q_shape, np.uint8, device, inputs=(("x", x),))
    if scale_out is not None:
        _validate.scale_out(scale_out, s_shape, np.uint8, device, inputs=(("out", out), ("x", x)))
    return in_t, rows, K, row_stride, device, q_shape, s_shape


def launch_quantize(
    family: str, name: str, targs, x, q, s, rows, K, row_stride, block, fmt, scale_layout, device, **kw
):
    """Launch ``name<targs..., VEC, HW>`` of ``family`` (a block_quantize instance) over the row
    tiles of ``x``. ``kw``: ``floor_rule`` (MX), ``gs`` = (ScaleSource, value, pointer, output
    pointer) of NVFP4's global scale."""
    n_blocks = -(-K // block)
    n_ktiles = -(-K // TILE_K)
    a = np.zeros((), dtype=QUANT_ARGS)
    a["rows"], a["K"], a["row_stride"] = rows, K, row_stride
    a["q_row"] = K if fmt.bits == 8 else -(-K // 2)
    a["n_blocks"], a["n_units"], a["n_ktiles"] = n_blocks, -(-n_blocks // 4), n_ktiles
    a["swizzled"] = scale_layout == "swizzled"
    a["floor_rule"] = kw.get("floor_rule", 0)
    a["gs_mode"], a["gs_arg"], a["gs_ptr"], a["gs_out"] = kw.get("gs", (0, np.float32(0), 0, 0))
    vec = (
        K % 16 == 0
        and x.data.ptr % 16 == 0
        and (row_stride * x.itemsize) % 16 == 0
        and q.data.ptr % (16 if fmt.bits == 8 else 8) == 0
    )
    k = _jit.kernel(device, family, name, *targs, vec, not FORCE_SOFTWARE)
    k((-(-rows // 128) * n_ktiles,), (THREADS,), (x, q, s, a[()]))


def launch_dequantize(family: str, name: str, targs, q, y, gs_ptr: int) -> None:
    """Launch ``name<targs..., VEC>`` of ``family`` (a block_dequantize instance) to dequantize the
    QuantizedTensor ``q`` into ``y``; ``gs_ptr``: NVFP4's global scale (0 for MX)."""
    fmt = q.format
    shape = q.shape
    K = shape[-1] if shape else 0
    rows = math.prod(shape[:-1])
    if not (rows and K):
        return
    a = np.zeros((), dtype=DEQUANT_ARGS)
    a["rows"], a["K"] = rows, K
    a["q_row"] = K if fmt.bits == 8 else -(-K // 2)
    a["n_blocks"] = -(-K // q.scheme.block[0])
    a["swizzled"] = q.scheme.scale_layout == "swizzled"
    a["gs_ptr"] = gs_ptr
    # pieces of 8 elements: 4 (FP4) or 8 (FP8) bytes in, 8 elements out per load/store
    vec = K % 8 == 0 and q.data.data.ptr % (4 if fmt.bits == 4 else 8) == 0 and y.data.ptr % 16 == 0
    k = _jit.kernel(q.data.data.device_id, family, name, *targs, vec)
    # a warp takes 32 x 4 pieces of a row (block_scale.cuh's PIECES)
    spans = -(-K // (8 * 32 * 4))
    warps = min(8, spans)
    k((rows, -(-spans // warps)), (32, warps), (q.data, q.scale, y, a[()]))


def dequantize(family: str, name: str, targs, q, out_t: _dtypes.InputType, out, gs_ptr: int = 0) -> cupy.ndarray:
    """The body of the MX and NVFP4 dequantizers: check ``out``, allocate, launch."""
    device = q.data.data.device_id
    if out is not None:
        _validate.out_array(out, "out", q.shape, out_t.dtype, device, inputs=(("q.data", q.data),))
    with _validate.on_device_of(q.data):
        y = cupy.empty(q.shape, dtype=out_t.dtype) if out is None else out
        launch_dequantize(family, name, targs, q, y, gs_ptr)
    return y
