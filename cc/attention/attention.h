// Parameters of the attention kernels, shared by the FFI handlers and every kernel variant, and the
// contract with Python (jax_tk/attention/launch.py; the list's format: cc/core/core.h).
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/core.h"

namespace jax_tk::attention {

enum class DType { bf16, fp16 };

// clang-format off
#define JAX_TK_ATTENTION_CONTRACT(X)                                                                       \
  X(SEGMENT_GRANULE, 64)        /* rows per entry of Params::q_segment_ranges / kv_segment_ranges */       \
  X(HEAD_DIMS_SM80, 64 | 128)   /* head dims of every GPU's kernels (a set of powers of 2) */              \
  X(HEAD_DIMS_SM90, 64 | 128 | 256)  /* ... and of the sm_90a kernels */                                   \
  X(MLA_HEAD_DIM_QK, 192)       /* the one pair of unequal head dims (query/key, value), MLA's: the */     \
  X(MLA_HEAD_DIM_V, 128)        /*   sm_90a kernels' (every other kernel takes equal ones) */              \
  X(FWD_TILE_ROWS, 128)         /* sm_90a forward: query rows per tile (Params::fwd_tiles) */              \
  X(FWD_TILE_KEYS, 128)         /* ... keys per key block (fwd_tile_keys), head_dim up to 192 */           \
  X(FWD_TILE_KEYS_D256, 64)     /* ... keys per key block, head_dim 256 */                                 \
  X(FWD_DOCS_MAX_HEAD_DIM, 128) /* documents' own tiles (Params::fwd_tiles) up to this head_dim */         \
  X(FWD_TILES_PER_BLOCK, 2)     /* Params::fwd_tiles entries per FWD_TILE_ROWS query rows */               \
  X(BWD_BLOCK_KEYS, 128)        /* sm_90a backward: keys per block (Params::block_order), head_dim <= 128 */ \
  X(BWD_BLOCK_KEYS_D256, 64)    /* ... head_dim above 128 */                                               \
  X(BWD_QUERY_ROWS, 64)         /* ... query rows per step, and per dq tile of the workspace */            \
  X(MASK_BLOCK_ROWS, 128)       /* the boolean mask's block summary (Params::mask_blocks): query rows */   \
  X(MASK_BLOCK_KEYS, 128)       /* ... and keys per block (every kernel's blocks lie inside one; the bias  \
                                   is padded to whole blocks) */                                           \
  X(MASK_EMPTY, 0)              /* ... its codes: no pair of the block visible, */                         \
  X(MASK_FULL, 1)               /*   every pair visible, */                                                \
  X(MASK_MIXED, 2)              /*   some */
// clang-format on
JAX_TK_DECLARE_CONTRACT(JAX_TK_ATTENTION_CONTRACT)

struct Params {
  DType dtype;
  int batch, q_len, kv_len, q_heads, kv_heads, head_dim;  // q, k: [batch, q_len or kv_len, q_heads or kv_heads, head_dim]
  int v_head_dim;  // v: [batch, kv_len, kv_heads, v_head_dim], o: [batch, q_len, q_heads, v_head_dim]
                   // (head_dim, but in the MLA pair: see has_kernel_dims)
  float scale;
  bool causal;                                            // query i sees keys j <= i
  // Masking options (reference.visibility defines them; every rule must hold for query i to see key j):
  // (The defaults mean "no masking", also for a value-initialized Params p{}.)
  int window_left = -1, window_right = -1;  // i - left <= j <= i + right; -1: unbounded on that side
  const int *q_segment_ids = nullptr;       // [batch, q_len] and [batch, kv_len]: same segment only;
  const int *kv_segment_ids = nullptr;      //   nullptr: no segments
  const int *q_segment_ranges = nullptr;    // with segment ids: [batch, ceil(q_len / 64), 2] and
  const int *kv_segment_ranges = nullptr;   //   [batch, ceil(kv_len / 64), 2]: min and max id of each
                                            //   64 rows (SEGMENT_GRANULE), to skip whole blocks
  // With segment ids, the sm_90a backward may take its blocks in an order worked out by the caller
  // (jax_tk/attention/launch.py: longest first): block_order lists the (batch entry b, key/value head h,
  // block i) triples as (b * kv_heads + h) * blocks + i, a permutation of [0, batch * kv_heads *
  // blocks) (blocks of bwd_order_rows() keys); nullptr: the kernel's own order.
  const int *block_order = nullptr;  // (the backward's; the forward takes fwd_tiles)
  // With segment ids, the sm_90a forward's tiles in the order it takes them (jax_tk/attention/launch.py,
  // _fwd_tiles): fwd_tile_cap(q_len) entries per (batch entry, query head), four ints each:
  // {b * q_heads + h (-1: no more tiles), first query row q0, end, key base}. A tile owns the query
  // rows [q0, min(q0 + 128, end)). With key base -1 it is a tile of the fixed grid (q0 a multiple of
  // 128, end = q_len): it sees the keys the segment ids allow. With key base >= 0 it is a tile of one
  // document (q_len == kv_len, the queries' and the keys' ids the same sorted runs): it sees only the
  // keys [key base, end) (its document), in blocks counted from key base, with no segment test.
  // nullptr: the kernel's own order of the fixed grid.
  const int *fwd_tiles = nullptr;
  // The dense [q_len, kv_len] operands, jax.nn's mask= and bias=: one matrix per (batch entry, query
  // head), or broadcast over either (their batch 1 or the batch of one vmapped entry, entry_batch:
  // under vmap the entries follow each other; their heads 1 or q_heads; see dense_index).
  // The boolean mask: query i of (b, h) sees key j only if bit j % 32 of word j / 32 of row
  // dense_index(b, h) * q_len + i of mask_bits is set (mask_words(kv_len) words a row). mask_blocks
  // [.., ceil(q_len / MASK_BLOCK_ROWS), ceil(kv_len / MASK_BLOCK_KEYS)] (int8, indexed like the rows)
  // says for each block whether the mask hides all its pairs (MASK_EMPTY: the kernels skip it), shows
  // them all (MASK_FULL: no elementwise test) or some. nullptr: no mask.
  const uint32_t *mask_bits = nullptr;
  const int8_t *mask_blocks = nullptr;
  int mask_batch = 1, mask_heads = 1, entry_batch = 1;
  // The bias, added to the logits (after the scale): a [padded_rows(q_len), padded_keys(kv_len)] matrix
  // of the inputs' dtype at dense_index(b, h) (zero padding: no tile reads past it). The backward
  // writes the logits' gradient, the bias's gradient before any sum over broadcast dims, to dbias
  // [batch, q_heads, padded_rows, padded_keys] (of the inputs' dtype; the blocks no query sees are
  // not written: the handler zeroes them first, or the caller masks them out). nullptr: no bias.
  const void *bias = nullptr;
  void *dbias = nullptr;
  int bias_batch = 1, bias_heads = 1;
  const int *q_lengths = nullptr;           // [batch]: i < q_lengths[b]; nullptr: none
  const int *kv_lengths = nullptr;          // [batch]: j < kv_lengths[b]; nullptr: none
  float softcap = 0.f;                      // logits := cap * tanh(logits / cap) (after scaling); 0: none
  // Attention sinks (forward): float32 [entries, q_heads] at dense_index(b, h, 1, q_heads), one logit
  // per query head that joins every row's softmax denominator and has no value; the forward's out and
  // lse include it, so the backward, from them, needs nothing more. A non-finite one: no sink.
  // nullptr: none.
  const float *sinks = nullptr;
  const void *q, *k, *v;
  void *o;          // forward output; backward input (the forward's output)
  float *lse;       // [batch, q_heads, q_len]: forward output, backward input
  int *tile_counter;  // sm_90a forward: one int of scratch (the persistent kernel's tile counter)
  // backward only
  const void *dout;
  const float *dlse;  // cotangent of lse, [batch, q_heads, q_len]
  void *dq, *dk, *dv;
  float *delta;       // workspace [batch, q_heads, q_len]: rowsum(dout * o) - dlse
  // workspace of the sm_90a backward (bwd_sm90_workspace_words() floats): fp32 dq accumulator
  // tiles, lse/delta rows, then one int per (batch, q_head, 64-row query block)
  float *workspace;
  bool deterministic;  // sm_90a backward: add dq contributions in a fixed order (same bits every run)
};

// Entries of Params::fwd_tiles per (batch entry, query head): room for the fixed grid's 128-row tiles,
// or for documents' tiles (one more than the grid's per document at most: jax_tk/attention/launch.py takes
// the grid where they do not fit).
JAX_TK_HD inline int fwd_tile_cap(int q_len) {
  return FWD_TILES_PER_BLOCK * ((q_len + FWD_TILE_ROWS - 1) / FWD_TILE_ROWS);
}
// The (batch, head) entry of a dense operand with `batch` and `heads` entries (Params::mask_bits and
// mask_blocks, Params::bias) that batch entry b (of the folded batch) and query head h read.
JAX_TK_HD inline size_t dense_index(const Params &p, int b, int h, int batch, int heads) {
  const int entry = b / p.entry_batch, mb = batch > 1 ? b % p.entry_batch : 0;
  return (size_t(entry) * batch + mb) * heads + (heads > 1 ? h : 0);
}
// The bias's rows and columns: whole blocks of MASK_BLOCK_ROWS x MASK_BLOCK_KEYS.
JAX_TK_HD inline int padded_rows(int q_len) { return (q_len + MASK_BLOCK_ROWS - 1) / MASK_BLOCK_ROWS * MASK_BLOCK_ROWS; }
JAX_TK_HD inline int padded_keys(int kv_len) { return (kv_len + MASK_BLOCK_KEYS - 1) / MASK_BLOCK_KEYS * MASK_BLOCK_KEYS; }
// Words per row of Params::mask_bits: whole blocks of MASK_BLOCK_KEYS keys, so that no key block of a
// kernel reads past its row.
JAX_TK_HD inline int mask_words(int kv_len) {
  return (kv_len + MASK_BLOCK_KEYS - 1) / MASK_BLOCK_KEYS * (MASK_BLOCK_KEYS / 32);
}
// The sm_90a forward's keys per key block (its tiles' columns, Params::fwd_tiles).
JAX_TK_HD constexpr int fwd_tile_keys(int head_dim) { return head_dim < 256 ? FWD_TILE_KEYS : FWD_TILE_KEYS_D256; }
// The rows of a block of Params::block_order: the backward's key blocks.
inline int bwd_order_rows(int head_dim) { return head_dim <= 128 ? BWD_BLOCK_KEYS : BWD_BLOCK_KEYS_D256; }
inline bool head_dim_in(int head_dim, int dims) { return (head_dim & (head_dim - 1)) == 0 && (head_dim & dims) != 0; }
// The value head dim of the sm_90a kernels for query/key head dim d: d, but in MLA's pair.
JAX_TK_HD constexpr int kernel_v_head_dim(int d) { return d == MLA_HEAD_DIM_QK ? MLA_HEAD_DIM_V : d; }
// Whether some kernel takes query/key head dim d and value head dim dv: equal ones of HEAD_DIMS_SM90,
// or the MLA pair (the sm_90a kernels only).
inline bool has_kernel_dims(int d, int dv) {
  return dv == kernel_v_head_dim(d) && (d == MLA_HEAD_DIM_QK || head_dim_in(d, HEAD_DIMS_SM90));
}

// Size of Params::workspace in 4-byte words (the caller allocates it; it is also what Python asks for).
// Per (batch, head, 64-row query block): an fp32 64 x head_dim dq tile, the rows' lse (log2 units)
// and delta (64 floats each), one int.
JAX_TK_HD inline size_t bwd_sm90_workspace_words(int batch, int q_len, int q_heads, int head_dim) {
  constexpr int R = BWD_QUERY_ROWS;
  return size_t(batch) * q_heads * ((q_len + R - 1) / R) * (R * head_dim + 2 * R + 1);
}

// The formulas Python calls (jax_tk._tk.attention.<name>).
#define JAX_TK_ATTENTION_FORMULAS(F) \
  F(fwd_tile_cap) F(fwd_tile_keys) F(padded_rows) F(padded_keys) F(mask_words) F(bwd_order_rows) F(bwd_sm90_workspace_words)

#ifdef JAX_TK_CUDA_HEADERS
// The mma.sync kernels (sm_80 and newer). Return the launch error, if any.
cudaError_t fwd_sm80(const Params &p, cudaStream_t stream);
cudaError_t bwd_sm80(const Params &p, cudaStream_t stream);

// The Hopper kernels (sm_90a: TMA, wgmma, warp specialization).
bool fwd_sm90_supported(const Params &p);
cudaError_t fwd_sm90(const Params &p, cudaStream_t stream);
bool bwd_sm90_supported(const Params &p);
cudaError_t bwd_sm90(const Params &p, cudaStream_t stream);
#endif

}  // namespace jax_tk::attention
