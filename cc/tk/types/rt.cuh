// rt: register tile. A warp holds an R x C tile as (R/16) x (C/16) pieces in the mma.sync fragment
// layout. In each 16 x 16 piece a lane owns 8 elements, as 4 packed pairs:
//   row layout (row_l): pairs run along a row;  element e sits at (g + 8*((e/2)%2), 2t + e%2 + 8*(e/4))
//   col layout (col_l): pairs run down a column; element e sits at (2t + e%2 + 8*(e/4), g + 8*((e/2)%2))
// with g = lane/4, t = lane%4. A col-layout tile of X holds exactly the registers of a row-layout
// tile of X^T, which is how mma.sync wants B (and a transposed A).
#pragma once
#include "../common/base.cuh"

namespace tk {

struct row_l {};
struct col_l {};
template <typename L> constexpr bool is_layout = std::is_same_v<L, row_l> || std::is_same_v<L, col_l>;
template <typename L> using transpose_layout = std::conditional_t<std::is_same_v<L, row_l>, col_l, row_l>;

template <typename T, typename L> struct rt_base {
  static_assert(is_element<T> && is_layout<L>);
  using dtype = T;
  using layout = L;
  packed<T> data[4];
};

// Position of element e (0..7) of a lane's piece, inside the 16 x 16 piece.
template <typename L> __device__ __forceinline__ int piece_row(int lane, int e) {
  if constexpr (std::is_same_v<L, row_l>) return lane / 4 + 8 * ((e / 2) % 2);
  else return 2 * (lane % 4) + e % 2 + 8 * (e / 4);
}
template <typename L> __device__ __forceinline__ int piece_col(int lane, int e) {
  return piece_row<transpose_layout<L>>(lane, e);
}

template <typename T, int R, int C, typename L = row_l> struct rt {
  static_assert(R % TILE == 0 && C % TILE == 0, "register tiles are made of 16 x 16 pieces");
  using dtype = T;
  using layout = L;
  using piece = rt_base<T, L>;
  static constexpr int rows = R, cols = C;
  static constexpr int height = R / TILE, width = C / TILE;  // in pieces
  piece tiles[height][width];

  // Element e of piece (i, j) as a float (e in 0..7); read/write helpers for generic ops.
  __device__ __forceinline__ float get(int i, int j, int e) const {
    float2 f = to_float2(tiles[i][j].data[e / 2]);
    return (e & 1) ? f.y : f.x;
  }
  __device__ __forceinline__ void set(int i, int j, int e, float v) {
    float2 f = to_float2(tiles[i][j].data[e / 2]);
    if (e & 1) f.y = v; else f.x = v;
    tiles[i][j].data[e / 2] = from_float2<packed<T>>(f);
  }
  __device__ __forceinline__ static int row_of(int i, int e) { return i * TILE + piece_row<L>(laneid(), e); }
  __device__ __forceinline__ static int col_of(int j, int e) { return j * TILE + piece_col<L>(laneid(), e); }
};

template <typename X> concept RegisterTile = requires { typename X::piece; X::height; X::width; };

template <int R, int C, typename L = row_l> using rt_fl = rt<float, R, C, L>;
template <int R, int C, typename L = row_l> using rt_bf = rt<bf16, R, C, L>;
template <int R, int C, typename L = row_l> using rt_hf = rt<half, R, C, L>;

}  // namespace tk
