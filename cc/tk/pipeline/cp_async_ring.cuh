// A cp.async stage ring (sm_80+): blocks of data stream through STAGES slots of shared memory that
// the threads fill themselves with cp.async (tk::load_async). There are no semaphores: each use's
// copies are one commit group, cp.async.wait_group says when a thread's own copies have landed, and a
// barrier (the block's, or the kernel's for the threads that share the ring) makes them everyone's.
//
// Use n = 0, 1, 2, ... of the ring (cp_async_ring::n) takes slot n mod STAGES. Step n of a kernel's
// loop reads use n and fills use n + STAGES - 1, whose slot, (n - 1) mod STAGES, step n - 1 read. A
// step commits its group even where it has nothing to fill (an empty group), so that the groups
// committed after use n are known whatever the data:
//   prologue       fill uses 0 .. STAGES - 2, a group each (they are in slots 0 .. STAGES - 2);
//   step n, refill::before_wait (the slot it refills was released at the end of step n - 1):
//                  fill use n + STAGES - 1, commit;
//                  wait_group(STAGES - 1), barrier: use n has landed (only uses n + 1 .. n + STAGES - 1
//                  may be pending);
//                  read slot n mod STAGES;
//                  barrier (release): every thread is done with it before step n + 1 refills it;
//   step n, refill::after_wait (one barrier a step; one use fewer in flight):
//                  wait_group(STAGES - 2), barrier: use n has landed, and every thread is done with
//                  slot (n - 1) mod STAGES;
//                  fill use n + STAGES - 1, commit;
//                  read slot n mod STAGES.
// Groups committed before the prologue (e.g. a block's query rows) are older than every use: they
// have landed when use 0 has, and with refill::before_wait a wait right after the prologue (uses
// 0 .. STAGES - 2 pending) is for them alone. A block waits for all its copies (drain) before it
// exits or puts the slots to another use.
#pragma once
#include "../ops/memory/cp_async.cuh"

namespace tk {

// Where a step refills the slot that the step before it read: before the step's wait (a barrier at
// the end of each step releases the slot), or after the wait's barrier (which releases it).
enum class refill { before_wait, after_wait };

// The block-wide barrier (the default for a ring that all the block's threads fill and read).
struct sync_block {
  __device__ __forceinline__ void operator()() const { __syncthreads(); }
};

// The position of a kernel's loop in the ring: step n reads use n. A plain count; the slots are
// worked out from it where they are used (the kernel indexes its own arrays of shared tiles).
template <int STAGES_, refill ORDER_ = refill::before_wait> struct cp_async_ring {
  static constexpr int STAGES = STAGES_;
  static constexpr refill ORDER = ORDER_;
  static_assert(STAGES >= 2);
  // Groups that may still be pending once use n has landed (at the step's wait).
  static constexpr int IN_FLIGHT = ORDER == refill::before_wait ? STAGES - 1 : STAGES - 2;
  __device__ __forceinline__ static int slot(int n) { return n % STAGES; }  // the slot of use n (read)
  static constexpr int AHEAD = STAGES - 1;
  __device__ __forceinline__ static int fill_slot(int u) {  // the slot of use u >= AHEAD (filled)
    if constexpr (STAGES == 2) return slot(u - AHEAD) ^ 1;
    else return slot(u);
  }
};

// Ends a group: the copies this thread issued since the last commit (a use's, or data loaded before
// the ring's first use).
template <int S, refill O> __device__ __forceinline__ void commit(const cp_async_ring<S, O> &) { commit_group(); }

// Use n has landed for every thread that shares the ring (right after the prologue with
// refill::before_wait: the groups committed before it have): this thread's copies, then the
// barrier. A kernel that must order the copies for another proxy (wgmma reads shared memory through
// the async proxy) does so in `sync`, before its barrier.
template <int S, refill O, typename Sync = sync_block>
__device__ __forceinline__ void wait_full(const cp_async_ring<S, O> &, Sync sync = {}) {
  wait_group<cp_async_ring<S, O>::IN_FLIGHT>();
  sync();
}

// (refill::before_wait) Every thread that shares the ring is done reading slot n: step n + 1 may
// refill it.
template <int S, refill O, typename Sync = sync_block>
__device__ __forceinline__ void release(const cp_async_ring<S, O> &, Sync sync = {}) {
  static_assert(O == refill::before_wait, "with refill::after_wait the next wait_full releases the slot");
  sync();
}

// No copy of this thread is still landing (before the block exits, or reuses the slots).
template <int S, refill O> __device__ __forceinline__ void drain(const cp_async_ring<S, O> &) { wait_group<0>(); }

}  // namespace tk
