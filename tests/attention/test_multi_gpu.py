"""jax_tk on two or more GPUs (the kernels, not the reference): local shards in shard_map and pmap,
jit with inputs sharded over batch and heads (explicit and auto sharding) compiling to the kernel on
the local shards with no all-gather / all-to-all / collective-permute, and ring attention (values and
gradients) against single-device attention over the whole sequence. Skipped without 2 CUDA GPUs.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_tk
from jax_tk.attention import reference
from helpers import cuda_devices, rel_err


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(len(cuda_devices()) < 2, reason="needs 2 CUDA GPUs"),
]

BF16, F32 = jnp.bfloat16, jnp.float32
TOL = 1e-2  # relative error (norm) of bfloat16 results against the float32 reference


def _devices():
    return cuda_devices()[:2]


def _inputs(seed, b, t, n, kh, d, dtype=BF16):
    ks = jax.random.split(jax.random.key(seed), 5)
    return (
        jax.random.normal(ks[0], (b, t, n, d), dtype),
        jax.random.normal(ks[1], (b, t, kh, d), dtype),
        jax.random.normal(ks[2], (b, t, kh, d), dtype),
        jax.random.normal(ks[3], (b, t, n, d), dtype),
        jax.random.normal(ks[4], (b, n, t), F32),
    )


_rel = rel_err


def _values_and_grads(fn, causal):
    def loss(q, k, v, do, dl):
        out, lse = fn(q, k, v)
        return jnp.sum(out.astype(F32) * do.astype(F32)) + jnp.sum(lse * dl), (out, lse)

    def run(q, k, v, do, dl):
        (_, (out, lse)), g = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, do, dl)
        return (out, lse, *g)

    return jax.jit(run)


def _reference(causal):
    def fn(q, k, v):
        q, k, v = (x.astype(F32) for x in (q, k, v))
        return reference.attention_with_lse(q, k, v, scale=q.shape[-1] ** -0.5, is_causal=causal)

    return fn


def _check(got, want, tol=TOL):
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, (name, g.shape, w.shape)
        assert not np.isnan(np.asarray(g, np.float32)).any(), f"{name} has NaN"
        assert _rel(g, w) < tol, f"{name}: relative error {_rel(g, w):.2e}"


def _kernel_calls(hlo):
    return re.findall(r'custom_call_target="(jax_tk_attention_\w+)"', hlo)


def _collectives(hlo):
    return set(re.findall(r"\b(all-gather|all-to-all|collective-permute)", hlo))


# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.parametrize(
    "n,kh,q_spec,kv_spec",
    [
        (4, 4, P("x"), P("x")),
        (4, 4, P(None, None, "x"), P(None, None, "x")),
        (8, 2, P(None, None, "x"), P(None, None, "x")),  # GQA, kv heads split
        (4, 1, P(None, None, "x"), P()),  # GQA, one kv head shared by both GPUs
    ],
    ids=["batch", "heads", "gqa-split", "gqa-shared"],
)
def test_jit_sharded_runs_kernel_on_shards(axis_type, n, kh, q_spec, kv_spec):
    mesh = jax.make_mesh((2,), ("x",), axis_types=(axis_type,), devices=_devices())
    b, t, d = 2, 512, 64
    args = _inputs(0, b, t, n, kh, d)
    lse_spec = P(q_spec[0] if len(q_spec) > 0 else None, q_spec[2] if len(q_spec) > 2 else None)
    specs = (q_spec, kv_spec, kv_spec, q_spec, lse_spec)
    sharded = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
    fn = _values_and_grads(lambda q, k, v: jax_tk.attention_with_lse(q, k, v, is_causal=True), True)
    hlo = fn.lower(*sharded).compile().as_text()
    calls = _kernel_calls(hlo)
    assert "jax_tk_attention_fwd" in calls and "jax_tk_attention_bwd" in calls, calls
    assert not _collectives(hlo), _collectives(hlo)
    # the kernel sees the local shard
    local = [b, t, n, d]
    local[0 if q_spec[0] else 2] //= 2
    local_q = "bf16[%s]" % ",".join(map(str, local))
    for line in hlo.splitlines():
        if 'custom_call_target="jax_tk_attention_' in line:
            assert local_q in line and "bf16[%d,%d,%d,%d]" % (b, t, n, d) not in line, line
    _check(fn(*sharded), jax.jit(_values_and_grads(_reference(True), True))(*args))


def test_shard_map_and_pmap():
    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,), devices=_devices())
    q, k, v, do, dl = _inputs(1, 4, 256, 4, 2, 128)
    spec = P("x")
    smap = jax.shard_map(
        lambda q, k, v: jax_tk.attention_with_lse(q, k, v, is_causal=True),
        mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec, spec),
    )
    args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v, do, dl)]
    fn = _values_and_grads(smap, True)
    assert "jax_tk_attention_fwd" in _kernel_calls(fn.lower(*args).compile().as_text())
    want = jax.jit(_values_and_grads(_reference(True), True))(q, k, v, do, dl)
    _check(fn(*args), want)

    split = lambda x: x.reshape(2, x.shape[0] // 2, *x.shape[1:])
    out = jax.pmap(lambda q, k, v: jax_tk.attention(q, k, v, is_causal=True), devices=_devices())(
        split(q), split(k), split(v)
    )
    assert _rel(out.reshape(q.shape), want[0]) < TOL


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_vmap_of_sharded_attention_is_one_launch_per_shard(axis_type):
    """vmap over a jitted, batch-sharded call: each GPU runs one forward and one backward kernel for
    all the mapped entries (no loop), and the values are each entry's."""
    mesh = jax.make_mesh((2,), ("x",), axis_types=(axis_type,), devices=_devices())
    entries = [_inputs(10 + i, 2, 256, 4, 2, 64) for i in range(3)]
    args = [jnp.stack(xs) for xs in zip(*entries)]
    spec = P(None, "x")
    sharded = [jax.device_put(x, NamedSharding(mesh, spec)) for x in args]
    fn = jax.vmap(_values_and_grads(lambda q, k, v: jax_tk.attention_with_lse(q, k, v, is_causal=True), True))
    hlo = jax.jit(fn).lower(*sharded).compile().as_text()
    assert sorted(_kernel_calls(hlo)) == ["jax_tk_attention_bwd", "jax_tk_attention_fwd"], _kernel_calls(hlo)
    assert " while(" not in hlo and not _collectives(hlo)
    got = jax.jit(fn)(*sharded)
    for i, e in enumerate(entries):
        _check([g[i] for g in got], jax.jit(_values_and_grads(_reference(True), True))(*e))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ring_attention_matches_single_device(layout, causal):
    n_dev = 2
    mesh = jax.make_mesh((n_dev,), ("sp",), axis_types=(AxisType.Explicit,), devices=_devices())
    b, t, n, kh, d = 1, 2048, 4, 2, 128
    args = _inputs(2, b, t, n, kh, d)

    def ring(q, k, v):
        return jax_tk.ring_attention_with_lse(q, k, v, axis_name="sp", is_causal=causal, layout=layout)

    seq, lse_spec = P(None, "sp"), P(None, None, "sp")
    smap = jax.shard_map(ring, mesh=mesh, in_specs=(seq, seq, seq), out_specs=(seq, lse_spec))
    perm = jax_tk.zigzag_indices(t, n_dev) if layout == "zigzag" else np.arange(t)
    inv = np.argsort(perm)
    moved = [jnp.take(x, perm, axis=2 if x.ndim == 3 else 1) for x in args]
    put = [jax.device_put(x, NamedSharding(mesh, lse_spec if x.ndim == 3 else seq)) for x in moved]
    fn = _values_and_grads(smap, causal)
    hlo = fn.lower(*put).compile().as_text()
    assert "collective-permute" in hlo and "all-gather" not in hlo
    assert {"jax_tk_attention_fwd", "jax_tk_attention_bwd"} <= set(_kernel_calls(hlo))
    got = [np.take(np.asarray(g), inv, axis=2 if i == 1 else 1) for i, g in enumerate(fn(*put))]

    single = jax.jit(_values_and_grads(
        lambda q, k, v: jax_tk.attention_with_lse(q, k, v, is_causal=causal), causal))(*args)
    want = jax.jit(_values_and_grads(_reference(causal), causal))(*args)
    _check(got, want)
    _check(single, want)
    for name, g, s in zip(("out", "lse", "dq", "dk", "dv"), got, single):
        assert _rel(g, s) < TOL, f"{name} ring vs single GPU: {_rel(g, s):.2e}"
