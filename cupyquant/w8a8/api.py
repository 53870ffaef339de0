"""The W8A8 FP8 matmul: :func:`scaled_matmul` (quantized containers) and :func:`scaled_mm` (raw
codes and scales, vLLM's ``cutlass_scaled_mm`` convention with ``b`` given ``(N, K)``).

Kernels: ``kernels/scaled_mm_sm90.cu`` (wgmma, compute capability 9.0) and
``kernels/scaled_mm_mma.cu`` (mma.sync FP8, 8.9 and newer); ``kernels/scaled_mm.cuh`` states the
numerics they share. Reference: :func:`cupyquant.reference.scaled_mm`.
"""

from __future__ import annotations

import cupy
import numpy as np

from .. import _validate
from . import dispatch, operands


def _run(plan: operands.Plan) -> cupy.ndarray:
    dispatch.check_arch(plan.device)
    with _validate.on_device_of(plan.a):
        ops = operands.build(plan)
        if ops.M and ops.N:
            dispatch.run(ops)
    return ops.result


def scaled_matmul(a, b, *, out_dtype="bfloat16", bias=None, out=None) -> cupy.ndarray:
    """``dequant(a) @ dequant(b).T (+ bias)`` on the FP8 tensor cores, from quantized activations
    and weights.

    Parameters
    ----------
    a : QuantizedTensor
        FP8 activations ``[..., K]`` (``float8_e4m3fn`` or ``float8_e5m2``): per tensor
        (:func:`quantize_fp8`), per token (:func:`quantize_groupwise` with ``group_size=None``) or
        in groups of 128 along K (``group_size=128``; float32 scales in the ``"row"`` or ``"col"``
        layout, or packed UE8M0 words). The leading axes are flattened into rows.
    b : QuantizedWeight or QuantizedTensor
        The weight ``(N, K)``, ``float8_e4m3fn``: a :class:`QuantizedWeight` per output channel
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
        A format other than FP8 (``b``: E4M3), a scaling the kernels do not take (groups other than
        128), K different on the two sides or not a positive multiple of 16, scales of the wrong
        shape, ``bias``/``out`` of the wrong shape, on another device, or ``out`` overlapping an
        input or with a strided last axis.
    cupyquant.w8a8.dispatch.UnsupportedGPUError
        The GPU has no FP8 tensor cores (compute capability below 8.9); raised before anything is
        allocated.

    Notes
    -----
    K is cut into blocks of 128. Per output element, ``P(kb)`` is the tensor cores' float32 sum of
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
    """
    return _run(operands.for_matmul(a, b, out_dtype, bias, out))


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
    """``(a * a_scale) @ (b * b_scale).T (+ bias)`` from raw FP8 codes and scales, the scaling
    inferred from the scales' shapes.

    vLLM's ``cutlass_scaled_mm`` convention, with ``b`` given ``(N, K)`` row-major (vLLM's
    ``b.t()``).

    Parameters
    ----------
    a : cupy.ndarray
        uint8 ``(M, K)``, FP8 codes in ``a_format``; last axis contiguous.
    b : cupy.ndarray
        uint8 ``(N, K)``, FP8 codes in ``b_format``; last axis contiguous.
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

    Returns
    -------
    cupy.ndarray
        ``(M, N)`` in ``out_dtype`` (``out`` itself when given).

    Raises
    ------
    TypeError
        Arguments that are not CuPy arrays, codes that are not uint8, scales of another dtype, a
        bad ``out_dtype``, ``bias``/``out`` of the wrong dtype.
    ValueError
        ``a``/``b`` not 2-D, K different on the two sides or not a positive multiple of 16, a scale
        shape that fits no row of the table above, a format that is not FP8, ``bias``/``out`` of
        the wrong shape or device, ``out`` overlapping an input.
    cupyquant.w8a8.dispatch.UnsupportedGPUError
        The GPU has no FP8 tensor cores (compute capability below 8.9).

    Notes
    -----
    The formula and the error bound are :func:`scaled_matmul`'s.
    """
    return _run(operands.for_mm(a, b, a_scale, b_scale, out_dtype, bias, out, a_format, b_format))
