// weight_sm90_gemm.cu: y = a @ dequant(w).T for INT4, FP8 and FP4 (NVFP4, MXFP4) weights on Hopper's warpgroup tensor-core
// instructions (wgmma, sm_90a only), reading the prepared layout of weight_decode.cu's matmul (tiles of 16
// weight rows by 128 k stored as 1 KB each, scales and zero codes per tile and group: see
// weight/layout.py prepared_of; FP4: weight/layout.py). Compiled for the family-specific target sm_90a (cupyquant/_jit.py); on every
// other target the kernel is an empty stub that traps, and the host never launches it there.
//
// Organisation. sm90_wgmma.cuh holds the generated wgmma wrappers (Wgmma<T, N>::mma, wg_fence,
// wg_commit, wg_wait), sm90_async.cuh the mbarrier, TMA, proxy-fence, setmaxnreg and stmatrix
// helpers. The kernel sets up each thread's copy state (WgCopies, copies_init: sources, swizzled
// destinations, predicates; copy_a, copy_w and copy_advance issue and step the copies of a stage,
// wrapped as the lambdas load_a, load_w, load_stage, advance) and hands over to three role functions:
//   produce_ws   the producer warpgroup of the 128-row tile only: TMA boxes of activations and
//                cp.async of weights, scales and zero codes into a ring of mbarrier-guarded slots;
//   consume      the compute warpgroups' main loop: dequantize in registers, wgmma into the
//                accumulators; the 32-, 64- and 256-row tiles have no producer and issue their own
//                copies through the kernel's lambdas, behind a stage barrier;
//   finish_tile  the epilogue: round and store y, or first end a K split (2 ways: the cluster's two
//                blocks swap halves of their accumulators; 3 to 8: cluster_split_finish; with a
//                workspace: split_k_finish). Details below.
//
// Roles are swapped against y = a @ w.T: the wgmma computes y.T = w @ a.T, so the weights are the
// A operand (64 weight rows per warpgroup, M of the wgmma) and the activations the B operand (BMA
// rows of a, N of the wgmma, 32..256). The A operand of wgmma may come from registers, which is where
// the weights are dequantized; B is read by the tensor cores from shared memory, where cp.async puts
// the activations in the 128-byte-swizzled K-major layout the wgmma descriptor describes.
//
// A block is two warpgroups that compute (a third copies for the 128-row tile, below): 128 weight
// rows by BMA activation rows. K streams through shared memory
// in stages of 64 HALVES (HALVES = 1 or 2): per half, one 128-byte row of activations per a row (a
// swizzle atom of its own) and 32 bytes per weight row. STAGES slots deep with STAGES - 2 stages of
// loads in flight: the slot that stage i + STAGES - 2 overwrites held stage i - 2, whose wgmmas both
// warpgroups have waited for before the barrier of stage i. Stages of 128 halve the barriers and
// pipeline turns per k (10-16% faster than stages of 64 on the 64- and 128-row tiles on an H100).
// The 64- and 32-row tiles dequantize a whole half ahead of their wgmmas (AHEAD in the kernel), the
// others a k16 step ahead. The 32-row tile (M <= 32, 6 stages deep, two blocks a SM) is the 64-row
// tile's code at half the width: each thread copies one 16-byte piece of activations a half. It is
// 7-11% faster than the 64-row tile at M = 32 on an H100 (14336 x 4096: 18.1 against 19.5 us).
// The stage's scales and zero codes travel with it, by cp.async into a ring of the same depth, so
// that they are as far ahead as the weights (4-16% faster than loading them into registers 4 stages
// ahead on an H100, where their first use holds 11% of a 64-row tile's stall samples).
//
// Dequantization. Lane (g, t) of warp q of a warpgroup holds, per k16 step s, the A fragment of
// rows 16 q + g and 16 q + g + 8 at k = 16 s + {2t, 2t + 1, 2t + 8, 2t + 9}. The prepared layout
// stores exactly these 8 codes as the lane's 32-bit word of step s (fragment order: weight/quantize.py
// prepare_weight; a 16-byte piece holds the words of one step of four lanes), so a lane reads only
// its own bytes, one 4-byte shared load a step, and turns a word into its four registers with one shift and four lop3
// (fp16) or three shifts and four lop3 (bf16) that OR in the magic exponent (1024 + q or
// 1024 + 16 q; 128 + q); one FMA with the multiplier and the zero bias gives q - z exactly, and a
// second multiplies by the group's scale: round(s * (q - z)) in a's dtype, bit-identical to
// w.dequantize(a.dtype). K_PERMUTED (groups of whole chunks: the layout's 4 x 4 blocks of 8 k of each
// chunk are transposed, weight/layout.py k_permuted): the layout's k16 step j of a chunk holds the chunk's
// blocks of 8 k 8 (j % 2) + j / 2 and that + 4, not two adjacent blocks, so a real step s of
// half hh takes a0, a1 from the low or high registers of the word of layout step hh + 4 (s % 2) and
// a2, a3 from those of layout step hh + 4 (s % 2) + 2 (registers 2 (s / 2) and 2 (s / 2) + 1 of
// both words): the same shifts and lop3 as without K_PERMUTED, from two words instead of one, and the
// activations stay in K order in shared memory. The half's four words are pieces (hh, 4 g + u),
// 512 contiguous bytes a tile. (From a row-major tile a lane would read all four lanes' bytes and
// pick its own with a prmt: 4x the shared-memory reads, and 3 integer instructions a register
// instead of 1.25 or 1.75.) Products are exact in the tensor cores
// and summed in float32, as on the other paths.
// FP4 weights (always K_PERMUTED: the same bytes as INT4's, E2M1 codes) become w' = e2m1 * s * 2^-7
// exactly in T (weight_mma.cuh fp4_frag times the scale of the register's group, one FMA a
// register), the group that of the register's natural k, which is what the real step s of a half
// counts in (the wgmma B operand is in natural k order): natural chunk k16 step 4 hh + s, so NVFP4
// group 4 hh + s (rows g and g + 8 of the lane: two scales a step) and MXFP4 group 2 hh + s / 2. The
// scale bytes travel in the scale ring (copies_init); a lane turns each row's 4 bytes of a half
// (MXFP4: of a chunk) into pairs once (fp4_scale_pairs, the values of fp4_scale2) and the FMA takes
// one half of a pair by its operand selector (bf16 on an H100, 4096 x 4096, 14336 x 4096 and
// 4096 x 14336, M = 16 to 4096: NVFP4 1.07-1.22x INT4's time, MXFP4 1.02-1.11x, against NVFP4
// 1.16-1.67x converting a scale byte at each step with fp4_scale2). The float32 sums are multiplied
// by fp4_out_scale before they are rounded, in every epilogue (finish_tile).
// FP8 weights (never K_PERMUTED: the prepared tile is 16 rows by 64 bytes a 64-k chunk, k in order)
// take a byte a weight: a stage holds each tile's HALVES chunks (1 KB each, copied as they are but
// for the 16-byte pieces of each row, swizzled by the row: copies_init), and the tiles' rings are
// shallower (cupyquant/weight/sm90_gemm.py FP8_CONFIGS). The A fragment of step s is rows g and
// g + 8 at k 16 s + 2t, + 1 and 16 s + 2t + 8, + 9: four 16-bit reads of byte pairs a step (16 a
// half, against INT4's four 4-byte words), conflict-free, each pair turned into T and multiplied by
// its row's scale of the step's 32-k group in one rounding (weight_mma.cuh fp8x2_scaled, as the
// decode kernel does): the weights w.dequantize(a.dtype) gives. W_FP8_BLOCK (128 x 128 block weights):
// the scales are float32, one per row and 128 k (64 bytes a tile and group in the scale ring: a
// slot's 64 bytes a tile and half), multiplied in float32 and rounded once to T (weight_decode.cu).
//
// Split K: when the tiles cannot fill the GPU, K is split across blocks (gridDim.z). With a
// workspace (ws not null), as in weight_sm80_gemm.cu: float32 partial tiles to the workspace, a per-tile
// counter, and the last split adds the partials in split order 0, 1, ..., so the result does not
// depend on timing, and writes y (weight_mma.cuh split_k_finish). Without one (the splits launched
// as clusters of 1 x 1 x splits blocks), the partials stay on the SMs and the cluster's blocks add
// them through distributed shared memory, in the same order: 2 splits from the accumulator
// registers (the kernel's end), 3 to 8 from each block's whole partial tile (cluster_split_finish).
//
// The 128-row tile (WS in the kernel) adds a producer warpgroup (warps 8-11): thread 256 loads each
// stage's activations with two TMA boxes (64 k by 128 rows of a, the 128-byte swizzle the wgmma
// descriptor describes; the host encodes the tensor map, cupyquant/_workspace.py tensor_map; in the last M
// tile, where M is not a multiple of 128, boxes of that tile's rows rounded up to 8 from a second
// map, rows past M read as zeros) and the 128 producer threads copy the weights, scales and zero
// codes by cp.async into the same slots as the other tiles' copies. A ring of mbarriers replaces the stage
// barrier: full[s] completes when slot s has arrived (the TMA's bytes, and one arrival per producer
// thread when its copies complete: cp.async.mbarrier.arrive.noinc), empty[s] when every compute warp
// has retired the wgmmas of the stage in slot s (one arrival a warp, at the fourth k16 step of the
// next stage). The compute warps neither copy nor meet at a barrier; the producer runs up to STAGES
// stages ahead, then exits (exited threads count as arrived at the epilogue's barriers). Registers:
// 384 threads launch with 168 each, and setmaxnreg moves them to 224 for the compute warps and 56 for
// the producer (256 x 224 + 128 x 56 = 384 x 168). The producer is 2-5% faster than a stage barrier
// on an H100 (14336 x 4096 M = 128: 25.3 against 26.2 us), through the TMA: copying the activations
// with cp.async instead, it is slower than the stage barrier.
// The last M tile reads boxes of its own rows rounded up to 8 from the second map, one box a half as
// in the whole tiles: a 128-row box with many rows past M slows the tile for no known reason (4096^2
// M = 136 on an H100: 24.5 against 16.1 us), and boxes of 32 rows would take 4x the TMA instructions.
//
// Epilogue (K not split): the tile goes through shared memory (transposed to a's row order) so that y is written
// in 16-byte pieces along its rows (byte by byte where out= is not 16-byte aligned or at N's tail).

#include "common.cuh"
#include "weight_mma.cuh"
#include "sm90_async.cuh"
#include "sm90_wgmma.cuh"

using namespace cq;

static constexpr int WG_BN = 128;       // weight rows per block: two warpgroups of 64
static constexpr int WG_BK = 64;        // K per stage: 128 bytes of each activation row
static constexpr int WG_THREADS = 256;  // two warpgroups that compute (the 128-row tile adds a producer: WG_THREADS + 128)

struct WgArgs {
    i64 M, N, K;
    i64 lda;
    i64 ng;
    int gshift;  // k's group is k >> gshift (log2 G; 62 for one group per row)
    int splits;  // gridDim.z
    int iters;   // stages of K per split (the last split may have fewer)
    int early;   // 1: the first stages' weights and scales are copied before the PDL wait (weight/dispatch.py early_ok)
};
// The tensor maps (sm90_async.cuh TmaMap) of the launch's rows of a: boxes of 64 k by 128 rows in the
// 128-byte swizzle (tm), and where M is not a multiple of 128, by the last tile's rows rounded up to
// 8 (tm_tail). The 64- and 256-row tiles do not read them, nor the 128-row tile tm_tail where M is a
// multiple of 128 (the host passes zeros).

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The multiplier pairs (weight_mma.cuh frag_mul) read from constant memory, not as immediates: the
// INT4 zero bias takes the FMA's immediate operand, and the 256-row build, short of registers, would
// otherwise rebuild the multiplier in a register for every FMA. [fp16 row g, row g + 8, bf16, bf16]
__constant__ unsigned wg_mul[4] = {frag_mul<__half>(0), frag_mul<__half>(1), frag_mul<__nv_bfloat16>(0), frag_mul<__nv_bfloat16>(1)};
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Split K 3 to 8 ways inside a thread-block cluster (the host launches the splits of a tile, gridDim.z
// of them, as one cluster of 1 x 1 x splits blocks; cluster rank = split; 2 ways: the kernel's end,
// from registers). Each block stores its float32
// partial tile in its own shared memory; after a cluster barrier, block r adds up its share of the
// tile's pieces (16 bytes each) from every block's shared memory (distributed shared memory,
// ld.shared::cluster), in split order 0, 1, ..., so the sum does not depend on timing and matches
// split_k_finish bit for bit, rounds once and writes y; a second barrier keeps every block's
// shared memory alive until the others have read it. No global workspace, counter or memset.
// visit(f), SCALE_OUT and out_scale as in split_k_finish. The caller has waited for its wgmmas and
// copies. (The cluster helpers are in weight_mma.cuh, shared with the decode kernel's K split.)
template <typename T, int BMA, bool SCALE_OUT, typename Visit>
__device__ __forceinline__ void cluster_split_finish(unsigned char* smem, T* __restrict__ y, i64 M, i64 N, i64 m0, i64 n0, int splits,
                                                     Visit visit, float out_scale) {
    constexpr int LDP = WG_BN + 4;      // floats a row: 16-byte rows, conflict-free scalar stores
    constexpr int P = BMA * WG_BN / 4;  // float4 pieces of a tile
    float* part = reinterpret_cast<float*>(smem);
    __syncthreads();  // every warp is done with the pipeline's slots
    visit([&](int m, int n, float v) { part[m * LDP + n] = v; });
    cluster_sync_all();
    const int rank = (int)cluster_rank();
    const int lo = (int)((i64)P * rank / splits), hi = (int)((i64)P * (rank + 1) / splits);
    const unsigned pbase = (unsigned)__cvta_generic_to_shared(part);
#pragma unroll 1
    for (int idx = lo + threadIdx.x; idx < hi; idx += WG_THREADS) {
        const int m = idx / (WG_BN / 4), n = (idx % (WG_BN / 4)) * 4;
        if (m0 + m >= M || n0 + n >= N) continue;  // not read at all: every load below is consumed by a store
        const unsigned off = pbase + (unsigned)(m * LDP + n) * 4u;
        float4 v[8];
#pragma unroll
        for (int r = 0; r < 8; ++r)
            if (r < splits) v[r] = ld_shared_cluster_f4(map_shared_rank(off, (unsigned)r));
        float4 s = v[0];
#pragma unroll
        for (int r = 1; r < 8; ++r)
            if (r < splits) {
                s.x = add_rn(s.x, v[r].x), s.y = add_rn(s.y, v[r].y);
                s.z = add_rn(s.z, v[r].z), s.w = add_rn(s.w, v[r].w);
            }
        if constexpr (SCALE_OUT) {
            s.x = mul_rn(s.x, out_scale), s.y = mul_rn(s.y, out_scale);
            s.z = mul_rn(s.z, out_scale), s.w = mul_rn(s.w, out_scale);
        }
        store_rounded4(y, M, N, m0 + m, n0 + n, s);
    }
    cluster_sync_exit();  // the other blocks have read this block's partial
}

// The epilogue: acc (accumulator acc[4 j + r]: weight row nrow + 8 (r >> 1), activation row
// 8 j + 2 t + (r & 1)) summed over the splits of K where K is split (a cluster's registers or shared
// memory, or the workspace), rounded to T and stored to y; FP4 sums are first multiplied by osc
// (fp4_out_scale; 1 and unused for INT4). The caller has waited for its wgmmas and copies.
template <typename T, int S, int BMA>
__device__ __forceinline__ void finish_tile(float (&acc)[BMA / 2], unsigned char* smem, unsigned sbase, T* __restrict__ y, float* __restrict__ ws,
                                            int* __restrict__ counters, const WgArgs& a, i64 m0, i64 n0, int tid, int warp, int lane, int t,
                                            int nrow, int& s_last, float osc) {
    constexpr bool FP4 = S == W_NVFP4 || S == W_MXFP4;
    auto fin = [&](float v) {
        if constexpr (FP4) v = mul_rn(v, osc);
        return v;
    };
    if (a.splits > 2 && ws == nullptr) {  // the splits of the tile are one cluster of 3 to 8 blocks
        cluster_split_finish<T, BMA, FP4>(
            smem, y, a.M, a.N, m0, n0, a.splits,
            [&](auto f) {
#pragma unroll
                for (int j = 0; j < BMA / 8; ++j)
#pragma unroll
                    for (int r = 0; r < 4; ++r) f(8 * j + 2 * t + (r & 1), nrow + 8 * (r >> 1), acc[4 * j + r]);
            },
            osc);
        return;
    }
    if (a.splits > 1 && ws != nullptr) {
        split_k_finish<T, BMA, WG_BN, WG_THREADS, FP4>(
            ws, counters, y, a.M, a.N, m0, n0, a.splits, s_last,
            [&](auto f) {
#pragma unroll
                for (int j = 0; j < BMA / 8; ++j)
#pragma unroll
                    for (int r = 0; r < 4; ++r) f(8 * j + 2 * t + (r & 1), nrow + 8 * (r >> 1), acc[4 * j + r]);
            },
            osc);
        return;
    }

    // The rounded tile goes through shared memory: activation rows 8 jlo .. 8 jhi - 1 (jlo, jhi even)
    // by 128 weight rows, LD halves apart (272-byte rows, so the 8 rows of a tile below fall in
    // distinct banks), then out in 16-byte pieces.
    constexpr int LD = WG_BN + 8;
    unsigned short* so = reinterpret_cast<unsigned short*>(smem);
    auto store_rows = [&](int jlo, int jhi) {
        __syncthreads();  // every warpgroup's wgmmas are done with the pipeline's slots
        {
            // stmatrix .trans, four 8 x 8 tiles of 16-bit values a warp at a time: tile (j', h) is
            // activation rows 8 j' .. 8 j' + 7 by weight rows wrow + 8 h .. + 7 (j' = j, j + 1; h = 0, 1).
            // In the accumulator layout lane (g, t) holds its row g (weight row) at columns 2t, 2t + 1
            // (activation rows): acc[4 j' + 2 h] and + 1, packed into one register; .trans stores the
            // tile transposed, so each activation row gets 8 consecutive weight rows (16 bytes). Lane k
            // gives the address of row k % 8 of tile k / 8. The same bits as one 16-bit store an
            // element with 1/8 of the instructions (1.5% faster at 14336 x 4096 M = 256 on an H100).
            const int wrow = (warp >> 2) * 64 + (warp & 3) * 16, mi = lane >> 3;
            const unsigned sto = (unsigned)__cvta_generic_to_shared(so) + 2u * (unsigned)((8 * (mi >> 1) + (lane & 7)) * LD + wrow + 8 * (mi & 1));
#pragma unroll
            for (int j = 0; j < BMA / 8; j += 2) {
                if (j < jlo || j >= jhi) continue;
                unsigned v[4];
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int jj = j + (q >> 1), h = q & 1;
                    v[q] = (unsigned)bits16_rn<T>(fin(acc[4 * jj + 2 * h])) | ((unsigned)bits16_rn<T>(fin(acc[4 * jj + 2 * h + 1])) << 16);
                }
                stmatrix_x4_trans(sto + 2u * (unsigned)(8 * j * LD), v);
            }
        }
        __syncthreads();
#pragma unroll 1
        for (int idx = tid + 8 * jlo * (WG_BN / 8); idx < 8 * jhi * (WG_BN / 8); idx += WG_THREADS) {
            const int r = idx / (WG_BN / 8), c = idx % (WG_BN / 8);
            const i64 m = m0 + r, n = n0 + 8 * c;
            if (m >= a.M || n >= a.N) continue;
            const uint4 v = *reinterpret_cast<const uint4*>(so + r * LD + 8 * c);
            unsigned short* p = reinterpret_cast<unsigned short*>(y + m * a.N + n);
            if (n + 8 <= a.N && (reinterpret_cast<unsigned long long>(p) & 15) == 0) {
                *reinterpret_cast<uint4*>(p) = v;
            } else {
                const unsigned e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int k = 0; k < 8; ++k)
                    if (n + k < a.N) p[k] = (unsigned short)(e[k >> 1] >> (16 * (k & 1)));
            }
        }
    };
    if (a.splits == 1) {
        store_rows(0, BMA / 8);
        return;
    }
    // K split 2 ways as a cluster (ws == nullptr): block r adds and stores the rows of the tile's
    // 8-row groups [BMA / 16 r, BMA / 16 (r + 1)). Each block stages its partials of the other
    // block's groups in its shared memory in accumulator order (group, thread: 16 bytes a thread,
    // one st.shared.v4), past the rows of the store; after a cluster barrier each thread adds the
    // other block's piece of its own accumulators (ld.shared::cluster of the same thread's place;
    // a + b is b + a, so this is split_k_finish's sum, bit for bit) and the block stores its rows as
    // an unsplit tile does; a last barrier keeps the staging alive until the other block has read
    // it. This is 1-3% faster than cluster_split_finish on an H100 (4096^2 M = 128: 12.1 against
    // 12.5 us); for 3 to 8 blocks its uneven shares make it the slower one.
    {
        constexpr unsigned STG = (unsigned)((BMA * LD * 2 + 1023) & ~1023);  // past the rows of the store
        const int rk = (int)cluster_rank(), jlo = rk * (BMA / 16), jhi = jlo + BMA / 16;
        const unsigned stg = sbase + STG + (unsigned)tid * 16u;
        __syncthreads();  // every warp is done with the pipeline's slots
#pragma unroll
        for (int j = 0; j < BMA / 8; ++j)
            if (j < jlo || j >= jhi)
                st_shared_f4(stg + (unsigned)(j * WG_THREADS * 16), acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
        cluster_sync_all();
        const unsigned other = map_shared_rank(stg, (unsigned)(rk ^ 1));
#pragma unroll
        for (int j0 = 0; j0 < BMA / 8; j0 += 4) {  // four groups' loads issued together
            if (j0 + 4 <= jlo || j0 >= jhi) continue;
            float4 v[4];
#pragma unroll
            for (int u = 0; u < 4; ++u)
                if (j0 + u >= jlo && j0 + u < jhi) v[u] = ld_shared_cluster_f4(other + (unsigned)((j0 + u) * WG_THREADS * 16));
#pragma unroll
            for (int u = 0; u < 4; ++u)
                if (j0 + u >= jlo && j0 + u < jhi) {
                    const int j = j0 + u;
                    acc[4 * j] = add_rn(acc[4 * j], v[u].x), acc[4 * j + 1] = add_rn(acc[4 * j + 1], v[u].y);
                    acc[4 * j + 2] = add_rn(acc[4 * j + 2], v[u].z), acc[4 * j + 3] = add_rn(acc[4 * j + 3], v[u].w);
                }
        }
        store_rows(jlo, jhi);
        cluster_sync_exit();  // the other block has read this block's staging
    }
}
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// A thread's copies of the stages into the ring (cp.async): sources, swizzled destinations and
// predicates, set once by copies_init and stepped by copy_advance and copy_w. Read by copy_a and
// copy_w (tiles without a producer) and by produce_ws (the scales and zero codes).
struct WgCopies {
    const char* a_next;           // activations: this thread's first row of the loop group's stage
    unsigned a_dst;               // ... its swizzled place in slot 0
    i64 a_qstep;                  // ... 32 rows on
    int a_nq;                     // ... how many of its rows (32 apart) are below M
    bool a_full;                  // ... all of them
    const unsigned char* w_next;  // weights: the loop group's (HALVES = 1 without K_PERMUTED: the next stage's) source
    const unsigned char* w_next2; // ... HALVES = 2: the second copy's source
    unsigned w_dst[2];            // ... the places in slot 0 (HALVES of them)
    bool w_ok[2];                 // ... the tile is within the padded weight
    i64 w_tstep;                  // ... FP8: bytes between a thread's copies (whole tiles apart)
    unsigned w_okm;               // ... FP8: bit c, copy c's tile is within the padded weight
    int w_odd;                    // ... HALVES = 1 without K_PERMUTED: the next stage is the second half of its chunk
    unsigned sz_dst;              // scales or zero codes: the place in scale slot 0
    const unsigned char* sc_next; // ... the next stage's scale source
    const unsigned char* zc_next; // ... and zero-code source
    bool sc_ok, zc_ok;            // ... this thread copies scales, zero codes
    int zc_bytes;                 // ... of this thread's zero-code piece: 16, 8, or none
    int sc_step_even, sc_step_odd; // ... the sources' step after a stage of even, odd place in its group
    int sz_k;                     // k of the first stage (K < 2^31: host)
};

// Sets c for thread tid of the block of tile (m0, n0) and the split whose first stage is it0.
template <typename T, int S, int BMA, int STAGES, int HALVES, bool K_PERMUTED, int STAGE, int SZ_STAGE>
__device__ __forceinline__ void copies_init(WgCopies& c, const T* __restrict__ act, const unsigned char* __restrict__ wq,
                                            const T* __restrict__ scales, const unsigned char* __restrict__ zeros, const WgArgs& a, int tid,
                                            i64 n0, i64 m0, i64 it0, i64 nchunks, i64 n16_total, unsigned sbase) {
    constexpr int BK = 64 * HALVES, A_ATOM = BMA * 128, A_BYTES = A_ATOM * HALVES, SC_TILE = 64 * HALVES, ZC_TILE = 16 * HALVES;
    // Activations: chunk ac of rows ar0 + 32 q of each half, at swizzled chunk ac ^ (row & 7)
    // (the same for every q); stages are loaded in order, so the source pointers advance by one
    // stage per load. Rows past M and N are not copied: their slot rows hold stale data, which only
    // reaches accumulators of rows that are never stored.
    constexpr int A_CH = BMA * 8 / WG_THREADS;
    const int ac = tid & 7, ar0 = tid >> 3;
    const int a_nq = (int)max((i64)0, min((a.M - m0 - ar0 + 31) / 32, (i64)A_CH));  // q of rows < M
    const char* a_next = reinterpret_cast<const char*>(act + (m0 + ar0) * a.lda + it0 * BK + ac * 8);
    const i64 a_qstep = 32 * a.lda * (i64)sizeof(T);
    unsigned a_dst = sbase + ar0 * 128 + ((ac ^ (ar0 & 7)) << 4);
    asm volatile("" : "+r"(a_dst));  // opaque: kept in a register, not recomputed in each copy of the loop
    // Every row this thread copies is below M (all M tiles but the last): the 256-row tile copies
    // them unpredicated, where its 8 predicates a half, kept packed in a register (P2R) and unpacked
    // each stage, cost more than the branch (fewer rows a thread: the predicates stay)
    const bool a_full = a_nq == A_CH;
    // K_PERMUTED, HALVES = 1: the stage of half hh needs the layout's steps hh, hh + 2, hh + 4, hh + 6 (see
    // the dequantization above), which are the chunk's 512 bytes at hh 512: thread tid copies piece
    // p = tid % 32 of tile tid / 32 to 16 (4 pg + ((p % 4) ^ (pg / 2 % 4))), pg = p / 4, as the
    // halves of HALVES = 2 below, and the source steps 512 bytes a stage.
    // Weights, prepared layout: tile n16 of 16 rows holds chunk c (128 k) at (n16 nchunks + c) KB in
    // fragment order: the word of lane (g, t) for k16 step s is word t of piece (s % 2, 4 g + s / 2)
    // (512 bytes a value of s % 2, 16 a piece). Warp w of the block multiplies tile w of its 8; a lane
    // reads its word of each step (one 4-byte load). The pieces go to the slot swizzled so that the
    // 32 lanes' words of a step fall in 32 distinct banks:
    //   HALVES = 2 (a stage is a chunk, 1 KB a tile): piece (h, 4 g + j) at h 512 + 16 (4 g + (j ^ (g / 2 % 4)));
    //     thread tid copies pieces tid and tid + 256 of the block's 8 KB (tiles tid / 64 and tid / 64 + 4).
    //   HALVES = 1 (a stage is 64 k, the steps s = 4 hh + u of chunk half hh = stage % 2: pieces
    //     (h, 4 g + 2 hh + j1), j1 = 0, 1; 512 bytes a tile): piece (h, 4 g + 2 hh + j1) at
    //     h 256 + 16 (2 g + (j1 ^ (g / 4))); thread tid copies piece (h, g, j1) = (q / 16, q / 2 % 8, q % 2)
    //     of tile tid / 32, q = tid % 32, and the source steps 32 bytes from half 0 to 1 and
    //     1024 - 32 from half 1 to the next chunk.
    // FP8 (S = W_FP8, never K_PERMUTED): a tile's stage is its HALVES 64-k chunks of 16 rows by 64
    // bytes, contiguous in the prepared layout at (n16 2 nchunks + HALVES stage) KB. Piece
    // L = tid + 256 c (c < 2 HALVES) of the stage's 8 tiles, 64 HALVES pieces a tile: tile L / (64 HALVES), piece
    // p = L % (64 HALVES) (half p / 64, row r = p / 4 % 16, 16 bytes u = p % 4 of the row) to
    // 16 ((p & ~3) | (u ^ (r / 2 % 4))) of the tile's 1024 HALVES bytes, so that the 8 rows of a warp's
    // 16-bit reads of the same u fall in 8 distinct 16-byte bank groups (consume).
    const unsigned char* w_next;
    unsigned w_dst[HALVES];
    bool w_ok[HALVES];
    int w_odd = (int)(it0 & 1);
    i64 w_tstep = 0;
    unsigned w_okm = 0;
    if constexpr (is_fp8_scheme(S)) {
        constexpr int TP = 64 * HALVES, TT = WG_THREADS / TP;  // pieces a tile; tiles a pass of the threads
        const int p = tid % TP, r = (p >> 2) & 15;
#pragma unroll
        for (int c = 0; c < HALVES; ++c) w_ok[c] = false;  // w_okm instead
        w_next = wq + (((n0 >> 4) + tid / TP) * 2 * nchunks + HALVES * it0) * 1024 + p * 16;
        w_dst[0] = sbase + A_BYTES + (tid / TP) * (TP * 16) + ((p & ~3) | ((p & 3) ^ ((r >> 1) & 3))) * 16;
        w_dst[HALVES - 1] = w_dst[0];  // copy q's place is w_dst[0] + 4096 q
        w_tstep = (i64)TT * 2 * nchunks * 1024;
#pragma unroll
        for (int c = 0; c < 2 * HALVES; ++c)
            if ((n0 >> 4) + tid / TP + c * TT < n16_total) w_okm |= 1u << c;
    } else if constexpr (HALVES == 1 && K_PERMUTED) {
        const int p = tid & 31, pg = p >> 2;
        w_ok[0] = (n0 >> 4) + (tid >> 5) < n16_total;
        w_next = wq + (((n0 >> 4) + (tid >> 5)) * nchunks + (it0 >> 1)) * 1024 + (it0 & 1) * 512 + p * 16;
        w_dst[0] = sbase + A_BYTES + (tid >> 5) * 512 + (4 * pg + ((p & 3) ^ ((pg >> 1) & 3))) * 16;
    } else if constexpr (HALVES == 1) {
        const int q = tid & 31, h = q >> 4, pg = (q >> 1) & 7, j1 = q & 1;
        w_ok[0] = (n0 >> 4) + (tid >> 5) < n16_total;
        w_next = wq + (((n0 >> 4) + (tid >> 5)) * nchunks + (it0 >> 1)) * 1024 + h * 512 + (4 * pg + 2 * (int)(it0 & 1) + j1) * 16;
        w_dst[0] = sbase + A_BYTES + (tid >> 5) * 512 + h * 256 + (2 * pg + (j1 ^ (pg >> 2))) * 16;
    } else {
        w_next = wq + (((n0 >> 4) + (tid >> 6)) * nchunks + it0) * 1024 + (tid & 63) * 16;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int L = c * WG_THREADS + tid, p = L & 31, pg = p >> 2;
            w_ok[c] = (n0 >> 4) + (L >> 6) < n16_total;
            w_dst[c] = sbase + A_BYTES + (L >> 6) * 1024 + ((L >> 5) & 1) * 512 + (4 * pg + ((p & 3) ^ ((pg >> 1) & 3))) * 16;
        }
    }
#pragma unroll
    for (int c = 0; c < HALVES; ++c) asm volatile("" : "+r"(w_dst[c]));  // opaque, as a_dst
    const i64 w_cstep = 4 * nchunks * 1024;  // HALVES = 2: the second copy is 4 tiles on
    // Scales (and zero codes) of a stage: for each of the block's 8 tiles of 16 rows, the stage's
    // groups (BK / G of them when G < BK, else one), 32 bytes of scales a group and 8 bytes of zero
    // codes, copied with the stage into the scale ring (SZ_STAGE bytes a slot after the STAGES
    // slots): threads 0 .. 32 HALVES - 1 copy 16 bytes of scales each (tile tid / (4 HALVES), piece
    // tid % (4 HALVES)); the next 8 HALVES threads the zero codes (tile, 16-byte piece; 8 bytes where
    // a tile has only 8 for the stage). Tiles past the padded weight are not copied (their rows are
    // never stored).
    // The 128-row tile's producer warpgroup makes these copies: its thread szt = tid - WG_THREADS
    // takes thread tid's part (the compute warps' values are unused there).
    constexpr bool WS = BMA == 128;
    const int szt = WS ? tid - WG_THREADS : tid;
    const int ngst = max(1, BK >> min(a.gshift, 16));  // groups a stage spans
    constexpr int GB = S == W_FP8_BLOCK ? 64 : 32;  // a tile's scale bytes a group: 16 rows of float32 (W_FP8_BLOCK) or T
    constexpr int SC_T = 32 * HALVES, ZC_T = 8 * HALVES;
    const bool is_sc = szt < SC_T;
    const int sz_tile = is_sc ? szt / (4 * HALVES) : (szt - SC_T) / HALVES;
    const int sc_piece = szt % (4 * HALVES), zc_piece = (szt - SC_T) % HALVES;
    const i64 sz_n16 = n0 / 16 + sz_tile;
    bool sc_ok = is_sc && sz_n16 < n16_total && sc_piece < GB / 16 * ngst;
    const int zc_bytes = 8 * ngst - 16 * zc_piece;  // of this thread's piece: 16, 8, or none
    const bool zc_ok = S == W_UINT4 && !is_sc && szt < SC_T + ZC_T && sz_n16 < n16_total && zc_bytes > 0;
    const unsigned char* sc_base = reinterpret_cast<const unsigned char*>(scales) + (sz_n16 * a.ng) * GB + sc_piece * 16;
    const unsigned char* zc_base = zeros + (sz_n16 * a.ng) * 8 + zc_piece * 16;
    unsigned sz_dst = sbase + STAGES * STAGE + (is_sc ? sz_tile * SC_TILE + sc_piece * 16 : 8 * SC_TILE + sz_tile * ZC_TILE + zc_piece * 16);
    const int sz_k = (int)(it0 * BK);  // k of the first stage (K < 2^31: host)
    const int gsh = min(a.gshift, 31);
    // The scale and zero-code sources step by a stage's groups (32 and 8 bytes a group) after each
    // load: BK / G groups when G <= BK, none for one group per row, and for G = 128 with stages of 64
    // (the 256-row tile) one after every stage whose index from K's start is odd. That index is it0
    // plus an even group base plus the stage's place jj in its group, so the step after a load is
    // sc_step_odd for odd jj, sc_step_even for even jj, each set by it0's parity.
    const bool g2 = BK == 64 && gsh == 7, odd0 = (it0 & 1) != 0;
    int sc_step_even = g2 ? (odd0 ? GB : 0) : GB * (BK >> min(gsh, 16));
    int sc_step_odd = g2 ? (odd0 ? 0 : GB) : sc_step_even;
    const unsigned char* sc_next = sc_base + (sz_k >> gsh) * GB;
    const unsigned char* zc_next = zc_base + (sz_k >> gsh) * 8;
    if constexpr (S == W_NVFP4 || S == W_MXFP4) {
        // FP4: the scale bytes of tile n16 and chunk c, (n16 nchunks + c) 16 NB bytes (row i's NB
        // bytes at 16 NB c + NB i, byte j the chunk's group j), go to the tile's SC_TILE bytes of
        // the scale slot. A stage of 128 k (HALVES = 2) takes the chunk's 16 NB bytes as they are:
        // NB pieces of 16 bytes a tile (threads 0 .. 8 NB - 1). Stages of 64 k (HALVES = 1, the
        // 256-row tile) take NVFP4 row i's 4 bytes of the stage's half (bytes 4 hh .. 4 hh + 3, hh
        // the stage's index from K's start mod 2) to 4 i: 16 pieces of 4 bytes a tile (threads 0 ..
        // 127), and MXFP4's whole chunk (4 pieces of 16 bytes a tile, 64 bytes: a row's half is 2
        // bytes, below cp.async's 4), whose reader picks the half's bytes (consume: fsh).
        constexpr int NB = S == W_NVFP4 ? 8 : 4;
        constexpr bool ROW4 = HALVES == 1 && S == W_NVFP4;
        constexpr int PIECES = ROW4 ? 16 : NB;  // a tile's pieces
        const int ftile = szt / PIECES, fpiece = szt % PIECES;
        const i64 fn16 = n0 / 16 + ftile;
        sc_ok = szt < 8 * PIECES && fn16 < n16_total;
        sc_next = reinterpret_cast<const unsigned char*>(scales) + (fn16 * nchunks + (sz_k >> 7)) * (16 * NB) +
                  (ROW4 ? fpiece * 8 + (int)(it0 & 1) * 4 : fpiece * 16);
        sz_dst = sbase + STAGES * STAGE + ftile * SC_TILE + fpiece * (ROW4 ? 4 : 16);
        // the source's step after a stage: the chunk's bytes (HALVES = 2); HALVES = 1 after a stage
        // of even index from K's start 4 (NVFP4: the second half's bytes) or 0, after an odd one
        // to the next chunk
        const int after_even = HALVES == 2 ? 16 * NB : ROW4 ? 4 : 0, after_odd = HALVES == 2 ? 16 * NB : 16 * NB - after_even;
        sc_step_even = odd0 ? after_odd : after_even;
        sc_step_odd = odd0 ? after_even : after_odd;
        // NVFP4 in stages of 64 k: opaque, so that the two steps are held in registers (ptxas otherwise
        // recomputes it0's parity and selects the step at each stage: 6 uniform instructions more)
        if constexpr (ROW4) asm volatile("" : "+r"(sc_step_even), "+r"(sc_step_odd));
    }
    asm volatile("" : "+r"(sz_dst));  // opaque, as a_dst
    // The activation and weight sources of a stage are their loop group's pointers plus the stage's
    // place jj in the group times a stage's bytes (an immediate offset: jj is a constant in each
    // unrolled copy of the loop), and the pointers move once a group (copy_advance): the weights of
    // HALVES = 1 without K_PERMUTED alternate 32 and 1024 - 32 bytes a stage, so they step at each load.
    const unsigned char* w_next2 = w_next + w_cstep;  // HALVES = 2: the second copy's source
    // into c at the end: the setup computed in c's fields directly compiles to different code
    c.a_next = a_next, c.a_dst = a_dst, c.a_qstep = a_qstep, c.a_nq = a_nq, c.a_full = a_full;
    c.w_next = w_next, c.w_next2 = w_next2, c.w_odd = w_odd;
    c.w_dst[0] = w_dst[0], c.w_ok[0] = w_ok[0];
    if constexpr (HALVES == 2) c.w_dst[1] = w_dst[1], c.w_ok[1] = w_ok[1];
    c.w_tstep = w_tstep, c.w_okm = w_okm;
    c.sz_dst = sz_dst, c.sc_next = sc_next, c.zc_next = zc_next, c.sc_ok = sc_ok, c.zc_ok = zc_ok, c.zc_bytes = zc_bytes;
    c.sc_step_even = sc_step_even, c.sc_step_odd = sc_step_odd, c.sz_k = sz_k;
}

// moves the activation and fixed weight sources on by `stages` stages
template <typename T, int S, int HALVES, bool K_PERMUTED>
__device__ __forceinline__ void copy_advance(WgCopies& c, int stages) {
    constexpr int BK = 64 * HALVES;
    constexpr bool W_FIXED = HALVES == 2 || K_PERMUTED || is_fp8_scheme(S);
    constexpr int W_STEP = is_fp8_scheme(S) ? 1024 * HALVES : HALVES == 2 ? 1024 : 512;
    c.a_next += stages * BK * (int)sizeof(T);
    asm volatile("" : "+l"(c.a_next));  // one register pair: an address operand as it is, not copied into one each stage
    if constexpr (W_FIXED) c.w_next += stages * W_STEP, c.w_next2 += stages * W_STEP;
}

// the activations of the stage at place jj of the loop group into slot `slot`
template <typename T, int BMA, int HALVES, int STAGE>
__device__ __forceinline__ void copy_a(const WgCopies& c, int slot, int jj) {
    constexpr int BK = 64 * HALVES, A_ATOM = BMA * 128, A_CH = BMA * 8 / WG_THREADS;
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
        const char* src = c.a_next + jj * BK * (int)sizeof(T) + h * 128;
        if (A_CH >= 8 && c.a_full) {
#pragma unroll
            for (int q = 0; q < A_CH; ++q) {
                cp_async16_if(c.a_dst + slot * STAGE + h * A_ATOM + q * 32 * 128, src, true);
                src += c.a_qstep;
            }
        } else {
#pragma unroll
            for (int q = 0; q < A_CH; ++q) {
                cp_async16_if(c.a_dst + slot * STAGE + h * A_ATOM + q * 32 * 128, src, q < c.a_nq);
                src += c.a_qstep;
            }
        }
    }
}

// 4 bytes to shared address s when pred, nothing otherwise (NVFP4 scales of the 256-row tile)
__device__ __forceinline__ void cp_async4_if(unsigned s, const void* gmem, bool pred) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %2, 0;\n@p cp.async.ca.shared.global [%0], [%1], 4;\n}" ::"r"(s), "l"(gmem),
                 "r"((int)pred)
                 : "memory");
}

// the weights, scales and zero codes of the stage at place jj of the loop group into slot `slot`.
// ODD_RING (an odd number of stages of 64 k, FP8 only): jj's parity is not the stage's from K's
// start, so the scale sources take sc_step_even and then swap the two steps, a stage at a time.
template <int S, int HALVES, bool K_PERMUTED, int STAGE, int SZ_STAGE, bool ODD_RING>
__device__ __forceinline__ void copy_w(WgCopies& c, int slot, int jj) {
    constexpr int W_STEP = is_fp8_scheme(S) ? 1024 * HALVES : HALVES == 2 ? 1024 : 512;
    if constexpr (is_fp8_scheme(S)) {
#pragma unroll
        for (int q = 0; q < 2 * HALVES; ++q)
            cp_async16_if(c.w_dst[0] + slot * STAGE + q * (WG_THREADS * 16), c.w_next + jj * W_STEP + q * c.w_tstep, (c.w_okm >> q) & 1u);
    } else if constexpr (HALVES == 1 && K_PERMUTED) {
        cp_async16_if(c.w_dst[0] + slot * STAGE, c.w_next + jj * W_STEP, c.w_ok[0]);
    } else if constexpr (HALVES == 1) {
        cp_async16_if(c.w_dst[0] + slot * STAGE, c.w_next, c.w_ok[0]);
        c.w_next += c.w_odd ? 1024 - 32 : 32;
        c.w_odd ^= 1;
    } else {
        cp_async16_if(c.w_dst[0] + slot * STAGE, c.w_next + jj * W_STEP, c.w_ok[0]);
        cp_async16_if(c.w_dst[1] + slot * STAGE, c.w_next2 + jj * W_STEP, c.w_ok[1]);
    }
    if constexpr (S == W_NVFP4 && HALVES == 1)  // a row's 4 scale bytes of the stage (copies_init)
        cp_async4_if(c.sz_dst + slot * SZ_STAGE, c.sc_next, c.sc_ok);
    else
        cp_async16_if(c.sz_dst + slot * SZ_STAGE, c.sc_next, c.sc_ok);
    if (c.zc_ok) {
        if (c.zc_bytes >= 16) cp_async16_if(c.sz_dst + slot * SZ_STAGE, c.zc_next, true);
        else cp_async8_if(c.sz_dst + slot * SZ_STAGE, c.zc_next, true);
    }
    const int sc_step = ODD_RING ? c.sc_step_even : (jj & 1) ? c.sc_step_odd : c.sc_step_even;
    if constexpr (ODD_RING) {
        const int next = c.sc_step_odd;
        c.sc_step_odd = c.sc_step_even, c.sc_step_even = next;
    }
    c.sc_next += sc_step, c.zc_next += sc_step >> 2;
}
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The 128-row tile's producer warpgroup (warps 8-11, after setmaxnreg): per stage, thread 256 the
// TMA boxes of activations, the 128 threads cp.async of the weights, scales and zero codes into the
// ring slot, which empty[slot] has released; full[slot] completes when they have arrived. Returns
// once its copies have completed. cs is the kernel's copy state, as copy_w's.
template <int S, int BMA, int STAGES, int HALVES, int STAGE, int SZ_STAGE>
__device__ __forceinline__ void produce_ws(const unsigned char* __restrict__ wq, const WgArgs& a, const TmaMap& tm, const TmaMap& tm_tail, int tid,
                                           i64 n0, i64 m0, i64 it0, int niter, i64 nchunks, i64 n16_total, unsigned sbase, unsigned full0,
                                           unsigned empty0, const WgCopies& cs) {
    constexpr int BK = 64 * HALVES, A_ATOM = BMA * 128, A_BYTES = A_ATOM * HALVES;
    const int p = tid - WG_THREADS;
    // weights: pieces L = p + 128 c of the block's 8 KB a stage (tile L / 64, piece L % 64),
    // to the same swizzled places as load_stage's (HALVES = 2)
    const unsigned char* pw[4];
    unsigned pw_dst[4];
    bool pw_ok[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const int L = p + 128 * c, pp = L & 31, pg = pp >> 2;
        pw_ok[c] = (n0 >> 4) + (L >> 6) < n16_total;
        pw[c] = wq + (((n0 >> 4) + (L >> 6)) * nchunks + it0) * 1024 + (L & 63) * 16;
        pw_dst[c] = sbase + A_BYTES + (L >> 6) * 1024 + ((L >> 5) & 1) * 512 + (4 * pg + ((pp & 3) ^ ((pg >> 1) & 3))) * 16;
    }
    // activations: a box of the tile's 128 rows (tm), or where the tile holds fewer rows of a
    // (the last M tile) a box of those rows rounded up to 8 (tm_tail): rows past M read as
    // zeros, and the slot rows past the box keep stale data, as the copies' rows past M
    const int tile_rows = (int)min((i64)BMA, a.M - m0);
    const void* map = tile_rows == BMA ? (const void*)&tm : (const void*)&tm_tail;
    const unsigned box_bytes = (unsigned)(tile_rows == BMA ? A_BYTES : ((tile_rows + 7) & ~7) * 128 * HALVES);
    // scales and zero codes: load_stage's copies (szt = p), stepping a stage's groups
    const int sc_step = cs.sc_step_even;  // 32 bytes of scales (8 of zero codes) a group, FP4 a chunk's: HALVES = 2 steps alike
    // FP8: piece p of each of the 8 tiles' 2 KB (copies_init's order and places)
    const int r8 = (p >> 2) & 15;
    const unsigned char* pw8 = wq + ((n0 >> 4) * 2 * nchunks + 2 * it0) * 1024 + p * 16;
    const unsigned pw8_dst = sbase + A_BYTES + ((p & ~3) | ((p & 3) ^ ((r8 >> 1) & 3))) * 16;
    auto wcopy = [&](int i, int slot) {
        if constexpr (is_fp8_scheme(S)) {
#pragma unroll
            for (int c = 0; c < 8; ++c)
                cp_async16_if(pw8_dst + slot * STAGE + c * 2048, pw8 + (c * 2 * nchunks + 2 * (i64)i) * 1024, (n0 >> 4) + c < n16_total);
        } else {
#pragma unroll
            for (int c = 0; c < 4; ++c) cp_async16_if(pw_dst[c] + slot * STAGE, pw[c] + (i64)i * 1024, pw_ok[c]);
        }
        cp_async16_if(cs.sz_dst + slot * SZ_STAGE, cs.sc_next + (i64)i * sc_step, cs.sc_ok);
        if (cs.zc_ok) {
            if (cs.zc_bytes >= 16) cp_async16_if(cs.sz_dst + slot * SZ_STAGE, cs.zc_next + (i64)i * (sc_step >> 2), true);
            else cp_async8_if(cs.sz_dst + slot * SZ_STAGE, cs.zc_next + (i64)i * (sc_step >> 2), true);
        }
    };
    const int nearly = a.early ? min(STAGES, niter) : 0;  // stages whose weights go before the wait
#pragma unroll
    for (int i = 0; i < STAGES; ++i)
        if (i < nearly) wcopy(i, i);
    pdl_wait_then_release();
    int slot = 0, use = 0;
#pragma unroll 1
    for (int i = 0; i < niter; ++i) {
        if (use > 0) mbar_wait(empty0 + 8 * slot, (use - 1) & 1);  // the stage STAGES back is retired
        if (p == 0) {
            mbar_expect_tx(full0 + 8 * slot, box_bytes);
#pragma unroll
            for (int h = 0; h < HALVES; ++h) tma_load_2d(sbase + slot * STAGE + h * A_ATOM, map, full0 + 8 * slot, cs.sz_k + i * BK + 64 * h, (int)m0);
        }
        if (i >= nearly) wcopy(i, slot);
        mbar_arrive_cp_async(full0 + 8 * slot);
        if (++slot == STAGES) slot = 0, ++use;
    }
    cp_async_wait_all();
}

#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The compute warps' main loop: the ring's first stages (tiles without a producer), then every
// stage of this split's K dequantized in registers and multiplied by wgmma into acc (stage() with a
// stage barrier, stage_ws() on the producer's mbarriers, or the half-ahead pipeline of AHEAD).
// load_a, load_w, load_stage and advance are the kernel's copies (copy_a, copy_w, copy_advance); returns with every wgmma and copy complete.
template <typename T, int S, int BMA, int STAGES, int HALVES, bool K_PERMUTED, int STAGE, int SZ_STAGE, typename LoadA, typename LoadW,
          typename LoadStage, typename Advance>
__device__ __forceinline__ void consume(float (&acc)[BMA / 2], const WgArgs& a, unsigned char* smem, unsigned sbase, int niter, int warp, int lane,
                                        int g, int t, int nrow, const unsigned (&zb8)[2], const unsigned* zb_table, unsigned full0, unsigned empty0,
                                        LoadA& load_a, LoadW& load_w, LoadStage& load_stage, Advance& advance) {
    constexpr bool WS = BMA == 128;
    constexpr int A_ATOM = BMA * 128, A_BYTES = A_ATOM * HALVES, SC_TILE = 64 * HALVES, ZC_TILE = 16 * HALVES;
    constexpr bool FP4 = S == W_NVFP4 || S == W_MXFP4;
    constexpr bool FP8 = is_fp8_scheme(S);
    constexpr bool F32S = S == W_FP8_BLOCK;  // float32 scales (128 x 128 block weights)
    static_assert(!FP4 || K_PERMUTED, "FP4 weights are in the k-permuted order");
    static_assert(!FP8 || !K_PERMUTED, "FP8 weights are in k order");
    constexpr int WV = FP8 ? 16 : 4;  // a lane's words of a half (FP8: 16-bit byte pairs)
    static_assert(HALVES == 2 || STAGES % 2 == 0 || FP8, "stages of 64 k: a slot's stage index from K's start is it0 + slot mod 2");
    using H = HalfOps<T>;
    if constexpr (!WS) {
#pragma unroll
        for (int s = 0; s < STAGES - 2; ++s) {
            if (s < niter) {
                load_a(s, s);
                if (!a.early) load_w(s, s);
            }
            cp_async_commit();
        }
    }
    // B descriptor: 128-byte swizzle (bits 62-63 = 1), 8-row groups 1024 bytes apart (SBO), LBO
    // unused by swizzled K-major layouts (1 by convention)
    const unsigned long long desc_hi = (1ull << 62) | ((unsigned long long)(1024 >> 4) << 32) | (1ull << 16);
    // A step's descriptor: the stage's low word plus the step's offset (a start address that stays
    // within 14 bits, so no carry), ORed into the constant high word: one uniform add a wgmma, where
    // a 64-bit add takes two and a re-load of the high word.
    auto bdesc = [&](unsigned lo) { return (desc_hi & 0xffffffff00000000ull) | lo; };
    // the low word of slot 0's descriptor: sbase is 1024-aligned and below 2^18, so a slot's is this
    // plus its byte offset / 16 (no carry past the 14-bit address field)
    const unsigned desc0 = (unsigned)desc_hi | (sbase >> 4);

    // One stage: wait for its data, then for each 64-k half dequantize its weights a k16 step ahead
    // of the wgmmas and issue its 4 wgmmas; then refill the slot of stage i - 2. A wgmma reads its A
    // registers after it is issued, until a wait retires it, so no register of af is written while a
    // wgmma that reads it may be in flight: af[s] is rewritten 4 steps after it was last read, each
    // step a commit group, and the wait before the write leaves at most 3 groups in flight. ptxas
    // checks this too, and serializes every wgmma where it cannot prove it.
    // The A fragment of step s (k 16 s .. 16 s + 15 of the half): registers a0, a1 (k 2t, 2t + 1)
    // from register jlo, jlo + 1 of word wlo, a2, a3 (k 2t + 8, 2t + 9) from jhi, jhi + 1 of whi.
    // FP4: register j of a word is fp4_frag<T>(word, j) times its row's scale (as fp4_scale2 gives it)
    // of the group of step s: a real step s of half hh is the chunk's natural k16 step 4 hh + s
    // (stages of 64 k: the stage's half hh), so NVFP4 group 4 hh + s and MXFP4 group 2 hh + s / 2,
    // one half of the row's scale pairs sc[r] of the half (read_words), taken by the FMA's operand
    // selector: NVFP4 half s % 2 of sc[r][s / 2], MXFP4 half s / 2 of sc[r][0].
    auto dq = [&](unsigned (&f)[4], unsigned wlo, unsigned whi, int jlo, int jhi, const unsigned (&sc)[2][2],
                  const unsigned (&zc)[2][2], int s) {
        if constexpr (FP4) {
            const int pr = S == W_NVFP4 ? s >> 1 : 0, hi = S == W_NVFP4 ? s & 1 : s >> 1;
#pragma unroll
            for (int r = 0; r < 4; ++r) {  // a0..a3: rows g, g + 8, g, g + 8, as INT4's below
                const unsigned x = r < 2 ? fp4_frag<T>(wlo, jlo + r) : fp4_frag<T>(whi, jhi + r - 2);
                const unsigned sp = sc[r & 1][pr];
                f[r] = hi ? H::fma2_hi(x, sp, 0x80008000u) : H::fma2_lo(x, sp, 0x80008000u);  // e2m1 * s * 2^-C (fp4_shift), exact
            }
        } else {
            const int h = s >> 1;  // the 32-k group of step s within the half
#pragma unroll
            for (int r = 0; r < 4; ++r) {  // a0..a3: rows g, g + 8, g, g + 8; k 2t, 2t, 2t + 8, 2t + 8 (+ 0, 1)
                const unsigned x = r < 2 ? frag_codes<T>(wlo, jlo + r) : frag_codes<T>(whi, jhi + r - 2);
                const unsigned qz = H::fma2(x, wg_mul[2 * (int)!same_type<T, __half>::value + (r & 1)], zc[r & 1][h]);  // q - z, exact
                f[r] = H::fma2_lo(qz, sc[r & 1][h], 0x80008000u);  // round(s (q - z))
            }
        }
    };
    // The A fragment of step s of half hh from the words wv read by read_words (FP8: its four byte
    // pairs, a0..a3, each times its row's scale of the step's 32-k group: fp8x2_scaled, the decode
    // kernel's dequantization; sc holds the scale's bits in both halves)
    auto dq_step = [&](unsigned (&f)[4], const unsigned (&w)[WV], const unsigned (&sc)[2][2], const unsigned (&zc)[2][2], int s) {
        if constexpr (FP8) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const unsigned s2 = sc[r & 1][s >> 1];
                f[r] = fp8x2_scaled<T, F32S>((unsigned short)w[4 * s + r], s2, F32S ? __uint_as_float(s2) : bits16_to_float<T>(s2));
            }
        } else if constexpr (K_PERMUTED) {  // step s: the layout's steps hh + 4 (s % 2) and + 2, their words' registers 2 (s / 2) ..
            dq(f, w[2 * (s & 1)], w[2 * (s & 1) + 1], 2 * (s >> 1), 2 * (s >> 1), sc, zc, s);
        } else {
            dq(f, w[s], w[s], 0, 2, sc, zc, s);
        }
    };
    const int gsh7 = min(a.gshift, 7);  // group of k (< 128) within a stage: k >> gsh7
    // The byte offsets of this lane's words in a slot, computed once (per stage they cost four
    // multiply-adds of the lane's index and the slot's base). This, the scales read once a stage
    // (K_PERMUTED), the descriptors' 32-bit adds (bdesc) and the scales' operand selector (fma2_lo) take a
    // 128-k stage of the 64-row tile from 253 to 228 instructions a warp (bf16), 3-6% faster at
    // M = 32 to 128 on an H100.
    int woff[HALVES][4];
#pragma unroll
    for (int hh = 0; hh < HALVES; ++hh)
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int off = K_PERMUTED ? (HALVES == 1 ? 0 : hh * 512) + (4 * g + (u ^ ((g >> 1) & 3))) * 16
                            : HALVES == 1 ? (u & 1) * 256 + (2 * g + ((u >> 1) ^ (g >> 2))) * 16
                                          : (u & 1) * 512 + (4 * g + ((2 * hh + (u >> 1)) ^ ((g >> 1) & 3))) * 16;
            woff[hh][u] = A_BYTES + warp * (512 * HALVES) + off + 4 * t;
            if constexpr (!FP8) asm volatile("" : "+r"(woff[hh][u]));  // opaque: kept in a register, not recomputed in each copy of the loop
        }
    // FP8: the byte offsets of this lane's pair of row g, step s of half 0: tile warp's bytes (1024 a
    // half), row g's 64 bytes, its 16 bytes of step s (copies_init's place), bytes 2 t, 2 t + 1 (a0;
    // a1 is row g + 8, 512 on; a2 and a3 8 bytes on)
    int f8off[4];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        f8off[s] = A_BYTES + warp * (1024 * HALVES) + g * 64 + 16 * (s ^ ((g >> 1) & 3)) + 2 * t;
        if constexpr (FP8) asm volatile("" : "+r"(f8off[s]));  // opaque, as woff
    }
    // the byte offsets of the scale and zero code of row nrow (+ 8 r: + 16 r and + 4 r) in a scale slot,
    // computed once like woff
    // (FP4: of row nrow's scale bytes, FRB a row: + 8 FRB r)
    constexpr int FRB = S == W_NVFP4 && HALVES == 2 ? 8 : 4;
    int sc_row = (nrow >> 4) * SC_TILE + (nrow & 15) * (FP4 ? FRB : F32S ? 4 : 2), zc_row = 8 * SC_TILE + (nrow >> 4) * ZC_TILE + ((nrow & 15) >> 1);
    asm volatile("" : "+r"(sc_row), "+r"(zc_row));
    // this lane's words of half hh of the stage at st (the layout's four k16 steps: K_PERMUTED steps hh + 2 u,
    // else 4 hh + u; HALVES = 1: hh = i % 2), and its rows' scales and zero biases from the scale slot szs.
    // FP4: sc[hh][r] are row nrow + 8 r's scale pairs of the half (fp4_scale_pairs), from the row's
    // scale word: NVFP4 the row's bytes 4 hh .. 4 hh + 3 of the chunk (stages of 64 k hold just
    // those), pairs (4 hh, 4 hh + 1) and (4 hh + 2, 4 hh + 3); MXFP4 the row's chunk word, read with
    // half 0 (pair (0, 1) to sc[0][r][0], (2, 3) to sc[1][r][0]), or with stages of 64 k shifted right
    // by fsh (16 for the second half of a chunk, which the caller knows), pair (0, 1) of that
    auto read_words = [&](const unsigned char* st, const unsigned char* szs, int hh, unsigned (&wv)[HALVES][WV],
                          unsigned (&sc)[HALVES][2][2], unsigned (&zc)[HALVES][2][2], int fsh = 0) {
        if constexpr (FP8) {
#pragma unroll
            for (int s = 0; s < 4; ++s)
#pragma unroll
                for (int r = 0; r < 4; ++r)
                    wv[hh][4 * s + r] = *reinterpret_cast<const unsigned short*>(st + f8off[s] + hh * 1024 + (r & 1) * 512 + (r >> 1) * 8);
        } else {
#pragma unroll
            for (int u = 0; u < 4; ++u) wv[hh][u] = *reinterpret_cast<const unsigned*>(st + woff[hh][u]);
        }
        // A scale is read as its 16 bits in the low half: dq's FMA takes them into both halves through
        // an operand selector (fma2_lo), where a multiply by 0x10001 here cost an IMAD a scale.
        auto read_sz = [&](int r, int gl, unsigned& sv, unsigned& zv) {  // row nrow + 8 r
            if constexpr (F32S) {  // the float32 scale's bits (16 rows of 4 bytes a group)
                sv = *reinterpret_cast<const unsigned*>(szs + sc_row + 32 * r + gl * 64);
            } else {
                sv = (unsigned)*reinterpret_cast<const unsigned short*>(szs + sc_row + 16 * r + gl * 32);
                if constexpr (FP8) sv *= 0x10001u;  // fp8x2_scaled takes the pair
            }
            if constexpr (S == W_UINT4) {
                const unsigned zbyte = szs[zc_row + 4 * r + gl * 8];
                zv = zb_table[16 * r + ((zbyte >> (4 * (g & 1))) & 15u)];
            } else {
                zv = zb8[r];
            }
        };
        if constexpr (FP4) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const unsigned* row = reinterpret_cast<const unsigned*>(szs + sc_row + 8 * FRB * r);
                if constexpr (S == W_NVFP4) {
                    fp4_scale_pairs<T, S>(row[FRB == 8 ? hh : 0], sc[hh][r]);
                } else if constexpr (HALVES == 1) {
                    fp4_scale_pairs<T, S>(row[0] >> fsh, sc[0][r]);
                } else if (hh == 0) {
                    unsigned p[2];
                    fp4_scale_pairs<T, S>(row[0], p);
                    sc[0][r][0] = p[0], sc[HALVES - 1][r][0] = p[1];
                }
            }
        } else if constexpr (K_PERMUTED) {
            // groups of whole chunks: a stage (a chunk, or half of one) is one group, whose scale and
            // zero code serve all its k16 steps: read once a stage (the second half's are the first's)
            bool again = false;
            if constexpr (HALVES == 2) again = hh == 1;
            if (again) {
#pragma unroll
                for (int r = 0; r < 2; ++r) sc[HALVES - 1][r][0] = sc[HALVES - 1][r][1] = sc[0][r][0], zc[HALVES - 1][r][0] = zc[HALVES - 1][r][1] = zc[0][r][0];
            } else {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    read_sz(r, 0, sc[hh][r][0], zc[hh][r][0]);
                    sc[hh][r][1] = sc[hh][r][0], zc[hh][r][1] = zc[hh][r][0];
                }
            }
        } else {
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int r = 0; r < 2; ++r) read_sz(r, (64 * hh + 32 * h) >> gsh7, sc[hh][r][h], zc[hh][r][h]);
        }
    };
    unsigned af[4][4];  // the A fragments of the last four k16 steps
    const int fodd0 = S == W_MXFP4 && HALVES == 1 ? (int)(((i64)blockIdx.z * a.iters) & 1) : 0;  // it0's parity
    // the slot that stage i + STAGES - 2 loads into, from stage i's
    auto ahead_slot = [](int sl) { return sl >= 2 ? sl - 2 : sl + STAGES - 2; };
    auto stage = [&](int i, int slot) {
        cp_async_wait<STAGES - 3>();
        fence_proxy_async();
        __syncthreads();  // stage i has arrived for every thread; every wgmma of stage i - 2 is done
        const unsigned char* st = smem + slot * STAGE;
        const unsigned char* szs = smem + STAGES * STAGE + slot * SZ_STAGE;
        const unsigned desc = desc0 + (unsigned)(slot * (STAGE >> 4));
        // The 128-row tile reads every half's words, scales and zero codes from shared memory before
        // the stage's first wgmma: the wgmma statements are barriers to the compiler (memory
        // clobbers), so reads of the second half written after them wait out their latency behind the
        // first half's work (Nsight Compute, 14336 x 4096 M = 64: 10% of the stall samples at these
        // reads' first use, short scoreboard). Reading them ahead makes the 128-row tiles 2-6% faster
        // on an H200 but the 64-row tile (two blocks a SM) slower, so that one reads each half where
        // it starts. (The 256-row tile's stages are one half.)
        constexpr bool HOIST = BMA >= 128;
        unsigned wv[HALVES][WV];  // this lane's words of the half's four k16 steps of the layout (K_PERMUTED: steps hh + 2 u; else 4 hh + u; HALVES = 1: hh = i % 2)
        unsigned sc[HALVES][2][2], zc[HALVES][2][2];
        // (MXFP4, stages of 64 k: the slot's stage is the second half of its chunk where it0 + slot is odd)
        auto read_half = [&](int hh) { read_words(st, szs, hh, wv, sc, zc, ((slot & 1) ^ fodd0) * 16); };
        if constexpr (HOIST) {
#pragma unroll
            for (int hh = 0; hh < HALVES; ++hh) read_half(hh);
        }
#pragma unroll
        for (int hh = 0; hh < HALVES; ++hh) {
            if constexpr (!HOIST) read_half(hh);
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                wg_wait<3>();  // four groups back, the last reader of af[s], is done
                dq_step(af[s], wv[hh], sc[hh], zc[hh], s);
                wg_fence();
                Wgmma<T, BMA>::mma(acc, af[s], bdesc(desc + hh * (A_ATOM >> 4) + 2 * s));  // + 32 bytes of K per k16 step
                wg_commit();
            }
        }
        if (i + STAGES - 2 < niter) load_stage(ahead_slot(slot), slot);  // slot: the stage's place in its group
        cp_async_commit();
    };
    // AHEAD (64- and 32-row tiles): the next half is dequantized while the current half's 4 wgmmas run,
    // issued back to back, one commit group a half: 1-5% faster than stage() with 64-row tiles on an
    // H100, and slower with 128- and 256-row tiles, where it keeps one half of wgmmas in flight
    // across the stage barrier against stage()'s three k16 steps.
    constexpr bool AHEAD = BMA <= 64;
    static_assert(!AHEAD || HALVES == 2, "AHEAD pairs a stage's two halves with the two fragment buffers");
    // The main loop is unrolled by the ring's depth, so that every slot index is a constant: the
    // slots' shared addresses become immediate offsets and the slot bookkeeping leaves the loop.
    // With it, the lane's offsets and the copies' destinations held in registers (opaque: ptxas
    // otherwise recomputes them in each copy of the loop, 11 instructions more a 64-row stage), the
    // sources moved once a group (advance) and the scale sources stepped, a stage a warp (bf16,
    // K_PERMUTED) takes about 206 instructions on the 64-row tile (228 without): 5-11% faster on an H100.
    if constexpr (WS) {
        // stage() of the 128-row tile with the producer: wait for the slot's barrier instead of copies
        // and a stage barrier (the activations came by TMA: no proxy fence), and release the slot
        // of stage i - 1 once the fourth k16 step's wait has retired its last wgmma
        auto stage_ws = [&](int i, int slot, unsigned parity) {
            mbar_wait(full0 + 8 * slot, parity);
            const unsigned char* st = smem + slot * STAGE;
            const unsigned char* szs = smem + STAGES * STAGE + slot * SZ_STAGE;
            const unsigned desc = desc0 + (unsigned)(slot * (STAGE >> 4));
            unsigned wv[HALVES][WV];
            unsigned sc[HALVES][2][2], zc[HALVES][2][2];
#pragma unroll
            for (int hh = 0; hh < HALVES; ++hh) read_words(st, szs, hh, wv, sc, zc);
#pragma unroll
            for (int hh = 0; hh < HALVES; ++hh) {
#pragma unroll
                for (int s = 0; s < 4; ++s) {
                    wg_wait<3>();
                    if (hh == 0 && s == 3 && i > 0) {
                        __syncwarp();  // every lane's reads of that slot are done
                        if (lane == 0) mbar_arrive(empty0 + 8 * (slot == 0 ? STAGES - 1 : slot - 1));
                    }
                    dq_step(af[s], wv[hh], sc[hh], zc[hh], s);
                    wg_fence();
                    Wgmma<T, BMA>::mma(acc, af[s], bdesc(desc + hh * (A_ATOM >> 4) + 2 * s));
                    wg_commit();
                }
            }
        };
        unsigned parity = 0;  // of the ring's pass
#pragma unroll 1
        for (int i = 0; i < niter; i += STAGES) {
#pragma unroll
            for (int j = 0; j < STAGES; ++j)
                if (i + j < niter) stage_ws(i + j, j, parity);
            parity ^= 1;
        }
    } else if constexpr (!AHEAD) {
        advance(STAGES - 2);  // the group of stage 0 loads stages STAGES - 2 ..
#pragma unroll 1
        for (int i = 0; i < niter; i += STAGES) {
#pragma unroll
            for (int j = 0; j < STAGES; ++j)
                if (i + j < niter) stage(i + j, j);
            advance(STAGES);
        }
    } else {
        // A half ahead: the 4 wgmmas of a 64-k half are issued back to back from fragments
        // dequantized while the half before it ran (two buffers of a half's 4 fragments), so the
        // dequantization of half j + 1 overlaps the tensor-core work of half j.
        unsigned ah[2][4][4];
        unsigned wv[HALVES][WV], sc[HALVES][2][2], zc[HALVES][2][2];
        const unsigned char* st = smem;
        const unsigned char* szs = smem + STAGES * STAGE;
        auto read_half = [&](int hh) { read_words(st, szs, hh, wv, sc, zc); };
        // stage i has arrived for every thread and every wgmma of stage i - 2 (and of every half
        // but the last issued) is done: read its words, refill the slot of stage i - 2 with stage
        // i + STAGES - 2
        auto begin_stage = [&](int i, int slot, int jj) {
            cp_async_wait<STAGES - 3>();
            fence_proxy_async();
            __syncthreads();
            st = smem + slot * STAGE;
            szs = smem + STAGES * STAGE + slot * SZ_STAGE;
            if (i + STAGES - 2 < niter) load_stage(ahead_slot(slot), jj);
            cp_async_commit();
        };
        auto dq_half = [&](unsigned (&f)[4][4], int hh) {
            read_half(hh);
#pragma unroll
            for (int s = 0; s < 4; ++s) dq_step(f[s], wv[hh], sc[hh], zc[hh], s);
        };
        // stage i, whose first half is dequantized into ah[0]; half hh's wgmmas read ah[hh]. Ends with
        // the next stage's first half dequantized
        auto run_stage = [&](int i, int slot) {
            const unsigned desc = desc0 + (unsigned)(slot * (STAGE >> 4));
#pragma unroll
            for (int hh = 0; hh < HALVES; ++hh) {
                wg_fence();
#pragma unroll
                for (int s = 0; s < 4; ++s) Wgmma<T, BMA>::mma(acc, ah[hh][s], bdesc(desc + hh * (A_ATOM >> 4) + 2 * s));
                wg_commit();
                if (hh + 1 < HALVES) {
                    wg_wait<1>();  // the half before this one is done: ah[hh ^ 1] is free
                    dq_half(ah[hh ^ 1], hh + 1);
                } else if (i + 1 < niter) {
                    wg_wait<1>();
                    begin_stage(i + 1, slot == STAGES - 1 ? 0 : slot + 1, slot);
                    dq_half(ah[hh ^ 1], 0);
                }
            }
        };
        begin_stage(0, 0, STAGES - 2);
        advance(STAGES - 1);  // the group of stage 0 loads stages STAGES - 1 ..
        dq_half(ah[0], 0);
#pragma unroll 1
        for (int i = 0; i < niter; i += STAGES) {
#pragma unroll
            for (int j = 0; j < STAGES; ++j)
                if (i + j < niter) run_stage(i + j, j);
            advance(STAGES);
        }
    }
    wg_wait<0>();
    cp_async_wait<0>();
}

#endif

template <typename T, int S, int BMA, int STAGES, int HALVES, bool K_PERMUTED>
__global__ void __launch_bounds__(BMA == 128 ? WG_THREADS + 128 : WG_THREADS, BMA <= 64 ? 2 : 1)
    sm90_w16_gemm(const T* __restrict__ act, const unsigned char* __restrict__ wq, const T* __restrict__ scales,
                const unsigned char* __restrict__ zeros, const float* __restrict__ scale_2, T* __restrict__ y, float* __restrict__ ws, int* __restrict__ counters,
                WgArgs a, const __grid_constant__ TmaMap tm, const __grid_constant__ TmaMap tm_tail) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(HALVES == 1 || HALVES == 2, "a stage is 64 or 128 k");
    constexpr int BK = 64 * HALVES;              // k per stage
    constexpr int A_ATOM = BMA * 128;            // one 64-k half of the activations: a 128-byte swizzle atom per row
    constexpr int A_BYTES = A_ATOM * HALVES;
    constexpr int W_ROW = (is_fp8_scheme(S) ? 64 : 32) * HALVES;  // weight bytes per row and stage
    constexpr int STAGE = A_BYTES + WG_BN * W_ROW;  // a multiple of 1024: every slot's activations stay 1024-aligned
    constexpr int ND = BMA / 2;                  // accumulators per thread
    constexpr int SC_TILE = 64 * HALVES;         // scale bytes a tile in a ring slot: up to BK / 32 groups of 32 bytes
    constexpr int ZC_TILE = 16 * HALVES;         // zero-code bytes a tile: up to BK / 32 groups of 8 bytes
    constexpr int SZ_STAGE = 8 * (SC_TILE + ZC_TILE);
    using H = HalfOps<T>;
    extern __shared__ uint4 wg_smem[];
    __shared__ int s_last;
    // the 128-byte swizzle is a function of address bits 4..9: the tiles start at a multiple of 1024
    const unsigned raw = (unsigned)__cvta_generic_to_shared(wg_smem);
    const unsigned sbase = (raw + 1023u) & ~1023u;
    unsigned char* smem = reinterpret_cast<unsigned char*>(wg_smem) + (sbase - raw);

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const i64 n0 = (i64)blockIdx.x * WG_BN, m0 = (i64)blockIdx.y * BMA;
    const i64 it0 = (i64)blockIdx.z * a.iters;
    const int niter = (int)min((i64)a.iters, a.K / BK - it0);
    const i64 nchunks = a.K / 128;  // 128-k chunks of the prepared layout (K is a multiple of 128)
    const i64 n16_total = (a.N + 15) / 16;

    constexpr bool WS = BMA == 128;  // the 128-row tile: a producer warpgroup
    WgCopies copies;
    copies_init<T, S, BMA, STAGES, HALVES, K_PERMUTED, STAGE, SZ_STAGE>(copies, act, wq, scales, zeros, a, tid, n0, m0, it0, nchunks, n16_total,
                                                                        sbase);
    auto advance = [&](int stages) { copy_advance<T, S, HALVES, K_PERMUTED>(copies, stages); };
    auto load_a = [&](int slot, int jj) { copy_a<T, BMA, HALVES, STAGE>(copies, slot, jj); };
    constexpr bool ODD_RING = STAGES % 2 == 1 && HALVES == 1;
    static_assert(!ODD_RING || is_fp8_scheme(S), "an odd ring of 64-k stages: FP8 only (no state of a chunk's halves)");
    auto load_w = [&](int slot, int jj) { copy_w<S, HALVES, K_PERMUTED, STAGE, SZ_STAGE, ODD_RING>(copies, slot, jj); };
    auto load_stage = [&](int slot, int jj) { load_a(slot, jj); load_w(slot, jj); };

    // this thread's weight rows within the block (accumulator rows g and g + 8 of its warp)
    const int nrow = (warp >> 2) * 64 + (warp & 3) * 16 + g;
    const unsigned zb8[2] = {frag_zero_bias<T>(8u, 0), frag_zero_bias<T>(8u, 1)};  // INT4: z = 8
    __shared__ unsigned zb_table[32];  // zero_bias of each zero code (uint4), rows g then g + 8
    if (S == W_UINT4 && tid < 32) zb_table[tid] = frag_zero_bias<T>((unsigned)tid & 15u, tid >> 4);  // read after the first stage's barrier
    // a.early: the weights and scales of the ring's first stages (STAGES - 2 here, STAGES in the
    // 128-row tile's producer) are copied before the PDL wait, the activations after it, so that
    // the weights' first DRAM round trip overlaps the end of the kernel before (the activations may
    // be its output; the weights are not: weight/dispatch.py early_ok): 5% faster at 4096^2 M = 64 on
    // an H100 (9.67 against 10.20 us), no change where the tiles fill every SM in several waves.
    if constexpr (!WS) {
        if (a.early) {
#pragma unroll
            for (int s = 0; s < STAGES - 2; ++s)
                if (s < niter) load_w(s, s);
        }
        pdl_wait_then_release();  // no global access above this line but the early weights
    }
    // The 128-row tile: a producer warpgroup and the mbarrier ring (the header)
    static_assert(!WS || HALVES == 2, "the 128-row tile's producer copies stages of 128 k");
    __shared__ __align__(8) unsigned long long mb_full[WS ? STAGES : 1], mb_empty[WS ? STAGES : 1];
    const unsigned full0 = (unsigned)__cvta_generic_to_shared(mb_full), empty0 = (unsigned)__cvta_generic_to_shared(mb_empty);
    if constexpr (WS) {
        if (tid == 0) {
#pragma unroll
            for (int s = 0; s < STAGES; ++s) mbar_init(full0 + 8 * s, 129), mbar_init(empty0 + 8 * s, 8);
        }
        __syncthreads();  // the barriers are initialized (and zb_table written)
        if (warp >= 8) {
            setmaxnreg_dec<56>();
            produce_ws<S, BMA, STAGES, HALVES, STAGE, SZ_STAGE>(wq, a, tm, tm_tail, tid, n0, m0, it0, niter, nchunks, n16_total, sbase, full0, empty0,
                                                            copies);
            return;  // the epilogue's barriers wait only for the threads that have not exited
        }
        setmaxnreg_inc<224>();
        pdl_wait_then_release();  // the compute warps read no global memory but store y
    }
    float acc[ND];
#pragma unroll
    for (int i = 0; i < ND; ++i) acc[i] = 0.0f;
    // FP4: what the sums are multiplied by before rounding (NVFP4 reads scale_2, after the PDL wait)
    const float osc = S == W_NVFP4 || S == W_MXFP4 ? fp4_out_scale<T, S>(scale_2) : 1.0f;

    consume<T, S, BMA, STAGES, HALVES, K_PERMUTED, STAGE, SZ_STAGE>(acc, a, smem, sbase, niter, warp, lane, g, t, nrow, zb8, zb_table, full0, empty0,
                                                                   load_a, load_w, load_stage, advance);

    finish_tile<T, S, BMA>(acc, smem, sbase, y, ws, counters, a, m0, n0, tid, warp, lane, t, nrow, s_last, osc);
#else
    __trap();  // built only for sm_90a; the host never launches this stub
#endif
}
