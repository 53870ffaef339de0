// kv_cache.cu: FP8 writes into a paged KV cache (vLLM reshape_and_cache_flash with an FP8 cache) and
// the dequantizing read of whole cache blocks.
//
// What it computes (reference: cupyquant.reference.quantize_kv_cache / dequantize_kv_cache, which
// these kernels match bit for bit; every float step is one IEEE float32 operation):
//   kv_cache_write       for token t < len(slot_mapping) and head h, slot = slot_mapping[t]; a slot
//                        < 0 or >= blocks * block_size writes nothing. Otherwise the row x[t, h, :]
//                        (D elements) goes to cache block slot / block_size, offset slot % block_size:
//                          static  s = the decode scale (per tensor or per head, x ~ q * s);
//                                  q = cvt_rn_satfinite(x / s), x / s correctly rounded (never a
//                                  multiplication by 1 / s); NaN -> 0x7f
//                          dynamic amax = max |x| over the row (NaN ignored, fmaxf);
//                                  s = fmaxf(amax / qmax, 1 / (qmax * 512)) (vLLM's per-token FP8
//                                  rule); q = cvt_rn_satfinite(fminf(x / s, qmax)) (NaN -> +qmax);
//                                  s is stored in the scale cache at the same slot and head.
//                        blockIdx.y = 0 writes the keys, 1 the values: one launch for both.
//   kv_cache_write_wide  the static write of kv_cache_write, the same bytes, with 16-byte stores.
//   kv_cache_dequantize  y[i] = round_rn(float(q) * s) of cache block block_ids[i], s the static
//                        scale of the element's head or the row's scale-cache entry; an id outside
//                        [0, blocks) gives a block of NaNs (never an out-of-bounds read).
//
// Layout. x (key, value): [tokens, heads, D], the token and head axes strided, D contiguous. A cache
// is uint8 [blocks, block_size, heads, D] ("NHD") or [blocks, heads, block_size, D] ("HND"),
// C-contiguous; its scale cache float32 [blocks, block_size, heads] or [blocks, heads, block_size].
// The host passes the element strides of (block, offset, head), so one kernel serves both layouts.
//
// Threads. A row (D elements of one token and head) belongs to a team of 2^tpr_log2 consecutive
// lanes (the host picks the fewest that leave each lane KVUnits units); lane l takes units l,
// l + team, ... so that each load and store instruction of a team covers one contiguous span. A unit
// is 8 elements on the vector path (VEC: 16-byte loads, an 8-byte store; D % 8 == 0, rows 16-byte
// aligned, the caches 8-byte aligned) and one element on the scalar path (any D and alignment). A
// dynamic row is read once into registers when it fits (KVUnits units per lane), else twice, the
// second read from L1/L2. The team's amax is an xor-shuffle reduction in which every lane of the
// warp takes part (lanes of skipped or absent rows with zeros). kv_cache_write_wide, for static
// scales where D % 16 == 0 and everything is 16-byte aligned, gives a lane 16 contiguous elements
// of a row instead (one 16-byte store; see there). Indexing is 64-bit; the host keeps the row count
// below 2^31 so that a row splits into (token, head) with a 32-bit division.
// PDL: each kernel calls pdl_wait_then_release() (common.cuh) once in every thread, before its first
// global load or store, so that the wrappers may launch it with programmatic dependent launch.

#include "common.cuh"

using namespace cq;

static constexpr int KV_BLOCK = 256;

// Units a lane keeps in registers: 2 x 8 elements on the vector path (16 or 32 bytes of loads in
// flight per lane), 8 single elements on the scalar path. At 16384 x 8 x 128 bf16 on H100 (static /
// dynamic scales): 44.3 / 45.5 us with 2 units, 51.7 / 41.8 with 4, 48.9 / 60.7 with 1.
template <bool VEC> struct KVUnits { static constexpr int N = VEC ? 2 : 8; };

// Runtime parameters of a write; passed by value from a NumPy structured scalar with the same fields
// (cupyquant.kv_cache._WRITE_ARGS, align=True). Strides are in elements.
struct KVWriteArgs {
    i64 rows;                          // len(slot_mapping) * heads
    i64 num_slots;                     // blocks * block_size
    i64 x_tok_k, x_head_k;             // key's token and head strides
    i64 x_tok_v, x_head_v;             // value's
    i64 c_block, c_off, c_head;        // a cache's block, in-block offset and head strides
    i64 s_block, s_off, s_head;        // a scale cache's
    int heads, head_dim, block_size;
    int slot64;                        // slot_mapping is int64 (else int32)
    int stride_k, stride_v;            // device scale: 0 one per tensor, 1 one per head
    int dynamic;
    int tpr_log2;                      // log2 of the lanes per row
    int heads_log2, block_size_log2;   // log2 of heads and block_size when powers of two, else -1
};

// Runtime parameters of a read (cupyquant.kv_cache._READ_ARGS).
struct KVReadArgs {
    i64 rows;                          // len(block_ids) * rows_per_block
    i64 num_blocks;
    int rows_per_block;                // block_size * heads
    int heads, head_dim, block_size;
    int hnd;                           // layout "HND" (else "NHD")
    int ids64;                         // block_ids is int64 (else int32)
    int scale_stride;                  // as stride_k above
    int dynamic;
    int tpr_log2;
    int pad;
};

// One unit of a row: 8 elements as 16-byte vectors (VEC), or one element.
template <typename T, bool VEC> struct Unit;
template <typename T> struct Unit<T, true> {
    static constexpr int N = 8;
    static constexpr int LOADS = sizeof(T) == 4 ? 2 : 1;
    uint4 v[LOADS];
    __device__ __forceinline__ void load(const T* p) {
#pragma unroll
        for (int l = 0; l < LOADS; ++l) v[l] = ld16(p + l * Vec16<T>::N);
    }
    __device__ __forceinline__ void clear() {
#pragma unroll
        for (int l = 0; l < LOADS; ++l) v[l] = make_uint4(0u, 0u, 0u, 0u);
    }
    __device__ __forceinline__ unsigned absmax() const {
        unsigned m = 0;
#pragma unroll
        for (int l = 0; l < LOADS; ++l) m = max(m, absmax16<T>(v[l]));
        return m;
    }
    __device__ __forceinline__ void floats(float* f) const {
#pragma unroll
        for (int l = 0; l < LOADS; ++l) unpack16<T>(v[l], f + l * Vec16<T>::N);
    }
};
template <typename T> struct Unit<T, false> {
    static constexpr int N = 1;
    T v;
    __device__ __forceinline__ void load(const T* p) { v = *p; }
    __device__ __forceinline__ void clear() { v = from_float<T>(0.0f); }
    __device__ __forceinline__ unsigned absmax() const { return abs_key(to_float(v)); }
    __device__ __forceinline__ void floats(float* f) const { f[0] = to_float(v); }
};

// Whether div_by (common.cuh) may stand for div_rn with this s: s a positive normal in [2^-64, 2^64].
// Then for |x / s| < 2^64 every intermediate of div_by is a normal float wherever the quotient can
// reach an FP8 value (a residual goes subnormal only for x < 2^-103, where the quotient is below
// 2^-39 and converts to a signed zero either way), so the two agree bit for bit.
__device__ __forceinline__ bool fast_div_ok(float s) {
    const unsigned b = __float_as_uint(s);
    return b >= 0x1f800000u && b <= 0x5f800000u;
}

// x / s (IEEE, correctly rounded) of N elements, clamped by the dynamic rule. The quotients come
// from div_by with r = 1 / s when fast (fast_div_ok(s)); a group of N with a quotient that is not
// below 2^64 (x inf or NaN, or an overflow) is divided again with div_rn, as is every group when not
// fast. (div_rn for every element: 14.1 us at 4096 x 8 x 128 bf16 on H100, static scale; 13.5 us
// this way.)
template <class F, int N>
__device__ __forceinline__ void quotients(const float* f, float s, float r, bool fast, bool dynamic, float* v) {
    unsigned big = 0xffffffffu;
    if (fast) {
        big = 0;
#pragma unroll
        for (int i = 0; i < N; ++i) {
            v[i] = div_by(f[i], s, r);
            big = max(big, __float_as_uint(v[i]) & 0x7fffffffu);
        }
    }
    if (big >= 0x5f800000u) {  // 2^64, inf and NaN
#pragma unroll
        for (int i = 0; i < N; ++i) v[i] = div_rn(f[i], s);
    }
    if (dynamic) {
#pragma unroll
        for (int i = 0; i < N; ++i) v[i] = fmin_ieee(v[i], F::max_finite);
    }
}

// The saturating conversion of 8 quotients: two words of codes, element 0 in the low byte.
template <class F> __device__ __forceinline__ uint2 codes8(const float* v) {
    unsigned w[2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
        w[h] = (unsigned)to_fp8x2<F>(v[4 * h], v[4 * h + 1]) | ((unsigned)to_fp8x2<F>(v[4 * h + 2], v[4 * h + 3]) << 16);
    return make_uint2(w[0], w[1]);
}

// quotients() of N elements (8 or 1), converted and stored.
template <class F, int N>
__device__ __forceinline__ void quantize_store(unsigned char* __restrict__ dst, const float* f, float s, float r,
                                               bool fast, bool dynamic) {
    float v[N];
    quotients<F, N>(f, s, r, fast, dynamic, v);
    if constexpr (N == 8) __stcs(reinterpret_cast<uint2*>(dst), codes8<F>(v));
    else *dst = (unsigned char)__nv_cvt_float_to_fp8(v[0], __NV_SATFINITE, F::kind);
}

// n / d for n < 2^32: a shift where d is a power of two (d_log2 >= 0), else a 32-bit division.
__device__ __forceinline__ unsigned div_u32(unsigned n, unsigned d, int d_log2) {
    return d_log2 >= 0 ? n >> d_log2 : n / d;
}

// slot_mapping[token], int64 or int32.
__device__ __forceinline__ i64 load_slot(const void* slot_mapping, unsigned token, int slot64) {
    return slot64 ? static_cast<const long long*>(slot_mapping)[token] : (i64) static_cast<const int*>(slot_mapping)[token];
}

// A valid slot (0 <= slot < num_slots) as its cache block and offset in it: 32-bit arithmetic (a
// shift where block_size is a power of two) when every slot fits in 32 bits.
__device__ __forceinline__ void split_slot(i64 slot, const KVWriteArgs& a, i64& blk, i64& off) {
    if (a.num_slots <= 0xffffffffLL) {
        blk = div_u32((unsigned)slot, (unsigned)a.block_size, a.block_size_log2);
        off = (unsigned)slot - (unsigned)blk * (unsigned)a.block_size;
    } else {
        blk = slot / a.block_size;
        off = slot - blk * a.block_size;
    }
}

__device__ __forceinline__ unsigned team_max(unsigned m, int tpr_log2) {
    for (int o = 1; o < (1 << tpr_log2); o <<= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    return m;
}

template <typename T, class F, bool VEC>
__global__ void __launch_bounds__(KV_BLOCK)
kv_cache_write(const T* __restrict__ key, const T* __restrict__ value, unsigned char* __restrict__ key_cache,
               unsigned char* __restrict__ value_cache, const void* __restrict__ slot_mapping,
               const float* __restrict__ k_scale, const float* __restrict__ v_scale, float k_scale_arg,
               float v_scale_arg, float* __restrict__ k_scale_cache, float* __restrict__ v_scale_cache, KVWriteArgs a) {
    using U = Unit<T, VEC>;
    constexpr int UPL = KVUnits<VEC>::N;
    const bool is_v = blockIdx.y != 0;
    const T* x = is_v ? value : key;
    unsigned char* cache = is_v ? value_cache : key_cache;
    const i64 x_tok = is_v ? a.x_tok_v : a.x_tok_k, x_head = is_v ? a.x_head_v : a.x_head_k;

    const int tpr = 1 << a.tpr_log2;
    const int lane = threadIdx.x & (tpr - 1);
    const i64 row = (i64)blockIdx.x * (KV_BLOCK >> a.tpr_log2) + (threadIdx.x >> a.tpr_log2);
    const bool in_rows = row < a.rows;
    unsigned token = 0, head = 0;
    if (in_rows) {
        token = div_u32((unsigned)row, (unsigned)a.heads, a.heads_log2);
        head = (unsigned)row - token * (unsigned)a.heads;
    }
    const T* xr = x + (i64)token * x_tok + (i64)head * x_head;
    const int units = VEC ? a.head_dim >> 3 : a.head_dim;
    const int chunk = UPL * tpr;
    pdl_wait_then_release();  // no global access above this line

    // The row's first chunk, its slot and its static scale are loaded together: none of the three
    // addresses depends on another load (slot first, then x: 13.5 us at 4096 x 8 x 128 bf16, static).
    U raw[UPL];
#pragma unroll
    for (int k = 0; k < UPL; ++k) {
        const int c = k * tpr + lane;
        if (in_rows && c < units) raw[k].load(xr + (i64)c * U::N);
        else raw[k].clear();
    }
    const i64 slot = in_rows ? load_slot(slot_mapping, token, a.slot64) : -1;
    float s = 0.0f;
    if (!a.dynamic) {
        const float* sp = is_v ? v_scale : k_scale;
        s = sp ? sp[(i64)head * (is_v ? a.stride_v : a.stride_k)] : (is_v ? v_scale_arg : k_scale_arg);
    }
    const bool valid = in_rows && slot >= 0 && slot < a.num_slots;  // a hole (< 0) or a slot past the cache: skipped
    i64 blk = 0, off = 0;
    if (valid) split_slot(slot, a, blk, off);
    unsigned char* dst = cache + blk * a.c_block + off * a.c_off + (i64)head * a.c_head;

    if (a.dynamic) {
        unsigned m = 0;
        for (int base = 0; base < units; base += chunk) {  // the same trip count in every lane
            if (base > 0) {
#pragma unroll
                for (int k = 0; k < UPL; ++k) {
                    const int c = base + k * tpr + lane;
                    if (in_rows && c < units) raw[k].load(xr + (i64)c * U::N);
                    else raw[k].clear();
                }
            }
#pragma unroll
            for (int k = 0; k < UPL; ++k) m = max(m, raw[k].absmax());
        }
        m = team_max(m, a.tpr_log2);
        s = fmax_ieee(div_rn(__uint_as_float(m), F::max_finite), 1.0f / (F::max_finite * 512.0f));
        if (valid && lane == 0) {
            float* sc = is_v ? v_scale_cache : k_scale_cache;
            sc[blk * a.s_block + off * a.s_off + (i64)head * a.s_head] = s;
        }
    }
    if (!valid) return;  // no shuffle below
    const float r = rcp_rn(s);
    const bool fast = fast_div_ok(s);
    const bool one_chunk = units <= chunk;  // the row is still in raw
    for (int base = 0; base < units; base += chunk) {
#pragma unroll
        for (int k = 0; k < UPL; ++k) {
            const int c = base + k * tpr + lane;
            if (c < units) {
                if (base > 0 || (a.dynamic && !one_chunk)) raw[k].load(xr + (i64)c * U::N);
                float f[U::N];
                raw[k].floats(f);
                quantize_store<F, U::N>(dst + (i64)c * U::N, f, s, r, fast, a.dynamic);
            }
        }
    }
}

// quotients<F, 8>() of static scales then codes8<F>(), for 8 elements of x held as the raw 16-byte
// vectors: each pair converted as soon as its quotients are ready, so that only the raw vectors stay
// live and not 8 floats and 8 quotients (kv_cache_write_wide<bf16>: 32 registers on sm_90). div_by
// with r = 1 / s when fast; where a quotient is not below 2^64, or not fast, all 8 again with
// div_rn, unpacked again from the raw vectors.
template <typename T, class F>
__device__ __forceinline__ uint2 static_codes8(const uint4* raw, float s, float r, bool fast) {
    constexpr int E = Vec16<T>::N;
    unsigned big = 0xffffffffu;
    uint2 w = make_uint2(0u, 0u);
    if (fast) {
        big = 0;
#pragma unroll
        for (int l = 0; l < 8 / E; ++l) {
            float f[E];
            unpack16<T>(raw[l], f);
#pragma unroll
            for (int i = 0; i < E; i += 2) {
                const float q0 = div_by(f[i], s, r), q1 = div_by(f[i + 1], s, r);
                big = max(big, max(__float_as_uint(q0) & 0x7fffffffu, __float_as_uint(q1) & 0x7fffffffu));
                const int e = l * E + i;  // element index in the 8
                const unsigned c = (unsigned)to_fp8x2<F>(q0, q1) << (16 * ((e >> 1) & 1));
                if (e < 4) w.x |= c;
                else w.y |= c;
            }
        }
    }
    if (big >= 0x5f800000u) {  // 2^64, inf and NaN
        float f[8], q[8];
#pragma unroll
        for (int l = 0; l < 8 / E; ++l) unpack16<T>(raw[l], f + l * E);
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = div_rn(f[i], s);
        w = codes8<F>(q);
    }
    return w;
}

// kv_cache_write for static scales with wide stores (cupyquant.kv_cache.WRITE_PATH "wide"). A lane
// takes 16 contiguous elements of a row (two 16-byte loads of 16-bit x, four of float32) and writes
// their codes with one 16-byte store, so that each store instruction of a team writes whole 16-byte
// pieces and the team the row's D bytes at once (D = 128: 8 lanes, one 128-byte line). A block
// covers KV_BLOCK / team consecutive rows, and each of its load and store instructions covers them
// side by side. A lane's loads of x, its slot and its scale are issued before the first is used.
// One row a lane: two measured 0.87-1.00x one on an H200 (48 registers, 5 blocks an SM, against 32
// and 8 with 16-bit x). Needs D % 16 == 0 and D <= 32 * 16 (one pass of the fewest lanes, up to 32,
// that give each 16 elements), x rows and strides 16-byte aligned and both caches 16-byte aligned
// (so that every cache row of D bytes is). The bytes are kv_cache_write's (static_codes8 is
// quotients() and codes8() of 8 elements).
template <typename T, class F>
__global__ void __launch_bounds__(KV_BLOCK)
kv_cache_write_wide(const T* __restrict__ key, const T* __restrict__ value, unsigned char* __restrict__ key_cache,
                    unsigned char* __restrict__ value_cache, const void* __restrict__ slot_mapping,
                    const float* __restrict__ k_scale, const float* __restrict__ v_scale, float k_scale_arg,
                    float v_scale_arg, float* __restrict__ k_scale_cache, float* __restrict__ v_scale_cache,
                    KVWriteArgs a) {
    constexpr int N = 16;                   // elements a lane takes from a row: one 16-byte store
    constexpr int E = Vec16<T>::N;          // elements of x in one 16-byte load
    constexpr int LOADS = N / E;
    const bool is_v = blockIdx.y != 0;
    const T* x = is_v ? value : key;
    unsigned char* cache = is_v ? value_cache : key_cache;
    const i64 x_tok = is_v ? a.x_tok_v : a.x_tok_k, x_head = is_v ? a.x_head_v : a.x_head_k;
    const float* sp = is_v ? v_scale : k_scale;  // null: the scale by argument
    const i64 s_stride = is_v ? a.stride_v : a.stride_k;  // 0: one scale for every head

    const int tpr = 1 << a.tpr_log2;
    const int lane = threadIdx.x & (tpr - 1);
    const int teams = KV_BLOCK >> a.tpr_log2;
    const i64 row = (i64)blockIdx.x * teams + (threadIdx.x >> a.tpr_log2);
    const int chunks = a.head_dim >> 4;
    const bool in_rows = row < a.rows;
    const unsigned token = div_u32((unsigned)row, (unsigned)a.heads, a.heads_log2);
    const unsigned head = (unsigned)row - token * (unsigned)a.heads;
    const T* xr = x + (i64)token * x_tok + (i64)head * x_head + lane * N;
    pdl_wait_then_release();  // no global access above this line

    // The lane's 16 elements, the slot and the scale in flight together.
    uint4 v[LOADS];
#pragma unroll
    for (int l = 0; l < LOADS; ++l) v[l] = in_rows && lane < chunks ? ld16(xr + l * E) : make_uint4(0u, 0u, 0u, 0u);
    const i64 slot = in_rows ? load_slot(slot_mapping, token, a.slot64) : -1;
    const float s = sp ? sp[(i64)head * s_stride] : (is_v ? v_scale_arg : k_scale_arg);
    const bool valid = in_rows && slot >= 0 && slot < a.num_slots;  // a hole or a slot past the cache: skipped
    i64 blk = 0, off = 0;
    if (valid) split_slot(slot, a, blk, off);
    unsigned char* dst = cache + blk * a.c_block + off * a.c_off + (i64)head * a.c_head + lane * N;
    const float r = rcp_rn(s);
    const bool fast = fast_div_ok(s);
    if (lane >= chunks) return;
    if (valid) {  // two groups of 8, one store
        uint2 w[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) w[h] = static_codes8<T, F>(&v[h * LOADS / 2], s, r, fast);
        st16(dst, make_uint4(w[0].x, w[0].y, w[1].x, w[1].y));
    }
}

// Dequantize N elements (8: one 8-byte load; 1: one byte) and store them as OutT.
template <typename OutT, class F, int N>
__device__ __forceinline__ void dequantize_store(OutT* __restrict__ y, const unsigned char* __restrict__ q, float s,
                                                 bool nan_block) {
    float f[N];
    if (nan_block) {
#pragma unroll
        for (int i = 0; i < N; ++i) f[i] = __uint_as_float(0x7fffffffu);
    } else if constexpr (N == 8) {
        const uint2 b = __ldg(reinterpret_cast<const uint2*>(q));
        const unsigned w[2] = {b.x, b.y};
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            fp8x2_to_float2<F>((unsigned short)(w[i] & 0xffffu), f[4 * i], f[4 * i + 1]);
            fp8x2_to_float2<F>((unsigned short)(w[i] >> 16), f[4 * i + 2], f[4 * i + 3]);
        }
#pragma unroll
        for (int i = 0; i < N; ++i) f[i] = mul_rn(f[i], s);
    } else {
        f[0] = mul_rn(fp8_to_float<F>(q[0]), s);
    }
    if constexpr (N == 8) {
        constexpr int E = Vec16<OutT>::N;
#pragma unroll
        for (int i = 0; i < N / E; ++i) st16(y + i * E, pack16<OutT>(f + i * E));
    } else {
        y[0] = from_float<OutT>(f[0]);
    }
}

template <typename OutT, class F, bool VEC>
__global__ void __launch_bounds__(KV_BLOCK)
kv_cache_dequantize(const unsigned char* __restrict__ cache, const void* __restrict__ block_ids, OutT* __restrict__ y,
                    const float* __restrict__ scale, float scale_arg, const float* __restrict__ scale_cache, KVReadArgs a) {
    constexpr int N = VEC ? 8 : 1;
    pdl_wait_then_release();
    const int tpr = 1 << a.tpr_log2;
    const int lane = threadIdx.x & (tpr - 1);
    const i64 row = (i64)blockIdx.x * (KV_BLOCK >> a.tpr_log2) + (threadIdx.x >> a.tpr_log2);
    if (row >= a.rows) return;
    const unsigned i = (unsigned)row / (unsigned)a.rows_per_block;  // the output block
    const unsigned r = (unsigned)row - i * (unsigned)a.rows_per_block;  // the row within it
    const i64 id = a.ids64 ? static_cast<const long long*>(block_ids)[i] : (i64) static_cast<const int*>(block_ids)[i];
    const bool nan_block = id < 0 || id >= a.num_blocks;
    const unsigned head = a.hnd ? r / (unsigned)a.block_size : r % (unsigned)a.heads;
    float s = 0.0f;
    if (!nan_block) {
        if (a.dynamic) s = scale_cache[id * a.rows_per_block + r];
        else s = scale ? scale[(i64)head * a.scale_stride] : scale_arg;
    }
    const unsigned char* q = cache + (nan_block ? 0 : (id * a.rows_per_block + r) * a.head_dim);
    OutT* yr = y + row * a.head_dim;
    const int units = VEC ? a.head_dim >> 3 : a.head_dim;
    for (int c = lane; c < units; c += tpr) dequantize_store<OutT, F, N>(yr + (i64)c * N, q + (i64)c * N, s, nan_block);
}
