// Simple GLA's forward on Hopper (sm_90a), chunk by chunk. Per sequence and value head the state S
// [K, V] (float32) runs S <- S * exp(g_t) + k_t v_t^T and o_t = scale * S^T q_t. A chunk of C = 64
// tokens at once, with G_i = g_0 + ... + g_i its cumulative log decay and S the state it starts from:
//
//   O = scale * (diag(exp(G)) Q S + (Q K^T * D) V),  D_ij = exp(G_i - G_j) for j <= i, else 0
//   S <- exp(G_last) S + K^T diag(exp(G_last - G)) V
//
// Every exponent is <= 0 (g <= 0): no factor exceeds 1, however long the sequence. A thread block
// takes one sequence, one value head and V_SLICE columns of its values and state (the state's K rows
// whole: 2 x 64 rows of accumulators), and walks the sequence's chunks with four warpgroups:
//
// - a producer thread loads each chunk's Q, K (the value head's q/k head) and V slice by TMA into a
//   ring of STAGES; rows past the tensor arrive as zeros, and rows past the sequence (a packed
//   batch's next one) are masked out of every product below;
// - the state's warpgroup carries S (float32, in registers) from chunk to chunk: K^T V', where V' is V
//   with its rows scaled by exp(G_last - G_j) (0 past the sequence; the next chunk's formed while this
//   one's product runs), and hands each chunk's starting state, as bf16, to the outputs' warpgroup
//   through a second ring of two buffers;
// - two outputs' warpgroups, chunks 0, 2, 4, ... and 1, 3, 5, ...: each computes Q K^T, scales and
//   masks it to P, adds P V to diag(exp(G)) Q S once that chunk's state has arrived, and stores O (a
//   chunk's outputs are a chain of three products with waits between them, which the second
//   warpgroup overlaps).
// Only the state's update is a chain from chunk to chunk; the outputs' work of one chunk runs beside
// the update of the next. (The gated delta rule's pass, whose values depend on the state, is
// gdr_fwd_sm90.cu.)
#include "linear_attention/common.cuh"

namespace jax_tk::linear_attention {
namespace {

using namespace tk;

template <typename T, int K> struct Gla {
  static constexpr int OUTPUTS = 2;
  using Roles = roles</*CONSUMERS=*/3, /*PRODUCER_REGS=*/24, /*CONSUMER_REGS=*/160>;
  static constexpr int C = CHUNK, VS = V_SLICE, STAGES = SEQUENTIAL_STAGES<false, K>, THREADS = Roles::THREADS;
  static constexpr int STATE = 0;  // the state's consumer warpgroup (the outputs': 1 .. OUTPUTS)
  static_assert(C == 64 && VS == 64 && (K == 64 || K == 128));
  struct Shared {
    st<T, C, K> q[STAGES], k[STAGES];
    st<T, C, VS> v[STAGES];  // V's slice
    st<T, K, VS> s[2];       // the state a chunk starts from (bf16), handed to the outputs' warpgroups
    st<T, C, VS> vd[2];      // V', the chunk's values weighted for the state update (by chunk parity)
    float cum[1 + OUTPUTS][2][C];  // G, per consumer warpgroup and the parity of its own chunks
    semaphore full[STAGES], empty[STAGES], state_full[2], state_empty[2];
  };
  static_assert(sizeof(Shared) <= MAX_SHARED_BYTES);
};

template <typename T, int K> struct Args {
  FwdParams p;
  tma_map<T, CHUNK> q, k, v;
};

template <typename T, int K> struct GlaSm90 : SliceBlock {
  using G = Gla<T, K>;
  using Roles = typename G::Roles;
  using tile = rt_fl<16, 64>;
  using cvec = col_vec<tile>;
  using rvec = row_vec<tile>;
  static constexpr int C = G::C, VS = G::VS, STAGES = G::STAGES;
  static constexpr float c2 = LOG2E;
  const Args<T, K> &a;
  typename G::Shared &sm;
  const FwdParams &p = a.p;
  __device__ __forceinline__ ring<STAGES> kv() const { return {sm.full, sm.empty}; }
  __device__ __forceinline__ ring<2> states() const { return {sm.state_full, sm.state_empty}; }
  const int wg = warpgroup::groupid();

  // chunks: each consumer warp (both warpgroups) frees a slot; states: each warp of one side.
  __device__ __forceinline__ void init() const {
    tk::init(kv(), 1, 8);
    tk::init(states(), 4, 4);
  }
  __device__ __forceinline__ void before_sync() const {}

  __device__ __forceinline__ void produce() const {
    if (threadIdx.x % 128 != 0) return;
    const int hq = h / (p.v_heads / p.heads);
    for (ring_pos<STAGES> at(0); at.n < chunks; ++at) {
      const int t0 = bos + C * at.n;
      semaphore &full = kv().full(at);
      wait_empty(kv(), at);
      arrive_expect_bytes(full, sizeof(sm.q[0]) + sizeof(sm.k[0]) + sizeof(sm.v[0]));
      load_async(sm.q[at.slot], a.q, {b, t0, hq, 0}, full);
      load_async(sm.k[at.slot], a.k, {b, t0, hq, 0}, full);
      load_async(sm.v[at.slot], a.v, {b, t0, h, VS * slice}, full);
    }
  }

  // G of chunk `c` (scan_decays) into this warpgroup's copy for the parity of c / step (this warpgroup
  // takes every step-th chunk). `g_next` holds this chunk's decays on entry (thread t < C: token t),
  // those of chunk c + step on return: loaded a chunk early, off the chain. The warpgroup's named
  // barrier: 1 + wg.
  __device__ __forceinline__ float *scan(int c, int step, float &g_next) const {
    const int tid = threadIdx.x % 128, t = C * (c + step) + tid, bar = 1 + wg;
    float *cum = sm.cum[wg][c / step % 2];
    const float x = g_next;
    if (tid < C) g_next = t < len ? g[t] : 0.f;
    scan_decays(cum, x, bar);
    return cum;
  }
  __device__ __forceinline__ float first_decays(int c) const {  // chunk c's, for scan
    const int t = C * c + threadIdx.x % 128;
    return threadIdx.x % 128 < C && t < len ? g[t] : 0.f;
  }

  // This warp's 16 rows of the state's top (K rows 0..63) or bottom (64..127) half: from or to float32
  // [K, V] at `state` (this sequence and head), this block's columns.
  __device__ __forceinline__ gl<float> state_view(float *state) const {
    return gl<float>::make(state + ((size_t)n * p.v_heads + h) * K * p.v_dim, 1, K, 1, p.v_dim);
  }
  // Chunk c's starting state in p.states ([K, V] of this sequence and head).
  __device__ __forceinline__ gl<T> states_view(int c) const {
    return gl<T>::make(static_cast<T *>(p.states) + ((size_t)(seq.slot + c) * p.v_heads + h) * K * p.v_dim, 1, K, 1, p.v_dim);
  }

  __device__ __forceinline__ void consume() const {
    if (wg == G::STATE) carry_state();
    else outputs(wg - 1, G::OUTPUTS);
  }

  // Chunk `at`'s values weighted for the state's update, V' = diag(exp(G_last - G)) V with 0 past the
  // sequence, into sm.vd[c % 2]. Returns exp(G_last), the state's decay over the chunk. V' needs no
  // state, so the state's loop weighs chunk c + 1 while chunk c's update runs: only the update is its
  // chain.
  __device__ __forceinline__ float weigh(ring_pos<STAGES> at, float &g_next) const {
    const int w = warpid() % 4, c = at.n, valid = min(C, len - C * c);
    const float *cum = scan(c, 1, g_next);
    const float last = cum[valid - 1];
    wait_full(kv(), at);
    rt<T, 16, 64> vr;  // this warp's rows of V
    warp::load(vr, sm.v[at.slot], 16 * w, 0);
    warp::mul_row(vr, vr, decay_to_end(cum, valid));
    warp::store(sm.vd[c % 2], vr, 16 * w, 0);
    warpgroup::fence_shared_writes();
    return warp::fn::exp2(last * c2);
  }

  // The state's warpgroup: S_0, then per chunk c (S_c in registers and in sm.s[c % 2]): S_{c+1} =
  // exp(G_last) S_c + K^T V' (weigh), then S_{c+1} into the other buffer once the outputs' warpgroup is
  // done with S_{c-1} there.
  __device__ __forceinline__ void carry_state() const {
    const int w = warpid() % 4;
    tile s[K / 64];  // the state's rows 64 i + 16 w ..
#pragma unroll
    for (int i = 0; i < K / 64; i++) {
      if (p.h0) warp::load(s[i], state_view(const_cast<float *>(p.h0)), {0, 64 * i + 16 * w, 0, VS * slice});
      else warp::zero(s[i]);
    }
    auto publish = [&](int c) {  // sm.s[c % 2] := the state (bf16), handed over
      rt<T, 16, 64> sb;
#pragma unroll
      for (int i = 0; i < K / 64; i++) {
        warp::copy(sb, s[i]);
        warp::store(sm.s[c % 2], sb, 64 * i + 16 * w, 0);
        if (p.states) warp::store(states_view(c), sb, {0, 64 * i + 16 * w, 0, VS * slice});  // (for the backward)
      }
      warpgroup::fence_shared_writes();
      sync_named(1, 128);  // (and the next chunk's V' whole)
      if (laneid() == 0) arrive_full(states(), c);
    };
    publish(0);
    float g_next = first_decays(0), decay = 0.f;
    if (chunks > 0) {  // (a sequence of no tokens has no chunk to weigh)
      decay = weigh(ring_pos<STAGES>(0), g_next);
      sync_named(1, 128);
    }
    for (ring_pos<STAGES> at(0); at.n < chunks; ++at) {
      const int c = at.n;
      // (every tile scaled before the first product: ptxas waits for a product before touching other
      // accumulators after it)
#pragma unroll
      for (int i = 0; i < K / 64; i++) warp::map(s[i], s[i], [=](float x) { return x * decay; });
#pragma unroll
      for (int i = 0; i < K / 64; i++)
        warpgroup::mma_AtB(s[i], window<C, 64>(sm.k[at.slot], 0, 64 * i), sm.vd[c % 2], true);  // + K^T V'
      if (c + 1 < chunks) decay = weigh(ring_pos<STAGES>(c + 1), g_next);  // (while the update runs)
      warpgroup::wait<0>();
#pragma unroll
      for (int i = 0; i < K / 64; i++) warpgroup::fence_registers(s[i]);
      if (laneid() == 0) arrive_empty(kv(), at);
      if (c + 1 < chunks) {
        wait_empty(states(), c + 1);
        publish(c + 1);
      }
    }
    if (p.ht)
#pragma unroll
    for (int i = 0; i < K / 64; i++) warp::store(state_view(p.ht), s[i], {0, 64 * i + 16 * w, 0, VS * slice});
  }

  // An outputs' warpgroup, on chunks first, first + step, ...: O = scale (diag(exp(G)) Q S + (Q K^T * D) V).
  __device__ __forceinline__ void outputs(int first, int step) const {
    const int w = warpid() % 4;
    const float scale = p.scale;
    const gl<T> out = gl<T>::make(static_cast<T *>(p.o) + (size_t)b * p.seq_len * p.v_heads * p.v_dim + (size_t)bos * p.v_heads * p.v_dim,
                                  1, len, p.v_heads, p.v_dim);
    float g_next = first_decays(first);
    for (int c = first; c < chunks; c += step) {
      const ring_pos<STAGES> at(c);
      const int t0 = C * c, valid = min(C, len - t0);
      const float *cum = scan(c, step, g_next);
      tile o, pv, qk;
      rt<T, 16, 64> pw;
      wait_full(kv(), at);
      warpgroup::mma_ABt(qk, sm.q[at.slot], sm.k[at.slot], false);  // Q K^T
      cvec gi;
      warp::map_index(gi, [&](int r) { return scale * warp::fn::exp2(cum[16 * w + r] * c2); });
      rv<float2, 64, typename rvec::layout> gj;  // {G_j, j}
      warp::map_index(gj, [&](int j) { return float2{cum[j], float(j)}; });
      rv<float2, 16, typename cvec::layout> ri;  // {G_i, i}
      warp::map_index(ri, [&](int r) { return float2{cum[16 * w + r], float(16 * w + r)}; });
      warpgroup::wait<0>();
      warpgroup::fence_registers(qk);
      warp::map_outer(qk, qk, ri, gj, [=](float x, float2 i, float2 j) {
        return j.y <= i.y && j.y < valid ? scale * x * warp::fn::exp2((i.x - j.x) * c2) : 0.f;
      });
      warp::copy(pw, qk);
      warpgroup::mma_AB(pv, pw, sm.v[at.slot], false);  // (Q K^T * D) V, before the state
      wait_full(states(), c);
      warpgroup::mma_AB(o, sm.q[at.slot], sm.s[c % 2], false);  // Q S
      warpgroup::wait<0>();
      warpgroup::fence_registers(o);
      warpgroup::fence_registers(pv);
      if (laneid() == 0) {
        arrive_empty(states(), c);
        arrive_empty(kv(), at);
      }
      warp::mul_row(o, o, gi);  // scale * diag(exp(G)) Q S
      warp::map(o, o, pv, [](float x, float y) { return x + y; });
      warp::store(out, o, {0, t0 + 16 * w, h, VS * slice});
    }
  }
};

template <typename T, int K>
__global__ __launch_bounds__(Gla<T, K>::THREADS, 1) void simple_gla_fwd_kernel(const __grid_constant__ Args<T, K> a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem_raw[];
  GlaSm90<T, K> k{SliceBlock(a.p), a, *reinterpret_cast<typename Gla<T, K>::Shared *>(smem_raw)};
  single(k);
#endif
}

template <typename T, int K> cudaError_t run(const FwdParams &p, cudaStream_t stream) {
  Args<T, K> a{p, {}, {}, {}};
  if (!make_tma_map(a.q, p.q, p.batch, p.seq_len, p.heads, K) || !make_tma_map(a.k, p.k, p.batch, p.seq_len, p.heads, K) ||
      !make_tma_map(a.v, p.v, p.batch, p.seq_len, p.v_heads, p.v_dim))
    return cudaErrorInvalidValue;
  auto kernel = simple_gla_fwd_kernel<T, K>;
  const int smem = sizeof(typename Gla<T, K>::Shared);
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem); e != cudaSuccess)
    return e;
  const dim3 grid(unsigned(p.num_seqs * p.v_heads * (p.v_dim / V_SLICE)));
  kernel<<<grid, Gla<T, K>::THREADS, smem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t simple_gla_fwd_sm90(const FwdParams &p, cudaStream_t stream) {
  if (p.v_dim % V_SLICE != 0 || (p.k_dim != 64 && p.k_dim != 128) || p.heads <= 0 || p.v_heads % p.heads != 0 || p.t)
    return cudaErrorInvalidValue;
  if (p.num_seqs == 0) return cudaSuccess;
  auto by_k = [&]<typename T>() { return p.k_dim == 64 ? run<T, 64>(p, stream) : run<T, 128>(p, stream); };
  return p.dtype == DType::bf16 ? by_k.template operator()<bf16>() : by_k.template operator()<half>();
}

}  // namespace jax_tk::linear_attention
