"""jax_tk.decode on several devices (CPU, 8 fake host devices): attention and update_kv_cache under jit
with inputs sharded over batch and key/value heads (explicit and auto sharding, contiguous and paged
caches, grouped-query heads split and shared), inside shard_map, and in jitted lax.scan / while_loop
decoding loops with donated caches. Results match one device; compiled programs gather no cache.

Unless this process already has 8 CPU devices, ``test_in_subprocess`` reruns this file in a fresh
Python with them (see tests/helpers.py).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_tk
from helpers import collectives, multi_device_tests, needs_extension, randn, rel_err

F32 = jnp.float32


test_in_subprocess, needs_devices = multi_device_tests(__file__)

# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _gathered_shapes(hlo_text):
    """Result shapes (tuples of ints) of the all-gathers in a compiled HLO text."""
    shapes = []
    for m in re.finditer(r"=\s*\w+\[([\d,]*)\][^=]*?\ball-gather(?:-start)?\(", hlo_text):
        shapes.append(tuple(int(x) for x in m.group(1).split(",") if x))
    return shapes


def _mesh(axis_type, shape=(2, 4), names=("data", "model")):
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def _put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def _pages(rng, cache, page_size, extra=3):
    """A contiguous cache [B, S, K, H] as a shuffled pool [B*S/page_size + extra, page_size, K, H] and
    its page table."""
    b, s, kh, h = cache.shape
    per = s // page_size
    num = b * per + extra
    perm = rng.permutation(num)[: b * per]
    pool = np.array(randn(rng, (num, page_size, kh, h), cache.dtype).astype(F32))
    pool[perm] = np.asarray(cache.astype(F32)).reshape(b * per, page_size, kh, h)
    return jnp.asarray(pool, cache.dtype), jnp.asarray(perm.reshape(b, per), jnp.int32)


def _inputs(seed, b=8, t=2, n=8, kh=4, h=32, s=64, page_size=16):
    rng = np.random.default_rng(seed)
    q = randn(rng, (b, t, n, h), F32)
    k, v = randn(rng, (b, s, kh, h), F32), randn(rng, (b, s, kh, h), F32)
    lens = jnp.asarray(rng.integers(t, s + 1, size=b), jnp.int32)
    kp, table = _pages(np.random.default_rng(seed + 100), k, page_size)
    vp, table2 = _pages(np.random.default_rng(seed + 100), v, page_size)
    assert np.array_equal(table, table2)
    return q, k, v, lens, kp, vp, table


def _attend(q, k, v, lens, table=None):
    return jax_tk.decode.attention(q, k, v, lens, page_table=table, local_window_size=(40, 0), logits_soft_cap=20.0)


# (name, query heads, kv heads, query spec, contiguous-cache spec, pool spec): batch over "data",
# heads over "model" (4 shards); kv heads 4 (one per shard) or 2 (each shared by 2 shards: replicated
# over "model", each device slices the one it uses).
CASES = [
    ("batch", 8, 4, P("data"), P("data"), P()),
    ("heads", 8, 4, P(None, None, "model"), P(None, None, "model"), P(None, None, "model")),
    ("batch_heads", 8, 4, P("data", None, "model"), P("data", None, "model"), P(None, None, "model")),
    ("all_axes_batch", 8, 4, P(("data", "model")), P(("data", "model")), P()),
    ("kv_shared", 8, 2, P("data", None, "model"), P("data"), P()),
]


# ----------------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------------


@needs_devices
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_attention_jit_sharded(case, paged, axis_type):
    name, n, kh, q_spec, kv_spec, pool_spec = case
    mesh = _mesh(axis_type)
    q, k, v, lens, kp, vp, table = _inputs(0, n=n, kh=kh)
    batch = P(q_spec[0]) if len(q_spec) else P()
    if paged:
        args = (_put(q, mesh, q_spec), _put(kp, mesh, pool_spec), _put(vp, mesh, pool_spec), _put(lens, mesh, batch),
                _put(table, mesh, batch))
    else:
        args = (_put(q, mesh, q_spec), _put(k, mesh, kv_spec), _put(v, mesh, kv_spec), _put(lens, mesh, batch))
    fn = jax.jit(_attend)
    hlo = fn.lower(*args).compile().as_text()
    assert not collectives(hlo), collectives(hlo)
    # The op runs on per-device shards: custom_partitioning (auto) or shard_map (explicit). (On CPU XLA
    # could also partition the pure-JAX reference by itself; a kernel's custom call it cannot.)
    lowered = fn.lower(*args).as_text()
    assert ("CustomSPMDPartitioning" in lowered) == (axis_type == AxisType.Auto)
    assert ("manual_computation" in lowered) == (axis_type == AxisType.Explicit)
    out = fn(*args)
    want = _attend(q, kp, vp, lens, table) if paged else _attend(q, k, v, lens)
    assert rel_err(out, want) < 1e-5
    assert out.sharding.spec == NamedSharding(mesh, q_spec).spec or \
        tuple(out.sharding.spec) == tuple(q_spec) + (None,) * (4 - len(q_spec))


@needs_devices
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("case", [CASES[2], CASES[4]], ids=["batch_heads", "kv_shared"])
def test_attention_gradients_jit_sharded(case, paged, axis_type):
    """The gradients (query, caches) on the shards: a paged pool's summed over the batch shards that
    share it, a shared key/value head's over the head shards; no cache gathered."""
    name, n, kh, q_spec, kv_spec, pool_spec = case
    mesh = _mesh(axis_type)
    q, k, v, lens, kp, vp, table = _inputs(2, n=n, kh=kh)
    batch = P(q_spec[0])
    caches, spec = ((kp, vp), pool_spec) if paged else ((k, v), kv_spec)
    extra = (table,) if paged else ()
    grad = jax.grad(lambda q, k, v, lens, *t: jnp.sum(_attend(q, k, v, lens, *t) ** 2), argnums=(0, 1, 2))
    args = (_put(q, mesh, q_spec), *(_put(c, mesh, spec) for c in caches), _put(lens, mesh, batch),
            *(_put(t, mesh, batch) for t in extra))
    fn = jax.jit(grad)
    assert not _gathered_shapes(fn.lower(*args).compile().as_text())
    for got, want in zip(fn(*args), grad(q, *caches, lens, *extra)):
        assert rel_err(got, want) < 1e-5


@needs_devices
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_attention_in_shard_map(paged):
    """Inside shard_map the op runs on the local shards as given; with a paged cache each batch shard
    may have a pool of its own (page numbers local to the shard)."""
    mesh = _mesh(AxisType.Explicit)
    q, k, v, lens, kp, vp, table = _inputs(1)
    if paged:
        # a pool per "data" shard: shard i holds the pages of its sequences, renumbered from 0
        b, per = table.shape
        local = b // 2
        pools_k, pools_v, tables = [], [], []
        for i in range(2):
            rows = np.asarray(table[i * local:(i + 1) * local])
            pools_k.append(kp[rows.reshape(-1)])
            pools_v.append(vp[rows.reshape(-1)])
            tables.append(np.arange(local * per).reshape(local, per)[:, ::-1].copy())  # any order
            pools_k[-1] = pools_k[-1][tables[-1].reshape(-1).argsort()]
            pools_v[-1] = pools_v[-1][tables[-1].reshape(-1).argsort()]
        kc, vc = jnp.concatenate(pools_k), jnp.concatenate(pools_v)
        tab = jnp.asarray(np.concatenate(tables), jnp.int32)
        specs = (P("data", None, "model"), P("data", None, "model"), P("data", None, "model"), P("data"), P("data"))
        f = jax.shard_map(lambda q, k, v, l, t: _attend(q, k, v, l, t), mesh=mesh, in_specs=specs,
                          out_specs=P("data", None, "model"))
        out = jax.jit(f)(*(_put(x, mesh, sp) for x, sp in zip((q, kc, vc, lens, tab), specs)))
        want = _attend(q, kp, vp, lens, table)
    else:
        specs = (P("data", None, "model"), P("data", None, "model"), P("data", None, "model"), P("data"))
        f = jax.shard_map(_attend, mesh=mesh, in_specs=specs, out_specs=P("data", None, "model"))
        out = jax.jit(f)(*(_put(x, mesh, sp) for x, sp in zip((q, k, v, lens), specs)))
        want = _attend(q, k, v, lens)
    assert rel_err(out, want) < 1e-5


# ----------------------------------------------------------------------------------------------
# update_kv_cache
# ----------------------------------------------------------------------------------------------


@needs_devices
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_update_jit_sharded(paged, axis_type):
    mesh = _mesh(axis_type)
    rng = np.random.default_rng(2)
    _, k, _, lens, kp, _, table = _inputs(2)
    new = randn(rng, (8, 3, 4, 32), F32)
    lens = lens - 3
    fn = jax.jit(lambda c, x, l, t: jax_tk.decode.update_kv_cache(c, x, l, page_table=t))
    if paged:
        args = (_put(kp, mesh, P(None, None, "model")), _put(new, mesh, P("data", None, "model")),
                _put(lens, mesh, P("data")), _put(table, mesh, P("data")))
        want = jax_tk.decode.update_kv_cache(kp, new, lens, page_table=table)
    else:
        spec = P("data", None, "model")
        args = (_put(k, mesh, spec), _put(new, mesh, spec), _put(lens, mesh, P("data")), None)
        want = jax_tk.decode.update_kv_cache(k, new, lens)
    hlo = fn.lower(*args).compile().as_text()
    if paged:
        # The pool is split over heads only; the new rows of every sequence are gathered over "data"
        # (each replica of the pool writes them all). The pool itself is never gathered.
        assert collectives(hlo) <= {"all-gather"}, collectives(hlo)
        local_pool = kp.size // 4
        assert all(np.prod(s) < local_pool // 8 for s in _gathered_shapes(hlo)), _gathered_shapes(hlo)
    else:
        assert not collectives(hlo), collectives(hlo)
    out = fn(*args)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    assert tuple(out.sharding.spec)[:3] == tuple(args[0].sharding.spec) + (None,) * (3 - len(args[0].sharding.spec))


# ----------------------------------------------------------------------------------------------
# Decoding loops: update + attention in lax.scan / lax.while_loop, sharded, caches donated
# ----------------------------------------------------------------------------------------------


def _loop(kind, steps):
    def step(k, v, lens, q, nk, nv, table):
        k = jax_tk.decode.update_kv_cache(k, nk, lens, page_table=table)
        v = jax_tk.decode.update_kv_cache(v, nv, lens, page_table=table)
        lens = lens + nk.shape[1]
        return k, v, lens, jax_tk.decode.attention(q, k, v, lens, page_table=table)

    def run(k, v, lens, qs, nks, nvs, table):
        if kind == "scan":
            def body(carry, xs):
                k, v, lens, out = step(*carry, *xs, table)
                return (k, v, lens), out

            (k, v, lens), outs = jax.lax.scan(body, (k, v, lens), (qs, nks, nvs))
            return k, v, lens, outs

        def cond(c):
            return c[0] < steps

        def body(c):
            i, k, v, lens, outs = c
            k, v, lens, out = step(k, v, lens, qs[i], nks[i], nvs[i], table)
            return i + 1, k, v, lens, jax.lax.dynamic_update_index_in_dim(outs, out, i, 0)

        outs = qs * 0  # (zeros with qs's sharding: jnp.zeros_like drops an explicit sharding in some JAX versions)
        _, k, v, lens, outs = jax.lax.while_loop(cond, body, (0, k, v, lens, outs))
        return k, v, lens, outs

    return run


def _loop_inputs(seed, steps, paged):
    rng = np.random.default_rng(seed)
    b, n, kh, h, s = 8, 8, 4, 32, 64
    _, k, v, _, kp, vp, table = _inputs(seed, b=b, n=n, kh=kh, h=h, s=s)
    lens = jnp.asarray(rng.integers(0, s - steps, size=b), jnp.int32)
    qs = randn(rng, (steps, b, 1, n, h), F32)
    nks, nvs = randn(rng, (steps, b, 1, kh, h), F32), randn(rng, (steps, b, 1, kh, h), F32)
    return (kp, vp, table) if paged else (k, v, None), lens, qs, nks, nvs


@needs_devices
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("kind", ["scan", "while_loop"])
def test_sharded_decoding_loop_donated(kind, paged):
    steps = 5
    (k, v, table), lens, qs, nks, nvs = _loop_inputs(3, steps, paged)
    want = jax.jit(_loop(kind, steps))(k, v, lens, qs, nks, nvs, table)
    mesh = _mesh(AxisType.Explicit)
    cache_spec = P(None, None, "model") if paged else P("data", None, "model")
    if paged:
        table = _put(table, mesh, P("data"))
    args = (_put(k, mesh, cache_spec), _put(v, mesh, cache_spec), _put(lens, mesh, P("data")),
            _put(qs, mesh, P(None, "data", None, "model")), _put(nks, mesh, P(None, "data", None, "model")),
            _put(nvs, mesh, P(None, "data", None, "model")), table)
    fn = jax.jit(_loop(kind, steps), donate_argnums=(0, 1))
    hlo = fn.lower(*args).compile().as_text()
    if paged:
        local_pool = k.size // 4
        assert collectives(hlo) <= {"all-gather"}, collectives(hlo)
        assert all(np.prod(s) < local_pool // 8 for s in _gathered_shapes(hlo)), _gathered_shapes(hlo)
    else:
        assert not collectives(hlo), collectives(hlo)
    got = fn(*args)
    assert args[0].is_deleted() and args[1].is_deleted()  # donated: the caches were updated in place
    for g, w in zip(got[:3], want[:3]):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert rel_err(got[3], want[3]) < 1e-5


# ----------------------------------------------------------------------------------------------
# The CUDA lowering (without a GPU): the kernel runs on the local shards
# ----------------------------------------------------------------------------------------------


@needs_extension
@needs_devices
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_cuda_lowering_runs_kernel_on_local_shards(paged):
    mesh = _mesh(AxisType.Explicit)
    b, t, n, kh, h, s, page = 8, 1, 8, 4, 128, 256, 16
    bf16 = jnp.bfloat16
    sds = lambda shape, spec, dt=bf16: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))
    split = P("data", None, "model")
    q = sds((b, t, n, h), split)
    lens = sds((b,), P("data"), jnp.int32)
    if paged:
        cache = sds((b * s // page, page, kh, h), P(None, None, "model"))
        table = sds((b, s // page), P("data"), jnp.int32)
        args = (q, cache, cache, lens, table)
        local_cache = f"tensor<{b * s // page}x{page}x{kh // 4}x{h}xbf16>"
    else:
        cache = sds((b, s, kh, h), split)
        args = (q, cache, cache, lens)
        local_cache = f"tensor<{b // 2}x{s}x{kh // 4}x{h}xbf16>"
    fn = jax.jit(lambda q, k, v, l, tb=None: jax_tk.decode.attention(q, k, v, l, page_table=tb))
    check = [jax.export.DisabledSafetyCheck.custom_call("jax_tk_decode")]
    text = jax.export.export(fn, platforms=["cuda"], disabled_checks=check)(*args).mlir_module()
    assert "sdy.manual_computation" in text
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @jax_tk_decode" in line]
    assert calls
    for line in calls:
        assert f"tensor<{b // 2}x{t}x{n // 4}x{h}xbf16>" in line and local_cache in line, line
        assert f"tensor<{b}x{t}x{n}x{h}xbf16>" not in line, line
