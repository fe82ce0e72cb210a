// mbarrier semaphores (sm_90): a 64-bit shared-memory barrier that completes a phase when its
// expected arrivals and expected transaction bytes (from TMA) have all come in.
#pragma once
#include "cp_async.cuh"

namespace tk {

struct semaphore {
  uint64_t bar;
};

__device__ __forceinline__ void init(semaphore &s, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(&s.bar)), "r"(arrivals) : "memory");
}
// Make initialized barriers visible to the async proxy (TMA) and the other threads' views.
__device__ __forceinline__ void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

__device__ __forceinline__ void arrive(semaphore &s) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(&s.bar)) : "memory");
}
// Arrive and announce `bytes` of TMA transactions that will complete this phase.
__device__ __forceinline__ void arrive_expect_bytes(semaphore &s, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(&s.bar)), "r"(bytes) : "memory");
}
// Announce `bytes` of TMA transactions without arriving (arrive separately, e.g. after issuing the
// copies); the phase completes as with arrive_expect_bytes.
__device__ __forceinline__ void expect_bytes(semaphore &s, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(&s.bar)), "r"(bytes) : "memory");
}
// Arrive once every cp.async this thread has issued so far has landed (the arrival is one of those
// init counted: .noinc). The copies' writes are then visible to the threads that wait for the phase,
// through the generic proxy (wgmma, an async-proxy reader, needs fence.proxy.async after the wait).
__device__ __forceinline__ void arrive_copies(semaphore &s) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(&s.bar)) : "memory");
}
// Block until the phase with this parity (0 or 1) has completed.
__device__ __forceinline__ void wait(semaphore &s, int parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(smem_addr(&s.bar)),
      "r"(parity)
      : "memory");
}

// Thread-block clusters (sm_90): blocks launched together on neighbouring SMs, each of which can
// arrive on the others' semaphores and receive their TMA loads (multicast).
// This block's rank in its cluster.
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// Every thread of every block of the cluster (a block-wide barrier across the cluster): what each
// wrote before (semaphore initializations included, after fence_barrier_init) is visible to all.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// Arrive on the semaphore at the same place in the shared memory of the cluster's block `rank`. With
// the default (release at the block's scope) ordering: a release to the cluster's scope costs a
// MEMBAR.ALL.GPU before each arrival, and a consumer that frees a slot has only read it (its reads
// are done: nothing of its needs to be made visible).
__device__ __forceinline__ void arrive_remote(semaphore &s, unsigned rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_addr(&s.bar)), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}

}  // namespace tk
