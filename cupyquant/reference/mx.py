"""MXFP8 and MXFP4 (OCP MX v1.0): E8M0 block scales, the E2M1 casts."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .. import _checks, _dtypes
from .._layouts import pack_fp4, unpack_fp4
from ._common import _as_f32, _blocks, _e8m0_to_float, cast_fp8, fp8_to_float, round_to

MX_BLOCK = 32  # OCP MX v1.0 block
#: The exponent of the largest power of two in each element format (OCP's emax_elem).
MX_EMAX = {"float8_e4m3fn": 8, "float8_e5m2": 15, "float4_e2m1fn": 2}
E2M1_MAX = np.float32(6.0)
_MX_FORMATS = _checks.MX_FORMATS


def cast_e2m1(v) -> np.ndarray:
    """float32 -> E2M1 codes (uint8 0..15: sign in bit 3), the rule of ``cvt.rn.satfinite.e2m1x2.f32``
    and CUDA's software path (cuda_fp4.hpp): round to nearest even (0.25 -> 0, 0.75 -> 1.0,
    2.5 -> 2, 5 -> 4; ties go to the even code), saturate to +-6 (inf included), keep the sign of zero (-0.1 -> 0x8), and
    every NaN -> +6 (0x7). ml_dtypes rounds and saturates the same way but maps NaN to -0."""
    v = np.asarray(v, dtype=np.float32)
    nan = np.isnan(v)
    codes = np.where(nan, np.float32(0), v).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    return np.where(nan, np.uint8(0x7), codes).astype(np.uint8)


def e2m1_to_float(codes) -> np.ndarray:
    """E2M1 codes (uint8, low nibble) -> float32, exact."""
    return (np.asarray(codes, dtype=np.uint8) & 0xF).view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def cast_elements(v, dtype) -> np.ndarray:
    """float32 -> element codes of an MX/NVFP4 element format: FP8 bit patterns (:func:`cast_fp8`)
    or E2M1 codes (:func:`cast_e2m1`), unpacked, uint8."""
    name = _dtypes.element_format(dtype, allowed=_MX_FORMATS).name
    return cast_e2m1(v) if name == "float4_e2m1fn" else cast_fp8(v, name)


def elements_to_float(codes, dtype) -> np.ndarray:
    name = _dtypes.element_format(dtype, allowed=_MX_FORMATS).name
    return e2m1_to_float(codes) if name == "float4_e2m1fn" else fp8_to_float(codes, name)


def e8m0_ceil(v) -> np.ndarray:
    """The UE8M0 byte of float32 ``v >= 0`` rounded up to a power of two, saturating: the rule of
    ``cvt.rp.satfinite.ue8m0x2.f32`` and of TransformerEngine's ``float_to_e8m0``. NaN -> 255;
    inf -> 254; otherwise with ``e`` the exponent field and ``m`` the mantissa field of ``v``,
    ``e + 1`` if ``m != 0`` and ``e != 254`` and not (``e == 0`` and ``m <= 0x400000``), else
    ``e``. So 0 and every value up to 2^-127 give 0 (2^-127), values in (2^-127, 2^-126] give 1,
    2^k gives k + 127 exactly, and everything above 2^127 gives 254."""
    v = np.asarray(v, dtype=np.float32)
    b = v.view(np.uint32) & 0x7FFFFFFF
    e = (b >> 23).astype(np.int64)
    m = (b & 0x7FFFFF).astype(np.int64)
    up = (m != 0) & (e != 254) & ~((e == 0) & (m <= 0x400000))
    out = e + up
    out = np.where(b == 0x7F800000, 254, out)
    out = np.where(b > 0x7F800000, 255, out)
    return out.astype(np.uint8)


def mx_scale_exponent(block_amax, dtype="float8_e4m3fn", rounding="ceil") -> np.ndarray:
    """The E8M0 scale byte ``E`` of MX blocks with the given max |x| (float32; NaN when the block
    holds a NaN). The block's scale is ``2^(E - 127)``.

    ``rounding="ceil"`` (cuBLAS, TransformerEngine): ``E = e8m0_ceil(amax * r)`` with
    ``r = float32(1 / elem_max)`` (1/448, 1/57344, 1/6, each rounded to float32) and the product
    IEEE float32; ``amax = elem_max * 2^k`` may give ``k + 127`` or ``k + 128`` depending on how
    that product rounds. ``rounding="floor"`` (OCP MX v1.0 section 6.3): ``E = max(e_amax - emax,
    0)`` with ``e_amax`` the exponent field of amax (0 for subnormals) and ``emax`` 8, 15, 2 for
    E4M3, E5M2, E2M1 (elements may then exceed elem_max and saturate). Both: a block of zeros
    gives 0, a block whose amax is inf gives 254, a block holding a NaN gives 255 (E8M0's NaN).
    """
    name = _dtypes.element_format(dtype, allowed=_MX_FORMATS).name
    a = np.asarray(block_amax, dtype=np.float32)
    if rounding == "ceil":
        r = np.float32(1.0 / _dtypes.element_format(name).max)
        with np.errstate(over="ignore", invalid="ignore"):
            return e8m0_ceil((a * r).astype(np.float32))
    if rounding != "floor":
        raise ValueError(f"rounding must be 'ceil' or 'floor', got {rounding!r}")
    b = a.view(np.uint32) & 0x7FFFFFFF
    e = np.maximum((b >> 23).astype(np.int64) - MX_EMAX[name], 0)
    e = np.where(b == 0x7F800000, 254, e)
    e = np.where(b > 0x7F800000, 255, e)
    return e.astype(np.uint8)


def mx_data_multiplier(E) -> np.ndarray:
    """``2^(127 - E)`` as float32, what MX data is multiplied by before the cast: for E = 254 the
    subnormal 2^-127 (0x00400000; the bit formula ``(254 - E) << 23`` would give 0 there), for
    E = 0 the normal 2^127, for E = 255 NaN (so a NaN block's elements become NaN codes).
    TransformerEngine's ``exp2f_rcp`` differs at E = 0 (it multiplies by 1), 254 (0) and 255 (-inf)."""
    E = np.asarray(E, dtype=np.uint32)
    bits = np.where(
        E == 255, np.uint32(0x7FFFFFFF), np.where(E == 254, np.uint32(0x00400000), (254 - np.minimum(E, 253)) << 23)
    )
    return bits.astype(np.uint32).view(np.float32)


def quantize_mx(x, dtype="float8_e4m3fn", *, rounding="ceil"):
    """MXFP8 / MXFP4 quantization along the last axis (OCP MX v1.0 blocks of 32); returns
    ``(data, scale)``: ``data`` uint8, FP8 bit patterns ``x.shape`` or E2M1 codes packed two per
    byte ``x.shape[:-1] + (ceil(K / 2),)`` (:func:`pack_fp4`); ``scale`` the E8M0 bytes, uint8
    ``x.shape[:-1] + (ceil(K / 32),)`` (dense layout).

    Per block (the last one zero-padded when 32 does not divide K): ``amax = max|x|`` with NaN
    propagating (a block holding a NaN has amax NaN), ``E = mx_scale_exponent(amax, dtype,
    rounding)``, ``q = cast(x * mx_data_multiplier(E))`` with the product IEEE float32 (exact but
    for products below 2^-126, which cast to 0 anyway) and the cast saturating, round to nearest
    even (FP8: NaN -> 0x7f; E2M1: NaN -> +6). Dequantization is ``float(q) * 2^(E - 127)``.
    """
    name = _dtypes.element_format(dtype, allowed=_MX_FORMATS).name
    _checks.mx_rounding(rounding)
    xf = _as_f32(x)
    _checks.at_least_1d(xf.ndim)
    K = xf.shape[-1]
    g = _blocks(xf, MX_BLOCK)
    amax_b = np.max(np.abs(g), axis=-1, initial=np.float32(0)) if g.size else np.zeros(g.shape[:-1], np.float32)
    E = mx_scale_exponent(amax_b.astype(np.float32), name, rounding)
    with np.errstate(all="ignore"):
        v = (g * mx_data_multiplier(E)[..., None]).astype(np.float32)
    codes = cast_elements(v, name).reshape(xf.shape[:-1] + (g.shape[-2] * MX_BLOCK,))[..., :K]
    data = pack_fp4(codes) if name == "float4_e2m1fn" else codes
    return data, E


def _packed_width(data, K) -> int:
    """The K of packed FP4 data: ``2 B`` or ``2 B - 1`` for B bytes a row (the given K, or 2 B)."""
    B = data.shape[-1]
    if K is None:
        return 2 * B
    if K not in (2 * B, 2 * B - 1) or K < 0:
        raise ValueError(f"K={K!r} does not fit packed data of {B} bytes a row (K must be {2 * B - 1} or {2 * B})")
    return int(K)


def dequantize_mx(data, scale, dtype="float8_e4m3fn", out_dtype=np.float32, *, K=None):
    """``y = round_to(float(q) * 2^(E - 127), out_dtype)`` (the product exact in float32: E = 0 is
    the subnormal 2^-127, E = 255 NaN). ``data`` as :func:`quantize_mx` returns it; ``K`` the
    length of the last axis (needed for packed FP4 with odd K)."""
    name = _dtypes.element_format(dtype, allowed=_MX_FORMATS).name
    data = np.asarray(data, dtype=np.uint8)
    _checks.at_least_1d(data.ndim, "data")
    if name == "float4_e2m1fn":
        K = _packed_width(data, K)
        codes = unpack_fp4(data, K)
    else:
        codes = data
        K = data.shape[-1]
    v = _blocks(elements_to_float(codes, name), MX_BLOCK)
    s = _e8m0_to_float(scale, "scale")
    _checks.shape_of(s, "scale", codes.shape[:-1] + (v.shape[-2],))
    with np.errstate(all="ignore"):
        y = (v * s[..., None]).astype(np.float32).reshape(codes.shape[:-1] + (v.shape[-2] * MX_BLOCK,))[..., :K]
    return round_to(y, out_dtype)
