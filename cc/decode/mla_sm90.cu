// MLA decode on Hopper (sm_90a): DeepSeek's multi-head latent attention over a latent cache. Every
// query head of a sequence reads the same cache rows: the keys are whole rows (D = 576, 512 latent
// dims and 64 rotary ones) and the values their first DV = 512 dims, so one shared tile holds a key
// block's keys and values. A thread block takes 64 query rows (heads x new tokens, as decode's blocks
// take a KV head's group) of one sequence and one part of its keys:
//
// - A producer warpgroup loads key blocks of 64 rows into a ring of two stages: by TMA where all of a
//   block's rows are valid (one box, or boxes of 16 rows from pages of 16 or 32), else row by row with
//   cp.async, zeros past the length or outside the pool (a value row of NaN times a weight of 0 would
//   still be NaN).
// - Two consumer warpgroups split each block's keys for the logits (S = Q K^T, 32 keys each, over all
//   576 dims) and the output's columns for the values (O += P V, 256 columns each). Each hands the
//   other its rows' maxima, so that both weigh their keys against one running maximum, and then its
//   half of P through shared memory.
// - The parts of a split sequence merge in decode.cu's merge kernel.
#include "decode/common.cuh"

namespace jax_tk::decode {
namespace {

template <typename T, int BOX_> struct Mla {
  using Roles = roles</*CONSUMERS=*/2, /*PRODUCER_REGS=*/40, /*CONSUMER_REGS=*/232>;
  static constexpr int D = MLA_HEAD_DIM, DV = MLA_V_HEAD_DIM, ROWS = MLA_BLOCK_ROWS, KEYS = 64, STAGES = 2, BOX = BOX_;
  static constexpr int HALF_KEYS = KEYS / 2, HALF_DV = DV / 2, THREADS = Roles::THREADS;
  static constexpr int CONSUMERS = 128 * Roles::CONSUMERS;  // (threads)
  struct Shared {
    st<T, ROWS, D> q;
    st<T, KEYS, D> kv[STAGES];
    st<T, ROWS, KEYS> p;   // the block's weights, both consumers' keys
    float share[2][ROWS];  // each consumer's row maxima (at the end, row sums) for the other
    semaphore full[STAGES], empty[STAGES];
  };
  static_assert(sizeof(Shared) <= MAX_SHARED_BYTES && ROWS == 16 * 4);
};

template <typename T, typename C> struct MlaSm90 {
  using Roles = typename C::Roles;
  using A = Args<T, C::BOX>;
  static constexpr int KEYS = C::KEYS, STAGES = C::STAGES, CONSUMERS = C::CONSUMERS;
  const A &a;
  typename C::Shared &sm;
  const Params &p = a.p;
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
    auto boxes = [&](auto &stage, int row, int2 at, semaphore &full) { load_rows_async(stage, row, a.k, {at.x, at.y, 0, 0}, full); };
    auto rows = [&](auto &stage, int k0) {  // (zeros past the length or outside the pool)
      const T *cache = static_cast<const T *>(p.k);
      for (int i = threadIdx.x % 128; i < KEYS * (C::D / 8); i += 128) {
        const int r = i / (C::D / 8), c = i % (C::D / 8) * 8, row = cache_row(p, blk.b, k0 + r, blk.R.valid);
        cp_async16(&stage(r, c), cache + (row < 0 ? 0 : size_t(row) * C::D + c), row >= 0);
      }
    };
    produce_key_blocks<KEYS, C::BOX>(a, blk, kv(), sm.kv, boxes, rows);
  }

  __device__ __forceinline__ void consume() const {
    wait_group<0>();
    warpgroup::fence_shared_writes();
    sync_named(3, CONSUMERS);  // the query rows (the consumers' copies) have landed
    const int w = warpid() % 4, other = 1 - wg;  // the warp's 16 rows: 16 w ..
    using s_tile = rt_fl<TILE_ROWS, C::HALF_KEYS>;
    using vec = col_vec<s_tile>;
    rv<int2, TILE_ROWS, typename vec::layout> row_keys;
    warp::map_index(row_keys, [&](int r) { return blk.R.row_keys(p, 16 * w + r); });
    const float c = p.scale * LOG2E;
    s_tile s;
    rt<T, TILE_ROWS, C::HALF_KEYS> pr;
    rt_fl<TILE_ROWS, C::HALF_DV> o;
    vec m, l, corr, mx, theirs;
    warp::zero(o);
    warp::fill_vec(m, NEG_INF);
    warp::fill_vec(l, 0.f);
    // This warp's rows of x and of the other consumer's: mx := both (by f), through shared memory.
    auto exchange = [&](vec &x, auto f) {
      warp::store(sm.share[wg] + 16 * w, x, TILE_ROWS);
      sync_named(1, CONSUMERS);
      warp::load(theirs, sm.share[other] + 16 * w, TILE_ROWS);
      warp::map_vec(x, x, theirs, f);
    };
    for (ring_pos<STAGES> at(0); blk.j0 + at.n < blk.j1; ++at) {
      auto &stage = sm.kv[at.slot];
      const int k0 = (blk.j0 + at.n) * KEYS + C::HALF_KEYS * wg;  // this consumer's keys
      wait_full(kv(), at);
      warpgroup::fence_shared_writes();
      warpgroup::mma_ABt(s, sm.q, window<C::HALF_KEYS, C::D>(stage, C::HALF_KEYS * wg, 0), false);  // S = Q K^T
      warpgroup::wait<0>();
      warpgroup::fence_registers(s);
      mask_block(s, blk, row_keys, k0);
      warp::row_max(mx, s, m);
      exchange(mx, [](float x, float y) { return fmaxf(x, y); });  // (both consumers' keys)
      warp::softmax_step_to(s, m, l, corr, mx, c);
      warp::mul_row(o, o, corr);
      warp::copy(pr, s);
      warp::store(sm.p, pr, 16 * w, C::HALF_KEYS * wg);
      warpgroup::fence_shared_writes();
      sync_named(2, CONSUMERS);  // both halves of P are in (and both consumers have read the maxima)
      warpgroup::mma_AB(o, sm.p, window<KEYS, C::HALF_DV>(stage, 0, C::HALF_DV * wg), true);  // O += P V
      warpgroup::wait<0>();
      warpgroup::fence_registers(o);
      if (laneid() == 0) arrive_empty(kv(), at);
    }
    exchange(l, [](float x, float y) { return x + y; });  // the row sums over both consumers' keys
    warp::normalize_output(o, l);
    finish(o, m, l, c, w);
  }

  // This consumer's columns of the rows' outputs (O / l) and, from consumer 0, their log-sum-exp (log2
  // units): to the output, or to the workspace (this part's share of a split sequence).
  template <typename O, typename V> __device__ __forceinline__ void finish(const O &o, const V &m, const V &l, float c, int w) const {
    const size_t q_rows = size_t(p.batch) * p.q_len * p.q_heads, first = size_t(blk.b) * blk.R.rows;  // (the sequence's rows)
    const coord at{0, blk.R.r0 + 16 * w, 0, C::HALF_DV * wg};
    if (p.splits == 1)
      warp::store(gl<T>::make(static_cast<T *>(p.o) + first * C::DV, 1, blk.R.rows, 1, C::DV), o, at);
    else
      warp::store(gl<float>::make(p.workspace + p.splits * q_rows + (blk.part * q_rows + first) * C::DV, 1, blk.R.rows, 1, C::DV), o, at);
    sync_named(1, CONSUMERS);  // (both consumers have read the other's row sums)
    if (wg != 0) return;
    V lse;
    warp::map_vec(lse, m, l, [=](float mx, float x) { return x > 0.f ? mx * c + warp::fn::log2(x) : NEG_INF; });
    warp::store(sm.share[0] + 16 * w, lse, TILE_ROWS);
    __syncwarp();
    const int r = 16 * w + laneid();
    if (laneid() < TILE_ROWS && blk.R.real(r)) {
      const size_t row = blk.row_index(p, r);
      if (p.splits > 1) p.workspace[blk.part * q_rows + row] = sm.share[0][r];
      else store_lse(p, row, sm.share[0][r]);
    }
  }
};

template <typename T, typename C> __global__ __launch_bounds__(C::THREADS, 1) void mla_sm90_kernel(const __grid_constant__ Args<T, C::BOX> a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  grid_dependency_wait();  // (launched to wait here: see launch)
  extern __shared__ __align__(1024) char smem_raw[];
  MlaSm90<T, C> k{a, *reinterpret_cast<typename C::Shared *>(smem_raw)};
  single(k);
#endif
}

// Boxes of a whole key block where the cache is contiguous or its pages hold whole blocks, else of 16
// rows where pages are multiples of 16; other pages take cp.async only.
template <typename T> cudaError_t run(const Params &p, cudaStream_t stream) {
  auto go = [&]<int BOX>() {
    using C = Mla<T, BOX>;
    Args<T, BOX> a{p, {}, {}, false};
    const bool paged = p.page_table != nullptr;
    if (!paged || p.page_size % BOX == 0) {
      const int b = paged ? p.num_pages : p.batch, s = paged ? p.page_size : p.capacity;
      a.bulk = make_tma_map(a.k, p.k, b, s, 1, C::D);
    }
    return launch(mla_sm90_kernel<T, C>, grid_of(p, C::ROWS), dim3(C::THREADS), sizeof(typename C::Shared), stream, a, true);
  };
  if (!p.page_table || p.page_size % Mla<T, 16>::KEYS == 0) return go.template operator()<Mla<T, 16>::KEYS>();
  return go.template operator()<16>();
}

}  // namespace

cudaError_t decode_mla_sm90(const Params &p, cudaStream_t stream) {
  return p.dtype == DType::bf16 ? run<bf16>(p, stream) : run<half>(p, stream);
}

}  // namespace jax_tk::decode
