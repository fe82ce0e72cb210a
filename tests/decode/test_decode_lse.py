"""jax_tk.decode.attention_with_lse: the log-sum-exp against float64 numpy (contiguous and paged caches,
causal, windows, soft cap, rows that see no key), its gradient against a dense float32 formulation,
the exact merge of two calls over disjoint keys, empty calls; on a GPU, the kernel's lse through the
public API. The output itself is tested in test_decode.py (it is ``jax_tk.decode.attention``'s)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from helpers import randn, rel_err, sink_attention_oracle
from test_decode import to_pages

BF16, F32 = jnp.bfloat16, jnp.float32


def numpy_lse(q, k, lengths, scale, is_causal=True, window=None, softcap=None):
    """[B, N, T] float64: log-sum-exp of the visible scaled (soft-capped) logits, -inf for a row that
    sees no key (as test_decode.numpy_decode: row i of sequence b at p = lengths[b] - T + i)."""
    q, k = (np.asarray(x).astype(np.float64) for x in (q, k))
    b, t, n, _ = q.shape
    group = n // k.shape[2]
    lse = np.full((b, n, t), -np.inf)
    for bi in range(b):
        length = int(lengths[bi])
        for i in range(t):
            p = length - t + i
            keys = [j for j in range(min(length, k.shape[1]))
                    if p >= 0 and (not is_causal or j <= p) and (window is None or p - window[0] <= j <= p + window[1])]
            for hi in range(n) if keys else ():
                logits = scale * (k[bi, keys, hi // group] @ q[bi, i, hi])
                if softcap is not None:
                    logits = softcap * np.tanh(logits / softcap)
                lse[bi, hi, i] = logits.max() + np.log(np.exp(logits - logits.max()).sum())
    return lse


# (B, T_new, N, K, H, page_size, lengths, is_causal, window, softcap): rows with no key (length 0, and
# p < 0 when a length is shorter than T_new), GQA, windows, soft cap.
CASES = [
    (3, 4, 8, 2, 64, 16, (0, 3, 47), True, None, None),
    (2, 1, 4, 4, 32, 16, (17, 64), False, None, 20.0),
    (2, 16, 8, 1, 64, 64, (31, 128), True, (5, 3), None),
    (2, 4, 6, 3, 16, 16, (9, 40), False, (4, 2), 5.0),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_lse_against_numpy(case, paged):
    b, t, n, kh, h, page, lengths, causal, window, cap = CASES[case]
    rng = np.random.default_rng(case)
    s = max(lengths) + page - max(lengths) % page
    q, k, v = randn(rng, (b, t, n, h), F32), randn(rng, (b, s, kh, h), F32), randn(rng, (b, s, kh, h), F32)
    lens = jnp.asarray(lengths, jnp.int32)
    want_out = jax_tk.decode.attention(q, k, v, lens, is_causal=causal, local_window_size=window, logits_soft_cap=cap)
    want_lse = numpy_lse(q, k, lengths, h ** -0.5, causal, window, cap)
    table = None
    if paged:
        k, v, table = to_pages(rng, k, v, page)
    out, lse = jax.jit(functools.partial(jax_tk.decode.attention_with_lse, is_causal=causal, local_window_size=window,
                                         logits_soft_cap=cap))(q, k, v, lens, page_table=table)
    assert lse.shape == (b, n, t) and lse.dtype == F32
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    seen = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[seen], want_lse[seen], rtol=1e-5, atol=1e-5)
    assert rel_err(out, want_out) < 1e-5


def _dense(q, k, v, lengths, scale):
    """(out, lse) of non-causal attention over the first ``lengths[b]`` keys, float32, written densely
    with jax.nn.logsumexp (every length > 0)."""
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k, precision="highest") * scale
    valid = jnp.arange(k.shape[1])[None, :] < lengths[:, None]
    logits = jnp.where(valid[:, None, None], logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)
    out = jnp.einsum("bnts,bsnh->btnh", jnp.exp(logits - lse[..., None]), v, precision="highest")
    return out, lse


def test_gradient_of_out_and_lse():
    rng = np.random.default_rng(7)
    b, t, n, kh, h, s = 2, 3, 4, 2, 32, 40
    q, k, v = randn(rng, (b, t, n, h), F32), randn(rng, (b, s, kh, h), F32), randn(rng, (b, s, kh, h), F32)
    dout, dlse = randn(rng, (b, t, n, h), F32), randn(rng, (b, n, t), F32)
    lens = jnp.array([29, 40], jnp.int32)

    def loss(fn):
        def f(q, k, v):
            out, lse = fn(q, k, v)
            return jnp.sum(out * dout) + jnp.sum(lse * dlse)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

    got = loss(lambda q, k, v: jax_tk.decode.attention_with_lse(q, k, v, lens, is_causal=False))(q, k, v)
    want = loss(lambda q, k, v: _dense(q, k, v, lens, h ** -0.5))(q, k, v)
    assert abs(float(got[0]) - float(want[0])) < 1e-4 * abs(float(want[0]))
    for name, g, w in zip("qkv", got[1], want[1]):
        assert rel_err(g, w) < 1e-5, name


def test_no_key_rows_have_zero_gradient():
    """A row that sees no key: out 0, lse -inf, and a cotangent on them gives zero gradients, not NaN."""
    rng = np.random.default_rng(8)
    q, k = randn(rng, (2, 2, 2, 16), F32), randn(rng, (2, 8, 1, 16), F32)
    lens = jnp.array([0, 8], jnp.int32)
    (out, lse), vjp = jax.vjp(lambda q, k: jax_tk.decode.attention_with_lse(q, k, k, lens), q, k)
    assert np.all(np.asarray(out)[0] == 0) and np.all(np.isneginf(lse[0])) and np.all(np.isfinite(lse[1]))
    gq, gk = vjp((randn(rng, out.shape, F32), randn(rng, lse.shape, F32)))
    assert np.all(np.isfinite(gq)) and np.all(np.isfinite(gk))
    assert np.all(np.asarray(gq)[0] == 0) and np.all(np.asarray(gk)[0] == 0)
    assert np.all(np.asarray(gq)[1] != 0)


def test_two_parts_merge_into_the_whole():
    """Results over two disjoint halves of the keys merge through their lse into the whole call's."""
    rng = np.random.default_rng(9)
    b, t, n, kh, h, s = 2, 4, 8, 2, 64, 96
    q, k, v = randn(rng, (b, t, n, h), BF16), randn(rng, (b, s, kh, h), BF16), randn(rng, (b, s, kh, h), BF16)
    full = jnp.full((b,), s, jnp.int32)
    half = full // 2
    run = functools.partial(jax_tk.decode.attention_with_lse, is_causal=False)
    out_a, lse_a = run(q, k[:, :s // 2], v[:, :s // 2], half)
    out_b, lse_b = run(q, k[:, s // 2:], v[:, s // 2:], half)
    out, lse = run(q, k, v, full)
    merged = jnp.logaddexp(lse_a, lse_b)
    rows = lambda x: jnp.swapaxes(x, 1, 2)[..., None]  # [B, N, T] -> [B, T, N, 1]
    out_m = rows(jnp.exp(lse_a - merged)) * out_a.astype(F32) + rows(jnp.exp(lse_b - merged)) * out_b.astype(F32)
    np.testing.assert_allclose(merged, lse, rtol=1e-5, atol=1e-5)
    assert rel_err(out_m, out.astype(F32)) < 1e-2


@pytest.mark.parametrize("b,t", [(0, 2), (2, 0)])
def test_empty(b, t):
    rng = np.random.default_rng(10)
    q, k = randn(rng, (b, t, 4, 16), F32), randn(rng, (b, 8, 2, 16), F32)
    out, lse = jax_tk.decode.attention_with_lse(q, k, k, jnp.full((b,), 5, jnp.int32))
    assert out.shape == q.shape and lse.shape == (b, 4, t) and lse.dtype == F32


def test_kernel_unsupported_reason():
    rng = np.random.default_rng(11)
    k = randn(rng, (1, 8, 1, 64), BF16)
    assert jax_tk.decode.kernel_unsupported_reason(randn(rng, (1, 1, 2, 64), BF16), k) is None
    assert "dtype" in jax_tk.decode.kernel_unsupported_reason(randn(rng, (1, 1, 2, 64), F32), k.astype(F32))
    assert "head_dim" in jax_tk.decode.kernel_unsupported_reason(randn(rng, (1, 1, 2, 96), BF16),
                                                                  randn(rng, (1, 8, 1, 96), BF16))


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kernel_lse_through_the_public_api(paged):
    rng = np.random.default_rng(12)
    b, t, n, kh, h, s = 3, 4, 16, 4, 128, 1024
    q, k, v = randn(rng, (b, t, n, h), BF16), randn(rng, (b, s, kh, h), BF16), randn(rng, (b, s, kh, h), BF16)
    lens = jnp.array([0, 2, 777], jnp.int32)
    table = None
    if paged:
        k, v, table = to_pages(rng, k, v, 64)
    run = lambda impl: jax.jit(functools.partial(jax_tk.decode.attention_with_lse, page_table=table,
                                                 logits_soft_cap=30.0, implementation=impl))
    assert "jax_tk_decode" in run("tk").lower(q, k, v, lens).as_text()
    out, lse = run("tk")(q, k, v, lens)
    want_out, want_lse = run("xla")(*(x.astype(F32) for x in (q, k, v)), lens)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    seen = np.isfinite(np.asarray(want_lse))
    np.testing.assert_allclose(np.asarray(lse)[seen], np.asarray(want_lse)[seen], rtol=2e-2, atol=2e-2)
    assert rel_err(out.astype(F32), want_out) < 1.2e-2


# ----------------------------------------------------------------------------------------------
# Attention sinks (the reference only: jax_tk.decode.reference)
# ----------------------------------------------------------------------------------------------


def _sink_oracle(q, k, v, lengths, scale, sinks, is_causal):
    """The dense oracle (helpers.sink_attention_oracle), positions and masks written out: row i of
    sequence b at p = lengths[b] - T + i sees keys j < lengths[b], j <= p if causal, none if p < 0."""
    p = lengths[:, None] - q.shape[1] + jnp.arange(q.shape[1])[None, :]
    j = jnp.arange(k.shape[1])[None, None, :]
    visible = (j < lengths[:, None, None]) & (p[:, :, None] >= 0)
    if is_causal:
        visible &= j <= p[:, :, None]
    return sink_attention_oracle(q, k, v, visible, scale, sinks)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_reference_sinks(paged):
    """sinks [heads] join each row's softmax denominator (no value): out and lse, and the gradients in
    query, caches and sinks, equal a dense oracle; a row that sees no key gives 0 and lse = its sink; a
    sink far above the logits (100) does not overflow."""
    from jax_tk.decode import reference

    rng = np.random.default_rng(13)
    b, t, n, kh, h, s = 3, 4, 4, 2, 32, 32
    q, k, v = randn(rng, (b, t, n, h), F32), randn(rng, (b, s, kh, h), F32), randn(rng, (b, s, kh, h), F32)
    sinks = jnp.array([0.5, -1.0, 100.0, 2.0], F32)
    lens = jnp.array([0, 3, 29], jnp.int32)
    dout, dlse = randn(rng, (b, t, n, h), F32), randn(rng, (b, n, t), F32)
    kc, vc, table = (k, v, None) if not paged else to_pages(rng, k, v, 16, extra_pages=0)

    def loss(fn):
        def f(q, k, v, sinks):
            out, lse = fn(q, k, v, sinks)
            return jnp.sum(out * dout) + jnp.sum(lse * dlse), (out, lse)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3), has_aux=True))

    grads, (out, lse) = loss(lambda q, k, v, sk: reference.attention_with_lse(
        q, k, v, lens, scale=0.2, page_table=table, sinks=sk))(q, kc, vc, sinks)
    gather = (lambda x: x) if table is None else (lambda x: reference.gather_pages(x, table))
    want_grads, (want_out, want_lse) = loss(lambda q, k, v, sk: _sink_oracle(
        q, gather(k), gather(v), lens, 0.2, sk, True))(q, kc, vc, sinks)
    assert rel_err(out, want_out) < 1e-5
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)
    assert not np.asarray(out[0]).any() and not np.asarray(out[1, 0]).any()  # length 0; p < 0
    np.testing.assert_array_equal(np.asarray(lse[0]), np.broadcast_to(np.asarray(sinks)[:, None], (n, t)))
    for name, g, w in zip(("q", "k", "v", "sinks"), grads, want_grads):
        assert np.isfinite(np.asarray(g)).all() and rel_err(g, w) < 1e-5, name
    # The MLA reference passes sinks through: values = the first v_head_dim dims of the latent rows.
    mla, want = jax.jit(lambda q, c: (
        reference.mla_attention_with_lse(q, c, lens, scale=0.2, v_head_dim=16, page_table=table, sinks=sinks),
        reference.attention_with_lse(q, c, c[..., :16], lens, scale=0.2, page_table=table, sinks=sinks)))(q, kc[:, :, :1])
    np.testing.assert_array_equal(np.asarray(mla[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(mla[1]), np.asarray(want[1]))
