// testing.cu: kernels that only the tests launch (cupyquant._testing), never a quantizer.
//
// cvt_check and e8m0_check run block_scale.cuh's element conversions one float at a time:
// codes[i] = the HW or SW conversion of the float with bits pats[i] (or base + i when pats is null)
// (cvt_check), or the E8M0 round-up of its magnitude (e8m0_check): lets the tests compare both paths
// over every float32 bit pattern, and against the reference.

#include "block_scale.cuh"

template <class F, bool HW>
__global__ void cvt_check(const unsigned* __restrict__ pats, unsigned base, i64 n, unsigned char* __restrict__ codes) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float v = __uint_as_float(pats ? pats[i] : base + (unsigned)i);
    codes[i] = (unsigned char)(cvt_x2<F, HW>(v, 0.0f) & ((1u << Fmt<F>::BITS) - 1u));
}

template <bool HW>
__global__ void e8m0_check(const unsigned* __restrict__ pats, unsigned base, i64 n, unsigned char* __restrict__ codes) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    codes[i] = (unsigned char)e8m0_ceil<HW>(__uint_as_float((pats ? pats[i] : base + (unsigned)i) & 0x7fffffffu));
}
