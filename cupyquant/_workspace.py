"""Per-device and per-kernel state that the matmul kernels (weight-only and W8A8) share: K-split
arrival counters, the TMA tensor maps of activations, kernel attributes set once (shared-memory
limits, occupancy) and cluster capacities."""

from __future__ import annotations

import cupy
import numpy as np
from cupy.cuda import driver as _driver

from . import _device, _jit, _launch, _validate

# ---------------------------------------------------------------- K-split arrival counters
# The arrival counters of a K split through the workspace (weight_mma.cuh split_k_finish) are zero
# between calls: the last block of each tile resets its counter after the fix-up, so a zeroed buffer
# serves every later call with no memset (a memset a call costs 2.3-3 us in a CUDA graph:
# 4096^2 M = 256 27.7 against 30.7 us on an H200). One buffer per device and stream: the calls on a
# stream run one after another (a PDL launch waits for the kernel before it to complete before its
# first global access, the counters included), so they can share one. A CUDA graph being captured
# takes a slice of its own from a zeroed slab allocated outside any capture (a graph may be replayed
# on any stream, concurrently with direct calls, and lives as long as the user keeps it, so its
# slices are never handed out again); without room there, a zeroed buffer of its own, the memset a
# node of the graph.
COUNTER_SLAB = 1 << 20  # int32 counters per device for captured graphs
COUNTER_STREAMS = 32  # per-stream buffers kept per process (the oldest is dropped past this)
stream_counters: dict = {}
graph_slabs: dict = {}


def split_counters(device, n: int) -> cupy.ndarray:
    """``n`` zeroed int32 arrival counters for one split-K launch on the current stream."""
    stream = cupy.cuda.get_current_stream()
    if stream.is_capturing():
        slab = graph_slabs.get(device)
        if slab is not None and slab[1] + n <= slab[0].size:
            out = slab[0][slab[1] : slab[1] + n]
            slab[1] += n
            return out
        out = cupy.zeros(n, dtype=np.int32)
        _validate.keep_if_capturing(out)
        return out
    if device not in graph_slabs:  # zeroed before any graph can be captured with it, on any stream
        graph_slabs[device] = [cupy.zeros(COUNTER_SLAB, dtype=np.int32), 0]
        stream.synchronize()
    key = (device, stream.ptr)
    buf = stream_counters.pop(key, None)
    if buf is None or buf.size < n:
        buf = cupy.zeros(max(n, 1024), dtype=np.int32)
    stream_counters[key] = buf  # (re)inserted last: the most recently used
    while len(stream_counters) > COUNTER_STREAMS:
        del stream_counters[next(iter(stream_counters))]
    return buf[:n]


# ---------------------------------------------------------------- K-split workspaces
# The float32 partial tiles of a K split through memory are written and read within one launch, so
# the launches on a stream can share one buffer, as they share the counters: one per device and
# stream, kept up to WORKSPACE_KEEP_BYTES (a larger one is allocated for its call). Under a graph
# capture a call gets a buffer of its own, kept with the graph. Allocating it at every call cost
# 4-5 us of host time (cupy.empty and the capture check) at M = 1 on an H200 host.
WORKSPACE_KEEP_BYTES = 64 << 20
stream_workspaces: dict = {}


def split_buffers(device, ws_elems: int, n_counters: int) -> tuple:
    """(float32 workspace of at least ``ws_elems`` elements, ``n_counters`` zeroed arrival counters)
    for one split-K launch on the current stream."""
    stream = cupy.cuda.get_current_stream()
    nbytes = 4 * ws_elems
    if nbytes > WORKSPACE_KEEP_BYTES or stream.is_capturing():
        ws = cupy.empty(ws_elems, dtype=np.float32)
        _validate.keep_if_capturing(ws)
        return ws, split_counters(device, n_counters)
    key = (device, stream.ptr)
    ws = stream_workspaces.pop(key, None)
    if ws is None or ws.size < ws_elems:
        ws = cupy.empty(ws_elems, dtype=np.float32)
    stream_workspaces[key] = ws  # (re)inserted last: the most recently used
    while len(stream_workspaces) > COUNTER_STREAMS:
        del stream_workspaces[next(iter(stream_workspaces))]
    return ws, split_counters(device, n_counters)


# ---------------------------------------------------------------- activation tensor maps
# Encoding a tensor map is host work in the driver (7.6 us a map on an H100 host, 0.5 us for a
# cached one); matmul's activations are usually the same few buffers from call to call, so the maps
# are cached by address, shape and box, at most TMAP_CACHE of them.
TMAP_CACHE = 256
tmap_cache: dict = {}
NO_TENSOR_MAP = np.zeros((), dtype=_launch.TENSOR_MAP)


def tensor_map(
    ptr: int, rows: int, K: int, row_bytes: int, device: int, box_k: int, box_rows: int, elem_bytes: int = 2
):
    """The tensor map of ``rows`` rows of ``K`` ``elem_bytes``-byte elements at device address
    ``ptr``, rows ``row_bytes`` apart (16-byte aligned, a multiple of 16 bytes apart: the ops copy
    operands otherwise), in boxes of ``box_k`` by ``box_rows``: the weight-only gemm's activations
    and the W8A8 kernel's FP8 operands."""
    key = (ptr, rows, K, row_bytes, device, box_k, box_rows, elem_bytes)
    m = tmap_cache.get(key)
    if m is None:
        m = _launch.tensor_map_2d(ptr, rows, K, row_bytes, box_k, box_rows, elem_bytes)
        if len(tmap_cache) >= TMAP_CACHE:  # the oldest goes (another thread may be evicting too)
            try:
                tmap_cache.pop(next(iter(tmap_cache)), None)
            except (StopIteration, RuntimeError):  # emptied, or changed size under the iterator
                pass
        tmap_cache[key] = m
    return m


# ---------------------------------------------------------------- kernel attributes
_occupancy: dict = {}
_smem_raised: set = set()  # (device, id(kernel)) whose shared-memory limit is raised
_one_block_set: set = set()
_cluster_caps: dict = {}


def _set_smem_limit(device, k, smem: int) -> None:
    """The attribute on ``k``'s function on ``device`` (CuPy sets it on the current device's)."""
    with cupy.cuda.Device(device):
        k.max_dynamic_shared_size_bytes = smem


def raise_smem_limit(device, k, smem: int) -> None:
    """Raise ``k``'s dynamic shared-memory limit past the 48 KiB default, once per kernel (the
    function keeps the attribute)."""
    key = (device, id(k))
    if key not in _smem_raised:
        _set_smem_limit(device, k, smem)
        _smem_raised.add(key)


def occupancy(device, k, threads: int, smem: int) -> int:
    """Blocks of ``k`` per SM; the first call per kernel also raises its shared-memory limit past
    the 48 KiB default (the function keeps the attribute)."""
    key = (device, id(k))
    occ = _occupancy.get(key)
    if occ is None:
        _set_smem_limit(device, k, smem)
        with cupy.cuda.Device(device):
            n = _driver.occupancyMaxActiveBlocksPerMultiprocessor(_jit.function_ptr(k), threads, smem)
        occ = _occupancy[key] = max(1, n)
    return occ


def one_block_smem(device, k, smem: int) -> int:
    """Dynamic shared bytes for a launch of ``k`` that leaves room for only one block per SM (more
    than half an SM's shared memory; at least ``smem``), the kernel's limit raised to allow it.
    A 64-row sm90 tile (104 KB) otherwise runs two blocks a SM, and the cluster scheduler then packs
    a cluster's blocks two to an SM on some SMs while others idle (4096 x 14336 M = 64 64/3: 40.0 us
    packed, 32.5 one block per SM)."""
    smem_sm = _device.smem_per_sm(device)
    one = max(smem, smem_sm // 2 + 1024)
    key = (device, id(k))
    if key not in _one_block_set:
        _set_smem_limit(device, k, one)
        _one_block_set.add(key)
    return one


def cluster_capacity(device, k, threads: int, smem: int) -> dict:
    """splits -> how many clusters of that many blocks of ``k`` (one block per SM) the device holds
    at once (cuOccupancyMaxActiveClusters; once per device). The H100: 39 clusters of 3, 30 of 4,
    22 of 5, 17 of 6, 15 of 7 and 8: fewer than 132 / s, since a cluster's blocks must all be in
    one GPC."""
    cap = _cluster_caps.get(device)
    if cap is None:
        smem = one_block_smem(device, k, smem)
        with cupy.cuda.Device(device):
            cap = {s: _launch.max_active_clusters(k, threads, smem, (1, 1, s)) for s in range(3, 9)}
        _cluster_caps[device] = cap
    return cap
