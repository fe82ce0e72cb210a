// Decode attention ("flash-decoding"): the few newest query rows of each sequence against its long KV
// cache. The work is reading the cache, so the kernel is built to keep HBM busy:
//
// - One thread block owns one KV head of one sequence and up to block_rows() query rows: the query
//   heads that share that KV head times the new tokens (row r = token * group + head), so every key
//   and value is read once per KV head, not once per query head. A warp computes one tile of
//   TILE_ROWS of them; a block of TILES such tiles has groups of TILES warps, each group sharing one
//   ring of key blocks (speculative decoding's many new tokens would otherwise read the cache once
//   per tile). More rows than the maximum take more blocks (neighbours in the grid).
// - The sequence's keys may be split into `splits` parts, one thread block each, when sequences x KV
//   heads alone would leave SMs idle; the parts' outputs are merged through their log-sum-exp by a
//   second small kernel (merge_kernel).
// - Inside a block every group of TILES warps (one warp with a single tile) is an independent
//   flash-decoding worker over its own key blocks (blocks g, g + GROUPS, ... of the part): a cp.async
//   ring of STAGES blocks of K and V of its own (tk::cp_async_ring), filled by its warps together and
//   synchronized by the group's own named barrier, no block-wide barrier in the key loop (a ring per
//   group, not one for the block). S = Q K^T and O += P V run on mma.sync (on wgmma for a group of a
//   whole warpgroup on sm_90a); the online softmax is the tile language's. At the end the groups
//   merge their (max, sum, O) through shared memory (common.cuh). On sm_90a blocks of 128 rows take a
//   kernel of their own, warp-specialized (decode_sm90.cu).
// - Keys are gathered row by row (KeyRows: one address per run of 16 rows), so a paged cache costs its
//   page-table reads and nothing else: one per page a block touches, read 32 entries ahead (Pages),
//   or, for pages of other sizes, one per key row (a step ahead). Rows past the sequence's length (or
//   in a page outside the pool) are never read; their zeros make no NaN.
#include <algorithm>

#include "decode/common.cuh"

namespace jax_tk::decode {
namespace {

// Many short warps beat few deep ones: a warp's step is a chain of dependent mma, shuffles and exp2
// that only more warps overlap, while two stages already keep enough bytes in flight. WIDE blocks take
// a whole SM (core::WAVE_BLOCKS counts on it): a grid of one wave. A grid of several waves takes blocks of
// half the warps (HALF), two per SM, so that one block's ramp and tail overlap the other's streaming
// instead of leaving the SM idle between blocks. A block of TILES row tiles has WARPS / TILES groups
// (at least TILES warps: eight tiles take a whole SM), each with a ring of key blocks TILES times
// longer: longer blocks, up to 128 keys, then more stages (two at most for four or more tiles, which
// are a lone group at head dim 256). Blocks of four and eight tiles (on Hopper the latter take
// decode_sm90.cu's kernel) fit an A100's shared memory. Where a WIDE block does not fit the device
// (head dim 256 on an A100), it takes the HALF one; where that does not fit either (head dim 256 on
// GPUs of SMALL_GPU_SMEM), the SMALL one: HALF with two stages. (On those GPUs eight tiles, and four at
// head dim 256, run as two blocks of half the rows; so do eight tiles at head dim 256 on any GPU but
// Hopper.)
enum Width { SMALL, HALF, WIDE };
template <typename T, int D, int W, int TILES_> struct Config {
  static constexpr int TILES = TILES_, BASE_WARPS = (D <= 128 ? 8 : 4) / (W == WIDE ? 1 : 2);
  static constexpr int WARPS = BASE_WARPS > TILES ? BASE_WARPS : TILES, THREADS = 32 * WARPS;
  static constexpr int GROUPS = WARPS / TILES, ROWS = TILE_ROWS * TILES;
  // keys per group step: 8 KiB of K and V per tile (16 KiB at D=256)
  static constexpr int TILE_KEYS = D >= 128 ? 16 : 32, KEYS = TILE_KEYS * TILES < 128 ? TILE_KEYS * TILES : 128;
  static constexpr int STAGES = (D <= 128 || W == SMALL || TILES > 2 ? 2 : 3) * (TILE_KEYS * TILES / KEYS);
  static constexpr bool Q_IN_REGISTERS = D <= 128;  // at D=256 the query stays in shared memory
  using Stage = KeyBlock<T, KEYS, D>;
  struct Shared {
    st<T, ROWS, D> q;
    Stage stage[GROUPS][STAGES];
    float weight[GROUPS][ROWS];  // each group's share of the merged rows
    float lse[ROWS];
  };
  // (a HALF block of one group, four tiles at D=256, is the WIDE one)
  static constexpr int BLOCKS_PER_SM = W == HALF && sizeof(Shared) * 2 <= 227 * 1024 ? 2 : 1;
  static_assert(WARPS % TILES == 0 && GROUPS <= 15);  // (a named barrier per group: ids 1..GROUPS)
  static_assert(sizeof(Shared) * BLOCKS_PER_SM <= 227 * 1024 && (TILES < 4 || sizeof(Shared) <= 163 * 1024));
  static_assert(W != SMALL || sizeof(Shared) <= SMALL_GPU_SMEM);
};

template <typename T, int D, typename C, bool PAGED>
__global__ __launch_bounds__(C::THREADS, C::BLOCKS_PER_SM) void decode_kernel(const __grid_constant__ Params params) {
  const Params p = cache_layout<PAGED>(params);
  constexpr int KEYS = C::KEYS, STAGES = C::STAGES, TILES = C::TILES, GROUPS = C::GROUPS;
  grid_dependency_wait();  // (launched to wait here: see launch)
  extern __shared__ __align__(1024) char smem_raw[];
  auto &sm = *reinterpret_cast<typename C::Shared *>(smem_raw);

  const int tid = threadIdx.x, g = warpid() / TILES, t = warpid() % TILES;  // the warp's group and tile
  const Block blk = block_of<C::ROWS, KEYS>(p);
  const Rows &R = blk.R;
  const int j0 = blk.j0, j1 = blk.j1;
  // The group's barrier: its warps' copies of a stage have landed / are done being read.
  auto group_sync = [g] {
    if constexpr (TILES == 1) __syncwarp();
    else sync_named(1 + g, 32 * TILES);
  };
  const cp_async_ring<STAGES> kv;  // the group's key blocks: use n is its n-th block
  load_query<C::THREADS>(sm.q, p, blk, tid);
  commit(kv);  // (a group before the ring's)

  // On sm_90a a group of one whole warpgroup (four tiles, 64 rows) multiplies on wgmma, both
  // products' operands straight from shared memory (the query rows and the ring's K and V; P from
  // registers), which keeps up with the cache where mma.sync no longer does. (Blocks of 128 rows take
  // decode_sm90.cu's kernel there.)
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool WGMMA = TILES == 4;
#else
  constexpr bool WGMMA = false;
#endif

  auto &slots = sm.stage[g];
  auto block_of = [&](int n) { return j0 + g + GROUPS * n; };  // the group's n-th key block
  KeyRows<T, D, KEYS, 32 * TILES> next;  // the rows of the next block to load (this warp's share)
  Pages<KEYS> pages(p, blk.b, j0 + g, GROUPS);
  auto find = [&](int n) {  // the rows of the group's n-th block
    if (pages.used) next.find(p, pages, n, block_of(n) * KEYS, R.valid);
    else next.find(p, blk.b, block_of(n) * KEYS, R.valid);
  };
#pragma unroll
  for (int u = 0; u < kv.AHEAD; u++) {  // the ring's prologue
    if (block_of(u) < j1) {
      find(u);
      next.load(slots[kv.slot(u)], p, blk.h);
    }
    commit(kv);
  }
  if (block_of(kv.AHEAD) < j1) find(kv.AHEAD);  // (the rows of the block step 0 loads)
  wait_full(kv);  // the query rows have landed

  const int r_tile = TILE_ROWS * t;
  rt<T, 16, 16> q[C::Q_IN_REGISTERS && !WGMMA ? D / 16 : 1];
  if constexpr (C::Q_IN_REGISTERS && !WGMMA)
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) warp::load(q[kk], sm.q, r_tile, 16 * kk);

  // Each lane's two rows (lane / 4 and lane / 4 + 8): the keys they see, for the elementwise mask.
  using s_tile = rt_fl<TILE_ROWS, KEYS>;
  rv<int2, TILE_ROWS, typename col_vec<s_tile>::layout> row_keys;
  warp::map_index(row_keys, [&](int r) { return R.row_keys(p, r_tile + r); });
  const bool capped = p.softcap > 0.f;
  const float c = capped ? 1.f : p.scale * LOG2E;  // logits are in units of 1 / c (tk::warp::softmax_step)

  rt_fl<TILE_ROWS, 16> o[D / 16];
  auto &whole = reinterpret_cast<rt_fl<TILE_ROWS, D> &>(o);  // (the same pieces, in order)
  col_vec<s_tile> m, l, corr;
#pragma unroll
  for (int n = 0; n < D / 16; n++) warp::zero(o[n]);
  warp::fill_vec(m, NEG_INF);
  warp::fill_vec(l, 0.f);

  // Groups of several warps take as many steps as the first group, one past its last block only
  // through its two barriers: every warp then passes as many named barriers, which compute-sanitizer's
  // racecheck needs to pair them.
  const int steps = TILES > 1 && j1 > j0 ? (j1 - j0 + GROUPS - 1) / GROUPS : 0;
  for (int n = 0; block_of(n) < j1 || n < steps; n++) {
    if (TILES > 1 && block_of(n) >= j1) {
      group_sync();
      group_sync();
      continue;
    }
    const int k0 = block_of(n) * KEYS;
    if (block_of(n + kv.AHEAD) < j1) next.load(slots[kv.fill_slot(n + kv.AHEAD)], p, blk.h);
    commit(kv);
    if (block_of(n + kv.AHEAD + 1) < j1) find(n + kv.AHEAD + 1);  // (the rows of the block step n + 1 loads)
    wait_full(kv, [&] {
      if constexpr (WGMMA) warpgroup::fence_shared_writes();  // the copies, for wgmma's (async) proxy
      group_sync();
    });
    const auto &cur = slots[kv.slot(n)];

    s_tile s;
    if constexpr (WGMMA) {
      warpgroup::mma_ABt(s, sm.q, cur.k, false);
      warpgroup::wait<0>();
      warpgroup::fence_registers(s);
    } else {
      warp::zero(s);
#pragma unroll
      for (int kk = 0; kk < D / 16; kk++) {
        rt<T, KEYS, 16> kt;
        warp::load(kt, cur.k, 0, 16 * kk);
        if constexpr (C::Q_IN_REGISTERS) {
          warp::mma_ABt(s, q[kk], kt, s);
        } else {
          rt<T, 16, 16> qk;
          warp::load(qk, sm.q, r_tile, 16 * kk);
          warp::mma_ABt(s, qk, kt, s);
        }
      }
    }
    softmax_block(s, p, capped, blk, row_keys, k0, m, l, corr, c);

    rt<T, TILE_ROWS, KEYS> pr;
    warp::copy(pr, s);
    if constexpr (WGMMA) {
      warp::mul_row(whole, whole, corr);
      warpgroup::mma_AB(whole, pr, cur.v, true);
      warpgroup::wait<0>();
      warpgroup::fence_registers(whole);
    } else {
#pragma unroll
      for (int d = 0; d < D / 16; d++) {
        rt<T, KEYS, 16, col_l> vt;
        warp::load(vt, cur.v, 0, 16 * d);
        warp::mul_row(o[d], o[d], corr);
        warp::mma_AB(o[d], pr, vt, o[d]);
      }
    }
    release(kv, group_sync);  // every warp of the group is done with this stage before it is refilled
  }
  drain(kv);
  __syncwarp();
  finish<T, D, C, C::THREADS>(p, sm, blk, whole, m, l, c, g, t, tid, [] { __syncthreads(); });
}

// out = sum_s 2^(lse_s - lse) O_s over the parts s of every query row (one warp a row), lse the
// log-sum-exp of the parts' and the sink's (a part of its own with no value); 0 for a row that no part
// saw a key of. The kernel is a few memory latencies long, so it issues its loads
// together: the outputs of BATCH parts (lane l: columns l, l + 32, ...) before the lse of every part
// (lane l: parts l, l + 32, ...), and only then waits for any of them. Typical split counts take one
// batch.
template <typename T, int D> __global__ __launch_bounds__(128) void merge_kernel(const __grid_constant__ Params p) {
  // (BATCH parts' columns in registers: 16 up to D = 256, 8 at MLA's 512)
  constexpr int PER_LANE = (MAX_SPLITS + 31) / 32, BATCH = D <= 256 ? 16 : 8, COLS = D / 32;
  grid_dependency_wait();  // the main kernel's parts (see launch)
  const size_t q_rows = (size_t)p.batch * p.q_len * p.q_heads;
  const size_t row = (size_t)blockIdx.x * 4 + warpid();
  if (row >= q_rows) return;
  const int lane = laneid();
  const float *lse = p.workspace + row, *o = p.workspace + p.splits * q_rows + row * D + lane;
  auto load_batch = [&](int s0, float (&v)[BATCH][COLS]) {
#pragma unroll
    for (int i = 0; i < BATCH; i++)
#pragma unroll
      for (int k = 0; k < COLS; k++) v[i][k] = s0 + i < p.splits ? o[(size_t)(s0 + i) * q_rows * D + 32 * k] : 0.f;
  };
  float v[BATCH][COLS];
  load_batch(0, v);
  const float sink = sink_of(p, row);  // (read with the parts' loads, used after them)
  float x[PER_LANE], mx = NEG_INF;
#pragma unroll
  for (int i = 0; i < PER_LANE; i++) {
    const int s = lane + 32 * i;
    x[i] = s < p.splits ? lse[s * q_rows] : NEG_INF;
    mx = fmaxf(mx, x[i]);
  }
  // (across the lanes of a quad, then across the quads: all 32 lanes)
  mx = warp::across_lanes<warp::op::max, ortho_l>(warp::across_lanes<warp::op::max, align_l>(mx));
  const float s2 = warp::sink_log2(sink);
  mx = fmaxf(mx, s2);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < PER_LANE; i++) {
    x[i] = mx == NEG_INF ? 0.f : warp::fn::exp2(x[i] - mx);  // the part's weight
    sum += x[i];
  }
  sum = warp::across_lanes<warp::op::sum, ortho_l>(warp::across_lanes<warp::op::sum, align_l>(sum));
  if (s2 != NEG_INF) sum += warp::fn::exp2(s2 - mx);
  float acc[COLS] = {};
  for (int s0 = 0; s0 < p.splits; s0 += BATCH) {
    if (s0 > 0) load_batch(s0, v);
#pragma unroll
    for (int i = 0; i < BATCH; i++) {
      const int s = s0 + i;  // (its weight is lane s % 32's x[s / 32])
      float w = 0.f;
#pragma unroll
      for (int j = 0; j < PER_LANE; j++) {
        const float e = __shfl_sync(~0u, x[j], s % 32);
        if (s / 32 == j) w = e;
      }
#pragma unroll
      for (int k = 0; k < COLS; k++) acc[k] += w * v[i][k];
    }
  }
  T *out = static_cast<T *>(p.o) + row * D;
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  if (lane == 0) store_lse(p, row, sum > 0.f ? mx + warp::fn::log2(sum) : NEG_INF);
#pragma unroll
  for (int k = 0; k < COLS; k++) out[k * 32 + lane] = convert<T>(acc[k] * inv);
}

// The merge of a split call's parts (nothing to do for one part).
template <typename T, int D> cudaError_t merge(const Params &p, cudaStream_t stream) {
  if (p.splits == 1) return cudaSuccess;
  const size_t q_rows = (size_t)p.batch * p.q_len * p.q_heads;
  return launch(merge_kernel<T, D>, dim3(unsigned((q_rows + 3) / 4)), dim3(128), 0, stream, p, true);
}

// Whether a block of that config fits the shared memory a block may take.
template <typename T, int D, int W, int TILES> bool fits(size_t smem) {
  return sizeof(typename Config<T, D, W, TILES>::Shared) <= smem;
}

// The main kernel for blocks of TILES row tiles, given the shared memory a block may take. (Eight
// tiles take the whole SM whatever the grid.)
template <typename T, int D, int TILES> cudaError_t by_grid(const Params &p, size_t smem, cudaStream_t stream) {
  const dim3 grid = grid_of(p, TILE_ROWS * TILES);
  auto go = [&]<int W>() {
    using C = Config<T, D, W, TILES>;
    return launch(p.page_table ? decode_kernel<T, D, C, true> : decode_kernel<T, D, C, false>, grid, dim3(C::THREADS), sizeof(typename C::Shared), stream, p, true);
  };
  if constexpr (TILES == 8) {
    return go.template operator()<WIDE>();
  } else {
    if (fits<T, D, WIDE, TILES>(smem) && size_t(grid.x) * grid.y * grid.z <= core::WAVE_BLOCKS) return go.template operator()<WIDE>();
    if constexpr (D > 128 && TILES < 4)  // (run() gives four tiles at D=256 only where they fit)
      if (!fits<T, D, HALF, TILES>(smem)) return go.template operator()<SMALL>();
    return go.template operator()<HALF>();
  }
}

// The main kernel for the block's tiles of rows, then the merge of the parts.
template <typename T, int D> cudaError_t run(const Params &p, cudaStream_t stream) {
  int dev = 0, smem = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  if (cudaError_t e = cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev); e != cudaSuccess) return e;
  if (p.smem_limit > 0) smem = std::min(smem, p.smem_limit);
  int tiles = block_rows(p.q_heads / p.kv_heads * p.q_len) / TILE_ROWS;
  // Eight tiles at D=256 have a block only on Hopper (decode_sm90.cu); elsewhere they run as two of four.
  if (tiles == 8 && !p.sm90 && D > 128) tiles = 4;
  cudaError_t e = cudaErrorInvalidValue;
  if (tiles == 1) e = by_grid<T, D, 1>(p, smem, stream);
  if (tiles == 2) e = by_grid<T, D, 2>(p, smem, stream);
  // (where the largest blocks do not fit the device, blocks of half the rows: the cache is read twice)
  if (tiles == 4) e = fits<T, D, WIDE, 4>(smem) ? by_grid<T, D, 4>(p, smem, stream) : by_grid<T, D, 2>(p, smem, stream);
  if (tiles == 8) {
    if (p.sm90) e = decode_sm90_128(p, stream);
    else if constexpr (D <= 128) e = fits<T, D, WIDE, 8>(smem) ? by_grid<T, D, 8>(p, smem, stream) : by_grid<T, D, 4>(p, smem, stream);
  }
  if (e != cudaSuccess) return e;
  return merge<T, D>(p, stream);
}

// One warp per new row (sequence b, token t, KV head h), its key and its value in 16-byte pieces.
template <int D> __global__ __launch_bounds__(128) void append_kernel(const __grid_constant__ Params p, const __grid_constant__ Append a) {
  if (blockIdx.x == 0)
    for (int b = threadIdx.x; b < p.batch; b += blockDim.x) a.lengths_after[b] = a.lengths_before[b] + p.q_len;
  const long long row = (long long)blockIdx.x * 4 + warpid();
  if (row >= (long long)p.batch * p.q_len * p.kv_heads) return;
  const int h = int(row % p.kv_heads), t = int(row / p.kv_heads % p.q_len), b = int(row / p.kv_heads / p.q_len);
  const int pos = a.lengths_before[b] + t;
  const long long at = pos < 0 ? -1 : cache_row(p, b, pos, p.capacity);  // (-1: no row to write)
  if (at < 0) return;
  constexpr int PIECES = D * 2 / 16;  // (2-byte elements)
  const uint4 *src[2] = {static_cast<const uint4 *>(a.k_new) + row * PIECES, static_cast<const uint4 *>(a.v_new) + row * PIECES};
  uint4 *dst[2] = {static_cast<uint4 *>(const_cast<void *>(p.k)) + (at * p.kv_heads + h) * PIECES,
                   static_cast<uint4 *>(const_cast<void *>(p.v)) + (at * p.kv_heads + h) * PIECES};
  for (int i = laneid(); i < 2 * PIECES; i += 32) dst[i / PIECES][i % PIECES] = src[i / PIECES][i % PIECES];
}

}  // namespace

cudaError_t append(const Params &p, const Append &a, cudaStream_t stream) {
  const long long rows = (long long)p.batch * p.q_len * p.kv_heads;
  const dim3 grid(unsigned(std::max<long long>((rows + 3) / 4, 1)));
  return by_type<64, 128, 256>(p, [&]<typename T, int D>() {
    append_kernel<D><<<grid, 128, 0, stream>>>(p, a);
    return cudaGetLastError();
  });
}

cudaError_t decode(const Params &p, cudaStream_t stream) {
  if (p.head_dim == MLA_HEAD_DIM) {
    if (!p.sm90) return cudaErrorInvalidValue;  // (the FFI handler says why first)
    if (cudaError_t e = decode_mla_sm90(p, stream); e != cudaSuccess) return e;
    Params out = p;  // (the merge's rows are the values' width)
    out.head_dim = MLA_V_HEAD_DIM;
    return p.dtype == DType::bf16 ? merge<bf16, MLA_V_HEAD_DIM>(out, stream) : merge<half, MLA_V_HEAD_DIM>(out, stream);
  }
  return by_type<64, 128, 256>(p, [&]<typename T, int D>() { return run<T, D>(p, stream); });
}

}  // namespace jax_tk::decode
