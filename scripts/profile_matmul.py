#!/usr/bin/env python3
"""Run the weight-only matmul a few times on one shape, for a profiler.

    ncu --kernel-name regex:w4a16 --launch-skip 2 --launch-count 1 --section SpeedOfLight \\
        python scripts/profile_matmul.py 28672 8192 1 int4 [path]

path: "decode", "pipelined" or "wgmma" forces that kernel (cupyquant.weight.FORCE_PATH).
"""

import os
import sys

import cupy
import ml_dtypes

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import cupyquant as cq  # noqa: E402

if __name__ == "__main__":
    N, K, M = (int(v) for v in sys.argv[1:4])
    scheme = sys.argv[4] if len(sys.argv) > 4 else "int4"
    if len(sys.argv) > 5:
        from cupyquant import weight as _weight

        _weight.FORCE_PATH = sys.argv[5]
    rng = cupy.random.default_rng(0)
    w = rng.standard_normal((N, K), dtype="float32").astype(ml_dtypes.bfloat16)
    qw = cq.prepare_weight(cq.quantize_weight(w, scheme, group_size=None if scheme == "float8_e4m3fn" else 128))
    a = rng.standard_normal((M, K), dtype="float32").astype(ml_dtypes.bfloat16)
    for _ in range(4):
        cq.matmul(a, qw)
    cupy.cuda.Device().synchronize()
