"""Per-token and per-group quantization (vLLM's formulas), the fused SiLU*Mul, and the scale buffer
layouts of ``cupyquant.quantize_groupwise``."""

from __future__ import annotations

import numpy as np

from .. import _checks, _dtypes, _scales
from ._common import (
    _as_f32,
    _given_scale,
    azp_codes,
    cast_fp8,
    e8m0_to_float,
    fp8_to_float,
    int8_rn,
    int32_rn,
    minus_zero_point,
    round_to,
)

GROUP_EPS = np.float32(1e-10)  # vLLM's default eps, the floor of a group's amax
FLT_EPSILON = np.float32(2.0**-23)
_CUDA_NAN = np.uint32(0x7FFFFFFF)  # the NaN that float32 arithmetic on the GPU produces
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


def _to_codes(v, fmt) -> np.ndarray:
    """Already clamped float32 -> FP8 bit patterns (uint8) or INT8 codes (int8, half to even;
    NaN -> 0, saturating, as cvt.rni.sat.s8.f32)."""
    if fmt.name == "int8":
        return int8_rn(v)
    return cast_fp8(v, fmt.name)


def int8_azp_params(lo, hi):
    """The scale and zero point of asymmetric per-token INT8 for rows with min ``lo`` and max ``hi``
    (float32, NaN already ignored; 0 and 0 for a row with no other value). Returns ``(s, z, flat)``:
    float32 ``s``, int32 ``z`` and where the row is flat.

    vLLM ``dynamic_scaled_int8_azp_quant``, each step IEEE float32:
    ``s = (hi - lo) / 255``; ``z = int32_rn(-128 - lo / s)`` (vLLM: ``nearbyintf`` then the
    conversion to int32, which saturates and takes NaN to 0: the same value). Flat rows, where that
    ``s`` is 0 (vLLM would divide by it): ``s = max(|lo|, |hi|)``, ``z = 0``. A NaN ``s`` (``lo``
    and ``hi`` the same infinity) is the GPU's canonical NaN ``0x7fffffff``."""
    lo = np.asarray(lo, dtype=np.float32)
    hi = np.asarray(hi, dtype=np.float32)
    with np.errstate(all="ignore"):
        s = ((hi - lo).astype(np.float32) / np.float32(255)).astype(np.float32)
        flat = s == 0
        z = int32_rn((np.float32(-128) - (lo / s).astype(np.float32)).astype(np.float32))
    s = np.where(flat, np.fmax(np.abs(lo), np.abs(hi)), s).astype(np.float32)
    s = np.where(np.isnan(s), _CUDA_NAN, s.view(np.uint32)).astype(np.uint32).view(np.float32)
    z = np.where(flat, 0, z).astype(np.int32)
    return s, z, flat


def _quantize_azp(xf):
    """The asymmetric per-token INT8 of quantize_groupwise(symmetric=False), on float32 ``xf``."""
    g = xf.reshape(xf.shape[:-1] + (1, xf.shape[-1]))
    nan = np.isnan(g)
    some = ~nan.all(axis=-1)  # a row with a value that is not NaN (an empty row has none)
    lo = np.min(np.where(nan, np.float32(np.inf), g), axis=-1, initial=np.float32(np.inf))
    hi = np.max(np.where(nan, np.float32(-np.inf), g), axis=-1, initial=np.float32(-np.inf))
    lo = np.where(some, lo, 0).astype(np.float32)
    hi = np.where(some, hi, 0).astype(np.float32)
    s, z, flat = int8_azp_params(lo, hi)
    with np.errstate(all="ignore"):
        inv = (np.float32(1) / s).astype(np.float32)
        regular = azp_codes((g * inv[..., None]).astype(np.float32), z[..., None])
        flat_codes = int8_rn((g / s[..., None]).astype(np.float32))
    q = np.where(flat[..., None], flat_codes, regular).reshape(xf.shape)
    return q.astype(np.int8), s, z


def _ub_value(scale_ub):
    return None if scale_ub is None else _given_scale(scale_ub, "scale_ub")


def quantize_groupwise(
    x,
    dtype="float8_e4m3fn",
    *,
    group_size=128,
    scale_pow2=False,
    scale_dtype="float32",
    scale_ub=None,
    symmetric=True,
):
    """Per-group or per-token quantization (vLLM's formulas); returns ``(q, scale)``, or
    ``(q, scale, zero_point)`` with ``symmetric=False``.

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

    Asymmetric per-token INT8 (``symmetric=False``: ``dtype="int8"``, ``group_size=None``, float32
    scales, no ``scale_pow2`` or ``scale_ub``), vLLM ``dynamic_scaled_int8_azp_quant``
    (csrc/quantization/compressed_tensors/int8_quant_kernels.cu), ``x ~ (q - z) * s``:

    - ``lo``, ``hi``: the row's min and max, NaN ignored (vLLM's ``fminf``/``fmaxf``); 0 and 0 for
      a row with no value that is not NaN (empty or all NaN; vLLM starts from FLT_MAX and
      -FLT_MAX and would give ``s = -inf``).
    - ``s, z = int8_azp_params(lo, hi)``: ``s = (hi - lo) / 255``,
      ``z = int32_rn(-128 - lo / s)`` (vLLM ``nearbyintf`` and the saturating conversion).
    - ``q = int32_to_int8(int32_rn(x * inv) + z)`` with ``inv = 1 / s`` (vLLM multiplies by the
      inverse), the int32 sum wrapping, ``int32_to_int8`` saturating to [-128, 127]: a NaN element
      gives ``sat(z)``.
    - Flat rows (``s`` is 0: all values equal, or ``(hi - lo) / 255`` underflows; vLLM divides by
      zero there): ``s = max(|lo|, |hi|)``, ``z = 0``, ``q = rne_sat(x / s)`` in {-1, 0, 1}, so a
      constant row ``c`` gives ``q = sign(c)`` and dequantizes to ``c`` exactly; an all-zero row
      gives ``s = 0, z = 0, q = 0`` (vLLM's result too).
    - Rows that hold an inf, or finite values more than FLT_MAX apart, get ``s = inf`` (``NaN``
      for a row of one infinity) by the same arithmetic, as in vLLM; they dequantize to NaN.
      Where ``s`` is below 2^-128, ``1 / s`` is inf and the codes saturate, as in vLLM.

    Returns int8 ``q``, float32 ``s`` and int32 ``z``, both ``x.shape[:-1] + (1,)``.
    """
    fmt = _dtypes.element_format(dtype, allowed=_checks.GROUPWISE_FORMATS)
    sdt = _dtypes.scale_dtype(scale_dtype, allowed=("float32", "float8_e8m0fnu"))
    pow2 = scale_pow2 or sdt == "float8_e8m0fnu"
    xf = _as_f32(x)
    _checks.at_least_1d(xf.ndim)
    if not symmetric:
        _asymmetric_args(fmt.name, group_size, pow2, scale_ub)
        return _quantize_azp(xf)
    K = xf.shape[-1]
    # per token: one group of K, even when K = 0 (the scale of an all-zero row)
    g = xf.reshape(xf.shape[:-1] + (_checks.group_count(K, group_size), K if group_size is None else group_size))
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


def _asymmetric_args(fmt_name, group_size, pow2, scale_ub) -> None:
    """symmetric=False goes with int8 per token, float32 scales, no bound (ValueError naming the
    argument that does not), as cupyquant.quantize_groupwise checks it."""
    if fmt_name != "int8":
        raise ValueError(f"dtype={fmt_name!r} has no zero points: symmetric=False is for dtype='int8'")
    if group_size is not None:
        raise ValueError(f"group_size={group_size!r} with symmetric=False: zero points are per token, group_size=None")
    if pow2:
        raise ValueError("scale_pow2 / scale_dtype='float8_e8m0fnu' are not supported with symmetric=False")
    if scale_ub is not None:
        raise ValueError("scale_ub is not supported with symmetric=False")


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
    _checks.at_least_1d(xf.ndim)
    H = _checks.gate_up_width(xf.shape[-1])
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
    fmt = _dtypes.element_format(dtype, allowed=_checks.GROUPWISE_FORMATS)
    _checks.not_per_token(group_size, "silu_mul_quantize")
    r = np.asarray(r, dtype=np.float32)
    _checks.at_least_1d(r.ndim)
    H = r.shape[-1]
    g = r.reshape(r.shape[:-1] + (_checks.group_count(H, group_size), group_size))
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
    _checks.not_per_token(group_size, "silu_mul_quantize")
    return quantize_silu_intermediate(silu_mul(x), dtype, group_size=group_size, scale_ub=scale_ub)


def dequantize_groupwise(q, scale, dtype="float8_e4m3fn", out_dtype=np.float32, *, group_size=None, zero_point=None):
    """``y = round_to(float(q) * s, out_dtype)`` with ``s`` the scale of q's group (float32 scales,
    or UE8M0 bytes given as uint8), the product in IEEE float32. ``group_size`` None means one scale
    per row. INT8 with zero points (int32, the shape of ``scale``):
    ``y = round_to(minus_zero_point(q, z) * s, out_dtype)``, ``float32(q - z)`` rounded once from the
    exact difference."""
    fmt = _dtypes.element_format(dtype, allowed=_checks.GROUPWISE_FORMATS)
    q = np.asarray(q)
    scale = np.asarray(scale)
    _checks.at_least_1d(q.ndim, "q")
    K = q.shape[-1]
    ng = _checks.group_count(K, group_size)
    _checks.shape_of(scale, "scale", q.shape[:-1] + (ng,))
    s = e8m0_to_float(scale) if scale.dtype == np.uint8 else scale.astype(np.float32)
    if zero_point is not None:
        if fmt.name != "int8":
            raise ValueError(f"zero_point is for dtype 'int8', got {fmt.name!r}")
        zero_point = np.asarray(zero_point)
        _checks.shape_of(zero_point, "zero_point", scale.shape)
        z = zero_point.reshape(q.shape[:-1] + (ng, 1))
        v = minus_zero_point(q.reshape(q.shape[:-1] + (ng, K // ng if ng else 0)), z).reshape(q.shape)
    else:
        v = q.astype(np.float32) if fmt.name == "int8" else fp8_to_float(q, fmt.name)
    with np.errstate(all="ignore"):
        prod = v.reshape(q.shape[:-1] + (ng, K if group_size is None else group_size)) * s[..., None]
    return round_to(prod.reshape(q.shape), out_dtype)


def scale_word_offsets(shape, n_cols: int, scale_layout: str):
    """The 4-byte-word offsets of a scale buffer (cupyquant's "row" and "col" layouts) for a tensor
    whose leading dimensions are ``shape[:-1]`` and that has ``n_cols`` scale words per token.
    Returns ``(offsets, total_words)``: ``offsets[..., c]`` is the word of (token, column c).

    ``row``: C order, ``(..., n_cols)``. ``col`` (DeepGEMM's TMA-aligned MN-major): with
    ``M = shape[-2]`` tokens per batch (1 for 1-D), ``M_pad = round_up(M, 4)`` and the batch the
    product of the dimensions before, word ``b * n_cols * M_pad + c * M_pad + m``.
    """
    _scales.group_scale_layout(scale_layout)
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
    _scales.group_scale_layout(scale_layout)
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
