// weight_quant.cu: weight-only quantization (INT4 symmetric uint4b8 as GPTQ/Marlin, INT4 asymmetric with
// zero points as AWQ, FP8 E4M3 for W8A16), FP8 E4M3 in 2-D blocks of 128 x 128 with float32 scales
// (DeepSeek-V3's weights, for W8A8), symmetric INT8 per output channel with code sums (SmoothQuant /
// compressed-tensors W8A8 INT8), and their dequantization; the dequantization of NVFP4 and MXFP4
// weights (made by nvfp4.cu / mx.cu) and NVFP4's decode scale_2.
//
// What it computes (reference: cupyquant.reference.quantize_weight / dequantize_weight; every float
// step IEEE float32, T the weight's dtype, G the group size):
//   weight_quantize   per (row n, group of G along K): int4 s = T(amax / 7), q = clamp(rne(w / s),
//                     -8, 7) + 8; uint4 s = T(max(max - min, 1e-5) / 15), z = clamp(rne(-min / s),
//                     0, 15), q = clamp(rne(w / s) + z, 0, 15); fp8 s = T(amax / 448),
//                     q = e4m3_satfinite(w / s); int8 (G = K) s = T(amax / 127),
//                     q = clamp(rne(w / s), -128, 127) and sums[n] = sum_k q (exact, int32).
//                     Maxima over the finite weights, NaN -> the zero code (rne(NaN) = 0), +-inf
//                     clamps, a zero scale gives the zero code (reference: quantize_weight_int8,
//                     weight_code_sum for int8).
//   weight_code_sum   sums[n] = sum_k q[n, k] of int8 codes given as they are (weight_code_sum).
//   weight_dequantize y = round(float(q - z) * float(s)) (z = 8 for int4), fp8(q) * s, or
//                     float(q) * s for int8 (dequantize_weight_int8).
//   weight_quantize_block   per 128 x 128 block (partial at the bottom and right edges): amax over
//                     the block's finite weights, s = amax / 448 kept in float32,
//                     q = e4m3_satfinite(w / s); NaN and a zero s give 0x00, +-inf clamps to +-448
//                     (reference: cupyquant.reference.quantize_weight_blocks).
//   weight_dequantize_block y = round(fp8(q) * s), the product float32 (dequantize_weight_blocks).
//   weight_dequantize_fp4 NVFP4 y = round(e2m1(q) * float32(e4m3(sf) * scale_2)); MXFP4
//                     y = round(e2m1(q) * 2^(b - 127)) (b = 0: the subnormal 2^-127, b = 255: NaN);
//                     both products IEEE float32 (dequantize_weight with "nvfp4" / "mxfp4").
//   weight_scale_2    scale_2 = float32(1 / S_enc), NVFP4's decode scale from its global encode
//                     scale, correctly rounded with subnormals kept (an ordinary CuPy division
//                     would flush them: CuPy compiles with -ftz=true).
// Layout: w (N, K) row-major; INT4 data (N, K / 2) bytes, element 0 in the low nibble; FP8 data
// (N, K); INT8 data (N, K) signed bytes (any K), sums int32 (N,); scales (N, K / G) of T; uint4
// zero codes unpacked (N, K / G) bytes here (the wrapper packs them two per byte). Blocks: data
// (N, K), scales float32 (ceil(N / 128), ceil(K / 128)). FP4: data (N, K / 2) E2M1 codes, element 0
// in the low nibble; scales (N, K / B) bytes (E4M3 for NVFP4, B = 16; E8M0 for MXFP4, B = 32);
// NVFP4's scale_2 float32 (1,).

#include "common.cuh"
#include "weight_mma.cuh"

using namespace cq;

// INT8 weights (W8A8) exist only here: the weight-only matmul kernels take W_INT4, W_UINT4, W_FP8,
// W_NVFP4 and W_MXFP4.
#define W_INT8 3
static_assert(W_INT8 != W_INT4 && W_INT8 != W_UINT4 && W_INT8 != W_FP8, "weight scheme ids must differ");

// rne(v) as an integer clamped to [lo, hi]; NaN -> 0 (cvt.rni gives 0 for NaN and saturates inf).
__device__ __forceinline__ int rne_clamp(float v, int lo, int hi) {
    return min(max(__float2int_rn(v), lo), hi);
}

// ---------------------------------------------------------------- quantize
struct WQuantArgs {
    i64 N, K;
    i64 ng;  // groups per row, K / G
    int G;
};

// One warp per (row, group): lanes stride over the group for the maxima (shuffle reduction), then
// over element pairs (INT4: one byte each) or elements (FP8, INT8) to write the codes. INT8 (one
// group per row) also adds the row's codes (shuffle reduction) into sums[n]; sums is unused else.
template <typename T, int S>
__global__ void __launch_bounds__(256) weight_quantize(const T* __restrict__ w, unsigned char* __restrict__ q, T* __restrict__ scales,
                                                       unsigned char* __restrict__ zeros, int* __restrict__ sums, WQuantArgs a) {
    const i64 gw = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (gw >= a.N * a.ng) return;
    const i64 n = gw / a.ng, g = gw - n * a.ng;
    const T* src = w + n * a.K + g * a.G;

    unsigned key = 0;  // max |w| as float bits, over the finite weights
    float mx = __uint_as_float(0xff800000u), mn = __uint_as_float(0x7f800000u);  // max / min of the finite weights (from -inf, +inf)
    for (int i = lane; i < a.G; i += 32) {
        const float v = to_float(src[i]);
        if (is_finite_bits(__float_as_uint(v))) {
            key = max(key, __float_as_uint(v) & 0x7fffffffu);
            mx = fmax_ieee(mx, v);
            mn = fmin_ieee(mn, v);
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        key = max(key, __shfl_xor_sync(0xffffffffu, key, o));
        mx = fmax_ieee(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        mn = fmin_ieee(mn, __shfl_xor_sync(0xffffffffu, mn, o));
    }
    if (__float_as_uint(mx) == 0xff800000u && __float_as_uint(mn) == 0x7f800000u) mx = mn = 0.0f;  // none finite

    float s32;
    if constexpr (S == W_UINT4) s32 = div_rn(fmax_ieee(add_rn(mx, -mn), 1e-5f), 15.0f);
    else s32 = div_rn(__uint_as_float(key), S == W_INT4 ? 7.0f : S == W_INT8 ? 127.0f : 448.0f);
    const T st = from_float<T>(s32);
    const float sf = to_float(st);
    const bool zero_scale = (__float_as_uint(sf) & 0x7fffffffu) == 0u;  // on bits: -ftz would flush a compare
    const int z = S == W_UINT4 ? (zero_scale ? rne_clamp(0.0f, 0, 15) : rne_clamp(div_rn(-mn, sf), 0, 15)) : 8;
    if (lane == 0) {
        scales[n * a.ng + g] = st;
        if constexpr (S == W_UINT4) zeros[n * a.ng + g] = (unsigned char)z;
    }

    if constexpr (S == W_FP8) {
        unsigned char* dst = q + n * a.K + g * a.G;
        for (int i = lane; i < a.G; i += 32) {
            const float v = to_float(src[i]);
            const bool nan = (__float_as_uint(v) & 0x7fffffffu) > 0x7f800000u;
            dst[i] = zero_scale || nan ? 0 : (unsigned char)(to_fp8x2<E4M3>(div_rn(v, sf), 0.0f) & 0xffu);
        }
    } else if constexpr (S == W_INT8) {
        signed char* dst = reinterpret_cast<signed char*>(q) + n * a.K + g * a.G;
        int sum = 0;  // |sum| <= 128 K: exact in int32 for K <= 2^24 (the wrappers' limit)
        for (int i = lane; i < a.G; i += 32) {
            const int c = zero_scale ? 0 : rne_clamp(div_rn(to_float(src[i]), sf), -128, 127);
            dst[i] = (signed char)c;
            sum += c;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (lane == 0) sums[n] = sum;
    } else {
        unsigned char* dst = q + n * (a.K / 2) + g * (a.G / 2);
        for (int i = lane; i < a.G / 2; i += 32) {
            unsigned c[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float v = div_rn(to_float(src[2 * i + h]), sf);
                if constexpr (S == W_INT4) c[h] = zero_scale ? 8u : (unsigned)(rne_clamp(v, -8, 7) + 8);
                else c[h] = zero_scale ? (unsigned)z : (unsigned)min(max(rne_clamp(v, -(1 << 20), 1 << 20) + z, 0), 15);
            }
            dst[i] = (unsigned char)(c[0] | (c[1] << 4));
        }
    }
}

// ---------------------------------------------------------------- INT8 code sums
// sums[n] = sum_k q[n, k] of int8 codes (N, K), exact in int32 (K <= 2^24): the code sums of a
// weight given as codes (from a checkpoint), equal to what weight_quantize<T, W_INT8> writes.
// One warp per row, as weight_quantize. S is W_INT8, the scheme whose codes it sums.
template <int S>
__global__ void __launch_bounds__(256) weight_code_sum(const signed char* __restrict__ q, int* __restrict__ sums, WQuantArgs a) {
    static_assert(S == W_INT8, "code sums are of int8 codes");
    const i64 n = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (n >= a.N) return;
    const signed char* src = q + n * a.K;
    int sum = 0;
    for (i64 i = lane; i < a.K; i += 32) sum += (int)src[i];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) sums[n] = sum;
}

// ---------------------------------------------------------------- dequantize
struct WDequantArgs {
    i64 N, K;
    i64 ng;
    int G;
};

// Grid (ceil(ceil(K / 2) / 256), rows): one thread per element pair of a row (INT8: K may be odd,
// the last pair then has one element).
template <typename T, typename O, int S>
__global__ void __launch_bounds__(256) weight_dequantize(const unsigned char* __restrict__ q, const T* __restrict__ scales,
                                                         const unsigned char* __restrict__ zeros, O* __restrict__ y, WDequantArgs a) {
    const i64 p = (i64)blockIdx.x * blockDim.x + threadIdx.x;  // pair index within the row
    if (2 * p >= a.K) return;
    for (i64 n = blockIdx.y; n < a.N; n += gridDim.y) {
        const i64 g = 2 * p / a.G;
        const float s = to_float(scales[n * a.ng + g]);
        float v[2];
        if constexpr (S == W_FP8) {
            fp8x2_to_float2<E4M3>(*reinterpret_cast<const unsigned short*>(q + n * a.K + 2 * p), v[0], v[1]);
        } else if constexpr (S == W_INT8) {
            const signed char* c = reinterpret_cast<const signed char*>(q) + n * a.K + 2 * p;
            v[0] = (float)c[0];
            v[1] = 2 * p + 1 < a.K ? (float)c[1] : 0.0f;
        } else {
            const unsigned b = q[n * (a.K / 2) + p];
            const int z = S == W_UINT4 ? (int)((zeros[n * ((a.ng + 1) / 2) + g / 2] >> (4 * (g % 2))) & 15u) : 8;
            v[0] = (float)((int)(b & 15u) - z);
            v[1] = (float)((int)(b >> 4) - z);
        }
        O* d = y + n * a.K + 2 * p;
        d[0] = from_float<O>(mul_rn(v[0], s));
        if (S != W_INT8 || 2 * p + 1 < a.K) d[1] = from_float<O>(mul_rn(v[1], s));
    }
}

// ---------------------------------------------------------------- 128 x 128 blocks, float32 scales
struct WBlockArgs {
    i64 N, K;
    i64 kb;  // blocks along K, ceil(K / 128)
};

// A 1-D grid of one 256-thread block per 128 x 128 block of w (block b = bn * kb + bk, the scale's
// row-major index). Thread t takes column t % 128 of the block's rows t / 128, t / 128 + 2, ...,
// so a warp reads 32 contiguous elements of a row. The max |w| (float bits of the finite weights)
// over the block by block_max, then the same elements read again (L1/L2) to write the codes.
template <typename T>
__global__ void __launch_bounds__(256) weight_quantize_block(const T* __restrict__ w, unsigned char* __restrict__ q,
                                                             float* __restrict__ scales, WBlockArgs a) {
    const i64 b = blockIdx.x;
    const i64 bn = b / a.kb, bk = b - bn * a.kb;
    const i64 r0 = bn * 128, c = bk * 128 + (threadIdx.x & 127);
    const i64 rows = min((i64)128, a.N - r0);
    const bool col = c < a.K;
    const int r_first = threadIdx.x >> 7;

    unsigned key = 0;
    if (col) {
        for (i64 r = r_first; r < rows; r += 2) {
            const unsigned u = __float_as_uint(to_float(w[(r0 + r) * a.K + c]));
            if (is_finite_bits(u)) key = max(key, u & 0x7fffffffu);
        }
    }
    key = block_max<256>(key);
    __shared__ float s_block;
    if (threadIdx.x == 0) {
        s_block = div_rn(__uint_as_float(key), 448.0f);
        scales[b] = s_block;
    }
    __syncthreads();
    const float s = s_block;
    const bool zero_scale = (__float_as_uint(s) & 0x7fffffffu) == 0u;  // on bits: -ftz would flush a compare
    if (!col) return;
    for (i64 r = r_first; r < rows; r += 2) {
        const i64 i = (r0 + r) * a.K + c;
        const float v = to_float(w[i]);
        const bool nan = (__float_as_uint(v) & 0x7fffffffu) > 0x7f800000u;
        q[i] = zero_scale || nan ? 0 : (unsigned char)(to_fp8x2<E4M3>(div_rn(v, s), 0.0f) & 0xffu);
    }
}

// Grid (ceil(K / 256), rows): one thread per element of a row, y = round(fp8(q) * s).
template <typename O>
__global__ void __launch_bounds__(256) weight_dequantize_block(const unsigned char* __restrict__ q, const float* __restrict__ scales,
                                                               O* __restrict__ y, WBlockArgs a) {
    const i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= a.K) return;
    for (i64 n = blockIdx.y; n < a.N; n += gridDim.y) {
        const float s = scales[(n >> 7) * a.kb + (k >> 7)];
        y[n * a.K + k] = from_float<O>(mul_rn(fp8_to_float<E4M3>(q[n * a.K + k]), s));
    }
}

// ---------------------------------------------------------------- FP4 (NVFP4, MXFP4)
// E2M1 code (the low nibble of c: sign bit 3, exponent bits 2..1, mantissa bit 0) -> float,
// exact: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. Codes 1.. as float bits: 0.5 is 0x3f000000, and
// an exponent e >= 1 gives 2^(e - 1) * (1 + m / 2), exponent field e + 126, mantissa bit 22.
__device__ __forceinline__ float e2m1_value(unsigned c) {
    const unsigned m = c & 7u;
    const unsigned mag = m < 2u ? m * 0x3f000000u : (((m >> 1) + 126u) << 23) | ((m & 1u) << 22);
    return __uint_as_float(mag | ((c & 8u) << 28));
}

// Grid (ceil(K / 8 / 256), rows): one thread per 8 elements of a row (4 code bytes, inside one
// scale block: K is a multiple of B). a.ng = K / B. The code bytes are read one at a time: a
// checkpoint's data may start at any byte.
template <typename O, int S>
__global__ void __launch_bounds__(256) weight_dequantize_fp4(const unsigned char* __restrict__ q, const unsigned char* __restrict__ scales,
                                                             const float* __restrict__ scale_2, O* __restrict__ y, WDequantArgs a) {
    static_assert(S == W_NVFP4 || S == W_MXFP4, "FP4 weight schemes");
    constexpr int B = S == W_NVFP4 ? 16 : 32;
    const i64 p = (i64)blockIdx.x * blockDim.x + threadIdx.x;  // elements 8 p .. 8 p + 7 of a row
    if (8 * p >= a.K) return;
    float s2 = 0.0f;
    if constexpr (S == W_NVFP4) s2 = __ldg(scale_2);
    for (i64 n = blockIdx.y; n < a.N; n += gridDim.y) {
        const unsigned b = scales[n * a.ng + 8 * p / B];
        const float s = S == W_NVFP4 ? mul_rn(fp8_to_float<E4M3>((unsigned char)b), s2) : e8m0_to_float(b);
        const unsigned char* src = q + n * (a.K / 2) + 4 * p;
        unsigned w = 0u;
#pragma unroll
        for (int i = 0; i < 4; ++i) w |= (unsigned)src[i] << (8 * i);
        O* d = y + n * a.K + 8 * p;
#pragma unroll
        for (int j = 0; j < 8; ++j) d[j] = from_float<O>(mul_rn(e2m1_value(w >> (4 * j)), s));
    }
}

// One thread: scale_2[0] = rcp.rn(s_enc[0]) (IEEE, no flush). S is W_NVFP4, the scheme it serves.
template <int S>
__global__ void weight_scale_2(const float* __restrict__ s_enc, float* __restrict__ scale_2) {
    static_assert(S == W_NVFP4, "only NVFP4 weights have a second scale");
    if (threadIdx.x == 0 && blockIdx.x == 0) scale_2[0] = rcp_rn(s_enc[0]);
}
