// Simple GLA's backward on Hopper (sm_90a), first pass: the state's gradient carried backward over the
// chunks. With the forward's notation (simple_gla_fwd_sm90.cu), a chunk that starts from S and hands on
// S' = exp(G_last) S + K^T diag(exp(G_last - G)) V has
//
//   dS = exp(G_last) dS' + scale * Q^T diag(exp(G)) dO,      dS' of the last chunk = the final state's cotangent,
//
// a chain of scalings and sums whose products need no state. A thread block takes one sequence, value
// head and V_SLICE columns, as the forward does: a producer thread loads each chunk's Q and dO slice by
// TMA, last chunk first, into a ring of STAGES; one consumer warpgroup keeps dS in registers
// (float32), stores each chunk's dS' (in q's dtype, for the second pass, simple_gla_bwd_chunks_sm90.cu)
// and at the end dS_0, the initial state's gradient.
//
// With DELTA (the gated delta rule, whose chunk hands on S' = exp(G_last) S + K_d^T U with U = U' - W S)
// the chain runs through the values' gradient too:
//
//   dU = P^T dO + K_d dS',   dS = exp(G_last) dS' + scale * Q^T diag(exp(G)) dO - W^T dU
//
// with P = scale * D * Q K^T and K_d = diag(exp(G_last - G)) K; the producer also loads K and W, and
// each chunk's dU is kept for the second pass.
#include "linear_attention/common.cuh"

namespace jax_tk::linear_attention {
namespace {

using namespace tk;

template <typename T, int K, bool DELTA> struct GlaDs {
  using Roles = roles</*CONSUMERS=*/1, /*PRODUCER_REGS=*/40, /*CONSUMER_REGS=*/232>;
  static constexpr int C = CHUNK, VS = V_SLICE, STAGES = SEQUENTIAL_STAGES<DELTA, K>, THREADS = Roles::THREADS;
  static_assert(C == 64 && VS == 64 && (K == 64 || K == 128));
  template <typename X> using delta_only = std::conditional_t<DELTA, X, Empty>;
  struct Shared {
    st<T, C, K> q[STAGES];
    st<T, C, VS> d[STAGES];  // dO's slice
    st<T, C, VS> dw[2];      // diag(scale exp(G)) dO, 0 past the sequence (by the chunk's parity)
    [[no_unique_address]] delta_only<st<T, C, K>> k[STAGES], w[STAGES], kd;  // K, W, K_d
    [[no_unique_address]] delta_only<st<T, C, C>> p;    // P
    [[no_unique_address]] delta_only<st<T, K, VS>> dsb;  // dS' (q's dtype)
    [[no_unique_address]] delta_only<st<T, C, VS>> du;   // -dU
    float cum[2][C];         // G, by the chunk's parity
    semaphore full[STAGES], empty[STAGES];
  };
  static_assert(sizeof(Shared) <= MAX_SHARED_BYTES);
};

template <typename T> struct DsArgs {
  BwdParams p;
  tma_map<T, CHUNK> q, d, k, w;
};

template <typename T, int K, bool DELTA> struct GlaDsSm90 : SliceBlock {
  using G = GlaDs<T, K, DELTA>;
  using Roles = typename G::Roles;
  using tile = rt_fl<16, 64>;
  static constexpr int C = G::C, VS = G::VS, STAGES = G::STAGES;
  const DsArgs<T> &a;
  typename G::Shared &sm;
  const FwdParams &f = a.p.f;
  __device__ __forceinline__ ring<STAGES> kv() const { return {sm.full, sm.empty}; }
  const int wg = warpgroup::groupid();

  __device__ __forceinline__ void init() const { tk::init(kv(), 1, 4); }
  __device__ __forceinline__ void before_sync() const {}

  // Use u of the ring holds chunk chunks - 1 - u.
  __device__ __forceinline__ void produce() const {
    if (threadIdx.x % 128 != 0) return;
    const int hq = h / (f.v_heads / f.heads);
    for (ring_pos<STAGES> at(0); at.n < chunks; ++at) {
      const int t0 = bos + C * (chunks - 1 - at.n);
      semaphore &full = kv().full(at);
      wait_empty(kv(), at);
      arrive_expect_bytes(full, sizeof(sm.q[0]) + sizeof(sm.d[0]) + (DELTA ? 2 * sizeof(sm.k[0]) : 0));
      load_async(sm.q[at.slot], a.q, {b, t0, hq, 0}, full);
      load_async(sm.d[at.slot], a.d, {b, t0, h, VS * slice}, full);
      if constexpr (DELTA) {
        load_async(sm.k[at.slot], a.k, {b, t0, hq, 0}, full);
        load_async(sm.w[at.slot], a.w, {b, t0, h, 0}, full);
      }
    }
  }

  // [K, V] of this sequence and head: a float32 state (dht, dh0), or chunk c's in dstates.
  __device__ __forceinline__ gl<float> state_view(const float *s) const {
    return gl<float>::make(const_cast<float *>(s) + ((size_t)n * f.v_heads + h) * K * f.v_dim, 1, K, 1, f.v_dim);
  }
  __device__ __forceinline__ gl<T> chunk_view(int c) const {
    return gl<T>::make(static_cast<T *>(a.p.dstates) + ((size_t)(seq.slot + c) * f.v_heads + h) * K * f.v_dim, 1, K, 1, f.v_dim);
  }
  __device__ __forceinline__ float decay_of(int t) const { return t >= 0 && t < len && threadIdx.x % 128 < C ? g[t] : 0.f; }

  // (DELTA) dU = P^T dO + K_d dS' of chunk c (dS' in sm.dsb, this warp's rows of it written): kept, and
  // -dU into sm.du for - W^T dU. Rows past the sequence come out 0 (K_d's and P's are).
  __device__ __forceinline__ void values_gradient(ring_pos<STAGES> at, int c, int valid, const float *cum) const {
    const int w = warpid() % 4;
    tile qk, du;
    warpgroup::mma_ABt(qk, sm.q[at.slot], sm.k[at.slot], false);  // Q K^T
    const col_vec<tile> ed = decay_to_end(cum, valid);
    rt<T, 16, K> kr;
    warp::load(kr, sm.k[at.slot], 16 * w, 0);
    warp::mul_row(kr, kr, ed);
    warp::store(sm.kd, kr, 16 * w, 0);
    warpgroup::fence_shared_writes();
    sync_named(1, 128);  // (K_d and dS' whole)
    warpgroup::mma_AB(du, sm.kd, sm.dsb, false);  // K_d dS'
    warpgroup::wait<1>();
    warpgroup::fence_registers(qk);
    rt<T, 16, 64> pw = store_decayed(sm.p, qk, cum, valid, f.scale);
    warpgroup::fence_shared_writes();
    sync_named(1, 128);  // (P whole)
    warpgroup::mma_AtB(du, sm.p, sm.d[at.slot], true);  // + P^T dO
    warpgroup::wait<0>();
    warpgroup::fence_registers(du);
    const Sequence &s = seq;
    warp::store(gl<T>::make(static_cast<T *>(a.p.du) + (size_t)b * f.seq_len * f.v_heads * f.v_dim, 1, s.bos + s.len, f.v_heads,
                            f.v_dim),
                du, {0, s.bos + C * c + 16 * w, h, VS * slice});
    warp::map(du, du, [](float x) { return -x; });
    warp::copy(pw, du);
    warp::store(sm.du, pw, 16 * w, 0);
  }

  // Use `at` (chunk c = chunks - 1 - at.n, last first): G into sm.cum[at.n % 2] (`g_next`: this chunk's
  // decays on entry, the one before's on return) and dO' = diag(scale exp(G)) dO, 0 past the sequence,
  // into sm.dw[at.n % 2]. Returns exp(G_last). Simple GLA's needs no dS, so the loop forms the next
  // chunk's while this one's products run: only dS's update is the chain.
  __device__ __forceinline__ float weigh(ring_pos<STAGES> at, float &g_next) const {
    const int w = warpid() % 4, tid = threadIdx.x % 128, c = chunks - 1 - at.n, valid = min(C, len - C * c);
    float *cum = sm.cum[at.n % 2];
    const float x = g_next;
    g_next = decay_of(C * (c - 1) + tid);  // (the chunk before's, early)
    scan_decays(cum, x, 1);
    wait_full(kv(), at);
    rt<T, 16, 64> dr;
    col_vec<tile> e;  // scale exp(G_i), 0 past the sequence
    const float scale = f.scale;
    warp::map_index(e, [&](int r) { return 16 * w + r < valid ? scale * warp::fn::exp2(cum[16 * w + r] * LOG2E) : 0.f; });
    warp::load(dr, sm.d[at.slot], 16 * w, 0);
    warp::mul_row(dr, dr, e);
    warp::store(sm.dw[at.n % 2], dr, 16 * w, 0);
    warpgroup::fence_shared_writes();
    return warp::fn::exp2(cum[valid - 1] * LOG2E);
  }

  __device__ __forceinline__ void consume() const {
    const int w = warpid() % 4, tid = threadIdx.x % 128;
    tile ds[K / 64];  // dS, rows 64 i + 16 w ..
#pragma unroll
    for (int i = 0; i < K / 64; i++) {
      if (a.p.dht) warp::load(ds[i], state_view(a.p.dht), {0, 64 * i + 16 * w, 0, VS * slice});
      else warp::zero(ds[i]);
    }
    float g_next = decay_of(C * (chunks - 1) + tid), decay = 0.f;
    if (!DELTA && chunks > 0) {  // (a sequence of no tokens has no chunk)
      decay = weigh(ring_pos<STAGES>(0), g_next);
      sync_named(1, 128);
    }
    for (ring_pos<STAGES> at(0); at.n < chunks; ++at) {
      const int c = chunks - 1 - at.n, valid = min(C, len - C * c);
      rt<T, 16, 64> sb[K / 64];  // chunk c's dS', in q's dtype
#pragma unroll
      for (int i = 0; i < K / 64; i++) {
        warp::copy(sb[i], ds[i]);
        if constexpr (DELTA) warp::store(sm.dsb, sb[i], 64 * i + 16 * w, 0);
      }
      if constexpr (DELTA) {
        decay = weigh(at, g_next);
        values_gradient(at, c, valid, sm.cum[at.n % 2]);
        warpgroup::fence_shared_writes();
        sync_named(1, 128);
      }
      // (every tile scaled, and pinned there, before the first product: ptxas waits for a product before
      // touching other accumulators after it, and the compiler would sink the scaling to each product)
#pragma unroll
      for (int i = 0; i < K / 64; i++) warp::map(ds[i], ds[i], [=](float x) { return x * decay; });
#pragma unroll
      for (int i = 0; i < K / 64; i++) warpgroup::fence_registers(ds[i]);
#pragma unroll
      for (int i = 0; i < K / 64; i++) {
        warpgroup::mma_AtB(ds[i], window<C, 64>(sm.q[at.slot], 0, 64 * i), sm.dw[at.n % 2], true);  // + Q^T dO'
        if constexpr (DELTA) warpgroup::mma_AtB(ds[i], window<C, 64>(sm.w[at.slot], 0, 64 * i), sm.du, true);  // - W^T dU
      }
#pragma unroll
      for (int i = 0; i < K / 64; i++) warp::store(chunk_view(c), sb[i], {0, 64 * i + 16 * w, 0, VS * slice});
      const bool next = !DELTA && at.n + 1 < chunks;
      if (next) decay = weigh(ring_pos<STAGES>(at.n + 1), g_next);  // (while the products run)
      warpgroup::wait<0>();
#pragma unroll
      for (int i = 0; i < K / 64; i++) warpgroup::fence_registers(ds[i]);
      if (laneid() == 0) arrive_empty(kv(), at);
      if (next) sync_named(1, 128);  // (the next chunk's dO' whole)
    }
    if (a.p.dh0)
#pragma unroll
      for (int i = 0; i < K / 64; i++) warp::store(state_view(a.p.dh0), ds[i], {0, 64 * i + 16 * w, 0, VS * slice});
  }
};

template <typename T, int K, bool DELTA>
__global__ __launch_bounds__(GlaDs<T, K, DELTA>::THREADS, 1) void gla_bwd_state_kernel(const __grid_constant__ DsArgs<T> a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem_raw[];
  GlaDsSm90<T, K, DELTA> k{SliceBlock(a.p.f), a, *reinterpret_cast<typename GlaDs<T, K, DELTA>::Shared *>(smem_raw)};
  single(k);
#endif
}

template <typename T, int K, bool DELTA> cudaError_t run(const BwdParams &p, cudaStream_t stream) {
  const FwdParams &f = p.f;
  DsArgs<T> a{p, {}, {}, {}, {}};
  if (!make_tma_map(a.q, f.q, f.batch, f.seq_len, f.heads, K) || !make_tma_map(a.d, p.dout, f.batch, f.seq_len, f.v_heads, f.v_dim))
    return cudaErrorInvalidValue;
  if (DELTA && (!make_tma_map(a.k, f.k, f.batch, f.seq_len, f.heads, K) || !make_tma_map(a.w, f.w, f.batch, f.seq_len, f.v_heads, K)))
    return cudaErrorInvalidValue;
  auto kernel = gla_bwd_state_kernel<T, K, DELTA>;
  const int smem = sizeof(typename GlaDs<T, K, DELTA>::Shared);
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem); e != cudaSuccess) return e;
  kernel<<<dim3(unsigned(f.num_seqs * f.v_heads * (f.v_dim / V_SLICE))), GlaDs<T, K, DELTA>::THREADS, smem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t bwd_state_pass_sm90(const BwdParams &p, cudaStream_t stream) {
  const FwdParams &f = p.f;
  if (f.v_dim % V_SLICE != 0 || (f.k_dim != 64 && f.k_dim != 128) || f.heads <= 0 || f.v_heads % f.heads != 0 || !p.dstates ||
      (f.w != nullptr) != (p.du != nullptr))
    return cudaErrorInvalidValue;
  if (f.num_seqs == 0) return cudaSuccess;
  auto by_k = [&]<typename T, bool DELTA>() { return f.k_dim == 64 ? run<T, 64, DELTA>(p, stream) : run<T, 128, DELTA>(p, stream); };
  auto by_delta = [&]<typename T>() {
    return f.w ? by_k.template operator()<T, true>() : by_k.template operator()<T, false>();
  };
  return f.dtype == DType::bf16 ? by_delta.template operator()<bf16>() : by_delta.template operator()<half>();
}

cudaError_t simple_gla_bwd_sm90(const BwdParams &p, cudaStream_t stream) {
  if (!p.f.states || p.f.w) return cudaErrorInvalidValue;
  if (cudaError_t e = bwd_state_pass_sm90(p, stream); e != cudaSuccess) return e;
  return gla_bwd_chunks_sm90(p, stream);
}

}  // namespace jax_tk::linear_attention
