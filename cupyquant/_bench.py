"""Timing helpers shared by ``python -m cupyquant`` and ``scripts/bench.py``.

The protocol (docs/performance.md): CUDA events around each call, warm-up first, the median of many calls,
inputs rotated over enough copies that the working set is several times the L2 cache, and the copy
bandwidth (bytes read plus written by a large device-to-device copy) measured in the same process
as the ceiling.
"""

from __future__ import annotations

import math
import statistics
import time

import cupy
import numpy as np

from ._sizes import ceil_div


def device_name() -> str:
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    return props["name"].decode()


def l2_bytes() -> int:
    return cupy.cuda.Device().attributes["L2CacheSize"]


def copies_for(nbytes_per_set: int, factor: int = 4) -> int:
    """How many input sets to rotate over so that they span ``factor`` times the L2."""
    return max(1, ceil_div(factor * l2_bytes(), max(1, nbytes_per_set)))


def time_events(fn, args_list, warmup: int = 5, reps: int = 50, record=None) -> float:
    """Median seconds of ``fn(*args)`` between CUDA events on the current stream, cycling through
    ``args_list``. ``record`` may give a (start, end) event factory for other frameworks."""
    for i in range(warmup):
        fn(*args_list[i % len(args_list)])
    make = record or (lambda: (cupy.cuda.Event(), cupy.cuda.Event()))
    pairs = [make() for _ in range(reps)]
    for i, (s, e) in enumerate(pairs):
        args = args_list[i % len(args_list)]
        s.record()
        fn(*args)
        e.record()
    pairs[-1][1].synchronize()
    if record is None:
        times = [cupy.cuda.get_elapsed_time(s, e) for s, e in pairs]
    else:
        times = [s.elapsed_time(e) for s, e in pairs]
    return statistics.median(times) / 1e3


def host_seconds_per_call(fn, args_list, calls: int = 300, rounds: int = 5) -> float:
    """Host time per call of a loop of asynchronous calls, the least of ``rounds`` loops of
    ``calls`` (host timings only ever come out longer than the work, from the scheduler and the
    CPU's clock). The loop must fit in the launch queue (about a thousand launches) unless the GPU
    work is shorter than the host's, or this measures the GPU."""
    for i in range(10):
        fn(*args_list[i % len(args_list)])
    best = float("inf")
    for _ in range(rounds):
        cupy.cuda.get_current_stream().synchronize()
        t0 = time.perf_counter()
        for i in range(calls):
            fn(*args_list[i % len(args_list)])
        best = min(best, time.perf_counter() - t0)
    cupy.cuda.get_current_stream().synchronize()
    return best / calls


def copy_bandwidth(nbytes: int = 1 << 31, reps: int = 20) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read plus bytes written."""
    src = cupy.empty(nbytes, dtype=np.uint8)
    dst = cupy.empty(nbytes, dtype=np.uint8)
    src.fill(1)
    stream = cupy.cuda.get_current_stream()

    def copy(dst_ptr=dst.data.ptr, src_ptr=src.data.ptr):
        cupy.cuda.runtime.memcpyAsync(dst_ptr, src_ptr, nbytes, cupy.cuda.runtime.memcpyDeviceToDevice, stream.ptr)

    t = time_events(copy, [()], warmup=3, reps=reps)
    del src, dst
    cupy.get_default_memory_pool().free_all_blocks()
    return 2 * nbytes / t


# One 16-byte load and store a thread: an SM kernel, as every op timed beside it is. A graph's
# device-to-device memcpy node may run on a copy engine instead, which on an H200 moved 100 MB to
# 1.35 GB at 56-63% of the 2 GiB stream copy's rate, an erratic ceiling for an op of that size.
_COPY16_SOURCE = r"""
extern "C" __global__ void copy16(const uint4* __restrict__ src, uint4* __restrict__ dst, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}
"""
_COPY16_THREADS = 256
_copy16_kernel = None


def copy16(src, dst, stream=None) -> None:
    """Copy ``src`` into ``dst`` (contiguous, 16-byte aligned CuPy arrays of the same byte size, a
    multiple of 16) with a kernel of one 16-byte load and store a thread, on ``stream`` (default:
    the current one)."""
    global _copy16_kernel
    if _copy16_kernel is None:
        _copy16_kernel = cupy.RawKernel(_COPY16_SOURCE, "copy16")
    n = src.nbytes // 16
    grid = (max(1, ceil_div(n, _COPY16_THREADS)),)
    with stream or cupy.cuda.get_current_stream():
        _copy16_kernel(grid, (_COPY16_THREADS,), (src, dst, np.int64(n)))


def copy_seconds(nbytes: int, reps: int = 20) -> float:
    """Seconds of a device-to-device copy that moves ``nbytes`` (half read, half written, rounded
    up to 16-byte units), as an op of that size is timed: a CUDA graph of kernel copies
    (:func:`copy16`) over enough buffer pairs to span 4x the L2. The ceiling of a small op, whose
    launch and ramp a 2 GiB copy does not show."""
    half = ceil_div(max(nbytes // 2, 1), 16) * 16
    pairs = [(cupy.empty(half, np.uint8), cupy.empty(half, np.uint8)) for _ in range(min(256, copies_for(2 * half)))]
    for src, _ in pairs:
        src.fill(1)
    stream = cupy.cuda.Stream(non_blocking=True)

    def copy(src, dst):
        copy16(src, dst, stream)

    t = time_graph(copy, pairs, reps, stream)
    del pairs
    cupy.get_default_memory_pool().free_all_blocks()
    return t


def settle(seconds: float) -> None:
    """Wait for the GPU to finish, then ``seconds`` more: long enough for the board's power
    controller to bring the SM clock back up after a heavy burst (on the H100: 1395-1440 MHz at
    the 700 W cap right after 1-3 s of 4096-row matmuls, 1965-1980 MHz 0.2-0.5 s later). Without it
    a light call timed within about half a second of a heavy one runs at the lowered clock: the
    decode kernel at 14336 x 4096 M = 16 took 14.7 us there against 14.1 after a pause."""
    if seconds > 0:
        cupy.cuda.Device().synchronize()
        time.sleep(seconds)


def reps_for(seconds_per_replay: float, budget: float, lo: int = 3, hi: int = 20) -> int:
    """Replays of a graph that lasts about ``seconds_per_replay`` that fit in ``budget`` seconds,
    clamped to ``[lo, hi]``: heavy cells get few replays (their spread is small), light ones more."""
    if seconds_per_replay <= 0:
        return hi
    return max(lo, min(hi, math.floor(budget / seconds_per_replay)))


def capture_graph(fn, args_list, stream):
    """The calls ``fn(*args)`` (one per ``args_list`` entry, in order) captured in one CUDA graph on
    ``stream``, each made once before the capture (compilation and allocation outside it, and the
    steady state of a model's step: a matmul reads a weight before the PDL wait only from its
    second call with that weight, weight.py _early_ok). Replay with ``graph.launch(stream)``. A call
    that fails during the capture ends the capture before its error propagates, so that the
    stream can be used again (for a loop of calls instead)."""
    with stream:
        for args in args_list:
            fn(*args)
        stream.synchronize()
        stream.begin_capture()
        try:
            for args in args_list:
                fn(*args)
        except BaseException:
            try:
                stream.end_capture()
            except Exception:  # noqa: BLE001 - the capture is invalid already; the first error matters
                pass
            raise
        return stream.end_capture()


def time_graph(fn, args_list, reps: int = 20, stream=None) -> float:
    """Median seconds per call of ``fn(*args)``, the calls captured in one CUDA graph
    (:func:`capture_graph`) and replayed: for kernels of a few microseconds, where the time
    between two events around one Python call would be the host's launch time, not the GPU's."""
    stream = stream or cupy.cuda.Stream(non_blocking=True)
    graph = capture_graph(fn, args_list, stream)
    graph.launch(stream)
    stream.synchronize()
    times = []
    for _ in range(reps):
        s, e = cupy.cuda.Event(), cupy.cuda.Event()
        s.record(stream)
        graph.launch(stream)
        e.record(stream)
        e.synchronize()
        times.append(cupy.cuda.get_elapsed_time(s, e))
    return statistics.median(times) / 1e3 / len(args_list)


def capture_torch_graph(torch, fn, args_list):
    """:func:`capture_graph` for torch calls: the first two calls made on a side stream, then every
    call captured in a ``torch.cuda.CUDAGraph`` (replay with ``graph.replay()``)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for args in args_list[:2]:
            fn(*args)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for args in args_list:
            fn(*args)
    return g


def time_torch_graph(torch, fn, args_list, reps: int = 20) -> float:
    """:func:`time_graph` for torch calls (:func:`capture_torch_graph`)."""
    g = capture_torch_graph(torch, fn, args_list)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times) / 1e3 / len(args_list)


class GraphTimer:
    """The timings of a table whose cells differ by orders of magnitude: each contender's calls
    captured in one CUDA graph, replayed for about ``budget`` seconds (3 to 20 replays,
    :func:`reps_for`, from ``est``, a rough time of one call), ``settle`` seconds of idle GPU before
    each timing (:func:`settle`). Our calls that cannot be captured fall back to a loop of calls
    between two events, and say so."""

    def __init__(self, settle: float, budget: float):
        self.settle, self.budget = settle, budget

    def ours(self, fn, args_list, est: float):
        """(seconds per call, None) from a CuPy graph (:func:`time_graph`), or (seconds per call,
        "loop (the capture's exception)") from :func:`time_loop` when the capture fails."""
        reps = reps_for(est * len(args_list), self.budget)
        settle(self.settle)
        try:
            return time_graph(fn, args_list, reps), None
        except Exception as e:  # noqa: BLE001 - any capture failure: time a loop instead, and say so
            settle(self.settle)
            calls = max(len(args_list), reps_for(est, self.budget, lo=10, hi=200))
            return time_loop(fn, args_list, calls=calls), f"loop ({type(e).__name__})"

    def torch_graph(self, torch, fn, args_list, est: float) -> float:
        """Seconds per call from a torch graph (:func:`time_torch_graph`)."""
        reps = reps_for(est * len(args_list), self.budget)
        settle(self.settle)
        return time_torch_graph(torch, fn, args_list, reps)

    def loop(self, fn, args_list, est: float) -> float:
        """Seconds per call of a loop of calls (:func:`time_loop`), for calls no graph can hold."""
        settle(self.settle)
        return time_loop(fn, args_list, calls=max(len(args_list), reps_for(est, self.budget, 10, 200)))


def time_loop(fn, args_list, calls: int = 100) -> float:
    """Seconds per call over ``calls`` back-to-back calls between two events (for calls that cannot
    be captured in a graph, such as cuBLAS through cupy.matmul; host-bound when one call's GPU time
    is below its Python launch time)."""
    for args in args_list[:2]:
        fn(*args)
    s, e = cupy.cuda.Event(), cupy.cuda.Event()
    s.record()
    for i in range(calls):
        fn(*args_list[i % len(args_list)])
    e.record()
    e.synchronize()
    return cupy.cuda.get_elapsed_time(s, e) / 1e3 / calls
