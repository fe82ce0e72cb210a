// Copies between global tensors and shared tiles by the threads themselves, in 16-byte chunks:
// asynchronous loads (cp.async, sm_80+), whose rows past the end of the tensor are filled with zeros
// (tail tiles need no special case in the math), and plain stores, which skip those rows.
#pragma once
#include "../../types/gl.cuh"
#include "../../types/st.cuh"

namespace tk {

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Copy 16 bytes, or zero-fill them when !valid (src-size 0 reads nothing).
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void commit_group() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Threads 0..THREADS-1 (thread index `tid`) copy rows origin.s .. origin.s+R of src at (origin.b,
// origin.h), columns origin.d .. origin.d+C, into dst. Rows >= src.seq() become zeros. The caller
// commits and waits. Columns must be inside the tensor and 16-byte aligned.
template <int THREADS, SharedTile ST, typename U>
__device__ __forceinline__ void load_async(ST &dst, const gl<U> &src, coord origin, int tid) {
  static_assert(std::is_same_v<std::remove_const_t<U>, typename ST::dtype>, "load_async does not convert");
  constexpr int row_chunks = ST::cols / ST::chunk;  // 16-byte chunks in a whole row (all panels)
  constexpr int total = ST::rows * row_chunks;
#pragma unroll
  for (int i = tid; i < total; i += THREADS) {
    int r = i / row_chunks, c = (i % row_chunks) * ST::chunk;
    int s = origin.s + r;
    bool valid = s < src.seq();
    const auto *p = src.at(origin.b, valid ? s : 0, origin.h, origin.d + c);
    cp_async16(&dst(r, c), p, valid);
  }
}

// Threads 0..THREADS-1 (thread index `tid`) copy src into rows origin.s .. origin.s+R of dst at
// (origin.b, origin.h), columns origin.d .. origin.d+C; rows >= dst.seq() are not written (the
// mirror of load_async).
template <int THREADS, SharedTile ST, typename U>
__device__ __forceinline__ void store(const gl<U> &dst, const ST &src, coord origin, int tid) {
  static_assert(std::is_same_v<U, typename ST::dtype>, "store does not convert");
  constexpr int row_chunks = ST::cols / ST::chunk;
#pragma unroll
  for (int i = tid; i < ST::rows * row_chunks; i += THREADS) {
    const int r = i / row_chunks, c = (i % row_chunks) * ST::chunk;
    if (origin.s + r < dst.seq())
      *reinterpret_cast<uint4 *>(dst.at(origin.b, origin.s + r, origin.h, origin.d + c)) =
          *reinterpret_cast<const uint4 *>(&src(r, c));
  }
}

}  // namespace tk
