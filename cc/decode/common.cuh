// What the decode kernels share: where a thread block's rows and keys are, the copies of the query and
// of key blocks (contiguous or paged), and the end of a block (the merge of its groups and the stores).
#pragma once
#include <climits>
#include <cstddef>

#include "decode/decode.h"
#include "tk/tk.cuh"

namespace jax_tk::decode {

using namespace tk;

// The call's parameters as a kernel compiled for one cache layout sees them: without a page table
// where PAGED is false, which the compiler then knows. A contiguous cache's kernel so holds none of
// the paged paths (most of a kernel's code): a call of a few microseconds spends much of its time
// fetching instructions, and fewer, in one run, are fetched sooner.
template <bool PAGED> __device__ __forceinline__ Params cache_layout(const Params &p) {
  Params q = p;
  if constexpr (!PAGED) q.page_table = nullptr;
  return q;
}

// The cache row of position j (of some sequence) that lies in page `page` of a paged cache; -1 for a
// page outside the pool.
__device__ __forceinline__ int page_row(const Params &p, int page, int j) {
  if (unsigned(page) >= unsigned(p.num_pages)) return -1;
  return page * p.page_size + (p.page_shift >= 0 ? j & (p.page_size - 1) : j % p.page_size);
}
// The cache row (of the cache seen as [rows, kv_heads, head_dim]) of key position j of sequence b; -1
// where there is no valid row (past the length, or a page outside the pool).
__device__ __forceinline__ int cache_row(const Params &p, int b, int j, int valid) {
  if (j >= valid) return -1;
  if (!p.page_table) return b * p.capacity + j;
  const int slot = p.page_shift >= 0 ? j >> p.page_shift : j / p.page_size;
  return page_row(p, __ldg(p.page_table + (size_t)b * p.max_pages + slot), j);
}

// The pages of a warp's key blocks first, first + stride, ... (the n-th: step n) of a paged cache, where
// a block lies in one page or spans whole pages (`span` of them, a power of 2 up to 32). Lane l holds
// the table entry of page l % span of step base + l / span, and the entries of the next 32 / span steps
// are read while these are used: one coalesced table read per 32 entries, off the loop's path, instead
// of dependent reads in every step (pages of 16 keys in table order ran 2-3% slower than a contiguous
// cache that way, reading the same addresses).
template <int KEYS> struct Pages {
  const int *table;
  int first, stride, slots, span = 1, per_page = 1, steps, base = 0, now = -1, ahead = -1;
  bool used;
  __device__ __forceinline__ Pages(const Params &p, int b, int first_, int stride_)
      : table(p.page_table + (size_t)b * p.max_pages), first(first_), stride(stride_), slots(p.max_pages) {
    used = p.page_table && (p.page_size % KEYS == 0 || (KEYS % p.page_size == 0 && KEYS / p.page_size <= 32));
    if (!used) return;
    if (p.page_size < KEYS) span = KEYS / p.page_size;
    else per_page = p.page_size / KEYS;
    steps = 32 / span;
    now = read(0);
    ahead = read(steps);
  }
  // Lane l's entry of the window that starts at step n.
  __device__ __forceinline__ int read(int n) const {
    const int l = laneid(), slot = ((first + stride * (n + l / span)) * span + l % span) / per_page;
    return slot < slots ? __ldg(table + slot) : -1;
  }
  // Makes step n's entries available (the warp's lanes together, n one more than at the last call).
  __device__ __forceinline__ void reach(int n) {
    if (n >= base + steps) {
      base += steps;
      now = ahead;
      ahead = read(base + steps);
    }
  }
  // Page `i` of step n (after reach(n); every lane of the warp, each its own i).
  __device__ __forceinline__ int page(int n, int i) const { return __shfl_sync(~0u, now, (n - base) * span + i); }
};

// One thread's share of loading a block of KEYS keys (K and V) with the other LANES threads (LANES / 32
// consecutive warps) that load it: lane l takes the 16-byte chunks l, l + LANES, ... of the block
// (consecutive lanes, consecutive chunks of a row). find() works out where they are (the page-table
// reads of a paged cache) one step before load() issues the copies, so that the table's latency is
// not on the path of the loads.
//
// The keys of a contiguous cache, or of pages of a multiple of RUN keys, come in runs of RUN
// consecutive cache rows: find() keeps each run's first row, and load() steps one address per chunk
// from its run's. (With head dim 256 a warp has an SM sub-partition to itself or nearly, so its
// instructions are the step's length; per-row addresses made the reading 5-15% slower there.) Other
// page sizes keep every chunk's row.
template <typename T, int D, int KEYS, int LANES> struct KeyRows {
  static constexpr int ROW_CHUNKS = D / 8, PER_LANE = KEYS * ROW_CHUNKS / LANES;
  static constexpr int STEP = LANES / ROW_CHUNKS;  // rows between a lane's consecutive chunks
  static constexpr int RUN = 16, RUNS = KEYS / RUN;
  static constexpr bool HAS_RUNS = STEP <= RUN;  // (then the run of each of a lane's chunks is known here)
  static_assert(LANES % 32 == 0 && LANES % ROW_CHUNKS == 0 && PER_LANE * LANES == KEYS * ROW_CHUNKS && KEYS % RUN == 0);
  // By runs: row[q] (q < RUNS) is the cache row of the block's key RUN * q, keys [0, count) are valid;
  // otherwise row[i] is chunk i's cache row. -1: none (past the length, outside the pool).
  int row[PER_LANE], count;
  bool runs;
  __device__ __forceinline__ static int lane() { return 32 * (warpid() % (LANES / 32)) + laneid(); }

  __device__ __forceinline__ void find(const Params &p, int b, int k0, int valid) {
    runs = HAS_RUNS && (!p.page_table || p.page_size % RUN == 0);
    count = valid - k0;
    if constexpr (HAS_RUNS) {
      if (runs && (!p.page_table || p.page_size % KEYS == 0))  // (one table read)
        return one_run(p.page_table ? cache_row(p, b, k0, valid) : b * p.capacity + k0, k0, valid);
      if (runs) {
#pragma unroll
        for (int q = 0; q < RUNS; q++) row[q] = cache_row(p, b, k0 + RUN * q, valid);
        return;
      }
    }
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) row[i] = cache_row(p, b, k0 + (i * LANES + lane()) / ROW_CHUNKS, valid);
  }
  // The same for the warp's n-th block, starting at key k0, its pages' entries read ahead (Pages).
  template <int K> __device__ __forceinline__ void find(const Params &p, Pages<K> &pages, int n, int k0, int valid) {
    pages.reach(n);
    runs = HAS_RUNS && p.page_size % RUN == 0;
    count = valid - k0;
    if constexpr (HAS_RUNS)
      if (runs) {
        if (pages.span == 1) return one_run(page_row(p, pages.page(n, 0), k0), k0, valid);
#pragma unroll
        for (int q = 0; q < RUNS; q++) {
          const int j = k0 + RUN * q, page = pages.page(n, (j >> p.page_shift) & (pages.span - 1));
          row[q] = j < valid ? page_row(p, page, j) : -1;
        }
        return;
      }
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) {
      const int j = k0 + (i * LANES + lane()) / ROW_CHUNKS, page = pages.page(n, (j >> p.page_shift) & (pages.span - 1));
      row[i] = j < valid ? page_row(p, page, j) : -1;
    }
  }
  // The runs of a block that lies in one page (or a contiguous cache), from the cache row of its key
  // k0 (-1: none).
  __device__ __forceinline__ void one_run(int row0, int k0, int valid) {
#pragma unroll
    for (int q = 0; q < RUNS; q++) row[q] = row0 >= 0 && k0 + RUN * q < valid ? row0 + RUN * q : -1;
  }
  // Into stage.k and stage.v ([KEYS, D] shared tiles); zeros for rows without a valid key.
  template <typename Stage> __device__ __forceinline__ void load(Stage &stage, const Params &p, int h) const {
    const T *K = static_cast<const T *>(p.k), *V = static_cast<const T *>(p.v);
    const int r0 = lane() / ROW_CHUNKS, c = lane() % ROW_CHUNKS * 8;
    if constexpr (HAS_RUNS)
      if (runs) {
        const long long stride = (long long)p.kv_heads * D;  // (elements between cache rows)
#pragma unroll
        for (int q = 0; q < RUNS; q++) {
          const long long at = ((long long)max(row[q], 0) + r0) * stride + h * D + c;
          const int n = row[q] < 0 ? 0 : count - RUN * q;  // (valid keys of the run, if under RUN)
#pragma unroll
          for (int i = q * RUN / STEP; i < (q + 1) * RUN / STEP; i++) {  // (src-size 0 reads nothing)
            const int r = r0 + i * STEP;
            cp_async16(&stage.k(r, c), K + at + (r - r0 - RUN * q) * stride, r - RUN * q < n);
            cp_async16(&stage.v(r, c), V + at + (r - r0 - RUN * q) * stride, r - RUN * q < n);
          }
        }
        return;
      }
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) {
      const long long at = row[i] < 0 ? 0 : ((long long)row[i] * p.kv_heads + h) * D + c;
      cp_async16(&stage.k(r0 + i * STEP, c), K + at, row[i] >= 0);
      cp_async16(&stage.v(r0 + i * STEP, c), V + at, row[i] >= 0);
    }
  }
};

// A slot of a ring of key blocks: K and V of KEYS keys.
template <typename T, int KEYS, int D> struct KeyBlock {
  st<T, KEYS, D> k, v;
};
// What a warp leaves for finish(), in its group's ring once the key loop is over.
template <int D> struct Partial {
  st<float, TILE_ROWS, D> o;  // normalized output of the warp's tile
  float lse[TILE_ROWS];       // log2 units; -inf for a row that saw no key
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

// A thread block's work: sequence b, KV head h, a chunk of ROWS query rows (R), and part `part` of the
// keys some row of the chunk sees, as key blocks [j0, j1) of KEYS keys. Keys in [full_lo, full_hi) are
// seen by every real row of the chunk: blocks inside need no elementwise mask.
struct Block {
  int b, h, part;
  Rows R;
  int j0, j1, full_lo, full_hi;
  // Row r of the chunk as a row of the query (and of the output), [batch, q_len, q_heads].
  __device__ __forceinline__ size_t row_index(const Params &p, int r) const {
    const int x = R.r0 + r;
    return ((size_t)b * p.q_len + x / R.group) * p.q_heads + h * R.group + x % R.group;
  }
};

// Sequences longest first: the GPU starts a grid's blocks about in order, z (the sequence) slowest,
// so block z takes the sequence of rank z by decreasing length (ties by index). A ragged batch then
// ends on its shortest sequences' blocks rather than on whichever long one the batch holds last.
// Each warp ranks the sequences itself from the lengths in its lanes' registers (no barrier: the
// kernels form their block before their roles part). Only grids of more than one wave rank (the
// blocks of one wave all start at once, in any order, and the ranking's dependent loads would only
// delay them), and only up to LONGEST_FIRST_MAX sequences: past that the ranking costs more than it saves.
constexpr int LONGEST_FIRST_MAX = 64;
// (Out of line: the ranking stays out of the short calls' prologue, whose instruction fetches are
// much of their time.)
__device__ inline __noinline__ int rank_longest_first(const int *lengths, int batch, int z) {
  static_assert(LONGEST_FIRST_MAX == 64);  // (two sequences per lane)
  const int lane = laneid();
  const int len0 = lane < batch ? lengths[lane] : INT_MIN, len1 = 32 + lane < batch ? lengths[32 + lane] : INT_MIN;
  int rank0 = 0, rank1 = 0;  // of sequences lane and 32 + lane
  for (int t = 0; t < batch; t++) {
    const int l = __shfl_sync(0xffffffffu, t < 32 ? len0 : len1, t % 32);
    rank0 += l > len0 || (l == len0 && t < lane);
    rank1 += l > len1 || (l == len1 && t < 32 + lane);
  }
  const unsigned hit0 = __ballot_sync(0xffffffffu, lane < batch && rank0 == z);
  const unsigned hit1 = __ballot_sync(0xffffffffu, 32 + lane < batch && rank1 == z);
  return hit0 ? __ffs(hit0) - 1 : 32 + __ffs(hit1) - 1;
}
__device__ __forceinline__ int sequence_of(const Params &p, int z) {
  if (p.batch <= 1 || p.batch > LONGEST_FIRST_MAX || size_t(gridDim.x) * gridDim.y * gridDim.z <= core::WAVE_BLOCKS)
    return z;
  return rank_longest_first(p.lengths, p.batch, z);
}

// Blocks along x: the parts of each chunk of ROWS query rows; y: KV heads; z: sequences (sequence_of).
template <int ROWS, int KEYS> __device__ __forceinline__ Block block_of(const Params &p) {
  const int b = sequence_of(p, blockIdx.z), h = blockIdx.y, group = p.q_heads / p.kv_heads, rows = group * p.q_len;
  const int chunks = (rows + ROWS - 1) / ROWS, chunk = blockIdx.x % chunks, part = blockIdx.x / chunks;
  const int length = p.lengths[b];
  const Rows R{min(max(length, 0), p.capacity), length, group, p.q_len, chunk * ROWS, rows};
  // Keys some row sees: [lo, hi) (lo from the first row's window, hi from the last row's position).
  const int first = R.position(0), last = R.position(min(ROWS, rows - R.r0) - 1);  // (real rows)
  const int2 last_keys = R.keys(p, last), first_keys = R.keys(p, first);
  const int lo = first >= 0 ? first_keys.x : 0, hi = last_keys.y;  // (a row at position 0 starts at 0)
  const int blocks0 = lo / KEYS, blocks = hi > lo ? (hi + KEYS - 1) / KEYS - blocks0 : 0;
  const int per_part = (blocks + p.splits - 1) / p.splits;
  return {b, h, part, R, blocks0 + min(blocks, part * per_part), blocks0 + min(blocks, (part + 1) * per_part),
          last_keys.x, first >= 0 ? first_keys.y : INT_MIN};
}

// The chunk's query rows into q (cp.async, by threads [0, THREADS); the caller commits), zeros past
// the real rows.
template <int THREADS, typename QTile> __device__ __forceinline__ void load_query(QTile &q, const Params &p, const Block &k, int tid) {
  using T = typename QTile::dtype;
  constexpr int D = QTile::cols;
  const T *Q = static_cast<const T *>(p.q);
  for (int i = tid; i < QTile::rows * (D / 8); i += THREADS) {
    const int r = i / (D / 8), c = (i % (D / 8)) * 8;
    cp_async16(&q(r, c), Q + (k.R.real(r) ? k.row_index(p, r) * D + c : 0), k.R.real(r));
  }
}

// Logits s (the warp's rows x keys k0 ...) := -inf where the row does not see the key (row_keys:
// the keys each of the lane's rows sees); nothing to do for blocks inside what every row sees.
template <typename S, typename RK> __device__ __forceinline__ void mask_block(S &s, const Block &k, const RK &row_keys, int k0) {
  if (k0 < k.full_lo || k0 + S::cols > k.full_hi) {
    rv<int, S::cols, typename row_vec<S>::layout> cols;
    warp::map_index(cols, [&](int x) { return k0 + x; });
    warp::map_outer(s, s, row_keys, cols, [](float x, int2 r, int j) { return j >= r.x && j < r.y ? x : NEG_INF; });
  }
}

// One key block's step of a warp's online softmax (tk::warp::softmax_step, m in units of 1 / c): its
// logits s (the warp's rows x keys k0 ...) through the soft cap and the mask (row_keys: the keys
// each of the lane's rows sees), then into weights.
template <typename S, typename RK, typename V>
__device__ __forceinline__ void softmax_block(S &s, const Params &p, bool capped, const Block &k, const RK &row_keys, int k0,
                                              V &m, V &l, V &corr, float c) {
  if (capped) {
    const float in = p.scale / p.softcap, out = p.softcap * LOG2E;
    warp::map(s, s, [=](float x) { return out * warp::tanh_fast(x * in); });
  }
  mask_block(s, k, row_keys, k0);
  warp::softmax_step(s, m, l, corr, c);
}

// The log-sum-exp (natural log; -inf: no key) of query row `row` of [batch, q_len, q_heads] into
// Params::lse, which is [batch, q_heads, q_len] (the attention kernels' layout).
__device__ __forceinline__ void store_lse(const Params &p, size_t row, float lse2) {
  const int head = row % p.q_heads, token = (row / p.q_heads) % p.q_len, b = row / ((size_t)p.q_heads * p.q_len);
  p.lse[((size_t)b * p.q_heads + head) * p.q_len + token] = lse2 == NEG_INF ? NEG_INF : lse2 * LN2;
}

// The sink of query row `row` of [batch, q_len, q_heads] as given (-inf: none), then in log2 units
// (warp::sink_log2). (Two steps, so that a kernel can issue the read early and wait for it late.)
__device__ __forceinline__ float sink_of(const Params &p, size_t row) {
  return p.sinks ? p.sinks[row / ((size_t)p.q_len * p.q_heads) * p.sinks_stride + row % p.q_heads] : NEG_INF;
}
__device__ __forceinline__ float sink2(const Params &p, size_t row) { return warp::sink_log2(sink_of(p, row)); }

// The end of a block. Warp t of group g leaves its tile's rows in the group's stages (Partial: O / l
// and the rows' log-sum-exp, from m in units of 1 / c and l of its online softmax). A lone group's
// rows are final: each warp stores its own. Otherwise the groups' rows are merged through their
// log-sum-exp. Either way they go to the output (one part) or to the workspace (this part's share of a
// split sequence). Threads [0, THREADS) (index tid) take part, sync() is their barrier; every group
// must be done reading its stages.
template <typename T, int D, typename C, int THREADS, typename V, typename Sync>
__device__ __forceinline__ void finish(const Params &p, typename C::Shared &sm, const Block &k, rt_fl<TILE_ROWS, D> &o,
                                       const V &m, const V &l, float c, int g, int t, int tid, Sync sync) {
  constexpr int ROWS = C::ROWS, TILES = C::TILES, GROUPS = C::GROUPS;
  // (A lone group's tiles may reach from the query rows, which no warp reads any more, into its stages.)
  using Shared = typename C::Shared;
  constexpr bool FROM_Q = sizeof(Partial<D>) * TILES > sizeof(sm.stage[0]);
  static_assert(!FROM_Q || (GROUPS == 1 && offsetof(Shared, stage) == sizeof(sm.q) &&
                            sizeof(Partial<D>) * TILES <= sizeof(sm.q) + sizeof(sm.stage)));
  auto partial = [&](int x, int tile) -> Partial<D> & {
    return reinterpret_cast<Partial<D> *>(FROM_Q ? static_cast<void *>(&sm.q) : static_cast<void *>(&sm.stage[x]))[tile];
  };
  auto &mine = partial(g, t);
  warp::normalize_output(o, l);
  warp::store(mine.o, o);
  V lse;
  warp::map_vec(lse, m, l, [=](float mx, float x) { return x > 0.f ? mx * c + warp::fn::log2(x) : NEG_INF; });
  warp::store(mine.lse, lse, TILE_ROWS);

  // Row r (of the block) with its log-sum-exp goes out, output row by row in pairs of columns. An
  // unsplit call's rows are final: the sink joins them here (a split one's, in merge_kernel).
  const bool final = p.splits == 1;
  const size_t q_rows = (size_t)p.batch * p.q_len * p.q_heads;
  float *ws_o = p.workspace + p.splits * q_rows;
  auto store_row = [&](int r, float lse) {
    if (p.splits > 1) p.workspace[k.part * q_rows + k.row_index(p, r)] = lse;
    else store_lse(p, k.row_index(p, r), lse);
  };
  auto store_pair = [&](int r, int d, float2 v) {
    if (p.splits > 1)
      *reinterpret_cast<float2 *>(ws_o + ((size_t)k.part * q_rows + k.row_index(p, r)) * D + d) = v;
    else
      *reinterpret_cast<packed<T> *>(static_cast<T *>(p.o) + k.row_index(p, r) * D + d) = from_float2<packed<T>>(v);
  };

  if constexpr (GROUPS == 1) {
    __syncwarp();
    const int lane = laneid(), r0 = TILE_ROWS * t;
    if (lane < TILE_ROWS && k.R.real(r0 + lane)) {
      const float lse = mine.lse[lane], s2 = final ? sink2(p, k.row_index(p, r0 + lane)) : NEG_INF;
      const warp::Sunk x = s2 == NEG_INF ? warp::Sunk{lse, 1.f} : warp::with_sink(lse, s2);
      store_row(r0 + lane, x.lse2);
      mine.lse[lane] = x.factor;  // (from here on, the row's output factor)
    }
    __syncwarp();
    for (int i = lane; i < TILE_ROWS * D / 2; i += 32) {
      const int r = i / (D / 2), d = (i % (D / 2)) * 2;
      const float f = mine.lse[r];
      if (k.R.real(r0 + r)) store_pair(r0 + r, d, {f * mine.o(r, d), f * mine.o(r, d + 1)});
    }
  } else {
    // Row r gets sum_x weight[x][r] O_x with weight = 2^(lse_x - lse) (0 for a group that saw nothing),
    // lse the log-sum-exp of the groups' and the sink's, a group of its own with no value (-inf if
    // none saw a key and there is no sink).
    sync();
    if (tid < ROWS) {
      const int tile = TILES == 1 ? 0 : tid / TILE_ROWS, r = TILES == 1 ? tid : tid % TILE_ROWS;
      const float s2 = final && k.R.real(tid) ? sink2(p, k.row_index(p, tid)) : NEG_INF;
      float mx = s2;
      for (int x = 0; x < GROUPS; x++) mx = fmaxf(mx, partial(x, tile).lse[r]);
      float sum = s2 == NEG_INF ? 0.f : warp::fn::exp2(s2 - mx);
      for (int x = 0; x < GROUPS; x++) {
        const float e = mx == NEG_INF ? 0.f : warp::fn::exp2(partial(x, tile).lse[r] - mx);
        sm.weight[x][tid] = e;
        sum += e;
      }
      for (int x = 0; x < GROUPS; x++) sm.weight[x][tid] = sum > 0.f ? sm.weight[x][tid] / sum : 0.f;
      sm.lse[tid] = sum > 0.f ? mx + warp::fn::log2(sum) : NEG_INF;
    }
    sync();
    if (tid < ROWS && k.R.real(tid)) store_row(tid, sm.lse[tid]);
    for (int i = tid; i < ROWS * D / 2; i += THREADS) {
      const int r = i / (D / 2), d = (i % (D / 2)) * 2;
      const int tile = TILES == 1 ? 0 : r / TILE_ROWS, rr = TILES == 1 ? r : r % TILE_ROWS;
      if (!k.R.real(r)) continue;
      float2 v{0.f, 0.f};
#pragma unroll
      for (int x = 0; x < GROUPS; x++) {
        const float wgt = sm.weight[x][r];
        v.x += wgt * partial(x, tile).o(rr, d);
        v.y += wgt * partial(x, tile).o(rr, d + 1);
      }
      store_pair(r, d, v);
    }
  }
}

// (The Hopper kernels' TMA loads of key blocks.)
// The kernel's parameters: the call's, and tensor maps of the caches ([batch, capacity] or [num_pages,
// page_size] x [kv_heads, head_dim]) with boxes of BOX rows (a key block, or a part of one that lies in a
// page), if `bulk`.
template <typename T, int BOX> struct Args {
  Params p;
  tma_map<T, BOX> k, v;
  bool bulk;
};

// Box `i` of the keys [k0, k0 + KEYS) of the block's sequence: keys k0 + BOX i ..., at coordinates
// {b, s} of the tensor maps. Each lane of a warp finds box lane % (KEYS / BOX) (one table read) and the
// warp agrees whether the whole block goes by boxes: not where some keys lie past the valid ones (their
// rows must arrive as zeros, whatever the cache holds there), a page lies outside the pool, or there
// are no maps.
template <int KEYS, int BOX, typename A> struct Box {
  static constexpr int COUNT = KEYS / BOX;
  static_assert(COUNT <= 32);
  int2 at;
  __device__ __forceinline__ bool find(const A &a, const Block &blk, int k0) {
    const Params &p = a.p;
    if (!a.bulk || k0 + KEYS > blk.R.valid) return false;
    const int j = k0 + BOX * (laneid() % COUNT);
    bool ok = true;
    if (!p.page_table) {
      at = {blk.b, j};
    } else {
      const int page = __ldg(p.page_table + (size_t)blk.b * p.max_pages + j / p.page_size);
      ok = unsigned(page) < unsigned(p.num_pages);
      at = {page, j % p.page_size};
    }
    return __all_sync(~0u, ok);
  }
};

// A Hopper kernel's producer warpgroup: its block's key blocks, each into the ring's next stage. A block
// of boxes goes by TMA (the first warp's lanes issue one box each, boxes(stage, row, at, full), the other
// threads only arrive: many small boxes issued by one thread held the producer back); any other by every
// thread's cp.async, rows(stage, k0).
template <int KEYS, int BOX, typename A, int STAGES, typename Stage, typename Boxes, typename Rows>
__device__ __forceinline__ void produce_key_blocks(const A &a, const Block &blk, ring<STAGES> kv, Stage (&stages)[STAGES],
                                                   Boxes boxes, Rows rows) {
  using B = Box<KEYS, BOX, A>;
  const int tid = threadIdx.x % 128;
  for (ring_pos<STAGES> at(0); blk.j0 + at.n < blk.j1; ++at) {
    const int k0 = (blk.j0 + at.n) * KEYS;
    auto &stage = stages[at.slot];
    B box;
    const bool bulk = box.find(a, blk, k0);  // (the table reads, before the wait)
    wait_empty(kv, at);
    if (bulk) {
      if (tid == 0) arrive_expect_bytes(kv.full(at), sizeof(stage));
      __syncwarp();
      if (tid < B::COUNT) boxes(stage, BOX * tid, box.at, kv.full(at));
      if (tid != 0) arrive(kv.full(at));
    } else {
      rows(stage, k0);
      arrive_copies(kv.full(at));
    }
  }
  commit_group();
  wait_group<0>();  // (no copy outlives its thread)
}

// Launches a decode kernel. One that starts with grid_dependency_wait (`waits`), before it reads any
// input, goes as a programmatic dependent launch on sm_90 and newer: its blocks may be set up while the
// kernel before it on the stream is finishing. (Decode's calls are a few microseconds: the merge
// kernel after the main one, and a generation step's call after the step's other kernels, would
// otherwise each wait out a whole launch.)
template <typename Kernel, typename Arg>
cudaError_t launch(Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, const Arg &arg, bool waits = false) {
  if (smem > 48 * 1024) {
    if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)); e != cudaSuccess)
      return e;
  }
  int dev = 0, major = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  if (cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev); e != cudaSuccess) return e;
  cudaLaunchAttribute dependent{};
  dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent.val.programmaticStreamSerializationAllowed = 1;
  const bool pdl = waits && major >= 9;
  cudaLaunchConfig_t config{grid, block, smem, stream, pdl ? &dependent : nullptr, pdl ? 1u : 0u};
  return cudaLaunchKernelEx(&config, kernel, arg);
}

// run.template operator()<T, D>() for the call's dtype T and head dim D, one of DIMS (invalid value
// for any other).
template <int... DIMS, typename Run> cudaError_t by_type(const Params &p, Run run) {
  auto by_dim = [&]<typename T>() {
    cudaError_t e = cudaErrorInvalidValue;
    ((p.head_dim == DIMS ? (e = run.template operator()<T, DIMS>(), 0) : 0), ...);
    return e;
  };
  return p.dtype == DType::bf16 ? by_dim.template operator()<bf16>() : by_dim.template operator()<half>();
}

// The grid of the main kernel: block_of's blocks of `chunk` (block_rows()) query rows.
inline dim3 grid_of(const Params &p, int chunk) {
  const int rows = p.q_heads / p.kv_heads * p.q_len;
  return dim3((rows + chunk - 1) / chunk * p.splits, p.kv_heads, p.batch);
}

// The main kernel for blocks of 128 rows on sm_90a (decode_sm90.cu); head_dim 64 or 128.
cudaError_t decode_sm90_128(const Params &p, cudaStream_t stream);
// MLA's kernel (mla_sm90.cu), before the merge.
cudaError_t decode_mla_sm90(const Params &p, cudaStream_t stream);

}  // namespace jax_tk::decode
