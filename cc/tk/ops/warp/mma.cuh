// Warp matrix products on mma.sync m16n8k16: bf16/fp16 inputs, fp32 accumulation.
//   mma_AB  (D, A row [M x K], B col [K x N], C)   D = A B + C
//   mma_ABt (D, A row [M x K], B row [N x K], C)   D = A B^T + C
//   mma_AtB (D, A col [K x M], B col [K x N], C)   D = A^T B + C
//   mma_AtBt(D, A col [K x M], B row [N x K], C)   D = A^T B^T + C
// D and C are fp32 row-layout tiles and may be the same tile.
#pragma once
#include "../../types/rt.cuh"

namespace tk::warp {

template <typename T>
__device__ __forceinline__ void mma16816(float2 &d0, float2 &d1, const packed<T> (&a)[4], packed<T> b0,
                                         packed<T> b1, float2 c0, float2 c1) {
  const uint32_t *A = reinterpret_cast<const uint32_t *>(a);
  uint32_t B0 = *reinterpret_cast<uint32_t *>(&b0), B1 = *reinterpret_cast<uint32_t *>(&b1);
  if constexpr (std::is_same_v<T, bf16>)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
                 : "=f"(d0.x), "=f"(d0.y), "=f"(d1.x), "=f"(d1.y)
                 : "r"(A[0]), "r"(A[1]), "r"(A[2]), "r"(A[3]), "r"(B0), "r"(B1), "f"(c0.x), "f"(c0.y), "f"(c1.x), "f"(c1.y));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
                 : "=f"(d0.x), "=f"(d0.y), "=f"(d1.x), "=f"(d1.y)
                 : "r"(A[0]), "r"(A[1]), "r"(A[2]), "r"(A[3]), "r"(B0), "r"(B1), "f"(c0.x), "f"(c0.y), "f"(c1.x), "f"(c1.y));
}

// One 16x16x16 step: d += a b^T, with a the row-layout piece of A and b the row-layout piece of B^T.
template <typename T>
__device__ __forceinline__ void mma_piece(rt_base<float, row_l> &d, const rt_base<T, row_l> &a, const rt_base<T, row_l> &b) {
  mma16816<T>(d.data[0], d.data[1], a.data, b.data[0], b.data[2], d.data[0], d.data[1]);  // columns 0-7
  mma16816<T>(d.data[2], d.data[3], a.data, b.data[1], b.data[3], d.data[2], d.data[3]);  // columns 8-15
}
// A col-layout piece holds the registers of the row-layout piece of its transpose.
template <typename T, typename L> __device__ __forceinline__ const rt_base<T, row_l> &as_row(const rt_base<T, L> &p) {
  return reinterpret_cast<const rt_base<T, row_l> &>(p);
}

// Shared driver: a(m, k) and b(n, k) return the pieces of A (M x K) and B^T (N x K).
template <int M, int N, int K, typename D, typename C, typename GetA, typename GetB>
__device__ __forceinline__ void mma_driver(D &d, const C &c, GetA a, GetB b) {
  static_assert(std::is_same_v<typename D::dtype, float> && std::is_same_v<typename D::layout, row_l>);
  static_assert(D::height == M && D::width == N && C::height == M && C::width == N);
#pragma unroll
  for (int m = 0; m < M; m++)
#pragma unroll
    for (int n = 0; n < N; n++) {
      if (static_cast<const void *>(&d) != static_cast<const void *>(&c)) d.tiles[m][n] = c.tiles[m][n];
#pragma unroll
      for (int k = 0; k < K; k++) mma_piece(d.tiles[m][n], a(m, k), b(n, k));
    }
}

template <RegisterTile D, RegisterTile A, RegisterTile B, RegisterTile C>
__device__ __forceinline__ void mma_AB(D &d, const A &a, const B &b, const C &c) {
  static_assert(std::is_same_v<typename A::layout, row_l> && std::is_same_v<typename B::layout, col_l>);
  static_assert(A::width == B::height);
  mma_driver<A::height, B::width, A::width>(d, c, [&](int m, int k) -> auto & { return a.tiles[m][k]; },
                                            [&](int n, int k) -> auto & { return as_row(b.tiles[k][n]); });
}
template <RegisterTile D, RegisterTile A, RegisterTile B, RegisterTile C>
__device__ __forceinline__ void mma_ABt(D &d, const A &a, const B &b, const C &c) {
  static_assert(std::is_same_v<typename A::layout, row_l> && std::is_same_v<typename B::layout, row_l>);
  static_assert(A::width == B::width);
  mma_driver<A::height, B::height, A::width>(d, c, [&](int m, int k) -> auto & { return a.tiles[m][k]; },
                                             [&](int n, int k) -> auto & { return b.tiles[n][k]; });
}
template <RegisterTile D, RegisterTile A, RegisterTile B, RegisterTile C>
__device__ __forceinline__ void mma_AtB(D &d, const A &a, const B &b, const C &c) {
  static_assert(std::is_same_v<typename A::layout, col_l> && std::is_same_v<typename B::layout, col_l>);
  static_assert(A::height == B::height);
  mma_driver<A::width, B::width, A::height>(d, c, [&](int m, int k) -> auto & { return as_row(a.tiles[k][m]); },
                                            [&](int n, int k) -> auto & { return as_row(b.tiles[k][n]); });
}
template <RegisterTile D, RegisterTile A, RegisterTile B, RegisterTile C>
__device__ __forceinline__ void mma_AtBt(D &d, const A &a, const B &b, const C &c) {
  static_assert(std::is_same_v<typename A::layout, col_l> && std::is_same_v<typename B::layout, row_l>);
  static_assert(A::height == B::width);
  mma_driver<A::width, B::height, A::height>(d, c, [&](int m, int k) -> auto & { return as_row(a.tiles[k][m]); },
                                             [&](int n, int k) -> auto & { return b.tiles[n][k]; });
}

}  // namespace tk::warp
