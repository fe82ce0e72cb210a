"""Attention sinks (``sinks=``) in jax_tk.attention, jax_tk.decode.attention and decode.mla_attention,
against the float32 references that take sinks inside their softmax (outputs, log-sum-exp, and the
gradients in every input and in the sinks). On a CUDA GPU the same checks run the kernels."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
import helpers
from jax_tk.attention import reference as attention_reference
from jax_tk.decode import reference as decode_reference

ON_GPU = bool(helpers.cuda_devices())
IMPLEMENTATIONS = ["xla"] + (["tk"] if ON_GPU else [])


def _sinks(n, seed=3):
    # Some near the logits' scale, one large (the sink takes most of the weight), one -inf (no sink).
    s = np.random.default_rng(seed).normal(size=n).astype(np.float32)
    s[0], s[-1] = 6.0, -np.inf
    return jnp.asarray(s)


def _check(got, want, tol):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.all(np.isfinite(g) == np.isfinite(w))
        fin = np.isfinite(w)
        assert helpers.rel_err(g[fin], w[fin], floor=1e-3) < tol


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("causal,gqa", [(True, False), (False, True)])
def test_attention_sinks(implementation, causal, gqa):
    dtype = jnp.bfloat16 if implementation == "tk" else jnp.float32
    b, t, s, n, d = 2, 77, 93, 4, 64
    q, k, v, dout, dlse = helpers.attention_inputs(0, b, t, s, n, 2 if gqa else n, d, dtype, cotangents=True,
                                                   cotangent_dtype=jnp.float32)
    sinks = _sinks(n)
    lengths = jnp.array([t, 30], jnp.int32)  # rows past 30 of the second entry see no key

    def ours(q, k, v, sinks):
        return jax_tk.attention_with_lse(q, k, v, is_causal=causal, sinks=sinks, implementation=implementation,
                                         query_seq_lengths=lengths, key_value_seq_lengths=lengths)

    def ref(q, k, v, sinks):
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
        return attention_reference.attention_with_lse(q, k, v, scale=d ** -0.5, is_causal=causal, sinks=sinks,
                                                      query_seq_lengths=lengths, key_value_seq_lengths=lengths)

    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    out, vjp = jax.vjp(jax.jit(ours), q, k, v, sinks)
    out_ref, vjp_ref = jax.vjp(ref, q, k, v, sinks)
    _check(out, out_ref, tol)
    np.testing.assert_allclose(np.asarray(out[1][1, :, 40:]),  # no key: lse = the sink
                               np.broadcast_to(np.asarray(sinks)[:, None], (n, t - 40)), rtol=1e-6)
    _check(vjp((dout.astype(dtype), dlse)), vjp_ref((dout.astype(jnp.float32), dlse)), tol)
    # The sinks change the result (the test would see them dropped).
    plain = jax.jit(functools.partial(ours, sinks=None))(q, k, v)
    assert helpers.rel_err(plain[0], out[0]) > 0.05


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_decode_sinks(implementation):
    dtype = jnp.bfloat16 if implementation == "tk" else jnp.float32
    b, t_new, n, kh, d, s_max = 3, 2, 8, 2, 128, 700
    rng = np.random.default_rng(1)
    q = helpers.randn(rng, (b, t_new, n, d), dtype)
    kc, vc = helpers.randn(rng, (b, s_max, kh, d), dtype), helpers.randn(rng, (b, s_max, kh, d), dtype)
    lengths = jnp.array([700, 0, 513], jnp.int32)
    sinks = _sinks(n)

    def ours(q, kc, vc, sinks):
        return jax_tk.decode.attention_with_lse(q, kc, vc, lengths, sinks=sinks, implementation=implementation)

    def ref(q, kc, vc, sinks):
        q, kc, vc = (x.astype(jnp.float32) for x in (q, kc, vc))
        return decode_reference.attention_with_lse(q, kc, vc, lengths, scale=d ** -0.5, sinks=sinks)

    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    out, vjp = jax.vjp(jax.jit(ours), q, kc, vc, sinks)
    out_ref, vjp_ref = jax.vjp(ref, q, kc, vc, sinks)
    _check(out, out_ref, tol)
    assert np.all(np.asarray(out[0][1]) == 0)  # a length of 0 gives 0
    ct = (helpers.randn(rng, out[0].shape, jnp.float32), helpers.randn(rng, out[1].shape, jnp.float32))
    _check(vjp((ct[0].astype(dtype), ct[1])), vjp_ref(ct), tol)


def test_mla_sinks():
    b, t_new, n, d, dv = 2, 3, 16, 96, 64
    rng = np.random.default_rng(2)
    q, cache = helpers.randn(rng, (b, t_new, n, d), jnp.float32), helpers.randn(rng, (b, 50, 1, d), jnp.float32)
    lengths = jnp.array([50, 7], jnp.int32)
    sinks = _sinks(n)
    got = jax_tk.decode.mla_attention_with_lse(q, cache, lengths, v_head_dim=dv, sinks=sinks)
    want = decode_reference.mla_attention_with_lse(q, cache, lengths, scale=d ** -0.5, v_head_dim=dv, sinks=sinks)
    _check(got, want, 1e-5)
    g = jax.grad(lambda s: jax_tk.decode.mla_attention(q, cache, lengths, v_head_dim=dv, sinks=s).sum())(sinks)
    g_ref = jax.grad(lambda s: decode_reference.mla_attention_with_lse(
        q, cache, lengths, scale=d ** -0.5, v_head_dim=dv, sinks=s)[0].sum())(sinks)
    _check(g, g_ref, 1e-5)


def test_sinks_errors():
    q = jnp.ones((1, 8, 4, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"sinks must have shape \[q_heads\] = \(4,\)"):
        jax_tk.attention(q, q, q, sinks=jnp.zeros((2,)))
    with pytest.raises(TypeError, match="sinks must be a float array"):
        jax_tk.attention(q, q, q, sinks=jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="sinks are not supported"):
        jax_tk.attention(q, q, q, sinks=jnp.zeros((4,)), implementation="cudnn")
    with pytest.raises(ValueError, match=r"sinks must have shape \[q_heads\]"):
        jax_tk.decode.attention(q[:, :1], q, q, jnp.array([8]), sinks=jnp.zeros((3,)))


def _decode_oracle(q, kc, vc, lengths, sinks, *, scale, is_causal, window, cap):
    """(out, lse) of decode attention with sinks, written out plainly in float32: row i of sequence b is
    at position p = lengths[b] - T_new + i and sees key j if p >= 0, j < lengths[b], p - left <= j <=
    p + right (and j <= p when causal); its weights are p_j = exp(l_j) / (exp(sink) + sum_j exp(l_j))
    over the soft-capped logits l_j of those keys, and lse = log(exp(sink) + sum_j exp(l_j))."""
    q, kc, vc = (x.astype(jnp.float32) for x in (q, kc, vc))
    b, t, n, _ = q.shape
    kc, vc = (jnp.repeat(x, n // x.shape[2], axis=2) for x in (kc, vc))
    logits = jnp.einsum("btnd,bsnd->bnts", q, kc, precision="highest") * scale
    logits = cap * jnp.tanh(logits / cap)
    p = (lengths[:, None] - t + jnp.arange(t)[None, :])[:, None, :, None]  # [b, 1, t, 1]
    j = jnp.arange(kc.shape[1])
    seen = (p >= 0) & (j < lengths[:, None, None, None]) & (j >= p - window[0]) & (j <= p + window[1])
    if is_causal:
        seen &= j <= p
    e = jnp.where(seen, jnp.exp(logits), 0.0)  # (|logits| <= cap: no overflow)
    denom = jnp.exp(sinks)[None, :, None] + e.sum(-1)  # [b, n, t]
    out = jnp.einsum("bnts,bsnd->btnd", e / denom[..., None], vc, precision="highest")
    return out, jnp.log(denom)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("is_causal,window,paged", [(True, (9, 0), False), (False, (5, 3), True)],
                         ids=["causal_contiguous", "window_paged"])
def test_decode_sinks_window_softcap(implementation, is_causal, window, paged):
    """jax_tk.decode.attention with sinks, a window, a soft cap and lengths of 0, shorter than the new
    tokens and the whole cache (contiguous and paged), against the plain softmax above: out, lse, and
    the gradients in the query, the caches and the sinks. Rows that see no key give 0 and lse = sink."""
    dtype = jnp.bfloat16 if implementation == "tk" else jnp.float32
    b, t_new, n, kh, d, s_max, page, cap = 4, 3, 8, 2, 64, 48, 16, 2.0
    rng = np.random.default_rng(5)
    q = (2.0 * helpers.randn(rng, (b, t_new, n, d), jnp.float32)).astype(dtype)  # (logits well past the cap)
    kc, vc = helpers.randn(rng, (b, s_max, kh, d), dtype), helpers.randn(rng, (b, s_max, kh, d), dtype)
    lengths = jnp.array([s_max, 0, 2, 29], jnp.int32)
    sinks = jnp.asarray(rng.normal(size=n).astype(np.float32)).at[1].set(6.0)
    table = None
    if paged:  # the caches as a shuffled pool of pages (one spare) and its page table
        per = s_max // page
        perm = rng.permutation(b * per + 1)
        table = jnp.asarray(perm[: b * per].reshape(b, per), jnp.int32)
        pool = lambda c: (jnp.zeros((b * per + 1, page, kh, d), dtype).at[perm[b * per:]].set(1.5)
                          .at[perm[: b * per]].set(c.reshape(b * per, page, kh, d)))
        kc, vc = pool(kc), pool(vc)

    def ours(q, kc, vc, sinks):
        return jax_tk.decode.attention_with_lse(q, kc, vc, lengths, page_table=table, is_causal=is_causal,
                                                local_window_size=window, logits_soft_cap=cap, sinks=sinks,
                                                implementation=implementation)

    def oracle(q, kc, vc, sinks):
        if paged:
            kc, vc = (x[table].reshape(b, s_max, kh, d) for x in (kc, vc))
        return _decode_oracle(q, kc, vc, lengths, sinks, scale=d ** -0.5, is_causal=is_causal, window=window, cap=cap)

    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    out, vjp = jax.vjp(jax.jit(ours), q, kc, vc, sinks)
    out_ref, vjp_ref = jax.vjp(oracle, q, kc, vc, sinks)
    _check(out, out_ref, tol)
    assert np.all(np.asarray(out[0][1]) == 0) and np.all(np.asarray(out[0][2, 0]) == 0)  # rows that see no key
    np.testing.assert_allclose(np.asarray(out[1][1]), np.broadcast_to(np.asarray(sinks)[:, None], (n, t_new)),
                               rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out[1][2, :, 0]), np.asarray(sinks), rtol=1e-6)
    ct = (helpers.randn(rng, out[0].shape, jnp.float32), helpers.randn(rng, out[1].shape, jnp.float32))
    _check(vjp((ct[0].astype(dtype), ct[1])), vjp_ref(ct), tol)
