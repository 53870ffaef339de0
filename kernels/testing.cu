// testing.cu: kernels that only the tests launch (cupyquant._testing), never a quantizer.
//
// cvt_check and e8m0_check run block_scale.cuh's element conversions one float at a time:
// codes[i] = the HW or SW conversion of the float with bits pats[i] (or base + i when pats is null)
// (cvt_check), or the E8M0 round-up of its magnitude (e8m0_check): lets the tests compare both paths
// over every float32 bit pattern, and against the reference.

#include "block_scale.cuh"
#include "weight_mma.cuh"

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

// fp4_frag_check runs weight_mma.cuh's fp4_frag<T> (the four registers of a fragment-ordered word of
// E2M1 codes) on the words base + i, i < n (or words[i] where words is not null): regs[4 i + j] is
// register j where regs is not null, and bad[0] counts the registers that differ from the
// shift-and-mask form (the word shifted left by 4 (3 - j): its sign bits kept, and shifted right
// by SHIFT, its value bits), so that the tests compare both over every 32-bit word on the device.
template <typename T>
__global__ void fp4_frag_check(const unsigned* __restrict__ words, unsigned base, i64 n, unsigned* __restrict__ regs, unsigned long long* __restrict__ bad) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const unsigned w = words ? words[i] : base + (unsigned)i;
    unsigned n_bad = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const unsigned r = fp4_frag<T>(w, j), x = w << (4 * (3 - j));
        n_bad += r != ((x & 0x80008000u) | ((x >> Fp4Bits<T>::SHIFT) & Fp4Bits<T>::MAG));
        if (regs) regs[4 * i + j] = r;
    }
    if (n_bad) atomicAdd(bad, (unsigned long long)n_bad);
}

// fp4_scale_pairs_check runs weight_mma.cuh's fp4_scale_pairs<T, W_NVFP4> on the words base + i,
// i < n (four E4M3 scale bytes each), and bad[0] counts the 16-bit scales that differ from
// fp4_scale2 of their byte (NaN bytes, 0x7f and 0xff: that are not a NaN of T).
template <typename T>
__global__ void fp4_scale_pairs_check(unsigned base, i64 n, unsigned long long* __restrict__ bad) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const unsigned w = base + (unsigned)i;
    unsigned sc[2];
    fp4_scale_pairs<T, W_NVFP4>(w, sc);
    constexpr unsigned EXP = cq::same_type<T, __half>::value ? 0x7c00u : 0x7f80u;
    unsigned n_bad = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const unsigned b = (w >> (8 * k)) & 0xffu, got = (sc[k >> 1] >> (16 * (k & 1))) & 0xffffu;
        if ((b & 0x7fu) == 0x7fu) n_bad += (got & EXP) != EXP || (got & 0x7fffu) == EXP;
        else n_bad += got != (fp4_scale2<T, W_NVFP4>(b) & 0xffffu);
    }
    if (n_bad) atomicAdd(bad, (unsigned long long)n_bad);
}
