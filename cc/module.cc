// The nanobind module jax_tk._tk: registrations() -> {FFI target name: capsule}.
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

namespace jax_tk {
extern "C" {
XLA_FFI_Error *AttentionFwd(XLA_FFI_CallFrame *);
XLA_FFI_Error *AttentionBwd(XLA_FFI_CallFrame *);
}
}  // namespace jax_tk

template <typename F> nb::capsule capsule(F *fn) { return nb::capsule(reinterpret_cast<void *>(fn)); }

NB_MODULE(_tk, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jax_tk_attention_fwd"] = capsule(jax_tk::AttentionFwd);
    d["jax_tk_attention_bwd"] = capsule(jax_tk::AttentionBwd);
    return d;
  });
}
