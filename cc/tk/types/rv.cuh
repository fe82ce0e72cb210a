// rv: register vector, one value per row (col_vec) or per column (row_vec) of a register tile,
// spread over the warp the way that tile's pieces are:
//   ortho_l: 2 values per 16, index g + 8k          (k = 0, 1); lanes of one quad (same g) hold copies
//   align_l: 4 values per 16, index 2t + k%2 + 8(k/2) (k = 0..3); lanes with the same t hold copies
// so that broadcasting a vector over a tile needs no shuffles.
#pragma once
#include "rt.cuh"

namespace tk {

struct ortho_l { static constexpr int per = 2; };
struct align_l { static constexpr int per = 4; };

template <typename T, int N, typename VL> struct rv {
  static_assert(N % TILE == 0);
  using dtype = T;
  using layout = VL;
  static constexpr int length = N, pieces = N / TILE, per = VL::per;
  T data[pieces][per];

  // Index in the vector of slot k of piece i, for this lane.
  __device__ __forceinline__ static int index_of(int i, int k) {
    int lane = laneid();
    if constexpr (std::is_same_v<VL, ortho_l>) return i * TILE + lane / 4 + 8 * k;
    else return i * TILE + 2 * (lane % 4) + (k & 1) + 8 * (k >> 1);
  }
};

// Vector layouts that match a tile: one value per row (col_vec) or per column (row_vec).
template <RegisterTile RT>
using col_vec = rv<float, RT::rows, std::conditional_t<std::is_same_v<typename RT::layout, row_l>, ortho_l, align_l>>;
template <RegisterTile RT>
using row_vec = rv<float, RT::cols, std::conditional_t<std::is_same_v<typename RT::layout, row_l>, align_l, ortho_l>>;

// Slot of a tile element e in the vector indexed by that element's row (resp. column).
template <typename L> __device__ __forceinline__ constexpr int row_slot(int e) {
  if constexpr (std::is_same_v<L, row_l>) return (e / 2) % 2; else return e % 2 + 2 * (e / 4);
}
template <typename L> __device__ __forceinline__ constexpr int col_slot(int e) {
  return row_slot<transpose_layout<L>>(e);
}

}  // namespace tk
