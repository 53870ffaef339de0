"""What the matmul's kernel modules (``decode``, ``sm80_gemm``, ``sm90_gemm``) share: the
:class:`Problem` a call poses, which each module's ``plan`` turns into :class:`Step` launches, and
the launch plan of the two tensor-core gemms, which take the same arguments (:func:`gemm_steps`)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import _dtypes, _launch, _workspace
from .._launch import ARG, Blob, Launch
from .._sizes import MAX_GRID_YZ, ceil_div
from .formats import FP4_BLOCK

#: Weight rows (output columns) of a tile of both tensor-core gemms.
GEMM_BN = 128


def gemm_args(last: str) -> np.dtype:
    """The argument struct of the tensor-core gemms (weight_sm80_gemm.cu GemmArgs and
    weight_sm90_gemm.cu WgArgs), whose last field is ``last`` (``"kperm"``, ``"early"``)."""
    return np.dtype(
        [
            ("M", np.int64),
            ("N", np.int64),
            ("K", np.int64),
            ("lda", np.int64),
            ("ng", np.int64),
            ("gshift", np.int32),
            ("splits", np.int32),
            ("iters", np.int32),
            (last, np.int32),
        ],
        align=True,
    )


class Problem(NamedTuple):
    """One matmul shape: ``y (M, N) = a (M, K) @ dequant(w).T`` on ``device`` with a prepared
    weight of format ``fmt`` (kernel scheme ``sid``), rows of ``a`` ``lda`` elements apart (16-byte aligned), ``sms``
    multiprocessors, programmatic dependent launch if ``pdl``."""

    device: int
    t: _dtypes.InputType  # a's type (float16 or bfloat16)
    M: int
    N: int
    K: int
    lda: int
    fmt: str
    sid: int  # the kernels' scheme number (formats.kernel_scheme: WEIGHT_FP8_BLOCK for 128 x 128 blocks)
    group: int  # K per scale (K per channel; 128 for 128 x 128 blocks)
    k_permuted: bool  # the prepared chunks' 4 x 4 blocks of 8 k are transposed (layout.k_permuted)
    sms: int
    pdl: bool
    wgmma: bool  # the GPU runs the sm90 kernels
    cluster_launch: bool  # the GPU launches thread-block clusters (9.0 and newer)

    @property
    def gshift(self) -> int:
        """The kernels find k's group as k >> gshift: log2 of the group size, or 62 (every k < 2^62)
        for one group per row."""
        return 62 if self.group == self.K else self.group.bit_length() - 1

    @property
    def ng(self) -> int:
        """Scales per weight row (groups of K; a partial last group for blocks whose K 128 does not divide)."""
        return ceil_div(self.K, self.group)

    @property
    def fp4(self) -> bool:
        return self.fmt in FP4_BLOCK


class Step(NamedTuple):
    """One launch of a matmul plan over rows ``a_off / lda ..`` of a: the launch without and with the
    early weight reads (``early`` None where the kernel has none), the byte offsets of its rows of
    ``a`` and ``y``, the float32 workspace of a K split through memory (its shape, or None) and its
    arrival counters (their number, or 0), and for the 128-row sm90 tile the TMA boxes of its rows
    of ``a`` (``(rows, box_k, box_rows, tail_box_rows)``, or None)."""

    plain: object
    early: object
    a_off: int
    y_off: int
    ws_shape: tuple | None
    counters: int
    tmaps: tuple | None


def gemm_steps(p: Problem, k, threads: int, smem: int, rows: int, bk: int, split, args_dtype, last, wide=None):
    """The :class:`Step` launches of a tensor-core gemm (the sm80 and sm90 kernels take the same
    arguments: a, the weight's data, scales, zero points, scale_2, y, the workspace, the arrival
    counters, the argument struct, and for sm90 two tensor maps) over ``rows`` x 128 tiles of y,
    K in stages of ``bk``, split as ``split(tiles, stages, slots)`` says, at most 65535 row tiles a
    launch. ``last``: the struct's last field (sm80 ``kperm``, sm90 ``early``, which gets a launch
    of its own when ``p.pdl``). ``wide``: for sm90, ``(in_cluster, tma_rows, box_k)``: a K split of
    ``splits`` ways over ``tiles`` tiles runs as thread-block clusters where ``in_cluster(splits,
    tiles)`` (launched with shared memory for one block per SM past 2 ways), and the ``tma_rows``
    tile takes its activations by TMA in boxes of ``box_k`` columns."""
    occ = _workspace.occupancy(p.device, k, threads, smem)
    iters_total = p.K // bk
    ntiles = ceil_div(p.N, GEMM_BN)
    rows_per_launch = rows * MAX_GRID_YZ
    itemsize = p.t.dtype.itemsize
    steps = []
    for m0 in range(0, p.M, rows_per_launch):
        mrows = min(rows_per_launch, p.M - m0)
        mtiles = ceil_div(mrows, rows)
        splits, iters = split(ntiles * mtiles, iters_total, occ * p.sms)
        cluster = None
        launch_smem = smem
        tmaps = None
        if wide is not None:
            in_cluster, tma_rows, box_k = wide
            if splits > 1 and in_cluster(splits, ntiles * mtiles):
                cluster = (1, 1, splits)
                if splits > 2:
                    launch_smem = _workspace.one_block_smem(p.device, k, smem)
            if rows == tma_rows:  # boxes of the whole tile, and of the last tile's rows rounded up to 8
                tmaps = (mrows, box_k, rows, ceil_div(mrows % rows, 8) * 8)
        ws = None if splits == 1 or cluster is not None else (splits, mtiles, ntiles, rows, GEMM_BN)
        launches = []
        for flag in (False, True) if wide is not None and p.pdl else (last,):
            a = np.array((mrows, p.N, p.K, p.lda, p.ng, p.gshift, splits, iters, int(flag)), dtype=args_dtype)[()]
            tail = (Blob(_launch.TENSOR_MAP),) * 2 if wide is not None else ()
            launches.append(
                Launch(
                    k,
                    (ntiles, mtiles, splits),
                    (threads,),
                    (ARG,) * 8 + (a,) + tail,
                    smem=launch_smem,
                    pdl=p.pdl,
                    cluster=cluster,
                )  # fmt: skip
            )
        early = launches[-1] if len(launches) > 1 else None
        counters = ntiles * mtiles if ws is not None else 0
        steps.append(Step(launches[0], early, m0 * p.lda * itemsize, m0 * p.N * itemsize, ws, counters, tmaps))
    return steps
