// groupwise.cu: per-token and per-group FP8/INT8 quantization (vLLM's activation path), the fused
// SiLU(gate) * up + group quantization, and their dequantizer.
//
// What it computes (reference: cupyquant.reference.quantize_groupwise / silu_mul_quantize /
// dequantize_groupwise, which these kernels match bit for bit; every float step is IEEE float32):
//   group_quantize   vLLM per_token_group_quant_8bit: amax = max(1e-10, max|x|) over G elements
//                    (NaN ignored), optionally min(amax, scale_ub); s = amax / qmax; optionally
//                    s = pow2_ceil(s); q = cvt(fminf(fmaxf(x / s, qmin), qmax)). FP8 rounds to nearest
//                    even; INT8 rounds half to even (vLLM truncates: the one deliberate difference).
//   token_quantize   one scale per row, any K. FP8: vLLM dynamic_per_token_scaled_fp8_quant:
//                    amax = max|x| (min(amax, scale_ub)); s = fmaxf(amax / qmax, 1 / (qmax * 512));
//                    q = cvt(fmaxf(-qmax, fminf(x / s, qmax))). INT8: vLLM dynamic_scaled_int8_quant:
//                    s = amax / 127, q = cvt.rni.sat.s8(x * (amax == 0 ? 0 : 127 / amax)). With pow2,
//                    both use s = pow2_ceil(s) and q = x / s.
//   silu_mul_quantize vLLM silu_and_mul_per_block_quant: r = (gate * (1 / (1 + expf(-gate)))) * up in
//                    float32 registers (gate = x[..., :H], up = x[..., H:]); amax = max|r|;
//                    s = amax / qmax, min(s, scale_ub), fmaxf(s, min_scale) with min_scale
//                    1 / (qmax * 512) for FP8 and FLT_EPSILON for INT8; q = cvt(clamp(r / s)).
//   group_dequantize y = round_rn(float(q) * s) for the scale of q's group.
// pow2_ceil(s): s' = fmaxf(|s|, 1e-10); e = exponent_field(s') + (mantissa(s') != 0); 2^(e - 127),
// the UE8M0 exponent byte being e (vLLM's and DeepGEMM's bit rule).
//
// Layout. x is (rows, K) with a row stride (leading dimensions flattened); q is contiguous. Rows are
// (batch b, token m) with m < M. Scales are 4-byte words: float32, or four UE8M0 bytes packed in an
// int32 (byte j of word p holds group 4p + j). The word of (b, m, group g) is
// b * sb + m * sm + (g or g / 4) * sg: "row" layout sm = NGX, sg = 1; "col" layout (DeepGEMM's
// TMA-aligned MN-major) sm = 1, sg = M_pad = round_up(M, 4), sb = NGX * M_pad; the host side builds
// these strides. Padding (rows M..M_pad of "col", unused bytes of the last packed word) is written 0.
//
// Threads. Per-group kernels give each thread 16 consecutive elements (16-byte loads, one 16-byte
// store); a group's G / 16 threads are consecutive lanes of one warp and reduce with xor shuffles.
// The per-token kernel gives each row a team of one or more warps that holds the row in registers
// (token_quantize_regs). VEC = false is the scalar path for rows that are not 16-byte aligned.

#include "common.cuh"

using namespace cq;

// ---------------------------------------------------------------- element formats
template <class F> struct QRange {  // vLLM's clamp bounds
    static constexpr float lo = -F::max_finite, hi = F::max_finite;
};
template <> struct QRange<I8> {
    static constexpr float lo = -128.0f, hi = 127.0f;
};

// Round half to even with saturation to [-128, 127]; NaN gives 0 (cvt.rni.sat.s8.f32).
__device__ __forceinline__ unsigned char to_int8_rn(float v) {
    int r;
    asm("cvt.rni.sat.s8.f32 %0, %1;" : "=r"(r) : "f"(v));
    return (unsigned char)(r & 0xff);
}

template <class F> __device__ __forceinline__ float from_q(unsigned char b) { return fp8_to_float<F>(b); }
template <> __device__ __forceinline__ float from_q<I8>(unsigned char b) { return (float)(signed char)b; }

// ---------------------------------------------------------------- scales
__device__ __forceinline__ unsigned ue8m0_of(float s) {  // the exponent byte of pow2_ceil(s)
    const unsigned b = __float_as_uint(fmax_ieee(__uint_as_float(__float_as_uint(s) & 0x7fffffffu), 1e-10f));
    return ((b >> 23) & 0xffu) + ((b & 0x7fffffu) != 0u);
}
__device__ __forceinline__ float pow2_ceil(float s) { return __uint_as_float(ue8m0_of(s) << 23); }

// Runtime parameters shared by the quantizers: where scales go and how they are made. Passed by value
// from a NumPy structured scalar with the same fields (cupyquant.groupwise._SCALE_ARGS, align=True).
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

// ---------------------------------------------------------------- per-group quantization
// The end of a per-group thread: its 16 elements quantized with the group's scale s and stored; the
// group's first lane stores s.
template <class F, int CLAMP, bool VEC>
__device__ __forceinline__ void finish_group16(unsigned char* __restrict__ q16, const float* f, float s,
                                               const ScaleArgs& sa, i64 row, int u, int tpg) {
    const float r = rcp_rn(s);
    const bool exact = needs_exact_div(sa, s);
    store16w<VEC>(q16, quant8<F, CLAMP>(f, s, r, exact), quant8<F, CLAMP>(f + 8, s, r, exact));
    if ((u & (tpg - 1)) == 0) store_scale(sa, row, u >> (31 - __clz(tpg)), s);  // tpg: a power of two
}

// Each thread takes 16 consecutive elements (two 16-byte loads of a 16-bit type, four of float32;
// one 16-byte store), so a group of G is G / 16 consecutive lanes. Grid: blockDim (bx, by), bx * by =
// 256, bx a power of two that divides K / 16 (so a multiple of G / 16); blockIdx.x covers rows by by,
// blockIdx.y a row's 16-element units by bx. No division by a run-time value on the hot path.
// (8 elements per thread: 286 us at 16384 x 16384 bf16 on H200, the per-thread work of the scale
// computed for too few elements.)
template <typename T, class F, bool VEC>
__global__ void __launch_bounds__(256)
group_quantize(const T* __restrict__ x, i64 x_row_stride, unsigned char* __restrict__ q, i64 rows, int K,
               int group_size, ScaleArgs sa, unsigned* __restrict__ words) {
    sa.words = words;
    const int tpg = group_size >> 4;
    const i64 row = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    const int u = blockIdx.y * blockDim.x + threadIdx.x;
    const bool valid = row < rows;
    float f[16];
    if (valid) {
        const T* p = x + row * x_row_stride + u * 16;
        load8<T, VEC>(p, f);
        load8<T, VEC>(p + 8, f + 8);
    } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) f[i] = 0.0f;
    }
    const unsigned m = group_absmax16(f, tpg);  // every lane takes part, valid or not
    if (!valid) return;
    float amax = fmax_ieee(__uint_as_float(m), 1e-10f);
    if (sa.has_ub) amax = fmin_ieee(amax, load_ub(sa));
    float s = scale_of<F>(amax);
    if (sa.pow2) s = pow2_ceil(s);
    finish_group16<F, CLAMP_LO, VEC>(q + row * (i64)K + u * 16, f, s, sa, row, u, tpg);
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

// A team of WARPS warps per row, the row held in registers: lane t of the team keeps the 8-element
// units t, t + 32 * WARPS, ... (UNITS of them at most, 128 bytes), so a row of up to
// 8 * UNITS * 32 * WARPS elements (2048 * WARPS of a 16-bit type, 1024 * WARPS of float32) is read
// once. The block holds 256 / (32 * WARPS) rows (one row of 32 * WARPS threads for WARPS > 8); the
// row max is a warp shuffle reduction, plus one exchange through shared memory across a team's
// warps. The host picks WARPS (cupyquant.groupwise._token_team): for many rows the fewest that
// hold a row, for few rows up to 8, so that short rows do not leave a block of threads idling on a
// reduction. Rows must be 16-byte aligned with K % 8 == 0 (the host checks).
template <int WARPS> struct TokenTeam {
    static constexpr int THREADS = 32 * WARPS;
    static constexpr int BLOCK = THREADS > 256 ? THREADS : 256;
    static constexpr int ROWS = BLOCK / THREADS;
};

template <typename T, class F, int WARPS>
__global__ void __launch_bounds__(TokenTeam<WARPS>::BLOCK, 1024 / TokenTeam<WARPS>::BLOCK)
token_quantize_regs(const T* __restrict__ x, i64 x_row_stride, unsigned char* __restrict__ q, i64 rows, int K,
                    ScaleArgs sa, unsigned* __restrict__ words) {
    sa.words = words;
    using Team = TokenTeam<WARPS>;
    constexpr int LOADS = sizeof(T) == 4 ? 2 : 1;              // 16-byte loads per 8-element unit
    constexpr int UNITS = TOKEN_REG_BYTES / (16 * LOADS);
    const int t = threadIdx.x % Team::THREADS;                 // lane within the team
    const i64 row = (i64)blockIdx.x * Team::ROWS + threadIdx.x / Team::THREADS;
    const bool valid = row < rows;
    const T* xr = x + (valid ? row : 0) * x_row_stride;
    uint4 raw[UNITS][LOADS];
    unsigned m = 0;
#pragma unroll
    for (int v = 0; v < UNITS; ++v) {
        const int c = (v * Team::THREADS + t) * 8;
#pragma unroll
        for (int l = 0; l < LOADS; ++l) {
            raw[v][l] = valid && c < K ? ld16(xr + c + l * 4) : make_uint4(0u, 0u, 0u, 0u);
            m = max(m, absmax16<T>(raw[v][l]));
        }
    }
    m = warp_max(m);
    if constexpr (WARPS > 1) {
        __shared__ unsigned warp_vals[Team::BLOCK / 32];
        if ((threadIdx.x & 31) == 0) warp_vals[threadIdx.x >> 5] = m;
        __syncthreads();
        const unsigned* team = warp_vals + (threadIdx.x / Team::THREADS) * WARPS;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) m = max(m, team[w]);
    }
    if (!valid) return;
    float inv;
    const float s = token_scale<F>(sa, __uint_as_float(m), inv);
    const bool pow2 = sa.pow2 != 0;
    const bool exact_div = needs_exact_div(sa, s);
    unsigned char* qr = q + row * (i64)K;
#pragma unroll
    for (int v = 0; v < UNITS; ++v) {
        const int c = (v * Team::THREADS + t) * 8;
        if (c < K) {
            float f[8];
#pragma unroll
            for (int l = 0; l < LOADS; ++l) unpack16<T>(raw[v][l], f + l * 4);
            store8w<true>(qr + c, token_quant8<F>(f, s, inv, pow2, exact_div));
        }
    }
    if (t == 0) store_scale(sa, row, 0, s);
}

static constexpr int TOKEN_BLOCK = 256;

// Any K and any alignment (VEC = false: element loads; VEC = true: 16-byte loads, rows too long for
// token_quantize_regs): one block per row, two passes over the row (the second from L2).
template <typename T, class F, bool VEC>
__global__ void __launch_bounds__(TOKEN_BLOCK)
token_quantize(const T* __restrict__ x, i64 x_row_stride, unsigned char* __restrict__ q, int K, ScaleArgs sa,
               unsigned* __restrict__ words) {
    sa.words = words;
    const i64 row = blockIdx.x;
    const T* xr = x + row * x_row_stride;
    unsigned char* qr = q + row * (i64)K;
    const int step = VEC ? 8 : 1;
    unsigned m = 0;
    for (int c = threadIdx.x * step; c < K; c += TOKEN_BLOCK * step) {
        if constexpr (VEC) {
            float g[8];
            load8<T, true>(xr + c, g);
#pragma unroll
            for (int i = 0; i < 8; ++i) m = max(m, abs_key(g[i]));
        } else {
            m = max(m, abs_key(to_float(xr[c])));
        }
    }
    __shared__ float amax_s;
    m = block_max<TOKEN_BLOCK>(m);
    if (threadIdx.x == 0) amax_s = __uint_as_float(m);
    __syncthreads();
    float inv;
    const float s = token_scale<F>(sa, amax_s, inv);
    const bool pow2 = sa.pow2 != 0;
    const bool exact_div = needs_exact_div(sa, s);
    for (int c = threadIdx.x * step; c < K; c += TOKEN_BLOCK * step) {
        if constexpr (VEC) {
            float g[8];
            load8<T, true>(xr + c, g);
            store8w<true>(qr + c, token_quant8<F>(g, s, inv, pow2, exact_div));
        } else {
            float g[8] = {to_float(xr[c])};
            qr[c] = (unsigned char)(token_quant8<F>(g, s, inv, pow2, exact_div).x & 0xffu);
        }
    }
    if (threadIdx.x == 0) store_scale(sa, row, 0, s);
}

// ---------------------------------------------------------------- fused SiLU(gate) * up + group quantization
// The one definition of the intermediate, shared by the fused kernel and the test kernel below:
// e = expf(-gate) (CUDA's expf, within 2 ulp), then IEEE steps only.
__device__ __forceinline__ float silu_mul_from_exp(float gate, float up, float e) {
    const float sigmoid = rcp_rn(add_rn(1.0f, e));  // == 1.0f / (1.0f + e), correctly rounded
    return mul_rn(mul_rn(gate, sigmoid), up);
}
__device__ __forceinline__ float silu_mul(float gate, float up) { return silu_mul_from_exp(gate, up, expf(-gate)); }

template <class F> struct SiluRule {
    static constexpr int CLAMP = CLAMP_HI;
    __device__ static float min_scale() { return 1.0f / (F::max_finite * 512.0f); }
};
template <> struct SiluRule<I8> {
    static constexpr int CLAMP = CLAMP_NONE;
    __device__ static float min_scale() { return 1.1920928955078125e-07f; }  // FLT_EPSILON
};

// Grid as group_quantize (16 outputs per thread), over the H output columns.
template <typename T, class F, bool VEC>
__global__ void __launch_bounds__(256)
silu_mul_quantize(const T* __restrict__ x, i64 x_row_stride, unsigned char* __restrict__ q, i64 rows, int H,
                  int group_size, ScaleArgs sa, unsigned* __restrict__ words) {
    sa.words = words;
    const int tpg = group_size >> 4;
    const i64 row = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    const int u = blockIdx.y * blockDim.x + threadIdx.x;
    const bool valid = row < rows;
    float r[16];
    if (valid) {
        const T* p = x + row * x_row_stride + u * 16;
        float up[16];
        load8<T, VEC>(p, r);
        load8<T, VEC>(p + 8, r + 8);
        load8<T, VEC>(p + H, up);
        load8<T, VEC>(p + H + 8, up + 8);
#pragma unroll
        for (int i = 0; i < 16; ++i) r[i] = silu_mul(r[i], up[i]);
    } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) r[i] = 0.0f;
    }
    const unsigned m = group_absmax16(r, tpg);
    if (!valid) return;
    float s = scale_of<F>(__uint_as_float(m));
    if (sa.has_ub) s = fmin_ieee(s, load_ub(sa));
    s = fmax_ieee(s, SiluRule<F>::min_scale());
    finish_group16<F, SiluRule<F>::CLAMP, VEC>(q + row * (i64)H + u * 16, r, s, sa, row, u, tpg);
}

// Test only: the float32 intermediate r the fused kernel quantizes and the expf(-gate) it came from.
template <typename T>
__global__ void silu_mul_intermediate(const T* __restrict__ x, i64 x_row_stride, float* __restrict__ r,
                                      float* __restrict__ e, i64 rows, int H) {
    const i64 n = rows * H;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 row = i / H, c = i - row * H;
        const float gate = to_float(x[row * x_row_stride + c]);
        const float up = to_float(x[row * x_row_stride + H + c]);
        r[i] = silu_mul(gate, up);
        e[i] = expf(-gate);
    }
}

// ---------------------------------------------------------------- dequantization
// y = round(float(q) * s) for the scale s of q's group. VEC (K a multiple of 8, q 8-byte and y 16-byte
// aligned): a 2-D grid as the quantizers', each thread 8 elements (one 8-byte load, 16 or 32 bytes
// stored), the group index a shift (g_shift = log2 G; 31 for one scale per row) and the (batch,
// token) split a magic multiply. (A flat grid with 64-bit divisions per thread: 78% of copy at
// 16384 x 16384.) Otherwise a flat grid-stride loop of single elements.
__device__ __forceinline__ float load_scale(const ScaleArgs& a, i64 row, int g) {
    i64 b = 0, m = row;
    if (a.col) split_row(a, row, b, m);
    if (a.packed) {
        const unsigned w = __ldg(a.words + b * a.sb + m * a.sm + (i64)(g >> 2) * a.sg);
        return e8m0_to_float((w >> (8 * (g & 3))) & 0xffu);
    }
    return __uint_as_float(__ldg(a.words + b * a.sb + m * a.sm + (i64)g * a.sg));
}

template <typename OutT, class F, bool VEC>
__global__ void __launch_bounds__(256)
group_dequantize(const unsigned char* __restrict__ q, OutT* __restrict__ y, i64 rows, int K, int g_shift,
                 ScaleArgs sa, unsigned* __restrict__ words) {
    sa.words = words;
    if constexpr (VEC) {
        const i64 row = (i64)blockIdx.x * blockDim.y + threadIdx.y;
        if (row >= rows) return;
        const int c = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
        const float s = load_scale(sa, row, c >> g_shift);
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(q + row * (i64)K + c));
        float f[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = mul_rn(from_q<F>((unsigned char)(((i < 4 ? v.x : v.y) >> (8 * (i & 3))) & 0xffu)), s);
        OutT* yp = y + row * (i64)K + c;
        if constexpr (sizeof(OutT) == 4) {
            st16(yp, pack16<OutT>(f));
            st16(yp + 4, pack16<OutT>(f + 4));
        } else {
            st16(yp, pack16<OutT>(f));
        }
    } else {
        const i64 n = rows * K;
        for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
            const i64 row = i / K;
            const int c = (int)(i - row * K);
            y[i] = from_float<OutT>(mul_rn(from_q<F>(q[i]), load_scale(sa, row, c >> g_shift)));
        }
    }
}
