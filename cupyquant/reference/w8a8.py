"""The W8A8 matmul's reference. FP8: the float64 value of ``dequant(a) @ dequant(b).T + bias``, its
rounding to the output dtype, and the element-wise error bound the kernels meet. INT8: the kernels'
result itself, bit for bit (:func:`scaled_mm_int8`; the integer sum is exact and the epilogue is a
fixed sequence of float32 roundings).

For FP8 the kernels (kernels/scaled_mm.cuh) compute, per output element (m, n), with K cut into
blocks of 128 (the last one shorter where 128 does not divide K):

- ``P(kb)``: the tensor cores' float32 sum of the exact products ``qa(m, k) * qb(n, k)`` of block kb;
- no scale varies along K: ``acc = P(0) + P(1) + ...`` (float32), ``v = acc * (sa(m) * sb(n))``;
- a scale varies along K: ``acc = fma(P(kb), sa(m, kb) * sb(n, kb), acc)`` in block order, ``v = acc``;
- a K split: the parts' ``v`` added in part order (float32);
- ``y = round(v + bias(n))`` to nearest even in the output dtype.

The reference is ``ref = sum_k (qa(m, k) * sa(m, k // 128)) * (qb(n, k) * sb(n, k // 128)) + bias(n)``
in float64, with the codes and the scales exactly as stored (FP8 codes, float32 / bfloat16 /
float16 / UE8M0 scales: every one exact in float64). The kernels' float32 sums are within
:func:`error_bound` of it: ``|y - ref| <= 2^-9 * S + half an ulp of the output dtype at |ref|``
(plus a float32 ulp for float32 outputs), ``S = sum_k |dequant(a)[m, k] * dequant(b)[n, k]| +
|bias(n)| * 2^-24``. The 2^-9 covers the Hopper FP8 tensor cores' ~14-bit internal sum within a
block of four k32 steps and the float32 roundings of the scaling. Where every partial sum is exact
(small integer codes, power-of-two scales, short K), ``y`` equals :func:`round_result` of ``ref``
bit for bit.

Scales come in the shapes of :func:`cupyquant.scaled_mm`'s table; :func:`a_block_scales` and
:func:`b_block_scales` expand them to one float64 scale per (row, 128-k block). A QuantizedTensor's
``to_host()["scale"]`` reshaped to ``(rows, -1)`` (or its one element) and a QuantizedWeight's
``to_host()["scale"]`` are in those shapes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .. import _dtypes
from ._common import round_to

#: K per scale block along K
W8A8_BLOCK = 128
#: the relative error per unit of S the kernels' float32 block sums may add (see the module docstring)
W8A8_REL_ERROR = 2.0**-9


def _nkb(K: int) -> int:
    return -(-K // W8A8_BLOCK)


def _scale_f64(s) -> np.ndarray:
    """Stored scales (float32, bfloat16, float16, ml_dtypes float8_e8m0fnu) -> float64, exact."""
    s = np.asarray(s)
    if s.dtype == np.uint8:
        raise TypeError("UE8M0 scales must be given as ml_dtypes.float8_e8m0fnu (or packed int32 words)")
    return s.astype(np.float64)


def unpack_ue8m0_words(words, n: int) -> np.ndarray:
    """Packed UE8M0 words (int32 or uint32 ``(..., ceil(n / 4))``, scale ``4p + j`` in byte j of word
    p) -> ``(..., n)`` ml_dtypes float8_e8m0fnu."""
    w = np.ascontiguousarray(np.asarray(words)).view(np.uint32)
    b = np.stack([(w >> (8 * j)) & 0xFF for j in range(4)], axis=-1).astype(np.uint8)
    b = b.reshape(w.shape[:-1] + (4 * w.shape[-1],))[..., :n]
    return np.ascontiguousarray(b).view(_dtypes.SCALE_DTYPES["float8_e8m0fnu"])


def a_block_scales(a_scale, M: int, K: int) -> np.ndarray:
    """float64 ``(M, ceil(K / 128))``: a's scale of each (row, 128-k block), from ``a_scale`` in
    :func:`cupyquant.scaled_mm`'s shapes: one element (per tensor); ``(M,)`` or ``(M, 1)`` (per
    token); ``(M, ceil(K / 128))`` (1 x 128 groups, any float dtype or float8_e8m0fnu); int32
    ``(M, ceil(ceil(K / 128) / 4))`` (packed UE8M0 words)."""
    s, nkb = np.asarray(a_scale), _nkb(K)
    if s.dtype == np.int32:
        if s.shape != (M, -(-nkb // 4)):
            raise ValueError(f"packed a_scale must have shape {(M, -(-nkb // 4))}, got {s.shape}")
        return _scale_f64(unpack_ue8m0_words(s, nkb))
    if s.size == 1 and s.ndim <= 2:
        return np.full((M, nkb), _scale_f64(s).reshape(-1)[0])
    if s.shape in ((M,), (M, 1)):
        return np.repeat(_scale_f64(s).reshape(M, 1), nkb, axis=1)
    if s.shape == (M, nkb):
        return _scale_f64(s)
    raise ValueError(f"a_scale of shape {s.shape} fits no scaling of an ({M}, {K}) a")


def b_block_scales(b_scale, N: int, K: int) -> np.ndarray:
    """float64 ``(N, ceil(K / 128))``: b's scale of each (row, 128-k block), from ``b_scale`` in
    :func:`cupyquant.scaled_mm`'s shapes: one element (per tensor); ``(N,)`` or ``(N, 1)`` (per
    channel); ``(ceil(N / 128), ceil(K / 128))`` (128 x 128 blocks); ``(N, ceil(K / 128))`` (1 x
    128 groups). float32, or the 16-bit dtype of a quantized weight's scales."""
    s, nkb = np.asarray(b_scale), _nkb(K)
    if s.size == 1 and s.ndim <= 2:
        return np.full((N, nkb), _scale_f64(s).reshape(-1)[0])
    if s.shape in ((N,), (N, 1)):
        return np.repeat(_scale_f64(s).reshape(N, 1), nkb, axis=1)
    if s.shape == (-(-N // W8A8_BLOCK), nkb):
        return np.repeat(_scale_f64(s), W8A8_BLOCK, axis=0)[:N]
    if s.shape == (N, nkb):
        return _scale_f64(s)
    raise ValueError(f"b_scale of shape {s.shape} fits no scaling of an ({N}, {K}) b")


def _codes_f64(q, fmt) -> np.ndarray:
    q = np.asarray(q)
    if q.dtype == np.uint8:
        q = q.view(_dtypes.element_format(fmt, "format", allowed=_dtypes.FP8_NAMES).host_dtype)
    elif q.dtype.name not in _dtypes.FP8_NAMES:
        raise TypeError(f"codes must be uint8 or an ml_dtypes FP8 array, got {q.dtype}")
    return q.astype(np.float64)


def dequantize_operands(a, b, a_scale, b_scale, *, a_format="float8_e4m3fn", b_format="float8_e4m3fn"):
    """``(A, B)``: float64 ``dequant(a)`` ``(M, K)`` and ``dequant(b)`` ``(N, K)``, each code times
    the scale of its (row, 128-k block), exact. ``a``, ``b``: FP8 codes as uint8 (in ``a_format``
    / ``b_format``) or ml_dtypes FP8 arrays; scales as :func:`a_block_scales` /
    :func:`b_block_scales` take them."""
    A, B = _codes_f64(a, a_format), _codes_f64(b, b_format)
    if A.ndim != 2 or B.ndim != 2 or A.shape[1] != B.shape[1]:
        raise ValueError(f"a (M, K) and b (N, K) must share K, got {A.shape} and {B.shape}")
    (M, K), N = A.shape, B.shape[0]
    sa = np.repeat(a_block_scales(a_scale, M, K), W8A8_BLOCK, axis=1)[:, :K]
    sb = np.repeat(b_block_scales(b_scale, N, K), W8A8_BLOCK, axis=1)[:, :K]
    return A * sa, B * sb


def scaled_mm(a, b, a_scale, b_scale, bias=None, *, a_format="float8_e4m3fn", b_format="float8_e4m3fn"):
    """``(ref, S)``: float64 ``(M, N)`` ``ref = dequant(a) @ dequant(b).T + bias`` and ``S =
    |dequant(a)| @ |dequant(b)|.T + |bias| * 2^-24``, the magnitude :func:`error_bound` scales.
    Arguments as :func:`dequantize_operands`; ``bias`` ``(N,)`` in any float dtype (exact in
    float64)."""
    A, B = dequantize_operands(a, b, a_scale, b_scale, a_format=a_format, b_format=b_format)
    ref, S = A @ B.T, np.abs(A) @ np.abs(B).T
    if bias is not None:
        bias = np.asarray(bias).astype(np.float64).reshape(1, -1)
        ref, S = ref + bias, S + np.abs(bias) * 2.0**-24
    return ref, S


def round_result(ref, out_dtype) -> np.ndarray:
    """``ref`` (float64) rounded to ``out_dtype`` (bfloat16, float16, float32), to nearest even:
    through float32, so a single rounding where ``ref`` is exact in float32 (the exact tests)."""
    return round_to(np.asarray(ref, dtype=np.float64).astype(np.float32), out_dtype)


def _half_ulp(x, dtype) -> np.ndarray:
    """Half the spacing of ``dtype`` at magnitude ``x`` (float64; the subnormal spacing below the
    smallest normal)."""
    fi = ml_dtypes.finfo(np.dtype(dtype))
    x = np.maximum(np.abs(np.asarray(x, dtype=np.float64)), float(fi.smallest_normal))
    e = np.floor(np.log2(x))
    return np.ldexp(1.0, (e - fi.nmant - 1).astype(np.int64))


def error_bound(ref, S, out_dtype) -> np.ndarray:
    """The element-wise bound of ``|y - ref|``: ``2^-9 * S`` plus half an ulp of ``out_dtype`` (plus
    a float32 ulp for float32 outputs), the ulps taken at ``|ref| + 2^-9 * S`` (the largest
    magnitude the kernels' value can have, so a result rounded in the binade above is covered)."""
    out_dtype = _dtypes.input_type(out_dtype, "out_dtype").dtype
    S = np.asarray(S, dtype=np.float64)
    err = W8A8_REL_ERROR * S
    mag = np.abs(np.asarray(ref, dtype=np.float64)) + err
    bound = err + _half_ulp(mag, out_dtype)
    if out_dtype == np.float32:
        bound = bound + 2 * _half_ulp(mag, np.float32)
    return bound


# ------------------------------------------------------------------ INT8
_INT32_WRAP = 2**32


def int8_accumulate(a, b, *, azp=None, azp_adj=None) -> np.ndarray:
    """int32 ``(M, N)``: ``I = sum_k a[m, k] * b[n, k] - z(m) * azp_adj(n)`` computed exactly and
    wrapped to int32 (two's complement), as the kernels' int32 arithmetic gives it: exact wherever
    the true value lies in the int32 range. ``a`` int8 ``(M, K)``, ``b`` int8 ``(N, K)``;
    ``azp_adj`` int32 ``(N,)`` (None: no zero-point term); ``azp`` int32 ``(M,)`` or ``(M, 1)``,
    or one element (a per-tensor zero point), or None (z = 1: ``azp_adj`` holds the product)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != np.int8 or b.dtype != np.int8 or a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(
            f"a (M, K) and b (N, K) must be int8 and share K, got {a.dtype} {a.shape}, {b.dtype} {b.shape}"
        )
    # float64 sums of integer products below 2^53 are exact (K < 2^39): BLAS speed, integer result
    acc = (a.astype(np.float64) @ b.astype(np.float64).T).astype(np.int64)
    if azp_adj is not None:
        adj = np.asarray(azp_adj, dtype=np.int64).reshape(1, -1)
        z = np.int64(1) if azp is None else np.asarray(azp, dtype=np.int64).reshape(-1, 1)
        acc = acc - z * adj
    return ((acc + 2**31) % _INT32_WRAP - 2**31).astype(np.int32)


def _f32_column(s, n: int, arg: str) -> np.ndarray:
    s = np.asarray(s)
    if s.size == 1 and s.ndim <= 2:
        return np.full(n, _scale_f64(s).reshape(-1)[0], dtype=np.float32)
    if s.shape in ((n,), (n, 1)):
        return s.reshape(n).astype(np.float32)
    raise ValueError(f"{arg} of shape {s.shape} must have one element or {n} (INT8 scales do not vary along K)")


def scaled_mm_int8(a, b, a_scale, b_scale, *, azp=None, azp_adj=None, bias=None, out_dtype="bfloat16") -> np.ndarray:
    """The INT8 W8A8 matmul's result, bit for bit: ``I`` = :func:`int8_accumulate`, ``v =
    float32(I) * (sa(m) * sb(n))`` and ``y = round(v + bias(n))`` in ``out_dtype``, every float32
    operation rounded to nearest even. ``a_scale``: one element or ``(M,)``/``(M, 1)``; ``b_scale``:
    one element or ``(N,)``/``(N, 1)`` (float32, or a 16-bit weight's scales, exact in float32);
    ``bias`` ``(N,)`` in ``out_dtype``."""
    Iq = int8_accumulate(a, b, azp=azp, azp_adj=azp_adj)
    M, N = Iq.shape
    sa = _f32_column(a_scale, M, "a_scale").reshape(M, 1)
    sb = _f32_column(b_scale, N, "b_scale").reshape(1, N)
    with np.errstate(over="ignore", invalid="ignore"):
        v = Iq.astype(np.float32) * (sa * sb)
        if bias is not None:
            v = v + np.asarray(bias).astype(np.float32).reshape(1, N)
    return round_to(v, out_dtype)
