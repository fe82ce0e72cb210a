// Small helpers for the FFI handlers: errors, shape checks, and which kernels a call runs.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "core/core.h"
#include "xla/ffi/api/ffi.h"

namespace jax_tk {

namespace ffi = xla::ffi;

// An op's FFI targets, which cc/module.cc registers (jax_tk/_core/extension.py hands them to XLA):
// jax_tk::<op>::ffi_targets() in cc/<op>/ffi.cc. (The op's contract constants and formulas come from
// its header: cc/core/core.h.)
using FfiTargets = std::vector<std::pair<const char *, void *>>;  // FFI target name, XLA_FFI_Handler*

inline ffi::Error invalid(const std::string &msg) { return ffi::Error::InvalidArgument("jax_tk: " + msg); }

inline ffi::Error cuda_error(cudaError_t e, const char *what) {
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_tk: ") + what + ": " + cudaGetErrorString(e));
}

template <typename A, typename B> bool same_dims(const A &a, const B &b) {
  auto x = a.dimensions(), y = b.dimensions();
  if (x.size() != y.size()) return false;
  for (size_t i = 0; i < x.size(); i++)
    if (x[i] != y[i]) return false;
  return true;
}
// The same dimensions but the last (which may differ).
template <typename A, typename B> bool same_lead_dims(const A &a, const B &b) {
  auto x = a.dimensions(), y = b.dimensions();
  if (x.size() != y.size() || x.size() == 0) return false;
  for (size_t i = 0; i + 1 < x.size(); i++)
    if (x[i] != y[i]) return false;
  return true;
}
template <typename A, typename B> bool same_type_and_dims(const A &a, const B &b) {
  return a.element_type() == b.element_type() && same_dims(a, b);
}
inline bool dims_are(const ffi::AnyBuffer &x, std::initializer_list<int64_t> want) {
  auto d = x.dimensions();
  if (d.size() != want.size()) return false;
  for (size_t i = 0; i < want.size(); i++)
    if (d[i] != want.begin()[i]) return false;
  return true;
}
inline bool aligned16(const void *p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// The kernels a call runs, from the device and the call's `variant` attribute (cc/core/core.h's
// VARIANT_*). The one place of the rule (jax_tk/_core/extension.py's kernels_run_on and
// takes_sm90_kernels say the same in Python): every kernel needs compute capability 8.0 or newer, and
// the sm_90a kernels run at 9.0 exactly (sm_90a code runs on no other GPU), for VARIANT_AUTO only.
struct Kernels {
  bool sm90 = false;        // the sm_90a kernels (else the mma.sync ones)
  bool small_smem = false;  // keep to the shared memory of sm_86 / sm_89 GPUs (VARIANT_SM86)
};
inline ffi::Error pick_kernels(int32_t variant, Kernels &k) {
  if (variant != core::VARIANT_AUTO && variant != core::VARIANT_SM80 && variant != core::VARIANT_SM86)
    return invalid("unknown kernel variant " + std::to_string(variant));
  int dev = 0, major = 0, minor = 0;
  if (auto e = cudaGetDevice(&dev); e != cudaSuccess) return cuda_error(e, "cudaGetDevice");
  if (auto e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev); e != cudaSuccess)
    return cuda_error(e, "cudaDeviceGetAttribute");
  if (auto e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev); e != cudaSuccess)
    return cuda_error(e, "cudaDeviceGetAttribute");
  if (major < 8)
    return invalid("the kernels need compute capability 8.0 or newer, the device has " + std::to_string(major) + "." +
                   std::to_string(minor));
  k.sm90 = variant == core::VARIANT_AUTO && major == 9 && minor == 0;
  k.small_smem = variant == core::VARIANT_SM86;
  return ffi::Error::Success();
}

// A handler's production and test bindings from one operand list: head() returns the binding up to
// the operands, tail(binding) adds the results and attributes; the test target (TEST) takes
// RemainingArgs between them (buffers that tests alias to the outputs to poison them). (A Binding
// cannot be moved into a variable: the chain is built from prvalues.)
template <bool TEST> auto bind(auto head, auto tail) {
  if constexpr (TEST) return tail(head().RemainingArgs());
  else return tail(head());
}

// The two handler symbols of one handler template IMPL<Extra...> and binding BINDING<TEST>(): NAME, the
// production target, and NAME##Test, the test target (Extra = RemainingArgs, see bind). Both are
// CUDA-graph compatible: handlers allocate nothing and never synchronize with the host.
#define JAX_TK_DEFINE_HANDLERS(NAME, IMPL, BINDING)                                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, IMPL<>, BINDING<false>(), {::xla::ffi::Traits::kCmdBufferCompatible}); \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME##Test, IMPL<::xla::ffi::RemainingArgs>, BINDING<true>(),           \
                                {::xla::ffi::Traits::kCmdBufferCompatible})

}  // namespace jax_tk
