"""Weight-only quantization (GPTQ/Marlin uint4b8, AWQ, W8A16, NVFP4 and MXFP4), FP8 weights in
128 x 128 blocks (DeepSeek-V3, for W8A8 and the weight-only matmul), INT8 weights per output
channel (SmoothQuant / compressed-tensors W8A8 INT8) with their code sums, the prepared layout of
the matmul kernels, and the weight-only matmul of block weights with its error bound."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .. import _checks, _dtypes
from .._checks import DEFAULT_GROUP_SIZE, weight_block_size, weight_int8_k, weight_int8_options, weight_scheme
from .._layouts import pack_fp4, unpack_fp4
from ._common import cast_fp8, fp8_to_float, round_to
from .mx import MX_BLOCK, dequantize_mx, e2m1_to_float, quantize_mx
from .nvfp4 import NVFP4_BLOCK, quantize_nvfp4

AWQ_RANGE_FLOOR = np.float32(1e-5)  # AWQ's clamp(min=1e-5) on max - min
#: The FP4 weight formats and their blocks along K (one scale byte per block).
FP4_WEIGHT_BLOCK = {"nvfp4": NVFP4_BLOCK, "mxfp4": MX_BLOCK}
#: The FP4 formats' scale bytes, as ml_dtypes types (E4M3 for NVFP4, E8M0 for MXFP4).
_FP4_SCALE_DTYPES = {"nvfp4": np.dtype(ml_dtypes.float8_e4m3fn), "mxfp4": np.dtype(ml_dtypes.float8_e8m0fnu)}


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
    G = _checks.weight_group_size(K, group_size)
    return t, w.astype(np.float32).reshape(N, K // G, G), G


def quantize_weight(w, dtype="int4", *, group_size=DEFAULT_GROUP_SIZE, symmetric=True, block_size=None):
    """Weight-only quantization of ``w`` ``(N, K)`` (PyTorch Linear's ``[out, in]``), groups of
    ``group_size`` along K (``None``: one group per output channel), or FP8 in 2-D blocks
    (``block_size=(128, 128)``, see :func:`quantize_weight_blocks`; ``group_size`` must then be
    left at its default), or INT8 per output channel (``dtype="int8"``, ``group_size=None``, see
    :func:`quantize_weight_int8`), or FP4 (``dtype="nvfp4"`` or ``"mxfp4"``, see
    :func:`quantize_weight_fp4`: returns ``(data, scale, scale_2)``). Returns ``(data, scales,
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
    if scheme == "int8":
        weight_int8_options(group_size, block_size)
        return quantize_weight_int8(w)
    if weight_block_size(scheme, block_size, group_size) is not None:
        return quantize_weight_blocks(w)
    if scheme in FP4_WEIGHT_BLOCK:
        _checks.fp4_weight_group_size(scheme, FP4_WEIGHT_BLOCK[scheme], group_size)
        return quantize_weight_fp4(w, scheme)
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


def dequantize_weight(
    data, scales, zeros=None, dtype="int4", out_dtype=np.float32, *, K=None, block_size=None, scale_2=None
):
    """``y = round_to(float(q - z) * float(s), out_dtype)`` (``z = 8`` for int4), or
    ``round_to(fp8_to_float(q) * float(s), out_dtype)`` for FP8, the product in IEEE float32 (exact:
    a 4-bit integer or an E4M3 value times a float16/bfloat16 scale). ``K`` defaults to the full
    width of the data. ``block_size=(128, 128)``: FP8 in 2-D blocks, see
    :func:`dequantize_weight_blocks`. ``dtype="int8"``: see :func:`dequantize_weight_int8`.
    ``dtype="nvfp4"`` (with ``scale_2``, the decode scale) or ``"mxfp4"``: see
    :func:`dequantize_weight_fp4`."""
    if scale_2 is not None and dtype != "nvfp4":
        raise ValueError(f"scale_2 is for nvfp4 weights only, got dtype {dtype!r}")
    if isinstance(dtype, str) and dtype in FP4_WEIGHT_BLOCK:
        if zeros is not None or block_size is not None:
            raise ValueError(f"{dtype} weights take neither zeros nor block_size")
        data = np.asarray(data, dtype=np.uint8)
        if K is not None and (data.ndim != 2 or K != 2 * data.shape[1]):
            raise ValueError(f"K={K!r} must be 2 * data.shape[1] for {dtype} weights (or None), data {data.shape}")
        return dequantize_weight_fp4(data, scales, dtype, scale_2, out_dtype)
    scheme = weight_scheme(dtype, zeros is None and dtype != "uint4")
    if scheme == "uint4" and zeros is None:
        raise ValueError("zeros must be given for uint4 weights: their packed zero points, uint8 (N, ceil(ng / 2))")
    if scheme == "int8":
        if zeros is not None or K is not None or block_size is not None:
            raise ValueError("int8 weights take neither zeros, K nor block_size")
        return dequantize_weight_int8(data, scales, out_dtype)
    if weight_block_size(scheme, block_size, DEFAULT_GROUP_SIZE) is not None:
        if zeros is not None or K is not None:
            raise ValueError("block-scaled FP8 weights take neither zeros nor K")
        return dequantize_weight_blocks(data, scales, out_dtype)
    data = np.asarray(data, dtype=np.uint8)
    s = np.asarray(scales).astype(np.float32)
    if data.ndim != 2 or s.ndim != 2 or s.shape[0] != data.shape[0]:
        raise ValueError(f"data and scales must be 2-D with the same rows, got {data.shape} and {s.shape}")
    N, ng = s.shape
    fp8 = scheme == "float8_e4m3fn"
    K = (data.shape[1] if fp8 else 2 * data.shape[1]) if K is None else K
    if not 0 < K <= (data.shape[1] if fp8 else 2 * data.shape[1]) or ng == 0 or K % ng:
        raise ValueError(f"K = {K} must fit the data {data.shape} and split into the scales' {ng} groups")
    if zeros is not None:
        _checks.shape_of(np.asarray(zeros), "zeros", (N, -(-ng // 2)))
    if fp8:
        v = fp8_to_float(data[:, :K], "float8_e4m3fn")
    else:
        q = unpack_fp4(data[:, : -(-K // 2)], K).astype(np.int32)
        z = 8 if scheme == "int4" else unpack_fp4(zeros, ng).astype(np.int32)
        zz = np.broadcast_to(np.asarray(z), (N, ng))
        v = (q.reshape(N, ng, K // ng) - zz[..., None]).astype(np.float32).reshape(N, K)
    G = K // ng
    with np.errstate(over="ignore", invalid="ignore"):
        y = (v.reshape(N, ng, G) * s[..., None]).astype(np.float32).reshape(N, K)
    return round_to(y, out_dtype)


BLOCK = 128  # rows and columns of a block of quantize_weight_blocks


def _block_scale_shape(N, K):
    return (-(-N // BLOCK), -(-K // BLOCK))


def quantize_weight_blocks(w):
    """FP8 E4M3 weights in 2-D blocks of 128 x 128 (DeepSeek-V3's ``weight_scale_inv``), the
    FP8 formula of :func:`quantize_weight` with the amax over the 2-D block and the scale kept in
    float32. For block ``(i, j)`` (rows ``128 i ..``, columns ``128 j ..``; the blocks at the
    bottom and right edges hold the rows and columns that exist):

    - ``amax = max |w|`` over the block's finite weights (0 if none), in float32;
    - ``s = amax / 448`` (IEEE float32 division, not rounded to w's dtype);
    - ``q = e4m3_satfinite(w / s)`` (float32 division, round to nearest even, saturating: +-inf
      gives +-448, ``0x7e``/``0xfe``); a NaN weight gives the code 0x00, and so does every weight
      of a block whose ``s`` is 0 (all zeros, non-finite only, or an amax below 448 * 2^-150 whose
      quotient underflows).

    Returns ``(data, scales, None)``: data ``(N, K)`` uint8 E4M3 codes, scales float32
    ``(ceil(N / 128), ceil(K / 128))``, ``w ~ fp8(q) * s``. Any N >= 0 and K > 0."""
    w = np.asarray(w)
    _dtypes.input_type(w.dtype, "w")
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D (N, K), got shape {w.shape}")
    N, K = w.shape
    if K == 0:
        raise ValueError("w's K must be nonzero")
    nb, kb = _block_scale_shape(N, K)
    # zero padding to whole blocks leaves every amax as it is (amax >= 0)
    p = np.zeros((nb * BLOCK, kb * BLOCK), np.float32)
    p[:N, :K] = w.astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        b = p.reshape(nb, BLOCK, kb, BLOCK)
        amax = np.where(np.isfinite(b), np.abs(b), np.float32(0)).max(axis=(1, 3)).astype(np.float32)
        s = (amax / np.float32(448)).astype(np.float32)
        sf = np.repeat(np.repeat(s, BLOCK, axis=0), BLOCK, axis=1)[:N, :K]
        x = p[:N, :K]
        v = (x / sf).astype(np.float32)
        q = np.where((sf == 0) | np.isnan(x), 0, cast_fp8(v, "float8_e4m3fn"))
    return q.astype(np.uint8), s, None


def dequantize_weight_blocks(data, scales, out_dtype=np.float32):
    """``y = round_to(fp8_to_float(q) * s, out_dtype)`` of weights in 128 x 128 blocks: ``s`` the
    float32 scale of the element's block (``scales[n // 128, k // 128]``, shape
    ``(ceil(N / 128), ceil(K / 128))``), the product an IEEE float32 multiplication (rounded), then
    rounded to ``out_dtype`` (NaN codes give CUDA's canonical NaN)."""
    data = np.asarray(data, dtype=np.uint8)
    s = np.asarray(scales)
    if s.dtype != np.float32:
        raise ValueError(f"scales of 128 x 128 blocks must be float32, got {s.dtype}")
    if data.ndim != 2 or s.shape != _block_scale_shape(*data.shape):
        raise ValueError(
            f"scales must have shape {_block_scale_shape(*data.shape) if data.ndim == 2 else '(ceil(N/128), ceil(K/128))'} "
            f"for data {data.shape}, got {s.shape}"
        )
    N, K = data.shape
    sf = np.repeat(np.repeat(s, BLOCK, axis=0), BLOCK, axis=1)[:N, :K]
    with np.errstate(over="ignore", invalid="ignore"):
        y = (fp8_to_float(data, "float8_e4m3fn") * sf).astype(np.float32)
    return round_to(y, out_dtype)


#: The weight-only matmul's float32 sums: at most ``(K 2^-23 + 2^-22) S`` from the float64 sum
#: (``S = sum_k |a w|``): one rounding (truncation included) an addition, and the last one.
WEIGHT_MATMUL_REL_ERROR = (2.0**-23, 2.0**-22)


def weight_matmul_blocks(a, data, scales):
    """The weight-only matmul ``y = a @ W.T`` of FP8 weights in 128 x 128 blocks as
    :func:`cupyquant.matmul` defines it, in float64: returns ``(ref, S)``, both ``a.shape[:-1] + (N,)``.

    ``W = dequantize_weight_blocks(data, scales, a.dtype)``: each E4M3 value times the float32 scale
    of its block, ``scales[n // 128, k // 128]``, in an IEEE float32 multiply, rounded once to a's
    dtype (float16 or bfloat16), the bits of ``w.dequantize(a.dtype)``; the scale itself is never
    rounded to 16 bits. ``ref = sum_k a[m, k] W[n, k]`` in float64 and ``S = sum_k |a[m, k] W[n, k]|``.
    Every product ``a W`` is exact in float32 (at most 11 + 11 significant bits), so the kernels'
    float32 sums, in whatever order, and their one rounding to a's dtype are within
    :func:`weight_matmul_error_bound` of ``ref``; where every partial sum is exact in float32 (small
    integer activations, weights of few bits) ``y`` is ``round_to(ref, a.dtype)`` bit for bit.
    ``data`` uint8 ``(N, K)`` E4M3 codes, ``scales`` float32 ``(ceil(N / 128), ceil(K / 128))``,
    ``a`` ``(..., K)``."""
    a = np.asarray(a)
    t = _dtypes.input_type(a.dtype, "a")
    if t.name not in ("float16", "bfloat16"):
        raise TypeError(f"a must be float16 or bfloat16, got {a.dtype}")
    data = np.asarray(data)
    if data.ndim != 2 or a.ndim == 0 or a.shape[-1] != data.shape[1]:
        raise ValueError(f"a (..., K) and data (N, K) must share K, got {a.shape} and {data.shape}")
    W = dequantize_weight_blocks(data, scales, a.dtype).astype(np.float64)
    N, K = data.shape
    a64 = a.astype(np.float64).reshape(-1, K)
    shape = a.shape[:-1] + (N,)
    return (a64 @ W.T).reshape(shape), (np.abs(a64) @ np.abs(W).T).reshape(shape)


def weight_matmul_error_bound(ref, S, K: int, out_dtype) -> np.ndarray:
    """The element-wise bound of ``|y - ref|`` for :func:`weight_matmul_blocks`' ``(ref, S)``:
    ``err = (K 2^-23 + 2^-22) S`` (float32 sums) plus half an ulp of ``out_dtype`` at
    ``|ref| + err`` (the one rounding to a's dtype, in the binade the float32 sum may reach)."""
    out_dtype = _dtypes.input_type(out_dtype, "out_dtype").dtype
    per_k, last = WEIGHT_MATMUL_REL_ERROR
    err = (int(K) * per_k + last) * np.asarray(S, dtype=np.float64)
    fi = ml_dtypes.finfo(out_dtype)
    mag = np.maximum(np.abs(np.asarray(ref, dtype=np.float64)) + err, float(fi.smallest_normal))
    return err + np.ldexp(1.0, (np.floor(np.log2(mag)) - fi.nmant - 1).astype(np.int64))


INT8_QMAX = np.float32(127)  # s = amax / 127: vLLM's int8 kernels and SmoothQuant's per-channel weights
INT8_CODES = (-128, 127)  # the int8 range, compressed-tensors calculate_range and cvt.rni.sat.s8.f32


def quantize_weight_int8(w):
    """Symmetric INT8 weights, one scale per output channel (SmoothQuant, compressed-tensors W8A8
    INT8: the weights vLLM's ``cutlass_scaled_mm`` multiplies). Per row ``n`` of ``w`` ``(N, K)``,
    every float step IEEE float32, ``T`` w's dtype:

    - ``amax = max |w[n, :]|`` over the row's finite weights (0 if none), in float32;
    - ``s = T(amax / 127)``: the IEEE float32 quotient rounded to ``T`` (to nearest even), as the
      FP8 per-channel weights round theirs, so that dequantization inverts what was stored;
    - ``q = clamp(rne(w / s), -128, 127)``, the division by the stored scale in float32, round half
      to even, the int8 range (compressed-tensors' ``calculate_range`` and vLLM's
      ``float_to_int8_rn``, ``cvt.rni.sat.s8.f32``).

    A NaN weight gives the code 0 (rne(NaN) is taken as 0), +-inf clamps to 127 / -128; every weight
    of a row whose stored scale is 0 (all zeros, no finite weight, or an amax whose quotient
    underflows ``T``) gives 0. Finite weights give codes in -127..127 except where rounding the
    scale to ``T`` lowers it enough (``T``'s subnormals), when the codes saturate at -128 and 127.

    Returns ``(data, scales, None)``: data int8 ``(N, K)``, scales ``(N, 1)`` of w's dtype,
    ``w ~ q * s``. Any N >= 0, any 0 < K <= 2^24. The code sums that the W8A8 GEMM needs are
    :func:`weight_code_sum` of the data."""
    w = np.asarray(w)
    t = _dtypes.input_type(w.dtype, "w")
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D (N, K), got shape {w.shape}")
    weight_int8_k(w.shape[1])
    g = w.astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        amax = np.where(np.isfinite(g), np.abs(g), np.float32(0)).max(axis=1).astype(np.float32)
        s = (amax / INT8_QMAX).astype(np.float32).astype(t.dtype)[:, None]
        sf = s.astype(np.float32)
        v = (g / sf).astype(np.float32)
        q = np.where(sf == 0, 0, _rne_clamp(v, *INT8_CODES))
    return q.astype(np.int8), s, None


def weight_code_sum(data):
    """The code sums of INT8 weights: ``sum_k q[n, k]`` per row of ``data`` (int8 ``(N, K)``), exact,
    as int32 ``(N,)`` (``|sum| <= 128 K`` fits for K up to 2^24). The W8A8 GEMM removes an
    activation zero point ``z(m)`` with ``acc - z(m) * code_sum(n)`` (vLLM's ``azp_adj``)."""
    q = np.asarray(data)
    if q.dtype != np.int8 or q.ndim != 2:
        raise ValueError(f"data must be int8 (N, K), got {q.dtype} {q.shape}")
    weight_int8_k(q.shape[1], "data")
    return q.astype(np.int64).sum(axis=1).astype(np.int32)


def dequantize_weight_int8(data, scales, out_dtype=np.float32):
    """``y = round_to(float32(q) * float32(s), out_dtype)`` of INT8 weights: ``q`` int8 ``(N, K)``,
    ``s`` the row's scale, ``(N, 1)`` or ``(N,)`` of float32, float16 or bfloat16. The product is an
    IEEE float32 multiplication (exact for float16 and bfloat16 scales: 8 by 11 significant bits;
    rounded for float32 ones), then rounded to ``out_dtype`` (NaN as CUDA's canonical NaN), the FP8
    per-channel weights' formula."""
    q = np.asarray(data)
    s = np.asarray(scales)
    if q.dtype != np.int8 or q.ndim != 2:
        raise ValueError(f"data must be int8 (N, K), got {q.dtype} {q.shape}")
    N = q.shape[0]
    if s.shape not in ((N,), (N, 1)):
        raise ValueError(f"scales must have shape ({N}, 1) or ({N},) for data {q.shape}, got {s.shape}")
    _dtypes.input_type(s.dtype, "scales")
    with np.errstate(over="ignore", invalid="ignore"):
        y = (q.astype(np.float32) * s.reshape(N, 1).astype(np.float32)).astype(np.float32)
    return round_to(y, out_dtype)


def _fp4_format(fmt) -> str:
    if not isinstance(fmt, str) or fmt not in FP4_WEIGHT_BLOCK:
        raise ValueError(f"fmt must be one of {tuple(FP4_WEIGHT_BLOCK)}, got {fmt!r}")
    return fmt


def quantize_weight_fp4(w, fmt="nvfp4"):
    """FP4 weights ``w`` ``(N, K)``: the bytes of :func:`quantize_nvfp4` (``fmt="nvfp4"``, its global
    scale from the whole weight) or of :func:`quantize_mx` with ``"float4_e2m1fn"`` and
    ``rounding="ceil"`` (``fmt="mxfp4"``), dense scales. K must be a nonzero multiple of the block
    (16 for NVFP4, 32 for MXFP4); any N >= 0. Per block of K along a row:

    - NVFP4: ``S_enc = 2688 / amax(w)`` (:func:`nvfp4_global_scale`), ``sf = e4m3(amax_b * S_enc / 6)``,
      ``q = e2m1(w / (e4m3(sf) / S_enc))`` as :func:`quantize_nvfp4` computes them; the weight's
      ``scale_2 = float32(1 / S_enc)`` (IEEE float32 division, subnormals kept), its decode scale:
      ``w ~ e2m1(q) * (e4m3(sf) * scale_2)`` (ModelOpt's ``weight_scale_2``);
    - MXFP4: ``b = e8m0_ceil(amax_b * float32(1 / 6))``, ``q = e2m1(w * 2^(127 - b))``:
      ``w ~ e2m1(q) * 2^(b - 127)``.

    Returns ``(data, scale, scale_2)``: data uint8 ``(N, K / 2)`` (E2M1 codes, element 0 in the low
    nibble), scale uint8 ``(N, K / block)`` (the E4M3 or E8M0 bytes), and ``scale_2`` a float32
    ``(1,)`` array (NVFP4) or None (MXFP4): the three parts of a plain FP4
    :class:`cupyquant.QuantizedWeight` (``data``, ``scale``, ``scale_2``; its ``zero_point`` is
    None)."""
    fmt = _fp4_format(fmt)
    w = np.asarray(w)
    _dtypes.input_type(w.dtype, "w")
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D (N, K), got shape {w.shape}")
    block = FP4_WEIGHT_BLOCK[fmt]
    _checks.fp4_weight_k(fmt, block, w.shape[1])
    if fmt == "mxfp4":
        data, E = quantize_mx(w, "float4_e2m1fn")
        return data, E, None
    data, sf, S_enc = quantize_nvfp4(w)
    return data, sf, (np.float32(1) / np.array([S_enc], np.float32)).astype(np.float32)


def _fp4_scale_bytes(scales, fmt: str, arg: str = "scales") -> np.ndarray:
    """FP4 scale bytes given as uint8 or as the format's ml_dtypes type (viewed as uint8)."""
    s = np.asarray(scales)
    if s.dtype == _FP4_SCALE_DTYPES[fmt]:
        return s.view(np.uint8)
    if s.dtype != np.uint8:
        raise TypeError(f"{arg} must be uint8 or {_FP4_SCALE_DTYPES[fmt].name} (the {fmt} scale bytes), got {s.dtype}")
    return s


def dequantize_weight_fp4(data, scales, fmt="nvfp4", scale_2=None, out_dtype=np.float32):
    """``y`` ``(N, K)`` of FP4 weights, ``K = 2 * data.shape[1]``, each element's block scale
    ``scales[n, k // block]`` (uint8 bytes, or the ml_dtypes scale type viewed as bytes):

    - NVFP4: ``y = round_to(e2m1(q) * float32(e4m3(sf) * scale_2), out_dtype)``, both products IEEE
      float32 (the numbers of :func:`dequantize_nvfp4` with ``S_dec = scale_2``), ``scale_2`` the
      decode scale, a float32 array of one element (required);
    - MXFP4: ``y = round_to(e2m1(q) * 2^(b - 127), out_dtype)`` as :func:`dequantize_mx` computes it
      (``b = 0`` is the subnormal 2^-127, ``b = 255`` NaN); ``scale_2`` must be None.

    An E4M3 NaN byte (0x7f, 0xff) or E8M0 255 gives NaN, as CUDA's canonical NaN."""
    fmt = _fp4_format(fmt)
    block = FP4_WEIGHT_BLOCK[fmt]
    data = np.asarray(data)
    if data.dtype != np.uint8 or data.ndim != 2:
        raise ValueError(f"data must be uint8 (N, K / 2), got {data.dtype} {data.shape}")
    N, K = data.shape[0], 2 * data.shape[1]
    _checks.fp4_weight_k(fmt, block, K, "data")
    s = _fp4_scale_bytes(scales, fmt)
    _checks.shape_of(s, "scales", (N, K // block))
    if fmt == "mxfp4":
        if scale_2 is not None:
            raise ValueError("scale_2 must be None for mxfp4 weights (only nvfp4 has a second scale)")
        return dequantize_mx(data, s, "float4_e2m1fn", out_dtype)
    if scale_2 is None:
        raise ValueError("scale_2 must be given for nvfp4 weights (the float32 decode scale)")
    s2 = np.float32(_checks.one_element_float32(np.asarray(scale_2), "scale_2").reshape(-1)[0])
    with np.errstate(over="ignore", invalid="ignore"):
        sf = (fp8_to_float(s, "float8_e4m3fn") * s2).astype(np.float32)
        v = e2m1_to_float(unpack_fp4(data, K)).reshape(N, K // block, block)
        y = (v * sf[..., None]).astype(np.float32).reshape(N, K)
    return round_to(y, out_dtype)


def prepare_weight(data, scales, zeros=None, *, scheme, block_size=None):
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
      the low nibble for even ``n % 16``;
    - FP4 (``"nvfp4"``, ``"mxfp4"``; ``zeros`` None): data as INT4's with the k permuted (always,
      whatever the block: the same nibbles, E2M1 codes instead of uint4); ``scales`` the uint8
      (E4M3 or E8M0) bytes ``(N, K / block)``, prepared as ``(T, C, 16, NB)`` with
      ``NB = 128 / block`` (8 NVFP4, 4 MXFP4): the byte of row n, block j (natural k order, chunk
      ``j // NB``) at ``[n // 16, j // NB, n % 16, j % NB]``, so that a row's NB bytes of a chunk
      are contiguous. NVFP4's ``scale_2`` has one layout (unchanged).
    - FP8 in 128 x 128 blocks (``scheme="float8_e4m3fn"``, ``block_size=(128, 128)``; ``scales``
      float32 ``(ceil(N / 128), ceil(K / 128))``, ``zeros`` None): data as FP8's; the scales first
      repeated for each row of their block (row n takes ``scales[n // 128]``), then laid out as
      the scales above, ``(T, ceil(K / 128), 16)`` float32: the scale of row n and k at
      ``[n // 16, k // 128, n % 16]``, a group of 128 along K (the last one partial where 128 does
      not divide K), every value as stored.

    Written as the scatter of each element to its flat offset, not as the reshape and transpose of
    ``cupyquant.weight``, so that the two are independent checks of each other."""
    schemes = ("int4", "uint4", "float8_e4m3fn") + tuple(FP4_WEIGHT_BLOCK)
    if scheme not in schemes:
        raise ValueError(f"scheme must be one of {schemes}, got {scheme!r}")
    fp4 = scheme in FP4_WEIGHT_BLOCK
    data = np.asarray(data, dtype=np.uint8)
    scales = _fp4_scale_bytes(scales, scheme) if fp4 else np.asarray(scales)
    N, B = data.shape
    if block_size is not None:
        if scheme != "float8_e4m3fn" or tuple(block_size) != (BLOCK, BLOCK) or zeros is not None:
            raise ValueError(
                f"block_size=(128, 128) takes float8_e4m3fn weights without zeros, got scheme {scheme!r}, "
                f"block_size {block_size!r}, zeros {'None' if zeros is None else 'given'}"
            )
        if scales.dtype != np.float32 or scales.shape != _block_scale_shape(N, B):
            raise ValueError(
                f"scales of 128 x 128 blocks must be float32 of shape {_block_scale_shape(N, B)}, "
                f"got {scales.dtype} {scales.shape}"
            )
        scales = np.repeat(scales, BLOCK, axis=0)[:N]
    ng = scales.shape[1]
    if B % 64:
        raise ValueError(f"the data's row of {B} bytes must be a multiple of 64 (128 INT4 or 64 FP8 elements)")
    if fp4:
        if zeros is not None:
            raise ValueError(f"zeros must be None for {scheme} weights")
        _checks.shape_of(scales, "scales", (N, 2 * B // FP4_WEIGHT_BLOCK[scheme]))
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
        if fp4 or (2 * B // ng) % 128 == 0:  # FP4 or whole-chunk groups: the 4 x 4 blocks of 8 k transposed
            kk = 32 * (kk % 32 // 8) + 8 * (kk // 32) + kk % 8
        st, kb, t, e = kk // 16, kk % 16 // 8, kk % 8 // 2, kk % 2
        at = ((n // 16) * nch + k // 128) * 1024 + (st % 2) * 512 + (4 * (r % 8) + st // 2) * 16 + 4 * t + kb + 2 * e
        lo = r < 8  # rows g (low nibble) and g + 8 (high nibble) share a byte
        flat[at[lo]] = codes[lo]
        flat[at[~lo]] |= codes[~lo] << 4
        d = flat.reshape(T, nch, 2, 32, 16)
    n, j = np.indices((N, ng), dtype=np.int64)
    if fp4:  # a row's NB bytes of a chunk contiguous
        nb = 128 // FP4_WEIGHT_BLOCK[scheme]
        s = np.zeros(T * nch * 16 * nb, np.uint8)
        s[(((n // 16) * nch + j // nb) * 16 + n % 16) * nb + j % nb] = scales
        return d, s.reshape(T, nch, 16, nb), None
    at = ((n // 16) * ng + j) * 16 + n % 16
    s = np.zeros(T * ng * 16, scales.dtype)
    s[at] = scales
    z = None
    if zeros is not None:
        codes = np.zeros(T * ng * 16, np.uint8)
        codes[at] = unpack_fp4(zeros, ng)
        z = pack_fp4(codes.reshape(T, ng, 16))
    return d, s.reshape(T, ng, 16), z
