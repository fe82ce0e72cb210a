"""GPU tests of the grouped GEMM kernel (``jax_tk_gemm_ragged``) against the float32 reference (skipped
without a GPU).

The kernel's launches are called directly (``launch.ragged_dot`` / ``launch.ragged_contracting``) with
their outputs poisoned with NaN before the kernel runs (``out_init``: buffers aliased to the outputs),
so an element the kernel forgets to write shows up as NaN; and through the public op with
``implementation="tk"``: values and gradients, under jit, vmap (the batch folded into the groups) and
grad. Errors are relative, ``norm(x - ref) / norm(ref)``, against the float32 reference computed from
the same (rounded) inputs. Cases: odd m, k and n multiples of 8 but not of 16/64, empty groups (first,
middle, last), one group, sizes summing to less than m (rows past the sum must be exactly 0), 256
groups, skewed sizes, and 4096 groups of one row.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import jax_tk
from jax_tk.gemm import launch, reference

pytestmark = pytest.mark.gpu

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
RTOL = 1e-2


def rel_err(x, ref):
    return helpers.rel_err(x, ref, 1e-4)


def assert_close(name, x, ref, tol=RTOL):
    x32 = np.asarray(x).astype(np.float32)
    bad = ~np.isfinite(x32)
    assert not bad.any(), f"{name}: {bad.sum()} of {x32.size} values are NaN/inf (first at {np.argwhere(bad)[0]})"
    err = rel_err(x32, ref)
    assert err < tol, f"{name}: relative error {err:.3g} >= {tol}"


def inputs(seed, m, k, n, sizes, dtype):
    rng = np.random.default_rng(seed)
    g = len(sizes)
    return (helpers.randn(rng, (m, k), dtype), helpers.randn(rng, (g, k, n), dtype),
            jnp.asarray(np.asarray(sizes, np.int32)), helpers.randn(rng, (m, n), dtype))


def _skewed(m, g, seed):
    rng = np.random.default_rng(seed)
    return list(rng.multinomial(m, rng.dirichlet(np.full(g, 0.3))))


CASES = {  # (m, k, n, sizes)
    "odd_m": (333, 72, 88, [100, 0, 57, 176]),
    "empty_ends": (256, 64, 128, [0, 128, 0, 128, 0]),
    "one_group": (517, 128, 256, [517]),
    "short_sum": (300, 64, 64, [41, 0, 77, 2]),  # rows 120..299 give 0
    "all_empty": (64, 64, 64, [0, 0, 0]),
    "tiny_groups": (77, 136, 40, [1, 2, 3, 5, 8, 13, 21, 24]),
    "g256": (4099, 64, 64, _skewed(4000, 256, 1)),
    "g256_uniform": (4096, 256, 128, [16] * 256),
    "big_k": (1031, 1024, 520, [300, 211, 520]),
    "g4096": (4096 + 17, 32, 32, [1] * 4096),
}


def _want(lhs, rhs, sizes, dout):
    out = reference.ragged_dot(lhs, rhs, sizes, out_dtype=F32)
    dlhs = reference.ragged_dot(dout, rhs, sizes, out_dtype=F32, rhs_transposed=True)
    drhs = reference.ragged_contracting(lhs, dout, sizes, out_dtype=F32)
    return out, dlhs, drhs


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_launches_against_reference(case, dtype):
    """Both modes, b transposed or not, outputs in the input dtype and float32, poisoned first."""
    m, k, n, sizes = CASES[case]
    lhs, rhs, gs, dout = inputs(0, m, k, n, sizes, dtype)
    want_out, want_dlhs, want_drhs = _want(lhs, rhs, gs, dout)
    inside = int(np.sum(sizes))
    for out_dtype in (dtype, F32):
        out = launch.ragged_dot(lhs, rhs, gs, out_dtype=out_dtype, out_init=helpers.nan((m, n), out_dtype))
        assert out.dtype == out_dtype
        assert_close(f"out ({out_dtype.__name__})", out, want_out)
        assert np.all(np.asarray(out[inside:]) == 0), "rows past the groups must be 0"
        rhs_t = jnp.swapaxes(rhs, 1, 2)  # [g, n, k] as stored: out = a @ b_g^T
        out_t = launch.ragged_dot(lhs, rhs_t, gs, out_dtype=out_dtype, b_transposed=True,
                                  out_init=helpers.nan((m, n), out_dtype))
        assert_close("out (b transposed)", out_t, want_out)
        dlhs = launch.ragged_dot(dout, rhs, gs, out_dtype=out_dtype, b_transposed=True,
                                 out_init=helpers.nan((m, k), out_dtype))
        assert_close("d lhs (b transposed)", dlhs, want_dlhs)
        drhs = launch.ragged_contracting(lhs, dout, gs, out_dtype=out_dtype,
                                         out_init=helpers.nan((len(sizes), k, n), out_dtype))
        assert_close("d rhs (contracting)", drhs, want_drhs)
        for i, s in enumerate(sizes):
            if s == 0:
                assert np.all(np.asarray(drhs[i]) == 0), f"empty group {i} must give 0"


@pytest.mark.parametrize("case", ["odd_m", "short_sum", "g256", "one_group"])
@pytest.mark.parametrize("preferred", [None, F32])
def test_op_values_and_gradients(case, preferred):
    m, k, n, sizes = CASES[case]
    lhs, rhs, gs, dout = inputs(1, m, k, n, sizes, BF16)
    f = jax.jit(lambda a, b, s: jax_tk.ragged_dot(a, b, s, preferred_element_type=preferred, implementation="tk"))
    out, vjp = jax.vjp(lambda a, b: f(a, b, gs), lhs, rhs)
    assert out.dtype == (preferred or BF16)
    dlhs, drhs = vjp(dout.astype(out.dtype))
    want_out, want_dlhs, want_drhs = _want(lhs, rhs, gs, dout)
    assert_close("out", out, want_out)
    assert_close("d lhs", dlhs, want_dlhs)
    assert_close("d rhs", drhs, want_drhs)
    hlo = f.lower(lhs, rhs, gs).compile().as_text()
    assert "jax_tk_gemm_ragged" in hlo


def test_traced_group_sizes_and_determinism():
    m, k, n = 1000, 128, 64
    lhs, rhs, _, _ = inputs(2, m, k, n, [0] * 6, BF16)
    f = jax.jit(lambda a, b, s: jax_tk.ragged_dot(a, b, s, implementation="tk"))
    for seed in range(3):
        sizes = _skewed(m - 37, 6, seed)
        gs = jnp.asarray(np.asarray(sizes, np.int32))
        out = f(lhs, rhs, gs)
        assert_close(f"out (sizes {sizes})", out, reference.ragged_dot(lhs, rhs, gs, out_dtype=F32))
        assert np.array_equal(np.asarray(out), np.asarray(f(lhs, rhs, gs))), "not deterministic"


def test_vmap_is_one_launch_and_correct():
    e, m, k, n, g = 3, 200, 64, 96, 5
    rng = np.random.default_rng(3)
    lhs, rhs = helpers.randn(rng, (e, m, k), BF16), helpers.randn(rng, (e, g, k, n), BF16)
    sizes = jnp.asarray(np.array([[40, 0, 60, 50, 50], [0, 0, 0, 0, 7], [200, 0, 0, 0, 0]], np.int32))
    dout = helpers.randn(rng, (e, m, n), BF16)

    def one(a, b, s, d):
        out, vjp = jax.vjp(lambda a, b: jax_tk.ragged_dot(a, b, s, implementation="tk"), a, b)
        return (out, *vjp(d))

    f = jax.jit(jax.vmap(one))
    got = f(lhs, rhs, sizes, dout)
    for i in range(e):
        want = _want(lhs[i], rhs[i], sizes[i], dout[i])
        for name, x, w in zip(("out", "d lhs", "d rhs"), (g_[i] for g_ in got), want):
            assert_close(f"{name}[{i}]", x, w)
    assert f.lower(lhs, rhs, sizes, dout).as_text().count("custom_call @jax_tk_gemm_ragged") == 3


@pytest.mark.parametrize("shape", [((513, 264), (264, 136)), ((4, 77, 64), (4, 64, 128)), ((2048, 1024), (1024, 2048)),
                                   ((128, 8192), (8192, 2048)), ((64, 3000), (3000, 512)),
                                   ((128, 2048), (2048, 8192)), ((64, 2200), (2200, 4104))])
# (the last four split k in the forward; on Hopper all but (64, 3000) also in the input's gradient)
def test_matmul(shape):
    rng = np.random.default_rng(4)
    a, b = helpers.randn(rng, shape[0], BF16), helpers.randn(rng, shape[1], BF16)
    want = jnp.matmul(a.astype(F32), b.astype(F32), precision="highest")
    out, vjp = jax.vjp(lambda a, b: jax_tk.matmul(a, b, implementation="tk"), a, b)
    assert_close("matmul", out, want)
    dout = helpers.randn(rng, out.shape, BF16)
    da, db = vjp(dout)
    wa, wb = jax.vjp(lambda a, b: jnp.matmul(a, b, precision="highest"), a.astype(F32), b.astype(F32))[1](
        dout.astype(F32))
    assert_close("d a", da, wa)
    assert_close("d b", db, wb)


def test_unsupported_shapes_fall_back_or_raise():
    lhs, rhs, gs, _ = inputs(5, 64, 20, 64, [32, 32], BF16)  # k = 20: not a multiple of 8
    with pytest.raises(ValueError, match="multiples of 8"):
        jax_tk.ragged_dot(lhs, rhs, gs, implementation="tk")
    assert_close("fallback", jax_tk.ragged_dot(lhs, rhs, gs), reference.ragged_dot(lhs, rhs, gs, out_dtype=F32))
