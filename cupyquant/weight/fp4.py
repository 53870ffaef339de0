"""FP4 weights: NVFP4 (E2M1 codes, an E4M3 scale per 16 k, a float32 ``scale_2`` per weight) and
MXFP4 (E2M1 codes, an E8M0 scale per 32 k), made by the library's own quantizers
(:func:`cupyquant.quantize_nvfp4`, :func:`cupyquant.quantize_mx`) and checked here.

Plain layout: data uint8 ``(N, K / 2)`` (element 0 in the low nibble), scale uint8
``(N, K / block)`` (the E4M3 or E8M0 bytes, row-major), NVFP4's ``scale_2`` float32 ``(1,)``.
Prepared: the data in INT4's fragment order with each chunk's 4 x 4 blocks of 8 k transposed,
``(ceil(N / 16), K / 128, 2, 32, 16)``, and the scales ``(ceil(N / 16), K / 128, 16, 128 / block)``:
each 16-row tile's scale bytes of a 128-k chunk together, a row's ``128 / block`` bytes contiguous.
"""

from __future__ import annotations

import cupy
import numpy as np

from .. import _jit, _validate
from . import configs as C
from .container import QuantizedWeight, weight_scheme

FORMATS = tuple(C.FP4_BLOCK)


def group_size_of(fmt: str, group_size) -> int:
    """The block of an FP4 format; ``group_size`` must be left at its default or be that block."""
    from .. import _checks

    return _checks.fp4_weight_group_size(fmt, C.FP4_BLOCK[fmt], group_size)


def scale_2_of(global_scale) -> cupy.ndarray:
    """NVFP4's decode scale ``float32(1 / S_enc)`` (a new float32 (1,) array) from the encode scale
    ``global_scale`` (a float32 device array of one element, on the current device), correctly
    rounded with subnormals kept: one launch of ``weight_scale_2`` (a CuPy division would flush a
    subnormal quotient, ``-ftz=true``), no host synchronization."""
    s2 = cupy.empty((1,), np.float32)
    k = _jit.kernel(global_scale.data.device_id, C.QUANT_FAMILY, "weight_scale_2", C.WEIGHT_NVFP4)
    k((1,), (32,), (global_scale, s2))
    return s2


def quantize(w, fmt: str) -> QuantizedWeight:
    """quantize_weight for "nvfp4" and "mxfp4" (w checked: a 2-D C-contiguous float CuPy array):
    the bytes of quantize_nvfp4 (the global scale reduced on the device) or quantize_mx (rounding
    "ceil"), with dense scales."""
    from .. import _checks, mx, nvfp4

    N, K = w.shape
    block = C.FP4_BLOCK[fmt]
    _checks.fp4_weight_k(fmt, block, K)
    with _validate.on_device_of(w):
        if fmt == "nvfp4":
            q = nvfp4.quantize_nvfp4(w, scale_layout="dense")
            scale_2 = scale_2_of(q.global_scale)  # the decode scale, as dequantize_nvfp4 takes it
            _validate.keep_if_capturing(q.global_scale)
        else:
            q = mx.quantize_mx(w, "float4_e2m1fn", scale_layout="dense")
            scale_2 = None
    scheme = weight_scheme(fmt, block, K, w.dtype)
    return QuantizedWeight(q.data, q.scale, None, scheme, (N, K), w.dtype, scale_2=scale_2)


def check(w) -> None:
    """check_weight's rules for an FP4 weight (its arrays already checked to be C-contiguous CuPy arrays)."""
    fmt = w._format
    N, K = w.shape
    block = C.FP4_BLOCK[fmt]
    if w.scheme.granularity != "group" or w.scheme.block != (block,):
        raise ValueError(
            f"{fmt} weights have groups of {block} along K (granularity 'group', block ({block},)), "
            f"got granularity {w.scheme.granularity!r}, block {w.scheme.block}"
        )
    if K % block:
        raise ValueError(f"w.shape's K must be a multiple of {block} for {fmt} weights, got {w.shape}")
    if w.zero_point is not None:
        raise ValueError(f"w.zero_point must be None for {fmt} weights")
    if w._prepared:
        if K % C.CHUNK[fmt]:
            raise ValueError(f"w.shape's K must be a multiple of {C.CHUNK[fmt]} for a prepared weight, got {w.shape}")
        n16, nch = -(-N // 16), K // 128
        data_shape, scale_shape = (n16, nch, 2, 32, 16), (n16, nch, 16, 128 // block)
    else:
        data_shape, scale_shape = (N, K // 2), (N, K // block)
    if w.data.shape != data_shape or w.data.dtype != np.uint8:
        raise ValueError(
            f"w.data must be uint8 of shape {data_shape} for a {w.scheme.scale_layout} {fmt} weight of shape "
            f"{w.shape}, got {w.data.dtype} {w.data.shape}"
        )
    if w.scale.shape != scale_shape or w.scale.dtype != np.uint8:
        raise ValueError(
            f"w.scale must be uint8 (the {w.scheme.scale_dtype} bytes) of shape {scale_shape}, "
            f"got {w.scale.dtype} {w.scale.shape}"
        )
    s2 = getattr(w, "scale_2", None)
    if fmt == "mxfp4":
        if s2 is not None:
            raise ValueError("w.scale_2 must be None for mxfp4 weights (only nvfp4 has a second scale)")
        return
    if s2 is None:
        raise ValueError("w.scale_2 must be the float32 (1,) decode scale of an nvfp4 weight, got None")
    _validate.cupy_array(s2, "w.scale_2")
    if s2.shape != (1,) or s2.dtype != np.float32:
        raise ValueError(f"w.scale_2 must be float32 of shape (1,), got {s2.dtype} {s2.shape}")
    _validate.same_device(s2, "w.scale_2", w.data.data.device_id, "w.data")


def prepared_scales(w) -> cupy.ndarray:
    """The prepared scale bytes of plain FP4 ``w``: (n16, K / 128, 16, 128 / block)."""
    N, K = w.shape
    n16, nb = -(-N // 16), 128 // C.FP4_BLOCK[w._format]
    s = w.scale
    if N != 16 * n16:
        s = cupy.zeros((16 * n16, K // C.FP4_BLOCK[w._format]), np.uint8)
        s[:N] = w.scale
    return cupy.ascontiguousarray(s.reshape(n16, 16, K // 128, nb).transpose(0, 2, 1, 3)), s


def plain_scales(w) -> cupy.ndarray:
    """The inverse of prepared_scales (prepared FP4 ``w``)."""
    N, K = w.shape
    n16 = w.scale.shape[0]
    t = w.scale.transpose(0, 2, 1, 3).reshape(16 * n16, K // C.FP4_BLOCK[w._format])
    return cupy.ascontiguousarray(t[:N]), t


def dequantize(w, out_t, y) -> None:
    """dequantize_weight of plain FP4 ``w`` (N > 0) into ``y`` (N, K) of ``out_t`` (checked by
    dequantize_weight; here also that ``y`` does not overlap NVFP4's scale_2): one launch of
    ``weight_dequantize_fp4<O, S>``, one thread per 8 elements of a row."""
    _validate.disjoint(y, "out", (("w.scale_2", w.scale_2),))
    N, K = w.shape
    a = np.zeros((), dtype=C.QUANT_ARGS)
    a["N"], a["K"], a["ng"], a["G"] = N, K, K // C.FP4_BLOCK[w._format], C.FP4_BLOCK[w._format]
    k = _jit.kernel(
        w.data.data.device_id, C.QUANT_FAMILY, "weight_dequantize_fp4", out_t.ctype, C.SCHEME_IDS[w._format]
    )
    grid = (-(-(K // 8) // 256), min(N, C.MAX_GRID_Y))
    k(grid, (256,), (w.data, w.scale, w.scale_2 if w.scale_2 is not None else 0, y, a[()]))
