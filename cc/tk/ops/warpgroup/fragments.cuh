// A warpgroup's fp32 accumulator (its four warps' rt<float, 16, C>, a 64 x C tile) in memory in
// "fragment order": the registers as they are, float4 q of thread t (0..127) at float index
// (q * 128 + t) * 4. Each store instruction writes 512 consecutive bytes per warp (no bank
// conflicts, no address arithmetic), which suits a buffer that is only summed into or copied out and
// read back elsewhere with fragment_offset.
#pragma once
#include "../../types/rt.cuh"

namespace tk::warpgroup {

// Calls f(q, v) for float4 q of this thread's part of the 64 x C accumulator (fragment order).
template <int C, typename F> __device__ __forceinline__ void for_each_fragment(const rt<float, 16, C, row_l> &src, F &&f) {
#pragma unroll
  for (int j = 0; j < C / 16; j++)
#pragma unroll
    for (int k = 0; k < 4; k += 2) {
      const float2 a = src.tiles[0][j].data[k], b = src.tiles[0][j].data[k + 1];
      f(j * 2 + k / 2, float4{a.x, a.y, b.x, b.y});
    }
}

template <int C> __device__ __forceinline__ void store_fragments(float *dst, const rt<float, 16, C, row_l> &src) {
  const int t = threadIdx.x % 128;
  for_each_fragment(src, [&](int q, float4 v) { reinterpret_cast<float4 *>(dst)[q * 128 + t] = v; });
}

// dst += src for a tile in global memory kept in fragment order (one vector reduction,
// red.global.add.v4.f32, per float4: a warp adds 512 consecutive bytes per instruction). The adds are
// relaxed atomics at GPU scope: tiles summed by many thread blocks need no other synchronization.
template <int C> __device__ __forceinline__ void reduce_add_fragments(float *dst, const rt<float, 16, C, row_l> &src) {
  const int t = threadIdx.x % 128;
  for_each_fragment(src, [&](int q, float4 v) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst + (q * 128 + t) * 4), "f"(v.x), "f"(v.y),
                 "f"(v.z), "f"(v.w)
                 : "memory");
  });
}

// Float index of element (r, c) of the 64 x C tile written by store_fragments (see rt.cuh for the
// fragment layout: row g + 8 (k % 2), column 2 (lane % 4) + 8 (k / 2) of piece j, pair k).
template <int C> __host__ __device__ constexpr int fragment_offset(int r, int c) {
  const int warp = r / 16, lane = (r % 8) * 4 + (c % 8) / 2;
  const int f = ((c / 16) * 4 + (r % 16) / 8 + 2 * ((c % 16) / 8)) * 2 + c % 2;  // float of the thread
  return ((f / 4) * 128 + warp * 32 + lane) * 4 + f % 4;
}

// The inverse: the row and column of the first float of float4 q of thread t; its four floats are
// (r, c), (r, c + 1), (r + 8, c) and (r + 8, c + 1).
struct FragmentCoords {
  int r, c;
};
__host__ __device__ constexpr FragmentCoords fragment_coords(int q, int t) {
  return {(t / 32) * 16 + (t % 32) / 4, (q / 2) * 16 + (q % 2) * 8 + 2 * (t % 4)};
}
namespace detail {
constexpr bool coords_invert_offsets() {  // over a 64 x 128 tile (the layout does not depend on C)
  for (int q = 0; q < 16; q++)
    for (int t = 0; t < 128; t++) {
      const auto [r, c] = fragment_coords(q, t);
      const int at = (q * 128 + t) * 4;
      if (fragment_offset<128>(r, c) != at || fragment_offset<128>(r, c + 1) != at + 1 ||
          fragment_offset<128>(r + 8, c) != at + 2 || fragment_offset<128>(r + 8, c + 1) != at + 3)
        return false;
    }
  return true;
}
static_assert(coords_invert_offsets());
}  // namespace detail

}  // namespace tk::warpgroup
