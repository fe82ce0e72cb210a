// Simple GLA's backward on Hopper (sm_90a), second pass: every chunk at once. A chunk with the state S it
// starts from (the forward's, kept), the gradient dS' of the state it hands on (the first pass's) and dO
// has, with P = D * Q K^T and dP = D * dO V^T (D_ij = exp(G_i - G_j) for j <= i, else 0; both times
// scale) and K_d = diag(exp(G_last - G)) K:
//
//   dQ = scale diag(exp(G)) dO S^T + dP K
//   dK = dP^T Q + diag(exp(G_last - G)) V dS'^T
//   dV = P^T dO + K_d dS'
//   dG_i = q_i . dq_i - k_i . dk_i, and at the last token also + <S', dS'> (the state handed on, S' =
//          exp(G_last) S + K_d^T V: exp(G_last) <S, dS'> + sum_j k_j . (diag(exp(G_last - G)) V dS'^T)_j)
//   dg = dG summed from each token to the chunk's end (G is the decays' running sum)
//
// A grid of about a block per SM walks the chunks of every value head (a tile: one chunk of one value
// head; strided in the pipeline template). A producer thread loads each tile's Q and K (two buffers)
// and then, 64 value columns at a time, V, dO, S and dS' (TMA, two stages): the next tile's while the
// consumers work on this one's, since a tile's math is a chain of dependent products and its loads are
// what can overlap. Two consumer warpgroups share the slices: the first forms dO V^T and dO S^T (the
// sums over the value columns of dP and dQ), the second V dS'^T and each slice of dV (with P and K_d it
// formed first) and <S, dS'>. The first hands dP over through shared memory and finishes dQ; the second
// finishes dK; both hand their part of dG to a warp that sums it backward. dQ and dK: store_dqk.
#include "linear_attention/common.cuh"

namespace jax_tk::linear_attention {
namespace {

using namespace tk;

template <typename T, int K> struct GlaDc {
  using Roles = roles</*CONSUMERS=*/2, /*PRODUCER_REGS=*/40, /*CONSUMER_REGS=*/232>;
  static constexpr int C = CHUNK, VS = V_SLICE, STAGES = 2, THREADS = Roles::THREADS;
  static constexpr int DQ = 0;  // the consumer warpgroup that finishes dQ (the other: dK, dV)
  static_assert(C == 64 && VS == 64 && (K == 64 || K == 128));
  struct Shared {
    st<T, C, K> q[2], k[2], kd;        // Q, K (this tile's and the next's), K_d
    st<T, C, C> p, dp;                 // P, dP (both scaled)
    st<T, C, VS> v[STAGES], d[STAGES];  // a slice of V, of dO
    st<T, K, VS> s[STAGES], ds[STAGES];  // a slice of S, of dS'
    float cum[2][C];                   // G, each warpgroup's copy
    // dG as it gathers (zeroed again by the warp that sums it), k . (V dS'^T)_k (by the threads that
    // add it up) and the last token's <S', dS'> (by tile parity: the next tile's may start before the
    // sum has read this one's)
    float dg[C], kdc[C], extra[2];
    semaphore qk_full[2], qk_empty[2], full[STAGES], empty[STAGES];
  };
  static_assert(sizeof(Shared) <= MAX_SHARED_BYTES);
};

template <typename T> struct DcArgs {
  BwdParams p;
  tma_map<T, CHUNK> q, k, v, d, s, ds;
};

template <typename T, int K> struct GlaDcSm90 : ChunkTile {
  using G = GlaDc<T, K>;
  using Roles = typename G::Roles;
  using tile = rt_fl<16, 64>;
  using cvec = col_vec<tile>;
  using rvec = row_vec<tile>;
  static constexpr int C = G::C, VS = G::VS, STAGES = G::STAGES;
  const DcArgs<T> &a;
  typename G::Shared &sm;
  const FwdParams &f = a.p.f;
  __device__ __forceinline__ ring<STAGES> kv() const { return {sm.full, sm.empty}; }
  __device__ __forceinline__ ring<2> qk() const { return {sm.qk_full, sm.qk_empty}; }
  const int wg = warpgroup::groupid();
  const int slices = f.v_dim / VS, tiles = int(count(f));
  int kv_n = 0, qk_n = 0;  // the rings' uses so far

  __device__ __forceinline__ void init() const {
    tk::init(kv(), 1, 8);  // (empty: each consumer warp of both warpgroups)
    tk::init(qk(), 1, 8);
    sm.extra[0] = sm.extra[1] = 0.f;
    for (int i = 0; i < C; i++) sm.dg[i] = sm.kdc[i] = 0.f;
  }

  __device__ __forceinline__ void load(int t) {
    const int state = take(f, t);
    if (state < 0) return;
    const int hq = h / (f.v_heads / f.heads);
    const ring_use<2> u(qk_n++);
    wait_empty(qk(), u);
    arrive_expect_bytes(qk().full(u), sizeof(sm.q[0]) + sizeof(sm.k[0]));
    load_async(sm.q[u.slot], a.q, {b, t0, hq, 0}, qk().full(u));
    load_async(sm.k[u.slot], a.k, {b, t0, hq, 0}, qk().full(u));
    for (ring_pos<STAGES> at(kv_n); at.n < kv_n + slices; ++at) {
      semaphore &full = kv().full(at);
      const int col = VS * (at.n - kv_n);
      wait_empty(kv(), at);
      arrive_expect_bytes(full, sizeof(sm.v[0]) + sizeof(sm.d[0]) + sizeof(sm.s[0]) + sizeof(sm.ds[0]));
      load_async(sm.v[at.slot], a.v, {b, t0, h, col}, full);
      load_async(sm.d[at.slot], a.d, {b, t0, h, col}, full);
#pragma unroll
      for (int r = 0; r < K; r += C) {
        load_rows_async(sm.s[at.slot], r, a.s, {state, r, 0, col}, full);
        load_rows_async(sm.ds[at.slot], r, a.ds, {state, r, 0, col}, full);
      }
    }
    kv_n += slices;
  }

  // G into this warpgroup's copy; {G_i, i} of this warp's rows and {G_j, j} of all.
  __device__ __forceinline__ const float *scan() const {
    const int tid = threadIdx.x % 128;
    const float *g = f.g + ((size_t)b * f.v_heads + h) * f.seq_len + t0;
    scan_decays(sm.cum[wg], tid < valid ? g[tid] : 0.f, 1 + wg);
    return sm.cum[wg];
  }
  // This warp's rows' s_i (the sign of their part of dG, 0 past the sequence).
  __device__ __forceinline__ cvec signs(float s) const {
    cvec v;
    warp::map_index(v, [&](int r) { return 16 * (warpid() % 4) + r < valid ? s : 0.f; });
    return v;
  }

  __device__ __forceinline__ void start() const {}
  __device__ __forceinline__ void finish() const {}
  __device__ __forceinline__ void consume(int t) {
    if (take(f, t) < 0) return;
    const ring_use<2> u(qk_n++);
    wait_full(qk(), u);
    if (wg == G::DQ) finish_dq(u.slot);
    else finish_dk_dv(u.slot);
    if (laneid() == 0) arrive_empty(qk(), u);
    sync_named_unaligned(3, 256);  // (both parts of dG)
    if (threadIdx.x / 32 == 0) sum_dg(u.slot);
    kv_n += slices;
  }

  // dP and dQ = diag(scale exp(G)) dO S^T + dP K.
  __device__ __forceinline__ void finish_dq(int qs) const {
    const int w = warpid() % 4;
    const float *cum = scan();
    tile dp;
    rt_fl<16, K> dq;
    // (zeroed rather than a first product that overwrites them: accumulators left undefined before a
    // loop are live across the tiles' loop, which spills)
    warp::zero(dp), warp::zero(dq);
    for (ring_pos<STAGES> at(kv_n); at.n < kv_n + slices; ++at) {
      wait_full(kv(), at);
      warpgroup::mma_ABt(dp, sm.d[at.slot], sm.v[at.slot], true);  // dO V^T
      warpgroup::mma_ABt(dq, sm.d[at.slot], sm.s[at.slot], true);  // dO S^T
      warpgroup::wait<0>();
      if (laneid() == 0) arrive_empty(kv(), at);
    }
    warpgroup::fence_registers(dp);
    warpgroup::fence_registers(dq);
    const rt<T, 16, 64> dpw = store_decayed(sm.dp, dp, cum, valid, f.scale);
    warpgroup::fence_shared_writes();
    sync_named_unaligned(4, 256);  // (dP to the other warpgroup)
    cvec e;  // scale exp(G_i), 0 past the sequence
    const float scale = f.scale;
    warp::map_index(e, [&](int r) { return 16 * w + r < valid ? scale * warp::fn::exp2(cum[16 * w + r] * LOG2E) : 0.f; });
    warp::map_row(dq, dq, e, [](float x, float s) { return s != 0.f ? x * s : 0.f; });
    warpgroup::mma_AB(dq, dpw, sm.k[qs], true);  // + dP K
    warpgroup::wait<0>();
    warpgroup::fence_registers(dq);
    store_dqk<T>(a.p.dq, a.p, dq, b, end, t0 + 16 * w, h);
    add_row_dots(sm.dg, dq, sm.q[qs], signs(1.f));  // q . dq
  }

  // P, K_d, then per slice dV = P^T dO + K_d dS' (stored) and the sums V dS'^T, <S, dS'>; dK.
  __device__ __forceinline__ void finish_dk_dv(int qs) const {
    const int w = warpid() % 4, tid = threadIdx.x % 128;
    const float *cum = scan();
    const float last = cum[valid - 1];
    const cvec ed = decay_to_end(cum, valid);
    {
      tile pt;
      warpgroup::mma_ABt(pt, sm.q[qs], sm.k[qs], false);  // Q K^T
      rt<T, 16, K> kr;
      warp::load(kr, sm.k[qs], 16 * w, 0);
      warp::mul_row(kr, kr, ed);
      warp::store(sm.kd, kr, 16 * w, 0);
      warpgroup::wait<0>();
      warpgroup::fence_registers(pt);
      store_decayed(sm.p, pt, cum, valid, f.scale);
      warpgroup::fence_shared_writes();
      sync_named(2, 128);
    }
    rt_fl<16, K> dk;
    warp::zero(dk);  // (as in finish_dq)
    float frob = 0.f;  // this thread's part of <S, dS'>
    const gl<T> dv = gl<T>::make(static_cast<T *>(a.p.dv) + (size_t)b * f.seq_len * f.v_heads * f.v_dim, 1, end, f.v_heads,
                                 f.v_dim);
    for (ring_pos<STAGES> at(kv_n); at.n < kv_n + slices; ++at) {
      wait_full(kv(), at);
      tile dvs;
      warpgroup::mma_ABt(dk, sm.v[at.slot], sm.ds[at.slot], true);  // V dS'^T
      warpgroup::mma_AtB(dvs, sm.p, sm.d[at.slot], false);               // P^T dO
      warpgroup::mma_AB(dvs, sm.kd, sm.ds[at.slot], true);               // + K_d dS'
      for (int i = tid; i < K * VS; i += 128) frob += float(sm.s[at.slot](i / VS, i % VS)) * float(sm.ds[at.slot](i / VS, i % VS));
      warpgroup::wait<0>();
      warpgroup::fence_registers(dvs);
      if (laneid() == 0) arrive_empty(kv(), at);
      warp::store(dv, dvs, {0, t0 + 16 * w, h, VS * (at.n - kv_n)});
    }
    warpgroup::fence_registers(dk);
    warp::map_row(dk, dk, ed, [](float x, float s) { return s != 0.f ? x * s : 0.f; });  // diag(exp(G_last - G)) V dS'^T
    {  // the last token's <S', dS'> = exp(G_last) <S, dS'> + sum_j k_j . (diag(exp(G_last - G)) V dS'^T)_j
      add_row_dots(sm.kdc, dk, sm.k[qs], signs(1.f));
      for (int o = 16; o > 0; o /= 2) frob += __shfl_xor_sync(~0u, frob, o);
      if (laneid() == 0) atomicAdd(&sm.extra[qs], frob * warp::fn::exp2(last * LOG2E));
      sync_named(2, 128);  // (every warp's row dots)
      if (tid < C) atomicAdd(&sm.extra[qs], sm.kdc[tid]), sm.kdc[tid] = 0.f;
    }
    sync_named_unaligned(4, 256);  // (dP from the other warpgroup)
    warpgroup::mma_AtB(dk, sm.dp, sm.q[qs], true);  // + dP^T Q
    warpgroup::wait<0>();
    warpgroup::fence_registers(dk);
    store_dqk<T>(a.p.dk, a.p, dk, b, end, t0 + 16 * w, h);
    add_row_dots(sm.dg, dk, sm.k[qs], signs(-1.f));  // - k . dk
  }

  // One warp: dg_t = sum over the chunk's tokens i >= t of dG_i, two tokens a lane (t = lane, lane + 32);
  // dG and <S', dS'> zeroed for the tiles after.
  __device__ __forceinline__ void sum_dg(int qs) const {
    const int l = laneid();
    auto dG = [&](int i) { return i < valid ? sm.dg[i] + (i == valid - 1 ? sm.extra[qs] : 0.f) : 0.f; };
    float lo = dG(l), hi = dG(l + 32);
    sm.dg[l] = sm.dg[l + 32] = 0.f;
    __syncwarp();
    if (l == 0) sm.extra[qs] = 0.f;
    suffix_sums(lo, hi);
    float *dg = a.p.dg + ((size_t)b * f.v_heads + h) * f.seq_len + t0;
    if (l < valid) dg[l] = lo;
    if (l + 32 < valid) dg[l + 32] = hi;
  }
};

template <typename T, int K>
__global__ __launch_bounds__(GlaDc<T, K>::THREADS, 1) void gla_bwd_chunks_kernel(const __grid_constant__ DcArgs<T> a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem_raw[];
  GlaDcSm90<T, K> k{{}, a, *reinterpret_cast<typename GlaDc<T, K>::Shared *>(smem_raw)};
  strided(k);
#endif
}

template <typename T, int K> cudaError_t run(const BwdParams &p, cudaStream_t stream) {
  const FwdParams &f = p.f;
  DcArgs<T> a{p, {}, {}, {}, {}, {}, {}};
  const int states = state_slots(f.batch, f.seq_len, f.num_seqs, f.cu_seqlens != nullptr) * f.v_heads;
  if (!make_tma_map(a.q, f.q, f.batch, f.seq_len, f.heads, K) || !make_tma_map(a.k, f.k, f.batch, f.seq_len, f.heads, K) ||
      !make_tma_map(a.v, f.v, f.batch, f.seq_len, f.v_heads, f.v_dim) ||
      !make_tma_map(a.d, p.dout, f.batch, f.seq_len, f.v_heads, f.v_dim) || !make_tma_map(a.s, f.states, states, K, 1, f.v_dim) ||
      !make_tma_map(a.ds, p.dstates, states, K, 1, f.v_dim))
    return cudaErrorInvalidValue;
  auto kernel = gla_bwd_chunks_kernel<T, K>;
  const int smem = sizeof(typename GlaDc<T, K>::Shared);
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem); e != cudaSuccess) return e;
  unsigned blocks = 0;
  if (cudaError_t e = strided_blocks(ChunkTile::count(f), blocks); e != cudaSuccess) return e;
  kernel<<<blocks, GlaDc<T, K>::THREADS, smem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t gla_bwd_chunks_sm90(const BwdParams &p, cudaStream_t stream) {
  const FwdParams &f = p.f;
  if (f.num_seqs == 0 || f.max_chunks == 0) return cudaSuccess;
  auto by_k = [&]<typename T>() { return f.k_dim == 64 ? run<T, 64>(p, stream) : run<T, 128>(p, stream); };
  return f.dtype == DType::bf16 ? by_k.template operator()<bf16>() : by_k.template operator()<half>();
}

}  // namespace jax_tk::linear_attention
