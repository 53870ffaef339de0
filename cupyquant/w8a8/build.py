"""What one W8A8 call's launch reads, made from its arrays for the :class:`~.operands.Layout` of its
signature: copies of operands whose rows are not 16-byte aligned, float32 copies of scales the
kernels cannot read as stored (16-bit weight scales, made once per weight and kept with it;
packed UE8M0 words), a prepared weight made plain, b's code sums, the output."""

from __future__ import annotations

from typing import NamedTuple

import cupy
import numpy as np

from .. import _validate
from ..weight import layout as _weight_layout
from ..weight.container import QuantizedWeight
from .operands import Layout


class Arrays(NamedTuple):
    """A call's arrays: a's codes (``[..., K]``), scales and zero points, b's codes (None for a
    prepared weight), scales and the weight itself (None for raw codes), the column term (a code
    sum or vLLM's ``azp_adj``), the bias and the output buffer."""

    a: cupy.ndarray
    sa: cupy.ndarray
    azp: cupy.ndarray | None
    b: cupy.ndarray | None
    sb: cupy.ndarray
    weight: QuantizedWeight | None
    adj: cupy.ndarray | None
    bias: cupy.ndarray | None
    out: cupy.ndarray | None


def matmul_arrays(a, b, bias, out) -> Arrays:
    """The arrays of a :func:`cupyquant.scaled_matmul` call (checked by :func:`for_matmul`)."""
    if type(b) is QuantizedWeight:
        adj = b.code_sum if a.zero_point is not None else None
        return Arrays(a.data, a.scale, a.zero_point, b.data, b.scale, b, adj, bias, out)
    return Arrays(a.data, a.scale, a.zero_point, b.data, b.scale, None, None, bias, out)


def mm_arrays(a, b, a_scale, b_scale, bias, out, azp_adj=None, azp=None) -> Arrays:
    """The arrays of a :func:`cupyquant.scaled_mm` / :func:`cupyquant.scaled_mm_azp` call."""
    return Arrays(a, a_scale, azp, b, b_scale, None, azp_adj, bias, out)


def _e8m0_to_f32(words: cupy.ndarray, n: int, keep: list) -> cupy.ndarray:
    """Packed UE8M0 words ``(..., n_words)`` (any strides) -> float32 ``(..., n)``, C order:
    ``2^(e - 127)`` built from bits (e = 0 gives the subnormal 2^-127, 255 NaN), no arithmetic."""
    shifts = cupy.arange(0, 32, 8, dtype=np.int32)
    e = (words[..., :, None] >> shifts) & 255
    e = e.reshape(words.shape[:-1] + (4 * words.shape[-1],))[..., :n]
    bits = cupy.where(e == 0, np.int32(0x00400000), cupy.where(e == 255, np.int32(0x7FFFFFFF), e << 23))
    f = cupy.ascontiguousarray(bits.astype(np.int32)).view(np.float32)
    keep.extend((shifts, e, bits, f))
    return f


def _to_f32(sc: cupy.ndarray, how: str, keep: list) -> cupy.ndarray:
    """16-bit weight scales -> float32, C order (exact)."""
    if how == "bits16":  # bfloat16: its bits are the top half of the float32's
        f = (cupy.ascontiguousarray(sc).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        f = sc.astype(np.float32, order="C")
    keep.append(f)
    return f


def _weight_scale_f32(w: QuantizedWeight, sc: cupy.ndarray, how: str, keep: list) -> cupy.ndarray:
    """The float32 copy of a weight's 16-bit scales, made once per weight and kept on it (its
    ``_f32_scale``, which assigning a new ``scale`` drops). Not kept when made while a CUDA graph is
    being captured (the copy would be filled only when the graph is replayed). A later call on
    another stream waits for the copy (an event) until it has completed."""
    stream = cupy.cuda.get_current_stream()
    cached = w._f32_scale
    if cached is not None:
        event, made_on, f = cached
        if event is not None:
            if event.done:
                w._f32_scale = (None, made_on, f)
            elif made_on != stream.ptr:
                stream.wait_event(event)
        return f
    if stream.is_capturing():
        return _to_f32(sc, how, keep)
    f = _to_f32(sc, how, [])
    event = cupy.cuda.Event(disable_timing=True)
    event.record(stream)
    w._f32_scale = (event, stream.ptr, f)
    return f


class Operands(NamedTuple):
    """What one launch reads: a's and b's codes (the (M, K) and (N, K) matrices, rows ``Layout.lda``
    / ``ldb`` bytes apart, or 16-byte aligned copies with rows ``K`` bytes apart), the scale arrays
    as the kernels address them, the zero points and column term (None where absent), the bias, the
    (M, N) output's address and row stride (elements), what the call returns (``[..., N]``), and the
    weight whose codes ``b`` is, as the caller holds it (None for raw codes or for codes made in
    this call: the kernel for few rows may read a held weight's codes before its PDL wait)."""

    a: cupy.ndarray
    lda: int
    b: cupy.ndarray
    ldb: int
    sa: cupy.ndarray
    sb: cupy.ndarray
    azp: cupy.ndarray | None
    adj: cupy.ndarray | None
    bias: cupy.ndarray | None
    out2: int
    ldy: int
    result: cupy.ndarray
    weight: QuantizedWeight | None = None


def _copy_rows(x: cupy.ndarray, rows: int, K: int, ld: int, keep: list) -> cupy.ndarray:
    """A contiguous copy (a fresh, aligned allocation) of the (rows, K) 8-bit matrix at x's data
    pointer with rows ``ld`` bytes apart."""
    view = cupy.ndarray((rows, K), dtype=x.dtype, memptr=x.data, strides=(ld, 1))
    y = cupy.empty((rows, K), dtype=x.dtype)
    y[...] = view
    keep.append(y)
    return y


def operands(L: Layout, arr: Arrays) -> Operands:
    """Make what the launch of ``L`` needs from a call's arrays (call on ``L.device``, after the
    architecture check)."""
    if L.simple:
        sb = arr.sb
        if L.sb_convert is not None:
            made: list = []
            sb = _weight_scale_f32(arr.weight, sb, L.sb_convert, made)
            if made:  # converted for a call being captured: kept with the graph
                _validate.keep_if_capturing(*made)
        if arr.out is None:
            result = cupy.empty(L.lead + (L.N,), dtype=L.out_dtype)
            return Operands(
                arr.a,
                L.lda,
                arr.b,
                L.ldb,
                arr.sa,
                sb,
                arr.azp,
                arr.adj,
                arr.bias,
                result.data.ptr,
                L.N,
                result,
                arr.weight,
            )
        out = arr.out
        return Operands(
            arr.a, L.lda, arr.b, L.ldb, arr.sa, sb, arr.azp, arr.adj, arr.bias, out.data.ptr, L.ldy, out, arr.weight
        )
    keep: list = []
    a, lda = arr.a, L.lda
    if L.copy_a:
        a, lda = _copy_rows(a, L.M, L.K, lda, keep), L.K
    sa = arr.sa
    if L.sa_unpack:
        sa = _e8m0_to_f32(sa, 1, keep)
    b, ldb, sb = arr.b, L.ldb, arr.sb
    if L.b_plain:
        w = _weight_layout.plain_of(arr.weight)
        keep += [w.data, w.scale]
        b, ldb, sb = w.data, L.K, w.scale
        sb = cupy.ascontiguousarray(sb) if sb.dtype == np.float32 else _to_f32(sb, L.sb_convert, keep)
    elif L.sb_convert == "e8m0":
        sb = _e8m0_to_f32(sb, L.sb_n if L.sb_k else 1, keep)
    elif L.sb_convert is not None:
        sb = _weight_scale_f32(arr.weight, sb, L.sb_convert, keep)
    if L.copy_b:
        b, ldb = _copy_rows(b, L.N, L.K, ldb, keep), L.K
    adj = arr.adj
    if L.adj == "sum":  # b's code sums (a QuantizedTensor weight, or a weight made without them)
        bm = (
            b
            if ldb == L.K and b.ndim == 2
            else cupy.ndarray((L.N, L.K), dtype=b.dtype, memptr=b.data, strides=(ldb, 1))
        )
        adj = bm.sum(axis=1, dtype=np.int32)
        keep.append(adj)
    if arr.out is None:
        result = cupy.empty(L.lead + (L.N,), dtype=L.out_dtype)
        ldy = L.N
    else:
        result, ldy = arr.out, L.ldy
    if keep:
        _validate.keep_if_capturing(*keep)
    held = None if L.copy_b or L.b_plain else arr.weight
    return Operands(a, lda, b, ldb, sa, sb, arr.azp, adj, arr.bias, result.data.ptr, ldy, result, held)
