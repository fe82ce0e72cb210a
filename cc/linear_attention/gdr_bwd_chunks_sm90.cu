// The gated delta rule's backward on Hopper (sm_90a), second pass: every chunk at once. A chunk with S
// (the state it starts from), dS' (the gradient of the state it hands on) and dU (both from the first
// pass, simple_gla_bwd_sm90.cu with DELTA), the forward's U = U' - W S and T = (I + A)^-1 (its solve's)
// and dO has, with E_ij = exp(G_i - G_j), K_b = diag(beta exp(G)) K, V_b = diag(beta) V:
//
//   dQ  = scale diag(exp(G)) dO S^T + dP K,   dP = scale * causal * E * (dO U^T)
//   dK  = dP^T Q + diag(exp(G_last - G)) U dS'^T + diag(beta exp(G)) T^T dW + (dB + dB^T) K
//   dW  = -dU S^T,   dT = dW K_b^T + dU V_b^T,   dA = strict * (-T^T dT T^T),   dB = dA * diag(beta) E
//   dV  = diag(beta) T^T dU
//   dbeta = rowsum(V * T^T dU) + exp(G) rowsum(K * T^T dW) + rowsum(dA * E * K K^T)
//   dG  = q . (dq's first two terms) - k . (dk's first two) + beta exp(G) rowsum(K * T^T dW)
//         + rowsum(dA * A) - colsum(dA * A), and at the last token + <S', dS'>
//   dg  = dG summed from each token to the chunk's end
//
// (checked in float64 against autodiff of the token-by-token recurrence). A grid of about a block per SM
// walks the chunks of every value head (a tile: one chunk of one value head; strided in the pipeline
// template, as simple_gla_bwd_chunks_sm90.cu). A producer thread loads each tile's Q, K and T (one
// buffer: the shared memory holds no second) and, 64 value columns at a time, V, dO, U, dU, S and dS'
// (TMA, two stages, running on into the next tile while the consumers finish this one). Two consumer
// warpgroups: the first sums dO S^T, dO U^T and dU S^T over the slices and finishes dQ, dP and dW, then
// dT T^T, dA and dB; the second sums U dS'^T and dU V^T, stores each slice of dV, forms dT, and gathers
// dK. dQ and dK: store_dqk.
#include "linear_attention/common.cuh"

namespace jax_tk::linear_attention {
namespace {

using namespace tk;

template <typename T, int K> struct GdrDc {
  using Roles = roles</*CONSUMERS=*/2, /*PRODUCER_REGS=*/40, /*CONSUMER_REGS=*/232>;
  static constexpr int C = CHUNK, VS = V_SLICE, STAGES = 2, THREADS = Roles::THREADS;
  static constexpr int DQ = 0;  // the consumer warpgroup of dQ, dP, dW, dA (the other: dT, dV, dK)
  static_assert(C == 64 && VS == 64 && (K == 64 || K == 128));
  struct Shared {
    st<T, C, K> q, k, dw;                            // Q, K, dW
    st<T, C, C> t, dp, dt, y, db;                    // T, dP, dT, dT T^T, dB
    st<T, C, VS> v[STAGES], d[STAGES], u[STAGES], du[STAGES];  // slices of V, dO, U, dU
    st<T, K, VS> s[STAGES], ds[STAGES];              // slices of S, dS'
    float cum[2][C], beta[C];                        // G (each warpgroup's copy), beta
    // dG and dbeta as they gather, k . (U dS'^T)_k, the last token's <S', dS'>: each zeroed again by
    // what reads it (dbeta and <S', dS'> by tile parity: the next tile's may start before this one's
    // are read)
    float dg[C], dbeta[2][C], kdc[C], extra[2];
    semaphore qkt_full[1], qkt_empty[1], full[STAGES], empty[STAGES];
  };
  static_assert(sizeof(Shared) <= MAX_SHARED_BYTES);
};

template <typename T> struct GdrArgs {
  BwdParams p;
  tma_map<T, CHUNK> q, k, t, v, d, u, du, s, ds;
};

template <typename T, int K> struct GdrDcSm90 : ChunkTile {
  using G = GdrDc<T, K>;
  using Roles = typename G::Roles;
  using tile = rt_fl<16, 64>;
  using cvec = col_vec<tile>;
  using rvec = row_vec<tile>;
  static constexpr int C = G::C, VS = G::VS, STAGES = G::STAGES;
  const GdrArgs<T> &a;
  typename G::Shared &sm;
  const FwdParams &f = a.p.f;
  __device__ __forceinline__ ring<STAGES> kv() const { return {sm.full, sm.empty}; }
  __device__ __forceinline__ ring<1> qkt() const { return {sm.qkt_full, sm.qkt_empty}; }
  const int wg = warpgroup::groupid();
  const int slices = f.v_dim / VS, tiles = int(count(f));
  int kv_n = 0, qkt_n = 0;  // the rings' uses so far

  __device__ __forceinline__ void init() const {
    tk::init(kv(), 1, 8);  // (empty: each consumer warp of both warpgroups)
    tk::init(qkt(), 1, 8);
    sm.extra[0] = sm.extra[1] = 0.f;
    for (int i = 0; i < C; i++) sm.dg[i] = sm.dbeta[0][i] = sm.dbeta[1][i] = sm.kdc[i] = 0.f;
  }

  __device__ __forceinline__ void load(int t) {
    const int state = take(f, t);
    if (state < 0) return;
    // Q, K and T's one buffer frees only at the end of the tile before, a slice's slot early in it: the
    // slices that the ring holds go first (loaded after Q, K and T, they would wait for them), then Q, K
    // and T, then the rest of the slices, whose slots free only as this tile's consumers read the
    // first ones (and the second warpgroup reads none before T).
    const int ahead = slices < STAGES ? slices : STAGES;
    load_slices(state, 0, ahead);
    const int hq = h / (f.v_heads / f.heads);
    const ring_use<1> u(qkt_n++);
    wait_empty(qkt(), u);
    semaphore &once = qkt().full(u);
    arrive_expect_bytes(once, sizeof(sm.q) + sizeof(sm.k) + sizeof(sm.t));
    load_async(sm.q, a.q, {b, t0, hq, 0}, once);
    load_async(sm.k, a.k, {b, t0, hq, 0}, once);
    load_async(sm.t, a.t, {b, t0, h, 0}, once);
    load_slices(state, ahead, slices);
    kv_n += slices;
  }

  // This tile's value slices [from, to) (the ring's uses kv_n + from on).
  __device__ __forceinline__ void load_slices(int state, int from, int to) const {
    for (ring_pos<STAGES> at(kv_n + from); at.n < kv_n + to; ++at) {
      semaphore &full = kv().full(at);
      wait_empty(kv(), at);
      arrive_expect_bytes(full, 4 * sizeof(sm.v[0]) + 2 * sizeof(sm.s[0]));
      const coord o{b, t0, h, VS * (at.n - kv_n)};
      load_async(sm.v[at.slot], a.v, o, full);
      load_async(sm.d[at.slot], a.d, o, full);
      load_async(sm.u[at.slot], a.u, o, full);
      load_async(sm.du[at.slot], a.du, o, full);
#pragma unroll
      for (int r = 0; r < K; r += C) {
        load_rows_async(sm.s[at.slot], r, a.s, {state, r, 0, o.d}, full);
        load_rows_async(sm.ds[at.slot], r, a.ds, {state, r, 0, o.d}, full);
      }
    }
  }

  __device__ __forceinline__ const float *scan() const {
    const int tid = threadIdx.x % 128;
    scan_decays(sm.cum[wg], tid < valid ? f.g[gate(f) + tid] : 0.f, 1 + wg);
    return sm.cum[wg];
  }

  template <typename V> __device__ __forceinline__ void rows_of(V &v, auto fn) const {
    const int w = warpid() % 4;
    warp::map_index(v, [&](int r) { return 16 * w + r < valid ? fn(16 * w + r) : 0.f; });
  }

  __device__ __forceinline__ void start() const {}
  __device__ __forceinline__ void finish() const {}
  __device__ __forceinline__ void consume(int t) {
    if (take(f, t) < 0) return;
    const ring_use<1> u(qkt_n);
    const int par = qkt_n++ % 2;  // (the tile's parity)
    if (wg == G::DQ) dq_side(u, par);
    else dk_side(u, par);
    if (laneid() == 0) arrive_empty(qkt(), u);
    sync_named_unaligned(3, 256);  // (dG and dbeta whole)
    if (threadIdx.x / 32 == 0) finish_dg(par);
    kv_n += slices;
  }

  // dQ (stored), dP and dW (to the other warpgroup), then dA (its parts of dG, dbeta) and dB.
  __device__ __forceinline__ void dq_side(ring_use<1> u, int par) const {
    const int w = warpid() % 4;
    const float *cum = scan(), scale = f.scale;
    tile dp;
    rt_fl<16, K> dq, dw;
    // (zeroed rather than a first product that overwrites them: accumulators left undefined before a
    // loop are live across the tiles' loop, which spills)
    warp::zero(dq), warp::zero(dp), warp::zero(dw);
    for (ring_pos<STAGES> at(kv_n); at.n < kv_n + slices; ++at) {
      wait_full(kv(), at);
      warpgroup::mma_ABt(dq, sm.d[at.slot], sm.s[at.slot], true);   // dO S^T
      warpgroup::mma_ABt(dp, sm.d[at.slot], sm.u[at.slot], true);   // dO U^T
      warpgroup::mma_ABt(dw, sm.du[at.slot], sm.s[at.slot], true);  // dU S^T
      warpgroup::wait<0>();
      if (laneid() == 0) arrive_empty(kv(), at);
    }
    warpgroup::fence_registers(dq), warpgroup::fence_registers(dp), warpgroup::fence_registers(dw);
    rt<T, 16, 64> pw = store_decayed(sm.dp, dp, cum, valid, scale);
    rt<T, 16, K> wr;
    warp::map(dw, dw, [](float x) { return -x; });
    warp::copy(wr, dw);
    warp::store(sm.dw, wr, 16 * w, 0);
    warpgroup::fence_shared_writes();
    sync_named_unaligned(4, 256);  // #1: dP, dW
    cvec e, one;
    rows_of(e, [&](int i) { return scale * warp::fn::exp2(cum[i] * LOG2E); });
    rows_of(one, [](int) { return 1.f; });
    warp::map_row(dq, dq, e, [](float x, float s) { return s != 0.f ? x * s : 0.f; });
    wait_full(qkt(), u);
    warpgroup::mma_AB(dq, pw, sm.k, true);  // + dP K
    warpgroup::wait<0>();
    warpgroup::fence_registers(dq);
    store_dqk<T>(a.p.dq, a.p, dq, b, end, t0 + 16 * w, h);
    add_row_dots(sm.dg, dq, sm.q, one);  // q . dq
    {  // T^T dW: exp(G) rowsum(K * that) to dbeta, beta exp(G) times it to dG
      warpgroup::mma_AtB(dq, sm.t, sm.dw, false);
      warpgroup::wait<0>();
      warpgroup::fence_registers(dq);
      cvec eg, beg;
      rows_of(eg, [&](int i) { return warp::fn::exp2(cum[i] * LOG2E); });
      rows_of(beg, [&](int i) { return sm.beta[i] * warp::fn::exp2(cum[i] * LOG2E); });
      add_row_dots(sm.dbeta[par], dq, sm.k, eg);
      add_row_dots(sm.dg, dq, sm.k, beg);
    }
    sync_named_unaligned(4, 256);  // #2: dT from the other warpgroup
    tile x;
    warpgroup::mma_ABt(x, sm.dt, sm.t, false);  // dT T^T
    warpgroup::wait<0>();
    warpgroup::fence_registers(x);
    warp::copy(pw, x);
    warp::store(sm.y, pw, 16 * w, 0);
    warpgroup::fence_shared_writes();
    sync_named(1, 128);
    tile da, kk;
    warpgroup::mma_AtB(da, sm.t, sm.y, false);   // T^T (dT T^T)
    warpgroup::mma_ABt(kk, sm.k, sm.k, false);   // K K^T
    warpgroup::wait<0>();
    warpgroup::fence_registers(da), warpgroup::fence_registers(kk);
    dA_terms(da, kk, cum, par);
  }

  // dA = strict * -(T^T dT T^T) (in da), with K K^T (kk): its parts of dbeta and dG, and dB to the other
  // warpgroup.
  __device__ __forceinline__ void dA_terms(tile &da, tile &kk, const float *cum, int par) const {
    const int w = warpid() % 4, v = valid;
    rv<float2, 16, typename cvec::layout> ri;  // {G_i, i}
    warp::map_index(ri, [&](int r) { return float2{cum[16 * w + r], float(16 * w + r)}; });
    rv<float2, 64, typename rvec::layout> gj;  // {G_j, j}
    warp::map_index(gj, [&](int j) { return float2{cum[j], float(j)}; });
    auto strict_e = [=](float2 i, float2 j) { return j.y < i.y && i.y < v ? warp::fn::exp2((i.x - j.x) * LOG2E) : 0.f; };
    warp::map_outer(da, da, ri, gj, [=](float x, float2 i, float2 j) { return j.y < i.y && i.y < v ? -x : 0.f; });
    warp::map_outer(kk, kk, ri, gj, [=](float x, float2 i, float2 j) { return strict_e(i, j) * x; });  // E K K^T, strict
    cvec bi, sum;
    rows_of(bi, [&](int i) { return sm.beta[i]; });
    warp::map(kk, kk, da, [](float x, float y) { return x * y; });  // dA * E K K^T
    warp::row_sum(sum, kk);
    add_to(sm.dbeta[par] + 16 * w, sum, 16);
    warp::map_row(kk, kk, bi, [](float x, float s) { return x * s; });  // dA * A
    warp::row_sum(sum, kk);
    add_to(sm.dg + 16 * w, sum, 16);
    rvec col;
    warp::col_sum(col, kk);
    warp::map_vec(col, col, [](float x) { return -x; });
    add_to(sm.dg, col, C);
    warp::map_outer(da, da, ri, gj, [=](float x, float2 i, float2 j) { return x * strict_e(i, j); });
    warp::map_row(da, da, bi, [](float x, float s) { return x * s; });  // dB = dA * diag(beta) E
    rt<T, 16, 64> bw;
    warp::copy(bw, da);
    warp::store(sm.db, bw, 16 * w, 0);
    warpgroup::fence_shared_writes();
    sync_named_unaligned(4, 256);  // #3: dB
  }

  // dV (stored), dT (to the other warpgroup), dK (stored) and the parts of dG, dbeta they give.
  __device__ __forceinline__ void dk_side(ring_use<1> u, int par) const {
    const int w = warpid() % 4, tid = threadIdx.x % 128;
    if (tid < C) sm.beta[tid] = tid < valid ? f.beta[gate(f) + tid] : 0.f;  // (whole after the scan's barriers)
    const float *cum = scan();
    const float last = cum[valid - 1];
    const cvec ed = decay_to_end(cum, valid);
    cvec bi, one, minus;
    rows_of(bi, [&](int i) { return sm.beta[i]; });
    rows_of(one, [](int) { return 1.f; });
    rows_of(minus, [](int) { return -1.f; });
    rt_fl<16, K> dk, x;
    tile dtv;
    warp::zero(dk), warp::zero(dtv);  // (as in dq_side)
    float frob = 0.f;  // this thread's part of <S, dS'>
    const gl<T> dv = gl<T>::make(static_cast<T *>(a.p.dv) + (size_t)b * f.seq_len * f.v_heads * f.v_dim, 1, end, f.v_heads, f.v_dim);
    wait_full(qkt(), u);
    if (valid < C) {  // T's rows past the sequence: zero (packed, they are the next one's; T^T gathers over rows)
      for (int i = tid; i < (C - valid) * C; i += 128) sm.t(valid + i / C, i % C) = T(0.f);
      warpgroup::fence_shared_writes();
      sync_named(2, 128);  // (the other warpgroup reads T after #1)
    }
    for (ring_pos<STAGES> at(kv_n); at.n < kv_n + slices; ++at) {
      wait_full(kv(), at);
      tile dvb;
      warpgroup::mma_ABt(dk, sm.u[at.slot], sm.ds[at.slot], true);   // U dS'^T
      warpgroup::mma_ABt(dtv, sm.du[at.slot], sm.v[at.slot], true);  // dU V^T
      warpgroup::mma_AtB(dvb, sm.t, sm.du[at.slot], false);              // T^T dU
      for (int i = tid; i < K * VS; i += 128) frob += float(sm.s[at.slot](i / VS, i % VS)) * float(sm.ds[at.slot](i / VS, i % VS));
      warpgroup::wait<0>();
      warpgroup::fence_registers(dvb);
      add_row_dots(sm.dbeta[par], dvb, sm.v[at.slot], one);  // rowsum(V * T^T dU)
      if (laneid() == 0) arrive_empty(kv(), at);
      warp::map_row(dvb, dvb, bi, [](float x, float s) { return x * s; });
      warp::store(dv, dvb, {0, t0 + 16 * w, h, VS * (at.n - kv_n)});
    }
    warpgroup::fence_registers(dk), warpgroup::fence_registers(dtv);
    warp::map_row(dk, dk, ed, [](float x, float s) { return s != 0.f ? x * s : 0.f; });  // diag(exp(G_last - G)) U dS'^T
    // The last token's <S', dS'> = exp(G_last) <S, dS'> + sum_j k_j . (that)_j.
    add_row_dots(sm.kdc, dk, sm.k, one);
    for (int o = 16; o > 0; o /= 2) frob += __shfl_xor_sync(~0u, frob, o);
    if (laneid() == 0) atomicAdd(&sm.extra[par], frob * warp::fn::exp2(last * LOG2E));
    sync_named(2, 128);
    if (tid < C) atomicAdd(&sm.extra[par], sm.kdc[tid]), sm.kdc[tid] = 0.f;
    sync_named_unaligned(4, 256);  // #1: dP, dW from the other warpgroup
    warpgroup::mma_AtB(dk, sm.dp, sm.q, true);  // + dP^T Q
    tile dwk;
    warpgroup::mma_ABt(dwk, sm.dw, sm.k, false);  // dW K^T
    warpgroup::wait<0>();
    warpgroup::fence_registers(dk), warpgroup::fence_registers(dwk);
    add_row_dots(sm.dg, dk, sm.k, minus);  // - k . (dP^T Q + diag(exp(G_last - G)) U dS'^T)
    rvec bj, bgj;  // beta_j, beta_j exp(G_j)
    warp::map_index(bj, [&](int j) { return sm.beta[j]; });
    warp::map_index(bgj, [&](int j) { return sm.beta[j] * warp::fn::exp2(cum[j] * LOG2E); });
    warp::map_col(dwk, dwk, bgj, [](float x, float s) { return x * s; });
    warp::map_col(dtv, dtv, bj, [](float x, float s) { return x * s; });
    warp::map(dwk, dwk, dtv, [](float x, float y) { return x + y; });  // dT = dW K_b^T + dU V_b^T
    rt<T, 16, 64> tw;
    warp::copy(tw, dwk);
    warp::store(sm.dt, tw, 16 * w, 0);
    warpgroup::fence_shared_writes();
    sync_named_unaligned(4, 256);  // #2: dT to the other warpgroup
    warpgroup::mma_AtB(x, sm.t, sm.dw, false);  // T^T dW
    warpgroup::wait<0>();
    warpgroup::fence_registers(x);
    cvec beg;
    rows_of(beg, [&](int i) { return sm.beta[i] * warp::fn::exp2(cum[i] * LOG2E); });
    warp::map_row(x, x, beg, [](float y, float s) { return y * s; });
    warp::map(dk, dk, x, [](float y, float z) { return y + z; });  // + diag(beta exp(G)) T^T dW
    sync_named_unaligned(4, 256);  // #3: dB from the other warpgroup
    warpgroup::mma_AB(dk, sm.db, sm.k, true);   // + dB K
    warpgroup::mma_AtB(dk, sm.db, sm.k, true);  // + dB^T K
    warpgroup::wait<0>();
    warpgroup::fence_registers(dk);
    store_dqk<T>(a.p.dk, a.p, dk, b, end, t0 + 16 * w, h);
  }

  // One warp: dg_t = sum over the chunk's tokens i >= t of dG_i (two a lane), and dbeta; what it read
  // zeroed for the tiles after.
  __device__ __forceinline__ void finish_dg(int par) const {
    const int l = laneid();
    const size_t at = gate(f);
    auto dG = [&](int i) { return i < valid ? sm.dg[i] + (i == valid - 1 ? sm.extra[par] : 0.f) : 0.f; };
    float lo = dG(l), hi = dG(l + 32);
    suffix_sums(lo, hi);
    for (int i : {l, l + 32}) {
      if (i < valid) {
        a.p.dg[at + i] = i == l ? lo : hi;
        a.p.dbeta[at + i] = sm.dbeta[par][i];
      }
      sm.dg[i] = sm.dbeta[par][i] = 0.f;
    }
    __syncwarp();
    if (l == 0) sm.extra[par] = 0.f;
  }
};

template <typename T, int K>
__global__ __launch_bounds__(GdrDc<T, K>::THREADS, 1) void gdr_bwd_chunks_kernel(const __grid_constant__ GdrArgs<T> a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem_raw[];
  GdrDcSm90<T, K> k{{}, a, *reinterpret_cast<typename GdrDc<T, K>::Shared *>(smem_raw)};
  strided(k);
#endif
}

template <typename T, int K> cudaError_t run(const BwdParams &p, cudaStream_t stream) {
  const FwdParams &f = p.f;
  GdrArgs<T> a{p, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  const int states = state_slots(f.batch, f.seq_len, f.num_seqs, f.cu_seqlens != nullptr) * f.v_heads;
  const bool ok = make_tma_map(a.q, f.q, f.batch, f.seq_len, f.heads, K) && make_tma_map(a.k, f.k, f.batch, f.seq_len, f.heads, K) &&
                  make_tma_map(a.t, f.t, f.batch, f.seq_len, f.v_heads, CHUNK) &&
                  make_tma_map(a.v, f.v, f.batch, f.seq_len, f.v_heads, f.v_dim) &&
                  make_tma_map(a.d, p.dout, f.batch, f.seq_len, f.v_heads, f.v_dim) &&
                  make_tma_map(a.u, f.u, f.batch, f.seq_len, f.v_heads, f.v_dim) &&
                  make_tma_map(a.du, p.du, f.batch, f.seq_len, f.v_heads, f.v_dim) &&
                  make_tma_map(a.s, f.states, states, K, 1, f.v_dim) && make_tma_map(a.ds, p.dstates, states, K, 1, f.v_dim);
  if (!ok) return cudaErrorInvalidValue;
  auto kernel = gdr_bwd_chunks_kernel<T, K>;
  const int smem = sizeof(typename GdrDc<T, K>::Shared);
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem); e != cudaSuccess) return e;
  unsigned blocks = 0;
  if (cudaError_t e = strided_blocks(ChunkTile::count(f), blocks); e != cudaSuccess) return e;
  kernel<<<blocks, GdrDc<T, K>::THREADS, smem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t gdr_bwd_chunks_sm90(const BwdParams &p, cudaStream_t stream) {
  const FwdParams &f = p.f;
  if (!f.w || !f.u || !f.t || !p.du || !f.beta || !p.dbeta || !f.states || !p.dstates) return cudaErrorInvalidValue;
  if (f.num_seqs == 0 || f.max_chunks == 0) return cudaSuccess;
  auto by_k = [&]<typename T>() { return f.k_dim == 64 ? run<T, 64>(p, stream) : run<T, 128>(p, stream); };
  return f.dtype == DType::bf16 ? by_k.template operator()<bf16>() : by_k.template operator()<half>();
}

}  // namespace jax_tk::linear_attention
