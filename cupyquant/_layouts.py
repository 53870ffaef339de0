"""Layouts that the kernels' wrappers and the NumPy reference both need: FP4 packing and the 128x4
swizzled block-scale layout. NumPy only, so that ``cupyquant.reference`` stays free of CuPy."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from . import _checks


def pack_fp4(codes) -> np.ndarray:
    """Pack 4-bit codes two per byte along the last axis, element 2i in the low nibble of byte i;
    an odd last element gets a zero high nibble. ``(..., K) -> (..., ceil(K / 2))`` uint8."""
    # codes: integers in [0, 15], or a float4_e2m1fn array read as its codes; a cast would wrap 16 to 0
    codes = _checks.small_codes(codes, "codes", 15, "4-bit codes", bits_of=ml_dtypes.float4_e2m1fn)
    _checks.at_least_1d(codes.ndim, "codes")
    K = codes.shape[-1]
    if K % 2:
        codes = np.concatenate([codes, np.zeros(codes.shape[:-1] + (1,), np.uint8)], axis=-1)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def unpack_fp4(packed, K: int) -> np.ndarray:
    """Inverse of :func:`pack_fp4`: ``(..., ceil(K / 2))`` bytes -> ``(..., K)`` codes."""
    # K is 2 B or 2 B - 1 for B bytes a row: the lengths whose packing has B bytes
    packed = _checks.small_codes(packed, "packed", 255, "bytes")
    _checks.at_least_1d(packed.ndim, "packed")
    B = packed.shape[-1]
    if isinstance(K, (bool, np.bool_)) or not isinstance(K, (int, np.integer)):
        raise TypeError(f"K must be an int, got {type(K).__name__}")
    if K not in (2 * B, 2 * B - 1) or K < 0:
        raise ValueError(f"K must be {2 * B - 1} or {2 * B} for packed data of {B} bytes a row, got {K}")
    out = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (2 * packed.shape[-1],))
    return out[..., :K].astype(np.uint8)


def swizzled_shape(rows: int, n_blocks: int) -> tuple:
    """``(round_up(rows, 128), round_up(n_blocks, 4))``: the padded extent of the 128x4 layout."""
    return (-(-rows // 128) * 128, -(-n_blocks // 4) * 4)


def swizzle_offsets(rows: int, n_blocks: int) -> np.ndarray:
    """Byte offsets (int64 ``(rows, n_blocks)``) of each scale in the 128x4 swizzled layout that
    cuBLAS and Blackwell block-scaled MMA read: for row m and scale column k,
    ``((m // 128) * ceil(n_blocks / 4) + k // 4) * 512 + (m % 32) * 16 + ((m // 32) % 4) * 4 + k % 4``."""
    m = np.arange(rows, dtype=np.int64)[:, None]
    k = np.arange(n_blocks, dtype=np.int64)[None, :]
    kt = -(-n_blocks // 4)
    return ((m // 128) * kt + k // 4) * 512 + (m % 32) * 16 + ((m // 32) % 4) * 4 + k % 4


def swizzle_scales(scale) -> np.ndarray:
    """Dense scales ``(..., n_blocks)`` (leading axes flattened into rows) -> the swizzled buffer,
    uint8 of :func:`swizzled_shape`, its bytes in layout order and the padding zero."""
    scale = np.asarray(scale, dtype=np.uint8)
    nb = scale.shape[-1]
    s2 = scale.reshape(int(np.prod(scale.shape[:-1])), nb)
    buf = np.zeros(swizzled_shape(s2.shape[0], nb), np.uint8)
    buf.reshape(-1)[swizzle_offsets(*s2.shape).reshape(-1)] = s2.reshape(-1)
    return buf


def unswizzle_scales(buf, lead_shape, n_blocks: int) -> np.ndarray:
    """Inverse of :func:`swizzle_scales`: the dense ``lead_shape + (n_blocks,)`` scales."""
    rows = int(np.prod(lead_shape)) if len(lead_shape) else 1
    flat = np.asarray(buf, dtype=np.uint8).reshape(-1)
    return flat[swizzle_offsets(rows, n_blocks).reshape(-1)].reshape(tuple(lead_shape) + (n_blocks,))
