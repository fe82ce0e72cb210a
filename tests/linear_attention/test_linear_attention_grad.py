"""CPU tests of jax_tk.linear_attention's gradients: JAX's autodiff of the chunked path against that of
the recurrence, in every input (packed sequences and a long sequence included), and the recurrence's
gradient against finite differences."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from helpers import randn, rel_err
from jax_tk import linear_attention as la
from test_linear_attention import CU, inputs, run

# Gradients of the two paths differ by float32 rounding (about 1e-6 here).
TOL = 1e-4


@functools.partial(jax.jit, static_argnames=("implementation", "use_qk_l2norm", "chunk_size"))
def grads(q, k, v, g, beta, state, cotangents, implementation=None, use_qk_l2norm=False, cu_seqlens=None,
          chunk_size=None):
    """The gradients in (q, k, v, g, beta, state) of <o, do> + <final state, dstate>, through the op
    (``chunk_size=None``) or the chunked path at another chunk size."""
    def loss(q, k, v, g, beta, state):
        if chunk_size is None:
            o, f = run(implementation, q, k, v, g, beta, state, use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens)
        else:
            o, f = la.reference.chunked(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=state,
                                        cu_seqlens=cu_seqlens, output_final_state=True,
                                        use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
        return jnp.sum(o * cotangents[0]) + jnp.sum(f * cotangents[1])
    argnums = (0, 1, 2, 3, 5) if beta is None else (0, 1, 2, 3, 4, 5)
    return jax.grad(loss, argnums=argnums)(q, k, v, g, beta, state)


def cotangents(seed, v, state):
    rng = np.random.default_rng(seed)
    return randn(rng, v.shape, jnp.float32), randn(rng, state.shape, jnp.float32)


def assert_grads_close(got, want, tol=TOL):
    names = ("q", "k", "v", "g", "beta", "initial_state") if len(got) == 6 else ("q", "k", "v", "g", "initial_state")
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape and np.isfinite(np.asarray(a)).all(), name
        assert rel_err(a, b) < tol, (name, rel_err(a, b))


# (op, packed sequences): T = 70 (two chunks of 64, the second partial) or 80 packed ones in chunks of 16.
@pytest.mark.parametrize("op,packed", [("gdr", False), ("gla", False), ("gdr", True)])
def test_chunked_gradients_match_recurrence(op, packed):
    delta = op == "gdr"
    if packed:
        q, k, v, g, beta, state = inputs(10, 1, 80, 2, 4, 16, 16, n_states=len(CU) - 1, k_scale=0.25)
        kwargs = dict(cu_seqlens=jnp.asarray(CU))
    else:
        q, k, v, g, beta, state = inputs(11, 2, 70, 2, 4, 16, 16, delta=delta)
        kwargs = dict(use_qk_l2norm=delta)
    ct = cotangents(12, v, state)
    want = grads(q, k, v, g, beta, state, ct, implementation="reference", **kwargs)
    got = grads(q, k, v, g, beta, state, ct, chunk_size=16 if packed else None, **kwargs)
    assert_grads_close(got, want)


def test_long_sequence_gradients():
    """T = 4096, decays from 0 to -60 (exp(G_i - G_j) over a whole chunk underflows): every gradient
    finite and equal to the recurrence's."""
    q, k, v, g, beta, state = inputs(13, 1, 4096, 1, 1, 8, 8, g_range=(-1.0, 0.0))
    g_np = np.asarray(g).copy()
    g_np[0, ::97], g_np[0, 5::301] = 0.0, -60.0
    g = jnp.asarray(g_np)
    ct = cotangents(14, v, state)
    want = grads(q, k, v, g, beta, state, ct, implementation="reference", use_qk_l2norm=True)
    got = grads(q, k, v, g, beta, state, ct, use_qk_l2norm=True)
    assert_grads_close(got, want, tol=1e-3)


@pytest.mark.parametrize("delta", [True, False])
def test_recurrence_gradients_match_finite_differences(delta):
    """The oracle's own gradient (of o and the final state) against central differences, in float32 on
    a small problem (steps of 1e-2: truncation and rounding both well below the tolerance)."""
    q, k, v, g, beta, state = inputs(15, 1, 6, 1, 2, 4, 3, delta=delta)

    @jax.jit
    def f(q, k, v, g, state, beta):
        return run("reference", q, k, v, g, beta, state, use_qk_l2norm=delta)

    args = (q, k, v, g, state) + ((beta,) if delta else ())
    check_grads(f if delta else (lambda *a: f(*a, None)), args, order=1, modes=["rev"], eps=1e-2, atol=1e-2,
                rtol=1e-2)
