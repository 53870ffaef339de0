"""The sm90 gemm (``kernels/weight_sm90_gemm.cu``, ``sm90_w16_gemm``): the matmul for more rows of
activations on GPUs of compute capability 9.0, Hopper's warpgroup instructions with the dequantized
weights as the register operand, K streamed through shared memory, split across blocks (as
thread-block clusters adding their partials through distributed shared memory, or through a
float32 workspace) when few tiles and a long K make that pay. Its tile table (each row its template
arguments), its cost models (tile height and K split, fitted to H100 timings; FP8 weights' to H200
timings), its argument struct and the plan of its launches
(:func:`~cupyquant.weight.problem.gemm_steps`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .. import _device, _dtypes, _jit, _workspace
from .._sizes import ceil_div
from .formats import FP4_IDS, FP8_IDS, INT4_IDS
from .problem import GEMM_BN, Problem, gemm_args, gemm_steps

_BOOLS = (False, True)


# ---------------------------------------------------------------- tiles
class Sm90GemmConfig(NamedTuple):
    """A tile of the sm90 gemm; the fields are its template arguments."""

    rows: int  # rows of a per tile
    stages: int  # depth of the shared-memory ring
    halves: int  # 64-k halves per stage


#: The sm90 gemm's tiles, each built for both prepared INT4 orders (k_permuted false and true).
CONFIGS = (
    Sm90GemmConfig(32, 6, 2),
    Sm90GemmConfig(64, 4, 2),
    Sm90GemmConfig(128, 5, 2),
    Sm90GemmConfig(256, 6, 1),
)
TILES = {c.rows: c for c in CONFIGS}
#: The tiles of FP8 weights (a byte a weight: twice INT4's weight bytes a stage), shallower where
#: INT4's rings would not fit: the 32- and 64-row tiles keep two blocks a SM (4 stages, 104 KB; 3,
#: 103 KB), the 128-row tile's 4 stages fit in 227 KB (5 would take 252 KB), and the 256-row tile
#: takes 5 stages of 64 k (204 KB; 6 would take 245 KB), an odd ring whose scale sources step by
#: the stage's parity from K's start (weight_sm90_gemm.cu copy_w, ODD_RING).
FP8_CONFIGS = (
    Sm90GemmConfig(32, 4, 2),
    Sm90GemmConfig(64, 3, 2),
    Sm90GemmConfig(128, 4, 2),
    Sm90GemmConfig(256, 5, 1),
)
FP8_TILES = {c.rows: c for c in FP8_CONFIGS}
BN = GEMM_BN  # weight rows per tile
BK = 64  # the unit of K the plans count in (one half)
TMA_ROWS = 128  # the tile that loads its activations by TMA, from a producer warpgroup
THREADS = {32: 256, 64: 256, 128: 384, 256: 256}
BLOCKS_PER_SM = {32: 2, 64: 2, 128: 1, 256: 1}  # registers (launch bounds) and shared memory
SCALE_BYTES = 640  # a 64-k half's scales (8 tiles x 64 bytes) and zero codes (8 x 16)


def tiles(fp8: bool) -> dict:
    """rows -> the tile of that many rows of a, for FP8 weights or the others."""
    return FP8_TILES if fp8 else TILES


def epilogue_bytes(rows: int) -> int:
    """Shared bytes the epilogue of a tile reuses (weight_sm90_gemm.cu finish_tile): the rounded tile
    (rows of 136 halves), and past it (rounded up to 1 KB) the partials a block of a 2-way cluster
    split stages for the other block, 4 KB an 8-row group of the tile; more than the 3-to-8-way
    cluster split's float32 tile."""
    tile = rows * (BN + 8) * 2
    return (tile + 1023) // 1024 * 1024 + rows // 8 * 4096


def smem_bytes(rows: int, fp8: bool = False) -> int:
    """The ring (stages slots of activations and weights: 4 bits a weight, FP8 8), the scale ring
    (stages slots of SCALE_BYTES a half), or the epilogue's bytes where those are more, and 1 KB to
    align the first slot to 1024 bytes."""
    cfg = tiles(fp8)[rows]
    ring = cfg.stages * cfg.halves * (rows * 128 + BN * (64 if fp8 else 32) + SCALE_BYTES)
    return max(ring, epilogue_bytes(rows)) + 1024


#: weight_sm90_gemm.cu WgArgs: the sm80 gemm's layout, the last field the early flag
ARGS = gemm_args("early")
# wgmma exists only on sm_90a, and the kernel has no portable build (it traps elsewhere). FP4
# weights are always in the k-permuted order (k_permuted true), FP8 weights never.
FAMILY = _jit.register(
    "weight_sm90_gemm",
    [
        e
        for cfg in CONFIGS
        for e in _jit.product("sm90_w16_gemm", _dtypes.HALF_CTYPES, INT4_IDS, *[(v,) for v in cfg], _BOOLS)
    ]
    + [
        e
        for cfg in CONFIGS
        for e in _jit.product("sm90_w16_gemm", _dtypes.HALF_CTYPES, FP4_IDS, *[(v,) for v in cfg], (True,))
    ]
    + [
        e
        for cfg in FP8_CONFIGS
        for e in _jit.product("sm90_w16_gemm", _dtypes.HALF_CTYPES, FP8_IDS, *[(v,) for v in cfg], (False,))
    ],
    specific_targets=_device.WGMMA_TARGETS,
    specific_required=True,
)


# ---------------------------------------------------------------- cost model
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
#: FP8 weights (a byte a weight: twice INT4's bytes a stage, the shallower FP8_CONFIGS rings), fitted
#: the same way to 460 timings on an H200 (bf16, groups of 128; the five benchmark shapes at M =
#: 17-2048, 65 cells, every plan forced): rms error 4%, at most 15%. The plan picked is the fastest
#: measured on each of the 62 cells that take the sm90 gemm; INT4's costs, whose stages come out
#: 13-48% cheaper, picked plans up to 16% slower there (4096 x 14336 M = 64: 64/4 33.2 us against
#: 64/8 28.6).
SM90_FP8 = Sm90Costs(
    stage_us=((32, (0.327, 0.290)), (64, (0.400, 0.341)), (128, (0.426, 0.457)), (256, (0.681, 0.723))),
    call_us=1.30,
    workspace_split_us=(2.61, 0.0102),
    cluster2_split_us=(1.40, 0.0123),
    wide_cluster_split_us=(1.77, 0.0160),
)


def costs(fp8: bool) -> Sm90Costs:
    """The estimate's costs for FP8 weights or the others (INT4, FP4)."""
    return SM90_FP8 if fp8 else SM90


#: K splits run as thread-block clusters whose blocks add their partials through distributed shared
#: memory (no workspace, counters or memset; the same bits): 2 ways always, 3 to 8 ways where every
#: tile's cluster fits on the GPU at once with one block per SM. A cluster's blocks share a GPC,
#: so the H100 holds 30 clusters of 4 (not 33) and 15 of 8; clusters that do not all fit run in two
#: waves (128 blocks in clusters of 4: twice the time of the same blocks unclustered). Clusters of
#: 2 against the workspace: 4096^2 M = 256 128/2 21.8 against 28.0.
CLUSTER_SPLITS = True


def sm90_estimate(
    rows: int, tiles: int, splits: int, iters: int, sms: int, M: int, cluster=None, fp8: bool = False
) -> float:
    """Estimated microseconds of an sm90 gemm call (Sm90Costs; FP8 weights: SM90_FP8) with tiles of
    ``rows`` rows of a, ``tiles`` tiles, K of ``iters`` 64-k stages split ``splits`` ways.
    ``cluster``: the splits run as clusters (default: 2 splits, while CLUSTER_SPLITS); clusters of
    more than 2 blocks run one block per SM."""
    if cluster is None:
        cluster = splits == 2 and CLUSTER_SPLITS
    c = costs(fp8)
    blocks = tiles * splits
    one, per = c.stage(rows)
    per_sm = ceil_div(blocks, sms)  # blocks on the busiest SM (32/64 rows, two a SM) or waves (one a SM)
    stage = one if per_sm == 1 else per * per_sm
    tile_rows = min(rows, M)
    if splits == 1:
        split = 0.0
    elif cluster:
        fixed, per_row = c.cluster2_split_us if splits == 2 else c.wide_cluster_split_us
        split = fixed + per_row * tile_rows
    else:
        fixed, per_row = c.workspace_split_us
        split = fixed + per_row * splits * rows
    return c.call_us + stage * ceil_div(iters, splits) + split


def wide_cluster_fits(cluster_cap, splits: int, tiles: int) -> bool:
    """Whether the ``tiles`` clusters of ``splits`` > 2 blocks all fit on the GPU at once with one
    block per SM (``cluster_cap``: splits -> clusters that fit; None: none do)."""
    return bool(CLUSTER_SPLITS and cluster_cap and tiles <= cluster_cap.get(splits, 0))


def sm90_plan(M: int, N: int, iters: int, sms: int, cluster_cap=None, fp8: bool = False):
    """(rows of a per tile, K splits) for the sm90 gemm: the least sm90_estimate (FP8 weights: their
    own costs) over tiles of 256 / 128 / 64 rows (and 32 where M <= 32) and splits 1 / 2 / 3 / 4 /
    6 / 8 (a split only while its blocks fit in one wave, or as clusters that all fit at once:
    ``cluster_cap``, splits -> clusters resident with one block per SM; None: only 2 splits are
    clusters); ties go to the taller tile and fewer splits."""
    best = None
    for rows in (256, 128, 64, 32):
        if rows == 32 and M > 32:
            break  # the 32-row tile serves M <= 32 only (two tiles of 32 rows read the weights twice)
        tiles = ceil_div(N, BN) * ceil_div(M, rows)
        for splits in (1, 2, 3, 4, 6, 8):
            if splits > iters:
                break
            wide = splits > 2 and wide_cluster_fits(cluster_cap, splits, tiles)
            if splits > 1 and not wide and tiles * splits > BLOCKS_PER_SM[rows] * sms:
                continue
            cluster = (splits == 2 and CLUSTER_SPLITS) or wide
            est = sm90_estimate(rows, tiles, splits, iters, sms, M, cluster=cluster, fp8=fp8)
            if best is None or est < best[0] * 0.999:
                best = (est, rows, splits)
    return best[1], best[2]


# ---------------------------------------------------------------- launches
def cluster_cap(device, t, sid, kp) -> dict:
    """splits -> clusters of the sm90 gemm (one block per SM) the device holds at once (once per
    device, from the 256-row tile's kernel of scheme ``sid``). A split whose clusters do not all fit
    at once would run in two waves, so those splits go through the workspace."""
    fp8 = sid in FP8_IDS
    cfg = tiles(fp8)[256]
    k = _jit.kernel(device, FAMILY, "sm90_w16_gemm", t.ctype, sid, *cfg, kp)
    return _workspace.cluster_capacity(device, k, THREADS[256], smem_bytes(256, fp8))


def plan(p: Problem) -> list:
    """The :class:`Step` launches of the sm90 gemm for ``p``: the tile and K split sm90_plan picks;
    the 128-row tile takes its activations by TMA through two tensor maps given at each call (the
    whole tiles' boxes and the last tile's rows), and with ``p.pdl`` the launch with the early flag
    copies its first stages' weights before its PDL wait."""
    cap = cluster_cap(p.device, p.t, p.sid, p.k_permuted) if CLUSTER_SPLITS else None
    fp8 = p.sid in FP8_IDS
    rows, n_splits = sm90_plan(p.M, p.N, p.K // BK, p.sms, cluster_cap=cap, fp8=fp8)
    cfg = tiles(fp8)[rows]
    k = _jit.kernel(p.device, FAMILY, "sm90_w16_gemm", p.t.ctype, p.sid, *cfg, p.k_permuted)

    def split(tiles, iters_total, slots):
        iters = ceil_div(iters_total, n_splits)
        return ceil_div(iters_total, iters), iters

    def in_cluster(splits, tiles):
        return CLUSTER_SPLITS and (splits == 2 or wide_cluster_fits(cap, splits, tiles))

    return gemm_steps(
        p,
        k,
        THREADS[rows],
        smem_bytes(rows, fp8),
        rows,
        BK * cfg.halves,
        split,
        ARGS,
        False,
        wide=(in_cluster, TMA_ROWS, BK),
    )
