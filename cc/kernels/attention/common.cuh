// Helpers shared by the attention kernels: dispatch over dtype and head dim, launch with a large
// dynamic shared-memory budget, and the masking rule.
#pragma once
#include "attention.h"
#include "tk/tk.cuh"

namespace jax_tk::attention {

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
constexpr float NEG_INF = -__builtin_huge_valf();

// f.template operator()<T, D>() for the runtime dtype and head dim.
template <typename F> cudaError_t dispatch(const Params &p, F f) {
  auto by_dim = [&]<typename T>() -> cudaError_t {
    if (p.head_dim == 64) return f.template operator()<T, 64>();
    if (p.head_dim == 128) return f.template operator()<T, 128>();
    return cudaErrorInvalidValue;
  };
  return p.dtype == DType::bf16 ? by_dim.template operator()<tk::bf16>() : by_dim.template operator()<tk::half>();
}

template <typename Kernel>
cudaError_t launch(Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, const Params &p) {
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (e != cudaSuccess) return e;
  }
  kernel<<<grid, block, smem, stream>>>(p);
  return cudaGetLastError();
}

// May query row qi see key kj?
__device__ __forceinline__ bool visible(const Params &p, int qi, int kj) {
  return kj < p.kv_len && (!p.causal || kj <= qi);
}

// Key blocks of size BK that query rows [q0, q0 + rows) need: [0, end).
__device__ __forceinline__ int kv_block_end(const Params &p, int q0, int rows, int BK) {
  int n = (p.kv_len + BK - 1) / BK;
  if (p.causal) n = min(n, (min(q0 + rows, p.q_len) - 1) / BK + 1);
  return n;
}

}  // namespace jax_tk::attention
