"""First calls from many threads at once, in a fresh process; run by tests/test_runtime.py
(``test_first_calls_from_threads_compile_each_family_once``), which gives it an empty
``CUPY_CACHE_DIR`` so that every kernel family is really compiled here.

``N_THREADS`` threads, each with its own non-blocking stream, wait on a barrier and then call one
op of every family, each thread starting with a different family so that several families are
asked for at the same moment. ``cupyquant._jit._build_module`` is wrapped to count the builds per
instantiation and GPU architecture. Every result is compared byte for byte with cupyquant.reference.
Prints one JSON line: ``builds`` ("family@sm_XX:expression" -> count), ``problems`` (mismatches and
tracebacks), ``threads``, ``finished``, ``cache_files``.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import traceback

import cupy
import ml_dtypes
import numpy as np

import cupyquant as cq
from cupyquant import _device, _jit
from cupyquant import reference as ref

N_THREADS = 8
BF16 = ml_dtypes.bfloat16
E4, E2M1 = "float8_e4m3fn", "float4_e2m1fn"


def main() -> dict:
    problems: list[str] = []
    if _jit._kernels:
        problems.append(f"kernels were loaded before the threads started: {sorted(map(str, _jit._kernels))}")

    builds: collections.Counter = collections.Counter()
    count_lock = threading.Lock()
    build = _jit._build_module

    def counting_build(family, expression, device):
        arch = _device.arch(device)
        with count_lock:
            builds[f"{family}@sm_{arch}:{expression}"] += 1
        return build(family, expression, device)

    _jit._build_module = counting_build

    rng = np.random.default_rng(0)
    shape = (4, 33, 256)
    xh = (rng.standard_normal(shape) * np.exp(2.0 * rng.standard_normal(shape))).astype(np.float32).astype(BF16)
    # Small integer weights with a 7 in every group of 128 (scale exactly 1) and small integer
    # activations: every product and sum of the matmul is exact, so its bytes are known.
    N, K = 64, 256
    w = rng.integers(-7, 8, (N, K)).astype(np.float32)
    w[:, 0] = 7
    w[:, 128] = -7
    wh = w.astype(np.float16)
    ah = rng.integers(-4, 5, (5, K)).astype(np.float16)
    x, wd, a = cupy.asarray(xh), cupy.asarray(wh), cupy.asarray(ah)
    cupy.cuda.Device().synchronize()  # the threads read these on their own streams

    eq, es = ref.quantize_fp8(xh)
    gq, gs = ref.quantize_groupwise(xh, E4, group_size=128)
    md, ms = ref.quantize_mx(xh, E2M1)
    nd, ns, ng = ref.quantize_nvfp4(xh)
    wq, wsc, _ = ref.quantize_weight(wh, "int4", group_size=128)

    def fp8():
        q = cq.quantize_fp8(x)
        return [q.data, q.scale, cq.dequantize(q)]

    def group():
        q = cq.quantize_groupwise(x, E4, group_size=128)
        return [q.data, q.scale]

    def mx():
        q = cq.quantize_mx(x, E2M1)
        return [q.data, q.scale]

    def nvfp4():
        q = cq.quantize_nvfp4(x, scale_layout="dense")
        return [q.data, q.scale, q.global_scale]

    def weight():
        qw = cq.quantize_weight(wd, "int4", group_size=128)
        return [qw.data, qw.scale, cq.matmul(a, qw)]

    ops = [  # (name, call, expected arrays), one entry per kernel family
        ("quantize_fp8 + dequantize", fp8, [eq, es, ref.dequantize_fp8(eq, es, E4, BF16)]),
        ("quantize_groupwise", group, [gq, gs]),
        ("quantize_mx", mx, [md, ms]),
        ("quantize_nvfp4", nvfp4, [nd, ns, np.array([ng], np.float32)]),
        ("quantize_weight + matmul", weight, [wq, wsc, (ah.astype(np.float64) @ w.T).astype(np.float16)]),
    ]

    barrier = threading.Barrier(N_THREADS, timeout=600)
    finished: list[int] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        try:
            stream = cupy.cuda.Stream(non_blocking=True)
            barrier.wait()
            with stream:
                for j in range(len(ops)):
                    name, call, expected = ops[(i + j) % len(ops)]
                    got = call()
                    if len(got) != len(expected):
                        raise AssertionError(f"{name}: {len(got)} outputs, expected {len(expected)}")
                    for k, (g, e) in enumerate(zip(got, expected, strict=True)):
                        g = g.get()  # on this thread's stream
                        e = np.ascontiguousarray(e)
                        if g.shape != e.shape or g.dtype.itemsize != e.dtype.itemsize or g.tobytes() != e.tobytes():
                            with lock:
                                problems.append(f"thread {i}: {name}: output {k} differs from the reference")
            with lock:
                finished.append(i)
        except Exception:  # report everything; the parent test fails on any problem
            with lock:
                problems.append(f"thread {i}:\n{traceback.format_exc()}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    cache = os.environ.get("CUPY_CACHE_DIR", "")
    cache_files = sum(len(files) for _, _, files in os.walk(cache)) if cache else 0
    return {
        "builds": dict(builds),
        "problems": problems,
        "threads": N_THREADS,
        "finished": len(finished),
        "cache_files": cache_files,
    }


if __name__ == "__main__":
    print(json.dumps(main()))
