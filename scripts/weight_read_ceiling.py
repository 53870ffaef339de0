#!/usr/bin/env python3
"""What reading the packed INT4 weights alone costs, under the benchmark's protocol (CUDA-graph
replay, input sets rotated over 4x the L2), for the decode kernel's access pattern and others.

    python scripts/weight_read_ceiling.py [--shapes 4096x4096,28672x8192]

Scratch kernels, not part of the library: each reads N x K / 2 bytes and folds them into one word
(stored only if it matches a constant, so the loads cannot be dropped). Patterns:
  flat U<u> b<b>      grid-stride 16-byte loads, u in flight per thread, b blocks of 256 per SM;
  tile S<s> <seg>B    the decode kernel's: a block of 8 warps owns 16 weight rows, warp w copies
                      chunks w, w + 8, ... (16 rows x seg bytes each) through a cp.async ring of s
                      slots; seg = 64 is what kernels/weight.cu does;
  contig S<s>         the same with each chunk's 16 x 64 bytes stored contiguously (tile-major);
  +scales, +act       the 64-byte pattern with the kernel's other loads one chunk ahead: two 2-byte
                      group scales per lane (from N x K / 128 bf16), four 16-byte activation loads;
  contig regs         the contiguous chunks loaded straight into registers (ld.global.nc,
                      L1::no_allocate), one chunk ahead, instead of through the cp.async ring;
  bulk P<p> S<s>      TMA 1-D bulk copies (cp.async.bulk, compute capability 9.0+): a block of 256
                      threads per 16-row tile copies its N x K / 2 / (N / 16) bytes in pieces of p
                      bytes through a ring of s pieces, one mbarrier each, read back by all threads.
An empty kernel replayed the same way gives the per-call floor. Results in BENCHMARKS.md (issue 5).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SRC = r"""
extern "C" __global__ void empty(int* o) { if (threadIdx.x == 1000) o[0] = 1; }

template <int U>
__global__ void flat(const uint4* __restrict__ p, long long n, int* o) {
    unsigned x = 0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += U * stride) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const long long j = i + u * stride;
            v[u] = j < n ? __ldg(p + j) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) x ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (x == 0x12345678u) o[0] = (int)x;
}

__device__ __forceinline__ void copy16(void* s, const void* g) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((unsigned)__cvta_generic_to_shared(s)), "l"(g) : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wait_groups() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ uint4 ld_stream(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// contig chunks (as tile<.., 64, true, ..>) into registers, one chunk ahead
__global__ void contig_regs(const unsigned char* __restrict__ w, long long rowb, int* o) {
    constexpr int WARPS = 8;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int nch = (int)(rowb / 64);
    const unsigned char* src = w + (long long)blockIdx.x * 16 * rowb + lane * 16;
    unsigned x = 0;
    uint4 n0, n1;
    if (warp < nch) { n0 = ld_stream(src + warp * 1024); n1 = ld_stream(src + warp * 1024 + 512); }
    for (int c = warp; c < nch; c += WARPS) {
        const uint4 v0 = n0, v1 = n1;
        if (c + WARPS < nch) { n0 = ld_stream(src + (c + WARPS) * 1024); n1 = ld_stream(src + (c + WARPS) * 1024 + 512); }
        x ^= v0.x ^ v0.y ^ v0.z ^ v0.w ^ v1.x ^ v1.y ^ v1.z ^ v1.w;
    }
    if (x == 0x12345678u) o[0] = (int)x;
}

#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
#endif
// block b: bytes [b tb, (b + 1) tb) in pieces of P through a ring of S, each with its mbarrier
template <int P, int S>
__global__ void bulk(const unsigned char* __restrict__ w, long long tb, int* o) {
#if __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) unsigned char sm[];
    __shared__ unsigned long long full[S];
    const long long np = tb / P;
    const unsigned char* src = w + (long long)blockIdx.x * tb;
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&full[s])) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    auto issue = [&](long long p, int s) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(&full[s])), "r"(P) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(smem_addr(sm + s * P)), "l"(src + p * P), "r"(P), "r"(smem_addr(&full[s])) : "memory");
    };
    if (threadIdx.x == 0)
        for (int s = 0; s < S && s < np; ++s) issue(s, s);
    unsigned x = 0;
    for (long long p = 0; p < np; ++p) {
        const int s = (int)(p % S);
        const unsigned parity = (unsigned)((p / S) & 1);
        asm volatile("{\n.reg .pred q;\nW: mbarrier.try_wait.parity.shared::cta.b64 q, [%0], %1;\n@!q bra W;\n}"
                     ::"r"(smem_addr(&full[s])), "r"(parity) : "memory");
        const uint4* v = reinterpret_cast<const uint4*>(sm + s * P);
        for (int j = threadIdx.x; j < P / 16; j += blockDim.x) x ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
        __syncthreads();
        if (threadIdx.x == 0 && p + S < np) issue(p + S, s);
    }
    if (x == 0x12345678u) o[0] = (int)x;
#endif
}

// S ring slots, SEG bytes of each of 16 rows per chunk (piece p = lane + 32 j: row p / (SEG / 16)),
// CONTIG: chunk (block, c) is 1 KB contiguous (SEG = 64 only), SC / ACT: the decode kernel's scale
// and activation loads, one chunk ahead.
template <int S, int SEG, bool CONTIG, bool SC, bool ACT>
__global__ void tile(const unsigned char* __restrict__ w, const unsigned short* __restrict__ sc,
                     const uint4* __restrict__ act, long long rowb, int* o) {
    constexpr int WARPS = 8, PER = SEG / 32, PPR = SEG / 16;
    extern __shared__ uint4 ring_all[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int nch = (int)(rowb / SEG);
    const long long ng = rowb / 64;
    const unsigned char* src[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int p = lane + 32 * j;
        src[j] = CONTIG ? w + (long long)blockIdx.x * 16 * rowb + j * 512 + lane * 16
                        : w + ((long long)blockIdx.x * 16 + p / PPR) * rowb + (p % PPR) * 16;
    }
    const long long cstride = CONTIG ? 1024 : SEG;
    const unsigned short* s0 = sc + ((long long)blockIdx.x * 16 + g) * ng;
    const unsigned short* s1 = s0 + 8 * ng;
    uint4* ring = ring_all + warp * S * 32 * PER + lane;
    unsigned x = 0;
    for (int s = 0; s < S - 1; ++s) {
        const int c = warp + s * WARPS;
        if (c < nch)
            for (int j = 0; j < PER; ++j) copy16(ring + (s * PER + j) * 32, src[j] + c * cstride);
        commit();
    }
    unsigned sn0 = 0, sn1 = 0;
    uint4 an[4];
    if (SC) { sn0 = __ldg(s0 + warp * (SEG / 64)); sn1 = __ldg(s1 + warp * (SEG / 64)); }
    if (ACT)
        for (int q = 0; q < 4; ++q) an[q] = __ldg(act + warp * SEG / 4 + t * 4 + q);
    int i = 0;
    for (int c = warp; c < nch; c += WARPS, ++i) {
        wait_groups<S - 2>();
        const int slot = i % S;
        for (int j = 0; j < PER; ++j) {
            const uint4 v = ring[(slot * PER + j) * 32];
            x ^= v.x ^ v.y ^ v.z ^ v.w;
        }
        const int cn = c + (S - 1) * WARPS, sn = (i + S - 1) % S;
        if (cn < nch)
            for (int j = 0; j < PER; ++j) copy16(ring + (sn * PER + j) * 32, src[j] + cn * cstride);
        commit();
        if (SC) {
            x ^= sn0 ^ sn1;
            const int cc = min(c + WARPS, nch - 1) * (SEG / 64);
            sn0 = __ldg(s0 + cc);
            sn1 = __ldg(s1 + cc);
        }
        if (ACT) {
            for (int q = 0; q < 4; ++q) x ^= an[q].x ^ an[q].w;
            const int cc = min(c + WARPS, nch - 1);
            for (int q = 0; q < 4; ++q) an[q] = __ldg(act + cc * SEG / 4 + t * 4 + q);
        }
    }
    if (x == 0x12345678u) o[0] = (int)x;
}
"""

# (label, expression, ring slots, bytes per row per chunk)
TILES = [
    ("tile S2 64B (the kernel's)", "tile<2,64,false,false,false>", 2, 64),
    ("tile S4 64B", "tile<4,64,false,false,false>", 4, 64),
    ("tile S2 128B", "tile<2,128,false,false,false>", 2, 128),
    ("tile S4 128B", "tile<4,128,false,false,false>", 4, 128),
    ("tile S2 256B", "tile<2,256,false,false,false>", 2, 256),
    ("contig S2", "tile<2,64,true,false,false>", 2, 64),
    ("contig S4", "tile<4,64,true,false,false>", 4, 64),
    ("tile S2 64B +scales", "tile<2,64,false,true,false>", 2, 64),
    ("tile S2 64B +act", "tile<2,64,false,false,true>", 2, 64),
    ("tile S2 64B +scales +act", "tile<2,64,false,true,true>", 2, 64),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336,28672x8192,8192x28672",
                    help="comma-separated N x K (N a multiple of 16, K of 512)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    for N, K in shapes:
        if N % 16 or K % 512:
            ap.error(f"--shapes: {N}x{K}: N must be a multiple of 16 and K of 512")

    import cupy
    import numpy as np

    from cupyquant import _bench

    bulks = [(16384, 2), (8192, 4), (4096, 8)]
    names = (["empty", "contig_regs"] + [f"flat<{u}>" for u in (1, 2, 4, 8)] + [e for _, e, _, _ in TILES]
             + [f"bulk<{p},{s}>" for p, s in bulks])
    mod = cupy.RawModule(code=SRC, options=("-std=c++17",), name_expressions=names)
    dev = cupy.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    print(f"# {cupy.cuda.runtime.getDeviceProperties(dev.id)['name'].decode()}, graph replay, "
          "inputs rotated over 4x L2; us per call and GB/s of packed weight", flush=True)
    o = cupy.zeros(4, np.int32)
    f = mod.get_function("empty")
    t = _bench.time_graph(lambda: f((1,), (32,), (o,)), [()] * 200, args.reps)
    print(f"empty kernel: {t * 1e6:.2f} us", flush=True)
    for N, K in shapes:
        nb = N * K // 2
        sets = [(cupy.full(nb, 7, np.uint8), cupy.full(N * (K // 128), 0x3c00, np.uint16))
                for _ in range(_bench.copies_for(nb))]
        act = cupy.ones(K // 8 * 4, np.uint32)
        print(f"== {N}x{K}: {nb / 1e6:.1f} MB", flush=True)
        rows = []
        for u in (1, 2, 4, 8):
            f = mod.get_function(f"flat<{u}>")
            for bpsm in (4, 8):
                t = _bench.time_graph(lambda b, s: f((sms * bpsm,), (256,), (b, np.int64(nb // 16), o)), sets, args.reps)
                rows.append((f"flat U{u} b{bpsm}", t))
        for label, expr, slots, seg in TILES:
            f = mod.get_function(expr)
            smem = 8 * slots * seg * 16
            f.max_dynamic_shared_size_bytes = smem
            t = _bench.time_graph(lambda b, s: f((N // 16,), (256,), (b, s, act, np.int64(K // 2), o), shared_mem=smem),
                                  sets, args.reps)
            rows.append((label, t))
        f = mod.get_function("contig_regs")
        t = _bench.time_graph(lambda b, s: f((N // 16,), (256,), (b, np.int64(K // 2), o)), sets, args.reps)
        rows.append(("contig regs", t))
        if int(dev.compute_capability) >= 90:
            for p, slots in bulks:
                if 8 * K % p:
                    continue
                f = mod.get_function(f"bulk<{p},{slots}>")
                f.max_dynamic_shared_size_bytes = p * slots
                t = _bench.time_graph(lambda b, s: f((N // 16,), (256,), (b, np.int64(8 * K), o), shared_mem=p * slots),
                                      sets, args.reps)
                rows.append((f"bulk P{p} S{slots}", t))
        for label, t in rows:
            print(f"  {label:28s} {t * 1e6:8.2f} us {nb / t / 1e9:7.0f} GB/s", flush=True)
        del sets
        cupy.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
