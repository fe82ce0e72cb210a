#include <cstdio>
__global__ void k(int *out, int n0, int n1) {
  __shared__ float w[64];
  const int g = threadIdx.x / 64, iters = g == 0 ? n0 : n1;
  for (int i = 0; i < iters; i++) asm volatile("bar.sync %0, 64;" ::"r"(1 + g) : "memory");
  __syncthreads();
  if (threadIdx.x < 64) w[threadIdx.x] = threadIdx.x;
  __syncthreads();
  out[threadIdx.x] = w[(threadIdx.x + 1) % 64];
}
int main(int argc, char **argv) {
  int n0 = atoi(argv[1]), n1 = atoi(argv[2]), *d;
  cudaMalloc(&d, 128 * 4);
  k<<<1, 128>>>(d, n0, n1);
  printf("%d %d: %s\n", n0, n1, cudaGetErrorString(cudaDeviceSynchronize()));
}
