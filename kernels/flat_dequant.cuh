// flat_dequant.cuh: the flat geometry of the 8-bit dequantizers (group_dequantize_flat in
// groupwise.cu, mx_dequantize_flat in mx.cu): y = round(float(q) * s) over a C-contiguous q of
// n = rows * K one-byte codes, read as whole 16-byte words.
//
// Threads. A 1-D grid of FLAT_THREADS-thread blocks, no loop: block b takes the words
// [b * FLAT_THREADS * WORDS, (b + 1) * FLAT_THREADS * WORDS) of q, thread t the words
// b * FLAT_THREADS * WORDS + j * FLAT_THREADS + t for j < WORDS, so that each load instruction of a
// warp covers 512 contiguous bytes and each thread has WORDS 16-byte loads in flight (WORDS = 1: 16
// elements, WORDS = 2: 32). Each word's loads (its codes, with L1::no_allocate: they are read once,
// and its one scale) are all issued before any is used. A word's first element e = 16 * w is split
// into (row, column) by one multiply by a host-made magic number (FlatRows); a word that lies in one
// row and under one scale (its column span [c, c + 16) inside the row and one scale's span of
// 2^span_shift columns) is converted two codes at a time and stored as 16-byte streaming stores; any
// other (rows of K % 16 != 0 meet inside a word, the last word of q is short) is done element by
// element. q and y must start 16-byte aligned (the host checks), so that word w is at byte 16 * w of
// q and at byte 16 * w * sizeof(OutT) of y.
//
// Numerics: the codes' exact float values (fp8x2_to_float2, or the int8 value), one mul.rn.f32 by
// the scale, one rounding to OutT: the operations of the row geometry, so the same bytes.
//
// PDL: the kernels call pdl_wait_then_release() before flat_dequantize, which reads global memory
// from its first lines.
#pragma once

#include "common.cuh"

namespace cq {

static constexpr int FLAT_THREADS = 256;

// Kernel argument (cupyquant._flat.FLAT_ROWS mirrors it): n elements in rows of K, and the magic
// number of the division by K (cupyquant._scales.magic: exact for dividends below 2^31).
struct FlatRows {
    i64 n, K;
    u64 k_magic;
    int k_shift;
};

// The row of flat element e: one 64-bit multiply below 2^31, a division beyond.
__device__ __forceinline__ i64 flat_row(const FlatRows& f, i64 e) {
    return e < 0x80000000LL ? (i64)(((u64)e * f.k_magic) >> f.k_shift) : e / f.K;
}

// 16-byte load through the non-coherent path that does not allocate in L1 (each byte is read once).
__device__ __forceinline__ uint4 ld16_once(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// One code's exact float value; 16 codes of a word (FP8: two per conversion instruction).
template <class F> __device__ __forceinline__ float code_value(unsigned char b) { return fp8_to_float<F>(b); }
template <> __device__ __forceinline__ float code_value<I8>(unsigned char b) { return (float)(signed char)b; }

template <class F> __device__ __forceinline__ void code_values16(const uint4& v, float (&f)[16]) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        fp8x2_to_float2<F>((unsigned short)(w[i] & 0xffffu), f[4 * i], f[4 * i + 1]);
        fp8x2_to_float2<F>((unsigned short)(w[i] >> 16), f[4 * i + 2], f[4 * i + 3]);
    }
}
template <> __device__ __forceinline__ void code_values16<I8>(const uint4& v, float (&f)[16]) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 16; ++i) f[i] = (float)(signed char)((w[i / 4] >> (8 * (i % 4))) & 0xffu);
}

// Where a word's 16 elements go: whole (one row, one scale; 16-byte loads and stores), or not.
struct FlatWord {
    i64 e, row, col;
    bool whole;
};
__device__ __forceinline__ FlatWord flat_word(const FlatRows& f, i64 w, int span_shift) {
    FlatWord u;
    u.e = w * 16;
    u.row = flat_row(f, u.e);
    u.col = u.e - u.row * f.K;
    u.whole = u.e + 16 <= f.n && u.col + 16 <= f.K && (u.col >> span_shift) == ((u.col + 15) >> span_shift);
    return u;
}

// The elements of a word that is not whole, one at a time: the row advances where the column
// reaches K, each element's scale is its own.
template <typename OutT, class F, class Scale>
__device__ __forceinline__ void flat_elements(const unsigned char* __restrict__ q, OutT* __restrict__ y,
                                              const FlatRows& f, const FlatWord& u, const Scale& scale) {
    i64 row = u.row, col = u.col;
#pragma unroll 1
    for (int i = 0; i < 16 && u.e + i < f.n; ++i, ++col) {
        if (col == f.K) {
            col = 0;
            ++row;
        }
        y[u.e + i] = from_float<OutT>(mul_rn(code_value<F>(q[u.e + i]), scale.value(scale.load(row, col), col)));
    }
}

// The whole body of a flat kernel (see the top of this file). Scale: the scale of element (row, col)
// is scale.value(scale.load(row, col), col), load reading the bits that hold it (issued with the
// codes' loads) and value decoding them (after every load); span_shift: log2 of the columns one
// scale covers (31: the whole row).
template <typename OutT, class F, int WORDS, class Scale>
__device__ __forceinline__ void flat_dequantize(const unsigned char* __restrict__ q, OutT* __restrict__ y,
                                                const FlatRows& f, int span_shift, const Scale& scale) {
    const i64 n_words = (f.n + 15) >> 4;
    const i64 w0 = (i64)blockIdx.x * (FLAT_THREADS * WORDS) + threadIdx.x;
    FlatWord u[WORDS];
    uint4 v[WORDS];
    unsigned s[WORDS];
#pragma unroll
    for (int j = 0; j < WORDS; ++j) {  // every load before any use
        u[j] = flat_word(f, w0 + (i64)j * FLAT_THREADS, span_shift);  // past the end: not whole
        if (u[j].whole) {
            v[j] = ld16_once(q + u[j].e);
            s[j] = scale.load(u[j].row, u[j].col);
        }
    }
#pragma unroll
    for (int j = 0; j < WORDS; ++j) {
        if (u[j].whole) {
            float x[16];
            code_values16<F>(v[j], x);
            const float sj = scale.value(s[j], u[j].col);
#pragma unroll
            for (int i = 0; i < 16; ++i) x[i] = mul_rn(x[i], sj);
            constexpr int N = Vec16<OutT>::N;
            OutT* d = y + u[j].e;
#pragma unroll
            for (int i = 0; i < 16 / N; ++i) st16(d + i * N, pack16<OutT>(x + i * N));
        } else if (w0 + (i64)j * FLAT_THREADS < n_words) {
            flat_elements<OutT, F>(q, y, f, u[j], scale);
        }
    }
}

}  // namespace cq
