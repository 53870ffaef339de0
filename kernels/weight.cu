// weight.cu: weight-only quantization (INT4 symmetric uint4b8 as GPTQ/Marlin, INT4 asymmetric with
// zero points as AWQ, FP8 E4M3 for W8A16), its dequantization, and the decode matmul
// y = a @ dequant(w).T that dequantizes the weights in registers.
//
// What it computes (reference: cupyquant.reference.quantize_weight / dequantize_weight; every float
// step IEEE float32, T the weight's dtype):
//   weight_quantize   per (row n, group of G along K): int4 s = T(amax / 7), q = clamp(rne(w / s),
//                     -8, 7) + 8; uint4 s = T(max(max - min, 1e-5) / 15), z = clamp(rne(-min / s),
//                     0, 15), q = clamp(rne(w / s) + z, 0, 15); fp8 s = T(amax / 448),
//                     q = e4m3_satfinite(w / s). Maxima over the finite weights, NaN -> the zero
//                     code (rne(NaN) = 0), +-inf clamps, a zero scale gives the zero code.
//   weight_dequantize y = round(float(q - z) * float(s)) (z = 8 for int4), or fp8(q) * s.
//   w4a16_matmul      see below.
// Layout: w (N, K) row-major; INT4 data (N, K / 2) bytes, element 0 in the low nibble; FP8 data
// (N, K); scales (N, K / G) of T; uint4 zero codes unpacked (N, K / G) bytes here (the wrapper
// packs them two per byte).

#include "common.cuh"
#include "weight_mma.cuh"

using namespace cq;

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
// over element pairs (INT4: one byte each) or elements (FP8) to write the codes.
template <typename T, int S>
__global__ void __launch_bounds__(256) weight_quantize(const T* __restrict__ w, unsigned char* __restrict__ q, T* __restrict__ scales,
                                                       unsigned char* __restrict__ zeros, WQuantArgs a) {
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
    else s32 = div_rn(__uint_as_float(key), S == W_INT4 ? 7.0f : 448.0f);
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

// ---------------------------------------------------------------- dequantize
struct WDequantArgs {
    i64 N, K;
    i64 ng;
    int G;
};

// Grid (ceil(K / 2 / 256), rows): one thread per element pair of a row.
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
        } else {
            const unsigned b = q[n * (a.K / 2) + p];
            const int z = S == W_UINT4 ? (int)((zeros[n * ((a.ng + 1) / 2) + g / 2] >> (4 * (g % 2))) & 15u) : 8;
            v[0] = (float)((int)(b & 15u) - z);
            v[1] = (float)((int)(b >> 4) - z);
        }
        O* d = y + n * a.K + 2 * p;
        d[0] = from_float<O>(mul_rn(v[0], s));
        d[1] = from_float<O>(mul_rn(v[1], s));
    }
}

// ---------------------------------------------------------------- decode matmul
// y (M, N) = a (M, K) @ dequant(w).T, fp32 accumulation on mma.sync.m16n8k16 (f16 or bf16), the
// weights dequantized in registers from the plain layout, each weight byte read once per M tile
// of 16 rows.
//
// Tiling. A block of 8 warps owns 32 output columns (4 n8 tiles) and one M tile of 16 rows; its
// warps split K (warp w takes K chunks w, w + 8, ...) and add their partial sums through shared
// memory at the end. A K chunk is 4 x VALS elements, VALS = 32 (INT4, 16 bytes) or 16 (FP8): lane
// (g, t) = (lane / 4, lane % 4) loads 16 bytes of weight row n0 + 8j + g (tile j) at chunk offset
// t * VALS, and the matching 16 x VALS activations of rows g and g + 8 of the M tile.
//
// Weight stream. The weights are read once and nothing else hides their latency, so each warp keeps
// MM_STAGES chunks of them in flight: a ring of MM_STAGES slots in shared memory (2 KB per slot),
// filled by cp.async MM_STAGES - 1 chunks ahead of the chunk being multiplied. A lane reads back only
// the 16-byte pieces it copied itself, so cp.async.wait_group orders each slot's fill and use with no
// barrier; the slot refilled in an iteration is the one emptied into registers the iteration before.
//
// K order. The sum over K does not care in which order the products come, so each thread's VALS
// consecutive k are assigned to the mma's k slots (2t, 2t + 1, 2t + 8, 2t + 9 of each k16 step) in
// the order that is cheapest for the weights: INT4 step j takes from 32-bit word i = j / 2 the
// nibble pairs (p, p + 4) and (p + 1, p + 5), p = 2 (j % 2) (one shift and one lop3 each put two
// codes in the two 16-bit halves); the activations are permuted to match with one prmt per register,
// shared by the 4 tiles. FP8 step j takes word j's bytes (0, 1) and (2, 3) in order.
//
// Dequantization (without POST exact: the same bits as dequantize_weight to T): INT4 codes become 1024 + q
// (fp16, exponent 0x64) or 128 + q (bf16, 0x43) by one lop3, minus 1024 + z (or 128 + z) exactly,
// times the scale in one rounding (fma with -0). FP8 goes through the exact fp8 -> f16x2
// conversion; fp16 multiplies there, bf16 in float32 (exact) and rounds once to bf16.
static constexpr int MM_WARPS = 8;
static constexpr int MM_NT = 4;      // n8 tiles per warp
static constexpr int MM_STAGES = 4;  // weight chunks in flight per warp (the ring's slots)
static constexpr int MM_SMEM = MM_WARPS * MM_STAGES * MM_NT * 32 * 16;  // dynamic shared bytes (64 KB)

struct MatmulArgs {
    i64 M, N, K;
    i64 lda;     // elements between rows of a
    i64 ng;      // groups per weight row
    int gshift;  // group of k: k >> gshift (log2 G; 62 for one group per row)
};

// The fp16 / bf16 value with bits b (low 16 bits), as float (exact).
template <typename T> __device__ __forceinline__ float bits16_to_float(unsigned b) {
    if constexpr (same_t<T, __half>::value) return __half2float(__ushort_as_half((unsigned short)b));
    else return __uint_as_float(b << 16);
}

// Two fp8 (E4M3) bytes -> their values times s as a T pair, one rounding.
template <typename T>
__device__ __forceinline__ unsigned fp8x2_scaled(unsigned short b, unsigned s2, float sf) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(b, __NV_E4M3);
    if constexpr (same_t<T, __half>::value) {
        return HalfOps<__half>::fma2((unsigned)h.x | ((unsigned)h.y << 16), s2, 0x80008000u);
    } else {
        const float lo = mul_rn(__half2float(__ushort_as_half(h.x)), sf);
        const float hi = mul_rn(__half2float(__ushort_as_half(h.y)), sf);
        return (unsigned)bits16_rn<__nv_bfloat16>(lo) | ((unsigned)bits16_rn<__nv_bfloat16>(hi) << 16);
    }
}

// TWO: the M tile has rows past 8 (load rows g + 8). POST (INT4 with G a multiple of 128: a chunk is
// one group): the mma multiplies the exact q - z, and each chunk's partial sums are scaled in float32
// afterwards (one FMA per output instead of one multiply per weight pair).
template <typename T, int S, bool TWO, bool POST>
__global__ void __launch_bounds__(MM_WARPS * 32, 2) w4a16_matmul(const T* __restrict__ act, const unsigned char* __restrict__ wq,
                                                                const T* __restrict__ scales, const unsigned char* __restrict__ zeros,
                                                                T* __restrict__ y, MatmulArgs a) {
    constexpr bool FP8 = S == W_FP8;
    constexpr int VALS = FP8 ? 16 : 32;  // weights per 16-byte load
    constexpr int CHUNK = 4 * VALS;
    constexpr int STEPS = VALS / 4;      // k16 mma steps per chunk
    constexpr int AREGS = VALS / 2;      // activation registers per row per chunk
    using H = HalfOps<T>;
    extern __shared__ uint4 mm_smem[];  // the warps' rings [MM_WARPS][MM_STAGES][MM_NT][32], then the reduction

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const i64 n0 = (i64)blockIdx.x * (8 * MM_NT);
    const i64 m0 = (i64)blockIdx.y * 16;
    const i64 nchunks = a.K / CHUNK;
    const i64 wrow = FP8 ? a.K : a.K / 2;  // bytes per weight row
    const bool row0 = m0 + g < a.M, row1 = TWO && m0 + g + 8 < a.M;
    const T* arow0 = act + (m0 + g) * a.lda;
    const T* arow1 = act + (m0 + g + 8) * a.lda;

    float acc[MM_NT][4];
#pragma unroll
    for (int j = 0; j < MM_NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

    uint4* ring = mm_smem + warp * (MM_STAGES * MM_NT * 32) + lane;
    // chunk c of this warp's weights into ring slot `slot` (zeros past K or N), as one commit group
    auto fill = [&](i64 c, int slot) {
#pragma unroll
        for (int j = 0; j < MM_NT; ++j) {
            const i64 n = n0 + 8 * j + g;
            const bool ok = c < nchunks && n < a.N;
            const unsigned char* src = wq + n * wrow + (FP8 ? c * CHUNK + t * VALS : (c * CHUNK + t * VALS) / 2);
            cp_async16(ring + (slot * MM_NT + j) * 32, ok ? src : wq, ok);
        }
        cp_async_commit();
    };
#pragma unroll
    for (int s = 0; s < MM_STAGES - 1; ++s) fill(warp + (i64)s * MM_WARPS, s);

    // Scales when a chunk lies in one group (G >= CHUNK: always with POST): lane l loads the scale of
    // row n0 + l (and its zero code in the high half) one chunk ahead, and the lanes that need it
    // take it by shuffle: one load per chunk instead of 4 (12 with POST) scattered ones.
    const bool uni = POST || a.gshift >= (FP8 ? 6 : 7);
    const unsigned short* sc16 = reinterpret_cast<const unsigned short*>(scales);
    auto scale_word = [&](i64 c) -> unsigned {
        const i64 n = n0 + lane, grp = (c * CHUNK) >> a.gshift;
        if (!uni || c >= nchunks || n >= a.N) return 0u;
        unsigned v = __ldg(sc16 + n * a.ng + grp);
        if constexpr (S == W_UINT4) v |= ((unsigned)(zeros[n * ((a.ng + 1) / 2) + grp / 2] >> (4 * (grp % 2))) & 15u) << 16;
        return v;
    };
    // Activations of rows below 8 (M <= 8, the decode case) are loaded one chunk ahead too; with rows
    // 8..15 as well the registers are short, and they are loaded where used.
    constexpr bool PREF = !TWO;
    auto load_act = [&](const T* row, bool ok, i64 c, unsigned* r) {
        const i64 k0 = c * CHUNK + t * VALS;
#pragma unroll
        for (int q = 0; q < AREGS / 4; ++q) {
            const uint4 v = ok && c < nchunks ? ld16(row + k0 + 8 * q) : make_uint4(0u, 0u, 0u, 0u);
            r[4 * q] = v.x; r[4 * q + 1] = v.y; r[4 * q + 2] = v.z; r[4 * q + 3] = v.w;
        }
    };
    unsigned sw_next = scale_word(warp);
    unsigned ar0_next[PREF ? AREGS : 1];
    if constexpr (PREF) load_act(arow0, row0, warp, ar0_next);

#pragma unroll 1
    for (i64 c = warp, i = 0; c < nchunks; c += MM_WARPS, ++i) {
        uint4 wv[MM_NT];
        cp_async_wait<MM_STAGES - 2>();  // chunk i's group is complete (this lane's copies)
        const int slot = (int)(i % MM_STAGES);
#pragma unroll
        for (int j = 0; j < MM_NT; ++j) wv[j] = ring[(slot * MM_NT + j) * 32];
        fill(c + (i64)(MM_STAGES - 1) * MM_WARPS, (int)((i + MM_STAGES - 1) % MM_STAGES));  // the slot emptied last iteration
        {
            const i64 k0 = c * CHUNK + t * VALS;
            unsigned ar0[AREGS], ar1[AREGS];
            if constexpr (PREF) {
#pragma unroll
                for (int q = 0; q < AREGS; ++q) ar0[q] = ar0_next[q];
                load_act(arow0, row0, c + MM_WARPS, ar0_next);
#pragma unroll
                for (int q = 0; q < AREGS; ++q) ar1[q] = 0u;
            } else {
                load_act(arow0, row0, c, ar0);
                load_act(arow1, row1, c, ar1);
            }
            const unsigned sw = sw_next;
            sw_next = scale_word(c + MM_WARPS);
            // per tile: the group's scale (and zero) for this thread's VALS weights
            unsigned s2[MM_NT], zb[MM_NT];
            float sf[MM_NT], cs[MM_NT][2], part[MM_NT][4];
            const i64 grp = k0 >> a.gshift;
            if constexpr (POST) {
#pragma unroll
                for (int j = 0; j < MM_NT; ++j) {
                    part[j][0] = part[j][1] = part[j][2] = part[j][3] = 0.0f;
#pragma unroll
                    for (int h = 0; h < 2; ++h)  // the scales of this thread's accumulator columns
                        cs[j][h] = bits16_to_float<T>(__shfl_sync(0xffffffffu, sw, 8 * j + 2 * t + h) & 0xffffu);
                }
            }
#pragma unroll
            for (int j = 0; j < MM_NT; ++j) {
                const i64 n = n0 + 8 * j + g;
                unsigned sb, z = 8u;
                if (uni) {
                    const unsigned u = __shfl_sync(0xffffffffu, sw, 8 * j + g);
                    sb = u & 0xffffu;
                    if constexpr (S == W_UINT4) z = u >> 16;
                } else {
                    sb = n < a.N ? __ldg(sc16 + n * a.ng + grp) : 0u;
                    if constexpr (S == W_UINT4) z = n < a.N ? (unsigned)((zeros[n * ((a.ng + 1) / 2) + grp / 2] >> (4 * (grp % 2))) & 15u) : 0u;
                }
                s2[j] = sb * 0x10001u;
                sf[j] = __uint_as_float(same_t<T, __half>::value ? 0u : (sb << 16));
                zb[j] = (H::BIAS + z) * 0x10001u ^ 0x80008000u;  // -(bias + z) in each half
            }
#pragma unroll
            for (int st = 0; st < STEPS; ++st) {
                unsigned af[4];
                if constexpr (FP8) {
                    af[0] = ar0[2 * st]; af[1] = ar1[2 * st]; af[2] = ar0[2 * st + 1]; af[3] = ar1[2 * st + 1];
                } else {
                    const int i = st / 2, h = st % 2;
                    af[0] = __byte_perm(ar0[4 * i + h], ar0[4 * i + 2 + h], 0x5410);
                    af[1] = __byte_perm(ar1[4 * i + h], ar1[4 * i + 2 + h], 0x5410);
                    af[2] = __byte_perm(ar0[4 * i + h], ar0[4 * i + 2 + h], 0x7632);
                    af[3] = __byte_perm(ar1[4 * i + h], ar1[4 * i + 2 + h], 0x7632);
                }
#pragma unroll
                for (int j = 0; j < MM_NT; ++j) {
                    const unsigned* ww = reinterpret_cast<const unsigned*>(&wv[j]);
                    unsigned b0, b1;
                    if constexpr (FP8) {
                        b0 = fp8x2_scaled<T>((unsigned short)(ww[st] & 0xffffu), s2[j], sf[j]);
                        b1 = fp8x2_scaled<T>((unsigned short)(ww[st] >> 16), s2[j], sf[j]);
                    } else {
                        const unsigned word = ww[st / 2];
                        const int sh = 8 * (st % 2);  // pairs p = 2 (st % 2) and p + 1: shifts 4p and 4p + 4
                        const unsigned x0 = lop3_and_or(word >> sh, 0x000f000fu, H::MAGIC);
                        const unsigned x1 = lop3_and_or(word >> (sh + 4), 0x000f000fu, H::MAGIC);
                        b0 = H::fma2(x0, H::ONE, zb[j]);  // q - z, exact
                        b1 = H::fma2(x1, H::ONE, zb[j]);
                        if constexpr (!POST) {
                            b0 = H::fma2(b0, s2[j], 0x80008000u);
                            b1 = H::fma2(b1, s2[j], 0x80008000u);
                        }
                    }
                    mma16816<T>(POST ? part[j] : acc[j], af, b0, b1);
                }
            }
            if constexpr (POST) {
#pragma unroll
                for (int j = 0; j < MM_NT; ++j)
#pragma unroll
                    for (int r = 0; r < 4; ++r) acc[j][r] = fma_rn(part[j][r], cs[j][r & 1], acc[j][r]);
            }
        }
    }

    // split-K across the warps: partial sums through shared memory, over the emptied rings
    cp_async_wait<0>();  // the fills past the last chunk (zeros) land before the memory is reused
    __syncthreads();
    float(*red)[MM_NT][4][32] = reinterpret_cast<float(*)[MM_NT][4][32]>(mm_smem);
#pragma unroll
    for (int j = 0; j < MM_NT; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) red[warp][j][r][lane] = acc[j][r];
    __syncthreads();
#pragma unroll
    for (int o = threadIdx.x; o < MM_NT * 4 * 32; o += MM_WARPS * 32) {
        const int j = o / 128, r = (o / 32) % 4, l = o % 32;
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < MM_WARPS; ++w) sum = add_rn(sum, red[w][j][r][l]);
        const i64 m = m0 + (l >> 2) + 8 * (r >> 1);
        const i64 n = n0 + 8 * j + 2 * (l & 3) + (r & 1);
        if (m < a.M && n < a.N) y[m * a.N + n] = from_float<T>(sum);
    }
}
