// Helpers shared by the attention kernels: dispatch over dtype and head dim, launch with a large
// dynamic shared-memory budget, the masking rules and the logit transform (scale, soft cap); the
// online softmax itself is the tile language's (tk/ops/warp/softmax.cuh).
#pragma once
#include <climits>

#include "attention.h"
#include "tk/tk.cuh"

namespace jax_tk::attention {

using tk::LN2;
using tk::LOG2E;
using tk::NEG_INF;
using tk::warp::normalize_output;
using tk::warp::softmax_step;
using tk::warp::tanh_fast;

// Does p use an option beyond causal (window, segment ids, a boolean mask, a bias, lengths, soft cap)?
inline bool has_options(const Params &p) {
  return p.window_left >= 0 || p.window_right >= 0 || p.q_segment_ids || p.mask_bits || p.bias || p.q_lengths ||
         p.kv_lengths || p.softcap > 0.f;
}

// f.template operator()<T, D, FULL, DENSE>() for the runtime dtype and head dim (one of DIMS). The
// kernels are compiled three times: FULL = false knows only the causal mask and the sequence ends
// (plain attention pays nothing for the options), FULL = true applies every option of Params but the
// boolean mask and the bias (the dense [q_len, kv_len] operands), and FULL = DENSE = true every
// option. (The dense operands' helpers below take DENSE: without it the instances for windows, lengths
// and segment ids compile as if those did not exist; their code costs registers in the loops. The
// Hopper backward splits FULL further by option, see bwd_sm90_kernel.)
template <int... DIMS, typename F> cudaError_t dispatch(const Params &p, F f) {
  auto by_dim = [&]<typename T, bool FULL, bool DENSE>() -> cudaError_t {
    cudaError_t e = cudaErrorInvalidValue;
    ((p.head_dim == DIMS ? (e = f.template operator()<T, DIMS, FULL, DENSE>(), true) : false) || ...);
    return e;
  };
  auto by_options = [&]<typename T>() -> cudaError_t {
    if (p.mask_bits || p.bias) return by_dim.template operator()<T, true, true>();
    return has_options(p) ? by_dim.template operator()<T, true, false>() : by_dim.template operator()<T, false, false>();
  };
  return p.dtype == DType::bf16 ? by_options.template operator()<tk::bf16>() : by_options.template operator()<tk::half>();
}

template <typename Kernel>
cudaError_t launch(Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, const Params &p) {
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (e != cudaSuccess) return e;
  }
  kernel<<<grid, block, smem, stream>>>(p);
  return cudaGetLastError();
}

// ------------------------------------------------------------------------------------------------
// Masking: which keys a query row sees. The rules of reference.visibility, all together: causal
// (j <= i), window (i - left <= j <= i + right), same segment, i < q length, j < kv length.
// ------------------------------------------------------------------------------------------------

// Every masking function takes FULL (see dispatch): with FULL = false the options are known to be
// absent and fold away at compile time.

// Query rows [0, q_end) and keys [0, kv_end) of batch entry b take part (sequence lengths, clamped).
template <bool FULL> __device__ __forceinline__ int q_end(const Params &p, int b) {
  return FULL && p.q_lengths ? min(p.q_len, max(p.q_lengths[b], 0)) : p.q_len;
}
template <bool FULL> __device__ __forceinline__ int kv_end(const Params &p, int b) {
  return FULL && p.kv_lengths ? min(p.kv_len, max(p.kv_lengths[b], 0)) : p.kv_len;
}

// The position rules (causal, window, lengths) of one batch entry as four integers: query row qi
// sees key kj iff qi < q_end, kj < kv_end and lo <= kj - qi <= hi (segment ids aside). A kernel works
// them out once; each test is then a few integer operations, with no memory access.
struct KeyRule {
  int q_end, kv_end, lo, hi;
  __device__ __forceinline__ bool sees(int qi, int kj) const {
    // lo <= kj - qi <= hi as one unsigned comparison (wrapping arithmetic: hi - lo < 2^32)
    return qi < q_end && kj < kv_end && unsigned(kj - qi) - unsigned(lo) <= unsigned(hi) - unsigned(lo);
  }
  // Does some query row of [q0, q0 + rows) miss some key of [k0, k0 + cols)?
  __device__ __forceinline__ bool partial(int q0, int rows, int k0, int cols) const {
    return q0 + rows > q_end || k0 + cols > kv_end || k0 - (q0 + rows - 1) < lo || k0 + cols - 1 - q0 > hi;
  }
};
template <bool FULL> __device__ __forceinline__ KeyRule key_rule(const Params &p, int b) {
  KeyRule r{q_end<FULL>(p, b), kv_end<FULL>(p, b), INT_MIN, p.causal ? 0 : INT_MAX};
  if (FULL && p.window_right >= 0) r.hi = min(r.hi, p.window_right);
  if (FULL && p.window_left >= 0) r.lo = -p.window_left;
  return r;
}

// [first, end) of the blocks of size B that hold [lo, hi); {0, 0} when empty.
__device__ __forceinline__ int2 blocks_of(long long lo, long long hi, int B) {
  if (lo >= hi) return {0, 0};
  return {int(lo / B), int((hi + B - 1) / B)};
}

// Key blocks of size BK that query rows [q0, q0 + rows) may see: [first, end). Causal, the window
// and the lengths tighten it; segment ids skip blocks inside it (next_kv_block).
template <bool FULL> __device__ __forceinline__ int2 kv_block_range(const Params &p, int b, int q0, int rows, int BK) {
  const long long q_last = min(q0 + rows, q_end<FULL>(p, b)) - 1;
  if (q_last < q0) return {0, 0};
  long long lo = 0, hi = kv_end<FULL>(p, b);
  if (p.causal) hi = min(hi, q_last + 1);
  if (FULL && p.window_right >= 0) hi = min(hi, q_last + p.window_right + 1);
  if (FULL && p.window_left >= 0) lo = max(lo, (long long)q0 - p.window_left);
  return blocks_of(lo, hi, BK);
}

// Query blocks of size BQ that may see keys [k0, k0 + cols): [first, end) (backward over keys).
template <bool FULL> __device__ __forceinline__ int2 q_block_range(const Params &p, int b, int k0, int cols, int BQ) {
  const long long k_last = min(k0 + cols, kv_end<FULL>(p, b)) - 1;
  if (k_last < k0) return {0, 0};
  long long lo = 0, hi = q_end<FULL>(p, b);
  if (p.causal) lo = max(lo, (long long)k0);
  if (FULL && p.window_right >= 0) lo = max(lo, (long long)k0 - p.window_right);
  if (FULL && p.window_left >= 0) hi = min(hi, k_last + p.window_left + 1);
  return blocks_of(lo, hi, BQ);
}

// Segment ids of rows [r0, r0 + n) (of len) of batch entry b lie in [x, y], from the per-granule
// ranges (min, max of every SEGMENT_GRANULE rows).
__device__ __forceinline__ int2 segment_span(const int *ranges, int len, int b, int r0, int n) {
  const int granules = (len + SEGMENT_GRANULE - 1) / SEGMENT_GRANULE;
  const int g0 = max(r0, 0) / SEGMENT_GRANULE, g1 = (min(r0 + n, len) - 1) / SEGMENT_GRANULE;
  const int2 *r = reinterpret_cast<const int2 *>(ranges) + size_t(b) * granules;
  int2 span = r[g0];
  for (int g = g0 + 1; g <= g1; g++) span = {min(span.x, r[g].x), max(span.y, r[g].y)};
  return span;
}

// The segment ids of query rows [q0, q0 + rows) and keys [k0, k0 + cols) (those inside the
// sequences; the other rules are left to the callers): `meet`: can some row share a segment with
// some key (if not, the block is skipped); `one`: do they all lie in one segment, so that their tile
// needs no elementwise segment test? (Both true without segment ids, or past the ends: KeyRule.)
struct SegmentTest {
  bool meet, one;
};
template <bool FULL> __device__ __forceinline__ SegmentTest segment_test(const Params &p, int b, int q0, int rows, int k0, int cols) {
  if (!FULL || !p.q_segment_ids || q0 >= p.q_len || k0 >= p.kv_len) return {true, true};
  const int2 qs = segment_span(p.q_segment_ranges, p.q_len, b, q0, rows);
  const int2 ks = segment_span(p.kv_segment_ranges, p.kv_len, b, k0, cols);
  return {qs.x <= ks.y && ks.x <= qs.y, qs.x == qs.y && ks.x == ks.y && qs.x == ks.x};
}
template <bool FULL> __device__ __forceinline__ bool segments_meet(const Params &p, int b, int q0, int rows, int k0, int cols) {
  return segment_test<FULL>(p, b, q0, rows, k0, cols).meet;
}

// The boolean mask's code (MASK_EMPTY, MASK_FULL, MASK_MIXED) for query rows [q0, q0 + rows) of head h
// and keys [k0, k0 + cols), a block inside one block of Params::mask_blocks (every kernel's blocks
// divide MASK_BLOCK_ROWS x MASK_BLOCK_KEYS); MASK_FULL without a mask.
template <bool FULL, bool DENSE> __device__ __forceinline__ int mask_code(const Params &p, int b, int h, int q0, int k0) {
  if (!DENSE || !p.mask_blocks) return MASK_FULL;
  const int qb = (p.q_len + MASK_BLOCK_ROWS - 1) / MASK_BLOCK_ROWS, kb = (p.kv_len + MASK_BLOCK_KEYS - 1) / MASK_BLOCK_KEYS;
  return p.mask_blocks[(dense_index(p, b, h, p.mask_batch, p.mask_heads) * qb + q0 / MASK_BLOCK_ROWS) * kb + k0 / MASK_BLOCK_KEYS];
}
// The per-pair tests of a block (segment ids and the boolean mask) for head h: `meet`, some pair may
// be visible (else the block is skipped); `one`, no pair needs an elementwise test of either.
template <bool FULL, bool DENSE> __device__ __forceinline__ SegmentTest pair_test(const Params &p, int b, int h, int q0, int rows, int k0, int cols) {
  SegmentTest x = segment_test<FULL>(p, b, q0, rows, k0, cols);
  if (DENSE && p.mask_blocks && q0 < p.q_len && k0 < p.kv_len) {
    const int code = mask_code<FULL, DENSE>(p, b, h, q0, k0);
    x = {x.meet && code != MASK_EMPTY, x.one && code == MASK_FULL};
  }
  return x;
}

// The next key block in [j, end) (blocks of BK) that query rows [q0, q0 + rows) of head h may see
// (end if none): kv_block_range bounds the blocks, pair_test skips the ones between.
template <bool FULL, bool DENSE>
__device__ __forceinline__ int next_kv_block(const Params &p, int b, int h, int q0, int rows, int j, int end, int BK) {
  while (j < end && !pair_test<FULL, DENSE>(p, b, h, q0, rows, j * BK, BK).meet) j++;
  return j;
}

// The blocks [first, end) a thread block visits, minus those that a test rules out, and for each
// whether it is uniform: in one segment and, with a boolean mask, all visible (no per-pair test).
// Both tests read memory (the segment id ranges, the mask's block summary: an L2 round trip per
// block, serially one stall per step), so the whole thread block evaluates them once, in parallel,
// into two bit lists in shared memory (list_blocks); with bits == nullptr every block of the range is
// visited and none needs a per-pair test.
struct BlockList {
  int first, end;
  const uint32_t *bits;  // [0, words): takes part; [words, 2 words): uniform
  int words;
  __device__ __forceinline__ int next(int j) const {  // the first listed block >= j (end if none)
    if (!bits) return j;
    while (j < end) {
      const int i = j - first;
      const uint32_t w = bits[i / 32] >> (i % 32);
      if (w) return min(j + __ffs(w) - 1, end);
      j += 32 - i % 32;
    }
    return end;
  }
  __device__ __forceinline__ bool uniform(int j) const {
    if (!bits) return true;
    const int i = j - first;
    return (bits[words + i / 32] >> (i % 32)) & 1;
  }
  __device__ __forceinline__ int count() const {  // of the listed blocks
    if (!bits) return max(end - first, 0);
    int n = 0;
    for (int w = 0; w < words; w++) n += __popc(bits[w]);
    return n;
  }
};
// Shared memory for the lists of a range of `blocks` blocks.
__host__ __device__ constexpr size_t block_list_bytes(int blocks) { return 8 * size_t((blocks + 31) / 32); }
// Writes the lists of the blocks j of [first, end) as bits, by warps `warp`, `warp` + `warps`, ...
// (32 blocks each): test(j) gives whether j takes part (meet) and is uniform (one), as a SegmentTest.
// The list is {first, end, bits, (n + 31) / 32}.
template <typename F> __device__ __forceinline__ void write_block_list(uint32_t *bits, int first, int end, int warp, int warps, F test) {
  const int n = max(end - first, 0), words = (n + 31) / 32;
  for (int w = warp; w < words; w += warps) {
    const int i = w * 32 + int(threadIdx.x % 32);
    const SegmentTest x = i < n ? test(first + i) : SegmentTest{false, false};
    const uint32_t part = __ballot_sync(~0u, x.meet), one = __ballot_sync(~0u, x.one);
    if (threadIdx.x % 32 == 0) {
      bits[w] = part;
      bits[words + w] = one;
    }
  }
}
__device__ __forceinline__ BlockList block_list(const uint32_t *bits, int first, int end) {
  return {first, end, bits, (max(end - first, 0) + 31) / 32};
}
// The whole thread block lists the blocks when `use` (the same for the whole thread block: it
// synchronizes it); otherwise every block of [first, end) is listed.
template <typename F> __device__ __forceinline__ BlockList list_blocks(uint32_t *bits, int first, int end, bool use, F test) {
  if (!use) return {first, end, nullptr, 0};
  write_block_list(bits, first, end, threadIdx.x / 32, blockDim.x / 32, test);
  __syncthreads();
  return block_list(bits, first, end);
}

// s := -inf where query q0 + i and key k0 + j have different segment ids; (i, j) = (row, column) of
// s, or (column, row) when TRANSPOSED. Each thread loads the ids of its rows and columns once (INT_MIN
// past the ends of the sequences, where the KeyRule decides).
template <bool TRANSPOSED, typename RT> __device__ __forceinline__ void mask_segments(RT &s, const Params &p, int b, int q0, int k0) {
  auto ids = [](const int *x, int n) { return [=](int i) { return i < n ? x[i] : INT_MIN; }; };
  const auto q_ids = ids(p.q_segment_ids + size_t(b) * p.q_len + q0, p.q_len - q0);
  const auto kv_ids = ids(p.kv_segment_ids + size_t(b) * p.kv_len + k0, p.kv_len - k0);
  tk::rv<int, RT::rows, typename tk::col_vec<RT>::layout> row_ids;
  tk::rv<int, RT::cols, typename tk::row_vec<RT>::layout> col_ids;
  tk::warp::map_index(row_ids, TRANSPOSED ? kv_ids : q_ids);
  tk::warp::map_index(col_ids, TRANSPOSED ? q_ids : kv_ids);
  tk::warp::map_outer(s, s, row_ids, col_ids, [](float x, int r, int c) { return r == c ? x : NEG_INF; });
}

// s := -inf where the boolean mask (Params::mask_bits) hides key k0 + j from query q0 + i of head h;
// (i, j) as in mask_segments. Rows and keys past the ends are left to the KeyRule.
template <bool TRANSPOSED, typename RT>
__device__ __forceinline__ void mask_pairs(RT &s, const Params &p, int b, int h, int q0, int k0) {
  const int n = mask_words(p.kv_len), q_last = p.q_len - 1;
  const uint32_t *rows = p.mask_bits + dense_index(p, b, h, p.mask_batch, p.mask_heads) * p.q_len * n;
  auto words = [=](int r) { return rows + size_t(min(q0 + r, q_last)) * n; };  // (query row q0 + r)
  if constexpr (TRANSPOSED) tk::warp::keep_bits_by_col(s, s, words, k0, NEG_INF);
  else tk::warp::keep_bits(s, s, words, k0, NEG_INF);
}

// s := -inf where the rule hides key k0 + j from query q0 + i; (i, j) as in mask_segments.
template <bool TRANSPOSED, typename RT> __device__ __forceinline__ void mask_rule(RT &s, const KeyRule &rule, int q0, int k0) {
  tk::warp::map_indexed(s, s, [&](int r, int c, float x) {
    return rule.sees(q0 + (TRANSPOSED ? c : r), k0 + (TRANSPOSED ? r : c)) ? x : NEG_INF;
  });
}

// Which elementwise masks a tile of logits (query rows q0 + [0, rows), keys k0 + [0, cols)) needs:
// the rule where the tile cuts through it, the per-pair tests (segment ids, the boolean mask) where
// the tile is not known to pass them all (`one`, pair_test's). Only those tiles pay for the
// elementwise work.
struct MaskNeed {
  bool rule, pairs;
};
template <bool FULL, bool DENSE>
__device__ __forceinline__ MaskNeed mask_need(const Params &p, const KeyRule &rule, bool one, int q0, int rows, int k0, int cols) {
  return {rule.partial(q0, rows, k0, cols), FULL && (p.q_segment_ids || (DENSE && p.mask_bits)) && !one};
}

// A block's masks as a producer works them out for the consumers of a whole tile (rows: theirs
// together), in the two low bits of an int (MASK_BITS) that also carries something else: bit 1, the
// tile cuts through the rule (each warp then tests its own rows: warp_mask_need); bit 0, the per-pair
// tests. In the common blocks the consumers then pay one shared-memory load and no test (working the
// tests out per block and warp cost the masked forward and backward about 4%).
constexpr int MASK_BITS = 2;
template <bool FULL, bool DENSE>
__device__ __forceinline__ int tile_mask_bits(const Params &p, const KeyRule &rule, bool one, int q0, int rows, int k0, int cols) {
  const MaskNeed need = mask_need<FULL, DENSE>(p, rule, one, q0, rows, k0, cols);
  return (need.rule ? 2 : 0) | (need.pairs ? 1 : 0);
}
__device__ __forceinline__ MaskNeed warp_mask_need(int bits, const KeyRule &rule, int q0, int rows, int k0, int cols) {
  return {(bits & 2) && rule.partial(q0, rows, k0, cols), (bits & 1) != 0};
}

// s := -inf where query qw + r of head h does not see key k0 + c (s: rows are queries, columns
// keys), as far as `need` says.
template <bool FULL, bool DENSE, typename RT>
__device__ __forceinline__ void mask_logits(RT &s, const Params &p, const KeyRule &rule, MaskNeed need, int b, int h, int qw, int k0) {
  if (need.rule) mask_rule<false>(s, rule, qw, k0);
  if (FULL && need.pairs && (!DENSE || p.q_segment_ids)) mask_segments<false>(s, p, b, qw, k0);  // (need.pairs: ids or mask)
  if (DENSE && need.pairs && p.mask_bits) mask_pairs<false>(s, p, b, h, qw, k0);
}
// The same for a transposed tile s^T (rows are keys kw.., columns queries q0..).
template <bool FULL, bool DENSE, typename RT>
__device__ __forceinline__ void mask_logits_transposed(RT &s, const Params &p, const KeyRule &rule, MaskNeed need, int b, int h,
                                                       int kw, int q0) {
  if (need.rule) mask_rule<true>(s, rule, q0, kw);
  if (FULL && need.pairs && (!DENSE || p.q_segment_ids)) mask_segments<true>(s, p, b, q0, kw);
  if (DENSE && need.pairs && p.mask_bits) mask_pairs<true>(s, p, b, h, q0, kw);
}
// Both, working out the rule and the masks needed on the spot.
template <bool FULL, bool DENSE, typename RT> __device__ __forceinline__ void mask_logits(RT &s, const Params &p, int b, int h, int qw, int k0) {
  const KeyRule rule = key_rule<FULL>(p, b);
  const bool one = pair_test<FULL, DENSE>(p, b, h, qw, RT::rows, k0, RT::cols).one;
  mask_logits<FULL, DENSE>(s, p, rule, mask_need<FULL, DENSE>(p, rule, one, qw, RT::rows, k0, RT::cols), b, h, qw, k0);
}
template <bool FULL, bool DENSE, typename RT>
__device__ __forceinline__ void mask_logits_transposed(RT &s, const Params &p, int b, int h, int kw, int q0) {
  const KeyRule rule = key_rule<FULL>(p, b);
  const bool one = pair_test<FULL, DENSE>(p, b, h, q0, RT::cols, kw, RT::rows).one;
  mask_logits_transposed<FULL, DENSE>(s, p, rule, mask_need<FULL, DENSE>(p, rule, one, q0, RT::cols, kw, RT::rows), b, h, kw, q0);
}

// ------------------------------------------------------------------------------------------------
// Logits: scale, soft cap (cap * tanh(logit / cap), Gemma 2), base-2 units
// ------------------------------------------------------------------------------------------------

// s := the logits in log2 units: scale * s * log2 e, or with a cap cap * tanh(scale * s / cap) * log2 e.
template <bool FULL, typename RT> __device__ __forceinline__ void scale_logits(RT &s, const Params &p) {
  if (FULL && p.softcap > 0.f) {
    const float in = p.scale / p.softcap, out = p.softcap * LOG2E;
    tk::warp::map(s, s, [=](float x) { return out * tanh_fast(x * in); });
  } else {
    tk::warp::mul(s, s, p.scale * LOG2E);
  }
}
// Backward: the same, and dcap := d(capped logit) / d(scaled logit) = 1 - tanh^2 (only with a cap;
// untouched otherwise; a 16-bit tile is precise enough, like dS itself, and saves registers).
// softcap_backward then turns dS (w.r.t. the capped logits) into dS w.r.t. the scaled logits, so that
// dQ = scale * dS K and dK = scale * dS^T Q as without a cap.
template <bool FULL, typename RT, typename DT>
__device__ __forceinline__ void scale_logits(RT &s, DT &dcap, const Params &p) {
  if (FULL && p.softcap > 0.f) {
    const float in = p.scale / p.softcap, out = p.softcap * LOG2E;
    tk::warp::map(s, s, [=](float x) { return tanh_fast(x * in); });
    tk::warp::map(dcap, s, [](float t) { return 1.f - t * t; });
    tk::warp::mul(s, s, out);
  } else {
    tk::warp::mul(s, s, p.scale * LOG2E);
  }
}
template <bool FULL, typename RT, typename DT>
__device__ __forceinline__ void softcap_backward(RT &ds, const DT &dcap, const Params &p) {
  if (FULL && p.softcap > 0.f) tk::warp::mul(ds, ds, dcap);
}

// A row's log-sum-exp in log2 units for P = exp2(s - lse2). A row that sees no key (lse = -inf)
// gets +inf, so that its P is 0 (not exp2(-inf + inf) = NaN) and its gradients are 0.
__device__ __forceinline__ float lse_to_log2(float lse) { return lse == NEG_INF ? -NEG_INF : lse * LOG2E; }

// The softmax takes the logits in units of 1 / logit_factor: with a soft cap or a bias they are
// brought to log2 units first (cap_logits; then the bias is added: add_bias), factor 1; otherwise
// they stay raw and the softmax applies the factor scale * log2 e inside its exp2 (one fused
// multiply-add per logit). (scale > 0: the row max of the raw logits is that of the scaled ones.)
template <bool FULL, bool DENSE> __device__ __forceinline__ bool log2_logits(const Params &p) {
  return (FULL && p.softcap > 0.f) || (DENSE && p.bias);
}
template <bool FULL, bool DENSE> __device__ __forceinline__ float logit_factor(const Params &p) {
  return log2_logits<FULL, DENSE>(p) ? 1.f : p.scale * LOG2E;
}
template <bool FULL, bool DENSE, typename RT> __device__ __forceinline__ void cap_logits(RT &s, const Params &p) {
  if (log2_logits<FULL, DENSE>(p)) scale_logits<FULL>(s, p);
}

// The bias of batch entry b and query head h as a global view of its padded matrix (Params::bias):
// rows queries and columns keys, or TRANSPOSED rows keys and columns queries; GRAD: the view of its
// gradient (Params::dbias, a matrix per batch entry and query head).
template <typename T, bool TRANSPOSED, bool GRAD = false>
__device__ __forceinline__ auto bias_view(const Params &p, int b, int h) {
  using E = std::conditional_t<GRAD, T, const T>;
  const int rows = padded_rows(p.q_len), keys = padded_keys(p.kv_len);
  const size_t at = GRAD ? size_t(b) * p.q_heads + h : dense_index(p, b, h, p.bias_batch, p.bias_heads);
  E *base = static_cast<E *>(GRAD ? p.dbias : const_cast<void *>(p.bias)) + at * rows * keys;
  if constexpr (TRANSPOSED) return tk::gl<E>{base, {1, keys, 1, rows}, {0, 1, 0, keys}};
  else return tk::gl<E>{base, {1, rows, 1, keys}, {0, keys, 0, 1}};
}
// The bias at query rows q0.. and keys k0.. (TRANSPOSED: rows keys k0.., columns queries q0..) into a
// register tile of the inputs' dtype, loaded ahead of its use (add_bias) where the kernel has the
// registers, so that the loads' latency hides behind the products in flight.
template <typename T, bool TRANSPOSED, typename BT>
__device__ __forceinline__ void load_bias(BT &bt, const Params &p, int b, int h, int q0, int k0) {
  tk::warp::load(bt, bias_view<T, TRANSPOSED>(p, b, h), TRANSPOSED ? tk::coord{0, k0, 0, q0} : tk::coord{0, q0, 0, k0});
}
// s += bias (in log2 units).
template <typename RT, typename BT> __device__ __forceinline__ void add_bias(RT &s, const BT &bt) {
  tk::warp::map(s, s, bt, [](float x, float y) { return x + LOG2E * y; });
}
// Both at once (the bias tile's registers live only here).
template <typename T, bool TRANSPOSED, typename RT>
__device__ __forceinline__ void add_bias(RT &s, const Params &p, int b, int h, int q0, int k0) {
  tk::rt<T, RT::rows, RT::cols, typename RT::layout> bt;
  load_bias<T, TRANSPOSED>(bt, p, b, h, q0, k0);
  add_bias(s, bt);
}
// The bias's gradient: dS (w.r.t. the logits) at query rows q0.. and keys k0.. (TRANSPOSED: dS^T).
template <typename T, bool TRANSPOSED, typename RT>
__device__ __forceinline__ void store_dbias(const RT &ds, const Params &p, int b, int h, int q0, int k0) {
  tk::warp::store(bias_view<T, TRANSPOSED, true>(p, b, h), ds, TRANSPOSED ? tk::coord{0, k0, 0, q0} : tk::coord{0, q0, 0, k0});
}

// A bias shared by the batch entries (the usual position bias, [1, H, T, S]) is read by every entry:
// the Hopper kernels then order their work batch entry innermost, so that the blocks that read the
// same bias rows run at the same time and find them in L2 (the bias is the largest operand).
template <bool FULL> __device__ __forceinline__ bool batch_inner(const Params &p) {
  return FULL && p.bias && p.bias_batch == 1 && p.batch > 1;
}
// The Hopper kernels read the bias in 16-byte chunks (tk::warp::chunks: whole sectors, 4-8 loads a
// thread instead of 32) and put it in the logits' layout through a shared scratch tile of each
// consumer warp, BIAS_SCRATCH bytes; the backward writes the bias's gradient back the same way.
constexpr int BIAS_SCRATCH = 2048;
// Forward: the bias of 16 query rows and 64 * PARTS keys, in parts of 64 keys (one scratch tile each).
template <typename T, int PARTS> struct RowBias {
  tk::warp::chunks<T, 16, 64> part[PARTS];
};
template <typename T, int PARTS>
__device__ __forceinline__ void load_bias(RowBias<T, PARTS> &bt, const Params &p, int b, int h, int q0, int k0) {
  for (int i = 0; i < PARTS; i++) tk::warp::load(bt.part[i], bias_view<T, false>(p, b, h), {0, q0, 0, k0 + 64 * i});
}
// s (16 x 64 PARTS, rows queries) += the bias, in log2 units.
template <typename T, int PARTS, typename RT>
__device__ __forceinline__ void add_bias(RT &s, const RowBias<T, PARTS> &bt, void *scratch) {
  static_assert(RT::rows == 16 && RT::cols == 64 * PARTS);
  auto &st = *static_cast<tk::st<T, 16, 64> *>(scratch);
  for (int i = 0; i < PARTS; i++) {
    tk::rt<T, 16, 64> x;
    __syncwarp();  // (the scratch's last reads are done)
    tk::warp::store(st, bt.part[i]);
    __syncwarp();
    tk::warp::load(x, st);
    for (int j = 0; j < 4; j++)
      for (int k = 0; k < 4; k++) {
        const float2 a = tk::to_float2(s.tiles[0][4 * i + j].data[k]), v = tk::to_float2(x.tiles[0][j].data[k]);
        s.tiles[0][4 * i + j].data[k] = tk::from_float2<tk::packed<typename RT::dtype>>(float2{a.x + LOG2E * v.x, a.y + LOG2E * v.y});
      }
  }
}
// Backward: the bias^T of 16 keys and 64 queries, read as the 64 x 16 block of the bias it is.
template <typename T> using ColBias = tk::warp::chunks<T, 64, 16>;
template <typename T>
__device__ __forceinline__ void load_bias(ColBias<T> &bt, const Params &p, int b, int h, int q0, int k0) {
  tk::warp::load(bt, bias_view<T, false>(p, b, h), {0, q0, 0, k0});
}
// s (16 x 64, rows keys, columns queries) += the bias^T, in log2 units.
template <typename T, typename RT>
__device__ __forceinline__ void add_bias(RT &s, const ColBias<T> &bt, void *scratch) {
  auto &st = *static_cast<tk::st<T, 64, 16> *>(scratch);
  tk::rt<T, 16, 64> x;
  __syncwarp();
  tk::warp::store(st, bt);
  __syncwarp();
  tk::warp::load_transposed(x, st);
  add_bias(s, x);
}
// The bias's gradient from dS^T (16 x 64, rows keys k0.., columns queries q0.., the inputs' dtype).
template <typename T, typename RT>
__device__ __forceinline__ void store_dbias(const RT &ds, const Params &p, int b, int h, int q0, int k0, void *scratch) {
  auto &st = *static_cast<tk::st<T, 64, 16> *>(scratch);
  ColBias<T> c;
  __syncwarp();
  tk::warp::store_transposed(st, ds);
  __syncwarp();
  tk::warp::load(c, st);
  tk::warp::store(bias_view<T, false, true>(p, b, h), c, {0, q0, 0, k0});
}

// The output O as a global view whose rows end at rows_end (or q_len): stores skip the rows past it.
template <typename T> __device__ __forceinline__ tk::gl<T> output_rows(const Params &p, int rows_end = INT_MAX) {
  auto O = tk::gl<T>::make(static_cast<T *>(p.o), p.batch, p.q_len, p.q_heads, p.v_head_dim);
  O.dims[1] = min(p.q_len, rows_end);
  return O;
}

// O /= l, then store O's rows qw.. and their log-sum-exp ln(sum exp(logits)) = (m + log2 l) ln 2
// (-inf and O = 0 for a row that saw no key). Rows at or past rows_end (or q_len) are not stored.
template <typename T, typename RT, typename V>
__device__ __forceinline__ void store_output(const Params &p, RT &o, const V &l, int b, int h, int qw, int d0,
                                             int rows_end = INT_MAX) {
  normalize_output(o, l);
  tk::warp::store(output_rows<T>(p, rows_end), o, {b, qw, h, d0});
}
// The sink's logit of batch entry b, query head h, in log2 units (Params::sinks; -inf: none).
__device__ __forceinline__ float sink2(const Params &p, int b, int h) {
  return p.sinks ? tk::warp::sink_log2(p.sinks[dense_index(p, b, h, 1, p.q_heads)]) : NEG_INF;
}
// The rows' log-sum-exp out (with the sink s2 of sink2(); m in units of 1 / c, as softmax_step keeps
// it), then, with a sink, l := the divisor of the rows' O (l / Sunk::factor; 0 where the row saw no
// key). Call it before the output's store.
template <typename V>
__device__ __forceinline__ void store_lse(const Params &p, const V &m, V &l, float c, float s2, int b, int h, int qw,
                                          int rows_end = INT_MAX) {
  using namespace tk;
  auto lse2 = [=](float mx, float x) { return x > 0.f ? mx * c + warp::fn::log2(x) : NEG_INF; };
  V lse;
  warp::map_vec(lse, m, l, [=](float mx, float x) { return (s2 == NEG_INF ? lse2(mx, x) : warp::with_sink(lse2(mx, x), s2).lse2) * LN2; });
  const int end = min(p.q_len, rows_end);
  if (qw < end) warp::store(p.lse + (size_t(b) * p.q_heads + h) * p.q_len + qw, lse, end - qw);
  if (s2 != NEG_INF) {
    warp::map_vec(l, m, l, [=](float mx, float x) {
      const float f = warp::with_sink(lse2(mx, x), s2).factor;
      return f > 0.f ? x / f : 0.f;
    });
  }
}

}  // namespace jax_tk::attention
