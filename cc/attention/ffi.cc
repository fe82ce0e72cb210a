// XLA FFI handlers for attention: decode buffers and attributes into Params, check what the kernels
// can take, and launch on XLA's stream. No allocation: the workspaces (the forward's tile counter,
// the backward's delta and the sm_90a kernel's fp32 dq accumulator) are outputs declared in Python.
// The *_test targets are the same handlers plus trailing operands that they ignore: tests alias
// poisoned buffers to the outputs through them.
//
// Masking operands (after q, k, v in the forward; after q, k, v, o, lse, dout, dlse in the backward):
// (Every operand and result may have leading vmapped dimensions in front: see Lead.)
// q_segment_ids [batch, q_len], kv_segment_ids [batch, kv_len], q_lengths [batch], kv_lengths
// [batch], then with segment ids their ranges q_segment_ranges [batch, ceil(q_len / 64), 2] and
// kv_segment_ranges [batch, ceil(kv_len / 64), 2] (min and max id of every 64 rows, for skipping
// blocks), then with segment ids optionally the sm_90a forward's tiles (Params::fwd_tiles: [batch *
// q_heads * fwd_tile_cap(q_len) * 4]) or the backward's order of its blocks (Params::block_order:
// [batch * kv_heads * ceil(kv_len / bwd_order_rows)]; a permutation); jax_tk/attention/launch.py works them
// out. All int32; an absent option is an int32 array of shape (0,). Then a boolean mask, as
// Params::mask_bits (uint32 [mask batch, mask heads, q_len, mask_words(kv_len)], the batch 1 or batch,
// the heads 1 or q_heads) and Params::mask_blocks (int8 [mask batch, mask heads, ceil(q_len /
// MASK_BLOCK_ROWS), ceil(kv_len / MASK_BLOCK_KEYS)]), both of shape (0,) without one; then a bias, as
// Params::bias ([bias batch, bias heads, padded_rows(q_len), padded_keys(kv_len)] of the inputs' dtype,
// the batch 1 or batch, the heads 1 or q_heads; shape (0,) without one), whose gradient the backward
// returns as its last result (dbias, Params::dbias; shape (0,) without a bias); then in the forward the
// attention sinks (check_sinks). Attributes
// window_left, window_right (-1: unbounded) and softcap (0: none); the backward's zero_dbias: 1, the
// handler zeroes dbias before the kernel writes the blocks some query sees; 0, it leaves the other
// blocks as they were (for a caller that masks them out itself: a memset of [batch, heads, T, S]
// would cost as much as a third of the backward with a bias).
#include "ffi/common.h"
#include "attention/attention.h"

namespace jax_tk {
namespace {

using attention::Params;

// Under jax.vmap the operands and results come with the mapped dimensions in front (the FFI call's
// vmap_method "broadcast_all": the same leading dimensions everywhere). The layout stays contiguous,
// so those dimensions fold into the batch: the whole vmapped call is one launch. Lead holds them (from
// the query) and the unfolded batch; every other shape is checked as lead + its own dimensions.
struct Lead {
  std::vector<int64_t> dims;
  int64_t count = 1, batch = 0;  // product of dims; the batch of one vmapped entry

  bool matches(const ffi::AnyBuffer &x, std::initializer_list<int64_t> tail) const {
    auto d = x.dimensions();
    if (d.size() != dims.size() + tail.size()) return false;
    for (size_t i = 0; i < dims.size(); i++)
      if (d[i] != dims[i]) return false;
    for (size_t i = 0; i < tail.size(); i++)
      if (d[dims.size() + i] != tail.begin()[i]) return false;
    return true;
  }
  std::string shape(std::initializer_list<int64_t> tail) const {
    std::string s;
    for (auto n : dims) s += std::to_string(n) + ", ";
    for (auto n : tail) s += std::to_string(n) + ", ";
    return "[" + s.substr(0, s.size() - 2) + "]";
  }
};

int64_t elements(const ffi::AnyBuffer &x) {
  int64_t n = 1;
  for (auto d : x.dimensions()) n *= d;
  return n;
}

// q, k, v into p (p.batch: one vmapped entry's; fold() multiplies it by the leading dimensions).
ffi::Error check_qkv(Params &p, Lead &lead, const ffi::AnyBuffer &q, const ffi::AnyBuffer &k, const ffi::AnyBuffer &v) {
  if (q.element_type() != k.element_type() || q.element_type() != v.element_type())
    return invalid("query, key and value must have the same dtype");
  if (q.element_type() == ffi::DataType::BF16) p.dtype = attention::DType::bf16;
  else if (q.element_type() == ffi::DataType::F16) p.dtype = attention::DType::fp16;
  else return invalid("attention kernels take bfloat16 or float16 inputs");
  auto qa = q.dimensions(), ka = k.dimensions();
  const size_t r = qa.size();
  if (r < 4 || ka.size() != r || v.dimensions().size() != r)
    return invalid("query, key and value must be [..., batch, seq, heads, head_dim], of one rank");
  if (!same_lead_dims(k, v)) return invalid("key and value must have the same shape but their head dims");
  lead.dims.assign(qa.begin(), qa.end() - 4);
  for (size_t i = 0; i + 4 < r; i++) {
    if (ka[i] != qa[i]) return invalid("query and key/value disagree on their leading (vmapped) dimensions");
    lead.count *= qa[i];
  }
  const int64_t *qd = qa.begin() + (r - 4), *kd = ka.begin() + (r - 4);
  if (qd[0] != kd[0] || qd[3] != kd[3]) return invalid("query and key/value disagree on batch or head_dim");
  if (kd[2] == 0 || qd[2] % kd[2] != 0) return invalid("query heads must be a multiple of key/value heads");
  const int64_t dv = v.dimensions().back();
  if (qd[3] <= 0 || qd[3] > 256 || dv <= 0 || !attention::has_kernel_dims(int(qd[3]), int(dv)))
    return invalid("attention kernels take head_dim 64 or 128 (and 256 on H100/H200), and the value's head_dim "
                   "the same, or 192 with a value head_dim of 128 (H100/H200)");
  for (auto d : {lead.count * qd[0], qd[1], qd[2], kd[1], kd[2]})
    if (d <= 0 || d > core::MAX_INDEX) return invalid("attention dimensions must be in [1, 2^31)");
  if (qd[1] * qd[2] * qd[3] > core::MAX_INDEX || kd[1] * kd[2] * kd[3] > core::MAX_INDEX)
    return invalid("one batch entry of query or key must have fewer than 2^31 elements");
  lead.batch = qd[0];
  p.entry_batch = int(qd[0]);  // (fold() multiplies p.batch, not this)
  p.batch = int(qd[0]); p.q_len = int(qd[1]); p.q_heads = int(qd[2]); p.head_dim = int(qd[3]);
  p.v_head_dim = int(dv);
  p.kv_len = int(kd[1]); p.kv_heads = int(kd[2]);
  p.q = q.untyped_data(); p.k = k.untyped_data(); p.v = v.untyped_data();
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v)) return invalid("inputs must be 16-byte aligned");
  return ffi::Error::Success();
}

// After every shape check: the batch of the whole (vmapped) call.
void fold(Params &p, const Lead &lead) { p.batch = int(lead.count * lead.batch); }

ffi::Error check_rows(const Params &p, const Lead &lead, const ffi::AnyBuffer &x, const char *name) {
  if (x.element_type() != ffi::DataType::F32 || !lead.matches(x, {p.batch, p.q_heads, p.q_len}))
    return invalid(std::string(name) + " must be float32 " + lead.shape({p.batch, p.q_heads, p.q_len}) +
                   " ([..., batch, q_heads, q_len])");
  return ffi::Error::Success();
}

// An optional int32 operand: no elements means absent (nullptr: shape (0,), or that broadcast under
// vmap), else it must have shape lead + `dims`.
ffi::Error optional_ints(const Lead &lead, const ffi::AnyBuffer &x, std::initializer_list<int64_t> dims,
                         const char *name, const int **out) {
  if (x.element_type() != ffi::DataType::S32) return invalid(std::string(name) + " must be int32");
  *out = nullptr;
  if (elements(x) == 0) return ffi::Error::Success();
  if (!lead.matches(x, dims))
    return invalid(std::string(name) + " must have shape (0,) (absent) or " + lead.shape(dims));
  *out = static_cast<const int *>(x.untyped_data());
  return ffi::Error::Success();
}

// The kernels' order operand (Params::fwd_tiles, Params::block_order): `size` ints per vmapped entry,
// with segment ids only. Its entries name batch entries of one vmapped entry, so a folded call (more
// than one) runs in the kernel's own order instead (correct, without the longest-first balance).
ffi::Error check_order(const Params &p, const Lead &lead, const ffi::AnyBuffer &order, int64_t size,
                       const char *name, const int **out) {
  if (auto e = optional_ints(lead, order, {size}, name, out); e.failure()) return e;
  if (*out && !p.q_segment_ids) return invalid(std::string(name) + " must be absent without segment ids");
  if (lead.count > 1) *out = nullptr;
  return ffi::Error::Success();
}

// The masking operands and attributes (see the top of this file) into p; q, k, v already decoded.
ffi::Error check_masking(Params &p, const Lead &lead, const ffi::AnyBuffer &q_segment_ids, const ffi::AnyBuffer &kv_segment_ids,
                         const ffi::AnyBuffer &q_lengths, const ffi::AnyBuffer &kv_lengths,
                         const ffi::AnyBuffer &q_segment_ranges, const ffi::AnyBuffer &kv_segment_ranges,
                         int32_t window_left, int32_t window_right, float softcap) {
  if (auto e = optional_ints(lead, q_segment_ids, {p.batch, p.q_len}, "q_segment_ids", &p.q_segment_ids); e.failure())
    return e;
  if (auto e = optional_ints(lead, kv_segment_ids, {p.batch, p.kv_len}, "kv_segment_ids", &p.kv_segment_ids); e.failure())
    return e;
  if ((p.q_segment_ids == nullptr) != (p.kv_segment_ids == nullptr))
    return invalid("give both q_segment_ids and kv_segment_ids, or neither");
  const int64_t g = attention::SEGMENT_GRANULE, q_granules = (p.q_len + g - 1) / g, kv_granules = (p.kv_len + g - 1) / g;
  if (auto e = optional_ints(lead, q_segment_ranges, {p.batch, q_granules, 2}, "q_segment_ranges", &p.q_segment_ranges);
      e.failure())
    return e;
  if (auto e = optional_ints(lead, kv_segment_ranges, {p.batch, kv_granules, 2}, "kv_segment_ranges", &p.kv_segment_ranges);
      e.failure())
    return e;
  if ((p.q_segment_ranges == nullptr) != (p.q_segment_ids == nullptr) ||
      (p.kv_segment_ranges == nullptr) != (p.kv_segment_ids == nullptr))
    return invalid("segment ranges come with segment ids, and only with them");
  if (auto e = optional_ints(lead, q_lengths, {p.batch}, "q_lengths", &p.q_lengths); e.failure()) return e;
  if (auto e = optional_ints(lead, kv_lengths, {p.batch}, "kv_lengths", &p.kv_lengths); e.failure()) return e;
  if (window_left < -1 || window_right < -1) return invalid("window_left and window_right must be >= -1");
  // A side at least as long as the sequence it reaches over bounds nothing.
  p.window_left = window_left >= p.q_len ? -1 : window_left;
  p.window_right = window_right >= p.kv_len ? -1 : window_right;
  if (!(softcap >= 0.f) || softcap == __builtin_huge_valf()) return invalid("softcap must be finite and >= 0");
  p.softcap = softcap;
  return ffi::Error::Success();
}

// A dense operand's batch and heads dims (1 or the call's; see Params::dense_index): `x` must be lead
// + [batch, heads, rows, cols]; false if not.
bool dense_dims(const Params &p, const Lead &lead, const ffi::AnyBuffer &x, int64_t rows, int64_t cols, int *batch,
                int *heads) {
  auto d = x.dimensions();
  const size_t n = lead.dims.size();
  const int64_t b = d.size() == n + 4 ? d[n] : -1, h = d.size() == n + 4 ? d[n + 1] : -1;
  *batch = int(b);
  *heads = int(h);
  return (b == 1 || b == p.batch) && (h == 1 || h == p.q_heads) && lead.matches(x, {b, h, rows, cols});
}

// The boolean mask's operands (see the top of this file) into p; call before fold().
ffi::Error check_mask(Params &p, const Lead &lead, const ffi::AnyBuffer &bits, const ffi::AnyBuffer &blocks) {
  if (bits.element_type() != ffi::DataType::U32 || blocks.element_type() != ffi::DataType::S8)
    return invalid("mask_bits must be uint32 and mask_blocks int8");
  if (elements(bits) == 0 && elements(blocks) == 0) return ffi::Error::Success();
  const int64_t words = attention::mask_words(p.kv_len);
  const int64_t qb = (p.q_len + attention::MASK_BLOCK_ROWS - 1) / attention::MASK_BLOCK_ROWS;
  const int64_t kb = (p.kv_len + attention::MASK_BLOCK_KEYS - 1) / attention::MASK_BLOCK_KEYS;
  if (!dense_dims(p, lead, bits, p.q_len, words, &p.mask_batch, &p.mask_heads))
    return invalid("mask_bits must be uint32 " + lead.shape({p.batch, p.q_heads, p.q_len, words}) + " (batch and heads may be 1)");
  if (!lead.matches(blocks, {p.mask_batch, p.mask_heads, qb, kb}))
    return invalid("mask_blocks must be int8 " + lead.shape({p.mask_batch, p.mask_heads, qb, kb}));
  p.mask_bits = static_cast<const uint32_t *>(bits.untyped_data());
  p.mask_blocks = static_cast<const int8_t *>(blocks.untyped_data());
  return ffi::Error::Success();
}

// The bias operand (see the top of this file) into p; call after check_masking (softcap), before fold().
ffi::Error check_bias(Params &p, const Lead &lead, const ffi::AnyBuffer &q, const ffi::AnyBuffer &bias) {
  if (elements(bias) == 0) return ffi::Error::Success();
  const int64_t rows = attention::padded_rows(p.q_len), keys = attention::padded_keys(p.kv_len);
  if (bias.element_type() != q.element_type() || !dense_dims(p, lead, bias, rows, keys, &p.bias_batch, &p.bias_heads))
    return invalid("bias must have the inputs' dtype and shape " + lead.shape({p.batch, p.q_heads, rows, keys}) +
                   " (batch and heads may be 1; rows and keys padded to whole blocks of 128)");
  if (p.softcap > 0.f) return invalid("the kernels do not combine a bias with softcap");
  if (!aligned16(bias.untyped_data())) return invalid("bias must be 16-byte aligned");
  p.bias = bias.untyped_data();
  return ffi::Error::Success();
}

// The forward's attention sinks (Params::sinks): float32 [..., q_heads] (one row per vmapped entry), or
// shape (0,) (or that broadcast under vmap) without them.
ffi::Error check_sinks(Params &p, const Lead &lead, const ffi::AnyBuffer &sinks) {
  if (elements(sinks) == 0) return ffi::Error::Success();
  if (sinks.element_type() != ffi::DataType::F32 || !lead.matches(sinks, {p.q_heads}))
    return invalid("sinks must be float32 " + lead.shape({p.q_heads}) + " (one logit per query head)");
  p.sinks = static_cast<const float *>(sinks.untyped_data());
  return ffi::Error::Success();
}

// Extra... is empty in the production targets; the test targets take ffi::RemainingArgs there: the
// buffers that tests alias to the outputs to poison them (see jax_tk/_core/ffi.py), ignored here.
// variant: cc/core/core.h's VARIANT_* (pick_kernels).
template <typename... Extra>
ffi::Error fwd_impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids, ffi::AnyBuffer q_lengths,
                    ffi::AnyBuffer kv_lengths, ffi::AnyBuffer q_segment_ranges, ffi::AnyBuffer kv_segment_ranges,
                    ffi::AnyBuffer block_order, ffi::AnyBuffer mask_bits, ffi::AnyBuffer mask_blocks, ffi::AnyBuffer bias,
                    ffi::AnyBuffer sinks, Extra..., ffi::Result<ffi::AnyBuffer> o,
                    ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> tile_counter, float scale, int32_t is_causal, int32_t variant,
                    int32_t window_left, int32_t window_right, float softcap) {
  Params p{};
  Lead lead;
  if (auto e = check_qkv(p, lead, q, k, v); e.failure()) return e;
  if (auto e = check_masking(p, lead, q_segment_ids, kv_segment_ids, q_lengths, kv_lengths, q_segment_ranges,
                             kv_segment_ranges, window_left, window_right, softcap);
      e.failure())
    return e;
  if (auto e = check_order(p, lead, block_order, int64_t(p.batch) * p.q_heads * attention::fwd_tile_cap(p.q_len) * 4,
                           "tiles", &p.fwd_tiles);
      e.failure())
    return e;
  if (auto e = check_mask(p, lead, mask_bits, mask_blocks); e.failure()) return e;
  if (auto e = check_bias(p, lead, q, bias); e.failure()) return e;
  if (auto e = check_sinks(p, lead, sinks); e.failure()) return e;
  if (o->element_type() != q.element_type() || !same_lead_dims(*o, q) || o->dimensions().back() != p.v_head_dim)
    return invalid("output must have the query's dtype and shape, with the value's head_dim");
  if (auto e = check_rows(p, lead, *lse, "lse"); e.failure()) return e;
  if (tile_counter->element_type() != ffi::DataType::S32 || !lead.matches(*tile_counter, {1}))
    return invalid("tile_counter must be int32 " + lead.shape({1}));  // (the kernel uses its first int)
  Kernels kernels;
  if (auto e = pick_kernels(variant, kernels); e.failure()) return e;
  fold(p, lead);
  p.scale = scale;
  p.causal = is_causal != 0;
  p.o = o->untyped_data();
  p.lse = static_cast<float *>(lse->untyped_data());
  p.tile_counter = static_cast<int *>(tile_counter->untyped_data());
  if (kernels.sm90 && attention::fwd_sm90_supported(p))
    return cuda_error(attention::fwd_sm90(p, stream), "attention forward (sm_90a)");
  if (!attention::head_dim_in(p.head_dim, attention::HEAD_DIMS_SM80) || p.v_head_dim != p.head_dim)
    return invalid("head_dims " + std::to_string(p.head_dim) + ", " + std::to_string(p.v_head_dim) +
                   ": the forward kernel runs on H100/H200 (sm_90a) only");
  return cuda_error(attention::fwd_sm80(p, stream), "attention forward");
}

template <typename... Extra>
ffi::Error bwd_impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o,
                    ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::AnyBuffer dlse, ffi::AnyBuffer q_segment_ids,
                    ffi::AnyBuffer kv_segment_ids, ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                    ffi::AnyBuffer q_segment_ranges, ffi::AnyBuffer kv_segment_ranges, ffi::AnyBuffer block_order,
                    ffi::AnyBuffer mask_bits, ffi::AnyBuffer mask_blocks, ffi::AnyBuffer bias, Extra...,
                    ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                    ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> delta,
                    ffi::Result<ffi::AnyBuffer> workspace, ffi::Result<ffi::AnyBuffer> dbias, float scale, int32_t is_causal, int32_t variant,
                    int32_t window_left, int32_t window_right, float softcap, int32_t deterministic, int32_t zero_dbias) {
  Params p{};
  Lead lead;
  if (auto e = check_qkv(p, lead, q, k, v); e.failure()) return e;
  if (auto e = check_masking(p, lead, q_segment_ids, kv_segment_ids, q_lengths, kv_lengths, q_segment_ranges,
                             kv_segment_ranges, window_left, window_right, softcap);
      e.failure())
    return e;
  const int kv_blocks = (p.kv_len + attention::bwd_order_rows(p.head_dim) - 1) / attention::bwd_order_rows(p.head_dim);
  if (auto e = check_order(p, lead, block_order, int64_t(p.batch) * p.kv_heads * kv_blocks, "block_order",
                           &p.block_order);
      e.failure())
    return e;
  if (p.block_order && deterministic) return invalid("block_order cannot be combined with deterministic");
  if (auto e = check_mask(p, lead, mask_bits, mask_blocks); e.failure()) return e;
  if (auto e = check_bias(p, lead, q, bias); e.failure()) return e;
  const int64_t bias_rows = attention::padded_rows(p.q_len), bias_keys = attention::padded_keys(p.kv_len);
  if (p.bias ? dbias->element_type() != q.element_type() || !lead.matches(*dbias, {p.batch, p.q_heads, bias_rows, bias_keys})
             : elements(*dbias) != 0)
    return invalid(p.bias ? "dbias must have the inputs' dtype and shape " + lead.shape({p.batch, p.q_heads, bias_rows, bias_keys})
                          : std::string("dbias must have no elements without a bias"));
  if (!same_type_and_dims(*dq, q)) return invalid("dq must have the query's shape and dtype");
  for (auto *x : {&o, &dout})
    if (x->element_type() != q.element_type() || !same_lead_dims(*x, q) || x->dimensions().back() != p.v_head_dim)
      return invalid("out and dout must have the query's dtype and shape, with the value's head_dim");
  if (!same_type_and_dims(*dk, k) || !same_type_and_dims(*dv, v)) return invalid("dk and dv must match key and value");
  for (auto [x, name] : {std::pair{&lse, "lse"}, {&dlse, "dlse"}})
    if (auto e = check_rows(p, lead, *x, name); e.failure()) return e;
  if (auto e = check_rows(p, lead, *delta, "delta workspace"); e.failure()) return e;
  // (the size is linear in the batch: a vmapped entry's words each, one after the other, are the
  // folded call's workspace)
  const int64_t words = attention::bwd_sm90_workspace_words(p.batch, p.q_len, p.q_heads, p.head_dim);
  if (workspace->element_type() != ffi::DataType::F32 || !lead.matches(*workspace, {words}))
    return invalid("workspace must be float32 " + lead.shape({words}));
  Kernels kernels;
  if (auto e = pick_kernels(variant, kernels); e.failure()) return e;
  fold(p, lead);
  p.scale = scale;
  p.causal = is_causal != 0;
  p.o = o.untyped_data();
  p.lse = static_cast<float *>(lse.untyped_data());
  p.dout = dout.untyped_data();
  p.dlse = static_cast<const float *>(dlse.untyped_data());
  p.dq = dq->untyped_data();
  p.dk = dk->untyped_data();
  p.dv = dv->untyped_data();
  p.delta = static_cast<float *>(delta->untyped_data());
  p.workspace = static_cast<float *>(workspace->untyped_data());
  p.deterministic = deterministic != 0;
  if (p.bias) {  // (the blocks that no query sees are not written)
    p.dbias = dbias->untyped_data();
    const size_t bytes = size_t(p.batch) * p.q_heads * bias_rows * bias_keys * 2;
    if (zero_dbias)
      if (auto e = cuda_error(cudaMemsetAsync(p.dbias, 0, bytes, stream), "dbias"); e.failure()) return e;
  }
  if (kernels.sm90 && attention::bwd_sm90_supported(p))
    return cuda_error(attention::bwd_sm90(p, stream), "attention backward (sm_90a)");
  if (!attention::head_dim_in(p.head_dim, attention::HEAD_DIMS_SM80))
    return invalid("head_dim " + std::to_string(p.head_dim) + ": the backward kernel runs on H100/H200 (sm_90a) only");
  return cuda_error(attention::bwd_sm80(p, stream), "attention backward");
}

// The masking operands and the attributes both directions take (see the top of this file).
auto masking_operands(auto &&b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()   // q_segment_ids
      .template Arg<ffi::AnyBuffer>()   // kv_segment_ids
      .template Arg<ffi::AnyBuffer>()   // q_lengths
      .template Arg<ffi::AnyBuffer>()   // kv_lengths
      .template Arg<ffi::AnyBuffer>()   // q_segment_ranges
      .template Arg<ffi::AnyBuffer>()   // kv_segment_ranges
      .template Arg<ffi::AnyBuffer>()   // the forward's tiles (Params::fwd_tiles) or the backward's block_order
      .template Arg<ffi::AnyBuffer>()   // mask_bits
      .template Arg<ffi::AnyBuffer>()   // mask_blocks
      .template Arg<ffi::AnyBuffer>();  // bias
}
auto common_attributes(auto &&b) {
  return std::move(b)
      .template Attr<float>("scale")
      .template Attr<int32_t>("is_causal")
      .template Attr<int32_t>("variant")
      .template Attr<int32_t>("window_left")
      .template Attr<int32_t>("window_right")
      .template Attr<float>("softcap");
}
auto qkv(auto &&b) { return std::move(b).template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>(); }

template <bool TEST> auto fwd_binding() {
  auto head = [] {
    return masking_operands(qkv(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())).template Arg<ffi::AnyBuffer>();  // sinks
  };
  auto tail = [](auto &&b) {
    return common_attributes(std::move(b)
                                 .template Ret<ffi::AnyBuffer>()    // out
                                 .template Ret<ffi::AnyBuffer>()    // lse
                                 .template Ret<ffi::AnyBuffer>());  // tile counter of the sm_90a kernel (scratch)
  };
  return bind<TEST>(head, tail);
}

template <bool TEST> auto bwd_binding() {
  auto head = [] {
    return masking_operands(qkv(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
                                .Arg<ffi::AnyBuffer>()    // out
                                .Arg<ffi::AnyBuffer>()    // lse
                                .Arg<ffi::AnyBuffer>()    // dout
                                .Arg<ffi::AnyBuffer>());  // dlse
  };
  auto tail = [](auto &&b) {
    return common_attributes(std::move(b)
                                 .template Ret<ffi::AnyBuffer>()    // dq
                                 .template Ret<ffi::AnyBuffer>()    // dk
                                 .template Ret<ffi::AnyBuffer>()    // dv
                                 .template Ret<ffi::AnyBuffer>()    // delta workspace
                                 .template Ret<ffi::AnyBuffer>()    // workspace of the sm_90a kernel
                                 .template Ret<ffi::AnyBuffer>())   // dbias
        .template Attr<int32_t>("deterministic")
        .template Attr<int32_t>("zero_dbias");
  };
  return bind<TEST>(head, tail);
}

}  // namespace

namespace attention {
FfiTargets ffi_targets();
}

JAX_TK_DEFINE_HANDLERS(AttentionFwd, fwd_impl, fwd_binding);
JAX_TK_DEFINE_HANDLERS(AttentionBwd, bwd_impl, bwd_binding);

FfiTargets attention::ffi_targets() {  // (declared by cc/module.cc)
  return {{"jax_tk_attention_fwd", reinterpret_cast<void *>(AttentionFwd)},
          {"jax_tk_attention_bwd", reinterpret_cast<void *>(AttentionBwd)},
          {"jax_tk_attention_fwd_test", reinterpret_cast<void *>(AttentionFwdTest)},
          {"jax_tk_attention_bwd_test", reinterpret_cast<void *>(AttentionBwdTest)}};
}

}  // namespace jax_tk
