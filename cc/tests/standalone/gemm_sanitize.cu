// A standalone driver of the grouped GEMM kernels for compute-sanitizer (memcheck, racecheck,
// synccheck) and a quick check without JAX: small odd shapes, both kernels, every kind, each buffer
// its own cudaMalloc (an out-of-bounds access is caught), the output poisoned with NaN and compared
// with a float64 host reference; on Hopper also the FP8 path; FP8 quantization (to the bit, any
// GPU). Built and run by scripts/gpu_check.sh:
//   nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=sm_80 \
//        --expt-relaxed-constexpr -Icc cc/tests/standalone/gemm_sanitize.cu cc/gemm/*.cu -o gemm_sanitize
// (-O3: the host's float64 reference; without it, the larger cases take minutes)
//   compute-sanitizer --tool memcheck ./gemm_sanitize
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "driver.h"
#include "gemm/gemm.h"

using namespace jax_tk::gemm;

// The kernel's output (float32 or bfloat16, no elements) as float.
std::vector<float> download(const void *out, size_t no, bool out_f32) {
  std::vector<float> got(no);
  if (out_f32) {
    CHECK(cudaMemcpy(got.data(), out, no * 4, cudaMemcpyDeviceToHost));
  } else {
    std::vector<__nv_bfloat16> h(no);
    CHECK(cudaMemcpy(h.data(), out, no * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < no; i++) got[i] = __bfloat162float(h[i]);
  }
  return got;
}

// ||got - want|| / ||want|| (infinite where got holds a non-finite value: unwritten or NaN).
double fro_err(const std::vector<float> &got, const std::vector<double> &want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); i++) {
    if (!std::isfinite(got[i])) return INFINITY;
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// mode RAGGED or CONTRACT, b_transposed or not (CONTRACT: a [k, m] and b [n, m], Hopper only); out
// bf16 or float32. split > 1 (RAGGED, Hopper; MODE_SPLIT_K's Params): a [m / split, split k], group i's
// rows its rows' columns [i k, (i + 1) k) (bt: b [n, split k], group i's b its columns [i k, (i + 1) k)).
// Returns the relative error.
double run(int m, int k, int n, std::vector<int> sizes, int mode, bool bt, bool out_f32, bool hopper, int split = 1) {
  std::mt19937 rng(m * 7 + k * 3 + n + int(sizes.size()));
  const int g = int(sizes.size());
  const size_t na = size_t(m) * k, nb = mode == MODE_CONTRACT ? size_t(m) * n : size_t(g) * k * n;
  const size_t no = mode == MODE_CONTRACT ? size_t(g) * k * n : size_t(m) * n;
  std::normal_distribution<float> dist;
  std::vector<__nv_bfloat16> ha(na), hb(nb);
  for (auto &x : ha) x = __float2bfloat16(dist(rng));
  for (auto &x : hb) x = __float2bfloat16(dist(rng));
  __nv_bfloat16 *a, *b;
  int *gs;
  void *out;
  CHECK(cudaMalloc(&a, na * 2)); CHECK(cudaMalloc(&b, nb * 2));
  CHECK(cudaMalloc(&gs, std::max(g, 1) * sizeof(int)));
  CHECK(cudaMalloc(&out, no * (out_f32 ? 4 : 2)));
  CHECK(cudaMemcpy(a, ha.data(), na * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(b, hb.data(), nb * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(gs, sizes.data(), g * sizeof(int), cudaMemcpyHostToDevice));
  CHECK(cudaMemset(out, 0xff, no * (out_f32 ? 4 : 2)));  // NaN in both types
  Params p{DType::bf16, out_f32, mode, bt, m, k, n, g, a, b, gs, out};
  p.a_split = split;
  CHECK(hopper ? ragged_sm90(p, 0) : ragged_sm80(p, 0));
  CHECK(cudaDeviceSynchronize());
  const std::vector<float> got = download(out, no, out_f32);
  // float64 reference
  std::vector<double> want(no, 0.0);
  const bool cbt = mode == MODE_CONTRACT && bt;  // (a [k, m], b [n, m])
  const int rows = m / split;  // (split: a's rows)
  auto A = [&](int r, int c) {
    return double(__bfloat162float(ha[cbt ? size_t(c) * m + r : size_t(r % rows) * split * k + size_t(r / rows) * k + c]));
  };
  for (int i = 0, off = 0; i < g; i++) {
    const int s = std::min(std::max(sizes[i], 0), m - off), r0 = off, r1 = off + s;
    off += s;
    for (int r = r0; r < r1; r++)
      for (int c = 0; c < k; c++)
        for (int j = 0; j < n; j++) {
          if (mode == MODE_CONTRACT) {
            want[(size_t(i) * k + c) * n + j] += A(r, c) * __bfloat162float(hb[cbt ? size_t(j) * m + r : size_t(r) * n + j]);
          } else {
            const size_t bi = bt ? (split > 1 ? size_t(j) * g * k + size_t(i) * k + c : (size_t(i) * n + j) * k + c)
                                 : (size_t(i) * k + c) * n + j;
            want[size_t(r) * n + j] += A(r, c) * __bfloat162float(hb[bi]);
          }
        }
  }
  const double err = fro_err(got, want);
  const void *buffers[] = {a, b, gs, out};
  for (const void *x : buffers) CHECK(cudaFree(const_cast<void *>(x)));
  std::printf("%s m=%d k=%d n=%d g=%d mode=%d bt=%d split=%d out=%s %s: rel err %.3g\n", err < (out_f32 ? 1e-4 : 1e-2) ? "ok  " : "FAIL",
              m, k, n, g, mode, int(bt), split, out_f32 ? "f32" : "bf16", hopper ? "sm90" : "sm80", err);
  return err < (out_f32 ? 1e-4 : 1e-2) ? 0 : 1;
}

template <typename V> void *upload(const V &h) {
  void *d;
  CHECK(cudaMalloc(&d, std::max<size_t>(h.size(), 1) * sizeof(h[0])));
  CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(h[0]), cudaMemcpyHostToDevice));
  return d;
}

// An FP8 case's operands (random values and scales, of the given sizes) and its run: uploaded, the
// output poisoned, the kernel, the output back.
struct Fp8Case {
  std::vector<__nv_fp8_e4m3> a, b;
  std::vector<float> sa, sb;
  Fp8Case(std::mt19937 &rng, size_t na, size_t nb, size_t nsa, size_t nsb) : a(na), b(nb), sa(nsa), sb(nsb) {
    std::normal_distribution<float> dist;
    std::uniform_real_distribution<float> scale(0.25f, 2.f);
    for (auto *v : {&a, &b})
      for (auto &x : *v) x = __nv_fp8_e4m3(4 * dist(rng));
    for (auto *v : {&sa, &sb})
      for (auto &x : *v) x = scale(rng);
  }
  // p: dtype, out_f32, mode, b_transposed and the sizes; no: out's elements.
  std::vector<float> run(Params p, const std::vector<int> &sizes, size_t no) const {
    void *da = upload(a), *db = upload(b), *dsa = upload(sa), *dsb = upload(sb), *gs = upload(sizes), *out;
    CHECK(cudaMalloc(&out, no * (p.out_f32 ? 4 : 2)));
    CHECK(cudaMemset(out, 0xff, no * (p.out_f32 ? 4 : 2)));
    p.a = da, p.b = db, p.group_sizes = static_cast<const int *>(gs), p.out = out;
    p.a_scales = static_cast<const float *>(dsa), p.b_scales = static_cast<const float *>(dsb);
    CHECK(ragged_sm90(p, 0));
    CHECK(cudaDeviceSynchronize());
    std::vector<float> got = download(out, no, p.out_f32);
    for (void *x : {da, db, dsa, dsb, gs, out}) CHECK(cudaFree(x));
    return got;
  }
};

// FP8 (Hopper): a e4m3 [m, k] with scales [ceil(k/128), m], b e4m3 [g, n, k] with scales
// [g, ceil(k/128), ceil(n/128)]; out bf16 or float32. Returns 0 if within tolerance.
int run_fp8(int m, int k, int n, std::vector<int> sizes, bool out_f32) {
  std::mt19937 rng(m * 5 + k + n * 3);
  const int g = int(sizes.size()), B = FP8_BLOCK, kb = (k + B - 1) / B, nbk = (n + B - 1) / B;
  Fp8Case c(rng, size_t(m) * k, size_t(g) * n * k, size_t(kb) * m, size_t(g) * kb * nbk);
  const size_t no = size_t(m) * n;
  const std::vector<float> got = c.run({DType::fp8e4m3, out_f32, MODE_RAGGED, true, m, k, n, g}, sizes, no);
  const auto &ha = c.a, &hb = c.b;
  const auto &hsa = c.sa, &hsb = c.sb;
  std::vector<double> want(no, 0.0);
  for (int i = 0, off = 0; i < g; i++) {
    const int s = std::min(std::max(sizes[i], 0), m - off);
    for (int r = off; r < off + s; r++)
      for (int j = 0; j < n; j++)
        for (int c = 0; c < k; c++)
          want[size_t(r) * n + j] += double(float(ha[size_t(r) * k + c])) * hsa[size_t(c / B) * m + r] *
                                     double(float(hb[(size_t(i) * n + j) * k + c])) * hsb[(size_t(i) * kb + c / B) * nbk + j / B];
    off += s;
  }
  const double err = fro_err(got, want), tol = out_f32 ? 2e-3 : 1e-2;
  std::printf("%s fp8 m=%d k=%d n=%d g=%d out=%s: rel err %.3g\n", err < tol ? "ok  " : "FAIL", m, k, n, g,
              out_f32 ? "f32" : "bf16", err);
  return err < tol ? 0 : 1;
}

// FP8, MODE_CONTRACT (the weights' gradient): a [k, m] and b [n, m] (m a multiple of 16), a's scales
// [mb, k], b's [mb, nb]; out[i] = a[:, rows_i] @ b[:, rows_i]^T; rows past the groups hold values that
// must add nothing.
int run_fp8_contract(int m, int k, int n, std::vector<int> sizes, bool out_f32) {
  std::mt19937 rng(m * 3 + k + n * 7);
  const int g = int(sizes.size()), B = FP8_BLOCK, mb = (m + B - 1) / B, nbn = (n + B - 1) / B;
  Fp8Case c(rng, size_t(k) * m, size_t(n) * m, size_t(mb) * k, size_t(mb) * nbn);
  const size_t no = size_t(g) * k * n;
  const std::vector<float> got = c.run({DType::fp8e4m3, out_f32, MODE_CONTRACT, false, m, k, n, g}, sizes, no);
  const auto &ha = c.a, &hb = c.b;
  const auto &hsa = c.sa, &hsb = c.sb;
  std::vector<double> want(no, 0.0);
  for (int i = 0, off = 0; i < g; i++) {
    const int s = std::min(std::max(sizes[i], 0), m - off);
    for (int c = 0; c < k; c++)
      for (int j = 0; j < n; j++)
        for (int r = off; r < off + s; r++)
          want[(size_t(i) * k + c) * n + j] += double(float(ha[size_t(c) * m + r])) * hsa[size_t(r / B) * k + c] *
                                               double(float(hb[size_t(j) * m + r])) * hsb[size_t(r / B) * nbn + j / B];
    off += s;
  }
  const double err = fro_err(got, want), tol = out_f32 ? 2e-3 : 1e-2;
  std::printf("%s fp8 contract m=%d k=%d n=%d g=%d out=%s: rel err %.3g\n", err < tol ? "ok  " : "FAIL", m, k, n, g,
              out_f32 ? "f32" : "bf16", err);
  return err < tol ? 0 : 1;
}

// FP8 quantization (any GPU): x float32 or FP8 with 1 x 128 scales [rows, cols], transposed or not,
// rows at or past `limit` zeroed, padded to [out_rows, out_cols], blocks block_rows x 128; against a
// host reference of the same arithmetic (float32 division, the same conversion), to the bit.
int run_quantize(int rows, int cols, bool fp8_in, bool transposed, int block_rows, int limit, int out_rows, int out_cols) {
  std::mt19937 rng(rows * 7 + cols + block_rows);
  const int B = FP8_BLOCK, cb_in = (cols + B - 1) / B;
  Fp8Case c(rng, size_t(rows) * cols, 0, size_t(rows) * cb_in, 0);  // (FP8 values, scales)
  std::vector<float> xf(size_t(rows) * cols);
  std::normal_distribution<float> dist;
  for (auto &x : xf) x = dist(rng) * 1000.f;
  auto y = [&](int orow, int ocol) -> float {  // the input to quantize, in the output's frame
    const int r = transposed ? ocol : orow, col = transposed ? orow : ocol;
    if (r >= std::min(std::max(limit, 0), rows) || col >= cols) return 0.f;
    const size_t i = size_t(r) * cols + col;
    return fp8_in ? float(c.a[i]) * c.sa[size_t(r) * cb_in + col / B] : xf[i];
  };
  const int rb = (out_rows + block_rows - 1) / block_rows, cb = (out_cols + B - 1) / B;
  std::vector<float> want_s(size_t(rb) * cb, 0.f);
  for (int i = 0; i < out_rows; i++)
    for (int j = 0; j < out_cols; j++) {
      float &s = want_s[size_t(i / block_rows) * cb + j / B];
      s = std::max(s, std::fabs(y(i, j)));
    }
  for (auto &s : want_s) s = s > 0.f ? s / 448.f : 1.f;
  QuantParams p{};
  p.in = fp8_in ? QuantParams::In::fp8e4m3 : QuantParams::In::f32;
  void *dx = fp8_in ? upload(c.a) : upload(xf), *dxs = upload(c.sa), *dlim = upload(std::vector<int>{limit}), *dv, *ds;
  CHECK(cudaMalloc(&dv, size_t(out_rows) * out_cols));
  CHECK(cudaMalloc(&ds, want_s.size() * 4));
  CHECK(cudaMemset(dv, 0x7f, size_t(out_rows) * out_cols));  // (NaN)
  CHECK(cudaMemset(ds, 0xff, want_s.size() * 4));
  p.x = dx, p.x_scales = fp8_in ? static_cast<const float *>(dxs) : nullptr, p.row_limit = static_cast<const int *>(dlim);
  p.batch = 1, p.rows = rows, p.cols = cols, p.out_rows = out_rows, p.out_cols = out_cols;
  p.transposed = transposed, p.block_rows = block_rows, p.vector_loads = cols % (fp8_in ? 16 : 4) == 0;
  p.values = dv, p.scales = static_cast<float *>(ds);
  CHECK(quantize_fp8(p, 0));
  CHECK(cudaDeviceSynchronize());
  std::vector<uint8_t> got_v(size_t(out_rows) * out_cols);
  std::vector<float> got_s(want_s.size());
  CHECK(cudaMemcpy(got_v.data(), dv, got_v.size(), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(got_s.data(), ds, got_s.size() * 4, cudaMemcpyDeviceToHost));
  for (void *x : {dx, dxs, dlim, dv, ds}) CHECK(cudaFree(x));
  size_t bad = std::memcmp(got_s.data(), want_s.data(), got_s.size() * 4) != 0;
  for (int i = 0; i < out_rows; i++)
    for (int j = 0; j < out_cols; j++) {
      const float q = y(i, j) / want_s[size_t(i / block_rows) * cb + j / B];
      bad += got_v[size_t(i) * out_cols + j] != __nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3);
    }
  std::printf("%s quantize %dx%d %s%s blocks %dx128 limit %d out %dx%d: %zu mismatches\n", bad ? "FAIL" : "ok  ", rows,
              cols, fp8_in ? "fp8" : "f32", transposed ? " transposed" : "", block_rows, limit, out_rows, out_cols, bad);
  return bad ? 1 : 0;
}

int main() {
  int dev = 0, major = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  int failed = 0;
  for (bool hopper : {false, true}) {
    if (hopper && major != 9) continue;
    for (bool out_f32 : {false, true}) {
      failed += run(200, 72, 264, {0, 70, 3, 0, 100}, MODE_RAGGED, false, out_f32, hopper);  // sum < m
      failed += run(200, 72, 264, {0, 70, 3, 0, 100}, MODE_RAGGED, true, out_f32, hopper);
      failed += run(200, 72, 264, {0, 70, 3, 0, 100}, MODE_CONTRACT, false, out_f32, hopper);
      failed += run(129, 8, 8, {129}, MODE_RAGGED, false, out_f32, hopper);
      failed += run(300, 136, 40, {-3, 150, 400}, MODE_CONTRACT, false, out_f32, hopper);  // clipped
      // clusters of two blocks on Hopper. Groups in pairs of tiles (GroupWalk's PAIRS): odd counts of
      // row blocks (a last one in pairs of tiles side by side, a second past n where the count of column
      // tiles is odd), a group of one row, rows past the groups; one group: a half past the group, both past m
      failed += run(2300, 72, 264, {1300, 900}, MODE_RAGGED, false, out_f32, hopper);
      failed += run(2300, 72, 264, {1300, 900}, MODE_RAGGED, true, out_f32, hopper);
      failed += run(1500, 72, 520, {129, 0, 300, 1, 700}, MODE_RAGGED, false, out_f32, hopper);
      failed += run(1500, 72, 520, {129, 0, 300, 1, 700}, MODE_RAGGED, true, out_f32, hopper);
      failed += run(2300, 72, 264, {2100}, MODE_RAGGED, false, out_f32, hopper);
      failed += run(2300, 72, 264, {2100}, MODE_RAGGED, true, out_f32, hopper);
      // dense products in clusters on tiles of each width (dense_tile_n's picks with 66 clusters, as on
      // an H100 or H200: the one above 192 columns, these 256 and 320; a last row block of one row)
      for (int n : {2504, 3336}) {
        failed += run(1025, 72, n, {1025}, MODE_RAGGED, false, out_f32, hopper);
        failed += run(1025, 72, n, {1025}, MODE_RAGGED, true, out_f32, hopper);
      }
      if (hopper) failed += run(1000, 136, 264, {0, 130, 3, 0, 700}, MODE_CONTRACT, true, out_f32, hopper);
      if (hopper)
        for (int n : {264, 2504, 3336})  // one group's contraction in clusters, 192, 256 and 320 wide
          failed += run(1086, 1032, n, {1086}, MODE_CONTRACT, false, out_f32, hopper);
      if (hopper) {  // split k: parts of rows that fill the 128-row tiles and that do not
        failed += run(3 * 128, 1024, 256, {128, 128, 128}, MODE_RAGGED, false, out_f32, hopper, 3);
        failed += run(2 * 100, 64, 520, {100, 100}, MODE_RAGGED, false, out_f32, hopper, 2);
        failed += run(4 * 300, 512, 264, {300, 300, 300, 300}, MODE_RAGGED, false, out_f32, hopper, 4);
        failed += run(2 * 100, 64, 520, {100, 100}, MODE_RAGGED, true, out_f32, hopper, 2);
        failed += run(4 * 300, 512, 264, {300, 300, 300, 300}, MODE_RAGGED, true, out_f32, hopper, 4);
      }
    }
    failed += run(700, 64, 520, std::vector<int>(40, 17), MODE_RAGGED, false, false, hopper);
    failed += run(700, 64, 136, std::vector<int>(40, 17), MODE_CONTRACT, false, false, hopper);
  }
  if (major == 9)
    for (bool out_f32 : {false, true}) {
      failed += run_fp8(200, 272, 136, {0, 70, 3, 0, 100}, out_f32);  // k: a 16-wide last block; sum < m
      failed += run_fp8(129, 128, 8, {129}, out_f32);
      failed += run_fp8(2300, 256, 136, {2100}, out_f32);  // clusters: a half past the group
      // groups across the 128-row blocks, empty ones, rows past the groups; k and n past a tile
      failed += run_fp8_contract(400, 136, 200, {0, 70, 3, 0, 200, 100}, out_f32);
      failed += run_fp8_contract(256, 64, 8, {256}, out_f32);
    }
  failed += run_quantize(300, 272, false, false, 1, 300, 300, 288);
  failed += run_quantize(130, 37, false, false, 128, 100, 130, 37);
  failed += run_quantize(300, 272, true, true, 1, 270, 272, 304);
  failed += run_quantize(300, 200, false, true, 128, 1000, 200, 304);
  failed += run_quantize(260, 400, true, false, 128, 250, 300, 416);
  std::printf("%s\n", failed ? "FAILED" : "all ok");
  return failed ? 2 : 0;
}
