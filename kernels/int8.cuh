// int8.cuh: the INT8 conversions of vLLM's int8 kernels
// (csrc/quantization/compressed_tensors/int8_quant_kernels.cu: float_to_int8_rn, float_to_int32_rn,
// int32_to_int8) and the zero-point arithmetic built on them, shared by groupwise.cu (per-token
// INT8, symmetric and asymmetric) and per_tensor.cu (static per-tensor INT8). Reference:
// cupyquant/reference/_common.py (int8_rn, int32_rn, azp_codes, minus_zero_point), bit for bit.
//
//   to_int8_rn(v)     cvt.rni.sat.s8.f32: round half to even, saturate to [-128, 127], NaN -> 0
//   to_int32_rn(v)    cvt.rni.sat.s32.f32: round half to even, saturate to [-2^31, 2^31 - 1], NaN -> 0
//   int32_to_int8(i)  cvt.sat.s8.s32: saturate to [-128, 127]
//   azp_code(v, z)    int32_to_int8(to_int32_rn(v) + z), the int32 sum wrapping (two's complement,
//                     what vLLM's `float_to_int32_rn(v) + azp` compiles to)
//   minus_zero_point(b, z)  float32(q - z) for the int8 code q of byte b: q - z exact in 64 bits, one
//                     rounding to nearest even (exact when |q - z| <= 2^24)
#pragma once

#include "common.cuh"

namespace cq {

__device__ __forceinline__ unsigned char to_int8_rn(float v) {
    int r;
    asm("cvt.rni.sat.s8.f32 %0, %1;" : "=r"(r) : "f"(v));
    return (unsigned char)(r & 0xff);
}

__device__ __forceinline__ int to_int32_rn(float v) {
    int r;
    asm("cvt.rni.sat.s32.f32 %0, %1;" : "=r"(r) : "f"(v));
    return r;
}

__device__ __forceinline__ unsigned char int32_to_int8(int v) {
    int r;
    asm("cvt.sat.s8.s32 %0, %1;" : "=r"(r) : "r"(v));
    return (unsigned char)(r & 0xff);
}

__device__ __forceinline__ unsigned char azp_code(float v, int z) {
    return int32_to_int8((int)((unsigned)to_int32_rn(v) + (unsigned)z));
}

__device__ __forceinline__ float minus_zero_point(unsigned char b, int z) {
    return (float)((i64)(signed char)b - (i64)z);  // cvt.rn.f32.s64
}

// a - b without flushing subnormals (sub.rn.f32; CuPy's -ftz=true would make `a - b` sub.ftz)
__device__ __forceinline__ float sub_rn(float a, float b) {
    float r;
    asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

}  // namespace cq
