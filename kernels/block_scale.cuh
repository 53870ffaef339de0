// block_scale.cuh: the block-scaled quantizer and dequantizer shared by the MX (mx.cu) and NVFP4
// (nvfp4.cu) families, and the element conversions they use (also exercised by testing.cu).
//
// Conversions. HW = true uses the hardware conversions the GPU has: cvt.rn.satfinite.{e4m3,e5m2}x2
// on sm_89+, and on the Blackwell family-specific targets (sm_100a, sm_120a, ..., which cupyquant._jit
// asks NVRTC for) cvt.rn.satfinite.e2m1x2 and cvt.rp.satfinite.ue8m0x2. Everything else, and
// everything when HW = false, goes through the exact software conversions below, which give the same
// bytes (tests compare them over every float32 bit pattern on the GPU).
//
// Layout. x is (rows, K) with a row stride (leading dimensions flattened), q is C-contiguous with
// K bytes (FP8) or ceil(K / 2) bytes (FP4: element 2i in the low nibble of byte i) per row. A last
// block that K does not fill is treated as zero-padded. Scales are one byte per block: "dense"
// (rows, Kb) row-major, or "swizzled", the 128x4 layout of cuBLAS and Blackwell block-scaled MMA:
// the scale of (m, k) at ((m / 128) * ceil(Kb / 4) + k / 4) * 512 + (m % 32) * 16 + ((m / 32) % 4) * 4
// + k % 4, rows padded to 128 and scale columns to 4, the padding zero.
//
// Threads. Two geometries, both giving each thread segments of 16 consecutive elements of a row.
// The tile: one thread block quantizes a tile of 128 rows x 256 elements (8 MX or 16 NVFP4 scale
// blocks per row), so that its scale bytes are exactly 2 or 4 whole 512-byte units of the swizzled
// layout: they are gathered in shared memory and written as 16-byte stores (dense: one 8- or 16-byte
// store per row). Each thread takes 16 consecutive elements of a row (16-byte loads, one 16- or
// 8-byte store) in 8 rows of the tile, 4 rows' loads in flight at once; the two threads of an MX
// block combine their maxima with one shuffle. Rows and blocks past the tensor read as zeros, so the
// padding scales come out 0 without a separate pass. VEC = false is the scalar path for rows that
// are not 16-byte aligned or K not a multiple of 16. The small geometry (small_quantize), for few
// rows: one segment per thread, a grid of as many threads as segments, plus blocks that write the
// zero padding rows of the swizzled layout.
//
// PDL. block_quantize, small_quantize and block_dequantize read and write global memory from their first lines: the
// kernels that call them (mx.cu, nvfp4.cu) call pdl_wait_then_release() first.
#pragma once

#include "common.cuh"

using namespace cq;

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FAMILY_SPECIFIC__) && (__CUDA_ARCH_FAMILY_SPECIFIC__ >= 1000) && (__CUDA_ARCH_FAMILY_SPECIFIC__ < 1300)
#define CQ_HAS_FP4_CVT 1
#elif defined(__CUDA_ARCH_FEAT_SM100_ALL) || defined(__CUDA_ARCH_FEAT_SM101_ALL) || defined(__CUDA_ARCH_FEAT_SM103_ALL) || \
    defined(__CUDA_ARCH_FEAT_SM110_ALL) || defined(__CUDA_ARCH_FEAT_SM120_ALL) || defined(__CUDA_ARCH_FEAT_SM121_ALL)
#define CQ_HAS_FP4_CVT 1
#else
#define CQ_HAS_FP4_CVT 0
#endif

namespace cq {
struct E2M1 {
    static constexpr float max_finite = 6.0f;
};
}  // namespace cq

static constexpr int THREADS = 256;
static constexpr int TILE_ROWS = 128;
static constexpr float FLT_MAX_F = 3.40282346638528859812e+38f;

// ---------------------------------------------------------------- element formats
// MBITS/BIAS: mantissa bits and exponent bias; MAXCODE: the code of the max finite magnitude;
// NANCODE: what a NaN becomes (CUDA's canonical 0x7f for FP8; +6 for E2M1, which has no NaN);
// SIGN: the sign bit; EMAX: OCP's emax_elem; RCP: float32(1 / max_finite); SUB: 2^(MBITS+BIAS-1),
// which scales the largest subnormal step to 1.
template <class F> struct Fmt;
template <> struct Fmt<E4M3> {
    static constexpr int MBITS = 3, BIAS = 7, EMAX = 8, SIGN = 7, BITS = 8;
    static constexpr unsigned MAXCODE = 0x7e, NANCODE = 0x7f;
    static constexpr float RCP = 0x1.24924ap-9f, SUB = 512.0f;
};
template <> struct Fmt<E5M2> {
    static constexpr int MBITS = 2, BIAS = 15, EMAX = 15, SIGN = 7, BITS = 8;
    static constexpr unsigned MAXCODE = 0x7b, NANCODE = 0x7f;
    static constexpr float RCP = 0x1.24924ap-16f, SUB = 65536.0f;
};
template <> struct Fmt<E2M1> {
    static constexpr int MBITS = 1, BIAS = 1, EMAX = 2, SIGN = 3, BITS = 4;
    static constexpr unsigned MAXCODE = 0x7, NANCODE = 0x7;
    static constexpr float RCP = 0x1.555556p-3f, SUB = 2.0f;
};

// round(a * s) half to even, for a * s in [0, 2^22]: one FMA adds 2^23, which leaves the integer in
// the low mantissa bits (cheaper than cvt.rni, a quarter-rate conversion instruction).
__device__ __forceinline__ unsigned rne_int(float a, float s) {
    float r;
    asm("fma.rn.f32 %0, %1, %2, 0f4B000000;" : "=f"(r) : "f"(a), "f"(s));
    return __float_as_uint(r) - 0x4b000000u;
}

// float -> code, round to nearest even, saturating to +-max (inf included), NaN -> NANCODE. Branch
// free (both candidates are computed and one is selected): below the smallest normal, |x| * SUB is
// exact and rounds to the subnormal code, 2^MBITS being the smallest normal's code; above, the
// rebiased float bits are rounded at the target's last mantissa bit, the carry running into the
// exponent.
template <class F> __device__ __forceinline__ unsigned sw_cvt(float x) {
    using P = Fmt<F>;
    constexpr int DROP = 23 - P::MBITS;
    constexpr unsigned MINNORM = (unsigned)(127 - P::BIAS + 1) << 23;
    const unsigned u = __float_as_uint(x);
    const unsigned a = u & 0x7fffffffu;
    const unsigned b = a - ((unsigned)(127 - P::BIAS) << 23);
    const unsigned cn = min((b + (1u << (DROP - 1)) - 1u + ((b >> DROP) & 1u)) >> DROP, P::MAXCODE);
    const unsigned cs = rne_int(__uint_as_float(min(a, MINNORM)), P::SUB);
    const unsigned code = (a < MINNORM ? cs : cn) | ((u >> 31) << P::SIGN);
    return a > 0x7f800000u ? P::NANCODE : code;
}

// ---------------------------------------------------------------- packed E2M1 (bf16x2 arithmetic)
// The software E2M1 path works on two elements per 32-bit register with sm_80's bf16x2 FMA and
// min/max (no flushing: bf16 arithmetic keeps subnormals), about 6 instructions per element where
// a float32 bit-manipulation conversion needs 15.
// prmt.b32 in its default mode: each selector nibble picks one of the 8 bytes of a (0-3) and b (4-7)
// with its bits 0-2 and, with bit 3 set, replicates that byte's top bit over the result byte.
__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned sel) {
    unsigned d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}
__device__ __forceinline__ unsigned bf2_fma(unsigned a, unsigned b, unsigned c) {
    unsigned d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ unsigned bf2_min(unsigned a, unsigned b) {  // a NaN operand gives the other
    unsigned d;
    asm("min.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ unsigned bf2_max(unsigned a, unsigned b) {
    unsigned d;
    asm("max.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
// max(|a|, |b|) per half, NaN propagating; the result's sign bits are garbage (sm_86+: the xor of
// the operands', in one instruction; before: a max of the masked magnitudes).
__device__ __forceinline__ unsigned bf2_absmax_nan(unsigned a, unsigned b) {
    unsigned d;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 860
    asm("max.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
#else
    asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a & 0x7fff7fffu), "r"(b & 0x7fff7fffu));
#endif
    return d;
}
__device__ __forceinline__ unsigned bf2_max_nan(unsigned a, unsigned b) {  // NaN propagates
    unsigned d;
    asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// Two bf16 magnitudes (NaN allowed) -> their E2M1 magnitude codes at bits 0-2 and 16-18: round to
// nearest even, saturate at 6, NaN -> 6. With c = min(m, 6) and 2^k = clamp(2^floor(log2 c), 1, 4),
// the code is 2k + rne(c * 2^(1-k)) (steps of 0.5 below 2, 1 below 4, 2 above). One FMA computes
// c * 2^(1-k) + 128 + 2k: the sum (below 256) rounds once, to an integer, and bf16(128 + n) is
// 0x4300 + n, so the code is the low 3 bits. 2^(1-k) and 128 + 2k come from 2^k's bits by one
// subtraction and one shift-and-add that stay inside each 16-bit half.
__device__ __forceinline__ unsigned e2m1x2_mag(unsigned m) {
    const unsigned c = bf2_min(m, 0x40c040c0u);                      // min(m, 6)
    const unsigned p = bf2_max(c & 0x7f807f80u, 0x3f803f80u);        // 2^k
    const unsigned t = bf2_fma(c, 0x7f807f80u - p, (p >> 6) + 0x42024202u);
    return t & 0x00070007u;
}

// Two bf16 values (lo in the low half) -> E2M1 codes at bits 0-3 and 16-19, sign in bit 3 (kept for
// zeros), NaN -> +6: a NaN half (magnitude above 0x7f80) carries into bit 15 of m + 0x7f and drops its sign.
__device__ __forceinline__ unsigned e2m1x2_bf16(unsigned w) {
    const unsigned m = w & 0x7fff7fffu;
    const unsigned sign = w & ~(m + 0x007f007fu) & 0x80008000u;
    return e2m1x2_mag(m) | (sign >> 12);
}

// Two floats -> bf16x2 rounded to odd: truncate, and set the kept last bit when any dropped bit is
// set ((low 16 bits) + 0xffff carries into bit 16). Rounding that to E2M1 (nearest even) gives the
// float's own rounding, bf16 keeping 6 bits more than E2M1's 2 (round-to-odd needs 2); NaN stays NaN.
__device__ __forceinline__ unsigned bf16x2_rto(float lo, float hi) {
    const unsigned a = __float_as_uint(lo), b = __float_as_uint(hi);
    return __byte_perm(a | ((a & 0xffffu) + 0xffffu), b | ((b & 0xffffu) + 0xffffu), 0x7632);
}

// Codes of (e0, e1) and (e2, e3) at bits 0-3 / 16-19 -> low 16 bits e0 | e1 << 4 | e2 << 8 | e3 << 12.
__device__ __forceinline__ unsigned pack_nibbles4(unsigned c01, unsigned c23) {
    const unsigned x = c01 | (c23 << 8);  // e0 @0, e2 @8, e1 @16, e3 @24
    return x | (x >> 12);
}
// Eight code pairs (16 elements) -> 8 bytes, element 2i in the low nibble of byte i.
__device__ __forceinline__ void pack_e2m1x16(const unsigned* c, unsigned* w) {
    w[0] = __byte_perm(pack_nibbles4(c[0], c[1]), pack_nibbles4(c[2], c[3]), 0x5410);
    w[1] = __byte_perm(pack_nibbles4(c[4], c[5]), pack_nibbles4(c[6], c[7]), 0x5410);
}

// Two elements -> their codes, lo in the low bits (8 bits each for FP8, 4 for E2M1).
template <class F, bool HW> __device__ __forceinline__ unsigned cvt_x2(float lo, float hi) {
    if constexpr (HW && Fmt<F>::BITS == 8) {
        return to_fp8x2<F>(lo, hi);  // cvt.rn.satfinite.{e4m3,e5m2}x2.f32 on sm_89+
    } else if constexpr (Fmt<F>::BITS == 8) {
        return sw_cvt<F>(lo) | (sw_cvt<F>(hi) << 8);
    } else {
#if CQ_HAS_FP4_CVT
        if constexpr (HW) {
            unsigned short r;
            asm("{ .reg .b8 t; cvt.rn.satfinite.e2m1x2.f32 t, %1, %2; mov.b16 %0, {t, 0}; }" : "=h"(r) : "f"(hi), "f"(lo));
            return r;
        }
#endif
        const unsigned c = e2m1x2_bf16(bf16x2_rto(lo, hi));
        return (c & 0xfu) | ((c >> 12) & 0xf0u);
    }
}

// 16 floats -> packed codes: 16 bytes (FP8) or 8 bytes (E2M1, element 2i in the low nibble).
template <class F, bool HW> __device__ __forceinline__ void cvt16(const float* v, unsigned* w) {
    if constexpr (Fmt<F>::BITS == 8) {
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = cvt_x2<F, HW>(v[4 * i], v[4 * i + 1]) | (cvt_x2<F, HW>(v[4 * i + 2], v[4 * i + 3]) << 16);
    } else if constexpr (HW && CQ_HAS_FP4_CVT) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            unsigned r = 0;
#pragma unroll
            for (int j = 0; j < 4; ++j) r |= cvt_x2<F, HW>(v[8 * i + 2 * j], v[8 * i + 2 * j + 1]) << (8 * j);
            w[i] = r;
        }
    } else {
        unsigned c[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) c[i] = e2m1x2_bf16(bf16x2_rto(v[2 * i], v[2 * i + 1]));
        pack_e2m1x16(c, w);
    }
}

// ---------------------------------------------------------------- scales
// E8M0 of v >= 0 rounded up, saturating: NaN -> 255, inf -> 254, (0, 2^-127] -> 0 (TransformerEngine's
// float_to_e8m0; cvt.rp.satfinite.ue8m0x2.f32 on Blackwell).
template <bool HW> __device__ __forceinline__ unsigned e8m0_ceil(float v) {
#if CQ_HAS_FP4_CVT
    if constexpr (HW) {
        unsigned short r;
        asm("cvt.rp.satfinite.ue8m0x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(v));
        return r & 0xffu;
    }
#endif
    const unsigned b = __float_as_uint(v) & 0x7fffffffu;
    const unsigned e = b >> 23, m = b & 0x7fffffu;
    const bool up = m != 0u && e != 254u && !(e == 0u && m <= 0x400000u);
    return b > 0x7f800000u ? 255u : b == 0x7f800000u ? 254u : e + (up ? 1u : 0u);
}

// The MX scale byte of a block whose max |x| has the bits key (a NaN key exceeds inf's).
template <class F, bool HW> __device__ __forceinline__ unsigned mx_scale(unsigned key, bool floor_rule) {
    if (floor_rule) {
        const int e = max((int)(key >> 23) - Fmt<F>::EMAX, 0);
        return key > 0x7f800000u ? 255u : key == 0x7f800000u ? 254u : (unsigned)e;
    }
    return e8m0_ceil<HW>(mul_rn(__uint_as_float(key), Fmt<F>::RCP));
}

// 2^(127 - E): (254 - E) << 23 for E <= 253, the subnormal 2^-127 for 254, NaN for 255.
__device__ __forceinline__ float mx_multiplier(unsigned E) {
    return __uint_as_float(E == 255u ? 0x7fffffffu : E == 254u ? 0x00400000u : (254u - E) << 23);
}

// float -> E4M3 byte, round to nearest even, saturating (NVFP4 block scales).
template <bool HW> __device__ __forceinline__ unsigned to_e4m3(float v) {
    if constexpr (HW) return to_fp8x2<E4M3>(v, 0.0f) & 0xffu;
    else return sw_cvt<E4M3>(v);
}

// NVFP4 global encode scale S_enc: 2688 / amax (IEEE), fminf'd to FLT_MAX, 1 when amax is 0 or the
// quotient is 0 (TransformerEngine's compute_global_encode_scaling_factor_FP4). The zero tests are on
// bits: under -ftz a float compare would treat a subnormal amax as 0.
__device__ __forceinline__ float nvfp4_encode_scale(float amax) {
    const float s = fmin_ieee(div_rn(2688.0f, amax), FLT_MAX_F);
    return ((__float_as_uint(amax) & 0x7fffffffu) == 0u || __float_as_uint(s) == 0u) ? 1.0f : s;
}

// ---------------------------------------------------------------- 16-element loads
template <typename T> __device__ __forceinline__ void load16_vec(const T* __restrict__ p, float* f) {
    constexpr int N = Vec16<T>::N;
#pragma unroll
    for (int i = 0; i < 16 / N; ++i) unpack16<T>(ld16(p + i * N), f + i * N);
}
// Scalar: elements at or past n read as 0.
template <typename T> __device__ __forceinline__ void load16_scalar(const T* __restrict__ p, i64 n, float* f) {
#pragma unroll
    for (int i = 0; i < 16; ++i) f[i] = i < n ? to_float(p[i]) : 0.0f;
}

// ---------------------------------------------------------------- the quantizer
struct QuantArgs {
    i64 rows, K, row_stride;  // x is (rows, K), row_stride elements apart
    i64 q_row;                // bytes per row of q
    i64 n_blocks;             // scale blocks per row, ceil(K / BS)
    i64 n_units;              // 512-byte swizzle units per 128 rows: ceil(n_blocks / 4)
    i64 n_ktiles;             // tiles along K: ceil(K / TILE_K)
    int swizzled;             // scale layout: 1 swizzled, 0 dense
    int floor_rule;           // MX only: OCP round-down rule
    int gs_mode;              // NVFP4 only, a ScaleSource: gs_ptr holds the global amax (AMAX) or S_enc
                              // (DEVICE), or S_enc is gs_arg (ARG)
    float gs_arg;
    const float* gs_ptr;
    float* gs_out;            // NVFP4 only: S_enc as used, written by block 0
    i64 row_blocks;           // small geometry: blocks along x that quantize rows (the rest zero the
                              // swizzled layout's padding rows)
};

// ---------------------------------------------------------------- one segment
// The unit of work of both geometries below: 16 consecutive elements of a row, one thread's.
// RAW: the segment is kept as the 8 bf16 pairs it was loaded as (FP4 from bf16 without the hardware
// E2M1 conversion); otherwise as 16 floats.
template <typename T, class F, bool HW> struct Raw {
    static constexpr bool value = same_type<T, __nv_bfloat16>::value && Fmt<F>::BITS == 4 && !(HW && CQ_HAS_FP4_CVT);
};

// The segment at src into f (floats) or r (RAW pairs); n elements of the row from src are valid, and
// a segment outside the tensor (in false) or its elements past n read as zeros.
template <typename T, bool RAW, bool VEC>
__device__ __forceinline__ void load_segment(const T* __restrict__ src, bool in, i64 n, float* f, unsigned* r) {
    if constexpr (RAW) {
        if (in && VEC) {
            const uint4 lo = ld16(src), hi = ld16(src + 8);
            r[0] = lo.x; r[1] = lo.y; r[2] = lo.z; r[3] = lo.w;
            r[4] = hi.x; r[5] = hi.y; r[6] = hi.z; r[7] = hi.w;
        } else {
            const unsigned short* s16 = reinterpret_cast<const unsigned short*>(src);
            if (!in) n = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i)
                r[i] = (2 * i < n ? (unsigned)s16[2 * i] : 0u) | (2 * i + 1 < n ? (unsigned)s16[2 * i + 1] << 16 : 0u);
        }
    } else if (in) {
        if constexpr (VEC) load16_vec<T>(src, f);
        else load16_scalar<T>(src, n, f);
    } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) f[i] = 0.0f;
    }
}

// NVFP4's S_enc, read as a.gs_mode says, and from it S_enc * float32(1/6) and 1 / S_enc.
__device__ __forceinline__ float nvfp4_block_factors(const QuantArgs& a, float& S_enc6, float& S_dec) {
    const float S_enc = a.gs_mode == SCALE_FROM_ARG ? a.gs_arg
                      : a.gs_mode == SCALE_FROM_DEVICE ? *a.gs_ptr : nvfp4_encode_scale(*a.gs_ptr);
    S_enc6 = mul_rn(S_enc, Fmt<E2M1>::RCP);
    S_dec = rcp_rn(S_enc);
    return S_enc;
}

// NVFP4's scale byte of a block whose max |x| has the float bits key, and the block's element
// multiplier mult = fminf(1 / (float(sf) * S_dec), FLT_MAX).
// nvfp4_scale_byte and nvfp4_mult_denominator are its two halves (the wide geometry takes the
// reciprocals of several blocks' denominators at once).
template <bool HW> __device__ __forceinline__ unsigned nvfp4_scale_byte(unsigned key, float S_enc6) {
    return to_e4m3<HW>(fmin_ieee(mul_rn(__uint_as_float(key), S_enc6), FLT_MAX_F));
}
__device__ __forceinline__ float nvfp4_mult_denominator(unsigned sbyte, float S_dec) {
    return mul_rn(fp8_to_float<E4M3>((unsigned char)sbyte), S_dec);
}
template <bool HW> __device__ __forceinline__ unsigned nvfp4_scale(unsigned key, float S_enc6, float S_dec, float& mult) {
    const unsigned sbyte = nvfp4_scale_byte<HW>(key, S_enc6);
    mult = fmin_ieee(rcp_rn(nvfp4_mult_denominator(sbyte, S_dec)), FLT_MAX_F);
    return sbyte;
}

// The scale byte of the segment's block and the segment's codes in w (16 bytes FP8, 8 bytes FP4,
// element 2i in the low nibble of byte i). An MX block (BS = 32) is two segments, in lanes 2i and
// 2i + 1 of a warp, which combine their maxima with one shuffle: every lane of the warp calls this.
template <class F, int BS, bool NV, bool HW, bool RAW>
__device__ __forceinline__ unsigned quantize_segment(const float* f, const unsigned* r, float S_enc6, float S_dec,
                                                     bool floor_rule, unsigned* w) {
    // block max |x| as float bits: MX lets a NaN win (its magnitude bits exceed inf's);
    // NVFP4 ignores NaN (fmaxf), mapping it to 0.
    unsigned key = 0;
    unsigned mag[RAW ? 8 : 1];
    if constexpr (RAW) {  // bf16x2 max of the magnitudes (.NaN for MX; NVFP4's ignores NaN,
        unsigned m2 = 0;  // the other operand winning); bf16 bits order like float bits
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            mag[i] = r[i] & 0x7fff7fffu;
            m2 = NV ? bf2_max(m2, mag[i]) : bf2_max_nan(m2, mag[i]);
        }
        key = max(m2 & 0xffffu, m2 >> 16) << 16;
    } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) key = max(key, NV ? abs_key(f[i]) : (__float_as_uint(f[i]) & 0x7fffffffu));
    }
    if constexpr (BS == 32) key = max(key, __shfl_xor_sync(0xffffffffu, key, 1));

    unsigned sbyte;
    float mult;
    if constexpr (NV) {
        sbyte = nvfp4_scale<HW>(key, S_enc6, S_dec, mult);
    } else {
        sbyte = mx_scale<F, HW>(key, floor_rule);
        mult = mx_multiplier(sbyte);
    }
    if constexpr (RAW) {
        unsigned c[8];
        if (!NV && sbyte - 1u < 253u) {
            // 2^(127 - E) is a normal bf16, so |x| * 2^(127 - E) is exact in bf16 (or far
            // below 0.25 where it is not) and the conversion runs on the bf16 pairs directly.
            const unsigned m2 = ((254u - sbyte) << 7) * 0x10001u;
#pragma unroll
            for (int i = 0; i < 8; ++i)
                c[i] = e2m1x2_mag(bf2_fma(mag[i], m2, 0x80008000u)) | ((r[i] & 0x80008000u) >> 12);
        } else {  // NVFP4, or E = 0, 254 (subnormal or huge multiplier), 255 (NaN): through float
#pragma unroll
            for (int i = 0; i < 8; ++i)
                c[i] = e2m1x2_bf16(bf16x2_rto(mul_rn(__uint_as_float(r[i] << 16), mult),
                                              mul_rn(__uint_as_float(r[i] & 0xffff0000u), mult)));
        }
        pack_e2m1x16(c, w);
    } else {
        float v[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = mul_rn(f[i], mult);
        cvt16<F, HW>(v, w);
    }
    return sbyte;
}

// The segment's codes w at dst, n elements of the row valid from the segment's first.
template <class F, bool VEC>
__device__ __forceinline__ void store_segment(unsigned char* __restrict__ dst, const unsigned* w, i64 n) {
    constexpr int OUT_BYTES = 16 * Fmt<F>::BITS / 8;
    if constexpr (VEC) {
        if constexpr (OUT_BYTES == 16) st16(dst, make_uint4(w[0], w[1], w[2], w[3]));
        else __stcs(reinterpret_cast<uint2*>(dst), make_uint2(w[0], w[1]));
    } else if constexpr (OUT_BYTES == 16) {
#pragma unroll
        for (int i = 0; i < 16; ++i)
            if (i < n) dst[i] = (unsigned char)(w[i / 4] >> (8 * (i % 4)));
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            unsigned char b = (unsigned char)(w[i / 4] >> (8 * (i % 4)));
            if (2 * i + 1 >= n) b &= 0x0f;  // the element after the last is padding: 0
            if (2 * i < n) dst[i] = b;
        }
    }
}

// ---------------------------------------------------------------- NVFP4 codes in float32 arithmetic
// The wide geometry's NVFP4 segments (any input, without the hardware E2M1 conversion). The
// bf16x2 path of quantize_segment spends about 12 integer-pipe instructions per element (the product
// rounded to odd into bf16, the bf16 conversion, the packing), and the integer pipe issues at half
// the float pipe's rate; this path spends most of its instructions in the float pipe.
//
// For a finite v with |v| < 7, the E2M1 code of |v| (nearest, ties to even, saturating at 6) is
// min(rne(2|v|), rne(|v| + 2), rne(|v| / 2 + 4)): g(c) = min(2c, c + 2, c / 2 + 4) maps the E2M1
// values 0, 0.5, 1, 1.5, 2, 3, 4, 6 to their codes 0..7 and is linear between consecutive ones, so
// rne(g(c)) is the nearest code with ties to the even code (the even mantissa), and rne is monotone.
// Above 6, g < 7.5 rounds to 7. Each candidate is one FMA (an add for c + 2) of the float32 |v|
// that adds M (an even integer in [2^23, 2^24), where the float grid is the integers): its one
// rounding is rne of the exact candidate, and the code sits in the low 3 bits of its pattern. Horner's rule then
// packs eight patterns t_i as sum t_i * 16^i mod 2^32: M's bits shift out of 32 bits for i >= 2,
// and element 1 of every eight takes M1 = 2^23 + 0x500000, so that M0 + 16 * M1 = 0x100000000
// cancels them for i = 0, 1.
static constexpr float E2M1_M0 = 8388608.0f;   // 2^23: pattern 0x4b000000
static constexpr float E2M1_M1 = 13631488.0f;  // 2^23 + 0x500000: pattern 0x4b500000

__device__ __forceinline__ float fma_rn_f32(float a, float b, float c) {  // no flush: v may be subnormal
    float r;
    asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
    return r;
}
__device__ __forceinline__ float abs_f32(float a) {  // no flush (abs.ftz would zero a subnormal)
    float r;
    asm("abs.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}

// The pattern whose low 3 bits are the E2M1 code of |x| * mult (x finite, |x| * mult < 7), plus M.
__device__ __forceinline__ unsigned e2m1_mag_pattern(float x, float mult, float M) {
    const float c = mul_rn(abs_f32(x), mult);  // the float32 product the reference rounds
    // the candidates are floats in [2^23, 2^24): their patterns order like them (one 3-input integer min)
    return min(min(__float_as_uint(fma_rn_f32(c, 2.0f, M)), __float_as_uint(add_rn(c, M + 2.0f))),
               __float_as_uint(fma_rn_f32(c, 0.5f, M + 4.0f)));
}

// The sign nibbles of eight elements, the sign of element 2j in bit 15 and of 2j + 1 in bit 31 of
// p[j] (bf16 pairs): byte j of the result has E_2j in its low nibble and E_2j+1 in its high one, E
// all ones for a negative element (-0 included), zero otherwise.
__device__ __forceinline__ unsigned e2m1_sign_nibbles(const unsigned* p) {
    const unsigned a = prmt(p[0], p[1], 0x7351u);  // top bytes: e0, e2, e1, e3
    const unsigned b = prmt(p[2], p[3], 0x7351u);  // e4, e6, e5, e7
    const unsigned even = prmt(a, b, 0xdc98u);     // sign-replicated e0, e2, e4, e6
    const unsigned odd = prmt(a, b, 0xfebau);      // e1, e3, e5, e7
    return (even & 0x0f0f0f0fu) | (odd & 0xf0f0f0f0u);
}

// NVFP4's segment in float32 arithmetic, in two steps: nvfp4_fast_key, the bits of the segment's
// max |x| with NaN propagating (max.NaN: a NaN key compares false with anything); then, where
// |key| * mult < 7 (every element finite and below 7 after scaling), nvfp4_fast_codes, the 8 code
// bytes, equal to quantize_segment's. There is no NaN where the codes are taken, so the key is
// quantize_segment's NaN-ignoring max and gives the same scale byte. Every other segment (a NaN, an
// inf, a block whose scale saturated at 448 or rounded far down among the E4M3 subnormals) goes
// to quantize_segment.
template <bool RAW> __device__ __forceinline__ unsigned nvfp4_fast_key(const float* f, const unsigned* r) {
    unsigned key = 0;
    if constexpr (RAW) {
        unsigned m2 = bf2_absmax_nan(r[0], r[1]);
#pragma unroll
        for (int i = 2; i < 8; ++i) m2 = bf2_absmax_nan(m2, r[i]);
        key = max(m2 & 0x7fffu, (m2 >> 16) & 0x7fffu) << 16;
    } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) key = max(key, __float_as_uint(f[i]) & 0x7fffffffu);  // NaN above inf
    }
    return key;
}

template <bool RAW> __device__ __forceinline__ void nvfp4_fast_codes(const float* f, const unsigned* r, float mult, unsigned* w) {
    unsigned p[8];  // bf16-pair layout words holding the elements' sign bits
#pragma unroll
    for (int i = 0; i < 8; ++i) p[i] = RAW ? r[i] : prmt(__float_as_uint(f[2 * i]), __float_as_uint(f[2 * i + 1]), 0x7632u);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        unsigned t[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int e = 8 * u + i;
            const float x = RAW ? __uint_as_float(e % 2 ? r[e / 2] & 0xffff0000u : r[e / 2] << 16) : f[e];
            t[i] = e2m1_mag_pattern(x, mult, i == 1 ? E2M1_M1 : E2M1_M0);
        }
        unsigned mag = t[7];
#pragma unroll
        for (int i = 6; i >= 0; --i) mag = mag * 16u + t[i];  // codes at bits 4i..4i+2, bit 4i+3 clear
        w[u] = (mag & 0x77777777u) | (e2m1_sign_nibbles(p + 4 * u) & 0x88888888u);
    }
}

// ---------------------------------------------------------------- the tile geometry
static constexpr int TILE_K = 256;             // elements per tile row
static constexpr int TPR = TILE_K / 16;        // threads per tile row (16 elements each)
static constexpr int RPP = THREADS / TPR;      // tile rows per pass: 16
static constexpr int PASSES = TILE_ROWS / RPP;  // 8
static constexpr int GROUP = 4;                // passes whose loads are in flight together

// BS: block size (32 MX, 16 NVFP4). NV: the NVFP4 scale rule. A tile is 128 rows x 256 elements:
// 8 (MX) or 16 (NVFP4) scale blocks per row, i.e. 2 or 4 whole 512-byte units of the swizzled
// layout. Each row segment is read by 16 consecutive lanes (512 contiguous bytes for bf16).
template <typename T, class F, int BS, bool NV, bool VEC, bool HW>
__device__ __forceinline__ void block_quantize(const T* __restrict__ x, unsigned char* __restrict__ q,
                                               unsigned char* __restrict__ scales, const QuantArgs& a) {
    constexpr int TPB = BS / 16;            // threads per scale block: 2 or 1
    constexpr int BPR = TILE_K / BS;        // scale blocks per tile row: 8 or 16
    constexpr int UNITS = BPR / 4;          // swizzle units per tile: 2 or 4
    constexpr bool RAW = Raw<T, F, HW>::value;
    __shared__ __align__(16) unsigned char tile_scales[UNITS * 512];

    const int lane_k = threadIdx.x % TPR;
    const int r0 = threadIdx.x / TPR;
    const i64 rt = (i64)blockIdx.x / a.n_ktiles;
    const i64 kt = (i64)blockIdx.x - rt * a.n_ktiles;
    const i64 k0 = kt * TILE_K + lane_k * 16;
    const bool col_ok = k0 < a.K;

    float S_enc6 = 0.0f, S_dec = 0.0f;
    if constexpr (NV) {
        const float S_enc = nvfp4_block_factors(a, S_enc6, S_dec);
        if (blockIdx.x == 0 && threadIdx.x == 0) *a.gs_out = S_enc;
    }

#pragma unroll 1
    for (int g = 0; g < PASSES / GROUP; ++g) {
        float f[RAW ? 1 : GROUP][16];
        unsigned r[RAW ? GROUP : 1][8];
#pragma unroll
        for (int j = 0; j < GROUP; ++j) {  // the group's loads are all issued before any use
            const i64 row = rt * TILE_ROWS + (g * GROUP + j) * RPP + r0;
            const T* src = x + row * a.row_stride + k0;
            const bool in = row < a.rows && col_ok;
            load_segment<T, RAW, VEC>(src, in, a.K - k0, f[RAW ? 0 : j], r[RAW ? j : 0]);
        }
#pragma unroll
        for (int j = 0; j < GROUP; ++j) {
            const int row_local = (g * GROUP + j) * RPP + r0;
            const i64 row = rt * TILE_ROWS + row_local;
            unsigned w[4];
            const unsigned sbyte = quantize_segment<F, BS, NV, HW, RAW>(f[RAW ? 0 : j], r[RAW ? j : 0], S_enc6, S_dec,
                                                                        a.floor_rule != 0, w);
            if (row < a.rows && col_ok) store_segment<F, VEC>(q + row * a.q_row + k0 * Fmt<F>::BITS / 8, w, a.K - k0);
            if (lane_k % TPB == 0) {
                const int kb = lane_k / TPB;
                tile_scales[(kb / 4) * 512 + (row_local % 32) * 16 + (row_local / 32) * 4 + kb % 4] = (unsigned char)sbyte;
            }
        }
    }
    __syncthreads();
    if (a.swizzled) {
        if (threadIdx.x < UNITS * 32) {
            const int u = threadIdx.x / 32;
            const i64 unit = kt * UNITS + u;
            if (unit < a.n_units) {
                const uint4 v = *reinterpret_cast<const uint4*>(tile_scales + threadIdx.x * 16);
                st16(scales + ((rt * a.n_units + unit) * 512 + (threadIdx.x % 32) * 16), v);
            }
        }
    } else if (threadIdx.x < TILE_ROWS) {
        const int rl = threadIdx.x;
        const i64 row = rt * TILE_ROWS + rl;
        if (row < a.rows) {
            unsigned words[UNITS];
#pragma unroll
            for (int u = 0; u < UNITS; ++u)
                words[u] = *reinterpret_cast<const unsigned*>(tile_scales + u * 512 + (rl % 32) * 16 + (rl / 32) * 4);
            const i64 kb0 = kt * BPR;
            unsigned char* dst = scales + row * a.n_blocks + kb0;
            if (a.n_blocks % BPR == 0) {  // whole, aligned: one 8- or 16-byte store
                if constexpr (UNITS == 2) *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
                else *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
            } else {
                for (int j = 0; j < BPR && kb0 + j < a.n_blocks; ++j) dst[j] = (unsigned char)(words[j / 4] >> (8 * (j % 4)));
            }
        }
    }
}

// ---------------------------------------------------------------- the small geometry
// For few rows (the host picks it where the tile grid would give each SM fewer than two tiles): one
// thread per segment, so that every segment's loads are in flight at once, and only the padding
// rows of the swizzled layout (rows past the tensor in its last 128-row tile) written by threads
// that load nothing. Block (SMALL_THREADS threads) = (bx, by): thread (tx, ty) of block (i, j)
// takes segment j * bx + tx of row i * by + ty. A row has a.n_units * 4 * BS / 16 segments (its
// scale blocks rounded up to whole 4-byte words of the swizzled layout; those past K read as zeros
// and give the padding columns' zero scales), and bx, a power of two that divides that count, is a
// multiple of the 4 * BS / 16 segments of one word: the word's segments are consecutive lanes of one
// warp, which gathers the word with three shuffles and stores it with one 4-byte store. Dense
// scales are one byte store per block. Blocks i >= a.row_blocks zero the padding rows, 16 bytes a
// thread (the 16 bytes of rows c, c + 32, c + 64, c + 96 of a unit; a 4-byte word each where some
// of those rows hold data).
static constexpr int SMALL_THREADS = 128;

template <typename T, class F, int BS, bool NV, bool VEC, bool HW>
__device__ __forceinline__ void small_quantize(const T* __restrict__ x, unsigned char* __restrict__ q,
                                               unsigned char* __restrict__ scales, const QuantArgs& a) {
    constexpr int TPB = BS / 16;   // threads per scale block: 2 or 1
    constexpr int WORD = 4 * TPB;  // threads per 4-byte scale word
    constexpr bool RAW = Raw<T, F, HW>::value;

    if ((i64)blockIdx.x >= a.row_blocks) {  // the padding rows of the last 128-row tile
        const i64 i = (((i64)blockIdx.x - a.row_blocks) * gridDim.y + blockIdx.y) * SMALL_THREADS +
                      threadIdx.y * blockDim.x + threadIdx.x;
        if (i >= a.n_units * 32) return;
        const int data_rows = (int)(a.rows & (TILE_ROWS - 1));  // rows of the tile that hold data, 1..127
        const int c = (int)(i & 31);
        unsigned char* dst = scales + ((a.rows >> 7) * a.n_units + (i >> 5)) * 512 + c * 16;
        if (c >= data_rows) {
            st16(dst, make_uint4(0u, 0u, 0u, 0u));
        } else {
#pragma unroll
            for (int j = 1; j < 4; ++j)
                if (c + 32 * j >= data_rows) *reinterpret_cast<unsigned*>(dst + 4 * j) = 0u;
        }
        return;
    }

    const i64 row = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    const i64 seg = (i64)blockIdx.y * blockDim.x + threadIdx.x;
    const i64 k0 = seg * 16;
    const bool in = row < a.rows && k0 < a.K;

    float S_enc6 = 0.0f, S_dec = 0.0f;
    if constexpr (NV) {
        const float S_enc = nvfp4_block_factors(a, S_enc6, S_dec);
        if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) *a.gs_out = S_enc;
    }

    float f[RAW ? 1 : 16];
    unsigned r[RAW ? 8 : 1];
    load_segment<T, RAW, VEC>(x + row * a.row_stride + k0, in, a.K - k0, f, r);
    unsigned w[4];
    const unsigned sbyte = quantize_segment<F, BS, NV, HW, RAW>(f, r, S_enc6, S_dec, a.floor_rule != 0, w);
    if (in) store_segment<F, VEC>(q + row * a.q_row + k0 * Fmt<F>::BITS / 8, w, a.K - k0);

    const i64 kb = seg / TPB;
    if (a.swizzled) {
        unsigned word = sbyte;
#pragma unroll
        for (int i = 1; i < 4; ++i) word |= __shfl_down_sync(0xffffffffu, sbyte, i * TPB) << (8 * i);
        if (row < a.rows && seg % WORD == 0)
            *reinterpret_cast<unsigned*>(scales + ((row >> 7) * a.n_units + (kb >> 2)) * 512 + (row & 31) * 16 + ((row >> 5) & 3) * 4) = word;
    } else if (row < a.rows && seg % TPB == 0 && kb < a.n_blocks) {
        scales[row * a.n_blocks + kb] = (unsigned char)sbyte;
    }
}

// ---------------------------------------------------------------- the wide geometry
// For many rows: the small geometry's mapping along a row (a thread per segment, bx consecutive
// lanes on consecutive segments, the segments of a 4-byte swizzled scale word in one warp), but each
// thread takes its segment in WIDE_ROWS rows r, r + 32, r + 64, r + 96 of one 128-row tile, every
// load issued before any is used. Those four rows' scale words are one 16-byte chunk of a swizzled
// unit, which the thread holding the word's first segment stores with one 16-byte store after a
// transpose of four lanes' bytes (three shuffles, six byte permutes); dense scales are a byte store
// per row and block. The grid covers whole 128-row tiles, so rows past the tensor read as zeros
// and write the swizzled layout's zero padding rows (nothing else for dense scales). NVFP4 takes
// nvfp4_fast_codes for all four rows where it applies to all four, quantize_segment for all four
// otherwise (and MX always).
// Block (bx, by), bx * by = SMALL_THREADS: block (i, j) takes segment j * bx + tx of rows
// (i / (32 / by)) * 128 + (i % (32 / by)) * by + ty + 32 * n, n < WIDE_ROWS.
static constexpr int WIDE_ROWS = 4;

template <typename T, class F, int BS, bool NV, bool VEC, bool HW>
__device__ __forceinline__ void wide_quantize(const T* __restrict__ x, unsigned char* __restrict__ q,
                                              unsigned char* __restrict__ scales, const QuantArgs& a) {
    constexpr int TPB = BS / 16;  // threads per scale block: 2 or 1
    constexpr bool RAW = Raw<T, F, HW>::value;
    constexpr bool FAST = NV && !(HW && CQ_HAS_FP4_CVT);

    const int lg = 5 - (31 - __clz(blockDim.y));  // blocks per 128-row tile: 1 << lg (blockDim.y = 32 >> lg)
    const i64 tile = (i64)(blockIdx.x >> lg);
    const i64 row0 = tile * TILE_ROWS + (i64)(blockIdx.x & ((1u << lg) - 1u)) * blockDim.y + threadIdx.y;
    const i64 seg = (i64)blockIdx.y * blockDim.x + threadIdx.x;
    const i64 k0 = seg * 16;

    float f[RAW ? 1 : WIDE_ROWS][RAW ? 1 : 16];
    unsigned r[RAW ? WIDE_ROWS : 1][8];
#pragma unroll
    for (int n = 0; n < WIDE_ROWS; ++n) {  // every load issued first, before the global scale's
        const i64 row = row0 + 32 * n;
        load_segment<T, RAW, VEC>(x + row * a.row_stride + k0, row < a.rows && k0 < a.K, a.K - k0, f[RAW ? 0 : n],
                                  r[RAW ? n : 0]);
    }
    float S_enc6 = 0.0f, S_dec = 0.0f;
    if constexpr (NV) {
        const float S_enc = nvfp4_block_factors(a, S_enc6, S_dec);
        if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) *a.gs_out = S_enc;
    }
    auto put = [&](int n, const unsigned* w) {
        const i64 row = row0 + 32 * n;
        if (row < a.rows && k0 < a.K) store_segment<F, VEC>(q + row * a.q_row + k0 * Fmt<F>::BITS / 8, w, a.K - k0);
    };
    unsigned sb[WIDE_ROWS];
    bool general = true;
    if constexpr (FAST) {  // the rows' scales, their reciprocals under one test, one branch for all
        unsigned key[WIDE_ROWS];
        float den[WIDE_ROWS], mult[WIDE_ROWS];
#pragma unroll
        for (int n = 0; n < WIDE_ROWS; ++n) {
            key[n] = nvfp4_fast_key<RAW>(f[RAW ? 0 : n], r[RAW ? n : 0]);
            sb[n] = nvfp4_scale_byte<HW>(key[n], S_enc6);
            den[n] = nvfp4_mult_denominator(sb[n], S_dec);
        }
        rcp_rn_n<WIDE_ROWS>(den, mult);
        bool fast = true;
#pragma unroll
        for (int n = 0; n < WIDE_ROWS; ++n) {
            mult[n] = fmin_ieee(mult[n], FLT_MAX_F);
            fast = fast && mul_rn(__uint_as_float(key[n]), mult[n]) < 7.0f;  // a NaN key: false
        }
        if (fast) {
#pragma unroll
            for (int n = 0; n < WIDE_ROWS; ++n) {
                unsigned w[2];
                nvfp4_fast_codes<RAW>(f[RAW ? 0 : n], r[RAW ? n : 0], mult[n], w);
                put(n, w);
            }
            general = false;
        }
    }
    if (general) {
#pragma unroll
        for (int n = 0; n < WIDE_ROWS; ++n) {
            unsigned w[4];
            sb[n] = quantize_segment<F, BS, NV, HW, RAW>(f[RAW ? 0 : n], r[RAW ? n : 0], S_enc6, S_dec, a.floor_rule != 0, w);
            put(n, w);
        }
    }

    const i64 kb = seg / TPB;
    if (a.swizzled) {
        // byte n of p: row r + 32n's scale; word n of the chunk: that row's bytes of four blocks
        const unsigned p = sb[0] | (sb[1] << 8) | (sb[2] << 16) | (sb[3] << 24);
        const unsigned p1 = __shfl_down_sync(0xffffffffu, p, TPB);
        const unsigned p2 = __shfl_down_sync(0xffffffffu, p, 2 * TPB);
        const unsigned p3 = __shfl_down_sync(0xffffffffu, p, 3 * TPB);
        if (seg % (4 * TPB) == 0) {
            const unsigned lo0 = prmt(p, p1, 0x5140u), lo1 = prmt(p2, p3, 0x5140u);  // bytes 0, 1 of each
            const unsigned hi0 = prmt(p, p1, 0x7362u), hi1 = prmt(p2, p3, 0x7362u);  // bytes 2, 3
            const uint4 v = make_uint4(prmt(lo0, lo1, 0x5410u), prmt(lo0, lo1, 0x7632u), prmt(hi0, hi1, 0x5410u),
                                       prmt(hi0, hi1, 0x7632u));
            st16(scales + ((tile * a.n_units + (kb >> 2)) * 512 + (row0 & 31) * 16), v);
        }
    } else if (seg % TPB == 0 && kb < a.n_blocks) {
#pragma unroll
        for (int n = 0; n < WIDE_ROWS; ++n) {
            const i64 row = row0 + 32 * n;
            if (row < a.rows) scales[row * a.n_blocks + kb] = (unsigned char)sb[n];
        }
    }
}

// ---------------------------------------------------------------- the dequantizer
struct DequantArgs {
    i64 rows, K;
    i64 q_row;     // bytes per row of q
    i64 n_blocks;  // scale blocks per row
    int swizzled;
    const float* gs_ptr;  // NVFP4: S_enc
};

// Eight E2M1 codes (the nibbles of w, element 0 lowest) -> their values as four bf16x2 words, exact.
// Two byte permutes look up the high and low bytes of four magnitudes' bf16 patterns (0, 0.5, 1,
// 1.5, 2, 3, 4, 6 are 0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0), two more
// interleave them, and prmt's sign-replicating mode (selector nibble bit 3) spreads each code's
// sign bit, the top bit of a byte of w (odd elements) or of w << 4 (even elements).
__device__ __forceinline__ void e2m1x8_to_bf16x2(unsigned w, unsigned* o) {
    const unsigned w4 = w << 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const unsigned sel = (w >> (16 * h)) & 0x7777u;
        const unsigned hb = prmt(0x3f3f3f00u, 0x40404040u, sel);
        const unsigned lb = prmt(0xc0800000u, 0xc0804000u, sel);
        o[2 * h] = prmt(lb, hb, 0x5140u) | (prmt(w4, w, h ? 0xe0a0u : 0xc080u) & 0x80008000u);
        o[2 * h + 1] = prmt(lb, hb, 0x7362u) | (prmt(w4, w, h ? 0xf0b0u : 0xd090u) & 0x80008000u);
    }
}

__device__ __forceinline__ i64 scale_offset(const DequantArgs& a, i64 m, i64 k) {
    if (!a.swizzled) return m * a.n_blocks + k;
    const i64 kt = (a.n_blocks + 3) >> 2;
    return ((m >> 7) * kt + (k >> 2)) * 512 + (m & 31) * 16 + ((m >> 5) & 3) * 4 + (k & 3);
}

// Work split. A piece is 8 consecutive elements of a row (4 bytes of FP4, 8 of FP8; 16 bytes of
// bf16/fp16 out). A warp takes a span of 32 x PIECES consecutive pieces of one row, lane l pieces
// l, l + 32, l + 64, l + 96: every load and store instruction of the warp covers one contiguous
// stretch, and each thread has PIECES loads in flight. Grid (rows, ceil(spans / blockDim.y)),
// blockDim (32, warps).
static constexpr int PIECES = 4;

template <typename T, class F, int BS, bool NV, bool VEC>
__device__ __forceinline__ void block_dequantize(const unsigned char* __restrict__ q, const unsigned char* __restrict__ scales,
                                                 T* __restrict__ y, const DequantArgs& a) {
    constexpr bool FP4 = Fmt<F>::BITS == 4;
    const i64 row = blockIdx.x;
    const i64 span = (i64)blockIdx.y * blockDim.y + threadIdx.y;
    const i64 n8 = (a.K + 7) >> 3;  // pieces per row
    const i64 c0 = span * (32 * PIECES) + threadIdx.x;
    if (c0 >= n8) return;
    const unsigned char* qrow = q + row * a.q_row;

    unsigned w[PIECES][2];
    unsigned sb[PIECES];
#pragma unroll
    for (int p = 0; p < PIECES; ++p) {  // all loads first
        const i64 c = c0 + 32 * p;
        w[p][0] = w[p][1] = 0u;
        sb[p] = 0u;
        if (c < n8) {
            const i64 k = c * 8;
            sb[p] = scales[scale_offset(a, row, k / BS)];
            if constexpr (VEC) {  // K % 8 == 0 and aligned rows
                if constexpr (FP4) {
                    w[p][0] = __ldg(reinterpret_cast<const unsigned*>(qrow + k / 2));
                } else {
                    const uint2 v = __ldg(reinterpret_cast<const uint2*>(qrow + k));
                    w[p][0] = v.x; w[p][1] = v.y;
                }
            } else {
                const i64 n = a.K - k;
                constexpr int NB = FP4 ? 4 : 8;
#pragma unroll
                for (int i = 0; i < NB; ++i)
                    if (i * 8 / Fmt<F>::BITS < n) w[p][i / 4] |= (unsigned)qrow[(FP4 ? k / 2 : k) + i] << (8 * (i % 4));
            }
        }
    }
    float S_dec = 0.0f;
    if constexpr (NV) S_dec = rcp_rn(*a.gs_ptr);

#pragma unroll
    for (int p = 0; p < PIECES; ++p) {
        const i64 c = c0 + 32 * p;
        if (c >= n8) break;
        const i64 k = c * 8;
        T* d = y + row * a.K + k;
        float v[8];
        if constexpr (FP4) {
            unsigned b[4];
            e2m1x8_to_bf16x2(w[p][0], b);
            if constexpr (!NV && same_type<T, __nv_bfloat16>::value && VEC) {
                // MX to bf16 with a normal scale (E = 1..254): the bf16 pairs times 2^(E - 127) in
                // bf16 arithmetic, one rounding of the exact product, as float32 (where that product
                // is always exact) and then bf16 would round it.
                if (sb[p] - 1u < 254u) {
                    const unsigned s2 = (sb[p] << 7) * 0x10001u;
#pragma unroll
                    for (int i = 0; i < 4; ++i) b[i] = bf2_fma(b[i], s2, 0x80008000u);
                    st16(d, make_uint4(b[0], b[1], b[2], b[3]));
                    continue;
                }
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                v[2 * i] = __uint_as_float(b[i] << 16);
                v[2 * i + 1] = __uint_as_float(b[i] & 0xffff0000u);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 4; ++i) fp8x2_to_float2<F>((unsigned short)(w[p][i / 2] >> (16 * (i % 2))), v[2 * i], v[2 * i + 1]);
        }
        float s;
        if constexpr (NV) s = mul_rn(fp8_to_float<E4M3>((unsigned char)sb[p]), S_dec);
        else s = e8m0_to_float(sb[p]);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = mul_rn(v[i], s);
        if constexpr (VEC) {
            constexpr int N = Vec16<T>::N;
#pragma unroll
            for (int i = 0; i < 8 / N; ++i) st16(d + i * N, pack16<T>(v + i * N));
        } else {
            const i64 n = a.K - k;
#pragma unroll
            for (int i = 0; i < 8; ++i)
                if (i < n) d[i] = from_float<T>(v[i]);
        }
    }
}
