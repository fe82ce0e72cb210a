"""CPU tests of jax_tk.linear_attention's paths: the recurrence against an independent float64 numpy
loop, and the chunked XLA path against the recurrence, outputs, final states and gradients in every
input (T not a multiple of the chunk, initial states, grouped value heads, l2 normalization, packed
sequences, low-precision inputs), with a perturbed decay that the comparisons must notice. Forward and
gradient of a configuration are one compilation (``evaluate``), shared by the tests that use it."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import randn, rel_err
from jax_tk import linear_attention as la
from jax_tk._core import extension

BF16, F32 = jnp.bfloat16, jnp.float32
# float32 chunked vs float32 recurrence: they differ by rounding only (about 1e-7 here, 1e-6 in the
# gradients); a wrong decay, mask or solve is off by far more.
TOL, GRAD_TOL = 2e-5, 1e-4


def inputs(seed, b, t, h, hv, kd, vd, *, dtype=F32, n_states=None, delta=True, g_range=(-0.12, -0.002), k_scale=1.0):
    """q, k [b, t, h, kd] (k times ``k_scale``), v [b, t, hv, vd] in ``dtype``; g [b, t, hv] (log decays in
    ``g_range``), beta [b, t, hv] in (0, 1) (None for simple GLA), an initial state [n_states or b, hv, kd,
    vd] float32, and float32 cotangents for o and the final state. (Without l2 normalization, a small
    ``k_scale`` keeps the delta rule contractive.)"""
    rng = np.random.default_rng(seed)
    q, v = randn(rng, (b, t, h, kd), dtype), randn(rng, (b, t, hv, vd), dtype)
    k = jnp.asarray((rng.standard_normal((b, t, h, kd), dtype=np.float32) * k_scale).astype(jnp.dtype(dtype)))
    g = jnp.asarray(rng.uniform(*g_range, (b, t, hv)).astype(np.float32))
    beta = jnp.asarray(rng.uniform(0.05, 1.0, (b, t, hv)).astype(np.float32)) if delta else None
    state = randn(rng, (n_states or b, hv, kd, vd), F32)
    cotangents = randn(rng, v.shape, F32), randn(rng, state.shape, F32)
    return q, k, v, g, beta, state, cotangents


def run(implementation, q, k, v, g, beta, state, **kwargs):
    """gated_delta_rule (beta given) or simple_gla (beta None), with the final state."""
    if beta is None:
        kwargs.pop("use_qk_l2norm", None)
        return la.simple_gla(q, k, v, g, initial_state=state, output_final_state=True,
                             implementation=implementation, **kwargs)
    return la.gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                               implementation=implementation, **kwargs)


def evaluate(q, k, v, g, beta, state, cotangents=None, cu_seqlens=None, *, implementation=None, use_qk_l2norm=False,
             chunk_size=None):
    """``((o, final state), gradients)``: through the op (``chunk_size=None``) or the chunked path at
    another chunk size (small chunks put several boundaries in short tests); with ``cotangents`` (do,
    dstate), the gradients of <o, do> + <final state, dstate> in (q, k, v, g, [beta,] state), else None."""
    # (every option passed by name, whether given or not: jit's cache then finds one compilation per
    # configuration, however the tests spell the call)
    return _evaluate(q, k, v, g, beta, state, cotangents, cu_seqlens, implementation=implementation,
                     use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)


@functools.partial(jax.jit, static_argnames=("implementation", "use_qk_l2norm", "chunk_size"))
def _evaluate(q, k, v, g, beta, state, cotangents, cu_seqlens, *, implementation, use_qk_l2norm, chunk_size):
    def forward(q, k, v, g, beta, state):
        if chunk_size is None:
            return run(implementation, q, k, v, g, beta, state, use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens)
        return la.reference.chunked(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=state,
                                    cu_seqlens=cu_seqlens, output_final_state=True, use_qk_l2norm=use_qk_l2norm,
                                    chunk_size=chunk_size)
    if cotangents is None:
        return forward(q, k, v, g, beta, state), None
    out, vjp = jax.vjp(forward, q, k, v, g, beta, state)
    return out, tuple(x for x in vjp(cotangents) if x is not None)  # (no beta: simple GLA)


def assert_close(got, want, tol=TOL, grad_tol=GRAD_TOL):
    """Outputs and final states (and gradients, where both have them) within the tolerances."""
    (o, f), grads = got
    (o_ref, f_ref), grads_ref = want
    assert o.shape == o_ref.shape and f.shape == f_ref.shape
    assert rel_err(o, o_ref) < tol and rel_err(f, f_ref) < tol, (rel_err(o, o_ref), rel_err(f, f_ref))
    names = ("q", "k", "v", "g", "beta", "initial_state") if grads and len(grads) == 6 else \
        ("q", "k", "v", "g", "initial_state")
    for name, a, b in zip(names, grads or (), grads_ref or ()):
        assert a.shape == b.shape and np.isfinite(np.asarray(a)).all(), name
        assert rel_err(a, b) < grad_tol, (name, rel_err(a, b))


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


@pytest.mark.parametrize("delta,l2norm", [(True, True), (False, False)])
def test_recurrence_matches_numpy(delta, l2norm):
    q, k, v, g, beta, state, _ = inputs(0, 2, 19, 1, 3, 8, 4, delta=delta)
    (o, final), _ = evaluate(q, k, v, g, beta, state, implementation="reference", use_qk_l2norm=l2norm)
    o_np, final_np = numpy_recurrence(q, k, v, g, beta, state, 8 ** -0.5, l2norm)
    assert o.dtype == F32 and final.dtype == F32
    assert rel_err(o, o_np) < 1e-5 and rel_err(final, final_np) < 1e-5


# The shape the op's own path is tried on (forward and gradients), reused by other tests (one compilation).
SHAPE = dict(b=2, t=130, h=2, hv=4, kd=16, vd=32)


# (op, T, chunk, l2 normalization, q/k heads, value heads, gradients): T not a multiple of the chunk,
# one and several chunks, value heads grouped or not.
@pytest.mark.parametrize("op,t,chunk,l2norm,h,hv,grads", [
    ("gdr", 130, 64, True, 2, 4, True), ("gla", 130, 64, False, 2, 4, True), ("gdr", 37, 16, False, 2, 2, False)])
def test_chunked_matches_recurrence(op, t, chunk, l2norm, h, hv, grads):
    q, k, v, g, beta, state, ct = inputs(1, 2, t, h, hv, 16, 32, delta=op == "gdr", k_scale=1.0 if l2norm else 0.25)
    ct = ct if grads else None
    want = evaluate(q, k, v, g, beta, state, ct, implementation="reference", use_qk_l2norm=l2norm)
    got = evaluate(q, k, v, g, beta, state, ct, use_qk_l2norm=l2norm, chunk_size=None if chunk == 64 else chunk)
    assert_close(got, want)


def test_chunk_size_is_the_contract():
    assert la.chunk_size() == extension.header_constants("linear_attention")["CHUNK"] == 64


def test_a_perturbed_decay_is_noticed():
    """The comparisons above can fail: one token's decay moved by 0.3, or its beta halved (one of 1040
    tokens and heads), moves the output far past TOL."""
    q, k, v, g, beta, state, ct = inputs(3, **SHAPE)
    call = lambda g, beta: evaluate(q, k, v, g, beta, state, ct, use_qk_l2norm=True)[0]
    o, f = call(g, beta)
    g_bad, beta_bad = np.asarray(g).copy(), np.asarray(beta).copy()
    g_bad[0, 120, 1] -= 0.3
    beta_bad[0, 120, 1] *= 0.5
    o_bad, f_bad = call(jnp.asarray(g_bad), beta)
    assert rel_err(o_bad, o) > 50 * TOL and rel_err(f_bad, f) > 50 * TOL
    o_bad, _ = call(g, jnp.asarray(beta_bad))
    assert rel_err(o_bad, o) > 50 * TOL


# Packed sequences: empty ones, one of a single token, one longer than a chunk, boundaries inside chunks.
CU = np.array([0, 1, 1, 40, 58, 80], np.int32)


def test_cu_seqlens_matches_separate_sequences():
    """The delta rule on packed sequences (a traced cu_seqlens), in chunks of 16 (several per sequence),
    outputs, final states and gradients; each sequence also run alone in the numpy loop."""
    q, k, v, g, beta, states, ct = inputs(4, 1, 80, 2, 4, 16, 16, n_states=len(CU) - 1, k_scale=0.25)
    cu = jnp.asarray(CU)
    want = evaluate(q, k, v, g, beta, states, ct, cu, implementation="reference")
    assert_close(evaluate(q, k, v, g, beta, states, ct, cu, chunk_size=16), want)
    (o_rec, f_rec), _ = want
    o_rec, f_rec, q, k, v, g, beta, states = map(np.asarray, (o_rec, f_rec, q, k, v, g, beta, states))
    for n, (a, e) in enumerate(zip(CU[:-1], CU[1:])):
        if a == e:
            np.testing.assert_array_equal(f_rec[n], states[n])  # an empty sequence keeps its state
            continue
        part = lambda x: x[:, a:e]
        o_n, f_n = numpy_recurrence(*map(part, (q, k, v, g, beta)), states[n:n + 1], 16 ** -0.5)
        assert rel_err(o_rec[:, a:e], o_n) < 1e-5 and rel_err(f_rec[n], f_n[0]) < 1e-5


def test_cu_seqlens_in_the_op_without_initial_state():
    """simple GLA on packed sequences through the op itself (chunks of 64), from zero states."""
    q, k, v, g, _, _, _ = inputs(5, 1, 80, 2, 2, 16, 16, delta=False)

    @functools.partial(jax.jit, static_argnums=1)
    def fn(cu, implementation):
        return la.simple_gla(q, k, v, g, cu_seqlens=cu, output_final_state=True, implementation=implementation)

    (o, f), (o_ref, f_ref) = fn(CU, None), fn(CU, "reference")
    assert f.shape == (len(CU) - 1, 2, 16, 16)
    assert_close(((o, f), None), ((o_ref, f_ref), None))
    np.testing.assert_array_equal(np.asarray(f)[1], 0.0)  # the empty sequence: its (zero) initial state
    q, k, v, g = map(np.asarray, (q, k, v, g))
    o_n, f_n = numpy_recurrence(q[:, 40:58], k[:, 40:58], v[:, 40:58], g[:, 40:58], None, np.zeros((1, 2, 16, 16)),
                                16 ** -0.5)
    assert rel_err(np.asarray(o)[:, 40:58], o_n) < 1e-5 and rel_err(f[3], f_n[0]) < 1e-5


def test_low_precision_inputs():
    """bfloat16 q, k, v (and g, beta): the output in bfloat16, the state float32, the math float32 (the
    float32 result on the same rounded values, rounded once)."""
    q, k, v, g, beta, state, ct = inputs(7, **SHAPE, dtype=BF16)
    g, beta = g.astype(BF16), beta.astype(BF16)
    (o, f), _ = evaluate(q, k, v, g, beta, state, use_qk_l2norm=True)
    assert o.dtype == BF16 and f.dtype == F32
    (o32, f32), _ = evaluate(*(x.astype(F32) for x in (q, k, v, g, beta)), state, ct, use_qk_l2norm=True)
    assert rel_err(o, o32) < 1e-2 and rel_err(f, f32) < 1e-5
