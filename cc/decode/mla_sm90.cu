// MLA decode on Hopper (sm_90a): DeepSeek's multi-head latent attention over a latent cache. Every
// query head of a sequence reads the same cache rows: the keys are whole rows (D = 576, 512 latent
// dims and 64 rotary ones) and the values their first DV = 512 dims, so one shared tile holds a key
// block's keys and values. A thread block takes 64 query rows (heads x new tokens, as decode's blocks
// take a KV head's group) of one sequence and one part of its keys:
//
// - A producer warpgroup loads key blocks of 32 rows into a ring of four stages: by TMA where all of a
//   block's rows are valid (one box, or boxes of 16 rows from pages of 16 or 48), else row by row with
//   cp.async, zeros past the length or outside the pool (a value row of NaN times a weight of 0 would
//   still be NaN).
// - Two consumer warpgroups take the key blocks in turn (consumer 0 the even ones, 1 the odd ones) for
//   the logits (S = Q K^T over all 576 dims) and the weights, and split the output's columns (O += P V,
//   256 columns each). The owner of a block weighs it against the running row maxima it took over
//   with the block before, and hands its weights, the new maxima and the row sums to the other
//   through shared memory; both then add the block to their columns. So the two are half a block
//   apart: one's softmax runs while the other's products do.
// - The parts of a split sequence merge in decode.cu's merge kernel.
#include "decode/common.cuh"

namespace jax_tk::decode {
namespace {

template <typename T, int BOX_> struct Mla {
  using Roles = roles</*CONSUMERS=*/2, /*PRODUCER_REGS=*/40, /*CONSUMER_REGS=*/232>;
  static constexpr int D = MLA_HEAD_DIM, DV = MLA_V_HEAD_DIM, ROWS = MLA_BLOCK_ROWS, KEYS = 32, STAGES = 4, BOX = BOX_;
  static constexpr int HALF_DV = DV / 2, THREADS = Roles::THREADS;
  static constexpr int CONSUMERS = 128 * Roles::CONSUMERS;  // (threads)
  struct Shared {
    st<T, ROWS, D> q;
    st<T, KEYS, D> kv[STAGES];
    st<T, ROWS, KEYS> p;     // the weights of the block last handed over
    float handed[2][ROWS];   // its rows' running maxima and weight sums (at the end: the rows' lse)
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

  // Block i (of this part's, from 0) goes: S_i = Q K_i^T and its weights P_i by its owner (consumer
  // i % 2), handed over; O += P_i V_i by both, each on its columns. The owner of block i issues S_i
  // before it takes over block i - 1, so that its products run while the other weighs.
  __device__ __forceinline__ void consume() const {
    wait_group<0>();
    warpgroup::fence_shared_writes();
    sync_named(3, CONSUMERS);  // the query rows (the consumers' copies) have landed
    const int w = warpid() % 4, n = blk.j1 - blk.j0;  // the warp's 16 rows: 16 w ..
    using s_tile = rt_fl<TILE_ROWS, KEYS>;
    using vec = col_vec<s_tile>;
    rv<int2, TILE_ROWS, typename vec::layout> row_keys;
    warp::map_index(row_keys, [&](int r) { return blk.R.row_keys(p, 16 * w + r); });
    const float c = p.scale * LOG2E;
    s_tile s;
    rt<T, TILE_ROWS, KEYS> mine, theirs;  // P of this consumer's block, and of the other's
    rt_fl<TILE_ROWS, C::HALF_DV> o;
    vec m, l, corr, mx, r;  // r: the block's row sums of P
    warp::zero(o);
    warp::fill_vec(m, NEG_INF);
    warp::fill_vec(l, 0.f);
    auto logits = [&](int i) {
      const ring_pos<STAGES> at(i);
      wait_full(kv(), at);
      warpgroup::fence_shared_writes();
      warpgroup::mma_ABt(s, sm.q, sm.kv[at.slot], false);
    };
    auto weigh = [&](int i) {  // mine := P_i; m: the new maxima; corr, r
      warpgroup::fence_registers(s);
      mask_block(s, blk, row_keys, (blk.j0 + i) * KEYS);
      warp::row_max(mx, s, m);
      warp::fill_vec(r, 0.f);
      warp::softmax_step_to(s, m, r, corr, mx, c);
      warp::copy(mine, s);
    };
    auto hand_over = [&] {
      warp::store(sm.p, mine, 16 * w, 0);
      warp::store(sm.handed[0] + 16 * w, m, TILE_ROWS);
      warp::store(sm.handed[1] + 16 * w, r, TILE_ROWS);
      arrive_named_unaligned(1 + wg, CONSUMERS);
    };
    auto take_over = [&] {  // theirs := the other's P; m: its new maxima; corr, r
      sync_named_unaligned(2 - wg, CONSUMERS);
      warp::load(theirs, sm.p, 16 * w, 0);
      warp::load(mx, sm.handed[0] + 16 * w, TILE_ROWS);
      warp::load(r, sm.handed[1] + 16 * w, TILE_ROWS);
      warp::map_vec(corr, m, mx, [=](float a, float b) { return warp::fn::exp2(a * c - (b == NEG_INF ? 0.f : b * c)); });
      m = mx;
    };
    auto values = [&](int i, const rt<T, TILE_ROWS, KEYS> &weights) {  // o, l: up to block i
      warp::mul_row(o, o, corr);
      warp::map_vec(l, l, corr, [](float a, float b) { return a * b; });
      warp::map_vec(l, l, r, [](float a, float b) { return a + b; });
      warpgroup::mma_AB(o, weights, window<KEYS, C::HALF_DV>(sm.kv[i % STAGES], 0, C::HALF_DV * wg), true);
    };
    auto release = [&](int i) {
      if (laneid() == 0) arrive_empty(kv(), ring_pos<STAGES>(i));
    };
    // (Each product is waited for in the branch that issued it, or in the loop that carries it, and the
    // loop is entered with one product in flight: so ptxas need not serialize them.)
    const bool theirs_last = n > 0 && (n - 1) % 2 != wg;
    if (wg < n) {
      if (wg == 1) {  // consumer 1's first block, after block 0
        logits(1);
        take_over();
        values(0, theirs);
        warpgroup::wait<0>();
        warpgroup::fence_registers(o);
        release(0);
      } else {
        logits(0);
        warpgroup::wait<0>();
      }
      weigh(wg);
      hand_over();
      values(wg, mine);
      for (int i = wg + 2; i < n; i += 2) {  // this consumer's block i, and the other's i - 1 before it
        logits(i);
        take_over();  // (while S_i and this consumer's values of block i - 2 run)
        warpgroup::wait<0>();
        warpgroup::fence_registers(o);
        release(i - 2);  // (a lane's arrival branches: not while a product runs)
        values(i - 1, theirs);
        weigh(i);  // (while the values of block i - 1 run)
        warpgroup::wait<0>();
        warpgroup::fence_registers(o);
        release(i - 1);
        hand_over();
        values(i, mine);
      }
      warpgroup::wait<0>();
      warpgroup::fence_registers(o);
      release(n - 1 - theirs_last);  // this consumer's last block
    }
    if (theirs_last) {
      take_over();
      values(n - 1, theirs);
      warpgroup::wait<0>();
      warpgroup::fence_registers(o);
      release(n - 1);
    }
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
    sync_named(3, CONSUMERS);  // (the other consumer has read the last hand-over)
    if (wg != 0) return;
    V lse;
    warp::map_vec(lse, m, l, [=](float mx, float x) { return x > 0.f ? mx * c + warp::fn::log2(x) : NEG_INF; });
    warp::store(sm.handed[0] + 16 * w, lse, TILE_ROWS);
    __syncwarp();
    const int r = 16 * w + laneid();
    if (laneid() < TILE_ROWS && blk.R.real(r)) {
      const size_t row = blk.row_index(p, r);
      if (p.splits > 1) p.workspace[blk.part * q_rows + row] = sm.handed[0][r];
      else store_lse(p, row, sm.handed[0][r]);
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
