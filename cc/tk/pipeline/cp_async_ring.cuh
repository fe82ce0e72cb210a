// A cp.async stage ring (sm_80+): blocks of data stream through STAGES slots of shared memory that
// the threads fill themselves with cp.async (tk::load_async). No semaphores: a use's copies are one
// commit group, cp.async.wait_group tells a thread that its own copies have landed, and a barrier (the
// block's, or that of the threads that share the ring) makes them everyone's.
//
// Use u = 0, 1, 2, ... of the ring lives in slot u mod STAGES. Step n of a kernel's loop reads use n
// and fills use n + AHEAD (AHEAD = STAGES - 1), whose slot, (n - 1) mod STAGES, step n - 1 read. Every
// step commits a group, an empty one where it has nothing to fill, so that the groups committed after
// use n are known whatever the data:
//   prologue   uses 0 .. AHEAD - 1, a group each (in slots 0 .. AHEAD - 1);
//   step n, refill::before_wait:
//              fill use n + AHEAD, commit;
//              wait_full: wait_group(AHEAD) (only uses n + 1 .. n + AHEAD may be pending), barrier;
//              read slot n mod STAGES;
//              release: barrier (every thread is done with the slot before step n + 1 refills it);
//   step n, refill::after_wait (one barrier a step, one use fewer in flight):
//              wait_full: wait_group(AHEAD - 1), barrier (which also says that every thread is done
//              with slot (n - 1) mod STAGES);
//              fill use n + AHEAD, commit;
//              read slot n mod STAGES.
// Groups committed before the prologue (a block's query rows) are older than every use: they have
// landed once use 0 has, and with refill::before_wait a wait_full right after the prologue is for them
// alone. drain: all of a thread's copies have landed (before the block exits or reuses the slots).
//
// The ring holds no state. A kernel keeps its step count n (often its loop counter already) and
// writes its prologue and steps as above, `if (there is a block) fill it; commit(ring);`, its own
// copies in place: a prologue that took them as a callback would change the order in which the
// compiler inlines the kernel's code, and with it the kernel's machine code.
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

template <int STAGES_, refill ORDER_ = refill::before_wait> struct cp_async_ring {
  static constexpr int STAGES = STAGES_, AHEAD = STAGES - 1;
  static constexpr refill ORDER = ORDER_;
  static_assert(STAGES >= 2);
  // Groups that may still be pending once use n has landed (at step n's wait).
  static constexpr int IN_FLIGHT = ORDER == refill::before_wait ? AHEAD : AHEAD - 1;
  // The slot of use u (u >= 0).
  __device__ __forceinline__ static int slot(int u) { return u % STAGES; }
  // The same for a use u >= AHEAD that a step fills, from the use the kernel works out anyway (the
  // compiler then shares the sum). In a ring of two: the slot other than that of use u - 1, which the
  // step reads (the compiler derives it from the read slot).
  __device__ __forceinline__ static int fill_slot(int u) {
    if constexpr (STAGES == 2) return slot(u - AHEAD) ^ 1;
    else return slot(u);
  }
};

// Ends a group: the copies this thread issued since the last commit (a use's, or data loaded before
// the prologue).
template <int S, refill O> __device__ __forceinline__ void commit(const cp_async_ring<S, O> &) { commit_group(); }

// Use n has landed for every thread that shares the ring (right after the prologue with
// refill::before_wait: the groups committed before it have): this thread's copies, then the barrier
// `sync`. A kernel that must order the copies for another proxy (wgmma reads shared memory through
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

// All of this thread's copies have landed (before the block exits, or puts the slots to another use).
template <int S, refill O> __device__ __forceinline__ void drain(const cp_async_ring<S, O> &) { wait_group<0>(); }

}  // namespace tk
