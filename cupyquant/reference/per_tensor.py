"""Per-tensor FP8: TransformerEngine's current scaling, static scales, dequantization."""

from __future__ import annotations

import numpy as np

from .. import _checks, _dtypes
from ._common import FLT_MAX, _as_f32, _given_scale, cast_fp8, fp8_to_float, round_to


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


def quantize_fp8(x, dtype="float8_e4m3fn", *, scale=None):
    """Per-tensor FP8 quantization; returns ``(q, scale_inv)``: uint8 bit patterns in ``x.shape``
    and a float32 array of shape (1,).

    Dynamic (``scale`` None), TransformerEngine current scaling:
    ``s = compute_scale(amax(x))``, ``q = cast_fp8(float32(x) * s)``, ``scale_inv = 1 / s``.

    Static (``scale`` given in the dequantization sense, x ~ q * scale):
    ``s = 1 / float32(scale)``, ``q = cast_fp8(float32(x) * s)``, ``scale_inv = float32(scale)``.

    All products and quotients are IEEE float32, round to nearest even.
    """
    fmt = _dtypes.element_format(dtype, allowed=_checks.PER_TENSOR_FORMATS)
    xf = _as_f32(x)
    given = None if scale is None else _given_scale(scale, "scale")
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        if given is None:
            s = compute_scale(amax(xf), fmt.name)
            scale_inv = np.float32(1) / s
        else:
            scale_inv = given
            s = np.float32(1) / scale_inv
        q = cast_fp8(xf * s, fmt.name)
    return q, np.array([scale_inv], dtype=np.float32)


def dequantize_fp8(q, scale_inv, dtype="float8_e4m3fn", out_dtype=np.float32) -> np.ndarray:
    """``y = round_to(fp8_to_float(q) * float32(scale_inv), out_dtype)``, the product in IEEE
    float32. ``scale_inv`` is a scalar or one-element array (per tensor)."""
    _dtypes.element_format(dtype, allowed=_checks.PER_TENSOR_FORMATS)
    scale_inv = np.asarray(scale_inv, dtype=np.float32)
    _checks.shape_of(scale_inv.reshape(-1), "scale_inv", (1,))
    s = np.float32(scale_inv.reshape(-1)[0])
    with np.errstate(over="ignore", invalid="ignore"):
        v = fp8_to_float(q, dtype) * s
    return round_to(v, out_dtype)
