// The gated delta rule's sequential pass on Hopper (sm_90a), chunk by chunk, after the per-chunk solve
// (wy_fwd.cu: T of every chunk). Per sequence and value head, with S the state a chunk of C = 64 tokens
// starts from, G its cumulative log decay and beta its write strengths:
//
//   U = T diag(beta) (V - diag(exp(G)) K S)          (the delta rule's values)
//   O = scale * (diag(exp(G)) Q S + (Q K^T * D) U),  D_ij = exp(G_i - G_j) for j <= i, else 0
//   S <- exp(G_last) S + K^T diag(exp(G_last - G)) U
//
// Only S carries from chunk to chunk, so the pass's time is that chain's latency times the chunks. The
// state's warpgroup holds S transposed, S^T [V_SLICE, K] in float32 registers (warp w: value columns
// 16 w .. of the block's slice), so that each product of the chain takes its left operand from
// registers and nothing on the chain goes through shared memory:
//
//   X = S^T K^T                                  (S^T in bf16 registers; K as loaded, [C, K]: K-major)
//   U^T = ((V^T - X diag(exp(G))) diag(beta)) T^T     (T as loaded, [C, C]: K-major)
//   S^T <- exp(G_last) S^T + (U^T diag(exp(G_last - G))) K     (K N-major)
//
// A thread block takes one sequence, one value head and V_SLICE of its value columns, with three
// warpgroups: a producer thread loads each chunk's Q, K, V slice and T by TMA into a ring of STAGES
// (rows past the tensor arrive as zeros; rows past the sequence, a packed batch's next one, are masked
// out of U); the state's warpgroup runs the chain and hands each chunk's S^T and U^T (bf16) to the
// outputs' warpgroup through a ring of two, which computes O a chunk behind (Q K^T, then Q S and P U
// with S^T and U^T as K-major operands); for the backward, the producer's other warps write the chunks'
// states S [K, V] and U [C, V] out of those tiles.
#include "linear_attention/common.cuh"

namespace jax_tk::linear_attention {
namespace {

using namespace tk;

template <typename T, int K> struct Gdr {
  // (the producer's registers: its warps 1-3 keep the states for the backward)
  using Roles = roles</*CONSUMERS=*/2, /*PRODUCER_REGS=*/56, /*CONSUMER_REGS=*/224>;
  static constexpr int C = CHUNK, VS = V_SLICE, THREADS = Roles::THREADS;
  // (nothing but the ring and the two hand-over tiles in shared memory: three stages at K = 128)
  static constexpr int STAGES = K == 128 ? 3 : 4;
  static constexpr int STATE = 0;  // the state's consumer warpgroup (the outputs': 1)
  static_assert(C == 64 && VS == 64 && (K == 64 || K == 128));
  struct Shared {
    st<T, C, K> q[STAGES], k[STAGES];
    st<T, C, VS> v[STAGES];  // V's slice
    st<T, C, C> t[STAGES];
    st<T, VS, K> s[2];       // S^T of a chunk (bf16), handed to the outputs' warpgroup
    st<T, VS, C> ut[2];      // U^T, with it
    float cum[2][2][C];      // G, per consumer warpgroup and the parity of the chunk
    float beta[2][C];        // beta (the state's warpgroup), by the parity of the chunk
    semaphore full[STAGES], empty[STAGES], state_full[2], state_empty[2];
  };
  static_assert(sizeof(Shared) <= MAX_SHARED_BYTES);
};

template <typename T, int K> struct Args {
  FwdParams p;
  tma_map<T, CHUNK> q, k, v, t;
};

template <typename T, int K> struct GdrSm90 : SliceBlock {
  using G = Gdr<T, K>;
  using Roles = typename G::Roles;
  using tile = rt_fl<16, 64>;
  using rvec = row_vec<tile>;
  using cvec = col_vec<tile>;
  static constexpr int C = G::C, VS = G::VS, STAGES = G::STAGES;
  static constexpr float c2 = LOG2E;
  const Args<T, K> &a;
  typename G::Shared &sm;
  const FwdParams &p = a.p;
  __device__ __forceinline__ ring<STAGES> kv() const { return {sm.full, sm.empty}; }
  __device__ __forceinline__ ring<2> states() const { return {sm.state_full, sm.state_empty}; }
  const int wg = warpgroup::groupid();
  // This sequence and head's [K, V] float32 state (h0, ht), at the block's first column.
  __device__ __forceinline__ size_t state_at() const { return ((size_t)n * p.v_heads + h) * K * p.v_dim + VS * slice; }

  // chunks: each consumer warp (both warpgroups) frees a slot; states: the state's warps fill one, the
  // outputs' warps free it (and, keeping them, the producer's warps 1-3).
  __device__ __forceinline__ void init() const {
    tk::init(kv(), 1, 8);
    tk::init(states(), 4, p.states ? 7 : 4);
  }
  __device__ __forceinline__ void before_sync() const {}

  __device__ __forceinline__ void produce() const {
    if (warpid() % 4 != 0) {
      if (p.states) keep();
      return;
    }
    if (laneid() != 0) return;
    const int hq = h / (p.v_heads / p.heads);
    for (ring_pos<STAGES> at(0); at.n < chunks; ++at) {
      const int t0 = bos + C * at.n;
      semaphore &full = kv().full(at);
      wait_empty(kv(), at);
      arrive_expect_bytes(full, sizeof(sm.q[0]) + sizeof(sm.k[0]) + sizeof(sm.v[0]) + sizeof(sm.t[0]));
      load_async(sm.q[at.slot], a.q, {b, t0, hq, 0}, full);
      load_async(sm.k[at.slot], a.k, {b, t0, hq, 0}, full);
      load_async(sm.v[at.slot], a.v, {b, t0, h, VS * slice}, full);
      load_async(sm.t[at.slot], a.t, {b, t0, h, 0}, full);
    }
  }

  // G of chunk c into this warpgroup's copy for c's parity; `g_next` holds c's decays on entry (thread
  // t < C: token t), those of chunk c + 1 on return (loaded a chunk early). The warpgroup's named
  // barrier: 1 + wg.
  __device__ __forceinline__ float *scan(int c, float &g_next) const {
    const int tid = threadIdx.x % 128, t = C * (c + 1) + tid;
    float *cum = sm.cum[wg][c % 2];
    const float x = g_next;
    if (tid < C) g_next = t < len ? g[t] : 0.f;
    scan_decays(cum, x, 1 + wg);
    return cum;
  }
  __device__ __forceinline__ float first_decays() const {
    const int t = threadIdx.x % 128;
    return t < C && t < len ? g[t] : 0.f;
  }

  __device__ __forceinline__ void consume() const {
    if (wg == G::STATE) carry_state();
    else outputs();
  }

  // The state's warpgroup: per chunk c, from S_c^T in registers, U_c^T and S_{c+1}^T (the chain above);
  // S_c^T and U_c^T go to the outputs' warpgroup through sm.s, sm.ut [c % 2].
  __device__ __forceinline__ void carry_state() const {
    const int w = warpid() % 4, tid = threadIdx.x % 128;
    rt_fl<16, K> s;  // S^T: this warp's 16 value columns, all K rows of the state
    warp::zero(s);
    warp::map_indexed(s, s, [&](int r, int k, float) { return p.h0 ? p.h0[state_at() + (size_t)k * p.v_dim + 16 * w + r] : 0.f; });
    const float *beta = p.beta + (g - p.g);
    float g_next = first_decays(), b_next = tid < C && tid < len ? beta[tid] : 0.f;
    // Chunk c's G (scan) and beta into this warpgroup's copies for c's parity; those of c + 1 loaded.
    auto gates = [&](int c) {
      if (tid < C) {
        sm.beta[c % 2][tid] = b_next;
        const int t = C * (c + 1) + tid;
        b_next = t < len ? beta[t] : 0.f;
      }
      return scan(c, g_next);  // (its barriers make sm.beta whole too)
    };
    const float *cum = chunks > 0 ? gates(0) : nullptr;
    for (ring_pos<STAGES> at(0); at.n < chunks; ++at) {
      const int c = at.n, valid = min(C, len - C * c);
      rt<T, 16, K> sb;
      warp::copy(sb, s);
      tile x, u;
      wait_full(kv(), at);
      warpgroup::mma_ABt(x, sb, sm.k[at.slot], false);  // X = S^T K^T
      // (while it runs: V^T, this warp's rows of the slice's transpose, into u; S_c^T handed over; the
      // per-token factors)
      warp::map_indexed(u, u, [&](int r, int j, float) { return float(sm.v[at.slot](j, 16 * w + r)); });
      wait_empty(states(), c);
      warp::store(sm.s[c % 2], sb, 16 * w, 0);
      rvec eg, bj;  // per token j: exp(G_j), or -1 past the sequence (the columns' mask below); beta_j
      warp::map_index(eg, [&](int j) { return j < valid ? warp::fn::exp2(cum[j] * c2) : -1.f; });
      warp::map_index(bj, [&](int j) { return sm.beta[c % 2][j]; });
      warpgroup::wait<0>();
      warpgroup::fence_registers(x);
      // (V^T - X diag(exp(G))) diag(beta); tokens past the sequence (rows of the next sequence, or of
      // none) become 0
      warp::map_col(x, x, eg, [](float y, float e) { return y * e; });
      warp::map(u, u, x, [](float v, float y) { return v - y; });
      warp::map_col(u, u, bj, [](float v, float b) { return v * b; });
      warp::map_col(u, u, eg, [](float v, float e) { return e >= 0.f ? v : 0.f; });
      rt<T, 16, 64> ub;
      warp::copy(ub, u);
      warpgroup::mma_ABt(x, ub, sm.t[at.slot], false);  // U^T = (...) T^T
      rvec to_end;  // per token j: exp(G_last - G_j), 0 past the sequence
      const float last = cum[valid - 1];
      warp::map_index(to_end, [&](int j) { return j < valid ? warp::fn::exp2((last - cum[j]) * c2) : 0.f; });
      warpgroup::wait<0>();
      warpgroup::fence_registers(x);
      // (T's rows past the sequence belong to no chunk of it: whatever they hold, NaN included, becomes 0)
      warp::map_col(x, x, eg, [](float v, float e) { return e >= 0.f ? v : 0.f; });
      warp::copy(ub, x);
      warp::store(sm.ut[c % 2], ub, 16 * w, 0);
      warpgroup::fence_shared_writes();
      __syncwarp();
      if (laneid() == 0) arrive_full(states(), c);  // this warp's rows of S_c^T and U_c^T
      warp::map_col(x, x, to_end, [](float v, float d) { return v * d; });
      warp::copy(ub, x);
      const float decay = warp::fn::exp2(last * c2);
      warp::map(s, s, [=](float v) { return v * decay; });
      warpgroup::mma_AB(s, ub, sm.k[at.slot], true);  // + (U^T diag(exp(G_last - G))) K
      const float *next = c + 1 < chunks ? gates(c + 1) : cum;  // (off the chain, while it runs)
      warpgroup::wait<0>();
      warpgroup::fence_registers(s);
      if (laneid() == 0) arrive_empty(kv(), at);
      cum = next;
    }
    if (p.ht) warp::map_indexed(s, s, [&](int r, int k, float v) {
      p.ht[state_at() + (size_t)k * p.v_dim + 16 * w + r] = v;
      return v;
    });
  }

  // The outputs' warpgroup, chunk by chunk: O = scale (diag(exp(G)) Q S + (Q K^T * D) U), then (for the
  // backward) S_c and U_c out of the handed-over S_c^T and U_c^T.
  __device__ __forceinline__ void outputs() const {
    const int w = warpid() % 4;
    const float scale = p.scale;
    const gl<T> out = gl<T>::make(static_cast<T *>(p.o) + (size_t)b * p.seq_len * p.v_heads * p.v_dim + (size_t)bos * p.v_heads * p.v_dim,
                                  1, len, p.v_heads, p.v_dim);
    float g_next = first_decays();
    for (ring_pos<STAGES> at(0); at.n < chunks; ++at) {
      const int c = at.n, t0 = C * c, valid = min(C, len - t0);
      const float *cum = scan(c, g_next);
      tile o, pu, qk;
      rt<T, 16, 64> pw;
      wait_full(kv(), at);
      warpgroup::mma_ABt(qk, sm.q[at.slot], sm.k[at.slot], false);  // Q K^T
      cvec gi;
      warp::map_index(gi, [&](int r) { return scale * warp::fn::exp2(cum[16 * w + r] * c2); });
      warpgroup::wait<0>();
      warpgroup::fence_registers(qk);
      decay_mask(qk, cum, valid, scale);
      warp::copy(pw, qk);
      wait_full(states(), c);
      warpgroup::mma_ABt(o, sm.q[at.slot], sm.s[c % 2], false);  // Q S
      warpgroup::mma_ABt(pu, pw, sm.ut[c % 2], false);           // P U
      warpgroup::wait<0>();
      warpgroup::fence_registers(o);
      warpgroup::fence_registers(pu);
      if (laneid() == 0) {
        arrive_empty(states(), c);
        arrive_empty(kv(), at);
      }
      warp::mul_row(o, o, gi);  // scale * diag(exp(G)) Q S
      warp::map(o, o, pu, [](float x, float y) { return x + y; });
      warp::store(out, o, {0, t0 + 16 * w, h, VS * slice});
    }
  }

  // For the backward, the producer's warps 1-3 (idle otherwise): each chunk c's starting state S_c
  // ([K, V] of p.states' slot, q's dtype) and U_c (p.uk's rows of the chunk), this block's columns, as
  // 16-row tiles transposed out of the handed-over S_c^T and U_c^T (ldmatrix .trans).
  __device__ __forceinline__ void keep() const {
    const int w = warpid() % 4 - 1;  // 0..2
    const gl<T> uk = gl<T>::make(static_cast<T *>(p.uk) + (size_t)b * p.seq_len * p.v_heads * p.v_dim, 1, bos + len, p.v_heads, p.v_dim);
    for (int c = 0; c < chunks; c++) {
      const gl<T> kept = gl<T>::make(static_cast<T *>(p.states) + ((size_t)(seq.slot + c) * p.v_heads + h) * K * p.v_dim, 1, K, 1, p.v_dim);
      wait_full(states(), c);
      rt<T, 16, 64> x;
      for (int i = w; i < (K + C) / 16; i += 3) {  // tiles of S_c's rows, then of U_c's
        if (i < K / 16) {
          warp::load_transposed(x, sm.s[c % 2], 0, 16 * i);
          warp::store(kept, x, {0, 16 * i, 0, VS * slice});
        } else {
          warp::load_transposed(x, sm.ut[c % 2], 0, 16 * i - K);
          warp::store(uk, x, {0, bos + C * c + 16 * i - K, h, VS * slice});  // (rows past the sequence not stored)
        }
      }
      __syncwarp();
      if (laneid() == 0) arrive_empty(states(), c);
    }
  }
};

template <typename T, int K> __global__ __launch_bounds__(Gdr<T, K>::THREADS, 1) void gdr_fwd_kernel(const __grid_constant__ Args<T, K> a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem_raw[];
  GdrSm90<T, K> k{SliceBlock(a.p), a, *reinterpret_cast<typename Gdr<T, K>::Shared *>(smem_raw)};
  single(k);
#endif
}

template <typename T, int K> cudaError_t run(const FwdParams &p, cudaStream_t stream) {
  Args<T, K> a{p, {}, {}, {}, {}};
  if (!make_tma_map(a.q, p.q, p.batch, p.seq_len, p.heads, K) || !make_tma_map(a.k, p.k, p.batch, p.seq_len, p.heads, K) ||
      !make_tma_map(a.v, p.v, p.batch, p.seq_len, p.v_heads, p.v_dim) || !make_tma_map(a.t, p.t, p.batch, p.seq_len, p.v_heads, CHUNK))
    return cudaErrorInvalidValue;
  auto kernel = gdr_fwd_kernel<T, K>;
  const int smem = sizeof(typename Gdr<T, K>::Shared);
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem); e != cudaSuccess)
    return e;
  const dim3 grid(unsigned(p.num_seqs * p.v_heads * (p.v_dim / V_SLICE)));
  kernel<<<grid, Gdr<T, K>::THREADS, smem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t gdr_fwd_sm90(const FwdParams &p, cudaStream_t stream) {
  if (p.v_dim % V_SLICE != 0 || (p.k_dim != 64 && p.k_dim != 128) || p.heads <= 0 || p.v_heads % p.heads != 0 || !p.t ||
      !p.beta || (p.states != nullptr) != (p.uk != nullptr))
    return cudaErrorInvalidValue;
  if (p.num_seqs == 0) return cudaSuccess;
  auto by_k = [&]<typename T>() { return p.k_dim == 64 ? run<T, 64>(p, stream) : run<T, 128>(p, stream); };
  return p.dtype == DType::bf16 ? by_k.template operator()<bf16>() : by_k.template operator()<half>();
}

}  // namespace jax_tk::linear_attention
