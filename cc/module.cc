// The nanobind module jax_tk._tk: registrations() -> {FFI target name: capsule}, contract() ->
// {op: {constant: value}} of every op and archs() -> the GPU architectures compiled for, e.g. "80,90a"
// (jax_tk/_core/extension.py reads them).
#include <nanobind/nanobind.h>

#include "ffi/common.h"

namespace nb = nanobind;

#ifndef JAX_TK_ARCHS  // (set by CMakeLists.txt from JAX_TK_CUDA_ARCHS)
#define JAX_TK_ARCHS "80,90a"
#endif

// The ops: one entry each. cc/<op>/ffi.cc defines jax_tk::<op>::exports().
#define JAX_TK_OPS(op) op(attention) op(decode) op(gemm)

#define JAX_TK_DECLARE(name) \
  namespace jax_tk::name {   \
  OpExports exports();       \
  }
JAX_TK_OPS(JAX_TK_DECLARE)
#undef JAX_TK_DECLARE

static std::vector<jax_tk::OpExports> ops() {
#define JAX_TK_EXPORTS(name) jax_tk::name::exports(),
  return {JAX_TK_OPS(JAX_TK_EXPORTS)};
#undef JAX_TK_EXPORTS
}

NB_MODULE(_tk, m) {
  m.def("registrations", []() {
    nb::dict d;
    for (const auto &op : ops())
      for (const auto &[name, handler] : op.targets) d[name] = nb::capsule(handler);
    return d;
  });
  m.def("archs", []() { return nb::str(JAX_TK_ARCHS); });
  m.def("contract", []() {
    nb::dict d;
    for (const auto &op : ops()) {
      nb::dict c;
      for (const auto &[name, value] : op.constants) c[name] = value;
      d[op.op] = c;
    }
    return d;
  });
}
