// XLA FFI handlers of decode attention (jax_tk_decode) and of appending new tokens then attending
// (jax_tk_decode_append): decode buffers and attributes into Params, check what the kernel can take,
// launch on XLA's stream. No allocation and no host synchronization (the lengths
// stay on the device; the split count is an attribute): CUDA-graph compatible.
//
// Operands: query [batch, q_len, q_heads, head_dim]; key_cache and value_cache (head_dim 576: MLA's
// latent cache, one head, passed as both), contiguous [batch,
// capacity, kv_heads, head_dim] or paged [num_pages, page_size, kv_heads, head_dim]; lengths int32
// [batch]; page_table int32 [batch, max_pages] (paged) or shape (0,) (contiguous); the attention sinks,
// float32 [q_heads] or [batch, q_heads] (Params::sinks), or shape (0,) without them. Results: out (the
// query's shape and dtype; head_dim 512 for MLA's), lse float32 [batch, q_heads, q_len] and the workspace, float32
// [max(workspace_words(), 1)]. Attributes:
// scale, is_causal, window_left, window_right (-1: unbounded), softcap (0: none), splits, and variant
// (cc/core/core.h's VARIANT_*: on Hopper, VARIANT_SM80 runs the kernels of other GPUs, VARIANT_SM86
// those within the shared memory of sm_86 and sm_89 GPUs, SMALL_GPU_SMEM).
#include "decode/decode.h"
#include "ffi/common.h"

namespace jax_tk {
namespace {

using decode::Params;

ffi::Error check_cache(Params &p, const ffi::AnyBuffer &q, const ffi::AnyBuffer &k, const ffi::AnyBuffer &v,
                       const ffi::AnyBuffer &page_table) {
  if (!same_type_and_dims(k, v) || k.element_type() != q.element_type())
    return invalid("key_cache and value_cache must have one shape, and the query's dtype");
  auto kd = k.dimensions();
  if (kd.size() != 4 || kd[3] != p.head_dim || kd[2] <= 0 || p.q_heads % kd[2] != 0)
    return invalid("the caches must be [..., kv_heads, head_dim] with the query's head_dim and q_heads a multiple of kv_heads");
  p.kv_heads = int(kd[2]);
  if (page_table.element_type() != ffi::DataType::S32) return invalid("page_table must be int32");
  auto pd = page_table.dimensions();
  if (pd.size() == 1 && pd[0] == 0) {  // contiguous
    if (kd[0] != p.batch) return invalid("a contiguous cache must be [batch, max_seq_len, kv_heads, head_dim]");
    p.capacity = int(kd[1]);
    if (kd[0] * kd[1] > core::MAX_INDEX) return invalid("batch * max_seq_len must be below 2^31");
  } else {
    if (pd.size() != 2 || pd[0] != p.batch || pd[1] <= 0) return invalid("page_table must be int32 [batch, max_pages]");
    if (kd[1] <= 0 || pd[1] * kd[1] > core::MAX_INDEX) return invalid("max_pages * page_size must be in [1, 2^31)");
    p.page_table = static_cast<const int *>(page_table.untyped_data());
    p.num_pages = int(kd[0]);
    p.page_size = int(kd[1]);
    p.max_pages = int(pd[1]);
    p.capacity = p.max_pages * p.page_size;
    if (kd[0] * kd[1] > core::MAX_INDEX) return invalid("num_pages * page_size must be below 2^31");
    if ((p.page_size & (p.page_size - 1)) == 0)
      for (p.page_shift = 0; (1 << p.page_shift) < p.page_size;) p.page_shift++;
  }
  for (auto d : kd)
    if (d > core::MAX_INDEX) return invalid("cache dimensions must be below 2^31");
  if (p.capacity <= 0) return invalid("the cache must hold at least one position");
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  if (!aligned16(p.k) || !aligned16(p.v)) return invalid("the caches must be 16-byte aligned");
  return ffi::Error::Success();
}

// The call's Params from its buffers and attributes, checked (everything but the launch).
ffi::Error fill(Params &p, const ffi::AnyBuffer &q, const ffi::AnyBuffer &k, const ffi::AnyBuffer &v,
                const ffi::AnyBuffer &lengths, const ffi::AnyBuffer &page_table, const ffi::AnyBuffer &sinks,
                ffi::AnyBuffer &o, ffi::AnyBuffer &lse, ffi::AnyBuffer &workspace, float scale, int32_t is_causal,
                int32_t window_left, int32_t window_right, float softcap, int32_t splits, int32_t variant) {
  if (q.element_type() == ffi::DataType::BF16) p.dtype = decode::DType::bf16;
  else if (q.element_type() == ffi::DataType::F16) p.dtype = decode::DType::fp16;
  else return invalid("the decode kernel takes bfloat16 or float16");
  auto qd = q.dimensions();
  if (qd.size() != 4) return invalid("query must be [batch, q_len, q_heads, head_dim]");
  for (auto d : qd)
    if (d <= 0 || d > core::MAX_INDEX) return invalid("query dimensions must be in [1, 2^31)");
  p.batch = int(qd[0]); p.q_len = int(qd[1]); p.q_heads = int(qd[2]); p.head_dim = int(qd[3]);
  Kernels kernels;
  if (auto e = pick_kernels(variant, kernels); e.failure()) return e;
  // MLA's latent rows (keys, and values their first dims): key_cache and value_cache are the one cache.
  const bool mla = p.head_dim == decode::MLA_HEAD_DIM;
  if (mla && !kernels.sm90) return invalid("the MLA decode kernel (head_dim 576) runs on H100/H200 (sm_90a) only");
  if (!mla && !decode::head_dim_supported(p.head_dim))
    return invalid("the decode kernel takes head_dim 64, 128 or 256 (and 576: MLA's latent rows)");
  if (auto e = check_cache(p, q, k, v, page_table); e.failure()) return e;
  // (The kernel reads key_cache alone: jax_tk passes the one cache as both.)
  if (mla && (p.kv_heads != 1 || softcap != 0.f || sinks.dimensions().size() != 1 || sinks.dimensions()[0] != 0))
    return invalid("the MLA decode kernel takes one latent cache (one head) as both key_cache and value_cache, "
                   "without a soft cap or sinks");
  const int dv = decode::v_head_dim(p.head_dim);
  if (lengths.element_type() != ffi::DataType::S32 || lengths.dimensions().size() != 1 || lengths.dimensions()[0] != p.batch)
    return invalid("lengths must be int32 [batch]");
  if (o.element_type() != q.element_type() || !same_lead_dims(o, q) || o.dimensions().back() != dv)
    return invalid("out must have the query's dtype and shape, with head_dim " + std::to_string(dv));
  auto ld = lse.dimensions();
  if (lse.element_type() != ffi::DataType::F32 || ld.size() != 3 || ld[0] != p.batch || ld[1] != p.q_heads || ld[2] != p.q_len)
    return invalid("lse must be float32 [batch, q_heads, q_len]");
  if (auto sd = sinks.dimensions(); sd.size() != 1 || sd[0] != 0) {
    if (sinks.element_type() != ffi::DataType::F32 || sd.size() < 1 || sd.size() > 2 || sd.back() != p.q_heads ||
        (sd.size() == 2 && sd[0] != p.batch))
      return invalid("sinks must be float32 [q_heads] or [batch, q_heads]");
    p.sinks = static_cast<const float *>(sinks.untyped_data());
    p.sinks_stride = sd.size() == 2 ? p.q_heads : 0;
  }
  if (splits < 1 || splits > decode::MAX_SPLITS) return invalid("splits must be in [1, MAX_SPLITS]");
  const size_t words = decode::workspace_words(splits, p.batch, p.q_len, p.q_heads, dv);
  auto wd = workspace.dimensions();
  if (workspace.element_type() != ffi::DataType::F32 || wd.size() != 1 || size_t(wd[0]) < std::max<size_t>(words, 1))
    return invalid("workspace must be float32 [max(workspace_words, 1)]");
  if (window_left < -1 || window_right < -1) return invalid("window_left and window_right must be >= -1");
  if (!(softcap >= 0.f) || softcap == __builtin_huge_valf()) return invalid("softcap must be finite and >= 0");
  p.lengths = static_cast<const int *>(lengths.untyped_data());
  p.scale = scale;
  p.causal = is_causal != 0;
  p.window_left = window_left;
  p.window_right = window_right;
  p.softcap = softcap;
  p.splits = splits;
  p.sm90 = kernels.sm90;
  p.smem_limit = kernels.small_smem ? decode::SMALL_GPU_SMEM : 0;
  p.q = q.untyped_data();
  p.o = o.untyped_data();
  p.lse = static_cast<float *>(lse.untyped_data());
  p.workspace = static_cast<float *>(workspace.untyped_data());
  if (!aligned16(p.q) || !aligned16(p.o)) return invalid("query and out must be 16-byte aligned");
  return ffi::Error::Success();
}

// Extra... is empty in the production target; the test target takes ffi::RemainingArgs there (buffers
// that tests alias to the outputs to poison them), ignored here.
template <typename... Extra>
ffi::Error decode_impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer lengths,
                       ffi::AnyBuffer page_table, ffi::AnyBuffer sinks, Extra..., ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                       ffi::Result<ffi::AnyBuffer> workspace,
                       float scale, int32_t is_causal, int32_t window_left, int32_t window_right, float softcap,
                       int32_t splits, int32_t variant) {
  Params p{};
  if (auto e = fill(p, q, k, v, lengths, page_table, sinks, *o, *lse, *workspace, scale, is_causal, window_left, window_right,
                    softcap, splits, variant);
      e.failure())
    return e;
  return cuda_error(decode::decode(p, stream), "decode attention");
}

// The same after appending the new tokens' keys and values (k_new, v_new [batch, q_len, kv_heads,
// head_dim]) to the caches, which are also results (k_out, v_out: jax_tk aliases them to k and v, so
// that the append writes in place); lengths are those before the new tokens, lengths_after (int32
// [batch]) those after, which the attention reads.
template <typename... Extra>
ffi::Error append_impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k_new, ffi::AnyBuffer v_new, ffi::AnyBuffer k,
                       ffi::AnyBuffer v, ffi::AnyBuffer lengths, ffi::AnyBuffer page_table, ffi::AnyBuffer sinks, Extra...,
                       ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> workspace,
                       ffi::Result<ffi::AnyBuffer> lengths_after, ffi::Result<ffi::AnyBuffer> k_out,
                       ffi::Result<ffi::AnyBuffer> v_out, float scale, int32_t is_causal, int32_t window_left,
                       int32_t window_right, float softcap, int32_t splits, int32_t variant) {
  Params p{};
  if (auto e = fill(p, q, k, v, lengths, page_table, sinks, *o, *lse, *workspace, scale, is_causal, window_left, window_right,
                    softcap, splits, variant);
      e.failure())
    return e;
  if (p.head_dim == decode::MLA_HEAD_DIM) return invalid("appending takes head_dim 64, 128 or 256 (not MLA's latent rows)");
  for (const ffi::AnyBuffer *x : {&k_new, &v_new})
    if (x->element_type() != q.element_type() || !dims_are(*x, {p.batch, p.q_len, p.kv_heads, p.head_dim}))
      return invalid("the new keys and values must be [batch, q_len, kv_heads, head_dim] in the query's dtype");
  if (!aligned16(k_new.untyped_data()) || !aligned16(v_new.untyped_data())) return invalid("the new keys and values must be 16-byte aligned");
  if (lengths_after->element_type() != ffi::DataType::S32 || !dims_are(*lengths_after, {p.batch}))
    return invalid("lengths_after must be int32 [batch]");
  // The results are the caches' own buffers (aliased), unless XLA hands them buffers of their own (seen
  // under vmap's sequential rule): the caches are then copied there first, and the append and the
  // attention work on the copies.
  for (auto [in, out] : {std::pair{&k, &k_out}, std::pair{&v, &v_out}})
    if ((*out)->untyped_data() != in->untyped_data())
      if (auto e = cuda_error(cudaMemcpyAsync((*out)->untyped_data(), in->untyped_data(), in->size_bytes(), cudaMemcpyDeviceToDevice, stream),
                              "decode attention: copying a cache");
          e.failure())
        return e;
  p.k = k_out->untyped_data();
  p.v = v_out->untyped_data();
  decode::Append a{k_new.untyped_data(), v_new.untyped_data(), p.lengths, static_cast<int *>(lengths_after->untyped_data())};
  p.lengths = a.lengths_after;
  if (auto e = cuda_error(decode::append(p, a, stream), "decode attention: appending"); e.failure()) return e;
  return cuda_error(decode::decode(p, stream), "decode attention");
}

// N buffer operands (ARGS) or results, then (with_attributes) the attributes: the handlers' signatures
// above name them.
template <int N, bool ARGS> auto with_buffers(auto &&b) {  // (N >= 1: a binding is built, never moved)
  auto one = [](auto &&x) {
    if constexpr (ARGS) return std::move(x).template Arg<ffi::AnyBuffer>();
    else return std::move(x).template Ret<ffi::AnyBuffer>();
  };
  if constexpr (N == 1) return one(std::move(b));
  else return with_buffers<N - 1, ARGS>(one(std::move(b)));
}
auto with_attributes(auto &&b) {
  return std::move(b)
      .template Attr<float>("scale")
      .template Attr<int32_t>("is_causal")
      .template Attr<int32_t>("window_left")
      .template Attr<int32_t>("window_right")
      .template Attr<float>("softcap")
      .template Attr<int32_t>("splits")
      .template Attr<int32_t>("variant");
}
// A target of OPERANDS buffers and RESULTS results (decode_impl's 6 and 3, append_impl's 8 and 6).
template <bool TEST, int OPERANDS, int RESULTS> auto binding_of() {
  auto head = [] { return with_buffers<OPERANDS, true>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()); };
  auto tail = [](auto &&b) { return with_attributes(with_buffers<RESULTS, false>(std::move(b))); };
  return bind<TEST>(head, tail);
}
template <bool TEST> auto binding() { return binding_of<TEST, 6, 3>(); }
template <bool TEST> auto append_binding() { return binding_of<TEST, 8, 6>(); }

}  // namespace

namespace decode {
FfiTargets ffi_targets();
}

JAX_TK_DEFINE_HANDLERS(Decode, decode_impl, binding);
JAX_TK_DEFINE_HANDLERS(DecodeAppend, append_impl, append_binding);

FfiTargets decode::ffi_targets() {  // (declared by cc/module.cc)
  return {{"jax_tk_decode", reinterpret_cast<void *>(Decode)},
          {"jax_tk_decode_test", reinterpret_cast<void *>(DecodeTest)},
          {"jax_tk_decode_append", reinterpret_cast<void *>(DecodeAppend)},
          {"jax_tk_decode_append_test", reinterpret_cast<void *>(DecodeAppendTest)}};
}

}  // namespace jax_tk
