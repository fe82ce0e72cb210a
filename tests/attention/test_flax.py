"""jax_tk.attention as the attention_fn of Flax's linen.MultiHeadDotProductAttention and
nnx.MultiHeadAttention: the same results and parameter gradients as Flax's own attention (causal and
padding masks, jit, grad, decode mode), and errors, never silently wrong results, for what jax_tk does
not do (active dropout, sow_weights).

Flax gives a query row that sees no key (a padded query row under a padding mask) the mean of V, jax_tk
0: those rows are left out of the comparisons (they are padding)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from helpers import rel_err

flax = pytest.importorskip("flax")
nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

B, T, F, HEADS, QKV = 2, 7, 12, 4, 16
LENGTHS = np.array([7, 4])  # the second sequence is padded after 4 tokens
TOL = 1e-5


def _inputs(seed=0, t=T):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((B, t, F)), jnp.float32)


def _valid(t=T):
    return jnp.arange(t)[None, :] < jnp.asarray(LENGTHS)[:, None]  # [B, T]


def _masks(kind, t=T):
    valid = _valid(t)
    causal = nn.make_causal_mask(jnp.ones((B, t)))
    padding = nn.make_attention_mask(valid, valid)
    return {"causal": causal, "padding": padding, "causal_padding": nn.combine_masks(causal, padding)}[kind]


def _row_weights(kind, seed=1, t=T):
    """A random cotangent that is 0 on padded query rows (which see no key under a padding mask)."""
    w = np.random.default_rng(seed).standard_normal((B, t, F)).astype(np.float32)
    if "padding" in kind:
        w = w * np.asarray(_valid(t))[..., None]
    return jnp.asarray(w)


# ----------------------------------------------------------------------------------------------
# linen
# ----------------------------------------------------------------------------------------------


def _linen(attention_fn=None, **kwargs):
    opts = dict(num_heads=HEADS, qkv_features=QKV, **kwargs)
    return nn.MultiHeadDotProductAttention(**opts) if attention_fn is None else \
        nn.MultiHeadDotProductAttention(attention_fn=attention_fn, **opts)


@pytest.mark.parametrize("kind", ["causal", "padding", "causal_padding"])
def test_linen_matches_flax(kind):
    x, mask, w = _inputs(), _masks(kind), _row_weights(kind)
    params = _linen().init(jax.random.key(0), x, mask=mask)

    def run(module):
        apply = jax.jit(lambda p, x: module.apply(p, x, mask=mask))
        loss = lambda p, x: jnp.sum(module.apply(p, x, mask=mask) * w)
        return apply(params, x) * (w != 0), jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)

    (want, want_g), (got, got_g) = run(_linen()), run(_linen(jax_tk.attention))
    assert rel_err(got, want) < TOL
    for g, r in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        assert _grad_close(g, r)


def test_linen_several_batch_dims():
    """Flax's modules take inputs [*batch, len, features]: the leading dims reach attention_fn as they are."""
    x = jnp.asarray(np.random.default_rng(7).standard_normal((3, B, T, F)), jnp.float32)
    valid = jnp.broadcast_to(_valid(), (3, B, T))
    mask = nn.combine_masks(nn.make_attention_mask(valid, valid), nn.make_causal_mask(jnp.ones((1, 1, T))))
    w = jnp.asarray(np.random.default_rng(8).standard_normal(x.shape), jnp.float32) * valid[..., None]
    params = _linen().init(jax.random.key(3), x, mask=mask)

    def run(module):
        loss = lambda p, x: jnp.sum(module.apply(p, x, mask=mask) * w)
        return module.apply(params, x, mask=mask) * (w != 0), jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)

    (want, want_g), (got, got_g) = run(_linen()), run(_linen(jax_tk.attention))
    assert got.shape == x.shape and rel_err(got, want) < TOL
    for g, r in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        assert _grad_close(g, r)


def test_linen_cross_attention_with_key_padding():
    xq, xkv = _inputs(2, t=5), _inputs(3, t=T)
    mask = nn.make_attention_mask(jnp.ones((B, 5), bool), _valid())
    params = _linen().init(jax.random.key(1), xq, xkv, mask=mask)
    want = _linen().apply(params, xq, xkv, mask=mask)
    got = jax.jit(lambda p: _linen(jax_tk.attention).apply(p, xq, xkv, mask=mask))(params)
    assert rel_err(got, want) < TOL


def test_linen_decode():
    x = _inputs(4)
    module, ours = _linen(decode=True), _linen(jax_tk.attention, decode=True)
    variables = module.init(jax.random.key(2), x)  # the cache is sized by the full-length input
    params, cache = variables["params"], variables["cache"]
    caches = {"flax": cache, "ours": cache}
    step = {name: jax.jit(lambda p, c, xi, m=m: m.apply({"params": p, "cache": c}, xi, mutable=["cache"]))
            for name, m in (("flax", module), ("ours", ours))}
    for i in range(T):
        outs = {}
        for name in caches:
            outs[name], mutated = step[name](params, caches[name], x[:, i:i + 1])
            caches[name] = mutated["cache"]
        assert rel_err(outs["ours"], outs["flax"]) < TOL, i
    # ... and the decoded steps are causal attention over the whole sequence.
    full = _linen().apply({"params": params}, x, mask=_masks("causal"))
    assert rel_err(outs["ours"], full[:, -1:]) < TOL


def test_linen_dropout():
    x, mask = _inputs(5), _masks("causal")
    module, ours = _linen(dropout_rate=0.2), _linen(jax_tk.attention, dropout_rate=0.2)
    params = module.init(jax.random.key(3), x, mask=mask, deterministic=True)
    # Inference (deterministic=True): no dropout, the same result as Flax.
    want = module.apply(params, x, mask=mask, deterministic=True)
    assert rel_err(ours.apply(params, x, mask=mask, deterministic=True), want) < TOL
    # Training: Flax would drop attention weights; jax_tk raises rather than ignore it.
    with pytest.raises(NotImplementedError, match="dropout"):
        ours.apply(params, x, mask=mask, deterministic=False, rngs={"dropout": jax.random.key(4)})
    with pytest.raises(NotImplementedError, match="dropout"):
        ours.apply(params, x, mask=mask, deterministic=False, dropout_rng=jax.random.key(4))


def test_linen_sow_weights_raises():
    x = _inputs(6)
    ours = _linen(jax_tk.attention)
    params = ours.init(jax.random.key(5), x)
    with pytest.raises(NotImplementedError, match="sow_weights"):
        ours.apply(params, x, sow_weights=True, mutable=["intermediates"])


def test_linen_bfloat16_module():
    x, mask = _inputs(7), _masks("causal")
    module, ours = _linen(dtype=jnp.bfloat16), _linen(jax_tk.attention, dtype=jnp.bfloat16)
    params = module.init(jax.random.key(6), x, mask=mask)
    want, got = module.apply(params, x, mask=mask), ours.apply(params, x, mask=mask)
    assert got.dtype == want.dtype == jnp.bfloat16
    assert rel_err(got, want) < 2e-2


def test_reproducible_backward_through_partial():
    # Flax passes deterministic= as its dropout flag; jax_tk's reproducible backward is
    # deterministic_backward, which a partial fixes (linen inspects the partial's signature).
    x, mask = _inputs(8), _masks("causal")
    params = _linen().init(jax.random.key(7), x, mask=mask)
    ours = _linen(functools.partial(jax_tk.attention, deterministic_backward=True))
    assert rel_err(ours.apply(params, x, mask=mask), _linen().apply(params, x, mask=mask)) < TOL


# ----------------------------------------------------------------------------------------------
# nnx
# ----------------------------------------------------------------------------------------------


def _nnx(attention_fn=None, seed=0, **kwargs):
    opts = dict(num_heads=HEADS, in_features=F, qkv_features=QKV, rngs=nnx.Rngs(seed), **{"decode": False, **kwargs})
    if attention_fn is not None:
        opts["attention_fn"] = attention_fn
    return nnx.MultiHeadAttention(**opts)


def _grad_close(g, r):
    """Within TOL relatively, or (a gradient that is 0 analytically, e.g. the key projection's bias: the
    softmax ignores a shift of all logits) within float32 rounding noise absolutely."""
    return rel_err(g, r) < TOL or float(np.max(np.abs(np.asarray(g) - np.asarray(r)))) < 1e-6


@pytest.mark.parametrize("kind", ["causal", "padding", "causal_padding", "is_causal"])
def test_nnx_matches_flax(kind):
    x = _inputs(9)
    mask = None if kind == "is_causal" else _masks(kind)
    causal = kind == "is_causal"
    w = _row_weights(kind)

    def run(module):
        fwd = nnx.jit(lambda m, x: m(x, mask=mask, is_causal=causal))
        loss = lambda m, x: jnp.sum(m(x, mask=mask, is_causal=causal) * w)
        grads = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(module, x)
        return fwd(module, x) * (w != 0), grads

    (want, want_g), (got, got_g) = run(_nnx()), run(_nnx(jax_tk.attention))
    assert rel_err(got, want) < TOL
    want_leaves, got_leaves = jax.tree.leaves(nnx.state(want_g[0])), jax.tree.leaves(nnx.state(got_g[0]))
    assert len(got_leaves) == len(want_leaves) > 0
    for g, r in zip(got_leaves + [got_g[1]], want_leaves + [want_g[1]]):
        assert _grad_close(g, r)


def test_nnx_decode():
    x = _inputs(10)
    module, ours = _nnx(decode=True), _nnx(jax_tk.attention, decode=True)
    for m in (module, ours):
        m.init_cache(x.shape)
    for i in range(T):
        want, got = module(x[:, i:i + 1]), ours(x[:, i:i + 1])
        assert rel_err(got, want) < TOL, i
    full = _nnx(decode=False)(x, mask=_masks("causal"))
    assert rel_err(got, full[:, -1:]) < TOL


def test_nnx_dropout():
    x = _inputs(11)
    module, ours = _nnx(dropout_rate=0.3), _nnx(jax_tk.attention, dropout_rate=0.3)
    want = module(x, deterministic=True)
    assert rel_err(ours(x, deterministic=True), want) < TOL
    with pytest.raises(NotImplementedError, match="dropout"):
        ours(x, deterministic=False)


def test_nnx_sow_weights_raises():
    with pytest.raises(NotImplementedError, match="sow_weights"):
        _nnx(jax_tk.attention)(_inputs(12), sow_weights=True)


def test_nnx_dtype_is_honoured():
    x = _inputs(13)
    module, ours = _nnx(dtype=jnp.bfloat16), _nnx(jax_tk.attention, dtype=jnp.bfloat16)
    want, got = module(x, is_causal=True), ours(x, is_causal=True)
    assert got.dtype == want.dtype == jnp.bfloat16
    assert rel_err(got, want) < 2e-2
