// The linear-attention ops' FFI targets on Hopper: simple GLA's forward (jax_tk_simple_gla_fwd) and
// backward (jax_tk_simple_gla_bwd), and the gated delta rule's forward (jax_tk_gated_delta_rule_fwd:
// wy_fwd's solve, then the sequential pass). The handlers decode buffers and attributes into the
// kernels' parameters, check what the kernels can take, and launch on XLA's stream, with no allocation
// (CUDA-graph compatible).
//
// Operands: q, k [batch, seq_len, heads, k_dim]; v [batch, seq_len, v_heads, v_dim] (bfloat16 or
// float16, one dtype); g float32 [batch, v_heads, seq_len]; cu_seqlens int32 [num_seqs + 1] (batch 1)
// or shape (0,); initial states float32 [num_seqs, v_heads, k_dim, v_dim] or shape (0,). Results: o
// (v's shape, q's dtype), final states float32 [num_seqs, v_heads, k_dim, v_dim], and for simple GLA
// the chunks' starting states for the backward ([state_slots, v_heads, k_dim, v_dim] in q's dtype; shape
// (0,): not kept). Attributes: scale, variant (the sm_90a kernel only). The gated delta rule's target
// takes beta (float32 [batch, v_heads, seq_len]) after g, and returns its workspaces after the final
// states: W [batch, seq_len, v_heads, k_dim] and U' (v's shape), in q's dtype. Simple GLA's backward
// takes q, k, v, g, cu_seqlens, the forward's chunk states, dout (v's shape) and the final states'
// cotangent (or shape (0,)), and returns dq and dk (float32 [batch, seq_len, v_heads, k_dim], one per
// value head), dv, dg (g's shape), the initial states' gradient and a workspace shaped as the states.
#include "ffi/common.h"
#include "linear_attention/linear_attention.h"

namespace jax_tk {
namespace {

using linear_attention::FwdParams;

// FwdParams from the operands both targets share.
ffi::Error parse_inputs(FwdParams &p, const ffi::AnyBuffer &q, const ffi::AnyBuffer &k, const ffi::AnyBuffer &v,
                        const ffi::AnyBuffer &g, const ffi::AnyBuffer &cu_seqlens, float scale, int32_t variant) {
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
  p.max_chunks = (p.seq_len + linear_attention::CHUNK - 1) / linear_attention::CHUNK;
  p.q = q.untyped_data(), p.k = k.untyped_data(), p.v = v.untyped_data();
  p.g = static_cast<const float *>(g.untyped_data());
  p.scale = scale;
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v)) return invalid("q, k and v must be 16-byte aligned");
  return ffi::Error::Success();
}

bool is_none(const ffi::AnyBuffer &x) { return x.dimensions().size() == 1 && x.dimensions()[0] == 0; }

// A float32 [num_seqs, v_heads, k_dim, v_dim] state (initial, final, or a cotangent), or shape (0,)
// where `optional` (then nullptr).
template <typename B> ffi::Error state_of(const FwdParams &p, B &s, const char *what, bool optional, float *&out) {
  out = nullptr;
  if (optional && is_none(s)) return ffi::Error::Success();
  auto sd = s.dimensions();
  if (s.element_type() != ffi::DataType::F32 || sd.size() != 4 || sd[0] != p.num_seqs || sd[1] != p.v_heads ||
      sd[2] != p.k_dim || sd[3] != p.v_dim)
    return invalid(std::string(what) + " must be float32 [num_seqs, v_heads, k_dim, v_dim]");
  out = static_cast<float *>(const_cast<void *>(s.untyped_data()));
  return ffi::Error::Success();
}

// The chunks' states, [state_slots, v_heads, k_dim, v_dim] in q's dtype, or shape (0,) where optional.
template <typename B> ffi::Error chunk_states_of(const FwdParams &p, B &s, bool optional, void *&out) {
  out = nullptr;
  if (optional && is_none(s)) return ffi::Error::Success();
  auto sd = s.dimensions();
  const int slots = linear_attention::state_slots(p.batch, p.seq_len, p.num_seqs, p.cu_seqlens != nullptr);
  if (s.element_type() != (p.dtype == linear_attention::DType::bf16 ? ffi::DataType::BF16 : ffi::DataType::F16) ||
      sd.size() != 4 || sd[0] != slots || sd[1] != p.v_heads || sd[2] != p.k_dim || sd[3] != p.v_dim)
    return invalid("the chunks' states must be [" + std::to_string(slots) + ", v_heads, k_dim, v_dim] in q's dtype");
  out = const_cast<void *>(s.untyped_data());
  return ffi::Error::Success();
}

// The forward's operands and results: parse_inputs, then the initial states, o and the final states.
ffi::Error parse(FwdParams &p, const ffi::AnyBuffer &q, const ffi::AnyBuffer &k, const ffi::AnyBuffer &v, const ffi::AnyBuffer &g,
                 const ffi::AnyBuffer &cu_seqlens, const ffi::AnyBuffer &h0, ffi::AnyBuffer &o, ffi::AnyBuffer &ht, float scale,
                 int32_t variant) {
  if (auto e = parse_inputs(p, q, k, v, g, cu_seqlens, scale, variant); e.failure()) return e;
  float *h0p = nullptr;
  if (auto e = state_of(p, h0, "initial states", true, h0p); e.failure()) return e;
  p.h0 = h0p;
  if (o.element_type() != q.element_type() || !same_dims(o, v)) return invalid("o must have v's shape and q's dtype");
  if (auto e = state_of(p, ht, "final states", false, p.ht); e.failure()) return e;
  p.o = o.untyped_data();
  return ffi::Error::Success();
}

template <typename... Extra>
ffi::Error gla_fwd_impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer g,
                        ffi::AnyBuffer cu_seqlens, ffi::AnyBuffer h0, Extra..., ffi::Result<ffi::AnyBuffer> o,
                        ffi::Result<ffi::AnyBuffer> ht, ffi::Result<ffi::AnyBuffer> states, float scale, int32_t variant) {
  FwdParams p{};
  if (auto e = parse(p, q, k, v, g, cu_seqlens, h0, *o, *ht, scale, variant); e.failure()) return e;
  if (auto e = chunk_states_of(p, *states, true, p.states); e.failure()) return e;
  return cuda_error(linear_attention::simple_gla_fwd_sm90(p, stream), "simple GLA forward");
}

template <typename... Extra>
ffi::Error gla_bwd_impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer g,
                        ffi::AnyBuffer cu_seqlens, ffi::AnyBuffer states, ffi::AnyBuffer dout, ffi::AnyBuffer dht, Extra...,
                        ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                        ffi::Result<ffi::AnyBuffer> dg, ffi::Result<ffi::AnyBuffer> dh0, ffi::Result<ffi::AnyBuffer> dstates,
                        float scale, int32_t variant) {
  linear_attention::BwdParams p{};
  FwdParams &f = p.f;
  if (auto e = parse_inputs(f, q, k, v, g, cu_seqlens, scale, variant); e.failure()) return e;
  if (auto e = chunk_states_of(f, states, false, f.states); e.failure()) return e;
  if (auto e = chunk_states_of(f, *dstates, false, p.dstates); e.failure()) return e;
  if (!same_type_and_dims(dout, v) || !aligned16(dout.untyped_data())) return invalid("dout must be like v (16-byte aligned)");
  float *dht_p = nullptr;
  if (auto e = state_of(f, dht, "the final states' cotangent", true, dht_p); e.failure()) return e;
  if (auto e = state_of(f, *dh0, "the initial states' gradient", false, p.dh0); e.failure()) return e;
  auto per_value_head = [&](const auto &x) {  // float32 [batch, seq_len, v_heads, k_dim]
    auto d = x.dimensions();
    return x.element_type() == ffi::DataType::F32 && d.size() == 4 && d[0] == f.batch && d[1] == f.seq_len && d[2] == f.v_heads &&
           d[3] == f.k_dim;
  };
  if (!per_value_head(*dq) || !per_value_head(*dk)) return invalid("dq and dk must be float32 [batch, seq_len, v_heads, k_dim]");
  if (!same_type_and_dims(*dv, v)) return invalid("dv must be like v");
  if (!same_type_and_dims(*dg, g)) return invalid("dg must be like g");
  p.dout = dout.untyped_data(), p.dht = dht_p;
  p.dq = static_cast<float *>(dq->untyped_data()), p.dk = static_cast<float *>(dk->untyped_data());
  p.dv = dv->untyped_data(), p.dg = static_cast<float *>(dg->untyped_data());
  return cuda_error(linear_attention::simple_gla_bwd_sm90(p, stream), "simple GLA backward");
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
    else return std::move(r).template Ret<ffi::AnyBuffer>().template Attr<float>("scale").template Attr<int32_t>("variant");  // states
  };
  return bind<TEST>(head, tail);
}
template <bool TEST> auto gla_binding() { return binding<TEST, false>(); }
template <bool TEST> auto gdr_binding() { return binding<TEST, true>(); }
// Simple GLA's backward: q, k, v, g, cu_seqlens, the chunks' states, dout, dht (or (0,)) -> dq, dk, dv,
// dg, dh0, the chunks' dS' (workspace), then the attributes.
template <bool TEST> auto gla_bwd_binding() {
  auto head = [] {
    auto b = ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                 .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>();
    return std::move(b).Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>();
  };
  auto tail = [](auto &&b) {
    auto r = std::move(b).template Ret<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>();
    return std::move(r).template Ret<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>()
        .template Attr<float>("scale").template Attr<int32_t>("variant");
  };
  return bind<TEST>(head, tail);
}

}  // namespace

namespace linear_attention {
FfiTargets ffi_targets();
}

JAX_TK_DEFINE_HANDLERS(GlaFwd, gla_fwd_impl, gla_binding);
JAX_TK_DEFINE_HANDLERS(GdrFwd, gdr_fwd_impl, gdr_binding);
JAX_TK_DEFINE_HANDLERS(GlaBwd, gla_bwd_impl, gla_bwd_binding);

FfiTargets linear_attention::ffi_targets() {  // (declared by cc/module.cc)
  return {{"jax_tk_simple_gla_fwd", reinterpret_cast<void *>(GlaFwd)},
          {"jax_tk_simple_gla_fwd_test", reinterpret_cast<void *>(GlaFwdTest)},
          {"jax_tk_gated_delta_rule_fwd", reinterpret_cast<void *>(GdrFwd)},
          {"jax_tk_gated_delta_rule_fwd_test", reinterpret_cast<void *>(GdrFwdTest)},
          {"jax_tk_simple_gla_bwd", reinterpret_cast<void *>(GlaBwd)},
          {"jax_tk_simple_gla_bwd_test", reinterpret_cast<void *>(GlaBwdTest)}};
}

}  // namespace jax_tk
