// What the standalone drivers of the kernels share: CUDA error checks and random device buffers.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include <cuda_runtime.h>

#define CHECK(x)                                                                          \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

template <typename T> T *device_random(size_t n, std::mt19937 &rng) {
  std::normal_distribution<float> dist;
  std::vector<T> host(n);
  for (auto &x : host) x = T(dist(rng));
  T *d;
  CHECK(cudaMalloc(&d, n * sizeof(T)));
  CHECK(cudaMemcpy(d, host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}
