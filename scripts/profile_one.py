#!/usr/bin/env python3
"""Run one op a few times on a fixed input, for a profiler (ncu --kernel-name ... python this).

    ncu --kernel-name regex:group_quantize --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats python scripts/profile_one.py group128 16384 16384
"""

import os
import sys

import cupy
import ml_dtypes

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import cupyquant as cq  # noqa: E402

OPS = {
    "group128": lambda x: cq.quantize_groupwise(x, group_size=128),
    "token_fp8": lambda x: cq.quantize_groupwise(x, group_size=None),
    "silu": lambda x: cq.silu_mul_quantize(x, group_size=128),
    "quant_static": lambda x: cq.quantize_fp8(x, scale=0.5),
}

if __name__ == "__main__":
    op, m, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    x = cupy.random.default_rng(0).standard_normal((m, k), dtype="float32").astype(ml_dtypes.bfloat16)
    for _ in range(3):
        OPS[op](x)
    cupy.cuda.Device().synchronize()
