"""The matmul's planners: which kernel a call takes, and each kernel's configuration.

Every fitted cost and threshold is data at the top of this module, each with what it is and how it
was fitted; the functions below only read them. Timings are on an H100 SXM (132 SMs) unless said,
bf16 activations, INT4 weights in groups of 128, microseconds per call of ``scripts/bench.py``
(CUDA graphs of back-to-back calls); BENCHMARKS.md has the full tables.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import configs as C


# ---------------------------------------------------------------- which kernel
@dataclass(frozen=True)
class PathThresholds:
    """Where the decode kernel hands over to a tensor-core gemm (INT4; FP8 always takes decode).

    The decode kernel reads each weight byte once per 16 rows of ``a``, so its time grows with M
    from the start; the gemms read it once per tile of 16-256 rows but pay a pipeline fill (and a K
    split's reduction), which a small weight does not amortize."""

    decode_max_m: int = 16  # decode for every M up to this, on every GPU
    # sm90 (wgmma): decode also for M <= sm90_decode_max_m while M x N < sm90_decode_mn_per_sm x SMs
    # (202,752 on 132 SMs: N = 4096 up to M = 32, 8192 up to 24). With two M tiles the decode kernel
    # is faster wherever this gives it the call (4096 x 14336 M = 32: 20.7 against 26.8); with three
    # it is slower on 9 of 10 shapes, by up to 60%.
    sm90_decode_max_m: int = 32
    sm90_decode_mn_per_sm: int = 1536
    # FP4 weights, whose dequantization costs the decode kernel more, take the sm90 gemm from M = 17:
    # at M = 32 it is faster on 4096 x 14336 (22.1 against 28.9) and slower on 4096^2 (10.3 against 9.6).
    # Other GPUs (mma.sync gemm): decode up to M = 64 below 2^26 weights and up to 256 below 2^25,
    # from scripts/bench.py --matmul-paths on an H200 (4096^2: M = 128 46 against 115, M = 1024 312
    # against 189; 14336 x 4096 M = 64 78 against 100, M = 128 149 against 132).
    small_weight: int = 1 << 25
    small_weight_decode_max_m: int = 256
    mid_weight: int = 1 << 26
    mid_weight_decode_max_m: int = 64


PATHS = PathThresholds()
#: Compute capabilities (as CuPy spells them) that run the sm90 gemm.
SM90_ARCHS = ("90",)
#: The path names matmul_path returns, and the older spellings still accepted as input.
PATH_NAMES = ("decode", "sm80_gemm", "sm90_gemm")
PATH_ALIASES = {"pipelined": "sm80_gemm", "wgmma": "sm90_gemm"}


def choose_path(M: int, N: int, K: int, fp8: bool, arch, sms, fp4: bool = False) -> str:
    """The kernel for ``M`` rows of ``a`` times an (N, K) weight (see PathThresholds); FP4 weights
    (``fp4``) take INT4's paths except the sm90 decode extension past M = 16."""
    if fp8 or M <= PATHS.decode_max_m:
        return "decode"
    if arch in SM90_ARCHS and K < 1 << 31:  # the sm90 kernel's group index is 32-bit
        if not fp4 and M <= PATHS.sm90_decode_max_m and M * N < PATHS.sm90_decode_mn_per_sm * sms:
            return "decode"
        return "sm90_gemm"
    w = N * K
    if (
        M <= PATHS.small_weight_decode_max_m
        and w < PATHS.small_weight
        or M <= PATHS.mid_weight_decode_max_m
        and w < PATHS.mid_weight
    ):
        return "decode"
    return "sm80_gemm"


# ---------------------------------------------------------------- decode kernel
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
    False: (C.R16_W8_B3, C.R16_W8_B4, C.R16_W16_B2, C.R16_W4_B8),
    True: (C.R32_W8_B2, C.R32_W4_B4, C.R32_W16_B1),
}


def decode_estimate(cfg: C.DecodeConfig, blocks: int, sms: int, nchunks: int) -> float:
    """The wave model's time for ``blocks`` blocks of ``cfg`` over ``nchunks`` chunks of K, in
    rounds: waves of (blocks per SM x SMs) blocks, each as long as a warp's chunks (plus
    DECODE.block_chunks) times max(1, KB in flight per SM / DECODE.inflight_kb)."""
    slots = cfg.blocks_per_sm * sms
    per_warp = -(-nchunks // cfg.warps) + DECODE.block_chunks
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
) -> C.DecodeConfig:
    """The decode kernel's configuration for a launch of ``blocks`` blocks of 16 weight rows (of
    32 with ``two``, M tiles of 16 rows; times the M tiles) over ``nchunks`` chunks of K.

    The 64-row blocks come first, since the wave model does not see their halved activation reads:
    R64_W4_B2 when its ``four_blocks`` blocks (0 where not offered: FP8, M <= 8) outnumber the SMs,
    R64_W8_B1 where four_wide_splits takes it (``split_ok``: a K split may be offered). Otherwise the
    wave model's least estimate among DECODE_WAVE_CONFIGS, with R32_W8_B1_EVEN_ODD in place of
    R32_W16_B1 for a short K where ``even_odd_ok`` (the sums are scaled after each chunk). The
    costs and their measurements: DecodeCosts."""
    if two and four_blocks > sms:
        return C.R64_W4_B2
    if two and four_blocks and four_wide_splits(four_blocks, sms, nchunks, split_ok):
        return C.R64_W8_B1
    pick = min(DECODE_WAVE_CONFIGS[bool(two)], key=lambda cfg: decode_estimate(cfg, blocks, sms, nchunks))
    if pick == C.R32_W16_B1 and even_odd_ok and nchunks <= DECODE.even_odd_max_chunks:
        return C.R32_W8_B1_EVEN_ODD
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


def decode_splits(cfg: C.DecodeConfig, blocks: int, sms: int, nchunks: int) -> int:
    """Into how many blocks (one thread-block cluster) the decode kernel splits each tile's K, for
    ``blocks`` blocks of ``cfg`` over ``nchunks`` chunks (compute capability 9.0+): only R64_W8_B1
    is split, as four_wide_splits says."""
    return max(1, four_wide_splits(blocks, sms, nchunks, True)) if cfg == C.R64_W8_B1 else 1


# ---------------------------------------------------------------- sm80 gemm
#: (largest M, tile): the smallest tile that covers M, so each weight byte is read once per
#: ceil(M / rows) row tiles; past 64 rows, 128-row tiles of 8 warps.
SM80_GEMM_TILES = (
    (16, C.Sm80GemmConfig(1, 1, 4)),
    (32, C.Sm80GemmConfig(2, 1, 4)),
    (64, C.Sm80GemmConfig(4, 1, 4)),
    (None, C.Sm80GemmConfig(4, 2, 3)),
)
#: Each K split of the sm80 gemm streams at least this many stages (pipeline fill, reduction).
SM80_MIN_SPLIT_STAGES = 4


def sm80_gemm_config(M: int) -> C.Sm80GemmConfig:
    for limit, cfg in SM80_GEMM_TILES:
        if limit is None or M <= limit:
            return cfg


def sm80_splits(tiles: int, iters_total: int, blocks: int):
    """(splits, stages per split): split K across blocks until the tiles fill ``blocks`` slots,
    keeping at least SM80_MIN_SPLIT_STAGES stages per split."""
    if tiles >= blocks:
        return 1, iters_total
    splits = max(1, min(iters_total // SM80_MIN_SPLIT_STAGES, -(-blocks // tiles)))
    iters = -(-iters_total // splits)
    return -(-iters_total // iters), iters


# ---------------------------------------------------------------- sm90 gemm
@dataclass(frozen=True)
class Sm90Costs:
    """Estimated microseconds of an sm90 gemm call (sm90_estimate), fitted by least squares
    (relative error) to 587 timings of every plan the planner may pick, forced in turn, over 35
    cells (4096^2 M = 32-1024, the other benchmark shapes M = 32-1024, 4096 x 14336 M = 200,
    4096 x 11008, 11008 x 4096, 2048 x 8192): rms error 4%, at most 11%; the plan picked is within
    3% of the fastest measured on all 35 cells (4096 x 11008 M = 128: 128/4 26.1, 128/3 25.4), 0.1%
    on average."""

    # rows -> (a 64-k stage of a block's main loop with one block a SM in one wave; the same for
    # each block where two share an SM (32 and 64 rows) or each wave past the first (128, 256))
    stage_us: tuple = ((32, (0.245, 0.221)), (64, (0.271, 0.247)), (128, (0.340, 0.375)), (256, (0.600, 0.644)))
    call_us: float = 1.47  # every call
    # K split through the float32 workspace: (fixed, per split and row of the tile; partial tiles are whole)
    workspace_split_us: tuple = (2.92, 0.0101)
    # K split 2 ways as a cluster: (fixed, per row of a up to the tile's). The fixed part is the
    # highest at which 14336 x 4096 M = 32 and 64 take the faster 2-way split (64/2 19.2 against
    # 64/1 20.1); it moves 20 picks of an 18-shape x 14-M grid, 19 of them faster by 1-9%.
    cluster2_split_us: tuple = (0.8, 0.0091)
    # K split 3 to 8 ways as clusters: (fixed, per row of a up to the tile's)
    wide_cluster_split_us: tuple = (2.15, 0.0122)

    def stage(self, rows: int):
        return dict(self.stage_us)[rows]


SM90 = Sm90Costs()
#: K splits run as thread-block clusters whose blocks add their partials through distributed shared
#: memory (no workspace, counters or memset; the same bits): 2 ways always, 3 to 8 ways where every
#: tile's cluster fits on the GPU at once with one block per SM. A cluster's blocks share a GPC,
#: so the H100 holds 30 clusters of 4 (not 33) and 15 of 8; clusters that do not all fit run in two
#: waves (128 blocks in clusters of 4: twice the time of the same blocks unclustered). Clusters of
#: 2 against the workspace: 4096^2 M = 256 128/2 21.8 against 28.0.
CLUSTER_SPLITS = True


def sm90_estimate(rows: int, tiles: int, splits: int, iters: int, sms: int, M: int, cluster=None) -> float:
    """Estimated microseconds of an sm90 gemm call (Sm90Costs) with tiles of ``rows`` rows of a,
    ``tiles`` tiles, K of ``iters`` 64-k stages split ``splits`` ways. ``cluster``: the splits run
    as clusters (default: 2 splits, while CLUSTER_SPLITS); clusters of more than 2 blocks run one
    block per SM."""
    if cluster is None:
        cluster = splits == 2 and CLUSTER_SPLITS
    blocks = tiles * splits
    one, per = SM90.stage(rows)
    per_sm = -(-blocks // sms)  # blocks on the busiest SM (32/64 rows, two a SM) or waves (one a SM)
    stage = one if per_sm == 1 else per * per_sm
    tile_rows = min(rows, M)
    if splits == 1:
        split = 0.0
    elif cluster:
        fixed, per_row = SM90.cluster2_split_us if splits == 2 else SM90.wide_cluster_split_us
        split = fixed + per_row * tile_rows
    else:
        fixed, per_row = SM90.workspace_split_us
        split = fixed + per_row * splits * rows
    return SM90.call_us + stage * -(-iters // splits) + split


def wide_cluster_fits(cluster_cap, splits: int, tiles: int) -> bool:
    """Whether the ``tiles`` clusters of ``splits`` > 2 blocks all fit on the GPU at once with one
    block per SM (``cluster_cap``: splits -> clusters that fit; None: none do)."""
    return bool(CLUSTER_SPLITS and cluster_cap and tiles <= cluster_cap.get(splits, 0))


def sm90_plan(M: int, N: int, iters: int, sms: int, cluster_cap=None):
    """(rows of a per tile, K splits) for the sm90 gemm: the least sm90_estimate over tiles of
    256 / 128 / 64 rows (and 32 where M <= 32) and splits 1 / 2 / 3 / 4 / 6 / 8 (a split only while
    its blocks fit in one wave, or as clusters that all fit at once: ``cluster_cap``, splits ->
    clusters resident with one block per SM; None: only 2 splits are clusters); ties go to the
    taller tile and fewer splits."""
    best = None
    for rows in (256, 128, 64, 32):
        if rows == 32 and M > 32:
            break  # the 32-row tile serves M <= 32 only (two tiles of 32 rows read the weights twice)
        tiles = -(-N // C.SM90_GEMM_BN) * -(-M // rows)
        for splits in (1, 2, 3, 4, 6, 8):
            if splits > iters:
                break
            wide = splits > 2 and wide_cluster_fits(cluster_cap, splits, tiles)
            if splits > 1 and not wide and tiles * splits > C.SM90_GEMM_BLOCKS_PER_SM[rows] * sms:
                continue
            est = sm90_estimate(rows, tiles, splits, iters, sms, M, cluster=(splits == 2 and CLUSTER_SPLITS) or wide)
            if best is None or est < best[0] * 0.999:
                best = (est, rows, splits)
    return best[1], best[2]
