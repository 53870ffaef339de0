"""The matmul's launches: one function per kernel (decode, sm80 gemm, sm90 gemm), each given the
problem (:class:`Problem`) and asking :mod:`.plan` for its configuration."""

from __future__ import annotations

from typing import Callable, NamedTuple

import cupy
import numpy as np

from .. import _device, _jit, _launch, _validate
from . import _cache, plan
from . import configs as C
from .quantize import k_permuted


class Problem(NamedTuple):
    """One matmul call: ``y2 (M, N) = a2 (M, K) @ dequant(w).T`` on ``device``, with prepared ``w``."""

    device: int
    t: object  # _dtypes.InputType of a
    a2: cupy.ndarray
    w: object  # prepared QuantizedWeight
    y2: cupy.ndarray
    M: int
    N: int
    K: int
    pdl: bool  # programmatic dependent launch
    early: bool  # the weights may be read before the PDL wait (dispatch.early_ok)

    @property
    def zero_point(self):
        return self.w.zero_point if self.w.zero_point is not None else 0

    @property
    def scale_2(self):
        """NVFP4's float32 scale_2 (1,), or a null pointer."""
        return self.w.scale_2 if getattr(self.w, "scale_2", None) is not None else 0

    @property
    def sms(self) -> int:
        return _device.sm_count(self.device)


class TiledLaunch(NamedTuple):
    """How a tensor-core gemm covers y: tiles of ``rows`` x ``cols``, K in stages of ``bk``, split
    as ``split(tiles, stages, slots)`` says."""

    kernel: object
    threads: int
    smem: int
    rows: int
    cols: int
    bk: int
    split: Callable
    sm90: bool = False  # the sm90 kernel: tensor maps after the argument struct, the early flag
    cluster_cap: dict | None = None  # splits -> clusters that fit at once (wide clusters), or None


def run(k, grid, block, args, smem, pdl, cluster=None):
    """One launch of a matmul kernel: through cuLaunchKernelEx with programmatic dependent launch
    or as clusters of ``cluster`` blocks (_launch.py), or CuPy's RawKernel call; ``args`` ends with
    the 0-d argument struct."""
    if pdl or cluster is not None:
        _launch.launch(k, grid, block, args, smem, pdl=pdl, cluster=cluster)
    else:
        k(grid, block, args[:-1] + (args[-1][()],), shared_mem=smem)


def gshift(w) -> int:
    """The kernels find k's group as k >> gshift: log2 of the group size, or 62 (every k < 2^62) for
    one group per row."""
    return 62 if w.group_size is None else int(w.group_size).bit_length() - 1


def decode(p: Problem) -> None:
    """The decode kernel, in the configuration plan.decode_config picks, launched per 16 * 65535
    rows of a."""
    w, device = p.w, p.device
    fmt = w._format
    nchunks = p.K // C.CHUNK[fmt]
    hopper = int(_device.arch(device)) >= 90
    args = np.zeros((), dtype=C.DECODE_ARGS)
    args["N"], args["K"], args["lda"] = p.N, p.K, p.a2.strides[0] // p.a2.itemsize
    args["ng"], args["gshift"], args["early"] = p.K // w._group, gshift(w), int(p.early)
    # INT4 with whole-chunk groups: scales applied to each chunk's float32 partial sums, and the
    # chunks' blocks of 8 k transposed (the kernel reads the activations that way; FP4 weights
    # are in that order too, dequantized before the mma)
    scale_after_sum = k_permuted(w) and C.SCHEME_IDS[fmt] in C.INT4_IDS
    rows_per_launch = 16 * C.MAX_GRID_Y
    for m0 in range(0, p.M, rows_per_launch):
        mrows = min(rows_per_launch, p.M - m0)
        args["M"] = mrows
        two = mrows > 8
        mtiles = -(-mrows // 16)
        # the 64-row blocks for INT4 only (plan.DecodeCosts: FP8 and FP4 are faster without them)
        four_blocks = -(-p.N // 64) * mtiles if two and C.SCHEME_IDS[fmt] in C.INT4_IDS else 0
        cfg = plan.decode_config(
            -(-p.N // (32 if two else 16)) * mtiles,
            p.sms,
            nchunks,
            two,
            four_blocks,
            hopper and mrows >= 16,
            scale_after_sum,
        )
        k = _jit.kernel(
            device, C.DECODE_FAMILY, "w16_decode", p.t.ctype, C.SCHEME_IDS[fmt], *cfg.targs, scale_after_sum
        )
        smem = C.decode_smem(cfg)
        _cache.raise_smem_limit(device, k, smem)
        grid = (-(-p.N // cfg.rows), mtiles)
        splits = plan.decode_splits(cfg, grid[0] * mtiles, p.sms, nchunks) if hopper else 1
        run(
            k,
            grid + (splits,),
            (32 * cfg.warps,),
            (p.a2[m0:], w.data, w.scale, p.zero_point, p.scale_2, p.y2[m0:], args),
            smem,
            p.pdl,
            (1, 1, splits) if splits > 1 else None,
        )


def sm80_gemm(p: Problem) -> None:
    cfg = plan.sm80_gemm_config(p.M)
    scale_after_sum = p.w._group % C.SM80_GEMM_BK == 0 and cfg.m_tiles < 4
    k = _jit.kernel(
        p.device, C.SM80_GEMM_FAMILY, "sm80_w16_gemm", p.t.ctype, C.SCHEME_IDS[p.w._format], *cfg, scale_after_sum
    )
    tiled(
        p,
        TiledLaunch(
            k,
            128 * cfg.warps_m,
            C.sm80_gemm_smem(cfg),
            C.sm80_gemm_rows(cfg),
            C.SM80_GEMM_BN,
            C.SM80_GEMM_BK,
            plan.sm80_splits,
        ),
    )


def sm90_cluster_cap(device, t, fmt, kp) -> dict:
    """splits -> clusters of the sm90 gemm (one block per SM) the device holds at once (once per
    device, from the 256-row tile's kernel). A split whose clusters do not all fit at once would run
    in two waves, so those splits go through the workspace."""
    cfg = C.SM90_GEMM[256]
    k = _jit.kernel(device, C.SM90_GEMM_FAMILY, "sm90_w16_gemm", t.ctype, C.SCHEME_IDS[fmt], *cfg, kp)
    return _cache.cluster_capacity(device, k, C.SM90_GEMM_THREADS[256], C.sm90_gemm_smem(256))


def sm90_gemm(p: Problem) -> None:
    kp = k_permuted(p.w)
    cap = sm90_cluster_cap(p.device, p.t, p.w._format, kp) if plan.CLUSTER_SPLITS else None
    rows, splits = plan.sm90_plan(p.M, p.N, p.K // C.SM90_GEMM_BK, p.sms, cluster_cap=cap)
    cfg = C.SM90_GEMM[rows]
    k = _jit.kernel(p.device, C.SM90_GEMM_FAMILY, "sm90_w16_gemm", p.t.ctype, C.SCHEME_IDS[p.w._format], *cfg, kp)

    def split(tiles, iters_total, slots):
        iters = -(-iters_total // splits)
        return -(-iters_total // iters), iters

    tiled(
        p,
        TiledLaunch(
            k,
            C.SM90_GEMM_THREADS[rows],
            C.sm90_gemm_smem(rows),
            rows,
            C.SM90_GEMM_BN,
            C.SM90_GEMM_BK * cfg.halves,
            split,
            sm90=True,
            cluster_cap=cap,
        ),
    )


def tiled(p: Problem, L: TiledLaunch) -> None:
    """Launch a tensor-core gemm (the sm80 and sm90 kernels take the same arguments) over
    ``L.rows x L.cols`` tiles of y, K in stages of ``L.bk``, split as ``L.split`` says; at most
    MAX_GRID_Y row tiles per launch. The sm90 kernel runs the splits of a tile as one thread-block
    cluster, whose blocks add their partials through distributed shared memory (no workspace), when
    K is split 2 ways, or s = 3..8 ways with at most ``L.cluster_cap[s]`` tiles (plan.CLUSTER_SPLITS);
    those wider clusters are launched with shared memory for one block per SM. Other splits go
    through a float32 workspace in global memory. The sm90 kernel also takes two tensor maps of the
    launch's rows of a after the argument struct (read by the 128-row tile; zeros for the others),
    is always launched through cuLaunchKernelEx, and with ``p.early`` copies its first stages'
    weights before its PDL wait."""
    w, device = p.w, p.device
    occ = _cache.occupancy(device, L.kernel, L.threads, L.smem)
    args = np.zeros((), dtype=C.SM90_GEMM_ARGS if L.sm90 else C.SM80_GEMM_ARGS)
    args["N"], args["K"], args["lda"] = p.N, p.K, p.a2.strides[0] // p.a2.itemsize
    args["ng"], args["gshift"] = p.K // w._group, gshift(w)
    if L.sm90:
        args["early"] = int(bool(p.early) and bool(p.pdl))
    else:
        args["kperm"] = int(k_permuted(w))
    iters_total = p.K // L.bk
    ntiles = -(-p.N // L.cols)
    rows_per_launch = L.rows * C.MAX_GRID_Y
    for m0 in range(0, p.M, rows_per_launch):
        mrows = min(rows_per_launch, p.M - m0)
        mtiles = -(-mrows // L.rows)
        splits, iters = L.split(ntiles * mtiles, iters_total, occ * p.sms)
        args["M"], args["splits"], args["iters"] = mrows, splits, iters
        in_cluster = (
            L.sm90
            and plan.CLUSTER_SPLITS
            and (splits == 2 or (splits > 2 and plan.wide_cluster_fits(L.cluster_cap, splits, ntiles * mtiles)))
        )
        launch_smem = L.smem
        if in_cluster and splits > 2:
            launch_smem = _cache.one_block_smem(device, L.kernel, L.smem)
        if splits > 1 and not in_cluster:  # float32 partial tiles (whole, tile-major), per-tile arrival counters
            ws = cupy.empty((splits, mtiles, ntiles, L.rows, L.cols), dtype=np.float32)
            counters = _cache.split_counters(device, ntiles * mtiles)
            _validate.keep_if_capturing(ws)
        else:
            ws = counters = 0
        kargs = (p.a2[m0:], w.data, w.scale, p.zero_point, p.scale_2, p.y2[m0:], ws, counters, args)
        cluster = (1, 1, splits) if in_cluster else None
        if L.sm90:
            tmaps = (_cache.NO_TENSOR_MAP, _cache.NO_TENSOR_MAP)
            if L.rows == C.SM90_GEMM_TMA_ROWS:  # boxes of the whole tile, and of the last tile's rows rounded up to 8
                tail = -(-(mrows % L.rows) // 8) * 8
                tail_map = (
                    _cache.act_tensor_map(p.a2[m0:], mrows, p.K, C.SM90_GEMM_BK, tail) if tail else _cache.NO_TENSOR_MAP
                )
                tmaps = (_cache.act_tensor_map(p.a2[m0:], mrows, p.K, C.SM90_GEMM_BK, L.rows), tail_map)
            _launch.launch(
                L.kernel, (ntiles, mtiles, splits), (L.threads,), kargs + tmaps, launch_smem, pdl=p.pdl, cluster=cluster
            )
        else:
            run(L.kernel, (ntiles, mtiles, splits), (L.threads,), kargs, launch_smem, p.pdl, cluster)
