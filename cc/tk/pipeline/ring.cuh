// A stage ring: a producer hands data to consumers through STAGES slots of shared memory, slot s
// guarded by two semaphores (mbarriers):
//   full[s]   completes a phase when the slot holds new data (the producer's arrivals, and the
//             bytes of its TMA loads);
//   empty[s]  completes a phase when every consumer is done with it.
// Use n = 0, 1, 2, ... of the ring (ring_pos) takes slot s = n mod STAGES in round r = n / STAGES,
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

// Use n of a ring of STAGES slots, and its slot. Kernels keep the plain count n across their outer
// loops (often their step counter already) and make positions from it where they use the ring; in
// a loop that steps one position (++), the slot is carried along, so that a copy made before ++
// (the previous use, still to be released) keeps its slot instead of having it worked out again.
template <int STAGES> struct ring_pos {
  static_assert(STAGES >= 1);
  int n, s;
  __device__ __forceinline__ ring_pos(int uses = 0) : n(uses), s(uses % STAGES) {}
  __device__ __forceinline__ int slot() const { return s; }
  __device__ __forceinline__ int phase() const { return (n / STAGES) & 1; }
  __device__ __forceinline__ ring_pos &operator++() {
    s = ++n % STAGES;
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
  using pos = ring_pos<STAGES>;
  semaphore *fulls, *empties;  // [STAGES] each
  __device__ __forceinline__ semaphore &full(pos at) const { return fulls[at.slot()]; }
  __device__ __forceinline__ semaphore &empty(pos at) const { return empties[at.slot()]; }
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

// (The position is not deduced: a use count converts, wait_full(r, n).)
template <int S> __device__ __forceinline__ void wait_full(const ring<S> &r, std::type_identity_t<ring_pos<S>> at) {
  wait(r.full(at), at.phase());
}
template <int S> __device__ __forceinline__ void wait_empty(const ring<S> &r, std::type_identity_t<ring_pos<S>> at) {
  wait(r.empty(at), at.phase() ^ 1);
}
template <int S> __device__ __forceinline__ void arrive_full(const ring<S> &r, std::type_identity_t<ring_pos<S>> at) {
  arrive(r.full(at));
}
template <int S> __device__ __forceinline__ void arrive_empty(const ring<S> &r, std::type_identity_t<ring_pos<S>> at) {
  arrive(r.empty(at));
}

}  // namespace tk
