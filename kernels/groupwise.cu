// groupwise.cu: per-token and per-group FP8/INT8 quantization (vLLM's activation path), the fused
// SiLU(gate) * up + group quantization, asymmetric per-token INT8 (zero points), and their dequantizers.
//
// What it computes (reference: cupyquant.reference.quantize_groupwise / silu_mul_quantize /
// dequantize_groupwise, which these kernels match bit for bit; every float step is IEEE float32; the
// INT8 conversions to_int8_rn, to_int32_rn, int32_to_int8 are those of int8.cuh):
//   group_quantize   vLLM per_token_group_quant_8bit: amax = max(1e-10, max|x|) over G elements
//                    (NaN ignored), optionally min(amax, scale_ub); s = amax / qmax; optionally
//                    s = pow2_ceil(s); q = cvt(fminf(fmaxf(x / s, qmin), qmax)). FP8 rounds to nearest
//                    even; INT8 rounds half to even (vLLM truncates: the one deliberate difference).
//   token_quantize   one scale per row, any K. FP8: vLLM dynamic_per_token_scaled_fp8_quant:
//                    amax = max|x| (min(amax, scale_ub)); s = fmaxf(amax / qmax, 1 / (qmax * 512));
//                    q = cvt(fmaxf(-qmax, fminf(x / s, qmax))). INT8: vLLM dynamic_scaled_int8_quant:
//                    s = amax / 127, q = cvt.rni.sat.s8(x * (amax == 0 ? 0 : 127 / amax)). With pow2,
//                    both use s = pow2_ceil(s) and q = x / s.
//   token_quantize_azp asymmetric INT8 per row (zero points), vLLM dynamic_scaled_int8_azp_quant:
//                    lo, hi = min, max of the row (NaN ignored); s = (hi - lo) / 255;
//                    z = to_int32_rn(-128 - lo / s); q = int32_to_int8(to_int32_rn(x * (1 / s)) + z);
//                    where s is 0 (a flat row) s = max(|lo|, |hi|), z = 0, q = rne_sat(x / s) (AzpRow).
//   silu_mul_quantize vLLM silu_and_mul_per_block_quant: r = (gate * (1 / (1 + expf(-gate)))) * up in
//                    float32 registers (gate = x[..., :H], up = x[..., H:]); amax = max|r|;
//                    s = amax / qmax, min(s, scale_ub), fmaxf(s, min_scale) with min_scale
//                    1 / (qmax * 512) for FP8 and FLT_EPSILON for INT8; q = cvt(clamp(r / s)).
//   group_dequantize y = round_rn(float(q) * s) for the scale of q's group (group_dequantize_flat:
//                    the same, in the flat geometry of flat_dequant.cuh).
//   token_dequantize_azp y = round_rn(float32(q - z) * s), q - z exact (64-bit), for the row's s and z.
// pow2_ceil(s): s' = fmaxf(|s|, 1e-10); e = exponent_field(s') + (mantissa(s') != 0); 2^(e - 127),
// the UE8M0 exponent byte being e (vLLM's and DeepGEMM's bit rule).
//
// Layout. x is (rows, K) with a row stride (leading dimensions flattened); q is contiguous. Rows are
// (batch b, token m) with m < M. Scales are 4-byte words: float32, or four UE8M0 bytes packed in an
// int32 (byte j of word p holds group 4p + j). The word of (b, m, group g) is
// b * sb + m * sm + (g or g / 4) * sg: "row" layout sm = NGX, sg = 1; "col" layout (DeepGEMM's
// TMA-aligned MN-major) sm = 1, sg = M_pad = round_up(M, 4), sb = NGX * M_pad; the host side builds
// these strides. Padding (rows M..M_pad of "col", unused bytes of the last packed word) is written 0.
// Zero points (int32) use the words of the scales' layout in an array of their own.
//
// Threads. Per-group kernels give each thread 16 consecutive elements (16-byte loads, one 16-byte
// store); a group's G / 16 threads are consecutive lanes of one warp and reduce with xor shuffles.
// The per-token kernels give each row a team of one or more warps that holds the row in registers
// (token_quantize_regs, many rows), or a block per row with all of the row's loads in one round
// (token_quantize_few, few rows). VEC = false (vec = 0) is the scalar path for rows that are not
// 16-byte aligned.
// PDL: each kernel calls pdl_wait_then_release() (common.cuh) once in every thread, before its first
// global load or store, so that the wrappers may launch it with programmatic dependent launch.

#include "groupwise.cuh"
#include "flat_dequant.cuh"

// ---------------------------------------------------------------- per-group quantization
// A thread's 16 elements quantized with the group's scale s and stored.
template <class F, int CLAMP, bool VEC>
__device__ __forceinline__ void quant_store16(unsigned char* __restrict__ q16, const float* f, float s,
                                              const ScaleArgs& sa) {
    const float r = rcp_rn(s);
    const bool exact = needs_exact_div(sa, s);
    store16w<VEC>(q16, quant8<F, CLAMP>(f, s, r, exact), quant8<F, CLAMP>(f + 8, s, r, exact));
}

// A per-group thread's 16 elements from p, or zeros where the thread has no row (valid false: it
// still takes part in its group's shuffles).
template <typename T, bool VEC> __device__ __forceinline__ void load16_or_zeros(const T* p, bool valid, float* f) {
    if (valid) {
        load8<T, VEC>(p, f);
        load8<T, VEC>(p + 8, f + 8);
    } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) f[i] = 0.0f;
    }
}

// UE8M0 scales of a warp that holds 32 whole units of one row (blockDim.x a multiple of 32) in groups
// of tpg <= 8 units, so that each 4 tpg lanes are the four groups of one packed word: every lane
// turns its s into its byte, the word's first lane gathers the other three by shuffles and stores
// the word, and (for "col" scales, on the batch's last token) its lanes 1..3 zero the word's padding
// rows M..M_pad - 1. One 4-byte store a word and no loop, where store_scale stores each group's byte
// and loops over the padding (group-128 "col" at one row of 4096, bf16 on an H200: 1.61 us through
// store_scale).
__device__ __forceinline__ void store_packed_scales_warp(const ScaleArgs& a, i64 row, int u, int tpg, float s) {
    const unsigned e = ue8m0_of(s);
    const unsigned word = e | (__shfl_down_sync(0xffffffffu, e, tpg) << 8) | (__shfl_down_sync(0xffffffffu, e, 2 * tpg) << 16) |
                          (__shfl_down_sync(0xffffffffu, e, 3 * tpg) << 24);
    const int q = u & (4 * tpg - 1);  // this lane within its word's 4 tpg (u and the lane agree mod 32)
    if (q > 3) return;
    i64 b = 0, m = row;
    if (a.col) split_row(a, row, b, m);
    const i64 pw = (i64)((u - q) >> (33 - __clz(tpg)));  // the packed word of the row: group / 4
    if (q == 0) a.words[b * a.sb + m * a.sm + pw * a.sg] = word;
    else if (a.col && m == a.M - 1 && m + q < a.M_pad) a.words[b * a.sb + (m + q) * a.sm + pw * a.sg] = 0u;
}

// After the PDL wait, a per-group thread's 16 elements of (row, unit u) into f (zeros where not
// valid) and its group's max |x| key, every lane of the warp taking part in the shuffles.
template <typename T, bool VEC>
__device__ __forceinline__ unsigned load_group16(const T* __restrict__ x, i64 x_row_stride, i64 row, int u, bool valid, int tpg,
                                                 float* f) {
    pdl_wait_then_release();  // no global access above this line
    load16_or_zeros<T, VEC>(x + row * x_row_stride + u * 16, valid, f);
    return group_absmax16(f, tpg);
}

// The end of a per-group thread: its 16 elements quantized and stored; the group's first lane stores s.
// PACKED (UE8M0 scales, sa.packed): whole warps store theirs by store_packed_scales_warp, every lane
// of the warp taking part. Compiled apart: the run-time test in the float32 build made group_quantize
// 1.5-2% slower from 1024 rows up (bf16, H200).
template <class F, int CLAMP, bool VEC, bool PACKED = false>
__device__ __forceinline__ void finish_group16(unsigned char* __restrict__ q16, const float* f, float s,
                                               const ScaleArgs& sa, i64 row, int u, int tpg) {
    quant_store16<F, CLAMP, VEC>(q16, f, s, sa);
    if (PACKED && tpg <= 8 && (blockDim.x & 31) == 0) store_packed_scales_warp(sa, row, u, tpg, s);  // uniform in a block
    else if ((u & (tpg - 1)) == 0) store_scale(sa, row, u >> (31 - __clz(tpg)), s);  // tpg: a power of two
}

// vLLM's group scale from the group's max |x| key m: amax = max(1e-10, m), min(amax, scale_ub),
// amax / qmax, pow2_ceil.
template <class F> __device__ __forceinline__ float group_scale(const ScaleArgs& sa, unsigned m) {
    float amax = fmax_ieee(__uint_as_float(m), 1e-10f);
    if (sa.has_ub) amax = fmin_ieee(amax, load_ub(sa));
    float s = scale_of<F>(amax);
    if (sa.pow2) s = pow2_ceil(s);
    return s;
}

// Each thread takes 16 consecutive elements (two 16-byte loads of a 16-bit type, four of float32;
// one 16-byte store), so a group of G is G / 16 consecutive lanes. Grid: blockDim (bx, by), bx * by =
// 256, bx a power of two that divides K / 16 (so a multiple of G / 16); blockIdx.x covers rows by by,
// blockIdx.y a row's 16-element units by bx. No division by a run-time value on the hot path.
// (8 elements per thread: 286 us at 16384 x 16384 bf16 on H200, the per-thread work of the scale
// computed for too few elements.) PACKED: UE8M0 scales (finish_group16).
template <typename T, class F, bool VEC, bool PACKED>
__global__ void __launch_bounds__(256)
group_quantize(const T* __restrict__ x, i64 x_row_stride, unsigned char* __restrict__ q, i64 rows, int K,
               int group_size, ScaleArgs sa, unsigned* __restrict__ words) {
    sa.words = words;
    const int tpg = group_size >> 4;
    const i64 row = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    const int u = blockIdx.y * blockDim.x + threadIdx.x;
    const bool valid = row < rows;
    float f[16];
    const unsigned m = load_group16<T, VEC>(x, x_row_stride, row, u, valid, tpg, f);
    if (!valid) return;
    finish_group16<F, CLAMP_LO, VEC, PACKED>(q + row * (i64)K + u * 16, f, group_scale<F>(sa, m), sa, row, u, tpg);
}

// The "col" scale of (row, group g) from a group's first lane of group_quantize_tall: float32 words, or
// (PACKED) UE8M0 bytes packed four a word; compiled for that layout alone, with 32-bit word offsets
// (the host takes the kernel where rows and the scale buffer's words are below 2^31). The (batch,
// token) split is split_row's multiply, the word b * sb + m + (g or g / 4) * M_pad; the padding (rows
// M..M_pad of the column after a batch's last token; the unused bytes after a row's last packed
// group) is store_scale's, on a branch of its own. About 15 instructions a warp against about 70 for
// store_scale's "col" path, whose uniform layout tests, 64-bit offsets and branch around the 64-bit
// division (rows from 2^31) run after the codes (sm_90 SASS; the "row" float32 path: about 16).
template <bool PACKED>
__device__ __forceinline__ void store_col_scale(const ScaleArgs& a, unsigned row, int g, float s) {
    const unsigned b = (unsigned)(((unsigned long long)row * (unsigned)a.m_magic) >> a.m_shift);  // m_magic < 2^32
    const unsigned m = row - b * (unsigned)a.M;
    const unsigned w = b * (unsigned)a.sb + m + (PACKED ? (unsigned)g >> 2 : (unsigned)g) * (unsigned)a.sg;
    if constexpr (PACKED) reinterpret_cast<unsigned char*>(a.words + w)[g & 3] = (unsigned char)ue8m0_of(s);
    else a.words[w] = __float_as_uint(s);
    if ((m == (unsigned)a.M - 1u && a.M_pad != a.M) || (PACKED && g == a.n_groups - 1 && (g & 3) != 3))
        store_scale(a, row, g, s);  // the same store again, then the padding
}

// group_quantize for "col" scales, its warps down the rows ("tall"): blockDim (tpg, by), one group of
// by rows a block; blockIdx.x the group, blockIdx.y the block of rows (so consecutive blocks take
// the consecutive groups of the same rows). A warp is then 32 / tpg consecutive rows of one group,
// and its scales one run of 32 / tpg words in the "col" layout (16 bytes at G = 128: one sector),
// where group_quantize's warp along a row stores 32 / tpg scales M_pad words apart, a sector each.
// The codes' loads and stores are the same per warp (a 32-byte piece of x a lane, 256 contiguous
// bytes of a row for each 8 lanes at G = 128), and so is the index arithmetic; the scales go
// through store_col_scale.
template <typename T, class F, bool VEC, bool PACKED>
__global__ void __launch_bounds__(256)
group_quantize_tall(const T* __restrict__ x, i64 x_row_stride, unsigned char* __restrict__ q, i64 rows, int K,
                    int group_size, ScaleArgs sa, unsigned* __restrict__ words) {
    sa.words = words;
    const int tpg = group_size >> 4;
    const i64 row = (i64)blockIdx.y * blockDim.y + threadIdx.y;
    const int g = blockIdx.x;
    const int u = g * tpg + threadIdx.x;
    const bool valid = row < rows;
    float f[16];
    const unsigned m = load_group16<T, VEC>(x, x_row_stride, row, u, valid, tpg, f);
    if (!valid) return;
    const float s = group_scale<F>(sa, m);
    quant_store16<F, CLAMP_LO, VEC>(q + row * (i64)K + u * 16, f, s, sa);
    if (threadIdx.x == 0) store_col_scale<PACKED>(sa, (unsigned)row, g, s);
}

// A team of WARPS warps per row, the row held in registers: lane t of the team keeps the 8-element
// units t, t + 32 * WARPS, ... (UNITS of them at most, 128 bytes), so a row of up to
// 8 * UNITS * 32 * WARPS elements (2048 * WARPS of a 16-bit type, 1024 * WARPS of float32) is read
// once. The block holds 256 / (32 * WARPS) rows (one row of 32 * WARPS threads for WARPS > 8); the
// row max is a warp shuffle reduction, plus one exchange through shared memory across a team's
// warps. The host picks WARPS (cupyquant._group_plan._token_team): for many rows the fewest that
// hold a row, for few rows up to 8, so that short rows do not leave a block of threads idling on a
// reduction. Rows must be 16-byte aligned with K % 8 == 0 (the host checks).

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
    pdl_wait_then_release();  // no global access above this line
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
    m = team_max<WARPS>(m);
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

// A block per row, every thread holding U units of 8 elements (16 or 32 bytes of a 16-bit type), so
// that a row of up to 8 * U * 1024 elements is read in one round: the block (blockDim.x a multiple
// of 32, up to 1024) issues all of the row's loads before any arithmetic. The row's max is one
// redux.sync a warp, the warps' maxima through shared memory and one barrier, and one more redux;
// scale_ub is loaded while the row is in flight, and the scale and its reciprocal come once a
// thread from token_scale_lead (for FP8 and a finite amax, no IEEE division). No second pass over
// global memory. vec: 16-byte loads and 8-byte stores (rows 16-byte aligned, K % 8 == 0);
// otherwise single elements, zero past K, so that any K and any alignment can take it. The host
// picks it for few rows (cupyquant._group_plan._token_few), where a row's fixed chain of dependent
// steps, not its bytes, is the cost.
static constexpr int TOKEN_FEW_BLOCK_MAX = 1024;

// Max over the warp's lanes: one redux.sync (compute capability 8.0 and newer; shuffles before).
__device__ __forceinline__ unsigned warp_max_redux(unsigned v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned r;
    asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    return r;
#else
    return warp_max(v);
#endif
}

// Max of v over the block (blockDim.x a multiple of 32; every thread takes part and gets it).
__device__ __forceinline__ unsigned block_max_redux(unsigned v) {
    __shared__ unsigned warp_vals[TOKEN_FEW_BLOCK_MAX / 32];
    v = warp_max_redux(v);
    const int warps = blockDim.x >> 5;
    if (warps == 1) return v;
    const int lane = threadIdx.x & 31;
    if (lane == 0) warp_vals[threadIdx.x >> 5] = v;
    __syncthreads();
    return warp_max_redux(lane < warps ? warp_vals[lane] : 0u);
}

// A thread's U units of 8 elements as T's bits (LOADS 16-byte words a unit): unit v starts at
// element c0 + v * step of the row xr (xr points at element c0); elements at K and past read as 0.
// vec: 16-byte loads (K % 8 == 0, rows 16-byte aligned); otherwise single elements. Either way
// every load is issued before any result is used (the single elements are packed afterwards).
template <typename T, int U, int LOADS>
__device__ __forceinline__ void load_units(const T* __restrict__ xr, int c0, int step, int K, bool vec,
                                           uint4 (&w)[U][LOADS]) {
    if (vec) {
#pragma unroll
        for (int v = 0; v < U; ++v) {
            const bool in = c0 + v * step < K;
#pragma unroll
            for (int l = 0; l < LOADS; ++l) w[v][l] = in ? ld16(xr + v * step + l * 4) : make_uint4(0u, 0u, 0u, 0u);
        }
        return;
    }
    using Bits = typename cond_type<sizeof(T) == 4, unsigned, unsigned short>::type;
    constexpr int PER_WORD = 4 / sizeof(T);  // elements in a 32-bit word
    const Bits* b = reinterpret_cast<const Bits*>(xr);
    unsigned e[U][8];
#pragma unroll
    for (int v = 0; v < U; ++v)
#pragma unroll
        for (int i = 0; i < 8; ++i) e[v][i] = c0 + v * step + i < K ? (unsigned)__ldg(b + v * step + i) : 0u;
#pragma unroll
    for (int v = 0; v < U; ++v) {
        unsigned u[4 * LOADS] = {};
#pragma unroll
        for (int i = 0; i < 8; ++i) u[i / PER_WORD] |= e[v][i] << (8 * sizeof(T) * (i % PER_WORD));
#pragma unroll
        for (int l = 0; l < LOADS; ++l) w[v][l] = make_uint4(u[4 * l], u[4 * l + 1], u[4 * l + 2], u[4 * l + 3]);
    }
}

// The first n of the 8 bytes in w at q: vec, one 8-byte store (n >= 8).
__device__ __forceinline__ void store_unit_bytes(unsigned char* __restrict__ q, int n, uint2 w, bool vec) {
    if (vec) {
        *reinterpret_cast<uint2*>(q) = w;
        return;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i)
        if (i < n) q[i] = (unsigned char)(((i < 4 ? w.x : w.y) >> (8 * (i & 3))) & 0xffu);
}

template <typename T, class F, int U>
__global__ void __launch_bounds__(TOKEN_FEW_BLOCK_MAX)
token_quantize_few(const T* __restrict__ x, i64 x_row_stride, unsigned char* __restrict__ q, int K, int vec,
                   ScaleArgs sa, unsigned* __restrict__ words) {
    sa.words = words;
    constexpr int LOADS = sizeof(T) == 4 ? 2 : 1;  // 16-byte loads per 8-element unit
    const i64 row = blockIdx.x;
    const int step = blockDim.x * 8;               // elements between a thread's units
    const int c0 = threadIdx.x * 8;
    const T* xr = x + row * x_row_stride + c0;
    pdl_wait_then_release();  // no global access above this line
    const float ub = sa.has_ub ? load_ub(sa) : 0.0f;  // first, so that its load is under the row's
    uint4 raw[U][LOADS];
    load_units<T, U, LOADS>(xr, c0, step, K, vec != 0, raw);
    unsigned m = 0;
#pragma unroll
    for (int v = 0; v < U; ++v)
#pragma unroll
        for (int l = 0; l < LOADS; ++l) m = max(m, absmax16<T>(raw[v][l]));
    m = block_max_redux(m);
    float inv;
    const float s = token_scale_lead<F>(sa, ub, __uint_as_float(m), inv);
    const bool pow2 = sa.pow2 != 0;
    const bool exact_div = needs_exact_div(sa, s);
    unsigned char* qr = q + row * (i64)K;
#pragma unroll
    for (int v = 0; v < U; ++v) {
        const int c = c0 + v * step;
        if (c < K) {
            float f[8];
#pragma unroll
            for (int l = 0; l < LOADS; ++l) unpack16<T>(raw[v][l], f + l * 4);
            store_unit_bytes(qr + c, K - c, token_quant8<F>(f, s, inv, pow2, exact_div), vec != 0);
        }
    }
    if (threadIdx.x == 0) store_scale(sa, row, 0, s);
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
    pdl_wait_then_release();  // no global access above this line
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

// ---------------------------------------------------------------- asymmetric per-token INT8 (zero points)
// vLLM dynamic_scaled_int8_azp_quant; the rule is AzpRow below, the layout and the teams those of
// token_quantize_regs / token_quantize. The zero points go to zp_words, laid out like the scales.

// Order-preserving keys of float32 values: key(a) < key(b) exactly when a < b, -0 below +0, so the
// row's min and max are unsigned max reductions on integers (no float compare, no -ftz flush). The
// min is reduced as the max of ~key. A NaN contributes 0 to both, a key no other value has: a row
// whose two maxima stay 0 has no value that is not NaN.
__device__ __forceinline__ unsigned order_key(float x) {
    const unsigned u = __float_as_uint(x);
    return u ^ ((unsigned)((int)u >> 31) | 0x80000000u);
}
__device__ __forceinline__ float from_order_key(unsigned k) {
    return __uint_as_float(k ^ ((k & 0x80000000u) ? 0x80000000u : 0xffffffffu));
}
__device__ __forceinline__ void minmax_add(unsigned& hi, unsigned& nlo, float x) {
    const unsigned u = __float_as_uint(x);
    const unsigned k = order_key(x);
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
    hi = max(hi, nan ? 0u : k);
    nlo = max(nlo, nan ? 0u : ~k);
}

// A row's scale s, zero point z and the inverse inv = 1 / s, from its min lo and max hi (NaN ignored;
// 0 and 0 for a row with no other value). vLLM's arithmetic, each step IEEE float32:
//   s = (hi - lo) / 255;  z = int32(nearbyint(-128 - lo / s));  inv = 1 / s
// (int32() of the already integral value saturates and takes NaN to 0, as the conversion in vLLM's
// `azp_t(zp)` does, so z = to_int32_rn(-128 - lo / s)). Where s is 0 (all the row's values equal, or
// so close that (hi - lo) / 255 underflows) vLLM divides by zero; here the row is coded
// symmetrically with one step instead: s = max(|lo|, |hi|), z = 0 and q = rne_sat(x / s), so that a
// constant row c gives q = sign(c) and dequantizes to c exactly, and an all-zero row s = 0, z = 0,
// q = 0 (vLLM's own result for it).
struct AzpRow {
    float s, inv;
    int z;
    bool flat;  // s was 0: q = to_int8_rn(x / s)
};
__device__ __forceinline__ AzpRow azp_row(unsigned hi_key, unsigned nlo_key) {
    float lo = 0.0f, hi = 0.0f;
    if (hi_key != 0u) {
        hi = from_order_key(hi_key);
        lo = from_order_key(~nlo_key);
    }
    AzpRow r;
    r.s = div_rn(sub_rn(hi, lo), 255.0f);
    r.flat = (__float_as_uint(r.s) & 0x7fffffffu) == 0u;  // on the bits: -ftz compares a subnormal equal to 0
    if (r.flat) {
        r.s = __uint_as_float(max(__float_as_uint(lo) & 0x7fffffffu, __float_as_uint(hi) & 0x7fffffffu));
        r.z = 0;
        r.inv = 0.0f;
    } else {
        r.z = to_int32_rn(sub_rn(-128.0f, div_rn(lo, r.s)));
        r.inv = rcp_rn(r.s);
    }
    return r;
}

// q = int32_to_int8(float_to_int32_rn(x * inv) + z) (vLLM), or rne_sat(x / s) for a flat row.
__device__ __forceinline__ unsigned char azp_quant1(float x, const AzpRow& r) {
    return r.flat ? to_int8_rn(div_rn(x, r.s)) : azp_code(mul_rn(x, r.inv), r.z);
}
__device__ __forceinline__ uint2 azp_quant8(const float* f, const AzpRow& r) {
    unsigned w[2] = {0u, 0u};
    if (r.flat) {
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i >> 2] |= (unsigned)to_int8_rn(div_rn(f[i], r.s)) << (8 * (i & 3));
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i >> 2] |= (unsigned)azp_code(mul_rn(f[i], r.inv), r.z) << (8 * (i & 3));
    }
    return make_uint2(w[0], w[1]);
}

// As token_quantize_regs: a team of WARPS warps per row holds it in registers (rows 16-byte aligned,
// K % 8 == 0). Only the row's own elements enter its min and max.
template <typename T, int WARPS>
__global__ void __launch_bounds__(TokenTeam<WARPS>::BLOCK, 1024 / TokenTeam<WARPS>::BLOCK)
token_quantize_azp_regs(const T* __restrict__ x, i64 x_row_stride, unsigned char* __restrict__ q, i64 rows, int K,
                        ScaleArgs sa, unsigned* __restrict__ words, unsigned* __restrict__ zp_words) {
    sa.words = words;
    using Team = TokenTeam<WARPS>;
    constexpr int LOADS = sizeof(T) == 4 ? 2 : 1;
    constexpr int UNITS = TOKEN_REG_BYTES / (16 * LOADS);
    const int t = threadIdx.x % Team::THREADS;
    const i64 row = (i64)blockIdx.x * Team::ROWS + threadIdx.x / Team::THREADS;
    const bool valid = row < rows;
    const T* xr = x + (valid ? row : 0) * x_row_stride;
    pdl_wait_then_release();  // no global access above this line
    uint4 raw[UNITS][LOADS];
    unsigned hi = 0, nlo = 0;
#pragma unroll
    for (int v = 0; v < UNITS; ++v) {
        const int c = (v * Team::THREADS + t) * 8;
        const bool in = valid && c < K;
#pragma unroll
        for (int l = 0; l < LOADS; ++l) raw[v][l] = in ? ld16(xr + c + l * 4) : make_uint4(0u, 0u, 0u, 0u);
        if (in) {
            float f[8];
#pragma unroll
            for (int l = 0; l < LOADS; ++l) unpack16<T>(raw[v][l], f + l * 4);
#pragma unroll
            for (int i = 0; i < 8; ++i) minmax_add(hi, nlo, f[i]);
        }
    }
    team_max2<WARPS>(hi, nlo);
    if (!valid) return;
    const AzpRow r = azp_row(hi, nlo);
    unsigned char* qr = q + row * (i64)K;
#pragma unroll
    for (int v = 0; v < UNITS; ++v) {
        const int c = (v * Team::THREADS + t) * 8;
        if (c < K) {
            float f[8];
#pragma unroll
            for (int l = 0; l < LOADS; ++l) unpack16<T>(raw[v][l], f + l * 4);
            store8w<true>(qr + c, azp_quant8(f, r));
        }
    }
    if (t == 0) {
        store_scale(sa, row, 0, r.s);
        store_word(sa, zp_words, row, 0, (unsigned)r.z);
    }
}

// As token_quantize: any K and alignment, one block per row, two passes over the row.
template <typename T, bool VEC>
__global__ void __launch_bounds__(TOKEN_BLOCK)
token_quantize_azp(const T* __restrict__ x, i64 x_row_stride, unsigned char* __restrict__ q, int K, ScaleArgs sa,
                   unsigned* __restrict__ words, unsigned* __restrict__ zp_words) {
    sa.words = words;
    const i64 row = blockIdx.x;
    const T* xr = x + row * x_row_stride;
    unsigned char* qr = q + row * (i64)K;
    pdl_wait_then_release();  // no global access above this line
    const int step = VEC ? 8 : 1;
    unsigned hi = 0, nlo = 0;
    for (int c = threadIdx.x * step; c < K; c += TOKEN_BLOCK * step) {
        if constexpr (VEC) {
            float g[8];
            load8<T, true>(xr + c, g);
#pragma unroll
            for (int i = 0; i < 8; ++i) minmax_add(hi, nlo, g[i]);
        } else {
            minmax_add(hi, nlo, to_float(xr[c]));
        }
    }
    team_max2<TOKEN_BLOCK / 32>(hi, nlo);  // the whole block: every thread gets the row's keys
    const AzpRow r = azp_row(hi, nlo);
    for (int c = threadIdx.x * step; c < K; c += TOKEN_BLOCK * step) {
        if constexpr (VEC) {
            float g[8];
            load8<T, true>(xr + c, g);
            store8w<true>(qr + c, azp_quant8(g, r));
        } else {
            qr[c] = azp_quant1(to_float(xr[c]), r);
        }
    }
    if (threadIdx.x == 0) {
        store_scale(sa, row, 0, r.s);
        store_word(sa, zp_words, row, 0, (unsigned)r.z);
    }
}

// ---------------------------------------------------------------- fused SiLU(gate) * up + group quantization
// The one definition of the intermediate, shared by the fused kernel and the test kernel below:
// e = expf(-gate) (CUDA's expf, within 2 ulp), then IEEE steps only.
__device__ __forceinline__ float silu_mul_from_sigmoid(float gate, float up, float sigmoid) {
    return mul_rn(mul_rn(gate, sigmoid), up);
}
__device__ __forceinline__ float silu_mul_from_exp(float gate, float up, float e) {
    const float sigmoid = rcp_rn(add_rn(1.0f, e));  // == 1.0f / (1.0f + e), correctly rounded
    return silu_mul_from_sigmoid(gate, up, sigmoid);
}
__device__ __forceinline__ float silu_mul(float gate, float up) { return silu_mul_from_exp(gate, up, expf(-gate)); }

// silu_mul of 16 elements (g holds the gates and receives r), the same r bit for bit, the 16
// reciprocals by rcp_rn_n: one exponent test for all 16 and no branch between them, so the 16 chains
// of expf, reciprocal and products overlap. (silu_mul per element puts rcp_rn's branch and its
// convergence barrier around each reciprocal, and ptxas issues the 16 chains one after another, about
// 30 dependent instructions each with two MUFU latencies: sm_90 SASS.)
__device__ __forceinline__ void silu_mul16(float* g, const float* up) {
    float d[16], sigmoid[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) d[i] = add_rn(1.0f, expf(-g[i]));
    rcp_rn_n<16>(d, sigmoid);
#pragma unroll
    for (int i = 0; i < 16; ++i) g[i] = silu_mul_from_sigmoid(g[i], up[i], sigmoid[i]);
}

template <class F> struct SiluRule {
    static constexpr int CLAMP = CLAMP_HI;
    __device__ static float min_scale() { return 1.0f / (F::max_finite * 512.0f); }
};
template <> struct SiluRule<I8> {
    static constexpr int CLAMP = CLAMP_NONE;
    __device__ static float min_scale() { return 1.1920928955078125e-07f; }  // FLT_EPSILON
};

// Grid as group_quantize (16 outputs per thread), over the H output columns. RCP16: r by silu_mul16
// (one exponent test a thread), else by silu_mul (a branch an element); the same bytes. RCP16 asks
// for 4 blocks an SM (64 registers): with no minimum, ptxas holds it to 48 registers by issuing the
// loads of `up` after the 16 expf, which puts a second memory latency on the thread's chain (sm_90
// SASS; with the minimum, 54 registers and the four loads issued together).
template <typename T, class F, bool VEC, bool RCP16>
__global__ void __launch_bounds__(256, RCP16 ? 4 : 0)
silu_mul_quantize(const T* __restrict__ x, i64 x_row_stride, unsigned char* __restrict__ q, i64 rows, int H,
                  int group_size, ScaleArgs sa, unsigned* __restrict__ words) {
    sa.words = words;
    const int tpg = group_size >> 4;
    const i64 row = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    const int u = blockIdx.y * blockDim.x + threadIdx.x;
    const bool valid = row < rows;
    pdl_wait_then_release();  // no global access above this line
    float r[16];
    if (valid) {
        const T* p = x + row * x_row_stride + u * 16;
        float up[16];
        load8<T, VEC>(p, r);
        load8<T, VEC>(p + 8, r + 8);
        load8<T, VEC>(p + H, up);
        load8<T, VEC>(p + H + 8, up + 8);
        if constexpr (RCP16) {
            silu_mul16(r, up);
        } else {
#pragma unroll
            for (int i = 0; i < 16; ++i) r[i] = silu_mul(r[i], up[i]);
        }
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
    pdl_wait_then_release();
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
// 16384 x 16384.) Otherwise a flat grid-stride loop of single elements. group_dequantize_flat below
// is the flat geometry of flat_dequant.cuh (pieces of 8 codes, the row a magic multiply in 32-bit),
// which the host plans for large aligned tensors (cupyquant._flat).
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
    pdl_wait_then_release();
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

// The flat geometry (flat_dequant.cuh): PIECES pieces of 8 codes per thread, q 8-byte and y 16-byte
// aligned, any K. g_shift as group_dequantize's; the scale of (row, col) as load_scale's, in two
// steps: the word that holds it, then its value (a UE8M0 byte of a packed word, or the float32 word).
// ROW_F32: float32 scales in the "row" layout (word row * sm + g * sg: no batch split, no byte
// select), the common case compiled without the other layouts' branches.
template <bool ROW_F32> struct GroupScale {
    ScaleArgs sa;
    int g_shift;
    // 32-bit: rows and scale word offsets are below 2^31 where the flat kernel runs
    __device__ __forceinline__ unsigned load(unsigned row, unsigned col) const {
        const unsigned g = col >> g_shift;
        if constexpr (ROW_F32) return __ldg(sa.words + row * (unsigned)sa.sm + g * (unsigned)sa.sg);
        unsigned b = 0, m = row;
        if (sa.col) {  // split_row's multiply (m_magic is below 2^32)
            b = (unsigned)(((u64)row * (unsigned)sa.m_magic) >> sa.m_shift);
            m = row - b * (unsigned)sa.M;
        }
        const unsigned w = b * (unsigned)sa.sb + m * (unsigned)sa.sm + (sa.packed ? g >> 2 : g) * (unsigned)sa.sg;
        return __ldg(sa.words + w);
    }
    __device__ __forceinline__ float value(unsigned w, unsigned col) const {
        if (ROW_F32 || !sa.packed) return __uint_as_float(w);
        return e8m0_to_float((w >> (8 * ((col >> g_shift) & 3u))) & 0xffu);
    }
};

template <typename OutT, class F, int PIECES, bool ROW_F32>
__global__ void __launch_bounds__(FLAT_THREADS)
group_dequantize_flat(const unsigned char* __restrict__ q, OutT* __restrict__ y, FlatRows f, int g_shift, ScaleArgs sa,
                      unsigned* __restrict__ words) {
    sa.words = words;
    pdl_wait_then_release();
    flat_dequantize<OutT, F, PIECES>(q, y, f, g_shift, GroupScale<ROW_F32>{sa, g_shift});
}

// Per-token INT8 with zero points: y = round(float32(q - z) * s) for the scale s and zero point z
// of q's row (z at the same word offset as s, in zp_words). Grids as group_dequantize's.
template <typename OutT, bool VEC>
__global__ void __launch_bounds__(256)
token_dequantize_azp(const unsigned char* __restrict__ q, OutT* __restrict__ y, i64 rows, int K, ScaleArgs sa,
                     const unsigned* __restrict__ words, const int* __restrict__ zp_words) {
    pdl_wait_then_release();
    if constexpr (VEC) {
        const i64 row = (i64)blockIdx.x * blockDim.y + threadIdx.y;
        if (row >= rows) return;
        const int c = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
        const i64 w = word_index(sa, row, 0);
        const float s = __uint_as_float(__ldg(words + w));
        const int z = __ldg(zp_words + w);
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(q + row * (i64)K + c));
        float f[8];
#pragma unroll
        for (int i = 0; i < 8; ++i)
            f[i] = mul_rn(minus_zero_point((unsigned char)(((i < 4 ? v.x : v.y) >> (8 * (i & 3))) & 0xffu), z), s);
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
            const i64 w = word_index(sa, row, 0);
            const float s = __uint_as_float(__ldg(words + w));
            y[i] = from_float<OutT>(mul_rn(minus_zero_point(q[i], __ldg(zp_words + w)), s));
        }
    }
}

