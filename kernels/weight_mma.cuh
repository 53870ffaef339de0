// weight_mma.cuh: what the weight kernels (weight.cu, weight_gemm.cu) share: the scheme ids, the
// fp16/bf16 pair arithmetic that dequantizes INT4 codes, and the m16n8k16 tensor-core multiply.
#pragma once

#include "common.cuh"

#define W_INT4 0   // symmetric, codes q - 8
#define W_UINT4 1  // asymmetric, codes q - z
#define W_FP8 2    // E4M3 values

namespace cq {
template <class A, class B> struct same_t { static constexpr bool value = false; };
template <class A> struct same_t<A, A> { static constexpr bool value = true; };
}  // namespace cq

template <typename T> struct HalfOps;
template <> struct HalfOps<__half> {
    static constexpr unsigned MAGIC = 0x64006400u;  // 1024.0 in each half
    static constexpr unsigned BIAS = 0x6400u;
    static __device__ __forceinline__ unsigned fma2(unsigned a, unsigned b, unsigned c) {
        unsigned d;
        asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
        return d;
    }
    static constexpr unsigned ONE = 0x3c003c00u;
};
template <> struct HalfOps<__nv_bfloat16> {
    static constexpr unsigned MAGIC = 0x43004300u;  // 128.0 in each half
    static constexpr unsigned BIAS = 0x4300u;
    static __device__ __forceinline__ unsigned fma2(unsigned a, unsigned b, unsigned c) {
        unsigned d;
        asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
        return d;
    }
    static constexpr unsigned ONE = 0x3f803f80u;
};

template <typename T>
__device__ __forceinline__ void mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    if constexpr (cq::same_t<T, __half>::value) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// 16 bytes global -> shared without passing through registers (sm_80+); pred false writes 16 zero
// bytes and reads nothing. The "memory" clobbers keep the compiler from moving ordinary loads and
// stores of the same buffers across the copy, the commit or the wait.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(pred ? 16 : 0) : "memory");
}
// 16 bytes to shared address s when pred, nothing otherwise (no zero fill: for rows whose results are
// never stored)
__device__ __forceinline__ void cp_async16_if(unsigned s, const void* gmem, bool pred) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %2, 0;\n@p cp.async.cg.shared.global [%0], [%1], 16;\n}" ::"r"(s), "l"(gmem),
                 "r"((int)pred)
                 : "memory");
}
// Programmatic dependent launch (compute capability 9.0 and newer; cupyquant/_launch.py). The matmul
// kernels call this before their first access to global memory: wait until the kernel before on the
// stream has completed and its writes are visible (at once when this grid was launched without the
// attribute, or the kernel before has ended), then let the kernel after launch, so that its blocks
// are set up on the SMs while this grid runs and wait there in turn. A grid that waits before every
// load and store needs nothing of the kernel before it (CuPy's kernels never signal early, which
// just means no overlap).
__device__ __forceinline__ void pdl_wait_then_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

__device__ __forceinline__ float fma_rn(float a, float b, float c) {
    float d;
    asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(d) : "f"(a), "f"(b), "f"(c));
    return d;
}

__device__ __forceinline__ unsigned lop3_and_or(unsigned a, unsigned mask, unsigned magic) {
    unsigned d;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(a), "r"(mask), "r"(magic));  // (a & mask) | magic
    return d;
}

// ---------------------------------------------------------------- split K across blocks
// Blocks (x, y, z), z the split of K (weight_gemm.cu, weight_wgmma.cu): each stores its float32
// partial outputs to ws[z] (M x N, through L2), and the last block of tile (x, y) to arrive (a
// per-tile counter) adds every split's partials, its own included, in split order 0, 1, ... (the
// splits are the outer loop, so each step's loads are all in flight together): the sum does not
// depend on which block finishes first. visit(f) calls f(m, n, v) for each output (m, n) of this
// thread inside M x N, v its float accumulator by reference. Returns true in the last block, with
// the sums in the accumulators and the counter reset for the next call; the other blocks are done.
// s_last: an int in the block's shared memory.
namespace cq {
template <typename Visit>
__device__ __forceinline__ bool split_k_reduce(float* __restrict__ ws, int* __restrict__ counters, i64 M, i64 N, int splits,
                                               int& s_last, Visit visit) {
    visit([&](i64 m, i64 n, float& v) { __stcg(ws + ((i64)blockIdx.z * M + m) * N + n, v); });
    __threadfence();  // this thread's partials are visible before its block counts as arrived
    __syncthreads();
    int* counter = counters + blockIdx.y * gridDim.x + blockIdx.x;
    if (threadIdx.x == 0) s_last = atomicAdd(counter, 1) == splits - 1;
    __syncthreads();
    if (!s_last) return false;
    __threadfence();  // and the other splits' partials are read after their arrival
    const i64 stride = M * N;
#pragma unroll 1
    for (int sp = 0; sp < splits; ++sp)
        visit([&](i64 m, i64 n, float& v) {
            const float x = __ldcg(ws + sp * stride + m * N + n);
            v = sp == 0 ? x : add_rn(v, x);
        });
    if (threadIdx.x == 0) *counter = 0;  // ready for the next call
    return true;
}
}  // namespace cq
