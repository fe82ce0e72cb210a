// The gated delta rule's per-chunk solve (the "WY" or "UT" form; any GPU of sm_80 or later). Within a
// chunk of C = 64 tokens, with G its cumulative log decay and beta the write strengths, the delta
// rule's new values are U = U' - W S for the state S the chunk starts from, where
//
//   A_ij = beta_i exp(G_i - G_j) (k_i . k_j) for j < i, else 0      (strictly lower triangular)
//   T = (I + A)^-1,   W = T diag(beta exp(G)) K,   U' = T diag(beta) V
//
// none of which depends on the state: every chunk of every sequence and head is solved at once, here,
// and the sequential pass (simple_gla_fwd_sm90.cu's kernel with DELTA) needs only U = U' - W S. A
// block of four warps takes one chunk of one value head: A by mma.sync, T by forward substitution in
// float32 (thread c of the first two warps solves column c), then T diag(beta) and T diag(beta exp(G))
// in the inputs' type, so that W and U' are plain products with K and V as loaded (by mma.sync, V a
// slice at a time, the next slice loading while this one multiplies). Rows past the sequence load as
// zeros, take beta = 0 (they then add nothing) and are not stored.
#include "linear_attention/common.cuh"

namespace jax_tk::linear_attention {
namespace {

using namespace tk;

template <typename T, int K> struct Wy {
  static constexpr int C = CHUNK, VS = V_SLICE, THREADS = 128;
  struct Shared {
    st<T, C, K> k;
    st<T, C, VS> v[2];   // slices of V, double-buffered
    st<T, C, C> tu, tw;  // T diag(beta), T diag(beta exp(G))
    float a[C][C + 1];   // A (float32; a padded row: column c of the solve reads across rows)
    float beta[C], cum[C];
  };
};

// T = (I + A)^-1's column c (c = tid < C): t_i = [i == c] - sum_{j < i} A_ij t_j, the sum over four
// accumulators (a quarter of the dependent chain); written scaled as T diag(beta) and T diag(beta exp(G)).
// tk: column c of T in the kept T (row i at tk[i * stride]), or nullptr.
template <typename T, int K>
__device__ __forceinline__ void solve_column(typename Wy<T, K>::Shared &sm, int c, T *tk, size_t stride, int valid) {
  constexpr int C = Wy<T, K>::C;
  float t[C];
#pragma unroll
  for (int i = 0; i < C; i++) {
    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < i; j++) s[j % 4] += sm.a[i][j] * t[j];
    t[i] = (i == c ? 1.f : 0.f) - ((s[0] + s[1]) + (s[2] + s[3]));
  }
  const float bu = sm.beta[c], bw = bu * exp2f(sm.cum[c] * LOG2E);
#pragma unroll
  for (int i = 0; i < C; i++) {
    sm.tu(i, c) = T(t[i] * bu);
    sm.tw(i, c) = T(t[i] * bw);
  }
  if (tk) {  // (for the backward: T itself, row i at the chunk's token i, past the sequence not stored)
#pragma unroll
    for (int i = 0; i < C; i++)
      if (i < valid) tk[i * stride] = T(t[i]);
  }
}

template <typename T, int K> __global__ __launch_bounds__(128) void wy_fwd_kernel(const __grid_constant__ WyParams p) {
  using W = Wy<T, K>;
  constexpr int C = W::C, VS = W::VS;
  extern __shared__ __align__(1024) char smem_raw[];
  auto &sm = *reinterpret_cast<typename W::Shared *>(smem_raw);
  const int h = blockIdx.y, chunk = blockIdx.x % p.max_chunks, n = blockIdx.x / p.max_chunks;
  const Sequence seq{p.cu_seqlens, p.seq_len, n};
  const int b = seq.b, bos = seq.bos, len = seq.len;
  const int t0 = C * chunk, valid = min(C, len - t0);
  if (valid <= 0) return;
  const int tid = threadIdx.x, w = tid / 32, hq = h / (p.v_heads / p.heads);
  const size_t row0 = (size_t)b * p.seq_len + bos + t0;  // (the chunk's first token in [batch * seq_len])

  // K's rows and V's first slice (zeros past the sequence), beta and the decays' cumulative sum G.
  const auto kg = gl<const T>::make(static_cast<const T *>(p.k) + row0 * p.heads * K, 1, valid, p.heads, K);
  const auto vg = gl<const T>::make(static_cast<const T *>(p.v) + row0 * p.v_heads * p.v_dim, 1, valid, p.v_heads, p.v_dim);
  load_async<W::THREADS>(sm.k, kg, {0, 0, hq, 0}, tid);
  load_async<W::THREADS>(sm.v[0], vg, {0, 0, h, 0}, tid);
  commit_group();
  const size_t gate = ((size_t)b * p.v_heads + h) * p.seq_len + bos + t0;
  if (tid < C) {
    sm.beta[tid] = tid < valid ? p.beta[gate + tid] : 0.f;
    float x = tid < valid ? p.g[gate + tid] : 0.f;
    for (int d = 1; d < 32; d *= 2) {
      const float y = __shfl_up_sync(~0u, x, d);
      if (laneid() >= d) x += y;
    }
    sm.cum[tid] = x;
  }
  wait_group<0>();
  __syncthreads();
  if (tid >= 32 && tid < C) sm.cum[tid] += sm.cum[31];
  __syncthreads();

  // A: this warp's 16 rows.
  {
    rt<T, 16, K> kr;
    rt<T, C, K> ka;
    rt_fl<16, C> acc;
    warp::load(kr, sm.k, 16 * w, 0);
    warp::load(ka, sm.k);
    warp::zero(acc);
    warp::mma_ABt(acc, kr, ka, acc);
    rv<float2, 16, typename col_vec<rt_fl<16, C>>::layout> ri;  // {G_i, beta_i (i past: 0)} and i
    rv<float, C, typename row_vec<rt_fl<16, C>>::layout> gj;
    warp::map_index(ri, [&](int r) { return float2{sm.cum[16 * w + r], sm.beta[16 * w + r]}; });
    warp::map_index(gj, [&](int j) { return sm.cum[j]; });
    rv<int, C, typename row_vec<rt_fl<16, C>>::layout> cols;
    rv<int, 16, typename col_vec<rt_fl<16, C>>::layout> rows;
    warp::map_index(cols, [](int j) { return j; });
    warp::map_index(rows, [&](int r) { return 16 * w + r; });
    warp::map_outer(acc, acc, ri, gj, [](float x, float2 i, float gj) { return i.y * x * exp2f((i.x - gj) * LOG2E); });
    warp::map_outer(acc, acc, rows, cols, [](float x, int i, int j) { return j < i ? x : 0.f; });
    warp::store(gl<float>::make(&sm.a[0][0], 1, C, 1, C + 1), acc, {0, 16 * w, 0, 0});
  }
  __syncthreads();
  if (tid < C) {
    T *tk = p.t ? static_cast<T *>(p.t) + (row0 * p.v_heads + h) * C + tid : nullptr;
    solve_column<T, K>(sm, tid, tk, size_t(p.v_heads) * C, valid);
  }
  __syncthreads();

  {  // W = T diag(beta exp(G)) K
    rt<T, 16, C> tr;
    rt<T, C, K, col_l> kb;
    rt_fl<16, K> acc;
    warp::load(tr, sm.tw, 16 * w, 0);
    warp::load(kb, sm.k);
    warp::zero(acc);
    warp::mma_AB(acc, tr, kb, acc);
    warp::store(gl<T>::make(static_cast<T *>(p.w) + row0 * p.v_heads * K, 1, valid, p.v_heads, K), acc, {0, 16 * w, h, 0});
  }
  // U' = T diag(beta) V, a slice of V at a time.
  rt<T, 16, C> tr;
  warp::load(tr, sm.tu, 16 * w, 0);
  const auto ug = gl<T>::make(static_cast<T *>(p.u) + row0 * p.v_heads * p.v_dim, 1, valid, p.v_heads, p.v_dim);
  const int slices = p.v_dim / VS;
  for (int s = 0; s < slices; s++) {
    if (s + 1 < slices) {
      __syncthreads();  // (the slice two back, in the buffer this load fills, has been read)
      load_async<W::THREADS>(sm.v[(s + 1) % 2], vg, {0, 0, h, (s + 1) * VS}, tid);
      commit_group();
      wait_group<1>();
    } else {
      wait_group<0>();
    }
    __syncthreads();
    rt<T, C, VS, col_l> vb;
    rt_fl<16, VS> acc;
    warp::load(vb, sm.v[s % 2]);
    warp::zero(acc);
    warp::mma_AB(acc, tr, vb, acc);
    warp::store(ug, acc, {0, 16 * w, h, s * VS});
  }
}

template <typename T, int K> cudaError_t run(const WyParams &p, cudaStream_t stream) {
  const dim3 grid(unsigned(p.num_seqs * p.max_chunks), unsigned(p.v_heads));
  const int smem = sizeof(typename Wy<T, K>::Shared);
  if (cudaError_t e = cudaFuncSetAttribute(wy_fwd_kernel<T, K>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem); e != cudaSuccess)
    return e;
  wy_fwd_kernel<T, K><<<grid, 128, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t wy_fwd(const WyParams &p, cudaStream_t stream) {
  if (p.v_dim % V_SLICE != 0 || (p.k_dim != 64 && p.k_dim != 128) || p.heads <= 0 || p.v_heads % p.heads != 0)
    return cudaErrorInvalidValue;
  if (p.num_seqs == 0 || p.max_chunks == 0) return cudaSuccess;
  auto by_k = [&]<typename T>() { return p.k_dim == 64 ? run<T, 64>(p, stream) : run<T, 128>(p, stream); };
  return p.dtype == DType::bf16 ? by_k.template operator()<bf16>() : by_k.template operator()<half>();
}

}  // namespace jax_tk::linear_attention
