// Parameters of the decode-attention kernels, shared by the FFI handler and the kernels, and the
// contract with Python (jax_tk/decode/launch.py; the list's format: cc/core/core.h).
#pragma once
#include <cstddef>

#include "core/core.h"

namespace jax_tk::decode {

enum class DType { bf16, fp16 };

// clang-format off
#define JAX_TK_DECODE_CONTRACT(X)                                                                          \
  X(HEAD_DIMS, 64 | 128 | 256)  /* head dims of the kernel (a set of powers of 2), every GPU */            \
  X(MLA_HEAD_DIM, 576)     /* MLA's latent rows (sm_90a): one cache for keys and values, the query's ... */ \
  X(MLA_V_HEAD_DIM, 512)   /* ... head dim, and the values' (the first dims of each row) */                \
  X(MLA_BLOCK_ROWS, 64)    /* ... query rows (heads x new tokens) per thread block */                      \
  X(TILE_ROWS, 16)         /* query rows per warp: (query heads of one KV head) x (new tokens) ... */      \
  X(MAX_TILE_ROWS, 128)    /* ... and at most this many per thread block (TILE_ROWS x 2^k; before Hopper,  \
                              head_dim 256 runs 128 of them as two blocks of 64) */                        \
  X(MAX_SPLITS, 128)       /* parts a sequence's cache may be split into (the split-KV grid) */            \
  X(SPLIT_MIN_KEYS, 128)   /* ... each covering at least this many positions of the capacity */            \
  X(SMALL_GPU_SMEM, 99 * 1024)  /* shared memory a block may take on sm_86 / sm_89 GPUs: every head dim    \
                                   and block size has a config within it (VARIANT_SM86 keeps to it) */
// clang-format on
JAX_TK_DECLARE_CONTRACT(JAX_TK_DECODE_CONTRACT)

struct Params {
  DType dtype;
  int batch, q_len, q_heads, kv_heads, head_dim;  // q, out: [batch, q_len, q_heads, head_dim]
  // The cache: contiguous [batch, capacity, kv_heads, head_dim] (page_table == nullptr), or paged
  // [num_pages, page_size, kv_heads, head_dim] with page_table [batch, max_pages] (capacity = max_pages
  // * page_size): position j of sequence b is row j % page_size of page page_table[b, j / page_size].
  int capacity;  // (batch * capacity, or num_pages * page_size, rows: below 2^31)
  const int *page_table = nullptr;
  int page_size = 0, num_pages = 0, max_pages = 0;
  int page_shift = -1;  // log2(page_size) when it is a power of 2, else -1
  const int *lengths;  // [batch]: positions j < lengths[b] are valid (clamped to [0, capacity])
  // Query row i of sequence b is at position lengths[b] - q_len + i (a negative one sees nothing) and
  // sees key j iff j < length, j <= position (causal), position - left <= j <= position + right.
  float scale;
  bool causal;
  int window_left = -1, window_right = -1;  // -1: unbounded on that side
  float softcap = 0.f;                      // logits := cap * tanh(logits / cap) (after scaling); 0: none
  // Attention sinks: float32 logits, of query head h of sequence b at sinks[b * sinks_stride + h] (the
  // stride 0: the same for every sequence, or q_heads), each joining its rows' softmax denominator
  // with no value; a non-finite one: no sink. nullptr: none.
  const float *sinks = nullptr;
  int sinks_stride = 0;
  const void *q, *k, *v;
  void *o;
  float *lse;  // [batch, q_heads, q_len]: each row's log-sum-exp (natural log; -inf where it sees no key)
  int splits = 1;  // parts of each sequence's keys, merged through their log-sum-exp (splits > 1)
  float *workspace;  // splits > 1: workspace_words() floats, see there
  bool sm90 = false;  // the device runs sm_90a code: blocks of 128 rows take its warp-specialized kernel
  int smem_limit = 0;  // > 0: the kernels take at most this much shared memory per block (less than the
                       // device allows: tests of the configs of smaller GPUs)
};

// Workspace of a split call, in 4-byte words: each part's log-sum-exp (log2 units) of every query row,
// [splits, batch, q_len, q_heads], then its normalized output, [splits, batch, q_len, q_heads, head_dim]
// (head_dim: the output's, v_head_dim()).
JAX_TK_HD inline size_t workspace_words(int splits, int batch, int q_len, int q_heads, int head_dim) {
  return splits > 1 ? size_t(splits) * batch * q_len * q_heads * (head_dim + 1) : 0;
}
// Query rows of one thread block, of a sequence's `rows` = (query heads per KV head) x (new tokens):
// the fewest TILE_ROWS x 2^k that hold them, at most the maximum; more rows take more blocks.
JAX_TK_HD constexpr int block_rows(int rows) {
  int n = TILE_ROWS;
  while (n < rows && n < MAX_TILE_ROWS) n *= 2;
  return n;
}
inline bool head_dim_supported(int head_dim) { return (head_dim & (head_dim - 1)) == 0 && (head_dim & HEAD_DIMS) != 0; }
// The output's head dim of a call with query head dim d: d, but MLA's values are the first dims of
// the latent rows.
JAX_TK_HD constexpr int v_head_dim(int d) { return d == MLA_HEAD_DIM ? MLA_V_HEAD_DIM : d; }

// The formulas Python calls (jax_tk._tk.decode.<name>).
#define JAX_TK_DECODE_FORMULAS(F) F(workspace_words) F(block_rows) F(v_head_dim)

// New tokens' keys and values appended to the cache before the attention, in the same call
// (jax_tk_decode_append): rows k_new and v_new [batch, q_len, kv_heads, head_dim] go to positions
// lengths_before[b] + t of the cache (Params: p.k and p.v, written), dropped where the position is
// negative or past the capacity, or its page-table entry outside the pool; lengths_after[b] =
// lengths_before[b] + q_len, which the attention then reads (p.lengths).
struct Append {
  const void *k_new, *v_new;
  const int *lengths_before;
  int *lengths_after;
};

#ifdef JAX_TK_CUDA_HEADERS
// The append (a kernel of its own, before decode()'s, which waits for it: programmatic dependent launch).
cudaError_t append(const Params &p, const Append &a, cudaStream_t stream);
// The kernel (mma.sync and cp.async: sm_80 and newer; wgmma on sm_90a), and the merge of the parts when
// splits > 1.
// head_dim MLA_HEAD_DIM: MLA's latent cache (k and v the same cache; sm_90a only).
cudaError_t decode(const Params &p, cudaStream_t stream);
#endif

}  // namespace jax_tk::decode
