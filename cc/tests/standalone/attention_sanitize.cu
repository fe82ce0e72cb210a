// A standalone driver of the attention kernels for compute-sanitizer (memcheck, racecheck,
// synccheck): small odd shapes, every kernel variant, each buffer its own cudaMalloc so that an
// out-of-bounds access is caught. No JAX in the process. Built and run by scripts/gpu_check.sh:
//   nvcc -std=c++20 -gencode=arch=compute_90a,code=sm_90a -Icc cc/tests/standalone/attention_sanitize.cu \
//        cc/attention/*.cu -o attention_sanitize
//   compute-sanitizer --tool memcheck ./attention_sanitize [head_dim: only its cases]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include <cuda_bf16.h>

#include "attention/attention.h"
#include "driver.h"

using namespace jax_tk::attention;

int *device_ints(const std::vector<int> &host) {
  int *d;
  CHECK(cudaMalloc(&d, host.size() * sizeof(int)));
  CHECK(cudaMemcpy(d, host.data(), host.size() * sizeof(int), cudaMemcpyHostToDevice));
  return d;
}

// The masks: ALL = a window, packed segment ids (the queries' last segment has no key), lengths (one
// batch entry with no query rows, the other with only half of its keys) and a soft cap, all at once;
// SEGMENTS = the segment ids and lengths alone; WINDOW = the window and lengths alone (each option
// set takes its own Hopper backward kernel); DOCUMENTS = the same sorted segment ids for queries and
// keys (t == s) and lengths, the forward taking one document's tiles (Params::fwd_tiles); DENSE = ALL
// but the soft cap, and the dense operands: a boolean mask per head (Params::mask_bits and
// mask_blocks, broadcast over the batch) whose blocks are empty, full and mixed, and a bias per batch
// entry (broadcast over the heads) with its gradient.
enum Mask { NONE, ALL, SEGMENTS, WINDOW, DOCUMENTS, DENSE };

// The boolean mask of DENSE as the kernels read it: [1, n, t, mask_words(s)] words and the int8 block
// summary (what jax_tk/attention/launch.py computes).
std::vector<int *> boolean_mask(Params &p, std::mt19937 &rng) {
  const int t = p.q_len, s = p.kv_len, n = p.q_heads, words = mask_words(s);
  const int qb = (t + MASK_BLOCK_ROWS - 1) / MASK_BLOCK_ROWS, kb = (s + MASK_BLOCK_KEYS - 1) / MASK_BLOCK_KEYS;
  std::vector<int> bits(size_t(n) * t * words, 0), blocks(size_t(n) * qb * kb, 0), seen(blocks.size() * 2, 0);
  for (int h = 0; h < n; h++)
    for (int i = 0; i < t; i++)
      for (int j = 0; j < s; j++) {
        const int block = (h * qb + i / MASK_BLOCK_ROWS) * kb + j / MASK_BLOCK_KEYS;
        // block kinds by head: head 0 all visible, head 1 hidden from key 128 on, others random
        const bool on = h == 0 || (h == 1 ? j < 128 : rng() % 3 != 0);
        if (on) bits[(size_t(h) * t + i) * words + j / 32] |= int(1u << (j % 32));
        seen[2 * block + on] = 1;
      }
  for (size_t e = 0; e < blocks.size(); e++)
    blocks[e] = seen[2 * e + 1] ? (seen[2 * e] ? MASK_MIXED : MASK_FULL) : MASK_EMPTY;
  std::vector<int8_t> codes(blocks.begin(), blocks.end());
  int8_t *codes_d;
  CHECK(cudaMalloc(&codes_d, codes.size()));
  CHECK(cudaMemcpy(codes_d, codes.data(), codes.size(), cudaMemcpyHostToDevice));
  int *bits_d = device_ints(bits);
  p.mask_bits = reinterpret_cast<const uint32_t *>(bits_d);
  p.mask_blocks = codes_d;
  p.mask_batch = 1; p.mask_heads = n; p.entry_batch = p.batch;
  return {bits_d, reinterpret_cast<int *>(codes_d)};
}

// vd: the value's head dim (0: d; MLA's pair on Hopper only).
int only_d = 0;  // the driver's argument: run only the cases of this head dim (0: all)

int run(int b, int t, int s, int n, int kh, int d, bool causal, bool hopper, Mask masked = NONE,
        bool deterministic = false, int vd = 0) {
  if (only_d && d != only_d) return 0;
  vd = vd ? vd : d;
  std::mt19937 rng(b * 1000 + t + s + d);
  Params p{};
  p.dtype = DType::bf16;
  p.batch = b; p.q_len = t; p.kv_len = s; p.q_heads = n; p.kv_heads = kh; p.head_dim = d; p.v_head_dim = vd;
  p.scale = 0.125f; p.causal = causal;
  size_t nq = size_t(b) * t * n * d, nk = size_t(b) * s * kh * d, nr = size_t(b) * n * t;
  size_t no = size_t(b) * t * n * vd, nv = size_t(b) * s * kh * vd;
  p.q = device_random<__nv_bfloat16>(nq, rng);
  p.k = device_random<__nv_bfloat16>(nk, rng);
  p.v = device_random<__nv_bfloat16>(nv, rng);
  p.dout = device_random<__nv_bfloat16>(no, rng);
  p.dlse = device_random<float>(nr, rng);
  p.entry_batch = b;
  if (causal) p.sinks = device_random<float>(n, rng);  // (the forward's epilogue with attention sinks)
  void *o, *dq, *dk, *dv;
  float *lse, *delta;
  CHECK(cudaMalloc(&o, no * 2)); CHECK(cudaMalloc(&dq, nq * 2));
  CHECK(cudaMalloc(&dk, nk * 2)); CHECK(cudaMalloc(&dv, nv * 2));
  CHECK(cudaMalloc(&lse, nr * 4)); CHECK(cudaMalloc(&delta, nr * 4));
  float *workspace;
  CHECK(cudaMalloc(&workspace, bwd_sm90_workspace_words(b, t, n, d) * 4));
  int *tile_counter;
  CHECK(cudaMalloc(&tile_counter, sizeof(int)));
  p.tile_counter = tile_counter;
  p.o = o; p.lse = lse; p.dq = dq; p.dk = dk; p.dv = dv; p.delta = delta;
  p.workspace = workspace; p.deterministic = deterministic;
  std::vector<int *> ints;
  if (masked) {
    std::vector<int> qs(size_t(b) * t), ks(size_t(b) * s), ql(b), kl(b);
    for (size_t i = 0; i < qs.size(); i++) qs[i] = int(3 * (i % t) / t);  // segments 0, 1, 2
    for (size_t j = 0; j < ks.size(); j++) ks[j] = int(2 * (j % s) / s);  // segments 0, 1
    if (masked == DOCUMENTS) ks = qs;
    for (int i = 0; i < b; i++) {
      ql[i] = i == 0 ? t : 0;
      kl[i] = i == 0 ? s / 2 + 1 : s;
    }
    // min and max id of every SEGMENT_GRANULE rows (what jax_tk computes in Python)
    auto ranges = [](const std::vector<int> &ids, int b, int n) {
      const int g = (n + SEGMENT_GRANULE - 1) / SEGMENT_GRANULE;
      std::vector<int> r(size_t(b) * g * 2);
      for (int i = 0; i < b; i++)
        for (int k = 0; k < g; k++) {
          int lo = 1 << 30, hi = -(1 << 30);
          for (int x = k * SEGMENT_GRANULE; x < std::min(n, (k + 1) * SEGMENT_GRANULE); x++) {
            lo = std::min(lo, ids[size_t(i) * n + x]);
            hi = std::max(hi, ids[size_t(i) * n + x]);
          }
          r[(size_t(i) * g + k) * 2] = lo;
          r[(size_t(i) * g + k) * 2 + 1] = hi;
        }
      return r;
    };
    ints = {device_ints(qs), device_ints(ks), device_ints(ql), device_ints(kl), device_ints(ranges(qs, b, t)),
            device_ints(ranges(ks, b, s))};
    p.q_lengths = ints[2]; p.kv_lengths = ints[3];
    if (masked != WINDOW) {
      p.q_segment_ids = ints[0]; p.kv_segment_ids = ints[1];
      p.q_segment_ranges = ints[4]; p.kv_segment_ranges = ints[5];
    }
    if (masked != SEGMENTS && masked != DOCUMENTS) p.window_left = 40, p.window_right = 7;
    if (masked == ALL) p.softcap = 5.f;
    if (masked == SEGMENTS || masked == DOCUMENTS) {  // tiles and blocks in orders of their own
      // the forward's tiles (Params::fwd_tiles): with SEGMENTS the fixed grid's in reverse, with
      // DOCUMENTS each segment's, from its start
      const int cap = fwd_tile_cap(t), qblocks = (t + 127) / 128;
      std::vector<int> tiles;
      auto tile = [&](int bh, int q0, int end, int base) { tiles.insert(tiles.end(), {bh, q0, end, base}); };
      if (masked == SEGMENTS) {
        for (int e = b * n * qblocks - 1; e >= 0; e--) tile(e / qblocks, e % qblocks * 128, t, -1);
      } else {
        for (int e = 0; e < b * n; e++)
          for (int start = 0, end; start < t; start = end) {
            for (end = start; end < t && qs[size_t(e / n) * t + end] == qs[size_t(e / n) * t + start]; end++) {}
            for (int q0 = start; q0 < end; q0 += 128) tile(e, q0, end, start);
          }
      }
      while (tiles.size() < size_t(b) * n * cap * 4) tile(-1, 0, 0, -1);
      ints.push_back(device_ints(tiles));
      // the backward's blocks in reverse (jax_tk sorts them by work)
      std::vector<int> order(size_t(b) * kh * ((s + bwd_order_rows(d) - 1) / bwd_order_rows(d)));
      for (size_t i = 0; i < order.size(); i++) order[i] = int(order.size() - 1 - i);
      ints.push_back(device_ints(order));
    }
  }
  const bool ordered = ints.size() > 6;
  p.fwd_tiles = ordered ? ints[6] : nullptr;
  std::vector<int *> mask = masked == DENSE ? boolean_mask(p, rng) : std::vector<int *>{};
  void *dbias = nullptr;
  if (masked == DENSE) {  // [b, 1, padded rows, padded keys] (causal: [1, n, ...], shared by the batch
                          // entries: the kernels' batch_inner order) and its gradient [b, n, ...]
    const size_t matrix = size_t(padded_rows(t)) * padded_keys(s);
    p.bias_batch = causal ? 1 : b;
    p.bias_heads = causal ? n : 1;
    p.bias = device_random<__nv_bfloat16>(size_t(p.bias_batch) * p.bias_heads * matrix, rng);
    CHECK(cudaMalloc(&dbias, size_t(b) * n * matrix * 2));
    CHECK(cudaMemset(dbias, 0, size_t(b) * n * matrix * 2));
    p.dbias = dbias;
  }
  CHECK(hopper ? fwd_sm90(p, 0) : fwd_sm80(p, 0));
  p.block_order = ordered && !deterministic ? ints[7] : nullptr;
  CHECK(hopper ? bwd_sm90(p, 0) : bwd_sm80(p, 0));
  CHECK(cudaDeviceSynchronize());
  const void *buffers[] = {p.q, p.k, p.v, p.dout, p.dlse, o, dq, dk, dv, lse, delta, workspace, tile_counter};
  for (const void *x : buffers) CHECK(cudaFree(const_cast<void *>(x)));
  if (p.sinks) CHECK(cudaFree(const_cast<float *>(p.sinks)));
  for (int *x : ints) CHECK(cudaFree(x));
  for (int *x : mask) CHECK(cudaFree(x));
  if (dbias) {
    CHECK(cudaFree(dbias));
    CHECK(cudaFree(const_cast<void *>(p.bias)));
  }
  const char *masks[] = {"", " masked", " segments", " window", " documents", " mask and bias"};
  std::printf("ok b=%d t=%d s=%d n=%d kh=%d d=%d dv=%d causal=%d %s%s%s\n", b, t, s, n, kh, d, vd, causal,
              hopper ? "sm90" : "sm80", masks[masked], deterministic ? " deterministic" : "");
  return 0;
}

int main(int argc, char **argv) {
  if (argc > 1) only_d = std::atoi(argv[1]);
  int dev = 0, major = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  for (bool hopper : {false, true}) {
    if (hopper && major != 9) continue;
    for (bool causal : {false, true}) {
      run(1, 70, 50, 2, 1, 64, causal, hopper);
      run(2, 33, 130, 4, 2, 128, causal, hopper);
      run(2, 150, 90, 4, 2, 64, causal, hopper, ALL);
      run(2, 150, 200, 4, 2, 64, causal, hopper, DENSE);
      run(1, 70, 130, 4, 2, 128, causal, hopper, DENSE);
      if (hopper) {
        run(2, 150, 200, 4, 2, 128, causal, hopper, DENSE, true);
        run(1, 70, 130, 4, 2, 256, causal, hopper, DENSE);
        run(1, 130, 200, 4, 2, 64, causal, hopper, NONE, true);
        run(1, 70, 130, 2, 1, 256, causal, hopper, ALL);
        run(1, 70, 130, 2, 1, 256, causal, hopper, ALL, true);
        run(2, 65, 50, 2, 2, 256, causal, hopper, NONE, true);
        run(2, 150, 90, 4, 2, 128, causal, hopper, SEGMENTS);
        run(2, 150, 90, 4, 2, 128, causal, hopper, SEGMENTS, true);
        run(2, 150, 90, 4, 2, 128, causal, hopper, WINDOW);
        run(2, 300, 300, 4, 2, 128, causal, hopper, DOCUMENTS);
        run(1, 300, 300, 2, 2, 64, causal, hopper, DOCUMENTS);
        run(1, 2048 + 67, 2048 + 90, 1, 1, 64, causal, hopper);  // three consumers (three_consumers); causal: a consumer stops early
        for (Mask m : {NONE, ALL, SEGMENTS, DENSE}) run(2, 150, 200, 4, 2, MLA_HEAD_DIM_QK, causal, hopper, m, false, MLA_HEAD_DIM_V);
        run(1, 130, 200, 2, 1, MLA_HEAD_DIM_QK, causal, hopper, ALL, true, MLA_HEAD_DIM_V);
      }
    }
  }
  return 0;
}
