// jax_tk._tk_tests: FFI targets that run single tile-language operations, for the unit tests.
#include <nanobind/nanobind.h>

#include "ffi/common.h"
#include "tests/hopper_ops.h"
#include "tests/tile_ops.h"

namespace nb = nanobind;

namespace jax_tk::tests {
namespace {

// Every case writes its outputs over aliased initial values (input_output_aliases): NaN poison, so that
// an element an operation fails to write cannot pass as a value left by an earlier case (for the Hopper
// reduce-add, the values it adds to).
ffi::Error check_aliased(const ffi::AnyBuffer &init, const void *out, const char *what) {
  if (init.untyped_data() != out)
    return invalid(std::string(what) + ": the output must be aliased to its initial value");
  return ffi::Error::Success();
}

ffi::Error tile_op_impl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Buffer<ffi::F32> v,
                        ffi::AnyBuffer out_init, ffi::AnyBuffer vec_init, ffi::ResultBuffer<ffi::F32> out,
                        ffi::ResultBuffer<ffi::F32> vec, int32_t op, int32_t layout, float param) {
  TileOpArgs x{};
  auto t = a.element_type();
  x.dtype = t == ffi::DataType::F32 ? 0 : t == ffi::DataType::BF16 ? 1 : t == ffi::DataType::F16 ? 2 : -1;
  if (x.dtype < 0 || !same_type_and_dims(a, b)) return invalid("tile_op: a and b must be f32/bf16/f16 of one shape");
  auto d = a.dimensions();
  if (d.size() != 2 || !same_dims(a, *out) || v.element_count() != 64 || vec->element_count() != 64)
    return invalid("tile_op: a, b, out must be [rows, cols]; v and vec [64]");
  if (auto e = check_aliased(out_init, out->untyped_data(), "tile_op out"); e.failure()) return e;
  if (auto e = check_aliased(vec_init, vec->untyped_data(), "tile_op vec"); e.failure()) return e;
  x.op = op; x.layout = layout; x.param = param;
  x.rows = int(d[0]); x.cols = int(d[1]);
  x.a = a.untyped_data(); x.b = b.untyped_data(); x.v = v.typed_data();
  x.out = out->typed_data(); x.vec = vec->typed_data();
  return cuda_error(launch_tile_op(x, stream), "tile_op");
}

bool elem_of(ffi::DataType t, Elem &e) {
  if (t == ffi::DataType::BF16) e = Elem::bf16;
  else if (t == ffi::DataType::F16) e = Elem::fp16;
  else return false;
  return true;
}

ffi::Error tma_load_impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer init, ffi::Result<ffi::AnyBuffer> out,
                         int32_t b, int32_t s0, int32_t h) {
  TmaLoadArgs a{};
  auto d = x.dimensions(), o = out->dimensions();
  if (!elem_of(x.element_type(), a.dtype) || d.size() != 4)
    return invalid("hopper tma_load: x must be a bf16/f16 [batch, seq, heads, dim] array");
  a.batch = int(d[0]); a.seq = int(d[1]); a.heads = int(d[2]); a.dim = int(d[3]);
  if (out->element_type() != x.element_type() || o.size() != 2 || o[1] != d[3] || (o[0] != 64 && o[0] != 128) ||
      (a.dim != 64 && a.dim != 128))
    return invalid("hopper tma_load: out must be [64 or 128, dim] of x's dtype, dim 64 or 128");
  if (b < 0 || b >= a.batch || h < 0 || h >= a.heads) return invalid("hopper tma_load: b or h out of range");
  if (auto e = check_aliased(init, out->untyped_data(), "hopper tma_load"); e.failure()) return e;
  a.rows = int(o[0]); a.b = b; a.s0 = s0; a.h = h;
  a.x = x.untyped_data(); a.out = out->untyped_data();
  return cuda_error(launch_tma_load(a, stream), "hopper tma_load");
}

ffi::Error wgmma_impl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Buffer<ffi::F32> c,
                      ffi::AnyBuffer init, ffi::ResultBuffer<ffi::F32> out, int32_t product, int32_t k,
                      int32_t accumulate, int32_t fragments) {
  WgmmaArgs x{};
  auto da = a.dimensions(), db = b.dimensions(), dc = c.dimensions();
  const bool fp8 = a.element_type() == ffi::DataType::F8E4M3FN;
  if (fp8) x.dtype = Elem::fp8e4m3;
  if (!(fp8 || elem_of(a.element_type(), x.dtype)) || b.element_type() != a.element_type() || da.size() != 2 ||
      db.size() != 2)
    return invalid("hopper wgmma: a and b must be 2-D bf16/f16/float8_e4m3fn arrays of one dtype");
  if (dc.size() != 2 || dc[0] != 64 || !same_dims(c, *out)) return invalid("hopper wgmma: c and out must be [64, n]");
  x.product = product; x.n = int(dc[1]); x.k = k;
  x.a_rows = int(da[0]); x.a_cols = int(da[1]); x.b_rows = int(db[0]); x.b_cols = int(db[1]);
  if (fragments < 0 || fragments > 2) return invalid("hopper wgmma: fragments must be 0, 1 or 2");
  if (!has_wgmma_case(x)) return invalid("hopper wgmma: not one of the compiled cases (TK_WGMMA_CASES in hopper_ops.cu)");
  if (auto e = check_aliased(init, out->untyped_data(), "hopper wgmma"); e.failure()) return e;
  x.a = a.untyped_data(); x.b = b.untyped_data(); x.c = c.typed_data();
  x.accumulate = accumulate != 0; x.fragments = fragments; x.out = out->typed_data();
  return cuda_error(launch_wgmma(x, stream), "hopper wgmma");
}

ffi::Error reduce_add_impl(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer init,
                           ffi::ResultBuffer<ffi::F32> out) {
  auto d = x.dimensions(), o = out->dimensions();
  if (d.size() != 4 || d[2] != 64 || d[3] != 64 || d[0] < 1 || d[1] < 1 || o.size() != 2 || o[0] != 64 || o[1] != 64)
    return invalid("hopper reduce_add: x must be [blocks, rounds, 64, 64] and out [64, 64]");
  if (auto e = check_aliased(init, out->untyped_data(), "hopper reduce_add"); e.failure()) return e;
  ReduceAddArgs a{x.typed_data(), int(d[0]), int(d[1]), out->typed_data()};
  return cuda_error(launch_reduce_add(a, stream), "hopper reduce_add");
}

ffi::Error ring_impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> w, ffi::AnyBuffer init,
                     ffi::ResultBuffer<ffi::F32> out, int32_t b, int32_t h, int32_t n_tiles) {
  RingArgs a{};
  auto d = x.dimensions(), o = out->dimensions();
  if (!elem_of(x.element_type(), a.dtype) || d.size() != 4 || (d[3] != 64 && d[3] != 128))
    return invalid("hopper ring: x must be a bf16/f16 [batch, seq, heads, 64 or 128] array");
  a.batch = int(d[0]); a.seq = int(d[1]); a.heads = int(d[2]); a.dim = int(d[3]);
  if (o.size() != 2 || o[0] != 128 || o[1] != d[3]) return invalid("hopper ring: out must be [128, dim]");
  if (b < 0 || b >= a.batch || h < 0 || h >= a.heads) return invalid("hopper ring: b or h out of range");
  if (n_tiles < 1 || int64_t(n_tiles - 1) * 128 >= a.seq)
    return invalid("hopper ring: n_tiles must be >= 1, every tile starting inside the sequence");
  if (w.element_count() != size_t(n_tiles) * 128) return invalid("hopper ring: w must have n_tiles * 128 elements");
  if (auto e = check_aliased(init, out->untyped_data(), "hopper ring"); e.failure()) return e;
  a.b = b; a.h = h; a.n_tiles = n_tiles;
  a.x = x.untyped_data(); a.w = w.typed_data(); a.out = out->typed_data();
  return cuda_error(launch_ring(a, stream), "hopper ring");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HopperTmaLoad, tma_load_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // out's initial value
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("b")
                                  .Attr<int32_t>("s0")
                                  .Attr<int32_t>("h"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HopperWgmma, wgmma_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // a
                                  .Arg<ffi::AnyBuffer>()         // b
                                  .Arg<ffi::Buffer<ffi::F32>>()  // c
                                  .Arg<ffi::AnyBuffer>()         // out's initial value
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("product")
                                  .Attr<int32_t>("k")
                                  .Attr<int32_t>("accumulate")
                                  .Attr<int32_t>("fragments"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HopperReduceAdd, reduce_add_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::AnyBuffer>()         // out's initial value
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HopperRing, ring_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Arg<ffi::AnyBuffer>()         // out's initial value
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("b")
                                  .Attr<int32_t>("h")
                                  .Attr<int32_t>("n_tiles"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TileOp, tile_op_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()  // out's initial value
                                  .Arg<ffi::AnyBuffer>()  // vec's initial value
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
    d["jax_tk_test_hopper_tma_load"] = nb::capsule(reinterpret_cast<void *>(jax_tk::tests::HopperTmaLoad));
    d["jax_tk_test_hopper_wgmma"] = nb::capsule(reinterpret_cast<void *>(jax_tk::tests::HopperWgmma));
    d["jax_tk_test_hopper_reduce_add"] = nb::capsule(reinterpret_cast<void *>(jax_tk::tests::HopperReduceAdd));
    d["jax_tk_test_hopper_ring"] = nb::capsule(reinterpret_cast<void *>(jax_tk::tests::HopperRing));
    return d;
  });
}
