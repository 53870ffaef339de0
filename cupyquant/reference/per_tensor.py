"""Per-tensor FP8: TransformerEngine's current scaling, static scales, dequantization; static
per-tensor INT8 with or without a zero point (vLLM ``static_scaled_int8_quant``)."""

from __future__ import annotations

import numbers

import numpy as np

from .. import _checks, _dtypes
from ._common import (
    FLT_MAX,
    _as_f32,
    _given_scale,
    azp_codes,
    cast_fp8,
    fp8_to_float,
    int8_rn,
    minus_zero_point,
    round_to,
)


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


def _given_zero_point(v) -> np.int32:
    """A zero point as the op takes it: a NumPy int32 array of one element (standing where the op
    takes a CuPy one) or an integer in the int32 range."""
    if isinstance(v, np.ndarray):
        if v.dtype != np.int32:
            raise TypeError(f"zero_point must be an int32 array of one element, got {v.dtype} {v.shape}")
        if v.size != 1:
            raise ValueError(f"zero_point must be an int32 array of one element, got {v.dtype} {v.shape}")
        return np.int32(v.reshape(-1)[0])
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
        raise TypeError(f"zero_point must be an int, an array or None, got {type(v).__name__}")
    if not -(2**31) <= int(v) < 2**31:
        raise ValueError(f"zero_point must be in the int32 range, got {v!r}")
    return np.int32(int(v))


def quantize_int8(x, *, scale, zero_point=None):
    """Static per-tensor INT8, vLLM ``static_scaled_int8_quant``
    (csrc/quantization/compressed_tensors/int8_quant_kernels.cu); returns ``(q, scale, zero_point)``:
    int8 codes in ``x.shape``, float32 (1,) and int32 (1,) or None. ``x ~ (q - z) * s``.

    ``scale`` (required, by keyword) is the decode scale ``s``: a positive finite real, or a float32 one-element array
    whose value is used as it is (as the op reads a device array). ``zero_point``: None, an integer
    in the int32 range or an int32 one-element array.

    - Without a zero point (vLLM ``static_scaled_int8_quant_kernel``):
      ``q = int8_rn(float32(x) / s)``, the IEEE float32 quotient rounded half to even and saturated
      (inf to +-127/-128, NaN to 0).
    - With one (vLLM ``static_scaled_int8_azp_quant_kernel``): ``inv = 1 / s`` in float32 once,
      ``q = azp_codes(float32(x) * inv, z)``: ``int32_rn`` of the product (saturating, NaN to 0),
      plus ``z`` wrapping in int32, saturated to [-128, 127]. vLLM multiplies by the inverse here
      and divides in the symmetric kernel; both are copied as they are.
    """
    s = _given_scale(scale, "scale")
    z = None if zero_point is None else _given_zero_point(zero_point)
    xf = _as_f32(x)
    with np.errstate(all="ignore"):
        if z is None:
            q = int8_rn((xf / s).astype(np.float32))
        else:
            inv = np.float32(np.float32(1) / s)
            q = azp_codes((xf * inv).astype(np.float32), z)
    return q, np.array([s], np.float32), None if z is None else np.array([z], np.int32)


def dequantize_int8(q, scale, zero_point=None, out_dtype=np.float32) -> np.ndarray:
    """Per-tensor INT8: ``y = round_to(float32(q) * s, out_dtype)``, or with a zero point
    ``y = round_to(minus_zero_point(q, z) * s, out_dtype)`` (``float32(q - z)``: the exact
    difference rounded once), the product in IEEE float32. ``scale`` and ``zero_point`` are
    scalars or one-element arrays."""
    q = np.asarray(q, dtype=np.int8)
    scale = np.asarray(scale, dtype=np.float32)
    _checks.shape_of(scale.reshape(-1), "scale", (1,))
    s = np.float32(scale.reshape(-1)[0])
    if zero_point is None:
        v = q.astype(np.float32)
    else:
        zero_point = np.asarray(zero_point, dtype=np.int32)
        _checks.shape_of(zero_point.reshape(-1), "zero_point", (1,))
        v = minus_zero_point(q, zero_point.reshape(-1)[0])
    with np.errstate(over="ignore", invalid="ignore"):
        y = (v * s).astype(np.float32)
    return round_to(y, out_dtype)
