"""The attention and decode kernels with attention sinks, called directly with their outputs (and
workspaces) poisoned with NaN, against the float32 references with sinks: sinks near the logits' scale,
one that dwarfs every logit (its rows' outputs fall to ~0 and their lse to the sink, with no overflow),
one -inf (no sink); rows that see no key (their lse is the sink, to float32's rounding of the
change to log2 units and back); the kernels of every GPU, head dims
64-256, split counts 1 and many, and vmap with the sinks mapped."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from helpers import nan, randn, rel_err
from jax_tk._core import dispatch
from jax_tk.attention import reference as attention_reference
from jax_tk.attention.api import AttentionSpec
from jax_tk.attention.launch import Masks, fwd_kernel
from jax_tk.decode import launch as decode_launch, reference as decode_reference
from jax_tk.decode.api import DecodeSpec

pytestmark = pytest.mark.gpu
BF16, F32 = jnp.bfloat16, jnp.float32
AUTO, SM80 = dispatch.kernel_variant("auto"), dispatch.kernel_variant("sm80")


def _sinks(n, seed=0):
    s = np.random.default_rng(seed).normal(size=n).astype(np.float32)
    s[0], s[1], s[-1] = 6.0, 200.0, -np.inf
    return jnp.asarray(s)


def _check(got, want, tol=2e-2):
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert not np.isnan(g).any()
        assert np.array_equal(np.isneginf(g), np.isneginf(w))
        fin = np.isfinite(w)
        assert rel_err(g[fin], w[fin], floor=1e-3) < tol


@pytest.mark.parametrize("variant", [AUTO, SM80], ids=["auto", "sm80"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "lengths"])
def test_attention_forward_kernel(variant, d, causal, masked):
    if variant == SM80 and d == 256:
        pytest.skip("head_dim 256 runs on sm_90a only")
    b, t, s, n, kh = 2, 200, 333, 6, 2
    rng = np.random.default_rng(d)
    q, k, v = randn(rng, (b, t, n, d), BF16), randn(rng, (b, s, kh, d), BF16), randn(rng, (b, s, kh, d), BF16)
    sinks = _sinks(n, d)
    lengths = jnp.array([s, 0], jnp.int32) if masked else None  # entry 1 sees no key
    masks = Masks(kv_lengths=lengths) if masked else None
    spec = AttentionSpec(d ** -0.5, causal, True, sinks=True)

    @jax.jit
    def run(q, k, v, sinks):
        return fwd_kernel(q, k, v, spec, out_init=(nan(q.shape, BF16), nan((b, n, t), F32)), variant=variant,
                          masks=masks, sinks=sinks)

    out, lse = run(q, k, v, sinks)
    want = attention_reference.attention_with_lse(*(x.astype(F32) for x in (q, k, v)), scale=d ** -0.5,
                                                  is_causal=causal, key_value_seq_lengths=lengths, sinks=sinks)
    _check((out, lse), want)
    assert np.all(np.asarray(out[:, :, 1]) == 0)  # the sink of 200 takes all the weight
    np.testing.assert_allclose(np.asarray(lse[:, 1]), 200.0, rtol=1e-6)
    if masked:
        assert np.all(np.asarray(out[1]) == 0)
        np.testing.assert_allclose(np.asarray(lse[1]), np.broadcast_to(np.asarray(sinks)[:, None], (n, t)), rtol=1e-6)


@functools.partial(jax.jit, static_argnames=("spec", "parts", "kernels"))
def _decode(q, k, v, lengths, sinks, *, spec, parts, kernels):
    b, t, n, h = q.shape
    words = decode_launch.workspace_words(parts, b, t, n, h)
    out_init = (nan(q.shape, q.dtype), nan((b, n, t), F32), nan((words,), F32))
    return decode_launch.kernel(q, k, v, lengths, None, spec, out_init=out_init, parts=parts, with_lse=True,
                                variant=dispatch.kernel_variant(kernels), sinks=sinks)


# (heads, kv heads, new tokens): blocks of 16 query rows (one warp group or several), 64, and 128 (the
# sm_90a decode kernel).
@pytest.mark.parametrize("n,kh,t_new", [(8, 2, 1), (8, 8, 3), (64, 8, 1), (16, 2, 8), (32, 1, 4)])
@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("kernels", ["auto", "sm80"])
def test_decode_kernel(n, kh, t_new, parts, d, kernels):
    b, s = 3, 600
    rng = np.random.default_rng(n * d + t_new)
    q = randn(rng, (b, t_new, n, d), BF16)
    kc, vc = randn(rng, (b, s, kh, d), BF16), randn(rng, (b, s, kh, d), BF16)
    lengths = jnp.array([s, 0, 37], jnp.int32)
    sinks = _sinks(n, d)
    spec = DecodeSpec(d ** -0.5, True, True)
    out, lse = _decode(q, kc, vc, lengths, sinks, spec=spec, parts=parts, kernels=kernels)
    want = decode_reference.attention_with_lse(*(x.astype(F32) for x in (q, kc, vc)), lengths, scale=d ** -0.5,
                                               sinks=sinks)
    _check((out, lse), want)
    assert np.all(np.asarray(out[1]) == 0)  # a length of 0: the output 0, the lse the sink
    np.testing.assert_allclose(np.asarray(lse[1]), np.broadcast_to(np.asarray(sinks)[:, None], (n, t_new)), rtol=1e-6)


@pytest.mark.parametrize("mapped", ["query", "sinks", "query_cache"])
def test_decode_vmap(mapped):
    """vmap folds the entries into more heads (only the query mapped) or more sequences (the cache
    mapped): the sinks follow them, mapped or not."""
    e, b, t_new, n, kh, d, s = 3, 2, 2, 8, 2, 128, 300
    rng = np.random.default_rng(5)
    q = randn(rng, (e, b, t_new, n, d), BF16)
    kc, vc = randn(rng, (e, b, s, kh, d), BF16), randn(rng, (e, b, s, kh, d), BF16)
    lengths = jnp.array([s, 41], jnp.int32)
    sinks = jnp.stack([_sinks(n, i) for i in range(e)])
    op = lambda q, kc, vc, sinks: jax_tk.decode.attention_with_lse(q, kc, vc, lengths, sinks=sinks, implementation="tk")
    axes = {"query": (0, None, None, 0), "sinks": (None, None, None, 0), "query_cache": (0, 0, 0, None)}[mapped]
    args = [q, kc, vc, sinks]
    args = [x if a is not None else x[0] for x, a in zip(args, axes)]
    got = jax.jit(jax.vmap(op, in_axes=axes))(*args)
    for i in range(e):
        one = [x[i] if a is not None else x for x, a in zip(args, axes)]
        want = decode_reference.attention_with_lse(*(x.astype(F32) for x in one[:3]), lengths, scale=d ** -0.5,
                                                   sinks=one[3])
        _check((got[0][i], got[1][i]), want)


def test_attention_vmap():
    e, b, t, n, d = 2, 2, 130, 4, 64
    rng = np.random.default_rng(6)
    q, k, v = (randn(rng, (e, b, t, n, d), BF16) for _ in range(3))
    sinks = jnp.stack([_sinks(n, i) for i in range(e)])
    op = lambda q, k, v, s: jax_tk.attention_with_lse(q, k, v, is_causal=True, sinks=s, implementation="tk")
    got = jax.jit(jax.vmap(op))(q, k, v, sinks)
    for i in range(e):
        want = attention_reference.attention_with_lse(*(x[i].astype(F32) for x in (q, k, v)), scale=d ** -0.5,
                                                      is_causal=True, sinks=sinks[i])
        _check((got[0][i], got[1][i]), want)
