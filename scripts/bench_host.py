"""Host time per call of every public op at decode size, against a bare replay of its own launches.

``python scripts/bench_host.py [--json host.json] [--ops name,...] [--rounds 7] [--calls 300]``
(also ``python scripts/bench.py --host``). Each case calls one op at M = 1 (K = 4096, bfloat16; the
matmuls on 4096 x 4096 weights), in a loop of asynchronous calls; ``ours us`` is the least host time
per call over ``--rounds`` loops. The floor, ``bare us``, replays what the op launched, recorded from
one call (``cupyquant._launch.recording``): each kernel through ``cupy.RawKernel`` with the same
arguments (a cluster launch through its own ``Launch``, which ``cupy.RawKernel`` cannot make), each
memset through ``cudaMemsetAsync``, and one ``cupy.empty`` per array the op returns. The two loops
alternate, since the host's clock moves between loops a second apart. ``x bare`` is ours over the
floor: the target is at most 2. Cases named ``... out=`` pass caller-given buffers (checked on every
call: shapes and dtypes through the plan's key, the overlaps by address). Load-time ops (the weight's
quantization and conversions) are timed on a 256 x 4096 weight. An op that also runs CuPy's own
kernels (``prepare_weight``'s copies, which the recording does not see) has them counted from a CUDA
graph of one call (``foreign``: its kernel, memset and memcpy nodes past the recorded ones) and
charged in the floor at the host time of a bare launch of a two-pointer kernel measured in the same
run.

Where the library predates the recording (an older checkout run for a before/after table), only
``ours us`` is measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
K = 4096


def per_call(fn, calls: int) -> float:
    """Host seconds per call of a loop of ``calls`` asynchronous calls (the GPU work runs behind it)."""
    import cupy

    cupy.cuda.get_current_stream().synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = time.perf_counter() - t0
    cupy.cuda.get_current_stream().synchronize()
    return t / calls


def _arrays(result) -> list:
    """The arrays an op returned."""
    import cupy

    if result is None:
        return []
    if isinstance(result, tuple):
        return [o for r in result for o in _arrays(r)]
    if isinstance(result, cupy.ndarray):
        return [result]
    names = ("data", "scale", "amax", "global_scale", "zero_point", "code_sum", "scale_2")
    return [a for a in (getattr(result, n, None) for n in names) if isinstance(a, cupy.ndarray)]


def bare_replay(fn, given=()):
    """A function that replays the launches ``fn()`` made and allocates the arrays it returned but
    for those the caller gave (``given``: out= buffers), or None where the library cannot record its
    launches."""
    import cupy

    try:
        from cupyquant._launch import recording
    except ImportError:
        return None
    with recording() as rec:
        result = fn()
    given_ptrs = {g.data.ptr for g in given}
    outs = [(a.shape, a.dtype) for a in _arrays(result) if a.data.ptr not in given_ptrs]
    steps = []
    for kernel, grid, block, args, smem, launch in rec:
        if launch is None:  # ("memset", ptr, value, nbytes)
            _, ptr, value, n = kernel
            steps.append(("memset", ptr, value, n))
        elif launch.cluster is not None:
            steps.append(("launch", launch, tuple(a for a, spec in zip(args, launch._args) if _given(spec))))
        else:
            steps.append(("raw", kernel, grid, block, args, smem))

    def replay():
        stream = cupy.cuda.get_current_stream().ptr
        for shape, dtype in outs:
            cupy.empty(shape, dtype)
        for s in steps:
            if s[0] == "raw":
                s[1](s[2], s[3], s[4], shared_mem=s[5])
            elif s[0] == "memset":
                cupy.cuda.runtime.memsetAsync(s[1], s[2], s[3], stream)
            else:
                s[1](*s[2])

    replay.launches = sum(s[0] != "memset" for s in steps)
    replay.memsets = sum(s[0] == "memset" for s in steps)
    replay.outputs = len(outs)
    return replay


def graph_nodes(fn) -> int:
    """Kernel, memset and memcpy nodes of a CUDA graph of one call of ``fn`` (the driver's
    cuGraphGetNodes and cuGraphNodeGetType)."""
    import ctypes

    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        fn()
        graph = stream.end_capture()
    lib = ctypes.CDLL("libcuda.so.1")
    n = ctypes.c_size_t(0)
    lib.cuGraphGetNodes(ctypes.c_void_p(graph.graph), None, ctypes.byref(n))
    nodes = (ctypes.c_void_p * n.value)()
    lib.cuGraphGetNodes(ctypes.c_void_p(graph.graph), nodes, ctypes.byref(n))
    kinds = []
    for h in nodes:
        t = ctypes.c_int(0)
        lib.cuGraphNodeGetType(ctypes.c_void_p(h), ctypes.byref(t))
        kinds.append(t.value)
    stream.synchronize()
    return sum(k in (0, 1, 2) for k in kinds)  # CU_GRAPH_NODE_TYPE_KERNEL, _MEMCPY, _MEMSET


def bare_kernel():
    """A bare launch of a two-pointer kernel through cupy.RawKernel (the charge of a foreign node)."""
    import cupy

    k = cupy.RawKernel('extern "C" __global__ void k(const float* a, float* b) {}', "k")
    a, b = cupy.empty(1, np.float32), cupy.empty(1, np.float32)
    return lambda: k((1,), (32,), (a, b))


def _given(spec) -> bool:
    from cupyquant import _launch

    return spec is _launch.ARG or isinstance(spec, getattr(_launch, "Blob", ()))


def cases():
    """name -> (the call to time, the buffers it is given as out=)."""
    import cupy

    import cupyquant as cq

    rng = np.random.default_rng(0)

    def arr(shape, dtype=BF16):
        return cupy.asarray(rng.standard_normal(shape).astype(np.float32).astype(dtype))

    x, x2, wn = arr((1, K)), arr((1, 2 * K)), arr((K,))
    res = arr((1, K))
    W = arr((K, K))
    w_small = arr((256, K))
    c = {}

    def add(name, fn, given=()):
        c[name] = (fn, given)

    add("quantize_fp8 dynamic", lambda: cq.quantize_fp8(x))
    add("quantize_fp8 static", lambda: cq.quantize_fp8(x, scale=0.5))
    q8 = cupy.empty((1, K), np.uint8)
    add("quantize_fp8 dynamic out=", lambda: cq.quantize_fp8(x, out=q8), (q8,))
    add("amax", lambda: cq.amax(x))
    add("quantize_int8 static", lambda: cq.quantize_int8(x, scale=0.5))
    add("quantize_groupwise token fp8", lambda: cq.quantize_groupwise(x, group_size=None))
    add("quantize_groupwise group128 fp8", lambda: cq.quantize_groupwise(x, group_size=128))
    gs = cq.empty_scales((1, K), 128)
    add(
        "quantize_groupwise group128 out=",
        lambda: cq.quantize_groupwise(x, group_size=128, out=q8, scale_out=gs),
        (q8, gs),
    )
    add("quantize_groupwise token int8 azp", lambda: cq.quantize_groupwise(x, "int8", group_size=None, symmetric=False))
    add("silu_mul_quantize group128", lambda: cq.silu_mul_quantize(x2, group_size=128))
    add("quantize_mx mxfp8", lambda: cq.quantize_mx(x))
    add("quantize_mx mxfp4", lambda: cq.quantize_mx(x, "float4_e2m1fn"))
    ms = cupy.empty(cq.block_scale_shape((1, K), 32, "dense"), np.uint8)
    add("quantize_mx mxfp8 out=", lambda: cq.quantize_mx(x, out=q8, scale_out=ms), (q8, ms))
    add("quantize_nvfp4 dynamic", lambda: cq.quantize_nvfp4(x))
    add("quantize_nvfp4 static", lambda: cq.quantize_nvfp4(x, global_scale=100.0))
    add("rms_norm_quantize token", lambda: cq.rms_norm_quantize(x, wn))
    add("rms_norm_quantize token residual", lambda: cq.rms_norm_quantize(x, wn, residual=res))
    add("rms_norm_quantize group128", lambda: cq.rms_norm_quantize(x, wn, scheme="group"))
    add("rms_norm_quantize nvfp4", lambda: cq.rms_norm_quantize(x, wn, scheme="nvfp4", global_scale=100.0))
    ts = cq.empty_scales((1, K), None)
    add("rms_norm_quantize token out=", lambda: cq.rms_norm_quantize(x, wn, out=q8, scale_out=ts), (q8, ts))
    key, value = arr((1, 8, 128)), arr((1, 8, 128))
    kc, vc = cupy.zeros((64, 16, 8, 128), np.uint8), cupy.zeros((64, 16, 8, 128), np.uint8)
    slots = cupy.asarray(np.array([5], np.int64))
    add("quantize_kv_cache static", lambda: cq.quantize_kv_cache(key, value, kc, vc, slots, scale_k=0.5, scale_v=0.5))
    blocks = cupy.asarray(np.array([0], np.int32))
    add("dequantize_kv_cache", lambda: cq.dequantize_kv_cache(kc, blocks, scale=0.5))
    for label, q in (
        ("per-tensor fp8", cq.quantize_fp8(x)),
        ("token fp8", cq.quantize_groupwise(x, group_size=None)),
        ("group128 fp8", cq.quantize_groupwise(x, group_size=128)),
        ("mxfp8", cq.quantize_mx(x)),
        ("nvfp4", cq.quantize_nvfp4(x)),
        ("int8 static", cq.quantize_int8(x, scale=0.5)),
    ):
        add(f"dequantize {label}", lambda q=q: cq.dequantize(q))
    yq = cupy.empty((1, K), BF16)
    qg = cq.quantize_groupwise(x, group_size=128)
    add("dequantize group128 fp8 out=", lambda: cq.dequantize(qg, out=yq), (yq,))
    w4 = cq.prepare_weight(cq.quantize_weight(W, "int4", group_size=128))
    w8 = cq.prepare_weight(cq.quantize_weight(W, "float8_e4m3fn", group_size=None))
    wn4 = cq.prepare_weight(cq.quantize_weight(W, "nvfp4"))
    add("matmul int4 g128", lambda: cq.matmul(x, w4))
    add("matmul fp8 channel", lambda: cq.matmul(x, w8))
    add("matmul nvfp4", lambda: cq.matmul(x, wn4))
    y = cupy.empty((1, K), BF16)
    add("matmul int4 g128 out=", lambda: cq.matmul(x, w4, out=y), (y,))
    wf = cq.quantize_weight(W, "float8_e4m3fn", group_size=None)
    wb = cq.quantize_weight(W, "float8_e4m3fn", block_size=(128, 128))
    wi = cq.quantize_weight(W, "int8", group_size=None)
    a_tok = cq.quantize_groupwise(x, group_size=None)
    a_ten = cq.quantize_fp8(x)
    a_grp = cq.quantize_groupwise(x, group_size=128, scale_layout="col")
    a_i8 = cq.quantize_groupwise(x, "int8", group_size=None)
    add("scaled_matmul fp8 token x channel", lambda: cq.scaled_matmul(a_tok, wf))
    add("scaled_matmul fp8 tensor x channel", lambda: cq.scaled_matmul(a_ten, wf))
    add("scaled_matmul fp8 group x block", lambda: cq.scaled_matmul(a_grp, wb))
    add("scaled_matmul int8 token x channel", lambda: cq.scaled_matmul(a_i8, wi))
    add("scaled_matmul fp8 token x channel out=", lambda: cq.scaled_matmul(a_tok, wf, out=y), (y,))
    sa, sb = cupy.ones((1, 1), np.float32), cupy.ones((K, 1), np.float32)
    add("scaled_mm fp8 token x channel", lambda: cq.scaled_mm(a_tok.data, wf.data, sa, sb))
    a_az = cq.quantize_groupwise(x, "int8", group_size=None, symmetric=False)
    wi_scale = wi.scale.astype(np.float32)  # the caller's float32 scales, made once
    add(
        "scaled_mm_azp int8 token x channel",
        lambda: cq.scaled_mm_azp(a_az.data, wi.data, a_az.scale, wi_scale, wi.code_sum, azp=a_az.zero_point),
    )
    add("quantize_weight int4 g128 (256 x 4096)", lambda: cq.quantize_weight(w_small, "int4", group_size=128))
    qs = cq.quantize_weight(w_small, "int4", group_size=128)
    add("dequantize_weight int4 g128 (256 x 4096)", lambda: cq.dequantize_weight(qs))
    add("prepare_weight int4 g128 (256 x 4096)", lambda: cq.prepare_weight(qs))
    add("empty_scales group128", lambda: cq.empty_scales((1, K), 128))
    return c


def measure(fn, given, rounds: int, calls: int, kernel=None) -> dict:
    """The case's row: ``ours_us``; and where the library records its launches, ``bare_us`` (the
    replay, plus ``foreign`` nodes charged at a bare launch of ``kernel``), the counts and
    ``x_bare``."""
    for _ in range(20):
        fn()
    bare = bare_replay(fn, given)
    foreign = 0
    if bare is not None:
        for _ in range(20):
            bare()
        foreign = max(0, graph_nodes(fn) - bare.launches - bare.memsets)
        kernel = kernel or bare_kernel()
    ours = floor = one = float("inf")
    for _ in range(rounds):
        ours = min(ours, per_call(fn, calls))
        if bare is not None:
            floor = min(floor, per_call(bare, calls))
            if foreign:
                one = min(one, per_call(kernel, calls))
    row = {"ours_us": ours * 1e6}
    if bare is not None:
        floor += foreign * one if foreign else 0.0
        row.update(bare_us=floor * 1e6, launches=bare.launches, memsets=bare.memsets, outputs=bare.outputs)
        row.update(foreign=foreign, x_bare=ours / floor if floor else None)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default=None, help="comma-separated case names (substrings), default every case")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--json", help="write the rows to this file")
    a = p.parse_args(argv)
    import cupy

    rows = {}
    want = None if a.ops is None else [s.strip() for s in a.ops.split(",")]
    print(f"{'op':44} {'launches':>10} {'outputs':>7} {'bare us':>8} {'ours us':>8} {'x bare':>6}")
    for name, (fn, given) in cases().items():
        if want and not any(w in name for w in want):
            continue
        r = rows[name] = measure(fn, given, a.rounds, a.calls)
        launches = str(r.get("launches", "-"))
        launches += f"+{r['memsets']}m" if r.get("memsets") else ""
        launches += f"+{r['foreign']}f" if r.get("foreign") else ""
        bare = f"{r['bare_us']:8.1f}" if "bare_us" in r else f"{'-':>8}"
        ratio = f"{r['x_bare']:6.2f}" if r.get("x_bare") is not None else f"{'-':>6}"
        print(f"{name:44} {launches:>10} {r.get('outputs', '-'):>7} {bare} {r['ours_us']:8.1f} {ratio}")
        sys.stdout.flush()
    if a.json:
        props = cupy.cuda.runtime.getDeviceProperties(0)
        with open(a.json, "w") as f:
            json.dump({"device": props["name"].decode(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
