"""Weights from checkpoint bytes (:meth:`QuantizedWeight.from_checkpoint`): FP8 E4M3 codes and their
scales as a checkpoint stores them (DeepSeek-V3's ``weight`` and ``weight_scale_inv``, FP8 models'
per-channel ``weight_scale``), INT8 codes with per-channel scales (compressed-tensors W8A8 INT8
``weight`` and ``weight_scale``), INT4 codes packed two per byte with group or per-channel scales
and, for uint4, zero points (compressed-tensors ``pack-quantized``: its int32 words viewed as bytes,
its zero points repacked along K), and FP4 codes with their scale bytes (NVFP4: ModelOpt's
``weight``, ``weight_scale`` and ``weight_scale_2``, or compressed-tensors' ``weight_packed``,
``weight_scale`` and ``weight_global_scale``; MXFP4: packed E2M1 codes and E8M0 bytes), wrapped
without quantizing again (INT8: the code sums computed; NVFP4 from a global scale:
``scale_2 = 1 / global_scale`` computed on the device). :func:`parse` checks them and returns the
weight's constructor arguments."""

from __future__ import annotations

import numbers

import cupy
import numpy as np

from .. import _checks, _dtypes, _validate
from .._sizes import ceil_div
from .formats import BLOCK, DEFAULT_BLOCK_SIZE, FP4_BLOCK, FP4_SCALE_DTYPES, weight_scheme
from .quant import code_sums, scale_2_of

#: The formats from_checkpoint takes.
CHECKPOINT_FORMATS = ("float8_e4m3fn", "int8", "int4", "uint4", "nvfp4", "mxfp4")
#: The INT4 formats: two codes per byte, element 0 in the low nibble; uint4 with zero points.
_INT4 = ("int4", "uint4")
_GROUPS = tuple(g for g in _checks.WEIGHT_GROUP_SIZES if g is not None)
_SCALE_DTYPES = ("float32", "float16", "bfloat16")


def _format_name(format) -> str:
    if isinstance(format, str):
        name = format
    else:  # ml_dtypes.float8_e4m3fn, as a type or a np.dtype
        try:
            name = np.dtype(format).name
        except TypeError:
            raise TypeError(f"format must be a str such as 'float8_e4m3fn' or 'int8', got {format!r}") from None
    if name not in CHECKPOINT_FORMATS:
        raise ValueError(f"format must be one of {CHECKPOINT_FORMATS}, got {format!r}")
    return name


def _int_pair(v):
    """``v`` as a tuple of two Python ints when it is a tuple or list of two integers, else None."""
    if isinstance(v, (tuple, list)) and len(v) == 2:
        if all(isinstance(e, numbers.Integral) and not isinstance(e, (bool, np.bool_)) for e in v):
            return int(v[0]), int(v[1])
    return None


def _int4_group(block_size, fmt: str):
    """The group size of an INT4 weight from ``block_size``: ``(1, G)`` with G in the weight group
    sizes, or None (one scale per output channel). Checked before the arrays (it needs no K)."""
    if block_size is None:
        return None
    bs = None if block_size is DEFAULT_BLOCK_SIZE else _int_pair(block_size)
    if bs is None or bs[0] != 1 or bs[1] not in _GROUPS:
        hint = " (the default (128, 128) is for FP8 blocks)" if block_size is DEFAULT_BLOCK_SIZE else ""
        raise ValueError(
            f"block_size must be (1, G) with G in {_GROUPS} (groups along K) or None (one scale per output "
            f"channel) for format {fmt!r}, got {block_size!r}{hint}"
        )
    return bs[1]


def _zero_point_option(fmt: str, zero_point) -> None:
    """uint4 weights take zero points, every other format none."""
    if fmt == "uint4" and zero_point is None:
        raise ValueError(
            "zero_point must be given for uint4 weights: the codes of zero, uint8 (N, ceil(K / G / 2)), "
            "two per byte along K"
        )
    if fmt != "uint4" and zero_point is not None:
        why = " (its zero point is the implicit 8: pass format='uint4' for zero points)" if fmt == "int4" else ""
        raise ValueError(f"zero_point must be None for format {fmt!r}{why}")


def _zero_points(zero_point, N: int, ng: int, data) -> cupy.ndarray:
    """uint4 zero points as the weight holds them: uint8 ``(N, ceil(ng / 2))``, C-contiguous (a
    non-contiguous array as a copy), on ``data``'s device."""
    _validate.cupy_array(zero_point, "zero_point")
    if zero_point.dtype != np.uint8:
        raise TypeError(
            f"zero_point must be uint8 (the uint4 codes of zero, element 0 in the low nibble), got {zero_point.dtype}"
        )
    shape = (N, ceil_div(ng, 2))
    if tuple(zero_point.shape) != shape:
        raise ValueError(
            f"zero_point must have shape {shape} (N, ceil(K / G / 2)) for {ng} scales a row, got {zero_point.shape}"
        )
    _validate.same_device(zero_point, "zero_point", data.data.device_id, "data")
    with _validate.on_device_of(data):
        return cupy.ascontiguousarray(zero_point)


def _float_scale(scale, shapes, data, block_size, *, channel: bool, to_float32: bool) -> cupy.ndarray:
    """The float scales of an FP8, INT8 or INT4 weight, checked against ``shapes`` (those accepted),
    as the weight holds them: C-contiguous on ``data``'s device, ``(N, 1)`` for one per ``channel``,
    float32 where ``to_float32`` (block weights) or given as float64 (where exact), else their dtype."""
    _validate.cupy_array(scale, "scale")
    if scale.dtype.name not in _SCALE_DTYPES + ("float64",):
        raise TypeError(f"scale must be float32, float16, bfloat16 or float64, got {scale.dtype}")
    if tuple(scale.shape) not in shapes:
        want = " or ".join(str(s) for s in shapes)
        raise ValueError(
            f"scale must have shape {want} for data {data.shape} and block_size={block_size!r}, got {scale.shape}"
        )
    _validate.same_device(scale, "scale", data.data.device_id, "data")
    with _validate.on_device_of(data):
        to = np.float32 if to_float32 or scale.dtype == np.float64 else scale.dtype
        s = cupy.ascontiguousarray(_exact_scale(scale, np.dtype(to)))
        return s.reshape(data.shape[0], 1) if channel else s


def _granularity(block_size, N: int, K: int, fmt: str):
    """(kind, G, scale shapes accepted): kind "block", "group" or "channel"."""
    if fmt == "int8":  # one scale per channel (block_size None, checked before), any K
        _checks.weight_int8_k(K, "data")
        return "channel", None, ((N,), (N, 1))
    if block_size is None:
        if K % 2:
            raise ValueError(f"data's K = {K} must be even for one scale per channel (as quantize_weight's)")
        return "channel", None, ((N,), (N, 1))
    bs = _int_pair(block_size)
    if bs is not None and bs in _checks.WEIGHT_BLOCK_SIZES:
        return "block", None, ((ceil_div(N, BLOCK), ceil_div(K, BLOCK)),)
    if bs is not None and bs[0] == 1 and bs[1] in _GROUPS:
        G = bs[1]
        if K % 2 or K % G:
            raise ValueError(f"block_size={block_size!r}: groups of {G} must divide data's K = {K} (an even K)")
        return "group", G, ((N, K // G),)
    raise ValueError(
        f"block_size must be {_checks.WEIGHT_BLOCK_SIZES[0]} (2-D blocks), (1, G) with G in {_GROUPS} "
        f"(groups along K) or None (one scale per output channel), got {block_size!r}"
    )


def _exact_scale(scale, to) -> cupy.ndarray:
    """``scale`` converted to dtype ``to`` where every value converts exactly (NaN counts as
    exact), else ValueError. float16 and bfloat16 convert to float32 exactly; from float64 the
    check synchronizes (it reads the result)."""
    if scale.dtype == to:
        return scale
    s = scale.astype(to)
    if scale.dtype != np.float64:
        return s
    back = s.astype(scale.dtype)
    if not bool(cupy.all((back == scale) | (cupy.isnan(scale) & cupy.isnan(back)))):
        raise ValueError(
            f"scale of dtype {scale.dtype} has values that {np.dtype(to).name} cannot hold exactly; "
            f"round them yourself (scale.astype({np.dtype(to).name!r})) if that is what you want"
        )
    return s


def _fp4_block_size(block_size, fmt: str) -> int:
    """The block of an FP4 format: ``block_size`` left at its default, None or ``(1, block)``."""
    block = FP4_BLOCK[fmt]
    ok = block_size is DEFAULT_BLOCK_SIZE or block_size is None or _int_pair(block_size) == (1, block)
    if not ok:
        raise ValueError(
            f"block_size={block_size!r} is not supported for {fmt} weights (one scale byte per {block} k): "
            f"leave it at its default, or pass None or (1, {block})"
        )
    return block


def _fp4_scale_options(fmt: str, scale_2, global_scale) -> None:
    """NVFP4 takes exactly one of scale_2 and global_scale, MXFP4 neither."""
    if fmt == "mxfp4":
        for name, v in (("scale_2", scale_2), ("global_scale", global_scale)):
            if v is not None:
                raise ValueError(f"{name} must be None for mxfp4 weights (only nvfp4 has a second scale)")
    elif scale_2 is None and global_scale is None:
        raise ValueError(
            "scale_2 or global_scale must be given for nvfp4 weights: the decode scale (ModelOpt's "
            "weight_scale_2) or the encode scale S_enc (compressed-tensors' weight_global_scale)"
        )
    elif scale_2 is not None and global_scale is not None:
        raise ValueError("scale_2 and global_scale are exclusive (scale_2 = 1 / global_scale): pass one of them")


def _packed_data(data, fmt: str, what: str) -> tuple[int, int]:
    """``(N, K)`` of 4-bit codes packed two per byte: ``data`` a C-contiguous 2-D CuPy uint8 array
    ``(N, K / 2)``; ``what`` names the codes in the error."""
    _validate.cupy_array(data, "data")
    if data.dtype != np.uint8:
        raise TypeError(
            f"data must be uint8 ({what}, element 0 in the low nibble) for format {fmt!r}, got {data.dtype}"
        )
    if data.ndim != 2:
        raise ValueError(f"data must be 2-D (N, K / 2), got shape {data.shape}")
    _validate.c_contiguous(data, "data")
    return data.shape[0], 2 * data.shape[1]


def _from_fp4(data, scale, fmt: str, block_size, scale_2, global_scale, dtype) -> dict:
    """parse for "nvfp4" and "mxfp4"."""
    block = _fp4_block_size(block_size, fmt)
    _fp4_scale_options(fmt, scale_2, global_scale)
    out_t = _dtypes.input_type(dtype, "dtype")
    N, K = _packed_data(data, fmt, "the packed E2M1 codes")
    _checks.fp4_weight_k(fmt, block, K, "data")
    _validate.cupy_array(scale, "scale")
    sdt = np.dtype(FP4_SCALE_DTYPES[fmt])
    if scale.dtype not in (np.dtype(np.uint8), sdt):
        raise TypeError(f"scale must be uint8 or {sdt.name} (the {fmt} scale bytes), got {scale.dtype}")
    if tuple(scale.shape) != (N, K // block):
        raise ValueError(
            f"scale must have shape {(N, K // block)} (N, K / {block}) for data {data.shape} (K = {K}), got {scale.shape}"
        )
    device = data.data.device_id
    _validate.same_device(scale, "scale", device, "data")
    arg = "scale_2" if global_scale is None else "global_scale"
    given = _validate.scale_arg(scale_2 if global_scale is None else global_scale, arg, device, "data")
    with _validate.on_device_of(data):
        s = cupy.ascontiguousarray(scale.view(np.uint8))
        s2 = None
        if fmt == "nvfp4" and given.array is not None:
            s2 = given.array.reshape(1) if arg == "scale_2" else scale_2_of(given.array)
        elif fmt == "nvfp4":
            v = given.value if arg == "scale_2" else np.float32(1) / given.value  # IEEE float32, as on the device
            s2 = cupy.asarray(np.array([v], np.float32))
    scheme = weight_scheme(fmt, block, K, np.uint8)
    return dict(data=data, scale=s, zero_point=None, scheme=scheme, shape=(N, K), dtype=out_t.dtype, scale_2=s2)


def _from_int4(data, scale, zero_point, fmt: str, block_size, dtype) -> dict:
    """parse for "int4" and "uint4"."""
    G = _int4_group(block_size, fmt)
    out_t = _dtypes.input_type(dtype, "dtype")
    N, K = _packed_data(data, fmt, f"the {fmt} codes, two per byte")
    if K == 0:
        raise ValueError(f"data's K must be nonzero, got shape {data.shape}")
    if G is not None and K % G:
        raise ValueError(f"block_size={block_size!r}: groups of {G} must divide data's K = {K}")
    ng = 1 if G is None else K // G
    shapes = ((N,), (N, 1)) if G is None else ((N, ng),)
    s = _float_scale(scale, shapes, data, block_size, channel=G is None, to_float32=False)
    z = None if zero_point is None else _zero_points(zero_point, N, ng, data)
    scheme = weight_scheme(fmt, G, K, s.dtype)
    return dict(data=data, scale=s, zero_point=z, scheme=scheme, shape=(N, K), dtype=out_t.dtype)


def parse(data, scale, *, format, block_size, zero_point, scale_2, global_scale, dtype) -> dict:
    """The QuantizedWeight constructor's arguments for :meth:`QuantizedWeight.from_checkpoint`
    (its docstring says what it takes and checks)."""
    fmt = _format_name(format)
    _zero_point_option(fmt, zero_point)
    if fmt in FP4_BLOCK:
        return _from_fp4(data, scale, fmt, block_size, scale_2, global_scale, dtype)
    for name, v in (("scale_2", scale_2), ("global_scale", global_scale)):
        if v is not None:
            raise ValueError(f"{name} is for nvfp4 weights only, got format {fmt!r}")
    if fmt in _INT4:
        return _from_int4(data, scale, zero_point, fmt, block_size, dtype)
    if fmt == "int8" and block_size is not None:
        raise ValueError(
            f"block_size={block_size!r} is not supported for format 'int8': INT8 checkpoints have one scale per "
            "output channel, pass block_size=None"
        )
    out_t = _dtypes.input_type(dtype, "dtype")
    _validate.cupy_array(data, "data")
    if fmt == "int8" and data.dtype != np.int8:
        raise TypeError(f"data must be int8 (the INT8 codes) for format 'int8', got {data.dtype}")
    if fmt != "int8" and data.dtype != np.uint8:
        raise TypeError(f"data must be uint8 (the FP8 codes; view a float8 tensor as uint8), got {data.dtype}")
    if data.ndim != 2:
        raise ValueError(f"data must be 2-D (N, K), got shape {data.shape}")
    _validate.c_contiguous(data, "data")
    N, K = data.shape
    if K == 0:
        raise ValueError(f"data's K must be nonzero, got shape {data.shape}")
    kind, G, shapes = _granularity(block_size, N, K, fmt)
    s = _float_scale(scale, shapes, data, block_size, channel=kind == "channel", to_float32=kind == "block")
    with _validate.on_device_of(data):
        sums = code_sums(data) if fmt == "int8" else None
    if kind == "block":
        scheme = weight_scheme(fmt, None, K, np.float32, block=(BLOCK, BLOCK))
    else:
        scheme = weight_scheme(fmt, G, K, s.dtype)
    return dict(data=data, scale=s, zero_point=None, scheme=scheme, shape=(N, K), dtype=out_t.dtype, code_sum=sums)
