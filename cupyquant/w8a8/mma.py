"""The W8A8 matmul on the mma.sync tensor cores (kernels/scaled_mm_mma.cu: FP8 on compute capability
8.9 and newer, INT8 on 8.0 and newer): its kernel family, tile table, cost model (tile and K split)
and the plan of its launch."""

from __future__ import annotations

import math
from typing import NamedTuple

from .. import _device, _dtypes, _jit, _workspace
from .._launch import ARG, Launch
from .._sizes import ceil_div
from . import args as _args
from .args import BLOCK_K, MODE_END, MODE_K_COL, MODES


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
    if M <= mid.bm or ceil_div(M, large.bm) * ceil_div(N, large.bn) < sms:
        return mid
    return large


def split(tiles: int, nkb: int, slots: int) -> tuple:
    """(parts, 128-k blocks a part) of K: one part where the tiles fill the ``slots`` (blocks that
    run at once), else as many as fill them with at least MIN_BLOCKS_PER_SPLIT blocks a part; every
    part has at least one block."""
    parts = 1 if tiles >= slots else max(1, min(nkb // MIN_BLOCKS_PER_SPLIT, ceil_div(slots, tiles)))
    if parts == 1:
        return 1, max(nkb, 1)
    per = ceil_div(nkb, parts)
    return ceil_div(nkb, per), per


class MmLaunch:
    """The planned launch of one call layout: the kernel's Launch (arguments: a, b, their scales,
    zero points, column term, bias, the output, the workspace and arrival counters of a K split)
    and the K split's workspace shape (None for none) and counters."""

    __slots__ = ("launch", "ws", "counters", "device")

    def __init__(self, L):
        M, N, K = L.M, L.N, L.K
        self.device = device = L.device
        cfg = config(M, N, _device.sm_count(device))
        ty = _dtypes.input_type(L.out_dtype, "out_dtype").ctype
        fa, fb = _args.FORMAT_IDS[L.a_format], _args.FORMAT_IDS[L.b_format]
        k = _jit.kernel(device, FAMILY, "scaled_mm_mma", fa, fb, ty, L.mode, *cfg)
        smem = smem_bytes(cfg, L.mode)
        occ = _workspace.occupancy(device, k, THREADS, smem)  # also raises the kernel's shared-memory limit
        tiles = ceil_div(M, cfg.bm) * ceil_div(N, cfg.bn)
        nkb = ceil_div(K, BLOCK_K)
        parts, per = split(tiles, nkb, occ * _device.sm_count(device))
        # float32 partial tiles (part, tile, BM, BN) and per-tile arrival counters
        self.ws = (parts, tiles, cfg.bm, cfg.bn) if parts > 1 else None
        self.counters = tiles if parts > 1 else 0
        args = (ARG,) * 10 + (_args.mm_args(L, parts, per),)
        self.launch = Launch(k, (tiles, 1, parts), (THREADS,), args, smem=smem)

    def __call__(self, ops) -> None:
        """Launch on the current stream for a call's Operands."""
        ws = counters = None
        if self.ws is not None:
            ws, counters = _workspace.split_buffers(self.device, math.prod(self.ws), self.counters)
        self.launch(ops.a, ops.b, ops.sa, ops.sb, ops.azp, ops.adj, ops.bias, ops.out2, ws, counters)
