"""jax_tk.ragged_dot and jax_tk.matmul on 8 CPU devices: lhs's rows split under sharded jit (explicit
and auto meshes: each device works out its part of every group; no all-gather, and the rhs gradient
is the only all-reduce), per-shard calls inside shard_map, the CUDA lowering on local shards, and the
expert-parallel example (experts split, tokens exchanged with all_to_all).

Unless this process already has 8 CPU devices, ``test_in_subprocess`` reruns this file in a fresh
Python with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``."""
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_tk
from helpers import (collectives, have_devices as _have_devices, load_example, multi_device_tests,
                     needs_extension, randn, rel_err)

F32, BF16 = jnp.float32, jnp.bfloat16


test_in_subprocess, _ = multi_device_tests(__file__)


def _inputs(seed, m, k, n, sizes, dtype=F32):
    rng = np.random.default_rng(seed)
    return (randn(rng, (m, k), dtype), randn(rng, (len(sizes), k, n), dtype),
            jnp.asarray(np.asarray(sizes, np.int32)), randn(rng, (m, n), dtype))


# 64 rows over 8 devices (8 each): groups that span shards, an empty group, rows past the sum.
SIZES = [3, 0, 30, 7, 9, 2]  # 51 of 64 rows


def _loss(f, sizes, dout):
    return lambda a, b: jnp.sum(f(a, b, sizes).astype(F32) * dout.astype(F32))


class TestSharding:
    @pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
    @pytest.mark.parametrize("mesh_shape,spec", [((8,), P("x")), ((2, 4), P(("x", "y")))], ids=["1d", "2d"])
    def test_jit_rows_sharded(self, axis_type, mesh_shape, spec):
        names = ("x", "y")[:len(mesh_shape)]
        mesh = jax.make_mesh(mesh_shape, names, axis_types=(axis_type,) * len(mesh_shape))
        lhs, rhs, sizes, dout = _inputs(0, 64, 16, 24, SIZES)
        want = jax_tk.ragged_dot(lhs, rhs, sizes)
        want_grads = jax.grad(_loss(jax_tk.ragged_dot, sizes, dout), argnums=(0, 1))(lhs, rhs)
        put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
        args = put(lhs, spec), put(rhs, P()), put(sizes, P())
        with jax.set_mesh(mesh):
            f = jax.jit(jax_tk.ragged_dot)
            out = f(*args)
            assert rel_err(out, want) < 1e-6
            assert not collectives(f.lower(*args).compile().as_text())
            assert out.sharding.spec[0] in (spec[0], *((spec[0],) if isinstance(spec[0], str) else ()))
            g = jax.jit(jax.grad(lambda a, b, s, d: _loss(jax_tk.ragged_dot, s, d)(a, b), argnums=(0, 1)))
            grads = g(*args, put(dout, spec))
            for got, w in zip(grads, want_grads):
                assert rel_err(got, w) < 1e-6
            # d rhs is a sum over the rows: one all-reduce; nothing is gathered
            assert collectives(g.lower(*args, put(dout, spec)).compile().as_text()) == {"all-reduce"}

    @pytest.mark.parametrize("shape,spec", [((64, 32), P("x")), ((8, 6, 32), P("x"))])
    def test_matmul_rows_sharded(self, shape, spec):
        mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
        rng = np.random.default_rng(1)
        a, b = randn(rng, shape, F32), randn(rng, (32, 8), F32)
        with jax.set_mesh(mesh):
            A = jax.device_put(a, NamedSharding(mesh, spec))
            f = jax.jit(jax_tk.matmul)
            np.testing.assert_allclose(f(A, b), np.matmul(a, b), atol=1e-4, rtol=1e-5)
            assert not collectives(f.lower(A, b).compile().as_text())

    def test_vmap_rows_sharded_under_auto_partitioning(self):
        """vmap of the row-split op: one partitioned op (no loop) whose shards still find their part of
        every entry's groups (batch_start under the mapped axis)."""
        mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
        entries = [_inputs(3 + i, 64, 16, 24, sizes) for i, sizes in enumerate((SIZES, [64, 0], [5, 5, 5, 5]))]
        entries = [(a, jnp.pad(b, ((0, 6 - len(b)), (0, 0), (0, 0))), jnp.pad(s, (0, 6 - len(s))), d)
                   for a, b, s, d in entries]
        lhs, rhs, sizes, dout = (jnp.stack(x) for x in zip(*entries))
        lhs_sharded = jax.device_put(lhs, NamedSharding(mesh, P(None, "x")))
        loss = lambda a, b, s, d: _loss(jax_tk.ragged_dot, s, d)(a, b)
        both = lambda a, b, s, d: (jax_tk.ragged_dot(a, b, s), *jax.grad(loss, argnums=(0, 1))(a, b, s, d))
        f = jax.jit(jax.vmap(both))
        got = f(lhs_sharded, rhs, sizes, dout)
        assert "stablehlo.while" not in f.lower(lhs_sharded, rhs, sizes, dout).as_text()
        for i, (a, b, s, d) in enumerate(entries):
            for g, w in zip(got, both(a, b, s, d)):
                assert rel_err(g[i], w) < 1e-6

    def test_shard_map_per_shard_group_sizes(self):
        """Inside shard_map each call sees its own rows: the caller passes each shard's group sizes
        (here from the global ones with local_group_sizes) and gets the global result's rows."""
        mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
        lhs, rhs, sizes, dout = _inputs(2, 64, 16, 24, SIZES, BF16)

        def local(a, b, s, d):
            start = jax.lax.axis_index("x") * a.shape[0]
            mine = jax_tk.gemm.local_group_sizes(s, start, a.shape[0])
            out, vjp = jax.vjp(lambda a, b: jax_tk.ragged_dot(a, b, mine), a, b)
            return out, *vjp(d)  # (d rhs: rhs is replicated, so JAX sums the shards' parts)

        f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("x"), P(), P(), P("x")),
                                  out_specs=(P("x"), P("x"), P())))
        put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
        out, da, db = f(put(lhs, P("x")), put(rhs, P()), put(sizes, P()), put(dout, P("x")))
        want_out, vjp = jax.vjp(lambda a, b: jax_tk.ragged_dot(a, b, sizes), lhs, rhs)
        want_da, want_db = vjp(dout)
        assert rel_err(out, want_out) < 1e-2 and rel_err(da, want_da) < 1e-2 and rel_err(db, want_db) < 1e-2

    @needs_extension
    def test_cuda_lowering_runs_kernel_on_local_shards(self):
        from jax_tk.gemm import launch

        if launch.extension.has_cuda_kernels() and not launch.extension.has_target(launch.TARGET):
            pytest.skip("this build has no grouped GEMM kernel")
        mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
        sds = lambda shape, spec, dt=BF16: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))
        args = sds((64, 16), P("x")), sds((6, 16, 24), P()), sds((6,), P(), jnp.int32)
        fn = jax.jit(jax.value_and_grad(lambda a, b, s: jnp.sum(jax_tk.ragged_dot(a, b, s).astype(F32)),
                                        argnums=(0, 1)))
        text = jax.export.export(fn, platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call(launch.TARGET)])(*args).mlir_module()
        calls = [l for l in text.splitlines() if "stablehlo.custom_call @jax_tk_gemm_ragged" in l]
        assert len(calls) == 3, calls
        for line in calls:
            assert "tensor<8x" in line and "tensor<64x" not in line, line  # 8 local rows
        assert "sdy.manual_computation" in text


class TestExpertParallelExample:
    def _module(self):
        pytest.importorskip("optax")  # (examples/moe.py imports it)
        return load_example("expert_parallel.py", "expert_parallel")

    def test_example_main(self, capsys):
        err, gerr = self._module().main()  # (both exchanges: all_to_all, and all_gather with group_offset)
        assert err < 1e-5 and gerr < 1e-5
        out = capsys.readouterr().out
        assert "all_to_all: 8 devices" in out and "all_gather: 8 devices" in out

    def test_bench(self, capsys):
        result = self._module().bench(8, 16, 32, 64, 8, 2, steps=1)
        assert set(result) == {1, 8} and all(v > 0 for v in result.values())
        assert "all_to_all, jax_tk.ragged_dot: 8 device(s), 1 experts each" in capsys.readouterr().out

    def test_bench_fp8(self, capsys):
        result = self._module().bench(8, 16, 128, 64, 8, 2, steps=1, gemm="fp8")
        assert set(result) == {1, 8} and all(v > 0 for v in result.values())
        assert "all_to_all, jax_tk.ragged_dot_fp8: 8 device(s)" in capsys.readouterr().out
        with pytest.raises(ValueError, match="all_to_all exchange only"):
            self._module().bench(8, 16, 128, 64, 8, 2, steps=1, exchange="all_gather", gemm="fp8")

    def test_bf16_against_one_device(self):
        """bf16 tokens, skewed routing (most tokens to two experts), values and gradients."""
        ep = self._module()
        moe = sys.modules["moe"]
        mesh = jax.make_mesh((8,), ("e",), axis_types=(AxisType.Explicit,))
        width, hidden, experts, top_k = 32, 64, 16, 2
        p = ep.example_params(jax.random.key(3), width, hidden, experts)
        p["router"] = p["router"].at[:, 5].add(3.0).at[:, 11].add(2.0)
        x = jax.random.normal(jax.random.key(4), (8 * 24, width)).astype(BF16)
        dout = jax.random.normal(jax.random.key(5), x.shape).astype(BF16)

        def loss(f):
            return lambda x, p: jnp.sum(f(x, p).astype(F32) * dout.astype(F32))

        one = lambda x, p: moe.moe_layer(x, p, top_k, moe.ragged_dot_tk)[0]
        want, want_grads = one(x, p), jax.grad(loss(one), argnums=(0, 1))(x, p)
        xs = jax.device_put(x, NamedSharding(mesh, P("e")))
        ps = jax.device_put(p, {k: NamedSharding(mesh, s) for k, s in ep.param_specs("e").items()})
        f = jax.jit(ep.sharded_moe(mesh, "e", top_k))
        assert rel_err(f(xs, ps), want) < 1e-2
        grads = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(xs, ps)
        for got, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
            assert rel_err(got, w) < 2e-2
        assert "all-to-all" in collectives(f.lower(xs, ps).compile().as_text())


if not _have_devices():  # the subprocess runs them (see test_in_subprocess)
    del TestSharding, TestExpertParallelExample
