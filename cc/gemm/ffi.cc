// XLA FFI handler of the grouped GEMM (the contract is at the top of cc/gemm/gemm.h): decode the
// buffers and attributes into Params, reject what the kernels cannot take, launch on XLA's stream.
// No allocation; calls with an empty output return at once, calls whose output is all zeros (k = 0,
// no groups, no rows to contract) clear it with a memset.
#include <algorithm>
#include <climits>
#include <string>

#include "ffi/common.h"
#include "gemm/gemm.h"

namespace jax_tk {
namespace {

using gemm::Params;

std::string dims_of(const ffi::AnyBuffer &x) {
  std::string s;
  for (auto d : x.dimensions()) s += std::to_string(d) + ", ";
  return "[" + s.substr(0, s.size() >= 2 ? s.size() - 2 : 0) + "]";
}

// Extra... is empty in the production target; the test target takes ffi::RemainingArgs there (the
// buffers that tests alias to the output to poison it), ignored here.
template <typename... Extra>
ffi::Error ragged_impl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer group_sizes, Extra...,
                       ffi::Result<ffi::AnyBuffer> out, int32_t mode, int32_t b_transposed, int32_t variant) {
  Params p{};
  if (a.element_type() != b.element_type()) return invalid("gemm: a and b must have the same dtype");
  if (a.element_type() == ffi::DataType::BF16) p.dtype = gemm::DType::bf16;
  else if (a.element_type() == ffi::DataType::F16) p.dtype = gemm::DType::fp16;
  else return invalid("gemm: a and b must be bfloat16 or float16");
  if (out->element_type() == ffi::DataType::F32) p.out_f32 = true;
  else if (out->element_type() != a.element_type()) return invalid("gemm: out must have the inputs' dtype or be float32");
  if (mode != gemm::MODE_RAGGED && mode != gemm::MODE_CONTRACT && mode != gemm::MODE_SPLIT_K)
    return invalid("gemm: mode must be 0 (ragged), 1 (contract) or 2 (split k)");
  if (b_transposed != 0 && b_transposed != 1) return invalid("gemm: b_transposed must be 0 or 1");
  const bool split = mode == gemm::MODE_SPLIT_K;  // (MODE_RAGGED's kernel, a's columns split among the groups)
  p.mode = split ? gemm::MODE_RAGGED : mode;
  p.b_transposed = b_transposed != 0;
  if (group_sizes.element_type() != ffi::DataType::S32 || group_sizes.dimensions().size() != 1)
    return invalid("gemm: group_sizes must be a one-dimensional int32 array");
  const bool contract_bt = mode == gemm::MODE_CONTRACT && p.b_transposed;
  if (a.dimensions().size() != 2) return invalid(std::string("gemm: a must be ") + (contract_bt ? "[k, m]" : "[m, k]") + ", got " + dims_of(a));
  int64_t m = a.dimensions()[contract_bt ? 1 : 0], k = a.dimensions()[contract_bt ? 0 : 1], n = 0;
  const int64_t g = group_sizes.dimensions()[0];
  if (split) {  // (a [rows, g k]: m = g rows rows of k; b [g, k, n], or transposed [n, g k])
    auto bd = b.dimensions();
    const bool ok = p.b_transposed ? bd.size() == 2 && bd[1] == a.dimensions()[1] && g > 0 && bd[1] % g == 0
                                   : bd.size() == 3 && bd[0] == g && a.dimensions()[1] == g * bd[1];
    if (!ok)
      return invalid("gemm: in mode 2, b must be " + std::string(p.b_transposed ? "[n, g * k]" : "[g, k, n]") +
                     " with a [rows, g * k] = " + dims_of(a) + " and g = " + std::to_string(g) + " groups, got " + dims_of(b));
    m = g * a.dimensions()[0];
    k = p.b_transposed ? bd[1] / g : bd[1];
    n = p.b_transposed ? bd[0] : bd[2];
    if (!dims_are(*out, {m, n}))
      return invalid("gemm: in mode 2, out must be [g * rows, n] = [" + std::to_string(m) + ", " + std::to_string(n) + "]");
    p.a_split = int(std::max<int64_t>(g, 1));
  } else if (mode == gemm::MODE_RAGGED) {
    auto bd = b.dimensions();
    if (bd.size() != 3 || bd[0] != g || bd[p.b_transposed ? 2 : 1] != k)
      return invalid("gemm: b must be " + std::string(p.b_transposed ? "[g, n, k]" : "[g, k, n]") + " with a [m, k] = " +
                     dims_of(a) + " and g = " + std::to_string(g) + " groups, got " + dims_of(b));
    n = bd[p.b_transposed ? 1 : 2];
    if (!dims_are(*out, {m, n})) return invalid("gemm: out must be [m, n] = [" + std::to_string(m) + ", " + std::to_string(n) + "]");
  } else {  // (mode 1: b [m, n], or [n, m] with a [k, m])
    if (b.dimensions().size() != 2 || b.dimensions()[contract_bt ? 1 : 0] != m)
      return invalid(std::string("gemm: in mode 1, b must be ") + (contract_bt ? "[n, m] with a [k, m] = " : "[m, n] with a [m, k] = ") +
                     dims_of(a) + ", got " + dims_of(b));
    n = b.dimensions()[contract_bt ? 0 : 1];
    if (!dims_are(*out, {g, k, n}))
      return invalid("gemm: in mode 1, out must be [g, k, n] = [" + std::to_string(g) + ", " + std::to_string(k) + ", " +
                     std::to_string(n) + "]");
    if (contract_bt && m % gemm::DIM_MULTIPLE != 0)
      return invalid("gemm: in mode 1 with b_transposed, m must be a multiple of " + std::to_string(gemm::DIM_MULTIPLE) +
                     ", got " + std::to_string(m));
  }
  for (auto d : {m, k, n, g})
    if (d > core::MAX_INDEX) return invalid("gemm: every dimension must be below 2^31");
  if (k % gemm::DIM_MULTIPLE != 0 || n % gemm::DIM_MULTIPLE != 0)
    return invalid("gemm: k and n must be multiples of " + std::to_string(gemm::DIM_MULTIPLE) + ", got k = " +
                   std::to_string(k) + ", n = " + std::to_string(n));
  p.m = int(m); p.k = int(k); p.n = int(n); p.groups = int(g);
  p.a = a.untyped_data(); p.b = b.untyped_data(); p.out = out->untyped_data();
  p.group_sizes = static_cast<const int *>(group_sizes.untyped_data());
  if (!aligned16(p.a) || !aligned16(p.b) || !aligned16(p.out)) return invalid("gemm: a, b and out must be 16-byte aligned");
  if (gemm::tile_bound(p, gemm::SM80_TILE_M, gemm::SM80_TILE_N) >= INT_MAX / 2 ||
      gemm::tile_bound(p, gemm::SM90_TILE_M, gemm::SM90_TILE_N) >= INT_MAX / 2)
    return invalid("gemm: too many output tiles (more than 2^30)");
  Kernels kernels;
  if (auto e = pick_kernels(variant, kernels); e.failure()) return e;

  const size_t out_bytes = size_t(out->element_count()) * (p.out_f32 ? 4 : 2);
  if (out_bytes == 0) return ffi::Error::Success();
  if (k == 0 || g == 0 || m == 0)  // (mode 0: k = 0 or no groups; mode 1: no rows) out is all zeros
    return cuda_error(cudaMemsetAsync(p.out, 0, out_bytes, stream), "gemm: clearing out");
  if (kernels.sm90) return cuda_error(gemm::ragged_sm90(p, stream), "gemm (sm_90a)");
  if (contract_bt || split)
    return invalid(std::string("gemm: ") + (split ? "mode 2" : "mode 1 with b_transposed") + " runs on the sm_90a kernel (H100/H200) only");
  return cuda_error(gemm::ragged_sm80(p, stream), "gemm");
}

// FP8 with block scales, both operands float8_e4m3fn and K-major; out bfloat16 or float32; group_sizes
// int32 [g]. Hopper only.
// Mode ragged (jax_tk_gemm_fp8): a [m, k], its scales float32 [ceil(k/128), m] (1 x 128 blocks,
// k-block major), b [g, n, k], its scales [g, ceil(k/128), ceil(n/128)]; out [m, n].
// Mode contract (jax_tk_gemm_fp8_contract; the weights' gradient): a [k, m] and b [n, m] (a's and b's
// rows transposed, m a multiple of 16), a's scales [ceil(m/128), k] (1 x 128 blocks along m), b's
// [ceil(m/128), ceil(n/128)] (128 x 128 blocks); out [g, k, n], out[i] = a[:, rows_i] @ b[:, rows_i]^T.
// Rows past the groups must hold finite values (the kernel multiplies them by zeros).

// The checks both modes share; p's dtype, out_f32 and group_sizes.
ffi::Error fp8_common(Params &p, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer group_sizes, ffi::AnyBuffer &out) {
  p.dtype = gemm::DType::fp8e4m3;
  if (a.element_type() != ffi::DataType::F8E4M3FN || b.element_type() != ffi::DataType::F8E4M3FN)
    return invalid("gemm fp8: a and b must be float8_e4m3fn");
  if (out.element_type() == ffi::DataType::F32) p.out_f32 = true;
  else if (out.element_type() != ffi::DataType::BF16) return invalid("gemm fp8: out must be bfloat16 or float32");
  if (group_sizes.element_type() != ffi::DataType::S32 || group_sizes.dimensions().size() != 1)
    return invalid("gemm fp8: group_sizes must be a one-dimensional int32 array");
  if (a.dimensions().size() != 2) return invalid("gemm fp8: a must have rank 2, got " + dims_of(a));
  p.group_sizes = static_cast<const int *>(group_sizes.untyped_data());
  return ffi::Error::Success();
}

// The shared tail: dimension limits, pointers, alignment, then the kernel (or zeros).
ffi::Error fp8_run(Params &p, int64_t m, int64_t k, int64_t n, int64_t g, ffi::AnyBuffer a, ffi::AnyBuffer a_scales,
                   ffi::AnyBuffer b, ffi::AnyBuffer b_scales, ffi::AnyBuffer &out, int32_t variant, cudaStream_t stream) {
  for (auto d : {m, k, n, g})
    if (d > core::MAX_INDEX) return invalid("gemm fp8: every dimension must be below 2^31");
  p.m = int(m); p.k = int(k); p.n = int(n); p.groups = int(g);
  p.a = a.untyped_data(); p.b = b.untyped_data(); p.out = out.untyped_data();
  p.a_scales = static_cast<const float *>(a_scales.untyped_data());
  p.b_scales = static_cast<const float *>(b_scales.untyped_data());
  if (!aligned16(p.a) || !aligned16(p.b) || !aligned16(p.out)) return invalid("gemm fp8: a, b and out must be 16-byte aligned");
  if (gemm::tile_bound(p, gemm::SM90_TILE_M, gemm::FP8_BLOCK) >= INT_MAX / 2) return invalid("gemm fp8: too many output tiles");
  Kernels kernels;
  if (auto e = pick_kernels(variant, kernels); e.failure()) return e;
  if (!kernels.sm90) return invalid("gemm fp8: the FP8 kernel runs on H100/H200 (sm_90a) only");
  const size_t out_bytes = size_t(out.element_count()) * (p.out_f32 ? 4 : 2);
  if (out_bytes == 0) return ffi::Error::Success();
  if (p.k == 0 || p.groups == 0 || p.m == 0) return cuda_error(cudaMemsetAsync(p.out, 0, out_bytes, stream), "gemm fp8: clearing out");
  return cuda_error(gemm::ragged_sm90(p, stream), "gemm fp8 (sm_90a)");
}

std::string shape(std::initializer_list<int64_t> dims) {
  std::string s = "[";
  for (auto d : dims) s += (s.size() > 1 ? ", " : "") + std::to_string(d);
  return s + "]";
}

template <typename... Extra>
ffi::Error fp8_impl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer a_scales, ffi::AnyBuffer b, ffi::AnyBuffer b_scales,
                    ffi::AnyBuffer group_sizes, Extra..., ffi::Result<ffi::AnyBuffer> out, int32_t variant) {
  Params p{};
  if (auto e = fp8_common(p, a, b, group_sizes, *out); e.failure()) return e;
  p.mode = gemm::MODE_RAGGED;
  p.b_transposed = true;
  const int64_t m = a.dimensions()[0], k = a.dimensions()[1], g = group_sizes.dimensions()[0];
  if (b.dimensions().size() != 3 || b.dimensions()[0] != g || b.dimensions()[2] != k)
    return invalid("gemm fp8: b must be [g, n, k] with a [m, k] = " + dims_of(a) + ", got " + dims_of(b));
  const int64_t n = b.dimensions()[1], B = gemm::FP8_BLOCK, kb = (k + B - 1) / B, nb = (n + B - 1) / B;
  if (a_scales.element_type() != ffi::DataType::F32 || !dims_are(a_scales, {kb, m}))
    return invalid("gemm fp8: a's scales must be float32 [ceil(k/128), m] = " + shape({kb, m}));
  if (b_scales.element_type() != ffi::DataType::F32 || !dims_are(b_scales, {g, kb, nb}))
    return invalid("gemm fp8: b's scales must be float32 [g, ceil(k/128), ceil(n/128)] = " + shape({g, kb, nb}));
  if (!dims_are(*out, {m, n})) return invalid("gemm fp8: out must be [m, n] = " + shape({m, n}));
  if (k % 16 != 0 || n % gemm::DIM_MULTIPLE != 0)  // (16-byte rows of a and b; of out)
    return invalid("gemm fp8: k must be a multiple of 16 and n of " + std::to_string(gemm::DIM_MULTIPLE) + ", got k = " +
                   std::to_string(k) + ", n = " + std::to_string(n));
  return fp8_run(p, m, k, n, g, a, a_scales, b, b_scales, *out, variant, stream);
}

template <typename... Extra>
ffi::Error fp8_contract_impl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer a_scales, ffi::AnyBuffer b,
                             ffi::AnyBuffer b_scales, ffi::AnyBuffer group_sizes, Extra..., ffi::Result<ffi::AnyBuffer> out,
                             int32_t variant) {
  Params p{};
  if (auto e = fp8_common(p, a, b, group_sizes, *out); e.failure()) return e;
  p.mode = gemm::MODE_CONTRACT;
  const int64_t k = a.dimensions()[0], m = a.dimensions()[1], g = group_sizes.dimensions()[0];
  if (b.dimensions().size() != 2 || b.dimensions()[1] != m)
    return invalid("gemm fp8 contract: b must be [n, m] with a [k, m] = " + dims_of(a) + ", got " + dims_of(b));
  const int64_t n = b.dimensions()[0], B = gemm::FP8_BLOCK, mb = (m + B - 1) / B, nb = (n + B - 1) / B;
  if (a_scales.element_type() != ffi::DataType::F32 || !dims_are(a_scales, {mb, k}))
    return invalid("gemm fp8 contract: a's scales must be float32 [ceil(m/128), k] = " + shape({mb, k}));
  if (b_scales.element_type() != ffi::DataType::F32 || !dims_are(b_scales, {mb, nb}))
    return invalid("gemm fp8 contract: b's scales must be float32 [ceil(m/128), ceil(n/128)] = " + shape({mb, nb}));
  if (!dims_are(*out, {g, k, n})) return invalid("gemm fp8 contract: out must be [g, k, n] = " + shape({g, k, n}));
  if (m % 16 != 0 || n % gemm::DIM_MULTIPLE != 0)  // (16-byte rows of a and b; of out)
    return invalid("gemm fp8 contract: m must be a multiple of 16 and n of " + std::to_string(gemm::DIM_MULTIPLE) +
                   ", got m = " + std::to_string(m) + ", n = " + std::to_string(n));
  return fp8_run(p, m, k, n, g, a, a_scales, b, b_scales, *out, variant, stream);
}

// FP8 block quantization (the contract: gemm.h's QuantParams). Operands x, x's scales (FP8 x only,
// else an empty array), the row limit (int32 [1], or empty: every row); results values and scales;
// attributes transposed and block_rows.
template <typename... Extra>
ffi::Error quantize_impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer x_scales, ffi::AnyBuffer row_limit,
                         Extra..., ffi::Result<ffi::AnyBuffer> values, ffi::Result<ffi::AnyBuffer> scales,
                         int32_t transposed, int32_t block_rows) {
  using In = gemm::QuantParams::In;
  gemm::QuantParams p{};
  switch (x.element_type()) {
    case ffi::DataType::BF16: p.in = In::bf16; break;
    case ffi::DataType::F16: p.in = In::fp16; break;
    case ffi::DataType::F32: p.in = In::f32; break;
    case ffi::DataType::F8E4M3FN: p.in = In::fp8e4m3; break;
    default: return invalid("fp8 quantize: x must be bfloat16, float16, float32 or float8_e4m3fn");
  }
  const auto xd = x.dimensions();
  const bool fp8_in = p.in == In::fp8e4m3;
  if (xd.size() != 2 && (xd.size() != 3 || fp8_in))
    return invalid("fp8 quantize: x must be [rows, cols], or [batch, rows, cols] and not FP8, got " + dims_of(x));
  if (transposed != 0 && transposed != 1) return invalid("fp8 quantize: transposed must be 0 or 1");
  if (block_rows != 1 && block_rows != gemm::FP8_BLOCK) return invalid("fp8 quantize: block_rows must be 1 or 128");
  const int64_t batch = xd.size() == 3 ? xd[0] : 1, rows = xd[xd.size() - 2], cols = xd[xd.size() - 1];
  const auto vd = values->dimensions();
  if (values->element_type() != ffi::DataType::F8E4M3FN || vd.size() != xd.size() || (xd.size() == 3 && vd[0] != batch))
    return invalid("fp8 quantize: values must be float8_e4m3fn of x's rank and batch, got " + dims_of(*values));
  const int64_t out_rows = vd[vd.size() - 2], out_cols = vd[vd.size() - 1];
  if (out_rows < (transposed ? cols : rows) || out_cols < (transposed ? rows : cols))
    return invalid("fp8 quantize: values " + dims_of(*values) + " cannot hold x " + dims_of(x) + (transposed ? " transposed" : ""));
  const int64_t B = gemm::FP8_BLOCK, rb = (out_rows + block_rows - 1) / block_rows, cb = (out_cols + B - 1) / B;
  const bool batched = xd.size() == 3;
  if (scales->element_type() != ffi::DataType::F32 || !(batched ? dims_are(*scales, {batch, rb, cb}) : dims_are(*scales, {rb, cb})))
    return invalid("fp8 quantize: scales must be float32 " + (batched ? shape({batch, rb, cb}) : shape({rb, cb})));
  if (fp8_in ? x_scales.element_type() != ffi::DataType::F32 || !dims_are(x_scales, {rows, (cols + B - 1) / B})
             : x_scales.element_count() != 0)
    return invalid("fp8 quantize: x's scales must be float32 [rows, ceil(cols/128)] for an FP8 x, else empty");
  if (row_limit.element_count() > 1 || (row_limit.element_count() == 1 && row_limit.element_type() != ffi::DataType::S32))
    return invalid("fp8 quantize: the row limit must be int32 [1], or empty");
  for (auto d : {batch, rows, cols, out_rows, out_cols})
    if (d > core::MAX_INDEX) return invalid("fp8 quantize: every dimension must be below 2^31");
  if (batch > 65535 || (out_rows + B - 1) / B > 65535) return invalid("fp8 quantize: too many rows or batch entries");
  p.x = x.untyped_data();
  p.x_scales = fp8_in ? static_cast<const float *>(x_scales.untyped_data()) : nullptr;
  p.row_limit = row_limit.element_count() ? static_cast<const int *>(row_limit.untyped_data()) : nullptr;
  p.batch = int(batch); p.rows = int(rows); p.cols = int(cols); p.out_rows = int(out_rows); p.out_cols = int(out_cols);
  p.transposed = transposed != 0;
  p.block_rows = block_rows;
  p.vector_loads = aligned16(p.x) && (cols * int64_t(ffi::ByteWidth(x.element_type()))) % 16 == 0;
  p.values = values->untyped_data();
  p.scales = static_cast<float *>(scales->untyped_data());
  if (values->element_count() == 0) return ffi::Error::Success();
  return cuda_error(gemm::quantize_fp8(p, stream), "fp8 quantize");
}

template <bool TEST> auto quantize_binding() {
  auto head = [] {
    return ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()   // x
        .Arg<ffi::AnyBuffer>()   // x's scales
        .Arg<ffi::AnyBuffer>();  // row limit
  };
  auto tail = [](auto &&x) {
    return std::move(x)
        .template Ret<ffi::AnyBuffer>()
        .template Ret<ffi::AnyBuffer>()
        .template Attr<int32_t>("transposed")
        .template Attr<int32_t>("block_rows");
  };
  return bind<TEST>(head, tail);
}

template <bool TEST> auto fp8_binding() {
  auto head = [] {
    return ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()   // a
        .Arg<ffi::AnyBuffer>()   // a's scales
        .Arg<ffi::AnyBuffer>()   // b
        .Arg<ffi::AnyBuffer>()   // b's scales
        .Arg<ffi::AnyBuffer>();  // group_sizes
  };
  auto tail = [](auto &&x) { return std::move(x).template Ret<ffi::AnyBuffer>().template Attr<int32_t>("variant"); };
  return bind<TEST>(head, tail);
}

// The bindings: operands, then (test target only) the remaining operands, then result and attributes.
// (A Binding cannot be moved into a variable: the chain is built from prvalues.)
template <bool TEST> auto ragged_binding() {
  auto head = [] {
    return ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()   // a
        .Arg<ffi::AnyBuffer>()   // b
        .Arg<ffi::AnyBuffer>();  // group_sizes
  };
  auto tail = [](auto &&x) {
    return std::move(x)
        .template Ret<ffi::AnyBuffer>()
        .template Attr<int32_t>("mode")
        .template Attr<int32_t>("b_transposed")
        .template Attr<int32_t>("variant");
  };
  return bind<TEST>(head, tail);
}

}  // namespace

namespace gemm {
FfiTargets ffi_targets();
}

JAX_TK_DEFINE_HANDLERS(GemmRagged, ragged_impl, ragged_binding);
JAX_TK_DEFINE_HANDLERS(GemmFp8, fp8_impl, fp8_binding);
JAX_TK_DEFINE_HANDLERS(GemmFp8Contract, fp8_contract_impl, fp8_binding);
JAX_TK_DEFINE_HANDLERS(Fp8Quantize, quantize_impl, quantize_binding);

FfiTargets gemm::ffi_targets() {  // (declared by cc/module.cc)
  return {{"jax_tk_gemm_ragged", reinterpret_cast<void *>(GemmRagged)},
          {"jax_tk_gemm_ragged_test", reinterpret_cast<void *>(GemmRaggedTest)},
          {"jax_tk_gemm_fp8", reinterpret_cast<void *>(GemmFp8)},
          {"jax_tk_gemm_fp8_test", reinterpret_cast<void *>(GemmFp8Test)},
          {"jax_tk_gemm_fp8_contract", reinterpret_cast<void *>(GemmFp8Contract)},
          {"jax_tk_gemm_fp8_contract_test", reinterpret_cast<void *>(GemmFp8ContractTest)},
          {"jax_tk_fp8_quantize", reinterpret_cast<void *>(Fp8Quantize)},
          {"jax_tk_fp8_quantize_test", reinterpret_cast<void *>(Fp8QuantizeTest)}};
}

}  // namespace jax_tk
