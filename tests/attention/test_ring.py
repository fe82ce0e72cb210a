"""jax_tk.ring_attention (context parallelism) on 8 fake CPU devices: values, log-sum-exps and
gradients equal unsharded attention over the whole sequence, for the contiguous and zig-zag layouts,
causal or not, grouped-query attention, several ring sizes, and a 2-D (data x sequence) mesh; the
zig-zag helpers; input errors. As in test_sharding.py, this file reruns itself in a subprocess with 8
host devices unless this process already has them.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_tk
from jax_tk.attention import reference
from jax_tk import unzigzag, zigzag, zigzag_indices

from helpers import attention_inputs, have_devices as _have_devices, multi_device_tests, rel_err

BF16, F32 = jnp.bfloat16, jnp.float32


test_in_subprocess, _ = multi_device_tests(__file__)


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _inputs(seed, b, t, s, n, kh, d, dtype):
    return attention_inputs(seed, b, t, s, n, kh, d, dtype, cotangents=True)


_rel = rel_err


def _ring_fn(mesh, axis, layout, causal, batch_axis=None, sinks=None):
    """Ring attention over arrays whose sequence (already in ``layout`` order) is split over ``axis``."""
    seq = P(batch_axis, axis)

    def local(q, k, v):
        return jax_tk.ring_attention_with_lse(
            q, k, v, axis_name=axis, is_causal=causal, layout=layout, sinks=sinks
        )

    return jax.shard_map(
        local, mesh=mesh, in_specs=(seq, seq, seq), out_specs=(seq, P(batch_axis, None, axis))
    )


def _ref(causal, sinks=None):
    return lambda q, k, v: reference.attention_with_lse(
        q, k, v, scale=q.shape[-1] ** -0.5, is_causal=causal, sinks=sinks
    )


def _values_and_grads(fn):
    """One jitted program: (out, lse) and the gradients of a loss using both."""

    def loss(q, k, v, do, dl):
        out, lse = fn(q, k, v)
        value = jnp.sum(out.astype(F32) * do.astype(F32)) + jnp.sum(lse * dl.astype(F32))
        return value, (out, lse)

    def run(q, k, v, do, dl):
        (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
            q, k, v, do, dl
        )
        return (out, lse, *grads)

    return jax.jit(run)


def _compare(fn, ref, args, tol, layout="contiguous", ring=1, put=lambda x, i: x):
    """Runs ``fn`` on ``args`` put in ``layout`` order (the zig-zag reordering is done on the host,
    which keeps the compiled programs small) and compares with ``ref`` on the original order."""
    perm_t = zigzag_indices(args[0].shape[1], ring) if layout == "zigzag" else None
    perm_s = zigzag_indices(args[1].shape[1], ring) if layout == "zigzag" else None
    order = lambda x, axis, perm: x if perm is None else jnp.asarray(np.take(np.asarray(x), perm, axis))
    restore = lambda x, axis, perm: x if perm is None else np.take(x, np.argsort(perm), axis)
    q, k, v, do, dl = args
    moved = (order(q, 1, perm_t), order(k, 1, perm_s), order(v, 1, perm_s), order(do, 1, perm_t),
             order(dl, 2, perm_t))
    got = _values_and_grads(fn)(*(put(x, i) for i, x in enumerate(moved)))
    got = [restore(np.asarray(g), axis, perm) for g, axis, perm in
           zip(got, (1, 2, 1, 1, 1), (perm_t, perm_t, perm_t, perm_s, perm_s))]
    want = _values_and_grads(ref)(*args)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape, g.dtype, w.dtype)
        assert _rel(g, w) < tol, f"{name}: relative error {_rel(g, w):.2e}"


def _mesh1(n, name="sp"):
    return jax.make_mesh((n,), (name,), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])


class TestRing:
    """Runs with 8 CPU devices (see the module docstring)."""

    @pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
    @pytest.mark.parametrize(
        "causal,layout",
        [(False, "contiguous"), (True, "contiguous"), (True, "zigzag")],
        ids=["full", "causal-contiguous", "causal-zigzag"],
    )
    def test_float32(self, causal, layout, heads):
        n_q, n_kv = heads
        ring = 4
        args = _inputs(0, 2, 8 * ring, 8 * ring, n_q, n_kv, 32, F32)
        _compare(_ring_fn(_mesh1(ring), "sp", layout, causal), _ref(causal), args, 1e-5, layout, ring)

    @pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
    def test_bfloat16(self, layout):
        # bfloat16 with head_dim 64: the kernel branch on CUDA, the reference here.
        ring = 4
        args = _inputs(1, 2, 16 * ring, 16 * ring, 4, 2, 64, BF16)
        _compare(_ring_fn(_mesh1(ring), "sp", layout, True), _ref(True), args, 2e-2, layout, ring)

    @pytest.mark.parametrize("ring", [2, 8])
    def test_ring_sizes(self, ring):
        args = _inputs(2, 1, 4 * ring, 4 * ring, 2, 2, 16, F32)
        _compare(_ring_fn(_mesh1(ring), "sp", "zigzag", True), _ref(True), args, 1e-5, "zigzag", ring)

    def test_sinks(self):
        # The sink joins the softmax merged over the ring: each device's rows, once.
        ring, sinks = 4, jnp.array([0.5, 3.0, -1.0, 2.0], F32)
        args = _inputs(4, 2, 8 * ring, 8 * ring, 4, 2, 32, F32)
        _compare(_ring_fn(_mesh1(ring), "sp", "zigzag", True, sinks=sinks), _ref(True, sinks), args, 1e-5,
                 "zigzag", ring)

    @pytest.mark.parametrize("causal,layout,heads,dtype", [
        (False, "contiguous", (4, 2), F32), (True, "contiguous", (4, 4), F32), (True, "zigzag", (4, 2), F32),
        (True, "zigzag", (4, 2), BF16)], ids=["full-gqa", "causal-contiguous", "causal-zigzag-gqa", "bf16"])
    def test_mla_head_dims(self, causal, layout, heads, dtype):
        # query/key head_dim 192, value head_dim 128 (MLA): the output, its accumulators and dV have 128.
        ring, sinks = 4, jnp.array([0.5, 3.0, -1.0, 2.0], F32)
        args = attention_inputs(9, 2, 8 * ring, 8 * ring, *heads, 192, dtype, cotangents=True, dv=128)
        tol = 1e-5 if dtype == F32 else 2e-2
        sinks = sinks if layout == "zigzag" else None
        fn = _ring_fn(_mesh1(ring), "sp", layout, causal, sinks=sinks)
        _compare(fn, _ref(causal, sinks), args, tol, layout, ring)

    def test_different_query_and_key_lengths(self):
        ring = 4
        args = _inputs(3, 2, 4 * ring, 12 * ring, 4, 2, 32, F32)
        _compare(_ring_fn(_mesh1(ring), "sp", "contiguous", False), _ref(False), args, 1e-5)

    def test_data_and_sequence_mesh(self):
        # 2-D mesh: batch over "data", ring over "sp"; explicitly sharded global arrays.
        mesh = jax.make_mesh((2, 4), ("data", "sp"), axis_types=(AxisType.Explicit,) * 2)
        args = _inputs(4, 4, 32, 32, 4, 2, 32, F32)
        specs = [P("data", "sp")] * 4 + [P("data", None, "sp")]
        put = lambda x, i: jax.device_put(x, NamedSharding(mesh, specs[i]))
        fn = _ring_fn(mesh, "sp", "zigzag", True, batch_axis="data")
        _compare(fn, _ref(True), args, 1e-5, "zigzag", 4, put)

    @pytest.mark.parametrize("axes", [("sp", "x"), ("x", "sp")], ids=["mesh_order", "reversed"])
    @pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
    def test_sequence_over_a_tuple_of_axes(self, axes, layout):
        """The sequence split over two mesh axes, in either order: ppermute numbers a tuple's devices in
        the mesh's order, axis_index in the tuple's (the ring is built on the latter)."""
        mesh = jax.make_mesh((2, 4), ("sp", "x"), axis_types=(AxisType.Auto,) * 2)
        args = _inputs(8, 2, 32, 32, 4, 2, 32, F32)
        _compare(_ring_fn(mesh, axes, layout, True), _ref(True), args, 1e-5, layout, 8)

    def test_rotates_with_collective_permute_only(self):
        mesh = _mesh1(4)
        q, k, v, _, _ = _inputs(5, 2, 32, 32, 4, 4, 32, F32)
        fn = _ring_fn(mesh, "sp", "contiguous", True)
        loss = lambda q, k, v: jnp.sum(fn(q, k, v)[0])
        seq = NamedSharding(mesh, P(None, "sp"))
        q, k, v = (jax.device_put(x, seq) for x in (q, k, v))
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
        found = set(re.findall(r"\b(all-gather|all-to-all|collective-permute)", hlo))
        assert found == {"collective-permute"}, found

    def test_one_device_ring_is_plain_attention(self):
        args = _inputs(6, 2, 16, 16, 4, 2, 32, F32)
        _compare(_ring_fn(_mesh1(1), "sp", "zigzag", True), _ref(True), args, 1e-5, "zigzag", 1)

    def test_zigzag_helpers(self):
        x = jnp.arange(2 * 24 * 3).reshape(2, 24, 3)
        for n in (1, 2, 3, 4):
            idx = zigzag_indices(24, n)
            z = zigzag(x, n)
            np.testing.assert_array_equal(z, x[:, idx])
            np.testing.assert_array_equal(unzigzag(z, n), x)
            np.testing.assert_array_equal(unzigzag(jnp.moveaxis(z, 1, -1), n, axis=-1), jnp.moveaxis(x, 1, -1))
            c = 24 // (2 * n)
            shards = idx.reshape(n, 2 * c)  # device i gets chunks i and 2n-1-i
            for i in range(n):
                np.testing.assert_array_equal(shards[i, :c] // c, i)
                np.testing.assert_array_equal(shards[i, c:] // c, 2 * n - 1 - i)
        with pytest.raises(ValueError, match="multiple of 2 \\* axis_size"):
            zigzag(x, 5)
        with pytest.raises(ValueError, match="axis_size must be an int"):
            zigzag(x, 2.0)
        for axis in (3, -4, 1.0):
            with pytest.raises(ValueError, match="out of range"):
                unzigzag(x, 2, axis=axis)

    def test_errors(self):
        mesh = _mesh1(4)
        q = jnp.zeros((1, 16, 2, 32), F32)
        seq = P(None, "sp")

        def run(q, k, **kw):
            f = lambda q, k: jax_tk.ring_attention(q, k, k, axis_name="sp", **kw)
            jax.eval_shape(jax.shard_map(f, mesh=mesh, in_specs=(seq, seq), out_specs=seq), q, k)

        with pytest.raises(ValueError, match="layout"):
            run(q, q, layout="spiral")
        with pytest.raises(ValueError, match="same length"):
            run(q, jnp.zeros((1, 32, 2, 32), F32), is_causal=True)
        with pytest.raises(ValueError, match="even"):
            run(jnp.zeros((1, 12, 2, 32), F32), jnp.zeros((1, 12, 2, 32), F32), is_causal=True, layout="zigzag")
        with pytest.raises(ValueError, match="ring_attention: query must have rank 4"):
            jax_tk.ring_attention(q[0], q[0], q[0], axis_name="sp")
        with pytest.raises(ValueError, match=r"ring_attention: implementation must be one of \(None, 'tk', 'xla'\)"):
            run(q, q, implementation="cudnn")
        with pytest.raises((ValueError, NameError), match="axis"):
            jax_tk.ring_attention(q, q, q, axis_name="nope")


if not _have_devices():  # the subprocess runs them (see test_in_subprocess)
    del TestRing
