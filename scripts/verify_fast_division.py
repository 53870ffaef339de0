#!/usr/bin/env python3
"""Exhaustive check of common.cuh's div_by(x, s, r) against IEEE division div_rn(x, s).

For x and s in [1, 2) every pair of float32 significands is tried (2^23 x 2^23 = 2^46 pairs). Scaling
x or s by a power of two scales every intermediate of both computations exactly, so agreement here
means agreement for all normal x and s whose quotient, product x * r and remainder stay in the
normal range. Prints the number of mismatches (0 is the claim) and the first few.

    python scripts/verify_fast_division.py [--s-count 8388608]
"""

import argparse
import os
import sys
import time

import cupy
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from cupyquant import _jit  # noqa: E402

KERNEL = r"""
#include "common.cuh"
using namespace cq;
// one block per s significand; its threads sweep all 2^23 x significands
extern "C" __global__ void sweep(unsigned s_first, unsigned long long* bad, unsigned* first_bad) {
    const float s = __uint_as_float(0x3f800000u | (s_first + blockIdx.x));
    const float r = div_rn(1.0f, s);
    unsigned n_bad = 0;
    for (unsigned j = threadIdx.x; j < (1u << 23); j += blockDim.x) {
        const float x = __uint_as_float(0x3f800000u | j);
        if (__float_as_uint(div_by(x, s, r)) != __float_as_uint(div_rn(x, s))) {
            ++n_bad;
            const unsigned slot = atomicAdd(first_bad, 1u);
            if (slot < 8) { first_bad[1 + 2 * slot] = __float_as_uint(x); first_bad[2 + 2 * slot] = __float_as_uint(s); }
        }
    }
    if (n_bad) atomicAdd(bad, (unsigned long long)n_bad);
}
"""


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--s-count", type=int, default=1 << 23, help="s significands to sweep (all: 2^23)")
    a = p.parse_args()
    src = KERNEL.replace('#include "common.cuh"', (_jit.kernel_dir() / "common.cuh").read_text())
    k = cupy.RawKernel(src, "sweep", options=_jit.options())
    bad = cupy.zeros(1, np.uint64)
    first = cupy.zeros(17, np.uint32)
    t0 = time.time()
    chunk = 1 << 16
    for s0 in range(0, a.s_count, chunk):
        k((min(chunk, a.s_count - s0),), (1024,), (np.uint32(s0), bad, first))
    cupy.cuda.Device().synchronize()
    n = int(bad.get()[0])
    pairs = a.s_count * (1 << 23)
    print(f"div_by vs div_rn: {n} mismatches in {pairs} pairs ({time.time() - t0:.1f} s)")
    f = first.get()
    for i in range(min(8, int(f[0]))):
        x, s = f[1 + 2 * i : 3 + 2 * i].view(np.float32)
        print(f"  x={x!r} s={s!r}")
    return 1 if n else 0


if __name__ == "__main__":
    sys.exit(main())
