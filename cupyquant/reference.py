"""NumPy + ml_dtypes reference of every cupyquant op. Imports no CuPy.

Each function states its formula; the GPU kernels must match these bit for bit. Inputs are NumPy
arrays of float32, float16 or ml_dtypes.bfloat16. All float arithmetic is IEEE float32 with
subnormals (no flush-to-zero), as in TransformerEngine and vLLM: the kernels use explicit IEEE PTX
instructions wherever CuPy's forced ``-ftz=true`` could otherwise flush, so the reference needs no
FTZ model.

Conventions the bit patterns depend on:

- FP8 casts round to nearest even and saturate (``satfinite``): values past the max finite value,
  and +-inf, become +-max; every NaN becomes the canonical ``0x7f`` (positive), as the
  ``cvt.rn.satfinite`` instruction and CUDA's software path both do. ml_dtypes alone would give
  NaN for overflow and keep NaN signs, so :func:`cast_fp8` clamps and canonicalizes first.
- Dequantized NaNs carry CUDA's canonical patterns: ``0x7fff`` for float16 and bfloat16,
  ``0x7fffffff`` for float32 (NumPy would give ``0x7e00``/``0x7fc0``/``0x7fc00000``).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from . import _dtypes

FLT_MAX = np.float32(np.finfo(np.float32).max)

_CANONICAL_NAN = {
    np.dtype(np.float32): np.uint32(0x7FFFFFFF),
    np.dtype(np.float16): np.uint16(0x7FFF),
    np.dtype(ml_dtypes.bfloat16): np.uint16(0x7FFF),
}
_UINT_OF = {4: np.uint32, 2: np.uint16, 1: np.uint8}


def _as_f32(x) -> np.ndarray:
    x = np.asarray(x)
    _dtypes.input_type(x.dtype, "x")
    return x.astype(np.float32)  # exact for float16 and bfloat16


def amax(x) -> np.float32:
    """``max |x|`` as float32, NaN ignored (``fmaxf``); 0 for an empty or all-NaN array."""
    a = np.abs(_as_f32(x)).ravel()
    a = a[~np.isnan(a)]
    return np.float32(a.max()) if a.size else np.float32(0)


def compute_scale(amax_value, dtype="float8_e4m3fn") -> np.float32:
    """TransformerEngine's current-scaling scale (``compute_scale_from_amax``, epsilon 0, no
    power-of-two forcing): ``fp8_max / amax`` by IEEE float32 division; 1 when amax is 0, inf or
    NaN; FLT_MAX when the quotient is inf (amax below ``fp8_max / FLT_MAX``)."""
    fmt = _dtypes.element_format(dtype)
    a = np.float32(amax_value)
    if a == 0 or not np.isfinite(a):
        return np.float32(1)
    with np.errstate(over="ignore"):
        s = np.float32(fmt.max) / a
    return FLT_MAX if np.isinf(s) else np.float32(s)


def cast_fp8(v, dtype="float8_e4m3fn") -> np.ndarray:
    """float32 -> FP8 bit patterns (uint8): round to nearest even, saturate to +-max (inf
    included), NaN -> 0x7f."""
    fmt = _dtypes.element_format(dtype)
    v = np.asarray(v, dtype=np.float32)
    nan = np.isnan(v)
    clipped = np.clip(np.where(nan, 0, v), -fmt.max, fmt.max).astype(np.float32)
    bits = clipped.astype(fmt.host_dtype).view(np.uint8)
    return np.where(nan, np.uint8(0x7F), bits).astype(np.uint8)


def fp8_to_float(q, dtype="float8_e4m3fn") -> np.ndarray:
    """FP8 bit patterns (uint8) -> float32, exact."""
    fmt = _dtypes.element_format(dtype)
    return np.asarray(q, dtype=np.uint8).view(fmt.host_dtype).astype(np.float32)


def quantize_fp8(x, dtype="float8_e4m3fn", *, scale=None):
    """Per-tensor FP8 quantization; returns ``(q, scale_inv)``: uint8 bit patterns in ``x.shape``
    and a float32 array of shape (1,).

    Dynamic (``scale`` None), TransformerEngine current scaling:
    ``s = compute_scale(amax(x))``, ``q = cast_fp8(float32(x) * s)``, ``scale_inv = 1 / s``.

    Static (``scale`` given in the dequantization sense, x ~ q * scale):
    ``s = 1 / float32(scale)``, ``q = cast_fp8(float32(x) * s)``, ``scale_inv = float32(scale)``.

    All products and quotients are IEEE float32, round to nearest even.
    """
    fmt = _dtypes.element_format(dtype)
    xf = _as_f32(x)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        if scale is None:
            s = compute_scale(amax(xf), fmt.name)
            scale_inv = np.float32(1) / s
        else:
            scale_inv = np.float32(np.asarray(scale, dtype=np.float32).reshape(-1)[0])
            s = np.float32(1) / scale_inv
        q = cast_fp8(xf * s, fmt.name)
    return q, np.array([scale_inv], dtype=np.float32)


def round_to(v, out_dtype) -> np.ndarray:
    """float32 -> float32/float16/bfloat16, round to nearest even; NaN as CUDA's canonical NaN."""
    out_dtype = _dtypes.input_type(out_dtype, "out_dtype").dtype
    v = np.asarray(v, dtype=np.float32)
    with np.errstate(over="ignore"):
        y = v.astype(out_dtype)
    uint = _UINT_OF[out_dtype.itemsize]
    bits = np.where(np.isnan(v), _CANONICAL_NAN[out_dtype], y.view(uint)).astype(uint)
    return bits.view(out_dtype)


def dequantize_fp8(q, scale_inv, dtype="float8_e4m3fn", out_dtype=np.float32) -> np.ndarray:
    """``y = round_to(fp8_to_float(q) * float32(scale_inv), out_dtype)``, the product in IEEE
    float32. ``scale_inv`` is a scalar or one-element array (per tensor)."""
    s = np.float32(np.asarray(scale_inv, dtype=np.float32).reshape(-1)[0])
    with np.errstate(over="ignore", invalid="ignore"):
        v = fp8_to_float(q, dtype) * s
    return round_to(v, out_dtype)
