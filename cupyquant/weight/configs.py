"""The weight family's kernel configurations and their registration with the loader.

Each table here is the one source of a kernel's configurations: the fields of a row are the
kernel's template arguments in order, and the planners (:mod:`.plan`) and launchers (:mod:`.launch`)
read the same rows. The argument structs mirror the kernels' ``struct ... Args`` (tests/test_launch.py
checks the layouts).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import _dtypes, _jit

_BOOLS = (False, True)

# Weight schemes of the kernels (kernels/weight_mma.cuh W_INT4, W_UINT4, W_FP8, W_NVFP4, W_MXFP4;
# weight_quant.cu W_INT8). SCHEME_IDS: the matmul kernels' schemes; QUANT_SCHEME_IDS:
# weight_quant.cu's, which also quantizes and dequantizes INT8 (W8A8) weights, which no weight-only
# matmul takes.
WEIGHT_INT4, WEIGHT_UINT4, WEIGHT_FP8, WEIGHT_INT8, WEIGHT_NVFP4, WEIGHT_MXFP4 = 0, 1, 2, 3, 4, 5
SCHEME_IDS = {
    "int4": WEIGHT_INT4,
    "uint4": WEIGHT_UINT4,
    "float8_e4m3fn": WEIGHT_FP8,
    "nvfp4": WEIGHT_NVFP4,
    "mxfp4": WEIGHT_MXFP4,
}
QUANT_SCHEME_IDS = {n: i for n, i in SCHEME_IDS.items() if n not in ("nvfp4", "mxfp4")} | {"int8": WEIGHT_INT8}
INT4_IDS = (WEIGHT_INT4, WEIGHT_UINT4)
FP4_IDS = (WEIGHT_NVFP4, WEIGHT_MXFP4)
#: The FP4 formats: E2M1 codes with a scale byte per block of ``block`` k (E4M3 or E8M0).
FP4_BLOCK = {"nvfp4": 16, "mxfp4": 32}

#: K of one chunk of the prepared layout: 64 bytes of a weight row (the decode kernel's K step).
CHUNK = {"int4": 128, "uint4": 128, "float8_e4m3fn": 64, "nvfp4": 128, "mxfp4": 128}
#: The largest grid y; launches with more row tiles than this are cut into several.
MAX_GRID_Y = 65535


# ---------------------------------------------------------------- decode kernel
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

#: Every decode configuration (plan.py says which serves which shapes).
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


# ---------------------------------------------------------------- sm80 gemm (mma.sync, cp.async)
class Sm80GemmConfig(NamedTuple):
    """A tile of the sm80 gemm; the fields are its template arguments."""

    m_tiles: int  # m16 tiles per warp
    warps_m: int  # warps along M (4 along N each)
    stages: int  # depth of the cp.async ring


#: Each tile and the scale_after_sum values it is built with (4 m16 tiles a warp have no registers
#: for that second set of accumulators).
SM80_GEMM_CONFIGS = {
    Sm80GemmConfig(1, 1, 4): _BOOLS,
    Sm80GemmConfig(2, 1, 4): _BOOLS,
    Sm80GemmConfig(4, 1, 4): (False,),
    Sm80GemmConfig(4, 2, 3): (False,),
}
SM80_GEMM_BN = 128  # output columns per block
SM80_GEMM_BK = 128  # K per stage


def sm80_gemm_rows(cfg: Sm80GemmConfig) -> int:
    return 16 * cfg.m_tiles * cfg.warps_m


def sm80_gemm_smem(cfg: Sm80GemmConfig) -> int:
    return cfg.stages * (sm80_gemm_rows(cfg) * SM80_GEMM_BK * 2 + SM80_GEMM_BN * SM80_GEMM_BK // 2)


# ---------------------------------------------------------------- sm90 gemm (wgmma, TMA)
class Sm90GemmConfig(NamedTuple):
    """A tile of the sm90 gemm; the fields are its template arguments."""

    rows: int  # rows of a per tile
    stages: int  # depth of the shared-memory ring
    halves: int  # 64-k halves per stage


#: The sm90 gemm's tiles, each built for both prepared INT4 orders (k_permuted false and true).
SM90_GEMM_CONFIGS = (
    Sm90GemmConfig(32, 6, 2),
    Sm90GemmConfig(64, 4, 2),
    Sm90GemmConfig(128, 5, 2),
    Sm90GemmConfig(256, 6, 1),
)
SM90_GEMM = {c.rows: c for c in SM90_GEMM_CONFIGS}
SM90_GEMM_BN = 128  # weight rows per tile
SM90_GEMM_BK = 64  # the unit of K the plans count in (one half)
SM90_GEMM_TMA_ROWS = 128  # the tile that loads its activations by TMA, from a producer warpgroup
SM90_GEMM_THREADS = {32: 256, 64: 256, 128: 384, 256: 256}
SM90_GEMM_BLOCKS_PER_SM = {32: 2, 64: 2, 128: 1, 256: 1}  # registers (launch bounds) and shared memory
SM90_GEMM_SCALE_BYTES = 640  # a 64-k half's scales (8 tiles x 64 bytes) and zero codes (8 x 16)


def sm90_gemm_smem(rows: int) -> int:
    """The ring (stages slots of activations and weights), the scale ring (stages slots of
    SM90_GEMM_SCALE_BYTES a half), and 1 KB to align the first slot to 1024 bytes."""
    cfg = SM90_GEMM[rows]
    return cfg.stages * cfg.halves * (rows * 128 + SM90_GEMM_BN * 32 + SM90_GEMM_SCALE_BYTES) + 1024


# ---------------------------------------------------------------- argument structs
QUANT_ARGS = np.dtype([("N", np.int64), ("K", np.int64), ("ng", np.int64), ("G", np.int32)], align=True)
#: weight_quantize_block / weight_dequantize_block (WBlockArgs): kb the blocks along K.
BLOCK_ARGS = np.dtype([("N", np.int64), ("K", np.int64), ("kb", np.int64)], align=True)
#: Rows and columns of a block of block-scaled FP8 weights (weight_quantize_block).
BLOCK = 128
DECODE_ARGS = np.dtype(
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
SM80_GEMM_ARGS = np.dtype(
    [
        ("M", np.int64),
        ("N", np.int64),
        ("K", np.int64),
        ("lda", np.int64),
        ("ng", np.int64),
        ("gshift", np.int32),
        ("splits", np.int32),
        ("iters", np.int32),
        ("kperm", np.int32),
    ],
    align=True,
)
# the same layout, the last field the early flag
SM90_GEMM_ARGS = np.dtype(
    [(n if n != "kperm" else "early", SM80_GEMM_ARGS.fields[n][0]) for n in SM80_GEMM_ARGS.names], align=True
)


# ---------------------------------------------------------------- registration
# Kernel families are the kernels/ file stems; the decode and gemm kernels take the fp16/bf16 matmul
# types only, scale_after_sum (the last template argument) as in each table.
QUANT_FAMILY = _jit.register(
    "weight_quant",
    _jit.product("weight_quantize", _dtypes.INPUT_CTYPES, QUANT_SCHEME_IDS.values())
    + _jit.product("weight_dequantize", _dtypes.INPUT_CTYPES, _dtypes.INPUT_CTYPES, QUANT_SCHEME_IDS.values())
    + _jit.product("weight_code_sum", (WEIGHT_INT8,))
    + _jit.product("weight_quantize_block", _dtypes.INPUT_CTYPES)
    + _jit.product("weight_dequantize_block", _dtypes.INPUT_CTYPES)
    + _jit.product("weight_dequantize_fp4", _dtypes.INPUT_CTYPES, FP4_IDS)
    + _jit.product("weight_scale_2", (WEIGHT_NVFP4,)),
)
# FP4 weights are dequantized before the mma (no scale_after_sum), and not offered the even/odd
# configuration, which serves scale_after_sum only.
DECODE_FAMILY = _jit.register(
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
        for e in _jit.product("w16_decode", _dtypes.HALF_CTYPES, FP4_IDS, *[(v,) for v in cfg.targs], (False,))
    ],
)
SM80_GEMM_FAMILY = _jit.register(
    "weight_sm80_gemm",
    [
        e
        for cfg, scale_after_sum in SM80_GEMM_CONFIGS.items()
        for e in _jit.product("sm80_w16_gemm", _dtypes.HALF_CTYPES, INT4_IDS, *[(v,) for v in cfg], scale_after_sum)
    ]
    + [
        e
        for cfg in SM80_GEMM_CONFIGS
        for e in _jit.product("sm80_w16_gemm", _dtypes.HALF_CTYPES, FP4_IDS, *[(v,) for v in cfg], (False,))
    ],
)
# wgmma exists only on sm_90a, and the kernel has no portable build (it traps elsewhere). FP4
# weights are always in the k-permuted order (k_permuted true).
SM90_GEMM_FAMILY = _jit.register(
    "weight_sm90_gemm",
    [
        e
        for cfg in SM90_GEMM_CONFIGS
        for e in _jit.product("sm90_w16_gemm", _dtypes.HALF_CTYPES, INT4_IDS, *[(v,) for v in cfg], _BOOLS)
    ]
    + [
        e
        for cfg in SM90_GEMM_CONFIGS
        for e in _jit.product("sm90_w16_gemm", _dtypes.HALF_CTYPES, FP4_IDS, *[(v,) for v in cfg], (True,))
    ],
    specific_targets=("90",),
    specific_required=True,
)
