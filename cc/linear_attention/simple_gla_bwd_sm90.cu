// Simple GLA's backward on Hopper (sm_90a), first pass: the state's gradient carried backward over the
// chunks. With the forward's notation (simple_gla_fwd_sm90.cu), a chunk that starts from S and hands on
// S' = exp(G_last) S + K^T diag(exp(G_last - G)) V has
//
//   dS = exp(G_last) dS' + scale * Q^T diag(exp(G)) dO,      dS' of the last chunk = the final state's cotangent,
//
// a chain of scalings and sums whose products need no state. A thread block takes one sequence, value
// head and V_SLICE columns, as the forward does: a producer thread loads each chunk's Q and dO slice by
// TMA, last chunk first, into a ring of two stages; one consumer warpgroup keeps dS in registers
// (float32), stores each chunk's dS' (in q's dtype, for the second pass, simple_gla_bwd_chunks_sm90.cu)
// and at the end dS_0, the initial state's gradient.
#include "linear_attention/common.cuh"

namespace jax_tk::linear_attention {
namespace {

using namespace tk;

template <typename T, int K> struct GlaDs {
  using Roles = roles</*CONSUMERS=*/1, /*PRODUCER_REGS=*/40, /*CONSUMER_REGS=*/232>;
  static constexpr int C = CHUNK, VS = V_SLICE, STAGES = 2, THREADS = Roles::THREADS;
  static_assert(C == 64 && VS == 64 && (K == 64 || K == 128));
  struct Shared {
    st<T, C, K> q[STAGES];
    st<T, C, VS> d[STAGES];  // dO's slice
    st<T, C, VS> dw;         // diag(scale exp(G)) dO, 0 past the sequence
    float cum[2][C];         // G, by the chunk's parity
    semaphore full[STAGES], empty[STAGES];
  };
  static_assert(sizeof(Shared) <= MAX_SHARED_BYTES);
};

template <typename T> struct DsArgs {
  BwdParams p;
  tma_map<T, CHUNK> q, d;
};

template <typename T, int K> struct GlaDsSm90 {
  using G = GlaDs<T, K>;
  using Roles = typename G::Roles;
  using tile = rt_fl<16, 64>;
  static constexpr int C = G::C, VS = G::VS, STAGES = G::STAGES;
  const DsArgs<T> &a;
  typename G::Shared &sm;
  const FwdParams &f = a.p.f;
  __device__ __forceinline__ ring<STAGES> kv() const { return {sm.full, sm.empty}; }
  const int wg = warpgroup::groupid();
  const int slices = f.v_dim / VS, slice = blockIdx.x % slices, h = blockIdx.x / slices % f.v_heads,
            n = blockIdx.x / slices / f.v_heads;
  const Sequence seq{f.cu_seqlens, f.seq_len, n};
  const int b = seq.b, bos = seq.bos, len = seq.len, chunks = seq.chunks;
  const float *g = f.g + ((size_t)b * f.v_heads + h) * f.seq_len + bos;

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
      arrive_expect_bytes(full, sizeof(sm.q[0]) + sizeof(sm.d[0]));
      load_async(sm.q[at.slot], a.q, {b, t0, hq, 0}, full);
      load_async(sm.d[at.slot], a.d, {b, t0, h, VS * slice}, full);
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

  __device__ __forceinline__ void consume() const {
    const int w = warpid() % 4, tid = threadIdx.x % 128;
    tile ds[K / 64];  // dS, rows 64 i + 16 w ..
#pragma unroll
    for (int i = 0; i < K / 64; i++) {
      if (a.p.dht) warp::load(ds[i], state_view(a.p.dht), {0, 64 * i + 16 * w, 0, VS * slice});
      else warp::zero(ds[i]);
    }
    float g_next = decay_of(C * (chunks - 1) + tid);
    for (ring_pos<STAGES> at(0); at.n < chunks; ++at) {
      const int c = chunks - 1 - at.n, valid = min(C, len - C * c);
      rt<T, 16, 64> sb;
#pragma unroll
      for (int i = 0; i < K / 64; i++) {  // chunk c's dS'
        warp::copy(sb, ds[i]);
        warp::store(chunk_view(c), sb, {0, 64 * i + 16 * w, 0, VS * slice});
      }
      float *cum = sm.cum[at.n % 2];
      const float x = g_next;
      g_next = decay_of(C * (c - 1) + tid);  // (the chunk before's, early)
      scan_decays(cum, x, 1);
      const float last = cum[valid - 1];
      wait_full(kv(), at);
      rt<T, 16, 64> dr;
      col_vec<tile> e;  // scale exp(G_i), 0 past the sequence
      const float scale = f.scale;
      warp::map_index(e, [&](int r) { return 16 * w + r < valid ? scale * warp::fn::exp2(cum[16 * w + r] * LOG2E) : 0.f; });
      warp::load(dr, sm.d[at.slot], 16 * w, 0);
      warp::mul_row(dr, dr, e);
      warp::store(sm.dw, dr, 16 * w, 0);
      warpgroup::fence_shared_writes();
      sync_named(1, 128);
      const float decay = warp::fn::exp2(last * LOG2E);
#pragma unroll
      for (int i = 0; i < K / 64; i++) {
        warp::map(ds[i], ds[i], [=](float x) { return x * decay; });
        warpgroup::mma_AtB(ds[i], window<C, 64>(sm.q[at.slot], 0, 64 * i), sm.dw, true);  // + Q^T dO'
      }
      warpgroup::wait<0>();
#pragma unroll
      for (int i = 0; i < K / 64; i++) warpgroup::fence_registers(ds[i]);
      if (laneid() == 0) arrive_empty(kv(), at);
    }
    if (a.p.dh0)
#pragma unroll
      for (int i = 0; i < K / 64; i++) warp::store(state_view(a.p.dh0), ds[i], {0, 64 * i + 16 * w, 0, VS * slice});
  }
};

template <typename T, int K>
__global__ __launch_bounds__(GlaDs<T, K>::THREADS, 1) void gla_bwd_state_kernel(const __grid_constant__ DsArgs<T> a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem_raw[];
  GlaDsSm90<T, K> k{a, *reinterpret_cast<typename GlaDs<T, K>::Shared *>(smem_raw)};
  single(k);
#endif
}

template <typename T, int K> cudaError_t run(const BwdParams &p, cudaStream_t stream) {
  const FwdParams &f = p.f;
  DsArgs<T> a{p, {}, {}};
  if (!make_tma_map(a.q, f.q, f.batch, f.seq_len, f.heads, K) || !make_tma_map(a.d, p.dout, f.batch, f.seq_len, f.v_heads, f.v_dim))
    return cudaErrorInvalidValue;
  auto kernel = gla_bwd_state_kernel<T, K>;
  const int smem = sizeof(typename GlaDs<T, K>::Shared);
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem); e != cudaSuccess) return e;
  kernel<<<dim3(unsigned(f.num_seqs * f.v_heads * (f.v_dim / V_SLICE))), GlaDs<T, K>::THREADS, smem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t simple_gla_bwd_sm90(const BwdParams &p, cudaStream_t stream) {
  const FwdParams &f = p.f;
  if (f.v_dim % V_SLICE != 0 || (f.k_dim != 64 && f.k_dim != 128) || f.heads <= 0 || f.v_heads % f.heads != 0 || !f.states ||
      !p.dstates)
    return cudaErrorInvalidValue;
  if (f.num_seqs == 0) return cudaSuccess;
  auto by_k = [&]<typename T>() {
    cudaError_t e = f.k_dim == 64 ? run<T, 64>(p, stream) : run<T, 128>(p, stream);
    return e != cudaSuccess ? e : gla_bwd_chunks_sm90(p, stream);
  };
  return f.dtype == DType::bf16 ? by_k.template operator()<bf16>() : by_k.template operator()<half>();
}

}  // namespace jax_tk::linear_attention
