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

from .. import _validate
from . import configs as C
from .container import QuantizedWeight, weight_scheme

FORMATS = tuple(C.FP4_BLOCK)


def group_size_of(fmt: str, group_size) -> int:
    """The block of an FP4 format; ``group_size`` must be left at its default or be that block."""
    from .. import _checks

    block = C.FP4_BLOCK[fmt]
    if group_size is not _checks.DEFAULT_GROUP_SIZE and group_size != block:
        raise ValueError(
            f"{fmt} weights have blocks of {block} along K: leave group_size at its default, got {group_size!r}"
        )
    return block


def quantize(w, fmt: str) -> QuantizedWeight:
    """quantize_weight for "nvfp4" and "mxfp4" (w checked: a 2-D C-contiguous float CuPy array):
    the bytes of quantize_nvfp4 (the global scale reduced on the device) or quantize_mx (rounding
    "ceil"), with dense scales."""
    from .. import mx, nvfp4

    N, K = w.shape
    block = C.FP4_BLOCK[fmt]
    if K == 0 or K % block:
        raise ValueError(f"w's K = {K} must be a nonzero multiple of {block} for {fmt} weights")
    with _validate.on_device_of(w):
        if fmt == "nvfp4":
            q = nvfp4.quantize_nvfp4(w, scale_layout="dense")
            scale_2 = cupy.float32(1) / q.global_scale  # the decode scale, as dequantize_nvfp4 takes it
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
    """dequantize_weight of plain FP4 ``w`` into ``y`` (N, K) of ``out_t``."""
    raise NotImplementedError("FP4 dequantization")
