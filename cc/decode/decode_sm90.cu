// Decode attention on Hopper (sm_90a) for blocks of 128 query rows of one KV head (e.g. 8 query heads
// per KV head x 16 new tokens in speculative decoding). At 128 rows each key costs as many flops as a
// training forward's, and the tensor cores, not HBM, set the pace unless the softmax hides behind
// them; so this block is organized like a training forward (tk/pipeline):
//
// - A producer warpgroup loads key blocks (K and V, 128 keys; 64 at head dim 256) into a ring of
//   stages. A block of valid rows goes by TMA: one box of the cache, or boxes of 64 or 16 rows from the
//   pages of a paged cache, each found (one table read) and issued by a lane of its own. Any other
//   block (the last one of a sequence, whose rows past the length must be zeros; a page outside the
//   pool; pages of other sizes) is copied row by row with cp.async as decode.cu does it, each thread
//   arriving on the stage's semaphore when its copies land.
// - Two consumer warpgroups of 64 rows each multiply on wgmma, operands from shared memory. Each
//   issues S = Q K_j^T together with O += P_{j-1} V_{j-1} and runs the softmax of block j while they
//   are in flight, and the two take turns issuing (named barriers): one's softmax overlaps the
//   other's products. A stage is freed once both are done with its V.
// - The parts of a split sequence and the end of the block are the other kernel's (common.cuh).
#include "decode/common.cuh"

namespace jax_tk::decode {
namespace {

template <typename T, int D, int BOX_> struct Wide {
  using Roles = roles</*CONSUMERS=*/2, /*PRODUCER_REGS=*/72, /*CONSUMER_REGS=*/216>;
  static constexpr int TILES = 8, GROUPS = 1, ROWS = TILE_ROWS * TILES, THREADS = Roles::THREADS;
  static constexpr int KEYS = D <= 128 ? 128 : 64, BOX = BOX_;  // (BOX: rows of a TMA box, see Args)
  using Stage = KeyBlock<T, KEYS, D>;
  static constexpr int STAGES = (D <= 128 ? 192 : 128) * 1024 / sizeof(Stage);  // (beside 64 KiB of query at D=256)
  struct Shared {
    st<T, ROWS, D> q;
    Stage stage[GROUPS][STAGES];
    semaphore full[STAGES], empty[STAGES];
  };
  static_assert(Roles::CONSUMERS * 64 == ROWS && sizeof(Shared) <= MAX_SHARED_BYTES);
};

// The kernel's parts (pipeline/kernel.cuh: single, one block of rows of one KV head per block).
template <typename T, int D, typename C> struct DecodeSm90 {
  using Roles = typename C::Roles;
  using A = Args<T, C::BOX>;
  static constexpr int KEYS = C::KEYS, STAGES = C::STAGES, CONSUMERS = 128 * Roles::CONSUMERS;  // (threads)
  const A &a;
  typename C::Shared &sm;
  const Params &p = a.p;
  typename C::Stage (&stages)[STAGES] = sm.stage[0];
  // The ring (ring.cuh), formed where it is used: each semaphore's address a base and a constant offset.
  __device__ __forceinline__ ring<STAGES> kv() const { return {sm.full, sm.empty}; }
  const Block blk = block_of<C::ROWS, KEYS>(p);
  const int wg = warpgroup::groupid();

  __device__ __forceinline__ void init() const { tk::init(kv(), 128, Roles::CONSUMERS * 4); }  // full: each producer thread; empty: each consumer warp
  __device__ __forceinline__ void before_sync() const {
    if (wg != Roles::PRODUCER) {
      load_query<CONSUMERS>(sm.q, p, blk, threadIdx.x);
      commit_group();
    }
  }

  __device__ __forceinline__ void produce() const {
    auto boxes = [&](typename C::Stage &stage, int row, int2 at, semaphore &full) {
      load_rows_async(stage.k, row, a.k, {at.x, at.y, blk.h, 0}, full);
      load_rows_async(stage.v, row, a.v, {at.x, at.y, blk.h, 0}, full);
    };
    auto rows = [&](typename C::Stage &stage, int k0) {
      KeyRows<T, D, KEYS, 128> r;
      r.find(p, blk.b, k0, blk.R.valid);
      r.load(stage, p, blk.h);
    };
    produce_key_blocks<KEYS, C::BOX>(a, blk, kv(), stages, boxes, rows);
  }

  __device__ __forceinline__ void consume() const {
    wait_group<0>();
    warpgroup::fence_shared_writes();
    sync_named(3, CONSUMERS);  // the query rows (the consumers' copies) have landed
    const int t = warpid(), r_tile = TILE_ROWS * t;  // the warp's tile of 16 rows
    const auto q = window<64, D>(sm.q, 64 * wg, 0);  // its warpgroup's rows

    using s_tile = rt_fl<TILE_ROWS, KEYS>;
    rv<int2, TILE_ROWS, typename col_vec<s_tile>::layout> row_keys;  // (as in decode.cu)
    warp::map_index(row_keys, [&](int r) { return blk.R.row_keys(p, r_tile + r); });
    const bool capped = p.softcap > 0.f;
    const float c = capped ? 1.f : p.scale * LOG2E;
    s_tile s;
    rt<T, TILE_ROWS, KEYS> pr;
    rt_fl<TILE_ROWS, D> o;
    col_vec<s_tile> m, l, corr;
    warp::zero(o);
    warp::fill_vec(m, NEG_INF);
    warp::fill_vec(l, 0.f);

    // Turns: named barrier 1 + w opens consumer w's turn when the other arrives on it; consumer 1 opens
    // the first, and consumer 0 takes the answer to the last one at the end.
    auto my_turn = [&] { sync_named(1 + wg, CONSUMERS); };
    auto your_turn = [&] { arrive_named(2 - wg, CONSUMERS); };
    if (wg == 1) your_turn();
    // Stage `at` holds its block (the producer's copies, for wgmma's async proxy).
    auto ready = [&](ring_use<STAGES> at) {
      wait_full(kv(), at);
      warpgroup::fence_shared_writes();
    };
    if (blk.j0 < blk.j1) {
      ring_pos<STAGES> at(0);  // the block in S (the one before it is in P)
      ready(at);
      my_turn();
      warpgroup::mma_ABt(s, q, stages[at.slot].k, false);
      your_turn();
      warpgroup::wait<0>();
      warpgroup::fence_registers(s);
      softmax_block(s, p, capped, blk, row_keys, blk.j0 * KEYS, m, l, corr, c);
      warp::copy(pr, s);
      for (int j = blk.j0 + 1; j < blk.j1; j++) {
        const ring_use<STAGES> prev = at;
        ++at;
        ready(at);
        my_turn();
        warpgroup::mma_ABt(s, q, stages[at.slot].k, false);    // S_j = Q K_j^T
        warpgroup::mma_AB(o, pr, stages[prev.slot].v, true);  // O += P_{j-1} V_{j-1}
        your_turn();
        warpgroup::wait<1>();  // S_j is ready
        warpgroup::fence_registers(s);
        softmax_block(s, p, capped, blk, row_keys, j * KEYS, m, l, corr, c);
        warpgroup::wait<0>();  // P_{j-1} V_{j-1} is done: its stage is free
        warpgroup::fence_registers(o);
        warpgroup::fence_registers(pr);
        if (laneid() == 0) arrive_empty(kv(), prev);
        warp::mul_row(o, o, corr);
        warp::copy(pr, s);
      }
      my_turn();
      warpgroup::mma_AB(o, pr, stages[at.slot].v, true);
      your_turn();
      warpgroup::wait<0>();
      warpgroup::fence_registers(o);
    }
    if (wg == 0) my_turn();  // the answer to consumer 1's last turn
    sync_named(3, CONSUMERS);  // both are done with the stages, which finish() writes over
    finish<T, D, C, CONSUMERS>(p, sm, blk, o, m, l, c, 0, t, threadIdx.x, [] { sync_named(3, CONSUMERS); });
  }
};

template <typename T, int D, typename C>
__global__ __launch_bounds__(C::THREADS, 1) void decode_sm90_kernel(const __grid_constant__ Args<T, C::BOX> a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  grid_dependency_wait();  // (launched to wait here: see launch)
  extern __shared__ __align__(1024) char smem_raw[];
  DecodeSm90<T, D, C> k{a, *reinterpret_cast<typename C::Shared *>(smem_raw)};
  single(k);
#endif
}

// Boxes of a whole key block where the cache is contiguous or its pages hold whole blocks, else of
// 64 or 16 rows where pages are multiples of those; other pages take cp.async only.
template <typename T, int D> cudaError_t run(const Params &p, cudaStream_t stream) {
  auto go = [&]<int BOX>() {
    using C = Wide<T, D, BOX>;
    Args<T, BOX> a{p, {}, {}, false};
    const bool paged = p.page_table != nullptr;
    if (!paged || p.page_size % BOX == 0) {
      const int b = paged ? p.num_pages : p.batch, s = paged ? p.page_size : p.capacity;
      a.bulk = make_tma_map(a.k, p.k, b, s, p.kv_heads, D) && make_tma_map(a.v, p.v, b, s, p.kv_heads, D);
    }
    return launch(decode_sm90_kernel<T, D, C>, grid_of(p, C::ROWS), dim3(C::THREADS), sizeof(typename C::Shared), stream, a, true);
  };
  constexpr int KEYS = Wide<T, D, 16>::KEYS;
  if (!p.page_table || p.page_size % KEYS == 0) return go.template operator()<KEYS>();
  if (p.page_size % 64 == 0) return go.template operator()<64>();
  return go.template operator()<16>();
}

}  // namespace

cudaError_t decode_sm90_128(const Params &p, cudaStream_t stream) {
  return by_type<64, 128, 256>(p, [&]<typename T, int D>() { return run<T, D>(p, stream); });
}

}  // namespace jax_tk::decode
