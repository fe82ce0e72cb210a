"""The decode kernel on the GPU against the float32 reference: contiguous and paged caches (pages
shuffled, stray NaN pages), ragged lengths in one batch (0, shorter than T_new, odd), page sizes
16/64/256, T_new 1-16, GQA ratios 1-16, windows, soft cap, head dims 64/128/256, bf16 and fp16, split
counts 1 to many. The cache past each length is NaN, and the output and workspace are poisoned with
NaN before the kernel runs: every element must be written, and nothing unread may leak in. Blocks of
128 query rows take a kernel of their own on Hopper; the ``sm80`` kernels (``JAX_TK_KERNELS``'s value,
passed here as the launch's variant) run the one of other GPUs there too (test_sm80_kernel_for_128_rows),
and ``sm86`` the configs of GPUs with less shared memory (test_small_gpu_configs)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from helpers import nan, randn, rel_err, scan_step
from jax_tk._core import dispatch, extension
from jax_tk.decode import launch, reference
from jax_tk.decode.api import DecodeSpec
from test_decode import poison_past, to_pages

pytestmark = pytest.mark.gpu
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
TOL = {BF16: 1.2e-2, F16: 3e-3}


@functools.partial(jax.jit, static_argnames=("spec", "parts", "kernels"))
def kernel(q, k, v, lengths, table, *, spec, parts, kernels="auto"):
    b, t, n, h = q.shape
    words = launch.workspace_words(parts, b, t, n, h)
    out_init = (nan(q.shape, q.dtype), nan((b, n, t), F32), nan((words,), F32))
    return launch.kernel(q, k, v, lengths, table, spec, out_init=out_init, parts=parts, with_lse=True,
                         variant=dispatch.kernel_variant(kernels))


@functools.partial(jax.jit, static_argnames=("spec",))
def want(q, k, v, lengths, table, *, spec):
    """(out, lse [B, N, T]) in float32."""
    q, k, v = (x.astype(F32) for x in (q, k, v))
    out = reference.attention(q, k, v, lengths, scale=spec.scale, page_table=table, is_causal=spec.is_causal,
                              local_window_size=spec.window, logits_soft_cap=spec.softcap)
    if table is not None:
        k = reference.gather_pages(k, table)
    b, t, n, h = q.shape
    kh = k.shape[2]
    logits = jnp.einsum("btkgh,bskh->bkgts", q.reshape(b, t, kh, n // kh, h), jnp.nan_to_num(k)) * spec.scale
    if spec.softcap is not None:
        logits = spec.softcap * jnp.tanh(logits / spec.softcap)
    mask = reference.visibility(lengths, t, k.shape[1], is_causal=spec.is_causal, local_window_size=spec.window)
    lse = jax.nn.logsumexp(jnp.where(mask[:, None, None], logits, -jnp.inf), axis=-1)  # [B, K, G, T]
    return out, lse.reshape(b, n, t)


def check_part(p, out, lse, ref, ref_lse, tol):
    """One split count's output and lse against the reference's: every element written (the buffers
    were poisoned), the rows that see no key exactly 0 with lse -inf."""
    out, lse = np.asarray(out.astype(F32)), np.asarray(lse)
    assert np.isfinite(out).all(), f"splits={p}: {np.isnan(out).sum()} NaN (unwritten or leaked)"
    err = rel_err(out, ref)
    assert err < tol, f"splits={p}: rel err {err:.3g}"
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), empty) and not np.isnan(lse).any(), f"splits={p}: lse -inf/NaN"
    assert np.abs(lse[~empty] - ref_lse[~empty]).max(initial=0) < 2e-2, f"splits={p}: lse"
    assert (out[np.transpose(empty, (0, 2, 1))] == 0).all(), f"splits={p}: a row that sees no key is not 0"


def check(seed, b, t, n, kh, h, lengths, dtype, *, page_size=None, causal=True, window=None, softcap=None,
          parts=(1, 3, None), kernels="auto"):
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths)
    unit = page_size or 1
    s = unit * ((int(lengths.max()) + unit) // unit)
    q, k, v = randn(rng, (b, t, n, h), dtype), randn(rng, (b, s, kh, h), dtype), randn(rng, (b, s, kh, h), dtype)
    k, v = poison_past(k, lengths), poison_past(v, lengths)
    table = None
    if page_size:
        k, v, table = to_pages(rng, k, v, page_size)
    lens = jnp.asarray(lengths, jnp.int32)
    spec = DecodeSpec(1 / np.sqrt(h), causal, True, window, softcap, page_size)
    ref, ref_lse = (np.asarray(x) for x in want(q, k, v, lens, table, spec=spec))
    for p in parts:
        p = launch.splits(b, t, n, kh, s) if p is None else p
        out, lse = kernel(q, k, v, lens, table, spec=spec, parts=p, kernels=kernels)
        check_part(p, out, lse, ref, ref_lse, TOL[dtype])


# (B, T_new, N, K, H, lengths): GQA ratios 1, 4, 8, 16; T_new 1..16; odd and ragged lengths with 0 and < T_new
SHAPES = [
    (3, 1, 32, 8, 128, (0, 1, 3001)),
    (2, 1, 8, 8, 64, (517, 33)),
    (2, 4, 32, 8, 128, (2, 1999)),
    (2, 4, 64, 8, 128, (4097, 100)),
    (1, 16, 16, 1, 128, (1234,)),
    (2, 3, 6, 3, 256, (255, 7)),
    (4, 2, 4, 4, 64, (0, 1, 64, 65)),
    (1, 7, 16, 2, 128, (8191,)),
    # blocks of several 16-row tiles: 20 rows at D=256 (two tiles), 48 at D=64 (four, one of padding),
    # 64 at D=256 (four tiles, one group)
    (2, 5, 16, 4, 256, (1500, 37)),
    (3, 12, 32, 8, 64, (0, 900, 2049)),
    (2, 16, 32, 8, 256, (3, 777)),
]


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:5])))
def test_contiguous(shape, dtype):
    check(0, *shape, dtype)


@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("shape", SHAPES[:5], ids=lambda s: "x".join(map(str, s[:5])))
def test_paged(shape, page_size):
    check(1, *shape, BF16, page_size=page_size)


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("t, n", [(1, 32), (4, 64)])  # blocks of 16 and of 32 keys (two tiles)
def test_paged_long(page_size, t, n):
    # a warp's key blocks span several windows of 32 page-table entries (read ahead), from the
    # sequence's start and from inside it (three parts)
    check(8, 2, t, n, 8, 128, (20011, 9000), BF16, page_size=page_size, parts=(1, 3))


@pytest.mark.parametrize("page_size", [8, 24, 48])
@pytest.mark.parametrize("t, n, h", [(1, 32, 128), (4, 64, 128), (4, 64, 256)])  # blocks of 16 and of 32 keys
def test_other_page_sizes(page_size, t, n, h):
    # pages that are not multiples of 16 keys (their rows found one by one: 8 divides a block, 24 does
    # not), and pages of 48 (runs of 16 rows; blocks of 32 keys straddle pages, one table read a run)
    check(10, 2, t, n, 8, h, (1000, 333), BF16, page_size=page_size)


@pytest.mark.parametrize("opts", [
    dict(causal=False), dict(window=(100, 0)), dict(window=(37, 5)), dict(causal=False, window=(64, 64)),
    dict(softcap=30.0), dict(softcap=5.0, window=(200, 0), page_size=16),
], ids=str)
@pytest.mark.parametrize("h", [64, 128, 256])
@pytest.mark.parametrize("t", [4, 12, 32])  # 16, 48 and 128 query rows per KV head
def test_options(opts, h, t):
    check(2, 3, t, 16, 4, h, (0, 700, 2053), BF16, **opts)


@pytest.mark.parametrize("h", [64, 128])
@pytest.mark.parametrize("opts", [dict(), dict(page_size=16, window=(300, 0)), dict(causal=False, softcap=10.0)], ids=str)
def test_sm80_kernel_for_128_rows(opts, h):
    # the mma.sync kernel that takes 128-row blocks on GPUs before Hopper, run on this one
    check(7, 3, 16, 16, 2, h, (0, 1300, 2047), BF16, kernels="sm80", **opts)


@pytest.mark.parametrize("h", [64, 128, 256])
@pytest.mark.parametrize("t, page_size", [(1, None), (8, 16), (32, 64)])  # 4, 32 and 128 query rows per KV head
def test_small_gpu_configs(h, t, page_size):
    # the configs of GPUs with less shared memory per block (sm_86, sm_89: fewer stages at head dim 256,
    # 128 rows as blocks of 64, of 32 at head dim 256), run on this one
    check(9, 3, t, 16, 4, h, (0, 700, 2053), BF16, page_size=page_size, kernels="sm86")


def test_many_splits_short_lengths():
    # more parts than key blocks: most parts see nothing and must still be merged correctly
    check(3, 2, 1, 8, 2, 128, (20, 5), BF16, parts=(1, 7, 64))


@pytest.mark.parametrize("page_size", [None, 64])
def test_scheduler_edges(page_size):
    # every length 0 (each row 0 with lse -inf, whatever the cache holds); one long sequence among short
    # ones (its parts against many sequences of one key block); a batch of one
    check(11, 3, 2, 32, 8, 128, (0, 0, 0), BF16, page_size=page_size)
    check(12, 8, 1, 32, 8, 128, (30011, 1, 5, 17, 0, 3, 2, 9), BF16, page_size=page_size)
    check(13, 1, 1, 64, 8, 128, (4099,), BF16, page_size=page_size)


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("b", [33, 64, 65])
def test_longest_first_order(b, page_size):
    # in grids of more than one wave (here 3 parts: 4 x 3 blocks a sequence), blocks take the sequences by
    # decreasing length up to 64 of them (common.cuh: sequence_of), in the grid's order past that and in
    # grids of one wave (1 part, b = 33): lengths with ties, zeros and one long sequence in the middle
    lengths = np.random.default_rng(b).integers(0, 12, b) * 37
    lengths[b // 2] = 5001
    check(14, b, 1, 16, 4, 128, lengths, BF16, page_size=page_size, parts=(1, 3))


@pytest.mark.parametrize("h", [64, 128, 256])
@pytest.mark.parametrize("t", [2, 8, 32])  # 8, 32 and 128 query rows per KV head
def test_grid_of_several_waves(h, t):
    # more thread blocks than one wave (the core contract's WAVE_BLOCKS) take the kernel of two blocks per SM
    b, kh = 34, 4
    assert b * kh > extension.WAVE_BLOCKS
    lengths = np.random.default_rng(5).integers(0, 700, b)
    check(5, b, t, 16, kh, h, lengths, BF16, parts=(1, 2))


def test_public_api_in_a_jitted_scan():
    """jax_tk.decode.attention(implementation="tk") inside a lax.scan decoding loop, against the reference."""
    rng = np.random.default_rng(4)
    b, n, kh, h, s, steps = 2, 16, 4, 128, 1024, 5
    kc, vc = randn(rng, (b, s, kh, h), BF16), randn(rng, (b, s, kh, h), BF16)
    qs, nk = randn(rng, (steps, b, 1, n, h), BF16), randn(rng, (steps, b, 1, kh, h), BF16)

    def run(impl):
        return jax.jit(lambda kc, vc, lens: jax.lax.scan(scan_step(impl), (kc, vc, lens), (qs, nk))[1])(
            kc, vc, jnp.array([300, 777], jnp.int32))

    assert rel_err(run("tk"), run("xla")) < TOL[BF16]


@pytest.mark.parametrize("t", [1, 5, 16])
def test_attention_takes_the_decode_kernel_for_short_queries(t):
    """jax_tk.attention (no causal mask) with a few queries over many keys runs the decode kernel forward
    (one custom call of it in the program) and the attention backward with its lse: values and grads."""
    rng = np.random.default_rng(t)
    q, k, v = randn(rng, (2, t, 16, 128), BF16), randn(rng, (2, 1500, 4, 128), BF16), randn(rng, (2, 1500, 4, 128), BF16)
    dout = randn(rng, (2, t, 16, 128), F32)

    def loss(impl):
        return lambda q, k, v: jnp.sum(jax_tk.attention(q, k, v, implementation=impl, logits_soft_cap=20.0).astype(F32) * dout)

    assert "jax_tk_decode" in jax.jit(jax.grad(loss("tk"), argnums=(0, 1, 2))).lower(q, k, v).as_text()
    got = jax.jit(jax.value_and_grad(loss("tk"), argnums=(0, 1, 2)))(q, k, v)
    ref = jax.jit(jax.value_and_grad(loss("xla"), argnums=(0, 1, 2)))(*(x.astype(F32) for x in (q, k, v)))
    assert abs(float(got[0]) - float(ref[0])) <= 2e-2 * max(1.0, abs(float(ref[0])))
    for name, g, r in zip("qkv", got[1], ref[1]):
        assert rel_err(g.astype(F32), r) < 2e-2, name


def test_public_api_gradients_and_pages_outside_the_pool():
    """jax_tk.decode.attention(implementation="tk") under jit(value_and_grad): the kernel's forward, the
    reference's gradient; table entries outside the pool within a length read zeros, as in the reference."""
    rng = np.random.default_rng(6)
    q, pool = randn(rng, (2, 4, 8, 64), BF16), randn(rng, (9, 16, 2, 64), BF16)
    table = jnp.array([[3, -1, 8, 100], [0, 2, 9, 5]], jnp.int32)  # -1, 100 and 9 are outside the pool
    lens = jnp.array([60, 51], jnp.int32)
    dout = randn(rng, q.shape, F32)

    def loss(impl):
        return lambda q, k: jnp.sum(jax_tk.decode.attention(q, k, k, lens, page_table=table, implementation=impl)
                                    .astype(F32) * dout)

    f = jax.jit(jax.value_and_grad(loss("tk"), argnums=(0, 1)))
    assert "jax_tk_decode" in f.lower(q, pool).as_text()
    got = f(q, pool)
    ref = jax.value_and_grad(loss("xla"), argnums=(0, 1))(q.astype(F32), pool.astype(F32))
    assert abs(float(got[0]) - float(ref[0])) <= 1e-2 * max(1.0, abs(float(ref[0])))
    for g, r in zip(got[1], ref[1]):
        assert rel_err(g.astype(F32), r) < 2e-2
