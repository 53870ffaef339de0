// per_tensor.cu: per-tensor FP8 (E4M3, E5M2) quantization and dequantization, and static per-tensor
// INT8 (with or without a zero point) and its dequantization.
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
//   int8_quantize  vLLM static_scaled_int8_quant (reference: cupyquant.reference.quantize_int8), the
//                  caller's decode scale s (x ~ (q - z) * s) and zero point z, int8.cuh's conversions:
//                  without a zero point (AZP = false) q = to_int8_rn(x / s), IEEE division (vLLM's
//                  float_to_int8_rn(x / scale)); with one, inv = 1 / s once and
//                  q = int32_to_int8(to_int32_rn(x * inv) + z) (vLLM's azp kernel multiplies by
//                  the inverse). Thread 0 stores s and z into the tensor's (1,) arrays.
//   int8_dequantize y = round_rn(float(q) * s), or round_rn(float32(q - z) * s) with a zero point
//                  (q - z exact, rounded once to float32: int8.cuh's minus_zero_point).
// Layout: flat C-contiguous arrays; q is one byte per element (the fp8 bit pattern).
// Vector path (VEC = true; x, q and y 16-byte aligned): a flat grid (3.05 TB/s for a 2:1 read:write
// stream on H100, against 2.88 with a grid-stride loop). The quantizer gives each thread 16
// elements (16-byte loads, one 16-byte store) and the thread just past the last vector the
// < 16-element tail; the dequantizer's layout is described above it. Scalar path (VEC = false):
// any alignment, a grid-stride loop of one element per thread and iteration.
// Indexing is 64-bit throughout.
// PDL: each kernel calls pdl_wait_then_release() (common.cuh) once in every thread, before its first
// global load, store or atomic, so that the wrappers may launch it with programmatic dependent launch.

#include "common.cuh"
#include "int8.cuh"

using namespace cq;

static constexpr int AMAX_BLOCK = 512;
static constexpr int AMAX_UNROLL = 4;  // 16-byte loads in flight per thread in the main loop

template <typename T, bool VEC>
__global__ void __launch_bounds__(AMAX_BLOCK)
fp8_amax(const T* __restrict__ x, i64 n, unsigned* __restrict__ amax_bits) {
    unsigned m = 0;
    const i64 tid = (i64)blockIdx.x * AMAX_BLOCK + threadIdx.x;
    const i64 stride = (i64)gridDim.x * AMAX_BLOCK;
    pdl_wait_then_release();  // no global access above this line
    i64 scalar_from = 0;
    if (VEC) {
        constexpr int N = Vec16<T>::N;
        const i64 nvec = n / N;
        // All AMAX_UNROLL loads are issued before the first use, predicated rather than split into
        // a remainder loop, so a thread with only one or two vectors left still has them in flight
        // together (a missing vector reads as zeros, which cannot raise the max).
        for (i64 i = tid; i < nvec; i += AMAX_UNROLL * stride) {
            uint4 v[AMAX_UNROLL];
#pragma unroll
            for (int u = 0; u < AMAX_UNROLL; ++u)
                v[u] = i + u * stride < nvec ? ld16(x + (i + u * stride) * N) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
            for (int u = 0; u < AMAX_UNROLL; ++u) m = max(m, absmax16<T>(v[u]));
        }
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

// MODE (a cq::ScaleSource): SCALE_FROM_AMAX, scale_src holds amax (as written by fp8_amax): dynamic
// quantization; SCALE_FROM_DEVICE, scale_src holds the caller's dequantization scale s;
// SCALE_FROM_ARG, s is the argument scale_arg.
template <typename T, class F, int MODE, bool VEC>
__global__ void __launch_bounds__(256)
fp8_quantize(const T* __restrict__ x, unsigned char* __restrict__ q, i64 n,
             const float* __restrict__ scale_src, float scale_arg, float* __restrict__ scale_inv_out) {
    pdl_wait_then_release();
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
        const i64 nvec = n >> 4;
        if (t < nvec) {
            float f[16];
            load16_floats(x + t * 16, f);
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

// Vector path of the dequantizer: a unit is the E = 16 / sizeof(OutT) elements of one 16-byte
// output vector (8 for 16-bit outputs, 4 for float32), read as one E-byte load. Each thread does
// two units; unit u of lane l in global warp w is unit w * 64 + u * 32 + l, so that every load and
// store instruction of a warp covers one contiguous span. (One thread per 16 consecutive elements
// had each of its two 16-byte stores cover every other 16 bytes: 89.6% of copy bandwidth at 1G
// bf16 elements on H200, behind torch.compile.)
template <typename OutT, class F>
__device__ __forceinline__ void dequant_unit(const unsigned char* __restrict__ q, OutT* __restrict__ y, i64 unit,
                                             float scale_inv) {
    constexpr int E = Vec16<OutT>::N;
    float f[E];
    unsigned w[E / 4];
    if constexpr (E == 8) {
        const uint2 b = __ldg(reinterpret_cast<const uint2*>(q + unit * 8));
        w[0] = b.x;
        w[1] = b.y;
    } else {
        w[0] = __ldg(reinterpret_cast<const unsigned*>(q + unit * 4));
    }
#pragma unroll
    for (int i = 0; i < E / 4; ++i) {
        fp8x2_to_float2<F>((unsigned short)(w[i] & 0xffffu), f[4 * i], f[4 * i + 1]);
        fp8x2_to_float2<F>((unsigned short)(w[i] >> 16), f[4 * i + 2], f[4 * i + 3]);
    }
#pragma unroll
    for (int i = 0; i < E; ++i) f[i] = mul_rn(f[i], scale_inv);
    st16(y + unit * E, pack16<OutT>(f));
}

template <typename OutT, class F, bool VEC>
__global__ void __launch_bounds__(256)
fp8_dequantize(const unsigned char* __restrict__ q, OutT* __restrict__ y, i64 n,
               const float* __restrict__ scale_inv_src) {
    pdl_wait_then_release();
    const float scale_inv = *scale_inv_src;
    const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (VEC) {
        constexpr int E = Vec16<OutT>::N;
        const i64 nunits = n / E;
        const i64 first = (t >> 5) * 64 + (t & 31);
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const i64 unit = first + u * 32;
            if (unit < nunits) {
                dequant_unit<OutT, F>(q, y, unit, scale_inv);
            } else if (unit == nunits) {  // the < E-element tail, one element at a time
                for (i64 j = nunits * E; j < n; ++j) y[j] = from_float<OutT>(mul_rn(fp8_to_float<F>(q[j]), scale_inv));
            }
        }
    } else {
        const i64 stride = (i64)gridDim.x * blockDim.x;
        for (i64 j = t; j < n; j += stride) y[j] = from_float<OutT>(mul_rn(fp8_to_float<F>(q[j]), scale_inv));
    }
}

// ---------------------------------------------------------------- static per-tensor INT8
// x / s for an INT8 code: div_by (the hoisted reciprocal r = 1 / s and one FMA correction) where it
// equals the IEEE quotient in every place an 8-bit code can see: s in [2^-60, 2^60] and |x| <= 2^60
// (no overflow; where the code depends on the last place, |x / s| in [2^-2, 2^9], every operand and
// remainder is normal, the range of scripts/verify_fast_division.py). Otherwise, and for inf and
// NaN, div_rn. The check is per 16 elements, so that a thread takes one branch.
static constexpr unsigned DIV_BY_LIMIT = 0x5d800000u;  // 2^60
static constexpr unsigned DIV_BY_FLOOR = 0x21800000u;  // 2^-60

__device__ __forceinline__ bool div_by_safe_scale(float s) {
    const unsigned b = __float_as_uint(s);  // negative, 0, inf and NaN all fall outside
    return b >= DIV_BY_FLOOR && b <= DIV_BY_LIMIT;
}

// Eight INT8 codes (element 0 in the low byte) of f, by the rule AZP selects (see the top).
template <bool AZP>
__device__ __forceinline__ uint2 int8_codes8(const float* f, float s, float r, int z, bool fast) {
    unsigned w[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        unsigned char c;
        if constexpr (AZP) c = azp_code(mul_rn(f[i], r), z);
        else c = to_int8_rn(fast ? div_by(f[i], s, r) : div_rn(f[i], s));
        w[i >> 2] |= (unsigned)c << (8 * (i & 3));
    }
    return make_uint2(w[0], w[1]);
}

template <bool AZP> __device__ __forceinline__ unsigned char int8_code1(float x, float s, float r, int z) {
    if constexpr (AZP) return azp_code(mul_rn(x, r), z);
    else return to_int8_rn(div_rn(x, s));
}

// s from scale_src (a device array) or scale_arg where scale_src is null; z likewise from zp_src
// or zp_arg (AZP only). Layout and grids as fp8_quantize: a flat grid of 16 elements per thread
// (VEC) plus the tail thread, or a grid-stride loop.
template <typename T, bool AZP, bool VEC>
__global__ void __launch_bounds__(256)
int8_quantize(const T* __restrict__ x, unsigned char* __restrict__ q, i64 n, const float* __restrict__ scale_src,
              float scale_arg, const int* __restrict__ zp_src, int zp_arg, float* __restrict__ scale_out,
              int* __restrict__ zp_out) {
    pdl_wait_then_release();
    const float s = scale_src ? *scale_src : scale_arg;
    const int z = AZP ? (zp_src ? *zp_src : zp_arg) : 0;
    const float r = rcp_rn(s);  // AZP: vLLM's inv_s = 1 / scale; otherwise div_by's reciprocal
    const bool s_ok = div_by_safe_scale(s);
    const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t == 0) {
        *scale_out = s;
        if (AZP) *zp_out = z;
    }
    if (VEC) {
        const i64 nvec = n >> 4;
        if (t < nvec) {
            float f[16];
            load16_floats(x + t * 16, f);
            bool fast = s_ok;
            if (!AZP) {
                unsigned m = 0;
#pragma unroll
                for (int i = 0; i < 16; ++i) m = max(m, __float_as_uint(f[i]) & 0x7fffffffu);
                fast = fast && m <= DIV_BY_LIMIT;
            }
            uint2 a, b;
            if (fast) {  // one branch for all 16, the same code in both arms but for the division
                a = int8_codes8<AZP>(f, s, r, z, true);
                b = int8_codes8<AZP>(f + 8, s, r, z, true);
            } else {
                a = int8_codes8<AZP>(f, s, r, z, false);
                b = int8_codes8<AZP>(f + 8, s, r, z, false);
            }
            st16(q + t * 16, make_uint4(a.x, a.y, b.x, b.y));
        } else if (t == nvec) {
            for (i64 j = nvec * 16; j < n; ++j) q[j] = int8_code1<AZP>(to_float(x[j]), s, r, z);
        }
    } else {
        const i64 stride = (i64)gridDim.x * blockDim.x;
        for (i64 j = t; j < n; j += stride) q[j] = int8_code1<AZP>(to_float(x[j]), s, r, z);
    }
}

// float32 of the int8 code in byte b, less the zero point where AZP.
template <bool AZP> __device__ __forceinline__ float int8_value(unsigned char b, int z) {
    if constexpr (AZP) return minus_zero_point(b, z);
    else return (float)(signed char)b;
}

// As fp8_dequantize (two units of 16 / sizeof(OutT) elements per thread, a unit's bytes one load).
template <typename OutT, bool AZP>
__device__ __forceinline__ void int8_dequant_unit(const unsigned char* __restrict__ q, OutT* __restrict__ y, i64 unit,
                                                  float s, int z) {
    constexpr int E = Vec16<OutT>::N;
    unsigned w[E / 4];
    if constexpr (E == 8) {
        const uint2 b = __ldg(reinterpret_cast<const uint2*>(q + unit * 8));
        w[0] = b.x;
        w[1] = b.y;
    } else {
        w[0] = __ldg(reinterpret_cast<const unsigned*>(q + unit * 4));
    }
    float f[E];
#pragma unroll
    for (int i = 0; i < E; ++i)
        f[i] = mul_rn(int8_value<AZP>((unsigned char)((w[i >> 2] >> (8 * (i & 3))) & 0xffu), z), s);
    st16(y + unit * E, pack16<OutT>(f));
}

template <typename OutT, bool AZP, bool VEC>
__global__ void __launch_bounds__(256)
int8_dequantize(const unsigned char* __restrict__ q, OutT* __restrict__ y, i64 n, const float* __restrict__ scale_src,
                const int* __restrict__ zp_src) {
    pdl_wait_then_release();
    const float s = *scale_src;
    const int z = AZP ? *zp_src : 0;
    const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (VEC) {
        constexpr int E = Vec16<OutT>::N;
        const i64 nunits = n / E;
        const i64 first = (t >> 5) * 64 + (t & 31);
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const i64 unit = first + u * 32;
            if (unit < nunits) {
                int8_dequant_unit<OutT, AZP>(q, y, unit, s, z);
            } else if (unit == nunits) {
                for (i64 j = nunits * E; j < n; ++j) y[j] = from_float<OutT>(mul_rn(int8_value<AZP>(q[j], z), s));
            }
        }
    } else {
        const i64 stride = (i64)gridDim.x * blockDim.x;
        for (i64 j = t; j < n; j += stride) y[j] = from_float<OutT>(mul_rn(int8_value<AZP>(q[j], z), s));
    }
}
