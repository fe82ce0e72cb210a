"""CPU tests of jax_tk.linear_attention's gradients beyond those of test_linear_attention.py: a long
sequence (outputs and gradients of both paths), and the recurrence's gradient against finite
differences."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.test_util import check_grads

from test_linear_attention import assert_close, evaluate, inputs, run


def test_long_sequence():
    """T = 4096, decays from 0 (none) to -60 (exp(G_i - G_j) over a whole chunk underflows): outputs,
    final state and every gradient finite and equal to the recurrence's."""
    q, k, v, g, beta, state, ct = inputs(13, 1, 4096, 1, 1, 8, 8, g_range=(-1.0, 0.0))
    g_np = np.asarray(g).copy()
    g_np[0, ::97], g_np[0, 5::301] = 0.0, -60.0
    g = jnp.asarray(g_np)
    want = evaluate(q, k, v, g, beta, state, ct, implementation="reference", use_qk_l2norm=True)
    got = evaluate(q, k, v, g, beta, state, ct, use_qk_l2norm=True)
    assert np.isfinite(np.asarray(got[0][0])).all() and np.isfinite(np.asarray(got[0][1])).all()
    assert_close(got, want, grad_tol=1e-3)


def test_recurrence_gradients_match_finite_differences():
    """The oracle's own gradient (of o and the final state, the delta rule with l2 normalization) against
    central differences, in float32 on a small problem (steps of 1e-2: truncation and rounding both well
    below the tolerance). Simple GLA's gradient is checked through the two paths' agreement."""
    q, k, v, g, beta, state, _ = inputs(15, 1, 6, 1, 2, 4, 3)
    f = jax.jit(lambda *args: run("reference", *args, use_qk_l2norm=True))
    check_grads(f, (q, k, v, g, beta, state), order=1, modes=["rev"], eps=1e-2, atol=1e-2, rtol=1e-2)
