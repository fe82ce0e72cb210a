// st: shared tile, R x C row-major in shared memory with its 16-byte chunks swizzled so that the
// 8 rows an ldmatrix reads at one column hit 8 different bank groups.
#pragma once
#include "../common/base.cuh"

namespace tk {

template <typename T, int R, int C> struct st {
  static_assert(is_element<T> && R % TILE == 0 && C % TILE == 0);
  using dtype = T;
  static constexpr int rows = R, cols = C;
  static constexpr int chunk = 16 / sizeof(T);         // elements per 16-byte chunk
  static constexpr int chunks_per_row = C / chunk;
  static constexpr int bytes = R * C * sizeof(T);
  alignas(128) T data[R * C];

  // XOR pattern for a row: spread consecutive rows over the 8 chunk positions of a 128-byte line.
  __device__ __forceinline__ static int swizzle(int r) {
    if constexpr (chunks_per_row >= 8) return r % 8;
    else if constexpr (chunks_per_row == 4) return (r / 2) % 4;
    else if constexpr (chunks_per_row == 2) return (r / 4) % 2;
    else return 0;
  }
  // Offset (in elements) of element (r, c).
  __device__ __forceinline__ static int offset(int r, int c) {
    return r * C + (((c / chunk) ^ swizzle(r)) * chunk) + c % chunk;
  }
  __device__ __forceinline__ T &operator()(int r, int c) { return data[offset(r, c)]; }
  __device__ __forceinline__ const T &operator()(int r, int c) const { return data[offset(r, c)]; }
};

template <typename X> concept SharedTile = requires { X::chunks_per_row; X::swizzle(0); };

}  // namespace tk
