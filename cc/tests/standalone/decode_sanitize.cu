// A standalone driver of the decode kernel for compute-sanitizer (memcheck, racecheck, synccheck) and
// a quick check without JAX: small odd shapes, contiguous and paged caches (a shuffled table with
// entries outside the pool), lengths 0, shorter than the new tokens and full, GQA, windows, soft cap,
// the new tokens' rows written by append() before the attention,
// head dims 64/128/256, one and several parts, grids of one wave and of several. Each buffer is its own
// cudaMalloc (an out-of-bounds access is caught); the cache rows past each length, the output, the lse
// and the workspace hold NaN, and the results are compared with a float64 host reference.
// Built and run by scripts/gpu_check.sh:
//   nvcc -std=c++20 -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=sm_80 \
//        --expt-relaxed-constexpr -Icc cc/tests/standalone/decode_sanitize.cu cc/decode/*.cu -o decode_sanitize
//   compute-sanitizer --tool memcheck ./decode_sanitize
// racecheck reports hazards in the MLA kernel (mla_sm90.cu) only: the two consumers' hand-over of P and
// the row statistics through sm.p and sm.handed. Each write and the other consumer's read of it are
// ordered by a named barrier (bar.arrive by the writer, bar.sync by the reader), and the writer's next
// write by its own wait for the other's hand-over, which follows that read; racecheck does not follow
// an order made with bar.arrive. This driver's float64 comparison checks the results either way.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <cuda_bf16.h>

#include "decode/decode.h"
#include "driver.h"

using namespace jax_tk::decode;
using bf16 = __nv_bfloat16;

struct Case {
  int q_len, q_heads, kv_heads, head_dim;
  std::vector<int> lengths;
  int capacity;       // contiguous: rows per sequence; paged: max_pages * page_size
  int page_size = 0;  // 0: contiguous
  int splits = 1;
  bool causal = true;
  int left = -1, right = -1;
  float softcap = 0.f;
  bool sinks = false;  // attention sinks: one logit per query head (Params::sinks)
  bool append = false;  // the new tokens' rows arrive through append() (contiguous caches)
};

template <typename T> T *upload(const std::vector<T> &host) {
  T *d;
  CHECK(cudaMalloc(&d, std::max<size_t>(host.size(), 1) * sizeof(T)));
  CHECK(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <typename T> std::vector<T> download(const T *d, size_t n) {
  std::vector<T> host(n);
  CHECK(cudaMemcpy(host.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

// sm90: blocks of 128 rows take the sm_90a kernel (only where the device runs it); smem_limit: see Params.
int run(const Case &c, bool sm90, int smem_limit = 0) {
  const int b_count = int(c.lengths.size()), t_count = c.q_len, n_count = c.q_heads, k_count = c.kv_heads;
  const int d = c.head_dim, group = n_count / k_count, dv = v_head_dim(d);
  const bool mla = d == MLA_HEAD_DIM;  // (one latent cache: the values are its rows' first dv dims)
  const bool paged = c.page_size > 0;
  if (paged && c.capacity % c.page_size != 0) {
    std::printf("FAIL: a paged case's capacity must be a multiple of its page size\n");
    return 1;
  }
  std::mt19937 rng(b_count * 131 + d * 7 + c.capacity + c.splits);
  std::normal_distribution<float> dist;
  const float nan = std::nanf("");

  // The cache, and where each sequence's position j lives in it (-1: a page outside the pool).
  const int max_pages = paged ? c.capacity / c.page_size : 0;
  const int num_pages = paged ? b_count * max_pages / 2 + 3 : 0;  // fewer than the slots: some point outside
  const int rows = paged ? num_pages * c.page_size : b_count * c.capacity;
  std::vector<int> table(size_t(b_count) * max_pages);
  if (paged) {
    std::vector<int> pages(num_pages);
    for (int i = 0; i < num_pages; i++) pages[i] = i;
    std::shuffle(pages.begin(), pages.end(), rng);
    for (size_t i = 0; i < table.size(); i++)
      table[i] = i % 3 == 2 ? (i % 2 ? -1 : num_pages + 5) : pages[i % num_pages];  // every third outside
  }
  auto row_of = [&](int b, int j) {
    if (!paged) return b * c.capacity + j;
    const int page = table[size_t(b) * max_pages + j / c.page_size];
    return page < 0 || page >= num_pages ? -1 : page * c.page_size + j % c.page_size;
  };
  std::vector<bf16> q(size_t(b_count) * t_count * n_count * d), k(size_t(rows) * k_count * d, __float2bfloat16(nan)),
      v(k.size(), __float2bfloat16(nan));
  for (auto &x : q) x = __float2bfloat16(dist(rng));
  for (int b = 0; b < b_count; b++)  // only the rows within a length hold numbers (pages may be shared)
    for (int j = 0; j < std::min(c.lengths[b], c.capacity); j++)
      if (int r = row_of(b, j); r >= 0)
        for (int i = 0; i < k_count * d; i++) {
          k[size_t(r) * k_count * d + i] = __float2bfloat16(dist(rng));
          v[size_t(r) * k_count * d + i] = mla ? k[size_t(r) * k_count * d + i] : __float2bfloat16(dist(rng));
        }

  // append: the rows of the new tokens (positions length - q_len + t) reach the cache through append(),
  // from k_new and v_new; the cache uploaded holds NaN there
  std::vector<bf16> kd = k, vd = v, k_new, v_new;
  std::vector<int> before(b_count);
  if (c.append) {
    k_new.resize(size_t(b_count) * t_count * k_count * d);
    v_new.resize(k_new.size());
    for (int b = 0; b < b_count; b++) {
      before[b] = c.lengths[b] - t_count;
      for (int t = 0; t < t_count; t++) {
        const int pos = before[b] + t, r = pos >= 0 && pos < c.capacity ? row_of(b, pos) : -1;
        for (int i = 0; i < k_count * d; i++) {
          const size_t at = (size_t(b) * t_count + t) * k_count * d + i, in = size_t(r) * k_count * d + i;
          k_new[at] = r >= 0 ? k[in] : __float2bfloat16(dist(rng));  // (dropped where r < 0)
          v_new[at] = r >= 0 ? v[in] : __float2bfloat16(dist(rng));
          if (r >= 0) kd[in] = vd[in] = __float2bfloat16(nan);
        }
      }
    }
  }

  Params p{};
  p.dtype = DType::bf16;
  p.batch = b_count; p.q_len = t_count; p.q_heads = n_count; p.kv_heads = k_count; p.head_dim = d;
  p.capacity = c.capacity;
  if (paged) {
    p.page_table = upload(table);
    p.page_size = c.page_size; p.num_pages = num_pages; p.max_pages = max_pages;
    p.page_shift = (c.page_size & (c.page_size - 1)) == 0 ? __builtin_ctz(c.page_size) : -1;
  }
  p.lengths = upload(c.lengths);
  p.scale = 1.f / std::sqrt(float(d));
  p.causal = c.causal; p.window_left = c.left; p.window_right = c.right; p.softcap = c.softcap;
  p.q = upload(q); p.k = upload(kd); p.v = mla ? p.k : upload(vd);
  std::vector<float> sinks(n_count, -INFINITY);
  if (c.sinks) {
    for (float &x : sinks) x = dist(rng);
    sinks[0] = 30.f;  // (one that takes nearly all the weight)
    p.sinks = upload(sinks);
  }
  const size_t o_n = q.size() / d * dv;
  p.o = upload(std::vector<bf16>(o_n, __float2bfloat16(nan)));
  const size_t lse_n = size_t(b_count) * n_count * t_count;
  p.lse = upload(std::vector<float>(lse_n, nan));
  p.splits = c.splits;
  p.workspace = upload(std::vector<float>(workspace_words(c.splits, b_count, t_count, n_count, dv), nan));
  p.sm90 = sm90;
  p.smem_limit = smem_limit;
  Append a{};
  if (c.append) {
    a = {upload(k_new), upload(v_new), upload(before), upload(std::vector<int>(b_count, -7))};
    CHECK(cudaFree(const_cast<int *>(p.lengths)));  // (the attention reads the lengths append() leaves)
    p.lengths = a.lengths_after;
    CHECK(append(p, a, 0));
  }
  CHECK(decode(p, 0));
  CHECK(cudaDeviceSynchronize());
  bool lengths_ok = true;
  if (c.append) {
    const auto after = download(a.lengths_after, b_count);
    for (int b = 0; b < b_count; b++) lengths_ok = lengths_ok && after[b] == c.lengths[b];
    for (const void *x : {a.k_new, a.v_new, static_cast<const void *>(a.lengths_before), static_cast<const void *>(a.lengths_after)})
      CHECK(cudaFree(const_cast<void *>(x)));
  }
  auto o = download(static_cast<bf16 *>(p.o), o_n);
  auto lse = download(p.lse, lse_n);

  // float64 reference
  double num = 0, den = 0, lse_err = 0;
  bool finite = true;
  std::vector<double> logit(c.capacity), acc(dv);
  for (int b = 0; b < b_count; b++)
    for (int t = 0; t < t_count; t++)
      for (int n = 0; n < n_count; n++) {
        const int length = std::clamp(c.lengths[b], 0, c.capacity), pos = c.lengths[b] - t_count + t;
        const bf16 *qr = &q[((size_t(b) * t_count + t) * n_count + n) * d];
        double m = -INFINITY;
        for (int j = 0; j < length; j++) {
          const bool seen = pos >= 0 && (!c.causal || j <= pos) && (c.left < 0 || j >= pos - c.left) &&
                            (c.right < 0 || j <= pos + c.right);
          logit[j] = -INFINITY;
          if (!seen) continue;
          const int r = row_of(b, j);
          double s = 0;
          for (int i = 0; i < d; i++)
            s += r < 0 ? 0.0 : double(__bfloat162float(qr[i])) * __bfloat162float(k[(size_t(r) * k_count + n / group) * d + i]);
          s *= p.scale;
          if (c.softcap > 0) s = c.softcap * std::tanh(s / c.softcap);
          logit[j] = s;
          m = std::max(m, s);
        }
        const double seen_max = m, sink = sinks[n];  // (-inf: no sink)
        m = std::max(m, sink);
        double sum = m == -INFINITY ? 0.0 : std::exp(sink - m);
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int j = 0; j < length && seen_max > -INFINITY; j++) {
          if (logit[j] == -INFINITY) continue;
          const double w = std::exp(logit[j] - m);
          sum += w;
          if (int r = row_of(b, j); r >= 0)
            for (int i = 0; i < dv; i++) acc[i] += w * __bfloat162float(v[(size_t(r) * k_count + n / group) * d + i]);
        }
        const float *got_lse = &lse[(size_t(b) * n_count + n) * t_count + t];
        if (m == -INFINITY) {
          finite = finite && *got_lse == -INFINITY;
        } else {
          lse_err = std::max(lse_err, std::abs(*got_lse - (m + std::log(sum))));
        }
        for (int i = 0; i < dv; i++) {
          const double want = seen_max == -INFINITY ? 0.0 : acc[i] / sum;
          const float got = __bfloat162float(o[((size_t(b) * t_count + t) * n_count + n) * dv + i]);
          finite = finite && std::isfinite(got);
          num += (got - want) * (got - want);
          den += want * want;
        }
      }
  const double err = finite ? std::sqrt(num / std::max(den, 1e-30)) : INFINITY;
  const bool ok = err < 1e-2 && lse_err < 1e-2 && lengths_ok;
  const void *buffers[] = {p.page_table, c.append ? nullptr : p.lengths, p.q, p.k, mla ? nullptr : p.v, p.o, p.lse, p.workspace, p.sinks};
  for (const void *x : buffers)
    if (x) CHECK(cudaFree(const_cast<void *>(x)));
  std::printf("%s B=%d T=%d heads %d/%d D=%d cap=%d page=%d splits=%d%s%s%s: rel err %.3g, lse err %.3g\n",
              ok ? "ok  " : "FAIL", b_count, t_count, n_count, k_count, d, c.capacity, c.page_size, c.splits,
              c.sinks ? " sinks" : "", c.append ? " append" : "", sm90 ? " (sm_90a)" : smem_limit ? " (small)" : "", err, lse_err);
  return ok ? 0 : 1;
}

int main() {
  int dev = 0, major = 0, minor = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  const bool hopper = major == 9 && minor == 0;
  int failed = 0;
  auto check = [&](const Case &c) { failed += run(c, hopper); };
  // contiguous: a length 0, one shorter than the new tokens, a full one; one and several parts
  for (int splits : {1, 3}) {
    check({2, 4, 2, 64, {0, 1, 77}, 77, 0, splits});
    check({3, 8, 1, 128, {130, 2, 200}, 200, 0, splits, true, 40, 0, 30.f});  // MQA, window, soft cap
  }
  check({1, 2, 2, 256, {300, 45}, 301, 0, 2, false});  // D=256, not causal
  // the new tokens appended in the same call: a length shorter than the new tokens, a full cache
  for (int splits : {1, 3}) check({3, 8, 2, 128, {2, 150, 200}, 200, 0, splits, true, -1, -1, 0.f, false, true});
  // paged (table entries outside the pool inside the lengths read as zeros)
  check({1, 4, 1, 128, {0, 64, 63, 17}, 80, 16, 2});
  check({4, 16, 4, 64, {250, 9}, 256, 64, 1, false, -1, 2});  // GQA 4 x 4 new tokens, right window
  check({2, 2, 2, 256, {5, 200}, 240, 48, 4});                // a page size that is not a power of 2
  check({1, 4, 1, 128, {4700, 70}, 4800, 16, 1});             // past 32 blocks a warp (Pages' windows)
  check({4, 16, 2, 128, {2100, 3}, 2112, 16, 1});             // blocks of two pages, past 16 blocks a group
  // blocks of several row tiles (warps sharing a ring): 48 rows (a tile of padding), 20 rows at D=256,
  // 64 rows in two parts
  check({12, 8, 2, 64, {0, 5, 300}, 300, 0, 3});
  check({5, 8, 2, 256, {129, 40}, 144, 16, 2});
  check({16, 4, 1, 128, {300, 1}, 320, 0, 2});
  check({16, 4, 1, 256, {300, 1}, 320, 16, 2});  // 64 rows at D=256: four tiles
  // a grid of several waves (half blocks, two per SM), with one and with several row tiles
  check({1, 8, 4, 128, std::vector<int>(40, 33), 64, 0, 1});
  check({8, 8, 2, 128, std::vector<int>(70, 70), 80, 0, 1});
  // 128 rows (blocks of their own kernel on Hopper; here also the other GPUs'): a window and pages of 64,
  // two chunks of 128 rows in two parts with pages of 16, pages of 128, a soft cap at D=64 in three parts
  for (bool sm90 : {hopper, false}) {
    failed += run({16, 8, 1, 128, {200}, 256, 64, 1, true, 50}, sm90);
    failed += run({32, 8, 1, 128, {0, 500}, 512, 16, 2}, sm90);
    failed += run({16, 8, 1, 128, {385, 1}, 512, 128, 1}, sm90);
    failed += run({16, 8, 1, 64, {9, 700, 333}, 720, 0, 3, false, -1, -1, 20.f}, sm90);
    failed += run({16, 8, 1, 256, {200, 77}, 256, 64, 2}, sm90);  // head dim 256 (elsewhere two blocks of 64)
    if (!hopper) break;
  }
  // attention sinks: one part and several (the merge), a block of several row tiles, 128 rows
  for (int splits : {1, 3}) {
    check({2, 4, 2, 64, {0, 1, 77}, 77, 0, splits, true, -1, -1, 0.f, true});
    check({16, 4, 1, 128, {300, 1}, 320, 0, splits, true, -1, -1, 0.f, true});
    for (bool sm90 : {hopper, false}) failed += run({16, 8, 1, 128, {0, 500}, 512, 16, splits, true, -1, -1, 0.f, true}, sm90);
  }
  // the configs of GPUs with less shared memory (SMALL_GPU_SMEM): head dim 256 in one and two tiles,
  // 128 rows as blocks of 64, 64 rows at D=256 as blocks of 32
  failed += run({1, 4, 1, 256, {300, 45}, 304, 16, 2}, false, SMALL_GPU_SMEM);
  failed += run({5, 4, 1, 256, {129, 40}, 144, 0, 1}, false, SMALL_GPU_SMEM);
  failed += run({16, 8, 1, 128, {0, 500}, 512, 16, 2}, false, SMALL_GPU_SMEM);
  failed += run({16, 4, 1, 256, {300, 1}, 320, 16, 2}, false, SMALL_GPU_SMEM);
  // MLA's latent cache (Hopper): 16 heads x 1 token and 128 x 2 (two blocks of rows), contiguous and
  // paged (16, 64, a size that is no multiple of 16), one part and several
  if (hopper)
    for (int splits : {1, 3}) {
      failed += run({1, 16, 1, MLA_HEAD_DIM, {0, 1, 200}, 200, 0, splits}, true);
      failed += run({2, 64, 1, MLA_HEAD_DIM, {130, 3}, 192, 64, splits}, true);
      failed += run({1, 16, 1, MLA_HEAD_DIM, {77, 150}, 160, 16, splits}, true);
      failed += run({2, 16, 1, MLA_HEAD_DIM, {100, 40}, 144, 48, splits}, true);
    }
  std::printf("%s\n", failed ? "FAILED" : "all ok");
  return failed ? 2 : 0;
}
