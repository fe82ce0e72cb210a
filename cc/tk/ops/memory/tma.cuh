// TMA (the bulk tensor copy engine, sm_90): tensor maps built on the host from a [b, s, h, d] view,
// and asynchronous loads of whole shared tiles that complete on a semaphore. Rows past the end of
// the tensor arrive as zeros. Tiles are loaded one 128-byte-wide panel at a time (SWIZZLE_128B).
#pragma once
#include <cuda.h>

#include "../../types/st.cuh"
#include "mbarrier.cuh"

namespace tk {

// Host: a tensor map for a contiguous [b, s, h, d] tensor of T whose boxes are ROWS x (128 bytes).
template <typename T, int ROWS> struct tma_map {
  CUtensorMap map;
};

using encode_fn = CUresult (*)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                               const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                               CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled from the driver, found at run time (no link-time libcuda dependency).
inline encode_fn tensor_map_encoder() {
  static encode_fn fn = [] {
    void *p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      p = nullptr;
    return reinterpret_cast<encode_fn>(p);
  }();
  return fn;
}

template <typename T> constexpr CUtensorMapDataType tma_dtype() {
  if constexpr (std::is_same_v<T, bf16>) return CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  else if constexpr (std::is_same_v<T, half>) return CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  else if constexpr (is_8bit<T>) return CU_TENSOR_MAP_DATA_TYPE_UINT8;  // (bytes: TMA moves them as they are)
  else return CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
}

// Returns false if the driver refuses (alignment, sizes). Boxes are as wide as the tensor where it is
// narrower than 128 bytes, unless full_width: then always 128 bytes (a tile may be wider than the
// tensor; its columns past the end arrive as zeros, and the box's bytes are still the tile's).
template <typename T, int ROWS>
inline bool make_tma_map(tma_map<T, ROWS> &m, const void *ptr, int b, int s, int h, int d, bool full_width = false) {
  encode_fn encode = tensor_map_encoder();
  if (!encode) return false;
  constexpr int box_cols = 128 / sizeof(T);
  cuuint64_t dims[4] = {cuuint64_t(d), cuuint64_t(h), cuuint64_t(s), cuuint64_t(b)};
  cuuint64_t strides[3] = {cuuint64_t(d) * sizeof(T), cuuint64_t(h) * d * sizeof(T), cuuint64_t(s) * h * d * sizeof(T)};
  cuuint32_t box[4] = {cuuint32_t(d < box_cols && !full_width ? d : box_cols), 1, cuuint32_t(ROWS), 1};
  cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  CUresult r = encode(&m.map, tma_dtype<T>(), 4, const_cast<void *>(ptr), dims, strides, box, elem_strides,
                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

// Device: one thread loads rows [row0, row0 + ROWS) of tile dst, all panels, from rows [s, s + ROWS) at
// (b, h), completing on `bar`; the caller has announced the bytes on `bar` (see arrive_expect_bytes).
// row0 is a multiple of 8 (the swizzle repeats every 8 rows of a panel).
template <SharedTile ST, int ROWS>
__device__ __forceinline__ void load_rows_async(ST &dst, int row0, const tma_map<typename ST::dtype, ROWS> &m, coord o,
                                                semaphore &bar) {
  static_assert(ST::rows % ROWS == 0 && ST::panel_cols * sizeof(typename ST::dtype) == 128);
#pragma unroll
  for (int p = 0; p < ST::panels; p++) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(
            smem_addr(dst.panel(p) + row0 * ST::panel_cols)),
        "l"(&m.map), "r"(o.d + p * ST::panel_cols), "r"(o.h), "r"(o.s), "r"(o.b), "r"(smem_addr(&bar.bar))
        : "memory");
  }
}
// Panels [p0, p1) of rows [row0, row0 + ROWS) of tile dst, as load_rows_async, landing at the same
// place in the shared memory of every block of the cluster in `ctas` (bit r: rank r) and completing
// on each one's semaphore at bar's place (each announces the bytes it receives).
template <SharedTile ST, int ROWS>
__device__ __forceinline__ void multicast_rows_async(ST &dst, int row0, int p0, int p1, const tma_map<typename ST::dtype, ROWS> &m,
                                                     coord o, semaphore &bar, uint16_t ctas) {
  static_assert(ST::rows % ROWS == 0 && ST::panel_cols * sizeof(typename ST::dtype) == 128);
  for (int p = p0; p < p1; p++) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n" ::"r"(
            smem_addr(dst.panel(p) + row0 * ST::panel_cols)),
        "l"(&m.map), "r"(o.d + p * ST::panel_cols), "r"(o.h), "r"(o.s), "r"(o.b), "r"(smem_addr(&bar.bar)), "h"(ctas)
        : "memory");
  }
}
// The whole tile (ROWS of them).
template <SharedTile ST, int ROWS>
__device__ __forceinline__ void load_async(ST &dst, const tma_map<typename ST::dtype, ROWS> &m, coord o, semaphore &bar) {
  static_assert(ST::rows == ROWS);
  load_rows_async(dst, 0, m, o, bar);
}

// Device: one thread stores a shared tile to rows [s, s + R) at (b, h), all panels (rows past the end
// of the tensor are not written). A bulk group: commit it, then bulk_wait_read before the tile is
// written again or the thread block exits (the writes to global memory are done by the kernel's end;
// bulk_wait where the kernel itself must see them, e.g. before handing them on to another block).
template <SharedTile ST, int ROWS>
__device__ __forceinline__ void store_async(const tma_map<typename ST::dtype, ROWS> &m, const ST &src, coord o) {
  static_assert(ST::rows == ROWS && ST::panel_cols * sizeof(typename ST::dtype) == 128);
#pragma unroll
  for (int p = 0; p < ST::panels; p++) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(&m.map),
                 "r"(o.d + p * ST::panel_cols), "r"(o.h), "r"(o.s), "r"(o.b), "r"(smem_addr(src.panel(p)))
                 : "memory");
  }
}

// Device: one thread copies `bytes` contiguous bytes global -> shared, completing on `bar` (bytes a
// multiple of 16, both addresses 16-byte aligned; announce them on `bar` like a tile's).
__device__ __forceinline__ void load_async(void *dst, const void *src, uint32_t bytes, semaphore &bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(&bar.bar))
               : "memory");
}

// Device: global fp32 [0, bytes/4) += shared memory, by the bulk copy engine (one thread issues;
// bytes a multiple of 16, both addresses 16-byte aligned). Completion is tracked per thread in
// bulk groups: commit them, then wait until at most N are pending (wait_read: until their
// shared-memory sources may be overwritten; wait: until their writes are done).
__device__ __forceinline__ void reduce_add_async(float *dst, const void *src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory"); }

}  // namespace tk
