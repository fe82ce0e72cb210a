// A persistent tile scheduler. A grid of G <= T blocks (about one per SM) works through tiles
// 0 .. T-1, each block taking its k-th tile as
//   t_0 = blockIdx.x,   t_k = G + atomicAdd(counter, 1)  (k >= 1; counter = 0 at the launch)
// so every t < T goes to exactly one block, the next free block takes it (tiles that differ in
// length balance themselves), and a block stops at its first t >= T (the counter only grows: no
// tile is left). Each block overshoots once, so t < T + G: launch with T + 2 G < INT_MAX.
// Within a block one warp, the scheduler, takes the tiles and announces each through a tile_queue
// of SLOTS slots (a ring, ring.cuh, whose slots hold the kernel's description of a tile, Tile, with
// its number in field t; t >= T announces the end) to the warps that work on them. It runs up to
// SLOTS tiles ahead, so that a tile's loads start while the one before it finishes:
//   scheduler:  for (int k = 0;; k++) { const ring_use<SLOTS> at(k); wait_empty(q.ring, at);
//               int t = next_tile(counter, k); ... announce_tile(q, at, x); if (t >= T) return; }
//   workers:    for (int k = 0;; k++) { const ring_use<SLOTS> at(k); if (!wait_tile(q, at, T)) break;
//               ... q.tile[at.slot] ...; arrive_empty(q.ring, at); }
//   (init(q.ring, 1, workers): the scheduler's lane 0 fills a slot, every worker frees it.)
// A kernel with one tile per block (a grid of T blocks, t = blockIdx.x, the order chosen by the
// tile's coordinates) needs none of this.
#pragma once
#include "ring.cuh"

namespace tk {

// The announcements: a ring of SLOTS slots and the array of SLOTS Tiles in shared memory that it
// guards (a view, like ring).
template <typename Tile, int SLOTS = 2> struct tile_queue {
  tk::ring<SLOTS> ring;  // (qualified: the member takes the name)
  Tile (&tile)[SLOTS];
};

// The k-th tile of this block (the whole warp calls it, lane 0 takes it from the counter). The
// counter's address is passed by reference, so that a kernel parameter is read where it is used
// rather than held in a register across the loop (a producer's registers are few).
__device__ __forceinline__ int next_tile(int *const &counter, int k) {
  int t = blockIdx.x;
  if (k > 0 && laneid() == 0) t = gridDim.x + atomicAdd(counter, 1);
  return __shfl_sync(~0u, t, 0);
}

// The scheduler (the whole warp, converged): announces Tile x in the slot of use `at`, which it has
// waited to be empty (wait_empty(q.ring, at)).
template <typename Tile, int SLOTS>
__device__ __forceinline__ void announce_tile(const tile_queue<Tile, SLOTS> &q, std::type_identity_t<ring_use<SLOTS>> at,
                                              const Tile &x) {
  if (laneid() == 0) {
    q.tile[at.slot] = x;
    arrive_full(q.ring, at);
  }
}

// A worker: waits for the announcement of use `at`; false at the end.
template <typename Tile, int SLOTS>
__device__ __forceinline__ bool wait_tile(const tile_queue<Tile, SLOTS> &q, std::type_identity_t<ring_use<SLOTS>> at, int tiles) {
  wait_full(q.ring, at);
  return q.tile[at.slot].t < tiles;
}

}  // namespace tk
