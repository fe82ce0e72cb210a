// Attention forward for Hopper (sm_90a): TMA, mbarriers, wgmma and warp specialization, in a
// persistent kernel (FwdSm90, the kernel's parts on pipeline/kernel.cuh, says how it is organized).
#include <algorithm>

#include "common.cuh"

namespace jax_tk::attention {
namespace {

using namespace tk;

// Tile t as the scheduler announces it. In plain attention (FULL = false) and with segment ids the
// scheduler works out where it lies (divisions, or a load of Params::fwd_tiles) and the consumers,
// whose tensor cores wait at each tile's start, only read it (the divisions took 1.2% of the stall
// samples at T = 2k); plain attention reads the key range from it too. The other masked kernels
// work it out where it is used (in the scheduler's registers it spills there).
struct alignas(16) TileSlot {
  int t, b, h, q0;
  int2 range;      // (read by plain attention)
  int kbase, end;  // a document's tile: its keys' base and its document's end (Params::fwd_tiles); -1, q_len otherwise
};

// D: the query's and key's head dim, DV: the value's and output's (D but in MLA's pair, 192 and 128).
// CONSUMERS_ = 3 (plain attention at D = 64, see three_consumers): tiles of 192 rows, and a third
// warpgroup's softmax to overlap the others' products; its S, P and O fit the 160 registers that four
// warpgroups leave each consumer.
template <typename T, int D, int DV, int CONSUMERS_> struct FwdH {
  static_assert(CONSUMERS_ == 2 || (CONSUMERS_ == 3 && D == 64 && DV == 64));
  using Roles = std::conditional_t<CONSUMERS_ == 3, roles<3, /*PRODUCER_REGS=*/32, /*CONSUMER_REGS=*/160>,
                                   roles<2, /*PRODUCER_REGS=*/40, /*CONSUMER_REGS=*/232>>;
  static constexpr int CONSUMERS = Roles::CONSUMERS, THREADS = Roles::THREADS, BQ = 64 * CONSUMERS;
  static constexpr int BK = fwd_tile_keys(D);  // (D = 256: 64, as O takes 128 registers and K/V tiles 32 KB)
  static constexpr int STAGES = D <= 64 ? 4 : 2;
  static constexpr int Q_STAGES = D <= 128 ? 2 : 1;  // the next tile's Q loads during this one (not above: space)
  static constexpr bool PINGPONG = DV <= 128;  // the consumers take turns issuing their products
  // In the masked kernel the loader tells the consumers, with each key block, the next listed one and
  // the masks it needs (see the consumers' loop); at D = 256 they work both out themselves (the other
  // way costs spills there).
  static constexpr bool LOADER_INFO = DV <= 128;
  // The masked kernel takes documents' tiles (Params::fwd_tiles) at D <= 128 (at D = 256 the
  // registers they need spill in the consumers' loop; jax_tk gives it tiles of the fixed grid only).
  static constexpr bool DOCS = D <= FWD_DOCS_MAX_HEAD_DIM;
  using OTile = st<T, 64, DV>;
  struct Shared {
    st<T, 64, D> q[Q_STAGES][CONSUMERS];
    st<T, BK, D> k[STAGES];
    st<T, BK, DV> v[STAGES];
    // Rings (ring.cuh): Q of a tile (both consumers' rows); K and V of a key block (in step, but V is
    // freed later); the tiles announced by the scheduler (scheduler.cuh).
    semaphore q_full[Q_STAGES], q_empty[Q_STAGES], k_full[STAGES], v_full[STAGES], k_empty[STAGES], v_empty[STAGES];
    semaphore tile_full[2], tile_empty[2];
    TileSlot tile[2];  // (t >= tiles: no more)
    int info[STAGES];  // (LOADER_INFO) the listed key block after the one in the slot, shifted left by
                       // MASK_BITS, and that one's mask bits (tile_mask_bits)
  };
  struct Args {
    Params p;
    tma_map<T, 64> q, o;
    tma_map<T, BK> k, v;
    bool stage_o;  // see stages_o
  };
  static constexpr size_t smem = sizeof(Shared) + 1024;  // + room to align the base to 1024
  static_assert(smem <= MAX_SHARED_BYTES);
  // Shared memory after Shared (and the bias's scratch): where it fits (D <= 128) a staging tile of O
  // per consumer (O goes out through it and one TMA store, instead of each thread's global stores),
  // then with segment ids the block lists of the two announced tiles. Where both do not fit (D = 128:
  // keys past 256k with segment ids; a bias), the consumers store O themselves.
  static constexpr bool STAGE_O = smem + CONSUMERS * sizeof(OTile) <= MAX_SHARED_BYTES;
  static size_t lists_bytes(const Params &p, bool full) {
    return full && (p.q_segment_ids || p.mask_blocks) ? 2 * block_list_bytes((p.kv_len + BK - 1) / BK) : 0;
  }
  // With a bias, first each consumer warp's scratch tile (see RowBias).
  __host__ __device__ static size_t bias_bytes(const Params &p) { return p.bias ? CONSUMERS * 4 * BIAS_SCRATCH : 0; }
  static bool stages_o(const Params &p, bool full, size_t max_smem) {
    return STAGE_O && smem + bias_bytes(p) + CONSUMERS * sizeof(OTile) + lists_bytes(p, full) <= max_smem;
  }
  static size_t extra_bytes(const Params &p, bool full, bool stage_o) {
    return bias_bytes(p) + (stage_o ? CONSUMERS * sizeof(OTile) : 0) + lists_bytes(p, full);
  }
};

// A tile: query rows [q0, min(q0 + BQ, end)) of head h of batch entry b, and the key blocks it visits:
// blocks of BK keys from kbase (0; a document's tile: its document's start, see Params::fwd_tiles).
struct FwdTile {
  int b, h, q0;
  int2 range;        // key blocks [first, end) (kv_block_range)
  BlockList blocks;  // ... minus those of other segments
  bool doc;          // a document's tile: keys [kbase, end) only, no segment test
  int kbase, end;
};
// Tile t of the order in which the tiles are handed out: the query blocks of one head, heaviest
// (causal) first, then the next head, the next batch entry (the tiles running at one time share
// their keys and values in L2); with a bias shared by the batch entries, the batch entries of one
// query block innermost (batch_inner); with Params::fwd_tiles, its tile t.
template <bool FULL> __device__ __forceinline__ TileSlot tile_coords(const Params &p, int t, int BQ) {
  if (FULL && p.fwd_tiles) {
    const int4 e = reinterpret_cast<const int4 *>(p.fwd_tiles)[t];
    return {t, e.x / p.q_heads, e.x % p.q_heads, e.y, {}, e.w, e.z};
  }
  const int qblocks = (p.q_len + BQ - 1) / BQ;
  if (batch_inner<FULL>(p)) {
    const int rest = t / p.batch;
    return {t, t % p.batch, rest / qblocks, (qblocks - 1 - rest % qblocks) * BQ, {}, -1, p.q_len};
  }
  const int rest = t / qblocks;
  return {t, rest / p.q_heads, rest % p.q_heads, (qblocks - 1 - t % qblocks) * BQ, {}, -1, p.q_len};
}
// The tile at c (tile_coords) and its key blocks (with segment ids, the list in `list`, unless a
// document's tile; DOCS: the kernel takes documents' tiles).
template <bool FULL, bool DOCS>
__device__ __forceinline__ FwdTile fwd_tile(const Params &p, const TileSlot &c, int BQ, int BK, const uint32_t *list) {
  FwdTile x{c.b, c.h, c.q0};
  x.doc = DOCS && c.kbase >= 0;
  x.kbase = x.doc ? c.kbase : 0;
  x.end = c.end;
  if (x.doc) {  // its document's keys that its rows may see, in blocks from the document's start
    const int2 keys = kv_block_range<FULL>(p, x.b, x.q0, min(BQ, x.end - x.q0), 1);
    x.range = blocks_of(max(keys.x, x.kbase) - x.kbase, min(keys.y, x.end) - x.kbase, BK);
  } else {
    x.range = kv_block_range<FULL>(p, x.b, x.q0, BQ, BK);
  }
  x.blocks = FULL && (p.q_segment_ids || p.mask_blocks) && !x.doc ? block_list(list, x.range.x, x.range.y)
                                                                  : BlockList{x.range.x, x.range.y, nullptr, 0};
  return x;
}
// The position rules of a tile's rows: a document's tile's rows see its document's keys only.
template <bool FULL> __device__ __forceinline__ KeyRule tile_rule(const Params &p, const FwdTile &x) {
  KeyRule r = key_rule<FULL>(p, x.b);
  if (x.doc) {
    r.q_end = min(r.q_end, x.end);
    r.kv_end = min(r.kv_end, x.end);
  }
  return r;
}

// A persistent kernel: one block per SM, each taking tiles (fwd_tile) one after the other from a
// counter shared by the grid (the tiles of causal or packed attention differ in length), so that the
// next tile's loads overlap this tile's last blocks and its output. Per block, 3 warpgroups (4 with
// three consumers, see three_consumers):
//   producer warpgroup: warp 0 (one thread) loads each tile's Q once and streams its key/value
//     blocks through a ring of STAGES slots (TMA), each slot guarded by a "full" semaphore (bytes
//     landed) and an "empty" one (every consumer warp is done with it); warp 1 schedules: it takes
//     the next tile from the counter and announces it in one of two slots (with segment ids, with the
//     list of its key blocks, worked out by the warp's 32 lanes in parallel);
//   CONSUMERS_ consumer warpgroups, 64 query rows each: S = Q K^T (wgmma, both operands in shared
//     memory), online softmax in registers, O += P V (wgmma, P from registers), pipelined so that the
//     softmax of one block overlaps the P V product of the previous, and they take turns issuing
//     their products (ping-pong), so that one's softmax runs while the tensor cores work for another;
//     each writes its rows of O through a staging tile and a TMA store (where it fits: STAGE_O).
// setmaxnreg moves registers from the producer to the consumers. A tile whose rows see no key loads
// nothing and stores O = 0, lse = -inf. Only the tiles that cut through a rule or a segment
// boundary are masked elementwise (KeyRule, BlockList::one_segment). BIAS (with DENSE, when a bias
// is given): the bias's code, whose registers a mask alone should not pay for.
template <typename T, int D, int DV, bool FULL, bool DENSE, bool BIAS, int CONSUMERS_> struct FwdSm90 {
  using C = FwdH<T, D, DV, CONSUMERS_>;
  // The masked kernels' tiles: those of Params::fwd_tiles and of the mask's blocks (attention.h).
  static_assert(!FULL || C::BQ == FWD_TILE_ROWS);
  static_assert(!FULL || (MASK_BLOCK_ROWS % C::BQ == 0 && MASK_BLOCK_KEYS % C::BK == 0));  // (mask_code)
  using Roles = typename C::Roles;
  using Tile = TileSlot;
  static constexpr int BK = C::BK, STAGES = C::STAGES, QS = C::Q_STAGES, CONSUMERS = C::CONSUMERS;
  static constexpr bool DOCS = FULL && C::DOCS;
  // In plain attention the warpgroup and the Q slot are made known to be warp-uniform
  // (warp_uniform), so that the wgmma descriptors of Q stay in uniform registers instead of being
  // moved there before each wgmma. (In the masked kernels it cost spills.)
  __device__ __forceinline__ static int known_uniform(int x) { return FULL ? x : warp_uniform(x); }

  const typename C::Args &a;
  typename C::Shared &sm;
  const Params p = a.p;  // a copy: the fields it uses stay in registers (no reloads after each memory clobber)
  const int tiles = FULL && p.fwd_tiles ? fwd_tile_cap(p.q_len) * p.q_heads * p.batch : (p.q_len + C::BQ - 1) / C::BQ * p.q_heads * p.batch;
  const bool listed = FULL && (p.q_segment_ids || p.mask_blocks);  // (see fwd_tile)
  const bool stage_o = C::STAGE_O && (!FULL || a.stage_o);  // (always in plain attention: see fwd_sm90)
  char *const bias_scratch = reinterpret_cast<char *>(&sm + 1);
  typename C::OTile *const o_stages = reinterpret_cast<typename C::OTile *>(bias_scratch + C::bias_bytes(p));
  uint32_t *const lists = reinterpret_cast<uint32_t *>(o_stages + (stage_o ? CONSUMERS : 0));  // two slots of list_words words
  const int list_words = int(block_list_bytes((p.kv_len + BK - 1) / BK) / 4);
  const int wg = known_uniform(warpgroup::groupid());
  // The rings (ring.cuh), formed where they are used: from the shared struct, each semaphore's address
  // is then a base and a constant offset (members holding the pointers made the compiler form each
  // address in full, in the main loop too). K and V go at the same positions.
  __device__ __forceinline__ ring<QS> q_ring() const { return {sm.q_full, sm.q_empty}; }
  __device__ __forceinline__ ring<STAGES> k_ring() const { return {sm.k_full, sm.k_empty}; }
  __device__ __forceinline__ ring<STAGES> v_ring() const { return {sm.v_full, sm.v_empty}; }
  int n = 0, nq = 0;  // key blocks, Q loads so far (the loader's, or this consumer's)
  float c = 0.f;      // (the consumers') logit_factor

  __device__ __forceinline__ tile_queue<TileSlot> queue() const { return {{sm.tile_full, sm.tile_empty}, sm.tile}; }
  // full: the loader (and its bytes); empty: each consumer warp (and the loader)
  __device__ __forceinline__ void init() const {
    tk::init(q_ring(), 1, CONSUMERS * 4);
    tk::init(k_ring(), v_ring(), 1, CONSUMERS * 4);
  }

  __device__ __forceinline__ FwdTile read_tile(int slot) const {
    TileSlot x = sm.tile[slot];
    if constexpr (FULL) {
      if (!listed) x = tile_coords<FULL>(p, x.t, C::BQ);
      return fwd_tile<FULL, DOCS>(p, x, C::BQ, BK, lists + slot * list_words);
    }
    return FwdTile{x.b, x.h, x.q0, x.range, BlockList{x.range.x, x.range.y, nullptr, 0}, false, 0, p.q_len};
  }

  // The scheduler: the next tile from the counter (with segment ids or a mask, with the list of its
  // key blocks, written by the warp's lanes into the slot's list).
  __device__ __forceinline__ TileSlot schedule(int k, int slot) const {
    const Params &p = a.p;  // read where used: the producer's registers are few
    int t = next_tile(p.tile_counter, k);
    if (FULL && p.fwd_tiles && t < tiles && p.fwd_tiles[4 * t] < 0) t = tiles;  // (the list's unused entries come last)
    TileSlot c{t, 0, 0, 0, {}, -1, p.q_len};
    FwdTile x{};  // (the masked kernels need it only with segment ids: see TileSlot)
    if (!FULL || (listed && t < tiles)) {
      c = tile_coords<FULL>(p, min(t, tiles - 1), C::BQ);
      c.t = t;
      x = fwd_tile<FULL, DOCS>(p, c, C::BQ, BK, nullptr);
    }
    if (listed && t < tiles && !x.doc) {
      write_block_list(lists + slot * list_words, x.range.x, x.range.y, 0, 1,
                       [&](int j) { return pair_test<FULL, DENSE>(p, x.b, x.h, x.q0, C::BQ, j * BK, BK); });
      __syncwarp();
    }
    c.range = x.range;
    return c;
  }

  // The loader: the tile's Q once, then its key/value blocks.
  template <typename Release> __device__ __forceinline__ void load(int slot, Release release) {
    const Params &p = a.p;
    const FwdTile x = read_tile(slot);
    const int kvh = x.h / (p.q_heads / p.kv_heads);
    const KeyRule rule = tile_rule<FULL>(p, x);
    if (int j = x.blocks.next(x.range.x); j < x.range.y) {
      const ring_use<QS> qa(nq);
      nq++;
      wait_empty(q_ring(), qa);
      arrive_expect_bytes(q_ring().full(qa), CONSUMERS * sizeof(sm.q[0][0].data));
      for (int c = 0; c < CONSUMERS; c++) load_async(sm.q[qa.slot][c], a.q, {x.b, x.q0 + 64 * c, x.h, 0}, q_ring().full(qa));
      for (int j_next; j < x.range.y; n++, j = j_next) {
        const ring_use<STAGES> kv(n);
        const int s = kv.slot, k0 = x.kbase + j * BK;
        j_next = x.blocks.next(j + 1);
        wait_empty(k_ring(), kv);
        if (FULL && C::LOADER_INFO)  // (released by the arrival)
          sm.info[s] = j_next << MASK_BITS | tile_mask_bits<FULL, DENSE>(p, rule, x.blocks.uniform(j), x.q0, C::BQ, k0, BK);
        arrive_expect_bytes(k_ring().full(kv), sizeof(sm.k[s].data));
        load_async(sm.k[s], a.k, {x.b, k0, kvh, 0}, k_ring().full(kv));
        wait_empty(v_ring(), kv);
        arrive_expect_bytes(v_ring().full(kv), sizeof(sm.v[s].data));
        load_async(sm.v[s], a.v, {x.b, k0, kvh, 0}, v_ring().full(kv));
      }
    }
    release();
  }

  // Turns: named barrier 1 + w opens consumer w's turn when the one before it (w - 1, cyclically)
  // arrives on it. The last consumer opens the first turn, every turn is answered, and consumer 0
  // takes the answer to the last one at the end (no arrival is left pending). (Not at D = 256: there
  // the barriers cost registers that O needs.)
  // (With two consumers the next one's barrier is written 2 - wg: the same id as the cyclic form,
  // which compiles to more instructions.)
  __device__ __forceinline__ void my_turn() const {
    if constexpr (C::PINGPONG) sync_named(1 + wg, 256);
  }
  __device__ __forceinline__ void your_turn() const {
    if constexpr (C::PINGPONG) arrive_named(CONSUMERS == 2 ? 2 - wg : 1 + (wg + 1) % CONSUMERS, 256);
  }
  __device__ __forceinline__ void start() {
    if (wg == CONSUMERS - 1) your_turn();
    c = logit_factor<FULL, DENSE>(p);
  }
  __device__ __forceinline__ void finish() const {
    if (stage_o && threadIdx.x % 128 == 0) bulk_wait<0>();  // the last store is done with shared memory
    if (wg == 0) my_turn();  // the answer to the last consumer's last turn
  }

  // A consumer's 64 rows of a tile: S = Q K^T and the online softmax, O += P V, then O and lse out.
  template <typename Release> __device__ __forceinline__ void consume(int slot, Release release);

  // The blocks from stop on, whose keys none of these rows sees: released as they land, with a turn
  // each (every consumer takes as many turns per tile as there are blocks, plus one). (Not unrolled:
  // unrolled, the ring positions left the uniform registers, and the main loop slowed.)
  __device__ __forceinline__ void drain(ring_pos<STAGES> &kv, int stop, int end) const {
#pragma unroll 1
    for (int jd = stop; jd < end; jd++) {
      const auto d = kv++;
      wait_full(k_ring(), d);
      wait_full(v_ring(), d);
      if (laneid() == 0) {
        arrive_empty(k_ring(), d);
        arrive_empty(v_ring(), d);
      }
      my_turn();
      your_turn();
    }
  }

  // O /= l into this consumer's staging tile, then one TMA store (the warps do not wait for global
  // stores); the leader first waits until the last tile's store has read the tile.
  __device__ __forceinline__ void store_staged(rt_fl<16, DV> &o, const col_vec<rt_fl<16, BK>> &l, const FwdTile &x,
                                               int rows_end) const {
    const bool leader = threadIdx.x % 128 == 0;
    auto &o_stage = o_stages[wg];
    if (leader) bulk_wait_read<0>();
    sync_named(1 + CONSUMERS + wg, 128);
    normalize_output(o, l);
    rt<T, 16, DV> o16;
    warp::copy(o16, o);
    warp::store(o_stage, o16, 16 * (warpid() % 4), 0);
    warpgroup::fence_shared_writes();
    sync_named(1 + CONSUMERS + wg, 128);
    const int r0 = x.q0 + 64 * wg;
    if (rows_end == p.q_len || r0 + 64 <= rows_end) {
      if (leader && r0 < p.q_len) store_async(a.o, o_stage, {x.b, r0, x.h, 0});
    } else {  // a document's tile that ends inside these rows: the rows after it are the next tile's
      store<128>(output_rows<T>(p, rows_end), o_stage, {x.b, r0, x.h, 0}, threadIdx.x % 128);
    }
    if (leader) bulk_commit();
  }
};

template <typename T, int D, int DV, bool FULL, bool DENSE, bool BIAS, int CONSUMERS_>
template <typename Release>
__device__ __forceinline__ void FwdSm90<T, D, DV, FULL, DENSE, BIAS, CONSUMERS_>::consume(int slot, Release release) {
  const bool lane0 = laneid() == 0;
  const FwdTile x = read_tile(slot);
  const float s2 = sink2(p, x.b, x.h);  // (read now: its latency passes under the tile's products)
  const KeyRule rule = tile_rule<FULL>(p, x);
  const BlockList &blocks = x.blocks;
  const int end = x.range.y, first = blocks.next(x.range.x);
  const int qw = x.q0 + 64 * wg + 16 * (warpid() % 4);  // this warp's first query row
  // With three consumers (192-row tiles) the last key blocks of a causal tile can lie wholly past
  // the diagonal for the first consumers' rows, and the last tile's last consumers can have no
  // rows at all: a consumer multiplies the blocks before stop (at least one) and only passes the
  // rest on (see drain). With 128-row tiles and 128-key blocks every block of the range reaches
  // every consumer's rows.
  constexpr bool SKIP = !FULL && CONSUMERS == 3;
  const int stop = SKIP ? max(min(kv_block_range<FULL>(p, x.b, x.q0 + 64 * wg, 64, BK).y, end), first + 1) : end;
  rt_fl<16, BK> s;
  rt<T, 16, BK> pr;
  rt_fl<16, DV> o;
  col_vec<rt_fl<16, BK>> m, l, corr;
  warp::zero(o);
  warp::fill_vec(m, NEG_INF);
  warp::fill_vec(l, 0.f);
  if (first == end) {  // these rows see no key: O = 0, lse = -inf (or the sink)
    release();
    store_lse(p, m, l, c, s2, x.b, x.h, qw, x.end);
    store_output<T>(p, o, l, x.b, x.h, qw, 0, x.end);
    return;
  }
  const ring_use<QS> qa(nq);
  wait_full(q_ring(), qa);
  nq++;
  const auto &q = sm.q[known_uniform(qa.slot)][wg];

  // Software pipeline: while the tensor cores compute O += P_{j-1} V_{j-1}, the warps run the
  // softmax of block j. S_j is issued first; wgmma groups complete in order.
  // The key block after block j (blocks.next(j + 1)) and block j's masks: in the masked kernel with
  // LOADER_INFO the loader, which walks the list, leaves both in j's slot (walking the list here, a
  // loop inside the loop below, would hold up the products in flight; and most blocks need no mask).
  constexpr bool from_loader = FULL && C::LOADER_INFO;
  // (A document's tile counts its key blocks from its document's start: the base is read from the
  // slot where a block needs a mask, not held in a register through the loop.)
  // The bias (in log2 units, after cap_logits) first: the masks then hide what they hide. Block j's
  // bias is loaded before its products are issued (no documents' tiles with dense operands).
  RowBias<T, BK / 64> bias;
  void *const scratch = bias_scratch + BIAS_SCRATCH * (4 * wg + warpid() % 4);
  auto load_block_bias = [&](int j) {
    if constexpr (BIAS) load_bias(bias, p, x.b, x.h, qw, j * BK);
  };
  // In plain attention the blocks that cut through the rule are the range's last ones (as j grows,
  // a block's keys only move further past the causal diagonal and the keys' end): from mask_from on.
  int mask_from = stop;
  if constexpr (!FULL)
    while (mask_from > first && rule.partial(qw, 16, (mask_from - 1) * BK, BK)) mask_from--;
  auto mask = [&](int j, int info) {
    if constexpr (!FULL) {
      if (j >= mask_from) mask_rule<false>(s, rule, qw, j * BK);
      return;
    }
    if constexpr (BIAS) add_bias(s, bias, scratch);
    if (from_loader && (info & ((1 << MASK_BITS) - 1)) == 0) return;  // most blocks
    const int k0 = (DOCS ? max(sm.tile[slot].kbase, 0) : 0) + j * BK;
    const MaskNeed need = from_loader ? warp_mask_need(info, rule, qw, 16, k0, BK)
                                      : mask_need<FULL, DENSE>(p, rule, blocks.uniform(j), qw, 16, k0, BK);
    mask_logits<FULL, DENSE>(s, p, rule, need, x.b, x.h, qw, k0);
  };
  ring_pos<STAGES> kv(n);  // the key block in S (the one before it is in P)
  load_block_bias(first);
  wait_full(k_ring(), kv);
  int info = from_loader ? sm.info[kv.slot] : 0;
  int j = from_loader ? info >> MASK_BITS : blocks.next(first + 1);
  my_turn();
  warpgroup::mma_ABt(s, q, sm.k[kv.slot], false);  // S_0 = Q K_0^T
  your_turn();
  warpgroup::wait<0>();
  warpgroup::fence_registers(s);
  if (lane0) arrive_empty(k_ring(), kv);
  cap_logits<FULL, DENSE>(s, p);
  mask(first, info);
  softmax_step<true>(s, m, l, corr, c);
  warp::copy(pr, s);

  for (int j_next; j < stop; j = j_next) {
    load_block_bias(j);
    const ring_use<STAGES> prev = kv;
    ++kv;
    wait_full(k_ring(), kv);
    if (from_loader) {
      info = sm.info[kv.slot];
      j_next = info >> MASK_BITS;
    }
    wait_full(v_ring(), prev);
    my_turn();
    warpgroup::mma_ABt(s, q, sm.k[kv.slot], false);   // S_j = Q K_j^T
    warpgroup::mma_AB(o, pr, sm.v[prev.slot], true);  // O += P_{j-1} V_{j-1}
    your_turn();
    if (!from_loader) j_next = blocks.next(j + 1);  // while the products run
    warpgroup::wait<1>();  // S_j is ready
    warpgroup::fence_registers(s);
    if (lane0) arrive_empty(k_ring(), kv);
    cap_logits<FULL, DENSE>(s, p);
    mask(j, info);
    softmax_step<true>(s, m, l, corr, c);
    warpgroup::wait<0>();  // P_{j-1} V_{j-1} is done
    warpgroup::fence_registers(o);
    warpgroup::fence_registers(pr);
    if (lane0) arrive_empty(v_ring(), prev);
    warp::mul_row(o, o, corr);
    warp::copy(pr, s);
  }
  const int rows_end = DOCS ? sm.tile[slot].end : p.q_len;  // (see FwdTile)
  if (lane0) arrive_empty(q_ring(), qa);  // done with Q and with the tile's slot and list
  release();
  const auto last = kv++;
  wait_full(v_ring(), last);
  my_turn();
  warpgroup::mma_AB(o, pr, sm.v[last.slot], true);
  your_turn();
  warpgroup::wait<0>();
  warpgroup::fence_registers(o);
  if (lane0) arrive_empty(v_ring(), last);
  if constexpr (SKIP) drain(kv, stop, end);
  n = kv.n;
  warp::sum_lanes(l);  // (softmax_step kept each lane's part)
  store_lse(p, m, l, c, s2, x.b, x.h, qw, rows_end);  // (with a sink, l grows)
  if (stage_o) store_staged(o, l, x, rows_end);
  else store_output<T>(p, o, l, x.b, x.h, qw, 0, rows_end);
}

// A persistent kernel (pipeline/kernel.cuh) of the parts above. BIAS (with DENSE, when a bias is
// given): the bias's code, whose registers a mask alone should not pay for.
template <typename T, int D, int DV, bool FULL, bool DENSE, bool BIAS, int CONSUMERS_>
__global__ __launch_bounds__(FwdH<T, D, DV, CONSUMERS_>::THREADS, 1) void fwd_sm90_kernel(const __grid_constant__ typename FwdH<T, D, DV, CONSUMERS_>::Args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ char smem_raw[];
  FwdSm90<T, D, DV, FULL, DENSE, BIAS, CONSUMERS_> k{a, align_shared<typename FwdH<T, D, DV, CONSUMERS_>::Shared>(smem_raw)};
  persistent(k);
#endif
}

template <typename T, int D, int DV, bool FULL, bool DENSE, int CONSUMERS> cudaError_t fwd_launch(const Params &p, cudaStream_t stream) {
  using C = FwdH<T, D, DV, CONSUMERS>;
  typename C::Args a{p, {}, {}, {}, {}, false};
  if (!make_tma_map(a.q, p.q, p.batch, p.q_len, p.q_heads, D) ||
      !make_tma_map(a.o, p.o, p.batch, p.q_len, p.q_heads, DV) ||
      !make_tma_map(a.k, p.k, p.batch, p.kv_len, p.kv_heads, D) ||
      !make_tma_map(a.v, p.v, p.batch, p.kv_len, p.kv_heads, DV))
    return cudaErrorInvalidValue;
  const long long tiles = (p.q_len + C::BQ - 1) / C::BQ * (long long)p.q_heads * p.batch;
  const long long listed = FULL && p.fwd_tiles ? (long long)fwd_tile_cap(p.q_len) * p.q_heads * p.batch : tiles;
  int dev = 0, sms = 0, max_smem = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (e != cudaSuccess) return e;
  // (Plain attention always stages O where it can: it fits, and the kernel takes it as known.)
  a.stage_o = C::stages_o(p, FULL, size_t(max_smem));
  if (!FULL && C::STAGE_O && !a.stage_o) return cudaErrorInvalidConfiguration;
  if (listed + 2 * sms >= INT_MAX || p.tile_counter == nullptr) return cudaErrorInvalidValue;
  auto kernel = p.bias ? fwd_sm90_kernel<T, D, DV, FULL, DENSE, DENSE, CONSUMERS> : fwd_sm90_kernel<T, D, DV, FULL, DENSE, false, CONSUMERS>;
  const size_t smem = C::smem + C::extra_bytes(p, FULL, a.stage_o);
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (e == cudaSuccess) e = cudaMemsetAsync(p.tile_counter, 0, sizeof(int), stream);
  if (e != cudaSuccess) return e;
  kernel<<<unsigned(std::min<long long>(tiles, sms)), C::THREADS, smem, stream>>>(a);
  return cudaGetLastError();
}

// Plain attention at D = 64 takes three consumers (192-row tiles) where the queries then fall in fewer
// tiles than in 128-row ones (129-192 queries, and from 257): the third warpgroup's softmax overlaps
// the others' products (the exponentials weigh twice as much against the products as at D = 128).
// The rows a 192-row tile pads, and the key blocks its causal diagonal adds, cost no products (a
// consumer stops at the last key block its rows see), but with as many tiles (128 or 256 queries:
// 1% and 21% slower) a bigger tile only adds idle consumers. Keys under 384 have not been compared.
bool three_consumers(const Params &p) {
  return p.kv_len >= 384 && (p.q_len + 191) / 192 < (p.q_len + 127) / 128;
}

}  // namespace

bool fwd_sm90_supported(const Params &p) { return has_kernel_dims(p.head_dim, p.v_head_dim); }

cudaError_t fwd_sm90(const Params &p, cudaStream_t stream) {
  if (p.v_head_dim != p.head_dim)  // (MLA's pair, the one unequal one: has_kernel_dims)
    return dispatch<MLA_HEAD_DIM_QK>(p, [&]<typename T, int D, bool FULL, bool DENSE>() {
      return fwd_launch<T, D, MLA_HEAD_DIM_V, FULL, DENSE, 2>(p, stream);
    });
  return dispatch<64, 128, 256>(p, [&]<typename T, int D, bool FULL, bool DENSE>() {
    if constexpr (D == 64 && !FULL)
      if (three_consumers(p)) return fwd_launch<T, D, D, FULL, DENSE, 3>(p, stream);
    return fwd_launch<T, D, D, FULL, DENSE, 2>(p, stream);
  });
}

}  // namespace jax_tk::attention
