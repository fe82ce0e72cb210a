// Unit-test kernels for the tile language. Every case loads a (and b) global -> shared with
// cp.async, shared -> registers, runs one operation and writes float32 results.
#include "tests/tile_ops.h"
#include "tk/tk.cuh"

namespace jax_tk::tests {
namespace {

using namespace tk;

enum Op {
  COPY = 0,        // out = a                  (cp.async, ldmatrix/loads, register -> global store)
  SHARED_RT = 1,   // out = a                  (via register -> shared store and back)
  GLOBAL_RT = 2,   // out = a with rows >= rows-3 zeroed (global -> register load with a short view)
  EXP = 3, EXP2 = 4, LOG = 5, ABS = 6, NEG = 7,                  // out = f(a)   (LOG on |a| + 0.5)
  ADD = 8, SUB = 9, MUL = 10, DIV = 11, MAX = 12, MIN = 13,      // out = a (op) b
  ADD_SCALAR = 14,                                               // out = a + param
  ROW_MAX = 15, ROW_SUM = 16, COL_MAX = 17, COL_SUM = 18,        // vec = reduction of a (+ v when param != 0)
  ADD_ROW = 19, SUB_ROW = 20, MUL_ROW = 21, DIV_ROW = 22,        // out[r, c] = a[r, c] (op) v[r]
  ADD_COL = 23, SUB_COL = 24, MUL_COL = 25, DIV_COL = 26,        // out[r, c] = a[r, c] (op) v[c]
  TRIL = 27, TRIU = 28,                                          // keep c - r <= / >= param, else -inf
  BOUNDS = 29,                                                   // keep r < rows - 5 and c < cols - 7, else 7
  MMA_AB = 30, MMA_ABT = 31, MMA_ATB = 32, MMA_ATBT = 33,        // out = v[0] + a (b) in the named transposes
  FILL = 34, ZERO = 35,                                          // out = param / 0
  CAST = 36,                                                     // out = float(T(float(a)) via rt<float>)
  SHARED_ST = 37,  // out = a (register -> shared store alone, read back element by element)
  KEEP_BITS = 38,         // keep a[r, c] where bit param + c of row r is set (v's words: (param + C) / 32 a row), else -inf
  KEEP_BITS_BY_COL = 39,  // keep a[r, c] where bit param + r of column c is set ((param + R) / 32 words a column), else -inf
  // 16-bit, row_l: a in 16-byte chunks from a view of its first R - 3 rows (the rest read as 0),
  // through shared memory, into registers: out = that (CHUNKS), or its transpose (CHUNKS_T, square)
  CHUNKS = 40, CHUNKS_T = 41,
  // 16-bit, row_l, square: a (CHUNKS_STORE) or a^T (CHUNKS_STORE_T) from registers to shared memory,
  // then in chunks to global memory: out's bytes as an R x C matrix of T, its first R - 2 rows (out
  // filled with 1.0f first)
  CHUNKS_STORE = 42, CHUNKS_STORE_T = 43,
  ROW_SUM_LANES = 44,  // vec = row sums of a and b: row_sum_lane over a, then b (each lane's part), then sum_lanes
  // 16-bit: uses n < param of a cp.async ring (cp_async_ring) of 2 or 3 slots, refilled before or
  // after the wait: use n is a with its rows rotated up by n; out = b + sum_n (n + 1) use_n
  RING_BEFORE_2 = 45, RING_BEFORE_3 = 46, RING_AFTER_3 = 47,
};

// The RING_* ops: the warp streams the uses through the ring's slots and adds each one up as it
// reads it. b comes in a group of its own before the ring's (with refill::before_wait the wait after
// the prologue is for it; otherwise it is read once every copy has landed).
template <typename T, typename L, int R, int C, int STAGES, refill ORDER>
__device__ void ring_op(const TileOpArgs &x, st<T, R, C> *slots, st<T, R, C> &sb) {
  using tile = st<T, R, C>;
  const cp_async_ring<STAGES, ORDER> ring;
  const T *A = static_cast<const T *>(x.a);
  const int uses = int(x.param);
  auto fill = [&](int n, int slot) {
    constexpr int row_chunks = C / tile::chunk;
    for (int i = laneid(); i < R * row_chunks; i += 32) {
      const int r = i / row_chunks, c = i % row_chunks * tile::chunk;
      cp_async16(&slots[slot](r, c), A + (r + n) % R * C + c, true);
    }
  };
  rt_fl<R, C, L> acc, f;
  rt<T, R, C, L> t;
  warp::zero(acc);
  auto add_b = [&] {
    warp::load(t, sb);
    warp::copy(f, t);
    warp::add(acc, acc, f);
  };
  load_async<32>(sb, gl<const T>::make(static_cast<const T *>(x.b), 1, R, 1, C), {}, laneid());
  commit(ring);
#pragma unroll
  for (int u = 0; u < ring.AHEAD; u++) {
    if (u < uses) fill(u, ring.slot(u));
    commit(ring);
  }
  if constexpr (ORDER == refill::before_wait) {
    wait_full(ring);
    add_b();
  }
  for (int n = 0; n < uses; n++) {
    if constexpr (ORDER == refill::before_wait) {
      if (n + ring.AHEAD < uses) fill(n + ring.AHEAD, ring.fill_slot(n + ring.AHEAD));
      commit(ring);
      wait_full(ring);
    } else {
      wait_full(ring);
      if (n + ring.AHEAD < uses) fill(n + ring.AHEAD, ring.fill_slot(n + ring.AHEAD));
      commit(ring);
    }
    warp::load(t, slots[ring.slot(n)]);
    warp::copy(f, t);
    warp::mul(f, f, float(n + 1));
    warp::add(acc, acc, f);
    if constexpr (ORDER == refill::before_wait) release(ring);
  }
  drain(ring);
  if constexpr (ORDER == refill::after_wait) {
    __syncwarp();
    add_b();
  }
  warp::store(gl<float>::make(x.out, 1, R, 1, C), acc, {});
}

template <typename T, typename L, int R, int C>
__device__ void run(const TileOpArgs &x, st<T, R, C> &sa, st<T, R, C> &sb) {
  constexpr bool is_row = std::is_same_v<L, row_l>;
  auto A = gl<const T>::make(static_cast<const T *>(x.a), 1, R, 1, C);
  auto B = gl<const T>::make(static_cast<const T *>(x.b), 1, R, 1, C);
  auto OUT = gl<float>::make(x.out, 1, R, 1, C);
  load_async<32>(sa, A, {}, laneid());
  load_async<32>(sb, B, {}, laneid());
  commit_group();
  wait_group<0>();
  __syncwarp();

  rt<T, R, C, L> a, b, r;
  warp::load(a, sa);
  warp::load(b, sb);
  using CV = col_vec<decltype(a)>;
  using RV = row_vec<decltype(a)>;
  CV cv;
  RV rv;
  warp::load(cv, x.v, R);
  warp::load(rv, x.v, C);
  const float p = x.param;

  switch (x.op) {
    case COPY: warp::copy(r, a); break;
    case SHARED_RT: {
      warp::store(sb, a);
      __syncwarp();
      warp::load(r, sb);
      break;
    }
    case SHARED_ST: {
      warp::store(sb, a);
      __syncwarp();
      for (int e = laneid(); e < R * C; e += 32) x.out[e] = convert<float>(sb(e / C, e % C));
      return;
    }
    case GLOBAL_RT: {
      auto shortA = A;
      shortA.dims[1] = R - 3;
      warp::load(r, shortA, {});
      break;
    }
    case EXP: warp::exp(r, a); break;
    case EXP2: warp::exp2(r, a); break;
    case LOG: warp::abs(r, a); warp::add(r, r, 0.5f); warp::log(r, r); break;
    case ABS: warp::abs(r, a); break;
    case NEG: warp::neg(r, a); break;
    case ADD: warp::add(r, a, b); break;
    case SUB: warp::sub(r, a, b); break;
    case MUL: warp::mul(r, a, b); break;
    case DIV: warp::div(r, a, b); break;
    case MAX: warp::max(r, a, b); break;
    case MIN: warp::min(r, a, b); break;
    case ADD_SCALAR: warp::add(r, a, p); break;
    case ROW_MAX: case ROW_SUM: {
      CV out;
      if (x.op == ROW_MAX) { if (p != 0) warp::row_max(out, a, cv); else warp::row_max(out, a); }
      else { if (p != 0) warp::row_sum(out, a, cv); else warp::row_sum(out, a); }
      warp::store(x.vec, out, R);
      return;
    }
    case ROW_SUM_LANES: {
      CV part;
      warp::fill_vec(part, 0.f);
      warp::row_sum_lane(part, a, part);
      warp::row_sum_lane(part, b, part);
      warp::sum_lanes(part);
      warp::store(x.vec, part, R);
      return;
    }
    case COL_MAX: case COL_SUM: {
      RV out;
      if (x.op == COL_MAX) { if (p != 0) warp::col_max(out, a, rv); else warp::col_max(out, a); }
      else { if (p != 0) warp::col_sum(out, a, rv); else warp::col_sum(out, a); }
      warp::store(x.vec, out, C);
      return;
    }
    case ADD_ROW: warp::add_row(r, a, cv); break;
    case SUB_ROW: warp::sub_row(r, a, cv); break;
    case MUL_ROW: warp::mul_row(r, a, cv); break;
    case DIV_ROW: warp::div_row(r, a, cv); break;
    case ADD_COL: warp::add_col(r, a, rv); break;
    case SUB_COL: warp::sub_col(r, a, rv); break;
    case MUL_COL: warp::mul_col(r, a, rv); break;
    case DIV_COL: warp::div_col(r, a, rv); break;
    case TRIL: { rt<float, R, C, L> f; warp::copy(f, a); warp::tril(f, f, int(p), -INFINITY); warp::store(OUT, f, {}); return; }
    case TRIU: { rt<float, R, C, L> f; warp::copy(f, a); warp::triu(f, f, int(p), -INFINITY); warp::store(OUT, f, {}); return; }
    case BOUNDS: warp::bounds(r, a, R - 5, C - 7, 7.f); break;
    case KEEP_BITS: case KEEP_BITS_BY_COL: {
      rt<float, R, C, L> f;
      warp::copy(f, a);
      const uint32_t *words = reinterpret_cast<const uint32_t *>(x.v);  // (v's 64 floats as bits)
      const int off = int(p), n = (off + (x.op == KEEP_BITS ? C : R) + 31) / 32;
      if (x.op == KEEP_BITS) warp::keep_bits(f, f, [=](int row) { return words + row * n; }, off, -INFINITY);
      else warp::keep_bits_by_col(f, f, [=](int col) { return words + col * n; }, off, -INFINITY);
      warp::store(OUT, f, {});
      return;
    }
    case CHUNKS: case CHUNKS_T: {
      if constexpr (is_16bit<T> && is_row && R == C) {
        auto shortA = A;
        shortA.dims[1] = R - 3;
        warp::chunks<T, R, C> c;
        warp::load(c, shortA, {});
        warp::store(sb, c);
        __syncwarp();
        if (x.op == CHUNKS) warp::load(r, sb);
        else warp::load_transposed(r, sb);
        break;
      }
      return;
    }
    case CHUNKS_STORE: case CHUNKS_STORE_T: {
      if constexpr (is_16bit<T> && is_row && R == C) {
        if (x.op == CHUNKS_STORE) warp::store(sb, a);
        else warp::store_transposed(sb, a);
        for (int e = laneid(); e < R * C; e += 32) x.out[e] = 1.f;
        __syncwarp();
        warp::chunks<T, R, C> c;
        warp::load(c, sb);
        warp::store(gl<T>::make(reinterpret_cast<T *>(x.out), 1, R - 2, 1, C), c, {});
      }
      return;
    }
    case FILL: warp::fill(r, p); break;
    case ZERO: warp::copy(r, a); warp::zero(r); break;
    case CAST: { rt<float, R, C, L> f; warp::copy(f, a); warp::copy(r, f); break; }
    case MMA_AB: case MMA_ABT: case MMA_ATB: case MMA_ATBT: {
      if constexpr (is_16bit<T> && R == C && is_row) {
        rt<T, R, C, row_l> ar, br;
        rt<T, R, C, col_l> ac, bc;
        warp::load(ar, sa); warp::load(br, sb);
        warp::load(ac, sa); warp::load(bc, sb);
        rt<float, R, C, row_l> acc, d;
        warp::fill(acc, x.v[0]);
        if (x.op == MMA_AB) warp::mma_AB(d, ar, bc, acc);
        if (x.op == MMA_ABT) warp::mma_ABt(d, ar, br, acc);
        if (x.op == MMA_ATB) warp::mma_AtB(d, ac, bc, acc);
        if (x.op == MMA_ATBT) warp::mma_AtBt(d, ac, br, acc);
        warp::store(OUT, d, {});
      }
      return;
    }
    default: return;
  }
  warp::store(OUT, r, {});
}

template <typename T, typename L, int R, int C> __device__ void run_ring(const TileOpArgs &x, st<T, R, C> &sb) {
  if constexpr (is_16bit<T>) {
    __shared__ st<T, R, C> slots[3];
    if (x.op == RING_BEFORE_2) ring_op<T, L, R, C, 2, refill::before_wait>(x, slots, sb);
    if (x.op == RING_BEFORE_3) ring_op<T, L, R, C, 3, refill::before_wait>(x, slots, sb);
    if (x.op == RING_AFTER_3) ring_op<T, L, R, C, 3, refill::after_wait>(x, slots, sb);
  }
}

template <typename T, int R, int C> __global__ void tile_op_kernel(const __grid_constant__ TileOpArgs x) {
  __shared__ st<T, R, C> sa, sb;
  if (x.op >= RING_BEFORE_2) {
    if (x.layout == 0) run_ring<T, row_l, R, C>(x, sb);
    else run_ring<T, col_l, R, C>(x, sb);
    return;
  }
  if (x.layout == 0) run<T, row_l, R, C>(x, sa, sb);
  else run<T, col_l, R, C>(x, sa, sb);
}

template <int R, int C> cudaError_t launch_shape(const TileOpArgs &x, cudaStream_t s) {
  if (x.dtype == 0) tile_op_kernel<float, R, C><<<1, 32, 0, s>>>(x);
  else if (x.dtype == 1) tile_op_kernel<bf16, R, C><<<1, 32, 0, s>>>(x);
  else if (x.dtype == 2) tile_op_kernel<half, R, C><<<1, 32, 0, s>>>(x);
  else return cudaErrorInvalidValue;
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_tile_op(const TileOpArgs &x, cudaStream_t s) {
  if (x.rows == 32 && x.cols == 64) return launch_shape<32, 64>(x, s);
  if (x.rows == 32 && x.cols == 32) return launch_shape<32, 32>(x, s);
  return cudaErrorInvalidValue;
}

}  // namespace jax_tk::tests
