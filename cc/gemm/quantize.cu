// FP8 block quantization (the FP8 GEMM's operands, forward and backward): one block of 128 threads
// x 2 per 128 x 128 tile of the output. The tile's input comes into shared memory as float32 (an
// FP8 input times its 1 x 128 row scales, rows at or past the limit as zeros), each output row's
// absolute maximum (or the tile's, for 128 x 128 blocks) gives its scale, and the values go out
// rounded to nearest, saturating, the output's rows 128 bytes at a time. Transposed, the tile is
// read along the input's rows and written along its columns: the quantized transpose in one pass
// over memory, where XLA takes several.
#include <cuda_fp8.h>

#include <cstdint>

#include "gemm/gemm.h"

namespace jax_tk::gemm {
namespace {

constexpr int T = FP8_BLOCK, THREADS = 256, PITCH = T + 1;  // (+1: columns read without bank conflicts)
constexpr float FP8_MAX = 448.0f;

__device__ __forceinline__ float to_float(const __nv_bfloat16 &x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(const __half &x) { return __half2float(x); }
__device__ __forceinline__ float to_float(const float &x) { return x; }
__device__ __forceinline__ float to_float(const __nv_fp8_e4m3 &x) { return float(x); }

// The input tile [T rows][T cols] from (r0, c0), as float32, into s; zeros outside the input and at
// or past the row limit. Each output row's absolute maximum comes from the registers as they are
// loaded, into amax[T]: a row's (untransposed) across the lanes that load it, or a column's
// (transposed) across the warps through cols[WARPS][T].
//
// The pass is bound by the bytes in flight: a thread's loads go out BATCH at a time, 16 bytes each,
// before any is used. In a tile wholly inside the input (the block's one uniform test) they are plain
// vector loads with nothing between them; a load under a per-row condition, or one whose value is
// stored to shared memory before the next is issued, would leave one load in flight per thread.
constexpr int WARPS = THREADS / 32;
template <typename In>
__device__ void load_tile(const QuantParams &p, float *s, float *amax, float (*cols)[T], int b, long long r0, long long c0, int limit) {
  constexpr int VEC = 16 / sizeof(In), PER_ROW = T / VEC;  // (a row's loads: PER_ROW neighbouring lanes)
  constexpr int LOADS = T * PER_ROW / THREADS, BATCH = LOADS < 8 ? LOADS : 8;
  static_assert(PER_ROW <= 32 && THREADS % PER_ROW == 0 && LOADS % BATCH == 0);
  const In *x = static_cast<const In *>(p.x) + (long long)b * p.rows * p.cols;
  const int ic = threadIdx.x % PER_ROW * VEC;  // this thread's columns, the same in every row it loads
  const int row_blocks = (p.cols + T - 1) / T;
  const bool inside = p.vector_loads && r0 + T <= limit && c0 + T <= p.cols;
  float col_max[VEC] = {};
#pragma unroll 1
  for (int l0 = 0; l0 < LOADS; l0 += BATCH) {
    uint4 raw[BATCH];
    float scale[BATCH];
    if (inside) {
#pragma unroll
      for (int l = 0; l < BATCH; l++) {
        const long long r = r0 + (threadIdx.x + (l0 + l) * THREADS) / PER_ROW;
        raw[l] = __ldcs(reinterpret_cast<const uint4 *>(x + r * p.cols + c0 + ic));
      }
    } else {
#pragma unroll
      for (int l = 0; l < BATCH; l++) {
        const long long r = r0 + (threadIdx.x + (l0 + l) * THREADS) / PER_ROW, c = c0 + ic;
        In *e = reinterpret_cast<In *>(&raw[l]);
#pragma unroll
        for (int j = 0; j < VEC; j++) e[j] = r < limit && c + j < p.cols ? x[r * p.cols + c + j] : In(0.0f);
      }
    }
    // (an FP8 input's scale: c0 is a multiple of 128, the tile one block of its 1 x 128 blocks; none
    // for a tile wholly in the output's padding)
#pragma unroll
    for (int l = 0; l < BATCH; l++) {
      const long long r = r0 + (threadIdx.x + (l0 + l) * THREADS) / PER_ROW;
      scale[l] = p.x_scales && r < limit && c0 < p.cols ? p.x_scales[r * row_blocks + c0 / T] : 1.0f;
    }
#pragma unroll
    for (int l = 0; l < BATCH; l++) {
      const int ir = (threadIdx.x + (l0 + l) * THREADS) / PER_ROW;
      const In *e = reinterpret_cast<const In *>(&raw[l]);
      float row_max = 0.0f;
#pragma unroll
      for (int j = 0; j < VEC; j++) {
        const float v = to_float(e[j]) * scale[l];
        s[ir * PITCH + ic + j] = v;
        row_max = fmaxf(row_max, fabsf(v));
        col_max[j] = fmaxf(col_max[j], fabsf(v));
      }
      if (!p.transposed) {
#pragma unroll
        for (int o = 1; o < PER_ROW; o *= 2) row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, o));
        if (threadIdx.x % PER_ROW == 0) amax[ir] = row_max;
      }
    }
  }
  if (!p.transposed) return;
  // A column's loads: the lanes PER_ROW apart in each warp, then the warps.
#pragma unroll
  for (int j = 0; j < VEC; j++) {
#pragma unroll
    for (int o = PER_ROW; o < 32; o *= 2) col_max[j] = fmaxf(col_max[j], __shfl_xor_sync(0xffffffffu, col_max[j], o));
    if (threadIdx.x % 32 < PER_ROW) cols[threadIdx.x / 32][ic + j] = col_max[j];
  }
  __syncthreads();
  if (threadIdx.x < T) {
    float m = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; w++) m = fmaxf(m, cols[w][threadIdx.x]);
    amax[threadIdx.x] = m;
  }
}

// x / d rounded to float8 as float8(__fdiv_rn(x, d)) rounds it, for the price of a product in most
// cases: q = x * (1 / d), each rounded to nearest, is within 2 float32 ulps of x / d (d in [2^-100,
// 2^100]: the reciprocal normal), so where q lies over 4 ulps from a float8 rounding midpoint (its 20
// bits below float8's 3 of mantissa not within 4 of 0x80000: a midpoint's are exactly that), x / d
// and its float32 rounding lie on q's side and round to q's float8 value. Near a midpoint (about 1 in
// 10^5 values), in float8's subnormal range (|q| < 2^-6, 1 bit of mantissa fewer per binade below)
// or out of that range of d, it divides. (Markstein's correction of q instead missed the correctly
// rounded quotient in a few values.)
__device__ __forceinline__ float fp8_quotient(float x, float d, float inv) {
  const float q = __fmul_rn(x, inv);
  const uint32_t low = __float_as_uint(q) & 0xFFFFFu;
  const bool clear = fabsf(q) >= 0x1p-6f && (low > 0x80004u || low < 0x7FFFCu) && d >= 0x1p-100f && d <= 0x1p100f;
  return clear ? q : __fdiv_rn(x, d);
}

template <typename In> __global__ void __launch_bounds__(THREADS, 3) quantize_kernel(const QuantParams p) {
  extern __shared__ float s[];  // [T][PITCH]: the input tile
  __shared__ float row_scale[T], row_inv[T], cols[WARPS][T];
  const int b = blockIdx.z;
  const long long o_r0 = (long long)blockIdx.y * T, o_c0 = (long long)blockIdx.x * T;  // the output tile
  const long long i_r0 = p.transposed ? o_c0 : o_r0, i_c0 = p.transposed ? o_r0 : o_c0;
  const int limit = p.row_limit ? min(max(*p.row_limit, 0), p.rows) : p.rows;
  load_tile<In>(p, s, row_scale, cols, b, i_r0, i_c0, limit);  // (row_scale: each output row's maximum)
  __syncthreads();
  // Output row t's elements: s[t][*], or transposed s[*][t].
  const int t = threadIdx.x;
  const int along = p.transposed ? PITCH : 1, across = p.transposed ? 1 : PITCH;
  if (p.block_rows == T && t < 32) {  // (one block: the tile's maximum)
    float amax = 0.0f;
    for (int j = t; j < T; j += 32) amax = fmaxf(amax, row_scale[j]);
    for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    __syncwarp();
    for (int j = t; j < T; j += 32) row_scale[j] = amax;
  }
  __syncthreads();
  if (t < T) {  // (a block of zeros gets scale 1: its values are 0, never 0 / 0)
    const float amax = row_scale[t];
    row_scale[t] = amax > 0.0f ? __fdiv_rn(amax, FP8_MAX) : 1.0f;
    row_inv[t] = __frcp_rn(row_scale[t]);
  }
  __syncthreads();
  const long long out_rows = p.out_rows, out_cols = p.out_cols;
  const int col_blocks = (p.out_cols + T - 1) / T;
  float *scales = p.scales + (long long)b * ((out_rows + p.block_rows - 1) / p.block_rows) * col_blocks;
  if (t < T && o_r0 + t < out_rows && (p.block_rows == 1 || t == 0))
    scales[(o_r0 + t) / p.block_rows * col_blocks + o_c0 / T] = row_scale[t];
  uint8_t *values = static_cast<uint8_t *>(p.values) + (long long)b * out_rows * out_cols;
  for (int i = t; i < T * T / 4; i += THREADS) {
    const int orow = i / (T / 4), oc = i % (T / 4) * 4;
    const long long r = o_r0 + orow, c = o_c0 + oc;
    if (r >= out_rows || c >= out_cols) continue;
    // A warp's lanes take one output row, 4 columns each; lane l reads them from the (l / 8 % 4)-th on,
    // so that the 32 lanes' reads fall in 32 banks (in order, lanes 8 apart would meet in one).
    const int rot = i / 8 % 4;
    uint32_t packed = 0;
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const int jj = (j + rot) % 4;
      const float x = s[orow * across + (oc + jj) * along];
      packed |= uint32_t(__nv_cvt_float_to_fp8(fp8_quotient(x, row_scale[orow], row_inv[orow]), __NV_SATFINITE, __NV_E4M3)) << (8 * jj);
    }
    uint8_t *dst = values + r * out_cols + c;
    if (out_cols % 4 == 0) {
      *reinterpret_cast<uint32_t *>(dst) = packed;
    } else {
      for (int j = 0; j < 4 && c + j < out_cols; j++) dst[j] = uint8_t(packed >> (8 * j));
    }
  }
}

template <typename In> cudaError_t launch(const QuantParams &p, cudaStream_t stream) {
  constexpr int smem = T * PITCH * sizeof(float);
  if (auto e = cudaFuncSetAttribute(quantize_kernel<In>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      e != cudaSuccess)
    return e;
  const dim3 grid((p.out_cols + T - 1) / T, (p.out_rows + T - 1) / T, p.batch);
  quantize_kernel<In><<<grid, THREADS, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t quantize_fp8(const QuantParams &p, cudaStream_t stream) {
  switch (p.in) {
    case QuantParams::In::bf16: return launch<__nv_bfloat16>(p, stream);
    case QuantParams::In::fp16: return launch<__half>(p, stream);
    case QuantParams::In::f32: return launch<float>(p, stream);
    case QuantParams::In::fp8e4m3: return launch<__nv_fp8_e4m3>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_tk::gemm
