"""What the W8A8 matmul's Python modules and kernels agree on: the kernels' argument struct
(``kernels/scaled_mm.cuh`` MmArgs), the format and scaling-mode numbers, and :class:`Operands`,
the validated description of one call that the launchers read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import cupy

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
        ("sb_shift", np.int32),
        ("sa_packed", np.int32),
        ("has_bias", np.int32),
        ("splits", np.int32),
        ("kb_per_split", np.int32),
        ("has_adj", np.int32),
    ],
    align=True,
)


@dataclass
class Operands:
    """One validated call of :func:`cupyquant.scaled_matmul` / :func:`cupyquant.scaled_mm`, as the
    kernels read it (kernels/scaled_mm.cuh states the formula and the scale addressing).

    ``a`` (M, K) and ``b`` (N, K) are uint8 views of the FP8 codes or int8 views of the INT8 codes
    (rows may be ``lda`` / ``ldb`` bytes apart, the last axis contiguous); ``sa`` holds a's scale
    words (float32, or int32 words of packed UE8M0 bytes when ``sa_packed``), ``sb`` b's float32
    scales, both addressed through the strides below (in words); INT8 only: ``adj`` the int32 (N,)
    column term subtracted as ``z(m) * adj(n)`` (None: none), ``azp`` a's int32 zero points (None
    with ``adj``: z = 1), addressed by ``zp_rows``, ``zp_batch``, ``zp_m``; ``out2`` is the (M, N)
    view the kernel writes (rows ``ldy`` elements apart) and ``result`` what the call returns
    (``[..., N]``, a view of the same memory)."""

    a: cupy.ndarray
    b: cupy.ndarray
    a_format: int
    b_format: int
    sa: cupy.ndarray
    sb: cupy.ndarray
    sa_rows: int
    sa_batch: int
    sa_m: int
    sa_k: int
    sa_packed: bool
    sb_n: int
    sb_k: int
    sb_shift: int
    mode: int
    azp: cupy.ndarray | None
    adj: cupy.ndarray | None
    zp_rows: int
    zp_batch: int
    zp_m: int
    bias: cupy.ndarray | None
    out2: cupy.ndarray
    result: cupy.ndarray
    device: int

    @property
    def M(self) -> int:
        return self.a.shape[0]

    @property
    def N(self) -> int:
        return self.b.shape[0]

    @property
    def K(self) -> int:
        return self.a.shape[1]


def mm_args(ops: Operands, splits: int = 1, kb_per_split: int | None = None) -> np.ndarray:
    """The 0-d :data:`MM_ARGS` of a launch of ``ops`` with K cut into ``splits`` parts of
    ``kb_per_split`` 128-k blocks (default: all of them)."""
    p = np.zeros((), dtype=MM_ARGS)
    nkb = -(-ops.K // BLOCK_K)
    p["M"], p["N"], p["K"] = ops.M, ops.N, ops.K
    p["lda"], p["ldb"] = ops.a.strides[0], ops.b.strides[0]
    p["ldy"] = ops.out2.strides[0] // ops.out2.itemsize
    p["sa_rows"], p["sa_batch"], p["sa_m"], p["sa_k"] = max(ops.sa_rows, 1), ops.sa_batch, ops.sa_m, ops.sa_k
    p["sb_n"], p["sb_k"], p["sb_shift"] = ops.sb_n, ops.sb_k, ops.sb_shift
    p["zp_rows"], p["zp_batch"], p["zp_m"] = max(ops.zp_rows, 1), ops.zp_batch, ops.zp_m
    p["has_adj"] = int(ops.adj is not None)
    p["sa_packed"] = int(ops.sa_packed)
    p["has_bias"] = int(ops.bias is not None)
    p["splits"] = splits
    p["kb_per_split"] = nkb if kb_per_split is None else kb_per_split
    return p
