// scaled_mm_sm90.cu: the W8A8 FP8 and INT8 matmul y = dequant(a) @ dequant(b).T (+ bias) on Hopper's
// warpgroup tensor-core instructions (wgmma, sm_90a only). What it computes, the scale addressing
// and the epilogue are kernels/scaled_mm.cuh's (cupyquant/reference/w8a8.py is the oracle); this file
// is the pipeline. Compiled for the family-specific target sm_90a (cupyquant/_jit.py); on every other
// target the kernel is a stub that traps, and the host never launches it there.
//
// The grid is persistent: one block a SM takes work items w = blockIdx.x, + gridDim.x, ... (a tile
// and, where K is split, a part of K; tiles in groups of RASTER rows that sweep N together, so that
// the tiles running at once share a's and b's rows in L2). A tile is BM x BN of y (BM = 64, 128 or
// 256 rows of a, BN = 64 or 128 rows of b, 256 for INT8, and for FP8 128-row tiles of MODE_END also
// 144, 160 or 192, whose widths fit N better), computed by one consumer warpgroup (BM =
// 64) or two, 64 rows each, or with BM = 256 128 rows each in two 64-row waves that share one
// temporary accumulator set (FP8 per tensor and 128 x 128 blocks only: a wave's promotion needs no
// per-column scales), with one producer warpgroup (the last), which runs ahead into the next tile
// while the consumers store the last one. With p.cluster = 2 the grid is made of clusters of two
// blocks that take neighbouring tiles in N (the same rows of a): each block's producer loads half of
// those rows by TMA multicast into both blocks' slot, and a slot is free once both blocks' consumers
// have released it (their empty barriers count both). K streams through
// a ring of STAGES shared-memory slots, one 128-k scale block a slot: BM rows of a and BN rows of b,
// 128 bytes each, loaded by the producer's thread with two TMA boxes (host-encoded tensor maps,
// cupyquant/w8a8/sm90.py) in the 128-byte swizzle that the wgmma descriptors describe. Rows past M or
// N and k past K read as zeros (TMA's out-of-bounds fill), so tails need no code here. A full[s]
// mbarrier completes when slot s has arrived (the TMA's bytes), empty[s] when every consumer thread (INT8: warp) has
// retired the wgmmas that read it.
//
// A consumer warpgroup multiplies its 64 rows of a by the tile's BN rows of b, both K-major in
// shared memory: four wgmma m64nBNk32 a block into fresh float32 accumulators (tmp; the first with
// scale-d = 0), then waits for them, releases the slot and adds tmp into acc by the block rule of
// scaled_mm.cuh on the CUDA cores (the promotion). The sum over one 128-k block stays inside the
// tensor cores, whose FP8 accumulation keeps about 14 bits; across blocks it is IEEE float32. With
// two consumer warpgroups one promotes while the other's wgmmas run. The scales of 128 x 128 blocks
// (MODE_K_TILE) come through shared memory: a ring of scale slots beside the operands' that the
// producer's second warp fills by cp.async as the TMA fills the operand slots (see SCALE_RING).
//
// INT8 (FA = FB = S8) sums exactly in int32, so there is no promotion: every block's wgmmas (m64nBNk32
// .s32.s8.s8) add into the same accumulators, the block's group is committed, and the consumer waits
// only for the block before it (wgmma.wait_group 1) before it releases that block's slot, so that the
// tensor cores always have the next block queued. After the item's last block it waits for all, and
// finish_tile does scaled_mm.cuh's integer epilogue after any K split's integer sum. Without the
// second accumulator set, a 128 x 256 tile fits (128 int32 accumulators a thread).
//
// Lane (g, t) of warp q of a warpgroup holds, in accumulator 4 j + r, row 16 q + g + 8 (r >> 1) of
// the warpgroup's rows and column 8 j + 2 t + (r & 1) of the tile: column pairs (r = 0, 1 and
// r = 2, 3), which the epilogue stores 16 bytes at a time for an unsplit tile in a 16-bit dtype
// (store_tile_16), else as 4-byte (8-byte for float32) pieces, or sums across the K split first
// (scaled_mm.cuh finish_tile).
//
// Registers: BM = 128 and 256 launch 384 threads with 168 each; setmaxnreg gives the producer's
// unused registers to the consumers (40 for it, 232 for them: 256 x 232 + 128 x 40 <= 64K), and
// ptxas allocates the consumers' code within those 232. BM = 256 keeps 128 running sums and 64 block
// sums a thread, which leaves no room for a K split's epilogue: that tile is never split (SPLIT).
// Neither are the tiles wider than 128 columns (72-96 running sums and as many block sums a thread;
// the split epilogue spills at BN = 192), whose 16-bit stores scale each value as they take it.
// BM = 64 launches 256 threads (255 each).

#include "cluster.cuh"
#include "common.cuh"
#include "scaled_mm.cuh"
#include "sm90_async.cuh"
#include "sm90_wgmma.cuh"

using namespace cq;

// a barrier of THREADS threads (whole warps) of the block, numbered ID (finish_tile's is 1); immediate
// operands, so that ptxas knows which barriers the kernel uses
template <int ID, int THREADS>
__device__ __forceinline__ void named_sync_id() { asm volatile("bar.sync %0, %1;" ::"n"(ID), "n"(THREADS) : "memory"); }

// Lanes t and t ^ 2, then t and t ^ 1, of a quad exchange words of a[Q]: with Q = 4, lane t's words
// of the column groups j = 4 q .. 4 q + 3 (a[k]: group 4 q + k) become the words of group 4 q + t (a[k]:
// its columns 2 k, + 1), a 4 x 4 transpose; with Q = 2, lane t's words of groups J, J + 1 become
// half of a group, columns 4 (t & 1) .. + 3 of group J + (t >> 1).
template <int Q>
__device__ __forceinline__ void quad_transpose(unsigned (&a)[Q], int t) {
    const bool hi = t & 2, odd = t & 1;
#pragma unroll
    for (int k = 0; k < Q / 2; ++k) {  // the words whose group has the other bit 1
        const unsigned r = __shfl_xor_sync(0xffffffffu, hi ? a[k] : a[k + Q / 2], 2);
        if (hi) {
            a[k] = r;
        } else {
            a[k + Q / 2] = r;
        }
    }
#pragma unroll
    for (int k = 0; k < Q; k += 2) {  // then on bit 0
        const unsigned r = __shfl_xor_sync(0xffffffffu, odd ? a[k] : a[k + 1], 1);
        if (odd) {
            a[k] = r;
        } else {
            a[k + 1] = r;
        }
    }
}

// The end of an unsplit tile in a 16-bit TY, y = round(v + bias), in 16-byte chunks of eight columns
// of one row. val(i) gives the thread's value of accumulator i = w ND + 4 j + r, laid out as the
// accumulators are (wave w: row row0 + 64 w + 8 (r >> 1), column 8 j + 2 t + (r & 1) of the tile).
// quad_chunks rounds wave w's pairs into 32-bit words (as store_pair would store them); then the four
// lanes of a quad, which hold the same rows' words of columns 8 j .. 8 j + 7, exchange them
// (quad_transpose over j = 4 q .. 4 q + 3), so that lane t holds the eight columns of j = 4 q + t
// whole, which it gives to sink(h, c, words) (h: row row0 + 64 w + 8 h; c = 8 j, the first column).
// Where the ND / 4 groups leave two over, J = ND / 4 - 2 and J + 1 (BN = 144: 16 and 17 of 18), the
// quad exchanges their words in halves, and lane t gives the four columns from c = 8 (J + (t >> 1)) +
// 4 (t & 1) (words[2]).
template <typename TY, int ND, typename Val, typename Sink>
__device__ __forceinline__ void quad_chunks(const TY* __restrict__ bias, const MmArgs& p, i64 n0, int t, int w, Val val, Sink sink) {
    static_assert(ND % 8 == 0, "whole quads of 8-column groups, and at most one pair of groups over");
    // column group j's rounded pair of row h
    auto word = [&](int h, int j) {
        const int i = w * ND + 4 * j + 2 * h;
        const i64 n = n0 + 8 * j + 2 * t;
        float v0 = val(i), v1 = val(i + 1);
        if (p.has_bias) {
            if (n < p.N) v0 = add_rn(v0, to_float(bias[n]));
            if (n + 1 < p.N) v1 = add_rn(v1, to_float(bias[n + 1]));
        }
        return (unsigned)bits16_rn<TY>(v0) | ((unsigned)bits16_rn<TY>(v1) << 16);
    };
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int q = 0; q < ND / 16; ++q) {
            unsigned a[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) a[k] = word(h, 4 * q + k);
            quad_transpose(a, t);
            sink(h, 8 * (4 * q + t), a);  // a[k]: columns 8 (4 q + t) + 2 k, + 1
        }
        if constexpr (ND % 16 != 0) {
            constexpr int J = ND / 4 - 2;
            unsigned a[2] = {word(h, J), word(h, J + 1)};
            quad_transpose(a, t);
            sink(h, 8 * (J + (t >> 1)) + 4 * (t & 1), a);  // a[k]: columns c + 2 k, + 1
        }
    }
}

// quad_chunks' chunks stored straight to y: one st.v4 (st.v2 for a half chunk) where the row is in M,
// the chunk's columns in N and the address aligned to its size, else one 2-byte store a column in N.
// Against a 4-byte store a pair, the tile takes a quarter of the store instructions, the LSU's limit
// in this epilogue.
template <typename TY, int WAVES, int ND, typename Val>
__device__ __forceinline__ void store_tile_16(TY* __restrict__ y, const TY* __restrict__ bias, const MmArgs& p, i64 m0, i64 n0, int row0, int t,
                                              Val val) {
#pragma unroll
    for (int w = 0; w < WAVES; ++w) {
        quad_chunks<TY, ND>(bias, p, n0, t, w, val, [&](int h, int c, const auto& a) {
            constexpr int Q = sizeof(a) / sizeof(a[0]);  // words: 4 (8 columns) or 2
            const i64 m = m0 + row0 + 64 * w + 8 * h, n = n0 + c;
            if (m >= p.M || n >= p.N) return;
            unsigned short* dst = reinterpret_cast<unsigned short*>(y + m * p.ldy + n);
            if (n + 2 * Q <= p.N && (reinterpret_cast<u64>(dst) & (4 * Q - 1)) == 0) {
                if constexpr (Q == 4) {
                    *reinterpret_cast<uint4*>(dst) = make_uint4(a[0], a[1], a[2], a[3]);
                } else {
                    *reinterpret_cast<uint2*>(dst) = make_uint2(a[0], a[1]);
                }
            } else {
#pragma unroll
                for (int e = 0; e < 2 * Q; ++e)
                    if (n + e < p.N) dst[e] = (unsigned short)(a[e >> 1] >> (16 * (e & 1)));
            }
        });
    }
}

template <int FA, int FB, typename TY, int MODE, int BM, int BN, int STAGES>
__global__ void __launch_bounds__((BM > 64 ? 256 : 128) + 128, 1)
    scaled_mm_sm90(const __grid_constant__ TmaMap tma, const __grid_constant__ TmaMap tmb, const __grid_constant__ TmaMap tmy, const void* __restrict__ sa,
                   const float* __restrict__ sb, const int* __restrict__ azp, const int* __restrict__ adj, const TY* __restrict__ bias,
                   TY* __restrict__ y, float* __restrict__ ws, int* __restrict__ counters, MmArgs p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr bool INT = FA == S8;
    static_assert(!INT || (FB == S8 && MODE == MODE_END), "INT8 takes INT8 b and scales that do not vary along K");
    static_assert(BM == 64 || BM == 128 || (!INT && BM == 256 && MODE != MODE_K_COL), "one or two consumer warpgroups of one or two waves");
    static_assert(BN == 64 || BN == 128 || (INT && BN == 256) || (!INT && BM == 128 && MODE == MODE_END && (BN == 144 || BN == 160 || BN == 192)),
                  "wgmma widths of sm90_wgmma.cuh's wrappers; MODE_K_TILE needs BN | 128, MODE_K_COL registers");
    constexpr int CW = BM > 64 ? 2 : 1;                // consumer warpgroups
    constexpr int WAVES = BM / (64 * CW);              // 64-row waves a consumer warpgroup multiplies in turn
    constexpr bool SPLIT = WAVES == 1 && (INT || BN <= 128);  // a K split's epilogue fits the registers (the host splits no other)
    constexpr int CT = CW * 128;                       // consumer threads
    constexpr int A_BYTES = BM * 128, STAGE = (BM + BN) * 128;  // a multiple of 1024: every slot stays 1024-aligned
    constexpr int ND = BN / 2;                         // accumulators a thread a wave
    constexpr int RASTER = 8;                          // rows of tiles a group of work items sweeps N with
    // MODE_K_TILE: a second ring of STAGES slots beside the operands' (where the TMA stores' staging
    // buffers would be), slot s holding the scales of the block in operand slot s: the words of a's
    // scales of the tile's BM rows (float32, or the UE8M0 word that holds the block's byte), then b's
    // tile scale. The producer's second and third warps fill it by cp.async, whose completion counts on
    // full[s] (64 arrivals beside the TMA thread's), so that the promotion reads its scales from shared memory,
    // loaded STAGES blocks ahead like the operands, with no address arithmetic of its own.
    constexpr bool SCALE_RING = MODE == MODE_K_TILE;
    constexpr int SC_BYTES = (BM + 4) * 4;             // a scale slot: BM words of a, b's, padding to 16 bytes
    // FP8: every consumer thread releases a slot once its wgmmas of it have retired, and after its own
    // reads of the scale slot (SCALE_RING), which the next cp.async fill overwrites: each thread's
    // program order then orders them, an order compute-sanitizer's racecheck follows (one arrival a
    // warp after __syncwarp, which it reports as a potential WAR hazard, also measured 1-4% slower:
    // H200, per tensor, 4096^2 x 512 19.6 against 18.8 us). INT8: one arrival a warp, a block late.
    constexpr int EMPTY_ARRIVALS = INT ? CW * 4 : CW * 128;
    extern __shared__ uint4 smem_raw[];
    __shared__ __align__(8) unsigned long long mb_full[STAGES], mb_empty[STAGES];
    // the 128-byte swizzle is a function of address bits 4..9: slots start at a multiple of 1024
    const unsigned raw = (unsigned)__cvta_generic_to_shared(smem_raw);
    const unsigned sbase = (raw + 1023u) & ~1023u;
    const unsigned full0 = (unsigned)__cvta_generic_to_shared(mb_full), empty0 = (unsigned)__cvta_generic_to_shared(mb_empty);

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int CL = p.cluster;  // 1, or 2: the cluster's blocks take tiles side by side in N (see above)
    const unsigned rank = CL > 1 ? cluster_rank() : 0u;
    // Tile and work-item numbers in 32 bits (a 2^31-tile output would hold 2^43 elements), so that
    // the divisions below, on the producer's way to its first load, are not 64-bit ones.
    const unsigned tiles_n = (unsigned)((p.N + BN - 1) / BN), tiles_m = (unsigned)((p.M + BM - 1) / BM), tiles = tiles_n * tiles_m;
    const unsigned groups_n = CL > 1 ? (tiles_n + 1) >> 1 : tiles_n;  // columns of tiles a cluster takes together
    const unsigned units = tiles_m * groups_n, work = units * (unsigned)p.splits;
    const int nkb = (int)((p.K + 127) / 128);
    // work item w of this block's cluster: part w / units of K, unit w % units, in groups of RASTER
    // rows of units that sweep N together, so that the clusters running at once share rows of a and
    // of b in L2; rank r of the cluster takes the unit's r-th tile (with CL = 2 and an odd number of
    // tile columns, the last unit's second tile lies past N: it is computed from zeros, never stored)
    auto item = [&](unsigned w, i64& m0, i64& n0, i64& tile, int& part, int& kb0, int& niter) {
        part = (int)(w / units);
        const unsigned u = w - (unsigned)part * units, group = u / (RASTER * groups_n), first = group * RASTER;
        const unsigned rows = min((unsigned)RASTER, tiles_m - first), in = u - group * RASTER * groups_n;
        const unsigned mi = first + in % rows, ni = (in / rows) * CL + rank;
        m0 = (i64)mi * BM, n0 = (i64)ni * BN, tile = (i64)mi * tiles_n + ni;
        kb0 = part * p.kb_per_split, niter = min(p.kb_per_split, nkb - kb0);  // >= 1: the host cuts K so
    };
    const unsigned w_first = CL > 1 ? blockIdx.x >> 1 : blockIdx.x, w_step = CL > 1 ? gridDim.x >> 1 : gridDim.x;

    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) mbar_init(full0 + 8 * s, SCALE_RING ? 65 : 1), mbar_init(empty0 + 8 * s, EMPTY_ARRIVALS * CL);
        if (CL > 1) fence_mbarrier_init_cluster();
    }
    if (CL > 1) {
        cluster_sync_all();  // every block's barriers are initialized before the first multicast or remote arrival
    } else {
        __syncthreads();
    }
    if (warp == CW * 4 && lane == 0) prefetch_tensor_map(&tma), prefetch_tensor_map(&tmb);
    pdl_wait_then_release();  // programmatic dependent launch: no global access above this line

    const unsigned sc0 = sbase + (unsigned)(STAGES * STAGE);  // SCALE_RING's first slot
    if (warp >= CW * 4) {  // the producer warpgroup: one thread issues the TMA loads of every tile
        if constexpr (CW > 1) setmaxnreg_dec<40>();
        // the scales' copies: thread c = 0..63 of the second and third warps takes a's rows c, c + 64, ...
        // (a few 64-bit pointers each: the producer's registers are 40 after setmaxnreg)
        if (SCALE_RING && (warp == CW * 4 + 1 || warp == CW * 4 + 2)) {
            constexpr int RPL = BM / 64;
            const int c = tid - CT - 32;
            int it = 0;
#pragma unroll 1
            for (unsigned w = w_first; w < work; w += w_step) {
                i64 m0, n0, tile;
                int part, kb0, niter;
                item(w, m0, n0, tile, part, kb0, niter);
                const unsigned* pa[RPL];  // rows past M copy the last row's scales (never stored)
#pragma unroll
                for (int r = 0; r < RPL; ++r) pa[r] = reinterpret_cast<const unsigned*>(sa) + a_scale_row(p, min(m0 + c + 64 * r, p.M - 1));
                const float* pb = sb + (min(n0, p.N - 1) >> p.sb_shift) * p.sb_n;
#pragma unroll 1
                for (int i = 0; i < niter; ++i, ++it) {
                    const int slot = it % STAGES, kb = kb0 + i;
                    if (it >= STAGES) mbar_wait(empty0 + 8 * slot, ((it / STAGES) - 1) & 1);
                    const i64 ko = (i64)(p.sa_packed ? kb >> 2 : kb) * p.sa_k;
                    const unsigned dst = sc0 + (unsigned)(slot * SC_BYTES);
#pragma unroll
                    for (int r = 0; r < RPL; ++r) cp_async4(dst + 4u * (unsigned)(c + 64 * r), pa[r] + ko);
                    if (c == 0) cp_async4(dst + 4u * BM, pb + (i64)kb * p.sb_k);
                    mbar_arrive_cp_async(full0 + 8 * slot);
                }
            }
        }
        if (tid == CT) {
            int it = 0;  // the ring's position, across tiles
#pragma unroll 1
            for (unsigned w = w_first; w < work; w += w_step) {
                i64 m0, n0, tile;
                int part, kb0, niter;
                item(w, m0, n0, tile, part, kb0, niter);
#pragma unroll 1
                for (int i = 0; i < niter; ++i, ++it) {
                    const int slot = it % STAGES;
                    if (it >= STAGES) mbar_wait(empty0 + 8 * slot, ((it / STAGES) - 1) & 1);  // the slot's last use is retired
                    const unsigned dst = sbase + (unsigned)(slot * STAGE), bar = full0 + 8 * slot;
                    mbar_expect_tx(bar, STAGE);
                    const int k = (kb0 + i) * 128;
                    if (CL > 1) {  // this block's half of the rows of a, into both blocks' slot
                        tma_load_2d_multicast(dst + rank * (A_BYTES / 2), &tma, bar, k, (int)(m0 + rank * (BM / 2)), (unsigned short)3);
                    } else {
                        tma_load_2d(dst, &tma, bar, k, (int)m0);
                    }
                    tma_load_2d(dst + A_BYTES, &tmb, bar, k, (int)n0);
                }
            }
        }
        return;  // the consumers' barriers (named, finish_tile) count only themselves
    }
    if constexpr (CW > 1) setmaxnreg_inc<232>();

    const int wg = warp >> 2, g = lane >> 2, t = lane & 3;
    const int row0 = wg * 64 * WAVES + (warp & 3) * 16 + g;  // this thread's rows of the tile: row0 + 64 w, + 8, for wave w

    // Descriptors: 128-byte swizzle (bits 62-63 = 1), 8-row groups 1024 bytes apart (SBO), LBO unused
    // by swizzled K-major layouts (1 by convention); the low word holds the start address / 16, which
    // stays below 2^14 (no carry into the high word), so a k32 step (+ 32 bytes) adds 2 to it.
    constexpr unsigned long long DESC_HI = (1ull << 62) | ((unsigned long long)(1024 >> 4) << 32) | (1ull << 16);
    const unsigned adesc0 = (unsigned)DESC_HI | ((sbase + (unsigned)(wg * WAVES * 64 * 128)) >> 4);
    constexpr unsigned WAVE_DESC = 64 * 128 >> 4;  // a wave's 64 rows of a further on
    const unsigned bdesc0 = (unsigned)DESC_HI | ((sbase + (unsigned)A_BYTES) >> 4);
    auto desc = [](unsigned lo) { return (DESC_HI & 0xffffffff00000000ull) | lo; };

    using Acc = typename cond_type<INT, int, float>::type;
    // TMA stores of y (p.y_tma, 16-bit TY, BN <= 128, not MODE_K_TILE): each consumer warpgroup stages one 64-row wave of
    // its rows at a time in its own buffer after the ring (64 x BN x 2 bytes, two 64-column boxes of
    // 128-byte rows in the 128-byte swizzle), from which one of its threads stores the boxes; the
    // warpgroup goes on to its next tile while they are written, and waits only before it refills
    // the buffer until the stores have read it
    constexpr bool TMA_OK = !same_type<TY, float>::value && BN <= 128 && !SCALE_RING;
    constexpr int D_WG = 64 * BN * 2;
    const unsigned dbuf = sbase + (unsigned)(STAGES * STAGE + wg * D_WG);
    bool d_busy = false;  // this warpgroup's buffer may still be read by its last TMA stores
    auto tma_tile = [&](i64 m0, i64 n0, auto val) {
        const int lrow0 = (warp & 3) * 16 + g;  // this thread's rows within a wave: lrow0, lrow0 + 8
#pragma unroll
        for (int w = 0; w < WAVES; ++w) {
            if (d_busy) {
                if ((tid & 127) == 0) bulk_wait_all<true>();
                wg ? named_sync_id<3, 128>() : named_sync_id<2, 128>();
            }
            quad_chunks<TY, ND>(bias, p, n0, t, w, val, [&](int h, int c0, const unsigned (&a)[4]) {  // BN | 64: whole chunks only
                const int r = lrow0 + 8 * h, j = c0 >> 3, c = j & 7;
                st_shared_u4(dbuf + (unsigned)((j >> 3) * 8192 + r * 128 + ((c ^ (r & 7)) << 4)), a[0], a[1], a[2], a[3]);
            });
            fence_proxy_async();  // the staged rows are visible to the TMA (async proxy)
            wg ? named_sync_id<3, 128>() : named_sync_id<2, 128>();
            if ((tid & 127) == 0) {
#pragma unroll
                for (int b = 0; b < BN / 64; ++b) tma_store_2d(&tmy, dbuf + b * 8192, (int)(n0 + 64 * b), (int)(m0 + (wg * WAVES + w) * 64));
                bulk_commit();
            }
            d_busy = true;
        }
    };

    // a slot's release: an arrival on its empty barrier (EMPTY_ARRIVALS a block), and with CL = 2 on the other
    // block's too, whose producer also writes into this block's slot
    const unsigned peer_empty0 = CL > 1 ? map_shared_rank(empty0, rank ^ 1u) : 0u;
    auto release = [&](int slot) {
        mbar_arrive(empty0 + 8 * slot);
        if (CL > 1) mbar_arrive_cluster(peer_empty0 + 8 * slot);
    };

    Acc acc[WAVES * ND];  // wave w's in acc[w ND ...]
    float tmp[INT ? 1 : ND];
    int it = 0;  // the ring's position, across tiles (as the producer's)
#pragma unroll 1
    for (unsigned w = w_first; w < work; w += w_step) {
        i64 m0, n0, tile;
        int part, kb0, niter;
        item(w, m0, n0, tile, part, kb0, niter);
        // scale lookups of rows and columns past M and N read the last row's and column's (never stored);
        // ra[2 w], ra[2 w + 1]: wave w's two rows
        i64 ra[2 * WAVES];
#pragma unroll
        for (int r = 0; r < 2 * WAVES; ++r) ra[r] = a_scale_row(p, min(m0 + row0 + 64 * (r >> 1) + 8 * (r & 1), p.M - 1));
        const i64 ra0 = ra[0], ra1 = ra[1];
        auto col = [&](int j, int c) { return min(n0 + 8 * j + 2 * t + c, p.N - 1); };
        // tmp too: the first wgmma of a block ignores it (scale-d = 0) but names it as an input, and
        // without this write it would stay live through the epilogue, whose K-split sums need the registers
#pragma unroll
        for (int i = 0; i < WAVES * ND; ++i) acc[i] = Acc(0);
#pragma unroll
        for (int i = 0; i < (INT ? 1 : ND); ++i) tmp[i] = 0.0f;

        // block i of the item
        auto block = [&](int i) {
            const int slot = it % STAGES, kb = kb0 + i;
            float sa0 = 0.0f, sa1 = 0.0f;
            float sbc[MODE == MODE_K_COL ? ND / 2 : 1];
            constexpr int NS = 2 * WAVES + 1;
            float cur[SCALE_RING ? NS : 1];  // K_TILE: a's scales of the thread's rows (wave w: 2 w, 2 w + 1), then b's
            if constexpr (MODE == MODE_K_COL) {
                sa0 = a_scale(p, sa, ra0, kb), sa1 = a_scale(p, sa, ra1, kb);
#pragma unroll
                for (int j = 0; j < ND / 4; ++j) sbc[2 * j] = b_scale(p, sb, col(j, 0), kb), sbc[2 * j + 1] = b_scale(p, sb, col(j, 1), kb);
            }
            mbar_wait(full0 + 8 * slot, (unsigned)((it / STAGES) & 1));
            if constexpr (SCALE_RING) {  // read before the slot is released
                const unsigned src = sc0 + (unsigned)(slot * SC_BYTES);
                const int shift = 8 * (kb & 3);
#pragma unroll
                for (int r = 0; r < 2 * WAVES; ++r) {
                    const unsigned word = ld_shared_u32(src + 4u * (unsigned)(row0 + 64 * (r >> 1) + 8 * (r & 1)));
                    cur[r] = p.sa_packed ? e8m0_to_float((word >> shift) & 0xffu) : __uint_as_float(word);
                }
                cur[NS - 1] = __uint_as_float(ld_shared_u32(src + 4u * BM));
            }
            const unsigned off = (unsigned)(slot * (STAGE >> 4));
            if constexpr (INT) {  // into acc (zeroed by the item's first step); the previous block's slot is released once it retires
                wg_fence();
#pragma unroll
                for (int s = 0; s < 4; ++s) WgmmaS8<BN>::mma(acc, desc(adesc0 + off + 2 * s), desc(bdesc0 + off + 2 * s), i > 0 || s > 0);
                wg_commit();
                wg_wait<1>();
                __syncwarp();
                if (lane == 0 && i > 0) release((it + STAGES - 1) % STAGES);
            } else {
                // wave by wave through the one tmp set: its wgmmas, their wait, its promotion; the slot
                // is released once the last wave's wgmmas have retired
#pragma unroll
                for (int w = 0; w < WAVES; ++w) {
                    wg_fence();
#pragma unroll
                    for (int s = 0; s < 4; ++s)
                        WgmmaFp8<FA, FB, BN>::mma(tmp, desc(adesc0 + w * WAVE_DESC + off + 2 * s), desc(bdesc0 + off + 2 * s), s);
                    wg_commit();
                    wg_wait<0>();
                    if (w == WAVES - 1) {
                        release(slot);  // this thread's wgmmas of the slot have retired (see EMPTY_ARRIVALS)
                    }
                    float* aw = acc + w * ND;
                    if constexpr (MODE == MODE_END) {
#pragma unroll
                        for (int r = 0; r < ND; ++r) aw[r] = add_rn(aw[r], tmp[r]);
                    } else if constexpr (MODE == MODE_K_TILE) {
                        const float s0 = mul_rn(cur[2 * w], cur[NS - 1]), s1 = mul_rn(cur[2 * w + 1], cur[NS - 1]);
#pragma unroll
                        for (int r = 0; r < ND; ++r) aw[r] = fma_rn(tmp[r], (r & 2) ? s1 : s0, aw[r]);
                    } else {
#pragma unroll
                        for (int r = 0; r < ND; ++r) aw[r] = fma_rn(tmp[r], mul_rn((r & 2) ? sa1 : sa0, sbc[2 * (r >> 2) + (r & 1)]), aw[r]);
                    }
                }
            }
            ++it;
        };
#pragma unroll 1
        for (int i = 0; i < niter; ++i) block(i);
        // this thread's pairs: pair (ND / 2) w + 2 j is row row0 + 64 w, pair (ND / 2) w + 2 j + 1 row
        // row0 + 64 w + 8, both columns 8 j + 2 t (+ 1), of acc or of its values converted in place
        auto pairs = [&](auto& vals, auto f) {
#pragma unroll
            for (int w = 0; w < WAVES; ++w) {
#pragma unroll
                for (int j = 0; j < ND / 4; ++j) {
                    f(w * ND / 2 + 2 * j, row0 + 64 * w, 8 * j + 2 * t, vals[w * ND + 4 * j], vals[w * ND + 4 * j + 1]);
                    f(w * ND / 2 + 2 * j + 1, row0 + 64 * w + 8, 8 * j + 2 * t, vals[w * ND + 4 * j + 2], vals[w * ND + 4 * j + 3]);
                }
            }
        };
        auto visit = [&](auto f) { pairs(acc, f); };
        if constexpr (INT) {  // the last block retires, its slot is released; then scaled_mm.cuh's integer epilogue
            wg_wait<0>();
            __syncwarp();
            if (lane == 0) release((it + STAGES - 1) % STAGES);
            const float sa0 = a_scale(p, sa, ra0, 0), sa1 = a_scale(p, sa, ra1, 0);
            const int z0 = a_zero(p, azp, a_zero_row(p, min(m0 + row0, p.M - 1))), z1 = a_zero(p, azp, a_zero_row(p, min(m0 + row0 + 8, p.M - 1)));
            if (p.splits == 1) {
                if constexpr (TMA_OK) {  // converted in place (the float's bits in acc), then stored
                    // (not the 128 x 256 tile: its 128 sums a thread leave no registers for the exchange)
#pragma unroll
                    for (int j = 0; j < ND / 4; ++j) {
                        const i64 c0 = col(j, 0), c1 = col(j, 1);
                        const float sb0 = b_scale(p, sb, c0, 0), sb1 = b_scale(p, sb, c1, 0);
                        acc[4 * j] = __float_as_int(int_epilogue(adj, c0, acc[4 * j], z0, mul_rn(sa0, sb0)));
                        acc[4 * j + 1] = __float_as_int(int_epilogue(adj, c1, acc[4 * j + 1], z0, mul_rn(sa0, sb1)));
                        acc[4 * j + 2] = __float_as_int(int_epilogue(adj, c0, acc[4 * j + 2], z1, mul_rn(sa1, sb0)));
                        acc[4 * j + 3] = __float_as_int(int_epilogue(adj, c1, acc[4 * j + 3], z1, mul_rn(sa1, sb1)));
                    }
                    auto val = [&](int i) { return __int_as_float(acc[i]); };
                    if (p.y_tma) {
                        tma_tile(m0, n0, val);
                    } else {
                        store_tile_16<TY, 1, ND>(y, bias, p, m0, n0, row0, t, val);
                    }
                } else {  // in place, a column pair's scales and adj loaded once for both rows
                    float v[ND];
#pragma unroll
                    for (int j = 0; j < ND / 4; ++j) {
                        const i64 c0 = col(j, 0), c1 = col(j, 1);
                        const float sb0 = b_scale(p, sb, c0, 0), sb1 = b_scale(p, sb, c1, 0);
                        v[4 * j] = int_epilogue(adj, c0, acc[4 * j], z0, mul_rn(sa0, sb0));
                        v[4 * j + 1] = int_epilogue(adj, c1, acc[4 * j + 1], z0, mul_rn(sa0, sb1));
                        v[4 * j + 2] = int_epilogue(adj, c0, acc[4 * j + 2], z1, mul_rn(sa1, sb0));
                        v[4 * j + 3] = int_epilogue(adj, c1, acc[4 * j + 3], z1, mul_rn(sa1, sb1));
                    }
                    finish_tile<TY, float, BM, BN, CT, ND / 2>(y, bias, ws, counters, p, m0, n0, tile, tiles, part, tid,
                                                               [&](auto f) { pairs(v, f); }, AsScaled());
                }
            } else {  // the parts' integer sums first
                finish_tile<TY, int, BM, BN, CT, ND / 2>(y, bias, ws, counters, p, m0, n0, tile, tiles, part, tid, visit,
                                                         [&](int i, int, int n, int v0, int v1) {
                    const float s_a = (i & 1) ? sa1 : sa0;
                    const int z = (i & 1) ? z1 : z0;
                    const i64 c0 = n0 + n, c1 = min(c0 + 1, p.N - 1);
                    return make_float2(int_epilogue(adj, c0, v0, z, mul_rn(s_a, b_scale(p, sb, c0, 0))),
                                       int_epilogue(adj, c1, v1, z, mul_rn(s_a, b_scale(p, sb, c1, 0))));
                });
            }
        } else {
            // MODE_END: v = acc * (sa * sb), the scales of block 0 (the same for every block). Tiles wider
            // than 128 columns (never split) that store a 16-bit TY scale each value as store_tile_16
            // takes it: scaled in place first, ptxas would keep all of a thread's column scales and
            // their addresses live next to the 72-96 sums, and spill
            constexpr bool SCALE_AT_STORE = MODE == MODE_END && BN > 128 && !same_type<TY, float>::value;
            if constexpr (SCALE_AT_STORE) {
                static_assert(!SPLIT && WAVES == 1, "one wave, never split");
                const float s_a0 = a_scale(p, sa, ra0, 0), s_a1 = a_scale(p, sa, ra1, 0);
                store_tile_16<TY, 1, ND>(y, bias, p, m0, n0, row0, t, [&](int i) {  // i = 4 j + r
                    const int r = i & 3;
                    return mul_rn(acc[i], mul_rn((r & 2) ? s_a1 : s_a0, b_scale(p, sb, col(i >> 2, r & 1), 0)));
                });
            } else {
                if constexpr (MODE == MODE_END) {  // v = acc * (sa * sb), the scales of block 0 (the same for every block)
#pragma unroll
                    for (int w = 0; w < WAVES; ++w) {
                        const float s_a0 = a_scale(p, sa, ra[2 * w], 0), s_a1 = a_scale(p, sa, ra[2 * w + 1], 0);
                        float* aw = acc + w * ND;
#pragma unroll
                        for (int j = 0; j < ND / 4; ++j) {
                            const float sb0 = b_scale(p, sb, col(j, 0), 0), sb1 = b_scale(p, sb, col(j, 1), 0);
                            aw[4 * j] = mul_rn(aw[4 * j], mul_rn(s_a0, sb0)), aw[4 * j + 1] = mul_rn(aw[4 * j + 1], mul_rn(s_a0, sb1));
                            aw[4 * j + 2] = mul_rn(aw[4 * j + 2], mul_rn(s_a1, sb0)), aw[4 * j + 3] = mul_rn(aw[4 * j + 3], mul_rn(s_a1, sb1));
                        }
                    }
                }
                bool stored = false;
                if constexpr (!same_type<TY, float>::value) {
                    if (p.splits == 1) {
                        auto val = [&](int i) { return acc[i]; };
                        if constexpr (TMA_OK) {
                            if (p.y_tma) tma_tile(m0, n0, val), stored = true;
                        }
                        if (!stored) store_tile_16<TY, WAVES, ND>(y, bias, p, m0, n0, row0, t, val), stored = true;
                    }
                }
                if (!stored)
                    finish_tile<TY, float, BM, BN, CT, WAVES * ND / 2, SPLIT>(y, bias, ws, counters, p, m0, n0, tile, tiles, part, tid, visit,
                                                                             AsScaled());
            }
        }
    }
    if (TMA_OK && p.y_tma && (tid & 127) == 0) bulk_wait_all<false>();  // this warpgroup's last stores are written
    if (CL > 1) cluster_sync_all();  // the other block's last arrivals on this block's barriers are complete
#else
    __trap();  // built only for sm_90a; the host never launches this stub
#endif
}
