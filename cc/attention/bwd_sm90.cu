// Attention backward for Hopper (sm_90a): TMA, mbarriers, wgmma and warp specialization.
//
// One block per 128 keys (64 above D = 128) of one key/value head. It loops over the query heads
// of that head's group and over the 64-row query blocks that see those keys, so dK and dV are summed
// over the group in registers and written once (no atomics). Three warpgroups:
//   producer:  one warp streams Q_i and dO_i (TMA) and the rows' log-sum-exp and delta (prepared
//              in the workspace) through a ring of STAGES slots; one thread adds the dQ tiles
//              (D <= 128, below);
//   consumers: 64 keys each:
//                S^T = K Q_i^T,  dP^T = V dO_i^T                   (wgmma, both from shared memory)
//                P^T = exp(S^T - lse),  dS^T = P^T (dP^T - delta)   (registers)
//                dV += P^T dO_i                                    (wgmma, A from registers)
//              then both write dS^T to shared memory, and each computes
//                dK += dS^T Q_i                                    (wgmma, A: its rows of dS^T,
//                                                                   from registers at D <= 128)
//                dQ_i = dS K, half of the columns                  (wgmma, A read M-major)
//              which goes to an fp32 accumulator tile in global memory: through shared memory and
//              a bulk reduce-add issued by the producer's dQ writer (D <= 128), or from the
//              registers by vector reductions (red.global.add.v4.f32, above). Above D = 128 both
//              consumers take the same 64 keys and split the columns of dK, dV and dQ_i instead
//              (BwdH::share; at MLA's 192/128 each also computes S^T and dP^T for half of the
//              queries only, P^T going through shared memory: BwdH::HALVES). With
//              Params::deterministic the blocks of one query block take turns, in key-block order,
//              so that the sums come out the same every run.
// Before it, a small kernel computes delta = rowsum(dO * O) - dlse, lays out the rows' statistics
// for the producer and clears the accumulator;
// after it, another scales the accumulator and converts it to dq.
#include "common.cuh"

namespace jax_tk::attention {
namespace {

using namespace tk;


template <typename T, int D> struct BwdH {
  using Roles = roles</*CONSUMERS=*/2, /*PRODUCER_REGS=*/24, /*CONSUMER_REGS=*/240>;
  static constexpr int CONSUMERS = Roles::CONSUMERS, THREADS = Roles::THREADS;
  static constexpr int DV = kernel_v_head_dim(D);  // the value's head dim (MLA's pair: 128 at D = 192)
  // SPLIT consumers share each 64 keys and split the columns of dK/dV (SPLIT = 2 above D = 128: 64 x
  // 256 fp32 accumulators would not fit one warpgroup's registers; both then compute S^T and dP^T).
  static constexpr int SPLIT = D > 128 ? 2 : 1;
  static constexpr int BK = 64 * CONSUMERS / SPLIT, BQ = 64;
  // (Params::block_order's blocks and the workspace's dq tiles, which Python sizes from attention.h)
  static_assert(BQ == BWD_QUERY_ROWS && BK == (D <= 128 ? BWD_BLOCK_KEYS : BWD_BLOCK_KEYS_D256));
  static_assert(MASK_BLOCK_ROWS % BQ == 0 && MASK_BLOCK_KEYS % BK == 0);  // (mask_code)
  // Consumer w's columns: [k0, k0 + kc) of dK, [v0, v0 + vc) of dV and [q0, q0 + qc) of dQ_i. With
  // SPLIT = 1 both take all of dK and dV (their own keys) and half of dQ_i. With SPLIT = 2 the
  // windows are whole 128-byte panels (wgmma's operands): at D = 192 consumer 0 takes 128 columns of
  // dK and consumer 1 the other 64; dQ_i's then split the other way (64 + 128), so that each does as
  // many products.
  struct Share {
    int k0, kc, v0, vc, q0, qc;
  };
  static constexpr int K_FIRST = (D / SPLIT + 63) / 64 * 64;  // consumer 0's columns of dK
  __host__ __device__ static constexpr Share share(int w) {
    if (SPLIT == 1) return {0, D, 0, DV, w * D / CONSUMERS, D / CONSUMERS};
    const int s = w % SPLIT;  // (arithmetic, not a choice: at D = 256 ptxas then keeps one offset for all three)
    return {s * K_FIRST, s ? D - K_FIRST : K_FIRST, s * DV / 2, DV / 2, s * (D - K_FIRST), s ? K_FIRST : D - K_FIRST};
  }
  // Whether the two consumers' shares differ in shape (then each is compiled on its own, see consume).
  static constexpr bool ASYMMETRIC = share(0).kc != share(1).kc || share(0).qc != share(1).qc;
  // HALVES (MLA's pair): each consumer computes S^T and dP^T for half of the step's queries only, and
  // P^T goes through shared memory to both dV products. (At D = 256 both consumers still compute all
  // of S^T and dP^T: not measured there yet.)
  static constexpr bool HALVES = ASYMMETRIC;
  static constexpr int SQ = HALVES ? BQ / 2 : BQ;  // query columns of a consumer's S^T and dP^T
  // Each consumer computes its columns of dQ_i in parts of at most 64 (registers again).
  template <int W> static constexpr int DQ_PART = share(W).qc < 64 ? share(W).qc : 64;
  // STAGED (D <= 128): each consumer stores its dQ_i tile to shared memory (its registers are free at
  // once) and a writer warp adds it to the accumulator with one bulk reduce-add; above (no room, or
  // none for both consumers' shares at D = 192) the consumers add it from their registers.
  static constexpr bool STAGED = D <= 128;
  static constexpr int STAGES = D == 64 ? 3 : 2;
  static_assert(!STAGED || (DQ_PART<0> == share(0).qc && !ASYMMETRIC));
  struct Shared {
    st<T, BK, D> k;
    st<T, BK, DV> v;
    st<T, BQ, D> q[STAGES];
    st<T, BQ, DV> dout[STAGES];
    st<T, BK, BQ> ds[2];                        // dS^T of the last two steps (keys x queries)
    [[no_unique_address]] std::conditional_t<HALVES, st<T, BK, BQ>[2], Empty> p;  // P^T of the last two steps (HALVES)
    alignas(16) float stats[STAGES][2 * BQ];    // per query row: lse (log2 units, +inf past q_len), delta
    int2 step[STAGES];  // (SEG) the step's query head g, and its query block i shifted left by MASK_BITS
                        // and the block's mask bits (tile_mask_bits)
    alignas(128) float dq[CONSUMERS][STAGED ? BQ * share(0).qc : 4];  // each consumer's dQ_i, fragment order
    // Rings (ring.cuh): the steps' Q, dO and statistics (full, empty); each consumer's dQ tile, one
    // slot (dq_full[c], dq_empty[c]). kv_full and kv_out complete once: K and V loaded, dK and dV
    // written to their tiles.
    semaphore kv_full, full[STAGES], empty[STAGES], dq_full[CONSUMERS], dq_empty[CONSUMERS], kv_out;
  };
  struct Args {
    Params p;
    tma_map<T, BQ> q, dout;
    tma_map<T, BK> k, v, dk, dv;  // (dK and dV go out from the shared tiles of K and V)
    int order_pairs;  // see block_coords
  };
  static constexpr size_t smem = sizeof(Shared) + 1024;  // + room to align the base to 1024
  // After Shared, with a bias at D <= 128, each consumer warp's scratch tile (see ColBias; at D = 256
  // there is no room: the bias goes pair by pair there), then the block list.
  static constexpr bool STAGE_BIAS = D <= 128;
  __host__ __device__ static size_t bias_bytes(const Params &p) { return STAGE_BIAS && p.bias ? CONSUMERS * 4 * BIAS_SCRATCH : 0; }
  // The workspace holds, per (batch, head, query block), a 64 x D dQ_i tile in fragment order (see
  // warpgroup::reduce_add_fragments; its columns from c on start at float BQ * c).
  __host__ __device__ static size_t dq_tile(const Params &p, int b, int h, int i) {
    return ((size_t(b) * p.q_heads + h) * ((p.q_len + BQ - 1) / BQ) + i) * (BQ * D);
  }
  // After the tiles: the stats rows (as in Shared::stats) of query block i, then the locks.
  __host__ __device__ static size_t stats(const Params &p, int b, int h, int i) {
    return dq_tile(p, p.batch, 0, 0) + ((size_t(b) * p.q_heads + h) * ((p.q_len + BQ - 1) / BQ) + i) * 2 * BQ;
  }
};

constexpr int BWD_BQ = 64;  // query rows per step of the main kernel and per lock of the workspace

// The per-pair tests of query block i and key block j (of BK keys) of batch entry b for the query
// heads of key/value head kvh, which one block of the kernel visits together: `meet` if some pair may
// be visible to some head; `one` from the segment ids alone (the mask's part differs between heads:
// the producer works it out for each step).
template <bool FULL, bool DENSE> __device__ __forceinline__ SegmentTest group_test(const Params &p, int b, int kvh, int i, int j, int BK) {
  SegmentTest x = segment_test<FULL>(p, b, i * BWD_BQ, BWD_BQ, j * BK, BK);
  if (DENSE && p.mask_blocks) {
    const int group = p.q_heads / p.kv_heads, heads = p.mask_heads > 1 ? group : 1;
    bool any = false;
    for (int g = 0; g < heads && !any; g++) any = mask_code<FULL, DENSE>(p, b, kvh * group + g, i * BWD_BQ, j * BK) != MASK_EMPTY;
    x.meet = x.meet && any;
  }
  return x;
}
// Does key block j (of BK keys) contribute to query block i of batch entry b (for the heads of kvh)?
template <bool FULL, bool DENSE> __device__ __forceinline__ bool sees(const Params &p, int b, int kvh, int i, int j, int BK) {
  int2 r = kv_block_range<FULL>(p, b, i * BWD_BQ, BWD_BQ, BK);
  return j >= r.x && j < r.y && group_test<FULL, DENSE>(p, b, kvh, i, j, BK).meet;
}
// The order in which the blocks (key block j of key/value head kvh of batch entry b) are launched:
// key block by key block within groups of `pairs` (batch entry, head) pairs, group after group. With
// a causal mask or packed sequences the first key blocks see the most query blocks, so each group
// starts with its longest blocks and the last wave ends with short ones (modelled: a tail of 1.4%
// instead of 6.3% at causal T = 2k with 8 pairs). The blocks running together read
// the Q and dO of a whole group, so a group is kept below ORDER_BYTES of them (L2; at D = 128: 7 pairs
// at T = 2k, 3 at 4k, one from 8k; 8 pairs at T = 16k measured 1-4% slower; key block by key block
// over all heads measured 40% slower at T = 2k). Within a (batch entry, head), key block j' < j
// comes first, as the deterministic mode's turns need. The pairs go batch entry after batch entry,
// or with a bias shared by the batch entries head after head (batch_inner). With
// Params::block_order (segment ids, not deterministic): its order.
constexpr size_t ORDER_BYTES = size_t(8) << 20;
constexpr int ORDER_MAX_PAIRS = 8;
inline int order_pairs(const Params &p) {
  const size_t per_pair = size_t(p.q_heads / p.kv_heads) * p.q_len * p.head_dim * 4 + 1;  // Q and dO, 2 bytes each
  const size_t n = ORDER_BYTES / per_pair;
  return n < 1 ? 1 : n > ORDER_MAX_PAIRS ? ORDER_MAX_PAIRS : int(n);
}
template <bool FULL>
__device__ __forceinline__ int3 block_coords(const Params &p, int pairs, int t, int kblocks) {  // {b, kvh, j}
  if (FULL && p.block_order) {
    const int e = p.block_order[t], pair = e / kblocks;
    return {pair / p.kv_heads, pair % p.kv_heads, e % kblocks};
  }
  const int first = t / (pairs * kblocks) * pairs;  // the group's first pair
  const int size = min(pairs, p.batch * p.kv_heads - first), r = t - first * kblocks;
  const int pair = first + r % size;
  if (batch_inner<FULL>(p)) return {pair % p.batch, pair / p.batch, r / size};
  return {pair / p.kv_heads, pair % p.kv_heads, r / size};
}

// How many key blocks before j contribute to query block i (the deterministic order's turn).
template <bool FULL, bool DENSE> __device__ __forceinline__ int blocks_before(const Params &p, int b, int kvh, int i, int j, int BK) {
  int n = 0;
  for (int jj = kv_block_range<FULL>(p, b, i * BWD_BQ, BWD_BQ, BK).x; jj < j; jj++) n += sees<FULL, DENSE>(p, b, kvh, i, jj, BK);
  return n;
}

// P^T from S^T (rows: keys kw.., columns: queries q0..) and the columns' lse (log2 units).
// (BIAS: bias, the bias^T of these rows and columns, as a register tile or chunks put in place
// through the warp's scratch.)
template <bool FULL, bool DENSE, bool CAP, bool BIAS, typename RT, typename V, typename BT>
__device__ __forceinline__ void probabilities(RT &s, const Params &p, const KeyRule &rule, MaskNeed need, int b, int h,
                                              int q0, int kw, const V &lse, const BT &bias, void *scratch) {
  cap_logits<CAP, DENSE>(s, p);  // in units of 1 / c (logit_factor)
  if constexpr (BIAS) {
    if constexpr (RegisterTile<BT>) add_bias(s, bias);
    else add_bias(s, bias, scratch);
  }
  const float c = logit_factor<CAP, DENSE>(p);
  // Masked entries -inf, then exp2(-inf) = 0. (One exp2 map after the conditional mask: two maps in
  // the two branches would make ptxas serialize the wgmmas, C7520.)
  mask_logits_transposed<FULL, DENSE>(s, p, rule, need, b, h, kw, q0);
  warp::map_col(s, s, lse, [=](float x, float l) { return warp::fn::exp2(x * c - l); });
}

// With a soft cap: P^T := d(capped logit) / d(scaled logit) = 1 - tanh^2 = 1 - (capped / cap)^2,
// the capped logit recovered from P = exp2(capped log2 e - lse) (no register tile to keep it in). An
// entry with P = 0 gets 0 (its dS is 0 anyway; this also turns -inf and NaN into 0).
template <typename RT> __device__ __forceinline__ void softcap_derivative(RT &pt, const Params &p, const float *lse) {
  const float inv = 1.f / (p.softcap * LOG2E);
  warp::map_indexed(pt, pt, [&](int, int col, float x) {
    const float t = (warp::fn::log2(x) + lse[col]) * inv;
    return fmaxf(1.f - t * t, 0.f);
  });
}

__device__ __forceinline__ int load_acquire(const int *x) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(x) : "memory");
  return v;
}

// The block's share of the work (key block j of key/value head kvh of batch entry b), worked out by
// every thread before the roles split.
struct BwdBlock {
  int b, kvh, j;
  int2 qr;            // the query blocks that see these keys: with segment ids those listed (see
  BlockList qblocks;  // BlockList); without, every block of the range sees some of them
  KeyRule rule;
  int group;          // query heads per key/value head
  int n_steps;        // the (query head, query block) pairs visited: for each head g, the listed i
  int *locks;         // the deterministic turns' locks (see BwdH::stats)
};

// The masked kernels (FULL) come in four: SEG and CAP say whether per-pair tests (segment ids, a
// boolean mask) and a soft cap may be given (otherwise they are known to be absent): windows and
// lengths alone (neither), per-pair tests without a cap (SEG), and any options with a cap (both);
// DET, the deterministic mode (any options:
// SEG and CAP). Leaving out the code of the segment test and of the cap takes branches out of the
// loop (the window rows ran 10% faster without them and without the block list), and leaving out the
// deterministic turns' code keeps ptxas from spilling in the loop (14-18 LDL/STL per step). The plain
// kernel (FULL = false) tests Params::deterministic at run time: DET does not apply to it (with the
// turns' code compiled out it spilled instead, and ran 2-4% slower). DENSE: the code of the dense
// operands, the boolean mask and the bias (see dispatch), in the kernels for any options only; BIAS
// (with DENSE, when a bias is given): the bias's code, whose registers a mask alone should not pay
// for (they made the mask's backward up to 40% slower).
//
// The parts of the kernel below: static functions of the block's share (BwdBlock, by value), each
// forming its views of shared memory in place. Written as member functions reading the fields of the
// kernel's object, ptxas grew the dense-mask kernel's main loop by 4%; with the steps' ring returned
// by a function, it spilled in the plain kernel's.
template <typename T, int D, bool FULL, bool SEG, bool CAP, bool DET, bool DENSE, bool BIAS> struct BwdParts {
  using C = BwdH<T, D>;
  using Args = typename C::Args;
  using Shared = typename C::Shared;
  static constexpr int BK = C::BK, BQ = C::BQ, STAGES = C::STAGES, CONSUMERS = C::CONSUMERS;
  static_assert(BQ == BWD_BQ);
  // At D <= 128 the warpgroup and the ring slots are made known to be warp-uniform (warp_uniform),
  // so that the wgmma descriptors stay in uniform registers instead of being worked out per thread
  // and moved there before each wgmma. (At D = 256 it cost more in spills than it saved.)
  __device__ __forceinline__ static int known_uniform(int x) { return D <= 128 ? warp_uniform(x) : x; }
  // Both consumers wait for each other (named barrier 1). Where their shares differ they run code of
  // their own (consume<W>), so the barrier is reached at two instructions.
  __device__ __forceinline__ static void sync_consumers() {
    if constexpr (C::ASYMMETRIC) sync_named_unaligned(1, 128 * CONSUMERS);
    else sync_named(1, 128 * CONSUMERS);
  }
  // The deterministic mode's turns: read where they are tested (a flag kept in a register across the
  // loop changed the plain kernel's schedule and cost it 2%).
  __device__ __forceinline__ static bool det(const Params &p) { return FULL ? DET : p.deterministic; }
  // The rings (ring.cuh): the steps' Q, dO and statistics, `ring<STAGES> steps{sm.full, sm.empty}`
  // (formed in place, see above); each consumer's dQ tile.
  __device__ __forceinline__ static ring<1> dq_ring(Shared &sm, int c) { return {&sm.dq_full[c], &sm.dq_empty[c]}; }
  // The deterministic turns' lock of (batch entry x.b, query head h, query block i of n_qblocks).
  __device__ __forceinline__ static int *lock(const Params &p, const BwdBlock &x, int h, int i, int n_qblocks) {
    return x.locks + (size_t(x.b) * p.q_heads + h) * n_qblocks + i;
  }
  // The next step: the next listed query block, or the first of the next query head.
  __device__ __forceinline__ static void advance(const BwdBlock &x, int &g, int &i) {
    if ((i = x.qblocks.next(i + 1)) >= x.qr.y) {
      i = x.qblocks.next(x.qr.x);
      g++;
    }
  }
  __device__ __forceinline__ static BwdBlock block(const Args &a, Shared &sm) {
    const Params &p = a.p;
    const int3 at = block_coords<FULL>(p, a.order_pairs, blockIdx.x, (p.kv_len + BK - 1) / BK);
    const int b = at.x, kvh = at.y, j = at.z;
    const int2 qr = q_block_range<FULL>(p, b, j * BK, BK, BQ);
    const BlockList qblocks = list_blocks(reinterpret_cast<uint32_t *>(bias_scratch(sm) + C::bias_bytes(p)), qr.x, qr.y, SEG, [&](int i) {
      const int2 r = kv_block_range<FULL>(p, b, i * BQ, BQ, BK);
      const SegmentTest x = group_test<FULL, DENSE>(p, b, kvh, i, j, BK);
      return SegmentTest{x.meet && j >= r.x && j < r.y, x.one};  // (takes part: sees)
    });
    const int group = p.q_heads / p.kv_heads;
    int *const locks = reinterpret_cast<int *>(p.workspace + C::stats(p, p.batch, 0, 0));
    return {b, kvh, j, qr, qblocks, key_rule<FULL>(p, b), group, qblocks.count() * group, locks};
  }
  __device__ __forceinline__ static char *bias_scratch(Shared &sm) { return reinterpret_cast<char *>(&sm + 1); }

  __device__ __forceinline__ static void init(Shared &sm) {
    tk::init(sm.kv_full, 1);
    tk::init(sm.kv_out, CONSUMERS * 128);  // one arrival per consumer thread: dK and dV are in shared memory
    tk::init(ring<STAGES>{sm.full, sm.empty}, 32, CONSUMERS * 128);  // full: each lane of the producer warp; empty: each consumer thread
    for (int c = 0; c < CONSUMERS; c++) tk::init(dq_ring(sm, c), 128, 1);  // full: each thread of consumer c; empty: the writer
  }

  // The dQ writer (one thread): adds each consumer's dQ tile to the accumulator in global memory.
  __device__ __forceinline__ static void write_dq(const Params &p, Shared &sm, const BwdBlock x) {
    static_assert(CONSUMERS == 2);
    for (int it = 0, g = 0, i = x.qblocks.next(x.qr.x); it < x.n_steps; it++, advance(x, g, i)) {
      const int h = x.kvh * x.group + g;
      for (int c = 0; c < CONSUMERS; c++) {  // (deterministic: the consumers have waited for the turn)
        wait_full(dq_ring(sm, c), it);
        reduce_add_async(p.workspace + C::dq_tile(p, x.b, h, i) + BQ * C::share(c).q0, sm.dq[c], sizeof(sm.dq[c]));
        bulk_commit();
      }
      bulk_wait_read<1>();  // consumer 0's tile is read: it may store the next one
      arrive_empty(dq_ring(sm, 0), it);
      bulk_wait_read<0>();
      arrive_empty(dq_ring(sm, 1), it);
      if (det(p)) {  // the additions are done: hand the turn on
        bulk_wait<0>();
        __threadfence();
        atomicAdd(lock(p, x, h, i, (p.q_len + BQ - 1) / BQ), CONSUMERS);
      }
    }
    bulk_wait<0>();  // the copy engine has finished with shared memory
  }

  // The loader warp: K and V once, each step's Q, dO and statistics, and at the end dK and dV.
  __device__ __forceinline__ static void load(const Args &a, Shared &sm, const BwdBlock x) {
    const Params &p = a.p;
    const int k0 = x.j * BK;
    const bool loader = laneid() == 0;
    const ring<STAGES> steps{sm.full, sm.empty};
    if (loader && x.n_steps > 0) {
      arrive_expect_bytes(sm.kv_full, sizeof(sm.k.data) + sizeof(sm.v.data));
      load_async(sm.k, a.k, {x.b, k0, x.kvh, 0}, sm.kv_full);
      load_async(sm.v, a.v, {x.b, k0, x.kvh, 0}, sm.kv_full);
    }
    for (int it = 0, g = 0, i = x.qblocks.next(x.qr.x); it < x.n_steps; it++, advance(x, g, i)) {  // the consumers' steps
      const int h = x.kvh * x.group + g;
      const ring_use<STAGES> at(it);
      const int s = at.slot;
      wait_empty(steps, at);
      if (loader) {
        if constexpr (SEG) {  // for the consumers (see next_step); the mask's block is this head's own
          const bool uniform = x.qblocks.uniform(i) && mask_code<FULL, DENSE>(p, x.b, h, i * BQ, k0) == MASK_FULL;
          sm.step[s] = {g, i << MASK_BITS | tile_mask_bits<FULL, DENSE>(p, x.rule, uniform, i * BQ, BQ, k0, BK)};
        }
        expect_bytes(steps.full(at), sizeof(sm.q[s].data) + sizeof(sm.dout[s].data));
        load_async(sm.q[s], a.q, {x.b, i * BQ, h, 0}, steps.full(at));
        load_async(sm.dout[s], a.dout, {x.b, i * BQ, h, 0}, steps.full(at));
      }
      // The rows' statistics: 128 floats, one float4 per lane, each lane's stores released by its own
      // arrival (so that every write and read is ordered by a release and an acquire of its own thread).
      reinterpret_cast<float4 *>(sm.stats[s])[laneid()] = reinterpret_cast<const float4 *>(p.workspace + C::stats(p, x.b, h, i))[laneid()];
      arrive_full(steps, at);
    }
    if (loader) {  // dK and dV, once the consumers have put them in the tiles of K and V
      wait_once(sm.kv_out);
      store_async(a.dk, sm.k, {x.b, k0, x.kvh, 0});
      store_async(a.dv, sm.v, {x.b, k0, x.kvh, 0});
      bulk_commit();
      bulk_wait_read<0>();  // (the writes are done by the kernel's end)
    }
  }

  // With a block list (whose next() is a loop) the consumers take the next step's (g, i) from the
  // producer, in its slot (whose full barrier they have passed in issue_logits), and each step's mask
  // bits there: ptxas keeps the wgmmas in flight across one back edge, not across nested loops (C7514).
  __device__ __forceinline__ static void next_step(Shared &sm, const BwdBlock &x, int it, int &g, int &i) {
    if constexpr (SEG) {
      const int2 y = sm.step[ring_use<STAGES>(it).slot];
      g = y.x;
      i = y.y >> MASK_BITS;
    } else {
      advance(x, g, i);
    }
  }

  template <int W> __device__ __forceinline__ static void consume(const Args &a, Shared &sm, const BwdBlock x, int wg);
  template <typename RK, typename RV>
  __device__ __forceinline__ static void store_dkv(Shared &sm, RK &dk, RV &dv, float scale, int row, int k_col, int v_col);
};

// consumers: warpgroup wg owns keys k0 + row0 .. + 64 (this warp 16 of them from kw) and its share of
// the columns of their dK and dV and of dQ_i (BwdH::share; the shapes of consumer W's, which is wg's
// where the shares differ)
template <typename T, int D, bool FULL, bool SEG, bool CAP, bool DET, bool DENSE, bool BIAS>
template <int W>
__device__ __forceinline__ void BwdParts<T, D, FULL, SEG, CAP, DET, DENSE, BIAS>::consume(const Args &a, Shared &sm, const BwdBlock x, const int wg) {
  const Params &p = a.p;
  const int b = x.b, kvh = x.kvh, j = x.j, k0 = j * BK, n_steps = x.n_steps, group = x.group;
  const KeyRule &rule = x.rule;
  const int n_qblocks = (p.q_len + BQ - 1) / BQ;
  const ring<STAGES> steps{sm.full, sm.empty};
  constexpr typename C::Share cols = C::share(W);
  const typename C::Share at = C::ASYMMETRIC ? cols : C::share(wg);
  const int row0 = 64 * (wg / C::SPLIT);
  const int kw = k0 + row0 + 16 * (warpid() % 4);
  const int qh = C::HALVES ? C::SQ * W : 0;  // the first query column of this consumer's S^T and dP^T
  const bool writes_ds = C::HALVES || wg % C::SPLIT == 0;  // (without HALVES: one of those sharing the keys)
  const auto k_rows = window<64, D>(sm.k, row0, 0);
  const auto v_rows = window<64, C::DV>(sm.v, row0, 0);
  const bool leader = threadIdx.x % 128 == 0;
  rt_fl<16, cols.kc> dk;
  rt_fl<16, cols.vc> dv;
  rt_fl<16, C::SQ> s, dp;  // S^T (then P^T), dP^T (then dS^T) of the current step
  warp::zero(dk);
  warp::zero(dv);
  // S^T = K Q^T of the next step is issued before this step's dQ goes out. After the last step it
  // is issued all the same, on the other slot's stale tiles, and ignored: a wgmma under a branch
  // would make ptxas serialize them all (C7518).
  auto issue_logits = [&](int step) {
    const int slot = known_uniform(ring_use<STAGES>(step).slot);
    if (step < n_steps) wait_full(steps, step);
    warpgroup::mma_ABt(s, k_rows, window<C::SQ, D>(sm.q[slot], qh, 0), false);
  };
  // The bias^T of a step (BIAS), loaded as its S^T is issued (at the end of the step before), so
  // that the loads land while the dQ product and additions run.
  std::conditional_t<C::STAGE_BIAS, ColBias<T>, rt<T, 16, C::SQ>> bias;
  void *const scratch = bias_scratch(sm) + BIAS_SCRATCH * (4 * wg + warpid() % 4);
  auto load_step_bias = [&](int step, int g, int i) {
    if (BIAS && step < n_steps) {
      if constexpr (C::STAGE_BIAS) load_bias(bias, p, b, kvh * group + g, i * BQ, kw);
      else load_bias<T, true>(bias, p, b, kvh * group + g, i * BQ + qh, kw);
    }
  };
  if (n_steps > 0) {
    wait_once(sm.kv_full);
    issue_logits(0);
  }

  // wgmma groups in flight are listed in [brackets]; they complete in order. One loop over the steps
  // (query head g, query block i; see next_step).
  load_step_bias(0, 0, x.qblocks.next(x.qr.x));
  for (int it = 0, g = 0, i = x.qblocks.next(x.qr.x); it < n_steps; it++, next_step(sm, x, it, g, i)) {
    const int h = kvh * group + g;
    const int q0 = i * BQ, slot = known_uniform(ring_use<STAGES>(it).slot);
    auto &ds_tile = sm.ds[known_uniform(buffer_of<2>(it))];
    rt<T, 16, C::SQ> p16, ds16;  // P^T and dS^T in the input dtype
    row_vec<rt_fl<16, C::SQ>> lse, delta;
    const float *stats = sm.stats[slot] + qh;
    // The columns' lse, from shared memory before the dP product's reads of it queue ahead; with SEG
    // after the step's mask bits are decoded (loaded before them, the bits' first use waited for them).
    if constexpr (!SEG) warp::load(lse, stats, C::SQ);
    // The step's masks: with SEG from the producer's bits, loaded before the wait and decoded after
    // the dP product's issue (decoded before it, the branch waited for the load).
    const int mask_bits = SEG ? sm.step[slot].y : 0;
    warpgroup::wait<0>();  // S^T is ready (issued at the end of the last step)
    warpgroup::fence_registers(s);
    warpgroup::mma_ABt(dp, v_rows, window<C::SQ, C::DV>(sm.dout[slot], qh, 0), false);  // dP^T = V dO^T   [dP]
    const int qc = q0 + qh;  // (the query columns of s and dp)
    const MaskNeed need = SEG ? warp_mask_need(mask_bits, rule, qc, C::SQ, kw, 16) : mask_need<FULL, DENSE>(p, rule, true, qc, C::SQ, kw, 16);
    if constexpr (SEG) warp::load(lse, stats, C::SQ);
    probabilities<FULL, DENSE, CAP, BIAS>(s, p, rule, need, b, h, qc, kw, lse, bias, scratch);
    warp::copy(p16, s);
    warp::load(delta, stats + BQ, C::SQ);  // (before the dV product's shared-memory reads queue ahead of it)
    if constexpr (C::HALVES) warp::store(sm.p[buffer_of<2>(it)], p16, kw - k0, qh);  // (dV takes both halves)
    else warpgroup::mma_AB(dv, p16, window<BQ, cols.vc>(sm.dout[slot], 0, at.v0), true);  // dV += P^T dO   [dP, dV]
    warpgroup::wait<C::HALVES ? 0 : 1>();  // dP^T is ready
    warpgroup::fence_registers(dp);
    warp::map_col(dp, dp, delta, [](float x, float d) { return x - d; });
    warp::mul(dp, dp, s);  // dS^T = P^T (dP^T - delta)
    if (!C::STAGE_BIAS && BIAS && writes_ds) store_dbias<T, true>(dp, p, b, h, qc, kw);  // (no soft cap with a bias)
    if (CAP && p.softcap > 0.f) {  // w.r.t. the logits before the cap
      softcap_derivative(s, p, stats);
      warp::mul(dp, dp, s);
    }
    if (writes_ds) {
      warp::copy(ds16, dp);
      warp::store(ds_tile, ds16, kw - k0, qh);
    }
    // dK needs only this warpgroup's rows of dS^T: where it computed them itself (SPLIT = 1) it
    // takes them from its registers, at once; dQ needs all of them, from shared memory.
    const auto q_cols = window<BQ, cols.kc>(sm.q[slot], 0, at.k0);
    if constexpr (C::SPLIT == 1) warpgroup::mma_AB(dk, ds16, q_cols, true);  // dK += dS^T Q  [dV, dK]
    if (writes_ds) warpgroup::fence_shared_writes();
    sync_consumers();  // all of dS^T (and with HALVES of P^T) is in shared memory
    if constexpr (C::HALVES)  // dV += P^T dO   [dV]
      warpgroup::mma_AB(dv, window<64, BQ>(sm.p[buffer_of<2>(it)], row0, 0), window<BQ, cols.vc>(sm.dout[slot], 0, at.v0), true);
    if constexpr (C::SPLIT == 2) warpgroup::mma_AB(dk, window<64, BQ>(ds_tile, row0, 0), q_cols, true);
    if (C::STAGE_BIAS && BIAS) store_dbias<T>(ds16, p, b, h, q0, kw, scratch);  // (while dK is computed)
    // This warpgroup's columns of dQ_i = dS K, added to the accumulator tile in global memory: by the
    // writer warp from shared memory (STAGED), or from the registers. With Params::deterministic the
    // warpgroup first waits for its turn (the key blocks before this one); the turn is handed on once
    // the additions are done.
    int *const lock = BwdParts::lock(p, x, h, i, n_qblocks);
    const auto wait_for_turn = [&] {
      if (leader)
        while (load_acquire(lock) < CONSUMERS * blocks_before<FULL, DENSE>(p, b, kvh, i, j, BK)) __nanosleep(32);
    };
    constexpr int DQ_PART = C::template DQ_PART<W>, DQ_PARTS = cols.qc / DQ_PART;
    float *dq_tile = p.workspace + C::dq_tile(p, b, h, i) + BQ * at.q0;
#pragma unroll
    for (int part = 0; part < DQ_PARTS; part++) {
      rt_fl<16, DQ_PART> dq;
      warpgroup::mma_AtB(dq, ds_tile, window<BK, DQ_PART>(sm.k, 0, at.q0 + DQ_PART * part), false);  // [dV, dK, dQ]
      if (part == DQ_PARTS - 1) {
        // (With dK's operand in registers, S^T's accumulators wait for it: both held, ptxas would
        // serialize the wgmmas for want of registers, C7512.)
        if constexpr (C::SPLIT == 1) warpgroup::wait<1>();  // [dQ]
        issue_logits(it + 1);  // [dQ, S'] (SPLIT = 2: [dV, dK, dQ, S'])
        if constexpr (BIAS) {
          int g1 = g, i1 = i;
          next_step(sm, x, it + 1, g1, i1);
          load_step_bias(it + 1, g1, i1);
        }
        warpgroup::wait<1>();  // [S']
      } else {
        warpgroup::wait<0>();
      }
      warpgroup::fence_registers(dq);
      if (part == 0) arrive_empty(steps, it);  // this thread is done with the slot (Q, dO and the statistics)
      if constexpr (C::STAGED) {  // (one part)
        if (det(p)) wait_for_turn();  // the writer adds once all threads have arrived
        wait_empty(dq_ring(sm, wg), it);  // the writer has read the last step's tile
        warpgroup::store_fragments(sm.dq[wg], dq);
        warpgroup::fence_shared_writes();
        arrive_full(dq_ring(sm, wg), it);
      } else {
        if (part == 0 && det(p)) {
          wait_for_turn();
          sync_named(2 + wg, 128);
        }
        warpgroup::reduce_add_fragments(dq_tile + part * BQ * DQ_PART, dq);
      }
    }
    if (!C::STAGED && det(p)) {
      __threadfence();  // this thread's additions are done before the turn moves on
      sync_named(2 + wg, 128);
      if (leader) {
        __threadfence();
        atomicAdd(lock, 1);
      }
    }
  }
  warpgroup::wait<0>();  // the extra S^T
  store_dkv(sm, dk, dv, p.scale, kw - k0, at.k0, at.v0);
}

// dK and dV are read only here, after the last wait (fencing them in the loop makes ptxas serialize
// the wgmmas). They go out through the shared tiles of K and V, free once both consumers are done
// with them (the dQ product reads all keys), by the loader's TMA stores: stored from the registers
// pair by pair (half-filled sectors), they took 6-7 us of every block's life (a timeline of the
// blocks at B = 8, T = 2k), about 3 steps' time.
template <typename T, int D, bool FULL, bool SEG, bool CAP, bool DET, bool DENSE, bool BIAS>
template <typename RK, typename RV>
__device__ __forceinline__ void BwdParts<T, D, FULL, SEG, CAP, DET, DENSE, BIAS>::store_dkv(Shared &sm, RK &dk, RV &dv, float scale, int row,
                                                                                          int k_col, int v_col) {
  warpgroup::fence_registers(dk);
  warpgroup::fence_registers(dv);
  warp::mul(dk, dk, scale);
  sync_consumers();
  warp::store(sm.k, dk, row, k_col);
  warp::store(sm.v, dv, row, v_col);
  warpgroup::fence_shared_writes();
  arrive(sm.kv_out);
}

// One block per key block (pipeline/kernel.cuh: single) of the parts above.
template <typename T, int D, bool FULL, bool SEG, bool CAP, bool DET, bool DENSE, bool BIAS> struct BwdSm90 {
  using Parts = BwdParts<T, D, FULL, SEG, CAP, DET, DENSE, BIAS>;
  using Roles = typename BwdH<T, D>::Roles;
  const typename Parts::Args &a;
  typename Parts::Shared &sm;
  const BwdBlock x;
  const int wg;
  __device__ __forceinline__ void init() const { Parts::init(sm); }
  __device__ __forceinline__ void before_sync() const {}
  __device__ __forceinline__ void produce() const {
    // (Its warps by block warp number: Roles::warp(), warpid() % 4, compiles to other producer code.)
    if (BwdH<T, D>::STAGED && warpid() == Parts::CONSUMERS * 4 + 1 && laneid() == 0) Parts::write_dq(a.p, sm, x);
    if (warpid() == Parts::CONSUMERS * 4) Parts::load(a, sm, x);
  }
  __device__ __forceinline__ void consume() const {
    if constexpr (BwdH<T, D>::ASYMMETRIC) {
      if (wg == 0) Parts::template consume<0>(a, sm, x, wg);
      else Parts::template consume<1>(a, sm, x, wg);
    } else {
      Parts::template consume<0>(a, sm, x, wg);
    }
  }
};
template <typename T, int D, bool FULL, bool SEG, bool CAP, bool DET, bool DENSE, bool BIAS>
__global__ __launch_bounds__(BwdH<T, D>::THREADS, 1) void bwd_sm90_kernel(const __grid_constant__ typename BwdH<T, D>::Args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using K = BwdSm90<T, D, FULL, SEG, CAP, DET, DENSE, BIAS>;
  extern __shared__ char smem_raw[];
  auto &sm = align_shared<typename BwdH<T, D>::Shared>(smem_raw);
  const BwdBlock x = K::Parts::block(a, sm);
  K k{a, sm, x, K::Parts::known_uniform(warpgroup::groupid())};
  single(k);
#endif
}

// delta = rowsum(dO * O) - dlse per query row (DV / 8 lanes per row, 16 bytes of O and of dO per
// lane), the stats rows of the main kernel (lse in log2 units and delta per 64-row query block; +inf
// and 0 past q_len) and cleared dq tiles and locks.
template <int D> constexpr int PREP_LANES = D / 8;                       // lanes per row
template <int D> constexpr int PREP_ROWS = 8 * (32 / PREP_LANES<D>);  // rows per block of 256 threads
template <typename T, int D> __global__ __launch_bounds__(256) void bwd_prep_kernel(const __grid_constant__ Params p) {
  using C = BwdH<T, D>;
  constexpr int DV = C::DV, LANES = PREP_LANES<DV>;
  static_assert(LANES <= 32 && 32 % LANES == 0);
  const size_t n_stats = C::stats(p, p.batch, 0, 0) - C::stats(p, 0, 0, 0);
  const size_t tiles = C::stats(p, 0, 0, 0), locks = n_stats / (2 * C::BQ);
  const size_t stride = size_t(gridDim.x) * blockDim.x, tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (size_t e = tid; e < tiles / 4; e += stride) reinterpret_cast<float4 *>(p.workspace)[e] = float4{0.f, 0.f, 0.f, 0.f};
  for (size_t e = tid; e < locks; e += stride) p.workspace[tiles + n_stats + e] = 0.f;
  const int padded = (p.q_len + C::BQ - 1) / C::BQ * C::BQ;
  for (size_t e = tid; e < n_stats / 2; e += stride) {  // the rows past q_len
    const int t = int(e % padded);
    const size_t bh = e / padded;
    if (t >= p.q_len) {
      float *row = p.workspace + C::stats(p, 0, 0, 0) + bh * 2 * padded + t / C::BQ * 2 * C::BQ + t % C::BQ;
      row[0] = -NEG_INF;  // P = 0
      row[C::BQ] = 0.f;
    }
  }

  // Rows in [b, h, t] order: the statistics (lse, dlse, delta and the stats rows) are read and written
  // in runs of consecutive rows; each row of O and dO is DV * 2 contiguous bytes.
  const size_t rows = size_t(p.batch) * p.q_len * p.q_heads;
  const size_t row = size_t(blockIdx.x) * PREP_ROWS<DV> + threadIdx.x / LANES;
  const bool valid = row < rows;  // (every lane takes part in the shuffles)
  const int t = int(row % p.q_len), h = int(row / p.q_len % p.q_heads), b = int(row / (size_t(p.q_heads) * p.q_len));
  float acc = 0.f;
  if (valid) {
    const size_t at = ((size_t(b) * p.q_len + t) * p.q_heads + h) * DV + threadIdx.x % LANES * 8;
    const uint4 x = *reinterpret_cast<const uint4 *>(static_cast<const T *>(p.o) + at);
    const uint4 y = *reinterpret_cast<const uint4 *>(static_cast<const T *>(p.dout) + at);
    for (int k = 0; k < 4; k++) {
      const float2 o = to_float2(reinterpret_cast<const packed<T> *>(&x)[k]), d = to_float2(reinterpret_cast<const packed<T> *>(&y)[k]);
      acc += o.x * d.x + o.y * d.y;
    }
  }
  for (int off = LANES / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (valid && threadIdx.x % LANES == 0) {
    const float delta = acc - p.dlse[row];
    p.delta[row] = delta;
    float *stats = p.workspace + C::stats(p, b, h, t / C::BQ) + t % C::BQ;
    stats[0] = lse_to_log2(p.lse[row]);  // a row that sees no key: +inf, so that P = 0
    stats[C::BQ] = delta;
  }
}

// dq = scale * accumulator, in the input dtype: one block per 64 columns of an accumulator tile (BQ
// rows, in the order of BwdH::dq_tile), read in fragment order (each load instruction of a warp reads
// 512 consecutive bytes), turned into rows in shared memory and written 16 bytes per thread.
constexpr int DQ_OUT_COLS = 64;
template <typename T, int D> __global__ __launch_bounds__(128) void bwd_dq_kernel(const __grid_constant__ Params p) {
  using C = BwdH<T, D>;
  constexpr int ROWS = C::BQ, COLS = DQ_OUT_COLS, PITCH = COLS + 8;  // (+ 8: conflict-free float2 stores)
  static_assert(ROWS == 64 && D % COLS == 0);
  __shared__ alignas(16) float tile[ROWS * PITCH];
  const int t = threadIdx.x, n_qblocks = (p.q_len + ROWS - 1) / ROWS;
  const int c = int(blockIdx.x % (D / COLS)), i = int(blockIdx.x / (D / COLS) % n_qblocks);
  const int bh = int(blockIdx.x / ((D / COLS) * n_qblocks)), h = bh % p.q_heads, b = bh / p.q_heads;
  const auto *src = reinterpret_cast<const float4 *>(p.workspace + C::dq_tile(p, b, h, i) + ROWS * COLS * c);
#pragma unroll
  for (int q = 0; q < ROWS * COLS / 512; q++) {
    const float4 v = src[q * 128 + t];
    const auto [r, col] = warpgroup::fragment_coords(q, t);
    *reinterpret_cast<float2 *>(tile + r * PITCH + col) = float2{v.x * p.scale, v.y * p.scale};
    *reinterpret_cast<float2 *>(tile + (r + 8) * PITCH + col) = float2{v.z * p.scale, v.w * p.scale};
  }
  __syncthreads();
  for (int e = t; e < ROWS * COLS / 8; e += 128) {  // 8 columns of one row each
    const int r = e / (COLS / 8), col = e % (COLS / 8) * 8, row = i * ROWS + r;
    if (row >= p.q_len) continue;
    const float *x = tile + r * PITCH + col;
    struct alignas(16) {
      packed<T> v[4];
    } out;
    for (int k = 0; k < 4; k++) out.v[k] = from_float2<packed<T>>(float2{x[2 * k], x[2 * k + 1]});
    *reinterpret_cast<decltype(out) *>(static_cast<T *>(p.dq) + ((size_t(b) * p.q_len + row) * p.q_heads + h) * D +
                                       c * COLS + col) = out;
  }
}

}  // namespace

bool bwd_sm90_supported(const Params &p) { return has_kernel_dims(p.head_dim, p.v_head_dim) && p.workspace != nullptr; }

cudaError_t bwd_sm90(const Params &p, cudaStream_t stream) {
  auto launch = [&]<typename T, int D, bool FULL, bool DENSE>() {
    using C = BwdH<T, D>;
    const size_t rows = size_t(p.batch) * p.q_len * p.q_heads;
    bwd_prep_kernel<T, D><<<unsigned((rows + PREP_ROWS<C::DV> - 1) / PREP_ROWS<C::DV>), 256, 0, stream>>>(p);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;

    typename C::Args a{p, {}, {}, {}, {}, {}, {}, order_pairs(p)};
    if (!make_tma_map(a.q, p.q, p.batch, p.q_len, p.q_heads, D) ||
        !make_tma_map(a.dout, p.dout, p.batch, p.q_len, p.q_heads, C::DV) ||
        !make_tma_map(a.k, p.k, p.batch, p.kv_len, p.kv_heads, D) ||
        !make_tma_map(a.v, p.v, p.batch, p.kv_len, p.kv_heads, C::DV) ||
        !make_tma_map(a.dk, p.dk, p.batch, p.kv_len, p.kv_heads, D) ||
        !make_tma_map(a.dv, p.dv, p.batch, p.kv_len, p.kv_heads, C::DV))
      return cudaErrorInvalidValue;
    // The kernel's DET, CAP, SEG and DENSE (the deterministic masked kernel takes any options but the
    // dense operands; with a mask or a bias, the kernels for any options, deterministic or not).
    const bool det = FULL && p.deterministic, cap = det || DENSE || (FULL && p.softcap > 0.f);
    const bool seg = cap || (FULL && p.q_segment_ids);
    auto kernel = bwd_sm90_kernel<T, D, FULL, false, false, false, false, false>;
    if constexpr (DENSE)
      kernel = p.bias ? (det ? bwd_sm90_kernel<T, D, true, true, true, true, true, true> : bwd_sm90_kernel<T, D, true, true, true, false, true, true>)
                      : (det ? bwd_sm90_kernel<T, D, true, true, true, true, true, false> : bwd_sm90_kernel<T, D, true, true, true, false, true, false>);
    else if constexpr (FULL)
      kernel = det   ? bwd_sm90_kernel<T, D, true, true, true, true, false, false>
               : cap ? bwd_sm90_kernel<T, D, true, true, true, false, false, false>
               : seg ? bwd_sm90_kernel<T, D, true, true, false, false, false, false>
                     : kernel;
    const size_t smem = C::smem + C::bias_bytes(p) + (seg ? block_list_bytes((p.q_len + C::BQ - 1) / C::BQ) : 0);
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (e != cudaSuccess) return e;
    const long long blocks = (p.kv_len + C::BK - 1) / C::BK * (long long)p.kv_heads * p.batch;
    if (blocks >= INT_MAX) return cudaErrorInvalidValue;
    kernel<<<unsigned(blocks), C::THREADS, smem, stream>>>(a);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;

    const size_t tiles = size_t(p.batch) * p.q_heads * ((p.q_len + C::BQ - 1) / C::BQ) * (D / DQ_OUT_COLS);
    if (tiles >= INT_MAX) return cudaErrorInvalidValue;
    bwd_dq_kernel<T, D><<<unsigned(tiles), 128, 0, stream>>>(p);
    return cudaGetLastError();
  };
  if (p.v_head_dim != p.head_dim) return dispatch<MLA_HEAD_DIM_QK>(p, launch);  // (has_kernel_dims)
  return dispatch<64, 128, 256>(p, launch);
}

}  // namespace jax_tk::attention
