// Unit-test kernels for the Hopper (sm_90a) layer of the tile language: TMA loads, wgmma, bulk
// reduce-add and an mbarrier producer/consumer ring. One launch per case; tests/tk/test_hopper_ops_gpu.py
// mirrors every case with numpy. The launchers return cudaErrorNoKernelImageForDevice unless the
// current GPU has compute capability 9.0 (the kernels exist only as sm_90a code).
#pragma once
#include <cuda_runtime.h>

namespace jax_tk::tests {

enum class Elem { bf16, fp16, fp8e4m3 };  // (fp8e4m3: the wgmma cases only)

// out[r, c] = x[b, s0 + r, h, c] (zero outside the sequence): one TMA load into a swizzled shared
// tile, completing on a semaphore, then written out element by element through st's layout.
struct TmaLoadArgs {
  Elem dtype;
  const void *x;       // [batch, seq, heads, dim], dim 64 or 128
  int batch, seq, heads, dim;
  int rows;            // 64 or 128
  int b, s0, h;        // s0 may be negative or run past the end
  void *out;           // [rows, dim], same dtype
};
cudaError_t launch_tma_load(const TmaLoadArgs &args, cudaStream_t stream);

// out = [c +] product, by one warpgroup. The product reads the bottom-right window of each operand
// tile (the whole tile when the sizes match) and is one of:
enum Product {
  ABT = 0,        // window(a, 64, K)   @ window(b, N, K)^T   (mma_ABt, both from shared memory)
  ATB = 1,        // window(a, K, 64)^T @ window(b, K, N)     (mma_AtB, both from shared memory)
  AB_SHARED = 2,  // window(a, 64, K)   @ window(b, K, N)     (mma_AB, A from shared memory)
  AB_REGS = 3,    // window(a, 64, K)   @ window(b, K, N)     (mma_AB, A loaded into registers)
};
struct WgmmaArgs {
  Elem dtype;
  int product, n, k;                   // (fp8e4m3: ABT, k a multiple of 32, tiles 128 bytes wide)
  int a_rows, a_cols, b_rows, b_cols;  // the operand tiles (must be one of the compiled cases)
  const void *a, *b;                   // [a_rows, a_cols], [b_rows, b_cols]
  const float *c;                      // [64, n]: the accumulator's previous value
  bool accumulate;                     // false: c is loaded, then ignored by the product
  int fragments;                       // 1: out goes through shared memory in fragment order
                                       // (store_fragments, read back with fragment_offset);
                                       // 2: out is zeroed, the result added to it twice in fragment
                                       // order (reduce_add_fragments), then read back: out = 2 d
  float *out;                          // [64, n]
};
bool has_wgmma_case(const WgmmaArgs &args);  // is (product, n, k, tile shapes) a compiled case?
cudaError_t launch_wgmma(const WgmmaArgs &args, cudaStream_t stream);

// out[64 x 64] += sum over blocks g and rounds r of x[g, r]: each of `blocks` blocks fills one fp32
// shared tile `rounds` times (reusing it after bulk_wait_read) and bulk-reduce-adds it into out.
struct ReduceAddArgs {
  const float *x;  // [blocks, rounds, 64, 64]
  int blocks, rounds;
  float *out;      // [64, 64], in place
};
cudaError_t launch_reduce_add(const ReduceAddArgs &args, cudaStream_t stream);

// out[128 x dim] = sum over j < n_tiles of w[128 j : 128 (j + 1), None] * x[b, 128 j : 128 (j + 1), h, :]
// (x zero past the end): a producer thread streams each tile (tensor copy) and its row weights
// (plain bulk copy) through a 2-slot ring (full/empty semaphores), two consumer warpgroups add them
// up in registers, then swap halves through shared memory at a named barrier.
struct RingArgs {
  Elem dtype;
  const void *x;   // [batch, seq, heads, dim], dim 64 or 128
  const float *w;  // [n_tiles * 128]
  int batch, seq, heads, dim;
  int b, h, n_tiles;
  float *out;      // [128, dim]
};
cudaError_t launch_ring(const RingArgs &args, cudaStream_t stream);

}  // namespace jax_tk::tests
