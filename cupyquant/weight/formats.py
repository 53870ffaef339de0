"""The weight formats: their names and the kernels' numbers for them, the sizes their layouts are cut
in, and the :class:`~cupyquant.Scheme` of a weight. NumPy only; every other weight module builds on it."""

from __future__ import annotations

import numpy as np

from ..quantized import Scheme

# Weight schemes of the kernels (kernels/weight_mma.cuh W_INT4, W_UINT4, W_FP8, W_NVFP4, W_MXFP4,
# W_FP8_BLOCK; weight_quant.cu W_INT8). SCHEME_IDS: the matmul kernels' schemes by format;
# QUANT_SCHEME_IDS: weight_quant.cu's, which also quantizes and dequantizes INT8 (W8A8) weights,
# which no weight-only matmul takes. WEIGHT_FP8_BLOCK: FP8 weights in 128 x 128 blocks, whose
# float32 block scales the prepared layout holds once per row and 128 k (kernel_scheme).
WEIGHT_INT4, WEIGHT_UINT4, WEIGHT_FP8, WEIGHT_INT8, WEIGHT_NVFP4, WEIGHT_MXFP4 = 0, 1, 2, 3, 4, 5
WEIGHT_FP8_BLOCK = 6
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
#: The FP8 schemes: scales in a's 16-bit dtype per group, or float32 per 128 x 128 block.
FP8_IDS = (WEIGHT_FP8, WEIGHT_FP8_BLOCK)
#: The FP4 formats: E2M1 codes with a scale byte per block of ``block`` k (E4M3 or E8M0).
FP4_BLOCK = {"nvfp4": 16, "mxfp4": 32}
FP4_FORMATS = tuple(FP4_BLOCK)
#: The scale bytes' dtype of the FP4 formats.
FP4_SCALE_DTYPES = {"nvfp4": "float8_e4m3fn", "mxfp4": "float8_e8m0fnu"}

#: K of one chunk of the prepared layout: 64 bytes of a weight row (the decode kernel's K step).
CHUNK = {"int4": 128, "uint4": 128, "float8_e4m3fn": 64, "nvfp4": 128, "mxfp4": 128}
#: Weight rows of one tile of the prepared layout.
TILE_ROWS = 16
#: Rows and columns of a block of block-scaled FP8 weights (weight_quantize_block).
BLOCK = 128

#: A weight's data layouts: "plain" (the interchange layout, what quantize_weight returns) and
#: "prepared" (every array in the matmul kernels' tile order, made by prepare_weight).
DATA_LAYOUTS = ("plain", "prepared")


def kernel_scheme(w) -> int:
    """The matmul kernels' scheme number of the weight ``w``: SCHEME_IDS of its format, and
    WEIGHT_FP8_BLOCK for FP8 in 128 x 128 blocks."""
    if w.scheme.granularity == "block":
        return WEIGHT_FP8_BLOCK
    return SCHEME_IDS[w.scheme.format]


class _DefaultBlockSize(tuple):
    """from_checkpoint's default ``block_size``, ``(128, 128)``, told apart from an explicit
    ``(128, 128)`` so that the FP4 formats (whose blocks are 1 x 16 or 1 x 32) can take the default."""

    def __repr__(self) -> str:
        return "(128, 128)"


DEFAULT_BLOCK_SIZE = _DefaultBlockSize((BLOCK, BLOCK))
#: The family that quantizes and dequantizes weights (kernels/weight_quant.cu).
FAMILY = "weight_quant"


def weight_scheme(fmt: str, group_size, K: int, dtype, *, block=None) -> Scheme:
    """The Scheme of a weight: ``fmt`` ``"int4"``, ``"uint4"``, ``"float8_e4m3fn"``, ``"int8"``,
    ``"nvfp4"`` or ``"mxfp4"``, groups of ``group_size`` along K (None: one scale per output
    channel), scales in ``dtype`` (FP4: the scale bytes' E4M3 or E8M0); or, with ``block``
    ``(rows, columns)``, FP8 in 2-D blocks (granularity ``"block"``, ``group_size`` ignored). The
    scales' layout is ``"row"`` (a row-major grid of scales, ``(N, K / G)`` or ``(ceil(N / 128),
    ceil(K / 128))``), or ``"dense"`` for the FP4 scale bytes (the MX and NVFP4 quantizers' name
    for the same row-major bytes)."""
    if block is not None:
        return Scheme(fmt, "block", tuple(int(v) for v in block), np.dtype(dtype).name, "row", FAMILY)
    channel = group_size is None
    return Scheme(
        fmt,
        "channel" if channel else "group",
        (int(K) if channel else int(group_size),),
        FP4_SCALE_DTYPES.get(fmt) or np.dtype(dtype).name,
        "dense" if fmt in FP4_BLOCK else "row",
        FAMILY,
    )
