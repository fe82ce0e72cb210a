// Row and column reductions of register tiles into register vectors (max, sum), optionally
// folding in a previous vector (the running max / sum of an online softmax).
#pragma once
#include "maps.cuh"

namespace tk::warp {

namespace op {
struct max { __device__ __forceinline__ static float apply(float a, float b) { return fmaxf(a, b); } };
struct sum { __device__ __forceinline__ static float apply(float a, float b) { return a + b; } };
}  // namespace op

// Combine v across the lanes that hold copies of the same vector index.
template <typename Op, typename VL> __device__ __forceinline__ float across_lanes(float v) {
  if constexpr (std::is_same_v<VL, ortho_l>) {  // same g: the 4 lanes of a quad
    v = Op::apply(v, __shfl_xor_sync(0xffffffff, v, 1));
    v = Op::apply(v, __shfl_xor_sync(0xffffffff, v, 2));
  } else {  // same t: lanes t, t+4, ..., t+28
    v = Op::apply(v, __shfl_xor_sync(0xffffffff, v, 4));
    v = Op::apply(v, __shfl_xor_sync(0xffffffff, v, 8));
    v = Op::apply(v, __shfl_xor_sync(0xffffffff, v, 16));
  }
  return v;
}

// dst[r] = Op over the columns of src's row r (and over init[r] when given). LANES = false: over
// this lane's columns only (the other lanes that hold the row have the rest).
template <typename Op, bool ACROSS_COLS, bool LANES = true, RegisterTile S, typename V>
__device__ __forceinline__ void reduce(V &dst, const S &src, const V *init) {
  using L = typename S::layout;
  constexpr int outer = ACROSS_COLS ? S::height : S::width;   // pieces along the kept axis
  constexpr int inner = ACROSS_COLS ? S::width : S::height;   // pieces reduced over
#pragma unroll
  for (int o = 0; o < outer; o++)
#pragma unroll
    for (int k = 0; k < V::per; k++) {
      bool first = true;
      float acc = 0.f;
#pragma unroll
      for (int in = 0; in < inner; in++)
#pragma unroll
        for (int e = 0; e < 8; e++) {
          int slot = ACROSS_COLS ? row_slot<L>(e) : col_slot<L>(e);
          if (slot != k) continue;
          float x = ACROSS_COLS ? src.get(o, in, e) : src.get(in, o, e);
          acc = first ? x : Op::apply(acc, x);
          first = false;
        }
      if constexpr (LANES) acc = across_lanes<Op, typename V::layout>(acc);
      dst.data[o][k] = init ? Op::apply(init->data[o][k], acc) : acc;
    }
}

template <RegisterTile S> __device__ __forceinline__ void row_max(col_vec<S> &dst, const S &src) { reduce<op::max, true>(dst, src, (const col_vec<S> *)nullptr); }
template <RegisterTile S> __device__ __forceinline__ void row_max(col_vec<S> &dst, const S &src, const col_vec<S> &init) { reduce<op::max, true>(dst, src, &init); }
template <RegisterTile S> __device__ __forceinline__ void row_sum(col_vec<S> &dst, const S &src) { reduce<op::sum, true>(dst, src, (const col_vec<S> *)nullptr); }
template <RegisterTile S> __device__ __forceinline__ void row_sum(col_vec<S> &dst, const S &src, const col_vec<S> &init) { reduce<op::sum, true>(dst, src, &init); }
// This lane's part of row_sum (init: its part so far): the sum over the columns it holds, without
// shuffles; sum_lanes completes it.
template <RegisterTile S> __device__ __forceinline__ void row_sum_lane(col_vec<S> &dst, const S &src, const col_vec<S> &init) { reduce<op::sum, true, false>(dst, src, &init); }
// v[i] := the sum of v[i] over the lanes that hold index i (completes row_sum_lane's parts).
template <typename V> __device__ __forceinline__ void sum_lanes(V &v) {
#pragma unroll
  for (int o = 0; o < V::pieces; o++)
#pragma unroll
    for (int k = 0; k < V::per; k++) v.data[o][k] = across_lanes<op::sum, typename V::layout>(v.data[o][k]);
}
template <RegisterTile S> __device__ __forceinline__ void col_max(row_vec<S> &dst, const S &src) { reduce<op::max, false>(dst, src, (const row_vec<S> *)nullptr); }
template <RegisterTile S> __device__ __forceinline__ void col_max(row_vec<S> &dst, const S &src, const row_vec<S> &init) { reduce<op::max, false>(dst, src, &init); }
template <RegisterTile S> __device__ __forceinline__ void col_sum(row_vec<S> &dst, const S &src) { reduce<op::sum, false>(dst, src, (const row_vec<S> *)nullptr); }
template <RegisterTile S> __device__ __forceinline__ void col_sum(row_vec<S> &dst, const S &src, const row_vec<S> &init) { reduce<op::sum, false>(dst, src, &init); }

}  // namespace tk::warp
