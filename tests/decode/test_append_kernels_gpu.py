"""jax_tk.decode.append_attention's fused call on the GPU (the append kernel, then the decode kernel, in one
FFI call) against the composition in float32 (update_kv_cache, then the reference attention over the
lengths after the new tokens). The output, lse, workspace and lengths after are poisoned first; the
cache past each length is NaN (the new rows must replace it where they land); only the new rows may
change in the caches, and rows past the capacity are dropped. Split counts 1 and several, GQA, T_new 1-4,
windows, soft cap, sinks, head dims 64/128/256, and the public call inside a jitted scan with donated
caches."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from helpers import nan, randn, rel_err
from jax_tk.decode import launch
from jax_tk.decode.api import DecodeSpec
from test_decode import poison_past, to_pages
from test_decode_kernels_gpu import TOL, check_part, want

pytestmark = pytest.mark.gpu
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


@functools.partial(jax.jit, static_argnames=("spec", "parts"))
def fused(q, nk, nv, kc, vc, lengths, table, sinks, *, spec, parts):
    b, t, n, h = q.shape
    out_init = (nan(q.shape, q.dtype), nan((b, n, t), F32), nan((launch.workspace_words(parts, b, t, n, h),), F32),
                jnp.full((b,), -7, jnp.int32))
    return launch.append_kernel(q, nk, nv, kc, vc, lengths, table, spec, sinks=sinks, parts=parts, out_init=out_init)


def check(seed, b, t, n, kh, h, s, lengths, dtype=BF16, parts=(1, 3), window=None, softcap=None, sinks=False,
          page_size=None):
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths)
    q, nk, nv = randn(rng, (b, t, n, h), dtype), randn(rng, (b, t, kh, h), dtype), randn(rng, (b, t, kh, h), dtype)
    # the cache past each length (after the new tokens) is NaN: what the append leaves there is never read
    kc = poison_past(randn(rng, (b, s, kh, h), dtype), lengths)
    vc = poison_past(randn(rng, (b, s, kh, h), dtype), lengths)
    table = None
    if page_size:  # the same caches in shuffled pages, with stray NaN pages
        kc, vc, table = to_pages(rng, kc, vc, page_size)
    lens = jnp.asarray(lengths, jnp.int32)
    sink = jnp.asarray(rng.standard_normal(n), F32) if sinks else None
    spec = DecodeSpec(1 / np.sqrt(h), True, True, window, softcap, page_size)
    wk = jax_tk.decode.update_kv_cache(kc, nk, lens, page_table=table)
    wv = jax_tk.decode.update_kv_cache(vc, nv, lens, page_table=table)
    ref, ref_lse = (np.asarray(x) for x in want(q, wk, wv, lens + t, table, spec=spec))
    if sinks:
        ref_spec = dict(scale=spec.scale, local_window_size=window, logits_soft_cap=softcap, sinks=sink,
                        implementation="xla")
        ref, ref_lse = (np.asarray(x) for x in jax_tk.decode.attention_with_lse(
            q.astype(F32), wk.astype(F32), wv.astype(F32), lens + t, page_table=table, **ref_spec))
    for p in parts:
        out, lse, k2, v2 = fused(q, nk, nv, kc, vc, lens, table, sink, spec=spec, parts=p)
        check_part(p, out, lse, ref, ref_lse, TOL[dtype])
        for got, w in ((k2, wk), (v2, wv)):  # the caches: the new rows, and nothing else, changed
            np.testing.assert_array_equal(np.asarray(got.astype(F32)), np.asarray(w.astype(F32)))


# (B, T_new, N, K, H, capacity, lengths before): empty sequences, rows at and past the capacity's end
SHAPES = [
    (3, 1, 32, 8, 128, 4096, (0, 1, 3001)),
    (2, 4, 32, 8, 128, 700, (698, 33)),
    (2, 2, 8, 8, 64, 300, (0, 299)),
    (2, 3, 6, 3, 256, 520, (255, 7)),
    (1, 1, 16, 1, 128, 9000, (8191,)),
]


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:6])))
def test_against_the_composition(shape, dtype):
    check(0, *shape, dtype=dtype)


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1][:5] + (704,) + SHAPES[1][6:]], ids=["t1", "t4_full"])
def test_paged(shape, page_size):
    check(3, *shape, page_size=page_size)


@pytest.mark.parametrize("opts", [dict(window=(100, 0)), dict(softcap=20.0), dict(sinks=True)], ids=str)
def test_options(opts):
    check(1, 3, 2, 16, 4, 128, 2100, (0, 700, 2053), **opts)


def test_public_call_in_a_jitted_scan():
    rng = np.random.default_rng(2)
    b, n, kh, h, s, steps = 4, 32, 8, 128, 1024, 8
    q, nk, nv = (randn(rng, (steps, b, 1, x, h), BF16) for x in (n, kh, kh))
    kc, vc = randn(rng, (b, s, kh, h), BF16), randn(rng, (b, s, kh, h), BF16)
    lengths = jnp.asarray([0, 10, 500, 1020], jnp.int32)

    def loop(kc, vc, xs, impl):
        def step(carry, x):
            kc, vc, lengths = carry
            out, kc, vc = jax_tk.decode.append_attention(*x, kc, vc, lengths, implementation=impl)
            return (kc, vc, lengths + 1), out
        return jax.lax.scan(step, (kc, vc, lengths), xs)

    f32 = lambda *xs: tuple(x.astype(F32) for x in xs)
    (k_ref, v_ref, _), ref = jax.jit(loop, static_argnums=3)(*f32(kc, vc), f32(q, nk, nv), "xla")
    (k2, v2, _), out = jax.jit(loop, static_argnums=3, donate_argnums=(0, 1))(kc, vc, (q, nk, nv), "tk")
    assert rel_err(out, ref) < TOL[BF16]
    np.testing.assert_array_equal(np.asarray(k2.astype(F32)), np.asarray(k_ref))
    np.testing.assert_array_equal(np.asarray(v2.astype(F32)), np.asarray(v_ref))


def test_vmapped_public_call():
    # (the fused call runs once per entry under vmap, where XLA may give the caches' results buffers of
    # their own: the handler then copies the caches there before appending)
    rng = np.random.default_rng(4)
    e, b, n, kh, h, s = 3, 2, 16, 4, 64, 256
    q, nk, nv = randn(rng, (e, b, 1, n, h), BF16), randn(rng, (e, b, 1, kh, h), BF16), randn(rng, (e, b, 1, kh, h), BF16)
    kc, vc = randn(rng, (e, b, s, kh, h), BF16), randn(rng, (e, b, s, kh, h), BF16)
    lengths = jnp.asarray(rng.integers(0, s, size=(e, b)), jnp.int32)
    f = lambda impl: jax.jit(jax.vmap(functools.partial(jax_tk.decode.append_attention, implementation=impl)))
    got = f("tk")(q, nk, nv, kc, vc, lengths)
    want_ = f("xla")(*(x.astype(F32) for x in (q, nk, nv, kc, vc)), lengths)
    assert rel_err(got[0], want_[0]) < TOL[BF16]
    for g, w in zip(got[1:], want_[1:]):
        np.testing.assert_array_equal(np.asarray(g.astype(F32)), np.asarray(w))
