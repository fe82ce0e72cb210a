"""append_attention on several devices (CPU, 8 fake host devices): under jit with inputs sharded over
batch and key/value heads (explicit and auto sharding) it runs as its composition, split as
update_kv_cache and attention are, matching one device and gathering no cache; inside shard_map it
takes the fused call's path (on CUDA: the fused kernels) on the local shards.

Unless this process already has 8 CPU devices, ``test_in_subprocess`` reruns this file in a fresh
Python with them (see tests/helpers.py).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import jax_tk
from helpers import collectives, multi_device_tests, randn, rel_err
from jax_tk._core import sharding
from test_decode_sharding import CASES, _mesh, _put

F32 = jnp.float32
test_in_subprocess, needs_devices = multi_device_tests(__file__)


def _inputs(n, kh, b=8, t=2, h=32, s=64):
    rng = np.random.default_rng(0)
    q, nk, nv = randn(rng, (b, t, n, h), F32), randn(rng, (b, t, kh, h), F32), randn(rng, (b, t, kh, h), F32)
    kc, vc = randn(rng, (b, s, kh, h), F32), randn(rng, (b, s, kh, h), F32)
    return q, nk, nv, kc, vc, jnp.asarray(rng.integers(0, s, size=b), jnp.int32)


def _step(q, nk, nv, kc, vc, lens):
    return jax_tk.decode.append_attention(q, nk, nv, kc, vc, lens, local_window_size=(40, 0), logits_soft_cap=20.0)


@needs_devices
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_jit_sharded(case, axis_type):
    name, n, kh, q_spec, kv_spec, _ = case
    mesh = _mesh(axis_type)
    args = _inputs(n, kh)
    batch = P(q_spec[0]) if len(q_spec) else P()
    specs = (q_spec, kv_spec, kv_spec, kv_spec, kv_spec, batch)
    sharded = tuple(_put(x, mesh, spec) for x, spec in zip(args, specs))
    assert not sharding.runs_locally(sharded[0])
    fn = jax.jit(_step)
    assert not collectives(fn.lower(*sharded).compile().as_text())
    for got, want in zip(fn(*sharded), _step(*args), strict=True):
        assert rel_err(got, want) < 1e-5


@needs_devices
def test_shard_map_runs_locally():
    mesh = _mesh(AxisType.Explicit)
    args = _inputs(8, 4)
    spec = (P("data", None, "model"),) * 5 + (P("data"),)
    seen = []

    def local(*xs):
        seen.append(sharding.runs_locally(xs[0]))
        return _step(*xs)

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec[:3]))
    for got, want in zip(fn(*(_put(x, mesh, s) for x, s in zip(args, spec))), _step(*args), strict=True):
        assert rel_err(got, want) < 1e-5
    assert seen == [True]
