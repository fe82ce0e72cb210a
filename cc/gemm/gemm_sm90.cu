// Grouped GEMM for Hopper (sm_90a): TMA, mbarriers, wgmma and warp specialization, in a persistent
// kernel that walks the tiles of every group in one launch.
//
// Output tiles of 128 x 256 (two consumer warpgroups of 64 rows), steps of 64 (FP8: 128) along the
// contraction through a ring of 4 stages. Per block, 3 warpgroups:
//   producer: warp 1 schedules: block b takes tiles b, b + G, b + 2G, ... (G blocks, about one per
//     SM; common.cuh orders them), finds each tile's group by walking the group sizes (GroupWalk),
//     and announces it in one of two slots; warp 0 (one thread) streams each tile's steps of a and
//     b into the ring with TMA (128-byte swizzled tiles), each slot guarded by a "full" semaphore
//     (bytes landed) and an "empty" one (every consumer warp is done with it);
//   two consumers: the products with wgmma (both operands from shared memory, fp32 accumulators in
//     registers, one product in flight while the next step is awaited), then the tile's rows out
//     through shared memory, 128 bytes of columns at a time, double-buffered, with a TMA store each
//     (a tile that runs past its group's last row, into the next group's rows, is stored by the
//     threads instead, row by row).
// The kinds (KIND): RAGGED, out[rows_i] = a[rows_i] @ b[i] (b [g, k, n]: B tiles N-major); RAGGED_BT,
// the same with b [g, n, k] (B tiles K-major); CONTRACT, out[i] = a[rows_i]^T @ b[rows_i] (A tiles
// M-major: the contraction runs down the rows). A tile row block starts at its group's first row, so
// the TMA loads read rows of the next group only at a group's end: RAGGED ignores their results
// (they are not stored), CONTRACT zeroes those rows of its last step in shared memory before the
// products (whole 128-byte rows: the swizzle stays inside a row). Rows and columns past the arrays'
// ends arrive from TMA as zeros and are not stored.
//
// RAGGED, RAGGED_BT and CONTRACT may run in clusters of two blocks (CLUSTER = 2), each block one tile
// of a pair that shares an operand, loading half of that operand's tile of a step and multicasting it
// to both (TMA), so that its reads from L2 halve. The two blocks' rings then move together (ring.cuh:
// arrive_empty_cluster). In RAGGED(_BT) a pair is two tiles one above the other (the same columns of
// b), or, for a group's odd last row block, two side by side (the same rows of a): common.cuh's
// GroupWalk with PAIRS, so that a block idles only where a row's last pair of tiles has one past n.
// CONTRACT's pairs are tiles of 256 rows (of out[i], along k) cut in two halves (the same rows and
// columns of b [m, n]), a half past k computed and not stored. Dense products' tiles may be 192 or
// 320 columns wide instead of 256 where that fills the waves better (gemm.h: dense_tile_n), with one
// wgmma per part of the width (128 + 64, 256 + 64) and, at 320, three stages.
#include <algorithm>
#include <atomic>
#include <climits>
#include <utility>

#include "gemm/common.cuh"

namespace jax_tk::gemm {
namespace {

using namespace tk;

enum Kind { RAGGED = 0, RAGGED_BT = 1, CONTRACT = 2, CONTRACT_BT = 3 };
// (CONTRACT_BT: out[i] = a[:, rows_i] @ b[:, rows_i]^T with a [k, m] and b [n, m], both K-major, as
// 8-bit operands must be and as a split-k product's input gradient has them; its steps are blocks
// of TK rows (FP8: the 128-wide blocks that the scales cover), the first and last of a group
// holding other groups' rows, zeroed in a's tile.)
template <int KIND> constexpr bool contracts = KIND == CONTRACT || KIND == CONTRACT_BT;

template <typename T, typename TO, int KIND, int CLUSTER, int TN_ = SM90_TILE_N> struct Sm90 {
  using Roles = roles</*CONSUMERS=*/2, /*PRODUCER_REGS=*/40, /*CONSUMER_REGS=*/232>;
  static constexpr int CONSUMERS = Roles::CONSUMERS, THREADS = Roles::THREADS;
  // FP8: steps of one scale block (128 bytes of k, as the 16-bit steps), tiles as wide as the 16-bit
  // ones (the same bytes per stage; narrower tiles read more of a and b from L2 per product).
  // TN: SM90_TILE_N, or another width: one that fills the waves better for dense products in clusters
  // (dense_tile_n), SM90_SPLIT_TILE_N for MODE_SPLIT_K's parts. Tiles wider than SM90_TILE_N leave room
  // for three stages.
  static constexpr bool FP8 = is_8bit<T>;
  static constexpr int TM = SM90_TILE_M, TN = TN_, TK = FP8 ? FP8_BLOCK : SM90_TILE_K, STAGES = TN > SM90_TILE_N ? 3 : 4;
  static_assert(TM == 64 * CONSUMERS && (!FP8 || KIND == RAGGED_BT || KIND == CONTRACT_BT));
  static_assert(CLUSTER == 1 || (CLUSTER == 2 && KIND != CONTRACT_BT));
  static_assert(TN % 64 == 0 && (TN == SM90_TILE_N || (!FP8 && KIND != CONTRACT_BT)));
  using ATile = std::conditional_t<KIND == CONTRACT, st<T, TK, TM>, st<T, TM, TK>>;
  using BTile = std::conditional_t<KIND == RAGGED_BT || KIND == CONTRACT_BT, st<T, TN, TK>, st<T, TK, TN>>;
  // b's tile in two halves (a cluster's blocks load one each): its panels where it has several (b
  // N-major; an odd count: the second block the larger share), else its rows, loaded by boxes of half
  // the rows.
  static constexpr bool HALF_PANELS = BTile::panels >= 2;
  static constexpr int B_ROWS = HALF_PANELS || contracts<KIND> ? BTile::rows : BTile::rows / 2;
  // a's tile in two halves by rows where the cluster's pairs of tiles side by side share it
  // (common.cuh: GroupWalk's PAIRS), each block loading one.
  static constexpr bool PAIRS = CLUSTER > 1 && !contracts<KIND>;
  static constexpr int A_ROWS = PAIRS ? ATile::rows / 2 : ATile::rows;
  static constexpr int OUT_COLS = 128 / int(sizeof(TO));  // columns of a staged piece of out
  using OTile = st<TO, 64, OUT_COLS>;
  struct Shared {
    ATile a[STAGES];
    BTile b[STAGES];
    OTile out[CONSUMERS][2];
    semaphore full[STAGES], empty[STAGES], tile_full[2], tile_empty[2];
    TileSlot tile[2];  // (t == INT_MAX: no more)
  };
  struct Args {
    Params p;
    tma_map<T, A_ROWS> a;
    tma_map<T, B_ROWS> b;
    tma_map<TO, 64> out;
  };
  static constexpr size_t smem = sizeof(Shared) + 1024;  // + room to align the base to 1024
  static_assert(smem <= MAX_SHARED_BYTES, "more shared memory than an H100 block may have");

  // Zero the rows [valid, TK) of a panel (rows of 128 bytes) of a step's tile: 128 threads, thread i.
  __device__ __forceinline__ static void zero_rows(void *panel, int valid, int i) {
    uint4 *q = reinterpret_cast<uint4 *>(static_cast<char *>(panel) + valid * 128);
    for (int c = i; c < (TK - valid) * 8; c += 128) q[c] = make_uint4(0, 0, 0, 0);
  }
};

// Steps along the contraction of tile x.
template <int KIND, int TK> __device__ __forceinline__ int steps(const Params &p, const TileSlot &x) {
  if constexpr (KIND == CONTRACT) return (x.r1 - x.r0 + TK - 1) / TK;
  else if constexpr (KIND == CONTRACT_BT) return x.r1 > x.r0 ? (x.r1 + TK - 1) / TK - x.r0 / TK : 0;
  else return x.group >= 0 ? (p.k + TK - 1) / TK : 0;
}

// The kernel's parts (pipeline/kernel.cuh: persistent). Each thread's object keeps its role's place in
// the ring and, in the consumers, the pieces of out staged so far.
template <typename T, typename TO, int KIND, int CLUSTER_, int TN_> struct RaggedSm90 {
  static constexpr int CLUSTER = CLUSTER_;
  using C = Sm90<T, TO, KIND, CLUSTER, TN_>;
  using Roles = typename C::Roles;
  static constexpr int TM = C::TM, TN = C::TN, TK = C::TK, STAGES = C::STAGES, CONSUMERS = C::CONSUMERS;
  const typename C::Args &a;
  typename C::Shared &sm;
  const int wg = warpgroup::groupid();
  const int tiles = INT_MAX;  // (the scheduler ends with t = INT_MAX)
  // The ring (ring.cuh), formed where it is used: each semaphore's address a base and a constant offset.
  __device__ __forceinline__ ring<STAGES> slots() const { return {sm.full, sm.empty}; }
  // (the scheduler's: tiles of the cluster, 2 TM rows in CONTRACT; in RAGGED(_BT), pairs of tiles)
  GroupWalk<C::PAIRS ? TM : TM * CLUSTER, TN, C::PAIRS> walk;
  const unsigned rank = CLUSTER > 1 ? cluster_rank() : 0;
  int n = 0, staged = 0;   // ring uses, pieces of out staged so far

  __device__ __forceinline__ tile_queue<TileSlot> queue() const { return {{sm.tile_full, sm.tile_empty}, sm.tile}; }
  // full: the loader (and its bytes); empty: each consumer warp of the cluster
  __device__ __forceinline__ void init() const { tk::init(slots(), 1, CONSUMERS * 4 * CLUSTER); }
  __device__ __forceinline__ void drain() const { drain_empty(slots(), n); }
  // A consumer warp is done with use u (lane 0).
  __device__ __forceinline__ void free_slot(ring_use<STAGES> u) const {
    if constexpr (CLUSTER > 1) arrive_empty_cluster(slots(), u, CLUSTER);
    else arrive_empty(slots(), u);
  }

  // Cluster c (block b alone: c = b) takes tiles c, c + G, c + 2G, ... of G clusters (common.cuh
  // orders them); a block of a cluster, its rank's rows of the tile (or columns: a pair across).
  __device__ __forceinline__ TileSlot schedule(int k, int) {
    const long long t = blockIdx.x / CLUSTER + (long long)k * (gridDim.x / CLUSTER);
    if (t >= INT_MAX) return TileSlot{INT_MAX, 0, 0, 0, 0, 0};
    TileSlot x = walk.find(a.p, int(t));
    if (x.across) x.n0 += TN * rank;
    else x.m0 += TM * rank;
    return x;
  }

  // a's tile at o (a pair across: this block's half, to both).
  __device__ __forceinline__ void load_a(typename C::ATile &dst, const TileSlot &x, coord o, semaphore &full) const {
    constexpr int R = C::A_ROWS;
    if constexpr (!C::PAIRS) {
      load_async(dst, a.a, o, full);
    } else if (x.across) {
      multicast_rows_async(dst, R * rank, 0, C::ATile::panels, a.a, {o.b, o.s + R * int(rank), o.h, o.d}, full, 0b11);
    } else {
      load_rows_async(dst, 0, a.a, o, full);
      load_rows_async(dst, R, a.a, {o.b, o.s + R, o.h, o.d}, full);
    }
  }

  // b's tile of step k0 (a cluster's block, but for a pair across: its half, to every block).
  __device__ __forceinline__ void load_b(typename C::BTile &dst, const TileSlot &x, int k0, semaphore &full) const {
    // (a split product's b transposed, [n, g k]: part x.group's columns of b's rows, a 4-D map;
    // CONTRACT: the group's rows of b [m, n])
    const coord o = KIND == CONTRACT ? coord{0, x.r0 + k0, 0, x.n0}
                    : KIND == RAGGED ? coord{x.group, k0, 0, x.n0}
                    : !C::FP8 && a.p.a_split > 1 ? coord{0, x.n0, x.group, k0} : coord{x.group, x.n0, 0, k0};
    constexpr int P = C::BTile::panels, R = C::B_ROWS;
    if (CLUSTER == 1 || x.across) {
      if constexpr (C::HALF_PANELS) load_async(dst, a.b, o, full);
      else {
        load_rows_async(dst, 0, a.b, o, full);
        load_rows_async(dst, R, a.b, {o.b, o.s + R, o.h, o.d}, full);
      }
    } else if constexpr (C::HALF_PANELS) {
      multicast_rows_async(dst, 0, P / 2 * rank, P / 2 * (rank + 1) + P % 2 * rank, a.b, o, full, 0b11);
    } else {
      multicast_rows_async(dst, R * rank, 0, P, a.b, {o.b, o.s + R * int(rank), o.h, o.d}, full, 0b11);
    }
  }

  template <typename Release> __device__ __forceinline__ void load(int slot, Release release) {
    const TileSlot x = sm.tile[slot];
    release();
    const int count = steps<KIND, TK>(a.p, x);
    for (int j = 0; j < count; j++, n++) {
      const ring_use<STAGES> u(n);
      const int s = u.slot, k0 = j * TK;
      wait_empty(slots(), u);
      arrive_expect_bytes(slots().full(u), sizeof(sm.a[s].data) + sizeof(sm.b[s].data));
      if constexpr (KIND == CONTRACT) {
        load_async(sm.a[s], a.a, {0, x.r0 + k0, 0, x.m0}, slots().full(u));
        load_b(sm.b[s], x, k0, slots().full(u));
      } else if constexpr (KIND == CONTRACT_BT) {
        const int r = (x.r0 / TK) * TK + k0;  // (whole blocks of rows)
        load_async(sm.a[s], a.a, {0, x.m0, 0, r}, slots().full(u));
        load_async(sm.b[s], a.b, {0, x.n0, 0, r}, slots().full(u));
      } else {
        const bool split = a.p.a_split > 1;  // (group x.group's rows: columns of a's rows)
        load_a(sm.a[s], x, {0, split ? x.m0 - x.r0 : x.m0, split ? x.group : 0, k0}, slots().full(u));
        load_b(sm.b[s], x, k0, slots().full(u));
      }
    }
  }

  // Step j (ring position u) into acc, after making its slot ready: in CONTRACT, at the group's last
  // step, zero the next group's rows of both operands (each consumer its panel of A and half of B's
  // panels: both read all of B, hence the barrier).
  __device__ __forceinline__ void step(rt_fl<16, TN> &acc, const TileSlot &x, int j, ring_pos<STAGES> u, bool accumulate) {
    wait_full(slots(), u);
    const int s = u.slot;
    if constexpr (KIND == CONTRACT) {
      const int valid = x.r1 - (x.r0 + j * TK);  // rows of this step in the group (>= 1)
      if (valid < TK) {
        constexpr int P = C::BTile::panels;  // (consumer 0 the first P / 2, 1 the rest)
        const int tid = threadIdx.x % 128;
        C::zero_rows(sm.a[s].panel(wg), valid, tid);
        for (int q = wg * (P / 2); q < (wg ? P : P / 2); q++) C::zero_rows(sm.b[s].panel(q), valid, tid);
        warpgroup::fence_shared_writes();
        sync_named(1, 128 * CONSUMERS);
      }
    }
    if constexpr (KIND == CONTRACT_BT) clear_other_rows(sm.a[s], x, x.r0 / TK + j);
    if constexpr (KIND == CONTRACT) warpgroup::mma_AtB(acc, window<TK, 64>(sm.a[s], 0, 64 * wg), sm.b[s], accumulate);
    else if constexpr (KIND == RAGGED) warpgroup::mma_AB(acc, window<64, TK>(sm.a[s], 64 * wg, 0), sm.b[s], accumulate);
    else warpgroup::mma_ABt(acc, window<64, TK>(sm.a[s], 64 * wg, 0), sm.b[s], accumulate);
  }

  // FP8 (DeepSeek-V3's recipe): each step's product (one 128-wide block of k) in float32 on its own,
  // then scaled by its blocks' scales, a's per row and b's per 128 columns, and added to acc: the
  // tensor cores' FP8 sums are short, so they never run past one block. The product is formed in
  // pieces of 128 columns (one block of b's scales), one at a time: a whole second 64 x 256
  // accumulator would not fit beside acc, and narrower pieces re-read the warpgroup's rows of a from
  // shared memory once per piece (64-column pieces put a step's reads plus its loads at about 1.3x
  // what shared memory delivers while the tensor cores run at full rate). While one warpgroup scales
  // its piece, the other's product runs. Each step's scales are loaded one step ahead: a load from L2
  // outlasts a step's product, and the first multiply by a scale was the kernel's largest stall.
  // In CONTRACT_BT the rows of out are k and the steps are blocks of a's rows (along m): a's scales
  // [blocks of m, k], b's [blocks of m, blocks of n], the step's block j + r0 / 128.
  template <int BLOCKS>
  struct StepScales {
    float a0, a1, b[BLOCKS];  // a's for this thread's rows r and r + 8; b's per block of the tile's columns
  };

  __device__ __forceinline__ void fp8_steps(rt_fl<16, TN> &acc, const TileSlot &x, int count, int row0, ring_pos<STAGES> &pos) {
    const Params &p = a.p;
    constexpr bool BT = KIND == CONTRACT_BT;
    constexpr int PIECE = FP8_BLOCK, PIECES = TN / PIECE, BLOCKS = TN / FP8_BLOCK;
    static_assert(TN % FP8_BLOCK == 0);
    const int blocks_n = (p.n + FP8_BLOCK - 1) / FP8_BLOCK, blocks_k = (p.k + FP8_BLOCK - 1) / FP8_BLOCK;
    const int rows = BT ? p.k : p.m, first = BT ? x.r0 / FP8_BLOCK : 0;
    const int r = row0 + 16 * (warpid() % 4) + laneid() / 4;  // this thread's rows: r and r + 8
    const int bn = x.n0 / FP8_BLOCK;  // the tile's first block of columns
    const float *sb = p.b_scales + (BT ? 0 : (size_t)max(x.group, 0) * blocks_k * blocks_n) + bn;  // (group -1: no steps)
    const auto load = [&](int j) {
      StepScales<BLOCKS> s;
      const float *sa = p.a_scales + (size_t)(first + j) * rows;
      s.a0 = r < rows ? __ldg(sa + r) : 0.f;
      s.a1 = r + 8 < rows ? __ldg(sa + r + 8) : 0.f;
#pragma unroll
      for (int h = 0; h < BLOCKS; h++) s.b[h] = bn + h < blocks_n ? __ldg(sb + (size_t)(first + j) * blocks_n + h) : 0.f;
      return s;
    };
    warp::zero(acc);
    StepScales<BLOCKS> next{};
    if (count > 0) next = load(0);
    for (int j = 0; j < count; j++, ++pos) {
      const StepScales<BLOCKS> s = next;
      if (j + 1 < count) next = load(j + 1);
      wait_full(slots(), pos);
      if constexpr (BT) clear_other_rows(sm.a[pos.slot], x, first + j);
      const auto rows_a = window<64, TK>(sm.a[pos.slot], 64 * wg, 0);
      rt_fl<16, PIECE> part;
      [&]<int... Q>(std::integer_sequence<int, Q...>) {
        ([&] {  // piece Q: its product, then scaled into acc
          warpgroup::mma_ABt(part, rows_a, window<PIECE, TK>(sm.b[pos.slot], Q * PIECE, 0), false);
          warpgroup::wait<0>();
          warpgroup::fence_registers(part);
          if constexpr (Q + 1 == PIECES)
            if (laneid() == 0) free_slot(pos);
          scale_into(acc, part, Q * PIECE / 16, s.a0 * s.b[Q], s.a1 * s.b[Q]);
        }(), ...);
      }(std::make_integer_sequence<int, PIECES>{});
    }
  }

  // acc's columns from 16 * t0 on += f * part, f = f0 in row r, f1 in r + 8.
  template <int N>
  __device__ __forceinline__ static void scale_into(rt_fl<16, TN> &acc, const rt_fl<16, N> &part, int t0, float f0, float f1) {
#pragma unroll
    for (int t = 0; t < N / 16; t++)
#pragma unroll
      for (int q = 0; q < 4; q++) {  // (q even: row r, odd: r + 8; the row layout's register order)
        const float f = q % 2 ? f1 : f0;
        acc.tiles[0][t0 + t].data[q].x += f * part.tiles[0][t].data[q].x;
        acc.tiles[0][t0 + t].data[q].y += f * part.tiles[0][t].data[q].y;
      }
  }

  // CONTRACT_BT: in a step's block of rows (columns of a's tile) that holds rows of other groups,
  // zero those columns in this consumer's 64 rows of a's tile (its own: no barrier), so that they
  // add nothing (b's values there are finite: the caller zeroes the rows past the groups).
  __device__ __forceinline__ void clear_other_rows(typename C::ATile &t, const TileSlot &x, int block) const {
    const int lo = max(x.r0 - block * TK, 0), hi = min(x.r1 - block * TK, TK);
    if (lo == 0 && hi == TK) return;
    for (int i = threadIdx.x % 128; i < 64 * TK; i += 128) {
      const int row = 64 * wg + i / TK, col = i % TK;
      if (col < lo || col >= hi) {
        if constexpr (sizeof(T) == 1) reinterpret_cast<unsigned char &>(t(row, col)) = 0;
        else reinterpret_cast<unsigned short &>(t(row, col)) = 0;
      }
    }
    warpgroup::fence_shared_writes();
    sync_named(2 + wg, 128);
  }

  __device__ __forceinline__ void start() const {}
  template <typename Release> __device__ __forceinline__ void consume(int slot, Release release) {
    const Params &p = a.p;
    const TileSlot x = sm.tile[slot];
    __syncwarp();
    release();
    const int count = steps<KIND, TK>(p, x);
    const int row0 = x.m0 + 64 * wg;  // this consumer's first row of out (of out[group] in CONTRACT)
    // A consumer whose rows are all past the group's end (or past k) stores nothing. (It computes
    // its products all the same: skipping them, in a branch of its own or per step, costs spills
    // and serialized wgmmas in every tile; such rows come only at a group's end.)
    const bool active = contracts<KIND> ? row0 < p.k : row0 < x.r1;
    rt_fl<16, TN> acc;
    ring_pos<STAGES> pos(n);
    if constexpr (C::FP8) {
      fp8_steps(acc, x, count, row0, pos);
    } else if (count == 0) {
      warp::zero(acc);
    } else {  // one product in flight while the next step is awaited
      step(acc, x, 0, pos, false);
      for (int j = 1; j < count; j++) {
        const ring_pos<STAGES> prev = pos;
        ++pos;
        step(acc, x, j, pos, true);
        warpgroup::wait<1>();  // the step before is done: free its slot
        if (laneid() == 0) free_slot(prev);
      }
      warpgroup::wait<0>();
      warpgroup::fence_registers(acc);
      if (laneid() == 0) free_slot(pos);
      ++pos;
    }
    n = pos.n;
    if (active) store_out(acc, x, row0);
  }

  // Out: 128 bytes of columns at a time through this consumer's two staging tiles. The leader first
  // waits until the TMA store that last read the tile has read it (at most one store, the other
  // tile's, stays in flight); a tile stored by the threads needs every store done.
  __device__ __forceinline__ void store_out(const rt_fl<16, TN> &acc, const TileSlot &x, int row0) {
    const Params &p = a.p;
    const bool leader = threadIdx.x % 128 == 0;
    const int w = warpid() % 4, tid = threadIdx.x % 128;
    constexpr int COLS = C::OUT_COLS;
    const bool by_rows = !contracts<KIND> && row0 + 64 > x.r1 && x.r1 < p.m;  // the next group's rows follow
#pragma unroll
    for (int c = 0; c < TN / COLS; c++) {
      const int col0 = x.n0 + c * COLS;
      if (col0 >= p.n) break;
      auto &stage = sm.out[wg][staged & 1];
      staged++;
      if (leader) {
        if (by_rows) bulk_wait_read<0>();
        else bulk_wait_read<1>();
      }
      sync_named(2 + wg, 128);
#pragma unroll
      for (int jj = 0; jj < COLS / 16; jj++)
#pragma unroll
        for (int q = 0; q < 4; q++) {
          const int r = 16 * w + laneid() / 4 + 8 * (q % 2), col = 16 * jj + 2 * (laneid() % 4) + 8 * (q / 2);
          *reinterpret_cast<packed<TO> *>(&stage(r, col)) = from_float2<packed<TO>>(acc.tiles[0][c * (COLS / 16) + jj].data[q]);
        }
      warpgroup::fence_shared_writes();
      sync_named(2 + wg, 128);
      if (!by_rows) {
        if (leader) {
          store_async(a.out, stage, {contracts<KIND> ? x.group : 0, row0, 0, col0});
          bulk_commit();
        }
      } else {
        constexpr int CHUNK = 16 / int(sizeof(TO));
        TO *out = static_cast<TO *>(p.out);
        const int rows = x.r1 - row0, cols = p.n - col0;
        for (int i = tid; i < 64 * 8; i += 128) {
          const int r = i / 8, cc = (i % 8) * CHUNK;
          if (r < rows && cc < cols)
            *reinterpret_cast<uint4 *>(out + size_t(row0 + r) * p.n + col0 + cc) = *reinterpret_cast<const uint4 *>(&stage(r, cc));
        }
      }
    }
  }

  // The last stores are done with shared memory (and global memory).
  __device__ __forceinline__ void finish() const {
    if (threadIdx.x % 128 == 0) bulk_wait<0>();
  }
};

template <typename T, typename TO, int KIND, int CLUSTER, int TN>
__global__ __launch_bounds__(Sm90<T, TO, KIND, CLUSTER, TN>::THREADS, 1) void ragged_sm90_kernel(
    const __grid_constant__ typename Sm90<T, TO, KIND, CLUSTER, TN>::Args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ char smem_raw[];
  RaggedSm90<T, TO, KIND, CLUSTER, TN> k{a, align_shared<typename Sm90<T, TO, KIND, CLUSTER, TN>::Shared>(smem_raw)};
  persistent(k);
#endif
}

// Clusters of two where they pay: products whose output has four tiles of 256 rows or more. CONTRACT
// (a dense product's weight gradient; out's rows are k) also needs a contraction of as many rows: a
// tile of a few steps is mostly its store, which sharing b's loads does not shorten, while the two
// blocks' rings move in lockstep; its grouped form (one out[i] per group, of a group's few rows) runs
// alone. So do grouped FP8 products (not measured in pairs).
constexpr long long CLUSTER_MIN_ROWS = 1024;
constexpr int MAX_DEVICES = 64;

template <typename T, typename TO, int KIND, int CLUSTER, int TN = SM90_TILE_N>
cudaError_t launch(const Params &p, int sms, cudaStream_t stream) {
  using C = Sm90<T, TO, KIND, CLUSTER, TN>;
  typename C::Args a{p, {}, {}, {}};
  const bool ok = KIND == CONTRACT
                      ? make_tma_map(a.a, p.a, 1, p.m, 1, p.k, true) && make_tma_map(a.b, p.b, 1, p.m, 1, p.n, true) &&
                            make_tma_map(a.out, p.out, p.groups, p.k, 1, p.n, true)
                  : KIND == CONTRACT_BT
                      ? make_tma_map(a.a, p.a, 1, p.k, 1, p.m, true) && make_tma_map(a.b, p.b, 1, p.n, 1, p.m, true) &&
                            make_tma_map(a.out, p.out, p.groups, p.k, 1, p.n, true)
                      : make_tma_map(a.a, p.a, 1, p.m / p.a_split, p.a_split, p.k, true) &&
                            (KIND == RAGGED      ? make_tma_map(a.b, p.b, p.groups, p.k, 1, p.n, true)
                             : p.a_split > 1 ? make_tma_map(a.b, p.b, 1, p.n, p.a_split, p.k, true)
                                             : make_tma_map(a.b, p.b, p.groups, p.n, 1, p.k, true)) &&
                            make_tma_map(a.out, p.out, 1, p.m, 1, p.n, true);
  if (!ok) return cudaErrorInvalidValue;
  // (the cluster's tiles: pairs too, at most ceil(rows / 256) per column tile of a group)
  const long long tiles = tile_bound(p, C::TM * CLUSTER, C::TN);
  if (tiles + 2LL * sms >= INT_MAX) return cudaErrorInvalidValue;
  auto kernel = ragged_sm90_kernel<T, TO, KIND, CLUSTER, TN>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(C::smem));
  if (e != cudaSuccess) return e;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim = {unsigned(CLUSTER), 1, 1};
  cudaLaunchConfig_t config{};
  config.blockDim = dim3(C::THREADS);
  config.dynamicSmemBytes = C::smem;
  config.attrs = &cluster;
  config.numAttrs = 1;
  // As many clusters as can run at once (a pair of SMs each where the GPU's layout allows; none: the
  // blocks alone), found once per device.
  int clusters = sms;
  if constexpr (CLUSTER > 1) {
    static std::atomic<int> active[MAX_DEVICES] = {};
    int dev = 0;
    if (e = cudaGetDevice(&dev); e != cudaSuccess) return e;
    clusters = dev < MAX_DEVICES ? active[dev].load() : 0;
    if (clusters == 0) {
      // (asked of the current device's context, the config naming no stream yet: the first call may
      // come while XLA records its stream into a CUDA graph, where a query naming the stream may be
      // refused and end the recording)
      config.gridDim = dim3(unsigned(sms / CLUSTER * CLUSTER));
      if (e = cudaOccupancyMaxActiveClusters(&clusters, kernel, &config); e != cudaSuccess) return e;
      if (clusters < 1) clusters = -1;  // (none; 0: not asked yet)
      if (dev < MAX_DEVICES) active[dev] = clusters;
    }
    if (clusters < 1) return launch<T, TO, KIND, 1>(p, sms, stream);
    if constexpr (TN == SM90_TILE_N && !C::FP8) {  // (the other widths' kernels have as many clusters)
      // (out's rows; grouped products keep 256)
      const int tn = p.groups == 1 ? dense_tile_n(KIND == CONTRACT ? p.k : p.m, p.n, clusters) : TN;
      if (tn == 192) return launch<T, TO, KIND, CLUSTER, 192>(p, sms, stream);
      if (tn == 320) return launch<T, TO, KIND, CLUSTER, 320>(p, sms, stream);
    }
  }
  config.gridDim = dim3(unsigned(std::min<long long>(tiles, clusters) * CLUSTER));
  config.stream = stream;
  return cudaLaunchKernelEx(&config, kernel, a);
}

template <typename T, typename TO, int KIND> cudaError_t launch(const Params &p, cudaStream_t stream) {
  int dev = 0, sms = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e != cudaSuccess) return e;
  if constexpr ((KIND == RAGGED || KIND == RAGGED_BT) && !is_8bit<T>)
    if (p.a_split > 1) return launch<T, TO, KIND, 1, SM90_SPLIT_TILE_N>(p, sms, stream);
  if constexpr (KIND != CONTRACT_BT) {
    const bool rows = (KIND == CONTRACT ? std::min(p.k, p.m) : p.m) >= CLUSTER_MIN_ROWS;
    const bool paired = p.groups == 1 || (KIND != CONTRACT && !is_8bit<T>);
    if (sms >= 2 && paired && rows) return launch<T, TO, KIND, 2>(p, sms, stream);
  }
  return launch<T, TO, KIND, 1>(p, sms, stream);
}

template <typename T, typename TO> cudaError_t launch_kind(const Params &p, cudaStream_t stream) {
  if (p.mode == MODE_CONTRACT) return p.b_transposed ? launch<T, TO, CONTRACT_BT>(p, stream) : launch<T, TO, CONTRACT>(p, stream);
  return p.b_transposed ? launch<T, TO, RAGGED_BT>(p, stream) : launch<T, TO, RAGGED>(p, stream);
}

}  // namespace

cudaError_t ragged_sm90(const Params &p, cudaStream_t stream) {
  if (p.dtype == DType::fp8e4m3) {
    if (!p.a_scales || !p.b_scales || (p.mode == MODE_RAGGED) != p.b_transposed) return cudaErrorInvalidValue;
    if (p.mode == MODE_CONTRACT)
      return p.out_f32 ? launch<fp8e4m3, float, CONTRACT_BT>(p, stream) : launch<fp8e4m3, bf16, CONTRACT_BT>(p, stream);
    return p.out_f32 ? launch<fp8e4m3, float, RAGGED_BT>(p, stream) : launch<fp8e4m3, bf16, RAGGED_BT>(p, stream);
  }
  if (p.dtype == DType::bf16) return p.out_f32 ? launch_kind<bf16, float>(p, stream) : launch_kind<bf16, bf16>(p, stream);
  return p.out_f32 ? launch_kind<half, float>(p, stream) : launch_kind<half, half>(p, stream);
}

}  // namespace jax_tk::gemm
