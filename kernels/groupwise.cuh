// groupwise.cuh: the per-group and per-token FP8/INT8 rules of groupwise.cu (formats, scales and
// their layouts, the clamp and conversion of 8 elements, the per-token scale and the row team), shared
// with the fused RMSNorm quantizer (rms_norm.cu). groupwise.cu states the formulas and the layouts.
#pragma once

#include "common.cuh"
#include "int8.cuh"

using namespace cq;

// ---------------------------------------------------------------- element formats
template <class F> struct QRange {  // vLLM's clamp bounds
    static constexpr float lo = -F::max_finite, hi = F::max_finite;
};
template <> struct QRange<I8> {
    static constexpr float lo = -128.0f, hi = 127.0f;
};

// INT8 codes: to_int8_rn (cvt.rni.sat.s8.f32, NaN -> 0) and the zero-point helpers are in int8.cuh.

template <class F> __device__ __forceinline__ float from_q(unsigned char b) { return fp8_to_float<F>(b); }
template <> __device__ __forceinline__ float from_q<I8>(unsigned char b) { return (float)(signed char)b; }

// ---------------------------------------------------------------- scales
__device__ __forceinline__ unsigned ue8m0_of(float s) {  // the exponent byte of pow2_ceil(s)
    const unsigned b = __float_as_uint(fmax_ieee(__uint_as_float(__float_as_uint(s) & 0x7fffffffu), 1e-10f));
    return ((b >> 23) & 0xffu) + ((b & 0x7fffffu) != 0u);
}
__device__ __forceinline__ float pow2_ceil(float s) { return __uint_as_float(ue8m0_of(s) << 23); }

// Runtime parameters shared by the quantizers: where scales go and how they are made. Passed by value
// from a NumPy structured scalar with the same fields (cupyquant._scales.SCALE_ARGS, align=True).
// The scale buffer itself is a kernel argument of its own (words), so that the host passes the same
// ScaleArgs to every launch of a plan; each kernel stores it into sa.words first.
struct ScaleArgs {
    unsigned* words;     // scale buffer (float32 bits or packed UE8M0)
    i64 M;               // tokens per batch
    i64 M_pad;           // round_up(M, 4) for "col", M for "row"
    i64 sb, sm, sg;      // word strides of batch, token, group (or packed group)
    int n_groups;        // groups per row
    int packed;          // 1: UE8M0 bytes packed four per word; 0: float32 words
    int pow2;            // round scales up to powers of two
    int col;             // 1: "col" layout (pad rows M..M_pad are zeroed)
    const float* ub_ptr; // scale_ub on the device, or null
    float ub_arg;        // scale_ub as a value (used when ub_ptr is null and has_ub)
    int has_ub;
    unsigned long long m_magic;  // row / M = (row * m_magic) >> m_shift for row < 2^31 ("col")
    int m_shift;
};

__device__ __forceinline__ float load_ub(const ScaleArgs& a) { return a.ub_ptr ? *a.ub_ptr : a.ub_arg; }

// (batch, token) of a row for the "col" layout: a multiply by a host-made magic number
// (Granlund-Montgomery: exact for rows below 2^31), a 64-bit division beyond.
__device__ __forceinline__ void split_row(const ScaleArgs& a, i64 row, i64& b, i64& m) {
    b = row < 0x80000000LL ? (i64)(((unsigned long long)row * a.m_magic) >> a.m_shift) : row / a.M;
    m = row - b * a.M;
}

// The word of (row, group g) of an unpacked array (float32 or int32 words) in the scales' layout.
__device__ __forceinline__ i64 word_index(const ScaleArgs& a, i64 row, int g) {
    i64 b = 0, m = row;
    if (a.col) split_row(a, row, b, m);
    return b * a.sb + m * a.sm + (i64)g * a.sg;
}

// Store v as the word of (row, group g) of `words`, an unpacked array laid out like the scales (the
// zero points of asymmetric INT8), zeroing the "col" padding words of its column as store_scale does.
__device__ __forceinline__ void store_word(const ScaleArgs& a, unsigned* __restrict__ words, i64 row, int g,
                                           unsigned v) {
    i64 b = 0, m = row;
    if (a.col) split_row(a, row, b, m);
    words[b * a.sb + m * a.sm + (i64)g * a.sg] = v;
    if (a.col && m == a.M - 1)
        for (i64 p = a.M; p < a.M_pad; ++p) words[b * a.sb + p * a.sm + (i64)g * a.sg] = 0u;
}

// Store the scale of (row, group g) and zero the padding this group is responsible for.
__device__ __forceinline__ void store_scale(const ScaleArgs& a, i64 row, int g, float s) {
    if (!a.col && !a.packed) {  // the common case: a "row" float32 word
        a.words[row * a.sm + g] = __float_as_uint(s);
        return;
    }
    i64 b = 0, m = row;
    if (a.col) split_row(a, row, b, m);
    if (!a.packed) {
        a.words[b * a.sb + m * a.sm + (i64)g * a.sg] = __float_as_uint(s);
        if (a.col && m == a.M - 1)
            for (i64 p = a.M; p < a.M_pad; ++p) a.words[b * a.sb + p * a.sm + (i64)g * a.sg] = 0u;
        return;
    }
    unsigned char* bytes = reinterpret_cast<unsigned char*>(a.words);
    const i64 w = b * a.sb + m * a.sm + (i64)(g >> 2) * a.sg;
    const int j = g & 3;
    // the last group of a row also owns the unused bytes after it in its word
    const int j_end = (g == a.n_groups - 1) ? 4 : j + 1;
    bytes[w * 4 + j] = (unsigned char)ue8m0_of(s);
    for (int jj = j + 1; jj < j_end; ++jj) bytes[w * 4 + jj] = 0;
    if (a.col && m == a.M - 1)
        for (i64 p = a.M; p < a.M_pad; ++p) {
            const i64 wp = b * a.sb + p * a.sm + (i64)(g >> 2) * a.sg;
            for (int jj = j; jj < j_end; ++jj) bytes[wp * 4 + jj] = 0;
        }
}

// ---------------------------------------------------------------- 8-element loads and stores
template <typename T, bool VEC> __device__ __forceinline__ void load8(const T* __restrict__ p, float* f) {
    if constexpr (VEC) {
        if constexpr (sizeof(T) == 4) {
            unpack16<T>(ld16(p), f);
            unpack16<T>(ld16(p + 4), f + 4);
        } else {
            unpack16<T>(ld16(p), f);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = to_float(p[i]);
    }
}

// Max over the TPG consecutive lanes of a group (TPG a power of two dividing 32, the same in every
// lane, so all 32 lanes take each branch together). Only the log2(TPG) shuffles a group needs are
// issued: shuffles were the top stall (36% of cycles) when all five ran.
__device__ __forceinline__ unsigned group_max(unsigned v, int tpg) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        if (o < tpg) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// |x| keys of 16 values for the group max, cheaply: the magnitude bits (a NaN's exceed inf's). Only if
// some lane of the warp saw a NaN does the warp redo its keys with NaN mapped to 0 (fmaxf semantics);
// the vote keeps all 32 lanes on one path for the shuffles that follow.
__device__ __forceinline__ unsigned group_absmax16(const float* f, int tpg) {
    unsigned m = 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) m = max(m, __float_as_uint(f[i]) & 0x7fffffffu);
    if (__any_sync(0xffffffffu, m > 0x7f800000u)) {
        m = 0;
#pragma unroll
        for (int i = 0; i < 16; ++i) m = max(m, abs_key(f[i]));
    }
    return group_max(m, tpg);
}

// What happens to x / s before the 8-bit conversion. The conversions saturate (cvt.satfinite to
// +-max finite, cvt.rni.sat to [-128, 127]), so each rule keeps only the clamp side that decides NaN:
//   LO   vLLM group kernel, fminf(fmaxf(v, qmin), qmax): NaN -> qmin   == cvt(fmaxf(v, qmin))
//   HI   vLLM per-token and fused kernels, fmaxf(-qmax, fminf(v, qmax)): NaN -> +qmax == cvt(fminf(v, qmax))
//   NONE vLLM's INT8 paths without a clamp (cvt.rni.sat; NaN -> 0)
enum { CLAMP_LO = 0, CLAMP_HI = 1, CLAMP_NONE = 2 };

template <class F, int CLAMP> __device__ __forceinline__ float pre_clamp(float v) {
    if constexpr (CLAMP == CLAMP_LO) return fmax_ieee(v, QRange<F>::lo);
    else if constexpr (CLAMP == CLAMP_HI) return fmin_ieee(v, QRange<F>::hi);
    else return v;
}

// Eight values through the rule's clamp and the saturating conversion, packed into 8 bytes,
// element 0 lowest.
template <class F, int CLAMP> __device__ __forceinline__ uint2 pack8(const float* u) {
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = pre_clamp<F, CLAMP>(u[i]);
    unsigned w[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if constexpr (F::max_finite == 127.0f) {  // INT8
            w[h] = (unsigned)to_int8_rn(v[4 * h]) | ((unsigned)to_int8_rn(v[4 * h + 1]) << 8) |
                   ((unsigned)to_int8_rn(v[4 * h + 2]) << 16) | ((unsigned)to_int8_rn(v[4 * h + 3]) << 24);
        } else {
            w[h] = (unsigned)to_fp8x2<F>(v[4 * h], v[4 * h + 1]) | ((unsigned)to_fp8x2<F>(v[4 * h + 2], v[4 * h + 3]) << 16);
        }
    }
    return make_uint2(w[0], w[1]);
}

// Eight elements quantized with scale s: x / s by div_by with r = 1 / s, or by div_rn where div_by
// is not safe (one branch around all eight: a branch per element cost five instructions of divergence
// bookkeeping each, even on the fast path), then pack8.
template <class F, int CLAMP>
__device__ __forceinline__ uint2 quant8(const float* f, float s, float r, bool exact_div) {
    float v[8];
    if (exact_div) {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = div_rn(f[i], s);
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = div_by(f[i], s, r);
    }
    return pack8<F, CLAMP>(v);
}

template <bool VEC> __device__ __forceinline__ void store16w(unsigned char* __restrict__ q, uint2 a, uint2 b) {
    if constexpr (VEC) {
        st16(q, make_uint4(a.x, a.y, b.x, b.y));
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = (unsigned char)(((i < 4 ? a.x : a.y) >> (8 * (i & 3))) & 0xffu);
#pragma unroll
        for (int i = 0; i < 8; ++i) q[8 + i] = (unsigned char)(((i < 4 ? b.x : b.y) >> (8 * (i & 3))) & 0xffu);
    }
}

template <bool VEC> __device__ __forceinline__ void store8w(unsigned char* __restrict__ q, uint2 w) {
    if constexpr (VEC) {
        *reinterpret_cast<uint2*>(q) = w;
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = (unsigned char)(((i < 4 ? w.x : w.y) >> (8 * (i & 3))) & 0xffu);
    }
}

// amax / qmax: div_by with the constant RN(1 / qmax) for finite amax (amax >= 1e-10 in the group
// kernel, and below FLT_MIN the fused kernel's result is replaced by its minimum scale anyway).
template <class F> __device__ __forceinline__ float scale_of(float amax) {
    constexpr float r = 1.0f / F::max_finite;  // folded at compile time, correctly rounded
    return is_finite_bits(__float_as_uint(amax)) ? div_by(amax, F::max_finite, r) : div_rn(amax, F::max_finite);
}

// Whether x / s must use the IEEE division: with scale_ub a quotient can overflow (and x can be
// inf while s is finite); a non-finite s gives div_by nothing to work with.
__device__ __forceinline__ bool needs_exact_div(const ScaleArgs& a, float s) {
    return a.has_ub || !is_finite_bits(__float_as_uint(s));
}

// ---------------------------------------------------------------- per-token quantization (any K)
template <class F> struct TokenRule {  // vLLM dynamic_per_token_scaled_fp8_quant
    static constexpr int CLAMP = CLAMP_HI;
    __device__ static float scale(float amax) {
        return fmax_ieee(div_rn(amax, F::max_finite), 1.0f / (F::max_finite * 512.0f));
    }
    __device__ static float inv(float, float s) { return div_rn(1.0f, s); }  // quantize by x / s
};
template <> struct TokenRule<I8> {  // vLLM dynamic_scaled_int8_quant
    static constexpr int CLAMP = CLAMP_NONE;
    __device__ static float scale(float amax) { return div_rn(amax, 127.0f); }
    // amax >= 0; compared on its bits, because -ftz would make a subnormal amax compare equal to 0
    __device__ static float inv(float amax, float) {
        return __float_as_uint(amax) == 0u ? 0.0f : div_rn(127.0f, amax);
    }
};

// Eight elements of a token: FP8 and pow2 INT8 as x / s; vLLM's INT8 multiplies by 127 / amax.
template <class F>
__device__ __forceinline__ uint2 token_quant8(const float* f, float s, float inv, bool pow2, bool exact_div) {
    if constexpr (F::max_finite == 127.0f) {
        if (!pow2) {
            float v[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = mul_rn(f[i], inv);
            return pack8<F, CLAMP_NONE>(v);
        }
        return quant8<F, CLAMP_NONE>(f, s, div_rn(1.0f, s), exact_div);
    }
    return quant8<F, CLAMP_HI>(f, s, inv, exact_div);
}

static constexpr int TOKEN_REG_BYTES = 128;  // row bytes a lane keeps in registers (32 registers)

// The scale of a token from its amax (after scale_ub), stored by the caller; sets inv for token_quant8.
template <class F> __device__ __forceinline__ float token_scale(const ScaleArgs& sa, float amax, float& inv) {
    if (sa.has_ub) amax = fmin_ieee(amax, load_ub(sa));
    float s = TokenRule<F>::scale(amax);
    if (sa.pow2) s = pow2_ceil(s);
    inv = TokenRule<F>::inv(amax, s);
    return s;
}

// The same scale and inv as token_scale, with scale_ub given (ub, loaded ahead of the reduction,
// off the row's chain) and shorter divisions (rms_norm_quantize_lead, token_quantize_few): FP8
// amax / qmax by scale_of (div_by where amax is finite; below about 2^-100, where div_by may differ
// in the last place, the quotient is far under the minimum scale that replaces it), 1 / s by
// rcp_rn. INT8 as TokenRule<I8>.
template <class F> __device__ __forceinline__ float token_scale_lead(const ScaleArgs& sa, float ub, float amax, float& inv) {
    if (sa.has_ub) amax = fmin_ieee(amax, ub);
    float s;
    if constexpr (F::max_finite == 127.0f) s = TokenRule<F>::scale(amax);
    else s = fmax_ieee(scale_of<F>(amax), 1.0f / (F::max_finite * 512.0f));
    if (sa.pow2) s = pow2_ceil(s);
    if constexpr (F::max_finite == 127.0f) inv = TokenRule<F>::inv(amax, s);
    else inv = rcp_rn(s);
    return s;
}

// A team of WARPS warps per row (token_quantize_regs, rms_norm_quantize): 32 * WARPS threads, blocks of
// at least 256 threads, ROWS rows per block.
template <int WARPS> struct TokenTeam {
    static constexpr int THREADS = 32 * WARPS;
    static constexpr int BLOCK = THREADS > 256 ? THREADS : 256;
    static constexpr int ROWS = BLOCK / THREADS;
};

// Max of v over the team (every thread of the block takes part; each gets its team's max): a warp
// shuffle reduction, then one exchange through shared memory across the team's warps.
template <int WARPS> __device__ __forceinline__ unsigned team_max(unsigned v) {
    v = warp_max(v);
    if constexpr (WARPS > 1) {
        __shared__ unsigned warp_vals[TokenTeam<WARPS>::BLOCK / 32];
        if ((threadIdx.x & 31) == 0) warp_vals[threadIdx.x >> 5] = v;
        __syncthreads();
        const unsigned* team = warp_vals + (threadIdx.x / TokenTeam<WARPS>::THREADS) * WARPS;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) v = max(v, team[w]);
    }
    return v;
}

// team_max of two values at once (one exchange through shared memory for both; two team_max calls
// would share one buffer between them). team_max2<TOKEN_BLOCK / 32> is the max over a whole block.
template <int WARPS> __device__ __forceinline__ void team_max2(unsigned& a, unsigned& b) {
    a = warp_max(a);
    b = warp_max(b);
    if constexpr (WARPS > 1) {
        __shared__ uint2 warp_pairs[TokenTeam<WARPS>::BLOCK / 32];
        if ((threadIdx.x & 31) == 0) warp_pairs[threadIdx.x >> 5] = make_uint2(a, b);
        __syncthreads();
        const uint2* team = warp_pairs + (threadIdx.x / TokenTeam<WARPS>::THREADS) * WARPS;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            a = max(a, team[w].x);
            b = max(b, team[w].y);
        }
    }
}
