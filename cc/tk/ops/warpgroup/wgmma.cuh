// Warpgroup (4 consecutive warps) matrix products on wgmma (sm_90a), accumulating in fp32 registers.
// Each warp of the group holds its 16 rows of the 64-row accumulator as an rt_fl<16, N>: the
// register order of wgmma's accumulator fragment is exactly that of a row-layout register tile.
//   mma_ABt(d, A smem [64 x K], B smem [N x K])       d (+)= A B^T   (both K-major; bf16, fp16 or fp8 e4m3)
//   mma_AB (d, A regs rt<T,16,K>, B smem [K x N])     d (+)= A B     (B N-major, e.g. V in P V)
//   mma_ABt(d, A regs rt<T,16,K>, B smem [N x K])     d (+)= A B^T   (B K-major; N one wgmma's width)
//   mma_AtB(d, A smem [K x 64], B smem [K x N])        d (+)= A^T B   (A M-major, B N-major)
// N is 32, 64, 128 or 256, one wgmma per k-step, or a sum of them (192 = 128 + 64, 320 = 256 + 64:
// one wgmma per part, each on its columns of d and of B).
#pragma once
#include "../../types/rt.cuh"
#include "../../types/st.cuh"
#include "../memory/cp_async.cuh"
#include "wgmma_asm.cuh"

namespace tk::warpgroup {

__device__ __forceinline__ int groupid() { return threadIdx.x / 128; }
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Tie a register tile to this point of the program: the compiler may not move its reads or writes
// across it (use after wait<N>() for tiles that in-flight wgmmas read or write).
template <RegisterTile RT> __device__ __forceinline__ void fence_registers(RT &t) {
#pragma unroll
  for (int i = 0; i < RT::height; i++)
#pragma unroll
    for (int j = 0; j < RT::width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        auto &d = t.tiles[i][j].data[k];
        if constexpr (sizeof(d) == 8) {  // float pair: "+f" (a bit cast to "+r" would read the
          asm volatile("" : "+f"(d.x), "+f"(d.y)::"memory");  // registers early: ptxas then waits)
        } else {
          asm volatile("" : "+r"(*reinterpret_cast<uint32_t *>(&d))::"memory");
        }
      }
}
// Make this thread's ordinary writes to shared memory visible to wgmma and TMA (the async proxy);
// then synchronize the writers with the warpgroups that read.
__device__ __forceinline__ void fence_shared_writes() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// setmaxnreg: move registers from the producer warpgroup to the consumers.
template <int R> __device__ __forceinline__ void increase_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R> __device__ __forceinline__ void decrease_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}

// Shared-memory matrix descriptor of a 128-byte-swizzled operand. The operands of one product's
// k-steps differ only in their start address, a compile-time offset from the tile's: at(bytes) adds
// it to the descriptor's low word (the 14-bit start-address field, in 16-byte units, cannot carry:
// shared memory is below 256 KB), so that each wgmma costs one add, not a descriptor built anew.
struct descriptor {
  uint32_t lo, hi;
  __device__ __forceinline__ descriptor(uint32_t addr, uint32_t lbo, uint32_t sbo)
      : lo(((addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16)), hi((sbo >> 4) | (1u << 30)) {}
  __device__ __forceinline__ uint64_t at(uint32_t bytes) const { return (uint64_t(hi) << 32) | (lo + (bytes >> 4)); }
};
// K-major operand: tile rows are M (or N), columns are K; k_offset(k): the 16 columns from k on.
template <SharedTile ST> __device__ __forceinline__ descriptor k_major(const ST &t) {
  static_assert(ST::panel_cols * sizeof(typename ST::dtype) == 128, "wgmma tiles use full 128-byte panels");
  return descriptor(smem_addr(t.panel(0)), 16, 1024);  // 8-row groups are 1024 bytes apart
}
template <SharedTile ST> constexpr uint32_t k_offset(int k) {
  return (k / ST::panel_cols) * ST::panel_bytes + (k % ST::panel_cols) * sizeof(typename ST::dtype);
}
// N-major operand: tile rows are K, columns are N; n_offset(k): the 16 rows from k on. Panels (64
// columns of bf16) are panel_bytes apart, groups of 8 rows 1024 bytes apart.
template <SharedTile ST> __device__ __forceinline__ descriptor n_major(const ST &t) {
  static_assert(ST::panel_cols * sizeof(typename ST::dtype) == 128, "wgmma tiles use full 128-byte panels");
  return descriptor(smem_addr(t.panel(0)), ST::panel_bytes, 1024);
}
constexpr uint32_t n_offset(int k) { return k * 128; }

template <int N> __device__ __forceinline__ float (&accumulators(rt<float, 16, N, row_l> &d))[N / 2] {
  return *reinterpret_cast<float(*)[N / 2]>(&d.tiles[0][0]);
}

namespace detail {
template <int N> constexpr int part_width() { return N >= 256 ? 256 : N >= 128 ? 128 : N >= 64 ? 64 : 32; }
// One k-step's wgmmas over the columns [C0, N) of d, part by part; b_at(c): B's descriptor for its
// columns from c on.
template <typename T, int N, int TRANS_B, int TRANS_A, int C0 = 0, typename BAt>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t a, BAt b_at, int scale_d) {
  constexpr int W = part_width<N - C0>();
  wgmma<T, W, TRANS_B>::template ss<TRANS_A>(*reinterpret_cast<float(*)[W / 2]>(&d[C0 / 2]), a, b_at(C0), scale_d);
  if constexpr (C0 + W < N) wgmma_ss<T, N, TRANS_B, TRANS_A, C0 + W>(d, a, b_at, scale_d);
}
// B's columns from c on: N-major, whole panels (the parts' widths keep c a multiple of a panel's);
// K-major, rows.
template <SharedTile ST> constexpr uint32_t n_major_columns(int c) { return (c / ST::panel_cols) * ST::panel_bytes; }
template <SharedTile ST> constexpr uint32_t k_major_rows(int c) { return c * ST::panel_cols * sizeof(typename ST::dtype); }
}  // namespace detail

// (both K-major: 16-bit operands 16 columns a step, 8-bit ones 32: 32 bytes either way)
template <int N, SharedTile SA, SharedTile SB>
__device__ __forceinline__ void mma_ABt(rt<float, 16, N, row_l> &d, const SA &a, const SB &b, bool accumulate) {
  using T = typename SA::dtype;
  constexpr int KS = 32 / int(sizeof(T));
  static_assert(SA::rows == 64 && SB::rows == N && SA::cols == SB::cols && SA::cols % KS == 0 &&
                std::is_same_v<T, typename SB::dtype>);
  const descriptor da = k_major(a), db = k_major(b);
  fence();
#pragma unroll
  for (int k = 0; k < SA::cols / KS; k++) {
    const auto b_at = [&](int c) { return db.at(k_offset<SB>(KS * k) + detail::k_major_rows<SB>(c)); };
    detail::wgmma_ss<T, N, 0, 0>(accumulators(d), da.at(k_offset<SA>(KS * k)), b_at, accumulate || k > 0);
  }
  commit();
}

template <int N, SharedTile SA, SharedTile SB>
__device__ __forceinline__ void mma_AtB(rt<float, 16, N, row_l> &d, const SA &a, const SB &b, bool accumulate) {
  using T = typename SA::dtype;
  static_assert(SA::cols == 64 && SB::cols == N && SA::rows == SB::rows && std::is_same_v<T, typename SB::dtype>);
  const descriptor da = n_major(a), db = n_major(b);
  fence();
#pragma unroll
  for (int k = 0; k < SA::rows / 16; k++) {
    const auto b_at = [&](int c) { return db.at(n_offset(16 * k) + detail::n_major_columns<SB>(c)); };
    detail::wgmma_ss<T, N, 1, 1>(accumulators(d), da.at(n_offset(16 * k)), b_at, accumulate || k > 0);
  }
  commit();
}

// A (64 x K) from shared memory, K-major; B (K x N) N-major.
template <int N, SharedTile SA, SharedTile SB>
__device__ __forceinline__ void mma_AB(rt<float, 16, N, row_l> &d, const SA &a, const SB &b, bool accumulate) {
  using T = typename SA::dtype;
  static_assert(SA::rows == 64 && SB::cols == N && SA::cols == SB::rows && std::is_same_v<T, typename SB::dtype>);
  const descriptor da = k_major(a), db = n_major(b);
  fence();
#pragma unroll
  for (int k = 0; k < SA::cols / 16; k++) {
    const auto b_at = [&](int c) { return db.at(n_offset(16 * k) + detail::n_major_columns<SB>(c)); };
    detail::wgmma_ss<T, N, 1, 0>(accumulators(d), da.at(k_offset<SA>(16 * k)), b_at, accumulate || k > 0);
  }
  commit();
}

// A (16 rows per warp x K) from registers.
template <int N, int K, typename T, SharedTile SB>
__device__ __forceinline__ void mma_AB(rt<float, 16, N, row_l> &d, const rt<T, 16, K, row_l> &a, const SB &b, bool accumulate) {
  static_assert(SB::rows == K && SB::cols == N && std::is_same_v<T, typename SB::dtype>);
  const descriptor db = n_major(b);
  fence();
#pragma unroll
  for (int k = 0; k < K / 16; k++)
    detail::wgmma<T, N, 1>::rs(accumulators(d), reinterpret_cast<const uint32_t(&)[4]>(a.tiles[0][k].data),
                               db.at(n_offset(16 * k)), accumulate || k > 0);
  commit();
}

// A (16 rows per warp x K) from registers; B (N x K) K-major.
template <int N, int K, typename T, SharedTile SB>
__device__ __forceinline__ void mma_ABt(rt<float, 16, N, row_l> &d, const rt<T, 16, K, row_l> &a, const SB &b, bool accumulate) {
  static_assert(SB::rows == N && SB::cols == K && std::is_same_v<T, typename SB::dtype> && detail::part_width<N>() == N);
  const descriptor db = k_major(b);
  fence();
#pragma unroll
  for (int k = 0; k < K / 16; k++)
    detail::wgmma<T, N, 0>::rs(accumulators(d), reinterpret_cast<const uint32_t(&)[4]>(a.tiles[0][k].data),
                               db.at(k_offset<SB>(16 * k)), accumulate || k > 0);
  commit();
}

}  // namespace tk::warpgroup
