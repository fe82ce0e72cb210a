"""jax_tk.ragged_dot on two GPUs (the kernels, not the reference): lhs's rows split under sharded jit
(each GPU runs the grouped GEMM on its rows, values and gradients, no all-gather), and the
expert-parallel layer of examples/expert_parallel.py (experts split over the GPUs, tokens exchanged
with all_to_all), values and gradients against the layer on one GPU. Skipped without 2 CUDA GPUs.
(tests/gemm/test_gemm_sharding.py runs the same on 8 CPU devices.)
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_tk
from helpers import collectives, cuda_devices, load_example, randn, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(len(cuda_devices()) < 2, reason="needs 2 CUDA GPUs"),
]

BF16, F32 = jnp.bfloat16, jnp.float32


def _mesh(name="x"):
    return jax.make_mesh((2,), (name,), axis_types=(AxisType.Explicit,), devices=cuda_devices()[:2])


def test_ragged_dot_rows_split():
    rng = np.random.default_rng(0)
    m, k, n, g = 1000, 256, 384, 7
    a, b = randn(rng, (m, k), BF16), randn(rng, (g, k, n), BF16)
    sizes = jnp.asarray([300, 0, 1, 255, 200, 100, 44], jnp.int32)  # groups across the split, one empty
    dout = randn(rng, (m, n), BF16)

    def loss(a, b):
        return jnp.sum(jax_tk.ragged_dot(a, b, sizes, implementation="tk").astype(F32) * dout.astype(F32))

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    mesh = _mesh()
    args = jax.device_put(a, NamedSharding(mesh, P("x"))), jax.device_put(b, NamedSharding(mesh, P()))
    hlo = fn.lower(*args).compile().as_text()
    assert 'custom_call_target="jax_tk_gemm_ragged"' in hlo and "all-gather" not in collectives(hlo)
    (_, (da, db)) = fn(*args)
    want = jax.grad(lambda a, b: jnp.sum(jax.lax.ragged_dot(a, b, sizes, preferred_element_type=F32)
                                         * dout.astype(F32)), argnums=(0, 1))(a.astype(F32), b.astype(F32))
    assert rel_err(da, want[0]) < 1e-2 and rel_err(db, want[1]) < 1e-2


def test_expert_parallel_layer_against_one_gpu():
    """bf16 tokens, skewed routing (most tokens to two experts), values and gradients."""
    pytest.importorskip("optax")  # (examples/moe.py imports it)
    ep = load_example("expert_parallel.py", "expert_parallel")
    moe = ep.moe
    width, hidden, experts, top_k, tokens = 256, 512, 8, 2, 2 * 512
    p = ep.example_params(jax.random.key(3), width, hidden, experts)
    p["router"] = p["router"].at[:, 5].add(3.0).at[:, 2].add(2.0)
    x = jax.random.normal(jax.random.key(4), (tokens, width)).astype(BF16)
    dout = jax.random.normal(jax.random.key(5), x.shape).astype(BF16)

    def loss(f):
        return lambda x, p: jnp.sum(f(x, p).astype(F32) * dout.astype(F32))

    one = jax.jit(lambda x, p: moe.moe_layer(x, p, top_k, moe.ragged_dot_tk)[0])
    want, want_grads = one(x, p), jax.jit(jax.grad(loss(one), argnums=(0, 1)))(x, p)
    mesh = _mesh("e")
    xs = jax.device_put(x, NamedSharding(mesh, P("e")))
    ps = jax.device_put(p, {k: NamedSharding(mesh, s) for k, s in ep.param_specs("e").items()})
    f = jax.jit(ep.sharded_moe(mesh, "e", top_k))
    hlo = f.lower(xs, ps).compile().as_text()
    assert "all-to-all" in collectives(hlo) and 'custom_call_target="jax_tk_gemm_ragged"' in hlo
    assert rel_err(f(xs, ps), want) < 1e-2
    grads = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(xs, ps)
    for got, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        assert rel_err(got, w) < 2e-2
