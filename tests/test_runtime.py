"""How every op behaves around the CUDA runtime rather than what it computes: capture in a CUDA
graph and replay on new inputs, no host synchronization, two streams at once, first calls from many
threads, several GPUs, and DLPack interop with torch and JAX.

Every public op appears in :data:`OPS`, each entry a function of the input buffers ``d`` (see
:func:`_device_inputs`) that returns the device arrays it produced, so each test here runs the same
list. The bytes themselves are checked against :mod:`cupyquant.reference` in the per-family test
files; here the graph, stream and thread results are compared byte for byte with the same op run
eagerly on the same inputs, or with the reference where the test is about interop.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# JAX reserves 75% of the GPU at its first use unless told not to, and CuPy and torch share the GPU
# in this process. setdefault leaves a value the caller set alone; the variable is read by JAX only.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from conftest import assert_bits_equal, heavy_tailed, poisoned, require_arch, side_stream  # noqa: E402

import cupyquant as cq  # noqa: E402
from cupyquant import _device, _jit  # noqa: E402
from cupyquant import reference as ref  # noqa: E402

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")

BF16 = ml_dtypes.bfloat16
E4, E5, E2M1, I8 = "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn", "int8"

X_SHAPE = (3, 37, 512)  # odd row count; [gate | up] with H = 256 for SiLU*Mul; every block size divides K
W_SHAPE = (96, 384)  # (N, K): 3 groups of 128 (odd: uint4's zero points get a padding nibble)
A_ROWS, BIG_ROWS = 5, 777  # decode-sized M, and an M past every tile size of the matmul
#: QuantizedWeight inputs of the dequantize_weight and matmul ops: key -> (scheme, group_size).
WEIGHTS = {"qw_int4": ("int4", 128), "qw_uint4": ("uint4", 64), "qw_fp8": (E4, None)}
FAMILIES = ("per_tensor", "groupwise", "mx", "nvfp4", "weight_quant", "weight_decode")

#: clock64() cycles of the long spin: about 0.5 s at H100/H200 clocks (1.6-2 GHz).
SPIN_CYCLES = 1 << 30
_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


# ------------------------------------------------------------------ inputs and the list of ops


def _host_inputs(seed: int) -> dict:
    """The raw inputs as NumPy arrays; a new seed gives new values of the same shapes."""
    rng = np.random.default_rng(seed)
    return {
        "x": heavy_tailed(X_SHAPE, seed, BF16),
        # static FP8 scale, NVFP4 global scale and per-token scale_ub, read on the device
        "s": np.array([rng.uniform(0.05, 2.0)], np.float32),
        "w": (rng.standard_normal(W_SHAPE) * 0.05).astype(np.float32).astype(BF16),
        "a": rng.standard_normal((A_ROWS, W_SHAPE[1])).astype(np.float32).astype(BF16),
        "a_big": rng.standard_normal((BIG_ROWS, W_SHAPE[1])).astype(np.float32).astype(BF16),
    }


def _add_weights(d: dict) -> dict:
    """Quantize ``d["w"]`` into the QuantizedWeight inputs, on the current stream."""
    for key, (scheme, group_size) in WEIGHTS.items():
        d[key] = cq.quantize_weight(d["w"], scheme, group_size=group_size)
    return d


def _device_inputs(h: dict) -> dict:
    d = _add_weights({k: cupy.asarray(v) for k, v in h.items()})
    cupy.cuda.Device().synchronize()  # the tests read these from other streams
    return d


def _copy_into(dst, src, stream=None) -> None:
    """Byte copy of src into dst on ``stream`` (the current one when None); a memcpy, no kernel,
    so it works for every dtype."""
    assert dst.shape == src.shape and dst.dtype == src.dtype
    assert dst.flags.c_contiguous and src.flags.c_contiguous
    stream_ptr = cupy.cuda.get_current_stream().ptr if stream is None else stream.ptr
    rt = cupy.cuda.runtime
    rt.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, rt.memcpyDeviceToDevice, stream_ptr)


def _update_in_place(d: dict, h: dict) -> None:
    """Write the values of ``h`` into the buffers of ``d`` (a captured graph reads those addresses),
    the QuantizedWeight inputs re-quantized from the new ``w`` into their own buffers."""
    for k, v in h.items():
        d[k].set(v)
    for key, (scheme, group_size) in WEIGHTS.items():
        new = cq.quantize_weight(d["w"], scheme, group_size=group_size)
        for part in ("data", "scale", "zero_point"):
            if getattr(new, part) is not None:
                _copy_into(getattr(d[key], part), getattr(new, part))
    cupy.cuda.Device().synchronize()


def _qt(q) -> list:
    """The device arrays of a QuantizedTensor."""
    return [a for a in (q.data, q.scale, q.amax, q.global_scale) if a is not None]


def _qw(w) -> list:
    """The device arrays of a QuantizedWeight."""
    return [a for a in (w.data, w.scale, w.zero_point) if a is not None]


def _dq(q, dtype=None) -> list:
    """Dequantize q; q's own arrays are returned too, so that a captured graph's every buffer stays
    referenced by the test."""
    return [cq.dequantize(q, dtype)] + _qt(q)


#: name -> op(d) -> list of the device arrays it produced.
OPS = {
    "quantize_fp8-dynamic": lambda d: _qt(cq.quantize_fp8(d["x"])),
    "quantize_fp8-e5m2-static-float": lambda d: _qt(cq.quantize_fp8(d["x"], E5, scale=0.37)),
    "quantize_fp8-static-device": lambda d: _qt(cq.quantize_fp8(d["x"], scale=d["s"])),
    "amax": lambda d: [cq.amax(d["x"])],
    "quantize_groupwise-fp8-g128-row": lambda d: _qt(cq.quantize_groupwise(d["x"], E4, group_size=128)),
    "quantize_groupwise-int8-g32-col": lambda d: _qt(
        cq.quantize_groupwise(d["x"], I8, group_size=32, scale_layout="col")
    ),
    "quantize_groupwise-e5m2-g64-ue8m0-col": lambda d: _qt(
        cq.quantize_groupwise(d["x"], E5, group_size=64, scale_layout="col", scale_dtype="float8_e8m0fnu")
    ),
    "quantize_groupwise-fp8-token-scale_ub": lambda d: _qt(
        cq.quantize_groupwise(d["x"], E4, group_size=None, scale_ub=d["s"])
    ),
    "silu_mul_quantize-fp8-g128": lambda d: _qt(cq.silu_mul_quantize(d["x"], E4, group_size=128)),
    "silu_mul_quantize-int8-g64-col": lambda d: _qt(
        cq.silu_mul_quantize(d["x"], I8, group_size=64, scale_layout="col")
    ),
    "quantize_mx-e4m3": lambda d: _qt(cq.quantize_mx(d["x"], E4)),
    "quantize_mx-e5m2-floor-swizzled": lambda d: _qt(
        cq.quantize_mx(d["x"], E5, scale_layout="swizzled", rounding="floor")
    ),
    "quantize_mx-e2m1-swizzled": lambda d: _qt(cq.quantize_mx(d["x"], E2M1, scale_layout="swizzled")),
    "quantize_nvfp4-dynamic": lambda d: _qt(cq.quantize_nvfp4(d["x"])),
    "quantize_nvfp4-global_scale-float": lambda d: _qt(
        cq.quantize_nvfp4(d["x"], global_scale=2688.0 / 50, scale_layout="dense")
    ),
    "quantize_nvfp4-global_scale-device": lambda d: _qt(cq.quantize_nvfp4(d["x"], global_scale=d["s"])),
    "quantize_weight-int4-g128": lambda d: _qw(cq.quantize_weight(d["w"], "int4", group_size=128)),
    "quantize_weight-uint4-g128": lambda d: _qw(cq.quantize_weight(d["w"], "uint4", group_size=128)),
    "quantize_weight-fp8-channel": lambda d: _qw(cq.quantize_weight(d["w"], E4, group_size=None)),
    "dequantize-fp8-tensor": lambda d: _dq(cq.quantize_fp8(d["x"])),
    "dequantize-fp8-group-col-ue8m0": lambda d: _dq(
        cq.quantize_groupwise(d["x"], E4, group_size=128, scale_layout="col", scale_dtype="float8_e8m0fnu"),
        np.float32,
    ),
    "dequantize-int8-token": lambda d: _dq(cq.quantize_groupwise(d["x"], I8, group_size=None), np.float16),
    "dequantize-mxfp8-swizzled": lambda d: _dq(cq.quantize_mx(d["x"], E4, scale_layout="swizzled")),
    "dequantize-mxfp4": lambda d: _dq(cq.quantize_mx(d["x"], E2M1), np.float32),
    "dequantize-nvfp4": lambda d: _dq(cq.quantize_nvfp4(d["x"])),
    "dequantize_weight-int4": lambda d: [cq.dequantize_weight(d["qw_int4"])],
    "dequantize_weight-uint4": lambda d: [cq.dequantize_weight(d["qw_uint4"], np.float32)],
    "dequantize-weight-fp8": lambda d: [cq.dequantize(d["qw_fp8"], np.float16)],
    "matmul-int4-g128": lambda d: [cq.matmul(d["a"], d["qw_int4"])],
    "matmul-uint4-g64": lambda d: [cq.matmul(d["a"], d["qw_uint4"])],
    "matmul-fp8-channel": lambda d: [cq.matmul(d["a"], d["qw_fp8"])],
    "matmul-int4-g128-M777": lambda d: [cq.matmul(d["a_big"], d["qw_int4"])],
    "matmul-uint4-g64-M777": lambda d: [cq.matmul(d["a_big"], d["qw_uint4"])],
}


def _assert_same_outputs(got, want, what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} outputs, expected {len(want)}"
    for i, (g, e) in enumerate(zip(got, want, strict=True)):
        assert tuple(g.shape) == tuple(e.shape) and g.dtype == e.dtype, (
            f"{what}: output {i} is {g.dtype} {g.shape}, expected {e.dtype} {e.shape}"
        )
        assert_bits_equal(g, e, f"{what}: output {i}")


# ------------------------------------------------------------------ CUDA graphs


def _capture(name: str, op, d: dict, stream):
    """Capture op(d) on ``stream`` (CuPy's default relaxed mode); fails the test, naming the op,
    if the op cannot be captured. Returns (the op's outputs, the graph)."""
    with stream:
        stream.begin_capture()
        try:
            outs = op(d)
        except Exception as e:  # noqa: BLE001 - any failure inside the capture is reported as this op's
            try:
                stream.end_capture()
            except Exception:  # noqa: BLE001 - the capture is already broken; its error is reported below
                pass
            pytest.fail(f"{name} cannot be captured in a CUDA graph: {type(e).__name__}: {e}")
        try:
            graph = stream.end_capture()
        except Exception as e:  # noqa: BLE001 - reported as this op's
            pytest.fail(f"{name} broke the CUDA graph capture: {type(e).__name__}: {e}")
    return outs, graph


def _poison_buffers(arrays, stream) -> None:
    """Fill each array's whole allocation with 0xFF on ``stream``."""
    for a in arrays:
        mem = a.data.mem
        if mem.size:
            cupy.cuda.runtime.memsetAsync(mem.ptr, 0xFF, mem.size, stream.ptr)


@pytest.mark.parametrize("name", list(OPS))
def test_cuda_graph_replays_on_new_inputs(name):
    """One warm-up call, then the op captured on a non-default stream; the inputs are rewritten in
    place and the outputs poisoned before each replay, and what the replay wrote must equal, byte
    for byte, the same op run eagerly on the new inputs (so nothing computed on the host at capture
    time, an amax or a scale, may be baked into the graph)."""
    op = OPS[name]
    d = _device_inputs(_host_inputs(1))
    stream = side_stream()
    with stream:
        op(d)  # compiles the kernels (compiling and loading may synchronize; capture must not)
    stream.synchronize()
    outs, graph = _capture(name, op, d, stream)
    for seed in (2, 3):
        _update_in_place(d, _host_inputs(seed))
        _poison_buffers(outs, stream)
        graph.launch(stream)
        stream.synchronize()
        _assert_same_outputs(outs, op(d), f"{name}: graph replay on the inputs of seed {seed}")


class _CaptureAllocations(cupy.cuda.MemoryHook):
    """Records the memory-pool allocations made while it is active, and which of them went back to
    the pool."""

    name = "cupyquant_test_capture_allocations"

    def __init__(self):
        self.live: dict = {}  # pointer -> bytes, allocated and not freed
        self.freed: dict = {}  # pointer -> bytes, allocated and then freed

    def malloc_postprocess(self, **kw):
        self.live[kw["mem_ptr"]] = kw["mem_size"]
        self.freed.pop(kw["mem_ptr"], None)

    def free_preprocess(self, **kw):
        ptr = kw["mem_ptr"]
        if ptr in self.live:
            self.freed[ptr] = self.live.pop(ptr)


@pytest.mark.parametrize("name", list(OPS))
def test_cuda_graph_owns_every_buffer_it_writes(name):
    """Every allocation an op makes inside a capture must still be referenced (by its result) when
    the capture ends. A temporary freed back to CuPy's pool stays a target of the graph: each replay
    writes it (here at least the test allocator's poison memset does), while the pool may hand the
    same memory to the next array allocated on that stream, or release it to the driver."""
    op = OPS[name]
    d = _device_inputs(_host_inputs(1))
    stream = side_stream()
    with stream:
        op(d)
    stream.synchronize()
    hook = _CaptureAllocations()
    with hook:
        outs, graph = _capture(name, op, d, stream)
        gc.collect()
    assert not hook.freed, (
        f"{name}: {len(hook.freed)} of its {len(hook.freed) + len(hook.live)} device allocations made "
        f"inside the capture ({sum(hook.freed.values())} bytes) were returned to the memory pool while the "
        "graph still writes them; keep such buffers alive with the result (or write the final layout "
        "directly) so that a replay cannot overwrite memory the pool has handed out again"
    )
    del outs, graph


# ------------------------------------------------------------------ no host synchronization


class _HostSync(Exception):
    """Raised by the patched synchronizing entry points."""


def _forbidden(what: str):
    def call(*args, **kwargs):
        raise _HostSync(f"{what} was called")

    return call


class _NoSyncDevice(cupy.cuda.Device):
    """cupy.cuda.Device is an extension type whose methods cannot be patched; this subclass stands
    in for it while synchronization is forbidden."""

    def synchronize(self):
        raise _HostSync("cupy.cuda.Device.synchronize was called")


def _forbid_host_sync(monkeypatch) -> None:
    for attr in ("get", "item", "tolist", "__float__", "__int__", "__index__", "__bool__", "__complex__"):
        if hasattr(cupy.ndarray, attr):  # cupy 14's ndarray has no __index__
            monkeypatch.setattr(cupy.ndarray, attr, _forbidden(f"cupy.ndarray.{attr}"))
    monkeypatch.setattr(cupy, "asnumpy", _forbidden("cupy.asnumpy"))
    for cls in (cupy.cuda.Stream, cupy.cuda.ExternalStream, cupy.cuda.Event):
        monkeypatch.setattr(cls, "synchronize", _forbidden(f"cupy.cuda.{cls.__name__}.synchronize"))
    monkeypatch.setattr(cupy.cuda, "Device", _NoSyncDevice)
    for fn in ("deviceSynchronize", "streamSynchronize", "eventSynchronize", "memcpy", "memcpy2D"):
        monkeypatch.setattr(cupy.cuda.runtime, fn, _forbidden(f"cupy.cuda.runtime.{fn}"))


def test_no_op_synchronizes_the_host(monkeypatch):
    """Every op, after a warm-up call, with CuPy's synchronizing entry points patched to raise: the
    device-to-host copies and conversions of cupy.ndarray, cupy.asnumpy, stream, event and device
    synchronize, and the runtime's synchronize and blocking memcpy functions. The patches are
    checked to raise first; the outputs are checked after the patches are undone."""
    d = _device_inputs(_host_inputs(5))
    want = {name: [a.get() for a in op(d)] for name, op in OPS.items()}  # also the warm-up
    probe = cupy.arange(4, dtype=cupy.float32)
    probe_int = cupy.arange(4, dtype=cupy.int64)[2]
    cupy.cuda.Device().synchronize()

    _forbid_host_sync(monkeypatch)
    sanity = {
        "x.get()": lambda: probe.get(),
        "x.item()": lambda: probe[1].item(),
        "x.tolist()": lambda: probe.tolist(),
        "float(x)": lambda: float(probe[1]),
        "int(x)": lambda: int(probe_int),
        "bool(x)": lambda: bool(probe[1]),
        "cupy.asnumpy(x)": lambda: cupy.asnumpy(probe),
        "Stream.null.synchronize()": lambda: cupy.cuda.Stream.null.synchronize(),
        "get_current_stream().synchronize()": lambda: cupy.cuda.get_current_stream().synchronize(),
        "Stream().synchronize()": lambda: cupy.cuda.Stream(non_blocking=True).synchronize(),
        "Event().synchronize()": lambda: cupy.cuda.Event().synchronize(),
        "cupy.cuda.Device().synchronize()": lambda: cupy.cuda.Device().synchronize(),
        "runtime.deviceSynchronize()": lambda: cupy.cuda.runtime.deviceSynchronize(),
        "runtime.streamSynchronize(0)": lambda: cupy.cuda.runtime.streamSynchronize(0),
    }
    for what, call in sanity.items():
        with pytest.raises(_HostSync):
            call()
            pytest.fail(f"the patch did not take: {what} returned")

    got, failures = {}, []
    for name, op in OPS.items():
        try:
            got[name] = op(d)
        except Exception as e:  # _HostSync, or anything else the patches made fail: report by op
            failures.append(f"{name}: {type(e).__name__}: {e}")
    monkeypatch.undo()
    assert not failures, "ops that synchronized with the host:\n" + "\n".join(failures)
    for name, outs in got.items():
        _assert_same_outputs(outs, want[name], name)


def test_ops_return_while_the_stream_is_busy():
    """A kernel spins for about half a second on a stream; every op is then called on that stream.
    An op that waits for the device in any way (a synchronize, a blocking copy, an implicit
    synchronization in the driver, hidden in CuPy's C code or anywhere else) cannot return before
    the spin ends, so each op's host time must stay far below it."""
    d = _device_inputs(_host_inputs(6))
    spin = cupy.RawKernel(_SPIN, "spin")
    stream = side_stream()
    with stream:
        spin((1,), (1,), (np.int64(1),))
        for _ in range(2):  # compile everything; leave buffers of every size in this stream's pool
            outs = [op(d) for op in OPS.values()]
            del outs
    stream.synchronize()

    took = {}
    with stream:
        t0 = time.perf_counter()
        spin((1,), (1,), (np.int64(SPIN_CYCLES),))
        for name, op in OPS.items():
            t = time.perf_counter()
            op(d)
            took[name] = time.perf_counter() - t
        host = time.perf_counter() - t0
        busy = not stream.done
    stream.synchronize()
    total = time.perf_counter() - t0
    assert total > 0.1, f"the spin kernel took {total:.3f} s: too short to tell a wait from none"
    waited = [f"{n} ({t * 1e3:.1f} ms)" for n, t in took.items() if t > total / 4]
    assert not waited, f"ops that waited for the device (spin {total * 1e3:.0f} ms): {', '.join(waited)}"
    assert busy and host < total / 2, (
        f"the ops took {host * 1e3:.1f} ms of host time and the stream was {'busy' if busy else 'idle'} "
        f"after them, against a {total * 1e3:.0f} ms spin"
    )


# ------------------------------------------------------------------ two streams


def test_two_streams_at_once():
    """The same ops on two non-blocking streams, interleaved. Each stream first spins (for a
    different time), then copies its real inputs over poisoned buffers and quantizes its weights;
    an op that put any of its work on another stream would read the poison or race the other
    stream. Every output must equal the op run eagerly on that stream's inputs."""
    spin = cupy.RawKernel(_SPIN, "spin")
    src = [{k: cupy.asarray(v) for k, v in _host_inputs(seed).items()} for seed in (11, 12)]
    want = []
    for s in src:  # eager, on the default stream; also compiles every kernel
        d = _add_weights(dict(s))
        want.append({name: [a.get() for a in op(d)] for name, op in OPS.items()})
    spin((1,), (1,), (np.int64(1),))
    ds = [{k: poisoned(v.shape, v.dtype) for k, v in s.items()} for s in src]
    cupy.cuda.Device().synchronize()

    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    for i, (stream, d, s) in enumerate(zip(streams, ds, src, strict=True)):
        with stream:
            spin((1,), (1,), (np.int64(SPIN_CYCLES // (5 * (i + 1))),))  # ~0.1 s, ~0.05 s
            for k in s:
                _copy_into(d[k], s[k], stream)
            _add_weights(d)
    got = [{}, {}]
    for name, op in OPS.items():
        for i, (stream, d) in enumerate(zip(streams, ds, strict=True)):
            with stream:
                got[i][name] = op(d)
    for stream in streams:
        stream.synchronize()
    for i in range(2):
        for name in OPS:
            _assert_same_outputs(got[i][name], want[i][name], f"stream {i}: {name}")


# ------------------------------------------------------------------ threads


@pytest.mark.slow
def test_first_calls_from_threads_compile_each_instantiation_once(tmp_path):
    """tests/_first_calls_in_threads.py in a fresh process with an empty CuPy kernel cache: 8
    threads released by a barrier make the first calls of every family at once, each thread
    starting with a different family. Each instantiation is built exactly once
    (``_jit._build_module`` counted per instantiation and architecture) and every thread gets the
    reference bytes."""
    script = Path(__file__).with_name("_first_calls_in_threads.py")
    env = dict(os.environ)
    env["CUPY_CACHE_DIR"] = str(tmp_path / "cupy-cache")
    env.pop("CUPY_CACHE_IN_MEMORY", None)
    package_root = str(Path(cq.__file__).resolve().parent.parent)  # the cupyquant this process tests
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"the thread script failed:\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not report["problems"], "\n".join(report["problems"])
    assert report["finished"] == report["threads"] == 8
    arch = _device.arch(0)
    builds = report["builds"]
    assert {f"{f}@sm_{arch}" for f in FAMILIES} <= {b.split(":")[0] for b in builds}, f"built: {builds}"
    assert all(n == 1 for n in builds.values()), f"an instantiation was built more than once: {builds}"
    assert report["cache_files"] > 0, "nothing was written to the fresh CUPY_CACHE_DIR"


# ------------------------------------------------------------------ several GPUs


def _need_two_gpus():
    n = cupy.cuda.runtime.getDeviceCount()
    if n < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {n}")


def test_array_on_the_second_gpu_is_quantized_there():
    """With device 0 current, ops on arrays of device 1 run on device 1 (kernels built for it), put
    their results there, give the reference bytes, and leave device 0 current."""
    _need_two_gpus()
    xh = heavy_tailed(X_SHAPE, 31, BF16)
    wh = (np.random.default_rng(32).standard_normal(W_SHAPE) * 0.05).astype(np.float32).astype(BF16)
    ah = np.random.default_rng(33).standard_normal((A_ROWS, W_SHAPE[1])).astype(np.float32).astype(BF16)
    with cupy.cuda.Device(1):
        x, w, a = cupy.asarray(xh), cupy.asarray(wh), cupy.asarray(ah)
        out = poisoned(X_SHAPE, np.uint8)
    assert cupy.cuda.runtime.getDevice() == 0

    q = cq.quantize_fp8(x, out=out)
    assert q.data is out
    eq, es = ref.quantize_fp8(xh)
    assert_bits_equal(q.data, eq, "fp8 data")
    assert_bits_equal(q.scale, es, "fp8 scale")
    y = cq.dequantize(q)
    assert_bits_equal(y, ref.dequantize_fp8(eq, es, E4, BF16), "fp8 dequantized")
    g = cq.quantize_groupwise(x, E4, group_size=128)
    gq, gs = ref.quantize_groupwise(xh, E4, group_size=128)
    assert_bits_equal(g.data, gq, "group data")
    assert_bits_equal(g.scale, gs, "group scales")
    m = cq.quantize_mx(x, E2M1)
    md, ms = ref.quantize_mx(xh, E2M1)
    assert_bits_equal(m.data, md, "mxfp4 data")
    assert_bits_equal(m.scale, ms, "mxfp4 scales")
    n = cq.quantize_nvfp4(x, scale_layout="dense")
    nd, ns, ng = ref.quantize_nvfp4(xh)
    assert_bits_equal(n.data, nd, "nvfp4 data")
    assert_bits_equal(n.scale, ns, "nvfp4 scales")
    assert_bits_equal(n.global_scale, np.array([ng], np.float32), "nvfp4 global scale")
    qw = cq.quantize_weight(w, "int4", group_size=128)
    wd, wsc, _ = ref.quantize_weight(wh, "int4", group_size=128)
    assert_bits_equal(qw.data, wd, "int4 data")
    assert_bits_equal(qw.scale, wsc, "int4 scales")
    mm = cq.matmul(a, qw)
    # the same product on device 0: the same kernel on the same kind of GPU gives the same bits
    mm0 = cq.matmul(cupy.asarray(ah), cq.quantize_weight(cupy.asarray(wh), "int4", group_size=128))
    assert_bits_equal(mm, mm0.get(), "matmul on device 1 vs device 0")

    results = _qt(q) + [y] + _qt(g) + _qt(m) + _qt(n) + _qw(qw) + [mm]
    assert [r.data.device_id for r in results] == [1] * len(results)
    assert cupy.cuda.runtime.getDevice() == 0
    for family in FAMILIES:
        assert any(k[:2] == (1, family) for k in _jit._kernels), f"no {family} kernel was loaded for device 1"


def test_buffers_on_another_gpu_are_refused_by_name():
    """Inputs on device 0 with an ``out=``, scale or other argument on device 1 (or the reverse
    for the matmul's ``a``): a ValueError naming the argument and both devices, before anything is
    written."""
    _need_two_gpus()
    rng = np.random.default_rng(34)
    x = cupy.asarray(heavy_tailed((4, 256), 35, BF16))
    a = cupy.asarray(rng.standard_normal((3, 256)).astype(np.float32).astype(BF16))
    qw = cq.quantize_weight(cupy.asarray((rng.standard_normal((64, 256)) * 0.05).astype(np.float32).astype(BF16)))
    q = cq.quantize_fp8(x)
    with cupy.cuda.Device(1):
        out_q = poisoned((4, 256), np.uint8)
        out_h = poisoned((4, 128), np.uint8)
        out_y = poisoned((4, 256), BF16)
        out_mm = poisoned((3, 64), BF16)
        out_w = poisoned((64, 256), BF16)
        s1 = cupy.asarray(np.array([0.5], np.float32))
        scales1 = cq.empty_scales((4, 256), 128, "row")
        a1 = cupy.asarray(a.get())
    cupy.cuda.Device(1).synchronize()
    cases = [  # (argument, call, the device-1 buffer it must leave untouched)
        ("out", lambda: cq.quantize_fp8(x, out=out_q), out_q),
        ("scale", lambda: cq.quantize_fp8(x, scale=s1), s1),
        ("out", lambda: cq.quantize_groupwise(x, E4, group_size=128, out=out_q), out_q),
        ("scale_out", lambda: cq.quantize_groupwise(x, E4, group_size=128, scale_out=scales1), scales1),
        ("scale_ub", lambda: cq.quantize_groupwise(x, E4, group_size=None, scale_ub=s1), s1),
        ("out", lambda: cq.silu_mul_quantize(x, E4, group_size=128, out=out_h), out_h),
        ("out", lambda: cq.quantize_mx(x, E2M1, out=out_h), out_h),
        ("out", lambda: cq.quantize_nvfp4(x, out=out_h), out_h),
        ("global_scale", lambda: cq.quantize_nvfp4(x, global_scale=s1), s1),
        ("out", lambda: cq.dequantize(q, out=out_y), out_y),
        ("out", lambda: cq.dequantize_weight(qw, out=out_w), out_w),
        ("out", lambda: cq.matmul(a, qw, out=out_mm), out_mm),
        ("a", lambda: cq.matmul(a1, qw), a1),
    ]
    for arg, call, buf in cases:
        before = buf.get()
        with pytest.raises(ValueError, match=rf"^{arg} is on device 1 but .* is on device 0"):
            call()
        assert_bits_equal(buf, before, f"{arg} after the refused call")
    assert cupy.cuda.runtime.getDevice() == 0


# ------------------------------------------------------------------ DLPack: torch and JAX

_E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch was built without CUDA or sees no GPU")
    return torch


def test_torch_in_and_out_without_copies():
    """A torch bfloat16 CUDA tensor enters through cupy.from_dlpack sharing its memory; FP8, FP4
    and scale outputs leave through torch.from_dlpack sharing theirs, and torch's float8 views
    (and a nibble decode of FP4) give the values ml_dtypes gives on the host."""
    torch = _torch_cuda()
    torch.manual_seed(0)
    xt = (torch.randn(4, 33, 256, device="cuda") * 3).to(torch.bfloat16)
    x = cupy.from_dlpack(xt)
    assert x.data.ptr == xt.data_ptr(), "cupy.from_dlpack copied the torch tensor"
    assert x.dtype == np.dtype(BF16) and x.shape == tuple(xt.shape)
    xh = x.get()

    views = {E4: (torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn), E5: (torch.float8_e5m2, ml_dtypes.float8_e5m2)}
    for fmt, (tdtype, hdtype) in views.items():
        q = cq.quantize_fp8(x, fmt)
        eq, es = ref.quantize_fp8(xh, fmt)
        assert_bits_equal(q.data, eq, f"{fmt} data")
        assert_bits_equal(q.scale, es, f"{fmt} scale")
        qt = torch.from_dlpack(q.data)
        assert qt.dtype == torch.uint8 and tuple(qt.shape) == q.data.shape
        assert qt.data_ptr() == q.data.data.ptr, "torch.from_dlpack copied the FP8 bytes"
        got = qt.view(tdtype).float().cpu().numpy()
        assert_bits_equal(got, eq.view(hdtype).astype(np.float32), f"torch {tdtype} view vs ml_dtypes")
        st = torch.from_dlpack(q.scale)
        assert st.dtype == torch.float32 and st.data_ptr() == q.scale.data.ptr
        assert_bits_equal(st.cpu().numpy(), es, f"{fmt} scale in torch")

    # per-group scales in DeepGEMM's column-major layout keep their strides through DLPack
    g = cq.quantize_groupwise(x, E4, group_size=128, scale_layout="col")
    gt = torch.from_dlpack(g.scale)
    assert gt.data_ptr() == g.scale.data.ptr
    assert tuple(gt.stride()) == tuple(s // 4 for s in g.scale.strides)
    assert_bits_equal(gt.cpu().numpy(), g.scale.get(), "col-layout scales in torch")

    # FP4: two E2M1 codes per byte, element 0 in the low nibble
    m = cq.quantize_mx(x, E2M1)
    pt = torch.from_dlpack(m.data)
    assert pt.dtype == torch.uint8 and pt.data_ptr() == m.data.data.ptr
    codes = torch.stack([pt & 0xF, pt >> 4], dim=-1).reshape(*pt.shape[:-1], -1)
    lut = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=pt.device)
    got = lut[codes.long()].cpu().numpy()
    want = m.to_host()["data"].astype(np.float32)
    assert_bits_equal(got, want, "MXFP4 elements decoded in torch vs ml_dtypes")

    # NVFP4 block scales are E4M3 bytes
    n = cq.quantize_nvfp4(x, scale_layout="dense")
    nt = torch.from_dlpack(n.scale)
    assert nt.data_ptr() == n.scale.data.ptr
    got = nt.view(torch.float8_e4m3fn).float().cpu().numpy()
    assert_bits_equal(got, n.to_host()["scale"].astype(np.float32), "NVFP4 scales in torch vs ml_dtypes")


_JAX_SCRIPT = r"""
import sys
import numpy as np, ml_dtypes, cupy
import jax, jax.numpy as jnp
import cupyquant as cq
from cupyquant import reference as ref
try:
    gpu = jax.devices("gpu")[0]
except RuntimeError as e:
    print("NOGPU", e); sys.exit(0)
rng = np.random.default_rng(41)
xh = (rng.standard_normal((4, 33, 256)) * np.exp(2 * rng.standard_normal((4, 33, 256)))).astype(np.float32).astype(ml_dtypes.bfloat16)
xj = jax.device_put(xh, gpu)
xj.block_until_ready()
x = cupy.from_dlpack(xj)
assert x.data.ptr == xj.unsafe_buffer_pointer(), "cupy.from_dlpack copied the JAX array"
assert x.dtype == np.dtype(ml_dtypes.bfloat16) and x.shape == xh.shape
assert (cupy.asnumpy(x).view(np.uint16) == xh.view(np.uint16)).all()
q = cq.quantize_fp8(x)
eq, es = ref.quantize_fp8(xh)
assert (cupy.asnumpy(q.data) == eq.view(np.uint8)).all(), "fp8 data"
cupy.cuda.get_current_stream().synchronize()  # JAX reads on its own stream
qj = jnp.from_dlpack(q.data)
assert qj.dtype == np.uint8 and qj.shape == q.data.shape
f8 = np.asarray(jax.lax.bitcast_convert_type(qj, jnp.float8_e4m3fn))
assert f8.dtype == np.dtype(ml_dtypes.float8_e4m3fn)
assert (f8.view(np.uint8) == eq.view(np.uint8)).all(), "float8_e4m3fn in JAX"
assert (np.asarray(jnp.from_dlpack(q.scale)).view(np.uint32) == np.asarray(es, np.float32).view(np.uint32)).all()
print("OK")
"""


def test_jax_in_and_out():
    """A JAX bfloat16 GPU array enters through cupy.from_dlpack sharing its buffer; the FP8 bytes
    go back through jnp.from_dlpack as uint8 and bitcast to float8_e4m3fn there. In a fresh
    process: JAX's GPU client must not start inside a process whose CuPy pool holds the memory."""
    pytest.importorskip("jax")
    cupy.get_default_memory_pool().free_all_blocks()
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _JAX_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    if r.stdout.startswith("NOGPU"):
        pytest.skip(f"JAX has no GPU backend here: {r.stdout.strip()}")
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), (
        f"rc {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    )


# ------------------------------------------------------------------ programmatic dependent launch
#: The ops whose every launch carries PDL where the GPU has it (the weight ops decide their own:
#: cupyquant.weight), and the fused RMSNorm and the KV cache, which OPS does not hold.
PDL_OPS = [n for n in OPS if not n.startswith(("quantize_weight", "dequantize_weight", "dequantize-weight", "matmul"))]


@pytest.mark.parametrize("pdl", [True, False], ids=["caps", "caps-without-pdl"])
def test_launches_carry_pdl_by_capability(pdl, monkeypatch):
    """Every kernel launch of the quantizers, dequantizers, the fused RMSNorm and the KV cache
    carries programmatic dependent launch exactly when the device's Caps.pdl says so: as the GPU
    has it (9.0 and newer), and with that fact turned off, as on a GPU below 9.0 (the launches of
    the second case run, plainly, on this GPU)."""
    from cupyquant import _launch

    dev = cupy.cuda.Device().id
    if pdl:
        require_arch("pdl")
    else:
        monkeypatch.setitem(_device._caps, dev, _device.caps(dev)._replace(pdl=False))
    d = _device_inputs(_host_inputs(1))
    key = d["x"].reshape(111, 4, 128)
    value = key.copy()
    kc, vc = cupy.zeros((8, 16, 4, 128), np.uint8), cupy.zeros((8, 16, 4, 128), np.uint8)
    slots, w = cupy.arange(111, dtype=np.int32), cupy.asarray(np.ones(512, BF16))
    with _launch.recording() as rec:
        for name in PDL_OPS:
            OPS[name](d)
        cq.rms_norm_quantize(d["x"], w, scheme="group")
        cq.rms_norm_quantize(d["x"], w, scheme="nvfp4", global_scale=d["s"])
        cq.quantize_kv_cache(key, value, kc, vc, slots, scale_k=1.0, scale_v=1.0)
        cq.dequantize_kv_cache(kc, slots[:8], scale=1.0)
    launches = [r[5] for r in rec if r[5] is not None]  # memsets record None
    assert len(launches) > len(PDL_OPS)
    assert [launch.pdl for launch in launches] == [pdl] * len(launches), [launch.kernel for launch in launches]
