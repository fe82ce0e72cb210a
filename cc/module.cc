// The nanobind module jax_tk._tk, built on every install (jax_tk/_core/extension.py reads it):
//   contract() -> {op: {constant: value}}: every op's contract list (cc/<op>/<op>.h), and "core"'s;
//   jax_tk._tk.<op>.<formula>(...): the formulas Python needs (workspace sizes, block counts);
//   registrations() -> {FFI target name: capsule}: the kernels' handlers ({} in a build without CUDA);
//   archs() -> the GPU architectures compiled for, e.g. "80,90a" ("" without the kernels).
// Built without CUDA (JAX_TK_WITH_CUDA undefined) it needs only a C++ compiler: the contracts and
// formulas still serve programs lowered for CUDA on a machine without one.
#include <nanobind/nanobind.h>

#include "attention/attention.h"
#include "core/core.h"
#include "decode/decode.h"
#include "gemm/gemm.h"
#include "linear_attention/linear_attention.h"

namespace nb = nanobind;

#ifndef JAX_TK_ARCHS  // (set by CMakeLists.txt from JAX_TK_CUDA_ARCHS in a build with the kernels)
#define JAX_TK_ARCHS ""
#endif

// The ops, one entry each (and each one's header included above): (its namespace, the prefix of its
// header's lists).
#define JAX_TK_OPS(op) op(attention, ATTENTION) op(decode, DECODE) op(gemm, GEMM) op(linear_attention, LINEAR_ATTENTION)

#ifdef JAX_TK_WITH_CUDA
#include "ffi/common.h"
#define JAX_TK_DECLARE_TARGETS(name, NAME) \
  namespace jax_tk::name {                 \
  FfiTargets ffi_targets();                \
  }
JAX_TK_OPS(JAX_TK_DECLARE_TARGETS)
#undef JAX_TK_DECLARE_TARGETS
#endif

// {op: {constant: value}} from every header's contract list, and jax_tk._tk.<op>.<formula> from its
// formula list (the lists' format: cc/core/core.h).
#define JAX_TK_TABLE_ENTRY(NAME, VALUE) table[#NAME] = NAME;
#define JAX_TK_TABLE(name, NAME)                 \
  {                                              \
    using namespace jax_tk::name;                \
    nb::dict table;                              \
    JAX_TK_##NAME##_CONTRACT(JAX_TK_TABLE_ENTRY) \
    d[#name] = table;                            \
  }
static nb::dict contracts() {
  nb::dict d;
  JAX_TK_TABLE(core, CORE)
  JAX_TK_OPS(JAX_TK_TABLE)
  return d;
}

#define JAX_TK_DEF_FORMULA(fn) sub.def(#fn, &fn);
#define JAX_TK_FORMULAS(name, NAME)                              \
  {                                                              \
    using namespace jax_tk::name;                                \
    [[maybe_unused]] nb::module_ sub = m.def_submodule(#name);   \
    JAX_TK_##NAME##_FORMULAS(JAX_TK_DEF_FORMULA)                 \
  }

NB_MODULE(_tk, m) {
  JAX_TK_OPS(JAX_TK_FORMULAS)
  m.def("contract", &contracts);
  m.def("archs", []() { return nb::str(JAX_TK_ARCHS); });
  m.def("registrations", []() {
    nb::dict d;
#ifdef JAX_TK_WITH_CUDA
#define JAX_TK_REGISTER(name, NAME) \
  for (const auto &[target, handler] : jax_tk::name::ffi_targets()) d[target] = nb::capsule(handler);
    JAX_TK_OPS(JAX_TK_REGISTER)
#undef JAX_TK_REGISTER
#endif
    return d;
  });
}
