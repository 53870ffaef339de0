"""The W8A8 matmul, FP8 or INT8: :func:`scaled_matmul` (quantized containers), :func:`scaled_mm`
(raw codes and scales, vLLM's ``cutlass_scaled_mm`` convention with ``b`` given ``(N, K)``) and
:func:`scaled_mm_azp` (INT8 with activation zero points, ``cutlass_scaled_mm_azp``'s convention).

Kernels: ``kernels/scaled_mm_sm90.cu`` (wgmma, compute capability 9.0) and
``kernels/scaled_mm_mma.cu`` (mma.sync: FP8 on 8.9 and newer, INT8 on 8.0 and newer);
``kernels/scaled_mm.cuh`` states the numerics they share. Reference:
:func:`cupyquant.reference.scaled_mm`.
"""

from __future__ import annotations

import cupy
import numpy as np

from .. import _plans, _validate
from ..quantized import QuantizedTensor
from ..weight.container import QuantizedWeight
from . import build, dispatch, operands

#: Planned calls per argument signature: (layout, planned launch or None, overlap check of ``out``).
_PLANS = _plans.Plans()


def _tensor_key(q):
    """What a plan depends on of a QuantizedTensor argument (unhashable for anything else)."""
    if type(q) is not QuantizedTensor:
        return [q]
    k = _validate.array_key
    return q.scheme, q.shape, k(q.data), k(q.scale), k(q.zero_point)


def _run(key, make_layout, arrays: build.Arrays, named) -> cupy.ndarray:
    """One call: its plan (made by ``make_layout()`` at its first signature, which checks every
    argument; then the GPU's capability and the kernel's launch), the overlap check of ``out``
    (``named()``: the call's arrays, by name, the output last), the operands and the launch."""
    entry = _PLANS.lookup(key)
    if entry is None:
        L = make_layout()
        dispatch.check_arch(L.device, L.a_format == "int8")
        with _validate.on_device_of(arrays.a):
            launch = dispatch.plan(L) if L.M and L.N else None
        n = named()
        entry = _PLANS.keep(key, (L, launch, _validate.Disjoint(n, len(n) - 1)))
    L, launch, disjoint = entry
    if arrays.out is not None:
        disjoint.check(tuple(0 if x is None else x.data.ptr for _, x in named()))
    with _validate.on_device_of(arrays.a):
        ops = build.operands(L, arrays)
        if launch is not None:
            launch(ops)
    return ops.result


def scaled_matmul(a, b, *, out_dtype="bfloat16", bias=None, out=None) -> cupy.ndarray:
    """``dequant(a) @ dequant(b).T (+ bias)`` on the FP8 or INT8 tensor cores, from quantized
    activations and weights.

    Parameters
    ----------
    a : QuantizedTensor
        FP8 activations ``[..., K]`` (``float8_e4m3fn`` or ``float8_e5m2``): per tensor
        (:func:`quantize_fp8`), per token (:func:`quantize_groupwise` with ``group_size=None``) or
        in groups of 128 along K (``group_size=128``; float32 scales in the ``"row"`` or ``"col"``
        layout, or packed UE8M0 words). Or INT8 activations with float32 scales, symmetric or with
        int32 zero points (``x ~ (q - z) * s``): per token (``quantize_groupwise(x, "int8",
        group_size=None, symmetric=...)``) or per tensor (:func:`quantize_int8`). The leading axes
        are flattened into rows.
    b : QuantizedWeight or QuantizedTensor
        With INT8 activations, INT8 weights ``(N, K)``: a :class:`QuantizedWeight` per output channel
        (``quantize_weight(w, "int8", group_size=None)``, whose ``code_sum`` removes a's zero points),
        or a symmetric INT8 :class:`QuantizedTensor` ``(N, K)`` per tensor or per token (its code sums
        are computed on every call that needs them). With FP8 activations,
        the weight ``(N, K)``, ``float8_e4m3fn``: a :class:`QuantizedWeight` per output channel
        (``quantize_weight(w, "float8_e4m3fn", group_size=None)``), in groups of 128 along K
        (``group_size=128``) or in 128 x 128 blocks (float32 scales ``(ceil(N / 128),
        ceil(K / 128))``); or a :class:`QuantizedTensor` ``(N, K)`` quantized per tensor, per token
        (one scale per output channel) or in groups of 128. 16-bit weight scales are converted to
        float32 once per weight (kept with it: after writing into ``b.scale`` in place, assign a
        new array to ``b.scale``); a prepared weight is converted to the plain layout on every
        call (a copy of the weight); packed UE8M0 scales of a QuantizedTensor ``b`` are expanded on
        every call.
    out_dtype : {"bfloat16", "float16", "float32"}
        The result's dtype (a name, NumPy dtype or type).
    bias : cupy.ndarray, optional
        ``(N,)`` in ``out_dtype``, added before the rounding.
    out : cupy.ndarray, optional
        ``[..., N]`` in ``out_dtype`` on a's device, its last axis contiguous and its leading axes
        collapsing into one row stride; not overlapping any input.

    Returns
    -------
    cupy.ndarray
        ``[..., N]`` in ``out_dtype`` (``out`` itself when given).

    Raises
    ------
    TypeError
        ``a``/``b`` of another type, their arrays not CuPy arrays, a bad ``out_dtype``, ``bias``/
        ``out`` of the wrong dtype.
    ValueError
        A format other than FP8 (``b``: E4M3) or INT8, FP8 with INT8, a scaling the kernels do not
        take (groups other than 128; INT8 scales that vary along K), K different on the two sides or
        not a positive multiple of 16, scales or zero points of the wrong shape, ``bias``/``out`` of
        the wrong shape, on another device, or ``out`` overlapping an input or with a strided last
        axis.
    cupyquant.UnsupportedGPUError
        The GPU has no FP8 tensor cores (compute capability below 8.9), or for INT8 operands none
        (below 8.0); raised before anything is allocated.

    Notes
    -----
    INT8: the sum is exact. ``acc = sum_k qa(m, k) * qb(n, k)`` in int32; with zero points ``I =
    acc - z(m) * c(n)``, ``c(n) = sum_k qb(n, k)`` (vLLM's ``azp_adj``), in int32 arithmetic that
    wraps, so ``I`` is exact whenever the true ``sum_k (qa - z) * qb`` lies in the int32 range:
    always for ``K <= 131071`` without zero points (``|qa * qb| <= 128 * 128``), and with them where
    ``|qa - z| <= 255`` (a row whose range holds 0) for ``K <= 65793``; ``v = float32(I) * (sa(m) *
    sb(n))`` (each step rounded to nearest even) and ``y = round(v + bias)``.
    ``y`` equals :func:`cupyquant.reference.scaled_mm_int8` bit for bit, whatever the K split.

    FP8: K is cut into blocks of 128. Per output element, ``P(kb)`` is the tensor cores' float32 sum of
    the exact code products of block ``kb``. Where neither scale varies along K, ``acc = P(0) +
    P(1) + ...`` (float32) and ``v = acc * (sa(m) * sb(n))``; where one does, ``acc =
    fma(P(kb), sa(m, kb) * sb(n, kb), acc)`` in block order and ``v = acc``; a K split adds its
    parts' ``v`` in part order. ``y = round(v + bias)`` to nearest even in ``out_dtype``.

    Error bound, element-wise: ``|y - ref| <= 2^-9 * S + half an ulp of out_dtype at |ref|`` (plus
    a float32 ulp for float32 outputs), with ``S = sum_k |dequant(a)[m, k] * dequant(b)[n, k]| +
    |bias(n)| * 2^-24`` and ``ref`` the float64 value of ``dequant(a) @ dequant(b).T + bias``
    (:func:`cupyquant.reference.scaled_mm`, :func:`cupyquant.reference.error_bound`). The 2^-9
    covers the Hopper FP8 tensor cores' ~14-bit internal sums within a block. Codes and scales
    whose partial sums are exact give the reference's rounding exactly.

    Operands whose rows are not 16-byte aligned (start or row stride) are copied first. The call
    runs on CuPy's current stream, does not synchronize the host, and can be captured in a CUDA
    graph once its kernels are compiled.

    On compute capability 9.0 the kernels are launched with programmatic dependent launch (PDL): a
    kernel may start while the kernel before it on the stream ends, and waits for it before it reads
    anything. For at most 16 rows of ``a``, from the second call with the same QuantizedWeight
    object and arrays (captured calls do not count), the kernel also reads the weight's first codes
    before that wait (weights are constants): after writing into a weight's arrays in place, assign
    them to it anew (``b.data = b.data``) before its next call, or launch another kernel in between.
    """
    bkey = b._signature() if type(b) is QuantizedWeight else _tensor_key(b)
    key = ("matmul", _tensor_key(a), bkey, out_dtype, _validate.array_key(bias), _validate.array_key(out))
    key += (dispatch._FORCED,)
    if type(a) is not QuantizedTensor or type(b) not in (QuantizedWeight, QuantizedTensor):
        operands.for_matmul(a, b, out_dtype, bias, out)  # raises, naming the argument
    arrays = build.matmul_arrays(a, b, bias, out)

    def named():
        return (("a.data", a.data), ("a.scale", a.scale), ("b.data", b.data), ("b.scale", b.scale), ("bias", bias),
                ("out", out))  # fmt: skip

    return _run(key, lambda: operands.for_matmul(a, b, out_dtype, bias, out), arrays, named)


def scaled_mm(
    a: cupy.ndarray,
    b: cupy.ndarray,
    a_scale: cupy.ndarray,
    b_scale: cupy.ndarray,
    *,
    out_dtype="bfloat16",
    bias: cupy.ndarray | None = None,
    out: cupy.ndarray | None = None,
    a_format: str | type | np.dtype = "float8_e4m3fn",
    b_format: str | type | np.dtype = "float8_e4m3fn",
) -> cupy.ndarray:
    """``(a * a_scale) @ (b * b_scale).T (+ bias)`` from raw FP8 or INT8 codes and scales, the
    scaling inferred from the scales' shapes.

    vLLM's ``cutlass_scaled_mm`` convention, with ``b`` given ``(N, K)`` row-major (vLLM's
    ``b.t()``).

    Parameters
    ----------
    a : cupy.ndarray
        uint8 ``(M, K)``, FP8 codes in ``a_format``; or int8 ``(M, K)``, INT8 codes (``b`` int8
        too; ``a_scale`` per tensor or per token, ``b_scale`` per tensor or per channel). Last axis
        contiguous.
    b : cupy.ndarray
        uint8 ``(N, K)``, FP8 codes in ``b_format``; or int8 ``(N, K)``; last axis contiguous.
    a_scale : cupy.ndarray
        Decode scales of ``a``: one float32 element (per tensor); float32 ``(M,)`` or ``(M, 1)``
        (per token); float32 ``(M, ceil(K / 128))`` (1 x 128 groups, any strides: row- or
        column-major); int32 ``(M, ceil(ceil(K / 128) / 4))`` (1 x 128 groups, UE8M0 bytes packed
        four per word, group ``4p + j`` in byte j of word p).
    b_scale : cupy.ndarray
        float32 decode scales of ``b``: one element (per tensor); ``(N,)`` or ``(N, 1)`` (per
        channel); ``(ceil(N / 128), ceil(K / 128))`` (128 x 128 blocks); ``(N, ceil(K / 128))``
        (1 x 128 groups). Where two rows give the same shape they mean the same scaling.
    out_dtype : {"bfloat16", "float16", "float32"}
    bias : cupy.ndarray, optional
        ``(N,)`` in ``out_dtype``.
    out : cupy.ndarray, optional
        ``(M, N)`` in ``out_dtype``, last axis contiguous, not overlapping any input.
    a_format, b_format : {"float8_e4m3fn", "float8_e5m2"}
        The FP8 formats of uint8 codes (ignored for int8 codes).

    Returns
    -------
    cupy.ndarray
        ``(M, N)`` in ``out_dtype`` (``out`` itself when given).

    Raises
    ------
    TypeError
        Arguments that are not CuPy arrays, codes that are not uint8 or int8, scales of another
        dtype, a bad ``out_dtype``, ``bias``/``out`` of the wrong dtype.
    ValueError
        ``a``/``b`` not 2-D, one int8 and the other not, K different on the two sides or not a
        positive multiple of 16, a scale shape that fits no row of the table above (for INT8: a
        scale that varies along K), a format that is not FP8, ``bias``/``out`` of the wrong shape or
        device, ``out`` overlapping an input.
    cupyquant.UnsupportedGPUError
        The GPU has no FP8 tensor cores (compute capability below 8.9), or for INT8 codes none
        (below 8.0).

    Notes
    -----
    The formulas and the error bound are :func:`scaled_matmul`'s.
    """
    k = _validate.array_key
    key = ("mm", k(a), k(b), k(a_scale), k(b_scale), out_dtype, k(bias), k(out), a_format, b_format)
    key += (dispatch._FORCED,)
    arrays = build.mm_arrays(a, b, a_scale, b_scale, bias, out)
    return _run(
        key,
        lambda: operands.for_mm(a, b, a_scale, b_scale, out_dtype, bias, out, a_format, b_format),
        arrays,
        lambda: (("a", a), ("b", b), ("a_scale", a_scale), ("b_scale", b_scale), ("bias", bias), ("out", out)),
    )


def scaled_mm_azp(
    a: cupy.ndarray,
    b: cupy.ndarray,
    a_scale: cupy.ndarray,
    b_scale: cupy.ndarray,
    azp_adj: cupy.ndarray,
    *,
    azp: cupy.ndarray | None = None,
    out_dtype="bfloat16",
    bias: cupy.ndarray | None = None,
    out: cupy.ndarray | None = None,
) -> cupy.ndarray:
    """``(a - azp) * a_scale @ (b * b_scale).T (+ bias)`` from raw INT8 codes with activation zero
    points: vLLM's ``cutlass_scaled_mm_azp`` convention, with ``b`` given ``(N, K)`` row-major.

    Parameters
    ----------
    a : cupy.ndarray
        int8 ``(M, K)``, the activations' codes ``q = rne(x / s) + z``; last axis contiguous.
    b : cupy.ndarray
        int8 ``(N, K)``, the weight's codes; last axis contiguous.
    a_scale : cupy.ndarray
        float32: one element (per tensor) or ``(M,)`` / ``(M, 1)`` (per token).
    b_scale : cupy.ndarray
        float32: one element (per tensor) or ``(N,)`` / ``(N, 1)`` (per channel).
    azp_adj : cupy.ndarray
        int32 ``(N,)``, C-contiguous. With ``azp``: the weight's code sums ``sum_k b[n, k]``; without:
        those sums times the per-tensor zero point (vLLM precomputes it so).
    azp : cupy.ndarray, optional
        int32 ``(M,)`` (or ``(M, 1)``), one zero point per token.
    out_dtype, bias, out
        As for :func:`scaled_mm`.

    Returns
    -------
    cupy.ndarray
        ``(M, N)`` in ``out_dtype`` (``out`` itself when given).

    Raises
    ------
    TypeError, ValueError, cupyquant.UnsupportedGPUError
        As for :func:`scaled_mm`; also ``azp_adj``/``azp`` not int32, of the wrong shape or device,
        and codes that are not int8.

    Notes
    -----
    ``I = acc - azp(m) * azp_adj(n)`` (``acc - azp_adj(n)`` without ``azp``) in int32 arithmetic,
    then the scaling and rounding of :func:`scaled_matmul`'s INT8 formula. vLLM applies the scales
    as ``fma(sa, sb * float(I), bias)``; this rounds ``float(I) * (sa * sb)`` and then ``+ bias``, the
    same epilogue as the FP8 path (both within one float32 rounding of each other).
    """
    k = _validate.array_key
    key = ("azp", k(a), k(b), k(a_scale), k(b_scale), k(azp_adj), k(azp), out_dtype, k(bias), k(out))
    key += (dispatch._FORCED,)

    def layout():
        for x, arg in ((a, "a"), (b, "b")):
            _validate.cupy_array(x, arg)
            if x.dtype != np.int8:
                raise TypeError(f"{arg} must hold INT8 codes as int8, got {x.dtype}")
        if azp_adj is None:
            raise TypeError("azp_adj must be an int32 CuPy array (N,), got None; without zero points use scaled_mm")
        return operands.for_mm(a, b, a_scale, b_scale, out_dtype, bias, out, "float8_e4m3fn", "float8_e4m3fn",
                               azp_adj=azp_adj, azp=azp)  # fmt: skip

    if type(a) is not cupy.ndarray or azp_adj is None:
        layout()  # raises, naming the argument
    arrays = build.mm_arrays(a, b, a_scale, b_scale, bias, out, azp_adj=azp_adj, azp=azp)
    names = ("a", "b", "a_scale", "b_scale", "azp_adj", "azp", "bias", "out")
    return _run(key, layout, arrays, lambda: tuple(zip(names, (a, b, a_scale, b_scale, azp_adj, azp, bias, out))))
