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

// Bit masks: a row-major bit matrix, each row a run of 32-bit words (bit k of a row is bit k % 32 of
// its word k / 32). keep_bits keeps (r, c) where bit off + c of row r is set, else fill; words(r)
// points at row r's words, off % 16 == 0. keep_bits_by_col is the same with the bits running down the
// columns: it keeps (r, c) where bit off + r of column c's words (words(c)) is set. The 16 bits of a
// 16 x 16 piece's row (column) lie in one word, so a lane loads one word per row (column) and piece.
template <bool BY_COL, RegisterTile D, RegisterTile S, typename W>
__device__ __forceinline__ void keep_bits_along(D &dst, const S &src, W words, int off, float fill) {
#pragma unroll
  for (int i = 0; i < D::height; i++)
#pragma unroll
    for (int j = 0; j < D::width; j++)
#pragma unroll
      for (int e = 0; e < 8; e++) {
        const int r = S::row_of(i, e), c = S::col_of(j, e), bit = off + (BY_COL ? r : c);
        const uint32_t w = __ldg(words(BY_COL ? c : r) + (off + TILE * (BY_COL ? i : j)) / 32);
        dst.set(i, j, e, (w >> (bit % 32)) & 1u ? src.get(i, j, e) : fill);
      }
}
template <RegisterTile D, RegisterTile S, typename W>
__device__ __forceinline__ void keep_bits(D &dst, const S &src, W words, int off, float fill) {
  keep_bits_along<false>(dst, src, words, off, fill);
}
template <RegisterTile D, RegisterTile S, typename W>
__device__ __forceinline__ void keep_bits_by_col(D &dst, const S &src, W words, int off, float fill) {
  keep_bits_along<true>(dst, src, words, off, fill);
}

}  // namespace tk::warp
