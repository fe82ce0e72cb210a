// Producer/consumer roles of a warp-specialized block: CONSUMERS consumer warpgroups (0 ..
// CONSUMERS - 1) do the math, one producer warpgroup (the last, CONSUMERS) loads, schedules and
// writes out. The producer needs few registers and the consumers many, so each role resets its
// per-thread budget with setmaxnreg on entry (the producer gives, the consumers take). The kernel is
// launched with THREADS threads and __launch_bounds__(THREADS, 1): each thread starts with
// LAUNCH_REGS = 65536 / THREADS registers rounded down to a multiple of 8 (168 for three warpgroups),
// and setmaxnreg.inc only takes what setmaxnreg.dec gave back to the block (a consumer asking for more
// waits forever), so
//   PRODUCER_REGS + CONSUMERS * CONSUMER_REGS <= WARPGROUPS * LAUNCH_REGS
// with each budget a multiple of 8 in [24, 256]. The kernel tests its warpgroup against PRODUCER with
// the group number it keeps anyway (a second threadIdx.x / 128 is not always merged with the first).
#pragma once
#include "../ops/warpgroup/wgmma.cuh"

namespace tk {

template <int CONSUMERS_, int PRODUCER_REGS, int CONSUMER_REGS> struct roles {
  static constexpr int CONSUMERS = CONSUMERS_, WARPGROUPS = CONSUMERS + 1, THREADS = 128 * WARPGROUPS;
  static constexpr int PRODUCER = CONSUMERS;  // the producer's warpgroup
  static_assert(CONSUMERS >= 1);
  static_assert(PRODUCER_REGS % 8 == 0 && PRODUCER_REGS >= 24 && PRODUCER_REGS <= 256);
  static_assert(CONSUMER_REGS % 8 == 0 && CONSUMER_REGS >= 24 && CONSUMER_REGS <= 256);
  static constexpr int LAUNCH_REGS = 65536 / THREADS / 8 * 8 < 256 ? 65536 / THREADS / 8 * 8 : 256;
  static_assert(PRODUCER_REGS + CONSUMERS * CONSUMER_REGS <= WARPGROUPS * LAUNCH_REGS,
                "the budgets exceed the registers the block is launched with");

  // The first thing each role does (the whole warpgroup, converged).
  __device__ __forceinline__ static void enter_producer() { warpgroup::decrease_registers<PRODUCER_REGS>(); }
  __device__ __forceinline__ static void enter_consumer() { warpgroup::increase_registers<CONSUMER_REGS>(); }
  // This warp's place in its warpgroup, 0..3 (in the producer: which of its tasks it does).
  __device__ __forceinline__ static int warp() { return warpid() % 4; }
};

}  // namespace tk
