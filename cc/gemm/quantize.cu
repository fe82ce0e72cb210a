// FP8 block quantization (the FP8 GEMM's operands, forward and backward): one block of 256 threads
// per 128 x 128 tile of the output. Each output row's absolute maximum (or the tile's, for 128 x 128
// blocks) gives its scale (an FP8 input is first multiplied by its 1 x 128 row scales; rows at or past
// the limit are zeros), and the values go out rounded to nearest, saturating.
//
// - Untransposed, a warp takes 16 rows of the tile in registers, each lane 4 columns of each row: its
//   16 loads are issued before any is used (the pass is bound by the bytes in flight, not by
//   arithmetic), a row's maximum is a reduction across the warp, and each lane stores its 4 bytes of
//   each row. Nothing goes through shared memory but the tile's maximum.
// - Transposed, the tile comes into shared memory as float32 (each thread's loads issued together) and
//   goes out along its columns: the quantized transpose in one pass over memory, where XLA takes
//   several.
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "gemm/gemm.h"

namespace jax_tk::gemm {
namespace {

constexpr int T = FP8_BLOCK, THREADS = 256, PITCH = T + 1;  // (+1: columns read without bank conflicts)
constexpr float FP8_MAX = 448.0f;

__device__ __forceinline__ float to_float(const __nv_bfloat16 &x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(const __half &x) { return __half2float(x); }
__device__ __forceinline__ float to_float(const float &x) { return x; }
__device__ __forceinline__ float to_float(const __nv_fp8_e4m3 &x) { return float(x); }

// The rows of x that hold data: those below the row limit (rows past it read as zeros).
__device__ __forceinline__ int row_limit(const QuantParams &p) { return p.row_limit ? min(max(*p.row_limit, 0), p.rows) : p.rows; }

// An FP8 input's scale of row r in the 128 columns from c0 (a multiple of 128): its 1 x 128 block's; 1
// for other inputs, and for rows past the limit or a tile wholly in the output's padding.
__device__ __forceinline__ float x_scale(const QuantParams &p, long long r, long long c0, int limit) {
  return p.x_scales && r < limit && c0 < p.cols ? p.x_scales[r * ((p.cols + T - 1) / T) + c0 / T] : 1.0f;
}

// A block's scale from its absolute maximum (a block of zeros gets scale 1: its values are 0, never
// 0 / 0).
__device__ __forceinline__ float scale_of(float amax) { return amax > 0.0f ? __fdiv_rn(amax, FP8_MAX) : 1.0f; }

__device__ __forceinline__ float warp_max(float m) {
#pragma unroll
  for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

// Batch entry b's outputs: its values [out_rows, out_cols] and its scales [ceil(out_rows / block_rows),
// col_blocks].
struct Out {
  float *scales;
  uint8_t *values;
  int col_blocks;
  __device__ __forceinline__ Out(const QuantParams &p, int b) : col_blocks((p.out_cols + T - 1) / T) {
    scales = p.scales + (long long)b * ((p.out_rows + p.block_rows - 1) / p.block_rows) * col_blocks;
    values = static_cast<uint8_t *>(p.values) + (long long)b * p.out_rows * p.out_cols;
  }
  // The scale of the block holding output row r and column c0 (a multiple of 128).
  __device__ __forceinline__ void scale(const QuantParams &p, long long r, long long c0, float d) const {
    scales[r / p.block_rows * col_blocks + c0 / T] = d;
  }
  // Output row r's 4 bytes from column c (byte j: column c + j), those inside the output.
  __device__ __forceinline__ void store4(const QuantParams &p, long long r, long long c, uint32_t packed) const {
    uint8_t *dst = values + r * p.out_cols + c;
    if (p.out_cols % 4 == 0 && c < p.out_cols)
      *reinterpret_cast<uint32_t *>(dst) = packed;
    else
      for (int j = 0; j < 4 && c + j < p.out_cols; j++) dst[j] = uint8_t(packed >> (8 * j));
  }
};

// sizeof(Raw) / sizeof(In) elements of x's row r from column c, as raw bytes: one vector load where the
// row allows it (vector_loads: 16-byte rows; c a multiple of the chunk), else element by element; zeros
// outside the input and at or past the row limit.
template <typename In, typename Raw>
__device__ __forceinline__ Raw load_chunk(const QuantParams &p, const In *x, long long r, long long c, int limit) {
  constexpr int VEC = sizeof(Raw) / sizeof(In);
  if (r < limit && p.vector_loads && c + VEC <= p.cols) return *reinterpret_cast<const Raw *>(x + r * p.cols + c);
  Raw raw;
  In *e = reinterpret_cast<In *>(&raw);
#pragma unroll
  for (int j = 0; j < VEC; j++) e[j] = r < limit && c + j < p.cols ? x[r * p.cols + c + j] : In(0.0f);
  return raw;
}

// The input tile [T rows][T cols] from (r0, c0), as float32, into s; zeros outside the input and at
// or past the row limit. 16-byte loads where the rows allow them, all of a thread's issued before the
// first is stored.
template <typename In>
__device__ void load_tile(const QuantParams &p, float *s, int b, long long r0, long long c0, int limit) {
  constexpr int VEC = 16 / sizeof(In), PER_ROW = T / VEC, PER_THREAD = T * PER_ROW / THREADS;
  static_assert(PER_THREAD * THREADS == T * PER_ROW);
  const In *x = static_cast<const In *>(p.x) + (long long)b * p.rows * p.cols;
  uint4 raw[PER_THREAD];
#pragma unroll
  for (int k = 0; k < PER_THREAD; k++) {
    const int i = threadIdx.x + k * THREADS;
    raw[k] = load_chunk<In, uint4>(p, x, r0 + i / PER_ROW, c0 + i % PER_ROW * VEC, limit);
  }
#pragma unroll
  for (int k = 0; k < PER_THREAD; k++) {
    const int i = threadIdx.x + k * THREADS, ir = i / PER_ROW, ic = i % PER_ROW * VEC;
    const long long r = r0 + ir;
    const float scale = x_scale(p, r, c0, limit);
    const In *e = reinterpret_cast<const In *>(&raw[k]);
#pragma unroll
    for (int j = 0; j < VEC; j++) s[ir * PITCH + ic + j] = to_float(e[j]) * scale;
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

// Untransposed: warp w takes rows 16 w .. 16 w + 15 of the tile, lane l its columns 4 l .. 4 l + 3.
template <typename In> __global__ void __launch_bounds__(THREADS) quantize_rows_kernel(const QuantParams p) {
  constexpr int WARPS = THREADS / 32, ROWS = T / WARPS, VEC = T / 32;
  // (a lane's VEC values of a row: 8 bytes of bf16, 16 of float32, 4 of float8)
  using Raw = std::conditional_t<VEC * sizeof(In) == 16, uint4, std::conditional_t<VEC * sizeof(In) == 8, uint2, uint32_t>>;
  static_assert(sizeof(Raw) == VEC * sizeof(In) && VEC == 4);  // (a lane stores 4 bytes of a row: Out::store4)
  __shared__ float warps_max[WARPS];
  const int b = blockIdx.z, w = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long long r0 = (long long)blockIdx.y * T + ROWS * w, c0 = (long long)blockIdx.x * T, c = c0 + VEC * lane;
  const int limit = row_limit(p);
  const In *x = static_cast<const In *>(p.x) + (long long)b * p.rows * p.cols;
  Raw raw[ROWS];
#pragma unroll
  for (int i = 0; i < ROWS; i++) raw[i] = load_chunk<In, Raw>(p, x, r0 + i, c, limit);
  // Row i's values (an FP8 input times its scale) and maxima.
  float xs[ROWS], amax[ROWS];
#pragma unroll
  for (int i = 0; i < ROWS; i++) xs[i] = x_scale(p, r0 + i, c0, limit);
  auto value = [&](int i, int j) { return to_float(reinterpret_cast<const In *>(&raw[i])[j]) * xs[i]; };
#pragma unroll
  for (int i = 0; i < ROWS; i++) {
    amax[i] = 0.0f;
#pragma unroll
    for (int j = 0; j < VEC; j++) amax[i] = fmaxf(amax[i], fabsf(value(i, j)));
  }
  if (p.block_rows == 1) {
#pragma unroll
    for (int i = 0; i < ROWS; i++) amax[i] = warp_max(amax[i]);
  } else {  // (one block: the tile's maximum)
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < ROWS; i++) m = fmaxf(m, amax[i]);
    m = warp_max(m);
    if (lane == 0) warps_max[w] = m;
    __syncthreads();
#pragma unroll
    for (int k = 0; k < WARPS; k++) m = fmaxf(m, warps_max[k]);
#pragma unroll
    for (int i = 0; i < ROWS; i++) amax[i] = m;
  }
  const Out out(p, b);
#pragma unroll
  for (int i = 0; i < ROWS; i++) {
    const long long r = r0 + i;
    if (r >= p.out_rows) break;
    const float d = scale_of(amax[i]), inv = __frcp_rn(d);
    if (lane == 0 && (p.block_rows == 1 || r % T == 0)) out.scale(p, r, c0, d);
    uint32_t packed = 0;
#pragma unroll
    for (int j = 0; j < VEC; j++)
      packed |= uint32_t(__nv_cvt_float_to_fp8(fp8_quotient(value(i, j), d, inv), __NV_SATFINITE, __NV_E4M3)) << (8 * j);
    out.store4(p, r, c, packed);
  }
}

// Transposed: output row t is the tile's column t.
template <typename In> __global__ void __launch_bounds__(THREADS) quantize_transposed_kernel(const QuantParams p) {
  extern __shared__ float s[];  // [T][PITCH]: the input tile
  __shared__ float row_scale[T], row_inv[T];
  const int b = blockIdx.z;
  const long long o_r0 = (long long)blockIdx.y * T, o_c0 = (long long)blockIdx.x * T;  // the output tile
  load_tile<In>(p, s, b, o_c0, o_r0, row_limit(p));
  __syncthreads();
  // Output row t's elements: s[*][t] (a warp's threads read one row of s: no bank conflicts).
  const int t = threadIdx.x;
  if (t < T) {
    float amax = 0.0f;
    for (int j = 0; j < T; j++) amax = fmaxf(amax, fabsf(s[j * PITCH + t]));
    row_scale[t] = amax;
  }
  __syncthreads();
  if (p.block_rows == T && t < 32) {  // (one block: the tile's maximum)
    float amax = 0.0f;
    for (int j = t; j < T; j += 32) amax = fmaxf(amax, row_scale[j]);
    amax = warp_max(amax);
    __syncwarp();
    for (int j = t; j < T; j += 32) row_scale[j] = amax;
  }
  __syncthreads();
  if (t < T) {
    row_scale[t] = scale_of(row_scale[t]);
    row_inv[t] = __frcp_rn(row_scale[t]);
  }
  __syncthreads();
  const Out out(p, b);
  if (t < T && o_r0 + t < p.out_rows && (p.block_rows == 1 || t == 0)) out.scale(p, o_r0 + t, o_c0, row_scale[t]);
  for (int i = t; i < T * T / 4; i += THREADS) {
    const int orow = i / (T / 4), oc = i % (T / 4) * 4;
    const long long r = o_r0 + orow, c = o_c0 + oc;
    if (r >= p.out_rows || c >= p.out_cols) continue;
    // Lane l reads its 4 columns starting from the (l / 8 % 4)-th: lanes 8 apart, whose columns are 32
    // rows of s apart (one bank), then read different banks. The bytes are rotated back into place.
    const int rot = (i % 32) / 8;
    uint32_t packed = 0;
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const int col = oc + (j + rot) % 4;
      const float x = s[col * PITCH + orow];
      packed |= uint32_t(__nv_cvt_float_to_fp8(fp8_quotient(x, row_scale[orow], row_inv[orow]), __NV_SATFINITE, __NV_E4M3)) << (8 * j);
    }
    out.store4(p, r, c, __funnelshift_l(packed, packed, 8 * rot));  // (rotated: byte j to byte (j + rot) % 4)
  }
}

template <typename In> cudaError_t launch(const QuantParams &p, cudaStream_t stream) {
  const dim3 grid((p.out_cols + T - 1) / T, (p.out_rows + T - 1) / T, p.batch);
  if (!p.transposed) {
    quantize_rows_kernel<In><<<grid, THREADS, 0, stream>>>(p);
    return cudaGetLastError();
  }
  constexpr int smem = T * PITCH * sizeof(float);
  if (auto e = cudaFuncSetAttribute(quantize_transposed_kernel<In>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      e != cudaSuccess)
    return e;
  quantize_transposed_kernel<In><<<grid, THREADS, smem, stream>>>(p);
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
