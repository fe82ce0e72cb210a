"""CPU tests of jax_tk.decode (the reference path; tests/decode/test_decode_kernels_gpu.py has the kernel's): against an independent float64 numpy version,
contiguous vs paged caches, update_kv_cache, a jitted scan decoding loop, and every input check."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from helpers import needs_extension, randn, rel_err

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
TOL = {F32: 1e-5, BF16: 1e-2, F16: 2e-3}


def numpy_decode(q, k, v, lengths, scale, is_causal=True, window=None, softcap=None):
    """Decode attention in float64 numpy, row by row. q [B, T, N, H]; k, v [B, S, K, H] (contiguous,
    logical positions); row i of sequence b is at p = lengths[b] - T + i and sees keys j < lengths[b],
    j <= p if causal, p - left <= j <= p + right with a window; a row with no key (or p < 0) gives 0."""
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    b, t, n, h = q.shape
    group = n // k.shape[2]
    out = np.zeros((b, t, n, h))
    for bi in range(b):
        length = int(lengths[bi])
        for i in range(t):
            p = length - t + i
            if p < 0:
                continue
            keys = [j for j in range(min(length, k.shape[1]))
                    if (not is_causal or j <= p) and (window is None or p - window[0] <= j <= p + window[1])]
            if not keys:
                continue
            for hi in range(n):
                logits = scale * (k[bi, keys, hi // group] @ q[bi, i, hi])
                if softcap is not None:
                    logits = softcap * np.tanh(logits / softcap)
                e = np.exp(logits - logits.max())
                out[bi, i, hi] = (e / e.sum()) @ v[bi, keys, hi // group]
    return out


def poison_past(cache, lengths):
    """Rows at or past each sequence's length set to NaN: they must never reach the output."""
    rows = np.arange(cache.shape[1])[None, :, None, None] >= np.asarray(lengths)[:, None, None, None]
    return jnp.where(rows, jnp.nan, cache).astype(cache.dtype)


def to_pages(rng, key, value, page_size, extra_pages=3):
    """Contiguous caches [B, S, K, H] (S a multiple of page_size) as paged ones with the pages shuffled
    randomly (the same way for key and value) and a few stray NaN pages no table names.
    Returns (key_pages, value_pages, page_table)."""
    b, s, kh, h = key.shape
    max_pages = s // page_size
    num = b * max_pages + extra_pages
    perm = rng.permutation(num)[: b * max_pages]

    def paged(cache):
        pages = np.full((num, page_size, kh, h), np.nan, np.float32)
        pages[perm] = np.asarray(cache.astype(F32)).reshape(b * max_pages, page_size, kh, h)
        return jnp.asarray(pages).astype(cache.dtype)

    return paged(key), paged(value), jnp.asarray(perm.reshape(b, max_pages), jnp.int32)


@functools.partial(jax.jit, static_argnames=("is_causal", "window", "softcap"))
def _decode(q, k, v, lengths, page_table=None, is_causal=True, window=None, softcap=None):
    return jax_tk.decode.attention(q, k, v, lengths, page_table=page_table, is_causal=is_causal,
                                   local_window_size=window, logits_soft_cap=softcap)


# (B, T_new, N, K, H, page_size, lengths, is_causal, window, softcap, dtype): ragged lengths in one batch
# (0, < T_new, odd, full), T_new 1/4/16, GQA ratios 1..16, windows, soft cap, page sizes 16/64/256.
CASES = [
    (4, 1, 4, 4, 64, 16, (0, 1, 17, 64), True, None, None, F32),
    (4, 4, 8, 2, 64, 16, (0, 3, 33, 47), True, None, None, F32),
    (3, 16, 16, 1, 128, 64, (5, 16, 129), True, None, None, F32),
    (3, 4, 16, 16, 32, 16, (2, 50, 63), False, None, None, F32),
    (2, 4, 12, 4, 64, 64, (77, 128), True, (20, 0), None, F32),
    (2, 16, 8, 8, 64, 16, (31, 64), True, (5, 3), 30.0, F32),
    (2, 1, 8, 1, 256, 256, (300, 511), True, 100, None, F32),
    (3, 4, 6, 3, 16, 16, (0, 9, 40), False, (4, 2), 5.0, F32),
    (2, 4, 16, 2, 128, 64, (70, 3), True, None, 20.0, BF16),
    (2, 16, 4, 1, 64, 16, (40, 15), True, None, None, F16),
]


@pytest.mark.parametrize("seed", range(len(CASES)), ids=[f"case{i}" for i in range(len(CASES))])
def test_against_numpy_contiguous_and_paged(seed):
    b, t, n, kh, h, page_size, lengths, causal, window, cap, dtype = CASES[seed]
    rng = np.random.default_rng(seed)
    s = page_size * ((max(lengths) + page_size) // page_size)  # a multiple of page_size, > every length
    q, k, v = randn(rng, (b, t, n, h), dtype), randn(rng, (b, s, kh, h), dtype), randn(rng, (b, s, kh, h), dtype)
    lengths_np = np.array(lengths)
    lens = jnp.asarray(lengths_np, jnp.int32)
    w = (window, window) if isinstance(window, int) else window
    ref = numpy_decode(q, k, v, lengths_np, 1 / np.sqrt(h), causal, w, cap)
    kc, vc = poison_past(k, lengths_np), poison_past(v, lengths_np)
    out = _decode(q, kc, vc, lens, is_causal=causal, window=window, softcap=cap)
    assert out.shape == q.shape and out.dtype == dtype
    assert np.isfinite(np.asarray(out.astype(F32))).all()
    assert rel_err(out, ref) < TOL[dtype]
    kp, vp, table = to_pages(rng, kc, vc, page_size)
    paged = _decode(q, kp, vp, lens, table, is_causal=causal, window=window, softcap=cap)
    # the same math on the gathered cache: equal up to the order of float32 sums, which XLA on a GPU
    # may choose differently for the two shapes (seen: 3e-7 absolute in float32)
    assert rel_err(paged, out) < (1e-5 if dtype == F32 else 1e-2)
    assert rel_err(paged, ref) < TOL[dtype]
    # rows with no key (length 0, or p < 0) are exactly 0
    for bi, length in enumerate(lengths):
        for i in range(t):
            if length - t + i < 0:
                assert not np.asarray(out[bi, i].astype(F32)).any()


def test_matches_full_attention_after_update():
    """update_kv_cache then decode.attention == jax_tk.attention over the whole sequence, last T_new rows
    (causal bottom-right alignment of decode == top-left causal attention on the full sequence)."""
    rng = np.random.default_rng(1)
    b, t, n, kh, h, s, page_size = 3, 4, 8, 2, 64, 128, 16
    old = np.array([0, 13, 100])
    seqs_k, seqs_v = randn(rng, (b, s, kh, h), F32), randn(rng, (b, s, kh, h), F32)
    q = randn(rng, (b, t, n, h), F32)
    new_k = jnp.stack([seqs_k[i, old[i]:old[i] + t] for i in range(b)])
    new_v = jnp.stack([seqs_v[i, old[i]:old[i] + t] for i in range(b)])
    kc = poison_past(seqs_k, old)
    vc = poison_past(seqs_v, old)
    lens = jnp.asarray(old, jnp.int32)
    upd = jax.jit(jax_tk.decode.update_kv_cache)
    kc, vc = upd(kc, new_k, lens), upd(vc, new_v, lens)
    out = jax_tk.decode.attention(q, kc, vc, lens + t)
    kp, vp, table = to_pages(rng, poison_past(seqs_k, old), poison_past(seqs_v, old), page_size)
    upd_paged = jax.jit(lambda c, x, l, pt: jax_tk.decode.update_kv_cache(c, x, l, page_table=pt))
    kp, vp = upd_paged(kp, new_k, lens, table), upd_paged(vp, new_v, lens, table)
    out_paged = jax_tk.decode.attention(q, kp, vp, lens + t, page_table=table)
    assert rel_err(out_paged, out) < 1e-2  # (up to the order of float32 sums, as above)
    for i in range(b):
        total = old[i] + t
        full_q = jnp.concatenate([randn(rng, (1, total - t, n, h), F32), q[i:i + 1]], axis=1)
        ref = jax_tk.attention(full_q, seqs_k[i:i + 1, :total], seqs_v[i:i + 1, :total], is_causal=True,
                               implementation="xla")[:, -t:]
        assert rel_err(out[i:i + 1], ref) < 1e-5


def test_update_kv_cache_positions_and_drop():
    rng = np.random.default_rng(2)
    cache, new = randn(rng, (3, 8, 2, 4), F32), randn(rng, (3, 3, 2, 4), F32)
    lens = jnp.array([0, 6, 8], jnp.int32)  # sequence 1 overflows by one row, sequence 2 by all of them
    out = np.asarray(jax_tk.decode.update_kv_cache(cache, new, lens))
    want = np.asarray(cache).copy()
    want[0, 0:3] = new[0]
    want[1, 6:8] = new[1, :2]
    np.testing.assert_array_equal(out, want)
    # paged: page_size 4, two pages per sequence; an entry -1 or past num_pages drops its rows
    pages = randn(rng, (5, 4, 2, 4), F32)
    table = jnp.array([[3, 1], [0, -1], [4, 9]], jnp.int32)
    lens = jnp.array([2, 3, 6], jnp.int32)
    out = np.asarray(jax_tk.decode.update_kv_cache(pages, new, lens, page_table=table))
    want = np.asarray(pages).copy()
    want[3, 2:4] = new[0, :2]
    want[1, 0] = new[0, 2]
    want[0, 3] = new[1, 0]  # positions 4, 5 of sequence 1 are in the unused slot -1: dropped
    # sequence 2: positions 6, 7 in page 9 (out of range): dropped; 8 past the table: dropped
    np.testing.assert_array_equal(out, want)


def test_update_kv_cache_donated():
    """Under jit with the cache donated XLA may update in place; the result is the same either way."""
    rng = np.random.default_rng(3)
    cache, new = randn(rng, (2, 32, 2, 64), BF16), randn(rng, (2, 4, 2, 64), BF16)
    want = np.asarray(cache.astype(F32)).copy()
    want[0, 5:9], want[1, 20:24] = np.asarray(new[0].astype(F32)), np.asarray(new[1].astype(F32))
    step = jax.jit(jax_tk.decode.update_kv_cache, donate_argnums=0)
    out = step(cache, new, jnp.array([5, 20], jnp.int32))
    np.testing.assert_array_equal(np.asarray(out.astype(F32)), want)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("kind", ["scan", "while_loop"])
def test_decoding_loop_donated(kind, paged):
    """A jitted lax.scan / lax.while_loop of decode steps: caches (donated) and traced lengths carried,
    one new token per step."""
    rng = np.random.default_rng(4)
    b, n, kh, h, s, steps, page_size = 2, 4, 2, 32, 32, 5, 16
    start = np.array([3, 11])
    seq_k, seq_v = randn(rng, (b, s, kh, h), F32), randn(rng, (b, s, kh, h), F32)
    qs = randn(rng, (steps, b, 1, n, h), F32)
    new_k = jnp.stack([jnp.stack([seq_k[i, start[i] + j] for i in range(b)]) for j in range(steps)])[:, :, None]
    new_v = jnp.stack([jnp.stack([seq_v[i, start[i] + j] for i in range(b)]) for j in range(steps)])[:, :, None]
    kc, vc = poison_past(seq_k, start), poison_past(seq_v, start)
    table = None
    if paged:
        kc, vc, table = to_pages(rng, kc, vc, page_size)

    def step(kc, vc, lens, q, nk, nv, table):
        kc = jax_tk.decode.update_kv_cache(kc, nk, lens, page_table=table)
        vc = jax_tk.decode.update_kv_cache(vc, nv, lens, page_table=table)
        lens = lens + 1
        return kc, vc, lens, jax_tk.decode.attention(q, kc, vc, lens, page_table=table)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def run(kc, vc, lens, qs, new_k, new_v, table):
        if kind == "scan":
            def body(carry, xs):
                *carry, out = step(*carry, *xs, table)
                return tuple(carry), out
            (kc, vc, lens), outs = jax.lax.scan(body, (kc, vc, lens), (qs, new_k, new_v))
            return kc, vc, lens, outs

        def body(c):
            i, kc, vc, lens, outs = c
            kc, vc, lens, out = step(kc, vc, lens, qs[i], new_k[i], new_v[i], table)
            return i + 1, kc, vc, lens, outs.at[i].set(out)
        _, kc, vc, lens, outs = jax.lax.while_loop(lambda c: c[0] < qs.shape[0], body,
                                                    (0, kc, vc, lens, jnp.zeros_like(qs)))
        return kc, vc, lens, outs

    kc_in, vc_in = kc, vc
    kc, vc, lens, outs = run(kc, vc, jnp.asarray(start, jnp.int32), qs, new_k, new_v, table)
    assert kc_in.is_deleted() and vc_in.is_deleted()  # donated: XLA reused their buffers
    np.testing.assert_array_equal(np.asarray(lens), start + steps)
    for j in range(steps):
        ref = numpy_decode(qs[j], seq_k, seq_v, start + j + 1, 1 / np.sqrt(h))
        assert rel_err(outs[j], ref) < 1e-5
    # the cache holds the sequences up to their new lengths
    full_k = kc if not paged else jax_tk.decode.reference.gather_pages(kc, table)
    for i in range(b):
        np.testing.assert_array_equal(np.asarray(full_k[i, :start[i] + steps]), np.asarray(seq_k[i, :start[i] + steps]))


@needs_extension
def test_block_rows_and_splits():
    """The grid's arithmetic (cc/decode/decode.h's block_rows, through the extension): a thread block
    takes the fewest 16 x 2^k of a sequence's query rows per KV head that hold them, at most 128, and
    the parts fill one wave of 132 blocks."""
    from jax_tk.decode import launch

    assert [launch.formulas().block_rows(r) for r in (1, 4, 16, 17, 20, 32, 33, 64, 65, 128, 256)] == \
        [16, 16, 16, 32, 32, 32, 64, 64, 128, 128, 128]
    # 8 sequences x 8 KV heads x one block of 64 rows (4 query heads x 16 new tokens): 2 parts
    assert launch.splits(8, 16, 32, 8, 32768) == 2
    assert launch.splits(8, 16, 64, 8, 32768) == 2  # 128 rows: one block
    assert launch.splits(8, 32, 64, 8, 32768) == 1  # 256 rows: two blocks per KV head, 128 blocks
    assert launch.splits(1, 1, 32, 8, 2048) == 16   # at most 2048 / 128 parts
    # A grid of a wave or more (32 x 8 blocks of 4 rows): parts of SPLIT_UNIT_KEYS positions, from two
    # units of capacity on (a batch of uneven lengths balances over the SMs)
    unit = launch.SPLIT_UNIT_KEYS
    assert launch.splits(32, 1, 32, 8, 4 * unit) == 4
    assert launch.splits(32, 1, 32, 8, 4 * unit + unit // 2) == 4
    assert launch.splits(32, 1, 32, 8, 2 * unit - 1) == 1
    assert launch.splits(16, 1, 32, 8, 8 * unit) == 8  # 128 blocks: over half a wave
    assert launch.splits(64, 1, 32, 8, 1 << 20) == launch.contract()["MAX_SPLITS"]
    assert launch.splits(32, 16, 64, 8, 4 * unit) == 1  # 128 rows per KV head: the Hopper kernel's blocks
    assert launch.splits(256, 1, 16, 1, 4 * unit, 576) == 1  # MLA


def test_implementation():
    rng = np.random.default_rng(5)
    q, k = randn(rng, (1, 1, 2, 16), F32), randn(rng, (1, 8, 2, 16), F32)
    lens = jnp.array([5], jnp.int32)
    a = jax_tk.decode.attention(q, k, k, lens)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(jax_tk.decode.attention(q, k, k, lens, implementation="xla")))
    with pytest.raises((RuntimeError, ValueError), match=r"implementation='tk'.*(CUDA|GPU|dtype)"):
        jax_tk.decode.attention(q, k, k, lens, implementation="tk")
    with pytest.raises(ValueError, match="implementation"):
        jax_tk.decode.attention(q, k, k, lens, implementation="cudnn")


# ----------------------------------------------------------------------------------------------
# Input checks: each bad argument raises at trace time, naming it
# ----------------------------------------------------------------------------------------------

_R = np.random.default_rng(6)
_Q, _K = randn(_R, (2, 4, 4, 16), F32), randn(_R, (2, 32, 2, 16), F32)
_PAGES, _TABLE = randn(_R, (6, 16, 2, 16), F32), jnp.array([[0, 1], [2, 3]], jnp.int32)
_LENS = jnp.array([5, 9], jnp.int32)

ATTENTION_ERRORS = [
    (dict(query=[[1.0]]), TypeError, "query must be an array"),
    (dict(query=_Q[0]), ValueError, "query must have rank 4"),
    (dict(query=_Q.astype(jnp.int32)), TypeError, "query must be bfloat16"),
    (dict(query=_Q[:, :, :0]), ValueError, "query has an empty dimension"),
    (dict(key_cache=_K[0]), ValueError, "key_cache must have rank 4"),
    (dict(value_cache=_K[:, :16]), ValueError, "same shape and dtype"),
    (dict(key_cache=_K.astype(BF16), value_cache=_K.astype(BF16)), TypeError, "query's dtype"),
    (dict(key_cache=_K[:1], value_cache=_K[:1]), ValueError, "batch of key_cache/value_cache"),
    (dict(key_cache=_K[..., :8], value_cache=_K[..., :8], query=_Q[..., :8].astype(F16)), TypeError, "query's dtype"),
    (dict(key_cache=randn(_R, (2, 32, 2, 8), F32), value_cache=randn(_R, (2, 32, 2, 8), F32)), ValueError, "head_dim"),
    (dict(key_cache=randn(_R, (2, 32, 3, 16), F32), value_cache=randn(_R, (2, 32, 3, 16), F32)), ValueError,
     "multiple of the number of key/value heads"),
    (dict(query=randn(_R, (2, 40, 4, 16), F32)), ValueError, "T_new"),
    (dict(cache_lengths=jnp.array([1.0, 2.0])), TypeError, "cache_lengths must have an integer dtype"),
    (dict(cache_lengths=jnp.array([1, 2, 3])), ValueError, "cache_lengths must have shape"),
    (dict(cache_lengths=5), TypeError, "cache_lengths must be an array"),
    (dict(key_cache=_PAGES, value_cache=_PAGES, page_table=_TABLE.astype(F32)), TypeError, "page_table must have an integer"),
    (dict(key_cache=_PAGES, value_cache=_PAGES, page_table=_TABLE[0]), ValueError, "page_table must have rank 2"),
    (dict(key_cache=_PAGES, value_cache=_PAGES, page_table=_TABLE[:1]), ValueError, "page_table must have shape"),
    (dict(key_cache=_PAGES, value_cache=_PAGES, page_table=_TABLE[:, :0]), ValueError, "max_pages >= 1"),
    (dict(key_cache=_PAGES[:, :0], value_cache=_PAGES[:, :0], page_table=_TABLE), ValueError, "empty dimension"),
    (dict(query=randn(_R, (2, 33, 4, 16), F32), key_cache=_PAGES, value_cache=_PAGES, page_table=_TABLE),
     ValueError, r"T_new \(33\) must be <= max_pages \* page_size \(32\)"),
    (dict(scale=-1.0), ValueError, "scale must be a positive"),
    (dict(scale=1e39), ValueError, "finite and nonzero in float32"),
    (dict(scale="1"), TypeError, "scale must be a Python float"),
    (dict(is_causal=1), TypeError, "is_causal must be a bool"),
    (dict(local_window_size=-1), ValueError, "local_window_size"),
    (dict(local_window_size=(1, 2, 3)), ValueError, "local_window_size"),
    (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap must be a positive"),
    (dict(logits_soft_cap=1e-50), ValueError, "finite and nonzero in float32"),
    (dict(implementation="pallas"), ValueError, "implementation must be one of"),
]


@pytest.mark.parametrize("bad,error,match", ATTENTION_ERRORS, ids=[e[2] + str(i) for i, e in enumerate(ATTENTION_ERRORS)])
def test_attention_errors(bad, error, match):
    args = dict(query=_Q, key_cache=_K, value_cache=_K, cache_lengths=_LENS)
    args.update(bad)
    with pytest.raises(error, match=match):
        jax_tk.decode.attention(args.pop("query"), args.pop("key_cache"), args.pop("value_cache"),
                                args.pop("cache_lengths"), **args)


def test_paged_t_new_not_bounded_by_page_size():
    """Paged: T_new may exceed one page (the limit is the table's capacity, positions past it drop)."""
    out = jax_tk.decode.attention(randn(_R, (2, 20, 4, 16), F32), _PAGES, _PAGES, jnp.array([20, 30], jnp.int32),
                                  page_table=_TABLE)
    assert np.isfinite(np.asarray(out)).all()


_NEW = randn(_R, (2, 3, 2, 16), F32)
UPDATE_ERRORS = [
    (dict(cache=[1.0]), TypeError, "must be arrays"),
    (dict(new=_NEW[0]), ValueError, "new must have rank 4"),
    (dict(new=_NEW.astype(BF16)), TypeError, "new must have the cache's dtype"),
    (dict(new=_NEW[..., :8]), ValueError, "kv_heads, head_dim"),
    (dict(cache=_K[:1]), ValueError, "batch of cache"),
    (dict(cache=_K[:, :2]), ValueError, "T_new"),
    (dict(cache_lengths=jnp.array([1.5, 2.5])), TypeError, "cache_lengths must have an integer dtype"),
    (dict(cache_lengths=jnp.array([1])), ValueError, "cache_lengths must have shape"),
    (dict(cache=_PAGES, page_table=_TABLE.astype(F32)), TypeError, "page_table must have an integer"),
    (dict(cache=_PAGES, page_table=_TABLE[:1]), ValueError, "page_table must have shape"),
    (dict(cache=_PAGES, page_table=_TABLE, new=randn(_R, (2, 33, 2, 16), F32)), ValueError, "max_pages \\* page_size"),
]


@pytest.mark.parametrize("bad,error,match", UPDATE_ERRORS, ids=[e[2] + str(i) for i, e in enumerate(UPDATE_ERRORS)])
def test_update_errors(bad, error, match):
    args = dict(cache=_K, new=_NEW, cache_lengths=_LENS)
    args.update(bad)
    with pytest.raises(error, match=match):
        jax_tk.decode.update_kv_cache(args.pop("cache"), args.pop("new"), args.pop("cache_lengths"), **args)


def test_int64_lengths_and_table_under_x64():
    """64-bit lengths and page tables are taken (as int32 positions) with the same result."""
    with jax.enable_x64(True):
        lens64, table64 = jnp.asarray(np.array([5, 9]), jnp.int64), jnp.asarray(np.array([[0, 1], [2, 3]]), jnp.int64)
        a = jax_tk.decode.attention(_Q, _PAGES, _PAGES, lens64, page_table=table64)
        c = jax_tk.decode.update_kv_cache(_PAGES, _NEW, lens64, page_table=table64)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(jax_tk.decode.attention(_Q, _PAGES, _PAGES, _LENS,
                                                                                    page_table=_TABLE)))
    np.testing.assert_array_equal(np.asarray(c), np.asarray(jax_tk.decode.update_kv_cache(_PAGES, _NEW, _LENS,
                                                                                         page_table=_TABLE)))


def test_wide_lengths_saturate():
    """numpy int64 (x64 off: jnp would wrap them to int32) and uint32 lengths past int32 mean "past the
    end of the cache", never a wrapped small or negative length."""
    cap = _K.shape[1]
    for wide in (np.array([2 ** 33, 2 ** 32 + 2]), np.array([2 ** 32 - 1, 2 ** 31], np.uint32)):
        np.testing.assert_array_equal(np.asarray(jax_tk.decode.update_kv_cache(_K, _NEW, wide)), np.asarray(_K))
        np.testing.assert_array_equal(np.asarray(jax_tk.decode.attention(_Q, _K, _K, wide, is_causal=False)),
                                      np.asarray(jax_tk.decode.attention(_Q, _K, _K, jnp.array([cap, cap]),
                                                                         is_causal=False)))


def test_lengths_past_capacity_with_a_wide_window():
    """Positions count from the length as given, also past the cache's capacity: a window wider than
    that distance bounds nothing."""
    q, k = _Q[:1, :1], _K[:1, :12]
    lens = jnp.array([20], jnp.int32)
    for window in ((100, 0), (13, 0), (8, 0)):
        out = jax_tk.decode.attention(q, k, k, lens, local_window_size=window)
        assert rel_err(out, numpy_decode(q, k, k, [20], 1 / 4, True, window)) < 1e-5


def test_empty_batch_and_no_new_tokens():
    lens = _LENS
    assert jax_tk.decode.attention(_Q[:0], _K[:0], _K[:0], lens[:0]).shape == (0,) + _Q.shape[1:]
    out = jax.jit(jax_tk.decode.attention)(_Q[:, :0], _K, _K, lens)
    assert out.shape == (2, 0) + _Q.shape[2:]
    assert jax_tk.decode.update_kv_cache(_K, _NEW[:, :0], lens) is _K
    assert jax_tk.decode.update_kv_cache(_PAGES, _NEW[:0], lens[:0], page_table=_TABLE[:0]) is _PAGES


def test_page_outside_the_pool_reads_zeros():
    """A table entry outside [0, num_pages) within a sequence's length reads as a page of zeros (as in
    the kernel), on every path; never a wrapped or clamped page."""
    table = jnp.array([[0, -1], [7, 3]], jnp.int32)
    out = jax_tk.decode.attention(_Q, _PAGES, _PAGES, jnp.array([30, 32]), page_table=table, is_causal=False)
    zero = jnp.zeros_like(_PAGES[0])
    kb = jnp.stack([jnp.concatenate([_PAGES[0], zero]), jnp.concatenate([zero, _PAGES[3]])])
    want = jax_tk.decode.attention(_Q, kb, kb, jnp.array([30, 32]), is_causal=False)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype,h", [(F32, 16), (BF16, 64)], ids=["f32", "bf16_kernel_shape"])
def test_gradients(paged, dtype, h):
    """Differentiable in the query and both caches, under jit too, where the kernel takes the forward
    (bfloat16, head_dim 64: on CUDA the kernel, elsewhere the same custom_vjp around the reference): the
    gradient is the reference's."""
    rng = np.random.default_rng(3)
    q, k, v = randn(rng, (2, 3, 4, h), dtype), randn(rng, (2, 32, 2, h), dtype), randn(rng, (2, 32, 2, h), dtype)
    lens, table = jnp.array([7, 32], jnp.int32), None
    if paged:
        k, v, table = to_pages(rng, k, v, 16, extra_pages=0)
    def loss(q, k, v, implementation=None):
        out = jax_tk.decode.attention(q, k, v, lens, page_table=table, local_window_size=(20, 0),
                                      logits_soft_cap=30.0, implementation=implementation)
        return jnp.sum(out.astype(F32) * jnp.arange(h, dtype=F32))
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(functools.partial(loss, implementation="xla"), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.shape == w.shape
        assert rel_err(g, w) < 1e-6
    if dtype == F32:  # the reference's gradient against finite differences
        f = lambda x: loss(x, k, v, "xla")
        d = randn(rng, q.shape, F32)
        eps = 1e-3
        fd = (f(q + eps * d) - f(q - eps * d)) / (2 * eps)
        np.testing.assert_allclose(float(jnp.vdot(got[0], d)), float(fd), rtol=2e-3)
