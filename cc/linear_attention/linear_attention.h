// The contract of the linear-attention ops (gated delta rule, simple GLA) with Python
// (jax_tk/linear_attention; the list's format: cc/core/core.h).
//
// The chunked XLA path (jax_tk/linear_attention/reference.py) splits each sequence into chunks of CHUNK
// tokens, the size the kernels take, so that both paths cut a sequence (and a packed batch of
// sequences, each starting on a chunk of its own) the same way.
#pragma once

#include "core/core.h"

namespace jax_tk::linear_attention {

// clang-format off
#define JAX_TK_LINEAR_ATTENTION_CONTRACT(X)                                                                \
  X(CHUNK, 64)  /* tokens per chunk: solved together with matrix products, the state carried between */ \
  X(V_SLICE, 64)  /* value columns of the state per thread block (the state's K rows whole) */
// clang-format on
JAX_TK_DECLARE_CONTRACT(JAX_TK_LINEAR_ATTENTION_CONTRACT)
#define JAX_TK_LINEAR_ATTENTION_FORMULAS(F) F(state_slots)

enum class DType { bf16, fp16 };

// A forward call. Sequence n is tokens [bos, bos + len) of batch row b: without cu_seqlens, n = b with
// bos = 0 and len = seq_len; with it (batch 1), bos = cu_seqlens[n] and len = cu_seqlens[n + 1] - bos.
struct FwdParams {
  DType dtype;
  int batch, seq_len, heads, v_heads, k_dim, v_dim, num_seqs;
  const void *q, *k, *v;     // [batch, seq_len, heads, k_dim] (q, k), [batch, seq_len, v_heads, v_dim] (v)
  const float *g;            // [batch, v_heads, seq_len]: log decays (<= 0), head-major (one chunk's contiguous)
  const int *cu_seqlens;     // [num_seqs + 1] or nullptr
  const float *h0;           // [num_seqs, v_heads, k_dim, v_dim] initial states, or nullptr (zeros)
  void *o;                   // [batch, seq_len, v_heads, v_dim]
  float *ht;                 // [num_seqs, v_heads, k_dim, v_dim] final states, or nullptr
  float scale;
  // The gated delta rule (nullptr: simple GLA): beta ([batch, v_heads, seq_len], as g) and wy_fwd's T
  // ([batch, seq_len, v_heads, CHUNK], q's dtype: row i of a chunk's T at its token i). For its backward,
  // wy_fwd's W ([batch, seq_len, v_heads, k_dim]) and the forward's kept U (uk below).
  const float *beta = nullptr;
  const void *t = nullptr;
  const void *w = nullptr, *u = nullptr;
  // For the backward: each chunk's starting state, [state_slots, v_heads, k_dim, v_dim] in q's dtype;
  // nullptr: not kept. max_chunks: ceil(seq_len / CHUNK), the most chunks a sequence can have.
  void *states = nullptr;
  int max_chunks = 0;
  void *uk = nullptr;  // (the gated delta rule, for the backward) U, v's shape; nullptr: not kept
};

// The kept chunk states' slots: sequence n's chunk c takes slot first_slot(n) + c, with n * max_chunks,
// or packed, floor(bos_n / CHUNK) + n (a sequence of len tokens moves floor(bos / CHUNK) on by at least
// floor(len / CHUNK), and takes at most one chunk more). state_slots: how many a call takes (the first
// slot of a sequence past the last).
JAX_TK_HD constexpr int first_slot(int n, int bos, int seq_len, bool packed) {
  return packed ? bos / CHUNK + n : n * ((seq_len + CHUNK - 1) / CHUNK);
}
JAX_TK_HD constexpr int state_slots(int batch, int seq_len, int num_seqs, bool packed) {
  return packed ? first_slot(num_seqs, seq_len, seq_len, true) : first_slot(batch, 0, seq_len, false);
}

// Simple GLA's backward: the forward's operands, sizes and states (f; its o, ht and u unused, w the
// gated delta rule's) and the cotangents. Two kernels: the state's gradient carried backward over the
// chunks (dstates), then every chunk at once.
struct BwdParams {
  FwdParams f;               // f.states: the forward's S_c (required)
  const void *dout;          // [batch, seq_len, v_heads, v_dim], q's dtype
  const float *dht;          // [num_seqs, v_heads, k_dim, v_dim] the final states' cotangent, or nullptr (zeros)
  void *dstates;             // as f.states: chunk c's dS', the gradient of the state it hands on (workspace)
  void *dq, *dk;             // [batch, seq_len, v_heads, k_dim]: float32, one per value head (the caller sums
  bool dqk_f32 = true;       // a group's); or, where heads == v_heads, in q's dtype (dqk_f32 false)
  void *dv;                  // v's shape, q's dtype
  float *dg;                 // [batch, v_heads, seq_len], as g
  float *dh0;                // [num_seqs, v_heads, k_dim, v_dim], or nullptr
  // The gated delta rule (f.w, f.u: W and U; f.t, f.beta): the first pass keeps dU (v's shape, q's
  // dtype); the second reads it and writes dbeta (as g).
  void *du = nullptr;
  float *dbeta = nullptr;
};

// The gated delta rule's per-chunk solve (wy_fwd.cu): T of every chunk, for the sequential pass, and W
// for the backward.
struct WyParams {
  DType dtype;
  int batch, seq_len, heads, v_heads, k_dim, num_seqs;
  int max_chunks;            // chunks of the longest sequence (the grid's; shorter ones' blocks return)
  const void *k;             // as FwdParams's (l2-normalized already where the op asks)
  const float *g, *beta;     // [batch, v_heads, seq_len] each
  const int *cu_seqlens;     // [num_seqs + 1] or nullptr
  void *t;                   // T, [batch, seq_len, v_heads, CHUNK]: row i of a chunk's at its token i, k's dtype
  void *w = nullptr;         // (for the backward) W, [batch, seq_len, v_heads, k_dim], k's dtype; nullptr: not kept
};

#ifdef JAX_TK_CUDA_HEADERS
cudaError_t wy_fwd(const WyParams &p, cudaStream_t stream);
// Simple GLA's forward on Hopper (sm_90a): k_dim 64 or 128, v_dim a multiple of V_SLICE.
cudaError_t simple_gla_fwd_sm90(const FwdParams &p, cudaStream_t stream);
// The gated delta rule's sequential pass on Hopper (FwdParams::t: wy_fwd's), the same sizes.
cudaError_t gdr_fwd_sm90(const FwdParams &p, cudaStream_t stream);
// Simple GLA's backward on Hopper (sm_90a), the same sizes as the forward's.
cudaError_t simple_gla_bwd_sm90(const BwdParams &p, cudaStream_t stream);
// The backward's passes: the state's gradient over the chunks (both ops: the gated delta rule's with
// f.w and du), and simple GLA's every chunk at once.
cudaError_t bwd_state_pass_sm90(const BwdParams &p, cudaStream_t stream);
cudaError_t gla_bwd_chunks_sm90(const BwdParams &p, cudaStream_t stream);
cudaError_t gdr_bwd_chunks_sm90(const BwdParams &p, cudaStream_t stream);  // (the gated delta rule's)
#endif

}  // namespace jax_tk::linear_attention
