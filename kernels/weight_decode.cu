// weight_decode.cu: the decode matmul y = a @ dequant(w).T for weight-only INT4 and FP8 weights
// (few rows of a), dequantizing the weights in registers from the prepared layout
// (cupyquant/weight/layout.py prepared_of). Numerics: each product exact, float32 sums in an
// order of the kernel's own (see w16_decode); reference: a @ cupyquant.reference.dequantize_weight(w).T
// within float32 summation error.

#include "common.cuh"
#include "weight_mma.cuh"

using namespace cq;

// ---------------------------------------------------------------- decode matmul
// y (M, N) = a (M, K) @ dequant(w).T, fp32 accumulation on mma.sync.m16n8k16 (f16 or bf16), the
// weights dequantized in registers from the prepared layout, each weight byte read once per M
// tile of 16 rows.
//
// Operands. The weights are the mma's A operand (16 rows of N by 16 of K) and the activations its
// B operand (16 of K by 8 rows of M): at decode (M <= 8) one mma covers 256 weights, and no mma row
// is idle for want of activation rows. With M tile rows past 8 (ROW_TILES > 1) each A fragment meets two B
// fragments (rows 0-7 and 8-15 of the M tile).
//
// Tiling. A block of WARPS warps owns RT = ROW_TILES 16-row tiles of weights (see the
// configurations below) and one M tile of 16 rows;
// its warps split K (warp w takes K chunks w, w + WARPS, ...) and add their partial sums through
// shared memory at the end. K split across blocks (compute capability 9.0+: gridDim.z = splits
// blocks of the same tiles, launched as one 1 x 1 x splits thread-block cluster): the cluster's
// warps take the chunks in turn as one block of splits x WARPS warps would (warp w of block z
// takes z WARPS + w, + splits WARPS, ...); each block adds its warps' sums as above, then block z
// adds the z-th share of the outputs over the blocks, in block order, through distributed shared
// memory, and stores them. A K chunk is 4 x VALS elements, VALS = 32 (INT4, 16 bytes) or 16 (FP8):
// lane (g, t) = (lane / 4, lane % 4) copies the 32 bytes of each tile's 1 KB chunk at
// 512 h + 16 (4 g + t), h = 0, 1, which hold the weights of rows g and g + 8 at chunk k
// t * VALS .. t * VALS + VALS - 1 (FP8: row 8 h + g, bytes 16 t..; INT4: pieces 4 g + t of the
// fragment order, see K order), and loads the VALS activations of M rows g (and g + 8) there.
//
// Weight stream. Each warp keeps the chunks after the one it multiplies in flight: a ring of
// DECODE_STAGES slots in shared memory (RT KB per slot), filled by cp.async DECODE_STAGES - 1 chunks
// ahead (2 stages, one chunk ahead, with 24-32 warps per SM: 3 and 4 stages are 1-20% slower on the
// H100 on every shape and configuration, 4096^2 M = 1 5.3 us against 6.3-6.4). A lane reads back only
// the 16-byte pieces it copied itself, so cp.async.wait_group orders each slot's fill and use with no
// barrier; the slot refilled in an iteration is the one emptied into registers the iteration before.
// A lane's scales (and zero codes) are loaded SCALES_AHEAD chunks ahead; the next chunk's
// activations are loaded into the registers of the quarters just used (INT4: two quarters after
// each four mma steps; FP8: one after each two), not through the cp.async ring (where lanes that
// copy the same address make it 1.5-8x slower).
//
// K order. The sum over K does not care in which order the products come, so each thread's VALS
// consecutive k are assigned to the mma's k slots (2t, 2t + 1, 2t + 8, 2t + 9 of each k16 step) in
// the order that is cheapest. INT4 (fragment order, weight/layout.py prepared_of): the lane's two pieces
// are the words of k16 steps 2t and 2t + 1 of lanes (g, t'), t' = 0..3; word t' of piece sl is an A
// fragment as it stands (k 32 t + 16 sl + 2 t' + {0, 1, 8, 9}; weight_mma.cuh frag_codes: one lop3
// a register, plus one shift a word for fp16 and three for bf16), and it meets the activation
// registers of those k pairs, 8 sl + t' and 8 sl + t' + 4, as loaded. FP8 step j takes word j's
// bytes (0, 1) and (2, 3) in order.
// Where the groups are whole chunks (SCALE_AFTER_SUM), the layout's chunks have their 4 x 4 blocks of 8 k
// transposed (weight/layout.py k_permuted): the lane's k 32 t + 8 q + r of the layout are the
// chunk's 32 q + 8 t + r, so each of its four 16-byte activation loads is one quarter of a 64-byte
// piece that the four lanes t of a row read together (without it, 16-byte pieces 64 bytes apart:
// twice the L2 sectors and four times the tag lookups a load; 4096^2 M = 16 on the H100 5.6 us
// against 6.5).
//
// Dequantization (without SCALE_AFTER_SUM exact: the same bits as dequantize_weight to T): INT4 codes become 1024 + q
// (fp16, exponent 0x64) or 128 + q (bf16, 0x43) by one lop3, minus 1024 + z (or 128 + z) exactly,
// times the scale in one rounding (fma with -0). FP8 goes through the exact fp8 -> f16x2
// conversion; fp16 multiplies there, bf16 in float32 (exact) and rounds once to bf16. A lane's VALS
// weights of a row lie in one group (G >= VALS), so it needs one scale per row and chunk.
// W_FP8_BLOCK (FP8 in 128 x 128 blocks): the same bytes and layout, the scales float32 (the prepared
// layout repeats each block scale for the rows of its block: groups of 128 along K, the last one
// partial where 128 does not divide K), each value times its scale in an IEEE float32 multiply and
// rounded once to T for fp16 and bf16 alike (weight_mma.cuh fp8x2_scaled<T, true>): the bits of
// reference.dequantize_weight_blocks(q, s, T); the scale is never rounded to 16 bits.
static constexpr int DECODE_STAGES = 2;  // weight chunks in flight per warp (the ring's slots)
static constexpr int DECODE_MAX_SPLITS = 8;  // blocks of a K split (a portable cluster's size)
// Configurations (cupyquant/weight/decode.py DECODE_CONFIGS; each row's fields are the template
// arguments WARPS ... EVEN_ODD_SUMS, and its decode_config says which shapes take which):
//   WARPS          warps per block (4, 8 or 16), which split the block's K between them;
//   BLOCKS_PER_SM  the launch bounds' minimum blocks per SM: the register budget (3 blocks of 8
//                  warps: 80 registers; 4: 64; one block a SM: up to 255);
//   ROW_TILES      16-row weight tiles per block: 1 for M <= 8 (N = 4096 already gives 256 blocks),
//                  2 for M tiles of 16 rows (halving the activation reads per weight byte), 4
//                  (halving them again: at M = 16 they are twice the weight bytes otherwise);
//   SCALES_AHEAD   chunks ahead that a lane loads its scales (2 where a chunk's work is short
//                  enough for the wait on them to show: the even/odd configuration);
//   EVEN_ODD_SUMS  each chunk's partial sums in two sets, even and odd k16 steps (with
//                  SCALE_AFTER_SUM), which halves the chain of dependent mma: at M tiles of 16 rows
//                  and a short K that chain, not the memory, sets the pace (4096^2 M = 16 on the
//                  H100: 6.5 us with two sets, 6.9 with one).
struct MatmulArgs {
    i64 M, N, K;
    i64 lda;     // elements between rows of a
    i64 ng;      // groups per weight row
    int gshift;  // group of k: k >> gshift (log2 G; 62 for one group per row)
    int early;   // 1: the first weight chunk and its scales are loaded before the PDL wait (below)
};

// A 16-byte read-only load written as asm volatile, so that it keeps its place among the mma's asm
// statements in what NVVM emits; ptxas still schedules it (in the sm_90 SASS at 80 registers the
// next chunk's activation loads issue after the third of the chunk's eight mma steps, at 64
// registers at the end of the iteration, the same as with __ldg).
__device__ __forceinline__ uint4 ld16_ordered(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// An empty asm that "changes" p: the value must be held in a register across it, not recomputed.
template <typename P> __device__ __forceinline__ void keep_reg(P*& p) { asm volatile("" : "+l"(p)); }

// SCALE_AFTER_SUM (INT4 with G a multiple of 128: a chunk is one group): the mma multiplies the
// exact q - z, and each chunk's partial sums are scaled in float32 afterwards (one FMA per output
// instead of one multiply per weight pair).
template <typename T, int S, int WARPS, int BLOCKS_PER_SM, int ROW_TILES, int SCALES_AHEAD, bool EVEN_ODD_SUMS,
          bool SCALE_AFTER_SUM>
__global__ void __launch_bounds__(WARPS * 32, BLOCKS_PER_SM) w16_decode(const T* __restrict__ act, const unsigned char* __restrict__ wq,
                                                                         const T* __restrict__ scales, const unsigned char* __restrict__ zeros,
                                                                         const float* __restrict__ scale_2, T* __restrict__ y, MatmulArgs a) {
    constexpr bool FP8 = is_fp8_scheme(S);
    constexpr bool F32S = S == W_FP8_BLOCK;  // float32 scales (128 x 128 block weights)
    using SW = typename cond_type<F32S, unsigned, unsigned short>::type;  // a scale's bits
    constexpr bool FP4 = S == W_NVFP4 || S == W_MXFP4;
    constexpr int NB = S == W_NVFP4 ? 8 : 4;  // FP4: scale bytes of a weight row per chunk
    constexpr int VALS = FP8 ? 16 : 32;  // weights per 16-byte load
    constexpr int CHUNK = 4 * VALS;      // k per chunk
    constexpr int CBYTES = 64;           // bytes of a weight row per chunk
    constexpr int STEPS = VALS / 4;      // k16 mma steps per chunk
    constexpr int AREGS = VALS / 2;      // activation registers per M row per chunk
    constexpr int MT = ROW_TILES > 1 ? 2 : 1;  // B fragments (8 M rows each)
    constexpr int RT = ROW_TILES;
    constexpr int STAGES = DECODE_STAGES;
    constexpr int SLOT = RT * 2 * 32;    // uint4 per ring slot: 16 bytes per lane of each weight row
    using H = HalfOps<T>;
    extern __shared__ uint4 mm_smem[];  // the warps' rings [WARPS][STAGES][SLOT], then the reduction

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    // K split (gridDim.z > 1: the blocks of a thread-block cluster, compute capability 9.0+): the
    // cluster's warps take the chunks in turn as one block of gridDim.z x WARPS warps would
    const int kw = (int)blockIdx.z * WARPS + warp;  // this warp's first chunk
    const int KW = (int)gridDim.z * WARPS;          // the chunk stride
    const i64 n0 = (i64)blockIdx.x * (16 * RT);
    const i64 m0 = (i64)blockIdx.y * 16;
    const int nchunks = (int)(a.K / CHUNK);  // the wrapper keeps it below 2^31
    const SW* sc16 = reinterpret_cast<const SW*>(scales);

    // This lane's weight rows n0 + 16 r + 8 h + g: the first byte it copies, its scales and zero codes,
    // in the prepared layout (weight/layout.py prepared_of): tile n16 of 16 rows holds chunk c at
    // (n16 * nchunks + c) KB (FP8: row i of the tile at 64 i; INT4: fragment order, the lane's
    // pieces at 512 h + 16 lane either way); scales [n16][group][16], zero codes
    // [n16][group][8 bytes] (row i in nibble i % 2 of byte i / 2). Rows past N are the zero padding
    // of the last tile, a block's second tile past the last reads the last again, and rows of a past
    // M read row M - 1: valid memory, and what they give lands only in outputs that are not stored
    // (an mma output depends on its own row of A and column of B alone), so no load needs a row
    // predicate.
    const unsigned char* wsrc[RT][2];
    const SW* srow[RT][2];
    const unsigned char* zrow[RT][2];
    const unsigned char* s8row[RT][2];  // FP4: the row's NB scale bytes of chunk 0 ([n16][chunk][16][NB])
    const i64 ntiles = (a.N + 15) / 16;
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const i64 tile = min(n0 / 16 + r, ntiles - 1);
            wsrc[r][h] = wq + (tile * nchunks * 16 + 8 * h + g) * CBYTES + t * 16;
            srow[r][h] = sc16 + tile * a.ng * 16 + 8 * h + g;
            zrow[r][h] = S == W_UINT4 ? zeros + tile * a.ng * 8 + 4 * h + g / 2 : zeros;
            s8row[r][h] = reinterpret_cast<const unsigned char*>(scales) + ((tile * nchunks) * 16 + 8 * h + g) * NB;
        }
    const T* arow[MT];
#pragma unroll
    // K_PERMUTED (SCALE_AFTER_SUM: whole-chunk groups): the prepared chunk's 4 x 4 blocks of 8 k are transposed
    // (weight/layout.py k_permuted), so this lane's k 32 t + 8 q + r (of the layout) are the chunk's k
    // 32 q + 8 t + r, and quarter q of the four lanes t is one 64-byte piece of an activation row
    // (FP4 weights are always in this order)
    constexpr bool K_PERMUTED = (SCALE_AFTER_SUM && !FP8) || FP4;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) arow[mt] = act + min(m0 + 8 * mt + g, a.M - 1) * a.lda + t * (K_PERMUTED ? 8 : VALS);

    // Programmatic dependent launch: this kernel may start while the kernel before it on the stream
    // still runs, and griddepcontrol.wait (pdl_wait_then_release) returns once that kernel has
    // completed and its writes are visible. The activations may be that kernel's output, so they
    // are read after the wait. The weights (data, scales, zero codes) are not, when the wrapper
    // sets a.early (weight/dispatch.py early_ok: a weight whose arrays an earlier call has read, and
    // not converted in this call): then this warp's first chunk goes into the ring and its scales
    // into registers before the wait, so that they are on their way while the kernel before
    // finishes (4096^2 M = 1 on the H100: 4.7 us against 5.3 in back-to-back calls; the whole ring
    // of two chunks before the wait is slower than one on every shape).
    if (!a.early) pdl_wait_then_release();  // no global access above this line
    uint4* ring = mm_smem + warp * (STAGES * SLOT) + lane;
    // chunk c of this warp's weights into ring slot `slot` (zeros past K), as one commit group
    auto fill = [&](int c, int slot) {
        const bool ok = c < nchunks;
        const i64 off = (i64)(unsigned)c * (16 * CBYTES);  // chunk c of the tile
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int h = 0; h < 2; ++h) cp_async16(ring + slot * SLOT + (2 * r + h) * 32, ok ? wsrc[r][h] + off : wq, ok);
        cp_async_commit();
    };
    // the scale bits of this lane's rows for chunk c (the zero code in the high half for uint4); past
    // the last chunk, the last chunk's again (never used)
    // FP4: the row's four scale bytes of this lane's quarters q = 0..3 of chunk c (chunk k 32 q + 8 t ..
    // 32 q + 8 t + 7, K_PERMUTED), byte q: MXFP4 group q, NVFP4 group 2 q + t / 2 (of the chunk's 8)
    auto load_groups = [&](int c, unsigned (&gd)[RT][2]) {
        if constexpr (FP4) {
            const i64 off = (i64)min(c, nchunks - 1) * (16 * NB);
#pragma unroll
            for (int r = 0; r < RT; ++r)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    if constexpr (S == W_NVFP4) {
                        const uint2 v = __ldg(reinterpret_cast<const uint2*>(s8row[r][h] + off));
                        gd[r][h] = __byte_perm(v.x, v.y, t >= 2 ? 0x7531 : 0x6420);
                    } else {
                        gd[r][h] = __ldg(reinterpret_cast<const unsigned*>(s8row[r][h] + off));
                    }
                }
            return;
        }
        const i64 grp = ((i64)min(c, nchunks - 1) * CHUNK + t * VALS) >> a.gshift;
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                unsigned v = __ldg(srow[r][h] + grp * 16);
                if constexpr (S == W_UINT4) v |= ((unsigned)(__ldg(zrow[r][h] + grp * 8) >> (4 * (g & 1))) & 15u) << 16;
                gd[r][h] = v;
            }
    };
    // quarter q (16 bytes per M row) of this lane's activations of chunk c
    auto load_act = [&](int c, int q, unsigned (&ar)[MT][AREGS]) {
        const i64 k0 = (i64)min(c, nchunks - 1) * CHUNK;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const uint4 v = ld16_ordered(arow[mt] + k0 + (K_PERMUTED ? 32 : 8) * q);
            ar[mt][4 * q] = v.x; ar[mt][4 * q + 1] = v.y; ar[mt][4 * q + 2] = v.z; ar[mt][4 * q + 3] = v.w;
        }
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) fill(kw + s * KW, s);
    // the scales of the next SCA chunks (scale loads come from memory, as the weights, but into
    // registers: loaded one chunk ahead their latency was not hidden where a chunk's work is short)
    constexpr int SCA = SCALES_AHEAD;
    unsigned gd_next[SCA][RT][2];
#pragma unroll
    for (int j = 0; j < SCA; ++j) load_groups(kw + j * KW, gd_next[j]);
    if (a.early) pdl_wait_then_release();  // the weights above, the activations below
    // The activations of the next chunk are loaded into the registers of the quarters just used, so
    // that they arrive during this chunk's work at no register cost (PAIRS: into a second set at
    // the top of the iteration, copied at its end; see the mma steps).
    constexpr bool PAIRS = !FP8 && ROW_TILES == 4;
    unsigned ar[MT][AREGS];
#pragma unroll
    for (int q = 0; q < AREGS / 4; ++q) load_act(kw, q, ar);
    unsigned an[PAIRS ? MT : 1][PAIRS ? AREGS : 1];

    float acc[RT][MT][4];
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) acc[r][mt][0] = acc[r][mt][1] = acc[r][mt][2] = acc[r][mt][3] = 0.0f;

    int i = 0;
#pragma unroll 1
    for (int c = kw; c < nchunks; c += KW, ++i) {
        // the row pointers stay in registers: without this the compiler recomputes them (64-bit
        // multiplies and the clamps) in every iteration
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                keep_reg(wsrc[r][h]);
                if constexpr (FP4) keep_reg(s8row[r][h]);
                else keep_reg(srow[r][h]);
                if constexpr (S == W_UINT4) keep_reg(zrow[r][h]);
            }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) keep_reg(arow[mt]);
        cp_async_wait<STAGES - 2>();  // chunk i's group is complete (this lane's copies)
        const int slot = i % STAGES;
        uint4 wv[RT][2];  // this lane's two pieces of each tile (INT4: the words of k16 steps 2t and 2t + 1)
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int h = 0; h < 2; ++h) wv[r][h] = ring[slot * SLOT + (2 * r + h) * 32];
        fill(c + (STAGES - 1) * KW, (i + STAGES - 1) % STAGES);  // the slot emptied last iteration
        if constexpr (PAIRS) {
#pragma unroll
            for (int q = 0; q < AREGS / 4; ++q) load_act(c + KW, q, an);
        }

        unsigned gd[RT][2];
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                gd[r][h] = gd_next[0][r][h];
#pragma unroll
                for (int j = 0; j + 1 < SCA; ++j) gd_next[j][r][h] = gd_next[j + 1][r][h];
            }
        load_groups(c + SCA * KW, gd_next[SCA - 1]);

        // per row: the scale pair (and float scale), -(bias + z) in each half
        unsigned s2[RT][2], zb[RT][2];
        float sf[RT][2];
        unsigned sq[FP4 ? RT : 1][2][2];  // FP4: the scales of each row's quarters (0, 1) and (2, 3) (fp4_scale_pairs)
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if constexpr (FP4) {
                    fp4_scale_pairs<T, S>(gd[r][h], sq[r][h]);
                    continue;
                }
                if constexpr (FP8) {
                    fp8_scale<T, S>(gd[r][h], s2[r][h], sf[r][h]);
                    continue;
                }
                const unsigned sb = gd[r][h] & 0xffffu;
                const unsigned z = S == W_UINT4 ? gd[r][h] >> 16 : 8u;
                s2[r][h] = sb * 0x10001u;
                sf[r][h] = bits16_to_float<T>(sb);
                zb[r][h] = frag_zero_bias<T>(z, h);
            }
        // SCALE_AFTER_SUM: the chunk's partial sums, in NCH sets (EVEN_ODD_SUMS: two, even and odd k16 steps;
        // PAIRS: two, the low and the high k pairs)
        constexpr int NCH = SCALE_AFTER_SUM && (EVEN_ODD_SUMS || PAIRS) ? 2 : 1;
        float part[NCH][SCALE_AFTER_SUM ? RT : 1][MT][4];
        if constexpr (SCALE_AFTER_SUM) {
#pragma unroll
            for (int ch = 0; ch < NCH; ++ch)
#pragma unroll
                for (int r = 0; r < RT; ++r)
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) part[ch][r][mt][0] = part[ch][r][mt][1] = part[ch][r][mt][2] = part[ch][r][mt][3] = 0.0f;
        }
        // INT4: word of tile r -> its four A registers (rows g, g + 8, g, g + 8): q - z exactly
        // (SCALE_AFTER_SUM), else the dequantized weights. FP4: w' (fp4_frag times the scale of the
        // register's row and quarter: word (sl, tp) register j is row j % 2 at quarter 2 sl + j / 2)
        auto dq_word = [&](unsigned word, int r, int sl, unsigned (&d)[4]) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if constexpr (FP4) {
                    const unsigned x = fp4_frag<T>(word, j), s = sq[r][j & 1][sl];
                    d[j] = j >> 1 ? H::fma2_hi(x, s, 0x80008000u) : H::fma2_lo(x, s, 0x80008000u);
                    continue;
                }
                unsigned b = H::fma2(frag_codes<T>(word, j), frag_mul<T>(j & 1), zb[r][j & 1]);  // q - z, exact
                if constexpr (!SCALE_AFTER_SUM) b = H::fma2(b, s2[r][j & 1], 0x80008000u);
                d[j] = b;
            }
        };
        if constexpr (FP8) {
#pragma unroll
            for (int st = 0; st < STEPS; ++st) {
                unsigned bf[MT][2];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) bf[mt][0] = ar[mt][2 * st], bf[mt][1] = ar[mt][2 * st + 1];
#pragma unroll
                for (int r = 0; r < RT; ++r) {
                    unsigned af[4];
#pragma unroll
                    for (int h = 0; h < 2; ++h) {  // rows g (a0, a2) and g + 8 (a1, a3)
                        const unsigned* ww = reinterpret_cast<const unsigned*>(&wv[r][h]);
                        af[h] = fp8x2_scaled<T, F32S>((unsigned short)(ww[st] & 0xffffu), s2[r][h], sf[r][h]);
                        af[2 + h] = fp8x2_scaled<T, F32S>((unsigned short)(ww[st] >> 16), s2[r][h], sf[r][h]);
                    }
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) mma16816<T>(acc[r][mt], af, bf[mt][0], bf[mt][1]);
                }
                if (st % 2 == 1) load_act(c + KW, st / 2, ar);  // steps st - 1 and st used quarter st / 2
            }
        } else if constexpr (PAIRS) {
            // Words tp and tp + 1 (tp even) of piece sl are the A fragments of lanes (g, tp) and
            // (g, tp + 1) for k16 step 2 t + sl of the prepared layout, i.e. this lane's k
            // 16 sl + 2 tp + {0, 1, 8, 9} and 16 sl + 2 tp + {2, 3, 10, 11} (of its 32). Their
            // registers are regrouped into two mma: the low k pairs of both words (a0, a1 from word
            // tp, a2, a3 from word tp + 1: k 16 sl + 2 tp + 0..3) meet activation pairs 8 sl + tp
            // and 8 sl + tp + 1, the high ones (+ 8) pairs 8 sl + tp + 4 and + 5, so that each mma's
            // B operand is two adjacent registers of one 16-byte load (an aligned pair, as the mma
            // wants it; below, the pairs 8 sl + tp and + 4 are in two loads, and ptxas copies them
            // into pairs). The registers this frees hold the next chunk's activations (an) and a
            // second set of partial sums. ROW_TILES = 4 only (2-3% faster there on the H100 at
            // M = 16, 4096 x 14336 15.0 us against 15.8; 1-2% slower at 4096^2 with fewer tiles).
#pragma unroll
            for (int sl = 0; sl < 2; ++sl) {
#pragma unroll
                for (int tp = 0; tp < 4; tp += 2) {
#pragma unroll
                    for (int r = 0; r < RT; ++r) {
                        unsigned d[2][4];  // words tp and tp + 1
#pragma unroll
                        for (int u = 0; u < 2; ++u) dq_word(reinterpret_cast<const unsigned*>(&wv[r][sl])[tp + u], r, sl, d[u]);
#pragma unroll
                        for (int hl = 0; hl < 2; ++hl) {  // the low k pairs, then the high ones
                            const unsigned af[4] = {d[0][2 * hl], d[0][2 * hl + 1], d[1][2 * hl], d[1][2 * hl + 1]};
#pragma unroll
                            for (int mt = 0; mt < MT; ++mt)
                                mma16816<T>(SCALE_AFTER_SUM ? part[hl % NCH][r][mt] : acc[r][mt], af, ar[mt][8 * sl + tp + 4 * hl],
                                            ar[mt][8 * sl + tp + 4 * hl + 1]);
                        }
                    }
                }
            }
        } else {
            // step (sl, tp): word tp of piece sl, the A fragment of lane (g, tp) for k16 step 2 t + sl of
            // the prepared layout, i.e. this lane's k 16 sl + 2 tp + {0, 1, 8, 9} (of its 32):
            // activation pairs 8 sl + tp and 8 sl + tp + 4, in quarters 2 sl and 2 sl + 1
#pragma unroll
            for (int sl = 0; sl < 2; ++sl) {
#pragma unroll
                for (int tp = 0; tp < 4; ++tp) {
                    unsigned bf[MT][2];
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) bf[mt][0] = ar[mt][8 * sl + tp], bf[mt][1] = ar[mt][8 * sl + tp + 4];
#pragma unroll
                    for (int r = 0; r < RT; ++r) {
                        unsigned af[4];  // a0..a3
                        dq_word(reinterpret_cast<const unsigned*>(&wv[r][sl])[tp], r, sl, af);
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt) mma16816<T>(SCALE_AFTER_SUM ? part[(4 * sl + tp) % NCH][r][mt] : acc[r][mt], af, bf[mt][0], bf[mt][1]);
                    }
                }
                load_act(c + KW, 2 * sl, ar);  // the four steps of sl used quarters 2 sl and 2 sl + 1
                load_act(c + KW, 2 * sl + 1, ar);
            }
        }
        if constexpr (SCALE_AFTER_SUM) {
#pragma unroll
            for (int r = 0; r < RT; ++r)
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        float p = part[0][r][mt][q];
#pragma unroll
                        for (int ch = 1; ch < NCH; ++ch) p = add_rn(p, part[ch][r][mt][q]);
                        acc[r][mt][q] = fma_rn(p, sf[r][q >> 1], acc[r][mt][q]);
                    }
        }
        if constexpr (PAIRS) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int q = 0; q < AREGS; ++q) ar[mt][q] = an[mt][q];
        }
    }

    // split-K across the warps: partial sums through shared memory, over the emptied rings; with a
    // K split across the cluster, each block's sums (fin, after red) are added by rank, below
    constexpr int OUTS = RT * MT * 4 * 32;
    cp_async_wait<0>();  // the fills past the last chunk (zeros) land before the memory is reused
    __syncthreads();
    float* red = reinterpret_cast<float*>(mm_smem);  // [WARPS][RT][MT][4][32]
    float* fin = red + WARPS * OUTS;                 // [RT][MT][4][32] (within the rings' half)
    const int splits = (int)gridDim.z;
    const float osc = FP4 ? fp4_out_scale<T, S>(scale_2) : 1.0f;  // FP4: the sums times 2^C (and scale_2)
    // output o of the block's tile: (row of a, weight row), relative to (m0, n0)
    auto out_mn = [](int o, int& m, int& n) {
        const int l = o & 31, q = (o >> 5) & 3, mt = (o >> 7) % MT, r = (o >> 7) / MT;
        m = 8 * mt + 2 * (l & 3) + (q & 1);
        n = 16 * r + (l >> 2) + 8 * (q >> 1);
    };
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int q = 0; q < 4; ++q) red[warp * OUTS + ((r * MT + mt) * 4 + q) * 32 + lane] = acc[r][mt][q];
    __syncthreads();
#pragma unroll
    for (int o = threadIdx.x; o < OUTS; o += WARPS * 32) {
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) sum = add_rn(sum, red[w * OUTS + o]);
        if (splits > 1) {
            fin[o] = sum;
            continue;
        }
        int dm, dn;
        out_mn(o, dm, dn);
        const i64 m = m0 + dm, n = n0 + dn;
        if (m < a.M && n < a.N) y[m * a.N + n] = from_float<T>(FP4 ? mul_rn(sum, osc) : sum);
    }
    if (splits == 1) return;
    // The cluster's blocks add their sums through distributed shared memory, block r the r-th share
    // of the outputs, in rank order 0, 1, ... (the same sum whichever block finishes first); the
    // second barrier keeps each block's fin alive until the others have read it.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cluster_sync_all();
    const int rank = (int)blockIdx.z;  // the cluster is 1 x 1 x gridDim.z: its rank is blockIdx.z
    const unsigned fbase = (unsigned)__cvta_generic_to_shared(fin);
#pragma unroll 1
    for (int o = OUTS * rank / splits + threadIdx.x; o < OUTS * (rank + 1) / splits; o += WARPS * 32) {
        int dm, dn;
        out_mn(o, dm, dn);
        const i64 m = m0 + dm, n = n0 + dn;
        if (m >= a.M || n >= a.N) continue;  // not read at all: every load below is consumed by a store
        float v[DECODE_MAX_SPLITS];
#pragma unroll
        for (int r = 0; r < DECODE_MAX_SPLITS; ++r)
            if (r < splits) v[r] = ld_shared_cluster_f32(map_shared_rank(fbase + 4u * (unsigned)o, (unsigned)r));
        float sum = v[0];
#pragma unroll
        for (int r = 1; r < DECODE_MAX_SPLITS; ++r)
            if (r < splits) sum = add_rn(sum, v[r]);
        y[m * a.N + n] = from_float<T>(FP4 ? mul_rn(sum, osc) : sum);
    }
    cluster_sync_exit();
#else
    __trap();  // the wrapper splits K only on compute capability 9.0 and newer
#endif
}
