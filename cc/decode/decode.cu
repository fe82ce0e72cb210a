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
//   ring of STAGES blocks of K and V of its own, filled by its warps together and synchronized by the
//   group's own named barrier, no block-wide barrier in the key loop (a ring per group, not
//   tk/pipeline's block-wide one). S = Q K^T and O += P V run on mma.sync (on wgmma for groups of
//   whole warpgroups on sm_90a); the online softmax is the tile language's. At the end the groups
//   merge their (max, sum, O) through shared memory.
// - Keys are gathered row by row, so a paged cache costs one page-table read per key row (cached,
//   and issued a step ahead) and nothing else; rows past the sequence's length (or in a page outside
//   the pool) are never read, their zeros make no NaN.
#include <climits>

#include "decode/decode.h"
#include "tk/tk.cuh"

namespace jax_tk::decode {
namespace {

using namespace tk;

// Many short warps beat few deep ones: a warp's step is a chain of dependent mma, shuffles and exp2
// that only more warps overlap, while two stages already keep enough bytes in flight. WIDE blocks take
// a whole SM (TARGET_BLOCKS counts on it): a grid of one wave. A grid of several waves takes blocks of
// half the warps, two per SM, so that one block's ramp and tail overlap the other's streaming instead
// of leaving the SM idle between blocks. A block of TILES row tiles has WARPS / TILES groups (at least
// TILES warps: eight tiles take a whole SM), each with a ring of key blocks TILES times longer: longer
// blocks, up to 128 keys, then more stages. Eight tiles are a lone group, with no other to overlap
// its waits: one stage more.
template <typename T, int D, bool WIDE, int TILES_> struct Config {
  static constexpr int TILES = TILES_, BASE_WARPS = (D <= 128 ? 8 : 4) / (WIDE ? 1 : 2);
  static constexpr int WARPS = BASE_WARPS > TILES ? BASE_WARPS : TILES, THREADS = 32 * WARPS;
  static constexpr int GROUPS = WARPS / TILES, ROWS = TILE_ROWS * TILES;
  static constexpr int BLOCKS_PER_SM = WIDE ? 1 : 2;
  // keys per group step: 8 KiB of K and V per tile (16 KiB at D=256)
  static constexpr int TILE_KEYS = D >= 128 ? 16 : 32, KEYS = TILE_KEYS * TILES < 128 ? TILE_KEYS * TILES : 128;
  static constexpr int STAGES = (D <= 128 ? 2 : 3) * (TILE_KEYS * TILES / KEYS) + (TILES == 8 ? 1 : 0);
  static constexpr bool Q_IN_REGISTERS = D <= 128;  // at D=256 the query stays in shared memory
  using q_tile = st<T, ROWS, D>;
  using kv_tile = st<T, KEYS, D>;
  struct Stage {
    kv_tile k, v;
  };
  // What a warp leaves for the merge, in its group's stages once the key loop is over.
  struct Partial {
    st<float, TILE_ROWS, D> o;  // normalized output of the warp's tile
    float lse[TILE_ROWS];       // log2 units; -inf for a row that saw no key
  };
  struct Shared {
    q_tile q;
    Stage stage[GROUPS][STAGES];
    float weight[GROUPS][ROWS];  // each group's share of the merged rows
    float lse[ROWS];
  };
  static_assert(WARPS % TILES == 0 && GROUPS <= 15);  // (a named barrier per group: ids 1..GROUPS)
  static_assert(sizeof(Partial) * TILES <= sizeof(Stage) * STAGES);
  static_assert(sizeof(Shared) * BLOCKS_PER_SM <= 227 * 1024);
};

// The cache row (of the cache seen as [rows, kv_heads, head_dim]) of key position j of sequence b; -1
// where there is no valid row (past the length, or a page outside the pool).
__device__ __forceinline__ int cache_row(const Params &p, int b, int j, int valid) {
  if (j >= valid) return -1;
  if (!p.page_table) return b * p.capacity + j;
  const int slot = p.page_shift >= 0 ? j >> p.page_shift : j / p.page_size;
  const int page = __ldg(p.page_table + (size_t)b * p.max_pages + slot);
  if (unsigned(page) >= unsigned(p.num_pages)) return -1;
  return page * p.page_size + (p.page_shift >= 0 ? j & (p.page_size - 1) : j % p.page_size);
}

// One warp's share of loading a block of KEYS keys (K and V) with the other warps of its group: lane l
// of the group (warp t's lanes are 32 t, ..., 32 t + 31) takes the 16-byte chunks l, l + 32 TILES, ... of
// the block (consecutive lanes, consecutive chunks of a row). find() works out their cache rows
// (the page-table reads of a paged cache) one step before load() issues the copies, so that the
// table's latency is not on the path of the loads.
template <typename C, typename T, int D> struct KeyRows {
  static constexpr int ROW_CHUNKS = D / 8, LANES = 32 * C::TILES, PER_LANE = C::KEYS * ROW_CHUNKS / LANES;
  static_assert(PER_LANE * LANES == C::KEYS * ROW_CHUNKS);
  int row[PER_LANE];
  __device__ __forceinline__ static int lane() { return 32 * (warpid() % C::TILES) + laneid(); }  // in the group

  __device__ __forceinline__ void find(const Params &p, int b, int k0, int valid) {
    if (p.page_table && p.page_size % C::KEYS == 0) {  // the block lies in one page: one table read
      const int first = cache_row(p, b, k0, valid);
#pragma unroll
      for (int i = 0; i < PER_LANE; i++) {
        const int key = (i * LANES + lane()) / ROW_CHUNKS;
        row[i] = first >= 0 && k0 + key < valid ? first + key : -1;
      }
      return;
    }
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) row[i] = cache_row(p, b, k0 + (i * LANES + lane()) / ROW_CHUNKS, valid);
  }
  // Zeros for rows without a valid key.
  __device__ __forceinline__ void load(typename C::Stage &stage, const Params &p, int h) const {
    const T *K = static_cast<const T *>(p.k), *V = static_cast<const T *>(p.v);
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) {
      const int idx = i * LANES + lane(), r = idx / ROW_CHUNKS, c = (idx % ROW_CHUNKS) * 8;
      const long long at = row[i] < 0 ? 0 : ((long long)row[i] * p.kv_heads + h) * D + c;
      cp_async16(&stage.k(r, c), K + at, row[i] >= 0);
      cp_async16(&stage.v(r, c), V + at, row[i] >= 0);
    }
  }
};

// Which keys the query rows of a tile see. Row r of the tile is row r0 + r of the sequence's (q_len x
// group) rows, (token, head) = divmod(r0 + r, group), at position end - q_len + token.
struct Rows {
  int valid;   // keys [0, valid) hold data: the length clamped to [0, capacity]
  int end;     // the length as given (positions count from it)
  int group, q_len, r0, rows;
  __device__ __forceinline__ bool real(int r) const { return r0 + r < rows; }
  __device__ __forceinline__ int position(int r) const { return end - q_len + (r0 + r) / group; }
  // The keys [lo, hi) a row at `position` sees (an empty range for a negative position).
  __device__ __forceinline__ int2 keys(const Params &p, int position) const {
    if (position < 0) return {0, 0};
    int lo = p.window_left >= 0 ? max(0, position - p.window_left) : 0, hi = valid;
    if (p.causal) hi = min(hi, position + 1);
    if (p.window_right >= 0) hi = min(hi, position + p.window_right + 1);
    return {lo, max(lo, hi)};
  }
  __device__ __forceinline__ int2 row_keys(const Params &p, int r) const { return real(r) ? keys(p, position(r)) : int2{0, 0}; }
};

// The log-sum-exp (natural log; -inf: no key) of query row `row` of [batch, q_len, q_heads] into
// Params::lse, which is [batch, q_heads, q_len] (the attention kernels' layout).
__device__ __forceinline__ void store_lse(const Params &p, size_t row, float lse2) {
  const int head = row % p.q_heads, token = (row / p.q_heads) % p.q_len, b = row / ((size_t)p.q_heads * p.q_len);
  p.lse[((size_t)b * p.q_heads + head) * p.q_len + token] = lse2 == NEG_INF ? NEG_INF : lse2 * LN2;
}

template <typename T, int D, typename C>
__global__ __launch_bounds__(C::THREADS, C::BLOCKS_PER_SM) void decode_kernel(const __grid_constant__ Params p) {
  constexpr int ROWS = C::ROWS, KEYS = C::KEYS, STAGES = C::STAGES, TILES = C::TILES, GROUPS = C::GROUPS;
  extern __shared__ __align__(1024) char smem_raw[];
  auto &sm = *reinterpret_cast<typename C::Shared *>(smem_raw);

  const int b = blockIdx.z, h = blockIdx.y, group = p.q_heads / p.kv_heads, rows = group * p.q_len;
  const int chunks = (rows + ROWS - 1) / ROWS, chunk = blockIdx.x % chunks, part = blockIdx.x / chunks;
  const int tid = threadIdx.x, g = warpid() / TILES, t = warpid() % TILES;  // the warp's group and tile
  const int length = p.lengths[b];
  const Rows R{min(max(length, 0), p.capacity), length, group, p.q_len, chunk * ROWS, rows};
  const int first = R.position(0), last = R.position(min(ROWS, rows - R.r0) - 1);  // (real rows)
  // The group's barrier: its warps' copies of a stage have landed / are done being read.
  auto group_sync = [g] {
    if constexpr (TILES == 1) __syncwarp();
    else sync_named(1 + g, 32 * TILES);
  };

  // The block's query rows, (token, head) = divmod(r0 + r, group), zeros past the real rows.
  const T *Q = static_cast<const T *>(p.q);
  for (int i = tid; i < ROWS * (D / 8); i += C::THREADS) {
    const int r = i / (D / 8), c = (i % (D / 8)) * 8, x = R.r0 + r;
    const size_t at = x < rows ? (((size_t)b * p.q_len + x / group) * p.q_heads + h * group + x % group) * D + c : 0;
    cp_async16(&sm.q(r, c), Q + at, x < rows);
  }
  commit_group();

  // Keys some row of the block sees: [lo, hi) (lo from the last row's window, hi from the last row's
  // position), in blocks of KEYS, of which this part takes [j0, j1). Keys in [full_lo, full_hi) are
  // seen by every real row: blocks inside need no elementwise mask.
  const int2 last_keys = R.keys(p, last), first_keys = R.keys(p, first);
  const int lo = first >= 0 ? first_keys.x : 0, hi = last_keys.y;  // (a row at position 0 starts at 0)
  const int full_lo = last_keys.x, full_hi = first >= 0 ? first_keys.y : INT_MIN;
  const int blocks0 = lo / KEYS, blocks = hi > lo ? (hi + KEYS - 1) / KEYS - blocks0 : 0;
  const int per_part = (blocks + p.splits - 1) / p.splits;
  const int j0 = blocks0 + min(blocks, part * per_part), j1 = blocks0 + min(blocks, (part + 1) * per_part);

  // On sm_90a a group of whole warpgroups (four tiles, 64 rows, each) multiplies on wgmma, both
  // products' operands straight from shared memory (the warpgroup's 64 query rows and the ring's K and
  // V; P from registers), which keeps up with the cache where mma.sync no longer does.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool WGMMA = TILES % 4 == 0;
#else
  constexpr bool WGMMA = false;
#endif

  auto &ring = sm.stage[g];
  auto block_of = [&](int n) { return j0 + g + GROUPS * n; };  // the group's n-th key block
  KeyRows<C, T, D> next;  // the rows of the next block to load (this warp's share)
#pragma unroll
  for (int n = 0; n < STAGES - 1; n++) {
    if (block_of(n) < j1) {
      next.find(p, b, block_of(n) * KEYS, R.valid);
      next.load(ring[n], p, h);
    }
    commit_group();
  }
  if (block_of(STAGES - 1) < j1) next.find(p, b, block_of(STAGES - 1) * KEYS, R.valid);
  wait_group<STAGES - 1>();  // the query rows (the oldest group) have landed
  __syncthreads();

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
    if (block_of(n + STAGES - 1) < j1) next.load(ring[(n + STAGES - 1) % STAGES], p, h);
    commit_group();
    if (block_of(n + STAGES) < j1) next.find(p, b, block_of(n + STAGES) * KEYS, R.valid);
    wait_group<STAGES - 1>();
    if constexpr (WGMMA) warpgroup::fence_shared_writes();  // the copies, for wgmma's (async) proxy
    group_sync();
    const auto &cur = ring[n % STAGES];

    s_tile s;
    if constexpr (WGMMA) {
      warpgroup::mma_ABt(s, window<64, D>(sm.q, 64 * (t / 4), 0), cur.k, false);
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
    if (capped) {
      const float in = p.scale / p.softcap, out = p.softcap * LOG2E;
      warp::map(s, s, [=](float x) { return out * warp::tanh_fast(x * in); });
    }
    if (k0 < full_lo || k0 + KEYS > full_hi) {
      rv<int, KEYS, typename row_vec<s_tile>::layout> cols;
      warp::map_index(cols, [&](int x) { return k0 + x; });
      warp::map_outer(s, s, row_keys, cols, [](float x, int2 r, int j) { return j >= r.x && j < r.y ? x : NEG_INF; });
    }
    warp::softmax_step(s, m, l, corr, c);

    rt<T, TILE_ROWS, KEYS> pr;
    warp::copy(pr, s);
    if constexpr (WGMMA) {
      auto &whole = reinterpret_cast<rt_fl<TILE_ROWS, D> &>(o);  // (the same pieces, in order)
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
    group_sync();  // every warp of the group is done with this stage before it is refilled
  }
  wait_group<0>();
  __syncwarp();

  // The warp's partial result into its group's stages (the group is past its last read of them): O / l
  // and the rows' log-sum-exp (log2 units).
  auto partial = [&](int x, int tile) -> typename C::Partial & {
    return reinterpret_cast<typename C::Partial *>(&sm.stage[x])[tile];
  };
  auto &mine = partial(g, t);
#pragma unroll
  for (int d = 0; d < D / 16; d++) {
    warp::normalize_output(o[d], l);
    warp::store(mine.o, o[d], 0, 16 * d);
  }
  col_vec<s_tile> lse;
  warp::map_vec(lse, m, l, [=](float mx, float x) { return x > 0.f ? mx * c + warp::fn::log2(x) : NEG_INF; });
  warp::store(mine.lse, lse, TILE_ROWS);
  __syncthreads();

  // Merge the groups: row r gets sum_x weight[x][r] O_x with weight = 2^(lse_x - lse) (0 for a group
  // that saw nothing), lse the log-sum-exp of the groups' (-inf if none saw a key).
  if (tid < ROWS) {
    const int tile = TILES == 1 ? 0 : tid / TILE_ROWS, r = TILES == 1 ? tid : tid % TILE_ROWS;
    float mx = NEG_INF;
    for (int x = 0; x < GROUPS; x++) mx = fmaxf(mx, partial(x, tile).lse[r]);
    float sum = 0.f;
    for (int x = 0; x < GROUPS; x++) {
      const float e = mx == NEG_INF ? 0.f : warp::fn::exp2(partial(x, tile).lse[r] - mx);
      sm.weight[x][tid] = e;
      sum += e;
    }
    for (int x = 0; x < GROUPS; x++) sm.weight[x][tid] = sum > 0.f ? sm.weight[x][tid] / sum : 0.f;
    sm.lse[tid] = sum > 0.f ? mx + warp::fn::log2(sum) : NEG_INF;
  }
  __syncthreads();

  // Rows go to the output (one part) or to the workspace (this part's share of a split sequence).
  const size_t q_rows = (size_t)p.batch * p.q_len * p.q_heads;
  auto row_index = [&](int r) {  // of the query row, in [batch, q_len, q_heads]
    const int x = R.r0 + r;
    return ((size_t)b * p.q_len + x / group) * p.q_heads + h * group + x % group;
  };
  if (tid < ROWS && R.real(tid)) {
    if (p.splits > 1) p.workspace[part * q_rows + row_index(tid)] = sm.lse[tid];
    else store_lse(p, row_index(tid), sm.lse[tid]);
  }
  float *ws_o = p.workspace + p.splits * q_rows;
  for (int i = tid; i < ROWS * D / 2; i += C::THREADS) {
    const int r = i / (D / 2), d = (i % (D / 2)) * 2;
    const int tile = TILES == 1 ? 0 : r / TILE_ROWS, rr = TILES == 1 ? r : r % TILE_ROWS;
    if (!R.real(r)) continue;
    float2 v{0.f, 0.f};
#pragma unroll
    for (int x = 0; x < GROUPS; x++) {
      const float wgt = sm.weight[x][r];
      v.x += wgt * partial(x, tile).o(rr, d);
      v.y += wgt * partial(x, tile).o(rr, d + 1);
    }
    if (p.splits > 1)
      *reinterpret_cast<float2 *>(ws_o + ((size_t)part * q_rows + row_index(r)) * D + d) = v;
    else
      *reinterpret_cast<packed<T> *>(static_cast<T *>(p.o) + row_index(r) * D + d) = from_float2<packed<T>>(v);
  }
}

// out = sum_s 2^(lse_s - lse) O_s over the parts s of every query row (one warp a row); 0 for a row
// that no part saw a key of. The kernel is a few memory latencies long, so it issues its loads
// together: the outputs of BATCH parts (lane l: columns l, l + 32, ...) before the lse of every part
// (lane l: parts l, l + 32, ...), and only then waits for any of them. Typical split counts take one
// batch.
template <typename T, int D> __global__ __launch_bounds__(128) void merge_kernel(const __grid_constant__ Params p) {
  constexpr int PER_LANE = (MAX_SPLITS + 31) / 32, BATCH = 16, COLS = D / 32;
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
  float x[PER_LANE], mx = NEG_INF;
#pragma unroll
  for (int i = 0; i < PER_LANE; i++) {
    const int s = lane + 32 * i;
    x[i] = s < p.splits ? lse[s * q_rows] : NEG_INF;
    mx = fmaxf(mx, x[i]);
  }
  // (across the lanes of a quad, then across the quads: all 32 lanes)
  mx = warp::across_lanes<warp::op::max, ortho_l>(warp::across_lanes<warp::op::max, align_l>(mx));
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < PER_LANE; i++) {
    x[i] = mx == NEG_INF ? 0.f : warp::fn::exp2(x[i] - mx);  // the part's weight
    sum += x[i];
  }
  sum = warp::across_lanes<warp::op::sum, ortho_l>(warp::across_lanes<warp::op::sum, align_l>(sum));
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

template <typename Kernel> cudaError_t launch(Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, const Params &p) {
  if (smem > 48 * 1024) {
    if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)); e != cudaSuccess)
      return e;
  }
  kernel<<<grid, block, smem, stream>>>(p);
  return cudaGetLastError();
}

// Blocks along x: the parts of each chunk of block_rows() query rows; y: KV heads; z: sequences.
dim3 grid_of(const Params &p) {
  const int rows = p.q_heads / p.kv_heads * p.q_len, chunk = block_rows(rows, p.head_dim);
  return dim3((rows + chunk - 1) / chunk * p.splits, p.kv_heads, p.batch);
}

template <typename T, int D, typename C> cudaError_t run(const Params &p, cudaStream_t stream) {
  if (cudaError_t e = launch(decode_kernel<T, D, C>, grid_of(p), dim3(C::THREADS), sizeof(typename C::Shared), stream, p); e != cudaSuccess)
    return e;
  if (p.splits == 1) return cudaSuccess;
  const size_t q_rows = (size_t)p.batch * p.q_len * p.q_heads;
  return launch(merge_kernel<T, D>, dim3(unsigned((q_rows + 3) / 4)), dim3(128), 0, stream, p);
}

// (Eight tiles take the whole SM whatever the grid.)
template <typename T, int D, int TILES> cudaError_t by_grid(const Params &p, cudaStream_t stream) {
  const dim3 grid = grid_of(p);
  if (TILES == 8 || size_t(grid.x) * grid.y * grid.z <= TARGET_BLOCKS) return run<T, D, Config<T, D, true, TILES>>(p, stream);
  if constexpr (TILES < 8) return run<T, D, Config<T, D, false, TILES>>(p, stream);
  return cudaErrorInvalidValue;
}

template <typename T, int D> cudaError_t by_rows(const Params &p, cudaStream_t stream) {
  switch (block_rows(p.q_heads / p.kv_heads * p.q_len, D) / TILE_ROWS) {
    case 1: return by_grid<T, D, 1>(p, stream);
    case 2: return by_grid<T, D, 2>(p, stream);
    case 4:
      if constexpr (D <= 128) return by_grid<T, D, 4>(p, stream);
      return cudaErrorInvalidValue;
    default:
      if constexpr (D <= 128) return by_grid<T, D, 8>(p, stream);
      return cudaErrorInvalidValue;
  }
}

template <typename T> cudaError_t by_dim(const Params &p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return by_rows<T, 64>(p, stream);
    case 128: return by_rows<T, 128>(p, stream);
    case 256: return by_rows<T, 256>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t decode(const Params &p, cudaStream_t stream) {
  return p.dtype == DType::bf16 ? by_dim<bf16>(p, stream) : by_dim<half>(p, stream);
}

}  // namespace jax_tk::decode
