// fp8_tensor.cu: per-tensor FP8 (E4M3, E5M2) quantization and dequantization.
//
// What it computes (TransformerEngine's "current scaling"; reference: cupyquant.reference
// .amax / .compute_scale / .quantize_fp8 / .dequantize_fp8, which these kernels match bit for bit):
//   fp8_amax       amax = max |x| over the tensor (NaN ignored, as fmaxf does), reduced on the
//                  bit patterns of |x| and combined across blocks by an unsigned atomicMax into a
//                  buffer the caller zeroed. Subnormal inputs count (no flush).
//   fp8_quantize   scale = fp8_max / amax (IEEE division); amax 0, inf or NaN gives 1; an infinite
//                  quotient becomes FLT_MAX. Static modes instead take the caller's dequantization
//                  scale s (x ~ q * s) and use scale = 1 / s. q = cvt_rn_satfinite(x * scale), the
//                  product an IEEE float32 multiply; block 0 stores scale_inv = 1 / scale (dynamic)
//                  or s (static), so no host round trip is ever needed.
//   fp8_dequantize y = round_rn(float(q) * scale_inv) in float32, then to the output type.
// Layout: flat C-contiguous arrays; q is one byte per element (the fp8 bit pattern).
// Vector path (VEC = true; x, q and y 16-byte aligned): one thread per 16 elements, 16-byte loads
// and stores, a flat grid (3.05 TB/s for a 2:1 read:write stream on H100, against 2.88 with a
// grid-stride loop); the thread just past the last vector does the < 16-element tail. Scalar path
// (VEC = false): any alignment, one element per thread and iteration.
// Indexing is 64-bit throughout.

#include "common.cuh"

using namespace cq;

// Scale sources of fp8_quantize (cupyquant._jit mirrors these numbers).
#define SCALE_FROM_AMAX 0    // src holds amax (as written by fp8_amax): dynamic quantization
#define SCALE_FROM_DEVICE 1  // src holds the caller's dequantization scale s
#define SCALE_FROM_ARG 2     // s is the kernel argument scale_arg (a Python float)

static constexpr int AMAX_BLOCK = 512;
static constexpr int AMAX_UNROLL = 4;  // 16-byte loads in flight per thread in the main loop

template <typename T, bool VEC>
__global__ void __launch_bounds__(AMAX_BLOCK)
fp8_amax(const T* __restrict__ x, i64 n, unsigned* __restrict__ amax_bits) {
    unsigned m = 0;
    const i64 tid = (i64)blockIdx.x * AMAX_BLOCK + threadIdx.x;
    const i64 stride = (i64)gridDim.x * AMAX_BLOCK;
    i64 scalar_from = 0;
    if (VEC) {
        constexpr int N = Vec16<T>::N;
        const i64 nvec = n / N;
        i64 i = tid;
        for (; i + (AMAX_UNROLL - 1) * stride < nvec; i += AMAX_UNROLL * stride) {
            uint4 v[AMAX_UNROLL];
#pragma unroll
            for (int u = 0; u < AMAX_UNROLL; ++u) v[u] = ld16(x + (i + u * stride) * N);
#pragma unroll
            for (int u = 0; u < AMAX_UNROLL; ++u) m = max(m, absmax16<T>(v[u]));
        }
        for (; i < nvec; i += stride) m = max(m, absmax16<T>(ld16(x + i * N)));
        scalar_from = nvec * N;
    }
    for (i64 j = scalar_from + tid; j < n; j += stride) m = max(m, abs_key(to_float(x[j])));
    m = block_max<AMAX_BLOCK>(m);
    if (threadIdx.x == 0 && m != 0u) atomicMax(amax_bits, m);
}

// TransformerEngine's compute_scale_from_amax with epsilon 0 and no power-of-two forcing.
template <class F> __device__ __forceinline__ float scale_from_amax(float amax) {
    const unsigned a = __float_as_uint(amax);
    if ((a & 0x7fffffffu) == 0u || !is_finite_bits(a)) return 1.0f;
    const float s = div_rn(F::max_finite, amax);
    return is_finite_bits(__float_as_uint(s)) ? s : 3.402823466e+38f;
}

template <typename T, class F, int MODE, bool VEC>
__global__ void __launch_bounds__(256)
fp8_quantize(const T* __restrict__ x, unsigned char* __restrict__ q, i64 n,
             const float* __restrict__ scale_src, float scale_arg, float* __restrict__ scale_inv_out) {
    float scale, scale_inv;
    if (MODE == SCALE_FROM_AMAX) {
        scale = scale_from_amax<F>(*scale_src);
        scale_inv = div_rn(1.0f, scale);
    } else {
        scale_inv = MODE == SCALE_FROM_DEVICE ? *scale_src : scale_arg;
        scale = div_rn(1.0f, scale_inv);
    }
    const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t == 0) *scale_inv_out = scale_inv;

    if (VEC) {
        constexpr int N = Vec16<T>::N;
        constexpr int LOADS = 16 / N;
        const i64 nvec = n >> 4;
        if (t < nvec) {
            uint4 v[LOADS];
#pragma unroll
            for (int l = 0; l < LOADS; ++l) v[l] = ld16(x + t * 16 + l * N);
            float f[16];
#pragma unroll
            for (int l = 0; l < LOADS; ++l) unpack16<T>(v[l], f + l * N);
            unsigned w[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const unsigned lo = to_fp8x2<F>(mul_rn(f[4 * i], scale), mul_rn(f[4 * i + 1], scale));
                const unsigned hi = to_fp8x2<F>(mul_rn(f[4 * i + 2], scale), mul_rn(f[4 * i + 3], scale));
                w[i] = lo | (hi << 16);
            }
            st16(q + t * 16, make_uint4(w[0], w[1], w[2], w[3]));
        } else if (t == nvec) {
            for (i64 j = nvec * 16; j < n; ++j)
                q[j] = (unsigned char)__nv_cvt_float_to_fp8(mul_rn(to_float(x[j]), scale), __NV_SATFINITE, F::kind);
        }
    } else {
        const i64 stride = (i64)gridDim.x * blockDim.x;
        for (i64 j = t; j < n; j += stride)
            q[j] = (unsigned char)__nv_cvt_float_to_fp8(mul_rn(to_float(x[j]), scale), __NV_SATFINITE, F::kind);
    }
}

template <typename OutT, class F, bool VEC>
__global__ void __launch_bounds__(256)
fp8_dequantize(const unsigned char* __restrict__ q, OutT* __restrict__ y, i64 n,
               const float* __restrict__ scale_inv_src) {
    const float scale_inv = *scale_inv_src;
    const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (VEC) {
        constexpr int N = Vec16<OutT>::N;
        constexpr int STORES = 16 / N;
        const i64 nvec = n >> 4;
        if (t < nvec) {
            const uint4 b = ld16(q + t * 16);
            const unsigned w[4] = {b.x, b.y, b.z, b.w};
            float f[16];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                fp8x2_to_float2<F>((unsigned short)(w[i] & 0xffffu), f[4 * i], f[4 * i + 1]);
                fp8x2_to_float2<F>((unsigned short)(w[i] >> 16), f[4 * i + 2], f[4 * i + 3]);
            }
#pragma unroll
            for (int i = 0; i < 16; ++i) f[i] = mul_rn(f[i], scale_inv);
#pragma unroll
            for (int s = 0; s < STORES; ++s) st16(y + t * 16 + s * N, pack16<OutT>(f + s * N));
        } else if (t == nvec) {
            for (i64 j = nvec * 16; j < n; ++j) y[j] = from_float<OutT>(mul_rn(fp8_to_float<F>(q[j]), scale_inv));
        }
    } else {
        const i64 stride = (i64)gridDim.x * blockDim.x;
        for (i64 j = t; j < n; j += stride) y[j] = from_float<OutT>(mul_rn(fp8_to_float<F>(q[j]), scale_inv));
    }
}
