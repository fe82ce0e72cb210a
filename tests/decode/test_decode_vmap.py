"""jax.vmap of decode attention: the mapped entries run as one kernel launch (more query heads when only
the query is mapped, more sequences otherwise, a mapped page pool stacked with each entry's table
offset to its own pages), and give what each entry gives on its own.

On CPU the folding is checked with the kernel call replaced by the reference (the same operands in,
the same results out), and the CUDA lowering is checked for one custom call and no loop; on the GPU
with the kernel itself."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from helpers import needs_extension, randn, rel_err
from jax_tk._core import sharding
from jax_tk.decode import launch, reference
from jax_tk.decode.api import DecodeSpec

F32, BF16 = jnp.float32, jnp.bfloat16
E, B, T, N, KH, H, PAGE, PAGES, MAX_PAGES = 3, 3, 2, 4, 2, 16, 4, 7, 3

# (name, in_axes of (query, key_cache, value_cache, lengths[, table]), how the call is folded)
CONTIGUOUS = [
    ("query", (0, None, None, None), "heads"),
    ("all", (0, 0, 0, 0), "batch"),
    ("caches", (None, 0, 0, None), "batch"),
    ("key_and_axis_1", (1, 1, None, 0), "batch"),
    ("query_and_lengths", (0, None, None, 0), "loop"),
]
PAGED = [
    ("query", (0, None, None, None, None), "heads"),
    ("query_lengths_table", (0, None, None, 0, 0), "batch"),
    ("all", (0, 0, 0, 0, 0), "batch"),
    ("pools", (None, 0, 0, None, None), "batch"),
]


def _spec(paged, window=None, softcap=None):
    return DecodeSpec(scale=0.3, is_causal=True, use_kernel=True, window=window, softcap=softcap,
                      page_size=PAGE if paged else None)


def _inputs(seed, in_axes, paged, dtype=F32, h=H):
    """Arrays with a mapped axis of E where in_axes says; lengths ragged (0, odd, the whole capacity);
    the last slot of each table outside the pool (-1 or PAGES)."""
    rng = np.random.default_rng(seed)
    cache = (PAGES, PAGE, KH, h) if paged else (B, MAX_PAGES * PAGE, KH, h)
    shapes = [(B, T, N, h), cache, cache, (B,)] + ([(B, MAX_PAGES)] if paged else [])
    out = []
    for i, (shape, axis) in enumerate(zip(shapes, in_axes)):
        full = shape if axis is None else shape[:axis] + (E,) + shape[axis:]
        if i < 3:
            out.append(randn(rng, full, dtype))
        elif i == 3:
            lengths = jnp.asarray(rng.integers(1, MAX_PAGES * PAGE, full), jnp.int32)
            out.append(lengths.at[..., 0].set(0).at[..., -1].set(MAX_PAGES * PAGE))
        else:
            table = rng.permuted(np.tile(np.arange(PAGES), (int(np.prod(full[:-1])), 1)), axis=1)[:, :MAX_PAGES]
            table = table.reshape(full)
            table[..., -1] = rng.choice([-1, PAGES], full[:-1])  # pages outside the pool read as zeros
            out.append(jnp.asarray(table, jnp.int32))
    return out


def _fake_call(seen, query, key_cache, value_cache, lengths, table, spec, parts, variant, out_init=None):
    """The kernel call's contract on the reference: (out, lse [B, N, T]); any per-row value serves as
    the lse here, as the test checks where each row lands."""
    seen.append((query.shape, key_cache.shape, table.shape))
    out = reference.attention(query, key_cache, value_cache, lengths, scale=spec.scale,
                              page_table=table if spec.page_size is not None else None, is_causal=spec.is_causal,
                              local_window_size=spec.window, logits_soft_cap=spec.softcap)
    return out, jnp.swapaxes(out.astype(F32).sum(-1), 1, 2)


def _entry(args, in_axes, i):
    return [x if a is None else jnp.take(x, i, axis=a) for x, a in zip(args, in_axes)]


@pytest.fixture
def fake_kernel(monkeypatch):
    """The kernel call replaced by ``_fake_call``; the calls it saw. The cached custom_vmap functions
    (and so JAX's traces of them) are dropped before and after, so that none mixes the two."""
    seen = []
    monkeypatch.setattr(launch, "_call", functools.partial(_fake_call, seen))
    launch._batched.cache_clear()
    yield seen
    launch._batched.cache_clear()


def _check_fold(seen, in_axes, fold, paged, spec):
    args = _inputs(0, in_axes, paged)
    table = (lambda a: a[4]) if paged else (lambda a: None)
    run = lambda *a: launch.kernel(*a[:4], table(a), spec, with_lse=True)
    out, lse = jax.vmap(run, in_axes=in_axes)(*args)
    folded = seen[-1]
    for i in range(E):
        want_out, want_lse = run(*_entry(args, in_axes, i))
        np.testing.assert_allclose(out[i], want_out, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse[i], want_lse, rtol=1e-5, atol=1e-5)
    q_shape = folded[0]
    assert q_shape == {"heads": (B, T, N * E, H), "batch": (B * E, T, N, H), "loop": (B, T, N, H)}[fold], q_shape
    if paged and fold == "batch":
        pool_mapped = in_axes[1] is not None
        assert folded[1][0] == PAGES * (E if pool_mapped else 1) and folded[2] == (B * E, MAX_PAGES)


@pytest.mark.parametrize("name,in_axes,fold", CONTIGUOUS, ids=[c[0] for c in CONTIGUOUS])
def test_vmap_contiguous_folds(fake_kernel, name, in_axes, fold):
    _check_fold(fake_kernel, in_axes, fold, False, _spec(False, window=(5, 0), softcap=20.0))


@pytest.mark.parametrize("name,in_axes,fold", PAGED, ids=[c[0] for c in PAGED])
def test_vmap_paged_folds(fake_kernel, name, in_axes, fold):
    _check_fold(fake_kernel, in_axes, fold, True, _spec(True))


def test_nested_vmap_of_the_query(fake_kernel):
    seen = fake_kernel
    rng = np.random.default_rng(1)
    q = randn(rng, (2, E, B, T, N, H), F32)
    k, v = (randn(rng, (B, 12, KH, H), F32) for _ in range(2))
    lengths = jnp.asarray([12, 5, 0], jnp.int32)
    spec = _spec(False)
    run = lambda q: launch.kernel(q, k, v, lengths, None, spec)
    out = jax.vmap(jax.vmap(run))(q)
    assert seen[-1][0] == (B, T, N * E * 2, H)
    for i in range(2):
        for j in range(E):
            np.testing.assert_allclose(out[i, j], run(q[i, j]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("in_axes,loop", [((0, None, None, None), False), ((0, 0, 0, 0), False),
                                          ((0, None, None, 0), True)], ids=["query", "all", "query_and_lengths"])
@needs_extension
def test_vmap_lowers_to_one_launch(monkeypatch, in_axes, loop):
    """The CUDA lowering of a vmapped jax_tk.decode.attention: one custom call, in a loop only where
    folding would copy the cache. (Auto partitioning, on with several devices, is turned off: programs
    with custom_partitioning cannot be exported.)"""
    monkeypatch.setattr(sharding, "_AUTO_PARTITIONING", False)
    shapes = [(B, T, N, 128), (B, 64, KH, 128), (B, 64, KH, 128), (B,)]
    args = [jax.ShapeDtypeStruct(s if a is None else (E, *s), jnp.int32 if i == 3 else BF16)
            for i, (s, a) in enumerate(zip(shapes, in_axes))]
    fn = jax.jit(jax.vmap(lambda q, k, v, l: jax_tk.decode.attention(q, k, v, l), in_axes=in_axes))
    check = [jax.export.DisabledSafetyCheck.custom_call(launch.TARGET)]
    text = jax.export.export(fn, platforms=["cuda"], disabled_checks=check)(*args).mlir_module()
    assert text.count(f"stablehlo.custom_call @{launch.TARGET}") == 1
    assert ("stablehlo.while" in text) == loop


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_vmap_kernel_matches_each_entry(paged):
    """The kernel, vmapped in every way above, against the float32 reference of each entry."""
    for _, in_axes, _ in PAGED if paged else CONTIGUOUS:
        args = _inputs(2, in_axes, paged, BF16, h=64)
        args[:3] = [x.astype(F32).astype(BF16) for x in args[:3]]
        table = (lambda a: a[4]) if paged else (lambda a: None)
        got = jax.jit(jax.vmap(lambda *a: jax_tk.decode.attention(*a[:4], page_table=table(a), scale=0.3,
                                                                   implementation="tk"), in_axes=in_axes))(*args)
        for i in range(E):
            e = _entry(args, in_axes, i)
            want = reference.attention(*(x.astype(F32) for x in e[:3]), e[3], scale=0.3, page_table=table(e))
            assert rel_err(got[i], want) < 1.2e-2, (in_axes, i)
