"""CPU tests of jax_tk.attention's gradients: the custom_vjp (reference forward/backward on CPU)
against jax.grad of the pure-JAX reference and of jax.nn.dot_product_attention."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from helpers import attention_inputs, randn as _randn, rel_err
from jax_tk.attention import reference

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
TOL = {F32: 1e-5, BF16: 1e-2, F16: 1e-2}
ARGS = (0, 1, 2)


def _inputs(seed, b, t, s, n, kh, d, dtype):
    """q, k, v in dtype, and float32 cotangents w (for out) and u (for lse); never zeros or ones."""
    return attention_inputs(seed, b, t, s, n, kh, d, dtype, cotangents=True, cotangent_dtype=F32)


_rel_err = rel_err


def _assert_grads_close(got, want, tol, what):
    for name, g, r in zip(("dq", "dk", "dv"), got, want):
        assert g.shape == r.shape, f"{what} {name}: shape {g.shape} != {r.shape}"
        assert np.all(np.isfinite(np.asarray(g).astype(np.float32))), f"{what} {name}: not finite"
        err = _rel_err(g, r)
        assert err < tol, f"{what} {name}: relative error {err:.3g} >= {tol}"


def _out_loss(fn, w):
    """A scalar loss of the attention output, weighted by a fixed random cotangent w."""
    return lambda q, k, v: jnp.sum(fn(q, k, v).astype(F32) * w)


@jax.jit
def _all_grads(q, k, v, w):
    """Gradients of sum(out * w) w.r.t. (q, k, v), full and causal, for jax_tk.attention
    (implementation None: the custom_vjp), jax.grad of reference.attention in the input dtype, and
    jax.grad of jax.nn.dot_product_attention in float32 from the same rounded inputs (for float32
    inputs, that is jax.nn on the inputs themselves) and, for low-precision inputs, in the input dtype.
    One compilation per shape."""
    scale = 1.0 / np.sqrt(q.shape[-1])
    q32, k32, v32 = (x.astype(F32) for x in (q, k, v))
    results = {}
    for c in (False, True):
        fns = dict(
            none=functools.partial(jax_tk.attention, is_causal=c),
            ref=functools.partial(reference.attention, scale=scale, is_causal=c),
        )
        results[c] = {name: jax.grad(_out_loss(fn, w), argnums=ARGS)(q, k, v) for name, fn in fns.items()}
        nn = functools.partial(jax.nn.dot_product_attention, is_causal=c, implementation="xla")
        results[c]["nn32"] = jax.grad(_out_loss(nn, w), argnums=ARGS)(q32, k32, v32)
        if q.dtype != F32:  # and jax.nn in the input dtype (its own low-precision backward)
            results[c]["nn"] = jax.grad(_out_loss(nn, w), argnums=ARGS)(q, k, v)
    return results


# (B, T, S, N, K, D)
GRAD_SHAPES = [
    (2, 16, 16, 4, 4, 32),  # multi-head, square
    (1, 17, 33, 4, 2, 16),  # GQA, T < S
    (1, 33, 17, 6, 2, 16),  # GQA, T > S
    (1, 1, 9, 2, 1, 8),  # single query row, multi-query
]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", GRAD_SHAPES, ids=["B{}_T{}_S{}_N{}_K{}_D{}".format(*s) for s in GRAD_SHAPES])
def test_grad_vs_reference_and_jax_nn(shape, dtype):
    q, k, v, w, _ = _inputs(100 + sum(shape), *shape, dtype)
    results = _all_grads(q, k, v, w)
    tol = TOL[dtype]
    for c in (False, True):
        r = results[c]
        what = f"is_causal={c}"
        for g, x in zip(r["none"], (q, k, v)):
            assert g.dtype == x.dtype and g.shape == x.shape, what
        _assert_grads_close(r["none"], r["ref"], tol, what + " vs jax.grad(reference)")
        _assert_grads_close(r["none"], r["nn32"], tol, what + " vs jax.grad(jax.nn, float32)")
        if "nn" in r:
            _assert_grads_close(r["none"], r["nn"], tol, what + " vs jax.grad(jax.nn, same dtype)")


def test_grad_goes_through_custom_vjp():
    q, k, v, w, _ = _inputs(1, 1, 4, 4, 2, 2, 8, BF16)
    jaxpr = str(jax.make_jaxpr(jax.grad(_out_loss(jax_tk.attention, w), argnums=ARGS))(q, k, v))
    assert "custom_vjp" in jaxpr


# ----------------------------------------------------------------------------------------------
# attention_with_lse: gradients through both outputs
# ----------------------------------------------------------------------------------------------


def _lse_independent(q, k, *, scale, is_causal):
    """The log-sum-exp written directly (not through reference.py), float32, [B, N, T]."""
    n, kh = q.shape[2], k.shape[2]
    k = jnp.repeat(k.astype(F32), n // kh, axis=2)
    logits = scale * jnp.einsum("btnd,bsnd->bnts", q.astype(F32), k, precision="highest")
    if is_causal:
        t, s = logits.shape[-2:]
        logits = jnp.where(jnp.arange(s)[None, :] <= jnp.arange(t)[:, None], logits, -jnp.inf)
    return jax.nn.logsumexp(logits, axis=-1)


@functools.partial(jax.jit, static_argnames=("scale",))
def _lse_grads(q, k, v, w, u, scale):
    def both_loss(fn):
        def loss(q, k, v):
            out, lse = fn(q, k, v)
            return jnp.sum(out.astype(F32) * w) + jnp.sum(lse * u)

        return loss

    def lse_loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v)[1] * u)

    results = {}
    for c in (False, True):
        ours = functools.partial(jax_tk.attention_with_lse, scale=scale, is_causal=c)
        ours_xla = functools.partial(ours, implementation="xla")
        ref = functools.partial(reference.attention_with_lse, scale=scale, is_causal=c)
        indep = lambda q, k, v, c=c: (None, _lse_independent(q, k, scale=scale, is_causal=c))
        results[c] = dict(
            both=jax.grad(both_loss(ours), argnums=ARGS)(q, k, v),
            both_xla=jax.grad(both_loss(ours_xla), argnums=ARGS)(q, k, v),
            both_ref=jax.grad(both_loss(ref), argnums=ARGS)(q, k, v),
            lse=jax.grad(lse_loss(ours), argnums=ARGS)(q, k, v),
            lse_ref=jax.grad(lse_loss(ref), argnums=ARGS)(q, k, v),
            # the lse does not depend on v: jax.grad gives zeros, which the custom_vjp must match
            lse_indep=jax.grad(lse_loss(indep), argnums=ARGS)(q, k, v),
        )
    return results


@pytest.mark.parametrize("dtype", [F32, BF16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(2, 12, 12, 4, 2, 16), (1, 9, 20, 4, 1, 32)], ids=["gqa_square", "mqa_t<s"])
def test_attention_with_lse_grads(shape, dtype):
    q, k, v, w, u = _inputs(200 + sum(shape), *shape, dtype)
    results = _lse_grads(q, k, v, w, u, scale=0.3)
    tol = TOL[dtype]
    for c in (False, True):
        r = results[c]
        _assert_grads_close(r["both"], r["both_ref"], tol, f"out+lse is_causal={c}")
        _assert_grads_close(r["both_xla"], r["both_ref"], tol, f"out+lse xla is_causal={c}")
        _assert_grads_close(r["lse"][:2], r["lse_ref"][:2], tol, f"lse-only is_causal={c}")
        _assert_grads_close(r["lse"][:2], r["lse_indep"][:2], tol, f"lse-only vs direct is_causal={c}")
        # The lse does not depend on v.
        assert np.all(np.asarray(r["lse"][2]).astype(np.float32) == 0)
        # The lse term changes the gradients (it is not silently dropped).
        assert _rel_err(r["both"][0], r["lse"][0]) > 1e-2


# ----------------------------------------------------------------------------------------------
# Transformations around the gradient
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, BF16], ids=lambda d: jnp.dtype(d).name)
def test_jit_of_grad_and_value_and_grad(dtype):
    q, k, v, w, _ = _inputs(300, 1, 6, 10, 4, 2, 16, dtype)
    loss = _out_loss(functools.partial(jax_tk.attention, is_causal=True), w)
    ref_loss = _out_loss(functools.partial(reference.attention, scale=0.25, is_causal=True), w)
    want_value, want_grads = jax.jit(jax.value_and_grad(ref_loss, argnums=ARGS))(q, k, v)

    grads_jit = jax.jit(jax.grad(loss, argnums=ARGS))(q, k, v)
    value, grads_vg = jax.jit(jax.value_and_grad(loss, argnums=ARGS))(q, k, v)

    tol = TOL[dtype]
    _assert_grads_close(grads_jit, want_grads, tol, "jit(grad)")
    _assert_grads_close(grads_vg, want_grads, tol, "jit(value_and_grad)")
    for g1, g2 in zip(grads_jit, grads_vg):
        np.testing.assert_array_equal(np.asarray(g1), np.asarray(g2))
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-4, atol=1e-4)


def test_grad_single_argument_and_has_aux():
    q, k, v, w, _ = _inputs(301, 1, 5, 7, 2, 1, 8, F32)

    def loss(q):
        out = jax_tk.attention(q, k, v)
        return jnp.sum(out * w), out

    (value, out), dq = jax.jit(jax.value_and_grad(loss, has_aux=True))(q)
    ref_loss = lambda q: jnp.sum(reference.attention(q, k, v, scale=1 / np.sqrt(8), is_causal=False) * w)
    want_value, want = jax.jit(jax.value_and_grad(ref_loss))(q)
    assert out.shape == q.shape
    assert _rel_err(dq, want) < 1e-5
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5, atol=1e-5)


def test_grad_under_vmap():
    rng = np.random.default_rng(302)
    q = _randn(rng, (3, 1, 5, 4, 8), F32)
    k = _randn(rng, (3, 1, 7, 2, 8), F32)
    v = _randn(rng, (3, 1, 7, 2, 8), F32)
    w = _randn(rng, (1, 5, 4, 8), F32)
    grad = jax.grad(_out_loss(functools.partial(jax_tk.attention, is_causal=True), w), argnums=ARGS)
    ref_grad = jax.grad(
        _out_loss(functools.partial(reference.attention, scale=1 / np.sqrt(8), is_causal=True), w), argnums=ARGS
    )
    got = jax.jit(jax.vmap(grad))(q, k, v)
    want = jax.jit(jax.vmap(ref_grad))(q, k, v)
    _assert_grads_close(got, want, 1e-5, "vmap(grad)")
