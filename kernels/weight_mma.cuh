// weight_mma.cuh: what the weight kernels (weight_quant.cu, weight_decode.cu, weight_sm80_gemm.cu, weight_sm90_gemm.cu) share: the scheme ids, the
// fp16/bf16 pair arithmetic that dequantizes INT4 codes, and the m16n8k16 tensor-core multiply.
#pragma once

#include "cluster.cuh"
#include "common.cuh"

#define W_INT4 0   // symmetric, codes q - 8
#define W_UINT4 1  // asymmetric, codes q - z
#define W_FP8 2    // E4M3 values
#define W_NVFP4 4  // E2M1 values, an E4M3 scale per 16 k and a float32 scale_2 per weight
#define W_MXFP4 5  // E2M1 values, an E8M0 scale per 32 k (3 is weight_quant.cu's W_INT8)
#define W_FP8_BLOCK 6  // E4M3 values, a float32 scale per row and 128 k (128 x 128 block weights, prepared)

// Both FP8 schemes: the same bytes and layout, scales in T (W_FP8) or float32 (W_FP8_BLOCK).
__host__ __device__ constexpr bool is_fp8_scheme(int s) { return s == W_FP8 || s == W_FP8_BLOCK; }


template <typename T> struct HalfOps;
template <> struct HalfOps<__half> {
    static constexpr unsigned MAGIC = 0x64006400u;  // 1024.0 in each half
    static __device__ __forceinline__ unsigned fma2(unsigned a, unsigned b, unsigned c) {
        unsigned d;
        asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
        return d;
    }
    // a * (b's low half in both halves) + c: ptxas reads b through an operand selector (SASS .H0_H0)
    static __device__ __forceinline__ unsigned fma2_lo(unsigned a, unsigned b, unsigned c) {
        unsigned d;
        asm("{.reg .b16 l, h; .reg .b32 bb; mov.b32 {l, h}, %2; mov.b32 bb, {l, l}; fma.rn.f16x2 %0, %1, bb, %3;}"
            : "=r"(d) : "r"(a), "r"(b), "r"(c));
        return d;
    }
    // the same with b's high half (SASS .H1_H1)
    static __device__ __forceinline__ unsigned fma2_hi(unsigned a, unsigned b, unsigned c) {
        unsigned d;
        asm("{.reg .b16 l, h; .reg .b32 bb; mov.b32 {l, h}, %2; mov.b32 bb, {h, h}; fma.rn.f16x2 %0, %1, bb, %3;}"
            : "=r"(d) : "r"(a), "r"(b), "r"(c));
        return d;
    }
};
template <> struct HalfOps<__nv_bfloat16> {
    static constexpr unsigned MAGIC = 0x43004300u;  // 128.0 in each half
    static __device__ __forceinline__ unsigned fma2(unsigned a, unsigned b, unsigned c) {
        unsigned d;
        asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
        return d;
    }
    static __device__ __forceinline__ unsigned fma2_lo(unsigned a, unsigned b, unsigned c) {
        unsigned d;
        asm("{.reg .b16 l, h; .reg .b32 bb; mov.b32 {l, h}, %2; mov.b32 bb, {l, l}; fma.rn.bf16x2 %0, %1, bb, %3;}"
            : "=r"(d) : "r"(a), "r"(b), "r"(c));
        return d;
    }
    static __device__ __forceinline__ unsigned fma2_hi(unsigned a, unsigned b, unsigned c) {
        unsigned d;
        asm("{.reg .b16 l, h; .reg .b32 bb; mov.b32 {l, h}, %2; mov.b32 bb, {h, h}; fma.rn.bf16x2 %0, %1, bb, %3;}"
            : "=r"(d) : "r"(a), "r"(b), "r"(c));
        return d;
    }
};

__device__ __forceinline__ unsigned lop3_and_or(unsigned a, unsigned mask, unsigned magic) {
    unsigned d;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(a), "r"(mask), "r"(magic));  // (a & mask) | magic
    return d;
}

// Fragment-ordered INT4 (weight/layout.py prepared_of): a lane's 32-bit word of a k16 step holds the 8
// codes of its A fragment, register j % 4 in nibble j (half 0) and nibble j + 4 (half 1); registers
// 0 and 2 are row g, 1 and 3 row g + 8. frag_codes gives register j with the magic exponent ORed in:
// fp16 1024 + q (j even: mask 0x000f000f) or 1024 + 16 q (j odd: mask 0x00f000f0), from the word
// shifted right by 8 for j >= 2 (one shift and four lop3 a word); bf16, whose 7 mantissa bits
// cannot take a code at bit 4, 128 + q from the word shifted right by 4 j (three shifts, four
// lop3). Then x * frag_mul(row) + frag_zero_bias(z, row) = q - z exactly.
template <typename T> __device__ __forceinline__ unsigned frag_codes(unsigned word, int j) {
    if constexpr (cq::same_type<T, __half>::value) {
        return lop3_and_or(j >= 2 ? word >> 8 : word, (j & 1) ? 0x00f000f0u : 0x000f000fu, HalfOps<T>::MAGIC);
    } else {
        return lop3_and_or(word >> (4 * j), 0x000f000fu, HalfOps<T>::MAGIC);
    }
}
// the multiplier pair of row (0: g, 1: g + 8): fp16 (1, 1) or (1/16, 1/16), bf16 (1, 1)
template <typename T> __host__ __device__ constexpr unsigned frag_mul(int row) {
    return cq::same_type<T, __half>::value ? (row ? 0x2c002c00u : 0x3c003c00u) : 0x3f803f80u;
}
// -(1024 + z), -(64 + z) (fp16 rows g, g + 8) or -(128 + z) (bf16) in both halves, z in 0..15: the
// bits of 1024 + z are 0x6400 + z, of 64 + z 0x5400 + 16 z, of 128 + z 0x4300 + z
template <typename T> __host__ __device__ constexpr unsigned frag_zero_bias(unsigned z, int row) {
    return ((cq::same_type<T, __half>::value ? (row ? 0x5400u + 16u * z : 0x6400u + z) : 0x4300u + z) | 0x8000u) * 0x10001u;
}

// FP4 weights (W_NVFP4, W_MXFP4) in the fragment order of INT4 (the chunks' 4 x 4 blocks of 8 k
// transposed). The tensor cores take w' = e2m1(q) * s * 2^-C, s the block scale and C =
// fp4_shift<T, S>(), and the float32 sums are multiplied by 2^C (and NVFP4's scale_2) at the end
// (fp4_out_scale). w' is exact in fp16 and bf16 for every E4M3 scale with C = 7 (|e2m1 * s| is a
// multiple of 2^-10 with at most 6 significant bits, at most 2688), and for E8M0 scales 2^e with
// -16 <= e <= 8 (fp16, C = 7: fp16's range is 2^-24..2^16) or -108 <= e <= 25 (bf16, C = 24, which
// puts bf16's wide range where weights are: up to 6 * 2^25).
template <typename T, int S> __host__ __device__ constexpr int fp4_shift() {
    return S == W_MXFP4 && !cq::same_type<T, __half>::value ? 24 : 7;
}
template <typename T> struct Fp4Bits;
template <> struct Fp4Bits<__half> {
    static constexpr int SHIFT = 3, BIAS = 14;  // 2-bit exponent and mantissa bit to fp16 bits 11..9: e2m1 * 2^-14
    static constexpr unsigned MAG = 0x0e000e00u;
};
template <> struct Fp4Bits<__nv_bfloat16> {
    static constexpr int SHIFT = 6, BIAS = 126;  // to bf16 bits 8..6: e2m1 * 2^-126
    static constexpr unsigned MAG = 0x01c001c0u;
};
// Register j of a fragment-ordered word of E2M1 codes (nibble j in half 0 and j + 4 in half 1, as
// frag_codes): each half e2m1 * 2^-BIAS exactly. The sign goes to bit 15, the two exponent bits
// and the mantissa bit to the 16-bit type's low exponent bits and top mantissa bit (bits
// 14 - SHIFT .. 12 - SHIFT); a zero exponent (0 and 0.5) becomes the type's subnormal of the same
// scale. The word rotated right by SHIFT (x) holds nibble n's three value bits at 4 n - SHIFT (mod
// 32), SHIFT + 3 below its sign bit in the word: the distance of the targets. A select of x's
// value bits and the word's sign bits (u) holds the eight bits of register j and of its partner
// j ^ 1 (bf16) or j ^ 2 (fp16), whose bits do not collide with j's; u rotated left by 12 - 4 j
// and masked is register j. A word's four registers: one rotate, two selects, three rotates and
// four masks (10 instructions, where a shift pair and two masks a register take 15); the rotate
// and the selects are common to the calls on one word. On the device the rotates and the select are
// PTX (shf.l.wrap, lop3), which the compiler does not take apart: written in C++ they become shifts,
// masks and multiply-adds again (16 instructions a word).
__host__ __device__ constexpr unsigned fp4_rotl(unsigned x, int n) { return (n & 31) ? (x << (n & 31)) | (x >> (32 - (n & 31))) : x; }
__host__ __device__ __forceinline__ unsigned fp4_rot(unsigned x, int n) {  // x rotated left by n (mod 32)
#ifdef __CUDA_ARCH__
    if ((n & 31) == 0) return x;
    unsigned d;
    asm("shf.l.wrap.b32 %0, %1, %1, %2;" : "=r"(d) : "r"(x), "r"(n & 31));
    return d;
#else
    return fp4_rotl(x, n);
#endif
}
__host__ __device__ __forceinline__ unsigned fp4_select(unsigned a, unsigned b, unsigned m) {  // a's bits where m has ones, b's elsewhere
#ifdef __CUDA_ARCH__
    unsigned d;
    asm("lop3.b32 %0, %1, %2, %3, 0xe4;" : "=r"(d) : "r"(a), "r"(b), "r"(m));
    return d;
#else
    return (a & m) | (b & ~m);
#endif
}
template <typename T> __host__ __device__ __forceinline__ unsigned fp4_frag(unsigned word, int j) {
    constexpr int SH = Fp4Bits<T>::SHIFT;
    const int p = j ^ (SH == 6 ? 1 : 2);  // the partner register
    const unsigned vals = fp4_rotl(0x7u << (4 * j), -SH) | fp4_rotl(0x7u << (4 * j + 16), -SH) |  // x's value bits of j and p
                          fp4_rotl(0x7u << (4 * p), -SH) | fp4_rotl(0x7u << (4 * p + 16), -SH);
    const unsigned u = fp4_select(fp4_rot(word, -SH), word, vals);
    return fp4_rot(u, 12 - 4 * j) & (0x80008000u | Fp4Bits<T>::MAG);
}
// 2^n as float, for -126 <= n <= 127 (exact; for constant n)
__host__ __device__ constexpr float fp4_pow2(int n) { return n > 0 ? 2.0f * fp4_pow2(n - 1) : n < 0 ? 0.5f * fp4_pow2(n + 1) : 1.0f; }
// The block scale of scale byte b (NVFP4: E4M3; MXFP4: E8M0, 2^(b - 127)) times 2^(BIAS - C) in
// both halves of a T pair, so that fp4_frag * fp4_scale2 = e2m1 * s * 2^-C. E4M3: |s| = v * 2^-9
// with the integer v = (8 + m) << (e - 1), or m when e = 0 (exact in float32).
template <typename T, int S> __device__ __forceinline__ unsigned fp4_scale2(unsigned b) {
    constexpr int P = Fp4Bits<T>::BIAS - fp4_shift<T, S>();  // 7 (fp16), 119 (bf16 NVFP4) or 102 (bf16 MXFP4)
    float f;
    if constexpr (S == W_NVFP4) {
        const unsigned m = b & 7u, e = (b >> 3) & 15u;
        const unsigned v = e ? (8u + m) << (e - 1) : m;
        constexpr float K = fp4_pow2(P - 9);
        f = cq::mul_rn((float)v, K);
        if (b & 0x80u) f = -f;
    } else {
        const float e = __uint_as_float(b ? (b & 0xffu) << 23 : 0x00400000u);  // 2^(b - 127); 2^-127 is subnormal
        constexpr float K = fp4_pow2(P);
        f = cq::mul_rn(e, K);
    }
    return (unsigned)cq::bits16_rn<T>(f) * 0x10001u;
}
// E4M3 bytes 2 i and 2 i + 1 of a word as an fp16 pair (exact: every E4M3 value is an fp16 normal
// or zero). sm_89+: the fp8 -> f16x2 conversion of half i of the word, which SASS reads through an
// operand selector (no shift for i = 1); elsewhere cuda_fp8.h's software conversion.
__device__ __forceinline__ unsigned e4m3x2_to_f16x2(unsigned bytes, int i) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned d;
    if (i == 0) asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, l;}" : "=r"(d) : "r"(bytes));
    else asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, h;}" : "=r"(d) : "r"(bytes));
    return d;
#else
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)((bytes >> (16 * i)) & 0xffffu), __NV_E4M3);
    return (unsigned)h.x | ((unsigned)h.y << 16);
#endif
}
// Four scale bytes (byte i the scale of slot i) -> sc[0] = slots (0, 1), sc[1] = slots (2, 3), each
// half s * 2^(BIAS - C) as fp4_scale2 gives it (a register's multiplier is then one half, read by
// fma2_lo / fma2_hi). NVFP4: the E4M3 pairs as fp16 pairs (e4m3x2_to_f16x2), then times 2^7
// (fp16), or (bf16) each value through float32 rounded to bf16 (exact: 4 significant bits) and the
// pair times 2^119 in one bf16 multiply (exact: the products lie in 2^110 .. 1.75 * 2^127, bf16
// normals, and zeros keep their sign). MXFP4: the exponent field of 2^(b - 127 + BIAS - C), b - 105
// (fp16) or b + 102 (bf16), in each 16-bit half, clamped so that a scale past the type's range is 0
// or inf (fp16 holds 2^-21..2^8 for scales, bf16 2^-127..2^25; an E8M0 NaN acts as inf).
template <typename T, int S> __device__ __forceinline__ void fp4_scale_pairs(unsigned bytes, unsigned (&sc)[2]) {
    constexpr bool F16 = cq::same_type<T, __half>::value;
    static_assert(fp4_shift<T, S>() == (S == W_MXFP4 && !F16 ? 24 : 7), "the constants below assume these shifts");
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if constexpr (S == W_NVFP4) {
            const unsigned hh = e4m3x2_to_f16x2(bytes, i);
            if constexpr (F16) {
                sc[i] = HalfOps<__half>::fma2(hh, 0x58005800u, 0x80008000u);  // times 128, exact
            } else {
                const float lo = __half2float(__ushort_as_half((unsigned short)(hh & 0xffffu)));
                const float hi = __half2float(__ushort_as_half((unsigned short)(hh >> 16)));
                const unsigned p = (unsigned)cq::bits16_rn<__nv_bfloat16>(lo) | ((unsigned)cq::bits16_rn<__nv_bfloat16>(hi) << 16);
                sc[i] = HalfOps<__nv_bfloat16>::fma2(p, 0x7b007b00u, 0x80008000u);  // times 2^119 (bf16 0x7b00), exact
            }
        } else {
            const unsigned p = __byte_perm(bytes >> (16 * i), 0u, 0x4140);  // b(2 i) in the low half, b(2 i + 1) in the high
            if constexpr (F16) {
                sc[i] = __vmins2(__vmaxs2(__vsub2(p, 0x00690069u), 0u), 0x001f001fu) << 10;
            } else {
                sc[i] = __vminu2(p + 0x00660066u, 0x00ff00ffu) << 7;
            }
        }
    }
}
// 2^C, times NVFP4's float32 scale_2: what the float32 sums of w' are multiplied by.
template <typename T, int S> __device__ __forceinline__ float fp4_out_scale(const float* scale_2) {
    constexpr float P = fp4_pow2(fp4_shift<T, S>());
    return S == W_NVFP4 ? cq::mul_rn(P, __ldg(scale_2)) : P;
}

// FP8 weights (W_FP8) are dequantized to T before the mma, as dequantize_weight does it: each E4M3
// value times its group's scale s (in T), rounded once to T. Every E4M3 value is an fp16 normal or
// zero, so the fp8 -> f16x2 conversion is exact (one instruction on sm_89+, exact software
// elsewhere); fp16 then multiplies in one rounding (the product of an E4M3 value and an fp16 scale
// is exact before it), bf16 multiplies in float32 (exact: 4 and 8 significant bits) and rounds
// once to bf16.

// The fp16 / bf16 value with bits b (low 16 bits), as float (exact).
template <typename T> __device__ __forceinline__ float bits16_to_float(unsigned b) {
    if constexpr (cq::same_type<T, __half>::value) return __half2float(__ushort_as_half((unsigned short)b));
    else return __uint_as_float(b << 16);
}
// Two E4M3 bytes (b: byte 0 the low half) -> their values times s as a T pair, one rounding each.
// s2 holds s's bits in both halves (read by fp16), sf is s as float (read by bf16).
// F32 (W_FP8_BLOCK: a float32 block scale sf, never rounded to 16 bits): each value times sf in an
// IEEE float32 multiply (mul.rn, no flush), then rounded once to T, for fp16 and bf16 alike: the
// bits of dequantize_weight_blocks(q, s, T) (round_to(float32(fp8(q) * s), T)).
template <typename T, bool F32 = false>
__device__ __forceinline__ unsigned fp8x2_scaled(unsigned short b, unsigned s2, float sf) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(b, __NV_E4M3);
    if constexpr (cq::same_type<T, __half>::value && !F32) {
        return HalfOps<__half>::fma2((unsigned)h.x | ((unsigned)h.y << 16), s2, 0x80008000u);
    } else {
        const float lo = cq::mul_rn(__half2float(__ushort_as_half(h.x)), sf);
        const float hi = cq::mul_rn(__half2float(__ushort_as_half(h.y)), sf);
        return (unsigned)cq::bits16_rn<T>(lo) | ((unsigned)cq::bits16_rn<T>(hi) << 16);
    }
}
// An FP8 scale's bits as loaded (the 16 bits of a T scale in the low half, or a float32's 32) ->
// (s2, sf) for fp8x2_scaled: the 16-bit pair and the float value.
template <typename T, int S> __device__ __forceinline__ void fp8_scale(unsigned bits, unsigned& s2, float& sf) {
    if constexpr (S == W_FP8_BLOCK) {
        s2 = 0u;
        sf = __uint_as_float(bits);
    } else {
        s2 = (bits & 0xffffu) * 0x10001u;
        sf = bits16_to_float<T>(bits & 0xffffu);
    }
}

template <typename T>
__device__ __forceinline__ void mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    if constexpr (cq::same_type<T, __half>::value) {
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
__device__ __forceinline__ void cp_async8_if(unsigned s, const void* gmem, bool pred) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %2, 0;\n@p cp.async.ca.shared.global [%0], [%1], 8;\n}" ::"r"(s), "l"(gmem),
                 "r"((int)pred)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

__device__ __forceinline__ float fma_rn(float a, float b, float c) {
    float d;
    asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(d) : "f"(a), "f"(b), "f"(c));
    return d;
}


// ---------------------------------------------------------------- split K across blocks
// Blocks (x, y, z), z the split of K (weight_sm80_gemm.cu, weight_sm90_gemm.cu), over BM x BN tiles of y.
// Each block stores its float32 partial tile to ws, tile-major: [splits][gridDim.y][gridDim.x][BM][BN]
// (through L2; rows and columns past M and N included, so every tile is whole and 16-byte aligned);
// the last block of tile (x, y) to arrive (a per-tile counter) reads the tile back in 16-byte
// pieces, adds the splits' partials in split order 0, 1, ... (so the sum does not depend on which
// block finishes first), rounds once to T (SCALE_OUT: each sum multiplied by out_scale first, the
// FP4 weights' fp4_out_scale) and writes y. visit(f) calls f(m, n, v) for each output
// (m, n) of this thread's accumulators (v its value), m and n relative to the tile.
// The read-back is coalesced and branch-free, each round's loads in flight together (a read-back
// one output at a time, each load under its own bounds branch, takes as long as the main loop of a
// 64-row tile).
// Returns in every block; the caller returns after it. s_last: an int in the block's shared memory.
namespace cq {
// Four float32 sums of row m, columns n .. n + 3 of y (M x N, row-major) rounded once to T and
// stored: one 8-byte store where all four columns exist and the address allows it (out= may be
// misaligned), else element by element up to N; nothing for rows past M. Shared by the split-K
// finishes (split_k_finish here, weight_sm90_gemm.cu cluster_split_finish).
template <typename T>
__device__ __forceinline__ void store_rounded4(T* __restrict__ y, i64 M, i64 N, i64 m, i64 n, float4 s) {
    if (m >= M) return;
    const unsigned short e[4] = {bits16_rn<T>(s.x), bits16_rn<T>(s.y), bits16_rn<T>(s.z), bits16_rn<T>(s.w)};
    unsigned short* q = reinterpret_cast<unsigned short*>(y + m * N + n);
    if (n + 4 <= N && (reinterpret_cast<unsigned long long>(q) & 7) == 0) {
        *reinterpret_cast<uint2*>(q) = make_uint2((unsigned)e[0] | ((unsigned)e[1] << 16), (unsigned)e[2] | ((unsigned)e[3] << 16));
    } else {
#pragma unroll
        for (int k = 0; k < 4; ++k)
            if (n + k < N) q[k] = e[k];
    }
}

template <typename T, int BM, int BN, int THREADS, bool SCALE_OUT = false, typename Visit>
__device__ __forceinline__ void split_k_finish(float* __restrict__ ws, int* __restrict__ counters, T* __restrict__ y, i64 M, i64 N,
                                               i64 m0, i64 n0, int splits, int& s_last, Visit visit, float out_scale = 1.0f) {
    constexpr int V = BM * BN / 4;  // float4 pieces of a tile
    static_assert(V % THREADS == 0, "a tile is a whole number of float4 pieces per thread");
    constexpr int PER = V / THREADS, CH = PER < 8 ? PER : 8;
    static_assert(PER % CH == 0, "pieces per thread in whole rounds");
    const i64 tiles = (i64)gridDim.x * gridDim.y, tile = (i64)blockIdx.y * gridDim.x + blockIdx.x;
    float* part = ws + ((i64)blockIdx.z * tiles + tile) * (BM * BN);
    visit([&](int m, int n, float v) { __stcg(part + m * BN + n, v); });
    __syncthreads();  // every thread's partials are stored before thread 0 counts the block as arrived
    int* counter = counters + tile;
    if (threadIdx.x == 0) {
        // acquire-release at GPU scope, by one thread: the release is cumulative, so it publishes
        // every partial the barrier above ordered before it, and the acquire orders the last
        // split's reads below (after the next barrier) after the other splits' stores (a
        // __threadfence in every thread instead puts 4% of the stall samples of 4096 x 14336
        // M = 64 64/4 on the ERRBAR).
        int old;
        asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
        s_last = old == splits - 1;
    }
    __syncthreads();
    if (!s_last) return;
    const float4* base = reinterpret_cast<const float4*>(ws) + tile * V + threadIdx.x;
#pragma unroll 1
    for (int c0 = 0; c0 < PER; c0 += CH) {
        float4 s[CH];
#pragma unroll 1
        for (int sp = 0; sp < splits; ++sp) {
            const float4* p = base + (i64)sp * tiles * V + c0 * THREADS;
#pragma unroll
            for (int j = 0; j < CH; ++j) {
                const float4 x = __ldcg(p + j * THREADS);
                if (sp == 0) {
                    s[j] = x;
                } else {
                    s[j].x = add_rn(s[j].x, x.x), s[j].y = add_rn(s[j].y, x.y);
                    s[j].z = add_rn(s[j].z, x.z), s[j].w = add_rn(s[j].w, x.w);
                }
            }
        }
#pragma unroll
        for (int j = 0; j < CH; ++j) {
            const int idx = (c0 + j) * THREADS + threadIdx.x;
            if constexpr (SCALE_OUT) {
                s[j].x = mul_rn(s[j].x, out_scale), s[j].y = mul_rn(s[j].y, out_scale);
                s[j].z = mul_rn(s[j].z, out_scale), s[j].w = mul_rn(s[j].w, out_scale);
            }
            store_rounded4(y, M, N, m0 + idx / (BN / 4), n0 + (idx % (BN / 4)) * 4, s[j]);
        }
    }
    if (threadIdx.x == 0) *counter = 0;  // ready for the next call
}
}  // namespace cq
