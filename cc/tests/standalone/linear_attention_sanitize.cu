// A standalone driver of the linear-attention kernels (Hopper): simple GLA's forward and backward, and
// the gated delta rule's forward (wy_fwd's solve, then the sequential pass), for compute-sanitizer and a
// quick check without JAX: lengths that are not multiples of the chunk, packed sequences (cu_seqlens)
// including a length-1 and an empty one, grouped value heads, head dims 64 and 128, initial and final
// states. Every result holds NaN before the kernels run; all are compared with a float64 host run of
// the token-by-token recurrence (and its gradient) on the same bf16-rounded inputs.
//   nvcc -std=c++20 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -Icc \
//        cc/tests/standalone/linear_attention_sanitize.cu cc/linear_attention/*.cu -o la_sanitize
//   compute-sanitizer --tool memcheck ./la_sanitize
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <initializer_list>
#include <tuple>
#include <utility>
#include <vector>

#include <cuda_bf16.h>

#include "driver.h"
#include "linear_attention/linear_attention.h"

using namespace jax_tk::linear_attention;
using bf16 = __nv_bfloat16;

struct Case {
  int batch, seq_len, heads, v_heads, k_dim, v_dim;
  std::vector<int> cu;  // packed sequences' offsets (batch 1), or empty
  bool h0, ht;
  bool delta = false;   // the gated delta rule (beta), else simple GLA
};

template <typename T> T *to_device(const std::vector<T> &h) {
  T *d;
  CHECK(cudaMalloc(&d, std::max<size_t>(h.size(), 1) * sizeof(T)));
  if (!h.empty()) CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}
template <typename T> std::vector<T> to_host(const T *d, size_t n) {
  std::vector<T> h(n);
  CHECK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

int run(const Case &c) {
  std::mt19937 rng(c.seq_len * 7 + c.k_dim + c.v_heads);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> decay(-0.3f, 0.f);
  const int B = c.batch, T = c.seq_len, H = c.heads, HV = c.v_heads, K = c.k_dim, V = c.v_dim;
  const int N = c.cu.empty() ? B : int(c.cu.size()) - 1;
  auto rounded = [](float x) { return float(bf16(x)); };
  std::vector<bf16> q(size_t(B) * T * H * K), k(q.size()), v(size_t(B) * T * HV * V);
  std::vector<float> qf(q.size()), kf(k.size()), vf(v.size()), g(size_t(B) * HV * T), h0(size_t(N) * HV * K * V);
  std::vector<float> beta(g.size());
  std::uniform_real_distribution<float> strength(0.05f, 1.f);
  for (auto &x : beta) x = strength(rng);
  for (size_t i = 0; i < q.size(); i++) qf[i] = rounded(normal(rng)), q[i] = bf16(qf[i]);
  for (size_t i = 0; i < k.size(); i++) kf[i] = rounded(normal(rng) / std::sqrt(float(K))), k[i] = bf16(kf[i]);
  for (size_t i = 0; i < v.size(); i++) vf[i] = rounded(normal(rng)), v[i] = bf16(vf[i]);
  for (auto &x : g) x = decay(rng);
  for (auto &x : h0) x = normal(rng);
  const float scale = 1.f / std::sqrt(float(K));

  // The recurrence, in float64.
  std::vector<double> want_o(v.size(), 0.0), want_ht(h0.size());
  for (int n = 0; n < N; n++)
    for (int h = 0; h < HV; h++) {
      const int b = c.cu.empty() ? n : 0, bos = c.cu.empty() ? 0 : c.cu[n], len = c.cu.empty() ? T : c.cu[n + 1] - bos;
      const int hq = h / (HV / H);
      std::vector<double> S(size_t(K) * V, 0.0);
      if (c.h0) for (size_t i = 0; i < S.size(); i++) S[i] = h0[(size_t(n) * HV + h) * K * V + i];
      for (int t = bos; t < bos + len; t++) {
        const double e = std::exp(double(g[(size_t(b) * HV + h) * T + t]));
        const float *kt = &kf[((size_t(b) * T + t) * H + hq) * K], *qt = &qf[((size_t(b) * T + t) * H + hq) * K];
        const float *vt = &vf[((size_t(b) * T + t) * HV + h) * V];
        std::vector<double> u(vt, vt + V);  // simple GLA: v; the delta rule: beta (v - S^T k), S decayed first
        for (auto &x : S) x *= e;
        if (c.delta)
          for (int j = 0; j < V; j++) {
            double sk = 0;
            for (int i = 0; i < K; i++) sk += S[size_t(i) * V + j] * kt[i];
            u[j] = beta[(size_t(b) * HV + h) * T + t] * (vt[j] - sk);
          }
        for (int i = 0; i < K; i++)
          for (int j = 0; j < V; j++) S[size_t(i) * V + j] += double(kt[i]) * u[j];
        for (int j = 0; j < V; j++) {
          double acc = 0;
          for (int i = 0; i < K; i++) acc += S[size_t(i) * V + j] * qt[i];
          want_o[((size_t(b) * T + t) * HV + h) * V + j] = scale * acc;
        }
      }
      for (size_t i = 0; i < S.size(); i++) want_ht[(size_t(n) * HV + h) * K * V + i] = S[i];
    }

  FwdParams p{};
  p.dtype = DType::bf16;
  p.batch = B, p.seq_len = T, p.heads = H, p.v_heads = HV, p.k_dim = K, p.v_dim = V, p.num_seqs = N;
  p.q = to_device(q), p.k = to_device(k), p.v = to_device(v), p.g = to_device(g);
  p.cu_seqlens = c.cu.empty() ? nullptr : to_device(c.cu);
  p.h0 = c.h0 ? to_device(h0) : nullptr;
  const std::vector<bf16> nan_o(v.size(), bf16(NAN));
  p.o = to_device(nan_o);
  p.ht = c.ht ? to_device(std::vector<float>(h0.size(), NAN)) : nullptr;
  p.scale = scale;
  if (c.delta) {
    p.beta = to_device(beta);
    p.t = to_device(std::vector<bf16>(size_t(B) * T * HV * CHUNK, bf16(NAN)));
    WyParams wy{p.dtype, B, T, H, HV, K, N, (T + CHUNK - 1) / CHUNK, p.k, p.g, p.beta, p.cu_seqlens, const_cast<void *>(p.t)};
    CHECK(wy_fwd(wy, 0));
  }
  CHECK(c.delta ? gdr_fwd_sm90(p, 0) : simple_gla_fwd_sm90(p, 0));
  CHECK(cudaDeviceSynchronize());

  // Relative error over the sequences' rows (rows outside every packed sequence stay NaN: not compared).
  auto o = to_host(static_cast<bf16 *>(p.o), v.size());
  double num = 0, den = 0;
  bool finite = true;
  for (int n = 0; n < N; n++) {
    const int b = c.cu.empty() ? n : 0, bos = c.cu.empty() ? 0 : c.cu[n], len = c.cu.empty() ? T : c.cu[n + 1] - bos;
    for (size_t i = ((size_t(b) * T + bos) * HV) * V; i < ((size_t(b) * T + bos + len) * HV) * V; i++) {
      const double x = float(o[i]);
      finite &= std::isfinite(x);
      num += (x - want_o[i]) * (x - want_o[i]), den += want_o[i] * want_o[i];
    }
  }
  const double err = std::sqrt(num / std::max(den, 1e-30));
  double state_err = 0;
  if (c.ht) {
    auto ht = to_host(p.ht, h0.size());
    double sn = 0, sd = 0;
    for (size_t i = 0; i < ht.size(); i++) {
      finite &= std::isfinite(ht[i]);
      sn += (ht[i] - want_ht[i]) * (ht[i] - want_ht[i]), sd += want_ht[i] * want_ht[i];
    }
    state_err = std::sqrt(sn / std::max(sd, 1e-30));
  }
  const bool ok = finite && err < 2e-2 && state_err < 1e-2;
  std::printf("%s %s B=%d T=%d heads %d/%d K=%d V=%d seqs=%d%s%s: rel err %.3g, state err %.3g\n", ok ? "ok  " : "FAIL",
              c.delta ? "delta" : "gla", B, T, H, HV, K, V, N, c.h0 ? " h0" : "", c.ht ? " ht" : "", err, state_err);
  for (const void *x : {p.q, p.k, p.v, static_cast<const void *>(p.g), static_cast<const void *>(p.cu_seqlens),
                        static_cast<const void *>(p.h0), static_cast<const void *>(p.o), static_cast<const void *>(p.ht),
                        static_cast<const void *>(p.beta), p.t})
    if (x) CHECK(cudaFree(const_cast<void *>(x)));
  return ok ? 0 : 1;
}

double rel_err(const std::vector<float> &x, const std::vector<double> &want, bool &finite) {
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); i++) {
    finite &= std::isfinite(x[i]);
    num += (x[i] - want[i]) * (x[i] - want[i]), den += want[i] * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// The backward (simple GLA's, or with c.delta the gated delta rule's): the forward kernels keeping what
// the backward takes, then the backward kernels, against the float64 recurrence's gradient (the states
// after every token kept, token by token back: dS += scale q dO^T, dq = scale S dO; simple GLA: dk = dS v,
// dv = dS^T k; the delta rule, u = beta (v - S_a^T k) with S_a the decayed state: du = dS^T k, dk = dS u
// - beta S_a du, dv = beta du, dbeta = du . u / beta, dS_a = dS - beta k du^T; dg = exp(g) <S_before,
// dS_a>, dS = exp(g) dS_a).
int run_bwd(const Case &c) {
  std::mt19937 rng(c.seq_len * 13 + c.k_dim + c.v_heads);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> decay(-0.3f, 0.f);
  const int B = c.batch, T = c.seq_len, H = c.heads, HV = c.v_heads, K = c.k_dim, V = c.v_dim;
  const int N = c.cu.empty() ? B : int(c.cu.size()) - 1;
  auto draw = [&](size_t n, float sd, std::vector<bf16> &dev) {
    std::vector<float> x(n);
    dev.resize(n);
    for (size_t i = 0; i < n; i++) dev[i] = bf16(normal(rng) * sd), x[i] = float(dev[i]);
    return x;
  };
  std::vector<bf16> q, k, v, dout;
  const auto qf = draw(size_t(B) * T * H * K, 1.f, q), kf = draw(q.size(), 1.f / std::sqrt(float(K)), k);
  const auto vf = draw(size_t(B) * T * HV * V, 1.f, v), df = draw(v.size(), 1.f, dout);
  std::vector<float> g(size_t(B) * HV * T), beta(g.size()), h0(size_t(N) * HV * K * V), dht(h0.size());
  std::uniform_real_distribution<float> strength(0.05f, 1.f);
  for (auto &x : g) x = decay(rng);
  for (auto &x : beta) x = strength(rng);
  for (auto &x : h0) x = c.h0 ? normal(rng) : 0.f;
  for (auto &x : dht) x = c.ht ? normal(rng) : 0.f;
  const float scale = 1.f / std::sqrt(float(K));

  std::vector<double> wq(size_t(B) * T * HV * K, 0.0), wk(wq.size(), 0.0), wv(v.size(), 0.0), wg(g.size(), 0.0), wh0(h0.size());
  std::vector<double> wbeta(g.size(), 0.0);
  for (int n = 0; n < N; n++)
    for (int h = 0; h < HV; h++) {
      const int b = c.cu.empty() ? n : 0, bos = c.cu.empty() ? 0 : c.cu[n], len = c.cu.empty() ? T : c.cu[n + 1] - bos;
      const int hq = h / (HV / H);
      const size_t KV = size_t(K) * V;
      std::vector<double> S((len + 1) * KV), U(size_t(len) * V);  // S[0]: initial; S[i + 1]: after token bos + i; u
      for (size_t i = 0; i < KV; i++) S[i] = h0[(size_t(n) * HV + h) * KV + i];
      auto at = [&](const std::vector<float> &x, int t, int heads, int d) { return &x[((size_t(b) * T + t) * heads + (heads == H ? hq : h)) * d]; };
      auto gate = [&](const std::vector<float> &x, int t) { return double(x[(size_t(b) * HV + h) * T + t]); };
      for (int i = 0; i < len; i++) {
        const double e = std::exp(gate(g, bos + i));
        const float *kt = at(kf, bos + i, H, K), *vt = at(vf, bos + i, HV, V);
        double *Sn = &S[(i + 1) * KV], *u = &U[size_t(i) * V];
        for (size_t x = 0; x < KV; x++) Sn[x] = e * S[i * KV + x];
        for (int j = 0; j < V; j++) {
          double sk = 0;
          if (c.delta)
            for (int a = 0; a < K; a++) sk += Sn[size_t(a) * V + j] * kt[a];
          u[j] = c.delta ? gate(beta, bos + i) * (vt[j] - sk) : vt[j];
        }
        for (size_t x = 0; x < KV; x++) Sn[x] += double(kt[x / V]) * u[x % V];
      }
      std::vector<double> dS(KV), du(V);
      for (size_t i = 0; i < KV; i++) dS[i] = dht[(size_t(n) * HV + h) * KV + i];
      for (int i = len - 1; i >= 0; i--) {
        const int t = bos + i;
        const double e = std::exp(gate(g, t)), bt = gate(beta, t);
        const float *qt = at(qf, t, H, K), *kt = at(kf, t, H, K), *dt = at(df, t, HV, V);
        const double *St = &S[(i + 1) * KV], *Sb = &S[i * KV], *u = &U[size_t(i) * V];
        for (size_t x = 0; x < KV; x++) dS[x] += scale * double(qt[x / V]) * dt[x % V];
        const size_t r = (size_t(b) * T + t) * HV + h;
        std::fill(du.begin(), du.end(), 0.0);
        for (int a = 0; a < K; a++)
          for (int j = 0; j < V; j++) {
            const size_t x = size_t(a) * V + j;
            wq[r * K + a] += scale * St[x] * dt[j];
            wk[r * K + a] += dS[x] * u[j];
            du[j] += dS[x] * kt[a];
          }
        for (int j = 0; j < V; j++) wv[r * V + j] = c.delta ? bt * du[j] : du[j];
        if (c.delta) {
          double db = 0;
          for (int j = 0; j < V; j++) db += du[j] * u[j] / bt;
          wbeta[(size_t(b) * HV + h) * T + t] = db;
          for (int a = 0; a < K; a++)
            for (int j = 0; j < V; j++) {
              const size_t x = size_t(a) * V + j;
              wk[r * K + a] -= bt * e * Sb[x] * du[j];  // (S_a = exp(g) S_before)
              dS[x] -= bt * kt[a] * du[j];
            }
        }
        double dg = 0;
        for (size_t x = 0; x < KV; x++) dg += Sb[x] * dS[x];
        wg[(size_t(b) * HV + h) * T + t] = e * dg;
        for (auto &x : dS) x *= e;
      }
      for (size_t i = 0; i < KV; i++) wh0[(size_t(n) * HV + h) * KV + i] = dS[i];
    }

  FwdParams f{};
  f.dtype = DType::bf16;
  f.batch = B, f.seq_len = T, f.heads = H, f.v_heads = HV, f.k_dim = K, f.v_dim = V, f.num_seqs = N;
  f.max_chunks = (T + CHUNK - 1) / CHUNK;
  f.q = to_device(q), f.k = to_device(k), f.v = to_device(v), f.g = to_device(g);
  f.cu_seqlens = c.cu.empty() ? nullptr : to_device(c.cu);
  f.h0 = to_device(h0);
  f.o = to_device(std::vector<bf16>(v.size()));
  f.ht = to_device(std::vector<float>(h0.size()));
  f.scale = scale;
  const size_t states = size_t(state_slots(B, T, N, !c.cu.empty())) * HV * K * V;
  f.states = to_device(std::vector<bf16>(states, bf16(NAN)));
  BwdParams p{};
  if (c.delta) {
    f.uk = to_device(std::vector<bf16>(v.size(), bf16(NAN)));
    f.t = to_device(std::vector<bf16>(size_t(B) * T * HV * CHUNK, bf16(NAN)));
    f.beta = to_device(beta);
    WyParams wy{f.dtype, B, T, H, HV, K, N, f.max_chunks, f.k, f.g, f.beta, f.cu_seqlens, const_cast<void *>(f.t),
                to_device(std::vector<bf16>(size_t(B) * T * HV * K, bf16(NAN)))};
    CHECK(wy_fwd(wy, 0));
    f.w = wy.w;
  }
  CHECK(c.delta ? gdr_fwd_sm90(f, 0) : simple_gla_fwd_sm90(f, 0));
  p.f = f;
  p.dout = to_device(dout);
  p.dht = to_device(dht);
  p.dstates = to_device(std::vector<bf16>(states, bf16(NAN)));
  p.dq = to_device(std::vector<float>(wq.size(), NAN)), p.dk = to_device(std::vector<float>(wq.size(), NAN));
  p.dv = to_device(std::vector<bf16>(v.size(), bf16(NAN)));
  p.dg = to_device(std::vector<float>(g.size(), NAN)), p.dh0 = to_device(std::vector<float>(h0.size(), NAN));
  if (c.delta) {
    p.f.u = f.uk;  // (the backward reads the forward's U)
    p.du = to_device(std::vector<bf16>(v.size(), bf16(NAN)));
    p.dbeta = to_device(std::vector<float>(g.size(), NAN));
    CHECK(bwd_state_pass_sm90(p, 0));
    CHECK(gdr_bwd_chunks_sm90(p, 0));
  } else {
    CHECK(simple_gla_bwd_sm90(p, 0));
  }
  CHECK(cudaDeviceSynchronize());

  // (rows outside every packed sequence stay NaN: compared only where the reference wrote)
  auto rows = [&](std::vector<float> x, const std::vector<double> &want, int d, bool head_major) {
    std::vector<float> kept;
    std::vector<double> w;
    for (int n = 0; n < N; n++) {
      const int b = c.cu.empty() ? n : 0, bos = c.cu.empty() ? 0 : c.cu[n], len = c.cu.empty() ? T : c.cu[n + 1] - bos;
      for (int t = bos; t < bos + len; t++)
        for (int h = 0; h < HV; h++)
          for (int j = 0; j < d; j++) {
            const size_t i = head_major ? (size_t(b) * HV + h) * T + t : ((size_t(b) * T + t) * HV + h) * d + j;
            kept.push_back(x[i]), w.push_back(want[i]);
          }
    }
    return std::make_pair(kept, w);
  };
  bool finite = true;
  auto dvh = to_host(static_cast<bf16 *>(p.dv), v.size());
  std::vector<float> dv(dvh.begin(), dvh.end());
  auto err = [&](std::vector<float> x, const std::vector<double> &want, int d, bool head_major) {
    return std::apply([&](auto &&x, auto &&w) { return rel_err(x, w, finite); }, rows(std::move(x), want, d, head_major));
  };
  auto f32 = [](void *x) { return static_cast<float *>(x); };  // (dq, dk float32 per value head: dqk_f32)
  const double errs[] = {err(to_host(f32(p.dq), wq.size()), wq, K, false), err(to_host(f32(p.dk), wk.size()), wk, K, false),
                         err(dv, wv, V, false), err(to_host(p.dg, wg.size()), wg, 1, true),
                         rel_err(to_host(p.dh0, wh0.size()), wh0, finite),
                         c.delta ? err(to_host(p.dbeta, wbeta.size()), wbeta, 1, true) : 0.0};
  const bool ok = finite && *std::max_element(std::begin(errs), std::end(errs)) < 3e-2;
  std::printf("%s %s bwd B=%d T=%d heads %d/%d K=%d V=%d seqs=%d%s%s: dq %.3g dk %.3g dv %.3g dg %.3g dh0 %.3g dbeta %.3g\n",
              ok ? "ok  " : "FAIL", c.delta ? "delta" : "gla", B, T, H, HV, K, V, N, c.h0 ? " h0" : "", c.ht ? " dht" : "",
              errs[0], errs[1], errs[2], errs[3], errs[4], errs[5]);
  for (const void *x : std::initializer_list<const void *>{f.q, f.k, f.v, f.g, f.cu_seqlens, f.h0, f.o, f.ht, f.states, f.w,
                                                          f.uk, f.t, f.beta, p.dout, p.dht, p.dstates, p.dq, p.dk, p.dv, p.dg,
                                                          p.dh0, p.du, p.dbeta})
    if (x) CHECK(cudaFree(const_cast<void *>(x)));
  return ok ? 0 : 1;
}

int main() {
  std::setvbuf(stdout, nullptr, _IONBF, 0);  // (each case's line out before the next starts)
  int failed = 0;
  for (bool delta : {false, true}) {
    failed += run_bwd({2, 200, 2, 2, 128, 128, {}, false, true, delta});
    failed += run_bwd({1, 64, 1, 1, 64, 64, {}, true, false, delta});
    failed += run_bwd({2, 300, 2, 4, 128, 64, {}, true, true, delta});
    failed += run_bwd({1, 400, 2, 2, 128, 128, {0, 1, 1, 130, 400}, true, true, delta});
    failed += run_bwd({1, 1000, 1, 2, 64, 128, {0, 999, 1000}, false, true, delta});
    failed += run_bwd({3, 129, 4, 4, 64, 192, {}, true, true, delta});  // three value slices
  }
  for (bool delta : {false, true}) {
    failed += run({2, 200, 2, 2, 128, 128, {}, false, true, delta});      // T not a multiple of the chunk
    failed += run({1, 64, 1, 1, 64, 64, {}, true, true, delta});          // one chunk, K = 64, an initial state
    failed += run({2, 300, 2, 4, 128, 64, {}, true, false, delta});       // grouped value heads
    failed += run({1, 400, 2, 2, 128, 128, {0, 1, 1, 130, 400}, true, true, delta});  // packed: length 1, 0, 129, 270
    failed += run({1, 1000, 1, 2, 64, 128, {0, 999, 1000}, false, true, delta});      // a long one, then a length-1 one
    failed += run({3, 129, 4, 4, 64, 192, {}, true, true, delta});        // three value slices
  }
  std::printf("%s\n", failed ? "FAILED" : "all ok");
  return failed ? 2 : 0;
}
