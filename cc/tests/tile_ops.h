// Unit-test kernels for the tile language: one warp runs one operation on small tiles.
#pragma once
#include <cuda_runtime.h>

namespace jax_tk::tests {

// What each op id computes is documented next to its case in tile_ops.cu and mirrored by the
// numpy reference in tests/tk/test_tile_ops_gpu.py.
struct TileOpArgs {
  int op;
  int dtype;   // 0 float32, 1 bfloat16, 2 float16 (a, b element type)
  int layout;  // 0 row_l, 1 col_l
  int rows, cols;
  float param;
  const void *a, *b;  // [rows, cols] of dtype
  const float *v;     // [64] float32
  float *out;         // [rows, cols] float32
  float *vec;         // [64] float32
};

cudaError_t launch_tile_op(const TileOpArgs &args, cudaStream_t stream);

}  // namespace jax_tk::tests
