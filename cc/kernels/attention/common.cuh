// Helpers shared by the attention kernels: dispatch over dtype and head dim, launch with a large
// dynamic shared-memory budget, and the masking rule.
#pragma once
#include "attention.h"
#include "tk/tk.cuh"

namespace jax_tk::attention {

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
constexpr float NEG_INF = -__builtin_huge_valf();

// f.template operator()<T, D>() for the runtime dtype and head dim.
template <typename F> cudaError_t dispatch(const Params &p, F f) {
  auto by_dim = [&]<typename T>() -> cudaError_t {
    if (p.head_dim == 64) return f.template operator()<T, 64>();
    if (p.head_dim == 128) return f.template operator()<T, 128>();
    return cudaErrorInvalidValue;
  };
  return p.dtype == DType::bf16 ? by_dim.template operator()<tk::bf16>() : by_dim.template operator()<tk::half>();
}

template <typename Kernel>
cudaError_t launch(Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, const Params &p) {
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (e != cudaSuccess) return e;
  }
  kernel<<<grid, block, smem, stream>>>(p);
  return cudaGetLastError();
}

// May query row qi see key kj?
__device__ __forceinline__ bool visible(const Params &p, int qi, int kj) {
  return kj < p.kv_len && (!p.causal || kj <= qi);
}

__device__ __forceinline__ bool visible(const Params &p, int b, int qi, int kj) { return visible(p, qi, kj); }

// Key blocks of size BK that query rows [q0, q0 + rows) need: [0, end).
__device__ __forceinline__ int kv_block_end(const Params &p, int q0, int rows, int BK) {
  int n = (p.kv_len + BK - 1) / BK;
  if (p.causal) n = min(n, (min(q0 + rows, p.q_len) - 1) / BK + 1);
  return n;
}

// Key blocks of size BK that query rows [q0, q0 + rows) of batch entry b need: [first, end).
__device__ __forceinline__ int2 kv_block_range(const Params &p, int b, int q0, int rows, int BK) {
  return {0, kv_block_end(p, q0, rows, BK)};
}

// Logits of query rows qw.. (tile rows) against keys k0.. (tile columns), scaled to log2 units, with
// invisible entries set to -inf (only blocks that touch the diagonal or the key tail pay for it).
template <typename RT>
__device__ __forceinline__ void scale_and_mask(RT &s, const Params &p, int qw, int k0) {
  tk::warp::mul(s, s, p.scale * LOG2E);
  if (k0 + RT::cols > p.kv_len || (p.causal && k0 + RT::cols - 1 > qw))
    tk::warp::map_indexed(s, s, [&](int r, int c, float x) { return visible(p, qw + r, k0 + c) ? x : NEG_INF; });
}

// One step of the online softmax over a block of logits s (log2 units): updates the running row max
// m and sum l, sets corr to the factor that rescales what was accumulated before, and s := exp2(s - m).
template <typename RT, typename V>
__device__ __forceinline__ void softmax_step(RT &s, V &m, V &l, V &corr) {
  using namespace tk;
  V m_new;
  warp::row_max(m_new, s, m);
  warp::map_vec(corr, m, m_new, [](float a, float b) { return b == NEG_INF ? 1.f : warp::fn::exp2(a - b); });
  warp::map_row(s, s, m_new, [](float x, float mx) { return warp::fn::exp2(x - (mx == NEG_INF ? 0.f : mx)); });
  warp::map_vec(l, l, corr, [](float a, float b) { return a * b; });
  warp::row_sum(l, s, l);
  m = m_new;
}

// O /= l, then store O's rows qw.. and their log-sum-exp ln(sum exp(logits)) = (m + log2 l) ln 2
// (-inf and O = 0 for a row that saw no key).
template <typename T, typename RT, typename V>
__device__ __forceinline__ void store_output(const Params &p, RT &o, const V &l, int b, int h, int qw, int d0) {
  using namespace tk;
  V inv_l;
  warp::map_vec(inv_l, l, [](float x) { return x > 0.f ? 1.f / x : 0.f; });
  warp::mul_row(o, o, inv_l);
  auto O = gl<T>::make(static_cast<T *>(p.o), p.batch, p.q_len, p.q_heads, p.head_dim);
  warp::store(O, o, {b, qw, h, d0});
}
template <typename V>
__device__ __forceinline__ void store_lse(const Params &p, const V &m, const V &l, int b, int h, int qw) {
  using namespace tk;
  V lse;
  warp::map_vec(lse, m, l, [](float mx, float x) { return x > 0.f ? (mx + warp::fn::log2(x)) * LN2 : NEG_INF; });
  if (qw < p.q_len) warp::store(p.lse + (size_t(b) * p.q_heads + h) * p.q_len + qw, lse, p.q_len - qw);
}

}  // namespace jax_tk::attention
