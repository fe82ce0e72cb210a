// A stage ring: a producer hands data to consumers through STAGES slots of shared memory, slot s
// guarded by two semaphores (mbarriers):
//   full[s]   completes a phase when the slot holds new data (the producer's arrivals, and the
//             bytes of its TMA loads);
//   empty[s]  completes a phase when every consumer is done with it.
// Use n = 0, 1, 2, ... of the ring (ring_use) takes slot s = n mod STAGES in round r = n / STAGES,
// and each semaphore completes one phase per round. mbarrier waits name the parity of the phase:
//   consumer of use n:  wait(full[s],  r & 1)
//   producer of use n:  wait(empty[s], (r & 1) ^ 1)   (round r - 1's release)
// For r = 0 the producer's wait asks for the phase before a fresh barrier's first, which counts as
// complete: the first STAGES uses pass at once. The empty waits keep the producer at most STAGES
// uses ahead, so a parity never stands for two rounds.
#pragma once
#include <type_traits>

#include "../ops/memory/mbarrier.cuh"

namespace tk {

// Use n of a ring: its slot and phase parity, worked out where it is made (so that a kernel decides
// where that arithmetic goes, e.g. before a wait rather than after it). Made from the use count
// (kernels keep the plain count n across their loops: often it is their step counter already).
template <int STAGES> struct ring_use {
  static_assert(STAGES >= 1);
  int slot, phase;
  __device__ __forceinline__ ring_use(int n) : slot(n % STAGES), phase((n / STAGES) & 1) {}
  __device__ __forceinline__ ring_use(int s, int ph) : slot(s), phase(ph) {}
};

// A position that steps through the ring (++): the count and its slot, carried along together, so
// that the use before a step (still to be released) keeps its slot rather than having it worked out
// again. It converts to its ring_use where it is used.
template <int STAGES> struct ring_pos {
  int n, slot;
  __device__ __forceinline__ explicit ring_pos(int uses) : n(uses), slot(uses % STAGES) {}
  __device__ __forceinline__ operator ring_use<STAGES>() const { return {slot, (n / STAGES) & 1}; }
  __device__ __forceinline__ ring_pos &operator++() {
    slot = ++n % STAGES;
    return *this;
  }
  __device__ __forceinline__ ring_pos operator++(int) {
    const ring_pos old = *this;
    ++*this;
    return old;
  }
};

// The ring's semaphores, full[s] and empty[s] of slot s, in two arrays of shared memory that the
// kernel declares (semaphore x_full[STAGES], x_empty[STAGES]). A view rather than a struct that
// holds them: through a struct member the addresses are formed from the struct's base, which the
// compiler then keeps in a register and reuses; from the kernel's own arrays they are a base and an
// offset each, as in a hand-written kernel. Buffers filled and freed separately but in step (K and
// V of one key block) take a ring each, at the same positions.
template <int STAGES_> struct ring {
  static constexpr int STAGES = STAGES_;
  static_assert(STAGES >= 1);
  semaphore *fulls, *empties;  // [STAGES] each
  __device__ __forceinline__ semaphore &full(ring_use<STAGES> u) const { return fulls[u.slot]; }
  __device__ __forceinline__ semaphore &empty(ring_use<STAGES> u) const { return empties[u.slot]; }
};

// One thread: full_arrivals per phase of each full semaphore (plus the TMA bytes announced on it),
// empty_arrivals per phase of each empty one; then fence_barrier_init and a block-wide barrier. The
// second form sets up rings that move in step, slot by slot.
template <int S> __device__ __forceinline__ void init(const ring<S> &r, int full_arrivals, int empty_arrivals) {
#pragma unroll
  for (int s = 0; s < S; s++) {
    init(r.fulls[s], full_arrivals);
    init(r.empties[s], empty_arrivals);
  }
}
template <int S>
__device__ __forceinline__ void init(const ring<S> &a, const ring<S> &b, int full_arrivals, int empty_arrivals) {
#pragma unroll
  for (int s = 0; s < S; s++) {
    init(a.fulls[s], full_arrivals);
    init(b.fulls[s], full_arrivals);
    init(a.empties[s], empty_arrivals);
    init(b.empties[s], empty_arrivals);
  }
}

// (The use is not deduced: a use count or a ring_pos converts, wait_full(r, n).)
template <int S> __device__ __forceinline__ void wait_full(const ring<S> &r, std::type_identity_t<ring_use<S>> u) {
  wait(r.full(u), u.phase);
}
template <int S> __device__ __forceinline__ void wait_empty(const ring<S> &r, std::type_identity_t<ring_use<S>> u) {
  wait(r.empty(u), u.phase ^ 1);
}
template <int S> __device__ __forceinline__ void arrive_full(const ring<S> &r, std::type_identity_t<ring_use<S>> u) {
  arrive(r.full(u));
}
template <int S> __device__ __forceinline__ void arrive_empty(const ring<S> &r, std::type_identity_t<ring_use<S>> u) {
  arrive(r.empty(u));
}

// A ring whose slots the blocks of a cluster fill together (each block's slot s receives loads that
// other blocks issue, multicast): a slot may be refilled only when the consumers of every block that
// receives the load are done with it, so each consumer frees slot s in its own block and in the
// other blocks (init: empty_arrivals counts the consumers of all of them), and a producer's block
// outlives the other blocks' last arrivals on its semaphores: after its last use n - 1 it waits
// for the release of every slot (drain_empty).
template <int S>
__device__ __forceinline__ void arrive_empty_cluster(const ring<S> &r, std::type_identity_t<ring_use<S>> u, unsigned blocks) {
  arrive(r.empty(u));
  const unsigned self = cluster_rank();
  for (unsigned d = 1; d < blocks; d++) arrive_remote(r.empty(u), (self + d) % blocks);
}
template <int S> __device__ __forceinline__ void drain_empty(const ring<S> &r, int n) {
#pragma unroll
  for (int i = 0; i < S; i++) wait_empty(r, n + i);
}

// A semaphore that completes one phase in the kernel's whole life (operands loaded once, results
// handed over once): its waiters wait for that first phase.
__device__ __forceinline__ void wait_once(semaphore &s) { wait(s, 0); }

// The buffer of use n of N buffers taken in turn (a ring without semaphores, whose turns another
// barrier orders).
template <int N> __device__ __forceinline__ int buffer_of(int n) { return ring_use<N>(n).slot; }

}  // namespace tk
