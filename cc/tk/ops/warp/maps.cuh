// Elementwise work on register tiles: fills, copies with casts, unary and binary maps, and
// broadcasts of a vector along rows (..._row: one value per row) or columns (..._col).
// Everything computes in fp32 and rounds to the destination type.
#pragma once
#include "../../types/rt.cuh"
#include "../../types/rv.cuh"

namespace tk::warp {

namespace fn {
__device__ __forceinline__ float exp2(float x) {  // ex2.approx: exact at -inf (-> 0), ~2 ulp
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float exp(float x) { return exp2(x * 1.4426950408889634f); }
__device__ __forceinline__ float log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float log(float x) { return log2(x) * 0.6931471805599453f; }
}  // namespace fn

// dst(e) = f(src(e)) for every element, in float.
template <RegisterTile D, RegisterTile S, typename F>
__device__ __forceinline__ void map(D &dst, const S &src, F f) {
  static_assert(D::rows == S::rows && D::cols == S::cols && std::is_same_v<typename D::layout, typename S::layout>);
#pragma unroll
  for (int i = 0; i < D::height; i++)
#pragma unroll
    for (int j = 0; j < D::width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        float2 v = to_float2(src.tiles[i][j].data[k]);
        dst.tiles[i][j].data[k] = from_float2<packed<typename D::dtype>>(float2{f(v.x), f(v.y)});
      }
}
// dst(e) = f(a(e), b(e)).
template <RegisterTile D, RegisterTile A, RegisterTile B, typename F>
__device__ __forceinline__ void map(D &dst, const A &a, const B &b, F f) {
  static_assert(D::rows == A::rows && D::cols == A::cols && A::rows == B::rows && A::cols == B::cols);
  static_assert(std::is_same_v<typename D::layout, typename A::layout> && std::is_same_v<typename A::layout, typename B::layout>);
#pragma unroll
  for (int i = 0; i < D::height; i++)
#pragma unroll
    for (int j = 0; j < D::width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        float2 x = to_float2(a.tiles[i][j].data[k]), y = to_float2(b.tiles[i][j].data[k]);
        dst.tiles[i][j].data[k] = from_float2<packed<typename D::dtype>>(float2{f(x.x, y.x), f(x.y, y.y)});
      }
}
// dst(e) = f(row, col, src(e)) with the element's position in the tile.
template <RegisterTile D, RegisterTile S, typename F>
__device__ __forceinline__ void map_indexed(D &dst, const S &src, F f) {
#pragma unroll
  for (int i = 0; i < D::height; i++)
#pragma unroll
    for (int j = 0; j < D::width; j++)
#pragma unroll
      for (int e = 0; e < 8; e++)
        dst.set(i, j, e, f(S::row_of(i, e), S::col_of(j, e), src.get(i, j, e)));
}
// dst(r, c) = f(src(r, c), v[r])  (vector along rows)   /   f(src(r, c), v[c])  (along columns)
template <RegisterTile D, RegisterTile S, typename V, typename F>
__device__ __forceinline__ void map_row(D &dst, const S &src, const V &v, F f) {
  static_assert(std::is_same_v<V, col_vec<S>>, "map_row takes the tile's col_vec (one value per row)");
#pragma unroll
  for (int i = 0; i < D::height; i++)
#pragma unroll
    for (int j = 0; j < D::width; j++)
#pragma unroll
      for (int e = 0; e < 8; e++)
        dst.set(i, j, e, f(src.get(i, j, e), v.data[i][row_slot<typename S::layout>(e)]));
}
template <RegisterTile D, RegisterTile S, typename V, typename F>
__device__ __forceinline__ void map_col(D &dst, const S &src, const V &v, F f) {
  static_assert(std::is_same_v<V, row_vec<S>>, "map_col takes the tile's row_vec (one value per column)");
#pragma unroll
  for (int i = 0; i < D::height; i++)
#pragma unroll
    for (int j = 0; j < D::width; j++)
#pragma unroll
      for (int e = 0; e < 8; e++)
        dst.set(i, j, e, f(src.get(i, j, e), v.data[j][col_slot<typename S::layout>(e)]));
}

// dst(r, c) = f(src(r, c), rows[r], cols[c]): rows and cols are vectors of any element type laid
// out like the tile's col_vec and row_vec (e.g. integer ids of the rows and columns).
template <RegisterTile D, RegisterTile S, typename RV, typename CV, typename F>
__device__ __forceinline__ void map_outer(D &dst, const S &src, const RV &rows, const CV &cols, F f) {
  static_assert(std::is_same_v<typename RV::layout, typename col_vec<S>::layout> && RV::length == S::rows);
  static_assert(std::is_same_v<typename CV::layout, typename row_vec<S>::layout> && CV::length == S::cols);
#pragma unroll
  for (int i = 0; i < D::height; i++)
#pragma unroll
    for (int j = 0; j < D::width; j++)
#pragma unroll
      for (int e = 0; e < 8; e++)
        dst.set(i, j, e, f(src.get(i, j, e), rows.data[i][row_slot<typename S::layout>(e)],
                           cols.data[j][col_slot<typename S::layout>(e)]));
}

// Fills and copies.
template <RegisterTile D> __device__ __forceinline__ void fill(D &dst, float x) { map(dst, dst, [x](float) { return x; }); }
template <RegisterTile D> __device__ __forceinline__ void zero(D &dst) { fill(dst, 0.f); }
template <RegisterTile D, RegisterTile S> __device__ __forceinline__ void copy(D &dst, const S &src) {
  map(dst, src, [](float x) { return x; });
}
template <typename V> __device__ __forceinline__ void fill_vec(V &v, float x) {
#pragma unroll
  for (int i = 0; i < V::pieces; i++)
#pragma unroll
    for (int k = 0; k < V::per; k++) v.data[i][k] = x;
}

// v[x] = f(x) for every index x of the vector (this lane's slots).
template <typename V, typename F> __device__ __forceinline__ void map_index(V &v, F f) {
#pragma unroll
  for (int i = 0; i < V::pieces; i++)
#pragma unroll
    for (int k = 0; k < V::per; k++) v.data[i][k] = f(V::index_of(i, k));
}
// Vector maps: dst[i] = f(a[i]) and dst[i] = f(a[i], b[i]).
template <typename V, typename F> __device__ __forceinline__ void map_vec(V &dst, const V &a, F f) {
#pragma unroll
  for (int i = 0; i < V::pieces; i++)
#pragma unroll
    for (int k = 0; k < V::per; k++) dst.data[i][k] = f(a.data[i][k]);
}
template <typename V, typename F> __device__ __forceinline__ void map_vec(V &dst, const V &a, const V &b, F f) {
#pragma unroll
  for (int i = 0; i < V::pieces; i++)
#pragma unroll
    for (int k = 0; k < V::per; k++) dst.data[i][k] = f(a.data[i][k], b.data[i][k]);
}

// Named unary maps.
#define TK_UNARY(name, expr)                                                                         \
  template <RegisterTile D, RegisterTile S> __device__ __forceinline__ void name(D &dst, const S &src) { \
    map(dst, src, [](float x) { return expr; });                                                      \
  }
TK_UNARY(exp, fn::exp(x))
TK_UNARY(exp2, fn::exp2(x))
TK_UNARY(log, fn::log(x))
TK_UNARY(log2, fn::log2(x))
TK_UNARY(abs, fabsf(x))
TK_UNARY(neg, -x)
#undef TK_UNARY

// Named binary maps: tile (op) tile, tile (op) scalar, tile (op) vector per row / per column.
#define TK_BINARY(name, expr)                                                                               \
  template <RegisterTile D, RegisterTile A, RegisterTile B>                                                 \
  __device__ __forceinline__ void name(D &dst, const A &a, const B &b) {                                   \
    map(dst, a, b, [](float x, float y) { return expr; });                                                 \
  }                                                                                                          \
  template <RegisterTile D, RegisterTile A> __device__ __forceinline__ void name(D &dst, const A &a, float y) { \
    map(dst, a, [y](float x) { return expr; });                                                            \
  }                                                                                                          \
  template <RegisterTile D, RegisterTile A, typename V>                                                     \
  __device__ __forceinline__ void name##_row(D &dst, const A &a, const V &v) {                             \
    map_row(dst, a, v, [](float x, float y) { return expr; });                                             \
  }                                                                                                          \
  template <RegisterTile D, RegisterTile A, typename V>                                                     \
  __device__ __forceinline__ void name##_col(D &dst, const A &a, const V &v) {                             \
    map_col(dst, a, v, [](float x, float y) { return expr; });                                             \
  }
TK_BINARY(add, x + y)
TK_BINARY(sub, x - y)
TK_BINARY(mul, x * y)
TK_BINARY(div, x / y)
TK_BINARY(max, fmaxf(x, y))
TK_BINARY(min, fminf(x, y))
#undef TK_BINARY

}  // namespace tk::warp
