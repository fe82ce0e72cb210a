// warp::load / warp::store: register tiles and vectors to and from shared tiles, global views and
// plain pointers. 16-bit tiles come out of shared memory with ldmatrix (transposing for col_l).
#pragma once
#include "../../types/gl.cuh"
#include "../../types/rt.cuh"
#include "../../types/rv.cuh"
#include "../../types/st.cuh"
#include "../memory/cp_async.cuh"

namespace tk::warp {

__device__ __forceinline__ void ldmatrix_x4(packed<bf16> *d, uint32_t addr, bool trans) {
  uint32_t *r = reinterpret_cast<uint32_t *>(d);
  if (trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// stmatrix (sm_90): the inverse of ldmatrix_x4, with the same lane addresses and registers.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const packed<bf16> *d, bool trans) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t *r = reinterpret_cast<const uint32_t *>(d);
  if (trans)
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n"
                 :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
  else
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n"
                 :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
#endif
}

// f(i, j, addr, trans) for each 16 x 16 piece (i, j) of a 16-bit register tile RT placed at (row0,
// col0) of shared tile t: addr is what this lane gives ldmatrix / stmatrix x4 for the piece (row
// lane % 8 of 8x8 matrix lane / 8; the matrices are the piece's quarters in register order), trans
// whether they transpose (col_l).
template <RegisterTile RT, SharedTile ST, typename F>
__device__ __forceinline__ void for_each_piece_x4(const ST &t, int row0, int col0, F f) {
  constexpr bool trans = std::is_same_v<typename RT::layout, col_l>;
  const int lane = laneid(), m = lane / 8;
  const int r = (lane % 8) + 8 * (trans ? m / 2 : m % 2), c = 8 * (trans ? m % 2 : m / 2);
#pragma unroll
  for (int i = 0; i < RT::height; i++)
#pragma unroll
    for (int j = 0; j < RT::width; j++) f(i, j, smem_addr(&t(row0 + i * TILE + r, col0 + j * TILE + c)), trans);
}

// The same for a 16-bit row_l register tile RT that is the transpose of the region of t at (row0,
// col0): element (r, c) of RT is t(row0 + c, col0 + r). ldmatrix / stmatrix .trans then move it.
template <RegisterTile RT, SharedTile ST, typename F>
__device__ __forceinline__ void for_each_piece_x4_transposed(const ST &t, int row0, int col0, F f) {
  static_assert(std::is_same_v<typename RT::layout, row_l>);
  const int lane = laneid(), m = lane / 8;
  const int r = (lane % 8) + 8 * (m / 2), c = 8 * (m % 2);
#pragma unroll
  for (int i = 0; i < RT::height; i++)
#pragma unroll
    for (int j = 0; j < RT::width; j++) f(i, j, smem_addr(&t(row0 + j * TILE + r, col0 + i * TILE + c)));
}

// Visit every pair a lane holds: f(i, j, k, row, col) with (row, col) the pair's first element
// inside the tile; the second element is at (row, col+1) for row_l and (row+1, col) for col_l.
template <RegisterTile RT, typename F> __device__ __forceinline__ void for_each_pair(F f) {
  int lane = laneid();
#pragma unroll
  for (int i = 0; i < RT::height; i++)
#pragma unroll
    for (int j = 0; j < RT::width; j++)
#pragma unroll
      for (int k = 0; k < 4; k++)
        f(i, j, k, i * TILE + piece_row<typename RT::layout>(lane, 2 * k),
          j * TILE + piece_col<typename RT::layout>(lane, 2 * k));
}
template <RegisterTile RT> constexpr bool pair_along_row = std::is_same_v<typename RT::layout, row_l>;

// Shared tile (from (row0, col0)) -> register tile.
template <RegisterTile RT, SharedTile ST>
__device__ __forceinline__ void load(RT &dst, const ST &src, int row0 = 0, int col0 = 0) {
  using T = typename RT::dtype;
  if constexpr (is_16bit<T> && std::is_same_v<T, typename ST::dtype>) {
    for_each_piece_x4<RT>(src, row0, col0, [&](int i, int j, uint32_t addr, bool trans) {
      ldmatrix_x4(reinterpret_cast<packed<bf16> *>(dst.tiles[i][j].data), addr, trans);
    });
  } else {
    for_each_pair<RT>([&](int i, int j, int k, int r, int c) {
      int r2 = pair_along_row<RT> ? r : r + 1, c2 = pair_along_row<RT> ? c + 1 : c;
      float2 v{convert<float>(src(row0 + r, col0 + c)), convert<float>(src(row0 + r2, col0 + c2))};
      dst.tiles[i][j].data[k] = from_float2<packed<T>>(v);
    });
  }
}

// Register tile := the transpose of shared tile src's region at (row0, col0) (16-bit, same type):
// dst(r, c) = src(row0 + c, col0 + r).
template <RegisterTile RT, SharedTile ST>
__device__ __forceinline__ void load_transposed(RT &dst, const ST &src, int row0 = 0, int col0 = 0) {
  static_assert(is_16bit<typename RT::dtype> && std::is_same_v<typename RT::dtype, typename ST::dtype>);
  for_each_piece_x4_transposed<RT>(src, row0, col0, [&](int i, int j, uint32_t addr) {
    ldmatrix_x4(reinterpret_cast<packed<bf16> *>(dst.tiles[i][j].data), addr, true);
  });
}
// Shared tile region at (row0, col0) := the transpose of register tile src (sm_90: stmatrix).
template <SharedTile ST, RegisterTile RT>
__device__ __forceinline__ void store_transposed(ST &dst, const RT &src, int row0 = 0, int col0 = 0) {
  static_assert(is_16bit<typename RT::dtype> && std::is_same_v<typename RT::dtype, typename ST::dtype>);
  for_each_piece_x4_transposed<RT>(dst, row0, col0, [&](int i, int j, uint32_t addr) {
    stmatrix_x4(addr, reinterpret_cast<const packed<bf16> *>(src.tiles[i][j].data), true);
  });
}

// Register tile -> shared tile (at (row0, col0)), converting the element type if they differ.
// 16-bit tiles of the shared tile's type go in with stmatrix on sm_90 (4 instructions per 16 x 16
// piece fewer than pair by pair).
template <SharedTile ST, RegisterTile RT>
__device__ __forceinline__ void store(ST &dst, const RT &src, int row0 = 0, int col0 = 0) {
  using T = typename ST::dtype;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (is_16bit<T> && std::is_same_v<T, typename RT::dtype>) {
    for_each_piece_x4<RT>(dst, row0, col0, [&](int i, int j, uint32_t addr, bool trans) {
      stmatrix_x4(addr, reinterpret_cast<const packed<bf16> *>(src.tiles[i][j].data), trans);
    });
    return;
  }
#endif
  for_each_pair<RT>([&](int i, int j, int k, int r, int c) {
    float2 v = to_float2(src.tiles[i][j].data[k]);
    if constexpr (pair_along_row<RT>) {  // the pair is contiguous in the row: one store
      *reinterpret_cast<packed<T> *>(&dst(row0 + r, col0 + c)) = from_float2<packed<T>>(v);
    } else {
      dst(row0 + r, col0 + c) = convert<T>(v.x);
      dst(row0 + r + 1, col0 + c) = convert<T>(v.y);
    }
  });
}

// Global view -> register tile, pair by pair (one load where the pair is contiguous in memory); rows
// at or past src.seq() read as zero.
template <RegisterTile RT, typename T>
__device__ __forceinline__ void load(RT &dst, const gl<T> &src, coord o) {
  using U = std::remove_const_t<T>;
  using P = packed<typename RT::dtype>;
  for_each_pair<RT>([&](int i, int j, int k, int r, int c) {
    if constexpr (pair_along_row<RT> && is_16bit<U> && std::is_same_v<U, typename RT::dtype>) {
      if (src.strides[3] == 1) {
        dst.tiles[i][j].data[k] = o.s + r < src.seq() ? *reinterpret_cast<const P *>(src.at(o.b, o.s + r, o.h, o.d + c))
                                                      : from_float2<P>(float2{0.f, 0.f});
        return;
      }
    }
    const int r2 = pair_along_row<RT> ? r : r + 1, c2 = pair_along_row<RT> ? c + 1 : c;
    float2 v{0.f, 0.f};
    if (o.s + r < src.seq()) v.x = convert<float>(*src.at(o.b, o.s + r, o.h, o.d + c));
    if (o.s + r2 < src.seq()) v.y = convert<float>(*src.at(o.b, o.s + r2, o.h, o.d + c2));
    dst.tiles[i][j].data[k] = from_float2<P>(v);
  });
}

// Register tile -> global view; rows at or past dst.seq() are not written.
template <typename T, RegisterTile RT>
__device__ __forceinline__ void store(const gl<T> &dst, const RT &src, coord o) {
  for_each_pair<RT>([&](int i, int j, int k, int r, int c) {
    float2 v = to_float2(src.tiles[i][j].data[k]);
    if (pair_along_row<RT> && is_16bit<T> && dst.strides[3] == 1) {  // the pair is contiguous: one store
      if (o.s + r < dst.seq())
        *reinterpret_cast<packed<T> *>(dst.at(o.b, o.s + r, o.h, o.d + c)) = from_float2<packed<T>>(v);
    } else {
      int r2 = pair_along_row<RT> ? r : r + 1, c2 = pair_along_row<RT> ? c + 1 : c;
      if (o.s + r < dst.seq()) *dst.at(o.b, o.s + r, o.h, o.d + c) = convert<T>(v.x);
      if (o.s + r2 < dst.seq()) *dst.at(o.b, o.s + r2, o.h, o.d + c2) = convert<T>(v.y);
    }
  });
}

// Vector <- src[0 .. n) (shared or global), `fill` past n.
template <typename RV, typename T>
__device__ __forceinline__ void load(RV &dst, const T *src, int n, float fill = 0.f) {
#pragma unroll
  for (int i = 0; i < RV::pieces; i++)
#pragma unroll
    for (int k = 0; k < RV::per; k++) {
      int idx = RV::index_of(i, k);
      dst.data[i][k] = idx < n ? convert<float>(src[idx]) : fill;
    }
}

// Vector -> dst[0 .. n); of the lanes holding copies of a value, one writes it.
template <typename T, typename RV>
__device__ __forceinline__ void store(T *dst, const RV &src, int n) {
  int lane = laneid();
  bool writer = std::is_same_v<typename RV::layout, ortho_l> ? lane % 4 == 0 : lane < 4;
#pragma unroll
  for (int i = 0; i < RV::pieces; i++)
#pragma unroll
    for (int k = 0; k < RV::per; k++) {
      int idx = RV::index_of(i, k);
      if (writer && idx < n) dst[idx] = convert<T>(src.data[i][k]);
    }
}

// A 16-bit R x C block of a global matrix in 16-byte chunks held in registers, the lanes taking the
// chunks row by row (coalesced, whole sectors). load() only issues the loads: the registers are read
// later, when the block goes to a shared tile (store), from which ldmatrix reads it in a register
// tile's layout, transposed or not. Fewer and wider accesses than pair by pair, and none of 2 bytes
// for a transposed tile. Writing a register tile to global memory goes the other way.
template <typename T, int R, int C> struct chunks {
  static_assert(is_16bit<T> && C % 8 == 0 && R * C % 256 == 0);
  static constexpr int PER_ROW = C / 8, N = R * C / 256;  // chunks per row; per lane
  uint4 v[N];
  __device__ static int row(int n) { return (laneid() + 32 * n) / PER_ROW; }
  __device__ static int col(int n) { return (laneid() + 32 * n) % PER_ROW * 8; }
};
// Global view (at o) -> chunks; rows at or past src.seq() read as zero. (Rows 16-byte aligned.)
template <typename T, int R, int C, typename U>
__device__ __forceinline__ void load(chunks<T, R, C> &dst, const gl<U> &src, coord o) {
  static_assert(std::is_same_v<std::remove_const_t<U>, T>);
#pragma unroll
  for (int n = 0; n < dst.N; n++) {
    const int r = dst.row(n);
    dst.v[n] = o.s + r < src.seq() ? *reinterpret_cast<const uint4 *>(src.at(o.b, o.s + r, o.h, o.d + dst.col(n)))
                                   : uint4{0, 0, 0, 0};
  }
}
// chunks -> global view (at o); rows at or past dst.seq() are not written.
template <typename T, int R, int C>
__device__ __forceinline__ void store(const gl<T> &dst, const chunks<T, R, C> &src, coord o) {
#pragma unroll
  for (int n = 0; n < src.N; n++) {
    const int r = src.row(n);
    if (o.s + r < dst.seq()) *reinterpret_cast<uint4 *>(dst.at(o.b, o.s + r, o.h, o.d + src.col(n))) = src.v[n];
  }
}
// chunks -> shared tile (at (row0, col0)), and back.
template <SharedTile ST, typename T, int R, int C>
__device__ __forceinline__ void store(ST &dst, const chunks<T, R, C> &src, int row0 = 0, int col0 = 0) {
#pragma unroll
  for (int n = 0; n < src.N; n++) *reinterpret_cast<uint4 *>(&dst(row0 + src.row(n), col0 + src.col(n))) = src.v[n];
}
template <typename T, int R, int C, SharedTile ST>
__device__ __forceinline__ void load(chunks<T, R, C> &dst, const ST &src, int row0 = 0, int col0 = 0) {
#pragma unroll
  for (int n = 0; n < dst.N; n++) dst.v[n] = *reinterpret_cast<const uint4 *>(&src(row0 + dst.row(n), col0 + dst.col(n)));
}

}  // namespace tk::warp
