// jax_tk._tk_tests: FFI targets that run single tile-language operations, for the unit tests.
#include <nanobind/nanobind.h>

#include "ffi/common.h"
#include "tests/tile_ops.h"

namespace nb = nanobind;

namespace jax_tk::tests {
namespace {

ffi::Error tile_op_impl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Buffer<ffi::F32> v,
                        ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> vec, int32_t op, int32_t layout,
                        float param) {
  TileOpArgs x{};
  auto t = a.element_type();
  x.dtype = t == ffi::DataType::F32 ? 0 : t == ffi::DataType::BF16 ? 1 : t == ffi::DataType::F16 ? 2 : -1;
  if (x.dtype < 0 || !same_type_and_dims(a, b)) return invalid("tile_op: a and b must be f32/bf16/f16 of one shape");
  auto d = a.dimensions();
  if (d.size() != 2 || !same_dims(a, *out) || v.element_count() != 64 || vec->element_count() != 64)
    return invalid("tile_op: a, b, out must be [rows, cols]; v and vec [64]");
  x.op = op; x.layout = layout; x.param = param;
  x.rows = int(d[0]); x.cols = int(d[1]);
  x.a = a.untyped_data(); x.b = b.untyped_data(); x.v = v.typed_data();
  x.out = out->typed_data(); x.vec = vec->typed_data();
  return cuda_error(launch_tile_op(x, stream), "tile_op");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TileOp, tile_op_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("op")
                                  .Attr<int32_t>("layout")
                                  .Attr<float>("param"));

}  // namespace jax_tk::tests

NB_MODULE(_tk_tests, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jax_tk_test_tile_op"] = nb::capsule(reinterpret_cast<void *>(jax_tk::tests::TileOp));
    return d;
  });
}
