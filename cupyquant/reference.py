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
from ._checks import WEIGHT_DTYPES, WEIGHT_GROUP_SIZES, weight_scheme  # noqa: F401 (re-exported)
from ._layouts import (  # noqa: F401 (re-exported)
    pack_fp4,
    swizzle_offsets,
    swizzle_scales,
    swizzled_shape,
    unpack_fp4,
    unswizzle_scales,
)

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


# ------------------------------------------------------------------ per-token / per-group (vLLM)

GROUP_EPS = np.float32(1e-10)  # vLLM's default eps, the floor of a group's amax
FLT_EPSILON = np.float32(2.0**-23)
_QRANGE = {"float8_e4m3fn": (-448.0, 448.0), "float8_e5m2": (-57344.0, 57344.0), "int8": (-128.0, 127.0)}


def ue8m0(s) -> np.ndarray:
    """The UE8M0 exponent byte of ``pow2_ceil(s)`` (uint8): with ``s' = fmaxf(|s|, 1e-10)``,
    ``e = exponent_field(s') + (mantissa(s') != 0)`` (vLLM's and DeepGEMM's bit rule)."""
    s = np.fmax(np.abs(np.asarray(s, dtype=np.float32)), GROUP_EPS).astype(np.float32)
    b = s.view(np.uint32)
    return (((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0)).astype(np.uint8)


def pow2_ceil(s) -> np.ndarray:
    """``s`` rounded up to a power of two by :func:`ue8m0` (``2^(e - 127)`` as float32)."""
    return (ue8m0(s).astype(np.uint32) << 23).view(np.float32)


def e8m0_to_float(e) -> np.ndarray:
    """UE8M0 bytes -> float32 (``2^(e - 127)``; 255 is NaN), as ml_dtypes decodes them."""
    return np.asarray(e, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)


def _to_codes(v, fmt) -> np.ndarray:
    """Already clamped float32 -> FP8 bit patterns (uint8) or INT8 codes (int8, half to even;
    NaN -> 0, saturating, as cvt.rni.sat.s8.f32)."""
    if fmt.name == "int8":
        with np.errstate(invalid="ignore"):
            r = np.clip(np.rint(np.nan_to_num(v, nan=0.0, posinf=127.0, neginf=-128.0)), -128, 127)
        return r.astype(np.int8)
    return cast_fp8(v, fmt.name)


def _ub_value(scale_ub):
    return None if scale_ub is None else np.float32(np.asarray(scale_ub, dtype=np.float32).reshape(-1)[0])


def quantize_groupwise(x, dtype="float8_e4m3fn", *, group_size=128, scale_pow2=False,
                       scale_dtype="float32", scale_ub=None):
    """Per-group or per-token quantization (vLLM's formulas); returns ``(q, scale)``.

    ``q`` has ``x.shape``: uint8 FP8 bit patterns, or int8 codes. ``scale`` has shape
    ``x.shape[:-1] + (K // group_size,)`` (one column per token when ``group_size`` is None): the
    float32 scale used (``x ~ q * scale``), or for ``scale_dtype="float8_e8m0fnu"`` its UE8M0
    exponent bytes (uint8; that dtype implies ``scale_pow2``). All arithmetic is IEEE float32.

    Per group (``group_size`` 32, 64, 128, 256), vLLM ``per_token_group_quant_8bit``:
    ``amax = fmaxf(1e-10, max|x|)`` over the group, NaN ignored; with ``scale_ub``,
    ``amax = fminf(amax, scale_ub)``; ``s = amax / qmax``; with pow2, ``s = pow2_ceil(s)``;
    ``q = cvt(fminf(fmaxf(x / s, qmin), qmax))`` with (qmin, qmax) = (-448, 448), (-57344, 57344)
    or (-128, 127). FP8 converts to nearest even; INT8 rounds half to even (vLLM truncates toward
    zero there: the one deliberate difference). A NaN element becomes qmin.

    Per token (``group_size`` None, any K). FP8, vLLM ``dynamic_per_token_scaled_fp8_quant``:
    ``amax = max|x|`` (0 for an all-zero or all-NaN row), ``amax = fminf(amax, scale_ub)``,
    ``s = fmaxf(amax / qmax, 1 / (qmax * 512))``, ``q = cvt(fmaxf(-qmax, fminf(x / s, qmax)))``
    (a NaN element becomes +qmax). INT8, vLLM ``dynamic_scaled_int8_quant``: ``s = amax / 127``,
    ``q = rne_sat(x * (127 / amax))`` (0 when amax is 0). With pow2 both use ``s = pow2_ceil(s)``
    and ``q = cvt(clamp(x / s))`` (INT8: ``rne_sat(x / s)``).
    """
    fmt = _dtypes.element_format(dtype, allowed=("float8_e4m3fn", "float8_e5m2", "int8"))
    sdt = _dtypes.scale_dtype(scale_dtype, allowed=("float32", "float8_e8m0fnu"))
    pow2 = scale_pow2 or sdt == "float8_e8m0fnu"
    xf = _as_f32(x)
    K = xf.shape[-1]
    G = K if group_size is None else int(group_size)
    # per token: one group of K, even when K = 0 (the scale of an all-zero row)
    g = xf.reshape(xf.shape[:-1] + (1 if group_size is None else K // G, G))
    ub = _ub_value(scale_ub)
    qmax = np.float32(fmt.max)
    lo, hi = (np.float32(v) for v in _QRANGE[fmt.name])
    with np.errstate(all="ignore"):
        amax = np.fmax.reduce(np.abs(g), axis=-1, initial=np.float32(0)).astype(np.float32)
        if group_size is not None:
            amax = np.fmax(amax, GROUP_EPS)
        if ub is not None:
            amax = np.fmin(amax, ub)
        if group_size is None and fmt.name == "int8":
            s = (amax / np.float32(127)).astype(np.float32)
            inv = np.where(amax == 0, np.float32(0), np.float32(127) / np.where(amax == 0, 1, amax)).astype(np.float32)
        elif group_size is None:
            s = np.fmax(amax / qmax, np.float32(1) / (qmax * np.float32(512))).astype(np.float32)
        else:
            s = (amax / qmax).astype(np.float32)
        if pow2:
            s = pow2_ceil(s)
        se = s[..., None]
        if group_size is None and fmt.name == "int8":
            v = g / se if pow2 else g * inv[..., None]
        elif group_size is None:
            v = np.fmax(-qmax, np.fmin(g / se, qmax))
        else:
            v = np.fmin(np.fmax(g / se, lo), hi)
        q = _to_codes(v.astype(np.float32), fmt).reshape(xf.shape)
    return q, (ue8m0(s) if sdt == "float8_e8m0fnu" else s.astype(np.float32))


def silu_mul_from_exp(gate, up, e) -> np.ndarray:
    """``r = (gate * (1 / (1 + e))) * up`` with ``e = exp(-gate)`` given, every step an IEEE float32
    operation (the part of the fused kernel's intermediate after its ``expf``)."""
    gate, up, e = (np.asarray(a, dtype=np.float32) for a in (gate, up, e))
    with np.errstate(over="ignore", invalid="ignore"):
        sig = (np.float32(1) / (np.float32(1) + e)).astype(np.float32)
        return ((gate * sig).astype(np.float32) * up).astype(np.float32)


def silu_mul(x) -> np.ndarray:
    """The float32 intermediate of the fused kernel: with ``gate = x[..., :H]``, ``up = x[..., H:]``,
    ``r = (gate * (1 / (1 + exp(-gate)))) * up``, each step rounded to float32 (vLLM
    ``silu_and_mul_per_block_quant``). ``exp`` here is float64 rounded to float32; CUDA's expf is
    within 2 ulp of that, and the GPU's r then follows :func:`silu_mul_from_exp` exactly."""
    xf = _as_f32(x)
    H = xf.shape[-1] // 2
    gate, up = xf[..., :H], xf[..., H:]
    with np.errstate(over="ignore"):
        e = np.exp(-gate.astype(np.float64)).astype(np.float32)
    return silu_mul_from_exp(gate, up, e)


def quantize_silu_intermediate(r, dtype="float8_e4m3fn", *, group_size=128, scale_ub=None):
    """Group quantization of the fused SiLU*Mul intermediate ``r`` (float32), vLLM
    ``silu_and_mul_per_block_quant``: ``amax = max|r|`` (no eps); ``s = amax / qmax``; with
    ``scale_ub``, ``s = fminf(s, scale_ub)`` (the scale, not the amax, is clamped here);
    ``s = fmaxf(s, min_scale)`` with ``min_scale = 1 / (qmax * 512)`` for FP8 and FLT_EPSILON for
    INT8; ``q = cvt(fmaxf(-qmax, fminf(r / s, qmax)))`` for FP8, ``rne_sat(r / s)`` for INT8.
    Returns ``(q, s)`` like :func:`quantize_groupwise`."""
    fmt = _dtypes.element_format(dtype, allowed=("float8_e4m3fn", "float8_e5m2", "int8"))
    r = np.asarray(r, dtype=np.float32)
    H = r.shape[-1]
    G = int(group_size)
    g = r.reshape(r.shape[:-1] + (H // G, G))
    ub = _ub_value(scale_ub)
    qmax = np.float32(fmt.max)
    min_scale = FLT_EPSILON if fmt.name == "int8" else np.float32(1) / (qmax * np.float32(512))
    with np.errstate(all="ignore"):
        s = (np.fmax.reduce(np.abs(g), axis=-1, initial=np.float32(0)) / qmax).astype(np.float32)
        if ub is not None:
            s = np.fmin(s, ub)
        s = np.fmax(s, min_scale).astype(np.float32)
        v = g / s[..., None]
        if fmt.name != "int8":
            v = np.fmax(-qmax, np.fmin(v, qmax))
        q = _to_codes(v.astype(np.float32), fmt).reshape(r.shape)
    return q, s


def silu_mul_quantize(x, dtype="float8_e4m3fn", *, group_size=128, scale_ub=None):
    """:func:`quantize_silu_intermediate` of :func:`silu_mul` (x): the whole fused op on the host."""
    return quantize_silu_intermediate(silu_mul(x), dtype, group_size=group_size, scale_ub=scale_ub)


def dequantize_groupwise(q, scale, dtype="float8_e4m3fn", out_dtype=np.float32, *, group_size=None):
    """``y = round_to(float(q) * s, out_dtype)`` with ``s`` the scale of q's group (float32 scales,
    or UE8M0 bytes given as uint8), the product in IEEE float32. ``group_size`` None means one scale
    per row."""
    fmt = _dtypes.element_format(dtype, allowed=("float8_e4m3fn", "float8_e5m2", "int8"))
    q = np.asarray(q)
    scale = np.asarray(scale)
    s = e8m0_to_float(scale) if scale.dtype == np.uint8 else scale.astype(np.float32)
    K = q.shape[-1]
    G = K if group_size is None else int(group_size)
    v = q.astype(np.float32) if fmt.name == "int8" else fp8_to_float(q, fmt.name)
    with np.errstate(all="ignore"):
        prod = v.reshape(q.shape[:-1] + (K // G if G else 0, G)) * s[..., None]
    return round_to(prod.reshape(q.shape), out_dtype)


def scale_word_offsets(shape, n_cols: int, scale_layout: str):
    """The 4-byte-word offsets of a scale buffer (cupyquant's "row" and "col" layouts) for a tensor
    whose leading dimensions are ``shape[:-1]`` and that has ``n_cols`` scale words per token.
    Returns ``(offsets, total_words)``: ``offsets[..., c]`` is the word of (token, column c).

    ``row``: C order, ``(..., n_cols)``. ``col`` (DeepGEMM's TMA-aligned MN-major): with
    ``M = shape[-2]`` tokens per batch (1 for 1-D), ``M_pad = round_up(M, 4)`` and the batch the
    product of the dimensions before, word ``b * n_cols * M_pad + c * M_pad + m``.
    """
    lead = tuple(shape[:-1])
    rows = int(np.prod(lead)) if lead else 1
    if scale_layout == "row":
        return np.arange(rows * n_cols, dtype=np.int64).reshape(lead + (n_cols,)), rows * n_cols
    M = lead[-1] if lead else 1
    B = rows // M if M else 0
    M_pad = -(-M // 4) * 4
    b = np.arange(B, dtype=np.int64)[:, None, None]
    m = np.arange(M, dtype=np.int64)[None, :, None]
    c = np.arange(n_cols, dtype=np.int64)[None, None, :]
    return (b * n_cols * M_pad + c * M_pad + m).reshape(lead + (n_cols,)), B * n_cols * M_pad


def scale_buffer(scale, shape, scale_layout: str) -> np.ndarray:
    """The raw scale buffer (uint32 words, padding zero) that cupyquant writes for logical scales
    ``scale`` (float32 ``(..., NG)``, or UE8M0 bytes uint8 ``(..., NG)`` packed four per word,
    group 4p + j in byte j of word p)."""
    scale = np.asarray(scale)
    if scale.dtype == np.uint8:
        ng = scale.shape[-1]
        n_cols = -(-ng // 4)
        padded = np.zeros(scale.shape[:-1] + (n_cols * 4,), np.uint8)
        padded[..., :ng] = scale
        words = padded.view(np.uint32)
    else:
        words = scale.astype(np.float32).view(np.uint32)
        n_cols = scale.shape[-1]
    offsets, total = scale_word_offsets(shape, n_cols, scale_layout)
    buf = np.zeros(total, np.uint32)
    buf[offsets.reshape(-1)] = words.reshape(-1)
    return buf


# ---------------------------------------------------------------- microscaling: MXFP8, MXFP4, NVFP4
MX_BLOCK = 32  # OCP MX v1.0 block
NVFP4_BLOCK = 16
#: The exponent of the largest power of two in each element format (OCP's emax_elem).
MX_EMAX = {"float8_e4m3fn": 8, "float8_e5m2": 15, "float4_e2m1fn": 2}
E2M1_MAX = np.float32(6.0)
NVFP4_RANGE = np.float32(448.0 * 6.0)  # E4M3 max times E2M1 max: 2688
_MX_FORMATS = _dtypes.MX_NAMES


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


def _blocks(xf: np.ndarray, block: int) -> np.ndarray:
    """``(..., K)`` -> ``(..., ceil(K / block), block)``, the last block zero-padded."""
    K = xf.shape[-1]
    nb = -(-K // block)
    pad = nb * block - K
    if pad:
        xf = np.concatenate([xf, np.zeros(xf.shape[:-1] + (pad,), xf.dtype)], axis=-1)
    return xf.reshape(xf.shape[:-1] + (nb, block))


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
    bits = np.where(E == 255, np.uint32(0x7FFFFFFF), np.where(E == 254, np.uint32(0x00400000), (254 - np.minimum(E, 253)) << 23))
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
    xf = _as_f32(x)
    K = xf.shape[-1]
    g = _blocks(xf, MX_BLOCK)
    amax_b = np.max(np.abs(g), axis=-1, initial=np.float32(0)) if g.size else np.zeros(g.shape[:-1], np.float32)
    E = mx_scale_exponent(amax_b.astype(np.float32), name, rounding)
    with np.errstate(all="ignore"):
        v = (g * mx_data_multiplier(E)[..., None]).astype(np.float32)
    codes = cast_elements(v, name).reshape(xf.shape[:-1] + (g.shape[-2] * MX_BLOCK,))[..., :K]
    data = pack_fp4(codes) if name == "float4_e2m1fn" else codes
    return data, E


def dequantize_mx(data, scale, dtype="float8_e4m3fn", out_dtype=np.float32, *, K=None):
    """``y = round_to(float(q) * 2^(E - 127), out_dtype)`` (the product exact in float32: E = 0 is
    the subnormal 2^-127, E = 255 NaN). ``data`` as :func:`quantize_mx` returns it; ``K`` the
    length of the last axis (needed for packed FP4 with odd K)."""
    name = _dtypes.element_format(dtype, allowed=_MX_FORMATS).name
    data = np.asarray(data, dtype=np.uint8)
    if name == "float4_e2m1fn":
        K = 2 * data.shape[-1] if K is None else K
        codes = unpack_fp4(data, K)
    else:
        codes = data
        K = data.shape[-1]
    v = _blocks(elements_to_float(codes, name), MX_BLOCK)
    s = e8m0_to_float(np.asarray(scale, dtype=np.uint8))
    with np.errstate(all="ignore"):
        y = (v * s[..., None]).astype(np.float32).reshape(codes.shape[:-1] + (v.shape[-2] * MX_BLOCK,))[..., :K]
    return round_to(y, out_dtype)


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
    K = xf.shape[-1]
    S_enc = nvfp4_global_scale(amax(xf)) if global_scale is None else np.float32(np.asarray(global_scale, np.float32).reshape(-1)[0])
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
    K = 2 * data.shape[-1] if K is None else K
    codes = unpack_fp4(data, K)
    S_enc = np.float32(np.asarray(global_scale, np.float32).reshape(-1)[0])
    with np.errstate(all="ignore"):
        S_dec = np.float32(1) / S_enc
        s = (fp8_to_float(np.asarray(scale, np.uint8)) * S_dec).astype(np.float32)
        v = _blocks(e2m1_to_float(codes), NVFP4_BLOCK)
        y = (v * s[..., None]).astype(np.float32).reshape(codes.shape[:-1] + (v.shape[-2] * NVFP4_BLOCK,))[..., :K]
    return round_to(y, out_dtype)


# ------------------------------------------------------------------ weight-only (GPTQ/Marlin, AWQ, W8A16)

AWQ_RANGE_FLOOR = np.float32(1e-5)  # AWQ's clamp(min=1e-5) on max - min


def _rne_clamp(v, lo, hi) -> np.ndarray:
    """Round half to even, then clamp to [lo, hi]; NaN -> 0 first (inf clamps)."""
    v = np.where(np.isnan(v), np.float32(0), v)
    return np.clip(np.rint(v), lo, hi).astype(np.int32)


def _weight_groups(w, group_size):
    w = np.asarray(w)
    t = _dtypes.input_type(w.dtype, "w")
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D (N, K), got shape {w.shape}")
    N, K = w.shape
    G = K if group_size is None else int(group_size)
    if group_size not in WEIGHT_GROUP_SIZES or K == 0 or (K % G):
        raise ValueError(f"group_size must be one of {WEIGHT_GROUP_SIZES} and divide K = {K}, got {group_size!r}")
    return t, w.astype(np.float32).reshape(N, K // G, G), G


def quantize_weight(w, dtype="int4", *, group_size=128, symmetric=True):
    """Weight-only quantization of ``w`` ``(N, K)`` (PyTorch Linear's ``[out, in]``), groups of
    ``group_size`` along K (``None``: one group per output channel). Returns ``(data, scales,
    zeros)``; every float step is IEEE float32 and ``T`` is w's dtype:

    - ``"int4"`` (GPTQ/Marlin uint4b8): ``s = T(amax / 7)``, ``q = clamp(rne(w / s), -8, 7) + 8``.
    - ``"uint4"`` (AWQ): ``s = T(max(max - min, 1e-5) / 15)``, ``z = clamp(rne(-min / s), 0, 15)``,
      ``q = clamp(rne(w / s) + z, 0, 15)``; max and min over the group as they are (0 need not be
      inside), as AWQ computes them.
    - ``"float8_e4m3fn"`` (W8A16): ``s = T(amax / 448)``, ``q = e4m3_satfinite(w / s)``.

    The maxima and minima take the finite weights only (NaN and +-inf ignored); a NaN weight
    quantizes to its group's zero code (8, z, 0x00: rne(NaN) is taken as 0), and +-inf clamps to the
    extreme codes (0 and 15, +-448). A group whose stored scale ``s`` is 0 (all zeros, or an amax
    that underflows T; uint4's floor keeps its scale above 0) quantizes to the zero code. Layout: INT4 data ``(N, K / 2)`` uint8, element 0 in
    the low nibble; FP8 data ``(N, K)`` uint8; scales ``(N, K / G)`` of w's dtype; zeros (uint4
    only) ``(N, ceil(K / G / 2))`` uint8 packed like the data, else None."""
    scheme = weight_scheme(dtype, symmetric)
    t, g, G = _weight_groups(w, group_size)
    N, ng, _ = g.shape
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        finite = np.isfinite(g)
        if scheme == "uint4":
            mx = np.where(finite, g, -np.inf).max(axis=-1)
            mn = np.where(finite, g, np.inf).min(axis=-1)
            none = ~finite.any(axis=-1)
            mx, mn = np.where(none, 0, mx).astype(np.float32), np.where(none, 0, mn).astype(np.float32)
            rng = np.fmax((mx - mn).astype(np.float32), AWQ_RANGE_FLOOR)
            s32 = (rng / np.float32(15)).astype(np.float32)
        else:
            amax = np.where(finite, np.abs(g), np.float32(0)).max(axis=-1).astype(np.float32)
            s32 = (amax / np.float32(7 if scheme == "int4" else 448)).astype(np.float32)
        s = s32.astype(t.dtype)
        sf = s.astype(np.float32)[..., None]
        zero_scale = sf == 0
        v = (g / sf).astype(np.float32)
        if scheme == "int4":
            q = np.where(zero_scale, 8, _rne_clamp(v, -8, 7) + 8)
            zeros = None
        elif scheme == "uint4":
            z = _rne_clamp((-mn[..., None] / sf).astype(np.float32), 0, 15)
            q = np.where(zero_scale, z, np.clip(_rne_clamp(v, -(1 << 20), 1 << 20) + z, 0, 15))
            zeros = pack_fp4(z[..., 0].astype(np.uint8))
        else:
            q = np.where(zero_scale | np.isnan(g), 0, cast_fp8(v, "float8_e4m3fn"))
            return q.reshape(N, ng * G).astype(np.uint8), s, None
    data = pack_fp4(q.reshape(N, ng * G).astype(np.uint8))
    return data, s, zeros


def dequantize_weight(data, scales, zeros=None, dtype="int4", out_dtype=np.float32, *, K=None):
    """``y = round_to(float(q - z) * float(s), out_dtype)`` (``z = 8`` for int4), or
    ``round_to(fp8_to_float(q) * float(s), out_dtype)`` for FP8, the product in IEEE float32 (exact:
    a 4-bit integer or an E4M3 value times a float16/bfloat16 scale). ``K`` defaults to the full
    width of the data."""
    scheme = weight_scheme(dtype, zeros is None and dtype != "uint4")
    data = np.asarray(data, dtype=np.uint8)
    s = np.asarray(scales).astype(np.float32)
    N, ng = s.shape
    if scheme == "float8_e4m3fn":
        K = data.shape[1] if K is None else K
        v = fp8_to_float(data[:, :K], "float8_e4m3fn")
    else:
        K = 2 * data.shape[1] if K is None else K
        q = unpack_fp4(data, K).astype(np.int32)
        z = 8 if scheme == "int4" else unpack_fp4(zeros, ng).astype(np.int32)
        zz = np.broadcast_to(np.asarray(z), (N, ng))
        v = (q.reshape(N, ng, K // ng) - zz[..., None]).astype(np.float32).reshape(N, K)
    G = K // ng
    with np.errstate(over="ignore", invalid="ignore"):
        y = (v.reshape(N, ng, G) * s[..., None]).astype(np.float32).reshape(N, K)
    return round_to(y, out_dtype)


def prepare_weight(data, scales, zeros=None, *, scheme):
    """The prepared (tile-major) layout that the matmul kernels read, from the plain layout of
    :func:`quantize_weight` (``data`` ``(N, B)`` uint8 with B = K / 2 for INT4 or K for FP8, a
    multiple of 64; ``scales`` ``(N, ng)``; ``zeros`` ``(N, ceil(ng / 2))`` or None; ``scheme`` the
    weight's). Returns ``(data, scales, zeros)``, the rows padded with zeros to ``16 T``,
    ``T = ceil(N / 16)`` tiles, each tile's K cut into chunks of 64 bytes a row (``C = B / 64``):

    - INT4 (``"int4"``, ``"uint4"``) data ``(T, C, 2, 32, 16)``, fragment order: with
      ``k % 128 = 16 s + 8 kb + 2 t + e`` (k16 step s of the chunk, t, kb, e as in the A fragment of
      an m16n8k16 mma) and ``g = n % 8``, the code of row n at k is in byte
      ``[n // 16, k // 128, s % 2, 4 g + s // 2, 4 t + kb + 2 e]``, the low nibble when
      ``n % 16 < 8``. So the 32-bit word ``4 t`` of piece ``[.., s % 2, 4 g + s // 2]`` holds the 8
      codes that lane (g, t) of a warp feeds to step s (rows g and g + 8 at k 2t, 2t + 1, 2t + 8,
      2t + 9), and the two pieces ``4 g + j`` (``s % 2 = 0, 1``) hold every code of rows g and g + 8
      at k 32 j .. 32 j + 31. Where every group is whole chunks (``G`` a multiple of 128, or one
      group per row: ``2 B / ng`` a multiple of 128), the k of each chunk are first permuted:
      chunk k ``32 a + 8 b + r`` (``a, b < 4``, ``r < 8``) takes the place of ``32 b + 8 a + r``
      in the formula above (the 4 x 4 blocks of 8 k transposed), so that pieces ``4 g + j`` hold
      k ``32 i + 8 j + r`` (``i < 4``): lanes ``t = 0..3`` of weight.cu's decode kernel, which
      take the k of pieces ``4 g + t``, load their activations in four loads of 8 (``i``), and
      each load of the four lanes is 64 contiguous bytes;
    - FP8 data ``(T, C, 16, 64)``: byte b of row n at ``[n // 16, b // 64, n % 16, b % 64]``;
    - scales ``(T, ng, 16)``: the scale of row n, group j at ``[n // 16, j, n % 16]``;
    - zeros ``(T, ng, 8)``: zero code of row n, group j in byte ``[n // 16, j, (n % 16) // 2]``,
      the low nibble for even ``n % 16``.

    Written as the scatter of each element to its flat offset, not as the reshape and transpose of
    ``cupyquant.weight``, so that the two are independent checks of each other."""
    if scheme not in ("int4", "uint4", "float8_e4m3fn"):
        raise ValueError(f"scheme must be 'int4', 'uint4' or 'float8_e4m3fn', got {scheme!r}")
    data = np.asarray(data, dtype=np.uint8)
    scales = np.asarray(scales)
    N, B = data.shape
    ng = scales.shape[1]
    if B % 64:
        raise ValueError(f"the data's row of {B} bytes must be a multiple of 64 (128 INT4 or 64 FP8 elements)")
    T, nch = -(-N // 16), B // 64
    flat = np.zeros(T * nch * 1024, np.uint8)
    if scheme == "float8_e4m3fn":
        n, b = np.indices((N, B), dtype=np.int64)
        flat[((n // 16) * nch + b // 64) * 1024 + (n % 16) * 64 + b % 64] = data
        d = flat.reshape(T, nch, 16, 64)
    else:
        n, k = np.indices((N, 2 * B), dtype=np.int64)
        codes = unpack_fp4(data, 2 * B).astype(np.uint8)
        r, kk = n % 16, k % 128
        if (2 * B // ng) % 128 == 0:  # whole-chunk groups: the 4 x 4 blocks of 8 k transposed
            kk = 32 * (kk % 32 // 8) + 8 * (kk // 32) + kk % 8
        st, kb, t, e = kk // 16, kk % 16 // 8, kk % 8 // 2, kk % 2
        at = ((n // 16) * nch + k // 128) * 1024 + (st % 2) * 512 + (4 * (r % 8) + st // 2) * 16 + 4 * t + kb + 2 * e
        lo = r < 8  # rows g (low nibble) and g + 8 (high nibble) share a byte
        flat[at[lo]] = codes[lo]
        flat[at[~lo]] |= codes[~lo] << 4
        d = flat.reshape(T, nch, 2, 32, 16)
    n, j = np.indices((N, ng), dtype=np.int64)
    at = ((n // 16) * ng + j) * 16 + n % 16
    s = np.zeros(T * ng * 16, scales.dtype)
    s[at] = scales
    z = None
    if zeros is not None:
        codes = np.zeros(T * ng * 16, np.uint8)
        codes[at] = unpack_fp4(zeros, ng)
        z = pack_fp4(codes.reshape(T, ng, 16))
    return d, s.reshape(T, ng, 16), z
