// sv: shared vector, N contiguous elements in shared memory.
#pragma once
#include "../common/base.cuh"

namespace tk {

template <typename T, int N> struct sv {
  static_assert(is_element<T>);
  using dtype = T;
  static constexpr int length = N;
  alignas(16) T data[N];
  __device__ __forceinline__ T &operator[](int i) { return data[i]; }
  __device__ __forceinline__ const T &operator[](int i) const { return data[i]; }
};

}  // namespace tk
