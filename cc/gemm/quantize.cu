// FP8 block quantization (the FP8 GEMM's operands, forward and backward). Each output row's absolute
// maximum over its 1 x 128 block (or its 128 x 128 block's) gives the block's scale, amax / 448 (1 for
// a block of zeros); an FP8 input is first multiplied by its 1 x 128 row scales, and rows at or past
// the limit are zeros. The values go out rounded to nearest, saturating. The pass is bound by bytes in
// flight and by instructions per element, so loads are issued in batches and values convert in pairs.
//
// - Untransposed 1 x 128 blocks (quantize_rows_kernel): no tile; a block's 128 values lie in 8-32
//   neighbouring lanes' registers.
// - Otherwise (quantize_kernel), one block of 256 threads per 128 x 128 tile of the output: the input
//   tile comes into shared memory as float32 and goes out along its rows, or transposed along its
//   columns: the quantized transpose in one pass over memory, where XLA takes several.
#include <cuda_fp8.h>

#include <algorithm>
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

// Four values of one output row divided by its scale d and rounded to float8, packed little-endian: as
// fp8_quotient rounds them, with its tests batched (a warp takes the division only where one of its
// lanes needs it) and the conversions two at a time. Below 2^-11 the product and the quotient both
// round to a zero of x's sign, so only [2^-11, 2^-6) of float8's subnormal range divides. d_ok: d in
// [2^-100, 2^100], the row's.
__device__ __forceinline__ uint32_t fp8x4(const float (&x)[4], float d, float inv, bool d_ok) {
  float q[4];
  bool clear = d_ok;
#pragma unroll
  for (int j = 0; j < 4; j++) {
    q[j] = __fmul_rn(x[j], inv);
    const float a = fabsf(q[j]);
    const uint32_t low = __float_as_uint(q[j]) & 0xFFFFFu;
    clear &= a < 0x1p-11f || (a >= 0x1p-6f && low - 0x7FFFCu > 8u);
  }
  if (!clear) {
#pragma unroll
    for (int j = 0; j < 4; j++) q[j] = fp8_quotient(x[j], d, inv);
  }
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(q[0], q[1]), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(q[2], q[3]), __NV_SATFINITE, __NV_E4M3);
  return lo | hi << 16;
}

__device__ __forceinline__ bool reciprocal_exact_enough(float d) { return d >= 0x1p-100f && d <= 0x1p100f; }

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
    // The bytes come out in that order and rotate into place.
    const int rot = i / 8 % 4;
    float x[4];
#pragma unroll
    for (int j = 0; j < 4; j++) x[j] = s[orow * across + (oc + (j + rot) % 4) * along];
    const float d = row_scale[orow];
    uint32_t packed = fp8x4(x, d, row_inv[orow], reciprocal_exact_enough(d));
    packed = __funnelshift_l(packed, packed, 8 * rot);
    uint8_t *dst = values + r * out_cols + c;
    if (out_cols % 4 == 0) {
      *reinterpret_cast<uint32_t *>(dst) = packed;
    } else {
      for (int j = 0; j < 4 && c + j < out_cols; j++) dst[j] = uint8_t(packed >> (8 * j));
    }
  }
}

// Untransposed 1 x 128 blocks (the activations of the forward, the cotangent of the backward's dgrad)
// need no tile: LANES neighbouring lanes take one row's block, 16 bytes each, a thread loads UNROLL
// rows' before it uses any, and a block's maximum is a reduction across its lanes. The rows of a
// block of threads: GROUPS * UNROLL, GROUPS apart for a thread.
template <typename In> __global__ void __launch_bounds__(THREADS) quantize_rows_kernel(const QuantParams p) {
  constexpr int VEC = 16 / sizeof(In), LANES = T / VEC, GROUPS = THREADS / LANES, UNROLL = 4;
  static_assert(LANES <= 32 && 32 % LANES == 0 && VEC % 4 == 0);
  const int b = blockIdx.z, lane = threadIdx.x % LANES;
  const long long c0 = (long long)blockIdx.x * T, c = c0 + lane * VEC;
  const int limit = p.row_limit ? min(max(*p.row_limit, 0), p.rows) : p.rows;
  const In *x = static_cast<const In *>(p.x) + (long long)b * p.rows * p.cols;
  const int col_blocks = (p.out_cols + T - 1) / T, in_blocks = (p.cols + T - 1) / T;
  float *scales = p.scales + (long long)b * p.out_rows * col_blocks;
  uint8_t *values = static_cast<uint8_t *>(p.values) + (long long)b * p.out_rows * p.out_cols;
  const bool inside = p.vector_loads && c0 + T <= p.cols && limit > 0;  // (the block's; no per-row branch)
  const long long row_steps = (p.out_rows + GROUPS * UNROLL - 1) / (GROUPS * UNROLL);
  for (long long step = blockIdx.y; step < row_steps; step += gridDim.y) {
    const long long r0 = step * GROUPS * UNROLL + threadIdx.x / LANES;  // this thread's rows: r0 + GROUPS u
    uint4 raw[UNROLL];
    if (inside) {
#pragma unroll
      for (int u = 0; u < UNROLL; u++) {
        const long long r = min(r0 + GROUPS * u, (long long)limit - 1);  // (a row past the limit: zeros next)
        raw[u] = __ldcs(reinterpret_cast<const uint4 *>(x + r * p.cols + c));
      }
#pragma unroll
      for (int u = 0; u < UNROLL; u++)
        if (r0 + GROUPS * u >= limit) raw[u] = make_uint4(0, 0, 0, 0);  // (not a product: it may hold NaN)
    } else {
#pragma unroll
      for (int u = 0; u < UNROLL; u++) {
        const long long r = r0 + GROUPS * u;
        In *e = reinterpret_cast<In *>(&raw[u]);
#pragma unroll
        for (int j = 0; j < VEC; j++) e[j] = r < limit && c + j < p.cols ? x[r * p.cols + c + j] : In(0.0f);
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      const long long r = r0 + GROUPS * u;
      const float x_scale = p.x_scales && r < limit && c0 < p.cols ? p.x_scales[r * in_blocks + c0 / T] : 1.0f;
      const In *e = reinterpret_cast<const In *>(&raw[u]);
      float v[VEC], amax = 0.0f;
#pragma unroll
      for (int j = 0; j < VEC; j++) {
        v[j] = to_float(e[j]) * x_scale;
        amax = fmaxf(amax, fabsf(v[j]));
      }
#pragma unroll
      for (int o = 1; o < LANES; o *= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      if (r >= p.out_rows || c >= p.out_cols) continue;
      const float d = amax > 0.0f ? __fdiv_rn(amax, FP8_MAX) : 1.0f, inv = __frcp_rn(d);  // (as the tile kernel's)
      if (lane == 0) scales[r * col_blocks + c0 / T] = d;
      uint32_t packed[VEC / 4];
#pragma unroll
      for (int k = 0; k < VEC / 4; k++) packed[k] = fp8x4(*reinterpret_cast<const float(*)[4]>(&v[4 * k]), d, inv, reciprocal_exact_enough(d));
      uint8_t *dst = values + r * p.out_cols + c;
      if (p.out_cols % VEC == 0) {
        if constexpr (VEC == 16) *reinterpret_cast<uint4 *>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        if constexpr (VEC == 8) *reinterpret_cast<uint2 *>(dst) = make_uint2(packed[0], packed[1]);
        if constexpr (VEC == 4) *reinterpret_cast<uint32_t *>(dst) = packed[0];
      } else {
        for (int j = 0; j < VEC && c + j < p.out_cols; j++) dst[j] = uint8_t(packed[j / 4] >> (8 * (j % 4)));
      }
    }
  }
}

template <typename In> cudaError_t launch(const QuantParams &p, cudaStream_t stream) {
  if (!p.transposed && p.block_rows == 1) {
    constexpr int rows_per_block = THREADS / (T / (16 / sizeof(In))) * 4;
    const long long steps = (p.out_rows + rows_per_block - 1) / rows_per_block;
    const dim3 grid((p.out_cols + T - 1) / T, (unsigned)std::min<long long>(steps, 65535), p.batch);
    quantize_rows_kernel<In><<<grid, THREADS, 0, stream>>>(p);
    return cudaGetLastError();
  }
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
