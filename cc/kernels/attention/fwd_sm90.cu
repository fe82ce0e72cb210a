// Attention forward for Hopper (sm_90a): TMA, mbarriers, wgmma and warp specialization.
// A block has 3 warpgroups. The last is the producer: one thread streams Q once and key/value
// blocks through a ring of STAGES shared-memory slots with TMA, each slot guarded by a "full"
// semaphore (TMA bytes landed) and an "empty" one (every consumer warp is done with it). The
// other two are consumers, 64 query rows each: S = Q K^T (wgmma, both operands in shared memory),
// online softmax in registers (the same warp code as the mma.sync kernel), O += P V (wgmma, P from
// registers), pipelined so that the softmax of one block overlaps the P V product of the previous,
// and the two consumers take turns issuing their products (ping-pong), so that one's softmax runs
// while the tensor cores work for the other.
// setmaxnreg moves registers from the producer to the consumers. Producer and consumers walk the
// same key blocks (kv_block_range: causal, window, lengths; a BlockList: segments); a block of
// query rows that sees no key loads nothing and stores O = 0, lse = -inf. Only the tiles that cut
// through a rule or a segment boundary are masked elementwise (KeyRule, BlockList::one_segment).
#include "common.cuh"

namespace jax_tk::attention {
namespace {

using namespace tk;

template <typename T, int D> struct FwdH {
  static constexpr int CONSUMERS = 2, THREADS = 128 * (CONSUMERS + 1), BQ = 64 * CONSUMERS;
  static constexpr int BK = D <= 128 ? 128 : 64;  // D = 256: O takes 128 registers, K/V tiles 32 KB
  static constexpr int STAGES = D <= 64 ? 4 : 2;
  static constexpr bool PINGPONG = D <= 128;  // the consumers take turns issuing their products
  struct Shared {
    st<T, 64, D> q[CONSUMERS];
    st<T, BK, D> k[STAGES], v[STAGES];
    semaphore q_full, k_full[STAGES], v_full[STAGES], k_empty[STAGES], v_empty[STAGES];
  };
  struct Args {
    Params p;
    tma_map<T, 64> q;
    tma_map<T, BK> k, v;
  };
  static constexpr size_t smem = sizeof(Shared) + 1024;  // + room to align the base to 1024
};

template <typename T, int D, bool FULL>
__global__ __launch_bounds__(FwdH<T, D>::THREADS, 1) void fwd_sm90_kernel(const __grid_constant__ typename FwdH<T, D>::Args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = FwdH<T, D>;
  constexpr int BK = C::BK, STAGES = C::STAGES, CONSUMERS = C::CONSUMERS;
  extern __shared__ char smem_raw[];
  auto &sm = align_shared<typename C::Shared>(smem_raw);
  const Params p = a.p;  // a copy: the fields it uses stay in registers (no reloads after each memory clobber)
  const int b = blockIdx.z, h = blockIdx.y;
  const int q0 = (gridDim.x - 1 - blockIdx.x) * C::BQ;  // heaviest (causal) blocks first
  const int kvh = h / (p.q_heads / p.kv_heads);
  // Key blocks to visit: in [first, end), minus the ones of other segments (next).
  const int2 range = kv_block_range<FULL>(p, b, q0, C::BQ, BK);
  const BlockList blocks = list_blocks(reinterpret_cast<uint32_t *>(&sm + 1), range.x, range.y,
                                       FULL && p.q_segment_ids != nullptr,
                                       [&](int j) { return segments_meet<FULL>(p, b, q0, C::BQ, j * BK, BK); },
                                       [&](int j) { return in_one_segment<FULL>(p, b, q0, C::BQ, j * BK, BK); });
  const KeyRule rule = key_rule<FULL>(p, b);
  const int end = range.y;
  auto next = [&](int j) { return blocks.next(j); };
  const int first = next(range.x);
  const int wg = warpgroup::groupid();

  if (threadIdx.x == 0) {
    init(sm.q_full, 1);
    for (int s = 0; s < STAGES; s++) {
      init(sm.k_full[s], 1);
      init(sm.v_full[s], 1);
      init(sm.k_empty[s], CONSUMERS * 4);  // one arrival per consumer warp
      init(sm.v_empty[s], CONSUMERS * 4);
    }
    fence_barrier_init();
  }
  __syncthreads();

  if (wg == CONSUMERS) {  // producer
    warpgroup::decrease_registers<24>();
    if (threadIdx.x == CONSUMERS * 128 && first < end) {
      arrive_expect_bytes(sm.q_full, CONSUMERS * sizeof(sm.q[0].data));
      for (int c = 0; c < CONSUMERS; c++) load_async(sm.q[c], a.q, {b, q0 + 64 * c, h, 0}, sm.q_full);
      for (int n = 0, j = first; j < end; n++, j = next(j + 1)) {
        const int s = n % STAGES, phase = (n / STAGES) & 1, k0 = j * BK;
        wait(sm.k_empty[s], phase ^ 1);
        arrive_expect_bytes(sm.k_full[s], sizeof(sm.k[s].data));
        load_async(sm.k[s], a.k, {b, k0, kvh, 0}, sm.k_full[s]);
        wait(sm.v_empty[s], phase ^ 1);
        arrive_expect_bytes(sm.v_full[s], sizeof(sm.v[s].data));
        load_async(sm.v[s], a.v, {b, k0, kvh, 0}, sm.v_full[s]);
      }
    }
    return;
  }

  // consumers
  warpgroup::increase_registers<240>();
  static_assert(CONSUMERS == 2);
  // Turns: named barrier 1 + w opens consumer w's turn when the other arrives on it. Every turn
  // but the other's last is answered, and consumer 1 opens the first one. (Not at D = 256: there
  // the barriers cost registers that O needs.)
  auto my_turn = [&] { if constexpr (C::PINGPONG) sync_named(1 + wg, 256); };
  auto your_turn = [&] { if constexpr (C::PINGPONG) arrive_named(2 - wg, 256); };
  const int qw = q0 + 64 * wg + 16 * (warpid() % 4);  // this warp's first query row
  rt_fl<16, BK> s;
  rt<T, 16, BK> pr;
  rt_fl<16, D> o;
  col_vec<rt_fl<16, BK>> m, l, corr;
  warp::zero(o);
  warp::fill_vec(m, NEG_INF);
  warp::fill_vec(l, 0.f);
  if (first == end) {  // these rows see no key: O = 0, lse = -inf
    store_output<T>(p, o, l, b, h, qw, 0);
    store_lse(p, m, l, b, h, qw);
    return;
  }
  wait(sm.q_full, 0);
  if (wg == 1) your_turn();

  // Software pipeline: while the tensor cores compute O += P_{j-1} V_{j-1}, the warps run the
  // softmax of block j. S_j is issued first; wgmma groups complete in order.
  wait(sm.k_full[0], 0);
  my_turn();
  warpgroup::mma_ABt(s, sm.q[wg], sm.k[0], false);  // S_0 = Q K_0^T
  your_turn();
  warpgroup::wait<0>();
  warpgroup::fence_registers(s);
  if (laneid() == 0) arrive(sm.k_empty[0]);
  scale_logits<FULL>(s, p);
  mask_logits<FULL>(s, p, rule, blocks.one_segment(first), b, qw, first * BK);
  softmax_step(s, m, l, corr);
  warp::copy(pr, s);

  int n = 1;  // blocks visited
  for (int j = next(first + 1), j_next; j < end; n++, j = j_next) {
    const int st = n % STAGES, phase = (n / STAGES) & 1;
    const int prev = (n - 1) % STAGES, prev_phase = ((n - 1) / STAGES) & 1;
    wait(sm.k_full[st], phase);
    wait(sm.v_full[prev], prev_phase);
    my_turn();
    warpgroup::mma_ABt(s, sm.q[wg], sm.k[st], false);  // S_j = Q K_j^T
    warpgroup::mma_AB(o, pr, sm.v[prev], true);        // O += P_{j-1} V_{j-1}
    your_turn();
    // While the products run: the next block (with segment ids: read from their ranges)
    j_next = next(j + 1);
    warpgroup::wait<1>();  // S_j is ready
    warpgroup::fence_registers(s);
    if (laneid() == 0) arrive(sm.k_empty[st]);
    scale_logits<FULL>(s, p);
    mask_logits<FULL>(s, p, rule, blocks.one_segment(j), b, qw, j * BK);
    softmax_step(s, m, l, corr);
    warpgroup::wait<0>();  // P_{j-1} V_{j-1} is done
    warpgroup::fence_registers(o);
    warpgroup::fence_registers(pr);
    if (laneid() == 0) arrive(sm.v_empty[prev]);
    warp::mul_row(o, o, corr);
    warp::copy(pr, s);
  }
  const int last = (n - 1) % STAGES;
  wait(sm.v_full[last], ((n - 1) / STAGES) & 1);
  my_turn();
  warpgroup::mma_AB(o, pr, sm.v[last], true);
  if (wg == 0) your_turn();
  warpgroup::wait<0>();
  warpgroup::fence_registers(o);
  if (laneid() == 0) arrive(sm.v_empty[last]);
  store_output<T>(p, o, l, b, h, qw, 0);
  store_lse(p, m, l, b, h, qw);
#endif
}

}  // namespace

bool fwd_sm90_supported(const Params &p) { return p.head_dim == 64 || p.head_dim == 128 || p.head_dim == 256; }

cudaError_t fwd_sm90(const Params &p, cudaStream_t stream) {
  return dispatch<64, 128, 256>(p, [&]<typename T, int D, bool FULL>() {
    using C = FwdH<T, D>;
    typename C::Args a{p, {}, {}, {}};
    if (!make_tma_map(a.q, p.q, p.batch, p.q_len, p.q_heads, D) ||
        !make_tma_map(a.k, p.k, p.batch, p.kv_len, p.kv_heads, D) ||
        !make_tma_map(a.v, p.v, p.batch, p.kv_len, p.kv_heads, D))
      return cudaErrorInvalidValue;
    dim3 grid((p.q_len + C::BQ - 1) / C::BQ, p.q_heads, p.batch);
    auto kernel = fwd_sm90_kernel<T, D, FULL>;
    const size_t smem = C::smem + (p.q_segment_ids ? block_list_bytes((p.kv_len + C::BK - 1) / C::BK) : 0);
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (e != cudaSuccess) return e;
    kernel<<<grid, C::THREADS, smem, stream>>>(a);
    return cudaGetLastError();
  });
}

}  // namespace jax_tk::attention
