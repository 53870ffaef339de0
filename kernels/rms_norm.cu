// rms_norm.cu: fused (residual add +) RMSNorm + quantization, one read of the activations.
//
// What it computes (reference: cupyquant.reference.rms_norm and .rms_norm_quantize, which this
// kernel matches bit for bit; every float step is an IEEE float32 operation, T is the input dtype):
//   z   = round_T(x + r) with the residual r (written back into r), else x
//   p_u = sum of z_i * z_i over the 8 elements of unit u (elements u * 8 .. u * 8 + 7, zero past H),
//         left to right: p = z_0 * z_0, then p = p + z_i * z_i (each product and sum rounded, no FMA)
//   ss  = the pairwise tree over the units, lowest index bit first: p_u = p_2u + p_2u+1 (units
//         zero-padded to a power of two) until one is left
//   inv = 1 / sqrt(ss / H + eps)        (division, square root and division correctly rounded)
//   y   = round_T(round_T(z * inv) * w)  (the weight product in float32, then rounded to T)
// and y is quantized by one of the library's activation schemes (SCHEME), with the formulas of its
// own kernel (groupwise.cu, per_tensor.cu, block_scale.cuh): per token (NQ_TOKEN) or per group
// (NQ_GROUP) FP8/INT8 with the groupwise scale layouts; per tensor FP8 with the caller's decode scale
// s (NQ_TENSOR: q = cvt(y * (1 / s))); MXFP8/MXFP4 with the "ceil" rule (NQ_MX); NVFP4 with the
// caller's global encode scale (NQ_NVFP4). The quantized bytes and scales are those of the
// quantizer applied to y.
//
// Threads. A team of 1 to 32 warps per row holds the row in registers (as groupwise.cu's per-token
// kernel): team lane t keeps the 8-element units u = t + 32 * warps * v, v < UNITS (32 bytes of x a lane).
// The unit index's low bits are the team lane and its high bits the slot v, so the sum-of-squares
// tree is: xor shuffles over the lanes (bit 0 first), a tree over the team's warps through shared
// memory, then a tree over the lane's own slots -- the same order whatever the team size. A group
// of G elements is G / 8 consecutive lanes of one slot (xor shuffles among them), an MX block 4
// lanes, an NVFP4 block 2. For swizzled MX/NVFP4 scales the grid also covers the padding rows up to
// a multiple of 128, whose scales come out 0; the lane of a row's last block zeroes the padding
// columns after it. The team size and the vector path are run-time arguments (one instantiation per
// input type, scheme and format: the family compiles in a fraction of the time of one per team);
// without vec, single elements are read and written (rows not 16-byte aligned, H not a multiple of
// 8). The host checks everything else (H % G, H % 32 for MX, H % 16 for NVFP4).
// Kernels: rms_norm_quantize, whose every warp computes its row's scalars (every scheme), and
// rms_norm_quantize_lead (per-token and per-tensor scales; below the first), which computes them
// once a row (cupyquant.norm picks by scheme; _forced_path forces either). Both give the same bytes
// with any team.
// OCC: the register bound of both kernels (see NORM_REG_BYTES), an instantiation each
// (cupyquant.norm._Path.occupancy).
// PDL: each kernel calls pdl_wait_then_release() (common.cuh) once in every thread, before its first
// global load, store, prefetch or copy, so that the wrappers may launch it with programmatic dependent launch.

#include "groupwise.cuh"
#include "block_scale.cuh"

enum { NQ_TOKEN = 0, NQ_GROUP = 1, NQ_TENSOR = 2, NQ_MX = 3, NQ_NVFP4 = 4 };

// Mirrors cupyquant.norm._NORM_ARGS (align=True).
struct NormArgs {
    i64 rows;        // rows of x
    i64 grid_rows;   // rows the grid covers: rows, or round_up(rows, 128) for swizzled block scales
    i64 x_stride;    // row strides of x and of the residual, in elements
    i64 r_stride;
    i64 q_row;       // bytes per row of q
    i64 n_blocks;    // NQ_MX / NQ_NVFP4: scale blocks per row
    int H;
    int team_shift;  // log2 of the threads per row: 32 to 1024
    int vec;         // 16-byte loads and stores (rows 16-byte aligned, H % 8 == 0)
    int group_size;  // NQ_GROUP
    int swizzled;    // NQ_MX / NQ_NVFP4: the 128x4 scale layout
    float eps;
    int s_mode;      // a ScaleSource for NQ_TENSOR's s and NQ_NVFP4's S_enc: DEVICE (s_ptr) or ARG
    float s_arg;
    float rcp_H;     // float32(1 / H), correctly rounded (rms_norm_quantize_lead)
    int w_async;     // rms_norm_quantize_lead, with vec: the weight staged in shared memory by cp.async
    const float* s_ptr;
    float* s_out;    // NQ_TENSOR: s; NQ_NVFP4: S_enc; written by the first thread
};

// ---------------------------------------------------------------- 8-element units
template <typename T> struct Unit {  // one unit of 8 elements as 16-byte words of T's bits
    static constexpr int LOADS = sizeof(T) == 4 ? 2 : 1;
};

// Unit at p with n elements left in the row: vec, two or one 16-byte loads (n >= 8); otherwise
// single elements, zero past n.
template <typename T> __device__ __forceinline__ void load_unit(const T* __restrict__ p, int n, uint4* w, bool vec) {
    constexpr int L = Unit<T>::LOADS;
    if (vec) {
#pragma unroll
        for (int l = 0; l < L; ++l) w[l] = ld16(p + l * 4);
    } else {
        float f[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = i < n ? to_float(p[i]) : 0.0f;
#pragma unroll
        for (int l = 0; l < L; ++l) w[l] = pack16<T>(f + l * (8 / L));
    }
}

template <typename T> __device__ __forceinline__ void store_unit(T* __restrict__ p, int n, const uint4* w, bool vec) {
    constexpr int L = Unit<T>::LOADS;
    if (vec) {
#pragma unroll
        for (int l = 0; l < L; ++l) st16(p + l * 4, w[l]);
    } else {
        float f[8];
#pragma unroll
        for (int l = 0; l < L; ++l) unpack16<T>(w[l], f + l * (8 / L));
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (i < n) p[i] = from_float<T>(f[i]);
    }
}

template <typename T> __device__ __forceinline__ void unpack_unit(const uint4* w, float* f) {
    constexpr int L = Unit<T>::LOADS;
#pragma unroll
    for (int l = 0; l < L; ++l) unpack16<T>(w[l], f + l * (8 / L));
}
// Two floats as T's bits, lo in the low half, each rounded to nearest even as bits16_rn rounds it
// (cvt.rn, no flush), in one cvt.rn.{bf16x2,f16x2}.f32 (one F2FP where two conversions and a PRMT
// would be).
template <typename T> __device__ __forceinline__ unsigned pack2_rn(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2_rn<__nv_bfloat16>(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <> __device__ __forceinline__ unsigned pack2_rn<__half>(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <typename T> __device__ __forceinline__ void pack_unit(const float* f, uint4* w) {  // rounds to T
    if constexpr (sizeof(T) == 2) {
        w[0] = make_uint4(pack2_rn<T>(f[0], f[1]), pack2_rn<T>(f[2], f[3]), pack2_rn<T>(f[4], f[5]),
                          pack2_rn<T>(f[6], f[7]));
    } else {
        w[0] = pack16<T>(f);
        w[1] = pack16<T>(f + 4);
    }
}

// The first n of NB bytes held in words (byte 0 lowest): vec, one NB-byte store (n == NB).
template <int NB> __device__ __forceinline__ void store_bytes(unsigned char* __restrict__ q, int n, const unsigned* w, bool vec) {
    if (vec && NB == 8) {
        *reinterpret_cast<uint2*>(q) = make_uint2(w[0], w[1]);
    } else if (vec && NB == 4) {
        *reinterpret_cast<unsigned*>(q) = w[0];
    } else {
#pragma unroll
        for (int i = 0; i < NB; ++i)
            if (i < n) q[i] = (unsigned char)(w[i / 4] >> (8 * (i % 4)));
    }
}

// ---------------------------------------------------------------- a row's loads
// Whether the lane's units all hold 8 elements of a valid row on the vector path (the last unit,
// at element ((UNITS - 1) * threads + t) * 8, starts below H, a multiple of 8 with vec): the row
// passes then go through their units without a bound test, a row's base pointers computed once.
template <int UNITS> __device__ __forceinline__ bool lane_whole(bool valid, bool vec, int t, int threads, int H) {
    return valid && vec && ((UNITS - 1) * threads + t) * 8 < H;
}

// round_T(a + b) for two pairs of 16-bit values (T's bits, low halves and high halves), a + b the
// float32 sum: one fma.rn.bf16x2 with 1 (a * 1 + b, the exact sum rounded once; a zero sum's sign as
// add's) or add.rn.f16x2, neither flushing subnormals. The two agree: the exact sum s of two values
// of T is a multiple of T's least subnormal (2^-133 bf16, 2^-24 f16), so where T rounds it as a
// subnormal (below 2^-126, 2^-14) it has at most 7 or 10 significant bits and is T's and float32's
// exactly; elsewhere rounding s to float32 (24 bits; 2^-126 <= |s| for bf16, float32's normal range,
// and for f16 |s| < 2^17) and then to T (8 or 11 bits) is rounding s to T, since 24 >= 2p + 1
// (double rounding of a sum is innocuous then, Figueroa 1995); past float32's range (bf16 only) both
// overflow to inf, the threshold being a float32. A NaN operand, or inf + -inf, gives the canonical
// NaN (0x7fff) either way: a property of the hardware (F2FP of float32's canonical NaN, the 16-bit
// units' NaN), tests/test_norm.py::test_add2_rn_matches_float_sum checks all 2^32 pairs.
template <typename T> __device__ __forceinline__ unsigned add2_rn(unsigned a, unsigned b);
template <> __device__ __forceinline__ unsigned add2_rn<__nv_bfloat16>(unsigned a, unsigned b) {
    unsigned r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(0x3f803f80u), "r"(b));
    return r;
}
template <> __device__ __forceinline__ unsigned add2_rn<__half>(unsigned a, unsigned b) {
    unsigned r;
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// z = round_T(x + r) for one unit held as T's bits (r's bits in r), in place of z: by add2_rn for
// 16-bit types.
template <typename T> __device__ __forceinline__ void add_unit(uint4* z, const uint4* r) {
    if constexpr (sizeof(T) == 2) {
        z[0] = make_uint4(add2_rn<T>(z[0].x, r[0].x), add2_rn<T>(z[0].y, r[0].y), add2_rn<T>(z[0].z, r[0].z),
                          add2_rn<T>(z[0].w, r[0].w));
    } else {
        float fz[8], fr[8];
        unpack_unit<T>(z, fz);
        unpack_unit<T>(r, fr);
#pragma unroll
        for (int i = 0; i < 8; ++i) fz[i] = add_rn(fz[i], fr[i]);
        pack_unit<T>(fz, z);
    }
}

// The lane's units of `row` (unit v at element (v * threads + t) * 8), as T's bits, zero past H and
// where !valid: z = x, or z = round_T(x + residual) stored back into the residual. Both kernels call
// it right after pdl_wait_then_release() and the weight's prefetch or staging, then unit_sums (the
// lead kernel with its scalars in between, where ptxas keeps 40 registers).
template <typename T, int UNITS>
__device__ __forceinline__ void load_row(const T* __restrict__ x, T* __restrict__ residual, const NormArgs& a, i64 row,
                                         int t, int threads, bool valid, bool vec, uint4 (&z)[UNITS][Unit<T>::LOADS]) {
    constexpr int L = Unit<T>::LOADS;
    const int H = a.H;
    if (lane_whole<UNITS>(valid, vec, t, threads, H)) {
        const T* xr = x + row * a.x_stride;
        if (residual != nullptr) {
            T* rr = residual + row * a.r_stride;
#pragma unroll
            for (int v = 0; v < UNITS; ++v) {
                const int c = (v * threads + t) * 8;
                uint4 r[L];
#pragma unroll
                for (int l = 0; l < L; ++l) z[v][l] = ld16(xr + c + l * 4);
#pragma unroll
                for (int l = 0; l < L; ++l) r[l] = ld16(rr + c + l * 4);
                add_unit<T>(z[v], r);
#pragma unroll
                for (int l = 0; l < L; ++l) st16(rr + c + l * 4, z[v][l]);
            }
        } else {
#pragma unroll
            for (int v = 0; v < UNITS; ++v)
#pragma unroll
                for (int l = 0; l < L; ++l) z[v][l] = ld16(xr + (v * threads + t) * 8 + l * 4);
        }
        return;
    }
#pragma unroll
    for (int v = 0; v < UNITS; ++v) {
        const int c = (v * threads + t) * 8;
        if (valid && c < H) {
            load_unit<T>(x + row * a.x_stride + c, H - c, z[v], vec);
            if (residual != nullptr) {
                uint4 r[L];
                load_unit<T>(residual + row * a.r_stride + c, H - c, r, vec);
                add_unit<T>(z[v], r);
                store_unit<T>(residual + row * a.r_stride + c, H - c, z[v], vec);
            }
        } else {
#pragma unroll
            for (int l = 0; l < L; ++l) z[v][l] = make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

// Each unit's sum of squares, left to right: p = z_0 * z_0, then p = p + z_i * z_i (no FMA).
template <typename T, int UNITS>
__device__ __forceinline__ void unit_sums(const uint4 (&z)[UNITS][Unit<T>::LOADS], float (&p)[UNITS]) {
#pragma unroll
    for (int v = 0; v < UNITS; ++v) {
        float f[8];
        unpack_unit<T>(z[v], f);
        p[v] = mul_rn(f[0], f[0]);
#pragma unroll
        for (int i = 1; i < 8; ++i) p[v] = add_rn(p[v], mul_rn(f[i], f[i]));
    }
}

// ---------------------------------------------------------------- the normalize step
// round_T(a * b) for two pairs of 16-bit values (T's bits, low halves and high halves), a * b the
// float32 product: one fma.rn.bf16x2 with -0 (a * b + -0 keeps a zero product's sign) or
// mul.rn.f16x2. The two agree because the exact product of two values of T is a float32 or rounds to
// T's zero: its significand has at most 16 bits (bf16) or 22 (f16); for f16 it lies in [2^-48,
// 2^32], float32's normal range; for bf16 it is exact in float32 unless its lowest bit is below
// 2^-149, and then it is below 2^-134 (half of bf16's least subnormal), where both roundings give
// the signed zero (RN(p) in float32 is at most 2^-134, a tie that rounds to the even 0), and past
// float32's range both overflow to inf. Neither flushes subnormals.
template <typename T> __device__ __forceinline__ unsigned mul2_rn(unsigned a, unsigned b);
template <> __device__ __forceinline__ unsigned mul2_rn<__nv_bfloat16>(unsigned a, unsigned b) {
    unsigned r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
    return r;
}
template <> __device__ __forceinline__ unsigned mul2_rn<__half>(unsigned a, unsigned b) {
    unsigned r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// y = round_T(round_T(z * inv) * w) for one unit (z and w as T's bits), in place of z: the weight
// product by mul2_rn on the rounded bits for 16-bit types.
template <typename T> __device__ __forceinline__ void normalize_unit(uint4* z, float inv, const uint4* wr) {
    float f[8];
    unpack_unit<T>(z, f);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = mul_rn(f[i], inv);
    pack_unit<T>(f, z);
    if constexpr (sizeof(T) == 2) {
        z[0] = make_uint4(mul2_rn<T>(z[0].x, wr[0].x), mul2_rn<T>(z[0].y, wr[0].y), mul2_rn<T>(z[0].z, wr[0].z),
                          mul2_rn<T>(z[0].w, wr[0].w));
    } else {
        float w[8];
        unpack_unit<T>(wr, w);
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = mul_rn(f[i], w[i]);
        pack_unit<T>(f, z);
    }
}

// y = round_T(round_T(z * inv) * w) for each of the lane's units, in place of z: w is the weight's
// unit from global memory or, with `staged` (the lead kernel's w_async), its copy that stage16 put
// in w_stage ([UNITS * L][blockDim.x] 16-byte words, complete after stage_wait). y goes to y_out
// where given; units past H and rows that are not valid (padding rows) become zeros. Both kernels
// call it once the row's inv is known.
template <typename T, int UNITS>
__device__ __forceinline__ void normalize_row(uint4 (&z)[UNITS][Unit<T>::LOADS], float inv,
                                              const T* __restrict__ weight, bool staged, const uint4* w_stage,
                                              T* __restrict__ y_out, const NormArgs& a, i64 row, int t, int threads,
                                              bool valid, bool vec) {
    constexpr int L = Unit<T>::LOADS;
    const int H = a.H;
    if (lane_whole<UNITS>(valid, vec, t, threads, H)) {
        if (staged) {
#pragma unroll
            for (int v = 0; v < UNITS; ++v) {
                uint4 wr[L];
#pragma unroll
                for (int l = 0; l < L; ++l) wr[l] = w_stage[(v * L + l) * blockDim.x + threadIdx.x];
                normalize_unit<T>(z[v], inv, wr);
            }
        } else {
#pragma unroll
            for (int v = 0; v < UNITS; ++v) {
                uint4 wr[L];
#pragma unroll
                for (int l = 0; l < L; ++l) wr[l] = ld16(weight + (v * threads + t) * 8 + l * 4);
                normalize_unit<T>(z[v], inv, wr);
            }
        }
        if (y_out != nullptr) {
            T* yr = y_out + row * (i64)H;
#pragma unroll
            for (int v = 0; v < UNITS; ++v)
#pragma unroll
                for (int l = 0; l < L; ++l) st16(yr + (v * threads + t) * 8 + l * 4, z[v][l]);
        }
        return;
    }
#pragma unroll
    for (int v = 0; v < UNITS; ++v) {
        const int c = (v * threads + t) * 8;
        if (valid && c < H) {
            uint4 wr[L];
            if (staged) {
#pragma unroll
                for (int l = 0; l < L; ++l) wr[l] = w_stage[(v * L + l) * blockDim.x + threadIdx.x];
            } else {
                load_unit<T>(weight + c, H - c, wr, vec);
            }
            normalize_unit<T>(z[v], inv, wr);
            if (y_out != nullptr) store_unit<T>(y_out + row * (i64)H + c, H - c, z[v], vec);
        } else {
#pragma unroll
            for (int l = 0; l < L; ++l) z[v][l] = make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

// ---------------------------------------------------------------- team reductions
static constexpr int NORM_BLOCK_MAX = 1024;  // threads of the widest team (32 warps)
// Row bytes a lane holds: 32 (8 registers), so that a thread needs 40 registers and an SM runs 1536
// threads. H100, bf16 with a residual, per-token FP8: 16384 x 8192 in 322 us at 32 bytes a lane, 344 at 64
// (60 registers), 416 at 128 (64 registers and spills).
static constexpr int NORM_REG_BYTES = 32;
// OCC, a template argument of both kernels: blocks of NORM_BLOCK_MAX threads that an SM must hold
// (__launch_bounds__). 1: ptxas may use 64 registers a thread; the 16-bit instances take 36-52
// (sm_90), so an SM holds 3 rows of 8192 bf16 on 16 warps (40 registers), 2 at 47-52 (the lead
// kernel's per-tensor tail, the MX tails). 2: at most 32 registers a thread, 2048 threads an SM:
// 4 rows of 8192 on 16 warps, 8 rows of 4096 on 8, the row's loads of 2 to 4 rows more in flight
// an SM; ptxas spills 4-32 bytes a thread in the 16-bit instances (to local memory, in L1).

// The pairwise tree over the team's `warps` warp values (lowest index bit first), given in
// vals[0 .. warps): lane k of every warp takes value k (0 past warps) and xor shuffles add them; the
// sum is lane 0's, broadcast.
__device__ __forceinline__ float team_tree(const float* vals, int warps) {
    const int lane = threadIdx.x & 31;
    float s = lane < warps ? vals[lane] : 0.0f;
    for (int o = 1; o < warps; o *= 2) s = add_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
    return __shfl_sync(0xffffffffu, s, 0);
}

// ---------------------------------------------------------------- block scales (NQ_MX, NQ_NVFP4)
__device__ __forceinline__ i64 block_scale_offset(const NormArgs& a, i64 row, i64 kb) {
    if (!a.swizzled) return row * a.n_blocks + kb;
    const i64 n_units = (a.n_blocks + 3) >> 2;
    return ((row >> 7) * n_units + (kb >> 2)) * 512 + (row & 31) * 16 + ((row >> 5) & 3) * 4 + (kb & 3);
}

// Eight values already multiplied by the block's multiplier -> FP8 (8 bytes) or E2M1 (4 bytes).
template <class F> __device__ __forceinline__ void block_codes8(const float* v, unsigned* w) {
    if constexpr (Fmt<F>::BITS == 8) {
        w[0] = cvt_x2<F, true>(v[0], v[1]) | (cvt_x2<F, true>(v[2], v[3]) << 16);
        w[1] = cvt_x2<F, true>(v[4], v[5]) | (cvt_x2<F, true>(v[6], v[7]) << 16);
    } else {
        w[0] = cvt_x2<F, true>(v[0], v[1]) | (cvt_x2<F, true>(v[2], v[3]) << 8) | (cvt_x2<F, true>(v[4], v[5]) << 16) |
               (cvt_x2<F, true>(v[6], v[7]) << 24);
    }
}

// ---------------------------------------------------------------- the kernel
// Blocks of max(256, team) threads; every thread of a block reaches each __syncthreads (rows past
// the grid's take part with zeros).
template <typename T, int SCHEME, class F, int OCC>
__global__ void __launch_bounds__(NORM_BLOCK_MAX, OCC)
rms_norm_quantize(const T* __restrict__ x, T* __restrict__ residual, const T* __restrict__ weight,
                  T* __restrict__ y_out, unsigned char* __restrict__ q, unsigned* __restrict__ scales, NormArgs a,
                  ScaleArgs sa) {
    sa.words = scales;
    constexpr int L = Unit<T>::LOADS;
    constexpr int UNITS = NORM_REG_BYTES / (16 * L);
    const int threads = 1 << a.team_shift;
    const int warps = threads >> 5;
    const int t = threadIdx.x & (threads - 1);
    const i64 row = (i64)blockIdx.x * (blockDim.x >> a.team_shift) + (threadIdx.x >> a.team_shift);
    const bool valid = row < a.rows;  // a row of x; rows up to grid_rows only write padding scales
    const bool vec = a.vec != 0;
    const int H = a.H;
    pdl_wait_then_release();  // no global access above this line (the weight's prefetch included)

    // the weight is read after the norm: start bringing it into L1 now, so that its first read
    // (from DRAM on a small call) is not on the critical path
#pragma unroll
    for (int v = 0; v < UNITS; ++v) {
        const int c = (v * threads + t) * 8;
        if (valid && c < H) asm volatile("prefetch.global.L1 [%0];" ::"l"(weight + c));
    }

    // z in registers, as T's bits
    uint4 z[UNITS][L];
    load_row<T, UNITS>(x, residual, a, row, t, threads, valid, vec, z);

    // the sum of squares: unit sums, then the tree over lanes, warps and slots
    float p[UNITS];
    unit_sums<T, UNITS>(z, p);
#pragma unroll
    for (int o = 1; o < 32; o *= 2)
#pragma unroll
        for (int v = 0; v < UNITS; ++v) p[v] = add_rn(p[v], __shfl_xor_sync(0xffffffffu, p[v], o));
    __shared__ float warp_sums[UNITS][NORM_BLOCK_MAX / 32];
    __shared__ unsigned warp_max_keys[NORM_BLOCK_MAX / 32];
    const int first_warp = (threadIdx.x >> a.team_shift) * warps;
    if (warps > 1) {
        if ((threadIdx.x & 31) == 0)
#pragma unroll
            for (int v = 0; v < UNITS; ++v) warp_sums[v][threadIdx.x >> 5] = p[v];
        __syncthreads();
#pragma unroll
        for (int v = 0; v < UNITS; ++v) p[v] = team_tree(&warp_sums[v][first_warp], warps);
    }
#pragma unroll
    for (int s = 1; s < UNITS; s *= 2)
#pragma unroll
        for (int v = 0; v < UNITS; v += 2 * s) p[v] = add_rn(p[v], p[v + s]);
    const float inv = div_rn(1.0f, sqrt_rn(add_rn(div_rn(p[0], (float)H), a.eps)));

    // y = round_T(round_T(z * inv) * w), in place of z (0 in padding rows)
    normalize_row<T, UNITS>(z, inv, weight, false, nullptr, y_out, a, row, t, threads, valid, vec);

    if constexpr (SCHEME == NQ_TOKEN) {
        unsigned m = 0;
#pragma unroll
        for (int v = 0; v < UNITS; ++v)
#pragma unroll
            for (int l = 0; l < L; ++l) m = max(m, absmax16<T>(z[v][l]));
        m = warp_max(m);
        if (warps > 1) {
            if ((threadIdx.x & 31) == 0) warp_max_keys[threadIdx.x >> 5] = m;
            __syncthreads();
            for (int w = 0; w < warps; ++w) m = max(m, warp_max_keys[first_warp + w]);
        }
        if (!valid) return;
        float tinv;
        const float s = token_scale<F>(sa, __uint_as_float(m), tinv);
        const bool pow2 = sa.pow2 != 0;
        const bool exact_div = needs_exact_div(sa, s);
#pragma unroll
        for (int v = 0; v < UNITS; ++v) {
            const int c = (v * threads + t) * 8;
            if (c < H) {
                float f[8];
                unpack_unit<T>(z[v], f);
                const uint2 w = token_quant8<F>(f, s, tinv, pow2, exact_div);
                const unsigned ww[2] = {w.x, w.y};
                store_bytes<8>(q + row * a.q_row + c, H - c, ww, vec);
            }
        }
        if (t == 0) store_scale(sa, row, 0, s);
    } else if constexpr (SCHEME == NQ_GROUP) {
        const int tpg = a.group_size >> 3;  // lanes per group, a power of two <= 32
#pragma unroll
        for (int v = 0; v < UNITS; ++v) {
            const int c = (v * threads + t) * 8;
            float f[8];
            unpack_unit<T>(z[v], f);
            unsigned m = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i) m = max(m, abs_key(f[i]));
            m = group_max(m, tpg);  // all 32 lanes, valid or not
            if (valid && c < H) {
                float amax = fmax_ieee(__uint_as_float(m), 1e-10f);
                if (sa.has_ub) amax = fmin_ieee(amax, load_ub(sa));
                float s = scale_of<F>(amax);
                if (sa.pow2) s = pow2_ceil(s);
                const uint2 w = quant8<F, CLAMP_LO>(f, s, rcp_rn(s), needs_exact_div(sa, s));
                const unsigned ww[2] = {w.x, w.y};
                store_bytes<8>(q + row * a.q_row + c, H - c, ww, vec);
                if ((t & (tpg - 1)) == 0) store_scale(sa, row, c / a.group_size, s);
            }
        }
    } else if constexpr (SCHEME == NQ_TENSOR) {
        const float s = a.s_mode == SCALE_FROM_DEVICE ? *a.s_ptr : a.s_arg;
        const float scale = div_rn(1.0f, s);
        if (blockIdx.x == 0 && threadIdx.x == 0) *a.s_out = s;
        if (!valid) return;
#pragma unroll
        for (int v = 0; v < UNITS; ++v) {
            const int c = (v * threads + t) * 8;
            if (c < H) {
                float f[8];
                unpack_unit<T>(z[v], f);
                unsigned w[2];
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    w[h] = (unsigned)to_fp8x2<F>(mul_rn(f[4 * h], scale), mul_rn(f[4 * h + 1], scale)) |
                           ((unsigned)to_fp8x2<F>(mul_rn(f[4 * h + 2], scale), mul_rn(f[4 * h + 3], scale)) << 16);
                store_bytes<8>(q + row * a.q_row + c, H - c, w, vec);
            }
        }
    } else {  // NQ_MX, NQ_NVFP4: blocks of 32 (4 lanes) or 16 (2 lanes)
        constexpr bool NV = SCHEME == NQ_NVFP4;
        constexpr int TPB = NV ? 2 : 4;
        constexpr int BS = 8 * TPB;
        constexpr int NB = Fmt<F>::BITS;  // bytes of 8 codes
        float S_enc6 = 0.0f, S_dec = 0.0f;
        if constexpr (NV) {
            const float S_enc = a.s_mode == SCALE_FROM_DEVICE ? *a.s_ptr : a.s_arg;
            S_enc6 = mul_rn(S_enc, Fmt<E2M1>::RCP);
            S_dec = rcp_rn(S_enc);
            if (blockIdx.x == 0 && threadIdx.x == 0) *a.s_out = S_enc;
        }
        unsigned char* sbytes = reinterpret_cast<unsigned char*>(scales);
        if (row >= a.grid_rows) return;
#pragma unroll
        for (int v = 0; v < UNITS; ++v) {
            const int c = (v * threads + t) * 8;
            float f[8];  // zero past H and in padding rows; every lane takes part in the shuffles
            unpack_unit<T>(z[v], f);
            // block max |y| as float bits: MX lets a NaN win (its magnitude bits exceed inf's),
            // NVFP4 ignores NaN
            unsigned key = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i) key = max(key, NV ? abs_key(f[i]) : (__float_as_uint(f[i]) & 0x7fffffffu));
#pragma unroll
            for (int o = 1; o < TPB; o *= 2) key = max(key, __shfl_xor_sync(0xffffffffu, key, o));
            if (c >= H) continue;  // whole blocks: H % BS == 0
            unsigned sbyte;
            float mult;
            if constexpr (NV) {
                sbyte = to_e4m3<true>(fmin_ieee(mul_rn(__uint_as_float(key), S_enc6), FLT_MAX_F));
                mult = fmin_ieee(rcp_rn(mul_rn(fp8_to_float<E4M3>((unsigned char)sbyte), S_dec)), FLT_MAX_F);
            } else {
                sbyte = mx_scale<F, true>(key, false);
                mult = mx_multiplier(sbyte);
            }
            if (valid) {
                float m8[8];
#pragma unroll
                for (int i = 0; i < 8; ++i) m8[i] = mul_rn(f[i], mult);
                unsigned w[2];
                block_codes8<F>(m8, w);
                store_bytes<NB>(q + row * a.q_row + c * Fmt<F>::BITS / 8, NB, w, vec);
            }
            if ((t & (TPB - 1)) == 0) {
                const i64 kb = c / BS;
                sbytes[block_scale_offset(a, row, kb)] = (unsigned char)sbyte;
                if (a.swizzled && kb == a.n_blocks - 1)
                    for (i64 k = kb + 1; k < ((a.n_blocks + 3) & ~(i64)3); ++k) sbytes[block_scale_offset(a, row, k)] = 0;
            }
        }
    }
}

// ================================================================ rms_norm_quantize_lead
// Per-token and per-tensor scales: the same bytes as rms_norm_quantize, with less work a row that
// does not depend on H (the block's
// barriers are the same __syncthreads, one barrier resource: a named barrier a team would reserve all
// sixteen, and 16 barriers a block allow 4 blocks an SM on sm_90, 1 on sm_89 and sm_120):
// - the sum of squares reduces a lane's two slots (16-bit types) in one shuffle tree: at the first
//   level each lane gives its partner the slot the partner keeps, so even lanes carry slot 0 and odd
//   lanes slot 1 through the other four levels (the order is the unit tree's: lane bits, then the
//   team's warp bits, then the slot bit);
// - inv = 1 / sqrt(ss / H + eps) is computed once a row, by the team's first warp, between the
//   barrier after which the warps' sums are in shared memory and one after which inv is; ss / H is
//   div_by with the host's RN(1 / H) where that is the IEEE quotient, 1 / sqrt is rcp.rn;
// - per token, the team's amax is an atomicMax in shared memory and one barrier (no loop over the
//   warps' maxima), the scale amax / qmax by div_by (scale_of) and 1 / s by rcp.rn;
// - the caller's scale (NQ_TENSOR's s) is loaded with the row and its reciprocal computed before the
//   norm needs it; scale_ub on the device ahead of the reductions
//   that precede its use;
// - with w_async (vec only), the row's weight goes to shared memory by cp.async ahead of the row's own
//   loads, each thread staging the 16-byte words it later reads, so the weight is on chip when the
//   norm is done without holding registers; without it, prefetch.global.L1 as rms_norm_quantize.
// Registers as rms_norm_quantize's on sm_90 (40 for the 16-bit per-token and per-group instances).

// Teams of two or more warps to a block, at most (blocks of 256 threads for teams below 256): the
// rows whose scalars go through shared memory.
static constexpr int NORM_SYNC_TEAMS = 4;

// 16 bytes from global src to shared dst without registers (sm_80+), completed by stage_wait.
__device__ __forceinline__ void stage16(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src)
                 : "memory");
}
__device__ __forceinline__ void stage_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// inv = 1 / sqrt(ss / H + eps), each step correctly rounded. ss / H is div_by(ss, H, RN(1 / H)) for
// ss in [2^-60, FLT_MAX] (normal operands, a quotient of at least 2^-74 and a remainder of at least
// 2^-120: the range where common.cuh's div_by is the IEEE quotient), div_rn elsewhere (0, tiny, inf,
// NaN); rcp_rn(v) is div_rn(1, v).
__device__ __forceinline__ float rms_inv(float ss, const NormArgs& a) {
    const unsigned b = __float_as_uint(ss);
    const float Hf = (float)a.H;
    const float mean = (b >= 0x21800000u && b < 0x7f800000u) ? div_by(ss, Hf, a.rcp_H) : div_rn(ss, Hf);
    return rcp_rn(sqrt_rn(add_rn(mean, a.eps)));
}

template <typename T, int SCHEME, class F, int OCC>
__global__ void __launch_bounds__(NORM_BLOCK_MAX, OCC)
rms_norm_quantize_lead(const T* __restrict__ x, T* __restrict__ residual, const T* __restrict__ weight,
                       T* __restrict__ y_out, unsigned char* __restrict__ q, unsigned* __restrict__ scales, NormArgs a,
                       ScaleArgs sa) {
    static_assert(SCHEME == NQ_TOKEN || SCHEME == NQ_TENSOR, "per-token and per-tensor scales only");
    sa.words = scales;
    constexpr int L = Unit<T>::LOADS;
    constexpr int UNITS = NORM_REG_BYTES / (16 * L);
    static_assert(UNITS == 1 || UNITS == 2, "one slot (float32) or two (16-bit types) a lane");
    constexpr unsigned FULL = 0xffffffffu;
    const int threads = 1 << a.team_shift;
    const int warps = threads >> 5;
    const int t = threadIdx.x & (threads - 1);
    const int lane = threadIdx.x & 31;
    const int tb = threadIdx.x >> a.team_shift;  // the team's index in the block
    const bool first_warp = t < 32;
    const i64 row = (i64)blockIdx.x * (blockDim.x >> a.team_shift) + tb;
    const bool valid = row < a.rows;  // a row of x; rows up to grid_rows only write padding scales
    const bool vec = a.vec != 0;
    const bool w_async = a.w_async != 0;
    const int H = a.H;
    __shared__ float lead_sums[UNITS][NORM_BLOCK_MAX / 32];  // the warps' slot sums
    __shared__ float lead_inv[NORM_SYNC_TEAMS];
    __shared__ unsigned lead_key[NORM_SYNC_TEAMS];           // NQ_TOKEN: the team's max |y| key
    extern __shared__ uint4 w_stage[];                       // w_async: [UNITS * L][blockDim.x]
    pdl_wait_then_release();  // no global access above this line

    // the caller's scale, loaded now: NQ_TENSOR's s
    float given = a.s_arg;
    if constexpr (SCHEME == NQ_TENSOR) {
        if (a.s_mode == SCALE_FROM_DEVICE) given = *a.s_ptr;
        if (blockIdx.x == 0 && threadIdx.x == 0) *a.s_out = given;
    }

    // the weight, read after the norm: on its way to shared memory (w_async) or to L1 now
    const bool whole = lane_whole<UNITS>(valid, vec, t, threads, H);
    if (w_async && whole) {
#pragma unroll
        for (int v = 0; v < UNITS; ++v)
#pragma unroll
            for (int l = 0; l < L; ++l)
                stage16(&w_stage[(v * L + l) * blockDim.x + threadIdx.x], weight + (v * threads + t) * 8 + l * 4);
    } else {
#pragma unroll
        for (int v = 0; v < UNITS; ++v) {
            const int c = (v * threads + t) * 8;
            if (valid && c < H) {
                if (w_async) {
#pragma unroll
                    for (int l = 0; l < L; ++l)
                        stage16(&w_stage[(v * L + l) * blockDim.x + threadIdx.x], weight + c + l * 4);
                } else {
                    asm volatile("prefetch.global.L1 [%0];" ::"l"(weight + c));
                }
            }
        }
    }

    // z in registers, as T's bits
    uint4 z[UNITS][L];
    load_row<T, UNITS>(x, residual, a, row, t, threads, valid, vec, z);

    // the scalars derived from the caller's, off the norm's chain
    float tensor_scale = 0.0f;
    if constexpr (SCHEME == NQ_TENSOR) tensor_scale = rcp_rn(given);
    if (SCHEME == NQ_TOKEN && warps > 1 && t == 0) lead_key[tb] = 0u;  // before the first barrier

    // the sum of squares: unit sums, then one tree over the lanes for both slots
    float p[UNITS];
    unit_sums<T, UNITS>(z, p);
    float s;  // UNITS == 2: even lanes slot 0's warp sum, odd lanes slot 1's; UNITS == 1: the warp sum
    if constexpr (UNITS == 2) {
        const bool odd = (lane & 1) != 0;
        s = add_rn(odd ? p[1] : p[0], __shfl_xor_sync(FULL, odd ? p[0] : p[1], 1));
    } else {
        s = add_rn(p[0], __shfl_xor_sync(FULL, p[0], 1));
    }
#pragma unroll
    for (int o = 2; o < 32; o *= 2) s = add_rn(s, __shfl_xor_sync(FULL, s, o));

    float inv;
    if (warps == 1) {
        inv = rms_inv(UNITS == 2 ? add_rn(s, __shfl_xor_sync(FULL, s, 1)) : s, a);
    } else {
        const int wb = threadIdx.x >> 5;  // the warp's index in the block
        if (lane < UNITS) lead_sums[lane][wb] = s;
        __syncthreads();
        if (first_warp) {
            // lane k takes warp (k mod warps): every aligned group of `warps` lanes sums all of them,
            // lowest warp bit first; then slot 0 + slot 1
            float ss = 0.0f;
#pragma unroll
            for (int v = 0; v < UNITS; ++v) {
                float sv = lead_sums[v][wb + (lane & (warps - 1))];
                for (int o = 1; o < warps; o *= 2) sv = add_rn(sv, __shfl_xor_sync(FULL, sv, o));
                ss = v == 0 ? sv : add_rn(ss, sv);
            }
            const float li = rms_inv(ss, a);
            if (lane == 0) lead_inv[tb] = li;
        }
        __syncthreads();
        inv = lead_inv[tb];
    }

    // y = round_T(round_T(z * inv) * w), in place of z (0 in padding rows)
    if (w_async) stage_wait();
    normalize_row<T, UNITS>(z, inv, weight, w_async, w_stage, y_out, a, row, t, threads, valid, vec);

    // scale_ub on the device: loaded ahead of the reductions that precede its use
    const float ub = SCHEME == NQ_TOKEN && sa.has_ub ? load_ub(sa) : 0.0f;
    if constexpr (SCHEME == NQ_TOKEN) {
        unsigned m = 0;
#pragma unroll
        for (int v = 0; v < UNITS; ++v)
#pragma unroll
            for (int l = 0; l < L; ++l) m = max(m, absmax16<T>(z[v][l]));
        m = warp_max(m);
        if (warps > 1) {
            if (lane == 0) atomicMax(&lead_key[tb], m);
            __syncthreads();
            m = lead_key[tb];
        }
        if (!valid) return;
        float tinv;
        const float sc = token_scale_lead<F>(sa, ub, __uint_as_float(m), tinv);
        const bool pow2 = sa.pow2 != 0;
        const bool exact_div = needs_exact_div(sa, sc);
        unsigned char* qr = q + row * a.q_row;
#pragma unroll
        for (int v = 0; v < UNITS; ++v) {
            const int c = (v * threads + t) * 8;
            if (c < H) {
                float f[8];
                unpack_unit<T>(z[v], f);
                const uint2 w = token_quant8<F>(f, sc, tinv, pow2, exact_div);
                const unsigned ww[2] = {w.x, w.y};
                store_bytes<8>(qr + c, H - c, ww, vec);
            }
        }
        if (t == 0) store_scale(sa, row, 0, sc);
    } else if constexpr (SCHEME == NQ_TENSOR) {
        // q = cvt(y * (1 / s)), 8 codes of a unit
        auto codes = [&](const uint4* y, unsigned* w) {
            float f[8];
            unpack_unit<T>(y, f);
#pragma unroll
            for (int h = 0; h < 2; ++h)
                w[h] = (unsigned)to_fp8x2<F>(mul_rn(f[4 * h], tensor_scale), mul_rn(f[4 * h + 1], tensor_scale)) |
                       ((unsigned)to_fp8x2<F>(mul_rn(f[4 * h + 2], tensor_scale), mul_rn(f[4 * h + 3], tensor_scale)) << 16);
        };
        if (!valid) return;
        if (whole) {
            unsigned char* qr = q + row * a.q_row;
#pragma unroll
            for (int v = 0; v < UNITS; ++v) {
                unsigned w[2];
                codes(z[v], w);
                *reinterpret_cast<uint2*>(qr + (v * threads + t) * 8) = make_uint2(w[0], w[1]);
            }
            return;
        }
#pragma unroll
        for (int v = 0; v < UNITS; ++v) {
            const int c = (v * threads + t) * 8;
            if (c < H) {
                unsigned w[2];
                codes(z[v], w);
                store_bytes<8>(q + row * a.q_row + c, H - c, w, vec);
            }
        }
    }
}
