// scaled_mm_sm90_small.cu: the W8A8 FP8 and INT8 matmul y = dequant(a) @ dequant(b).T (+ bias) for few rows of
// a (M <= TOK, TOK = 16 or 32; cupyquant/w8a8/sm90_small.py builds 16) on Hopper, with the operands swapped: the weights b fill wgmma's
// 64-row side and a's rows are its N = TOK columns, so that a block streams 64 rows of weights
// through the tensor cores with no rows of zeros multiplied (the 64-row tiles of scaled_mm_sm90.cu
// multiply 64 - M rows of zeros and read the weights a tile at a time). What it computes, the scale
// addressing and the K-split rule are kernels/scaled_mm.cuh's (cupyquant/reference/w8a8.py is the
// oracle). Compiled for sm_90a only (a stub that traps elsewhere, never launched there).
//
// Block (tile, part) = (blockIdx.x, blockIdx.y) takes b's rows n0 = 64 tile .. + 63 and the 128-k
// blocks of K part `part` (p.kb_per_split blocks a part, a multiple of KPS when K is split). The
// last warpgroup (its first thread) loads a ring of STAGES slots by TMA, KPS 128-k blocks a slot,
// each block a box of 64 rows of b and one of TOK rows of a (rows past M or N and k past K read as
// zeros). The first warpgroup multiplies them, four wgmma m64nTOKk32 a block into fresh float32
// sums (tmp, one set a block of the slot), waits for the slot's wgmmas, releases the slot and adds
// each block's tmp into acc by the block rule of scaled_mm.cuh (the promotion), in block order, as
// scaled_mm_sm90.cu does. INT8 sums every block into the same int32 acc (exact) and waits only for
// the slot before the one it just issued before it releases that slot; scaled_mm.cuh's integer
// epilogue (zero points, scales) follows the sum over all of K (a K split adds its parts' integer
// sums first). KPS (cupyquant/w8a8/sm90_small.py SLOTS, with the measurements) is 4 where the
// scales vary along K (one wait a slot, not a block, before the promotions' multiplies), 1 for FP8
// per tensor or per token, where the sums only add, and 2 for INT8. A slot's weights as one box of a 4-d
// tensor map, so that each row's 512 bytes are read together, measured no faster than 4 boxes; a's
// rows of a whole part loaded once (resident, the ring holding weights only) measured slower (the
// part's first multiply waits for all of them, and the space they take cuts K into more parts).
//
// Programmatic dependent launch: every thread waits (griddepcontrol.wait) before it reads memory
// that the kernel before on the stream may write; with p.early (cupyquant/w8a8/sm90_small.py: a
// weight that an earlier call has read) the producer issues the first slots' weights before that
// wait, so that they stream while the kernel before ends.
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

template <int FA, int FB, typename TY, int MODE, int TOK, int KPS, int STAGES>
__global__ void __launch_bounds__(256, 2)
    scaled_mm_sm90_small(const __grid_constant__ TmaMap tma, const __grid_constant__ TmaMap tmb, const void* __restrict__ sa,
                         const float* __restrict__ sb, const int* __restrict__ azp, const int* __restrict__ adj, const TY* __restrict__ bias,
                         TY* __restrict__ y, float* __restrict__ ws, int* __restrict__ counters, MmArgs p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr bool INT = FA == S8;
    static_assert(INT == (FB == S8) && (!INT || MODE == MODE_END), "FP8 pairs, or INT8 with scales that do not vary along K");
    static_assert(TOK == 16 || TOK == 32, "wgmma widths of sm90_wgmma.cuh's FP8 wrappers");
    constexpr int BW = 64;                                  // rows of b a block (wgmma's M)
    constexpr int W_BLOCK = BW * 128, A_BLOCK = TOK * 128;  // bytes of one 128-k block of b's rows, of a's
    constexpr int W_SLOT = KPS * W_BLOCK, STAGE = KPS * (W_BLOCK + A_BLOCK);  // a slot: weights, then a's rows; multiples of 1024
    constexpr int ND = TOK / 2;                             // accumulators a thread
    constexpr int NA = TOK / 4;                             // a's rows (y's rows) a thread holds: 8 jj + 2 t + e
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
    const int kb0 = part * p.kb_per_split, nblk = min(p.kb_per_split, nkb - kb0);  // >= 1: the host cuts K so
    const int niter = (nblk + KPS - 1) / KPS;                                         // slots of this part

    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) mbar_init(full0 + 8 * s, 1), mbar_init(empty0 + 8 * s, 4);
    }
    __syncthreads();

    // slot i's weights: its KPS blocks of b's 64 rows (blocks past K, zeros; with a K split the part's
    // blocks, KPS dividing kb_per_split), loaded by the producer thread
    auto load_b = [&](int i) {
        const int slot = i % STAGES;
        const unsigned dst = sbase + (unsigned)(slot * STAGE), bar = full0 + 8 * slot;
        const int kb = kb0 + i * KPS;
        mbar_expect_tx(bar, STAGE);
#pragma unroll
        for (int j = 0; j < KPS; ++j) tma_load_2d(dst + j * W_BLOCK, &tmb, bar, (kb + j) * 128, (int)n0);
    };
    const int early = p.early ? min(niter, STAGES) : 0;  // slots whose weights go before the PDL wait
    if (tid == 128) {
        prefetch_tensor_map(&tma);
        prefetch_tensor_map(&tmb);
#pragma unroll 1
        for (int i = 0; i < early; ++i) load_b(i);
    }
    pdl_wait_then_release();  // no global access above this line but the early weights

    if (warp >= 4) {  // the producer warpgroup: one thread issues every TMA load
        if (tid == 128) {
#pragma unroll 1
            for (int i = 0; i < niter; ++i) {
                const int slot = i % STAGES;
                if (i >= STAGES) mbar_wait(empty0 + 8 * slot, ((i / STAGES) - 1) & 1);  // the slot's last use is retired
                if (i >= early) load_b(i);
                const unsigned dst = sbase + (unsigned)(slot * STAGE + W_SLOT), bar = full0 + 8 * slot;
#pragma unroll
                for (int j = 0; j < KPS; ++j) tma_load_2d(dst + j * A_BLOCK, &tma, bar, (kb0 + i * KPS + j) * 128, 0);
            }
        }
        return;  // the consumers' barrier (named, 128 threads) counts only themselves
    }

    const int g = lane >> 2, t = lane & 3;
    const int rowb = warp * 16 + g;  // this thread's rows of b in the tile: rowb, rowb + 8
    // descriptors as scaled_mm_sm90.cu's: 128-byte swizzle, 8-row groups 1024 bytes apart; block j
    // of a slot W_BLOCK (b) or A_BLOCK (a) bytes further
    constexpr unsigned long long DESC_HI = (1ull << 62) | ((unsigned long long)(1024 >> 4) << 32) | (1ull << 16);
    const unsigned bdesc0 = (unsigned)DESC_HI | (sbase >> 4);                       // b's rows: wgmma's A
    const unsigned adesc0 = (unsigned)DESC_HI | ((sbase + (unsigned)W_SLOT) >> 4);  // a's rows: wgmma's B
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
    float tmp[INT ? 1 : KPS][INT ? 1 : ND];
#pragma unroll
    for (int i = 0; i < ND; ++i) acc[i] = Acc(0);
#pragma unroll
    for (int j = 0; j < (INT ? 1 : KPS); ++j)
#pragma unroll
        for (int i = 0; i < (INT ? 1 : ND); ++i) tmp[j][i] = 0.0f;

#pragma unroll 1
    for (int i = 0; i < niter; ++i) {
        const int slot = i % STAGES, kb = kb0 + i * KPS, nb = min(KPS, nblk - i * KPS);  // blocks of the part in this slot
        // the blocks' scales, loaded before the wait so that their latency hides behind it
        float s_a[MODE == MODE_END ? 1 : KPS][MODE == MODE_END ? 1 : NA], s_b[MODE == MODE_END ? 1 : KPS][MODE == MODE_K_COL ? 2 : 1];
        if constexpr (MODE != MODE_END) {
#pragma unroll
            for (int j = 0; j < KPS; ++j) {
                const int kbj = min(kb + j, nkb - 1);  // past K: a block whose sums are not added
#pragma unroll
                for (int c = 0; c < NA; ++c) s_a[j][c] = a_scale(p, sa, ra[c], kbj);
                s_b[j][0] = b_scale(p, sb, nb0, kbj);
                if constexpr (MODE == MODE_K_COL) s_b[j][1] = b_scale(p, sb, nb1, kbj);
            }
        }
        mbar_wait(full0 + 8 * slot, (unsigned)((i / STAGES) & 1));
        const unsigned off = (unsigned)(slot * (STAGE >> 4));
        wg_fence();
        if constexpr (INT) {  // into acc; the previous slot is released once its wgmmas retire
#pragma unroll
            for (int j = 0; j < KPS; ++j)
#pragma unroll
                for (int s = 0; s < 4; ++s)
                    WgmmaS8<TOK>::mma(acc, desc(bdesc0 + off + j * (W_BLOCK >> 4) + 2 * s), desc(adesc0 + off + j * (A_BLOCK >> 4) + 2 * s),
                                      i > 0 || j > 0 || s > 0);
            wg_commit();
            wg_wait<1>();
            __syncwarp();
            if (lane == 0 && i > 0) mbar_arrive(empty0 + 8 * ((i + STAGES - 1) % STAGES));
        } else {
#pragma unroll
            for (int j = 0; j < KPS; ++j)
#pragma unroll
                for (int s = 0; s < 4; ++s)
                    WgmmaFp8<FB, FA, TOK>::mma(tmp[j], desc(bdesc0 + off + j * (W_BLOCK >> 4) + 2 * s), desc(adesc0 + off + j * (A_BLOCK >> 4) + 2 * s), s);
            wg_commit();
            wg_wait<0>();
            __syncwarp();  // every lane's wgmmas of the slot are retired
            if (lane == 0) mbar_arrive(empty0 + 8 * slot);
#pragma unroll
            for (int j = 0; j < KPS; ++j) {
                if (j >= nb) break;  // blocks past the part (past K): no sums to add
                if constexpr (MODE == MODE_END) {
#pragma unroll
                    for (int r = 0; r < ND; ++r) acc[r] = add_rn(acc[r], tmp[j][r]);
                } else {
#pragma unroll
                    for (int r = 0; r < ND; ++r) {
                        const float s_br = MODE == MODE_K_COL ? s_b[j][half_of(r)] : s_b[j][0];
                        acc[r] = fma_rn(tmp[j][r], mul_rn(s_a[j][col_of(r)], s_br), acc[r]);
                    }
                }
            }
        }
    }
    if constexpr (INT) {  // the last slot retires (it needs no release: nothing refills it)
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
