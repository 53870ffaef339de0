"""The W8A8 matmul's arguments checked: ``for_matmul`` / ``for_mm`` check everything and derive
the kernels' view of a call, a :class:`Layout` (shapes, strides, formats, the scale addressing,
and what each call must convert), which depends only on the arguments' shapes, strides, dtypes,
alignments and schemes, so that a call keyed on those reuses it. :mod:`.build` then makes, for
each call, what the launch needs from that call's arrays.

Scale addressing (kernels/scaled_mm.cuh): a's scale of row m and 128-k block kb is word
``(m / sa_rows) * sa_batch + (m % sa_rows) * sa_m + kb * sa_k`` (or byte ``kb % 4`` of the word at
``(kb / 4) * sa_k`` when packed UE8M0); b's is ``sb[(n >> sb_shift) * sb_n + kb * sb_k]``; an INT8
a's zero point is word ``(m / zp_rows) * zp_batch + (m % zp_rows) * zp_m``. The
pure functions here (:func:`~cupyquant._scales.group_scale_addressing`, :func:`infer_a_scale`,
:func:`infer_b_scale`, :func:`mode_of`) work on shapes and strides only, so they are tested
without a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cupy
import numpy as np

from .. import _dtypes, _scales, _validate
from .._sizes import ceil_div
from ..quantized import QuantizedTensor
from ..weight.container import QuantizedWeight, check_weight
from .args import BLOCK_K, MODE_END, MODE_K_COL, MODE_K_TILE

#: K must be a multiple of this: TMA boxes and the 16-byte rows of the 8-bit operands
K_MULTIPLE = 16
#: rows of operands are copied unless their start and stride are multiples of this (bytes)
ROW_ALIGN = 16
OUT_DTYPES = ("bfloat16", "float16", "float32")
_E4M3 = "float8_e4m3fn"
_INT8 = "int8"
#: what a's scales may be for INT8 operands (the integer sum runs over all of K: no scale varies along it)
_INT8_A_SCALES = ("tensor", "token")


# ------------------------------------------------------------------ shape and stride rules (no GPU)
def mode_of(sa_k: int, sb_n: int, sb_k: int, sb_shift: int) -> int:
    """The kernels' MmMode: MODE_END where no scale varies along K; MODE_K_TILE where one does and
    b's scale is the same across a tile's columns (per tensor, or 128 x 128 blocks); else MODE_K_COL."""
    if sa_k == 0 and sb_k == 0:
        return MODE_END
    if sb_n == 0 or sb_shift >= 7:
        return MODE_K_TILE
    return MODE_K_COL


def n_blocks(K: int) -> int:
    """128-k blocks of a K axis (the last one shorter where 128 does not divide K)."""
    return ceil_div(K, BLOCK_K)


def a_scale_addressing(lead: tuple, scale_shape: tuple, scale_strides: tuple, per_token: bool, arg="a.scale") -> tuple:
    """``(sa_rows, sa_batch, sa_m, sa_k)`` in 4-byte words of a token or group scale array
    (:func:`cupyquant._scales.group_scale_addressing`)."""
    return _scales.group_scale_addressing(lead, scale_shape, scale_strides, per_token, arg)


def infer_a_scale(shape: tuple, dtype, M: int, K: int) -> str:
    """What a raw ``a_scale`` of ``shape``/``dtype`` means for an (M, K) ``a`` (scaled_mm's table):
    ``"tensor"`` (one float32 element), ``"token"`` ((M,) or (M, 1) float32), ``"group"`` (float32
    (M, ceil(K / 128))) or ``"packed"`` (int32 (M, ceil(ceil(K / 128) / 4)), UE8M0 bytes)."""
    shape, dtype, nkb = tuple(shape), np.dtype(dtype), n_blocks(K)
    if dtype == np.int32:
        want = (M, ceil_div(nkb, 4))
        if shape == want:
            return "packed"
        raise ValueError(f"a_scale: int32 scales are packed UE8M0 words and must have shape {want}, got {shape}")
    if dtype != np.float32:
        raise TypeError(f"a_scale must be float32 (or int32 packed UE8M0 words), got {dtype}")
    if math.prod(shape) == 1 and len(shape) <= 2:
        return "tensor"
    if shape in ((M,), (M, 1)):
        return "token"
    if shape == (M, nkb):
        return "group"
    raise ValueError(
        f"a_scale of shape {shape} fits none of: 1 element (per tensor), ({M},) or ({M}, 1) (per token), "
        f"({M}, {nkb}) (1 x 128 groups) for a of shape ({M}, {K})"
    )


def infer_b_scale(shape: tuple, dtype, N: int, K: int) -> str:
    """What a raw ``b_scale`` of ``shape`` means for an (N, K) ``b`` (scaled_mm's table):
    ``"tensor"``, ``"channel"`` ((N,) or (N, 1)), ``"block"`` ((ceil(N / 128), ceil(K / 128)))
    or ``"group"`` ((N, ceil(K / 128))); where two rows give the same shape they mean the same
    scaling."""
    shape, dtype, nkb = tuple(shape), np.dtype(dtype), n_blocks(K)
    if dtype != np.float32:
        raise TypeError(f"b_scale must be float32, got {dtype}")
    if math.prod(shape) == 1 and len(shape) <= 2:
        return "tensor"
    if shape in ((N,), (N, 1)):
        return "channel"
    if shape == (ceil_div(N, BLOCK_K), nkb):
        return "block"
    if shape == (N, nkb):
        return "group"
    raise ValueError(
        f"b_scale of shape {shape} fits none of: 1 element (per tensor), ({N},) or ({N}, 1) (per channel), "
        f"({ceil_div(N, BLOCK_K)}, {nkb}) (128 x 128 blocks), ({N}, {nkb}) (1 x 128 groups) for b of shape ({N}, {K})"
    )


def b_scale_addressing(kind: str, scale_strides: tuple) -> tuple:
    """``(sb_n, sb_k, sb_shift)`` of a float32 b scale array of kind ``kind`` (infer_b_scale's
    names) with byte ``scale_strides``."""
    if kind == "tensor":
        return 0, 0, 0
    words = _scales.word_strides(scale_strides, 4, "b_scale")
    if kind == "channel":
        return words[0], 0, 0
    return words[0], words[1], 7 if kind == "block" else 0


# ------------------------------------------------------------------ the validated call
@dataclass(frozen=True)
class Layout:
    """A validated call as the kernels read it, without its arrays: the (M, K) and (N, K) operands
    (rows ``lda`` / ``ldb`` bytes apart, or copied where ``copy_a`` / ``copy_b``: their start or
    row stride is not 16-byte aligned), the scale addressing and what :func:`.build.operands` makes at
    each call (``sa_unpack``: packed per-token UE8M0 words to expand into float32; ``sb_convert``:
    ``"bits16"`` (bfloat16), ``"half"`` or ``"e8m0"`` to turn into float32; ``b_plain``: a
    prepared weight to convert; INT8 with zero points: ``azp`` (a's zero points given; without
    them and with ``adj``, z = 1) and their addressing, ``adj`` ``"array"`` (the int32 (N,) column
    term given) or ``"sum"`` (b's code sums, made by build)), the output (``ldy`` elements between
    rows of a given ``out``, 0 for a new one)."""

    a_format: str
    b_format: str
    M: int
    N: int
    K: int
    lda: int
    ldb: int
    copy_a: bool
    copy_b: bool
    sa_rows: int
    sa_batch: int
    sa_m: int
    sa_k: int
    sa_packed: bool
    sa_unpack: bool
    sb_n: int
    sb_k: int
    sb_shift: int
    sb_convert: str | None
    b_plain: bool
    azp: bool
    zp_rows: int
    zp_batch: int
    zp_m: int
    adj: str | None
    bias: bool
    out_dtype: np.dtype
    lead: tuple
    ldy: int
    device: int
    simple: bool  # nothing to copy, expand or sum at a call (16-bit weight scales are cached)

    @property
    def mode(self) -> int:
        """The kernels' MmMode (after the per-call conversions, which leave the K-addressing as it is)."""
        sa_k = 0 if self.sa_unpack else self.sa_k
        return mode_of(sa_k, self.sb_n, self.sb_k, self.sb_shift)


def out_dtype_of(out_dtype) -> np.dtype:
    """bfloat16, float16 or float32, given by name, NumPy dtype or type."""
    return _dtypes.input_type(out_dtype, "out_dtype").dtype


def check_k(K: int, Kb: int, a_arg: str = "a", b_arg: str = "b") -> None:
    if K != Kb:
        raise ValueError(f"{a_arg} and {b_arg} must have the same K (last axis): {K} != {Kb}")
    if K <= 0 or K % K_MULTIPLE:
        raise ValueError(
            f"{a_arg}'s K = {K} (the last axis of {a_arg} and {b_arg}) must be a positive multiple of {K_MULTIPLE}: "
            "the 8-bit tensor-core operands and the TMA copies "
            f"read rows of 16-byte pieces (pad K with zero codes to a multiple of {K_MULTIPLE})"
        )


def _matrix(data: cupy.ndarray, arg: str, fmt: str = _E4M3) -> cupy.ndarray:
    """The (rows, K) view of the codes ``data`` (``[..., K]``, contiguous last axis, leading axes
    that collapse into one row stride): uint8 for FP8 ``fmt``, int8 for ``"int8"``."""
    _validate.cupy_array(data, arg)
    dtype = np.dtype(np.int8 if fmt == _INT8 else np.uint8)
    if data.dtype != dtype:
        what = "INT8 codes as int8" if fmt == _INT8 else "FP8 codes as uint8"
        raise TypeError(f"{arg} must hold {what}, got {data.dtype}")
    rows, K, row_stride = _validate.rows_view(data, arg)
    return cupy.ndarray((rows, K), dtype=dtype, memptr=data.data, strides=(row_stride, 1))


def _fp8(name, arg: str, allowed=_dtypes.FP8_NAMES) -> str:
    return _dtypes.element_format(name, arg, allowed=allowed).name


def _int8_zero_point(zp, scale, lead: tuple, granularity: str, device: int, arg: str) -> dict:
    """The addressing of an INT8 activation's int32 zero points ``zp`` (per token: the shape and
    strides of ``scale``; per tensor: one element)."""
    _validate.cupy_array(zp, arg)
    _validate.same_device(zp, arg, device, "a.data")
    if zp.dtype != np.int32:
        raise TypeError(f"{arg} must be int32, got {zp.dtype}")
    if granularity == "tensor":
        if zp.size != 1:
            raise ValueError(f"{arg} must have one element for a per-tensor a, got shape {zp.shape}")
        return {"azp": zp, "zp_rows": 1, "zp_batch": 0, "zp_m": 0}
    if tuple(zp.shape) != tuple(scale.shape):
        raise ValueError(f"{arg} must have a.scale's shape {tuple(scale.shape)}, got {tuple(zp.shape)}")
    rows, batch, zp_m, _ = a_scale_addressing(lead, tuple(zp.shape), tuple(zp.strides), True)
    return {"azp": zp, "zp_rows": rows, "zp_batch": batch, "zp_m": zp_m}


_NO_ZP = {"azp": None, "zp_rows": 1, "zp_batch": 0, "zp_m": 0, "adj": None}


def _a_of_tensor(a) -> dict:
    if not isinstance(a, QuantizedTensor):
        raise TypeError(
            f"a must be a cupyquant.QuantizedTensor of FP8 or INT8 activations (quantize_fp8, quantize_groupwise, "
            f"quantize_int8), got {type(a).__name__}; raw arrays go to cupyquant.scaled_mm"
        )
    fmt = _fp8(a.scheme.format, "a.scheme.format", allowed=_dtypes.FP8_NAMES + (_INT8,))
    _validate.cupy_array(a.data, "a.data")
    if tuple(a.data.shape) != tuple(a.shape) or not a.shape:
        raise ValueError(f"a.data must have a's shape {a.shape} (at least 1-D), got {a.data.shape}")
    mat = _matrix(a.data, "a.data", fmt)
    lead, K = tuple(a.shape[:-1]), a.shape[-1]
    device = a.data.data.device_id
    s, sc = a.scheme, a.scale
    _validate.cupy_array(sc, "a.scale")
    _validate.same_device(sc, "a.scale", device, "a.data")
    out = {"a": mat, "a_format": fmt, "sa": sc, "sa_packed": False, "sa_unpack": False, "lead": lead}
    g = s.granularity
    zp = getattr(a, "zero_point", None)
    if fmt == _INT8:
        if g not in _INT8_A_SCALES:
            raise ValueError(
                f"a.scheme.granularity={g!r}: INT8 activations must be quantized per tensor (quantize_int8) or per "
                "token (quantize_groupwise(x, 'int8', group_size=None))"
            )
        if s.scale_dtype != "float32":
            raise ValueError(f"a.scheme.scale_dtype={s.scale_dtype!r}: INT8 activations need float32 scales")
        out.update(_NO_ZP if zp is None else _int8_zero_point(zp, sc, lead, g, device, "a.zero_point"))
    elif zp is not None:
        raise ValueError("a.zero_point must be None for FP8 activations")
    else:
        out.update(_NO_ZP)
    if g == "tensor":
        if sc.dtype != np.float32 or sc.size != 1:
            raise ValueError(f"a.scale must be float32 of one element for a per-tensor a, got {sc.dtype} {sc.shape}")
        return dict(out, sa_rows=1, sa_batch=0, sa_m=0, sa_k=0)
    if g not in ("token", "group"):
        raise ValueError(
            f"a.scheme.granularity={g!r} is not supported: a must be quantized per tensor (quantize_fp8), "
            "per token or in groups of 128 (quantize_groupwise)"
        )
    if g == "group" and tuple(s.block or ()) != (BLOCK_K,):
        raise ValueError(
            f"a.scheme.block={s.block}: activation scales that vary along K need groups of {BLOCK_K} "
            f"(the matmul's K block); quantize with group_size={BLOCK_K} or None (per token)"
        )
    if s.scale_layout not in ("row", "col"):
        raise ValueError(f"a.scheme.scale_layout={s.scale_layout!r}: expected 'row' or 'col'")
    packed = _dtypes.scale_dtype(s.scale_dtype, "a.scheme.scale_dtype", ("float32", "float8_e8m0fnu")) != "float32"
    ng = 1 if g == "token" else n_blocks(K)
    want_shape = lead + (ceil_div(ng, 4) if packed else ng,)
    want_dtype = np.dtype(np.int32 if packed else np.float32)
    if tuple(sc.shape) != want_shape or sc.dtype != want_dtype:
        raise ValueError(f"a.scale must be {want_dtype.name} of shape {want_shape}, got {sc.dtype} {sc.shape}")
    rows, batch, sa_m, sa_k = a_scale_addressing(lead, want_shape, tuple(sc.strides), g == "token")
    # the kernels take byte kb % 4 of a packed word: one UE8M0 byte per token is expanded to float32
    return dict(out, sa_rows=rows, sa_batch=batch, sa_m=sa_m, sa_k=sa_k, sa_packed=packed and g == "group",
                sa_unpack=packed and g == "token")  # fmt: skip


def _b_of_weight(w: QuantizedWeight, device: int) -> dict:
    for name in ("data", "scale"):
        _validate.cupy_array(getattr(w, name), f"b.{name}")
        _validate.same_device(getattr(w, name), f"b.{name}", device, "a")
    s = w.scheme
    if s.format not in (_E4M3, _INT8) or w.zero_point is not None:
        raise ValueError(
            f"b must be an FP8 (float8_e4m3fn) or INT8 weight, got a {s.format} weight; INT4 weights go to "
            "cupyquant.matmul"
        )
    N, K = w.shape
    g = s.granularity
    if s.format == _INT8 and (g != "channel" or w.data_layout != "plain"):
        raise ValueError(
            f"b: an INT8 weight must be quantized per output channel in the plain layout "
            f"(quantize_weight(w, 'int8', group_size=None)), got granularity {g!r}, data_layout {w.data_layout!r}"
        )
    prepared = w.data_layout == "prepared"
    if prepared:
        if g == "block":
            raise ValueError(
                "b: a prepared weight of 128 x 128 blocks is the weight-only matmul's layout; pass the plain "
                "weight (b.plain())"
            )
        check_weight(w)  # the prepared shapes; build.operands converts it (plain_of)
        data = None
    else:
        data = _matrix(w.data, "b.data", s.format)
        if data.shape != (N, K):
            raise ValueError(f"b.data must be {data.dtype} of shape {(N, K)}, got {w.data.shape}")
    nkb = n_blocks(K)
    if g == "channel":
        want, kind = (N, 1), "channel"
    elif g == "group":
        if tuple(s.block) != (BLOCK_K,):
            raise ValueError(
                f"b.scheme.block={s.block}: weight scales that vary along K need groups of {BLOCK_K} "
                f"(the matmul's K block): quantize_weight(..., group_size={BLOCK_K}), None or block_size=(128, 128)"
            )
        want, kind = (N, nkb), "group"
    elif g == "block":
        if tuple(s.block) != (BLOCK_K, BLOCK_K):
            raise ValueError(f"b.scheme.block={s.block}: weight blocks must be (128, 128)")
        want, kind = (ceil_div(N, BLOCK_K), nkb), "block"
    else:
        raise ValueError(f"b.scheme.granularity={g!r} is not supported: expected 'channel', 'group' or 'block'")
    sc = w.scale
    if not prepared and tuple(sc.shape) != want:
        raise ValueError(f"b.scale must have shape {want} for a {g} weight of shape {(N, K)}, got {sc.shape}")
    convert = None
    if sc.dtype == np.float32:
        sb_n, sb_k, shift = b_scale_addressing(kind, tuple(sc.strides)) if not prepared else (0, 0, 0)
    elif sc.dtype in (np.dtype(np.float16), _dtypes.input_type("bfloat16").dtype) and kind != "block":
        convert = "half" if sc.dtype == np.float16 else "bits16"
        sb_n, sb_k, shift = b_scale_addressing(kind, (4 * want[1], 4))  # the float32 copy, C order
    else:
        raise TypeError(f"b.scale must be float32 (or the 16-bit dtype of a quantized weight), got {sc.dtype}")
    if prepared:
        sb_n, sb_k, shift = b_scale_addressing(kind, (4 * want[1], 4))
    return {"b": data, "b_format": s.format, "sb": sc, "sb_n": sb_n, "sb_k": sb_k, "sb_shift": shift,
            "sb_convert": convert, "weight": w, "b_plain": prepared, "N": N, "Kb": K}  # fmt: skip


def _b_of_tensor(b: QuantizedTensor, device: int) -> dict:
    fmt = _fp8(b.scheme.format, "b.scheme.format", allowed=(_E4M3, _INT8))
    _validate.cupy_array(b.data, "b.data")
    _validate.same_device(b.data, "b.data", device, "a")
    if len(b.shape) != 2 or tuple(b.data.shape) != tuple(b.shape):
        raise ValueError(f"b must be 2-D (N, K) with b.data of that shape, got shape {b.shape}, data {b.data.shape}")
    if getattr(b, "zero_point", None) is not None:
        raise ValueError("b.zero_point must be None: weights are symmetric")
    if fmt == _INT8 and b.scheme.granularity not in _INT8_A_SCALES:
        raise ValueError(
            f"b.scheme.granularity={b.scheme.granularity!r}: an INT8 QuantizedTensor weight must be quantized per "
            "tensor or per token (one scale per output channel)"
        )
    data = _matrix(b.data, "b.data", fmt)
    N, K = b.shape
    s, sc = b.scheme, b.scale
    _validate.cupy_array(sc, "b.scale")
    _validate.same_device(sc, "b.scale", device, "a")
    base = {"b": data, "b_format": fmt, "sb": sc, "sb_convert": None, "weight": None, "b_plain": False}
    base.update(N=N, Kb=K)
    g = s.granularity
    if g == "tensor":
        if sc.dtype != np.float32 or sc.size != 1:
            raise ValueError(f"b.scale must be float32 of one element for a per-tensor b, got {sc.dtype} {sc.shape}")
        return dict(base, sb_n=0, sb_k=0, sb_shift=0)
    if g not in ("token", "group") or g == "group" and tuple(s.block or ()) != (BLOCK_K,):
        raise ValueError(
            f"b: a QuantizedTensor weight must be quantized per tensor, per token (per channel) or in groups of "
            f"{BLOCK_K}, got granularity {g!r}, block {s.block}"
        )
    packed = _dtypes.scale_dtype(s.scale_dtype, "b.scheme.scale_dtype", ("float32", "float8_e8m0fnu")) != "float32"
    ng = 1 if g == "token" else n_blocks(K)
    want = (N, ceil_div(ng, 4) if packed else ng)
    want_dtype = np.dtype(np.int32 if packed else np.float32)
    if tuple(sc.shape) != want or sc.dtype != want_dtype:
        raise ValueError(f"b.scale must be {want_dtype.name} of shape {want}, got {sc.dtype} {sc.shape}")
    kind = "channel" if g == "token" else "group"
    if packed:  # the kernels read b's scales as float32: expanded by build.operands
        sb_n, sb_k, shift = b_scale_addressing(kind, (4 * ng, 4))
        return dict(base, sb_n=sb_n, sb_k=sb_k, sb_shift=shift, sb_convert="e8m0")
    sb_n, sb_k, shift = b_scale_addressing(kind, tuple(sc.strides))
    return dict(base, sb_n=sb_n, sb_k=sb_k, sb_shift=shift)


def _bias_and_out(bias, out, out_dtype, lead, N, device, inputs) -> tuple:
    if bias is not None:
        _validate.cupy_array(bias, "bias")
        if bias.shape != (N,):
            raise ValueError(f"bias must have shape ({N},), got {bias.shape}")
        if bias.dtype != out_dtype:
            raise TypeError(f"bias must have out_dtype {out_dtype.name}, got {bias.dtype}")
        _validate.c_contiguous(bias, "bias")
        _validate.same_device(bias, "bias", device, "a")
    if out is not None:
        _validate.cupy_array(out, "out")
        shape = lead + (N,)
        if tuple(out.shape) != shape:
            raise ValueError(f"out must have shape {shape}, got {tuple(out.shape)}")
        if out.dtype != out_dtype:
            raise TypeError(f"out must have dtype {out_dtype.name}, got {out.dtype}")
        _validate.same_device(out, "out", device, "a")
        _validate.rows_view(out, "out")
        _validate.disjoint(out, "out", tuple(inputs) + (("bias", bias),))
    return bias, out


def _layout(A: dict, B: dict, N: int, K: int, bias, out, od, device) -> Layout:
    """The Layout of a call from its checked pieces (the dicts of _a_of_tensor / _b_of_* and the
    raw checks, which hold the call's arrays too)."""
    a, b = A["a"], B.get("b")
    ldy = 0
    if out is not None:
        ldy = _validate.rows_view(out, "out")[2]
    return Layout(
        a_format=A["a_format"], b_format=B["b_format"], M=a.shape[0], N=N, K=K,
        lda=a.strides[0], ldb=0 if b is None else b.strides[0],
        copy_a=not _rows_aligned(a), copy_b=b is not None and not _rows_aligned(b),
        sa_rows=A["sa_rows"], sa_batch=A["sa_batch"], sa_m=A["sa_m"], sa_k=A["sa_k"], sa_packed=A["sa_packed"],
        sa_unpack=A["sa_unpack"], sb_n=B["sb_n"], sb_k=B["sb_k"], sb_shift=B["sb_shift"],
        sb_convert=B["sb_convert"], b_plain=B["b_plain"], azp=A["azp"] is not None, zp_rows=A["zp_rows"],
        zp_batch=A["zp_batch"], zp_m=A["zp_m"], adj=A["adj"] if A["adj"] is None or isinstance(A["adj"], str) else "array",
        bias=bias is not None, out_dtype=od, lead=A["lead"], ldy=ldy, device=device,
        simple=_rows_aligned(a) and (b is None or _rows_aligned(b)) and not A["sa_unpack"] and not B["b_plain"]
        and B["sb_convert"] in (None, "half", "bits16") and not isinstance(A["adj"], str),
    )  # fmt: skip


def _rows_aligned(x: cupy.ndarray) -> bool:
    """Whether the (rows, K) view ``x`` starts 16-byte aligned with rows a multiple of 16 bytes apart."""
    return x.data.ptr % ROW_ALIGN == 0 and (x.shape[0] <= 1 or x.strides[0] % ROW_ALIGN == 0)


def for_matmul(a, b, out_dtype, bias, out) -> Layout:
    """Validate :func:`cupyquant.scaled_matmul`'s arguments (nothing allocated or launched)."""
    A = _a_of_tensor(a)
    device = A["a"].data.device_id
    if isinstance(b, QuantizedWeight):
        B = _b_of_weight(b, device)
    elif isinstance(b, QuantizedTensor):
        B = _b_of_tensor(b, device)
    else:
        raise TypeError(
            f"b must be a cupyquant.QuantizedWeight (quantize_weight(w, 'float8_e4m3fn', ...)) or a QuantizedTensor "
            f"of FP8 weights, got {type(b).__name__}; raw arrays go to cupyquant.scaled_mm"
        )
    K = A["a"].shape[1]
    check_k(K, B.pop("Kb"))
    check_pair(A["a_format"], B["b_format"])
    if A["azp"] is not None:  # b's code sums: kept with an INT8 QuantizedWeight, else made by build.operands
        A["adj"] = getattr(b, "code_sum", None) if isinstance(b, QuantizedWeight) else None
        if A["adj"] is None:
            A["adj"] = "sum"
        else:
            _check_adj(A["adj"], B["N"], device, "b.code_sum")
    od = out_dtype_of(out_dtype)
    inputs = [("a.data", a.data), ("a.scale", a.scale), ("b.data", b.data), ("b.scale", b.scale)]
    bias, out = _bias_and_out(bias, out, od, A["lead"], B["N"], device, inputs)
    return _layout(A, B, B["N"], K, bias, out, od, device)


def check_pair(a_format: str, b_format: str, a_arg: str = "a", b_arg: str = "b") -> None:
    """FP8 with FP8 or INT8 with INT8."""
    if (a_format == _INT8) != (b_format == _INT8):
        raise ValueError(f"{a_arg} and {b_arg} must both be FP8 or both INT8, got {a_format} and {b_format}")


def _check_adj(adj, N: int, device: int, arg: str) -> None:
    _validate.cupy_array(adj, arg)
    if adj.dtype != np.int32:
        raise TypeError(f"{arg} must be int32, got {adj.dtype}")
    if adj.shape not in ((N,), (1, N), (N, 1)):
        raise ValueError(f"{arg} must have shape ({N},), got {adj.shape}")
    _validate.c_contiguous(adj, arg)
    _validate.same_device(adj, arg, device, "a")


def _raw_format(x, fmt, arg: str) -> str:
    """The format of raw codes ``x``: ``"int8"`` for int8 arrays, else the FP8 format named by ``fmt``."""
    if isinstance(x, cupy.ndarray) and x.dtype == np.int8:
        return _INT8
    return _fp8(fmt, f"{arg}_format")


def for_mm(a, b, a_scale, b_scale, out_dtype, bias, out, a_format, b_format, azp_adj=None, azp=None) -> Layout:
    """Validate :func:`cupyquant.scaled_mm`'s (and with ``azp_adj``, :func:`cupyquant.scaled_mm_azp`'s)
    arguments (nothing allocated or launched)."""
    af = _raw_format(a, a_format, "a")
    bf = _INT8 if af == _INT8 else _fp8(b_format, "b_format")  # int8 a takes int8 b (checked by _matrix)
    for x, arg in ((a, "a"), (b, "b"), (a_scale, "a_scale"), (b_scale, "b_scale")):
        _validate.cupy_array(x, arg)
        if arg in ("a", "b") and x.ndim != 2:
            raise ValueError(f"{arg} must be 2-D ({'M' if arg == 'a' else 'N'}, K), got shape {x.shape}")
    am, bm = _matrix(a, "a", af), _matrix(b, "b", bf)
    device = a.data.device_id
    for x, arg in ((b, "b"), (a_scale, "a_scale"), (b_scale, "b_scale")):
        _validate.same_device(x, arg, device, "a")
    (M, K), (N, Kb) = a.shape, b.shape
    check_k(K, Kb)
    ka = infer_a_scale(a_scale.shape, a_scale.dtype, M, K)
    kb = infer_b_scale(b_scale.shape, b_scale.dtype, N, K)
    zp = dict(_NO_ZP)
    if af == _INT8:
        for kind, allowed, arg, x in (
            (ka, _INT8_A_SCALES, "a_scale", a_scale),
            (kb, ("tensor", "channel"), "b_scale", b_scale),
        ):
            if kind not in allowed:
                raise ValueError(
                    f"{arg} of shape {tuple(x.shape)} scales {kind}: INT8 operands take a_scale per tensor or per token "
                    "and b_scale per tensor or per channel (the integer sum runs over all of K)"
                )
        if azp_adj is not None:
            _check_adj(azp_adj, N, device, "azp_adj")
            zp["adj"] = azp_adj
        if azp is not None:
            _validate.cupy_array(azp, "azp")
            if azp.dtype != np.int32:
                raise TypeError(f"azp must be int32, got {azp.dtype}")
            if tuple(azp.shape) not in ((M,), (M, 1)):
                raise ValueError(f"azp must have shape ({M},) (one zero point per token), got {tuple(azp.shape)}")
            _validate.same_device(azp, "azp", device, "a")
            zp.update(azp=azp, zp_rows=max(M, 1), zp_batch=0, zp_m=azp.strides[0] // 4)
    elif azp_adj is not None or azp is not None:
        raise ValueError("azp_adj and azp take INT8 operands (int8 a and b)")
    if ka == "tensor":
        sa = (1, 0, 0, 0)
    else:
        st = a_scale.strides if a_scale.ndim == 2 else a_scale.strides + (4,)
        shape = a_scale.shape if a_scale.ndim == 2 else a_scale.shape + (1,)
        sa = a_scale_addressing((M,), shape, tuple(st), ka == "token", "a_scale")
    sb = b_scale_addressing(kb, tuple(b_scale.strides) if b_scale.ndim == 2 else tuple(b_scale.strides) + (4,))
    od = out_dtype_of(out_dtype)
    inputs = [("a", a), ("b", b), ("a_scale", a_scale), ("b_scale", b_scale), ("azp_adj", azp_adj), ("azp", azp)]
    bias, out = _bias_and_out(bias, out, od, (M,), N, device, [(n, x) for n, x in inputs if x is not None])
    A = dict(a=am, a_format=af, sa_rows=sa[0], sa_batch=sa[1], sa_m=sa[2], sa_k=sa[3], sa_packed=ka == "packed",
             sa_unpack=False, lead=(M,), **zp)  # fmt: skip
    B = dict(b=bm, b_format=bf, sb_n=sb[0], sb_k=sb[1], sb_shift=sb[2], sb_convert=None, b_plain=False)
    return _layout(A, B, N, K, bias, out, od, device)
