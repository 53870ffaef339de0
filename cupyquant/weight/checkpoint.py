"""Weights from checkpoint bytes (:meth:`QuantizedWeight.from_checkpoint`): FP8 E4M3 codes and their
scales as a checkpoint stores them (DeepSeek-V3's ``weight`` and ``weight_scale_inv``, FP8 models'
per-channel ``weight_scale``), INT8 codes with per-channel scales (compressed-tensors W8A8 INT8
``weight`` and ``weight_scale``), and FP4 codes with their scale bytes (NVFP4: ModelOpt's ``weight``,
``weight_scale`` and ``weight_scale_2``, or compressed-tensors' ``weight_packed``, ``weight_scale``
and ``weight_global_scale``; MXFP4: packed E2M1 codes and E8M0 bytes), wrapped without quantizing
again (INT8: the code sums computed; NVFP4 from a global scale: ``scale_2 = 1 / global_scale``
computed on the device). :func:`parse` checks them and returns the weight's constructor arguments."""

from __future__ import annotations

import numbers

import cupy
import numpy as np

from .. import _checks, _dtypes, _validate
from .._sizes import ceil_div
from .formats import BLOCK, DEFAULT_BLOCK_SIZE, FP4_BLOCK, FP4_SCALE_DTYPES, weight_scheme
from .quant import code_sums, scale_2_of

#: The formats from_checkpoint takes.
CHECKPOINT_FORMATS = ("float8_e4m3fn", "int8", "nvfp4", "mxfp4")
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


def _granularity(block_size, N: int, K: int, fmt: str):
    """(kind, G, scale shapes accepted): kind "block", "group" or "channel"."""
    if fmt == "int8":  # one scale per channel (block_size None, checked before), any K
        _checks.weight_int8_k(K, "data")
        return "channel", None, ((N,), (N, 1))
    if block_size is None:
        if K % 2:
            raise ValueError(f"data's K = {K} must be even for one scale per channel (as quantize_weight's)")
        return "channel", None, ((N,), (N, 1))
    bs = None
    if isinstance(block_size, (tuple, list)) and len(block_size) == 2:
        if all(isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_)) for v in block_size):
            bs = (int(block_size[0]), int(block_size[1]))
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
    ok = block_size is DEFAULT_BLOCK_SIZE or block_size is None
    if not ok and isinstance(block_size, (tuple, list)) and len(block_size) == 2:
        ok = all(isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_)) for v in block_size) and (
            tuple(int(v) for v in block_size) == (1, block)
        )
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


def _from_fp4(data, scale, fmt: str, block_size, scale_2, global_scale, dtype) -> dict:
    """parse for "nvfp4" and "mxfp4"."""
    block = _fp4_block_size(block_size, fmt)
    _fp4_scale_options(fmt, scale_2, global_scale)
    out_t = _dtypes.input_type(dtype, "dtype")
    _validate.cupy_array(data, "data")
    if data.dtype != np.uint8:
        raise TypeError(
            f"data must be uint8 (the packed E2M1 codes, element 0 in the low nibble) for format {fmt!r}, "
            f"got {data.dtype}"
        )
    if data.ndim != 2:
        raise ValueError(f"data must be 2-D (N, K / 2), got shape {data.shape}")
    _validate.c_contiguous(data, "data")
    N, K = data.shape[0], 2 * data.shape[1]
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


def parse(data, scale, *, format, block_size, scale_2, global_scale, dtype) -> dict:
    """The QuantizedWeight constructor's arguments for :meth:`QuantizedWeight.from_checkpoint`
    (its docstring says what it takes and checks)."""
    fmt = _format_name(format)
    if fmt in FP4_BLOCK:
        return _from_fp4(data, scale, fmt, block_size, scale_2, global_scale, dtype)
    for name, v in (("scale_2", scale_2), ("global_scale", global_scale)):
        if v is not None:
            raise ValueError(f"{name} is for nvfp4 weights only, got format {fmt!r}")
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
        to = np.float32 if kind == "block" or scale.dtype == np.float64 else scale.dtype
        s = cupy.ascontiguousarray(_exact_scale(scale, np.dtype(to)))
        if kind == "channel":
            s = s.reshape(N, 1)
        sums = code_sums(data) if fmt == "int8" else None
    if kind == "block":
        scheme = weight_scheme(fmt, None, K, np.float32, block=(BLOCK, BLOCK))
    else:
        scheme = weight_scheme(fmt, G, K, s.dtype)
    return dict(data=data, scale=s, zero_point=None, scheme=scheme, shape=(N, K), dtype=out_t.dtype, code_sum=sums)
