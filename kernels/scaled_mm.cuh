// scaled_mm.cuh: what the W8A8 matmul kernels share (scaled_mm_sm90.cu: wgmma on Hopper;
// scaled_mm_mma.cu: mma.sync on sm_80 and later): the argument struct, the scale and zero-point
// lookups, the rule by which block sums are scaled and added, and the epilogue (bias, rounding,
// K-split fix-up).
//
// y (M x N, rows ldy elements apart, in TY) = dequant(a) @ dequant(b).T (+ bias), with a (M x K
// codes, rows lda bytes apart) and b (N x K codes, rows ldb bytes apart), both FP8 (E4M3 or E5M2)
// or both INT8.
//
// FP8. K is cut into blocks of 128 (the last one shorter where 128 does not divide K). For each
// output element:
//   P(kb) = sum over k of block kb of qa(m, k) * qb(n, k): the tensor cores' float32 sum of exact
//           products (their internal order and width; Hopper keeps about 14 bits while it adds a
//           k32 step, which is why the sum restarts at every block);
//   MODE_END (neither scale varies along K): acc = P(0) + P(1) + ... in block order (float32),
//           v = acc * (sa(m) * sb(n));
//   MODE_K_TILE, MODE_K_COL (a scale varies along K): acc = fma(P(kb), sa(m, kb) * sb(n, kb), acc)
//           in block order, v = acc. K_TILE: b's scale is the same for every column of the block's
//           tile (the host guarantees it: 128 x 128 weight blocks and tiles of at most 128 columns
//           starting at a multiple of 128), so a thread computes one product per row; K_COL: one
//           product per element (1 x 128 weight groups);
//   K split into S parts (gridDim.z or work items): each part's v over its blocks, then the parts'
//           v summed in part order 0, 1, ..., S - 1 (float32), whatever order the blocks finish in.
// INT8 (MODE_END only: the scales do not vary along K). The sum is exact integer arithmetic:
//   acc = sum over k of qa(m, k) * qb(n, k) in int32 (the tensor cores' exact sum; a K split adds
//           its parts' acc as integers);
//   I = acc - z(m) * adj(n) in int32 where has_adj (z(m) a's zero point, 1 where azp is null;
//           adj(n) the column term: sum_k qb(n, k), or that times a per-tensor zero point), else
//           I = acc; all int32 arithmetic wraps (two's complement), so I is exact whenever the
//           true sum_k (qa(m, k) - z(m)) * qb(n, k) lies in the int32 range;
//   v = float(I) * (sa(m) * sb(n)) (the conversion rounds to nearest even).
// Both: y = round_TY(v + bias(n)): bias in TY (converted exactly), round to nearest even.
// Every float32 operation is IEEE (explicit .rn PTX, no flush: CuPy compiles with -ftz=true).
//
// Scales (float32 unless packed): a's scale of row m and block kb is word
//   (m / sa_rows) * sa_batch + (m % sa_rows) * sa_m + kb * sa_k   (sa_packed = 0), or byte kb % 4 of word
//   (m / sa_rows) * sa_batch + (m % sa_rows) * sa_m + (kb / 4) * sa_k  (sa_packed = 1: UE8M0, 2^(byte - 127));
// per tensor: sa_m = sa_k = 0; per token: sa_k = 0; the batch terms describe the column-major
// ("col") layout of a 3-D activation (cupyquant/groupwise.py). a's zero point of row m is int32
// word (m / zp_rows) * zp_batch + (m % zp_rows) * zp_m of azp (per tensor: zp_m = zp_batch = 0).
// b's scale of row n and block kb is
//   sb[(n >> sb_shift) * sb_n + kb * sb_k]
// (per tensor: sb_n = sb_k = 0; per channel: sb_k = 0; 1 x 128 groups: sb_shift = 0; 128 x 128
// blocks: sb_shift = 7).
#pragma once

#include "common.cuh"

namespace cq {

// the formats of a and b (cupyquant/w8a8/args.py FORMAT_IDS); S8: both INT8
enum MmFormat : int { FP8_E4M3 = 0, FP8_E5M2 = 1, S8 = 2 };
// how the block sums are scaled (see above; cupyquant/w8a8/args.py MODES)
enum MmMode : int { MODE_END = 0, MODE_K_TILE = 1, MODE_K_COL = 2 };

// cupyquant/w8a8/args.py MM_ARGS mirrors this struct field for field.
struct MmArgs {
    i64 M, N, K;
    i64 lda, ldb, ldy;  // a and b: bytes; y: elements
    i64 sa_rows, sa_batch, sa_m, sa_k;  // a's scales (words), see above
    i64 sb_n, sb_k;                     // b's scales (floats)
    i64 zp_rows, zp_batch, zp_m;        // a's zero points (int32 words), see above
    i64 y_tma;                          // scaled_mm_sm90.cu: 1 where an unsplit tile is stored by TMA from shared memory
    int sb_shift;
    int sa_packed;
    int has_bias;
    int splits;  // parts of K
    int kb_per_split;  // 128-k blocks a part (the last part may have fewer)
    int has_adj;  // INT8: subtract z(m) * adj(n)
    int cluster;  // scaled_mm_sm90.cu: blocks of a cluster that share a's rows by TMA multicast (1 or 2)
    int early;    // scaled_mm_sm90_small.cu: 1 where b's first slots are loaded before the PDL wait
};

__device__ __forceinline__ float fma_rn(float a, float b, float c) {
    float r;
    asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
    return r;
}

// the word offset of row m's scales in a's scale array, and of its zero point in azp (see above)
__device__ __forceinline__ i64 a_scale_row(const MmArgs& p, i64 m) { return (m / p.sa_rows) * p.sa_batch + (m % p.sa_rows) * p.sa_m; }
__device__ __forceinline__ i64 a_zero_row(const MmArgs& p, i64 m) { return (m / p.zp_rows) * p.zp_batch + (m % p.zp_rows) * p.zp_m; }

// INT8: a's zero point of the row whose word offset is row (a_zero_row); 1 where azp is null (adj
// already holds the per-tensor zero point's product), 0 without a zero-point term
__device__ __forceinline__ int a_zero(const MmArgs& p, const int* __restrict__ azp, i64 row) {
    return !p.has_adj ? 0 : azp ? __ldg(azp + row) : 1;
}

// INT8: v = float(acc - z * adj(n)) * s (int32 wrapping, see above); s = sa(m) * sb(n). adj is read
// only where z is not 0.
__device__ __forceinline__ float int_epilogue(const int* __restrict__ adj, i64 n, int acc, int z, float s) {
    const unsigned i = z ? (unsigned)acc - (unsigned)z * (unsigned)__ldg(adj + n) : (unsigned)acc;
    return mul_rn(__int2float_rn((int)i), s);
}

// a's scale of the row whose word offset is row (a_scale_row) and of block kb
__device__ __forceinline__ float a_scale(const MmArgs& p, const void* __restrict__ sa, i64 row, int kb) {
    if (p.sa_packed) {
        const unsigned w = __ldg(reinterpret_cast<const unsigned*>(sa) + row + (i64)(kb >> 2) * p.sa_k);
        return e8m0_to_float((w >> (8 * (kb & 3))) & 0xffu);
    }
    return __ldg(reinterpret_cast<const float*>(sa) + row + (i64)kb * p.sa_k);
}

// b's scale of row n and block kb
__device__ __forceinline__ float b_scale(const MmArgs& p, const float* __restrict__ sb, i64 n, int kb) {
    return __ldg(sb + (n >> p.sb_shift) * p.sb_n + (i64)kb * p.sb_k);
}

// y[m, n] and y[m, n + 1] = round(v + bias), for m < M, n < N (the caller checks; n + 1 stored only if < N);
// one 4-byte (16-bit TY) or 8-byte (float) store where both are in and the address allows
template <typename TY>
__device__ __forceinline__ void store_pair(TY* __restrict__ y, const TY* __restrict__ bias, const MmArgs& p, i64 m, i64 n, float v0, float v1) {
    const bool two = n + 1 < p.N;
    if (p.has_bias) {
        v0 = add_rn(v0, to_float(bias[n]));
        if (two) v1 = add_rn(v1, to_float(bias[n + 1]));
    }
    TY* q = y + m * p.ldy + n;
    if constexpr (same_type<TY, float>::value) {
        if (two && (reinterpret_cast<u64>(q) & 7) == 0) {
            *reinterpret_cast<float2*>(q) = make_float2(v0, v1);
        } else {
            q[0] = v0;
            if (two) q[1] = v1;
        }
    } else {
        const unsigned short e0 = bits16_rn<TY>(v0), e1 = bits16_rn<TY>(v1);
        unsigned short* qs = reinterpret_cast<unsigned short*>(q);
        if (two && (reinterpret_cast<u64>(q) & 3) == 0) {
            *reinterpret_cast<unsigned*>(qs) = (unsigned)e0 | ((unsigned)e1 << 16);
        } else {
            qs[0] = e0;
            if (two) qs[1] = e1;
        }
    }
}

// The end of a tile. visit(f) calls f(i, m, n, v0, v1) for every pair i < NP of columns (n, n + 1)
// of the tile this thread holds (m, n relative to the tile's corner m0, n0; n even; v0, v1 references
// to the pair's sums over this thread's part of K: float, or int for INT8), the same pairs in the
// same order at every call; final(i, m, n, v0, v1) turns a pair's sums over all of K into the float2
// that is stored (identity for FP8, whose parts are scaled already; INT8's epilogue). Without a K
// split the pairs are stored. With one, each part stores its partial tile (BM x BN, row-major, the
// values' bits in float32 words) to its place in the workspace ws (part, tile of tiles), and the last
// part of the tile to arrive (a counter per tile, reset by it for the next call) adds the parts
// (loaded at the places of its own pairs: NP independent loads a part, one round trip) and stores
// final of the sums, so that y does not depend on which part finishes first: float sums in part
// order 0, 1, ..., its own part read back from ws like the others', into the pairs' registers (no
// second register set), two parts' loads at a time; int sums (exact, wrapping, any order) into its
// own. THREADS threads (tid 0 .. THREADS - 1, warps 0 .. THREADS / 32 - 1 of the block) call this
// and meet at named barrier 1, so that other warps of the block (a producer) need not. SPLIT = false compiles the K split out
// (the host never splits such a launch).
__device__ __forceinline__ void named_sync(int threads) { asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory"); }

__device__ __forceinline__ float to_bits(float v) { return v; }
__device__ __forceinline__ float to_bits(int v) { return __int_as_float(v); }

// finish_tile's final step where the pairs already hold v (FP8, and INT8 converted in place)
struct AsScaled {
    __device__ __forceinline__ float2 operator()(int, int, int, float v0, float v1) const { return make_float2(v0, v1); }
};

// finish_tile's K split: store this part's partial, and the last part to arrive sums and stores
template <typename TY, typename V, int BM, int BN, int THREADS, int NP, typename Visit, typename Store>
__device__ __forceinline__ void finish_split(TY* __restrict__ y, const TY* __restrict__ bias, float* __restrict__ ws, int* __restrict__ counters,
                                             const MmArgs& p, i64 m0, i64 n0, i64 tile, i64 tiles, int part, int tid, Visit visit, Store store) {
    __shared__ int s_last;
    float* own = ws + ((i64)part * tiles + tile) * (BM * BN);
    visit([&](int, int m, int n, V& v0, V& v1) {  // rows past M are neither stored nor read back
        if (m0 + m < p.M) __stcg(reinterpret_cast<float2*>(own + m * BN + n), make_float2(to_bits(v0), to_bits(v1)));
    });
    named_sync(THREADS);  // every partial is stored before thread 0 counts this part as arrived
    if (tid == 0) {
        // acquire-release at GPU scope by one thread: the release publishes every partial the
        // barrier ordered before it, the acquire orders the last part's reads after the others' stores
        int old;
        asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(counters + tile) : "memory");
        s_last = old == p.splits - 1;
    }
    named_sync(THREADS);
    const bool last = s_last;
    named_sync(THREADS);  // every thread has read s_last before a later tile's thread 0 writes it
    if (!last) return;
    // the partial of part sp at this thread's pair: no branch around the loads (it would keep the
    // compiler from issuing them together, one round trip each): rows past M, never stored, read the
    // last row's partial instead
    auto load = [&](int sp, int m, int n) {
        const int mr = m0 + m < p.M ? m : (int)(p.M - 1 - m0);
        return __ldcg(reinterpret_cast<const float2*>(ws + ((i64)sp * tiles + tile) * (BM * BN) + mr * BN + n));
    };
    if constexpr (same_type<V, int>::value) {
#pragma unroll 1
        for (int sp = 0; sp < p.splits; ++sp) {
            if (sp == part) continue;
            visit([&](int, int m, int n, int& v0, int& v1) {
                const float2 x = load(sp, m, n);
                v0 = (int)((unsigned)v0 + __float_as_uint(x.x)), v1 = (int)((unsigned)v1 + __float_as_uint(x.y));
            });
        }
        visit([&](int i, int m, int n, int& v0, int& v1) { store(i, m, n, v0, v1); });
    } else {  // every part's partial, this one's too (stored above), summed from ws in part order into the pairs' own
              // registers, two parts' loads in flight together (a split of 2: one round trip)
#pragma unroll 1
        for (int sp = 0; sp < p.splits; sp += 2) {
            const bool two = sp + 1 < p.splits;
            const int sq = two ? sp + 1 : sp;  // loaded either way, added only if it is another part
            visit([&](int, int m, int n, float& v0, float& v1) {
                const float2 x = load(sp, m, n), x2 = load(sq, m, n);
                v0 = sp == 0 ? x.x : add_rn(v0, x.x), v1 = sp == 0 ? x.y : add_rn(v1, x.y);
                if (two) v0 = add_rn(v0, x2.x), v1 = add_rn(v1, x2.y);
            });
        }
        visit([&](int i, int m, int n, float& v0, float& v1) { store(i, m, n, v0, v1); });
    }
    if (tid == 0) counters[tile] = 0;  // ready for the next call
}

template <typename TY, typename V, int BM, int BN, int THREADS, int NP, bool SPLIT = true, typename Visit, typename Final>
__device__ __forceinline__ void finish_tile(TY* __restrict__ y, const TY* __restrict__ bias, float* __restrict__ ws, int* __restrict__ counters,
                                            const MmArgs& p, i64 m0, i64 n0, i64 tile, i64 tiles, int part, int tid, Visit visit, Final final) {
    auto store = [&](int i, int m, int n, V v0, V v1) {
        if (m0 + m >= p.M || n0 + n >= p.N) return;
        const float2 v = final(i, m, n, v0, v1);
        store_pair<TY>(y, bias, p, m0 + m, n0 + n, v.x, v.y);
    };
    if (!SPLIT || p.splits == 1) {
        visit([&](int i, int m, int n, V& v0, V& v1) { store(i, m, n, v0, v1); });
        return;
    }
    if constexpr (SPLIT) finish_split<TY, V, BM, BN, THREADS, NP>(y, bias, ws, counters, p, m0, n0, tile, tiles, part, tid, visit, store);
}

}  // namespace cq
