// The online softmax on register tiles (FlashAttention's running row max and sum), in base 2, and the
// fast tanh of soft-capped logits: what every attention-like kernel computes per block of logits.
#pragma once
#include "reductions.cuh"

namespace tk {

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
constexpr float NEG_INF = -__builtin_huge_valf();

}  // namespace tk

namespace tk::warp {

// tanh(x) = 1 - 2 / (2^(2 x log2 e) + 1), absolute error ~1e-7; |x| >= 20 gives +-1 (as in fp32).
__device__ __forceinline__ float tanh_fast(float x) {
  x = fminf(fmaxf(x, -20.f), 20.f);
  return 1.f - __fdividef(2.f, fn::exp2(2.f * LOG2E * x) + 1.f);
}

// softmax_step (below) given the new row max m_new: at least m and s's row max, e.g. shared with the
// warps that hold the other keys of these rows.
template <bool LANE_SUMS = false, typename RT, typename V>
__device__ __forceinline__ void softmax_step_to(RT &s, V &m, V &l, V &corr, const V &m_new, float c) {
  V mc;
  // c m_new, or 0 for a row that has seen no key yet (all -inf: exp2(-inf) = 0, never NaN)
  map_vec(mc, m_new, [=](float x) { return x == NEG_INF ? 0.f : x * c; });
  map_vec(corr, m, mc, [=](float a, float b) { return fn::exp2(a * c - b); });
  map_row(s, s, mc, [=](float x, float b) { return fn::exp2(x * c - b); });
  map_vec(l, l, corr, [](float a, float b) { return a * b; });
  if constexpr (LANE_SUMS) row_sum_lane(l, s, l);
  else row_sum(l, s, l);
  m = m_new;
}
// One step of the online softmax over a block of logits s (units of 1 / c: s * c is in log2 units):
// updates the running row max m (same units) and sum l, sets corr to the factor that rescales what
// was accumulated before, and s := exp2(c (s - m)). LANE_SUMS: l holds this lane's part of each
// row's sum (row_sum_lane), which sum_lanes(l) completes after the last step: the shuffles of the
// sum are paid once instead of at every step.
template <bool LANE_SUMS = false, typename RT, typename V>
__device__ __forceinline__ void softmax_step(RT &s, V &m, V &l, V &corr, float c) {
  V m_new;
  row_max(m_new, s, m);
  softmax_step_to<LANE_SUMS>(s, m, l, corr, m_new, c);
}

// O /= l (O = 0 for a row that saw no key, l = 0).
template <typename RT, typename V> __device__ __forceinline__ void normalize_output(RT &o, const V &l) {
  V inv_l;
  map_vec(inv_l, l, [](float x) { return x > 0.f ? 1.f / x : 0.f; });
  mul_row(o, o, inv_l);
}

// Attention sinks: a logit per row that joins the softmax's denominator and has no value. Given a row's
// log-sum-exp lse2 and the sink's logit sink2 (both in log2 units; -inf: no key, no sink), the row's
// log-sum-exp with the sink, and the factor its (normalized) output takes: 2^(lse2 - lse2 with it),
// which is <= 1 and 0 for a row that saw no key. Neither overflows however far the two lie apart.
// A sink's logit in log2 units, as with_sink takes it: -inf for a non-finite one (no sink).
__device__ __forceinline__ float sink_log2(float sink) { return isfinite(sink) ? sink * LOG2E : NEG_INF; }
struct Sunk {
  float lse2, factor;
};
__device__ __forceinline__ Sunk with_sink(float lse2, float sink2) {
  const float hi = fmaxf(lse2, sink2), lo = fminf(lse2, sink2);
  if (hi == NEG_INF) return {NEG_INF, 0.f};
  const float e = fn::exp2(lo - hi);  // in [0, 1]
  return {hi + fn::log2(1.f + e), __fdividef(fn::exp2(lse2 - hi), 1.f + e)};
}

}  // namespace tk::warp
