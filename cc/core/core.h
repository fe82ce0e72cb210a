// What every op's contract shares: the X-macro machinery, the kernel variants and the index limit.
//
// An op's contract is everything its C++ and Python sides must agree on. Each header cc/<op>/<op>.h
// lists its integer constants once, as an X-macro:
//
//   #define JAX_TK_MYOP_CONTRACT(X)
//     X(BLOCK_ROWS, 128)  /* why this value */
//
// (each entry on its own line, its value an integer expression of literals, its comment a /* */ one:
// a // comment would swallow the line continuation). JAX_TK_DECLARE_CONTRACT(JAX_TK_MYOP_CONTRACT)
// turns the list into `constexpr int BLOCK_ROWS = 128;` for the kernels and handlers; cc/module.cc turns
// the same list into the table that jax_tk._tk.contract() reports, and Python reads that (or parses
// the X(...) lines of the header where the extension was not built: jax_tk/_core/extension.py). The
// formulas Python needs (workspace sizes, block counts) are functions of the header, listed in
// JAX_TK_MYOP_FORMULAS(F) and exposed as jax_tk._tk.myop.<name>: they have one implementation.
//
// Everything above an op header's kernel declarations compiles with a plain C++ compiler (the module
// built without CUDA has the contracts and formulas); JAX_TK_HD marks the formulas the kernels call too.
#pragma once

#ifdef __CUDACC__
#define JAX_TK_HD __host__ __device__
#else
#define JAX_TK_HD
#endif

// Compiled by nvcc, or by the host compiler with the CUDA headers on its include path (the FFI
// handlers): the kernels' declarations, which need cudaError_t and cudaStream_t, are visible.
#if defined(__CUDACC__) || __has_include(<cuda_runtime.h>)
#include <cuda_runtime.h>
#define JAX_TK_CUDA_HEADERS 1
#endif

// `constexpr int NAME = VALUE;` for every entry of an op's contract list.
#define JAX_TK_DECLARE_CONTRACT(LIST) LIST(JAX_TK_CONSTEXPR_INT)
#define JAX_TK_CONSTEXPR_INT(NAME, VALUE) constexpr int NAME = VALUE;

namespace jax_tk::core {

// clang-format off
#define JAX_TK_CORE_CONTRACT(X)                                                                           \
  /* Kernel variants: the int attribute `variant` of every op's FFI call (jax_tk/_core/dispatch.py      \
     picks it from JAX_TK_KERNELS; cc/ffi/common.h's pick_kernels applies it). */                          \
  X(VARIANT_AUTO, 0)  /* the fastest kernels for the device: sm_90a ones at compute capability 9.0 */       \
  X(VARIANT_SM80, 1)  /* the mma.sync (sm_80) kernels on every GPU: the portable path, run on Hopper too */ \
  X(VARIANT_SM86, 2)  /* as SM80, within the shared memory of sm_86/sm_89 GPUs (decode's SMALL_GPU_SMEM) */ \
  /* The kernels index rows, elements and positions with int32: every such count stays at or below. */    \
  X(MAX_INDEX, 2147483647)                                                                                 \
  /* Thread blocks of one wave where each takes a whole SM (one per SM of an H100/H200): grids of few     \
     blocks (decode's split count, matmul's split k) are sized to fill it. */                            \
  X(WAVE_BLOCKS, 132)
// clang-format on
JAX_TK_DECLARE_CONTRACT(JAX_TK_CORE_CONTRACT)
#define JAX_TK_CORE_FORMULAS(F)

}  // namespace jax_tk::core
