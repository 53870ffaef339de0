"""The sm80 gemm (``kernels/weight_sm80_gemm.cu``, ``sm80_w16_gemm``): the matmul for more rows of
activations on GPUs without the sm90 kernel, a pipelined ``mma.sync`` GEMM whose weights are
dequantized in registers; when its tiles cannot fill the GPU, K is split across blocks and the last
block of a tile adds the float32 partials in split order. Its tile table (each row its template
arguments), its cost model (tile and K split), its argument struct and the plan of its launches
(:func:`~cupyquant.weight.problem.gemm_steps`, shared with the sm90 gemm)."""

from __future__ import annotations

from typing import NamedTuple

from .. import _device, _dtypes, _jit
from .._sizes import ceil_div
from .formats import FP4_IDS, FP8_IDS, INT4_IDS
from .problem import GEMM_BN, Problem, gemm_args, gemm_steps

_BOOLS = (False, True)


# ---------------------------------------------------------------- tiles
class Sm80GemmConfig(NamedTuple):
    """A tile of the sm80 gemm; the fields are its template arguments."""

    m_tiles: int  # m16 tiles per warp
    warps_m: int  # warps along M (4 along N each)
    stages: int  # depth of the cp.async ring


#: Each tile and the scale_after_sum values it is built with (4 m16 tiles a warp have no registers
#: for that second set of accumulators).
CONFIGS = {
    Sm80GemmConfig(1, 1, 4): _BOOLS,
    Sm80GemmConfig(2, 1, 4): _BOOLS,
    Sm80GemmConfig(4, 1, 4): (False,),
    Sm80GemmConfig(4, 2, 3): (False,),
}
BN = GEMM_BN  # output columns per block
BK = 128  # K per stage


def tile_rows(cfg: Sm80GemmConfig) -> int:
    return 16 * cfg.m_tiles * cfg.warps_m


def smem_bytes(cfg: Sm80GemmConfig, fp8: bool = False) -> int:
    """A stage's activations and weights (4 bits a weight, FP8 8), ``cfg.stages`` deep."""
    return cfg.stages * (tile_rows(cfg) * BK * 2 + BN * BK // (1 if fp8 else 2))


#: weight_sm80_gemm.cu GemmArgs
ARGS = gemm_args("kperm")
FAMILY = _jit.register(
    "weight_sm80_gemm",
    [
        e
        for cfg, scale_after_sum in CONFIGS.items()
        for e in _jit.product("sm80_w16_gemm", _dtypes.HALF_CTYPES, INT4_IDS, *[(v,) for v in cfg], scale_after_sum)
    ]
    + [
        e
        for cfg in CONFIGS
        for e in _jit.product("sm80_w16_gemm", _dtypes.HALF_CTYPES, FP4_IDS + FP8_IDS, *[(v,) for v in cfg], (False,))
    ],
)

# ---------------------------------------------------------------- cost model
#: (largest M, tile): the smallest tile that covers M, so each weight byte is read once per
#: ceil(M / rows) row tiles; past 64 rows, 128-row tiles of 8 warps.
TILES = (
    (16, Sm80GemmConfig(1, 1, 4)),
    (32, Sm80GemmConfig(2, 1, 4)),
    (64, Sm80GemmConfig(4, 1, 4)),
    (None, Sm80GemmConfig(4, 2, 3)),
)
#: Each K split of the sm80 gemm streams at least this many stages (pipeline fill, reduction).
MIN_SPLIT_STAGES = 4


#: Shared bytes a block of the kernel holds besides the ring (a K split's flag and the like), kept
#: free under the device's limit
SMEM_SPARE = 1024


def config(M: int, fp8: bool = False, smem_limit: int | None = None) -> Sm80GemmConfig:
    """The smallest tile that covers M (TILES); where its ring does not fit ``smem_limit`` bytes a
    block (99 KB on compute capability 8.6, 8.9 and 12.x: FP8 past 32 rows, INT4 past 64), the
    largest smaller tile that does."""
    want = next(cfg for limit, cfg in TILES if limit is None or M <= limit)
    fits = [cfg for _, cfg in TILES if smem_limit is None or smem_bytes(cfg, fp8) + SMEM_SPARE <= smem_limit]
    return want if want in fits else max((c for c in fits if tile_rows(c) < tile_rows(want)), key=tile_rows)


def splits(tiles: int, iters_total: int, blocks: int):
    """(splits, stages per split): split K across blocks until the tiles fill ``blocks`` slots,
    keeping at least MIN_SPLIT_STAGES stages per split."""
    if tiles >= blocks:
        return 1, iters_total
    splits = max(1, min(iters_total // MIN_SPLIT_STAGES, ceil_div(blocks, tiles)))
    iters = ceil_div(iters_total, splits)
    return ceil_div(iters_total, iters), iters


# ---------------------------------------------------------------- launches
def plan(p: Problem) -> list:
    """The :class:`Step` launches of the sm80 gemm for ``p``: the smallest tile that covers M (that
    fits the device's shared memory), a K split where its tiles cannot fill the GPU."""
    fp8 = p.sid in FP8_IDS
    cfg = config(p.M, fp8, _device.smem_per_block(p.device))
    scale_after_sum = p.group % BK == 0 and cfg.m_tiles < 4 and not fp8
    k = _jit.kernel(p.device, FAMILY, "sm80_w16_gemm", p.t.ctype, p.sid, *cfg, scale_after_sum)
    smem = smem_bytes(cfg, fp8)
    return gemm_steps(p, k, 128 * cfg.warps_m, smem, tile_rows(cfg), BK, splits, ARGS, p.k_permuted)
