// sm90_async.cuh: Hopper (sm_90) data movement and synchronisation helpers of weight_sm90_gemm.cu and
// scaled_mm_sm90.cu:
// the async-proxy fence, mbarriers (CTA scope), the TMA load of a tensor-map box
// (cp.async.bulk.tensor), cp.async arrivals on an mbarrier, the warpgroup register split
// (setmaxnreg, sm_90a only), and the stmatrix / st.shared stores of the epilogue. Shared addresses are
// 32-bit shared-window addresses (__cvta_generic_to_shared). The cluster helpers (barrier.cluster,
// mapa, ld.shared::cluster, remote mbarrier arrivals) are in cluster.cuh.
#pragma once

#include "common.cuh"

// A CUtensorMap (cuTensorMapEncodeTiled: cupyquant/_launch.py tensor_map_2d), passed to a kernel by
// value (__grid_constant__), as TMA reads it.
struct alignas(64) TmaMap {
    unsigned long long w[16];
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// what cp.async and st.shared wrote (generic proxy) becomes visible to the wgmma's reads (async proxy)
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// initializes the mbarrier at bar to expect `count` arrivals a phase
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// spins until the phase of parity `parity` of the mbarrier at bar has completed
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
}
// one arrival on the mbarrier at bar
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(bar) : "memory");
}
// one arrival on the mbarrier at bar, and `bytes` of transactions (TMA) for its phase to wait for
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// 4 bytes from global src to shared dst, asynchronously (completion: cp_async_wait_all or mbar_arrive_cp_async)
__device__ __forceinline__ void cp_async4(unsigned dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}
// a 32-bit word of shared memory
__device__ __forceinline__ unsigned ld_shared_u32(unsigned addr) {
    unsigned v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
    return v;
}
// one arrival on bar once every cp.async this thread has issued so far has completed (no pending-count increment)
__device__ __forceinline__ void mbar_arrive_cp_async(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
// the box of the tensor map at (k c0, row c1) into this block's shared memory at dst, its bytes counted on bar
__device__ __forceinline__ void tma_load_2d(unsigned dst, const void* map, unsigned bar, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
                 "l"(map), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}
// the tensor map's descriptor into the constant cache ahead of its first TMA
__device__ __forceinline__ void prefetch_tensor_map(const void* map) { asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory"); }
// the box of the tensor map at (k c0, row c1) into the shared memory of every block of the cluster
// in `mask` (bit r: rank r), at the same offset dst in each, its bytes counted on each one's mbarrier
// at offset bar
__device__ __forceinline__ void tma_load_2d_multicast(unsigned dst, const void* map, unsigned bar, int c0, int c1, unsigned short mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
        "l"(map), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
        : "memory");
}
// the box of the tensor map at (column c0, row c1) stored from this block's shared memory at src
// (TMA; rows and columns outside the matrix are not written), in this thread's bulk group
__device__ __forceinline__ void tma_store_2d(const void* map, unsigned src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(map), "r"(c0), "r"(c1), "r"(src)
                 : "memory");
}
// closes this thread's bulk group of TMA stores
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// waits until this thread's TMA stores have read their shared memory (READ: may be reused) or
// have been written (all)
template <bool READ> __device__ __forceinline__ void bulk_wait_all() {
    if constexpr (READ) {
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    } else {
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    }
}
// 16 bytes to shared memory at addr
__device__ __forceinline__ void st_shared_u4(unsigned addr, unsigned x, unsigned y, unsigned z, unsigned w) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
}
// the mbarrier initializations of this block are visible to the cluster's other blocks (before a
// cluster barrier, ahead of their remote arrivals and multicast transactions)
__device__ __forceinline__ void fence_mbarrier_init_cluster() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// waits until every cp.async this thread has issued has completed
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// four 8 x 8 tiles of 16-bit values of a warp stored transposed (stmatrix .x4 .trans): lane k gives
// the address of row k % 8 of tile k / 8, v[i] holds the lane's pair of tile i
__device__ __forceinline__ void stmatrix_x4_trans(unsigned addr, const unsigned (&v)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3])
                 : "memory");
}
// four floats to shared memory at addr (16-byte aligned), one st.shared.v4
__device__ __forceinline__ void st_shared_f4(unsigned addr, float x, float y, float z, float w) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(x), "f"(y), "f"(z), "f"(w) : "memory");
}
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// the warpgroup's registers a thread lowered to N (a producer gives registers back) ...
template <int N> __device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N)); }
// ... or raised to N (the compute warpgroups take them)
template <int N> __device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N)); }
#endif
