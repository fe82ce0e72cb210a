"""The backward kernels (H100/H200) of simple GLA and the gated delta rule against the float32
recurrence's gradients: T not a multiple of the chunk, packed sequences with an empty and a length-1
one, initial states and the final states' cotangent, grouped value heads, K 64 and 128, V 64 to 192,
bf16 and fp16; the kernels' results poisoned with NaN before they run; the ops' gradients under jit
through the kernels."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import nan, randn, rel_err
from jax_tk import linear_attention as la
from jax_tk._core import extension
from jax_tk.linear_attention import launch, reference
from test_la_kernels_gpu import CASES  # (the forward's shapes)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(extension.cuda_device_capability() != (9, 0), reason="the kernel runs on sm_90a")]
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
TOL = {BF16: 3e-2, F16: 1e-2}

def inputs(seed, b, t, h, hv, kd, vd, dtype, n):
    """q, k (rows of about unit norm: the delta rule stays contractive), v, g, beta, a state, dO, dht."""
    rng = np.random.default_rng(seed)
    q, v = randn(rng, (b, t, h, kd), dtype), randn(rng, (b, t, hv, vd), dtype)
    k = jnp.asarray((rng.standard_normal((b, t, h, kd)) / np.sqrt(kd)).astype(np.float32)).astype(dtype)
    g = jnp.asarray(rng.uniform(-0.2, -0.001, (b, t, hv)).astype(np.float32))
    beta = jnp.asarray(rng.uniform(0.05, 1.0, (b, t, hv)).astype(np.float32))
    state, dht = randn(rng, (n, hv, kd, vd), F32), randn(rng, (n, hv, kd, vd), F32)
    do = randn(rng, (b, t, hv, vd), dtype)
    return q, k, v, g, beta, state, do, dht


@functools.partial(jax.jit, static_argnames=("scale",))
def kernels(q, k, v, g, beta, cu, state, do, dht, *, scale):
    """(dq, dk, dv, dg, dbeta or None, dh0) of the forward kernels (keeping what the backward takes) and
    the backward kernels (simple GLA's where beta is None), every result of the backward poisoned first."""
    b, t, h, kd = q.shape
    hv = v.shape[2]
    # dq, dk: like q with a value head per head, else float32 per value head (both kinds among CASES)
    per_head, gate = nan(q.shape, q.dtype) if hv == h else nan((b, t, hv, kd), F32), nan((b, hv, t), F32)
    if beta is None:
        _, _, states = launch.gla_fwd(q, k, v, g, cu, state, scale, keep_states=True)
        out_init = (per_head, per_head, nan(v.shape, v.dtype), gate, nan(dht.shape, F32), nan(states.shape, states.dtype))
        dq, dk, dv, dg, dh0 = launch.gla_bwd(q, k, v, g, cu, states, do, dht, scale, out_init=out_init)
        return dq, dk, dv, dg, None, dh0
    _, _, *kept = launch.gdr_fwd(q, k, v, g, beta, cu, state, scale, keep=True)
    out_init = (per_head, per_head, nan(v.shape, v.dtype), gate, gate, nan(dht.shape, F32), nan(kept[0].shape, q.dtype),
                nan(v.shape, v.dtype))
    return launch.gdr_bwd(q, k, v, g, beta, cu, kept, do, dht, scale, out_init=out_init)


@pytest.mark.parametrize("delta", [False, True], ids=["gla", "delta"])
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"case{i}" for i in range(len(CASES))])
def test_against_recurrence(case, delta):
    b, t, h, hv, kd, vd, cu, with_state, dtype = CASES[case]
    cu = None if cu is None else jnp.asarray(cu, jnp.int32)
    n = b if cu is None else cu.shape[0] - 1
    q, k, v, g, beta, state, do, dht = inputs(case, b, t, h, hv, kd, vd, dtype, n)
    state, beta = (state if with_state else jnp.zeros_like(state)), (beta if delta else None)
    scale = kd ** -0.5

    def loss(q, k, v, g, beta, h0):
        o, s = reference.recurrent(q, k, v, g, beta, scale=scale, initial_state=h0, cu_seqlens=cu, output_final_state=True)
        return jnp.sum(o * do.astype(F32)) + jnp.sum(s * dht)
    f32 = lambda x: x.astype(F32)
    want = jax.jit(jax.grad(loss, argnums=range(6)))(f32(q), f32(k), f32(v), g, beta, state)
    got = kernels(q, k, v, g, beta, cu, state, do, dht, scale=scale)
    rows = np.ones(t, bool)
    if cu is not None:  # (rows of no sequence: not compared)
        rows[:] = False
        for s, e in zip(np.asarray(cu)[:-1], np.asarray(cu)[1:]):
            rows[s:e] = True
    for name, x, y in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        if x is None:
            continue
        x, y = np.asarray(x.astype(F32)), np.asarray(y, np.float32)
        if name != "dh0":
            x, y = x[:, rows], y[:, rows]
        assert np.isfinite(x).all(), f"{name}: unwritten (NaN) entries"
        assert rel_err(x, y) < TOL[dtype], name


@pytest.mark.parametrize("delta", [False, True], ids=["gla", "delta"])
def test_op_gradient_takes_the_kernels(delta):
    """The op's gradient under jit lowers to the backward kernels and matches the chunked path's (the
    gated delta rule with l2 normalization)."""
    q, k, v, g, beta, state, do, dht = inputs(11, 2, 333, 2, 4, 128, 128, BF16, 2)
    target = "jax_tk_gated_delta_rule_bwd" if delta else "jax_tk_simple_gla_bwd"

    def loss(impl, q, k, v, g, beta, h0):
        if delta:
            o, s = la.gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True,
                                       implementation=impl)
        else:
            o, s = la.simple_gla(q, k, v, g, initial_state=h0, output_final_state=True, implementation=impl)
        return jnp.sum(o.astype(F32) * do.astype(F32)) + jnp.sum(s * dht)
    argnums = tuple(range(6)) if delta else (0, 1, 2, 3, 5)
    grad = lambda impl: jax.jit(jax.grad(functools.partial(loss, impl), argnums=argnums))
    assert target in grad(None).lower(q, k, v, g, beta, state).as_text()
    for x, y in zip(grad(None)(q, k, v, g, beta, state), grad("xla")(q, k, v, g, beta, state)):
        assert rel_err(np.asarray(x.astype(F32)), np.asarray(y.astype(F32))) < TOL[BF16]
