// Element types, packed pairs, conversions and the warp/tile constants every other header uses.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>
#include <type_traits>

namespace tk {

using bf16 = __nv_bfloat16;
using half = __half;
using bf16_2 = __nv_bfloat162;
using half_2 = __half2;

constexpr int WARP_THREADS = 32;
constexpr int TILE = 16;  // register and shared tiles are made of TILE x TILE pieces
constexpr int MAX_SHARED_BYTES = 227 * 1024;  // the most shared memory a thread block may take on sm_90 (H100, H200)
struct Empty {};  // (a member a configuration does without: [[no_unique_address]] std::conditional_t<..., X, Empty>)

__device__ __forceinline__ int laneid() { return threadIdx.x & 31; }
__device__ __forceinline__ int warpid() { return threadIdx.x >> 5; }
// x, which every lane of the warp holds alike, made known as such to the compiler: what is worked
// out from it (e.g. the shared-memory descriptors of wgmma) then stays in uniform registers instead
// of being computed per thread and moved there before each use.
__device__ __forceinline__ int warp_uniform(int x) { return __shfl_sync(0xffffffff, x, 0); }

// Programmatic dependent launch (sm_90 and newer): a grid launched with it may start while the grid
// before it on the stream is finishing, and waits here until that grid has completed and its writes
// are visible; call it before reading anything an earlier kernel wrote. (A no-op for a grid launched
// without it, and before sm_90.)
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Named barrier `id` (1..15; 0 is __syncthreads' barrier) over `threads` threads (a multiple of 32).
__device__ __forceinline__ void sync_named(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// The same for threads that reach it at different instructions (e.g. warpgroups running code of their
// own): bar.sync is barrier.sync.aligned, which requires all of them to execute the one instruction.
__device__ __forceinline__ void sync_named_unaligned(int id, int threads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Count this warp's threads toward named barrier `id` without waiting (a signal to the threads that
// sync_named on it).
__device__ __forceinline__ void arrive_named(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// The same where the threads that wait run other code (see sync_named_unaligned).
__device__ __forceinline__ void arrive_named_unaligned(int id, int threads) {
  asm volatile("barrier.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// The struct S at the first 1024-byte boundary of a dynamic shared-memory array (swizzled tiles need
// that alignment). Arithmetic on the array's own pointer keeps its state space known, so that plain
// loads and stores of S's members compile to shared-memory instructions, not generic ones.
template <typename S> __device__ __forceinline__ S &align_shared(char *raw) {
  const uintptr_t pad = (1024 - (reinterpret_cast<uintptr_t>(raw) & 1023)) & 1023;
  return *reinterpret_cast<S *>(raw + pad);
}

template <typename T> constexpr bool is_16bit = std::is_same_v<T, bf16> || std::is_same_v<T, half>;
template <typename T> constexpr bool is_element = is_16bit<T> || std::is_same_v<T, float>;
// FP8 (e4m3) tiles live in shared memory only: wgmma reads them there, K-major (8-bit operands have
// no transposed form); the products' accumulators are float32 register tiles.
using fp8e4m3 = __nv_fp8_e4m3;
template <typename T> constexpr bool is_8bit = std::is_same_v<T, fp8e4m3>;

// packed<T>: the pair of T one register (or two, for float) holds.
template <typename T> struct packed_of;
template <> struct packed_of<float> { using type = float2; };
template <> struct packed_of<bf16> { using type = bf16_2; };
template <> struct packed_of<half> { using type = half_2; };
template <typename T> using packed = typename packed_of<T>::type;

// convert<To>(x): scalar and pair conversions with round-to-nearest.
template <typename To, typename From> __device__ __forceinline__ To convert(From x) {
  if constexpr (std::is_same_v<To, From>) return x;
  else if constexpr (std::is_same_v<From, float2>) {
    if constexpr (std::is_same_v<To, bf16_2>) return __float22bfloat162_rn(x);
    else { static_assert(std::is_same_v<To, half_2>); return __float22half2_rn(x); }
  } else if constexpr (std::is_same_v<To, float2>) {
    if constexpr (std::is_same_v<From, bf16_2>) return __bfloat1622float2(x);
    else { static_assert(std::is_same_v<From, half_2>); return __half22float2(x); }
  } else if constexpr (std::is_same_v<To, float>) {
    return static_cast<float>(x);
  } else if constexpr (std::is_same_v<From, float>) {
    if constexpr (std::is_same_v<To, bf16>) return __float2bfloat16_rn(x);
    else { static_assert(std::is_same_v<To, half>); return __float2half_rn(x); }
  } else if constexpr (sizeof(To) == 4 && sizeof(From) == 4) {
    return convert<To>(convert<float2>(x));  // bf16 pair <-> half pair
  } else {
    return convert<To>(convert<float>(x));  // bf16 <-> half
  }
}

// Pairs as two floats, and back: what elementwise maps compute in.
template <typename P> __device__ __forceinline__ float2 to_float2(P p) { return convert<float2>(p); }
template <typename P> __device__ __forceinline__ P from_float2(float2 f) { return convert<P>(f); }

}  // namespace tk
