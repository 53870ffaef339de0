"""The decode kernel (``kernels/weight_decode.cu``, ``w16_decode``): the split-K ``mma.sync`` kernel
of the matmul for few rows of activations, one 16-row tile of ``a`` per block, each weight byte read
once per 16 rows. Its configuration table (each row its template arguments), its cost model (which
configuration a shape takes), its argument struct and the plan of its launches.

Every fitted cost is data here, with what it is and how it was fitted. Timings are on an H100 SXM
(132 SMs) unless said, bf16 activations, INT4 weights in groups of 128, microseconds per call of
``scripts/bench.py`` (CUDA graphs of back-to-back calls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .. import _dtypes, _jit, _workspace
from .._launch import ARG, Launch
from .._sizes import MAX_GRID_YZ, ceil_div
from .formats import CHUNK, FP4_IDS, INT4_IDS, TILE_ROWS, WEIGHT_FP8, WEIGHT_FP8_BLOCK, WEIGHT_INT4, WEIGHT_UINT4
from .problem import Problem, Step

_BOOLS = (False, True)


# ---------------------------------------------------------------- configurations
class DecodeConfig(NamedTuple):
    """A configuration of the decode kernel; the fields after ``name`` are its template arguments."""

    name: str
    warps: int  # warps per block; they split the block's K between them
    blocks_per_sm: int  # the launch bounds' minimum blocks per SM (sets the register budget)
    row_tiles: int  # 16-row weight tiles per block: 1 (M <= 8), 2 or 4 (M tiles of 16 rows)
    scales_ahead: int  # chunks ahead that a lane loads its scales
    even_odd_sums: bool  # two sets of partial sums, even and odd k16 steps (with scale_after_sum)

    @property
    def targs(self) -> tuple:
        return self[1:]

    @property
    def rows(self) -> int:
        """Weight rows (output columns) per block."""
        return 16 * self.row_tiles

    @property
    def m_tile_rows(self) -> int:
        """Rows of ``a`` a block multiplies: 8 (one mma B fragment) or 16 (two)."""
        return 8 if self.row_tiles == 1 else 16


# Names: r<weight rows a block>_w<warps a block>_b<blocks a SM>. Those of 16 rows serve M <= 8.
R16_W8_B3 = DecodeConfig("r16_w8_b3", 8, 3, 1, 1, False)
R16_W8_B4 = DecodeConfig("r16_w8_b4", 8, 4, 1, 1, False)  # 64 registers: where 4 blocks fill waves better
R16_W16_B2 = DecodeConfig("r16_w16_b2", 16, 2, 1, 1, False)  # few blocks: a K split twice as fine
R16_W4_B8 = DecodeConfig("r16_w4_b8", 4, 8, 1, 1, False)  # many short blocks in one wave
R32_W8_B2 = DecodeConfig("r32_w8_b2", 8, 2, 2, 1, False)
R32_W4_B4 = DecodeConfig("r32_w4_b4", 4, 4, 2, 1, False)
R32_W16_B1 = DecodeConfig("r32_w16_b1", 16, 1, 2, 1, False)  # few blocks of 32 rows, 32 KB in flight a SM
R64_W4_B2 = DecodeConfig("r64_w4_b2", 4, 2, 4, 1, False)  # half the activation reads per weight byte
R64_W8_B1 = DecodeConfig("r64_w8_b1", 8, 1, 4, 1, False)  # the 64-row blocks one a SM (or a 2-way K split)
# 8 warps, one block a SM (up to 255 registers): two sets of partial sums halve the chain of
# dependent mma that sets the pace of a short K; its scales are loaded two chunks ahead
R32_W8_B1_EVEN_ODD = DecodeConfig("r32_w8_b1_even_odd", 8, 1, 2, 2, True)

#: Every decode configuration (decode_config, below, says which serves which shapes).
DECODE_CONFIGS = (
    R16_W8_B3,
    R16_W8_B4,
    R32_W8_B2,
    R16_W16_B2,
    R16_W4_B8,
    R32_W4_B4,
    R32_W16_B1,
    R64_W4_B2,
    R64_W8_B1,
    R32_W8_B1_EVEN_ODD,
)
#: The decode kernel's ring depth: weight chunks in flight per warp (kernels/weight_decode.cu DECODE_STAGES).
DECODE_STAGES = 2


def decode_smem(cfg: DecodeConfig) -> int:
    """Dynamic shared bytes of a decode block: each warp's ring of DECODE_STAGES chunks, 1 KB per
    16 weight rows a chunk."""
    return cfg.warps * DECODE_STAGES * 1024 * cfg.row_tiles


#: weight_decode.cu MatmulArgs
ARGS = np.dtype(
    [
        ("M", np.int64),
        ("N", np.int64),
        ("K", np.int64),
        ("lda", np.int64),
        ("ng", np.int64),
        ("gshift", np.int32),
        ("early", np.int32),
    ],
    align=True,
)

# FP4 weights and FP8 weights in 128 x 128 blocks (float32 scales) are dequantized before the mma
# (no scale_after_sum), and not offered the even/odd configuration, which serves scale_after_sum only.
FAMILY = _jit.register(
    "weight_decode",
    [
        e
        for cfg in DECODE_CONFIGS
        for e in _jit.product(
            "w16_decode",
            _dtypes.HALF_CTYPES,
            (WEIGHT_INT4, WEIGHT_UINT4, WEIGHT_FP8),
            *[(v,) for v in cfg.targs],
            _BOOLS,
        )
    ]
    + [
        e
        for cfg in DECODE_CONFIGS
        if not cfg.even_odd_sums
        for e in _jit.product(
            "w16_decode", _dtypes.HALF_CTYPES, FP4_IDS + (WEIGHT_FP8_BLOCK,), *[(v,) for v in cfg.targs], (False,)
        )
    ],
)


# ---------------------------------------------------------------- cost model
@dataclass(frozen=True)
class DecodeCosts:
    """The decode kernel's time model and the rules beside it (decode_config).

    Wave model: a round of chunks takes one memory latency while an SM has less than ``inflight_kb``
    of weights in flight, and grows with the bytes past that (the memory's rate); a block costs
    ``block_chunks`` chunks more than its own (first load, the K reduction). 132 SMs x 20 KB =
    2.6 MB is about 0.9 us of an H100's 3 TB/s. Both numbers are fitted to the fastest configuration
    of 20 shapes x {INT4, FP8} x M = {1, 16}, every configuration forced in turn: the picks are
    within 5% of the fastest on all 80 cases and within 2% on 75 (20-24 KB with 0.75-1 chunk do as
    well; 16 KB misses by up to 39%, half a chunk by up to 12%).

    The 64-row blocks (R64_*) are not in the wave model. With more blocks than SMs, R64_W4_B2 is
    the fastest on all 19 such cases measured (by 4-20%: 14336 x 4096 M = 16 15.3 against 18.2);
    with fewer it is slower on 20 of 21. FP8 is not offered them (12-156% slower), nor FP4, whose
    dequantization costs more instructions than INT4's: at M = 16 the wave model's 32-row pick is
    faster on 3 of 4 shapes measured (MXFP4 28672 x 8192: R32_W4_B4 54.7 us against R64_W4_B2
    64.6) and 1-3% slower on the fourth (14336 x 4096). R64_W8_B1 (one
    block of 8 warps a SM) is taken where those blocks fill between half the SMs and all of them,
    or, its K split 2 ways as a cluster, between a quarter and a half, while each of the cluster's
    16 warps keeps ``four_wide_min_chunks`` chunks: faster in 45 of the 48 cases where this rule
    changes the pick (by up to 17%), slower in 3 by at most 2.9%. A split needs 16 rows of ``a``
    (with one M tile of 9 rows it is 6-11% slower).

    R32_W8_B1_EVEN_ODD replaces R32_W16_B1 where K has at most ``even_odd_max_chunks`` chunks and
    the sums are scaled after the chunk (INT4, whole-chunk groups): at M tiles of 16 rows and a
    short K the chain of dependent mma, not the memory, sets the pace (4096^2 M = 16: 6.5 against
    6.9; 4096 x 8192, 64 chunks, 3% slower, so it stops at 32)."""

    inflight_kb: float = 20
    block_chunks: float = 1.0
    four_wide_min_chunks: int = 4
    even_odd_max_chunks: int = 32


DECODE = DecodeCosts()
#: The wave model's candidates, in the order that breaks its ties: M <= 8 (16-row blocks), and M
#: tiles of 16 rows (32-row blocks).
DECODE_WAVE_CONFIGS = {
    False: (R16_W8_B3, R16_W8_B4, R16_W16_B2, R16_W4_B8),
    True: (R32_W8_B2, R32_W4_B4, R32_W16_B1),
}


def decode_estimate(cfg: DecodeConfig, blocks: int, sms: int, nchunks: int) -> float:
    """The wave model's time for ``blocks`` blocks of ``cfg`` over ``nchunks`` chunks of K, in
    rounds: waves of (blocks per SM x SMs) blocks, each as long as a warp's chunks (plus
    DECODE.block_chunks) times max(1, KB in flight per SM / DECODE.inflight_kb)."""
    slots = cfg.blocks_per_sm * sms
    per_warp = ceil_div(nchunks, cfg.warps) + DECODE.block_chunks
    kb = cfg.row_tiles * min(cfg.warps, nchunks)  # per block: warps past the chunks stream nothing
    total, left = 0.0, blocks
    while left > 0:
        wave = min(slots, left)
        left -= wave
        total += per_warp * max(1.0, wave / sms * kb / DECODE.inflight_kb)
    return total


def decode_config(
    blocks: int,
    sms: int,
    nchunks: int,
    two: bool = False,
    four_blocks: int = 0,
    split_ok: bool = False,
    even_odd_ok: bool = False,
) -> DecodeConfig:
    """The decode kernel's configuration for a launch of ``blocks`` blocks of 16 weight rows (of
    32 with ``two``, M tiles of 16 rows; times the M tiles) over ``nchunks`` chunks of K.

    The 64-row blocks come first, since the wave model does not see their halved activation reads:
    R64_W4_B2 when its ``four_blocks`` blocks (0 where not offered: FP8, M <= 8) outnumber the SMs,
    R64_W8_B1 where four_wide_splits takes it (``split_ok``: a K split may be offered). Otherwise the
    wave model's least estimate among DECODE_WAVE_CONFIGS, with R32_W8_B1_EVEN_ODD in place of
    R32_W16_B1 for a short K where ``even_odd_ok`` (the sums are scaled after each chunk). The
    costs and their measurements: DecodeCosts."""
    if two and four_blocks > sms:
        return R64_W4_B2
    if two and four_blocks and four_wide_splits(four_blocks, sms, nchunks, split_ok):
        return R64_W8_B1
    pick = min(DECODE_WAVE_CONFIGS[bool(two)], key=lambda cfg: decode_estimate(cfg, blocks, sms, nchunks))
    if pick == R32_W16_B1 and even_odd_ok and nchunks <= DECODE.even_odd_max_chunks:
        return R32_W8_B1_EVEN_ODD
    return pick


def four_wide_splits(four_blocks: int, sms: int, nchunks: int, split_ok: bool) -> int:
    """R64_W8_B1's K split for ``four_blocks`` blocks of 64 rows (times the M tiles), or 0 where it
    does not apply: 1 when they fill between half the SMs and all of them; 2 when they fill between a
    quarter and a half, ``split_ok`` and each of the cluster's 16 warps keeps at least
    DECODE.four_wide_min_chunks chunks."""
    if sms < 2 * four_blocks <= 2 * sms:
        return 1
    if split_ok and sms < 4 * four_blocks <= 2 * sms and nchunks >= 16 * DECODE.four_wide_min_chunks:
        return 2
    return 0


def decode_splits(cfg: DecodeConfig, blocks: int, sms: int, nchunks: int) -> int:
    """Into how many blocks (one thread-block cluster) the decode kernel splits each tile's K, for
    ``blocks`` blocks of ``cfg`` over ``nchunks`` chunks (compute capability 9.0+): only R64_W8_B1
    is split, as four_wide_splits says."""
    return max(1, four_wide_splits(blocks, sms, nchunks, True)) if cfg == R64_W8_B1 else 1


# ---------------------------------------------------------------- launches
def plan(p: Problem) -> list:
    """The :class:`Step` launches of the decode kernel for ``p``, in the configuration
    decode_config picks, one per 16 * 65535 rows of a. The kernel's arguments: a, the weight's data,
    scales, zero points (or null) and NVFP4 scale_2 (or null), y. INT4 with whole-chunk groups
    scales each chunk's float32 partial sums (scale_after_sum), the chunks' blocks of 8 k transposed
    (the kernel reads the activations that way; FP4 weights are in that order too, dequantized
    before the mma)."""
    sid = p.sid
    nchunks = p.K // CHUNK[p.fmt]
    scale_after_sum = p.k_permuted and sid in INT4_IDS
    rows_per_launch = TILE_ROWS * MAX_GRID_YZ
    steps = []
    for m0 in range(0, p.M, rows_per_launch):
        mrows = min(rows_per_launch, p.M - m0)
        two = mrows > 8
        mtiles = ceil_div(mrows, 16)
        # the 64-row blocks for INT4 only (DecodeCosts: FP8 and FP4 are faster without them)
        four_blocks = ceil_div(p.N, 64) * mtiles if two and sid in INT4_IDS else 0
        cfg = decode_config(
            ceil_div(p.N, 32 if two else 16) * mtiles,
            p.sms,
            nchunks,
            two,
            four_blocks,
            p.cluster_launch and mrows >= 16,
            scale_after_sum,
        )
        k = _jit.kernel(p.device, FAMILY, "w16_decode", p.t.ctype, sid, *cfg.targs, scale_after_sum)
        smem = decode_smem(cfg)
        _workspace.raise_smem_limit(p.device, k, smem)
        grid = (ceil_div(p.N, cfg.rows), mtiles)
        splits = decode_splits(cfg, grid[0] * mtiles, p.sms, nchunks) if p.cluster_launch else 1
        cluster = (1, 1, splits) if splits > 1 else None
        launches = []
        for early in (False, True) if p.pdl else (False,):
            a = np.array((mrows, p.N, p.K, p.lda, p.ng, p.gshift, int(early)), dtype=ARGS)[()]
            launches.append(
                Launch(k, grid + (splits,), (32 * cfg.warps,), (ARG,) * 6 + (a,), smem=smem, pdl=p.pdl, cluster=cluster)
            )
        itemsize = p.t.dtype.itemsize
        steps.append(
            Step(
                launches[0], launches[-1] if p.pdl else None, m0 * p.lda * itemsize, m0 * p.N * itemsize, None, 0, None
            )
        )
    return steps
