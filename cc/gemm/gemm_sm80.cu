// Grouped GEMM on mma.sync (sm_80 and newer): the portable kernel, and the reference the Hopper one
// is checked against on the same GPU.
//
// A persistent grid (a few blocks per SM) takes the tiles in the order of common.cuh (block b: t =
// b, b + G, ...; warp 0 finds each tile's group, GroupWalk). A tile is 128 x 128 of out, 4 warps of
// 64 x 64; steps of 32 along the contraction come into shared memory with cp.async, through a ring
// of 3 slots (tk::cp_async_ring, refilled after the wait: one barrier a step). The loads zero-fill
// what lies outside the tile's group rows or past the arrays' columns (so the products need no
// masks, and CONTRACT's steps see only their group's rows); warps then read fragments with ldmatrix
// (transposing where the operand is M- or N-major) and multiply them with mma.sync m16n8k16 into
// fp32 registers, which go straight to global memory, rows and columns outside the tile's part of
// out skipped.
#include <algorithm>
#include <climits>

#include "gemm/common.cuh"

namespace jax_tk::gemm {
namespace {

using namespace tk;

enum Kind { RAGGED = 0, RAGGED_BT = 1, CONTRACT = 2 };

template <typename T, int KIND> struct Sm80 {
  static constexpr int TM = SM80_TILE_M, TN = SM80_TILE_N, TK = SM80_TILE_K, STAGES = 3, THREADS = 128;
  static_assert(TM == 128 && TN == 128, "4 warps of 64 x 64");
  using ATile = std::conditional_t<KIND == CONTRACT, st<T, TK, TM>, st<T, TM, TK>>;
  using BTile = std::conditional_t<KIND == RAGGED_BT, st<T, TN, TK>, st<T, TK, TN>>;
  struct Shared {
    ATile a[STAGES];
    BTile b[STAGES];
    TileSlot tile;
  };
  static constexpr size_t smem = sizeof(Shared) + 1024;
};

// cp.async of dst's rows from rows row0.. of a row-major matrix (ld elements per row) at columns
// col0..: rows outside [lo, hi) and columns at or past `cols` become zeros (cols is a multiple of
// 8, so a 16-byte chunk is all in or all out).
template <int THREADS, SharedTile ST, typename T>
__device__ __forceinline__ void load_rows(ST &dst, const T *base, long long ld, int row0, int lo, int hi, int col0,
                                          int cols, int tid) {
  constexpr int row_chunks = ST::cols / ST::chunk;
#pragma unroll
  for (int i = tid; i < ST::rows * row_chunks; i += THREADS) {
    const int r = i / row_chunks, c = (i % row_chunks) * ST::chunk;
    const int gr = row0 + r, gc = col0 + c;
    const bool valid = gr >= lo && gr < hi && gc < cols;
    cp_async16(&dst(r, c), valid ? base + gr * ld + gc : base, valid);
  }
}

template <typename T, typename TO, int KIND>
__global__ __launch_bounds__(Sm80<T, KIND>::THREADS) void ragged_sm80_kernel(const __grid_constant__ Params p) {
  using C = Sm80<T, KIND>;
  constexpr int TM = C::TM, TN = C::TN, TK = C::TK, STAGES = C::STAGES, THREADS = C::THREADS;
  extern __shared__ char smem_raw[];
  auto &sm = align_shared<typename C::Shared>(smem_raw);
  const T *A = static_cast<const T *>(p.a), *B = static_cast<const T *>(p.b);
  const int tid = threadIdx.x, wm = warpid() / 2, wn = warpid() % 2;
  GroupWalk<TM, TN> walk;  // (warp 0's)
  for (long long t = blockIdx.x;; t += gridDim.x) {
    __syncthreads();  // every warp is done with the last tile's slot and stages
    if (warpid() == 0) {
      const TileSlot x = t < INT_MAX ? walk.find(p, int(t)) : TileSlot{INT_MAX, 0, 0, 0, 0, 0};
      if (laneid() == 0) sm.tile = x;
    }
    __syncthreads();
    const TileSlot x = sm.tile;
    if (x.t == INT_MAX) break;
    const int count = KIND == CONTRACT ? (x.r1 - x.r0 + TK - 1) / TK : x.group >= 0 ? (p.k + TK - 1) / TK : 0;
    auto load = [&](int j, int s) {
      const int k0 = j * TK;
      if constexpr (KIND == CONTRACT) {
        load_rows<THREADS>(sm.a[s], A, p.k, x.r0 + k0, x.r0, x.r1, x.m0, p.k, tid);
        load_rows<THREADS>(sm.b[s], B, p.n, x.r0 + k0, x.r0, x.r1, x.n0, p.n, tid);
      } else {
        load_rows<THREADS>(sm.a[s], A, p.k, x.m0, 0, x.r1, k0, p.k, tid);
        const T *bg = B + size_t(x.group) * p.k * p.n;
        if constexpr (KIND == RAGGED) load_rows<THREADS>(sm.b[s], bg, p.n, k0, 0, p.k, x.n0, p.n, tid);
        else load_rows<THREADS>(sm.b[s], bg, p.k, x.n0, 0, p.n, k0, p.k, tid);
      }
    };
    rt_fl<64, 64> acc;
    warp::zero(acc);
    const cp_async_ring<STAGES, refill::after_wait> steps;  // use j: step j along the contraction
#pragma unroll
    for (int u = 0; u < steps.AHEAD; u++) {  // the ring's prologue
      if (u < count) load(u, steps.slot(u));
      commit(steps);
    }
    for (int j = 0; j < count; j++) {
      wait_full(steps);  // step j has landed (everyone's copies), and step j - 1's slot is free
      if (j + steps.AHEAD < count) load(j + steps.AHEAD, steps.fill_slot(j + steps.AHEAD));
      commit(steps);
      const int s = steps.slot(j);
      if constexpr (KIND == CONTRACT) {
        rt<T, TK, 64, col_l> fa, fb;
        warp::load(fa, sm.a[s], 0, 64 * wm);
        warp::load(fb, sm.b[s], 0, 64 * wn);
        warp::mma_AtB(acc, fa, fb, acc);
      } else if constexpr (KIND == RAGGED) {
        rt<T, 64, TK> fa;
        rt<T, TK, 64, col_l> fb;
        warp::load(fa, sm.a[s], 64 * wm, 0);
        warp::load(fb, sm.b[s], 0, 64 * wn);
        warp::mma_AB(acc, fa, fb, acc);
      } else {
        rt<T, 64, TK> fa, fb;
        warp::load(fa, sm.a[s], 64 * wm, 0);
        warp::load(fb, sm.b[s], 64 * wn, 0);
        warp::mma_ABt(acc, fa, fb, acc);
      }
    }
    drain(steps);

    // out: rows of the tile's group (CONTRACT: rows < k of out[group]), columns < n
    const int rows = KIND == CONTRACT ? p.k : x.r1;
    TO *out = static_cast<TO *>(p.out) + (KIND == CONTRACT ? size_t(x.group) * p.k * p.n : 0);
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
      for (int j = 0; j < 4; j++)
#pragma unroll
        for (int q = 0; q < 4; q++) {
          const int r = x.m0 + 64 * wm + 16 * i + laneid() / 4 + 8 * (q % 2);
          const int c = x.n0 + 64 * wn + 16 * j + 2 * (laneid() % 4) + 8 * (q / 2);
          if (r < rows && c < p.n)
            *reinterpret_cast<packed<TO> *>(out + size_t(r) * p.n + c) = from_float2<packed<TO>>(acc.tiles[i][j].data[q]);
        }
  }
}

template <typename T, typename TO, int KIND> cudaError_t launch(const Params &p, cudaStream_t stream) {
  using C = Sm80<T, KIND>;
  auto kernel = ragged_sm80_kernel<T, TO, KIND>;
  int dev = 0, sms = 0, per_sm = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e == cudaSuccess) e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(C::smem));
  if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, C::THREADS, C::smem);
  if (e != cudaSuccess) return e;
  const long long tiles = tile_bound(p, C::TM, C::TN), blocks = (long long)sms * std::max(per_sm, 1);
  if (tiles + 2 * blocks >= INT_MAX) return cudaErrorInvalidValue;
  kernel<<<unsigned(std::min(tiles, blocks)), C::THREADS, C::smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, typename TO> cudaError_t launch_kind(const Params &p, cudaStream_t stream) {
  if (p.mode == MODE_CONTRACT) return launch<T, TO, CONTRACT>(p, stream);
  return p.b_transposed ? launch<T, TO, RAGGED_BT>(p, stream) : launch<T, TO, RAGGED>(p, stream);
}

}  // namespace

cudaError_t ragged_sm80(const Params &p, cudaStream_t stream) {
  if (p.mode == MODE_CONTRACT && p.b_transposed) return cudaErrorNotSupported;  // (sm_90a's only)
  if (p.dtype == DType::bf16) return p.out_f32 ? launch_kind<bf16, float>(p, stream) : launch_kind<bf16, bf16>(p, stream);
  return p.out_f32 ? launch_kind<half, float>(p, stream) : launch_kind<half, half>(p, stream);
}

}  // namespace jax_tk::gemm
