// mx.cu: MXFP8 and MXFP4 quantization and dequantization (OCP MX v1.0: blocks of 32 with E8M0
// scales).
//
// What it computes (reference: cupyquant.reference.quantize_mx / dequantize_mx, which these kernels
// match bit for bit; every float step is IEEE float32):
//   mx_quantize      amax = max|x| over a block of 32 (NaN propagates: any NaN makes the block NaN);
//                    E = e8m0_ceil(amax * float32(1 / elem_max)) ("ceil", cuBLAS/TransformerEngine)
//                    or max(exponent(amax) - emax_elem, 0) ("floor", OCP); NaN -> 255, inf -> 254;
//                    q = cvt_satfinite_rn(x * 2^(127 - E)) with 2^-127 (subnormal) for E = 254 and
//                    NaN for E = 255.
//   mx_dequantize    y = round_rn(float(q) * 2^(E - 127)) (mx_dequantize_flat: the same for MXFP8,
//                    in the flat geometry of flat_dequant.cuh).
// Conversions, layouts and the thread mapping: block_scale.cuh; the flat geometry of the MXFP8
// dequantizer: flat_dequant.cuh.
// PDL: each kernel calls pdl_wait_then_release() (common.cuh) once in every thread, before its first
// global load or store, so that the wrappers may launch it with programmatic dependent launch.

#include "block_scale.cuh"
#include "flat_dequant.cuh"

// MXFP8 / MXFP4. Grid: one block per (row tile, K tile), K tiles fastest (so that consecutive
// blocks write consecutive 512-byte swizzled units).
// Three blocks per SM (at most 85 registers) keep 3 x 256 x 4 x 32 bytes of loads in flight per SM.
template <typename T, class F, bool VEC, bool HW>
__global__ void __launch_bounds__(THREADS, 3)
mx_quantize(const T* __restrict__ x, unsigned char* __restrict__ q, unsigned char* __restrict__ scales, QuantArgs a) {
    pdl_wait_then_release();
    block_quantize<T, F, 32, false, VEC, HW>(x, q, scales, a);
}

// The small geometry (block_scale.cuh small_quantize): one thread per 16-element segment, for few rows.
template <typename T, class F, bool VEC, bool HW>
__global__ void __launch_bounds__(SMALL_THREADS)
mx_quantize_small(const T* __restrict__ x, unsigned char* __restrict__ q, unsigned char* __restrict__ scales, QuantArgs a) {
    pdl_wait_then_release();
    small_quantize<T, F, 32, false, VEC, HW>(x, q, scales, a);
}

// The wide geometry (block_scale.cuh wide_quantize): a thread per segment in four rows, for many rows.
template <typename T, class F, bool VEC, bool HW>
__global__ void __launch_bounds__(SMALL_THREADS)
mx_quantize_wide(const T* __restrict__ x, unsigned char* __restrict__ q, unsigned char* __restrict__ scales, QuantArgs a) {
    pdl_wait_then_release();
    wide_quantize<T, F, 32, false, VEC, HW>(x, q, scales, a);
}

template <typename T, class F, bool VEC>
__global__ void __launch_bounds__(256)
mx_dequantize(const unsigned char* __restrict__ q, const unsigned char* __restrict__ scales, T* __restrict__ y, DequantArgs a) {
    pdl_wait_then_release();
    block_dequantize<T, F, 32, false, VEC>(q, scales, y, a);
}

// MXFP8 in the flat geometry (flat_dequant.cuh): PIECES pieces of 8 codes per thread, q 8-byte and y
// 16-byte aligned, any K; the scale of (row, col) is the E8M0 byte of block col / 32 in the dense or
// (SWIZZLED) the swizzled layout: block_scale.cuh's scale_offset in 32-bit, rows and scale offsets
// being below 2^31 where the flat kernel runs.
template <bool SWIZZLED> struct MxScale {
    const unsigned char* __restrict__ scales;
    unsigned n_blocks;
    __device__ __forceinline__ unsigned load(unsigned m, unsigned col) const {
        const unsigned k = col >> 5;
        if constexpr (!SWIZZLED) return __ldg(scales + m * n_blocks + k);
        const unsigned o = ((m >> 7) * ((n_blocks + 3) >> 2) + (k >> 2)) * 512 + (m & 31) * 16 + ((m >> 5) & 3) * 4 + (k & 3);
        return __ldg(scales + o);
    }
    __device__ __forceinline__ float value(unsigned E, unsigned) const { return e8m0_to_float(E); }
};

template <typename T, class F, int PIECES, bool SWIZZLED>
__global__ void __launch_bounds__(FLAT_THREADS)
mx_dequantize_flat(const unsigned char* __restrict__ q, const unsigned char* __restrict__ scales, T* __restrict__ y,
                   DequantArgs a, FlatRows f) {
    pdl_wait_then_release();
    flat_dequantize<T, F, PIECES>(q, y, f, 5, MxScale<SWIZZLED>{scales, (unsigned)a.n_blocks});
}
