// flat_dequant.cuh: the flat geometry of the 8-bit dequantizers (group_dequantize_flat in
// groupwise.cu, mx_dequantize_flat in mx.cu): y = round(float(q) * s) over a C-contiguous q of
// n = rows * K one-byte codes, read as whole pieces of 8 codes (8 bytes in, 16 bytes of bf16/fp16 out).
//
// Threads. A 1-D grid of FLAT_THREADS-thread blocks, no loop: block b takes the pieces
// [b * FLAT_THREADS * PIECES, (b + 1) * FLAT_THREADS * PIECES) of q, thread t the pieces
// b * FLAT_THREADS * PIECES + j * FLAT_THREADS + t for j < PIECES (2: 16 elements a thread, 4: 32),
// so that each load instruction of a warp covers 256 contiguous bytes and each 16-byte store
// instruction 512 (whole 32-byte sectors: a thread that loaded 16 codes would store 32 contiguous
// bytes as two 16-byte halves, each store instruction then writing half of 32 sectors), and each
// thread has PIECES loads in flight. Each piece's loads (its codes, with L1::no_allocate: they are
// read once, and its one scale) are all issued before any is used. A piece's first element e = 8 * p
// is split into (row, column) by one multiply by a host-made magic number (FlatRows); a piece that
// lies in one row and under one scale (its columns [c, c + 8) inside the row and one scale's span of
// 2^span_shift columns) is converted two codes at a time and stored as 16-byte streaming stores; any
// other (rows of K % 8 != 0 meet inside a piece, the last piece of q is short) is done element by
// element. q must start 8-byte and y 16-byte aligned (the host checks), so that piece p is at byte
// 8 * p of q and at byte 8 * p * sizeof(OutT) of y.
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

// Kernel argument (cupyquant._flat.FLAT_ROWS mirrors it): n elements (fewer than 2^31: the host
// plans the row kernel beyond) in rows of K, and the magic number of the division by K
// (cupyquant._scales.magic: exact for dividends below 2^31).
struct FlatRows {
    i64 n, K;
    u64 k_magic;
    int k_shift;
};

// The row of flat element e < 2^31: one 32 x 32 -> 64-bit multiply (the magic number is below 2^32)
// and a shift. Elements, rows, columns and scale offsets of a flat kernel are all below 2^31, so the
// index arithmetic is 32-bit.
__device__ __forceinline__ unsigned flat_row(const FlatRows& f, unsigned e) {
    return (unsigned)(((u64)e * (unsigned)f.k_magic) >> f.k_shift);
}

// 8-byte load through the non-coherent path that does not allocate in L1 (each byte is read once).
__device__ __forceinline__ uint2 ld8_once(const void* p) {
    uint2 v;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// One code's exact float value; 8 codes of a piece (FP8: two per conversion instruction).
template <class F> __device__ __forceinline__ float code_value(unsigned char b) { return fp8_to_float<F>(b); }
template <> __device__ __forceinline__ float code_value<I8>(unsigned char b) { return (float)(signed char)b; }

template <class F> __device__ __forceinline__ void code_values8(const uint2& v, float (&f)[8]) {
    const unsigned w[2] = {v.x, v.y};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        fp8x2_to_float2<F>((unsigned short)(w[i] & 0xffffu), f[4 * i], f[4 * i + 1]);
        fp8x2_to_float2<F>((unsigned short)(w[i] >> 16), f[4 * i + 2], f[4 * i + 3]);
    }
}
template <> __device__ __forceinline__ void code_values8<I8>(const uint2& v, float (&f)[8]) {
    const unsigned w[2] = {v.x, v.y};
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = (float)(signed char)((w[i / 4] >> (8 * (i % 4))) & 0xffu);
}

// Where a piece's 8 elements are: flat index e of the first, its row and column, and whether the
// piece is whole (in one row, under one scale, inside the tensor: one load, one scale, 16-byte stores).
struct FlatPiece {
    unsigned e, row, col;
    bool whole;
};
__device__ __forceinline__ FlatPiece flat_piece(const FlatRows& f, unsigned p, int span_shift) {
    const unsigned n = (unsigned)f.n, K = (unsigned)f.K;
    FlatPiece u;
    u.e = p * 8;  // p < 2^28 + FLAT_THREADS * PIECES: no wrap
    u.row = flat_row(f, u.e);
    u.col = u.e - u.row * K;
    u.whole = u.e < n && n - u.e >= 8 && u.col + 8 <= K && (u.col >> span_shift) == ((u.col + 7) >> span_shift);
    return u;
}

// The elements of a piece that is not whole, one at a time: the row advances where the column
// reaches K, each element's scale is its own.
template <typename OutT, class F, class Scale>
__device__ __forceinline__ void flat_elements(const unsigned char* __restrict__ q, OutT* __restrict__ y,
                                              const FlatRows& f, const FlatPiece& u, const Scale& scale) {
    unsigned row = u.row, col = u.col;
#pragma unroll 1
    for (unsigned i = 0; i < 8 && u.e + i < (unsigned)f.n; ++i, ++col) {
        if (col == (unsigned)f.K) {
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
template <typename OutT, class F, int PIECES, class Scale>
__device__ __forceinline__ void flat_dequantize(const unsigned char* __restrict__ q, OutT* __restrict__ y,
                                                const FlatRows& f, int span_shift, const Scale& scale) {
    const unsigned n_pieces = (unsigned)((f.n + 7) >> 3);
    const unsigned p0 = blockIdx.x * (FLAT_THREADS * PIECES) + threadIdx.x;
    FlatPiece u[PIECES];
    uint2 v[PIECES];
    unsigned s[PIECES];
#pragma unroll
    for (int j = 0; j < PIECES; ++j) {  // every load before any use
        u[j] = flat_piece(f, p0 + j * FLAT_THREADS, span_shift);  // past the end: not whole
        if (u[j].whole) {
            v[j] = ld8_once(q + u[j].e);
            s[j] = scale.load(u[j].row, u[j].col);
        }
    }
#pragma unroll
    for (int j = 0; j < PIECES; ++j) {
        if (u[j].whole) {
            float x[8];
            code_values8<F>(v[j], x);
            const float sj = scale.value(s[j], u[j].col);
#pragma unroll
            for (int i = 0; i < 8; ++i) x[i] = mul_rn(x[i], sj);
            constexpr int N = Vec16<OutT>::N;
            OutT* d = y + u[j].e;
#pragma unroll
            for (int i = 0; i < 8 / N; ++i) st16(d + i * N, pack16<OutT>(x + i * N));
        } else if (p0 + j * FLAT_THREADS < n_pieces) {
            flat_elements<OutT, F>(q, y, f, u[j], scale);
        }
    }
}

}  // namespace cq
