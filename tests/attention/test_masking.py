"""Windows, packed sequences, padded lengths and logit soft-capping (CPU): values and gradients
against jax.nn.dot_product_attention and an independent float64 numpy implementation."""
import functools

import jax
from jax.test_util import check_grads
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from jax_tk.attention import reference
from helpers import needs_extension, rel_err

F32 = jnp.float32




def qkv(b=2, t=37, s=37, n=4, kh=2, d=32, seed=0, dtype=F32):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (b, t, n, d), dtype), jax.random.normal(ks[1], (b, s, kh, d), dtype),
            jax.random.normal(ks[2], (b, s, kh, d), dtype))


def numpy_attention(q, k, v, mask, scale, cap=None):
    """float64 softmax attention, head by head; mask [B, T, S]; rows with no visible key give 0."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, n, d = q.shape
    g = n // k.shape[2]
    out = np.zeros((b, t, n, d))
    lse = np.full((b, n, t), -np.inf)
    for bi in range(b):
        for h in range(n):
            logits = q[bi, :, h] @ k[bi, :, h // g].T * scale
            if cap is not None:
                logits = cap * np.tanh(logits / cap)
            for i in range(t):
                vis = mask[bi, i]
                if vis.any():
                    x = logits[i, vis]
                    m = x.max()
                    p = np.exp(x - m)
                    out[bi, i, h] = p @ v[bi, vis, h // g] / p.sum()
                    lse[bi, h, i] = m + np.log(p.sum())
    return out, lse


def grads(f, *args):
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * jnp.cos(jnp.arange(q.shape[-1]))), argnums=(0, 1, 2)))(*args)


@pytest.mark.parametrize("window", [(3, 2), (0, 0), (5, 0), 4])
@pytest.mark.parametrize("causal", [False, True])
def test_window_matches_jax_nn(window, causal):
    q, k, v = qkv()
    ours = functools.partial(jax_tk.attention, is_causal=causal, local_window_size=window)
    theirs = functools.partial(jax.nn.dot_product_attention, is_causal=causal, local_window_size=window,
                               implementation="xla")
    assert rel_err(jax.jit(ours)(q, k, v), jax.jit(theirs)(q, k, v)) < 1e-5
    for a, r in zip(grads(ours, q, k, v), grads(theirs, q, k, v)):
        assert rel_err(a, r) < 1e-4


def test_seq_lengths_match_jax_nn():
    q, k, v = qkv(b=3, t=20, s=29)
    ql = jnp.array([20, 7, 1], jnp.int32)
    kl = jnp.array([29, 3, 11], jnp.int32)
    ours = functools.partial(jax_tk.attention, query_seq_lengths=ql, key_value_seq_lengths=kl)
    theirs = functools.partial(jax.nn.dot_product_attention, query_seq_lengths=ql, key_value_seq_lengths=kl,
                               implementation="xla")
    out = jax.jit(ours)(q, k, v)
    assert rel_err(out, jax.jit(theirs)(q, k, v)) < 1e-5
    assert not np.asarray(out[1, 7:]).any() and not np.asarray(out[2, 1:]).any()  # padded rows are 0
    for a, r in zip(grads(ours, q, k, v), grads(theirs, q, k, v)):
        assert rel_err(a, r) < 1e-4


def segments(rng, b, n, parts):
    ids = np.zeros((b, n), np.int32)
    for i in range(b):
        cuts = np.sort(rng.choice(np.arange(1, n), parts - 1, replace=False))
        ids[i] = np.searchsorted(cuts, np.arange(n), side="right")
    return ids


@pytest.mark.parametrize("causal", [False, True])
def test_segment_ids_vs_numpy(causal):
    rng = np.random.default_rng(1)
    q, k, v = qkv(t=41, s=41)
    qs = segments(rng, 2, 41, 4)
    out, lse = jax.jit(functools.partial(jax_tk.attention_with_lse, is_causal=causal))(
        q, k, v, q_segment_ids=jnp.asarray(qs), kv_segment_ids=jnp.asarray(qs))
    mask = qs[:, :, None] == qs[:, None, :]
    if causal:
        mask &= np.tril(np.ones((41, 41), bool))[None]
    want, want_lse = numpy_attention(q, k, v, mask, 1 / np.sqrt(32))
    assert rel_err(out, want) < 1e-5
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-5)


def test_soft_cap_vs_numpy_and_gradients():
    q, k, v = qkv(t=19, s=23)
    q = q * 4.0  # large logits, where the cap matters
    out, lse = jax.jit(lambda q, k, v: jax_tk.attention_with_lse(q, k, v, logits_soft_cap=5.0))(q, k, v)
    want, want_lse = numpy_attention(q, k, v, np.ones((2, 19, 23), bool), 1 / np.sqrt(32), cap=5.0)
    assert rel_err(out, want) < 1e-5
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-5)
    f = lambda q, k, v: jax_tk.attention(q, k, v, logits_soft_cap=5.0)
    check_grads(f, (q[:1, :5], k[:1, :6], v[:1, :6]), order=1, modes=["rev"], atol=2e-2, rtol=2e-2)


def test_empty_rows_give_zero_and_no_nan():
    q, k, v = qkv(b=1, t=8, s=8)
    qs = jnp.array([[0, 0, 1, 1, 2, 2, 2, 3]], jnp.int32)
    ks = jnp.array([[0, 0, 1, 1, 1, 1, 1, 1]], jnp.int32)  # segments 2 and 3 have no keys
    f = lambda q, k, v: jax_tk.attention_with_lse(q, k, v, q_segment_ids=qs, kv_segment_ids=ks)
    out, lse = jax.jit(f)(q, k, v)
    assert not np.asarray(out[0, 4:]).any()
    assert np.all(np.isneginf(np.asarray(lse[0, :, 4:])))
    dq, dk, dv = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)[0]), argnums=(0, 1, 2)))(q, k, v)
    for g in (dq, dk, dv):
        assert np.all(np.isfinite(np.asarray(g)))
    assert not np.asarray(dq[0, 4:]).any()


@needs_extension
def test_masking_uses_the_kernel():
    """The kernels take every masking option: implementation=None lowers to them for CUDA, and "tk"
    is refused here only for want of a GPU/the compiled kernels, not for the options."""
    q, k, v = qkv(dtype=jnp.bfloat16, d=64)
    ids = jnp.zeros((2, 37), jnp.int32)
    kwargs = dict(local_window_size=8, q_segment_ids=ids, kv_segment_ids=ids, logits_soft_cap=20.0,
                  query_seq_lengths=jnp.array([37, 5], jnp.int32))
    f = jax.jit(lambda q, k, v: jax_tk.attention(q, k, v, **kwargs))
    text = f.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert "jax_tk_attention_fwd" in text
    if jax.default_backend() == "gpu":  # the kernel runs (its results: tests/attention/test_kernels_gpu.py)
        out = jax_tk.attention(q, k, v, implementation="tk", **kwargs)
        assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
        return
    with pytest.raises((RuntimeError, ValueError), match=r"implementation='tk'.*(CUDA|GPU)"):
        jax_tk.attention(q, k, v, implementation="tk", **kwargs)


def test_all_options_together_vs_numpy_and_gradients():
    """Causal + window + segments (with rows that see no key) + lengths + soft cap, grouped-query
    heads and cross attention, through the custom_vjp (the reference on CPU) against float64 numpy."""
    rng = np.random.default_rng(3)
    b, t, s = 2, 23, 31
    q, k, v = qkv(b=b, t=t, s=s)
    q = q * 3.0
    qs = rng.integers(0, 3, (b, t)).astype(np.int32)
    ks = rng.integers(1, 4, (b, s)).astype(np.int32)  # segment 0 of the queries has no key
    ql, kl = np.array([20, 0], np.int32), np.array([31, 17], np.int32)
    window, cap = (6, 4), 4.0
    kwargs = dict(is_causal=True, local_window_size=window, q_segment_ids=jnp.asarray(qs),
                  kv_segment_ids=jnp.asarray(ks), query_seq_lengths=jnp.asarray(ql),
                  key_value_seq_lengths=jnp.asarray(kl), logits_soft_cap=cap)
    out, lse = jax.jit(lambda q, k, v: jax_tk.attention_with_lse(q, k, v, **kwargs))(q, k, v)
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    mask = (j <= i) & (j >= i - window[0]) & (j <= i + window[1])
    mask = mask[None] & (qs[:, :, None] == ks[:, None, :]) & (i[None] < ql[:, None, None]) & (j[None] < kl[:, None, None])
    assert (~mask.any(-1)).any() and mask.any()  # some rows see nothing, some see something
    want, want_lse = numpy_attention(q, k, v, mask, 1 / np.sqrt(32), cap=cap)
    assert rel_err(out, want) < 1e-5
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-5)
    dq, dk, dv = grads(lambda q, k, v: jax_tk.attention(q, k, v, **kwargs), q, k, v)
    ref = lambda q, k, v: reference.attention(q, k, v, scale=1 / np.sqrt(32), **kwargs)
    for a, r in zip((dq, dk, dv), grads(ref, q, k, v)):
        assert np.all(np.isfinite(np.asarray(a)))
        assert rel_err(a, r) < 1e-5
    assert not np.asarray(dq)[~mask.any(-1)[:, :, None].repeat(4, 2)].any()  # rows that see nothing: dq = 0


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(local_window_size=-1), ValueError, "local_window_size"),
    (dict(local_window_size=(1, 2, 3)), ValueError, "local_window_size"),
    (dict(local_window_size=1.5), ValueError, "local_window_size"),
    (dict(q_segment_ids=jnp.zeros((2, 37), jnp.int32)), ValueError, "segment_ids"),
    (dict(q_segment_ids=jnp.zeros((2, 36), jnp.int32), kv_segment_ids=jnp.zeros((2, 37), jnp.int32)),
     ValueError, "q_segment_ids"),
    (dict(q_segment_ids=jnp.zeros((2, 37)), kv_segment_ids=jnp.zeros((2, 37))), TypeError, "q_segment_ids"),
    (dict(query_seq_lengths=jnp.zeros((3,), jnp.int32)), ValueError, "query_seq_lengths"),
    (dict(key_value_seq_lengths=[3, 4]), TypeError, "key_value_seq_lengths"),
    (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap="5"), TypeError, "logits_soft_cap"),
    (dict(kv_segment_ids=jnp.zeros((2, 37), jnp.int32)), ValueError, "segment_ids"),
    (dict(q_segment_ids=jnp.zeros((2, 37), jnp.int32), kv_segment_ids=jnp.zeros((2, 36), jnp.int32)),
     ValueError, "kv_segment_ids"),
    (dict(q_segment_ids=jnp.zeros((37,), jnp.int32), kv_segment_ids=jnp.zeros((37,), jnp.int32)),
     ValueError, "q_segment_ids"),
    (dict(q_segment_ids=[[0] * 37] * 2, kv_segment_ids=jnp.zeros((2, 37), jnp.int32)), TypeError, "q_segment_ids"),
    (dict(query_seq_lengths=jnp.zeros((2, 1), jnp.int32)), ValueError, "query_seq_lengths"),
    (dict(key_value_seq_lengths=jnp.zeros((2,), jnp.float32)), TypeError, "key_value_seq_lengths"),
    (dict(query_seq_lengths=jnp.zeros((2,), bool)), TypeError, "query_seq_lengths"),
    (dict(local_window_size=(2, -1)), ValueError, "local_window_size"),
    (dict(local_window_size=(True, 2)), ValueError, "local_window_size"),
    (dict(logits_soft_cap=float("inf")), ValueError, "logits_soft_cap"),
])
def test_masking_errors(kwargs, error, match):
    q, k, v = qkv()
    with pytest.raises(error, match=match):
        jax_tk.attention(q, k, v, **kwargs)


@pytest.mark.parametrize("n", [1, 63, 64, 65, 200])
def test_segment_ranges_per_64_rows(n):
    """The kernels skip blocks by these ranges: min and max id of every 64 rows, for any ids."""
    from jax_tk.attention.launch import segment_ranges

    ids = np.random.default_rng(n).integers(-5, 9, (3, n)).astype(np.int32)
    got = np.asarray(segment_ranges(jnp.asarray(ids)))
    groups = -(-n // 64)
    assert got.shape == (3, groups, 2)
    for g in range(groups):
        part = ids[:, 64 * g: 64 * (g + 1)]
        np.testing.assert_array_equal(got[:, g, 0], part.min(axis=1))
        np.testing.assert_array_equal(got[:, g, 1], part.max(axis=1))
