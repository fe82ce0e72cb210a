// A warp-specialized kernel from parts. The template owns what every such kernel shares: the
// semaphores' set-up, the roles (roles.cuh: one producer warpgroup, CONSUMERS consumer warpgroups,
// their register budgets) and, in a persistent kernel, the tile queue (scheduler.cuh) through which
// one warp announces each tile to the loader and the consumers. The kernel supplies its parts as the
// members of a struct K, of which each thread makes one object (its fields carry a role's state
// from tile to tile, e.g. its ring positions):
//
//   using Roles = tk::roles<...>;   int wg;          the roles, and this thread's warpgroup
//   void init();                                     one thread: init() of the kernel's own rings
//
// persistent(k): a grid of about one block per SM works through k.tiles tiles (scheduler.cuh):
//   static constexpr int CLUSTER;                    (optional; 1 if absent) blocks per cluster, which
//                                                    fill each other's rings (ring.cuh): the set-up
//                                                    waits for the whole cluster's, and the loader,
//                                                    after its last tile, for drain()
//   void drain();                                    (CLUSTER > 1) the loader: drain_empty of its rings
//   tile_queue<Tile> queue();                        the announcements' slots (in K's shared memory)
//   int tiles;                                       the tile count: a Tile with t >= tiles ends
//   Tile schedule(int n, int slot);                  the scheduler warp (32 lanes): the block's n-th
//                                                    tile, before it is announced in `slot`
//   void load(int slot, Release release);            the loader (one thread): the loads of the tile
//                                                    announced in `slot`; release() frees the slot
//   void start();                                    each consumer thread, before the first tile
//   void consume(int slot, Release release);         each consumer warpgroup, the same tile; release()
//                                                    (each warp, converged) frees the slot
//   void finish();                                   each consumer thread, after the last tile
// One thread of the producer warpgroup loads and one warp schedules; the other two warps leave.
//
// strided(k): a grid of about one block per SM; block b takes tiles b, b + G, b + 2G, ... (G blocks, k.tiles
// tiles), each role walking them by itself: no scheduler and no queue (tiles of one cost, which a static
// order balances; the roles keep only the tile's number):
//   void load(int t);                                the loader (one thread): tile t's loads
//   void start();  void consume(int t);  void finish();   each consumer warpgroup, as in persistent
//
// single(k): one block per tile, its coordinates from blockIdx:
//   void before_sync();                              every thread, before the block's first barrier
//                                                    (e.g. the consumers' own copies)
//   void produce();  void consume();                 the producer warpgroup; each consumer warpgroup
//
// The semaphores that the parts wait on and arrive at belong to rings (ring.cuh), whose phases are
// worked out there; a part names ring positions, never parities or slot arithmetic. Views of shared
// memory (rings, the queue) are formed where they are used, from the shared struct, never held in a
// variable across a loop: then each semaphore's address is the shared base plus a constant offset, in
// uniform registers; held, its pointers are formed in full, in per-thread registers, inside the main
// loops.
#pragma once
#include "roles.cuh"
#include "scheduler.cuh"

namespace tk {

template <typename K> constexpr int cluster_of() {
  if constexpr (requires { K::CLUSTER; }) return K::CLUSTER;
  else return 1;
}

template <typename K> __device__ __forceinline__ void persistent(K &k) {
  using R = typename K::Roles;
  if (threadIdx.x == 0) {  // the queue's full: the scheduler's lane 0; empty: each consumer warp, the loader
    k.init();
    init(k.queue().ring, 1, R::CONSUMERS * 4 + 1);
    fence_barrier_init();
  }
  if constexpr (cluster_of<K>() > 1) cluster_sync();
  else __syncthreads();

  if (k.wg == R::PRODUCER) {
    R::enter_producer();
    if (R::warp() == 1) {  // the scheduler
      for (int n = 0;; n++) {
        const ring_use<2> at(n);
        wait_empty(k.queue().ring, at);
        const auto x = k.schedule(n, at.slot);
        announce_tile(k.queue(), at, x);
        if (x.t >= k.tiles) return;
      }
    }
    if (threadIdx.x != R::CONSUMERS * 128) return;
    for (int n = 0;; n++) {  // the loader
      const ring_use<2> at(n);
      if (!wait_tile(k.queue(), at, k.tiles)) break;
      k.load(at.slot, [&] { arrive_empty(k.queue().ring, at); });
    }
    if constexpr (cluster_of<K>() > 1) k.drain();
    return;
  }

  R::enter_consumer();
  k.start();
  for (int n = 0;; n++) {
    const ring_use<2> at(n);
    if (!wait_tile(k.queue(), at, k.tiles)) break;
    k.consume(at.slot, [&] {
      if (laneid() == 0) arrive_empty(k.queue().ring, at);
    });
  }
  k.finish();
}

// strided's grid on the host: a block per SM, or one per tile where there are fewer (the walk's last
// step may overshoot T by G, so T + 2G stays below INT_MAX).
inline cudaError_t strided_blocks(long long tiles, unsigned &blocks) {
  int dev = 0, sms = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  if (cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev); e != cudaSuccess) return e;
  if (tiles + 2LL * sms >= INT_MAX) return cudaErrorInvalidValue;
  blocks = unsigned(tiles < sms ? tiles : sms);
  return cudaSuccess;
}

template <typename K> __device__ __forceinline__ void strided(K &k) {
  using R = typename K::Roles;
  if (threadIdx.x == 0) {
    k.init();
    fence_barrier_init();
  }
  __syncthreads();
  if (k.wg == R::PRODUCER) {
    R::enter_producer();
    if (threadIdx.x != R::CONSUMERS * 128) return;
    for (int t = blockIdx.x; t < k.tiles; t += gridDim.x) k.load(t);
    return;
  }
  R::enter_consumer();
  k.start();
  for (int t = blockIdx.x; t < k.tiles; t += gridDim.x) k.consume(t);
  k.finish();
}

template <typename K> __device__ __forceinline__ void single(K &k) {
  using R = typename K::Roles;
  if (threadIdx.x == 0) {
    k.init();
    fence_barrier_init();
  }
  k.before_sync();
  __syncthreads();
  if (k.wg == R::PRODUCER) {
    R::enter_producer();
    k.produce();
    return;
  }
  R::enter_consumer();
  k.consume();
}

}  // namespace tk
