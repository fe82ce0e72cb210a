// A timeline of the Hopper backward's thread blocks (diagnostic, no JAX): each block's start, its
// barriers, its K/V arriving, its first S^T, its loop's end, dK/dV in shared memory, and its end
// (%globaltimer), on which SM; printed as means per block and the gaps between blocks on an SM.
// Built against an instrumented copy of bwd_sm90.cu by scripts/bwd_timeline.py, which says how.
//   bwd_timeline B T H [causal]   (D = 128, bf16, plain attention)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <vector>
#include <cuda_bf16.h>
#include "attention/attention.h"
#include "driver.h"
using namespace jax_tk::attention;
namespace jax_tk::attention { cudaError_t bwd_trace_read(unsigned long long *host, size_t ctas); }
int main(int argc, char **argv) {
  int b = atoi(argv[1]), t = atoi(argv[2]), n = atoi(argv[3]), d = 128; bool causal = argc > 4 && atoi(argv[4]);
  std::mt19937 rng(1);
  Params p{}; p.dtype = DType::bf16; p.batch = b; p.q_len = t; p.kv_len = t; p.q_heads = n; p.kv_heads = n; p.head_dim = d;
  p.scale = 0.088f; p.causal = causal;
  size_t nq = size_t(b) * t * n * d, nr = size_t(b) * n * t;
  p.q = device_random<__nv_bfloat16>(nq, rng); p.k = device_random<__nv_bfloat16>(nq, rng); p.v = device_random<__nv_bfloat16>(nq, rng);
  p.dout = device_random<__nv_bfloat16>(nq, rng); p.dlse = device_random<float>(nr, rng);
  void *o, *dq, *dk, *dv; float *lse, *delta, *ws; int *tc;
  CHECK(cudaMalloc(&o, nq * 2)); CHECK(cudaMalloc(&dq, nq * 2)); CHECK(cudaMalloc(&dk, nq * 2)); CHECK(cudaMalloc(&dv, nq * 2));
  CHECK(cudaMalloc(&lse, nr * 4)); CHECK(cudaMalloc(&delta, nr * 4));
  CHECK(cudaMalloc(&ws, bwd_sm90_workspace_words(b, t, n, d) * 4)); CHECK(cudaMalloc(&tc, 4));
  p.o = o; p.lse = lse; p.dq = dq; p.dk = dk; p.dv = dv; p.delta = delta; p.workspace = ws; p.tile_counter = tc;
  CHECK(fwd_sm90(p, 0));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  for (int r = 0; r < 5; r++) CHECK(bwd_sm90(p, 0));
  cudaEventRecord(e0);
  for (int r = 0; r < 20; r++) CHECK(bwd_sm90(p, 0));
  cudaEventRecord(e1); CHECK(cudaDeviceSynchronize());
  float ms; cudaEventElapsedTime(&ms, e0, e1);
  const size_t ctas = size_t(b) * n * ((t + 127) / 128);
  std::vector<unsigned long long> tr(ctas * 8);
  CHECK(bwd_trace_read(tr.data(), ctas));
  unsigned long long t_min = ~0ull, t_max = 0;
  double s[8] = {};
  std::map<int, std::vector<std::pair<unsigned long long, unsigned long long>>> by_sm;
  for (size_t c = 0; c < ctas; c++) {
    auto *x = &tr[c * 8];
    const unsigned long long end = std::max(x[5], x[6]);
    t_min = std::min(t_min, x[0]); t_max = std::max(t_max, end);
    s[1] += x[1] - x[0]; s[2] += x[2] - x[0]; s[3] += x[3] - x[2]; s[4] += x[4] - x[3]; s[5] += x[5] - x[4];
    s[6] += double(end) - double(x[5]); s[0] += end - x[0];
    by_sm[int(x[7])].push_back({x[0], end});
  }
  double gap = 0; int gaps = 0; double first = 0, last = 0;
  for (auto &[sm, v] : by_sm) {
    std::sort(v.begin(), v.end());
    for (size_t i = 1; i < v.size(); i++) { gap += double(v[i].first) - double(v[i - 1].second); gaps++; }
    first += v.front().first - t_min; last += t_max - v.back().second;
  }
  std::printf("B=%d T=%d H=%d causal=%d: %.3f ms per backward (events, prep + main + dq); last call's main kernel span %.1f us, %zu blocks on %zu SMs\n",
              b, t, n, int(causal), ms / 20, (t_max - t_min) / 1e3, ctas, by_sm.size());
  std::printf("per block, us: whole %.2f | start->barriers %.2f | start->K,V in %.2f | K,V in->first S^T done %.2f | first S^T done->loop end %.2f (%s%.3f per step) | loop end->dK,dV in shared memory %.2f | ->block end (their TMA stores read) %.2f\n",
              s[0] / ctas / 1e3, s[1] / ctas / 1e3, s[2] / ctas / 1e3, s[3] / ctas / 1e3, s[4] / ctas / 1e3, causal ? "~" : "",
              s[4] / ctas / 1e3 / (causal ? (t / 64 + 1) / 2.0 : t / 64), s[5] / ctas / 1e3, s[6] / ctas / 1e3);
  std::printf("per SM: gap between blocks %.2f us (%d gaps), first block starts %.2f us after the first, last ends %.2f us before the end\n",
              gap / gaps / 1e3, gaps, first / by_sm.size() / 1e3, last / by_sm.size() / 1e3);
  return 0;
}
