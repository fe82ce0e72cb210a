"""jax_tk.decode.mla_attention on several devices (CPU, 8 fake host devices): under jit with inputs
sharded over batch and query heads (explicit and auto sharding, contiguous and paged latent caches),
its gradients, and inside shard_map. Results match one device; compiled programs gather nothing.

Unless this process already has 8 CPU devices, ``test_in_subprocess`` reruns this file in a fresh
Python with them (see tests/helpers.py).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_tk
from helpers import collectives, multi_device_tests, randn, rel_err
from test_decode_sharding import _gathered_shapes, _mesh, _pages, _put

F32 = jnp.float32


test_in_subprocess, needs_devices = multi_device_tests(__file__)


def _inputs(seed, b=8, t=2, n=16, d=576, s=64, page_size=16):
    rng = np.random.default_rng(seed)
    q, cache = randn(rng, (b, t, n, d), F32), randn(rng, (b, s, 1, d), F32)
    lens = jnp.asarray(np.concatenate([[0], rng.integers(1, s + 1, size=b - 1)]), jnp.int32)
    pool, table = _pages(np.random.default_rng(seed + 100), cache, page_size)
    return q, cache, lens, pool, table


def _mla(q, cache, lens, table=None):
    return jax_tk.decode.mla_attention(q, cache, lens, page_table=table)


# (name, query spec, contiguous-cache spec): batch over "data" and query heads over "model" (the one
# latent head stays whole on each device), or the batch over both axes. A paged pool is replicated.
CASES = [
    ("batch_heads", P("data", None, "model"), P("data")),
    ("all_axes_batch", P(("data", "model")), P(("data", "model"))),
]


def _args(mesh, case, paged, q, cache, lens, pool, table):
    _, q_spec, cache_spec = case
    batch = P(q_spec[0])
    if paged:
        return (_put(q, mesh, q_spec), _put(pool, mesh, P()), _put(lens, mesh, batch), _put(table, mesh, batch))
    return (_put(q, mesh, q_spec), _put(cache, mesh, cache_spec), _put(lens, mesh, batch))


@needs_devices
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_jit_sharded(case, paged, axis_type):
    mesh = _mesh(axis_type)
    q, cache, lens, pool, table = _inputs(0)
    args = _args(mesh, case, paged, q, cache, lens, pool, table)
    fn = jax.jit(_mla)
    hlo = fn.lower(*args).compile().as_text()
    assert not collectives(hlo), collectives(hlo)
    # The op runs on per-device shards: custom_partitioning (auto) or shard_map (explicit).
    lowered = fn.lower(*args).as_text()
    assert ("CustomSPMDPartitioning" in lowered) == (axis_type == AxisType.Auto)
    assert ("manual_computation" in lowered) == (axis_type == AxisType.Explicit)
    out = fn(*args)
    want = _mla(q, pool, lens, table) if paged else _mla(q, cache, lens)
    assert rel_err(out, want) < 1e-5
    padded = lambda spec: tuple(spec) + (None,) * (4 - len(spec))
    assert padded(out.sharding.spec) == padded(case[1])  # the query's layout


@needs_devices
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_gradients_jit_sharded(paged, axis_type):
    """The gradients in the query and the latent cache on the shards: the cache's summed over the head
    shards that share the latent head (and a pool's over the batch shards); nothing gathered."""
    mesh = _mesh(axis_type)
    q, cache, lens, pool, table = _inputs(1)
    args = _args(mesh, CASES[0], paged, q, cache, lens, pool, table)
    grad = jax.grad(lambda q, c, *rest: jnp.sum(_mla(q, c, *rest) ** 2), argnums=(0, 1))
    fn = jax.jit(grad)
    hlo = fn.lower(*args).compile().as_text()
    assert not _gathered_shapes(hlo), _gathered_shapes(hlo)
    want = grad(q, pool, lens, table) if paged else grad(q, cache, lens)
    for got, w in zip(fn(*args), want):
        assert rel_err(got, w) < 1e-5


@needs_devices
def test_in_shard_map():
    """Inside shard_map the op runs on the local shards as given (batch over "data", heads over "model")."""
    mesh = _mesh(AxisType.Explicit)
    q, cache, lens, _, _ = _inputs(2)
    specs = (P("data", None, "model"), P("data"), P("data"))
    f = jax.shard_map(_mla, mesh=mesh, in_specs=specs, out_specs=P("data", None, "model"))
    fn = jax.jit(f)
    args = [_put(x, mesh, sp) for x, sp in zip((q, cache, lens), specs)]
    assert not collectives(fn.lower(*args).compile().as_text())
    assert rel_err(fn(*args), _mla(q, cache, lens)) < 1e-5
