// The linear-attention ops' FFI targets on Hopper: simple GLA's forward (jax_tk_simple_gla_fwd) and the
// gated delta rule's (jax_tk_gated_delta_rule_fwd: wy_fwd's solve, then the sequential pass). The
// handlers decode buffers and attributes into FwdParams, check what the kernels can take, and launch on
// XLA's stream, with no allocation (CUDA-graph compatible).
//
// Operands: q, k [batch, seq_len, heads, k_dim]; v [batch, seq_len, v_heads, v_dim] (bfloat16 or
// float16, one dtype); g float32 [batch, v_heads, seq_len]; cu_seqlens int32 [num_seqs + 1] (batch 1)
// or shape (0,); initial states float32 [num_seqs, v_heads, k_dim, v_dim] or shape (0,). Results: o
// (v's shape, q's dtype), final states float32 [num_seqs, v_heads, k_dim, v_dim]. Attributes: scale,
// variant (the sm_90a kernel only). The gated delta rule's target takes beta (float32 [batch, v_heads,
// seq_len]) after g, and returns its workspaces after the final states: W [batch, seq_len, v_heads,
// k_dim] and U' (v's shape), in q's dtype.
#include "ffi/common.h"
#include "linear_attention/linear_attention.h"

namespace jax_tk {
namespace {

using linear_attention::FwdParams;

// FwdParams from the operands both targets share.
ffi::Error parse(FwdParams &p, const ffi::AnyBuffer &q, const ffi::AnyBuffer &k, const ffi::AnyBuffer &v, const ffi::AnyBuffer &g,
                 const ffi::AnyBuffer &cu_seqlens, const ffi::AnyBuffer &h0, ffi::AnyBuffer &o, ffi::AnyBuffer &ht, float scale,
                 int32_t variant) {
  if (q.element_type() == ffi::DataType::BF16) p.dtype = linear_attention::DType::bf16;
  else if (q.element_type() == ffi::DataType::F16) p.dtype = linear_attention::DType::fp16;
  else return invalid("the linear-attention kernels take bfloat16 or float16");
  Kernels kernels;
  if (auto e = pick_kernels(variant, kernels); e.failure()) return e;
  if (!kernels.sm90) return invalid("the linear-attention kernels run on H100/H200 (sm_90a) only");
  auto qd = q.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || vd.size() != 4 || !same_type_and_dims(q, k) || v.element_type() != q.element_type())
    return invalid("q and k must be [batch, seq_len, heads, k_dim] and v [batch, seq_len, v_heads, v_dim], of one dtype");
  for (auto d : qd)
    if (d > core::MAX_INDEX) return invalid("dimensions must be below 2^31");
  for (auto d : vd)
    if (d > core::MAX_INDEX) return invalid("dimensions must be below 2^31");
  p.batch = int(qd[0]), p.seq_len = int(qd[1]), p.heads = int(qd[2]), p.k_dim = int(qd[3]);
  p.v_heads = int(vd[2]), p.v_dim = int(vd[3]);
  if (vd[0] != qd[0] || vd[1] != qd[1] || p.heads <= 0 || p.v_heads % p.heads != 0)
    return invalid("v must share q's batch and seq_len, with v_heads a multiple of heads");
  if ((p.k_dim != 64 && p.k_dim != 128) || p.v_dim <= 0 || p.v_dim % linear_attention::V_SLICE != 0)
    return invalid("the kernel takes k_dim 64 or 128 and v_dim a multiple of V_SLICE");
  auto gd = g.dimensions();
  if (g.element_type() != ffi::DataType::F32 || gd.size() != 3 || gd[0] != p.batch || gd[1] != p.v_heads || gd[2] != p.seq_len)
    return invalid("g must be float32 [batch, v_heads, seq_len]");
  p.num_seqs = p.batch;
  if (auto cd = cu_seqlens.dimensions(); !(cd.size() == 1 && cd[0] == 0)) {
    if (cu_seqlens.element_type() != ffi::DataType::S32 || cd.size() != 1 || cd[0] < 2 || p.batch != 1)
      return invalid("cu_seqlens must be int32 [num_seqs + 1], with batch 1");
    p.cu_seqlens = static_cast<const int *>(cu_seqlens.untyped_data());
    p.num_seqs = int(cd[0] - 1);
  }
  auto state_ok = [&](const auto &s) {
    auto sd = s.dimensions();
    return s.element_type() == ffi::DataType::F32 && sd.size() == 4 && sd[0] == p.num_seqs && sd[1] == p.v_heads &&
           sd[2] == p.k_dim && sd[3] == p.v_dim;
  };
  if (auto hd = h0.dimensions(); !(hd.size() == 1 && hd[0] == 0)) {
    if (!state_ok(h0)) return invalid("initial states must be float32 [num_seqs, v_heads, k_dim, v_dim]");
    p.h0 = static_cast<const float *>(h0.untyped_data());
  }
  if (o.element_type() != q.element_type() || !same_dims(o, v)) return invalid("o must have v's shape and q's dtype");
  if (!state_ok(ht)) return invalid("final states must be float32 [num_seqs, v_heads, k_dim, v_dim]");
  p.q = q.untyped_data(), p.k = k.untyped_data(), p.v = v.untyped_data();
  p.g = static_cast<const float *>(g.untyped_data());
  p.o = o.untyped_data();
  p.ht = static_cast<float *>(ht.untyped_data());
  p.scale = scale;
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v)) return invalid("q, k and v must be 16-byte aligned");
  return ffi::Error::Success();
}

template <typename... Extra>
ffi::Error gla_fwd_impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer g,
                        ffi::AnyBuffer cu_seqlens, ffi::AnyBuffer h0, Extra..., ffi::Result<ffi::AnyBuffer> o,
                        ffi::Result<ffi::AnyBuffer> ht, float scale, int32_t variant) {
  FwdParams p{};
  if (auto e = parse(p, q, k, v, g, cu_seqlens, h0, *o, *ht, scale, variant); e.failure()) return e;
  return cuda_error(linear_attention::simple_gla_fwd_sm90(p, stream), "simple GLA forward");
}

template <typename... Extra>
ffi::Error gdr_fwd_impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer g,
                        ffi::AnyBuffer beta, ffi::AnyBuffer cu_seqlens, ffi::AnyBuffer h0, Extra..., ffi::Result<ffi::AnyBuffer> o,
                        ffi::Result<ffi::AnyBuffer> ht, ffi::Result<ffi::AnyBuffer> w, ffi::Result<ffi::AnyBuffer> u,
                        float scale, int32_t variant) {
  FwdParams p{};
  if (auto e = parse(p, q, k, v, g, cu_seqlens, h0, *o, *ht, scale, variant); e.failure()) return e;
  if (!same_type_and_dims(beta, g)) return invalid("beta must be float32 [batch, v_heads, seq_len], as g");
  if (w->element_type() != q.element_type() || !same_lead_dims(*w, v) || w->dimensions().back() != p.k_dim)
    return invalid("w must be [batch, seq_len, v_heads, k_dim] in q's dtype");
  if (u->element_type() != q.element_type() || !same_dims(*u, v)) return invalid("u must have v's shape and q's dtype");
  linear_attention::WyParams wy{p.dtype, p.batch, p.seq_len, p.heads, p.v_heads, p.k_dim, p.v_dim, p.num_seqs,
                                (p.seq_len + linear_attention::CHUNK - 1) / linear_attention::CHUNK, p.k, p.v, p.g,
                                static_cast<const float *>(beta.untyped_data()), p.cu_seqlens, w->untyped_data(),
                                u->untyped_data()};
  p.w = wy.w, p.u = wy.u;
  if (auto e = cuda_error(linear_attention::wy_fwd(wy, stream), "gated delta rule (solve)"); e.failure()) return e;
  return cuda_error(linear_attention::simple_gla_fwd_sm90(p, stream), "gated delta rule forward");
}

// Simple GLA: q, k, v, g, cu_seqlens, initial states -> o, final states, then the attributes. The gated
// delta rule: beta after g, and the workspaces W and U' after the final states.
template <bool TEST, bool DELTA> auto binding() {
  auto head = [] {
    auto b = ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                 .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>();  // q, k, v, g
    if constexpr (DELTA) return std::move(b).Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>();
    else return std::move(b).Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>();  // [beta,] cu_seqlens, initial states
  };
  auto tail = [](auto &&b) {
    auto r = std::move(b).template Ret<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>();  // o, final states
    if constexpr (DELTA)
      return std::move(r).template Ret<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>()  // W, U'
          .template Attr<float>("scale").template Attr<int32_t>("variant");
    else return std::move(r).template Attr<float>("scale").template Attr<int32_t>("variant");
  };
  return bind<TEST>(head, tail);
}
template <bool TEST> auto gla_binding() { return binding<TEST, false>(); }
template <bool TEST> auto gdr_binding() { return binding<TEST, true>(); }

}  // namespace

namespace linear_attention {
FfiTargets ffi_targets();
}

JAX_TK_DEFINE_HANDLERS(GlaFwd, gla_fwd_impl, gla_binding);
JAX_TK_DEFINE_HANDLERS(GdrFwd, gdr_fwd_impl, gdr_binding);

FfiTargets linear_attention::ffi_targets() {  // (declared by cc/module.cc)
  return {{"jax_tk_simple_gla_fwd", reinterpret_cast<void *>(GlaFwd)},
          {"jax_tk_simple_gla_fwd_test", reinterpret_cast<void *>(GlaFwdTest)},
          {"jax_tk_gated_delta_rule_fwd", reinterpret_cast<void *>(GdrFwd)},
          {"jax_tk_gated_delta_rule_fwd_test", reinterpret_cast<void *>(GdrFwdTest)}};
}

}  // namespace jax_tk
