"""The invariants of a weight's arrays: for its format, granularity, shape and data layout, the
shapes and dtypes of its data, scales, zero points, code sums and NVFP4 ``scale_2``."""

from __future__ import annotations

import numpy as np

from .. import _checks, _validate
from .._sizes import ceil_div
from .formats import BLOCK, CHUNK, FP4_BLOCK, TILE_ROWS


def block_grid(N: int, K: int) -> tuple[int, int]:
    """The scale shape of 128 x 128 blocks, ``(ceil(N / 128), ceil(K / 128))``."""
    return ceil_div(N, BLOCK), ceil_div(K, BLOCK)


def _check_block_weight(w) -> None:
    """The rules of a weight of granularity "block"."""
    N, K = w.shape
    if w.scheme.format != "float8_e4m3fn" or w.scheme.block != (BLOCK, BLOCK):
        raise ValueError(
            f"block weights are float8_e4m3fn in blocks of ({BLOCK}, {BLOCK}), "
            f"got format {w.scheme.format!r}, block {w.scheme.block}"
        )
    if w.zero_point is not None:
        raise ValueError("w.zero_point must be None for float8_e4m3fn weights")
    if w.data_layout == "prepared":
        # the FP8 tiles, and the float32 block scales once per row and 128 k (layout.prepared_of)
        n16, chunk = ceil_div(N, TILE_ROWS), CHUNK["float8_e4m3fn"]
        if K % chunk:
            raise ValueError(f"w.shape's K must be a multiple of {chunk} for a prepared weight, got w.shape {w.shape}")
        data_shape, scale_shape = (n16, K // chunk, 16, 64), (n16, ceil_div(K, BLOCK), 16)
        scale_what = "(ceil(N / 16), ceil(K / 128), 16)"
    else:
        data_shape, scale_shape, scale_what = (N, K), block_grid(N, K), "(ceil(N / 128), ceil(K / 128))"
    if w.data.shape != data_shape or w.data.dtype != np.uint8:
        raise ValueError(
            f"w.data must be uint8 of shape {data_shape} for a {w.data_layout} weight of shape {w.shape}, "
            f"got {w.data.dtype} {w.data.shape}"
        )
    if w.scale.shape != scale_shape or w.scale.dtype != np.float32:
        raise ValueError(
            f"w.scale must be float32 of shape {scale_shape} {scale_what} for a {w.data_layout} "
            f"weight of shape {w.shape}, got {w.scale.dtype} {w.scale.shape}"
        )


def _check_int8_weight(w) -> None:
    """The rules of an int8 weight: plain, per channel, int8 data, int32 code sums."""
    N, K = w.shape
    if w.scheme.granularity != "channel" or w.scheme.block != (K,):
        raise ValueError(
            f"int8 weights have one scale per output channel (granularity 'channel', block ({K},)), "
            f"got granularity {w.scheme.granularity!r}, block {w.scheme.block}"
        )
    if w.data_layout == "prepared":
        raise ValueError("w.data_layout must be 'plain' for int8 weights (they have no prepared layout)")
    _checks.weight_int8_k(K, "w.shape")
    if w.zero_point is not None:
        raise ValueError("w.zero_point must be None for int8 weights (symmetric)")
    if w.data.shape != (N, K) or w.data.dtype != np.int8:
        raise ValueError(
            f"w.data must be int8 of shape {(N, K)} for an int8 weight of shape {w.shape}, "
            f"got {w.data.dtype} {w.data.shape}"
        )
    if w.scale.shape != (N, 1):
        raise ValueError(f"w.scale must have shape {(N, 1)}, got {w.scale.shape}")
    if w.code_sum is None:
        raise ValueError("w.code_sum must be the int32 code sums of an int8 weight, got None")
    _validate.cupy_array(w.code_sum, "w.code_sum")
    _validate.c_contiguous(w.code_sum, "w.code_sum")
    if w.code_sum.shape != (N,) or w.code_sum.dtype != np.int32:
        raise ValueError(f"w.code_sum must be int32 of shape {(N,)}, got {w.code_sum.dtype} {w.code_sum.shape}")
    _validate.same_device(w.code_sum, "w.code_sum", w.data.data.device_id, "w.data")


def check_arrays(w) -> None:
    """Raise TypeError or ValueError unless the arrays of the weight ``w`` are CuPy arrays of the
    shapes its scheme, shape and data layout say."""
    for name in ("data", "scale") + (("zero_point",) if w.zero_point is not None else ()):
        _validate.cupy_array(getattr(w, name), f"w.{name}")
    _validate.c_contiguous(w.data, "w.data")
    _validate.c_contiguous(w.scale, "w.scale")
    if w.zero_point is not None:
        _validate.c_contiguous(w.zero_point, "w.zero_point")
    fmt = w.scheme.format
    N, K = w.shape
    if K <= 0 or N < 0:
        raise ValueError(f"w.shape must be (N >= 0, K > 0), got {w.shape}")
    if fmt == "int8":
        _check_int8_weight(w)
        return
    if getattr(w, "code_sum", None) is not None:
        raise ValueError(f"w.code_sum must be None for {fmt} weights (only int8 weights have code sums)")
    if fmt in FP4_BLOCK:
        _check_fp4_weight(w)
        return
    if getattr(w, "scale_2", None) is not None:
        raise ValueError(f"w.scale_2 must be None for {fmt} weights (only nvfp4 weights have a second scale)")
    if w.scheme.granularity == "block":
        _check_block_weight(w)
        return
    ng = K // w._group
    if w.data_layout == "prepared":
        n16, chunk = ceil_div(N, TILE_ROWS), CHUNK[fmt]
        data_shape = (n16, K // chunk, 16, 64) if fmt == "float8_e4m3fn" else (n16, K // chunk, 2, 32, 16)
        shapes = {"data": data_shape, "scales": (n16, ng, 16), "zeros": (n16, ng, 8)}
        if K % chunk:
            raise ValueError(f"w.shape's K must be a multiple of {chunk} for a prepared weight, got w.shape {w.shape}")
    else:
        shapes = {
            "data": (N, K) if fmt == "float8_e4m3fn" else (N, K // 2),
            "scales": (N, ng),
            "zeros": (N, (ng + 1) // 2),
        }
    if w.data.shape != shapes["data"] or w.data.dtype != np.uint8:
        raise ValueError(
            f"w.data must be uint8 of shape {shapes['data']} for a {w.data_layout} weight of shape {w.shape}, "
            f"got {w.data.dtype} {w.data.shape}"
        )
    if w.scale.shape != shapes["scales"]:
        raise ValueError(f"w.scale must have shape {shapes['scales']}, got {w.scale.shape}")
    if w.zero_point is not None and (w.zero_point.shape != shapes["zeros"] or w.zero_point.dtype != np.uint8):
        raise ValueError(
            f"w.zero_point must be uint8 of shape {shapes['zeros']}, got {w.zero_point.dtype} {w.zero_point.shape}"
        )
    if (w.zero_point is not None) != (fmt == "uint4"):
        raise ValueError(f"w.zero_point must be given for uint4 weights and only for them (format {fmt!r})")


def _check_fp4_weight(w) -> None:
    """The rules of an FP4 weight (its arrays already checked to be C-contiguous CuPy arrays)."""
    fmt = w.scheme.format
    N, K = w.shape
    block = FP4_BLOCK[fmt]
    if w.scheme.granularity != "group" or w.scheme.block != (block,):
        raise ValueError(
            f"{fmt} weights have groups of {block} along K (granularity 'group', block ({block},)), "
            f"got granularity {w.scheme.granularity!r}, block {w.scheme.block}"
        )
    if K % block:
        raise ValueError(f"w.shape's K must be a multiple of {block} for {fmt} weights, got {w.shape}")
    if w.zero_point is not None:
        raise ValueError(f"w.zero_point must be None for {fmt} weights")
    if w.data_layout == "prepared":
        if K % CHUNK[fmt]:
            raise ValueError(f"w.shape's K must be a multiple of {CHUNK[fmt]} for a prepared weight, got {w.shape}")
        n16, nch = ceil_div(N, TILE_ROWS), K // 128
        data_shape, scale_shape = (n16, nch, 2, 32, 16), (n16, nch, 16, 128 // block)
    else:
        data_shape, scale_shape = (N, K // 2), (N, K // block)
    if w.data.shape != data_shape or w.data.dtype != np.uint8:
        raise ValueError(
            f"w.data must be uint8 of shape {data_shape} for a {w.data_layout} {fmt} weight of shape "
            f"{w.shape}, got {w.data.dtype} {w.data.shape}"
        )
    if w.scale.shape != scale_shape or w.scale.dtype != np.uint8:
        raise ValueError(
            f"w.scale must be uint8 (the {w.scheme.scale_dtype} bytes) of shape {scale_shape}, "
            f"got {w.scale.dtype} {w.scale.shape}"
        )
    s2 = getattr(w, "scale_2", None)
    if fmt == "mxfp4":
        if s2 is not None:
            raise ValueError("w.scale_2 must be None for mxfp4 weights (only nvfp4 has a second scale)")
        return
    if s2 is None:
        raise ValueError("w.scale_2 must be the float32 (1,) decode scale of an nvfp4 weight, got None")
    _validate.cupy_array(s2, "w.scale_2")
    if s2.shape != (1,) or s2.dtype != np.float32:
        raise ValueError(f"w.scale_2 must be float32 of shape (1,), got {s2.dtype} {s2.shape}")
    _validate.same_device(s2, "w.scale_2", w.data.data.device_id, "w.data")
