// weight_sm80_gemm.cu: the pipelined tensor-core matmul y = a @ dequant(w).T for INT4, FP8 and FP4
// weights (prefill sizes of M), reading the prepared layout of weight_decode.cu's matmul (tiles of 16
// weight rows by 128 k stored as 1 KB each, FP8 by 64 k; scales and zero codes per tile and group: see
// weight/quantize.py prepare_weight; FP4 scale bytes per tile and chunk: weight/layout.py). Numerics as
// weight_decode.cu's decode matmul: each product exact, float32 sums (see sm80_w16_gemm).

#include "common.cuh"
#include "weight_mma.cuh"

using namespace cq;

// ---------------------------------------------------------------- pipelined tensor-core matmul
// The same y = a @ dequant(w).T for INT4 and FP4 weights at any M, built for prefill: a block computes a
// BM x 128 tile of y (BM = 16 * MT * WM rows, 4 x WM warps, each warp MT m16 tiles by 4 n8 tiles),
// streaming K in stages of 128 through shared memory with cp.async, STAGES deep, so the loads of
// stage i + STAGES - 1 are in flight while stage i is multiplied. Each weight byte is read once per
// BM rows of a. When the tiles alone cannot fill the GPU, K is split across blocks (gridDim.z):
// each split writes its float32 partial tile to a workspace, and the last split of a tile to arrive
// (a per-tile counter) adds the partials in split order 0, 1, ... and writes y, so the result does
// not depend on which block finishes first.
//
// K order. Within a stage, lane (g, t) of a warp owns k = 32t .. 32t + 31 of the prepared layout:
// 64 bytes of each of its activation rows (the A operand) and the codes of its weight rows (the B
// operand) at those k. (Where the layout's chunks have their 4 x 4 blocks of 8 k transposed,
// GemmArgs.kperm, the lane's sub-block i below is the stage's k 32 i + 8 t .. + 7: only which
// 16 bytes of the activation row it reads changes. FP4 weights are always in that order, and all k
// of sub-block i, the chunk's natural k 32 i + 8 t .. + 7, lie in one scale group: NVFP4 group
// 2 i + t / 2, MXFP4 group i of the chunk.)
// Sub-block i (k = 32t + 8i .. + 7) gives two k16 mma steps h = 0, 1, whose slots (2t, 2t + 1) and
// (2t + 8, 2t + 9) take k pairs 4h, 4h + 1 and 4h + 2, 4h + 3 of the sub-block, so the activation
// registers go to the mma as loaded. The weights are in fragment order (weight/layout.py prepared_of),
// built for a lane that takes k 2t, 2t + 1, 2t + 8, 2t + 9 of every k16 step: lane (g, t) here reads
// the words of steps 2t and 2t + 1 of the four lanes (g, t'), which hold exactly its 32 k, and takes
// each B register from the word and register that hold its k pair (weight_mma.cuh frag_codes: one
// lop3 a register, plus a shift a word for fp16 and three for bf16). Those words are the lane's
// own pieces 4 g + t of the two halves of each tile chunk: 16-byte reads, as the decode kernel's.
//
// FP8 (S = W_FP8; never kperm, never SCALE_AFTER_SUM): the prepared tile holds 16 rows by 64 bytes a
// 64-k chunk, so a stage is two chunks, 2 KB a tile. The lane's k 32 t .. 32 t + 31 of row r are
// bytes 32 (t % 2) .. + 31 of row r in chunk t / 2 of the stage: sub-block i is the 8 bytes at
// 8 i of those, and k16 step h of it takes the 32-bit word (i % 2) 2 + h of the 16-byte piece i / 2,
// its bytes (0, 1) as slots (2t, 2t + 1) and (2, 3) as (2t + 8, 2t + 9), the k of the activation
// registers as loaded; each pair becomes T by weight_mma.cuh fp8x2_scaled (times the row's group
// scale, one rounding: the decode kernel's dequantization). W_FP8_BLOCK: the same with float32
// scales (128 x 128 block weights, repeated per row in the prepared layout), multiplied in float32
// and rounded once to T (weight_decode.cu).
//
// Shared memory per stage: a (BM rows of 256 bytes, its 16-byte chunks XOR-swizzled so that the
// 8 lanes of a quarter warp, reading chunk 4t + i of rows g, hit 8 distinct bank groups), then w
// (the block's 8 weight tiles' KB of the chunk as in memory: a warp reads 512 contiguous bytes;
// FP8: each tile's 2 KB as in memory but for the second chunk's 16-byte pieces, whose index has
// its lowest bit flipped, so that the 8 lanes of a quarter warp, pieces 4 r + 2 (t % 2) + x of
// chunk t / 2 of rows r = g, g + 1, hit 8 distinct bank groups).
static constexpr int GM_BK = 128;  // K per stage
static constexpr int GM_WN = 4;    // warps along N
static constexpr int GM_NT = 4;    // n8 tiles per warp
static constexpr int GM_BN = 8 * GM_NT * GM_WN;

struct GemmArgs {
    i64 M, N, K;
    i64 lda;
    i64 ng;
    int gshift;  // group of k: k >> gshift (log2 G; 62 for one group per row)
    int splits;  // gridDim.z
    int iters;   // stages of K per split (the last split may have fewer)
    int kperm;   // 1: the chunks' 4 x 4 blocks of 8 k are transposed (weight/layout.py k_permuted; whole-chunk groups, FP4)
};

// Position of 16-byte chunk c of activation row r within the row. Lanes (g, t), g = 0, 1, of a
// quarter warp read chunk 4 t + i (or 4 i + t with kperm) of rows g: the XOR puts bit 3 of c into
// bit 1 and the row's parity into bits 0 and 2, so that both sets of 8 land in distinct 16-byte
// bank groups, as do the copies' 8 consecutive chunks of one row.
__device__ __forceinline__ int gm_swz(int r, int c) { return c ^ ((c >> 2) & 2) ^ ((r & 1) * 5); }

// SCALE_AFTER_SUM: false = the weights are dequantized exactly to T (the decode kernel's rule without SCALE_AFTER_SUM);
// true = (groups of 128, or per-channel) the mma takes the exact q - z and each stage's float32
// partial sums are multiplied by the stage's scale (one FMA per output per stage). MT = 4 is built
// without SCALE_AFTER_SUM: the second set of accumulators would not fit in the registers.
// FP4 (S = W_NVFP4, W_MXFP4; never SCALE_AFTER_SUM): the mma takes w' = e2m1 * s * 2^-C (fp4_shift), exact
// in T (weight_mma.cuh fp4_frag, fp4_scale2), and the float32 sums are multiplied by fp4_out_scale
// before they are rounded to T.
template <typename T, int S, int MT, int WM, int STAGES, bool SCALE_AFTER_SUM>
__global__ void __launch_bounds__(32 * GM_WN * WM) sm80_w16_gemm(const T* __restrict__ act, const unsigned char* __restrict__ wq,
                                                              const T* __restrict__ scales, const unsigned char* __restrict__ zeros,
                                                              const float* __restrict__ scale_2, T* __restrict__ y, float* __restrict__ ws, int* __restrict__ counters,
                                                              GemmArgs a) {
    constexpr int THREADS = 32 * GM_WN * WM;
    constexpr int BM = 16 * MT * WM;
    constexpr bool FP8 = is_fp8_scheme(S);
    constexpr bool F32S = S == W_FP8_BLOCK;  // float32 scales (128 x 128 block weights)
    using SW = typename cond_type<F32S, unsigned, unsigned short>::type;  // a scale's bits
    constexpr int W_TILE = FP8 ? 2048 : 1024;  // bytes of a 16-row weight tile a stage
    constexpr int A_BYTES = BM * GM_BK * 2;
    constexpr int STAGE_BYTES = A_BYTES + (GM_BN / 16) * W_TILE;
    using H = HalfOps<T>;
    constexpr bool FP4 = S == W_NVFP4 || S == W_MXFP4;
    static_assert(!((FP4 || FP8) && SCALE_AFTER_SUM), "FP4 and FP8 weights are dequantized before the mma");
    constexpr int NB = S == W_NVFP4 ? 8 : 4;  // FP4: scale bytes of a weight row per chunk
    extern __shared__ uint4 gm_smem[];
    unsigned char* smem = reinterpret_cast<unsigned char*>(gm_smem);
    __shared__ int s_last;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int wm = warp / GM_WN, wn = warp % GM_WN;
    const i64 n0 = (i64)blockIdx.x * GM_BN, m0 = (i64)blockIdx.y * BM;
    const i64 it0 = (i64)blockIdx.z * a.iters;
    const int niter = (int)min((i64)a.iters, a.K / GM_BK - it0);
    const i64 nchunks = a.K / GM_BK;  // the prepared layout's 128-k chunks: one per stage

    // The 16-byte chunks this thread copies each stage: a fixed chunk column and rows a fixed step
    // apart, so the addresses are set up once and each stage adds its K offset.
    constexpr int A_CH = BM * 16 / THREADS, A_RSTEP = THREADS / 16;  // activation rows: 16 chunks each
    constexpr int W_PIECES = W_TILE / 16;      // 16-byte weight pieces of a tile a stage: 64, FP8 128
    constexpr int W_CH = GM_BN / 16 * W_PIECES / THREADS;
    const int ar0 = tid >> 4, ach = tid & 15;
    const T* a_src = act + (m0 + ar0) * a.lda + ach * 8;
    const int a_dst = ar0 * 256 + (gm_swz(ar0, ach) << 4);  // row parity is the same for every chunk
    // prepared layout: tile n16's chunk (stage) c at (n16 nchunks + c) KB, in fragment order (FP8: its
    // 64-k chunks 2 c and 2 c + 1 at (n16 nchunks + c) 2 KB). The stage's 8 tiles are copied as they
    // are: piece P = tid + q THREADS of the 8 KB (FP8: 16 KB, the second chunk's pieces swizzled).
    static_assert(THREADS % W_PIECES == 0, "a thread's pieces are whole tiles apart");
    constexpr int W_SHIFT = FP8 ? 7 : 6, W_TSTEP = THREADS / W_PIECES;  // log2 W_PIECES; tiles between a thread's pieces
    const i64 n16_total = (a.N + 15) / 16;
    const int wp = tid & (W_PIECES - 1);
    const unsigned char* w_src = wq + ((n0 >> 4) + (tid >> W_SHIFT)) * nchunks * W_TILE + wp * 16;
    const int w_dst = A_BYTES + (FP8 ? (tid >> W_SHIFT) * W_TILE + (wp ^ (wp >> 6)) * 16 : tid * 16);

    auto load_stage = [&](int slot, i64 it) {
        unsigned char* st = smem + slot * STAGE_BYTES;
        const i64 k0 = it * GM_BK;
#pragma unroll
        for (int q = 0; q < A_CH; ++q) {
            const bool ok = m0 + ar0 + q * A_RSTEP < a.M;
            cp_async16(st + a_dst + q * A_RSTEP * 256, ok ? a_src + q * A_RSTEP * a.lda + k0 : act, ok);
        }
#pragma unroll
        for (int q = 0; q < W_CH; ++q) {
            const bool ok = (n0 >> 4) + (tid >> W_SHIFT) + q * W_TSTEP < n16_total;
            cp_async16(st + w_dst + q * W_TSTEP * W_TILE, ok ? w_src + (q * W_TSTEP * nchunks + it) * W_TILE : wq, ok);
        }
    };

    // scales (as T pairs, without SCALE_AFTER_SUM), zero biases, and the accumulator columns' scales
    // (SCALE_AFTER_SUM). FP4: s2[j] holds the four scale bytes of B column nb + 8 j for this lane's
    // sub-blocks, byte i that of sub-block i (fp4_scale2 turns each into a T pair when it is used)
    struct SZ {
        unsigned s2[GM_NT], zb[GM_NT];
        float cs[GM_NT][2];
    };
    const i64 nb = n0 + wn * 32 + g;           // this lane's B column in tile j: nb + 8 j
    const i64 nc = n0 + wn * 32 + 2 * t;       // its accumulator columns in tile j: nc + 8 j + {0, 1}
    // prepared layout: scales [N / 16][group][16], zero codes [N / 16][group][8 bytes] (row i of a
    // tile in nibble i % 2 of byte i / 2). Rows nb + 8 j and nc + 8 j + h lie in tile (nb >> 4) +
    // j / 2 at row (nb & 15) + 8 (j % 2) (nb & 15 = g, nc & 15 = 2 t: n0 and 32 wn are whole tiles).
    const i64 tstep = a.ng * 16;  // scales per tile
    const SW* s_b = reinterpret_cast<const SW*>(scales) + (nb >> 4) * tstep + g;
    const T* s_c = scales + (nc >> 4) * tstep + 2 * t;
    const unsigned char* z_b = zeros + (nb >> 4) * a.ng * 8 + g / 2;
    // FP4 scale bytes [N / 16][chunk][16][NB]: row g of tile nb >> 4 at chunk 0
    const unsigned char* s8_b = reinterpret_cast<const unsigned char*>(scales) + ((nb >> 4) * nchunks * 16 + g) * NB;
    auto load_sz = [&](i64 it) {
        SZ r;
        if constexpr (FP4) {
            // NVFP4: bytes 2 i + t / 2 of the row's 8; MXFP4: its 4 bytes as they are
#pragma unroll
            for (int j = 0; j < GM_NT; ++j) {
                const unsigned char* p = s8_b + (((j >> 1) * nchunks + it) * 16 + 8 * (j & 1)) * NB;
                unsigned v = 0;
                if (nb + 8 * j < a.N) {
                    if constexpr (S == W_NVFP4) {
                        const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
                        v = __byte_perm(u.x, u.y, t >= 2 ? 0x7531 : 0x6420);
                    } else {
                        v = __ldg(reinterpret_cast<const unsigned*>(p));
                    }
                }
                r.s2[j] = v;
                r.zb[j] = 0u;
                r.cs[j][0] = r.cs[j][1] = 0.0f;
            }
            return r;
        }
        const i64 grp = (it * GM_BK + (SCALE_AFTER_SUM ? 0 : 32 * t)) >> a.gshift;
#pragma unroll
        for (int j = 0; j < GM_NT; ++j) {
            const bool ok = nb + 8 * j < a.N;
            SW sb = 0;
            const i64 tj = (j >> 1) * tstep + grp * 16 + 8 * (j & 1);
            if (!SCALE_AFTER_SUM && ok) sb = __ldg(s_b + tj);
            r.s2[j] = F32S ? (unsigned)sb : (unsigned)sb * 0x10001u;  // float32 bits, or the T pair
            unsigned z = 8u;
            if constexpr (S == W_UINT4) z = ok ? (unsigned)((__ldg(z_b + (tj >> 1)) >> (4 * (g & 1))) & 15u) : 0u;
            r.zb[j] = frag_zero_bias<T>(z, j & 1);
#pragma unroll
            for (int h = 0; h < 2; ++h)
                r.cs[j][h] = SCALE_AFTER_SUM && nc + 8 * j + h < a.N ? to_float(s_c[tj + h]) : 0.0f;
        }
        return r;
    };

    float acc[MT][GM_NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < GM_NT; ++j) acc[mt][j][0] = acc[mt][j][1] = acc[mt][j][2] = acc[mt][j][3] = 0.0f;

    pdl_wait_then_release();  // no global access above this line
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < niter) load_stage(s, it0 + s);
        cp_async_commit();
    }
    SZ cur = load_sz(it0);
    const int arow = wm * MT * 16 + g;  // this lane's first activation row in the tile
    // the byte offset in its row of this lane's sub-block sub (k 32 t + 8 sub of the layout): chunk
    // 4 t + sub, or with kperm 4 sub + t (rows arow + 16 mt + 8 hr all have arow's parity)
    int a_off[4];
#pragma unroll
    for (int sub = 0; sub < 4; ++sub) a_off[sub] = gm_swz(arow, a.kperm ? 4 * sub + t : 4 * t + sub) << 4;

#pragma unroll 1
    for (int i = 0; i < niter; ++i) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // stage i has arrived for every thread, and slot (i - 1) % STAGES is free
        if (i + STAGES - 1 < niter) load_stage((i + STAGES - 1) % STAGES, it0 + i + STAGES - 1);
        cp_async_commit();
        const SZ nxt = load_sz(it0 + min(i + 1, niter - 1));

        const unsigned char* sa = smem + (i % STAGES) * STAGE_BYTES;
        const unsigned char* sw = sa + A_BYTES;
        // this lane's k (32 t .. 32 t + 31) of the warp's two weight tiles: pieces 4 g + t of both
        // halves, the words of k16 steps 2 t and 2 t + 1 of lanes (g, t'), t' = 0..3
        uint4 wv[GM_NT / 2][2];
        if constexpr (!FP8) {
#pragma unroll
            for (int jj = 0; jj < GM_NT / 2; ++jj)
#pragma unroll
                for (int h = 0; h < 2; ++h) wv[jj][h] = *reinterpret_cast<const uint4*>(sw + (2 * wn + jj) * 1024 + h * 512 + lane * 16);
        }
        // FP8: the row of B column nb + 8 j, its piece x = sub / 2 of this lane's 32 bytes (read at
        // sub 0 and 2), and the float scale of its group (bf16)
        uint4 w8[FP8 ? GM_NT : 1];
        const unsigned char* w8row = sw + (2 * wn) * W_TILE + (t >> 1) * 1024 + g * 64;
        float sf[FP8 ? GM_NT : 1];
        if constexpr (FP8) {
#pragma unroll
            for (int j = 0; j < GM_NT; ++j) sf[j] = F32S ? __uint_as_float(cur.s2[j]) : bits16_to_float<T>(cur.s2[j]);
        }
        float part[SCALE_AFTER_SUM ? MT : 1][GM_NT][4];
        if constexpr (SCALE_AFTER_SUM) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < GM_NT; ++j) part[mt][j][0] = part[mt][j][1] = part[mt][j][2] = part[mt][j][3] = 0.0f;
        }
#pragma unroll
        for (int sub = 0; sub < 4; ++sub) {
            if constexpr (FP8) {
                if (sub % 2 == 0) {
#pragma unroll
                    for (int j = 0; j < GM_NT; ++j)
                        w8[j] = *reinterpret_cast<const uint4*>(w8row + (j >> 1) * W_TILE + (j & 1) * 512 +
                                                                (((t & 1) * 2 + sub / 2) ^ (t >> 1)) * 16);
                }
            }
            unsigned ar[MT][2][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int hr = 0; hr < 2; ++hr) {
                    const int r = arow + 16 * mt + 8 * hr;
                    const uint4 v = *reinterpret_cast<const uint4*>(sa + r * 256 + a_off[sub]);
                    ar[mt][hr][0] = v.x; ar[mt][hr][1] = v.y; ar[mt][hr][2] = v.z; ar[mt][hr][3] = v.w;
                }
            unsigned sq[FP4 ? GM_NT : 1];  // FP4: the scale pair of B column nb + 8 j in this sub-block
            if constexpr (FP4) {
#pragma unroll
                for (int j = 0; j < GM_NT; ++j) sq[j] = fp4_scale2<T, S>((cur.s2[j] >> (8 * sub)) & 0xffu);
            }
            // the mma wants each A fragment in 4 consecutive registers, rows g and g + 8 interleaved:
            // build each once per k16 step and use it for every n8 tile
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                // B of n8 tile j (row g or g + 8 of tile j / 2): slots (2t, 2t + 1) take k 8 sub + 4 h
                // + {0, 1} (word t' = 2 h), slots (2t + 8, 2t + 9) k 8 sub + 4 h + {2, 3} (t' = 2 h + 1),
                // both in register 2 (sub % 2) + j % 2 of the word of step 2 t + sub / 2
                unsigned bw[GM_NT][2];
#pragma unroll
                for (int j = 0; j < GM_NT; ++j) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        if constexpr (FP8) {
                            const unsigned word = reinterpret_cast<const unsigned*>(&w8[j])[2 * (sub & 1) + h];
                            bw[j][e] = fp8x2_scaled<T, F32S>((unsigned short)(e ? word >> 16 : word & 0xffffu), cur.s2[j], sf[j]);
                            continue;
                        }
                        const unsigned word = reinterpret_cast<const unsigned*>(&wv[j >> 1][sub >> 1])[2 * h + e];
                        if constexpr (FP4) {
                            bw[j][e] = H::fma2(fp4_frag<T>(word, 2 * (sub & 1) + (j & 1)), sq[j], 0x80008000u);  // w', exact
                        } else {
                            const unsigned x = frag_codes<T>(word, 2 * (sub & 1) + (j & 1));
                            bw[j][e] = H::fma2(x, frag_mul<T>(j & 1), cur.zb[j]);  // q - z, exact
                            if constexpr (!SCALE_AFTER_SUM) bw[j][e] = H::fma2(bw[j][e], cur.s2[j], 0x80008000u);
                        }
                    }
                }
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    const unsigned af[4] = {ar[mt][0][2 * h], ar[mt][1][2 * h], ar[mt][0][2 * h + 1], ar[mt][1][2 * h + 1]};
#pragma unroll
                    for (int j = 0; j < GM_NT; ++j) mma16816<T>(SCALE_AFTER_SUM ? part[mt][j] : acc[mt][j], af, bw[j][0], bw[j][1]);
                }
            }
        }
        if constexpr (SCALE_AFTER_SUM) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < GM_NT; ++j)
#pragma unroll
                    for (int r = 0; r < 4; ++r) acc[mt][j][r] = fma_rn(part[mt][j][r], cur.cs[j][r & 1], acc[mt][j][r]);
        }
        cur = nxt;
    }
    cp_async_wait<0>();

    // this thread's outputs: rows arow + 16 mt + 8 hr, columns n0 + wn * 32 + 8 j + 2 t + {0, 1}
    // (FP4: each float32 sum times osc, then rounded to T)
    const float osc = FP4 ? fp4_out_scale<T, S>(scale_2) : 1.0f;
    if (a.splits > 1) {
        split_k_finish<T, BM, GM_BN, THREADS, FP4>(ws, counters, y, a.M, a.N, m0, n0, a.splits, s_last, [&](auto f) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int hr = 0; hr < 2; ++hr)
#pragma unroll
                    for (int j = 0; j < GM_NT; ++j)
#pragma unroll
                        for (int e = 0; e < 2; ++e)
                            f(arow + 16 * mt + 8 * hr, wn * 32 + 8 * j + 2 * t + e, acc[mt][j][2 * hr + e]);
        }, osc);
        return;
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const i64 m = m0 + arow + 16 * mt + 8 * hr;
            if (m >= a.M) continue;
#pragma unroll
            for (int j = 0; j < GM_NT; ++j) {
                const i64 n = n0 + wn * 32 + 8 * j + 2 * t;
                float v0 = acc[mt][j][2 * hr], v1 = acc[mt][j][2 * hr + 1];
                if constexpr (FP4) v0 = mul_rn(v0, osc), v1 = mul_rn(v1, osc);
                const unsigned short lo = bits16_rn<T>(v0), hi = bits16_rn<T>(v1);
                unsigned short* p = reinterpret_cast<unsigned short*>(y + m * a.N + n);
                if (n + 1 < a.N && (reinterpret_cast<unsigned long long>(p) & 3) == 0) {  // out= may be misaligned
                    *reinterpret_cast<unsigned*>(p) = (unsigned)lo | ((unsigned)hi << 16);
                } else {
                    if (n < a.N) p[0] = lo;
                    if (n + 1 < a.N) p[1] = hi;
                }
            }
        }
}
