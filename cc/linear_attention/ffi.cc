// The linear-attention ops' FFI targets on Hopper: simple GLA's forward (jax_tk_simple_gla_fwd) and
// backward (jax_tk_simple_gla_bwd), and the gated delta rule's (jax_tk_gated_delta_rule_fwd: wy_fwd's
// solve, then the sequential pass; jax_tk_gated_delta_rule_bwd). The handlers decode buffers and
// attributes into the kernels' parameters, check what the kernels can take, and launch on XLA's
// stream, with no allocation (CUDA-graph compatible).
//
// Operands: q, k [batch, seq_len, heads, k_dim]; v [batch, seq_len, v_heads, v_dim] (bfloat16 or
// float16, one dtype); g float32 [batch, v_heads, seq_len]; cu_seqlens int32 [num_seqs + 1] (batch 1)
// or shape (0,); initial states float32 [num_seqs, v_heads, k_dim, v_dim] or shape (0,). Results: o
// (v's shape, q's dtype), final states float32 [num_seqs, v_heads, k_dim, v_dim], and what the
// backward needs, kept where given a buffer (shape (0,): not kept): the chunks' starting states
// ([state_slots, v_heads, k_dim, v_dim] in q's dtype). Attributes: scale, variant (the sm_90a kernel
// only). The gated delta rule's forward takes beta (float32 [batch, v_heads, seq_len]) after g and
// returns the solve's T ([batch, seq_len, v_heads, CHUNK], q's dtype: a workspace where not kept) after
// the final states, then W [batch, seq_len, v_heads, k_dim], the states and U (v's shape) to keep.
// The backwards take the forward's inputs (beta after g), what it kept, dout (v's shape) and the final
// states' cotangent (or shape (0,)), and return dq and dk (float32 [batch, seq_len, v_heads, k_dim], one
// per value head; or, where heads == v_heads, like q), dv, dg (g's shape), [dbeta,] the initial states'
// gradient and workspaces (the chunks' dS', and the gated delta rule's dU).
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

// The backward's operands both ops share, and its results but dbeta (and the gated delta rule's).
ffi::Error parse_bwd(linear_attention::BwdParams &p, const ffi::AnyBuffer &q, const ffi::AnyBuffer &k, const ffi::AnyBuffer &v,
                     const ffi::AnyBuffer &g, const ffi::AnyBuffer &cu_seqlens, const ffi::AnyBuffer &states,
                     const ffi::AnyBuffer &dout, const ffi::AnyBuffer &dht, ffi::AnyBuffer &dq, ffi::AnyBuffer &dk, ffi::AnyBuffer &dv,
                     ffi::AnyBuffer &dg, ffi::AnyBuffer &dh0, ffi::AnyBuffer &dstates, float scale, int32_t variant) {
  FwdParams &f = p.f;
  if (auto e = parse_inputs(f, q, k, v, g, cu_seqlens, scale, variant); e.failure()) return e;
  if (auto e = chunk_states_of(f, states, false, f.states); e.failure()) return e;
  if (auto e = chunk_states_of(f, dstates, false, p.dstates); e.failure()) return e;
  if (!same_type_and_dims(dout, v) || !aligned16(dout.untyped_data())) return invalid("dout must be like v (16-byte aligned)");
  float *dht_p = nullptr;
  if (auto e = state_of(f, dht, "the final states' cotangent", true, dht_p); e.failure()) return e;
  if (auto e = state_of(f, dh0, "the initial states' gradient", false, p.dh0); e.failure()) return e;
  auto per_value_head = [&](const auto &x) {  // float32 [batch, seq_len, v_heads, k_dim]
    auto d = x.dimensions();
    return x.element_type() == ffi::DataType::F32 && d.size() == 4 && d[0] == f.batch && d[1] == f.seq_len && d[2] == f.v_heads &&
           d[3] == f.k_dim;
  };
  p.dqk_f32 = per_value_head(dq) && per_value_head(dk);
  if (!p.dqk_f32 && !(f.heads == f.v_heads && same_type_and_dims(dq, q) && same_type_and_dims(dk, q)))
    return invalid("dq and dk must be float32 [batch, seq_len, v_heads, k_dim], or like q where heads == v_heads");
  if (!same_type_and_dims(dv, v)) return invalid("dv must be like v");
  if (!same_type_and_dims(dg, g)) return invalid("dg must be like g");
  p.dout = dout.untyped_data(), p.dht = dht_p;
  p.dq = dq.untyped_data(), p.dk = dk.untyped_data();
  p.dv = dv.untyped_data(), p.dg = static_cast<float *>(dg.untyped_data());
  return ffi::Error::Success();
}

template <typename... Extra>
ffi::Error gla_bwd_impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer g,
                        ffi::AnyBuffer cu_seqlens, ffi::AnyBuffer states, ffi::AnyBuffer dout, ffi::AnyBuffer dht, Extra...,
                        ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                        ffi::Result<ffi::AnyBuffer> dg, ffi::Result<ffi::AnyBuffer> dh0, ffi::Result<ffi::AnyBuffer> dstates,
                        float scale, int32_t variant) {
  linear_attention::BwdParams p{};
  if (auto e = parse_bwd(p, q, k, v, g, cu_seqlens, states, dout, dht, *dq, *dk, *dv, *dg, *dh0, *dstates, scale, variant);
      e.failure())
    return e;
  return cuda_error(linear_attention::simple_gla_bwd_sm90(p, stream), "simple GLA backward");
}

// A [batch, seq_len, v_heads, d] buffer in q's dtype (d = 0: v's), or shape (0,) where optional (nullptr).
template <typename B> ffi::Error rows_of(const FwdParams &p, B &x, int d, const char *what, bool optional, void *&out) {
  out = nullptr;
  if (optional && is_none(x)) return ffi::Error::Success();
  auto xd = x.dimensions();
  const bool dtype_ok = x.element_type() == (p.dtype == linear_attention::DType::bf16 ? ffi::DataType::BF16 : ffi::DataType::F16);
  if (!dtype_ok || xd.size() != 4 || xd[0] != p.batch || xd[1] != p.seq_len || xd[2] != p.v_heads || xd[3] != (d ? d : p.v_dim))
    return invalid(std::string(what) + " must be [batch, seq_len, v_heads, " + (d ? std::to_string(d) : "v_dim") + "] in q's dtype");
  out = const_cast<void *>(x.untyped_data());
  return ffi::Error::Success();
}

template <typename... Extra>
ffi::Error gdr_fwd_impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer g,
                        ffi::AnyBuffer beta, ffi::AnyBuffer cu_seqlens, ffi::AnyBuffer h0, Extra..., ffi::Result<ffi::AnyBuffer> o,
                        ffi::Result<ffi::AnyBuffer> ht, ffi::Result<ffi::AnyBuffer> tk, ffi::Result<ffi::AnyBuffer> w,
                        ffi::Result<ffi::AnyBuffer> states, ffi::Result<ffi::AnyBuffer> uk, float scale, int32_t variant) {
  FwdParams p{};
  if (auto e = parse(p, q, k, v, g, cu_seqlens, h0, *o, *ht, scale, variant); e.failure()) return e;
  if (!same_type_and_dims(beta, g)) return invalid("beta must be float32 [batch, v_heads, seq_len], as g");
  void *tp, *wp;
  if (auto e = rows_of(p, *tk, linear_attention::CHUNK, "t", false, tp); e.failure()) return e;
  if (auto e = rows_of(p, *w, p.k_dim, "the kept W", true, wp); e.failure()) return e;
  if (auto e = chunk_states_of(p, *states, true, p.states); e.failure()) return e;
  if (auto e = rows_of(p, *uk, 0, "the kept U", true, p.uk); e.failure()) return e;
  if ((p.states != nullptr) != (p.uk != nullptr) || (p.uk != nullptr) != (wp != nullptr))
    return invalid("the states, U and W are kept together or not at all");
  p.beta = static_cast<const float *>(beta.untyped_data()), p.t = tp;
  linear_attention::WyParams wy{p.dtype, p.batch, p.seq_len, p.heads, p.v_heads, p.k_dim, p.num_seqs, p.max_chunks,
                                p.k, p.g, p.beta, p.cu_seqlens, tp, wp};
  if (auto e = cuda_error(linear_attention::wy_fwd(wy, stream), "gated delta rule (solve)"); e.failure()) return e;
  return cuda_error(linear_attention::gdr_fwd_sm90(p, stream), "gated delta rule forward");
}

// The gated delta rule's backward: the forward's inputs (q, k normalized where asked), its kept states,
// W, U and T, dout and dht -> dq, dk (float32 per value head), dv, dg, dbeta, dh0, then two workspaces
// (the chunks' dS', dU).
template <typename... Extra>
ffi::Error gdr_bwd_impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer g,
                        ffi::AnyBuffer beta, ffi::AnyBuffer cu_seqlens, ffi::AnyBuffer states, ffi::AnyBuffer w, ffi::AnyBuffer uk,
                        ffi::AnyBuffer tk, ffi::AnyBuffer dout, ffi::AnyBuffer dht, Extra..., ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dg,
                        ffi::Result<ffi::AnyBuffer> dbeta, ffi::Result<ffi::AnyBuffer> dh0, ffi::Result<ffi::AnyBuffer> dstates,
                        ffi::Result<ffi::AnyBuffer> du, float scale, int32_t variant) {
  linear_attention::BwdParams p{};
  if (auto e = parse_bwd(p, q, k, v, g, cu_seqlens, states, dout, dht, *dq, *dk, *dv, *dg, *dh0, *dstates, scale, variant);
      e.failure())
    return e;
  void *wp, *up, *tp;
  if (auto e = rows_of(p.f, w, p.f.k_dim, "w", false, wp); e.failure()) return e;
  if (auto e = rows_of(p.f, uk, 0, "the kept U", false, up); e.failure()) return e;
  if (auto e = rows_of(p.f, tk, linear_attention::CHUNK, "the kept T", false, tp); e.failure()) return e;
  if (auto e = rows_of(p.f, *du, 0, "du", false, p.du); e.failure()) return e;
  if (!same_type_and_dims(beta, g) || !same_type_and_dims(*dbeta, g)) return invalid("beta and dbeta must be like g");
  p.f.w = wp, p.f.u = up, p.f.t = tp;
  p.f.beta = static_cast<const float *>(beta.untyped_data()), p.dbeta = static_cast<float *>(dbeta->untyped_data());
  if (auto e = cuda_error(linear_attention::bwd_state_pass_sm90(p, stream), "gated delta rule backward (state)"); e.failure())
    return e;
  return cuda_error(linear_attention::gdr_bwd_chunks_sm90(p, stream), "gated delta rule backward (chunks)");
}

// Bindings: ARGS buffers, RETS results (both >= 1), then the attributes scale and variant. (Each step
// returns the chain's prvalue: a Binding cannot be moved.)
template <int N, typename B> auto with_args(B &&b) {
  if constexpr (N == 1) return std::move(b).template Arg<ffi::AnyBuffer>();
  else return with_args<N - 1>(std::move(b).template Arg<ffi::AnyBuffer>());
}
template <int N, typename B> auto with_rets(B &&b) {
  if constexpr (N == 1) return std::move(b).template Ret<ffi::AnyBuffer>();
  else return with_rets<N - 1>(std::move(b).template Ret<ffi::AnyBuffer>());
}
template <bool TEST, int ARGS, int RETS> auto binding() {
  auto head = [] { return with_args<ARGS>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()); };
  auto tail = [](auto &&b) { return with_rets<RETS>(std::move(b)).template Attr<float>("scale").template Attr<int32_t>("variant"); };
  return bind<TEST>(head, tail);
}
template <bool TEST> auto gla_binding() { return binding<TEST, 6, 3>(); }
template <bool TEST> auto gdr_binding() { return binding<TEST, 7, 6>(); }
template <bool TEST> auto gla_bwd_binding() { return binding<TEST, 8, 6>(); }
template <bool TEST> auto gdr_bwd_binding() { return binding<TEST, 12, 8>(); }

}  // namespace

namespace linear_attention {
FfiTargets ffi_targets();
}

JAX_TK_DEFINE_HANDLERS(GlaFwd, gla_fwd_impl, gla_binding);
JAX_TK_DEFINE_HANDLERS(GdrFwd, gdr_fwd_impl, gdr_binding);
JAX_TK_DEFINE_HANDLERS(GlaBwd, gla_bwd_impl, gla_bwd_binding);
JAX_TK_DEFINE_HANDLERS(GdrBwd, gdr_bwd_impl, gdr_bwd_binding);

FfiTargets linear_attention::ffi_targets() {  // (declared by cc/module.cc)
  return {{"jax_tk_simple_gla_fwd", reinterpret_cast<void *>(GlaFwd)},
          {"jax_tk_simple_gla_fwd_test", reinterpret_cast<void *>(GlaFwdTest)},
          {"jax_tk_gated_delta_rule_fwd", reinterpret_cast<void *>(GdrFwd)},
          {"jax_tk_gated_delta_rule_fwd_test", reinterpret_cast<void *>(GdrFwdTest)},
          {"jax_tk_simple_gla_bwd", reinterpret_cast<void *>(GlaBwd)},
          {"jax_tk_simple_gla_bwd_test", reinterpret_cast<void *>(GlaBwdTest)},
          {"jax_tk_gated_delta_rule_bwd", reinterpret_cast<void *>(GdrBwd)},
          {"jax_tk_gated_delta_rule_bwd_test", reinterpret_cast<void *>(GdrBwdTest)}};
}

}  // namespace jax_tk
