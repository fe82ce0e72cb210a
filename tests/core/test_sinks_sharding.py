"""Attention sinks (``sinks=``) on several devices (CPU, 8 fake host devices), for jax_tk.attention and
jax_tk.decode.attention:

- under jit with inputs sharded over batch and/or heads (explicit and auto sharding, grouped-query
  heads split or shared, a paged cache), the sinks split over the head axes like the query's heads or
  replicated; with masking options (causal, window, soft cap, segment ids and lengths; decode: window,
  soft cap and lengths, 0 and shorter than the new tokens included);
- inside shard_map, the sinks split over the heads, or replicated over the batch shards;
- under vmap over an extra leading axis, sinks mapped or not, on one device and sharded.

Outputs, log-sum-exp and the gradients in every input, the sinks' included, match the same calls on
one device (and each vmapped entry its own call); the forward compiles with no collective, the
backward gathers no query, key, value or cache (the one gather allowed is of the sinks' own gradient,
``[q_heads]`` floats, where the sinks are replicated over the head axes), and the gradients come back
sharded like their inputs. Also: the decode kernel's batching rule folds mapped and unmapped sinks with
the heads or the sequences (checked with the kernel call replaced by a float32 stand-in).

Unless this process already has 8 CPU devices, ``test_in_subprocess`` reruns this file in a fresh
Python with them (see tests/helpers.py).
"""
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_tk
from helpers import collectives, multi_device_tests, randn, rel_err
from jax_tk.decode import launch, reference as decode_reference
from jax_tk.decode.api import DecodeSpec

F32 = jnp.float32
TOL = 1e-5


test_in_subprocess, needs_devices = multi_device_tests(__file__)

# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _mesh(axis_type):
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)


def _put(x, mesh, spec):
    return None if x is None else jax.device_put(x, NamedSharding(mesh, spec))


def _sinks(rng, shape):
    """Sinks different for every head (and entry), none zero: normal values, one large per row (its
    sink takes most of the weight of the rows that see few keys)."""
    s = rng.normal(size=shape).astype(np.float32)
    s[..., 1] = 5.0
    return jnp.asarray(s)


def _axes(spec, ndim):
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)


def _gather_sizes(hlo):
    """The size (elements) of the largest array in each all-gather of a compiled HLO text."""
    sizes = []
    for line in hlo.splitlines():
        m = re.search(r"\ball-gather(?:-start)?\(", line)
        if m:
            shapes = re.findall(r"\b[a-z]+\d*\[([\d,]*)\]", line[:m.start()])
            sizes.append(max(math.prod(int(x) for x in s.split(",") if x) for s in shapes))
    return sizes


def _compile_checked(fwd, grad, args, grad_args, axis_type, heads):
    """``fwd(*args)`` and ``grad(*grad_args)`` (jitted) compiled, after checking their programs: the
    forward has no collective; the backward gathers nothing larger than the sinks' gradient (``heads``
    floats) and moves no data between devices otherwise than by sums; the op was partitioned by jax_tk
    (custom_partitioning under auto sharding, shard_map under explicit)."""
    lowered_fwd, lowered_grad = fwd.lower(*args), grad.lower(*grad_args)
    fwd_compiled, grad_compiled = lowered_fwd.compile(), lowered_grad.compile()
    fwd_hlo, grad_hlo = fwd_compiled.as_text(), grad_compiled.as_text()
    assert not collectives(fwd_hlo), collectives(fwd_hlo)
    assert collectives(grad_hlo) <= {"all-reduce", "all-gather", "reduce-scatter"}, collectives(grad_hlo)
    assert all(size <= heads for size in _gather_sizes(grad_hlo)), _gather_sizes(grad_hlo)
    text = lowered_fwd.as_text()
    assert ("CustomSPMDPartitioning" in text) == (axis_type == AxisType.Auto)
    assert ("manual_computation" in text) == (axis_type == AxisType.Explicit)
    return fwd_compiled, grad_compiled


def _run_sharded(fwd, grad, args, cts, specs, q_spec, axis_type):
    """fwd and grad compiled for ``args`` placed by ``specs`` (the cotangents like q and its lse rows) and
    checked for gathers, then run: ((out, lse), grads)."""
    mesh = _mesh(axis_type)
    lse_spec = P(q_spec[0], q_spec[2] if len(q_spec) > 2 else None)
    sharded = [_put(x, mesh, s) for x, s in zip(args, specs)]
    sharded_cts = [_put(cts[0], mesh, q_spec), _put(cts[1], mesh, lse_spec)]
    fwd_sharded, grad_sharded = _compile_checked(fwd, grad, sharded, (*sharded, *sharded_cts), axis_type, 8)
    return fwd_sharded(*sharded), grad_sharded(*sharded, *sharded_cts)


def _check_close(got, want, names):
    for name, g, w in zip(names, jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape, (name, g.shape, w.shape)
        assert np.all(np.isfinite(np.asarray(g))), name
        err = rel_err(g, w)
        assert err < TOL, f"{name}: relative error {err:.2e}"


def _loss(fn):
    """sum(out * dout) + sum(lse * dlse) of ``fn(*args)`` -> (out, lse): every output differentiated."""
    def loss(*args_and_cotangents):
        *args, dout, dlse = args_and_cotangents
        out, lse = fn(*args)
        return jnp.sum(out * dout) + jnp.sum(lse * dlse)

    return loss


# ----------------------------------------------------------------------------------------------
# jax_tk.attention under jit
# ----------------------------------------------------------------------------------------------


def _attention(q, k, v, sinks, q_ids, kv_ids, q_lens, kv_lens):
    return jax_tk.attention_with_lse(q, k, v, is_causal=True, local_window_size=(6, 1), logits_soft_cap=5.0,
                                     q_segment_ids=q_ids, kv_segment_ids=kv_ids, query_seq_lengths=q_lens,
                                     key_value_seq_lengths=kv_lens, sinks=sinks)


def _attention_inputs(seed, b=4, t=16, n=8, kh=4, d=16):
    """q, k, v, sinks, segment ids and lengths (some rows see no key: their lse is their sink), dout, dlse."""
    rng = np.random.default_rng(seed)
    q, k, v = randn(rng, (b, t, n, d), F32), randn(rng, (b, t, kh, d), F32), randn(rng, (b, t, kh, d), F32)
    q_ids = jnp.asarray(np.sort(rng.integers(0, 3, (b, t)), axis=1), jnp.int32)
    kv_ids = jnp.asarray(np.sort(rng.integers(1, 4, (b, t)), axis=1), jnp.int32)
    lens = [jnp.asarray(rng.integers(t // 2, t + 1, (b,)), jnp.int32) for _ in range(2)]
    cts = (randn(rng, (b, t, n, d), F32), randn(rng, (b, n, t), F32))
    return (q, k, v, _sinks(rng, (n,)), q_ids, kv_ids, *lens), cts


# (jitted once: the one-device results of equal shapes are compiled once for all tests)
_attention_fwd = jax.jit(_attention)
_attention_grad = jax.jit(jax.grad(_loss(_attention), argnums=(0, 1, 2, 3)))


# (name, sharding, kv heads, query spec, key/value spec, sinks spec): batch over "data" (2), heads over
# "model" (4); explicit sharding (shard_map) and auto (custom_partitioning) each with sinks split over
# the heads and replicated
ATTENTION_CASES = [
    ("batch-explicit", AxisType.Explicit, 4, P("data"), P("data"), P()),
    ("heads_replicated_sinks-explicit", AxisType.Explicit, 4, P(None, None, "model"), P(None, None, "model"), P()),
    ("heads_replicated_sinks-auto", AxisType.Auto, 4, P(None, None, "model"), P(None, None, "model"), P()),
    ("batch_heads_gqa-auto", AxisType.Auto, 4, P("data", None, "model"), P("data", None, "model"), P("model")),
    # 2 kv heads on 4 head shards: key/value replicated over "model" (each device slices its head)
    ("gqa_shared_kv-explicit", AxisType.Explicit, 2, P("data", None, "model"), P("data"), P("model")),
]


@needs_devices
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=[c[0] for c in ATTENTION_CASES])
def test_attention_jit_sharded(case):
    """jax_tk.attention with sinks, causal, a window, a soft cap, segment ids and lengths, under jit with
    the inputs sharded as ``case``: out, lse and the gradients (sinks' included) equal one device's; the
    programs gather no query/key/value; results and gradients keep their inputs' shardings."""
    name, axis_type, kh, q_spec, kv_spec, sinks_spec = case
    args, cts = _attention_inputs(0, kh=kh)
    specs = (q_spec, kv_spec, kv_spec, sinks_spec) + (P(q_spec[0]),) * 4
    fwd, grad = _attention_fwd, _attention_grad
    (out, lse), grads = _run_sharded(fwd, grad, args, cts, specs, q_spec, axis_type)
    _check_close((out, lse), fwd(*args), ("out", "lse"))
    _check_close(grads, grad(*args, *cts), ("dq", "dk", "dv", "dsinks"))
    if axis_type == AxisType.Explicit:  # (the types: results sharded like their inputs)
        assert _axes(out.sharding.spec, 4) == _axes(q_spec, 4)
        assert _axes(grads[1].sharding.spec, 4) == _axes(kv_spec, 4)
        assert _axes(grads[3].sharding.spec, 1) == _axes(sinks_spec, 1)


# ----------------------------------------------------------------------------------------------
# jax_tk.decode.attention under jit
# ----------------------------------------------------------------------------------------------


def _decode(q, k, v, lens, sinks, table=None):
    return jax_tk.decode.attention_with_lse(q, k, v, lens, page_table=table, local_window_size=(9, 0),
                                            logits_soft_cap=4.0, sinks=sinks)


def _decode_inputs(seed, b=4, t=2, n=8, kh=4, d=16, s=32, page=8, paged=False):
    """q, caches (contiguous, or a shuffled pool of pages with 2 spare pages), lengths (0, 1 < T_new, a
    few, the capacity), sinks, page table (None when contiguous); dout, dlse."""
    rng = np.random.default_rng(seed)
    q = randn(rng, (b, t, n, d), F32)
    lens = jnp.asarray(rng.permutation([0, 1, 13, s])[:b], jnp.int32)
    if paged:
        pages = b * s // page + 2
        k, v = randn(rng, (pages, page, kh, d), F32), randn(rng, (pages, page, kh, d), F32)
        table = jnp.asarray(rng.permutation(pages)[: b * s // page].reshape(b, s // page), jnp.int32)
    else:
        k, v, table = randn(rng, (b, s, kh, d), F32), randn(rng, (b, s, kh, d), F32), None
    cts = (randn(rng, (b, t, n, d), F32), randn(rng, (b, n, t), F32))
    return (q, k, v, lens, _sinks(rng, (n,)), table), cts


_decode_fwd = jax.jit(_decode)
_decode_grad = jax.jit(jax.grad(_loss(_decode), argnums=(0, 1, 2, 4)))


# (name, sharding, kv heads, query spec, cache spec, sinks spec, paged)
DECODE_CASES = [
    ("batch-auto", AxisType.Auto, 4, P("data"), P("data"), P(), False),
    ("heads_replicated_sinks-explicit", AxisType.Explicit, 4, P(None, None, "model"), P(None, None, "model"), P(),
     False),
    # 2 kv heads on 4 head shards: the caches replicated over "model" (each device slices its head)
    ("kv_shared-explicit", AxisType.Explicit, 2, P("data", None, "model"), P("data"), P("model"), False),
    # a pool of pages is split over kv heads only, replicated over the batch axes
    ("paged_batch_heads-explicit", AxisType.Explicit, 4, P("data", None, "model"), P(None, None, "model"), P(), True),
    ("paged_batch_heads-auto", AxisType.Auto, 4, P("data", None, "model"), P(None, None, "model"), P("model"), True),
]


@needs_devices
@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_decode_jit_sharded(case):
    """jax_tk.decode.attention with sinks, a window, a soft cap and lengths (0 and 1 < T_new included),
    under jit with the inputs sharded as ``case``: out, lse and the gradients (sinks' included) equal one
    device's; rows that see no key give 0 and lse = sink; the programs gather no query or cache."""
    name, axis_type, kh, q_spec, cache_spec, sinks_spec, paged = case
    args, cts = _decode_inputs(1, kh=kh, paged=paged)
    batch = P(q_spec[0])
    specs = (q_spec, cache_spec, cache_spec, batch, sinks_spec, batch)
    fwd, grad = _decode_fwd, _decode_grad
    (out, lse), grads = _run_sharded(fwd, grad, args, cts, specs, q_spec, axis_type)
    want = fwd(*args)
    _check_close((out, lse), want, ("out", "lse"))
    # rows that see no key (length 0; the row before the start of a length-1 sequence): 0, lse = sink
    lens, sinks = np.asarray(args[3]), np.asarray(args[4])
    empty = np.flatnonzero(lens == 0)[0]
    assert np.all(np.asarray(out)[empty] == 0)
    np.testing.assert_allclose(np.asarray(lse)[empty], np.broadcast_to(sinks[:, None], lse.shape[1:]), rtol=1e-6)
    _check_close(grads, grad(*args, *cts), ("dq", "dk", "dv", "dsinks"))
    if axis_type == AxisType.Explicit:
        assert _axes(out.sharding.spec, 4) == _axes(q_spec, 4)
        assert _axes(grads[1].sharding.spec, 4) == _axes(cache_spec, 4)
        assert _axes(grads[3].sharding.spec, 1) == _axes(sinks_spec, 1)


# ----------------------------------------------------------------------------------------------
# Inside shard_map: the op runs on the local shards; sinks split over the heads, or replicated over
# the batch shards (their gradient is then the sum of the shards' parts)
# ----------------------------------------------------------------------------------------------

SHARD_MAP_SPLITS = pytest.mark.parametrize("split", [("batch_heads", P("data", None, "model"), P("model")),
                                                     ("batch", P("data"), P())], ids=["batch_heads", "batch"])


@needs_devices
@SHARD_MAP_SPLITS
def test_attention_in_shard_map(split):
    """jax_tk.attention with sinks inside shard_map: values and gradients (sinks' included) equal one
    device's."""
    _, spec, sinks_spec = split
    mesh = _mesh(AxisType.Explicit)
    args, cts = _attention_inputs(2)
    lse_spec = P("data", spec[2] if len(spec) > 2 else None)
    in_specs = (spec, spec, spec, sinks_spec) + (P("data"),) * 4
    smap = jax.shard_map(_attention, mesh=mesh, in_specs=in_specs, out_specs=(spec, lse_spec))
    sharded = [_put(x, mesh, s) for x, s in zip(args, in_specs)]
    sharded_cts = [_put(cts[0], mesh, spec), _put(cts[1], mesh, lse_spec)]
    _check_close(jax.jit(smap)(*sharded), _attention_fwd(*args), ("out", "lse"))
    got = jax.jit(jax.grad(_loss(smap), argnums=(0, 1, 2, 3)))(*sharded, *sharded_cts)
    want = _attention_grad(*args, *cts)
    _check_close(got, want, ("dq", "dk", "dv", "dsinks"))


@needs_devices
@SHARD_MAP_SPLITS
def test_decode_in_shard_map(split):
    """jax_tk.decode.attention with sinks inside shard_map: values and gradients (sinks' included) equal
    one device's."""
    _, spec, sinks_spec = split
    mesh = _mesh(AxisType.Explicit)
    (q, k, v, lens, sinks, _), cts = _decode_inputs(3)
    lse_spec = P("data", spec[2] if len(spec) > 2 else None)
    in_specs = (spec, spec, spec, P("data"), sinks_spec)
    f = lambda q, k, v, lens, sinks: _decode(q, k, v, lens, sinks)
    smap = jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=(spec, lse_spec))
    args = (q, k, v, lens, sinks)
    sharded = [_put(x, mesh, s) for x, s in zip(args, in_specs)]
    sharded_cts = [_put(cts[0], mesh, spec), _put(cts[1], mesh, lse_spec)]
    _check_close(jax.jit(smap)(*sharded), _decode_fwd(*args, None), ("out", "lse"))
    got = jax.jit(jax.grad(_loss(smap), argnums=(0, 1, 2, 4)))(*sharded, *sharded_cts)
    want = _decode_grad(*args, None, *cts)
    _check_close(got, want, ("dq", "dk", "dv", "dsinks"))


# ----------------------------------------------------------------------------------------------
# vmap over an extra leading axis (E entries), sinks mapped ([E, heads]) or not ([heads])
# ----------------------------------------------------------------------------------------------

E = 2


def _looped(fn, in_axes):
    """``fn`` applied to each entry on its own (the arguments with an axis in ``in_axes`` indexed),
    results stacked: what vmap of ``fn`` must give."""
    def looped(*args):
        outs = [fn(*(x if a is None else x[i] for x, a in zip(args, in_axes))) for i in range(E)]
        return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)

    return looped


def _check_vmap(fn, in_axes, args, cts, specs, axis_type, diff):
    """vmap of ``fn`` with the arguments sharded as ``specs`` against each entry's call on one device: the
    values (the forward without collectives) and the gradients in the arguments ``diff`` (the program
    gathering nothing but the sinks' gradient)."""
    mapped = jax.vmap(fn, in_axes=in_axes)
    want = jax.jit(_looped(fn, in_axes))(*args)
    want_grads = jax.jit(jax.grad(_loss(_looped(fn, in_axes)), argnums=diff))(*args, *cts)
    grad = jax.jit(jax.grad(_loss(mapped), argnums=diff))

    mesh = _mesh(axis_type)
    sharded = [_put(x, mesh, s) for x, s in zip(args, specs)]
    sharded_cts = [_put(cts[0], mesh, P(None, "data", None, "model")), _put(cts[1], mesh, P(None, "data", "model"))]
    forward = jax.jit(mapped).lower(*sharded).compile()
    assert not collectives(forward.as_text()), collectives(forward.as_text())
    _check_close(forward(*sharded), want, ("out", "lse"))
    compiled = grad.lower(*sharded, *sharded_cts).compile()
    assert all(size <= E * 8 for size in _gather_sizes(compiled.as_text())), _gather_sizes(compiled.as_text())
    _check_close(compiled(*sharded, *sharded_cts), want_grads, ("dq", "dk", "dv", "dsinks"))


@needs_devices
@pytest.mark.parametrize("sinks_mapped,axis_type", [(False, AxisType.Explicit), (True, AxisType.Auto)],
                         ids=["sinks_explicit", "mapped_sinks_auto"])
def test_attention_vmap(sinks_mapped, axis_type):
    """vmap of jax_tk.attention with sinks (the same for every entry, or each entry's own), sharded over
    batch and heads."""
    b, t, n, kh, d = 4, 16, 8, 4, 16
    rng = np.random.default_rng(4)
    q, k, v = randn(rng, (E, b, t, n, d), F32), randn(rng, (E, b, t, kh, d), F32), randn(rng, (E, b, t, kh, d), F32)
    sinks = _sinks(rng, (E, n) if sinks_mapped else (n,))
    cts = (randn(rng, (E, b, t, n, d), F32), randn(rng, (E, b, n, t), F32))
    fn = lambda q, k, v, sinks: jax_tk.attention_with_lse(q, k, v, is_causal=True, local_window_size=(5, 0),
                                                          logits_soft_cap=5.0, sinks=sinks)
    split = P(None, "data", None, "model")
    specs = (split, split, split, P(None, "model") if sinks_mapped else P())
    _check_vmap(fn, (0, 0, 0, 0 if sinks_mapped else None), (q, k, v, sinks), cts, specs, axis_type, (0, 1, 2, 3))


@needs_devices
@pytest.mark.parametrize("mapped,sinks_mapped,axis_type", [("query", True, AxisType.Explicit),
                                                           ("all", False, AxisType.Auto)],
                         ids=["query_mapped_sinks_explicit", "all_sinks_auto"])
def test_decode_vmap(mapped, sinks_mapped, axis_type):
    """vmap of jax_tk.decode.attention with sinks (each entry's own, or the same for every entry), sharded
    over batch and heads: only the query mapped (every entry reads the same cache), or everything."""
    (q, k, v, lens, _, _), _ = _decode_inputs(5)
    rng = np.random.default_rng(6)
    n = q.shape[2]
    stack = lambda x, m: jnp.stack([x, randn(rng, x.shape, x.dtype) if x.dtype == F32 else x[::-1]]) if m else x
    q = stack(q, True)
    k, v, lens = (stack(x, mapped == "all") for x in (k, v, lens))
    sinks = _sinks(rng, (E, n) if sinks_mapped else (n,))
    cts = (randn(rng, q.shape, F32), randn(rng, (E, q.shape[1], n, q.shape[2]), F32))
    fn = lambda q, k, v, lens, sinks: _decode(q, k, v, lens, sinks)
    cache_axis = 0 if mapped == "all" else None
    in_axes = (0, cache_axis, cache_axis, cache_axis, 0 if sinks_mapped else None)
    lead = lambda m: (None,) if m is not None else ()
    split = P("data", None, "model")
    specs = (P(None, *split), P(*lead(cache_axis), *split), P(*lead(cache_axis), *split), P(*lead(cache_axis), "data"),
             P(None, "model") if sinks_mapped else P())
    _check_vmap(fn, in_axes, (q, k, v, lens, sinks), cts, specs, axis_type, (0, 1, 2, 4))


# ----------------------------------------------------------------------------------------------
# The decode kernel's batching rule with sinks (without a GPU: the kernel call replaced by the
# reference, its sinks [heads] or [batch, heads] applied to each row's softmax)
# ----------------------------------------------------------------------------------------------


def _stand_in_call(seen, query, key_cache, value_cache, lengths, table, sinks=None, *, spec, parts, variant,
                   out_init=None):
    seen.append((query.shape, None if sinks is None else sinks.shape))
    out, lse = decode_reference.attention_with_lse(query, key_cache, value_cache, lengths, scale=spec.scale,
                                                   is_causal=spec.is_causal, local_window_size=spec.window,
                                                   logits_soft_cap=spec.softcap)
    if sinks is not None:  # each row's sink joins its softmax: lse' = logaddexp(lse, sink), out shrinks
        s = jnp.broadcast_to(sinks, (query.shape[0], query.shape[2]))[:, :, None]
        new = jnp.logaddexp(lse, s)
        out, lse = out * jnp.swapaxes(jnp.exp(lse - new), 1, 2)[..., None], new
    return out, lse


@pytest.fixture
def stand_in_kernel(monkeypatch):
    seen = []
    monkeypatch.setattr(launch, "_call", functools.partial(_stand_in_call, seen))
    launch._batched.cache_clear()
    yield seen
    launch._batched.cache_clear()


@needs_devices
@pytest.mark.parametrize("mapped,sinks_mapped", [("query", True), ("all", True), ("all", False)],
                         ids=["query_mapped_sinks", "all_mapped_sinks", "all_sinks"])
def test_decode_kernel_fold_with_sinks(stand_in_kernel, mapped, sinks_mapped):
    """Only the query mapped: the entries become more heads (head ``n * E + i`` is entry i's head n), and
    so do the sinks; everything mapped: the entries become more sequences, the sinks one row per
    sequence (mapped, or the same for every entry). Each entry gets its own sinks (checked against the
    reference with them)."""
    (q, k, v, lens, _, _), _ = _decode_inputs(7, n=4, kh=2)
    rng = np.random.default_rng(8)
    b, t, n, h = q.shape
    q = jnp.stack([q, randn(rng, q.shape, F32)])
    cache_axis = 0 if mapped == "all" else None
    if mapped == "all":
        k, v, lens = jnp.stack([k, -v[::-1]]), jnp.stack([v, k[::-1]]), jnp.stack([lens, lens[::-1]])
    sinks = _sinks(rng, (E, n) if sinks_mapped else (n,))
    spec = DecodeSpec(scale=0.3, is_causal=True, use_kernel=True, window=(9, 0), softcap=4.0, page_size=None)
    run = lambda q, k, v, lens, s: launch.kernel(q, k, v, lens, None, spec, with_lse=True, sinks=s)
    in_axes = (0, cache_axis, cache_axis, cache_axis, 0 if sinks_mapped else None)
    got = jax.jit(jax.vmap(run, in_axes=in_axes))(q, k, v, lens, sinks)
    want_shapes = {"query": ((b, t, n * E, h), (n * E,)), "all": ((E * b, t, n, h), (E * b, n))}[mapped]
    assert stand_in_kernel[-1] == want_shapes, stand_in_kernel[-1]
    ref = lambda q, k, v, lens, s: decode_reference.attention_with_lse(
        q, k, v, lens, scale=0.3, local_window_size=(9, 0), logits_soft_cap=4.0, sinks=s)
    _check_close(got, jax.jit(_looped(ref, in_axes))(q, k, v, lens, sinks), ("out", "lse"))
