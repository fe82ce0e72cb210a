"""CPU tests of jax_tk.decode.mla_attention (multi-head latent attention over one latent cache; the
reference path, the only one so far): against a dense float32 oracle written here (explicit position
masks, naive softmax), contiguous vs paged caches (page sizes 16/64/256, shuffled tables), ragged
lengths including 0 and shorter than T_new, T_new 1..8, 16 and 128 query heads, v_head_dim 512 and
smaller, default and given scale, non-causal, the log-sum-exp, gradients in the query and the cache,
jit/vmap, the implementation= choice, the CUDA lowering, every input check, and update_kv_cache on the
latent cache. (Several devices: test_mla_sharding.py.)"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from helpers import needs_extension, randn, rel_err
from jax_tk.decode import mla
from test_decode import poison_past, to_pages

BF16, F32 = jnp.bfloat16, jnp.float32
HI = jax.lax.Precision.HIGHEST
TOL = {F32: 1e-5, BF16: 1e-2}


@functools.partial(jax.jit, static_argnames=("scale", "v_head_dim", "is_causal"))
def oracle(q, cache, lengths, scale, v_head_dim, is_causal=True):
    """(out [B, T, N, v_head_dim], lse [B, N, T]) in float32, densely: every query head against the one
    latent head, keys = the rows, values = their first v_head_dim dims. Row i of sequence b is at
    p = lengths[b] - T + i and sees keys j < lengths[b] (and j <= p if causal, and none if p < 0); a
    row that sees no key gives 0 and lse -inf. ``cache`` [B, S, 1, D] must be finite everywhere."""
    lengths = jnp.asarray(lengths)
    b, t, n, d = q.shape
    s = cache.shape[1]
    p = lengths[:, None] - t + jnp.arange(t)[None, :]  # [B, T]
    j = jnp.arange(s)[None, None, :]
    visible = (j < lengths[:, None, None]) & (p[:, :, None] >= 0)
    if is_causal:
        visible &= j <= p[:, :, None]
    rows = cache[:, :, 0].astype(F32)  # [B, S, D]
    logits = jnp.einsum("btnd,bsd->bnts", q.astype(F32), rows, precision=HI) * scale
    logits = jnp.where(visible[:, None], logits, -1e30)  # (finite: an empty row's weights are zeroed below)
    m = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.exp(logits - m)
    weights = e / jnp.sum(e, axis=-1, keepdims=True)
    seen = visible.any(axis=-1)[:, None, :]  # [B, 1, T]
    weights = jnp.where(seen[..., None], weights, 0.0)
    out = jnp.einsum("bnts,bse->btne", weights, rows[..., :v_head_dim], precision=HI)
    lse = jnp.where(seen, m[..., 0] + jnp.log(jnp.sum(e, axis=-1)), -jnp.inf)
    return out, lse


@functools.partial(jax.jit, static_argnames=("v_head_dim", "scale", "is_causal"))
def _mla(q, cache, lengths, page_table=None, v_head_dim=512, scale=None, is_causal=True):
    return jax_tk.decode.mla_attention_with_lse(q, cache, lengths, page_table=page_table, v_head_dim=v_head_dim,
                                                scale=scale, is_causal=is_causal)


def _inputs(seed, b, t, n, d, s, dtype=F32):
    rng = np.random.default_rng(seed)
    return rng, randn(rng, (b, t, n, d), dtype), randn(rng, (b, s, 1, d), dtype)


# (B, T_new, heads, D, v_head_dim, page_size, lengths, is_causal, scale, dtype): lengths 0, < T_new (rows
# before the start), odd, full; DeepSeek's 576/512 with 16 and 128 heads; smaller dims.
CASES = [
    (3, 1, 16, 576, 512, 16, (0, 1, 37), True, None, F32),
    (2, 4, 128, 576, 512, 64, (3, 100), True, None, F32),
    (2, 2, 16, 576, 512, 256, (129, 256), True, None, F32),
    (3, 3, 16, 576, 64, 16, (0, 5, 31), False, None, F32),
    (2, 4, 16, 96, 64, 16, (2, 47), True, 0.07, F32),
    (1, 8, 16, 64, 64, 16, (20,), True, None, F32),
    (2, 4, 32, 576, 512, 64, (17, 70), True, None, BF16),
]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"case{i}" for i in range(len(CASES))])
def test_against_oracle_contiguous_and_paged(case):
    b, t, n, d, dv, page_size, lengths, causal, scale, dtype = CASES[case]
    s = page_size * -(-max(lengths) // page_size)  # a multiple of page_size, >= every length
    rng, q, cache = _inputs(case, b, t, n, d, s, dtype)
    lens = jnp.asarray(lengths, jnp.int32)
    want, want_lse = oracle(q, cache, lens, d ** -0.5 if scale is None else scale, dv, causal)
    poisoned = poison_past(cache, np.array(lengths))
    out, lse = _mla(q, poisoned, lens, v_head_dim=dv, scale=scale, is_causal=causal)
    assert out.shape == (b, t, n, dv) and out.dtype == dtype and lse.shape == (b, n, t) and lse.dtype == F32
    assert np.isfinite(np.asarray(out.astype(F32))).all()
    assert rel_err(out, want) < TOL[dtype]
    np.testing.assert_array_equal(np.isinf(np.asarray(lse)), np.isinf(np.asarray(want_lse)))
    finite = np.isfinite(np.asarray(want_lse))
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite], rtol=1e-5, atol=1e-5)
    # rows with no key (length 0, or p < 0) are exactly 0
    for bi, length in enumerate(lengths):
        for i in range(t):
            if length - t + i < 0:
                assert not np.asarray(out[bi, i].astype(F32)).any()
    # paged, pages shuffled (and stray NaN pages no table names): the same computation on the gathered
    # cache, so the same numbers
    pool, _, table = to_pages(rng, poisoned, poisoned, page_size)
    paged, paged_lse = _mla(q, pool, lens, table, v_head_dim=dv, scale=scale, is_causal=causal)
    np.testing.assert_array_equal(np.asarray(paged.astype(F32)), np.asarray(out.astype(F32)))
    np.testing.assert_array_equal(np.asarray(paged_lse), np.asarray(lse))


def test_values_are_the_first_dims():
    """The output is attention with keys = the rows and values = their first v_head_dim dims, i.e.
    decode.attention over (cache, cache[..., :v_head_dim]) zero-padded to the key dims."""
    _, q, cache = _inputs(7, 2, 2, 16, 96, 32)
    lens = jnp.array([9, 32], jnp.int32)
    out = _mla(q, cache, lens, v_head_dim=48)[0]
    values = jnp.concatenate([cache[..., :48], jnp.zeros_like(cache[..., 48:])], axis=-1)
    want = jax.jit(jax_tk.decode.attention)(q, cache, values, lens)[..., :48]
    assert rel_err(out, want) < 1e-6


def test_gradients():
    """Gradients in the query and the latent cache (contiguous and paged; through out and lse) equal the
    oracle's; the cache's sums its use as keys and as values. None in lengths or table."""
    b, t, n, d, dv, page_size = 3, 2, 16, 576, 512, 16
    rng, q, cache = _inputs(8, b, t, n, d, 32)
    lens = jnp.array([0, 7, 32], jnp.int32)
    w_out, w_lse = randn(rng, (b, t, n, dv), F32), randn(rng, (b, n, t), F32)

    def loss(out, lse):
        return jnp.sum(out * w_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse)

    got = jax.jit(jax.grad(lambda q, c: loss(*jax_tk.decode.mla_attention_with_lse(q, c, lens)), argnums=(0, 1)))(
        q, cache)
    want = jax.jit(jax.grad(lambda q, c: loss(*oracle(q, c, lens, d ** -0.5, dv)), argnums=(0, 1)))(q, cache)
    for g, w in zip(got, want):
        assert g.shape == w.shape and rel_err(g, w) < 1e-5
    pool, _, table = to_pages(rng, cache, cache, page_size, extra_pages=0)

    def oracle_paged(q, pool):  # the pool read through the table with numpy-style indexing
        return oracle(q, pool[table].reshape(b, -1, 1, d), lens, d ** -0.5, dv)

    got = jax.jit(jax.grad(lambda q, p: loss(*jax_tk.decode.mla_attention_with_lse(q, p, lens, page_table=table)),
                           argnums=(0, 1)))(q, pool)
    want = jax.jit(jax.grad(lambda q, p: loss(*oracle_paged(q, p)), argnums=(0, 1)))(q, pool)
    for g, w in zip(got, want):
        assert g.shape == w.shape and rel_err(g, w) < 1e-5


def test_vmap_and_jit():
    """vmap over several queries against one cache, and over whole calls, equals one call per entry."""
    _, q, cache = _inputs(9, 2, 1, 16, 64, 32)
    qs = jnp.stack([q, 2 * q, -q])
    lens = jnp.array([5, 30], jnp.int32)
    f = jax.jit(lambda q, c, l: jax_tk.decode.mla_attention(q, c, l, v_head_dim=64))
    got = jax.jit(jax.vmap(f, in_axes=(0, None, None)))(qs, cache, lens)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(got[i]), np.asarray(f(qs[i], cache, lens)), rtol=1e-6, atol=1e-6)
    caches, all_lens = jnp.stack([cache, cache[::-1]]), jnp.array([[5, 30], [0, 12]], jnp.int32)
    got = jax.jit(jax.vmap(f))(qs[:2], caches, all_lens)
    for i in range(2):
        np.testing.assert_allclose(np.asarray(got[i]), np.asarray(f(qs[i], caches[i], all_lens[i])), rtol=1e-6,
                                   atol=1e-6)


def test_implementation():
    _, q, cache = _inputs(10, 1, 1, 16, 64, 16)
    lens = jnp.array([9], jnp.int32)
    a, b = jax.jit(lambda q, c, l: [jax_tk.decode.mla_attention(q, c, l, v_head_dim=32, implementation=i)
                                    for i in (None, "xla")])(q, cache, lens)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match=r"mla_attention\(implementation='tk'\).*head dims \(64, 32\)"):
        jax_tk.decode.mla_attention(q, cache, lens, v_head_dim=32, implementation="tk")
    with pytest.raises(ValueError, match="implementation must be one of"):
        jax_tk.decode.mla_attention(q, cache, lens, v_head_dim=32, implementation="cuda")


def test_cuda_lowering_without_the_kernel(monkeypatch):
    """Lowered for CUDA where the kernel does not run (no H100/H200 here, as the patch makes it on any
    machine), implementation=None is the reference: plain XLA, no custom call."""
    monkeypatch.setattr(mla.extension, "cuda_device_capability", lambda: None)
    sds = jax.ShapeDtypeStruct
    args = (sds((2, 1, 16, 576), BF16), sds((8, 64, 1, 576), BF16), sds((2,), jnp.int32), sds((2, 4), jnp.int32))
    fn = jax.jit(lambda q, c, l, t: jax_tk.decode.mla_attention(q, c, l, page_table=t))
    text = jax.export.export(fn, platforms=["cuda"])(*args).mlir_module()
    assert "custom_call" not in text
    assert "tensor<2x1x16x512xbf16>" in text


@needs_extension
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_cuda_lowering_of_the_kernel(paged):
    """The kernel's call, exported for CUDA: the decode target with the latent cache as both caches, the
    output 512 wide, and a workspace for the split count's parts of 512-wide rows."""
    sds = jax.ShapeDtypeStruct
    q, lens = sds((2, 1, 16, 576), BF16), sds((2,), jnp.int32)
    cache, table = (sds((8, 64, 1, 576), BF16), sds((2, 4), jnp.int32)) if paged else (sds((2, 256, 1, 576), BF16), None)
    spec = mla.MlaSpec(0.07, True, 512, True, 64 if paged else None)
    fn = jax.jit(lambda q, c, l, t: mla._kernel(spec, q, c, l, t, parts=3))
    check = jax.export.DisabledSafetyCheck.custom_call("jax_tk_decode")
    exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=[check])(q, cache, lens, table)
    assert [a.shape for a in exported.out_avals] == [(2, 1, 16, 512), (2, 16, 1)]
    call = re.search(r"@jax_tk_decode\((%[^,]+), (%[^,]+), (%[^,]+),.*?\) \{.*?\} : \((.*?)\) -> \((.*?)\)",
                     exported.mlir_module(), re.S)
    assert call.group(2) == call.group(3)  # the one latent cache as key_cache and value_cache
    words = 3 * 2 * 16 * (512 + 1)  # (decode.h's workspace_words at the values' width)
    assert re.findall(r"tensor<[^>]*>", call.group(5)) == ["tensor<2x1x16x512xbf16>", "tensor<2x16x1xf32>",
                                                           f"tensor<{words}xf32>"]


def test_empty_batch_and_no_new_tokens():
    _, q, cache = _inputs(11, 2, 2, 16, 64, 16)
    lens = jnp.array([3, 9], jnp.int32)
    out, lse = jax_tk.decode.mla_attention_with_lse(q[:0], cache[:0], lens[:0], v_head_dim=40)
    assert out.shape == (0, 2, 16, 40) and lse.shape == (0, 16, 2)
    out, lse = jax.jit(functools.partial(jax_tk.decode.mla_attention_with_lse, v_head_dim=40))(q[:, :0], cache, lens)
    assert out.shape == (2, 0, 16, 40) and lse.shape == (2, 16, 0)


# ----------------------------------------------------------------------------------------------
# update_kv_cache on the latent cache, then mla_attention: a decoding step
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_update_then_attend_donated(paged):
    """The latent cache is the one cache of MLA: update_kv_cache (one call, a single head of 576 dims)
    writes the new rows, in place under jit with the cache donated; mla_attention then equals the
    oracle over the whole sequences."""
    b, t, n, d, s, page_size = 2, 2, 16, 576, 64, 16
    rng, q, seq = _inputs(12, b, t, n, d, s)
    old = np.array([0, 45])
    new = jnp.stack([seq[i, old[i]:old[i] + t] for i in range(b)])  # [B, T, 1, D]
    cache, table = poison_past(seq, old), None
    if paged:
        cache, _, table = to_pages(rng, cache, cache, page_size)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(cache, q, new, lens):
        cache = jax_tk.decode.update_kv_cache(cache, new, lens, page_table=table)
        return cache, jax_tk.decode.mla_attention(q, cache, lens + new.shape[1], page_table=table)

    before = cache
    cache, out = step(cache, q, new, jnp.asarray(old, jnp.int32))
    assert before.is_deleted()
    assert rel_err(out, oracle(q, seq, old + t, d ** -0.5, 512)[0]) < 1e-5
    rows = cache if not paged else jax_tk.decode.reference.gather_pages(cache, table)
    for i in range(b):
        np.testing.assert_array_equal(np.asarray(rows[i, :old[i] + t]), np.asarray(seq[i, :old[i] + t]))


# ----------------------------------------------------------------------------------------------
# Input checks: each bad argument raises at trace time, naming it
# ----------------------------------------------------------------------------------------------

_R = np.random.default_rng(13)
_Q, _C = randn(_R, (2, 2, 16, 64), F32), randn(_R, (2, 32, 1, 64), F32)
_POOL, _TABLE = randn(_R, (6, 16, 1, 64), F32), jnp.array([[0, 1], [2, 3]], jnp.int32)
_LENS = jnp.array([5, 9], jnp.int32)

ERRORS = [
    (dict(query=[[1.0]]), TypeError, "query must be an array"),
    (dict(query=_Q[0]), ValueError, "query must have rank 4"),
    (dict(query=_Q.astype(jnp.int32)), TypeError, "query must be bfloat16"),
    (dict(query=_Q[:, :, :0]), ValueError, "query has an empty dimension"),
    (dict(latent_cache=_C[0]), ValueError, "latent_cache must have rank 4"),
    (dict(latent_cache=_C.astype(BF16)), TypeError, "latent_cache must have the query's dtype"),
    (dict(latent_cache=_C[..., :32]), ValueError, r"head_dim of latent_cache \(32\) != head_dim of query \(64\)"),
    (dict(latent_cache=jnp.concatenate([_C, _C], axis=2)), ValueError, "latent_cache must have one head"),
    (dict(latent_cache=_C[:1]), ValueError, "batch of latent_cache"),
    (dict(v_head_dim=65), ValueError, r"v_head_dim \(65\) must be in \[1, head_dim of query \(64\)\]"),
    (dict(v_head_dim=512), ValueError, r"v_head_dim \(512\)"),  # the default, with D = 64
    (dict(v_head_dim=0), ValueError, "v_head_dim"),
    (dict(v_head_dim=32.0), TypeError, "v_head_dim must be an int"),
    (dict(query=randn(_R, (2, 33, 16, 64), F32)), ValueError, "T_new"),
    (dict(cache_lengths=jnp.array([1.0, 2.0])), TypeError, "cache_lengths must have an integer dtype"),
    (dict(cache_lengths=jnp.array([1, 2, 3])), ValueError, "cache_lengths must have shape"),
    (dict(latent_cache=_POOL), ValueError, "pass page_table= for a paged one"),  # a pool without its table
    (dict(latent_cache=_POOL, page_table=_TABLE.astype(F32)), TypeError, "page_table must have an integer"),
    (dict(latent_cache=_POOL, page_table=_TABLE[0]), ValueError, "page_table must have rank 2"),
    (dict(latent_cache=_POOL, page_table=_TABLE[:1]), ValueError, "page_table must have shape"),
    (dict(query=randn(_R, (2, 33, 16, 64), F32), latent_cache=_POOL, page_table=_TABLE), ValueError,
     r"T_new \(33\) must be <= max_pages \* page_size \(32\)"),
    (dict(scale=-1.0), ValueError, "scale must be a positive"),
    (dict(is_causal=1), TypeError, "is_causal must be a bool"),
    (dict(implementation="pallas"), ValueError, "implementation must be one of"),
]


@pytest.mark.parametrize("bad,error,match", ERRORS, ids=[e[2] + str(i) for i, e in enumerate(ERRORS)])
def test_errors(bad, error, match):
    args = dict(query=_Q, latent_cache=_C, cache_lengths=_LENS, v_head_dim=48)
    args.update(bad)
    with pytest.raises(error, match=match):
        jax_tk.decode.mla_attention(args.pop("query"), args.pop("latent_cache"), args.pop("cache_lengths"), **args)
