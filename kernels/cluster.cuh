// cluster.cuh: thread-block clusters (compute capability 9.0 and newer), shared by the K splits of
// weight_decode.cu and weight_sm90_gemm.cu and by scaled_mm_sm90.cu's TMA multicast.
#pragma once

#include "common.cuh"

// A barrier over the cluster's blocks (release / acquire: the shared-memory stores before it are
// visible to the loads after it), this block's rank, another block's shared address (mapa), 16- or
// 4-byte loads from it (distributed shared memory), and an arrival on another block's mbarrier.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cluster_sync_all() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The last barrier of a cluster's K split, which only keeps each block's shared memory alive until
// the others have read it: no release (a release at cluster scope is a MEMBAR.ALL.GPU in the SASS,
// which would wait for this thread's global stores of y). Every load from another block's shared
// memory has been consumed (summed, and the sum stored) before the arrive, so it has completed.
__device__ __forceinline__ void cluster_sync_exit() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;" ::: "memory");
}
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ unsigned map_shared_rank(unsigned addr, unsigned rank) {
    unsigned d;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(d) : "r"(addr), "r"(rank));
    return d;
}
__device__ __forceinline__ float4 ld_shared_cluster_f4(unsigned addr) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ float ld_shared_cluster_f32(unsigned addr) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
    return v;
}
// one arrival on the mbarrier at bar, a shared::cluster address (map_shared_rank), with the default
// CTA-scope release: a cluster-scope one is a MEMBAR.ALL.GPU in the SASS, and what it would order
// (the arriving warp's wgmma reads of its own slot) has already completed (wgmma.wait_group)
__device__ __forceinline__ void mbar_arrive_cluster(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(bar) : "memory");
}
#endif
