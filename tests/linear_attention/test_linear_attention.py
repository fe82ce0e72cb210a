"""CPU tests of jax_tk.linear_attention's forward paths: the recurrence against an independent float64
numpy loop, the chunked XLA path against the recurrence (T not a multiple of the chunk, initial states,
grouped value heads, l2 normalization, packed sequences, long sequences, low-precision inputs), and a
perturbed decay that the comparisons must notice."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import randn, rel_err
from jax_tk import linear_attention as la
from jax_tk._core import extension

BF16, F32 = jnp.bfloat16, jnp.float32
# float32 chunked vs float32 recurrence: they differ by rounding only (about 1e-7 here); a wrong decay,
# mask or solve is off by far more.
TOL = 2e-5


def inputs(seed, b, t, h, hv, kd, vd, *, dtype=F32, n_states=None, delta=True, g_range=(-0.6, -0.01), k_scale=1.0):
    """q, k [b, t, h, kd] (k times ``k_scale``), v [b, t, hv, vd] in ``dtype``; g [b, t, hv] (log decays in
    ``g_range``), beta [b, t, hv] in (0, 1) (None for simple GLA), and an initial state [n_states or b,
    hv, kd, vd] float32. (Without l2 normalization, a small ``k_scale`` keeps the delta rule contractive.)"""
    rng = np.random.default_rng(seed)
    q, v = randn(rng, (b, t, h, kd), dtype), randn(rng, (b, t, hv, vd), dtype)
    k = jnp.asarray((rng.standard_normal((b, t, h, kd), dtype=np.float32) * k_scale).astype(jnp.dtype(dtype)))
    g = jnp.asarray(rng.uniform(*g_range, (b, t, hv)).astype(np.float32))
    beta = jnp.asarray(rng.uniform(0.05, 1.0, (b, t, hv)).astype(np.float32)) if delta else None
    state = randn(rng, (n_states or b, hv, kd, vd), F32)
    return q, k, v, g, beta, state


def run(implementation, q, k, v, g, beta, state, **kwargs):
    """gated_delta_rule (beta given) or simple_gla (beta None), with the final state."""
    if beta is None:
        kwargs.pop("use_qk_l2norm", None)
        return la.simple_gla(q, k, v, g, initial_state=state, output_final_state=True,
                             implementation=implementation, **kwargs)
    return la.gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                               implementation=implementation, **kwargs)


@functools.partial(jax.jit, static_argnames=("implementation", "use_qk_l2norm"))
def run_jit(q, k, v, g, beta, state, implementation=None, use_qk_l2norm=False, cu_seqlens=None):
    return run(implementation, q, k, v, g, beta, state, use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens)


@functools.partial(jax.jit, static_argnames=("chunk_size", "use_qk_l2norm"))
def chunked_jit(q, k, v, g, beta, state, chunk_size, use_qk_l2norm=False, cu_seqlens=None):
    """The chunked path at any chunk size (small chunks put several chunk boundaries in short tests)."""
    return la.reference.chunked(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=state,
                                cu_seqlens=cu_seqlens, output_final_state=True, use_qk_l2norm=use_qk_l2norm,
                                chunk_size=chunk_size)


def numpy_recurrence(q, k, v, g, beta, state, scale, l2norm=False):
    """The recurrence in float64 numpy, token by token and head by head (beta None: simple GLA)."""
    q, k, v, g, state = (np.asarray(x, np.float64) for x in (q, k, v, g, state))
    if l2norm:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    b, t, h, _ = q.shape
    hv = v.shape[2]
    out, state = np.zeros(v.shape), state.copy()
    for bi in range(b):
        for j in range(hv):
            s = state[bi, j]
            for i in range(t):
                qi, ki = q[bi, i, j // (hv // h)], k[bi, i, j // (hv // h)]
                s = s * np.exp(g[bi, i, j])
                if beta is None:
                    s = s + np.outer(ki, v[bi, i, j])
                else:
                    s = s + np.outer(ki, float(beta[bi, i, j]) * (v[bi, i, j] - s.T @ ki))
                out[bi, i, j] = scale * s.T @ qi
            state[bi, j] = s
    return out, state


@pytest.mark.parametrize("delta,l2norm", [(True, True), (True, False), (False, False)])
def test_recurrence_matches_numpy(delta, l2norm):
    q, k, v, g, beta, state = inputs(0, 2, 19, 1, 3, 8, 4, delta=delta)
    o, final = run_jit(q, k, v, g, beta, state, implementation="reference", use_qk_l2norm=l2norm)
    o_np, final_np = numpy_recurrence(q, k, v, g, beta, state, 8 ** -0.5, l2norm)
    assert o.dtype == F32 and final.dtype == F32
    assert rel_err(o, o_np) < 1e-5 and rel_err(final, final_np) < 1e-5


# (op, T, chunk, l2 normalization, q/k heads, value heads): T not a multiple of the chunk, one and
# several chunks, value heads grouped or not. The first shape is the one the other tests reuse (one
# compilation each).
SHAPE = dict(b=2, t=130, h=2, hv=4, kd=16, vd=32)
CASES = [("gdr", 130, 64, True, 2, 4), ("gdr", 37, 16, False, 2, 2), ("gla", 130, 64, False, 2, 4),
         ("gla", 37, 16, False, 2, 2)]


@pytest.mark.parametrize("op,t,chunk,l2norm,h,hv", CASES)
def test_chunked_matches_recurrence(op, t, chunk, l2norm, h, hv):
    q, k, v, g, beta, state = inputs(1, 2, t, h, hv, 16, 32, delta=op == "gdr", k_scale=1.0 if l2norm else 0.25)
    o_ref, f_ref = run_jit(q, k, v, g, beta, state, implementation="reference", use_qk_l2norm=l2norm)
    if chunk == la.chunk_size():
        o, f = run_jit(q, k, v, g, beta, state, use_qk_l2norm=l2norm)  # the op's own path
    else:
        o, f = chunked_jit(q, k, v, g, beta, state, chunk, use_qk_l2norm=l2norm)
    assert o.shape == v.shape and f.shape == state.shape
    assert rel_err(o, o_ref) < TOL and rel_err(f, f_ref) < TOL


def test_chunk_size_is_the_contract():
    assert la.chunk_size() == extension.header_constants("linear_attention")["CHUNK"] == 64


def test_a_perturbed_decay_is_noticed():
    """The comparisons above can fail: one token's decay moved by 0.3, or its beta halved (one of 1040
    tokens and heads), moves the output far past TOL."""
    q, k, v, g, beta, state = inputs(3, **SHAPE)
    o, f = run_jit(q, k, v, g, beta, state, use_qk_l2norm=True)
    g_bad, beta_bad = np.asarray(g).copy(), np.asarray(beta).copy()
    g_bad[0, 120, 1] -= 0.3
    beta_bad[0, 120, 1] *= 0.5
    o_bad, f_bad = run_jit(q, k, v, jnp.asarray(g_bad), beta, state, use_qk_l2norm=True)
    assert rel_err(o_bad, o) > 50 * TOL and rel_err(f_bad, f) > 50 * TOL
    o_bad, _ = run_jit(q, k, v, g, jnp.asarray(beta_bad), state, use_qk_l2norm=True)
    assert rel_err(o_bad, o) > 50 * TOL


# Packed sequences: empty ones, one of a single token, one longer than a chunk, boundaries inside chunks.
CU = np.array([0, 1, 1, 40, 58, 80], np.int32)


@pytest.mark.parametrize("delta", [True, False])
def test_cu_seqlens_matches_separate_sequences(delta):
    q, k, v, g, beta, states = inputs(4, 1, 80, 2, 4, 16, 16, n_states=len(CU) - 1, delta=delta, k_scale=0.25)
    cu = jnp.asarray(CU)
    o_rec, f_rec = map(np.asarray, run_jit(q, k, v, g, beta, states, implementation="reference", cu_seqlens=cu))
    for o, f in (run_jit(q, k, v, g, beta, states, cu_seqlens=cu), chunked_jit(q, k, v, g, beta, states, 16, cu_seqlens=cu)):
        assert rel_err(o, o_rec) < TOL and rel_err(f, f_rec) < TOL
    # Each sequence on its own (the numpy loop): no state crosses a boundary.
    q, k, v, g, beta, states = (None if x is None else np.asarray(x) for x in (q, k, v, g, beta, states))
    for n, (a, e) in enumerate(zip(CU[:-1], CU[1:])):
        if a == e:
            np.testing.assert_array_equal(f_rec[n], states[n])  # an empty sequence keeps its state
            continue
        part = lambda x: None if x is None else x[:, a:e]
        o_n, f_n = numpy_recurrence(*map(part, (q, k, v, g, beta)), states[n:n + 1], 16 ** -0.5)
        assert rel_err(o_rec[:, a:e], o_n) < 1e-5 and rel_err(f_rec[n], f_n[0]) < 1e-5


def test_cu_seqlens_traced_and_default_state():
    """cu_seqlens as a jit argument (values unknown at trace time), no initial state."""
    q, k, v, g, beta, _ = inputs(5, 1, 80, 2, 2, 16, 16)

    @functools.partial(jax.jit, static_argnums=1)
    def fn(cu, implementation):
        return la.gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True, use_qk_l2norm=True,
                                   implementation=implementation)

    (o, f), (o_ref, f_ref) = fn(CU, None), fn(CU, "reference")
    assert f.shape == (len(CU) - 1, 2, 16, 16)
    assert rel_err(o, o_ref) < TOL and rel_err(f, f_ref) < TOL
    np.testing.assert_array_equal(np.asarray(f)[1], 0.0)  # the empty sequence: its (zero) initial state


@pytest.mark.parametrize("delta", [True, False])
def test_long_sequence(delta):
    """T = 4096 with decays from 0 (none) to -60 (all but erased): finite, and the paths agree."""
    q, k, v, g, beta, state = inputs(6, 1, 4096, 1, 1, 8, 8, delta=delta, g_range=(-1.0, 0.0))
    g_np = np.asarray(g).copy()
    g_np[0, ::97], g_np[0, 5::301] = 0.0, -60.0
    g = jnp.asarray(g_np)
    o_ref, f_ref = run_jit(q, k, v, g, beta, state, implementation="reference", use_qk_l2norm=delta)
    o, f = run_jit(q, k, v, g, beta, state, use_qk_l2norm=delta)
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(f)).all()
    assert rel_err(o, o_ref) < TOL and rel_err(f, f_ref) < TOL


def test_low_precision_inputs():
    """bfloat16 q, k, v (and g, beta): the output in bfloat16, the state float32, the math float32 (the
    float32 result on the same rounded values, rounded once)."""
    q, k, v, g, beta, state = inputs(7, **SHAPE, dtype=BF16)
    g, beta = g.astype(BF16), beta.astype(BF16)
    o, f = run_jit(q, k, v, g, beta, state, use_qk_l2norm=True)
    assert o.dtype == BF16 and f.dtype == F32
    o32, f32 = run_jit(*(x.astype(F32) for x in (q, k, v, g, beta)), state, use_qk_l2norm=True)
    assert rel_err(o, o32) < 1e-2 and rel_err(f, f32) < 1e-5
