// Attention forward on mma.sync (sm_80+), FlashAttention-2 style.
// A block of 4 warps owns 64 query rows of one (batch, head), 16 rows a warp. Key/value blocks of 64
// rows stream through a cp.async ring of two slots (tk::cp_async_ring); each warp computes S = Q K^T,
// keeps a running row max and sum (online softmax in base 2), and accumulates O += P V in fp32. Only
// the key blocks the rows may see are visited (causal, window, lengths); blocks that cross a mask
// boundary, and every block with segment ids, are masked elementwise.
#include "common.cuh"

namespace jax_tk::attention {
namespace {

using namespace tk;

template <typename T, int D> struct Fwd {
  static constexpr int WARPS = 4, THREADS = 32 * WARPS, BQ = 16 * WARPS, BK = 64;
  static_assert(MASK_BLOCK_ROWS % BQ == 0 && MASK_BLOCK_KEYS % BK == 0);  // (mask_code)
  using q_tile = st<T, BQ, D>;
  using kv_tile = st<T, BK, D>;
  struct Shared {
    q_tile q;
    kv_tile k[2], v[2];
  };
};

template <typename T, int D, bool FULL, bool DENSE>
__global__ __launch_bounds__(Fwd<T, D>::THREADS) void fwd_kernel(const __grid_constant__ Params p) {
  using C = Fwd<T, D>;
  constexpr int BQ = C::BQ, BK = C::BK, NT = C::THREADS;
  extern __shared__ __align__(1024) char smem_raw[];
  auto &sm = *reinterpret_cast<typename C::Shared *>(smem_raw);

  const int b = blockIdx.z, h = blockIdx.y;
  const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;  // heaviest (causal) blocks first
  const int kvh = h / (p.q_heads / p.kv_heads);
  const int tid = threadIdx.x, w = warpid(), qw = q0 + 16 * w;
  auto Q = gl<const T>::make(static_cast<const T *>(p.q), p.batch, p.q_len, p.q_heads, D);
  auto K = gl<const T>::make(static_cast<const T *>(p.k), p.batch, p.kv_len, p.kv_heads, D);
  auto V = gl<const T>::make(static_cast<const T *>(p.v), p.batch, p.kv_len, p.kv_heads, D);
  // Key blocks to visit: in [first, end), minus the ones of other segments (next).
  const int2 range = kv_block_range<FULL>(p, b, q0, BQ, BK);
  const int end = range.y;
  auto next = [&](int j) { return next_kv_block<FULL, DENSE>(p, b, h, q0, BQ, j, end, BK); };
  const int first = next(range.x);

  const cp_async_ring<2> kv;  // the key/value blocks: use n is the n-th block visited
  auto fill = [&](int j, int slot) {
    load_async<NT>(sm.k[slot], K, {b, j * BK, kvh, 0}, tid);
    load_async<NT>(sm.v[slot], V, {b, j * BK, kvh, 0}, tid);
  };
  load_async<NT>(sm.q, Q, {b, q0, h, 0}, tid);
  commit(kv);  // (a group before the ring's)
  if (first < end) fill(first, kv.slot(0));  // the prologue (a ring of two: use 0 alone)
  commit(kv);
  wait_full(kv);  // the query rows have landed

  rt<T, 16, 16> q[D / 16];  // this warp's 16 query rows
#pragma unroll
  for (int kk = 0; kk < D / 16; kk++) warp::load(q[kk], sm.q, 16 * w, 16 * kk);

  rt_fl<16, 16> o[D / 16];
  rt_fl<16, BK> s;
  rt<T, 16, BK> pr;
  col_vec<rt_fl<16, BK>> m, corr, l;
#pragma unroll
  for (int n = 0; n < D / 16; n++) warp::zero(o[n]);
  warp::fill_vec(m, NEG_INF);
  warp::fill_vec(l, 0.f);

  for (int n = 0, j = first; j < end; n++) {
    const int buf = kv.slot(n), k0 = j * BK, j_next = next(j + 1);
    if (j_next < end) fill(j_next, kv.fill_slot(n + kv.AHEAD));  // prefetch the next key/value block
    commit(kv);
    wait_full(kv);

    // S = Q K^T (raw logits: the softmax scales them, see logit_factor).
    warp::zero(s);
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
      rt<T, BK, 16> kt;
      warp::load(kt, sm.k[buf], 0, 16 * kk);
      warp::mma_ABt(s, q[kk], kt, s);
    }
    cap_logits<FULL, DENSE>(s, p);
    if (DENSE && p.bias) add_bias<T, false>(s, p, b, h, qw, k0);
    mask_logits<FULL, DENSE>(s, p, b, h, qw, k0);
    softmax_step(s, m, l, corr, logit_factor<FULL, DENSE>(p));

    // O = O * corr + P V.
    warp::copy(pr, s);
#pragma unroll
    for (int n = 0; n < D / 16; n++) {
      rt<T, BK, 16, col_l> vt;
      warp::load(vt, sm.v[buf], 0, 16 * n);
      warp::mul_row(o[n], o[n], corr);
      warp::mma_AB(o[n], pr, vt, o[n]);
    }
    release(kv);  // everyone is done with `buf` before it is refilled
    j = j_next;
  }

  store_lse(p, m, l, logit_factor<FULL, DENSE>(p), sink2(p, b, h), b, h, qw);  // (with a sink, l grows)
#pragma unroll
  for (int n = 0; n < D / 16; n++) store_output<T>(p, o[n], l, b, h, qw, 16 * n);
}

}  // namespace

cudaError_t fwd_sm80(const Params &p, cudaStream_t stream) {
  return dispatch<64, 128>(p, [&]<typename T, int D, bool FULL, bool DENSE>() {
    using C = Fwd<T, D>;
    dim3 grid((p.q_len + C::BQ - 1) / C::BQ, p.q_heads, p.batch);
    return launch(fwd_kernel<T, D, FULL, DENSE>, grid, dim3(C::THREADS), sizeof(typename C::Shared), stream, p);
  });
}

}  // namespace jax_tk::attention
