// Masks on register tiles: elements outside a region are replaced by `fill` (e.g. -inf before a
// softmax). Positions are the tile's own (row, col) plus an offset, so a tile cut from a larger
// matrix masks by its place in that matrix.
#pragma once
#include "maps.cuh"

namespace tk::warp {

// Keep (r, c) with c - r <= diagonal (lower triangle), else fill.
template <RegisterTile D, RegisterTile S>
__device__ __forceinline__ void tril(D &dst, const S &src, int diagonal, float fill) {
  map_indexed(dst, src, [=](int r, int c, float x) { return c - r <= diagonal ? x : fill; });
}
// Keep (r, c) with c - r >= diagonal (upper triangle), else fill.
template <RegisterTile D, RegisterTile S>
__device__ __forceinline__ void triu(D &dst, const S &src, int diagonal, float fill) {
  map_indexed(dst, src, [=](int r, int c, float x) { return c - r >= diagonal ? x : fill; });
}
// Keep columns c < n_cols and rows r < n_rows, else fill (tail tiles).
template <RegisterTile D, RegisterTile S>
__device__ __forceinline__ void bounds(D &dst, const S &src, int n_rows, int n_cols, float fill) {
  map_indexed(dst, src, [=](int r, int c, float x) { return (r < n_rows && c < n_cols) ? x : fill; });
}

}  // namespace tk::warp
