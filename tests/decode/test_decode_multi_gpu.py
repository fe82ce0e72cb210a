"""jax_tk.decode on two GPUs (the kernel, not the reference): attention under jit with the query and the
cache split over the batch or over the key/value heads (a KV head shared by both GPUs too), contiguous
and paged, explicit and auto sharding, compiling to the decode kernel on each GPU's shard with no
collective; and a jitted decoding loop (update_kv_cache + attention in lax.scan, caches donated) with the
batch split over the GPUs, against the same loop on one GPU. Skipped without 2 CUDA GPUs.
(tests/decode/test_decode_sharding.py runs the same partitioning on 8 CPU devices.)
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_tk
from helpers import collectives, cuda_devices, randn, rel_err, scan_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(len(cuda_devices()) < 2, reason="needs 2 CUDA GPUs"),
]

BF16, F32 = jnp.bfloat16, jnp.float32
TOL = 1.2e-2  # bf16 results against the float32 reference


def _mesh(axis_type=AxisType.Explicit):
    return jax.make_mesh((2,), ("x",), axis_types=(axis_type,), devices=cuda_devices()[:2])


def _put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def _inputs(seed, b, t, n, kh, h, s, page_size):
    rng = np.random.default_rng(seed)
    q, k, v = randn(rng, (b, t, n, h), BF16), randn(rng, (b, s, kh, h), BF16), randn(rng, (b, s, kh, h), BF16)
    lens = jnp.asarray(rng.integers(t, s + 1, size=b), jnp.int32)
    per = s // page_size
    perm = rng.permutation(b * per)  # a shuffled pool of every sequence's pages
    pool = lambda c: jnp.zeros((b * per, page_size, kh, h), BF16).at[perm].set(c.reshape(b * per, page_size, kh, h))
    return q, k, v, lens, pool(k), pool(v), jnp.asarray(perm.reshape(b, per), jnp.int32)


def _attend(q, k, v, lens, table=None):
    return jax_tk.decode.attention(q, k, v, lens, page_table=table, implementation="tk")


def _reference(q, k, v, lens, table=None):
    return jax_tk.decode.attention(*(x.astype(F32) for x in (q, k, v)), lens, page_table=table, implementation="xla")


# (name, query heads, kv heads, query spec, contiguous-cache spec, pool spec)
CASES = [
    ("batch", 8, 2, P("x"), P("x"), P()),
    ("heads", 8, 2, P(None, None, "x"), P(None, None, "x"), P(None, None, "x")),
    ("kv_shared", 8, 1, P(None, None, "x"), P(), P()),
]


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_attention_sharded_runs_kernel_on_shards(case, paged, axis_type):
    _, n, kh, q_spec, kv_spec, pool_spec = case
    mesh = _mesh(axis_type)
    q, k, v, lens, kp, vp, table = _inputs(0, 4, 3, n, kh, 128, 1024, 64)
    batch = P(q_spec[0]) if len(q_spec) else P()
    if paged:
        plain = (q, kp, vp, lens, table)
        specs = (q_spec, pool_spec, pool_spec, batch, batch)
    else:
        plain = (q, k, v, lens)
        specs = (q_spec, kv_spec, kv_spec, batch)
    args = [_put(x, mesh, s) for x, s in zip(plain, specs)]
    fn = jax.jit(_attend)
    hlo = fn.lower(*args).compile().as_text()
    assert 'custom_call_target="jax_tk_decode"' in hlo
    assert not collectives(hlo)
    out = fn(*args)
    assert rel_err(out, _reference(*plain)) < TOL
    assert rel_err(out, jax.jit(_attend)(*plain)) < TOL


def test_decoding_loop_with_the_batch_split():
    """update_kv_cache + attention in a jitted lax.scan with donated caches, the batch over both GPUs:
    the same outputs and caches as on one GPU."""
    rng = np.random.default_rng(1)
    b, n, kh, h, s, steps = 4, 16, 4, 128, 2048, 6
    kc, vc = randn(rng, (b, s, kh, h), BF16), randn(rng, (b, s, kh, h), BF16)
    qs, new = randn(rng, (steps, b, 1, n, h), BF16), randn(rng, (steps, b, 1, kh, h), BF16)
    lens = jnp.asarray([0, 5, 1000, 1999], jnp.int32)
    loop = jax.jit(lambda kc, vc, lens, qs, new: jax.lax.scan(scan_step("tk"), (kc, vc, lens), (qs, new)),
                   donate_argnums=(0, 1))
    (k1, v1, _), want = loop(kc.copy(), vc.copy(), lens, qs, new)
    mesh = _mesh()
    seq = P(None, "x")
    (k2, v2, _), got = loop(_put(kc, mesh, P("x")), _put(vc, mesh, P("x")), _put(lens, mesh, P("x")),
                            _put(qs, mesh, seq), _put(new, mesh, seq))
    assert got.sharding.spec[1] == "x"
    np.testing.assert_array_equal(np.asarray(k2, F32), np.asarray(k1, F32))
    np.testing.assert_array_equal(np.asarray(v2, F32), np.asarray(v1, F32))
    assert rel_err(got, want) < 1e-2
