// nvfp4.cu: NVFP4 quantization and dequantization (blocks of 16 E2M1 values with E4M3 scales and
// one float32 global scale).
//
// What it computes (reference: cupyquant.reference.quantize_nvfp4 / dequantize_nvfp4, which these
// kernels match bit for bit; every float step is IEEE float32):
//   nvfp4_quantize   TransformerEngine's exact NVFP4 path: S_enc = 2688 / global_amax (or given),
//                    sf = e4m3(fminf(block_amax * (S_enc * float32(1/6)), FLT_MAX)) with block_amax
//                    NaN-ignoring; inv = fminf(1 / (float(sf) * (1 / S_enc)), FLT_MAX);
//                    q = e2m1_satfinite_rn(x * inv).
//   nvfp4_dequantize y = round_rn(float(q) * (float(sf) * (1 / S_enc))).
// The global amax comes from per_tensor.cu's fp8_amax. Conversions, layouts and the thread mapping:
// block_scale.cuh.
// PDL: each kernel calls pdl_wait_then_release() (common.cuh) once in every thread, before its first
// global load or store, so that the wrappers may launch it with programmatic dependent launch.

#include "block_scale.cuh"

template <typename T, bool VEC, bool HW>
__global__ void __launch_bounds__(THREADS, 3)
nvfp4_quantize(const T* __restrict__ x, unsigned char* __restrict__ q, unsigned char* __restrict__ scales, QuantArgs a) {
    pdl_wait_then_release();
    block_quantize<T, E2M1, 16, true, VEC, HW>(x, q, scales, a);
}

// The small geometry (block_scale.cuh small_quantize): one thread per 16-element segment, for few rows.
template <typename T, bool VEC, bool HW>
__global__ void __launch_bounds__(SMALL_THREADS)
nvfp4_quantize_small(const T* __restrict__ x, unsigned char* __restrict__ q, unsigned char* __restrict__ scales, QuantArgs a) {
    pdl_wait_then_release();
    small_quantize<T, E2M1, 16, true, VEC, HW>(x, q, scales, a);
}

// The wide geometry (block_scale.cuh wide_quantize): a thread per segment in four rows, for many rows.
template <typename T, bool VEC, bool HW>
__global__ void __launch_bounds__(SMALL_THREADS)
nvfp4_quantize_wide(const T* __restrict__ x, unsigned char* __restrict__ q, unsigned char* __restrict__ scales, QuantArgs a) {
    pdl_wait_then_release();
    wide_quantize<T, E2M1, 16, true, VEC, HW>(x, q, scales, a);
}

template <typename T, bool VEC>
__global__ void __launch_bounds__(256)
nvfp4_dequantize(const unsigned char* __restrict__ q, const unsigned char* __restrict__ scales, T* __restrict__ y, DequantArgs a) {
    pdl_wait_then_release();
    block_dequantize<T, E2M1, 16, true, VEC>(q, scales, y, a);
}
