// The gated delta rule's per-chunk solve (the "WY" or "UT" form; any GPU of sm_80 or later). Within a
// chunk of C = 64 tokens, with G its cumulative log decay and beta the write strengths, the delta
// rule's new values are U = T diag(beta) (V - diag(exp(G)) K S) for the state S the chunk starts from,
// where
//
//   A_ij = beta_i exp(G_i - G_j) (k_i . k_j) for j < i, else 0      (strictly lower triangular)
//   T = (I + A)^-1
//
// does not depend on the state: every chunk of every sequence and head is solved at once, here, and
// the sequential pass (gdr_fwd_sm90.cu) reads T. For the backward it also writes W = T diag(beta
// exp(G)) K. A block of four warps takes one chunk of one value head: A by mma.sync; T by blocks
// (block_inverse: the 16 x 16 diagonal blocks by forward substitution in float32, then merged to 32
// and 64 by matrix products); W (where asked) as a plain product of T diag(beta exp(G)), in the inputs'
// type, with K as loaded. Rows past the sequence load as zeros, take beta = 0 (they then add nothing)
// and are not stored.
#include "linear_attention/common.cuh"

namespace jax_tk::linear_attention {
namespace {

using namespace tk;

template <typename T, int K> struct Wy {
  static constexpr int C = CHUNK, THREADS = 128;
  // The solve's buffers and W's operand share memory (one is done before the other starts): at 66 KB a
  // block, three fit on an SM, where the latency of each block's chain of small steps wants warps.
  struct Solve {
    float a[C][C + 1];   // A (float32; a padded row: column c of the solve reads across rows)
    float xf[C][C + 1];  // the diagonal blocks' inverses (float32)
    st<T, C, C> x, y;    // block_inverse's operands: the inverse so far, corner times it
  };
  struct Shared {
    st<T, C, K> k;
    union {
      Solve solve;
      st<T, C, C> tw;  // T diag(beta exp(G))
    };
    float beta[C], cum[C];
  };
  static constexpr int BLOCKS_PER_SM = 3;
  static_assert(BLOCKS_PER_SM * (sizeof(Shared) + 1024) <= 228 * 1024);  // (an H100/H200 SM; 2 on an A100)
};

// T = (I + A)^-1 by blocks (every thread of the block; A in sm.solve.a). The inverse of [[X, 0], [Y, Z]] is
// [[X^-1, 0], [-Z^-1 Y X^-1, Z^-1]]: with `inv` holding the inverses of the diagonal blocks of size s,
// inv - inv L inv, L the lower-left s-blocks of the diagonal blocks of size 2s (A's), holds those of
// size 2s. s = 16 by forward substitution in float32 (thread c < C: column c of its block, 16 steps),
// then two merges by mma.sync (float32 accumulation, operands in the inputs' type). Returns this warp's
// 16 rows of T in float32.
template <typename T, int K> __device__ __forceinline__ rt_fl<16, CHUNK> block_inverse(typename Wy<T, K>::Shared &sm) {
  constexpr int C = Wy<T, K>::C, B = 16;
  const int tid = threadIdx.x, w = tid / 32;
  for (int i = tid; i < C * (C + 1); i += Wy<T, K>::THREADS) (&sm.solve.xf[0][0])[i] = 0.f;
  __syncthreads();
  if (tid < C) {
    const int d = tid / B * B;  // the block's first row and column
    float t[B];
#pragma unroll
    for (int i = 0; i < B; i++) {
      float s = d + i == tid ? 1.f : 0.f;
#pragma unroll
      for (int j = 0; j < i; j++) s -= sm.solve.a[d + i][d + j] * t[j];
      t[i] = s;
      sm.solve.xf[d + i][tid] = s;
    }
  }
  __syncthreads();
  const auto view = [](float (*m)[C + 1]) { return gl<float>::make(&m[0][0], 1, C, 1, C + 1); };
  rt_fl<16, C> inv, acc;
  rt<T, 16, C> ir;
  warp::load(inv, view(sm.solve.xf), {0, 16 * w, 0, 0});
  warp::copy(ir, inv);
  warp::store(sm.solve.x, ir, 16 * w, 0);
  __syncthreads();
#pragma unroll
  for (int s = B; s < C; s *= 2) {
    rt_fl<16, C> corner;  // this warp's rows of L
    warp::load(corner, view(sm.solve.a), {0, 16 * w, 0, 0});
    warp::map_indexed(corner, corner, [=](int r, int j, float x) {
      const int i = 16 * w + r;
      return i / s == j / s + 1 && (j / s) % 2 == 0 ? x : 0.f;
    });
    rt<T, 16, C> cr;
    rt<T, C, C, col_l> xb;
    warp::copy(cr, corner);
    warp::load(xb, sm.solve.x);
    warp::zero(acc);
    warp::mma_AB(acc, cr, xb, acc);  // L inv
    warp::copy(cr, acc);
    warp::store(sm.solve.y, cr, 16 * w, 0);
    __syncthreads();
    warp::load(xb, sm.solve.y);
    warp::zero(acc);
    warp::mma_AB(acc, ir, xb, acc);  // inv (L inv)
    warp::map(inv, inv, acc, [](float x, float y) { return x - y; });
    warp::copy(ir, inv);
    __syncthreads();  // (every warp has read sm.solve.x)
    warp::store(sm.solve.x, ir, 16 * w, 0);
    __syncthreads();
  }
  return inv;
}

template <typename T, int K> __global__ __launch_bounds__(128, Wy<T, K>::BLOCKS_PER_SM) void wy_fwd_kernel(const __grid_constant__ WyParams p) {
  using W = Wy<T, K>;
  constexpr int C = W::C;
  extern __shared__ __align__(1024) char smem_raw[];
  auto &sm = *reinterpret_cast<typename W::Shared *>(smem_raw);
  const int h = blockIdx.y, chunk = blockIdx.x % p.max_chunks, n = blockIdx.x / p.max_chunks;
  const Sequence seq{p.cu_seqlens, p.seq_len, n};
  const int b = seq.b, bos = seq.bos, len = seq.len;
  const int t0 = C * chunk, valid = min(C, len - t0);
  if (valid <= 0) return;
  const int tid = threadIdx.x, w = tid / 32, hq = h / (p.v_heads / p.heads);
  const size_t row0 = (size_t)b * p.seq_len + bos + t0;  // (the chunk's first token in [batch * seq_len])

  // K's rows (zeros past the sequence), beta and the decays' cumulative sum G.
  const auto kg = gl<const T>::make(static_cast<const T *>(p.k) + row0 * p.heads * K, 1, valid, p.heads, K);
  load_async<W::THREADS>(sm.k, kg, {0, 0, hq, 0}, tid);
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
    warp::store(gl<float>::make(&sm.solve.a[0][0], 1, C, 1, C + 1), acc, {0, 16 * w, 0, 0});
  }
  __syncthreads();
  // T (this warp's rows), then where W is asked T diag(beta exp(G)) in the inputs' type, and W.
  const rt_fl<16, C> t = block_inverse<T, K>(sm);
  warp::store(gl<T>::make(static_cast<T *>(p.t) + row0 * p.v_heads * C, 1, valid, p.v_heads, C), t, {0, 16 * w, h, 0});
  if (!p.w) return;
  {
    rv<float, C, typename row_vec<rt_fl<16, C>>::layout> bgj;
    warp::map_index(bgj, [&](int j) { return sm.beta[j] * exp2f(sm.cum[j] * LOG2E); });
    rt_fl<16, C> tb;
    rt<T, 16, C> tr;
    warp::map_col(tb, t, bgj, [](float x, float s) { return x * s; });
    warp::copy(tr, tb);
    warp::store(sm.tw, tr, 16 * w, 0);  // (block_inverse ended on a barrier: its buffers are free)
  }
  __syncthreads();
  rt<T, 16, C> tr;
  rt<T, C, K, col_l> kb;
  rt_fl<16, K> acc;
  warp::load(tr, sm.tw, 16 * w, 0);
  warp::load(kb, sm.k);
  warp::zero(acc);
  warp::mma_AB(acc, tr, kb, acc);
  warp::store(gl<T>::make(static_cast<T *>(p.w) + row0 * p.v_heads * K, 1, valid, p.v_heads, K), acc, {0, 16 * w, h, 0});
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
  if ((p.k_dim != 64 && p.k_dim != 128) || p.heads <= 0 || p.v_heads % p.heads != 0 || !p.t) return cudaErrorInvalidValue;
  if (p.num_seqs == 0 || p.max_chunks == 0) return cudaSuccess;
  auto by_k = [&]<typename T>() { return p.k_dim == 64 ? run<T, 64>(p, stream) : run<T, 128>(p, stream); };
  return p.dtype == DType::bf16 ? by_k.template operator()<bf16>() : by_k.template operator()<half>();
}

}  // namespace jax_tk::linear_attention
