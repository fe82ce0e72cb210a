// Grouped (ragged) and dense GEMM: the contract between the FFI handler (cc/gemm/ffi.cc), its
// kernels and Python (jax_tk/gemm/).
//
// FFI targets "jax_tk_gemm_ragged" and "jax_tk_gemm_ragged_test" (the same handler plus trailing
// operands that it ignores: tests alias poisoned buffers to the output through them).
//   operands  a, b, group_sizes (int32 [g]);  one result: out;  int32 attributes mode, b_transposed
//   and variant (cc/core/core.h's VARIANT_*: VARIANT_AUTO takes the sm_90a kernel on H100/H200, the
//   others the mma.sync one everywhere).
//   mode MODE_RAGGED (jax.lax.ragged_dot):
//     a [m, k]; b [g, k, n] (b_transposed = 0) or b [g, n, k] (b_transposed = 1); out [m, n].
//     Group i owns the rows [off_i, off_i + size_i) of a and out, off = exclusive cumsum of the
//     sizes, worked out on the device by the kernels: negative sizes count as 0 and every range is
//     clipped to [0, m). out rows of group i are a[rows_i] @ b[i] (or @ b[i]^T); rows at or past
//     the sum of the sizes are 0. Dense matmul is g = 1, group_sizes = [m].
//   mode MODE_CONTRACT (the gradient of ragged_dot with respect to b):
//     a [m, k], b [m, n] (rows grouped as above), b_transposed = 0; out [g, k, n] with
//     out[i] = a[rows_i]^T @ b[rows_i] (zeros for an empty group).
//     b_transposed = 1 (the sm_90a kernel only; m a multiple of DIM_MULTIPLE): both K-major, a [k, m]
//     and b [n, m], out[i] = a[:, rows_i] @ b[:, rows_i]^T; b's columns past the groups must be
//     finite (they meet zeros). A split-k product's input gradient, g @ w^T, takes its operands so,
//     as they are.
//   mode MODE_SPLIT_K (the sm_90a kernel only; a dense product's split-k parts, as groups):
//     a [rows, g * k], b [g, k, n], group_sizes g times rows; out [g * rows, n] ([g, rows, n]) with
//     out[i] = a[:, i k : (i + 1) k] @ b[i]: MODE_RAGGED's kernel, whose group i reads its rows of a
//     as those columns of a's rows (no copy of a). With b_transposed = 1, b is [n, g * k] and
//     out[i] = a[:, i k : (i + 1) k] @ b[:, i k : (i + 1) k]^T (an input gradient's parts, b read
//     in place as well).
//   Dtypes: a and b both bfloat16 or both float16; out the same dtype or float32 (the result
//   buffer's dtype decides); fp32 accumulation. k and n must be multiples of DIM_MULTIPLE (the
//   tensor copies need 16-byte row strides); m is free. Zero-sized dimensions are allowed.
//   Every array is contiguous, row-major, 16-byte aligned. No workspace: the kernels walk the
//   groups themselves (no tile counter, no host synchronization).
#pragma once
#include "core/core.h"

namespace jax_tk::gemm {

// The contract with Python (the list's format: cc/core/core.h).
// clang-format off
#define JAX_TK_GEMM_CONTRACT(X)                                                                            \
  X(MODE_RAGGED, 0)     /* attribute mode: out [m, n] = a @ b[group of the row] */                         \
  X(MODE_CONTRACT, 1)   /* attribute mode: out [g, k, n] = a[rows_i]^T @ b[rows_i] */                      \
  X(MODE_SPLIT_K, 2)    /* attribute mode: out [g, rows, n] = a[:, i k : (i + 1) k] @ b[i] */              \
  X(DIM_MULTIPLE, 8)    /* k and n must be multiples of this */                                            \
  X(SM90_TILE_M, 128)   /* output tile of the sm_90a kernel (rows of out, or of out[i] in MODE_CONTRACT) */ \
  X(SM90_TILE_N, 256)                                                                                      \
  X(SM90_TILE_K, 64)    /* ... and its steps along the contraction */                                      \
  X(SM90_SPLIT_TILE_N, 128) /* MODE_SPLIT_K's tiles' width: fewer, longer parts fill a wave */             \
  X(SM80_TILE_M, 128)   /* output tile of the mma.sync kernel */                                           \
  X(SM80_TILE_N, 128)                                                                                      \
  X(SM80_TILE_K, 32)                                                                                        \
  X(FP8_BLOCK, 128)     /* FP8: the scales' blocks, 1 x 128 of a (along k), 128 x 128 of b */
// clang-format on
JAX_TK_DECLARE_CONTRACT(JAX_TK_GEMM_CONTRACT)

enum class DType { bf16, fp16, fp8e4m3 };  // (fp8e4m3: a and b e4m3 with block scales, b [g, n, k])

struct Params {
  DType dtype;       // of a and b
  bool out_f32;      // out is float32 (else a's dtype)
  int mode;          // MODE_RAGGED or MODE_CONTRACT
  bool b_transposed; // MODE_RAGGED: b is [g, n, k]
  int m, k, n, groups;
  const void *a, *b;
  const int *group_sizes;  // [groups], on the device
  void *out;
  // FP8, out bfloat16 or float32, each scale over its FP8_BLOCK block. MODE_RAGGED (b_transposed):
  // out = (a * a_scales) @ (b * b_scales)^T per group. MODE_CONTRACT (the weights' gradient; a [k, m]
  // and b [n, m], both K-major): out[i] = (a * a_scales)[:, rows_i] @ (b * b_scales)[:, rows_i]^T.
  const float *a_scales = nullptr;  // RAGGED [ceil(k / 128), m]: a's 1 x 128 blocks, k-block major;
                                    // CONTRACT [ceil(m / 128), k]: a's 1 x 128 blocks along m
  const float *b_scales = nullptr;  // RAGGED [groups, ceil(k / 128), ceil(n / 128)]: b's 128 x 128 blocks;
                                    // CONTRACT [ceil(m / 128), ceil(n / 128)]
  // MODE_RAGGED from MODE_SPLIT_K (the sm_90a kernel): a is [m / a_split, a_split * k], and group i's
  // rows are its rows' columns [i k, (i + 1) k) (the groups' sizes all m / a_split); b_transposed:
  // b is [n, a_split * k], group i's b its columns [i k, (i + 1) k).
  int a_split = 1;
};

// FP8 block quantization (target "jax_tk_fp8_quantize", cc/gemm/quantize.cu): values float8_e4m3fn
// [batch, out_rows, out_cols] and scales float32 [batch, ceil(out_rows / block_rows), ceil(out_cols /
// 128)] of y, quantize_fp8's (jax_tk/gemm/fp8.py) in IEEE float32: per block amax / 448 (1 for a block of
// zeros) and y / scale rounded to nearest, saturating. y is x [batch, rows, cols] (transposed: each
// x[b]^T), zero-padded to [out_rows, out_cols], its rows (of x) at or past *row_limit zeroed; an FP8
// x comes with its scales [rows, ceil(cols / 128)] (1 x 128 blocks, batch 1) and is dequantized first.
struct QuantParams {
  enum class In { bf16, fp16, f32, fp8e4m3 } in;
  const void *x;
  const float *x_scales;   // FP8 x only, else null
  const int *row_limit;    // on the device, or null (every row)
  int batch, rows, cols, out_rows, out_cols;
  bool transposed;
  int block_rows;          // 1 or 128 (along the output's rows; 128 along its columns)
  bool vector_loads;       // x 16-byte aligned and its rows a multiple of 16 bytes
  void *values;
  float *scales;
};

// An upper bound on the output tiles of a call with tiles of tm x tn (what the persistent grids are
// sized from; the kernels find the exact count on the device): in MODE_RAGGED each group adds at
// most one partial row block, plus the block of rows past the groups' sum.
inline long long tile_bound(const Params &p, int tm, int tn) {
  const long long nt = (p.n + tn - 1) / tn;
  if (p.mode == MODE_CONTRACT) return (long long)p.groups * ((p.k + tm - 1) / tm) * nt;
  return ((p.m + tm - 1) / tm + (long long)p.groups + 1) * nt;
}

// The tile width of a dense product that the sm_90a kernel runs in `clusters` clusters of two blocks
// (tiles of 2 SM90_TILE_M rows): SM90_TILE_N, or a width of DENSE_TILE_WIDTHS whose waves take less
// time by this model, in which a tile's time is proportional to its width and a wave takes as long
// as its tiles (the last wave as long as a full one): by at least a twentieth, a margin for the
// other widths' lower rate per column (narrower: more of a read per product; wider: three stages).
// E.g. 3000 x 7000 on 66 clusters: 336 tiles of 256 columns are 6 waves (the last of 6 tiles), 264
// of 320 columns are 4.
constexpr int DENSE_TILE_WIDTHS[] = {320, 192};
inline int dense_tile_n(long long m, long long n, int clusters) {
  if (clusters < 1) return SM90_TILE_N;
  auto cost = [&](int tn) {
    const long long tiles = (m + 2 * SM90_TILE_M - 1) / (2 * SM90_TILE_M) * ((n + tn - 1) / tn);
    return (tiles + clusters - 1) / clusters * tn;
  };
  int best = SM90_TILE_N;
  long long limit = 19 * cost(SM90_TILE_N);  // (x 20: the margin; a tie keeps the earlier width)
  for (int tn : DENSE_TILE_WIDTHS)
    if (20 * cost(tn) <= limit) best = tn, limit = 20 * cost(tn) - 1;
  return best;
}

// (dense_tile_n for the tests, which name the widths their cases run on.)
#define JAX_TK_GEMM_FORMULAS(F) F(dense_tile_n)

#ifdef JAX_TK_CUDA_HEADERS
// The kernels. Both take any Params the handler accepts (m, k, n, groups >= 1) and return the
// launch error, if any.
cudaError_t ragged_sm80(const Params &p, cudaStream_t stream);  // mma.sync, cp.async (sm_80 and newer)
cudaError_t ragged_sm90(const Params &p, cudaStream_t stream);  // TMA, wgmma, warp-specialized (sm_90a)
cudaError_t quantize_fp8(const QuantParams &p, cudaStream_t stream);  // any sm_80+ (FP8 converts in software before sm_89)
#endif

}  // namespace jax_tk::gemm
