// scaled_mm_mma.cu: the W8A8 matmul on the mma.sync tensor cores: FP8 on compute capability 8.9
// and newer (Ada, Blackwell, and Hopper when forced), INT8 on 8.0 and newer: y = dequant(a) @
// dequant(b).T (+ bias) with the scales, sums and rounding of scaled_mm.cuh, which states the
// numerics and the scale addressing (cupyquant/w8a8/mma.py launches it; cupyquant/reference/w8a8.py
// is the oracle).
//
// Layout. a: M x K FP8 or INT8 codes, rows lda bytes apart; b: N x K FP8 codes, rows ldb bytes apart (the
// weight row-major, i.e. the mma's column-major B); both 16-byte aligned with K % 16 == 0 (the host
// copies other operands). A block of 256 threads (8 warps) computes a BM x BN tile of y (BN = 128;
// BM = 16, 64 or 128 by M: mma.py), grid (M tiles x N tiles, 1, K parts), the tiles in groups of
// 8 row tiles taken column by column (a wave of 132 blocks of the 128-row tile reads 8 x 128 rows
// of a and 17 x 128 of b from L2, where row by row it would read 132 x 128 rows of b). Warps: 2 x 4
// (1 x 8 for BM = 16), each a (BM / WM) x (BN / WN) piece of the tile as MT m16 by NT n8 tiles of
// mma.sync.m16n8k32.row.col.f32.{e4m3,e5m2}.{e4m3,e5m2}.f32: one QMMA.16832 on sm_89 and sm_120;
// sm_90 and sm_100 (ptxas 13.0) run it as two f16 HMMA.16816 after e4m3 -> f16 conversions (exact).
// INT8: mma.sync.m16n8k32.row.col.s32.s8.s8.s32 (IMMA), the same fragments, int32 sums.
//
// Pipeline. K is read in stages of 128 (one scale block): per stage BM rows of a and BN rows of b,
// 128 bytes each, copied with 16-byte cp.async (rows >= M or >= N and chunks at k >= K zero-filled,
// so they add nothing), STAGES deep: the copies of block i + STAGES - 1 are in flight while block i
// is multiplied, one barrier per block. In the K-varying modes the stage also carries a's BM scale
// words of the block (4-byte cp.async; a loader thread per row computes the row's scale offset,
// a 64-bit division, once), so the scaling after the block reads them from shared memory.
//
// Shared layout. Each 128-byte row is 8 chunks of 16 bytes, chunk c of row r stored at chunk
// c ^ (r % 8). ldmatrix.x4 reads four 8 x 16-byte matrices whose 8 row addresses are 8 consecutive
// rows at one logical chunk: the XOR sends them to 8 distinct chunk positions, i.e. all 32 banks,
// and the copies (8 threads a row, chunks 0..7) are conflict-free as well.
//
// Fragments (PTX ISA, m16n8k32 with 8-bit A and B; g = lane / 4, t = lane % 4): A registers 0..3
// hold k 4t..4t+3 of row g, of row g + 8, k 16 + 4t.. of row g, of row g + 8; B registers 0, 1 hold
// k 4t..4t+3 and 16 + 4t.. of column g; C/D 0, 1 row g columns 2t, 2t + 1, 2, 3 row g + 8. Read as
// 16-bit pairs these are the fp16 m16n8k16 fragments, so ldmatrix (.b16, thread l getting bytes
// 4 (l % 4).. of row l / 4 of matrix i in register i) gives them as loaded: for A the matrices are
// (rows 0-7, chunk 2s), (rows 8-15, 2s), (rows 0-7, 2s + 1), (rows 8-15, 2s + 1) of k32 step s; for
// B (columns 0-7, 2s), (0-7, 2s + 1), (8-15, 2s), (8-15, 2s + 1): two n8 tiles a load.
//
// Block sums (FP8). Each 128-k block is summed by the tensor cores into fresh float32 accumulators P
// (zeroed, then 4 k32 steps), then added to acc by the contract's rule: MODE_END acc += P;
// MODE_K_TILE one scale product a row (a's scale from the stage, b's read once a block for the
// tile, issued before the block's mma so that its latency hides behind it); MODE_K_COL one product
// an element (b's BN column scales of a block in two shared slots: one thread a column loads block
// i + 1's during block i and stores it after block i's scaling, which keeps the 2 NT column scales
// out of the registers across the mma: the 128-row tile otherwise spills on sm_90). Every float32
// operation outside the tensor cores is explicit IEEE PTX (.rn, no flush). MODE_END scales acc once
// at the end (v = acc * (sa * sb)); finish_tile (scaled_mm.cuh) adds the bias, rounds and stores,
// or with a K split stores the part's v and lets the tile's last part sum the parts in order.
// INT8 accumulates every block into the same int32 acc (exact), and finish_tile's final step does
// scaled_mm.cuh's integer epilogue (zero point, conversion, scales) after any K split's integer sum.
//
// Sizes. STAGES x (BM + BN) x 128 bytes (+ BM scale words a stage in the K modes, + 2 BN column
// scales in MODE_K_COL; cupyquant/w8a8/mma.py smem_bytes) stay within the 99 KB a block of sm_89 /
// sm_120 may have: 128 x 128 x 3 stages 98.5 KB at most, 64 x 128 x 4 98 KB, 16 x 128 x 4 73 KB.
// Registers: acc and P are 2 x 4 MT NT floats (128 for the 128-row tile), one block of 256 threads
// a SM (__launch_bounds__(256, 1)).
#include "scaled_mm.cuh"

using namespace cq;

namespace mma_fp8 {

constexpr int THREADS = 256;
constexpr int BK = 128;  // K per stage: one scale block, a 128-byte row
constexpr int GROUP_M = 8;  // row tiles a group of the tile order

__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool pred) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(pred ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async4(unsigned dst, const void* src, bool pred) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(pred ? 4 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

__device__ __forceinline__ void ldmatrix_x4(unsigned addr, unsigned (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// d += a (16 x 32, row) @ b (32 x 8, col): float32 sums of FP8 codes (FA, FB the formats of a and b,
// MmFormat; compute capability 8.9), or int32 sums of INT8 codes (FA = FB = S8; 8.0)
#define CQ_MMA_FP8(TA, TB)                                                                                     \
    asm("mma.sync.aligned.m16n8k32.row.col.f32." TA "." TB ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, " \
        "{%0, %1, %2, %3};"                                                                                    \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                                       \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
template <int FA, int FB, typename Acc>
__device__ __forceinline__ void mma(Acc (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    if constexpr (FA == S8) {
        asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
#if __CUDA_ARCH__ >= 890
        if constexpr (FA == FP8_E4M3 && FB == FP8_E4M3) {
            CQ_MMA_FP8("e4m3", "e4m3");
        } else if constexpr (FA == FP8_E4M3) {
            CQ_MMA_FP8("e4m3", "e5m2");
        } else if constexpr (FB == FP8_E4M3) {
            CQ_MMA_FP8("e5m2", "e4m3");
        } else {
            CQ_MMA_FP8("e5m2", "e5m2");
        }
#else
        __trap();  // FP8 mma.sync needs compute capability 8.9 (mma.py launches FP8 only there)
#endif
    }
}
#undef CQ_MMA_FP8

}  // namespace mma_fp8

template <int FA, int FB, typename TY, int MODE, int BM, int BN, int STAGES>
__global__ void __launch_bounds__(256, 1)
    scaled_mm_mma(const unsigned char* __restrict__ a, const unsigned char* __restrict__ b, const void* __restrict__ sa,
                  const float* __restrict__ sb, const int* __restrict__ azp, const int* __restrict__ adj, const TY* __restrict__ bias,
                  TY* __restrict__ y, float* __restrict__ ws, int* __restrict__ counters, MmArgs p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    using namespace mma_fp8;
    constexpr bool INT = FA == S8;
    static_assert(!INT || (FB == S8 && MODE == MODE_END), "INT8 takes INT8 b and scales that do not vary along K");
    using Acc = typename cond_type<INT, int, float>::type;
    constexpr int WM = BM >= 32 ? 2 : 1, WN = 8 / WM;  // warps along M and N
    constexpr int WTM = BM / WM, WTN = BN / WN;        // a warp's rows and columns
    constexpr int MT = WTM / 16, NT = WTN / 8;         // its m16 and n8 tiles
    static_assert(MT >= 1 && WTM % 16 == 0 && NT % 2 == 0 && WTN % 16 == 0, "warp tiles of whole m16 and n16 pieces");
    static_assert(BN <= 128 && 128 % BN == 0, "a tile's columns lie in one 128 x 128 weight block (MODE_K_TILE)");
    static_assert(BN * 8 % THREADS == 0 && (BM * 8 % THREADS == 0 || THREADS % (BM * 8) == 0), "copies in whole rounds");
    constexpr bool KMODE = MODE != MODE_END;
    constexpr int A_BYTES = BM * BK, B_BYTES = BN * BK;
    constexpr int STAGE_BYTES = A_BYTES + B_BYTES + (KMODE ? BM * 4 : 0);
    // MODE_K_COL: b's column scales of blocks i and i + 1 (two slots after the stages)
    constexpr int SB_OFF = STAGES * STAGE_BYTES;
    extern __shared__ uint4 mma_smem[];
    const unsigned smem = (unsigned)__cvta_generic_to_shared(mma_smem);
    const unsigned char* smem_g = reinterpret_cast<const unsigned char*>(mma_smem);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int wm = warp / WN, wn = warp % WN;
    // tile order: groups of GROUP_M row tiles, each group column by column, so that the blocks
    // running at once share both their rows of a and their rows of b in L2
    const i64 ntiles = (p.N + BN - 1) / BN, mtiles = (p.M + BM - 1) / BM;
    const i64 group = (i64)blockIdx.x / (GROUP_M * ntiles), in_group = (i64)blockIdx.x % (GROUP_M * ntiles);
    const i64 first_m = group * GROUP_M, group_rows = min((i64)GROUP_M, mtiles - first_m);
    const i64 m0 = (first_m + in_group % group_rows) * BM, n0 = (in_group / group_rows) * BN;
    const int nkb = (int)((p.K + BK - 1) / BK);
    const int kb0 = (int)blockIdx.z * p.kb_per_split;
    const int niter = max(0, min(nkb, kb0 + p.kb_per_split) - kb0);

    // The copies: thread tid moves chunk tid % 8 of rows tid / 8 + 32 q (q < A_CH of a, B_CH of b);
    // every such row has the same row % 8, so one swizzled offset serves all of them.
    constexpr int A_CH = BM * 8 >= THREADS ? BM * 8 / THREADS : 1, B_CH = BN * 8 / THREADS;
    const int lr = tid >> 3, lc = tid & 7;
    const unsigned dst = lr * BK + ((lc ^ (lr & 7)) << 4);
    const unsigned char* a_src = a + (m0 + lr) * p.lda + lc * 16;
    const unsigned char* b_src = b + (n0 + lr) * p.ldb + lc * 16;
    // a's scale word of row m0 + tid (K modes, tid < BM): the row's offset once, the block's per stage
    const unsigned* sa_src = reinterpret_cast<const unsigned*>(sa);
    const bool sa_ok = KMODE && tid < BM && m0 + tid < p.M;
    if (sa_ok) sa_src += a_scale_row(p, m0 + tid);
    // b's scale of column n0 + tid - (THREADS - BN) (MODE_K_COL, the last BN threads): loaded a block
    // ahead into a register, stored to its slot after the block's scaling
    float* s_sb = reinterpret_cast<float*>(mma_smem) + SB_OFF / 4;
    const int sb_col = tid - (THREADS - BN);
    const bool sb_ld = MODE == MODE_K_COL && sb_col >= 0;
    const i64 sb_n = min(n0 + sb_col, p.N - 1);

    auto load_stage = [&](int slot, int kb) {
        const unsigned st = smem + slot * STAGE_BYTES;
        const i64 k0 = (i64)kb * BK;
        const bool kin = k0 + lc * 16 < p.K;
#pragma unroll
        for (int q = 0; q < A_CH; ++q) {
            if (BM * 8 >= THREADS || lr < BM) {
                const bool ok = kin && m0 + lr + 32 * q < p.M;
                cp_async16(st + dst + q * 32 * BK, ok ? a_src + q * 32 * p.lda + k0 : a, ok);
            }
        }
#pragma unroll
        for (int q = 0; q < B_CH; ++q) {
            const bool ok = kin && n0 + lr + 32 * q < p.N;
            cp_async16(st + A_BYTES + dst + q * 32 * BK, ok ? b_src + q * 32 * p.ldb + k0 : b, ok);
        }
        if (KMODE && tid < BM) cp_async4(st + A_BYTES + B_BYTES + tid * 4, sa_ok ? sa_src + (i64)(p.sa_packed ? kb >> 2 : kb) * p.sa_k : sa_src, sa_ok);
    };

    // ldmatrix addresses of this lane (byte offsets in a stage; step s XORs 32 s into the chunk):
    // A: row wm WTM + 16 mt + lane % 16, chunk 2 s + lane / 16; B: row wn WTN + 16 jp + 8 (lane / 16)
    // + lane % 8, chunk 2 s + (lane / 8) % 2 (each row's % 8 is lane % 8)
    const unsigned a_ld = (wm * WTM + (lane & 15)) * BK + ((((lane >> 4) ^ lane) & 7) << 4);
    const unsigned b_ld = A_BYTES + (wn * WTN + ((lane >> 4) << 3) + (lane & 7)) * BK + (((((lane >> 3) & 1) ^ lane) & 7) << 4);

    Acc acc[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NT; ++j) acc[mt][j][0] = acc[mt][j][1] = acc[mt][j][2] = acc[mt][j][3] = Acc(0);

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < niter) load_stage(s, kb0 + s);
        cp_async_commit();
    }
    if (sb_ld && niter > 0) s_sb[sb_col] = b_scale(p, sb, sb_n, kb0);  // ordered before its reads by the loop's first barrier

#pragma unroll 1
    for (int i = 0; i < niter; ++i) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // block i has arrived for every thread, and slot (i - 1) % STAGES is free
        if (i + STAGES - 1 < niter) load_stage((i + STAGES - 1) % STAGES, kb0 + i + STAGES - 1);
        cp_async_commit();
        const int kb = kb0 + i, slot = i % STAGES;

        // b's scales: the tile's of this block (K_TILE), a column's of the next block (K_COL), loaded
        // now and used after the mma
        float sbt = 0.0f, sb_next = 0.0f;
        if constexpr (MODE == MODE_K_TILE) sbt = b_scale(p, sb, n0, kb);
        if (sb_ld && i + 1 < niter) sb_next = b_scale(p, sb, sb_n, kb + 1);

        const unsigned st = smem + slot * STAGE_BYTES;
        // the block's four k32 steps into D, rolled: on sm_90, which runs FP8 mma.sync as f16 HMMA
        // after conversions, the unrolled steps of the 128-row tile spill (255 registers); two warps
        // a scheduler cover one step's ldmatrix latency with the other's mma
        auto mma_block = [&](Acc (&D)[MT][NT][4]) {
#pragma unroll 1
            for (int s = 0; s < BK / 32; ++s) {
                unsigned af[MT][4], bf[NT / 2][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(st + ((a_ld + mt * 16 * BK) ^ (32 * s)), af[mt]);
#pragma unroll
                for (int jp = 0; jp < NT / 2; ++jp) ldmatrix_x4(st + ((b_ld + jp * 16 * BK) ^ (32 * s)), bf[jp]);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int j = 0; j < NT; ++j) mma<FA, FB>(D[mt][j], af[mt], bf[j >> 1][2 * (j & 1)], bf[j >> 1][2 * (j & 1) + 1]);
            }
        };
        if constexpr (INT) {  // exact: every block into acc
            mma_block(acc);
        } else {
            Acc P[MT][NT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < NT; ++j) P[mt][j][0] = P[mt][j][1] = P[mt][j][2] = P[mt][j][3] = 0.0f;
            mma_block(P);

            if constexpr (MODE == MODE_END) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int j = 0; j < NT; ++j)
#pragma unroll
                        for (int r = 0; r < 4; ++r) acc[mt][j][r] = add_rn(acc[mt][j][r], P[mt][j][r]);
            } else {
                const unsigned* s_sa = reinterpret_cast<const unsigned*>(smem_g + slot * STAGE_BYTES + A_BYTES + B_BYTES);
                float2 sbc[NT];
                if constexpr (MODE == MODE_K_COL) {
#pragma unroll
                    for (int j = 0; j < NT; ++j) sbc[j] = *reinterpret_cast<const float2*>(s_sb + (i & 1) * BN + wn * WTN + 8 * j + 2 * t);
                }
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const unsigned w = s_sa[wm * WTM + 16 * mt + 8 * h + g];
                        const float sa_v = p.sa_packed ? e8m0_to_float((w >> (8 * (kb & 3))) & 0xffu) : __uint_as_float(w);
                        const float st_row = MODE == MODE_K_TILE ? mul_rn(sa_v, sbt) : 0.0f;
#pragma unroll
                        for (int j = 0; j < NT; ++j)
#pragma unroll
                            for (int e = 0; e < 2; ++e) {
                                const float s = MODE == MODE_K_TILE ? st_row : mul_rn(sa_v, e ? sbc[j].y : sbc[j].x);
                                acc[mt][j][2 * h + e] = fma_rn(P[mt][j][2 * h + e], s, acc[mt][j][2 * h + e]);
                            }
                    }
                // slot (i + 1) % 2 was last read in block i - 1, before this block's barrier
                if (sb_ld && i + 1 < niter) s_sb[((i + 1) & 1) * BN + sb_col] = sb_next;
            }
        }
    }
    cp_async_wait<0>();

    // this thread's pairs of vals (acc, or its values converted in place): rows wm WTM + 16 mt + 8 h + g,
    // columns wn WTN + 8 j + 2 t (+ 1); pair i of row (mt, h) and column j is i = (mt * 2 + h) * NT + j
    auto pairs = [&](auto& vals, auto f) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int j = 0; j < NT; ++j)
                    f((mt * 2 + h) * NT + j, wm * WTM + 16 * mt + 8 * h + g, wn * WTN + 8 * j + 2 * t, vals[mt][j][2 * h], vals[mt][j][2 * h + 1]);
    };
    auto visit = [&](auto f) { pairs(acc, f); };
    // rows and columns past the ends read the last one's scales (never stored)
    auto row_of = [&](int mt, int h) { return min(m0 + wm * WTM + 16 * mt + 8 * h + g, p.M - 1); };
    auto col_of = [&](int j, int e) { return min(n0 + wn * WTN + 8 * j + 2 * t + e, p.N - 1); };
    if constexpr (INT) {  // scaled_mm.cuh's integer epilogue, after any K split's integer sum
        float sa_r[MT * 2];
        int z_r[MT * 2];
#pragma unroll
        for (int r = 0; r < MT * 2; ++r) {
            sa_r[r] = a_scale(p, sa, a_scale_row(p, row_of(r >> 1, r & 1)), 0);
            z_r[r] = a_zero(p, azp, a_zero_row(p, row_of(r >> 1, r & 1)));
        }
        if (p.splits == 1) {  // in place, a column's scale and adj loaded once for the thread's rows
            float v[MT][NT][4];
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const i64 c = col_of(j, e);
                    const float sbc = b_scale(p, sb, c, 0);
#pragma unroll
                    for (int r = 0; r < MT * 2; ++r)
                        v[r >> 1][j][2 * (r & 1) + e] = int_epilogue(adj, c, acc[r >> 1][j][2 * (r & 1) + e], z_r[r], mul_rn(sa_r[r], sbc));
                }
            finish_tile<TY, float, BM, BN, THREADS, MT * 2 * NT>(y, bias, ws, counters, p, m0, n0, (i64)blockIdx.x, (i64)gridDim.x, (int)blockIdx.z, tid,
                                                                 [&](auto f) { pairs(v, f); }, AsScaled());
        } else {  // the parts' integer sums first
            finish_tile<TY, int, BM, BN, THREADS, MT * 2 * NT>(y, bias, ws, counters, p, m0, n0, (i64)blockIdx.x, (i64)gridDim.x, (int)blockIdx.z, tid, visit,
                                                               [&](int i, int, int n, int v0, int v1) {
                const int r = i / NT;
                const i64 c0 = n0 + n, c1 = min(c0 + 1, p.N - 1);
                return make_float2(int_epilogue(adj, c0, v0, z_r[r], mul_rn(sa_r[r], b_scale(p, sb, c0, 0))),
                                   int_epilogue(adj, c1, v1, z_r[r], mul_rn(sa_r[r], b_scale(p, sb, c1, 0))));
            });
        }
    } else {
        if constexpr (MODE == MODE_END) {  // v = acc * (sa(m) * sb(n))
            float sbe[NT][2];
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) sbe[j][e] = b_scale(p, sb, col_of(j, e), 0);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float sa_v = a_scale(p, sa, a_scale_row(p, row_of(mt, h)), 0);
#pragma unroll
                    for (int j = 0; j < NT; ++j)
#pragma unroll
                        for (int e = 0; e < 2; ++e) acc[mt][j][2 * h + e] = mul_rn(acc[mt][j][2 * h + e], mul_rn(sa_v, sbe[j][e]));
                }
        }
        finish_tile<TY, float, BM, BN, THREADS, MT * 2 * NT>(y, bias, ws, counters, p, m0, n0, (i64)blockIdx.x, (i64)gridDim.x, (int)blockIdx.z, tid, visit,
                                                             AsScaled());
    }
#else
    __trap();  // mma.sync of 8-bit operands needs compute capability 8.0 (mma.py launches it only there)
#endif
}
