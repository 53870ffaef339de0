"""What every family of the reference shares: float32 conversion of inputs, the FP8 casts, the INT8
conversions of vLLM's int8 kernels, rounding to the output dtype with CUDA's canonical NaNs, UE8M0
decoding and zero-padded blocks."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .. import _checks, _dtypes

FLT_MAX = np.float32(np.finfo(np.float32).max)

_CANONICAL_NAN = {
    np.dtype(np.float32): np.uint32(0x7FFFFFFF),
    np.dtype(np.float16): np.uint16(0x7FFF),
    np.dtype(ml_dtypes.bfloat16): np.uint16(0x7FFF),
}
_UINT_OF = {4: np.uint32, 2: np.uint16, 1: np.uint8}


def _given_scale(v, arg: str) -> np.float32:
    """A scale the caller gives, checked as the ops check theirs: a NumPy array stands where the ops
    take a CuPy one (float32, one element, its value read as it is), anything else must be a
    positive finite real."""
    if isinstance(v, np.ndarray):
        return np.float32(_checks.one_element_float32(v, arg).reshape(-1)[0])
    return _checks.positive_finite_scalar(v, arg)


def _as_f32(x) -> np.ndarray:
    x = np.asarray(x)
    _dtypes.input_type(x.dtype, "x")
    return x.astype(np.float32)  # exact for float16 and bfloat16


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


def round_to(v, out_dtype) -> np.ndarray:
    """float32 -> float32/float16/bfloat16, round to nearest even; NaN as CUDA's canonical NaN."""
    out_dtype = _dtypes.input_type(out_dtype, "out_dtype").dtype
    v = np.asarray(v, dtype=np.float32)
    with np.errstate(over="ignore"):
        y = v.astype(out_dtype)
    uint = _UINT_OF[out_dtype.itemsize]
    bits = np.where(np.isnan(v), _CANONICAL_NAN[out_dtype], y.view(uint)).astype(uint)
    return bits.view(out_dtype)


def int8_rn(v) -> np.ndarray:
    """float32 -> int8 codes as ``cvt.rni.sat.s8.f32`` (vLLM ``float_to_int8_rn``): round half to
    even, saturate to [-128, 127] (infinities included), NaN -> 0."""
    v = np.asarray(v, dtype=np.float32)
    with np.errstate(invalid="ignore"):
        r = np.clip(np.rint(np.nan_to_num(v, nan=0.0, posinf=127.0, neginf=-128.0)), -128, 127)
    return r.astype(np.int8)


def int32_rn(v) -> np.ndarray:
    """float32 -> int32 as ``cvt.rni.sat.s32.f32`` (vLLM ``float_to_int32_rn``): round half to even,
    saturate to [-2^31, 2^31 - 1], NaN -> 0. Returned as int64 (the values are int32's)."""
    v = np.asarray(v, dtype=np.float32).astype(np.float64)  # exact
    with np.errstate(invalid="ignore"):
        r = np.clip(np.rint(np.nan_to_num(v, nan=0.0, posinf=2.0**31, neginf=-(2.0**31))), -(2.0**31), 2.0**31 - 1)
    return r.astype(np.int64)


def azp_codes(v, z) -> np.ndarray:
    """vLLM's ``int32_to_int8(float_to_int32_rn(v) + azp)``: :func:`int32_rn` of float32 ``v``, plus
    the int32 zero point ``z`` with int32 wraparound (two's complement), saturated to [-128, 127]
    (``cvt.sat.s8.s32``). int8."""
    s = int32_rn(v) + np.asarray(z, dtype=np.int64)
    s = (s + 2**31) % 2**32 - 2**31  # the int32 add wraps
    return np.clip(s, -128, 127).astype(np.int8)


def minus_zero_point(q, z) -> np.ndarray:
    """``float32(q - z)`` for int8 codes ``q`` and int32 zero points ``z`` (broadcast): the difference
    exact (64-bit), rounded once to float32, to nearest even (exact for ``|q - z| <= 2^24``)."""
    d = np.asarray(q, dtype=np.int64) - np.asarray(z, dtype=np.int64)
    return d.astype(np.float64).astype(np.float32)  # |d| < 2^33: exact in float64, one rounding


def e8m0_to_float(e) -> np.ndarray:
    """UE8M0 bytes -> float32 (``2^(e - 127)``; 255 is NaN), as ml_dtypes decodes them."""
    return _e8m0_to_float(e, "e")


def _e8m0_to_float(e, arg: str) -> np.ndarray:
    """:func:`e8m0_to_float` of an argument named ``arg`` in the errors: integers in [0, 255] (a
    cast would wrap 256 to 0) or an ml_dtypes ``float8_e8m0fnu`` array (read as its bytes)."""
    b = _checks.small_codes(e, arg, 255, "E8M0 bytes", bits_of=ml_dtypes.float8_e8m0fnu)
    return b.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)


def _blocks(xf: np.ndarray, block: int) -> np.ndarray:
    """``(..., K)`` -> ``(..., ceil(K / block), block)``, the last block zero-padded."""
    K = xf.shape[-1]
    nb = -(-K // block)
    pad = nb * block - K
    if pad:
        xf = np.concatenate([xf, np.zeros(xf.shape[:-1] + (pad,), xf.dtype)], axis=-1)
    return xf.reshape(xf.shape[:-1] + (nb, block))
