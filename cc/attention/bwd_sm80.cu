// Attention backward on mma.sync (sm_80+), by recomputation and with no atomics (deterministic):
//   1. dq_kernel: per block of 64 query rows, loop over key blocks:
//        P = exp(S - lse), dP = dO V^T, dS = P * (dP - delta), dQ += dS K;
//      it first computes delta = rowsum(dO * O) - dlse for its rows and writes it out.
//   2. dkdv_kernel: per block of 64 keys, loop over the query heads of the group and query blocks:
//        P^T = exp(K Q^T - lse), dV += P^T dO, dP^T = V dO^T, dS^T = P^T * (dP^T - delta), dK += dS^T Q.
// Each warp owns 16 rows (queries in 1, keys in 2); nothing of size T x S is stored.
// Masking visits only the blocks that can be visible (kv_block_range / q_block_range) and masks
// elementwise where needed. With a soft cap, S above is the capped logit and dS is multiplied by
// the cap's derivative 1 - tanh^2 before it meets K or Q. A row that sees no key has lse = -inf;
// lse_to_log2 makes its P (and so every gradient through it) exactly 0.
#include "common.cuh"

namespace jax_tk::attention {
namespace {

using namespace tk;

template <typename T> struct Views {
  gl<const T> Q, K, V, O, dO;
  gl<T> dQ, dK, dV;
  __device__ Views(const Params &p, int D)
      : Q(gl<const T>::make(static_cast<const T *>(p.q), p.batch, p.q_len, p.q_heads, D)),
        K(gl<const T>::make(static_cast<const T *>(p.k), p.batch, p.kv_len, p.kv_heads, D)),
        V(gl<const T>::make(static_cast<const T *>(p.v), p.batch, p.kv_len, p.kv_heads, D)),
        O(gl<const T>::make(static_cast<const T *>(p.o), p.batch, p.q_len, p.q_heads, D)),
        dO(gl<const T>::make(static_cast<const T *>(p.dout), p.batch, p.q_len, p.q_heads, D)),
        dQ(gl<T>::make(static_cast<T *>(p.dq), p.batch, p.q_len, p.q_heads, D)),
        dK(gl<T>::make(static_cast<T *>(p.dk), p.batch, p.kv_len, p.kv_heads, D)),
        dV(gl<T>::make(static_cast<T *>(p.dv), p.batch, p.kv_len, p.kv_heads, D)) {}
};

__device__ __forceinline__ size_t row_index(const Params &p, int b, int h, int t) {
  return (size_t(b) * p.q_heads + h) * p.q_len + t;  // into [batch, q_heads, q_len]
}

// s = X Y^T and dp = dX dY^T over the D columns, for this warp's 16 rows of x and dx (from row r)
// and every row of y and dy: the logits and their gradient's product of both kernels (queries
// against keys in dq_kernel, keys against queries in dkdv_kernel).
template <int D, typename ACC, typename SX, typename SY>
__device__ __forceinline__ void logits_and_dp(ACC &s, ACC &dp, const SX &x, const SX &dx, const SY &y, const SY &dy, int r) {
  using T = typename SX::dtype;
  warp::zero(s);
  warp::zero(dp);
#pragma unroll
  for (int kk = 0; kk < D / 16; kk++) {
    rt<T, 16, 16> xc, dxc;
    rt<T, SY::rows, 16> yt, dyt;
    warp::load(xc, x, r, 16 * kk);
    warp::load(dxc, dx, r, 16 * kk);
    warp::load(yt, y, 0, 16 * kk);
    warp::load(dyt, dy, 0, 16 * kk);
    warp::mma_ABt(s, xc, yt, s);
    warp::mma_ABt(dp, dxc, dyt, dp);
  }
}

// ------------------------------------------------------------------------------------------------
// dQ (and delta)
// ------------------------------------------------------------------------------------------------
template <typename T, int D> struct DQ {
  static constexpr int WARPS = 4, THREADS = 32 * WARPS, BQ = 16 * WARPS, BK = 64;
  static_assert(MASK_BLOCK_ROWS % BQ == 0 && MASK_BLOCK_KEYS % BK == 0);  // (mask_code)
  struct Shared {
    st<T, BQ, D> q, dout;
    st<T, BK, D> k[2], v[2];
  };
};

template <typename T, int D, bool FULL, bool DENSE>
__global__ __launch_bounds__(DQ<T, D>::THREADS) void dq_kernel(const __grid_constant__ Params p) {
  using C = DQ<T, D>;
  constexpr int BQ = C::BQ, BK = C::BK, NT = C::THREADS;
  extern __shared__ __align__(1024) char smem_raw[];
  auto &sm = *reinterpret_cast<typename C::Shared *>(smem_raw);
  const int b = blockIdx.z, h = blockIdx.y, q0 = (gridDim.x - 1 - blockIdx.x) * BQ;
  const int kvh = h / (p.q_heads / p.kv_heads);
  const int tid = threadIdx.x, w = warpid(), qw = q0 + 16 * w;
  const Views<T> g(p, D);
  // Key blocks to visit: in [first, end), minus the ones of other segments (next).
  const int2 range = kv_block_range<FULL>(p, b, q0, BQ, BK);
  const int end = range.y;
  auto next = [&](int j) { return next_kv_block<FULL, DENSE>(p, b, h, q0, BQ, j, end, BK); };
  const int first = next(range.x);

  const cp_async_ring<2> kv;  // the key/value blocks: use n is the n-th block visited
  auto fill = [&](int j, int slot) {
    load_async<NT>(sm.k[slot], g.K, {b, j * BK, kvh, 0}, tid);
    load_async<NT>(sm.v[slot], g.V, {b, j * BK, kvh, 0}, tid);
  };
  load_async<NT>(sm.q, g.Q, {b, q0, h, 0}, tid);
  load_async<NT>(sm.dout, g.dO, {b, q0, h, 0}, tid);
  commit(kv);  // (a group before the ring's)
  if (first < end) fill(first, kv.slot(0));  // the prologue (a ring of two: use 0 alone)
  commit(kv);
  wait_full(kv);  // Q and dO have landed

  // delta = rowsum(dO * O) - dlse, for this warp's rows; the dK/dV kernel reads it back.
  using vec = col_vec<rt_fl<16, BK>>;
  vec delta, lse2, dlse;
  warp::fill_vec(delta, 0.f);
#pragma unroll
  for (int n = 0; n < D / 16; n++) {
    rt_fl<16, 16> o, dout;
    warp::load(o, g.O, {b, qw, h, 16 * n});
    warp::load(dout, sm.dout, 16 * w, 16 * n);
    warp::mul(o, o, dout);
    warp::row_sum(delta, o, delta);
  }
  const int rows_left = p.q_len - qw;
  warp::load(dlse, p.dlse + row_index(p, b, h, max(qw, 0)), rows_left);
  warp::map_vec(delta, delta, dlse, [](float a, float c) { return a - c; });
  if (rows_left > 0) warp::store(p.delta + row_index(p, b, h, qw), delta, rows_left);
  warp::load(lse2, p.lse + row_index(p, b, h, max(qw, 0)), rows_left);
  warp::map_vec(lse2, lse2, lse_to_log2);

  rt_fl<16, 16> dq[D / 16];
#pragma unroll
  for (int n = 0; n < D / 16; n++) warp::zero(dq[n]);
  rt_fl<16, BK> s, dp;
  rt<T, 16, BK> ds, dcap;

  for (int n = 0, j = first; j < end; n++) {
    const int buf = kv.slot(n), k0 = j * BK, j_next = next(j + 1);
    if (j_next < end) fill(j_next, kv.fill_slot(n + kv.AHEAD));
    commit(kv);
    wait_full(kv);

    logits_and_dp<D>(s, dp, sm.q, sm.dout, sm.k[buf], sm.v[buf], 16 * w);  // S = Q K^T, dP = dO V^T
    // P = exp2(S * scale * log2 e - lse2), 0 where masked; dS = P * (dP - delta) (times the cap's
    // derivative).
    scale_logits<FULL>(s, dcap, p);
    if (DENSE && p.bias) add_bias<T, false>(s, p, b, h, qw, k0);
    mask_logits<FULL, DENSE>(s, p, b, h, qw, k0);
    warp::map_row(s, s, lse2, [](float x, float l) { return warp::fn::exp2(x - l); });
    warp::sub_row(dp, dp, delta);
    warp::mul(s, s, dp);
    if (DENSE && p.bias) store_dbias<T, false>(s, p, b, h, qw, k0);  // (this kernel's: dkdv_kernel sees the same dS; no soft cap with a bias)
    softcap_backward<FULL>(s, dcap, p);
    warp::copy(ds, s);

    // dQ += dS K.
#pragma unroll
    for (int n = 0; n < D / 16; n++) {
      rt<T, BK, 16, col_l> kc;
      warp::load(kc, sm.k[buf], 0, 16 * n);
      warp::mma_AB(dq[n], ds, kc, dq[n]);
    }
    release(kv);
    j = j_next;
  }
#pragma unroll
  for (int n = 0; n < D / 16; n++) {
    warp::mul(dq[n], dq[n], p.scale);
    warp::store(g.dQ, dq[n], {b, qw, h, 16 * n});
  }
}

// ------------------------------------------------------------------------------------------------
// dK, dV
// ------------------------------------------------------------------------------------------------
template <typename T, int D> struct DKV {
  static constexpr int WARPS = 4, THREADS = 32 * WARPS, BKV = 16 * WARPS;
  static constexpr int BQ = D <= 64 ? 64 : 32;  // query rows per step (register budget)
  static_assert(MASK_BLOCK_ROWS % BQ == 0 && MASK_BLOCK_KEYS % BKV == 0);  // (mask_code)
  struct Shared {
    st<T, BKV, D> k, v;
    st<T, BQ, D> q[2], dout[2];
    sv<float, BQ> lse2[2], delta[2];
  };
};

template <typename T, int D, bool FULL, bool DENSE>
__global__ __launch_bounds__(DKV<T, D>::THREADS) void dkdv_kernel(const __grid_constant__ Params p) {
  using C = DKV<T, D>;
  constexpr int BQ = C::BQ, BKV = C::BKV, NT = C::THREADS;
  extern __shared__ __align__(1024) char smem_raw[];
  auto &sm = *reinterpret_cast<typename C::Shared *>(smem_raw);
  const int b = blockIdx.z, kvh = blockIdx.y, k0 = (gridDim.x - 1 - blockIdx.x) * BKV;
  const int group = p.q_heads / p.kv_heads;
  const int tid = threadIdx.x, w = warpid(), kw = k0 + 16 * w;
  const Views<T> g(p, D);

  // Steps: (head in group, query block), over the query blocks that may see these keys.
  const int2 qb_range = q_block_range<FULL>(p, b, k0, BKV, BQ);
  const int qb_first = qb_range.x, qb_count = qb_range.y - qb_range.x;
  const int n_steps = group * qb_count;

  auto prefetch = [&](int step, int buf) {
    const int h = kvh * group + step / qb_count, q0 = (qb_first + step % qb_count) * BQ;
    load_async<NT>(sm.q[buf], g.Q, {b, q0, h, 0}, tid);
    load_async<NT>(sm.dout[buf], g.dO, {b, q0, h, 0}, tid);
    for (int i = tid; i < BQ; i += NT) {  // plain loads: ready by the next __syncthreads
      const bool ok = q0 + i < p.q_len;
      sm.lse2[buf][i] = ok ? lse_to_log2(p.lse[row_index(p, b, h, q0 + i)]) : -NEG_INF;
      sm.delta[buf][i] = ok ? p.delta[row_index(p, b, h, q0 + i)] : 0.f;
    }
  };

  load_async<NT>(sm.k, g.K, {b, k0, kvh, 0}, tid);
  load_async<NT>(sm.v, g.V, {b, k0, kvh, 0}, tid);
  // Steps whose query block has no key's segment, or whose mask block is empty, are skipped.
  auto next = [&](int step) {
    while (step < n_steps &&
           !pair_test<FULL, DENSE>(p, b, kvh * group + step / qb_count, (qb_first + step % qb_count) * BQ, BQ, k0, BKV).meet)
      step++;
    return step;
  };
  const int first = next(0);
  const cp_async_ring<2> qs;  // the steps' query blocks: use n is the n-th step taken (K and V join use 0)
  if (first < n_steps) prefetch(first, qs.slot(0));  // the prologue (a ring of two: use 0 alone)
  commit(qs);

  rt_fl<16, 16> dk[D / 16], dv[D / 16];
#pragma unroll
  for (int n = 0; n < D / 16; n++) {
    warp::zero(dk[n]);
    warp::zero(dv[n]);
  }
  rt_fl<16, BQ> s, dp;
  rt<T, 16, BQ> pt, dcap;
  row_vec<rt_fl<16, BQ>> lse2, delta;

  for (int n = 0, step = first; step < n_steps; n++) {
    const int buf = qs.slot(n), h = kvh * group + step / qb_count, q0 = (qb_first + step % qb_count) * BQ;
    const int step_next = next(step + 1);
    if (step_next < n_steps) prefetch(step_next, qs.fill_slot(n + qs.AHEAD));
    commit(qs);
    wait_full(qs);

    logits_and_dp<D>(s, dp, sm.k, sm.v, sm.q[buf], sm.dout[buf], 16 * w);  // S^T = K Q^T, dP^T = V dO^T
    // P^T = exp2(S^T * scale * log2 e - lse2[query]), 0 where masked (and for query rows past the end).
    warp::load(lse2, &sm.lse2[buf][0], BQ);
    warp::load(delta, &sm.delta[buf][0], BQ);
    scale_logits<FULL>(s, dcap, p);
    if (DENSE && p.bias) add_bias<T, true>(s, p, b, h, q0, kw);
    mask_logits_transposed<FULL, DENSE>(s, p, b, h, kw, q0);
    warp::map_col(s, s, lse2, [](float x, float l) { return warp::fn::exp2(x - l); });
    warp::copy(pt, s);

    // dV += P^T dO.
#pragma unroll
    for (int n = 0; n < D / 16; n++) {
      rt<T, BQ, 16, col_l> dc;
      warp::load(dc, sm.dout[buf], 0, 16 * n);
      warp::mma_AB(dv[n], pt, dc, dv[n]);
    }
    // dS^T = P^T * (dP^T - delta[query]) (times the cap's derivative); dK += dS^T Q.
    warp::sub_col(dp, dp, delta);
    warp::mul(s, s, dp);
    softcap_backward<FULL>(s, dcap, p);
    warp::copy(pt, s);
#pragma unroll
    for (int n = 0; n < D / 16; n++) {
      rt<T, BQ, 16, col_l> qc;
      warp::load(qc, sm.q[buf], 0, 16 * n);
      warp::mma_AB(dk[n], pt, qc, dk[n]);
    }
    release(qs);
    step = step_next;
  }
  drain(qs);  // no copy may still be landing when the block exits
#pragma unroll
  for (int n = 0; n < D / 16; n++) {
    warp::mul(dk[n], dk[n], p.scale);
    warp::store(g.dK, dk[n], {b, kw, kvh, 16 * n});
    warp::store(g.dV, dv[n], {b, kw, kvh, 16 * n});
  }
}

}  // namespace

cudaError_t bwd_sm80(const Params &p, cudaStream_t stream) {
  return dispatch<64, 128>(p, [&]<typename T, int D, bool FULL, bool DENSE>() {
    using A = DQ<T, D>;
    using B = DKV<T, D>;
    dim3 grid_q((p.q_len + A::BQ - 1) / A::BQ, p.q_heads, p.batch);
    cudaError_t e = launch(dq_kernel<T, D, FULL, DENSE>, grid_q, dim3(A::THREADS), sizeof(typename A::Shared), stream, p);
    if (e != cudaSuccess) return e;
    dim3 grid_kv((p.kv_len + B::BKV - 1) / B::BKV, p.kv_heads, p.batch);
    return launch(dkdv_kernel<T, D, FULL, DENSE>, grid_kv, dim3(B::THREADS), sizeof(typename B::Shared), stream, p);
  });
}

}  // namespace jax_tk::attention
