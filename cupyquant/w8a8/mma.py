"""The W8A8 matmul on the mma.sync tensor cores (kernels/scaled_mm_mma.cu: FP8 on compute capability
8.9 and newer, INT8 on 8.0 and newer): its kernel family, tile configurations, K split and launch."""

from __future__ import annotations

from typing import NamedTuple

import cupy
import numpy as np

from .. import _device, _dtypes, _jit, _launch, _validate
from ..weight import _cache
from . import args as _args
from .args import BLOCK_K, MODE_END, MODE_K_COL, MODES, Operands


class Config(NamedTuple):
    """A tile configuration: the kernel's template arguments BM, BN, STAGES."""

    bm: int  # rows of y a block: 16 (warps 1 x 8) or 64, 128 (warps 2 x 4)
    bn: int  # columns of y a block (at most 128, within one 128 x 128 weight block)
    stages: int  # 128-k stages in shared memory


#: Tiles by M (config): decode rows, mid-size M, and the 128 x 128 tile of large M. Shared memory
#: (smem_bytes, at most): 16 x 128 x 4 stages 73 KB, 64 x 128 x 4 98 KB, 128 x 128 x 3 98.5 KB, all
#: within the 99 KB a block may have on sm_89 and sm_120.
CONFIGS = (Config(16, 128, 4), Config(64, 128, 4), Config(128, 128, 3))
THREADS = 256
#: FP8 formats the family is built for (FP8_IDS numbers), for a and b: the weights are e4m3,
#: scaled_mm takes e5m2 too
FP8_FORMATS = tuple(_args.FP8_IDS.values())
#: the least number of 128-k blocks in one part of a K split (the fix-up costs a partial tile's
#: round trip through L2 per part)
MIN_BLOCKS_PER_SPLIT = 4

FAMILY = _jit.register(
    "scaled_mm_mma",
    [
        _jit.expr("scaled_mm_mma", fa, fb, ty, mode, *cfg)
        for fa in FP8_FORMATS
        for fb in FP8_FORMATS
        for ty in _dtypes.INPUT_CTYPES
        for mode in MODES
        for cfg in CONFIGS
    ]
    + [
        _jit.expr("scaled_mm_mma", _args.INT8_ID, _args.INT8_ID, ty, MODE_END, *cfg)
        for ty in _dtypes.INPUT_CTYPES
        for cfg in CONFIGS
    ],
)


def smem_bytes(cfg: Config, mode: int) -> int:
    """Dynamic shared memory of a launch (scaled_mm_mma.cu): STAGES x (a's and b's 128-byte rows,
    and in the K-varying modes a's scale word of each row), and in MODE_K_COL two slots of b's
    column scales."""
    stage = (cfg.bm + cfg.bn) * BLOCK_K + (0 if mode == MODE_END else 4 * cfg.bm)
    return cfg.stages * stage + (2 * 4 * cfg.bn if mode == MODE_K_COL else 0)


def config(M: int, N: int, sms: int) -> Config:
    """The tile of an (M, N) output: 16 rows up to M = 16; 64 rows up to M = 64 and wherever the
    128-row tiles would not give every SM one; 128 rows otherwise."""
    small, mid, large = CONFIGS
    if M <= small.bm:
        return small
    if M <= mid.bm or -(-M // large.bm) * -(-N // large.bn) < sms:
        return mid
    return large


def split(tiles: int, nkb: int, slots: int) -> tuple:
    """(parts, 128-k blocks a part) of K: one part where the tiles fill the ``slots`` (blocks that
    run at once), else as many as fill them with at least MIN_BLOCKS_PER_SPLIT blocks a part; every
    part has at least one block."""
    parts = 1 if tiles >= slots else max(1, min(nkb // MIN_BLOCKS_PER_SPLIT, -(-slots // tiles)))
    if parts == 1:
        return 1, max(nkb, 1)
    per = -(-nkb // parts)
    return -(-nkb // per), per


def launch(ops: Operands) -> None:
    """Run ``ops`` on the current stream (writes ``ops.out2``): the configuration for M, K split
    where the tiles cannot fill the GPU."""
    M, N, K = ops.M, ops.N, ops.K
    if M == 0 or N == 0:
        return
    device = ops.device
    cfg = config(M, N, _device.sm_count(device))
    ty = _dtypes.input_type(ops.out2.dtype, "out_dtype").ctype
    k = _jit.kernel(device, FAMILY, "scaled_mm_mma", ops.a_format, ops.b_format, ty, ops.mode, *cfg)
    smem = smem_bytes(cfg, ops.mode)
    occ = _cache.occupancy(device, k, THREADS, smem)  # also raises the kernel's shared-memory limit
    tiles = -(-M // cfg.bm) * -(-N // cfg.bn)
    nkb = -(-K // BLOCK_K)
    splits, per = split(tiles, nkb, occ * _device.sm_count(device))
    if splits > 1:  # float32 partial tiles (part, tile, BM, BN) and per-tile arrival counters
        ws = cupy.empty((splits, tiles, cfg.bm, cfg.bn), dtype=np.float32)
        _validate.keep_if_capturing(ws)
        counters = _cache.split_counters(device, tiles)
    else:
        ws = counters = 0
    kargs = (
        ops.a,
        ops.b,
        ops.sa,
        ops.sb,
        0 if ops.azp is None else ops.azp,
        0 if ops.adj is None else ops.adj,
        0 if ops.bias is None else ops.bias,
        ops.out2,
        ws,
        counters,
        _args.mm_args(ops, splits, per),
    )
    _launch.launch(k, (tiles, 1, splits), (THREADS,), kargs, smem, pdl=False)
