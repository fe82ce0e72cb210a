// Unit-test kernels for the Hopper layer of the tile language (see hopper_ops.h for what each
// computes). The kernel bodies exist only in the sm_90a pass; other passes compile empty kernels,
// which the launchers never start on a GPU other than compute capability 9.0.
#include "tests/hopper_ops.h"
#include "tk/tk.cuh"

namespace jax_tk::tests {
namespace {

using namespace tk;

// Dynamic shared memory as an S, its base rounded up to 1024 bytes (swizzled tiles need it).
template <typename S> __device__ __forceinline__ S &shared_as() {
  extern __shared__ char smem_raw[];
  return *reinterpret_cast<S *>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
}

// ------------------------------------------------------------------------------------------------
// 1. TMA load of one tile into a swizzled shared tile, completing on a semaphore
// ------------------------------------------------------------------------------------------------

template <typename T, int ROWS, int D> struct TmaLoad {
  struct Shared {
    st<T, ROWS, D> tile;
    semaphore full;
  };
  struct Args {
    tma_map<T, ROWS> map;
    coord origin;
    T *out;
  };
};

template <typename T, int ROWS, int D>
__global__ void tma_load_kernel(const __grid_constant__ typename TmaLoad<T, ROWS, D>::Args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  auto &sm = shared_as<typename TmaLoad<T, ROWS, D>::Shared>();
  if (threadIdx.x == 0) {
    init(sm.full, 1);
    fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    arrive_expect_bytes(sm.full, sizeof(sm.tile.data));  // the whole box: zero-filled rows count too
    load_async(sm.tile, a.map, a.origin, sm.full);
  }
  wait(sm.full, 0);
  for (int i = threadIdx.x; i < ROWS * D; i += blockDim.x) a.out[i] = sm.tile(i / D, i % D);  // through st's swizzle
#endif
}

// ------------------------------------------------------------------------------------------------
// 2. wgmma: one warpgroup, operands in shared memory (or A in registers), fp32 accumulator
// ------------------------------------------------------------------------------------------------

// The compiled cases: product, N, K, then the shapes of the A and B tiles. The product reads the
// bottom-right window of each tile that it needs (the tile itself when the sizes match), so the
// windows below start at row or column 64 (or 32) of their tile, as in the Hopper backward.
#define TK_WGMMA_CASES(X)                                                             \
  X(ABT, 32, 64, 64, 64, 32, 64)                                                      \
  X(ABT, 64, 64, 64, 64, 64, 64)                                                      \
  X(ABT, 128, 64, 64, 64, 128, 64)                                                    \
  X(ABT, 32, 128, 64, 128, 32, 128)                                                   \
  X(ABT, 64, 128, 64, 128, 64, 128)                                                   \
  X(ABT, 128, 128, 64, 128, 128, 128)                                                 \
  X(ABT, 64, 64, 128, 64, 64, 64)     /* A: rows 64.. of 128 (K rows, D = 64) */      \
  X(ABT, 64, 128, 128, 128, 64, 128)  /* A: rows 64.. of 128 (D = 128) */             \
  X(ABT, 64, 64, 64, 128, 64, 128)    /* A and B: columns 64.. of 128 (K window) */   \
  X(ABT, 64, 64, 64, 64, 128, 64)     /* B: rows 64.. of 128 */                       \
  X(ABT, 256, 64, 128, 64, 256, 64)   /* N = 256, A: rows 64.. of 128 (grouped GEMM) */ \
  X(ATB, 64, 64, 64, 64, 64, 64)                                                      \
  X(ATB, 128, 64, 64, 64, 64, 128)                                                    \
  X(ATB, 64, 128, 128, 64, 128, 64)                                                   \
  X(ATB, 128, 128, 128, 64, 128, 128)                                                 \
  X(ATB, 64, 128, 128, 64, 128, 128)  /* B: columns 64.. of 128 (dQ columns, D = 128) */ \
  X(ATB, 32, 128, 128, 64, 128, 64)   /* B: columns 32.. of 64 (dQ columns, D = 64) */   \
  X(ATB, 64, 64, 64, 128, 64, 64)     /* A: columns 64.. of 128 */                    \
  X(ATB, 64, 64, 128, 64, 128, 64)    /* A and B: rows 64.. of 128 (K window) */      \
  X(ATB, 256, 64, 64, 128, 64, 256)   /* N = 256, A: columns 64.. of 128 (grouped GEMM) */ \
  X(AB_SHARED, 64, 64, 64, 64, 64, 64)                                                \
  X(AB_SHARED, 128, 64, 64, 64, 64, 128)                                              \
  X(AB_SHARED, 64, 128, 64, 128, 128, 64)                                             \
  X(AB_SHARED, 128, 128, 64, 128, 128, 128)                                           \
  X(AB_SHARED, 64, 64, 128, 64, 64, 64)    /* A: rows 64.. of 128 (dS^T, D = 64) */   \
  X(AB_SHARED, 128, 64, 128, 64, 64, 128)  /* A: rows 64.. of 128 (dS^T, D = 128) */  \
  X(AB_SHARED, 64, 64, 64, 128, 128, 128)  /* A: columns 64..; B: rows and columns 64.. */ \
  X(AB_SHARED, 32, 64, 64, 64, 64, 64)     /* B: columns 32.. of 64 */                \
  X(AB_SHARED, 256, 64, 128, 64, 64, 256) /* N = 256, A: rows 64.. of 128 (grouped GEMM) */ \
  X(AB_REGS, 64, 64, 64, 64, 64, 64)                                                  \
  X(AB_REGS, 128, 64, 64, 64, 64, 128)                                                \
  X(AB_REGS, 64, 128, 64, 128, 128, 64)                                               \
  X(AB_REGS, 128, 128, 64, 128, 128, 128)                                             \
  X(AB_REGS, 64, 64, 128, 128, 128, 128)   /* A, B: rows and columns 64.. of 128 x 128 */ \
  X(AB_REGS, 32, 64, 64, 64, 64, 64)       /* B: columns 32.. of 64 */

// FP8 (e4m3) operands: mma_ABt only (8-bit wgmma reads both K-major), tiles a whole 128-byte panel
// wide, k steps of 32.
#define TK_WGMMA_FP8_CASES(X)                                                           \
  X(ABT, 64, 128, 64, 128, 64, 128)                                                     \
  X(ABT, 128, 128, 64, 128, 128, 128)                                                   \
  X(ABT, 256, 128, 64, 128, 256, 128)                                                   \
  X(ABT, 128, 256, 64, 256, 128, 256)  /* two panels along k */                         \
  X(ABT, 64, 128, 128, 128, 64, 128)   /* A: rows 64.. of 128 */                        \
  X(ABT, 64, 128, 64, 256, 64, 256)    /* A and B: the second panel along k (K window) */

template <typename T, int N, int AR, int AC, int BR, int BC> struct WgmmaShared {
  st<T, AR, AC> a;
  st<T, BR, BC> b;
  alignas(16) float frag[64 * N];  // the result in fragment order
};

// The R x C window at the bottom-right corner of t, or t itself when that is all of it.
template <int R, int C, SharedTile ST> __device__ __forceinline__ decltype(auto) corner(ST &t) {
  if constexpr (R == ST::rows && C == ST::cols) return (t);
  else return window<R, C>(t, ST::rows - R, ST::cols - C);
}

template <typename T, int P, int N, int K, int AR, int AC, int BR, int BC>
__global__ __launch_bounds__(128, 1) void wgmma_kernel(const __grid_constant__ WgmmaArgs x) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  auto &sm = shared_as<WgmmaShared<T, N, AR, AC, BR, BC>>();
  // Operands global -> shared with ordinary stores through st's swizzled layout, then fenced so
  // that wgmma (the async proxy) sees them.
  const T *a = static_cast<const T *>(x.a), *b = static_cast<const T *>(x.b);
  for (int i = threadIdx.x; i < AR * AC; i += 128) sm.a(i / AC, i % AC) = a[i];
  for (int i = threadIdx.x; i < BR * BC; i += 128) sm.b(i / BC, i % BC) = b[i];
  warpgroup::fence_shared_writes();
  __syncthreads();

  // The accumulator starts as c, read as each warp's 16 rows of a row-layout tile (the layout the
  // wgmma accumulator must have); accumulate = false must ignore it.
  const int row0 = 16 * warpid();
  rt_fl<16, N> d;
  warp::load(d, gl<const float>::make(x.c, 1, 64, 1, N), {0, row0, 0, 0});
  if constexpr (P == ABT) {
    warpgroup::mma_ABt(d, corner<64, K>(sm.a), corner<N, K>(sm.b), x.accumulate);
  } else if constexpr (P == ATB) {
    warpgroup::mma_AtB(d, corner<K, 64>(sm.a), corner<K, N>(sm.b), x.accumulate);
  } else if constexpr (P == AB_SHARED) {
    warpgroup::mma_AB(d, corner<64, K>(sm.a), corner<K, N>(sm.b), x.accumulate);
  } else {
    static_assert(P == AB_REGS);
    rt<T, 16, K> ra;  // this warp's 16 rows of A's window (ldmatrix from the swizzled tile)
    warp::load(ra, sm.a, AR - 64 + row0, AC - K);
    warpgroup::mma_AB(d, ra, corner<K, N>(sm.b), x.accumulate);
  }
  warpgroup::wait<0>();
  warpgroup::fence_registers(d);
  if (x.fragments == 2) {  // as the Hopper backward adds dQ up: vector reductions in global memory
    for (int i = threadIdx.x; i < 64 * N; i += 128) x.out[i] = 0.f;
    __syncthreads();
    warpgroup::reduce_add_fragments(x.out, d);
    warpgroup::reduce_add_fragments(x.out, d);
    __threadfence();
    __syncthreads();
    for (int i = threadIdx.x; i < 64 * N; i += 128) sm.frag[i] = __ldcg(x.out + i);  // fragment order
    __syncthreads();
    for (int i = threadIdx.x; i < 64 * N; i += 128) x.out[i] = sm.frag[warpgroup::fragment_offset<N>(i / N, i % N)];
  } else if (x.fragments == 1) {  // as a tile staged in shared memory: registers as they are, read back by position
    warpgroup::store_fragments(sm.frag, d);
    __syncthreads();
    for (int i = threadIdx.x; i < 64 * N; i += 128) x.out[i] = sm.frag[warpgroup::fragment_offset<N>(i / N, i % N)];
  } else {
    warp::store(gl<float>::make(x.out, 1, 64, 1, N), d, {0, row0, 0, 0});
  }
#endif
}

// ------------------------------------------------------------------------------------------------
// 3. Bulk reduce-add of a shared fp32 tile into global memory, from several blocks
// ------------------------------------------------------------------------------------------------

using ReduceTile = st<float, 64, 64>;

__global__ void reduce_add_kernel(const __grid_constant__ ReduceAddArgs x) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  auto &tile = shared_as<ReduceTile>();
  for (int r = 0; r < x.rounds; r++) {
    // In memory order: the copy engine adds the tile's bytes as they sit in shared memory.
    const float *src = x.x + (size_t(blockIdx.x) * x.rounds + r) * (64 * 64);
    for (int i = threadIdx.x; i < 64 * 64; i += blockDim.x) tile.data[i] = src[i];
    warpgroup::fence_shared_writes();  // ordinary writes -> the copy engine (async proxy)
    __syncthreads();
    if (threadIdx.x == 0) {
      reduce_add_async(x.out, tile.data, sizeof(tile.data));
      bulk_commit();
      bulk_wait_read<0>();  // the copy engine has read the tile...
    }
    __syncthreads();  // ...so the next round may overwrite it
  }
  if (threadIdx.x == 0) bulk_wait<0>();  // and its adds are done
#endif
}

// ------------------------------------------------------------------------------------------------
// 4. Producer/consumer ring (tk/pipeline): tensor and plain bulk copies through 2 slots with
//    full/empty semaphores, register reallocation (roles), a named barrier among the consumers
// ------------------------------------------------------------------------------------------------

template <typename T, int D> struct Ring {
  using Roles = roles</*CONSUMERS=*/2, /*PRODUCER_REGS=*/24, /*CONSUMER_REGS=*/240>;
  static constexpr int ROWS = 128, STAGES = 2, CONSUMERS = Roles::CONSUMERS, THREADS = Roles::THREADS;
  struct Shared {
    st<T, ROWS, D> tile[STAGES];
    alignas(16) float w[STAGES][ROWS];  // the tile's row weights
    st<float, ROWS, D> sum;
    semaphore full[STAGES], empty[STAGES];
  };
  struct Args {
    tma_map<T, ROWS> map;
    const float *w;
    int b, h, n_tiles;
    float *out;
  };
};

template <typename T, int D>
__global__ __launch_bounds__(Ring<T, D>::THREADS, 1) void ring_kernel(const __grid_constant__ typename Ring<T, D>::Args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using R = Ring<T, D>;
  using Roles = typename R::Roles;
  auto &sm = shared_as<typename R::Shared>();
  const int wg = warpgroup::groupid();
  const ring<R::STAGES> slots{sm.full, sm.empty};
  if (threadIdx.x == 0) {
    init(slots, 1, R::CONSUMERS * 4);  // full: the producer's arrival (+ the bytes of both copies); empty: each consumer warp
    fence_barrier_init();
  }
  __syncthreads();

  if (wg == Roles::PRODUCER) {  // one thread issues every load; the others leave
    Roles::enter_producer();
    if (threadIdx.x == 128 * R::CONSUMERS) {
      for (int j = 0; j < a.n_tiles; j++) {
        const ring_use<R::STAGES> u(j);
        wait_empty(slots, u);  // tile j - STAGES is consumed (passes at once the first time round)
        arrive_expect_bytes(slots.full(u), sizeof(sm.tile[u.slot].data) + sizeof(sm.w[u.slot]));
        load_async(sm.tile[u.slot], a.map, {a.b, j * R::ROWS, a.h, 0}, slots.full(u));  // tensor copy
        load_async(sm.w[u.slot], a.w + j * R::ROWS, sizeof(sm.w[u.slot]), slots.full(u));  // plain bulk copy
      }
    }
    return;
  }

  // consumers: warpgroup wg adds up rows 64 wg .. 64 wg + 64, this warp 16 of them
  Roles::enter_consumer();
  const int row0 = 64 * wg + 16 * (warpid() % 4);
  rt_fl<16, D> acc, xf;
  rt<T, 16, D> x;
  col_vec<rt_fl<16, D>> w;
  warp::zero(acc);
  ring_pos<R::STAGES> at(0);
  for (int j = 0; j < a.n_tiles; j++, ++at) {
    wait_full(slots, at);
    warp::load(x, sm.tile[at.slot], row0, 0);
    warp::load(w, sm.w[at.slot] + row0, 16);
    __syncwarp();  // every lane has read the slot before lane 0 frees it
    if (laneid() == 0) arrive_empty(slots, at);
    warp::copy(xf, x);
    warp::mul_row(xf, xf, w);
    warp::add(acc, acc, xf);
  }
  // Swap halves through shared memory: each warpgroup writes out the rows the other one summed.
  // The producer has left, so only the consumers' threads meet, at a named barrier.
  warp::store(sm.sum, acc, row0, 0);
  sync_named(1, 128 * R::CONSUMERS);
  const int other = 64 * (1 - wg);
  for (int i = threadIdx.x % 128; i < 64 * D; i += 128) {
    const int r = other + i / D, c = i % D;
    a.out[r * D + c] = sm.sum(r, c);
  }
#endif
}

// ------------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------------

bool is_sm90() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  return major == 9 && minor == 0;
}

// Launches kernel(args) with sizeof(Shared) bytes of dynamic shared memory (+ alignment room).
template <typename Shared, typename Args>
cudaError_t launch(void (*kernel)(Args), dim3 grid, int threads, const Args &args, cudaStream_t stream) {
  if (!is_sm90()) return cudaErrorNoKernelImageForDevice;  // sm_90a code only
  const size_t smem = sizeof(Shared) + 1024;
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
      e != cudaSuccess)
    return e;
  kernel<<<grid, threads, smem, stream>>>(args);
  return cudaGetLastError();
}

template <typename F> cudaError_t by_dtype(Elem e, F f) {
  return e == Elem::bf16 ? f.template operator()<bf16>() : f.template operator()<half>();
}

template <typename T, int ROWS, int D> cudaError_t tma_load_as(const TmaLoadArgs &x, cudaStream_t stream) {
  using C = TmaLoad<T, ROWS, D>;
  typename C::Args a{{}, {x.b, x.s0, x.h, 0}, static_cast<T *>(x.out)};
  if (!make_tma_map(a.map, x.x, x.batch, x.seq, x.heads, D)) return cudaErrorInvalidValue;
  return launch<typename C::Shared>(tma_load_kernel<T, ROWS, D>, 1, 128, a, stream);
}

template <typename T, int D> cudaError_t ring_as(const RingArgs &x, cudaStream_t stream) {
  using C = Ring<T, D>;
  typename C::Args a{{}, x.w, x.b, x.h, x.n_tiles, x.out};
  if (!make_tma_map(a.map, x.x, x.batch, x.seq, x.heads, D)) return cudaErrorInvalidValue;
  return launch<typename C::Shared>(ring_kernel<T, D>, 1, C::THREADS, a, stream);
}

bool is_case(const WgmmaArgs &x, int p, int n, int k, int ar, int ac, int br, int bc) {
  return x.product == p && x.n == n && x.k == k && x.a_rows == ar && x.a_cols == ac && x.b_rows == br && x.b_cols == bc;
}

}  // namespace

cudaError_t launch_tma_load(const TmaLoadArgs &x, cudaStream_t stream) {
  return by_dtype(x.dtype, [&]<typename T>() {
    if (x.rows == 64 && x.dim == 64) return tma_load_as<T, 64, 64>(x, stream);
    if (x.rows == 64 && x.dim == 128) return tma_load_as<T, 64, 128>(x, stream);
    if (x.rows == 128 && x.dim == 64) return tma_load_as<T, 128, 64>(x, stream);
    if (x.rows == 128 && x.dim == 128) return tma_load_as<T, 128, 128>(x, stream);
    return cudaErrorInvalidValue;
  });
}

bool has_wgmma_case(const WgmmaArgs &x) {
#define TK_IS_CASE(P, N, K, AR, AC, BR, BC) if (is_case(x, P, N, K, AR, AC, BR, BC)) return true;
  if (x.dtype == Elem::fp8e4m3) {
    TK_WGMMA_FP8_CASES(TK_IS_CASE)
    return false;
  }
  TK_WGMMA_CASES(TK_IS_CASE)
#undef TK_IS_CASE
  return false;
}

cudaError_t launch_wgmma(const WgmmaArgs &x, cudaStream_t stream) {
#define TK_LAUNCH_CASE(P, N, K, AR, AC, BR, BC)                                                         \
  if (is_case(x, P, N, K, AR, AC, BR, BC))                                                              \
    return launch<WgmmaShared<T, N, AR, AC, BR, BC>>(wgmma_kernel<T, P, N, K, AR, AC, BR, BC>, 1, 128, x, stream);
  if (x.dtype == Elem::fp8e4m3) {
    using T = fp8e4m3;
    TK_WGMMA_FP8_CASES(TK_LAUNCH_CASE)
    return cudaErrorInvalidValue;
  }
  return by_dtype(x.dtype, [&]<typename T>() {
    TK_WGMMA_CASES(TK_LAUNCH_CASE)
    return cudaErrorInvalidValue;
  });
#undef TK_LAUNCH_CASE
}

cudaError_t launch_reduce_add(const ReduceAddArgs &x, cudaStream_t stream) {
  return launch<ReduceTile>(reduce_add_kernel, x.blocks, 128, x, stream);
}

cudaError_t launch_ring(const RingArgs &x, cudaStream_t stream) {
  return by_dtype(x.dtype, [&]<typename T>() {
    if (x.dim == 64) return ring_as<T, 64>(x, stream);
    if (x.dim == 128) return ring_as<T, 128>(x, stream);
    return cudaErrorInvalidValue;
  });
}

}  // namespace jax_tk::tests
