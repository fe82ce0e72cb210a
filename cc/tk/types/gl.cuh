// gl: a view of a 4-D global tensor [b, s, h, d] (pointer, shape, strides in elements). Tiles are
// taken with their rows along s and their columns along d, at fixed (b, h): exactly the
// [batch, seq, heads, head_dim] layout, read in place with no transposes.
#pragma once
#include "../common/base.cuh"

namespace tk {

struct coord {
  int b = 0, s = 0, h = 0, d = 0;
};

template <typename T> struct gl {
  T *ptr;
  int dims[4];
  int64_t strides[4];

  // A contiguous [b, s, h, d] tensor.
  __host__ __device__ static gl make(T *p, int b, int s, int h, int d) {
    return gl{p, {b, s, h, d}, {int64_t(s) * h * d, int64_t(h) * d, d, 1}};
  }
  __host__ __device__ T *at(int b, int s, int h, int d) const {
    return ptr + b * strides[0] + s * strides[1] + h * strides[2] + d * strides[3];
  }
  __host__ __device__ T *at(coord c) const { return at(c.b, c.s, c.h, c.d); }
  __host__ __device__ int seq() const { return dims[1]; }
  __host__ __device__ int cols() const { return dims[3]; }
};

}  // namespace tk
