// Parameters of the attention kernels, shared by the FFI handlers and every kernel variant.
#pragma once
#include <cuda_runtime.h>

namespace jax_tk::attention {

enum class DType { bf16, fp16 };

struct Params {
  DType dtype;
  int batch, q_len, kv_len, q_heads, kv_heads, head_dim;  // q: [batch, q_len, q_heads, head_dim]
  float scale;                                            // k, v: [batch, kv_len, kv_heads, head_dim]
  bool causal;                                            // query i sees keys j <= i
  // Masking options (reference.visibility defines them; every rule must hold for query i to see key j):
  // (The defaults mean "no masking", also for a value-initialized Params p{}.)
  int window_left = -1, window_right = -1;  // i - left <= j <= i + right; -1: unbounded on that side
  const int *q_segment_ids = nullptr;       // [batch, q_len] and [batch, kv_len]: same segment only;
  const int *kv_segment_ids = nullptr;      //   nullptr: no segments
  const int *q_lengths = nullptr;           // [batch]: i < q_lengths[b]; nullptr: none
  const int *kv_lengths = nullptr;          // [batch]: j < kv_lengths[b]; nullptr: none
  float softcap = 0.f;                      // logits := cap * tanh(logits / cap) (after scaling); 0: none
  const void *q, *k, *v;
  void *o;          // forward output; backward input (the forward's output)
  float *lse;       // [batch, q_heads, q_len]: forward output, backward input
  // backward only
  const void *dout;
  const float *dlse;  // cotangent of lse, [batch, q_heads, q_len]
  void *dq, *dk, *dv;
  float *delta;       // workspace [batch, q_heads, q_len]: rowsum(dout * o) - dlse
};

// The mma.sync kernels (sm_80 and newer). Return the launch error, if any.
cudaError_t fwd_sm80(const Params &p, cudaStream_t stream);
cudaError_t bwd_sm80(const Params &p, cudaStream_t stream);

// The Hopper kernels (sm_90a: TMA, wgmma, warp specialization).
bool fwd_sm90_supported(const Params &p);
cudaError_t fwd_sm90(const Params &p, cudaStream_t stream);

}  // namespace jax_tk::attention
