// What the linear-attention kernels share on the device: a sequence's place in the batch and the scan of
// a chunk's decays.
#pragma once
#include "linear_attention/linear_attention.h"
#include "tk/tk.cuh"

namespace jax_tk::linear_attention {

constexpr float LOG2E = 1.4426950408889634f;

// The ring depth of simple GLA's forward and of the backward's state pass: a block walks its chunks in
// order, so a chunk's load latency hides only behind the chunks in flight ahead of it; four stages, but
// two for the delta rule's state pass at K = 128, whose K and W slices leave no room for more.
template <bool DELTA, int K> constexpr int SEQUENTIAL_STAGES = DELTA && K == 128 ? 2 : 4;

// Sequence n of a call: tokens [bos, bos + len) of batch row b, in `chunks` chunks, whose states (kept
// for the backward) take slots slot, slot + 1, ... (state_slots). Without cu_seqlens n = b, bos = 0 and
// len = seq_len; with it (batch 1), bos = cu_seqlens[n], len = cu_seqlens[n + 1] - bos.
struct Sequence {
  int b, bos, len, chunks, slot;
  __device__ __forceinline__ Sequence(const int *cu_seqlens, int seq_len, int n)
      : b(cu_seqlens ? 0 : n), bos(cu_seqlens ? cu_seqlens[n] : 0), len(cu_seqlens ? cu_seqlens[n + 1] - bos : seq_len),
        chunks((len + CHUNK - 1) / CHUNK), slot(first_slot(n, bos, seq_len, cu_seqlens != nullptr)) {}
};

// A tile of the per-chunk backward kernels (strided in the pipeline template): tile t is chunk
// t % max_chunks of sequence t % (num_seqs * max_chunks) / max_chunks, value head t / (num_seqs *
// max_chunks), so that a wave of blocks takes chunks side by side of one value head. take(f, t) sets
// the chunk's value head, batch row, first token, tokens and the end of its sequence's rows (the gl
// views' bound: rows past it are not stored), and returns the chunk's index in the kept states (and
// their gradients), or -1 where the chunk lies past its sequence's end (packed sequences' grids have
// holes). Few fields: the consumers' registers are full.
struct ChunkTile {
  int h = 0, b = 0, t0 = 0, valid = 0, end = 0;
  __device__ __forceinline__ int take(const FwdParams &f, int t) {
    const int per_head = f.num_seqs * f.max_chunks, n = t % per_head / f.max_chunks, c = t % f.max_chunks;
    const Sequence seq{f.cu_seqlens, f.seq_len, n};
    h = t / per_head, b = seq.b, t0 = seq.bos + CHUNK * c, valid = min(CHUNK, seq.len - CHUNK * c), end = seq.bos + seq.len;
    return valid > 0 ? (seq.slot + c) * f.v_heads + h : -1;
  }
  // The chunk's first entry in g, beta, dg and dbeta ([batch, v_heads, seq_len]).
  __device__ __forceinline__ size_t gate(const FwdParams &f) const { return ((size_t)b * f.v_heads + h) * f.seq_len + t0; }
  __host__ __device__ static long long count(const FwdParams &f) { return (long long)f.num_seqs * f.max_chunks * f.v_heads; }
};

// One warp's suffix sums over a chunk, two tokens a lane (lo: token lane, hi: token lane + 32):
// x_t := sum over i >= t of x_i (a decay's gradient gathers from every later token of its chunk).
__device__ __forceinline__ void suffix_sums(float &lo, float &hi) {
  const int l = tk::laneid();
  for (int o = 1; o < 32; o *= 2) {  // within each half
    const float x = __shfl_down_sync(~0u, lo, o), y = __shfl_down_sync(~0u, hi, o);
    if (l + o < 32) lo += x, hi += y;
  }
  lo += __shfl_sync(~0u, hi, 0);  // (the upper half's total)
}

// G, a chunk's cumulative log decays, into cum[0, CHUNK): the inclusive scan of x (thread t < CHUNK of
// the warpgroup: token t's decay, 0 past the sequence) over the warpgroup's first two warps. `bar`: the
// warpgroup's named barrier; cum is whole on return. A warpgroup that scans chunk after chunk keeps two
// copies (by parity): one of its warps may still read the last chunk's when another writes.
__device__ __forceinline__ void scan_decays(float *cum, float x, int bar) {
  const int tid = threadIdx.x % 128;
  if (tid < CHUNK) {
    for (int d = 1; d < 32; d *= 2) {
      const float y = __shfl_up_sync(~0u, x, d);
      if (tk::laneid() >= d) x += y;
    }
    cum[tid] = x;
  }
  tk::sync_named(bar, 128);
  if (tid >= 32 && tid < CHUNK) cum[tid] += cum[31];
  tk::sync_named(bar, 128);
}

// The block of a sequential pass (the forwards, the backward's state pass): sequence n, value head h and
// slice `slice` of V_SLICE value columns, from blockIdx.x; its sequence's tokens [bos, bos + len) of
// batch row b, in `chunks` chunks, and their log decays g (from bos on). The kernels' structs derive
// from it.
struct SliceBlock {
  const int slices, slice, h, n;
  const Sequence seq;
  const int b, bos, len, chunks;
  const float *g;
  __device__ __forceinline__ explicit SliceBlock(const FwdParams &f)
      : slices(f.v_dim / V_SLICE), slice(blockIdx.x % slices), h(blockIdx.x / slices % f.v_heads),
        n(blockIdx.x / slices / f.v_heads), seq{f.cu_seqlens, f.seq_len, n}, b(seq.b), bos(seq.bos), len(seq.len),
        chunks(seq.chunks), g(f.g + ((size_t)b * f.v_heads + h) * f.seq_len + bos) {}
};

// x := scale * D * x for this warp's 16 rows of a 64 x 64 tile over a chunk's tokens (rows i, columns
// j), D_ij = exp(G_i - G_j) for j <= i < valid, else 0 (rows past the sequence, and so their columns,
// become 0): P from Q K^T, dP from dO V^T. cum: G.
__device__ __forceinline__ void decay_mask(tk::rt_fl<16, 64> &x, const float *cum, int valid, float scale) {
  using tile = tk::rt_fl<16, 64>;
  const int w = tk::warpid() % 4;
  tk::rv<float2, 64, typename tk::row_vec<tile>::layout> gj;  // {G_j, j}
  tk::warp::map_index(gj, [&](int j) { return float2{cum[j], float(j)}; });
  tk::rv<float2, 16, typename tk::col_vec<tile>::layout> ri;  // {G_i, i}
  tk::warp::map_index(ri, [&](int r) { return float2{cum[16 * w + r], float(16 * w + r)}; });
  tk::warp::map_outer(x, x, ri, gj, [=](float e, float2 i, float2 j) {
    return j.y <= i.y && i.y < valid ? scale * e * tk::warp::fn::exp2((i.x - j.x) * LOG2E) : 0.f;
  });
}

// dst[j] += v[j] (j < n) from every warp: one lane of those holding each value adds it (shared-memory
// atomics: the warps of both consumer warpgroups gather into one array).
template <typename RV> __device__ __forceinline__ void add_to(float *dst, const RV &v, int n) {
  const int lane = tk::laneid();
  const bool writer = std::is_same_v<typename RV::layout, tk::ortho_l> ? lane % 4 == 0 : lane < 4;
#pragma unroll
  for (int i = 0; i < RV::pieces; i++)
#pragma unroll
    for (int k = 0; k < RV::per; k++)
      if (const int j = RV::index_of(i, k); writer && j < n) atomicAdd(dst + j, v.data[i][k]);
}

// dst[i] += s_i * sum_k x_ik y_ik over this warp's 16 rows (x: its rows in float32, y: a shared tile).
template <int N, typename ST>
__device__ __forceinline__ void add_row_dots(float *dst, const tk::rt_fl<16, N> &x, const ST &y,
                                             const tk::col_vec<tk::rt_fl<16, N>> &s) {
  const int w = tk::warpid() % 4;
  tk::rt<typename ST::dtype, 16, N> yr;
  tk::rt_fl<16, N> p;
  tk::warp::load(yr, y, 16 * w, 0);
  tk::warp::map(p, x, yr, [](float u, float v) { return u * v; });
  tk::col_vec<tk::rt_fl<16, N>> sum;
  tk::warp::row_sum(sum, p);
  tk::warp::map_vec(sum, sum, s, [](float u, float v) { return u * v; });
  add_to(dst + 16 * w, sum, 16);
}

// This warp's 16 rows of a chunk's dQ or dK (row t of batch row b, value head h) where BwdParams says:
// float32 per value head, or q's dtype T. rows: the batch row's rows up to the sequence's end (rows
// past it are not stored).
template <typename T, int K>
__device__ __forceinline__ void store_dqk(void *dst, const BwdParams &p, const tk::rt_fl<16, K> &x, int b, int rows, int t, int h) {
  const size_t at = (size_t)b * p.f.seq_len * p.f.v_heads * K;
  if (p.dqk_f32) tk::warp::store(tk::gl<float>::make(static_cast<float *>(dst) + at, 1, rows, p.f.v_heads, K), x, {0, t, h, 0});
  else tk::warp::store(tk::gl<T>::make(static_cast<T *>(dst) + at, 1, rows, p.f.v_heads, K), x, {0, t, h, 0});
}

// This warp's 16 rows' exp(G_last - G_i), each token's decay to its chunk's end (K_d, V', dS's
// terms), 0 past the sequence. cum: G.
__device__ __forceinline__ tk::col_vec<tk::rt_fl<16, 64>> decay_to_end(const float *cum, int valid) {
  const int w = tk::warpid() % 4;
  const float last = cum[valid - 1];
  tk::col_vec<tk::rt_fl<16, 64>> v;
  tk::warp::map_index(v, [&](int r) { return 16 * w + r < valid ? tk::warp::fn::exp2((last - cum[16 * w + r]) * LOG2E) : 0.f; });
  return v;
}

// x := decay_mask(x), then this warp's rows of it in the inputs' type into dst (P or dP, which other
// products read from shared memory); returns those rows.
template <typename ST>
__device__ __forceinline__ tk::rt<typename ST::dtype, 16, 64> store_decayed(ST &dst, tk::rt_fl<16, 64> &x, const float *cum,
                                                                            int valid, float scale) {
  decay_mask(x, cum, valid, scale);
  tk::rt<typename ST::dtype, 16, 64> y;
  tk::warp::copy(y, x);
  tk::warp::store(dst, y, 16 * (tk::warpid() % 4), 0);
  return y;
}

}  // namespace jax_tk::linear_attention
