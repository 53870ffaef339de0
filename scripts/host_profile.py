#!/usr/bin/env python3
"""Host time per call of each op on a small input, and where the dynamic quantizer's goes.

    python scripts/host_profile.py [--elements 1048576] [--profile]
"""

import argparse
import cProfile
import os
import pstats
import sys

import cupy
import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import cupyquant as cq  # noqa: E402
from cupyquant import _bench  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--elements", type=int, default=1 << 20)
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    x = cupy.ones(a.elements, dtype=ml_dtypes.bfloat16)
    s = cupy.ones(1, np.float32)
    q = cq.quantize_fp8(x)
    x2 = x.reshape(-1, 1024)
    ops = {
        "quantize_fp8 dynamic": lambda: cq.quantize_fp8(x),
        "quantize_fp8 static float": lambda: cq.quantize_fp8(x, scale=0.5),
        "quantize_fp8 static device": lambda: cq.quantize_fp8(x, scale=s),
        "dequantize": lambda: q.dequantize(),
        "amax": lambda: cq.amax(x),
        "quantize_groupwise g128": lambda: cq.quantize_groupwise(x2, group_size=128),
        "quantize_groupwise token": lambda: cq.quantize_groupwise(x2, "int8", group_size=None),
        "silu_mul_quantize g128": lambda: cq.silu_mul_quantize(x2, group_size=128),
        "(cupy.empty alone)": lambda: cupy.empty(a.elements, np.uint8),
    }
    # what one launch costs with the fp8_quantize argument list, by argument kind
    from cupyquant import _jit

    k = _jit.kernel(cupy.cuda.runtime.getDevice(), "per_tensor", "fp8_quantize", "__nv_bfloat16", "cq::E4M3", 2, True)
    out = cupy.empty(a.elements, np.uint8)
    sc = cupy.empty(1, np.float32)
    n64, f32 = np.int64(a.elements), np.float32(0.5)
    ops["launch, arrays + numpy scalars"] = lambda: k((a.elements // 4096 + 1,), (256,), (x, out, n64, s, f32, sc))
    ops["launch, int pointers"] = lambda: k(
        (a.elements // 4096 + 1,), (256,), (x.data.ptr, out.data.ptr, n64, s.data.ptr, f32, sc.data.ptr))
    fn_ = k.kernel  # the per-device cupy.cuda.Function behind the RawKernel
    ops["launch, cupy.cuda.Function"] = lambda: fn_((a.elements // 4096 + 1,), (256,), (x, out, n64, s, f32, sc))
    for name, fn in ops.items():
        print(f"{name:28s} {_bench.host_seconds_per_call(lambda: fn(), [()], calls=2000) * 1e6:6.1f} us host per call")
    if a.profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(5000):
            cq.quantize_fp8(x)
        pr.disable()
        cupy.cuda.get_current_stream().synchronize()
        pstats.Stats(pr).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
