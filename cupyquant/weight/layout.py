"""The two data layouts of a weight and the copies between them (the package's docstring describes
both): :func:`prepared_of` makes the prepared (tile-major) layout the matmul kernels read, on the GPU,
bit-exact with :func:`cupyquant.reference.prepare_weight` (FP8 weights in 128 x 128 blocks: their
float32 block scales repeated for each row of the block, so that the kernels read them as FP8
groups of 128 along K); :func:`plain_of` goes back. Both take a
weight and return a new one of its kind (``w._with``)."""

from __future__ import annotations

import cupy
import numpy as np

from .. import _validate
from .._sizes import ceil_div
from .formats import BLOCK, CHUNK, FP4_BLOCK, TILE_ROWS


def _pad_rows(x, rows, keep):
    if x.shape[0] == rows:
        return x
    y = keep(cupy.zeros((rows,) + x.shape[1:], x.dtype))
    y[: x.shape[0]] = x
    return y


def _nibbles(z, keep):
    """Packed uint8 (..., B) -> codes (..., 2 B), element 2 i the low nibble of byte i."""
    return keep(cupy.stack([keep(z & 15), keep(z >> 4)], axis=-1)).reshape(z.shape[:-1] + (2 * z.shape[-1],))


def _pack_pairs(codes, keep):
    """Codes (..., 2 B) -> packed uint8 (..., B), element 2 i in the low nibble of byte i."""
    out = keep(codes[..., 0::2] | keep(codes[..., 1::2] << 4))
    return out if out.dtype == np.uint8 else out.astype(np.uint8)


def _temps():
    """(keep, done): keep(x) records an intermediate array and returns it; done() keeps them all
    alive with the graph if the stream is capturing (every array made inside a capture must outlive
    the graph's replays, not return to the pool when the function returns)."""
    temps: list = []

    def keep(x):
        temps.append(x)
        return x

    return keep, lambda: _validate.keep_if_capturing(*temps)


# The INT4 fragment order's transposes (prepared_of, plain_of), and with the chunk's 4 x 4 blocks
# of 8 k transposed (k_permuted).
_FRAG, _FRAG_K_PERMUTED = (0, 3, 6, 2, 4, 5, 8, 9, 7, 1), (0, 3, 4, 2, 6, 7, 8, 9, 5, 1)
_PLAIN, _PLAIN_K_PERMUTED = (0, 9, 3, 1, 4, 5, 2, 8, 6, 7), (0, 9, 3, 1, 2, 8, 4, 5, 6, 7)


def k_permuted(w) -> bool:
    """Whether w's prepared INT4 chunks have their 4 x 4 blocks of 8 k transposed
    (reference.prepare_weight): INT4 weights whose groups are whole 128-k chunks (the matmul kernels
    then scale each chunk's float32 partial sums: scale_after_sum), and FP4 weights, always."""
    return w.scheme.format in FP4_BLOCK or w.scheme.format != "float8_e4m3fn" and w._group % 128 == 0


def _block_rows(w, keep):
    """The float32 block scales of plain block weight ``w`` once per row: ``(N, ceil(K / 128))``,
    row n the scales of its row of blocks, n // 128."""
    return keep(cupy.repeat(w.scale, BLOCK, axis=0)[: w.shape[0]])


def prepared_of(w):
    """The copies of prepare_weight (plain w, on its device)."""
    N, K = w.shape
    block = w.scheme.granularity == "block"
    n16, chunk = ceil_div(N, TILE_ROWS), CHUNK[w.scheme.format]
    ng = ceil_div(K, BLOCK) if block else K // w._group
    keep, done = _temps()
    rows = _pad_rows(w.data, 16 * n16, keep)
    if w.scheme.format == "float8_e4m3fn":
        data = cupy.ascontiguousarray(rows.reshape(n16, 16, K // chunk, 64).transpose(0, 2, 1, 3))
    else:  # fragment order (reference.prepare_weight): k16 step s = 4 h + 2 u1 + u0 of a chunk, k = 16 s + 8 kb + 2 t + e
        codes = keep(
            _nibbles(rows, keep).reshape(n16, 2, 8, K // 128, 2, 2, 2, 2, 4, 2)
        )  # tile, row / 8, g, chunk, h, u1, u0, kb, t, e
        # [s % 2][g, s // 2][t, e, kb] pairs; k_permuted: the chunk's axes read (a1, a0, b1, b0) for
        # (h, u1, u0, kb): k = 32 a + 8 b + r goes where 32 b + 8 a + r would
        frag = keep(cupy.ascontiguousarray(codes.transpose(_FRAG_K_PERMUTED if k_permuted(w) else _FRAG)))
        data = _pack_pairs(frag.reshape(n16, K // 128, 2, 32, 32), keep)
    if w.scheme.format in FP4_BLOCK:
        scales, padded = _fp4_prepared_scales(w)
        keep(padded)
    else:
        rows_s = _block_rows(w, keep) if block else w.scale
        scales = cupy.ascontiguousarray(_pad_rows(rows_s, 16 * n16, keep).reshape(n16, 16, ng).transpose(0, 2, 1))
    zeros = None
    if w.zero_point is not None:
        codes = _nibbles(w.zero_point, keep)[:, :ng]
        tiles = keep(_pad_rows(codes, 16 * n16, keep).reshape(n16, 16, ng)).transpose(0, 2, 1)
        zeros = _pack_pairs(keep(cupy.ascontiguousarray(tiles)), keep)
    done()
    return w._with(data, scales, zeros, "prepared")


def plain_of(w):
    """The inverse of prepared_of (prepared w, on its device)."""
    N, K = w.shape
    block = w.scheme.granularity == "block"
    n16 = w.data.shape[0]
    ng = ceil_div(K, BLOCK) if block else K // w._group
    keep, done = _temps()
    if w.scheme.format == "float8_e4m3fn":
        data = cupy.ascontiguousarray(keep(w.data.transpose(0, 2, 1, 3).reshape(16 * n16, -1))[:N])
    else:  # the inverse of prepared_of's fragment order
        frag = keep(
            _nibbles(w.data, keep).reshape(n16, K // 128, 2, 8, 2, 2, 4, 2, 2, 2)
        )  # tile, chunk, u0, g, h, u1, t, e, kb, row / 8
        inv = _PLAIN_K_PERMUTED if k_permuted(w) else _PLAIN
        codes = keep(cupy.ascontiguousarray(frag.transpose(inv)).reshape(16 * n16, K)[:N])
        data = _pack_pairs(codes, keep)
    if w.scheme.format in FP4_BLOCK:
        scales, t = _fp4_plain_scales(w)
        keep(t)
    elif block:  # the first row of each row of blocks
        scales = cupy.ascontiguousarray(keep(w.scale.transpose(0, 2, 1).reshape(16 * n16, ng))[:N:BLOCK])
    else:
        scales = cupy.ascontiguousarray(keep(w.scale.transpose(0, 2, 1).reshape(16 * n16, ng))[:N])
    zeros = None
    if w.zero_point is not None:
        codes = keep(_nibbles(w.zero_point, keep).transpose(0, 2, 1).reshape(16 * n16, ng))[:N]
        if ng % 2:
            codes = keep(cupy.concatenate([codes, keep(cupy.zeros((N, 1), np.uint8))], axis=1))
        zeros = _pack_pairs(keep(cupy.ascontiguousarray(codes)), keep)
    done()
    return w._with(data, scales, zeros, "plain")


def _fp4_prepared_scales(w) -> cupy.ndarray:
    """The prepared scale bytes of plain FP4 ``w``: (n16, K / 128, 16, 128 / block)."""
    N, K = w.shape
    n16, nb = ceil_div(N, TILE_ROWS), 128 // FP4_BLOCK[w.scheme.format]
    s = w.scale
    if N != 16 * n16:
        s = cupy.zeros((16 * n16, K // FP4_BLOCK[w.scheme.format]), np.uint8)
        s[:N] = w.scale
    return cupy.ascontiguousarray(s.reshape(n16, 16, K // 128, nb).transpose(0, 2, 1, 3)), s


def _fp4_plain_scales(w) -> cupy.ndarray:
    """The inverse of _fp4_prepared_scales (prepared FP4 ``w``)."""
    N, K = w.shape
    n16 = w.scale.shape[0]
    t = w.scale.transpose(0, 2, 1, 3).reshape(16 * n16, K // FP4_BLOCK[w.scheme.format])
    return cupy.ascontiguousarray(t[:N]), t
