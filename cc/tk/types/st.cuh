// st: shared tile, R x C, stored as column panels at most 128 bytes wide ([R x P] row-major each,
// P = 128 / sizeof(T) columns), with the 16-byte chunks of each row XOR-swizzled by the row index.
// For full 128-byte panels this is exactly the SWIZZLE_128B layout that TMA writes and wgmma reads
// (panels are 1024-byte aligned), and it also keeps ldmatrix and cp.async free of bank conflicts.
#pragma once
#include "../common/base.cuh"

namespace tk {

template <typename T, int R, int C> struct st {
  static_assert((is_element<T> || is_8bit<T>) && R % TILE == 0 && C % TILE == 0);
  using dtype = T;
  static constexpr int rows = R, cols = C;
  static constexpr int panel_cols = C * int(sizeof(T)) < 128 ? C : 128 / int(sizeof(T));
  static constexpr int panels = C / panel_cols;
  static constexpr int panel_bytes = R * panel_cols * int(sizeof(T));
  static constexpr int chunk = 16 / sizeof(T);  // elements per 16-byte chunk
  static constexpr int chunks_per_row = panel_cols / chunk;
  static constexpr int bytes = R * C * sizeof(T);
  alignas(1024) T data[R * C];

  // XOR pattern for a row: spread consecutive rows over the chunk positions of a 128-byte line.
  __host__ __device__ static constexpr int swizzle(int r) {
    if constexpr (chunks_per_row >= 8) return r % 8;
    else if constexpr (chunks_per_row == 4) return (r / 2) % 4;
    else if constexpr (chunks_per_row == 2) return (r / 4) % 2;
    else return 0;
  }
  // Offset (in elements) of element (r, c).
  __host__ __device__ static constexpr int offset(int r, int c) {
    int p = c / panel_cols, pc = c % panel_cols;
    return p * R * panel_cols + r * panel_cols + (((pc / chunk) ^ swizzle(r)) * chunk) + pc % chunk;
  }
  __device__ __forceinline__ T &operator()(int r, int c) { return data[offset(r, c)]; }
  __device__ __forceinline__ const T &operator()(int r, int c) const { return data[offset(r, c)]; }
  __device__ __forceinline__ T *panel(int p) { return data + p * R * panel_cols; }
  __device__ __forceinline__ const T *panel(int p) const { return data + p * R * panel_cols; }
};

template <typename X> concept SharedTile = requires { X::chunks_per_row; X::panel_cols; };

// A R x C window of a shared tile, from (row0, col0), for wgmma operands: it keeps the parent's
// panels (and their stride), so rows start on 8-row boundaries and columns on 16-byte chunks.
template <SharedTile ST, int R, int C> struct st_window {
  using dtype = typename ST::dtype;
  static constexpr int rows = R, cols = C, panel_cols = ST::panel_cols, panel_bytes = ST::panel_bytes;
  static constexpr int chunks_per_row = ST::chunks_per_row;
  dtype *base;  // element (row0, col0)
  __device__ __forceinline__ dtype *panel(int p) const { return base + p * ST::rows * panel_cols; }
};
template <int R, int C, SharedTile ST> __device__ __forceinline__ st_window<ST, R, C> window(ST &t, int row0, int col0) {
  static_assert(R <= ST::rows && C <= ST::cols);
  return {t.panel(col0 / ST::panel_cols) + row0 * ST::panel_cols + col0 % ST::panel_cols};
}

}  // namespace tk
