"""The linear-attention forward kernels (H100/H200), simple GLA's and the gated delta rule's, against the
float32 recurrence: T not a multiple of the chunk, packed sequences with an empty and a length-1 one,
initial states, grouped value heads, K 64 and 128, V 64 to 192, bf16 and fp16, outputs, final states
and workspaces poisoned with NaN before the kernels run; the ops' gradients (the chunked path's)
through the kernels' forward; a long sequence without overflow."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import nan, randn, rel_err
from jax_tk import linear_attention as la
from jax_tk._core import extension
from jax_tk.linear_attention import launch, reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(extension.cuda_device_capability() != (9, 0), reason="the kernel runs on sm_90a")]
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
TOL = {BF16: 2e-2, F16: 5e-3}


def inputs(seed, b, t, h, hv, kd, vd, dtype, n=None):
    """q, k (rows of about unit norm: the delta rule stays contractive), v, g, beta, an initial state."""
    rng = np.random.default_rng(seed)
    q, v = randn(rng, (b, t, h, kd), dtype), randn(rng, (b, t, hv, vd), dtype)
    k = jnp.asarray((rng.standard_normal((b, t, h, kd)) / np.sqrt(kd)).astype(np.float32)).astype(dtype)
    g = jnp.asarray(rng.uniform(-0.2, -0.001, (b, t, hv)).astype(np.float32))
    beta = jnp.asarray(rng.uniform(0.05, 1.0, (b, t, hv)).astype(np.float32))
    state = randn(rng, (n or b, hv, kd, vd), F32)
    return q, k, v, g, beta, state


@functools.partial(jax.jit, static_argnames=("scale",))
def kernel(q, k, v, g, beta, cu, state, *, scale):
    """(o, final state) of the simple GLA kernel (beta None) or the gated delta rule's."""
    b, t, _, kd = q.shape
    hv, vd = v.shape[2:]
    n = b if cu is None else cu.shape[0] - 1
    out_init = (nan((b, t, hv, vd), q.dtype), nan((n, hv, kd, vd), F32))
    if beta is None:
        return launch.gla_fwd(q, k, v, g, cu, state, scale, out_init=out_init + (jnp.zeros((0,), q.dtype),))
    out_init += (nan((b, t, hv, 64), q.dtype),) + (jnp.zeros((0,), q.dtype),) * 3
    return launch.gdr_fwd(q, k, v, g, beta, cu, state, scale, out_init=out_init)


# (B, T, H, HV, K, V, cu_seqlens, with an initial state, dtype)
CASES = [
    (2, 200, 2, 2, 128, 128, None, False, BF16),
    (1, 64, 1, 1, 64, 64, None, True, BF16),
    (2, 300, 2, 4, 128, 64, None, True, F16),
    (1, 400, 2, 2, 128, 128, (0, 1, 1, 130, 400), True, BF16),
    (1, 1000, 1, 2, 64, 128, (0, 999, 1000), False, BF16),
    (3, 129, 4, 4, 64, 192, None, True, BF16),
]


@pytest.mark.parametrize("delta", [False, True], ids=["gla", "delta"])
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"case{i}" for i in range(len(CASES))])
def test_against_recurrence(case, delta):
    b, t, h, hv, kd, vd, cu, with_state, dtype = CASES[case]
    cu = None if cu is None else jnp.asarray(cu, jnp.int32)
    q, k, v, g, beta, state = inputs(case, b, t, h, hv, kd, vd, dtype, None if cu is None else cu.shape[0] - 1)
    state, beta = (state if with_state else None), (beta if delta else None)
    scale = kd ** -0.5
    want, want_state = reference.recurrent(q, k, v, g, beta, scale=scale, initial_state=state, cu_seqlens=cu,
                                           output_final_state=True)
    out, final = kernel(q, k, v, g, beta, cu, state, scale=scale)
    out, final = np.asarray(out.astype(F32)), np.asarray(final)
    if cu is not None:  # (rows of no sequence stay as they were: only the sequences' rows compare)
        rows = np.zeros(t, bool)
        for s, e in zip(np.asarray(cu)[:-1], np.asarray(cu)[1:]):
            rows[s:e] = True
        out, want = out[:, rows], np.asarray(want)[:, rows]
    assert np.isfinite(out).all() and np.isfinite(final).all(), "unwritten (NaN) outputs or states"
    assert rel_err(out, np.asarray(want, np.float32)) < TOL[dtype]
    assert rel_err(final, np.asarray(want_state)) < TOL[dtype] / 2


@pytest.mark.parametrize("delta", [False, True], ids=["gla", "delta"])
def test_ops_take_the_kernels_and_their_gradients(delta):
    """The ops run the kernels by default here (their lowering calls the targets), agree with the chunked
    path, and so do their gradients, on the backward kernels, in every input (the delta rule with l2
    normalization, done before its kernels)."""
    q, k, v, g, beta, state = inputs(7, 2, 150, 2, 2, 128, 128, BF16)
    beta = beta if delta else None
    target = "jax_tk_gated_delta_rule_fwd" if delta else "jax_tk_simple_gla_fwd"

    def op(impl, q, k, v, g, beta, state):
        if beta is None:
            return la.simple_gla(q, k, v, g, initial_state=state, output_final_state=True, implementation=impl)
        return la.gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm=True,
                                   implementation=impl)
    f = lambda impl: jax.jit(functools.partial(op, impl))
    assert target in f(None).lower(q, k, v, g, beta, state).as_text()
    (o, s), (o_ref, s_ref) = f(None)(q, k, v, g, beta, state), f("xla")(q, k, v, g, beta, state)
    assert rel_err(np.asarray(o.astype(F32)), np.asarray(o_ref.astype(F32))) < TOL[BF16]
    assert rel_err(np.asarray(s), np.asarray(s_ref)) < TOL[BF16]

    def loss(impl, *args):
        o, s = op(impl, *args)
        return jnp.sum(o.astype(F32) * 0.01) + jnp.sum(s * 0.001)
    argnums = (0, 1, 2, 3, 5) + ((4,) if delta else ())
    grads = [jax.jit(jax.grad(functools.partial(loss, impl), argnums=argnums))(q, k, v, g, beta, state)
             for impl in (None, "xla")]
    for got, want in zip(*grads):
        assert rel_err(np.asarray(got.astype(F32)), np.asarray(want.astype(F32))) < TOL[BF16]


@pytest.mark.parametrize("delta", [False, True], ids=["gla", "delta"])
def test_long_sequence_stays_finite(delta):
    q, k, v, g, beta, _ = inputs(3, 1, 32768, 1, 1, 128, 64, BF16)
    beta = beta if delta else None
    out, final = kernel(q, k, v, g, beta, None, None, scale=128 ** -0.5)
    assert np.isfinite(np.asarray(out.astype(F32))).all() and np.isfinite(np.asarray(final)).all()
    tail = [x[:, -4096:] for x in (q, k, v, g)] + [None if beta is None else beta[:, -4096:]]
    want, _ = (la.simple_gla(*tail[:4], implementation="xla") if beta is None
               else la.gated_delta_rule(*tail, implementation="xla"))
    # (with decays <= -0.001 the state forgets: the last 4k tokens from zeros come within bf16's
    # rounding of the whole sequence's outputs at its end)
    assert rel_err(np.asarray(out[:, -64:].astype(F32)), np.asarray(want[:, -64:].astype(F32))) < 5e-2
