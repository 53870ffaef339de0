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
from typing import NamedTuple

import cupy
import numpy as np

from . import _dtypes, _jit, _plans, _validate

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


class QuantPlan(NamedTuple):
    """A quantizer call after its checks: the kernel (None when there is nothing to launch), its
    grid, its arguments with NVFP4's global-scale pointers unset, the outputs' shapes and the
    input's type."""

    kernel: object
    grid: tuple
    args: np.ndarray
    q_shape: tuple
    s_shape: tuple
    in_t: _dtypes.InputType


_QUANT_PLANS = _plans.Plans()


def plan_quantize(family, name, ftargs, x, fmt, block, scale_layout, out, scale_out, floor_rule=0, gs=(0, 0.0)):
    """Check the arguments of a block quantizer and plan the launch of ``name<in, *ftargs, VEC,
    HW>`` of ``family`` (a block_quantize instance); memoized per signature where no output buffer
    is given. ``gs``: NVFP4's (ScaleSource, value) of the global scale. Nothing is allocated."""
    key = None
    if out is None and scale_out is None and type(x) is cupy.ndarray:
        mem = x.data
        key = (family, name, ftargs, x.shape, x.strides, x.dtype, mem.device_id, mem.ptr & 15, block, scale_layout)
        key += (floor_rule, gs)
    plan = _QUANT_PLANS.lookup(key)
    if plan is None:
        plan = _QUANT_PLANS.keep(
            key, _plan_quantize(family, name, ftargs, x, fmt, block, scale_layout, out, scale_out, floor_rule, gs)
        )
    return plan


def _plan_quantize(family, name, ftargs, x, fmt, block, scale_layout, out, scale_out, floor_rule, gs) -> QuantPlan:
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
    n_blocks = -(-K // block)
    n_ktiles = -(-K // TILE_K)
    a = np.array(
        (
            rows,
            K,
            row_stride,
            K if fmt.bits == 8 else -(-K // 2),
            n_blocks,
            -(-n_blocks // 4),
            n_ktiles,
            scale_layout == "swizzled",
            floor_rule,
            gs[0],
            gs[1],
            0,
            0,
        ),
        dtype=QUANT_ARGS,
    )
    if not (rows and K):
        return QuantPlan(None, (), a, q_shape, s_shape, in_t)
    vec = (
        K % 16 == 0
        and x.data.ptr % 16 == 0
        and (row_stride * x.itemsize) % 16 == 0
        and (out is None or out.data.ptr % (16 if fmt.bits == 8 else 8) == 0)
    )
    k = _jit.kernel(device, family, name, in_t.ctype, *ftargs, vec, not FORCE_SOFTWARE)
    return QuantPlan(k, (-(-rows // 128) * n_ktiles,), a, q_shape, s_shape, in_t)


def launch_quantize(plan: QuantPlan, x, q, s, gs_ptr: int = 0, gs_out: int = 0) -> None:
    """Launch a planned block quantizer (nothing when the plan has no kernel); ``gs_ptr`` and
    ``gs_out``: NVFP4's global scale on the device, to read and to write."""
    if plan.kernel is None:
        return
    a = plan.args
    if gs_ptr or gs_out:
        a = a.copy()
        a["gs_ptr"], a["gs_out"] = gs_ptr, gs_out
    plan.kernel(plan.grid, (THREADS,), (x, q, s, a[()]))


def _dequant_plan(family, name, targs, q, y_aligned: bool) -> tuple:
    """(kernel or None, grid, block, arguments with the global-scale pointer unset)."""
    fmt = q.format
    shape = q.shape
    K = shape[-1] if shape else 0
    rows = math.prod(shape[:-1])
    if not (rows and K):
        return None, (), (), None
    a = np.array(
        (
            rows,
            K,
            K if fmt.bits == 8 else -(-K // 2),
            -(-K // q.scheme.block[0]),
            q.scheme.scale_layout == "swizzled",
            0,
        ),
        dtype=DEQUANT_ARGS,
    )
    # pieces of 8 elements: 4 (FP4) or 8 (FP8) bytes in, 8 elements out per load/store
    vec = K % 8 == 0 and q.data.data.ptr % (4 if fmt.bits == 4 else 8) == 0 and y_aligned
    k = _jit.kernel(q.data.data.device_id, family, name, *targs, vec)
    # a warp takes 32 x 4 pieces of a row (block_scale.cuh's PIECES)
    spans = -(-K // (8 * 32 * 4))
    warps = min(8, spans)
    return k, (rows, -(-spans // warps)), (32, warps), a


_DEQUANT_PLANS = _plans.Plans()


def dequantize(family: str, name: str, targs, q, out_t: _dtypes.InputType, out, gs_ptr: int = 0) -> cupy.ndarray:
    """The body of the MX and NVFP4 dequantizers: check ``out``, plan (memoized where ``out`` is
    None), allocate, launch ``name<targs..., VEC>`` of ``family``; ``gs_ptr``: NVFP4's global scale
    (0 for MX)."""
    device = q.data.data.device_id
    if out is None:
        key = (family, name, targs, q.scheme, q.shape, device, q.data.data.ptr & 7)
        plan = _DEQUANT_PLANS.lookup(key) or _DEQUANT_PLANS.keep(key, _dequant_plan(family, name, targs, q, True))
    else:
        _validate.out_array(out, "out", q.shape, out_t.dtype, device, inputs=(("q.data", q.data),))
        plan = _dequant_plan(family, name, targs, q, out.data.ptr % 16 == 0)
    k, grid, block, a = plan
    with _validate.on_device_of(q.data):
        y = cupy.empty(q.shape, dtype=out_t.dtype) if out is None else out
        if k is not None:
            if gs_ptr:
                a = a.copy()
                a["gs_ptr"] = gs_ptr
            k(grid, block, (q.data, q.scale, y, a[()]))
    return y
