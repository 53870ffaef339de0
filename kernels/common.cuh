// common.cuh: device helpers shared by every cupyquant kernel family.
//
// Inlined into each family's source by cupyquant/_jit.py (never found through -I), so that CuPy's
// disk cache, which hashes the source string, sees every edit here.
//
// Numerics. CuPy compiles with -ftz=true, which flushes float32 subnormals in ordinary C++ float
// arithmetic. TransformerEngine and vLLM are built without it, and so is the NumPy reference. Every
// float operation whose result reaches an output byte therefore goes through the explicit IEEE PTX
// instructions below (mul.rn.f32, div.rn.f32 without .ftz), which the -ftz flag does not touch, and
// the amax is reduced on integer bit patterns. The conversions we use (cvt.rn.bf16.f32,
// cvt.rn.f16.f32, cvt.rn.satfinite.e4m3x2.f32 and the software fp8 paths of cuda_fp8.h) do not
// flush either.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace cq {

typedef long long i64;
typedef unsigned long long u64;

// same_type<A, B>::value: whether two types are the same (NVRTC has no <type_traits>).
template <class A, class B> struct same_type { static constexpr bool value = false; };
template <class A> struct same_type<A, A> { static constexpr bool value = true; };
// cond_type<C, A, B>::type: A where C holds, else B (std::conditional)
template <bool C, class A, class B> struct cond_type { using type = A; };
template <class A, class B> struct cond_type<false, A, B> { using type = B; };

// Where a kernel takes a scale from (cupyquant._validate.ScaleSource mirrors these numbers).
enum ScaleSource : int {
    SCALE_FROM_AMAX = 0,    // derived from an amax the kernel reads (as written by an amax kernel)
    SCALE_FROM_DEVICE = 1,  // read from the caller's one-element device array
    SCALE_FROM_ARG = 2,     // passed by value as a kernel argument
};

// ---------------------------------------------------------------- IEEE float32 arithmetic
__device__ __forceinline__ float mul_rn(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

__device__ __forceinline__ float rcp_rn(float a) {  // 1 / a, correctly rounded (== div_rn(1, a))
    float r;
    asm("rcp.rn.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}

// rcp.rn.f32 as ptxas builds it (SASS for sm_80, sm_90, sm_100, sm_120): a test of a's exponent,
// then for a normal a with |a| in [2^-126, 2^126) the fast path, MUFU.RCP and one Newton step by two
// FMAs, and a call to a slow path for every other a (zero, subnormal, huge, inf, NaN). Each rcp_rn
// is therefore a branch with its convergence barrier, and ptxas does not move a later value's
// arithmetic across it: N reciprocals in a row run one after another. rcp_rn_n takes the test once
// for N values. rcp_fast is that fast path, written out (rcp.approx.ftz.f32 is MUFU.RCP): equal to
// rcp_rn(a) bit for bit wherever rcp_fast_ok(a) (all 2^32 inputs checked on the device:
// tests/test_groupwise.py::test_rcp_fast_matches_rcp_rn_everywhere_it_is_taken).
__device__ __forceinline__ unsigned rcp_fast_key(float a) {  // >= 2 << 23 iff a takes the fast path
    return (__float_as_uint(a) + 0x01800000u) & 0x7f800000u;      // (exponent field + 3) mod 256
}
__device__ __forceinline__ bool rcp_fast_ok(float a) { return rcp_fast_key(a) >= 0x02000000u; }
__device__ __forceinline__ float rcp_fast(float a) {
    float r0, e, r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0) : "f"(a));
    asm("fma.rn.f32 %0, %1, %2, 0fBF800000;" : "=f"(e) : "f"(a), "f"(r0));  // a * r0 - 1, exact
    asm("{ .reg .f32 ne; neg.f32 ne, %1; fma.rn.f32 %0, %2, ne, %2; }" : "=f"(r) : "f"(e), "f"(r0));
    return r;
}

// r[i] = rcp_rn(a[i]) for N values, bit for bit: one test of all N exponents, then N fast paths
// without a branch between them (so their latencies overlap), or N rcp_rn where any value needs the
// slow path.
template <int N> __device__ __forceinline__ void rcp_rn_n(const float* a, float* r) {
    unsigned key = rcp_fast_key(a[0]);
#pragma unroll
    for (int i = 1; i < N; ++i) key = min(key, rcp_fast_key(a[i]));
    if (key >= 0x02000000u) {
#pragma unroll
        for (int i = 0; i < N; ++i) r[i] = rcp_fast(a[i]);
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) r[i] = rcp_rn(a[i]);
    }
}

__device__ __forceinline__ float add_rn(float a, float b) {
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

__device__ __forceinline__ float div_rn(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

__device__ __forceinline__ float sqrt_rn(float a) {
    float r;
    asm("sqrt.rn.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}

// x / s, correctly rounded, given r = div_rn(1, s) computed once for many x: q0 = x * r, then one
// correction with the exact remainder: e = q0 * s - x (exact by the FMA), q = q0 - e * r, each one
// fma.rn (the structure of the GPU's own div.rn fast path, with the reciprocal hoisted; the negations
// fold into the FMA operands, and this sign arrangement keeps -0 / s = -0). Equal to div_rn(x, s) bit
// for bit for every pair of normal significands (checked exhaustively, all 2^46 pairs:
// scripts/verify_fast_division.py), so for all x, s away from the exponent range limits. Callers use
// div_rn instead when x / s can overflow or s is not finite; results below about 2^-100 may differ
// in the last place, which cannot change an 8-bit output.
__device__ __forceinline__ float div_by(float x, float s, float r) {
    float q0, e, q;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(q0) : "f"(x), "f"(r));
    asm("{ .reg .f32 nx; neg.f32 nx, %3; fma.rn.f32 %0, %1, %2, nx; }" : "=f"(e) : "f"(q0), "f"(s), "f"(x));
    asm("{ .reg .f32 ne; neg.f32 ne, %1; fma.rn.f32 %0, ne, %2, %3; }" : "=f"(q) : "f"(e), "f"(r), "f"(q0));
    return q;
}

// min.f32 / max.f32 without .ftz: a NaN operand gives the other one (fminf / fmaxf semantics)
__device__ __forceinline__ float fmin_ieee(float a, float b) {
    float r;
    asm("min.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float fmax_ieee(float a, float b) {
    float r;
    asm("max.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

__device__ __forceinline__ bool is_finite_bits(unsigned u) { return (u & 0x7f800000u) != 0x7f800000u; }

// ---------------------------------------------------------------- input/output element types
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// Elements of T in one 16-byte vector.
template <typename T> struct Vec16 { static constexpr int N = 16 / sizeof(T); };

// Unpack a 16-byte vector into floats (exact for every input type).
template <typename T> __device__ __forceinline__ void unpack16(const uint4& v, float* f);
template <> __device__ __forceinline__ void unpack16<float>(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
}
template <> __device__ __forceinline__ void unpack16<__half>(const uint4& v, float* f) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __half2float(__ushort_as_half((unsigned short)(w[i] & 0xffffu)));
        f[2 * i + 1] = __half2float(__ushort_as_half((unsigned short)(w[i] >> 16)));
    }
}
template <> __device__ __forceinline__ void unpack16<__nv_bfloat16>(const uint4& v, float* f) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

// float -> the bit pattern of a 16-bit type, rounded to nearest even (cvt.rn, no flush).
template <typename T> __device__ __forceinline__ unsigned short bits16_rn(float x);
template <> __device__ __forceinline__ unsigned short bits16_rn<__half>(float x) {
    return __half_as_ushort(__float2half_rn(x));
}
template <> __device__ __forceinline__ unsigned short bits16_rn<__nv_bfloat16>(float x) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

// Pack 16/sizeof(T) floats (rounded to nearest even) into a 16-byte vector.
template <typename T> __device__ __forceinline__ uint4 pack16(const float* f) {
    unsigned w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = (unsigned)bits16_rn<T>(f[2 * i]) | ((unsigned)bits16_rn<T>(f[2 * i + 1]) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
}
template <> __device__ __forceinline__ uint4 pack16<float>(const float* f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
}

// 16-byte global load through the read-only path; streaming store that does not linger in L1.
__device__ __forceinline__ uint4 ld16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// 16 consecutive elements of T from p (16-byte aligned) as floats: every 16-byte load issued before
// any is unpacked.
template <typename T> __device__ __forceinline__ void load16_floats(const T* p, float (&f)[16]) {
    constexpr int N = Vec16<T>::N, LOADS = 16 / N;
    uint4 v[LOADS];
#pragma unroll
    for (int l = 0; l < LOADS; ++l) v[l] = ld16(p + l * N);
#pragma unroll
    for (int l = 0; l < LOADS; ++l) unpack16<T>(v[l], f + l * N);
}
__device__ __forceinline__ void st16(void* p, const uint4& v) { __stcs(reinterpret_cast<uint4*>(p), v); }

// ---------------------------------------------------------------- |x| maxima on bit patterns
// |x| as the bit pattern of a non-negative float, NaN mapped to 0 (fmaxf semantics: NaN ignored).
// Non-negative IEEE floats order like their bit patterns, so max on these integers is fmaxf on
// |x| without any float arithmetic (and so without -ftz flushing subnormals).
__device__ __forceinline__ unsigned abs_key(float x) {
    const unsigned u = __float_as_uint(x) & 0x7fffffffu;
    return u > 0x7f800000u ? 0u : u;
}

// Max of the |x| keys of one 16-byte vector, as float bits.
template <typename T> __device__ __forceinline__ unsigned absmax16(const uint4& v);
template <> __device__ __forceinline__ unsigned absmax16<float>(const uint4& v) {
    return max(max(abs_key(__uint_as_float(v.x)), abs_key(__uint_as_float(v.y))),
               max(abs_key(__uint_as_float(v.z)), abs_key(__uint_as_float(v.w))));
}
// Two 16-bit halves at once: clear the signs, zero the NaN halves (magnitude above the inf
// pattern), then a per-half unsigned max.
__device__ __forceinline__ unsigned absmax_pairs(const uint4& v, unsigned inf2) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
    unsigned m = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned a = w[i] & 0x7fff7fffu;
        m = __vmaxu2(m, a & ~__vcmpgtu2(a, inf2));
    }
    return max(m & 0xffffu, m >> 16);
}
template <> __device__ __forceinline__ unsigned absmax16<__nv_bfloat16>(const uint4& v) {
    return absmax_pairs(v, 0x7f807f80u) << 16;  // bf16 bits are the top half of float bits
}
template <> __device__ __forceinline__ unsigned absmax16<__half>(const uint4& v) {
    return __float_as_uint(__half2float(__ushort_as_half((unsigned short)absmax_pairs(v, 0x7c007c00u))));
}

__device__ __forceinline__ unsigned warp_max(unsigned v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Max over the block; the result is valid in thread 0. BLOCK is the launch's blockDim.x.
template <int BLOCK> __device__ __forceinline__ unsigned block_max(unsigned v) {
    static_assert(BLOCK % 32 == 0 && BLOCK <= 1024, "block size");
    __shared__ unsigned warp_vals[BLOCK / 32];
    v = warp_max(v);
    if ((threadIdx.x & 31) == 0) warp_vals[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        v = threadIdx.x < BLOCK / 32 ? warp_vals[threadIdx.x] : 0u;
        v = warp_max(v);
    }
    return v;
}

// ---------------------------------------------------------------- FP8 element formats
struct E4M3 {
    static constexpr __nv_fp8_interpretation_t kind = __NV_E4M3;
    static constexpr float max_finite = 448.0f;
};
struct E5M2 {
    static constexpr __nv_fp8_interpretation_t kind = __NV_E5M2;
    static constexpr float max_finite = 57344.0f;
};
struct I8 {  // int8 codes; max_finite is the quantization range qmax
    static constexpr float max_finite = 127.0f;
};

// Round to nearest even with saturation to +-max finite; NaN becomes the canonical 0x7f. sm_89+
// uses cvt.rn.satfinite.{e4m3,e5m2}x2.f32, older GPUs the exact software path of cuda_fp8.h.
template <class F> __device__ __forceinline__ unsigned short to_fp8x2(float lo, float hi) {
    return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, F::kind);
}

// Exact fp8 -> float (through half, which holds every fp8 value; NaN becomes a NaN).
template <class F> __device__ __forceinline__ float fp8_to_float(unsigned char b) {
    return __half2float(__ushort_as_half(__nv_cvt_fp8_to_halfraw(b, F::kind).x));
}
// Two at once (one cvt.f16x2.{e4m3,e5m2}x2 on sm_89+): byte 0 of s -> lo, byte 1 -> hi.
template <class F> __device__ __forceinline__ void fp8x2_to_float2(unsigned short s, float& lo, float& hi) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(s, F::kind);
    lo = __half2float(__ushort_as_half(h.x));
    hi = __half2float(__ushort_as_half(h.y));
}

// ---------------------------------------------------------------- E8M0 scales
// E8M0 byte -> float: 2^(E - 127); 0 is the subnormal 2^-127, 255 is NaN (as ml_dtypes decodes it).
__device__ __forceinline__ float e8m0_to_float(unsigned E) {
    return __uint_as_float(E == 0u ? 0x00400000u : E == 255u ? 0x7fffffffu : E << 23);
}

// ---------------------------------------------------------------- programmatic dependent launch
// Compute capability 9.0 and newer (cupyquant/_launch.py). Every kernel launched with PDL calls this
// before its first access to global memory that another kernel may write: wait until the kernel before on the
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

}  // namespace cq
