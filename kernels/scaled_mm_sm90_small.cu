// scaled_mm_sm90_small.cu: the W8A8 FP8 and INT8 matmul y = dequant(a) @ dequant(b).T (+ bias) for few rows of
// a (M <= TOK, TOK = 16 or 32; cupyquant/w8a8/sm90_small.py builds 16) on Hopper, with the operands swapped: the weights b fill wgmma's
// 64-row side and a's rows are its N = TOK columns, so that a block streams 64 rows of weights
// through the tensor cores with no rows of zeros multiplied (the 64-row tiles of scaled_mm_sm90.cu
// multiply 64 - M rows of zeros and read the weights a tile at a time). What it computes, the scale
// addressing and the K-split rule are kernels/scaled_mm.cuh's (cupyquant/reference/w8a8.py is the
// oracle). Compiled for sm_90a only (a stub that traps elsewhere, never launched there).
//
// Block (tile, part) = (blockIdx.x, blockIdx.y) takes b's rows n0 = 64 tile .. + 63 and the 128-k
// blocks of K part `part` (p.kb_per_split blocks a part). The last warpgroup (its first thread)
// loads a ring of STAGES slots by TMA, one 128-k block a slot: 64 rows of b and TOK rows of a (rows
// past M or N and k past K read as zeros); the first warpgroup multiplies them, four wgmma
// m64nTOKk32 a block into fresh float32 sums (tmp), waits for them, releases the slot and adds tmp
// into acc by the block rule of scaled_mm.cuh (the promotion), as scaled_mm_sm90.cu does. INT8 sums
// every block into the same int32 acc (exact) and waits only for the block before the one it just
// issued before it releases that block's slot; scaled_mm.cuh's integer epilogue (zero points, scales)
// follows the sum over all of K (a K split adds its parts' integer sums first).
//
// Lane (g, t) of warp q holds, in accumulator i, row 16 q + g + 8 ((i >> 1) & 1) of the tile (b's
// row n0 + that) and column 8 (i >> 2) + 2 t + (i & 1) (a's row m): y[m][n]. Without a K split
// each value is rounded and stored on its own (2- or 4-byte stores: a tile of y is TOK x 64 values);
// with one, each part stores its values to the workspace in the thread's own order, and the last
// part to arrive sums the parts in part order 0, 1, ... (two parts' loads at a time) and stores.
// Two blocks fit a SM (256 threads, up to 97 KB of shared memory each), so that one's loads stream
// while the other starts or ends.

#include "common.cuh"
#include "scaled_mm.cuh"
#include "sm90_async.cuh"
#include "sm90_wgmma.cuh"

using namespace cq;

template <int FA, int FB, typename TY, int MODE, int TOK, int STAGES>
__global__ void __launch_bounds__(256, 2)
    scaled_mm_sm90_small(const __grid_constant__ TmaMap tma, const __grid_constant__ TmaMap tmb, const void* __restrict__ sa,
                         const float* __restrict__ sb, const int* __restrict__ azp, const int* __restrict__ adj, const TY* __restrict__ bias,
                         TY* __restrict__ y, float* __restrict__ ws, int* __restrict__ counters, MmArgs p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr bool INT = FA == S8;
    static_assert(INT == (FB == S8) && (!INT || MODE == MODE_END), "FP8 pairs, or INT8 with scales that do not vary along K");
    static_assert(TOK == 16 || TOK == 32, "wgmma widths of sm90_wgmma.cuh's FP8 wrappers");
    constexpr int BW = 64;                                 // rows of b a block (wgmma's M)
    constexpr int W_BYTES = BW * 128, STAGE = (BW + TOK) * 128;  // multiples of 1024: every slot stays 1024-aligned
    constexpr int ND = TOK / 2;                            // accumulators a thread
    constexpr int NA = TOK / 4;                            // a's rows (y's rows) a thread holds: 8 jj + 2 t + e
    extern __shared__ uint4 smem_raw[];
    __shared__ __align__(8) unsigned long long mb_full[STAGES], mb_empty[STAGES];
    __shared__ int s_last;
    const unsigned raw = (unsigned)__cvta_generic_to_shared(smem_raw);
    const unsigned sbase = (raw + 1023u) & ~1023u;
    const unsigned full0 = (unsigned)__cvta_generic_to_shared(mb_full), empty0 = (unsigned)__cvta_generic_to_shared(mb_empty);

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int tile = blockIdx.x, part = blockIdx.y, tiles = gridDim.x;
    const i64 n0 = (i64)tile * BW;
    const int nkb = (int)((p.K + 127) / 128);
    const int kb0 = part * p.kb_per_split, niter = min(p.kb_per_split, nkb - kb0);  // >= 1: the host cuts K so

    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) mbar_init(full0 + 8 * s, 1), mbar_init(empty0 + 8 * s, 4);
    }
    __syncthreads();

    if (warp >= 4) {  // the producer warpgroup: one thread issues every TMA load
        if (tid == 128) {
#pragma unroll 1
            for (int i = 0; i < niter; ++i) {
                const int slot = i % STAGES;
                if (i >= STAGES) mbar_wait(empty0 + 8 * slot, ((i / STAGES) - 1) & 1);  // the slot's last use is retired
                const unsigned dst = sbase + (unsigned)(slot * STAGE), bar = full0 + 8 * slot;
                mbar_expect_tx(bar, STAGE);
                const int k = (kb0 + i) * 128;
                tma_load_2d(dst, &tmb, bar, k, (int)n0);
                tma_load_2d(dst + W_BYTES, &tma, bar, k, 0);
            }
        }
        return;  // the consumers' barrier (named, 128 threads) counts only themselves
    }

    const int g = lane >> 2, t = lane & 3;
    const int rowb = warp * 16 + g;  // this thread's rows of b in the tile: rowb, rowb + 8
    // descriptors as scaled_mm_sm90.cu's: 128-byte swizzle, 8-row groups 1024 bytes apart
    constexpr unsigned long long DESC_HI = (1ull << 62) | ((unsigned long long)(1024 >> 4) << 32) | (1ull << 16);
    const unsigned bdesc0 = (unsigned)DESC_HI | (sbase >> 4);                       // b's rows: wgmma's A
    const unsigned adesc0 = (unsigned)DESC_HI | ((sbase + (unsigned)W_BYTES) >> 4);  // a's rows: wgmma's B
    auto desc = [](unsigned lo) { return (DESC_HI & 0xffffffff00000000ull) | lo; };

    // a's scale rows of this thread's columns (rows of a past M read the last row's, never stored),
    // b's rows (past N: the last row's)
    i64 ra[NA];
#pragma unroll
    for (int c = 0; c < NA; ++c) ra[c] = a_scale_row(p, min((i64)(8 * (c >> 1) + 2 * t + (c & 1)), p.M - 1));
    const i64 nb0 = min(n0 + rowb, p.N - 1), nb1 = min(n0 + rowb + 8, p.N - 1);
    auto col_of = [](int i) { return 2 * (i >> 2) + (i & 1); };  // accumulator i's entry of ra
    auto half_of = [](int i) { return (i >> 1) & 1; };           // accumulator i's row: rowb + 8 half

    using Acc = typename cond_type<INT, int, float>::type;
    Acc acc[ND];
    float tmp[INT ? 1 : ND];
#pragma unroll
    for (int i = 0; i < ND; ++i) acc[i] = Acc(0);
#pragma unroll
    for (int i = 0; i < (INT ? 1 : ND); ++i) tmp[i] = 0.0f;

#pragma unroll 1
    for (int i = 0; i < niter; ++i) {
        const int slot = i % STAGES, kb = kb0 + i;
        // the block's scales, loaded before the wait so that their latency hides behind it
        float s_a[MODE == MODE_END ? 1 : NA], s_b[MODE == MODE_K_COL ? 2 : 1];
        if constexpr (MODE != MODE_END) {
#pragma unroll
            for (int c = 0; c < NA; ++c) s_a[c] = a_scale(p, sa, ra[c], kb);
            s_b[0] = b_scale(p, sb, nb0, kb);
            if constexpr (MODE == MODE_K_COL) s_b[1] = b_scale(p, sb, nb1, kb);
        }
        mbar_wait(full0 + 8 * slot, (unsigned)((i / STAGES) & 1));
        const unsigned off = (unsigned)(slot * (STAGE >> 4));
        wg_fence();
        if constexpr (INT) {  // into acc; the previous block's slot is released once it retires
#pragma unroll
            for (int s = 0; s < 4; ++s) WgmmaS8<TOK>::mma(acc, desc(bdesc0 + off + 2 * s), desc(adesc0 + off + 2 * s), i > 0 || s > 0);
            wg_commit();
            wg_wait<1>();
            __syncwarp();
            if (lane == 0 && i > 0) mbar_arrive(empty0 + 8 * ((i + STAGES - 1) % STAGES));
        } else {
#pragma unroll
            for (int s = 0; s < 4; ++s) WgmmaFp8<FB, FA, TOK>::mma(tmp, desc(bdesc0 + off + 2 * s), desc(adesc0 + off + 2 * s), s);
            wg_commit();
            wg_wait<0>();
            __syncwarp();  // every lane's wgmmas of the slot are retired
            if (lane == 0) mbar_arrive(empty0 + 8 * slot);
            if constexpr (MODE == MODE_END) {
#pragma unroll
                for (int r = 0; r < ND; ++r) acc[r] = add_rn(acc[r], tmp[r]);
            } else {
#pragma unroll
                for (int r = 0; r < ND; ++r) {
                    const float s_br = MODE == MODE_K_COL ? s_b[half_of(r)] : s_b[0];
                    acc[r] = fma_rn(tmp[r], mul_rn(s_a[col_of(r)], s_br), acc[r]);
                }
            }
        }
    }
    if constexpr (INT) {  // the last block retires (its slot needs no release: nothing refills it)
        wg_wait<0>();
    } else if constexpr (MODE == MODE_END) {  // v = acc * (sa * sb), the scales of block 0
        float s_a[NA];
#pragma unroll
        for (int c = 0; c < NA; ++c) s_a[c] = a_scale(p, sa, ra[c], 0);
        const float s_b0 = b_scale(p, sb, nb0, 0), s_b1 = b_scale(p, sb, nb1, 0);
#pragma unroll
        for (int r = 0; r < ND; ++r) acc[r] = mul_rn(acc[r], mul_rn(s_a[col_of(r)], half_of(r) ? s_b1 : s_b0));
    }

    if (p.splits > 1) {
        // K split: this part's sums to its place in ws (part, tile, thread; INT8's int bits), then the
        // last part to arrive adds every part's (its own read back too): floats in part order 0, 1,
        // ..., two parts' loads in flight together; ints (exact, wrapping) likewise
        auto bits = [](Acc v) {
            if constexpr (INT) {
                return __int_as_float(v);
            } else {
                return v;
            }
        };
        auto add = [](Acc a, float x) {
            if constexpr (INT) {
                return (int)((unsigned)a + __float_as_uint(x));
            } else {
                return add_rn(a, x);
            }
        };
        auto from = [](float x) {
            if constexpr (INT) {
                return __float_as_int(x);
            } else {
                return x;
            }
        };
        float* own = ws + (((i64)part * tiles + tile) * 128 + tid) * ND;
#pragma unroll
        for (int r = 0; r < ND; r += 4) __stcg(reinterpret_cast<float4*>(own + r), make_float4(bits(acc[r]), bits(acc[r + 1]), bits(acc[r + 2]), bits(acc[r + 3])));
        named_sync(128);  // every partial is stored before thread 0 counts this part as arrived
        if (tid == 0) {
            int old;
            asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(counters + tile) : "memory");
            s_last = old == p.splits - 1;
        }
        named_sync(128);
        if (!s_last) return;
        auto load = [&](int sp, int r) { return __ldcg(reinterpret_cast<const float4*>(ws + (((i64)sp * tiles + tile) * 128 + tid) * ND + r)); };
#pragma unroll 1
        for (int sp = 0; sp < p.splits; sp += 2) {
            const bool two = sp + 1 < p.splits;
            const int sq = two ? sp + 1 : sp;
#pragma unroll
            for (int r = 0; r < ND; r += 4) {
                const float4 x = load(sp, r), x2 = load(sq, r);
                const float xs[4] = {x.x, x.y, x.z, x.w}, x2s[4] = {x2.x, x2.y, x2.z, x2.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    acc[r + e] = sp == 0 ? from(xs[e]) : add(acc[r + e], xs[e]);
                    if (two) acc[r + e] = add(acc[r + e], x2s[e]);
                }
            }
        }
        if (tid == 0) counters[tile] = 0;  // ready for the next call
    }

    // y[m][n] = round(v + bias[n]) for m < M, n < N; INT8's v from its integer sum (scaled_mm.cuh)
#pragma unroll
    for (int r = 0; r < ND; ++r) {
        const i64 m = 8 * (r >> 2) + 2 * t + (r & 1), n = n0 + rowb + 8 * half_of(r);
        if (m >= p.M || n >= p.N) continue;
        float x;
        if constexpr (INT) {
            const int z = a_zero(p, azp, a_zero_row(p, m));
            x = int_epilogue(adj, n, acc[r], z, mul_rn(a_scale(p, sa, ra[col_of(r)], 0), b_scale(p, sb, n, 0)));
        } else {
            x = acc[r];
        }
        if (p.has_bias) x = add_rn(x, to_float(bias[n]));
        if constexpr (same_type<TY, float>::value) {
            y[m * p.ldy + n] = x;
        } else {
            reinterpret_cast<unsigned short*>(y)[m * p.ldy + n] = bits16_rn<TY>(x);
        }
    }
#else
    __trap();  // built only for sm_90a; the host never launches this stub
#endif
}
