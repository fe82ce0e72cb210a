// Small helpers for the FFI handlers: errors, shape checks, the device's compute capability.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jax_tk {

namespace ffi = xla::ffi;

// What an op gives cc/module.cc: its FFI targets and its contract constants (cc/<op>/<op>.h), which
// jax_tk/_core/extension.py registers and reads.
struct OpExports {
  const char *op;
  std::vector<std::pair<const char *, void *>> targets;  // FFI target name, XLA_FFI_Handler*
  std::vector<std::pair<const char *, int>> constants;
};

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
template <typename A, typename B> bool same_type_and_dims(const A &a, const B &b) {
  return a.element_type() == b.element_type() && same_dims(a, b);
}
inline bool aligned16(const void *p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// The current device must have compute capability >= major.minor.
inline ffi::Error check_device(int major, int minor) {
  int dev = 0, ma = 0, mi = 0;
  if (auto e = cudaGetDevice(&dev); e != cudaSuccess) return cuda_error(e, "cudaGetDevice");
  cudaDeviceGetAttribute(&ma, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&mi, cudaDevAttrComputeCapabilityMinor, dev);
  if (ma * 10 + mi < major * 10 + minor)
    return invalid("this kernel needs compute capability " + std::to_string(major) + "." + std::to_string(minor) +
                   " or newer, the device has " + std::to_string(ma) + "." + std::to_string(mi));
  return ffi::Error::Success();
}

// Whether the current device runs the sm_90a kernels: compute capability 9.0 exactly (sm_90a code runs
// there only). `variant_env`, when set to "sm80" in the environment, keeps the mma.sync kernels on every
// GPU (to test them on Hopper).
inline bool use_sm90(const char *variant_env = nullptr) {
  if (const char *v = variant_env ? std::getenv(variant_env) : nullptr; v && std::string(v) == "sm80") return false;
  int dev = 0, major = 0, minor = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  return major == 9 && minor == 0;
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
