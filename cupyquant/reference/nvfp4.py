"""NVFP4: blocks of 16 E2M1 values with E4M3 scales and a float32 global scale (TransformerEngine)."""

from __future__ import annotations

import numpy as np

from .. import _checks
from .._layouts import pack_fp4, unpack_fp4
from ._common import FLT_MAX, _as_f32, _blocks, _given_scale, cast_fp8, fp8_to_float, round_to
from .mx import _packed_width, cast_e2m1, e2m1_to_float
from .per_tensor import amax

NVFP4_BLOCK = 16
NVFP4_RANGE = np.float32(448.0 * 6.0)  # E4M3 max times E2M1 max: 2688


def nvfp4_global_scale(global_amax) -> np.float32:
    """TransformerEngine's ``compute_global_encode_scaling_factor_FP4``: ``S_enc = 2688 / amax``
    (IEEE float32; 2688 = 448 * 6), then ``fminf(S_enc, FLT_MAX)``; 1 when amax is 0 or S_enc
    is 0 (amax inf)."""
    a = np.float32(global_amax)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        s = np.fmin(NVFP4_RANGE / a, FLT_MAX).astype(np.float32)
    return np.float32(1) if a == 0 or s == 0 else np.float32(s)


def quantize_nvfp4(x, *, global_scale=None):
    """NVFP4 quantization, TransformerEngine's exact path (``quantize_transpose_nvfp4`` rowwise,
    round to nearest); returns ``(data, scale, global_scale)``: E2M1 codes packed two per byte
    ``x.shape[:-1] + (ceil(K / 2),)``, E4M3 block scales as bytes ``x.shape[:-1] +
    (ceil(K / 16),)`` (dense), and ``S_enc`` as float32.

    ``S_enc = global_scale`` when given (the encode scale, ``2688 / amax`` by convention, as vLLM
    and FlashInfer pass it), else :func:`nvfp4_global_scale` of :func:`amax` (x) (NaN ignored).
    Per block of 16 (the last one zero-padded): ``amax_b = max|x|`` with NaN ignored (fmaxf);
    ``sf = e4m3(fminf(amax_b * (S_enc * r6), FLT_MAX))`` with ``r6 = float32(1/6)``, two IEEE
    products in that order, the cast saturating; ``S_dec = 1 / S_enc``; ``inv = fminf(1 /
    (float(sf) * S_dec), FLT_MAX)`` (FLT_MAX when sf is 0); ``q = cast_e2m1(x * inv)``.
    """
    xf = _as_f32(x)
    _checks.at_least_1d(xf.ndim)
    K = xf.shape[-1]
    S_enc = nvfp4_global_scale(amax(xf)) if global_scale is None else _given_scale(global_scale, "global_scale")
    g = _blocks(xf, NVFP4_BLOCK)
    with np.errstate(all="ignore"):
        amax_b = np.fmax.reduce(np.abs(g), axis=-1, initial=np.float32(0)).astype(np.float32)
        sf_val = np.fmin((amax_b * np.float32(S_enc * np.float32(1.0 / 6.0))).astype(np.float32), FLT_MAX)
        sf = cast_fp8(sf_val, "float8_e4m3fn")
        S_dec = np.float32(1) / S_enc
        inv = np.fmin(np.float32(1) / (fp8_to_float(sf) * S_dec).astype(np.float32), FLT_MAX).astype(np.float32)
        v = (g * inv[..., None]).astype(np.float32)
    codes = cast_e2m1(v).reshape(xf.shape[:-1] + (g.shape[-2] * NVFP4_BLOCK,))[..., :K]
    return pack_fp4(codes), sf, np.float32(S_enc)


def dequantize_nvfp4(data, scale, global_scale, out_dtype=np.float32, *, K=None):
    """``y = round_to(float(q) * (float(sf) * S_dec), out_dtype)`` with ``S_dec = 1 / S_enc``, both
    products IEEE float32: the inverse of the quantizer's ``inv`` (TransformerEngine's own
    dequantizer multiplies by ``float(sf) * amax * (1 / 2688)``, which can differ in the last bit)."""
    data = np.asarray(data, dtype=np.uint8)
    _checks.at_least_1d(data.ndim, "data")
    K = _packed_width(data, K)
    codes = unpack_fp4(data, K)
    scale = np.asarray(scale, np.uint8)
    _checks.shape_of(scale, "scale", codes.shape[:-1] + (-(-K // NVFP4_BLOCK),))
    global_scale = np.asarray(global_scale, np.float32)
    _checks.shape_of(global_scale.reshape(-1), "global_scale", (1,))
    S_enc = np.float32(global_scale.reshape(-1)[0])
    with np.errstate(all="ignore"):
        S_dec = np.float32(1) / S_enc
        s = (fp8_to_float(scale) * S_dec).astype(np.float32)
        v = _blocks(e2m1_to_float(codes), NVFP4_BLOCK)
        y = (v * s[..., None]).astype(np.float32).reshape(codes.shape[:-1] + (v.shape[-2] * NVFP4_BLOCK,))[..., :K]
    return round_to(y, out_dtype)
