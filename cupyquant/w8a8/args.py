"""What the W8A8 matmul's Python modules and kernels agree on: the kernels' argument struct
(``kernels/scaled_mm.cuh`` MmArgs) and the format and scaling-mode numbers."""

from __future__ import annotations

import numpy as np

from .._sizes import ceil_div

#: element formats and their template numbers (kernels/scaled_mm.cuh MmFormat); INT8 pairs only with INT8
FORMAT_IDS = {"float8_e4m3fn": 0, "float8_e5m2": 1, "int8": 2}
FP8_IDS = {k: v for k, v in FORMAT_IDS.items() if k != "int8"}
INT8_ID = FORMAT_IDS["int8"]

#: How block sums are scaled (kernels/scaled_mm.cuh MmMode): no scale varies along K; one does and
#: b's is the same across a tile's columns (per tensor, or 128 x 128 blocks); one does, per column.
MODE_END, MODE_K_TILE, MODE_K_COL = 0, 1, 2
MODES = (MODE_END, MODE_K_TILE, MODE_K_COL)

#: K per scale block along K (1 x 128 activation groups, 128 x 128 and 1 x 128 weight blocks)
BLOCK_K = 128

#: kernels/scaled_mm.cuh MmArgs, field for field (C alignment)
MM_ARGS = np.dtype(
    [
        ("M", np.int64),
        ("N", np.int64),
        ("K", np.int64),
        ("lda", np.int64),
        ("ldb", np.int64),
        ("ldy", np.int64),
        ("sa_rows", np.int64),
        ("sa_batch", np.int64),
        ("sa_m", np.int64),
        ("sa_k", np.int64),
        ("sb_n", np.int64),
        ("sb_k", np.int64),
        ("zp_rows", np.int64),
        ("zp_batch", np.int64),
        ("zp_m", np.int64),
        ("y_tma", np.int64),
        ("sb_shift", np.int32),
        ("sa_packed", np.int32),
        ("has_bias", np.int32),
        ("splits", np.int32),
        ("kb_per_split", np.int32),
        ("has_adj", np.int32),
        ("cluster", np.int32),
        ("early", np.int32),
    ],
    align=True,
)


def mm_args(L, splits: int = 1, kb_per_split: int | None = None, cluster: int = 1) -> np.void:
    """The :data:`MM_ARGS` of a launch of the call ``L`` (an operands.Layout) with K cut into
    ``splits`` parts of ``kb_per_split`` 128-k blocks (default: all of them), by clusters of
    ``cluster`` blocks sharing a's rows (the Hopper kernel; 1: no cluster)."""
    p = np.zeros((), dtype=MM_ARGS)
    nkb = ceil_div(L.K, BLOCK_K)
    p["M"], p["N"], p["K"] = L.M, L.N, L.K
    p["lda"] = L.K if L.copy_a else L.lda
    p["ldb"] = L.K if L.copy_b or L.b_plain else L.ldb
    p["ldy"] = L.ldy or L.N
    if L.sa_unpack:  # one float32 scale a row, C order (operands._e8m0_to_f32)
        p["sa_rows"], p["sa_batch"], p["sa_m"], p["sa_k"] = max(L.M, 1), 0, 1, 0
    else:
        p["sa_rows"], p["sa_batch"], p["sa_m"], p["sa_k"] = max(L.sa_rows, 1), L.sa_batch, L.sa_m, L.sa_k
    p["sb_n"], p["sb_k"], p["sb_shift"] = L.sb_n, L.sb_k, L.sb_shift
    p["zp_rows"], p["zp_batch"], p["zp_m"] = max(L.zp_rows, 1), L.zp_batch, L.zp_m
    p["has_adj"] = int(L.adj is not None)
    p["sa_packed"] = int(L.sa_packed)
    p["has_bias"] = int(L.bias)
    p["splits"] = splits
    p["kb_per_split"] = nkb if kb_per_split is None else kb_per_split
    p["cluster"] = cluster
    return p[()]
