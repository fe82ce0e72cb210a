// Thread-block clusters (sm_90 and newer): the blocks of a cluster run at once on one GPC and may read
// each other's shared memory (distributed shared memory). A kernel that uses these is launched with a
// cluster dimension (cudaLaunchAttributeClusterDimension); before sm_90 they compile to nothing and
// must not be reached.
#pragma once
#include "../../common/base.cuh"

namespace tk {

// This block's rank in its cluster (0 .. blocks of the cluster - 1).
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
#endif
  return r;
}

// Every thread of every block of the cluster waits here for all the others; the shared-memory writes
// before it (of any block) are visible to the reads after it (release / acquire at cluster scope). A
// block whose shared memory others read must not exit before they have passed a second one.
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

// The address of the same shared-memory location as `local` (this block's) in block `rank` of the
// cluster: a generic pointer that plain loads read through.
template <typename T> __device__ __forceinline__ const T *cluster_map(const T *local, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint64_t remote;
  asm volatile("mapa.u64 %0, %1, %2;\n" : "=l"(remote) : "l"(reinterpret_cast<uint64_t>(local)), "r"(rank));
  return reinterpret_cast<const T *>(remote);
#else
  return local;
#endif
}

}  // namespace tk
