"""CPU tests of jax_tk.decode.append_attention: the composition it stands for (update_kv_cache of the keys
and the values, then attention over the lengths after them), its fused path's reference and gradient
(the path CUDA takes, with the reference in place of the kernels), jit with donated caches, and its
input checks. tests/decode/test_append_kernels_gpu.py runs the kernels."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from helpers import randn, rel_err
from jax_tk.decode import api, append

BF16, F32 = jnp.bfloat16, jnp.float32


def inputs(seed, b, t, n, kh, h, s, dtype, pages=None):
    rng = np.random.default_rng(seed)
    q, nk, nv = randn(rng, (b, t, n, h), dtype), randn(rng, (b, t, kh, h), dtype), randn(rng, (b, t, kh, h), dtype)
    if pages is None:
        kc, vc, table = randn(rng, (b, s, kh, h), dtype), randn(rng, (b, s, kh, h), dtype), None
    else:
        size, per = pages
        kc, vc = randn(rng, (b * per + 1, size, kh, h), dtype), randn(rng, (b * per + 1, size, kh, h), dtype)
        table = jnp.asarray(rng.permutation(b * per + 1)[:b * per].reshape(b, per), jnp.int32)
    return q, nk, nv, kc, vc, table


def composed(q, nk, nv, kc, vc, lengths, table, **kw):
    kc = jax_tk.decode.update_kv_cache(kc, nk, lengths, page_table=table)
    vc = jax_tk.decode.update_kv_cache(vc, nv, lengths, page_table=table)
    return jax_tk.decode.attention(q, kc, vc, lengths + q.shape[1], page_table=table, **kw), kc, vc


@pytest.mark.parametrize("pages", [None, (16, 3)], ids=["contiguous", "paged"])
@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("opts", [{}, dict(local_window_size=(20, 0), logits_soft_cap=20.0)], ids=["plain", "window_cap"])
def test_matches_the_composition(pages, t, opts):
    # lengths: empty, inside, and at the end of the capacity (the rows past it are dropped)
    q, nk, nv, kc, vc, table = inputs(0, 3, t, 8, 2, 64, 48, F32, pages)
    lengths = jnp.asarray([0, 17, 48 - 1], jnp.int32)
    out, k2, v2 = jax_tk.decode.append_attention(q, nk, nv, kc, vc, lengths, page_table=table, **opts)
    want, wk, wv = composed(q, nk, nv, kc, vc, lengths, table, **opts)
    assert rel_err(out, want) < 1e-6
    assert np.array_equal(np.asarray(k2), np.asarray(wk)) and np.array_equal(np.asarray(v2), np.asarray(wv))


@pytest.mark.parametrize("pages", [None, (16, 3)], ids=["contiguous", "paged"])
def test_fused_path_reference_and_gradient(pages):
    # the path a CUDA GPU takes (custom_vjp over the fused call), with the reference in the kernels' place
    q, nk, nv, kc, vc, table = inputs(1, 2, 2, 8, 4, 64, 40, F32, pages)
    lengths, sinks = jnp.asarray([5, 30], jnp.int32), jnp.asarray(np.linspace(-1, 1, 8), F32)
    spec = api.DecodeSpec(0.125, True, False, page_size=None if pages is None else pages[0])
    args = (q, nk, nv, kc, vc, lengths, table, sinks)
    got, want = append._fused(spec, *args), append._composed(spec, *args)
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) < 1e-6
    weights = [randn(np.random.default_rng(2), x.shape, F32) for x in want]
    loss = lambda f: lambda q, nk, nv, kc, vc, s: sum(
        jnp.sum(jnp.where(jnp.isfinite(o), o, 0) * w)
        for o, w in zip(f(spec, q, nk, nv, kc, vc, lengths, table, s), weights))
    grads = jax.grad(loss(append._fused), argnums=range(6))(q, nk, nv, kc, vc, sinks)
    wants = jax.grad(loss(append._composed), argnums=range(6))(q, nk, nv, kc, vc, sinks)
    for g, w in zip(grads, wants, strict=True):
        assert rel_err(g, w) < 1e-6


def test_public_gradient():
    q, nk, nv, kc, vc, _ = inputs(3, 2, 1, 4, 2, 64, 32, F32)
    lengths = jnp.asarray([3, 20], jnp.int32)
    f = lambda fn: lambda *a: sum(jnp.sum(x * x) for x in fn(*a, lengths, None)[:1]) + jnp.sum(fn(*a, lengths, None)[1])
    g = jax.grad(f(lambda *a: jax_tk.decode.append_attention(*a[:5], a[5], page_table=a[6])), argnums=range(5))(
        q, nk, nv, kc, vc)
    w = jax.grad(f(composed), argnums=range(5))(q, nk, nv, kc, vc)
    for x, y in zip(g, w, strict=True):
        assert rel_err(x, y) < 1e-6


def test_jit_with_donated_caches_in_a_scan():
    q, nk, nv, kc, vc, _ = inputs(4, 2, 1, 8, 2, 64, 16, BF16)

    @jax.jit
    def loop(kc, vc):
        def step(carry, i):
            kc, vc, lengths = carry
            out, kc, vc = jax_tk.decode.append_attention(q, nk * (i + 1), nv, kc, vc, lengths)
            return (kc, vc, lengths + 1), out
        return jax.lax.scan(step, (kc, vc, jnp.asarray([0, 5], jnp.int32)), jnp.arange(4, dtype=BF16))

    (k2, _, lengths), outs = jax.jit(loop, donate_argnums=(0, 1))(kc, vc)
    assert outs.shape == (4, 2, 1, 8, 64) and np.asarray(lengths).tolist() == [4, 9]
    np.testing.assert_array_equal(np.asarray(k2[0, 3], F32), np.asarray(nk[0, 0] * 4, F32))


@pytest.mark.parametrize("bad, match", [
    (dict(new_key=(2, 1, 3, 64)), "new_key must be"),
    (dict(new_value=(2, 2, 2, 64)), "new_value must be"),
    (dict(dtype=F32), "must have the cache's dtype"),
])
def test_rejects(bad, match):
    q, nk, nv, kc, vc, _ = inputs(5, 2, 1, 8, 2, 64, 16, BF16)
    if "new_key" in bad:
        nk = jnp.zeros(bad["new_key"], BF16)
    if "new_value" in bad:
        nv = jnp.zeros(bad["new_value"], BF16)
    if "dtype" in bad:
        nk = nk.astype(bad["dtype"])
    with pytest.raises((ValueError, TypeError), match=match):
        jax_tk.decode.append_attention(q, nk, nv, kc, vc, jnp.asarray([1, 2], jnp.int32))
