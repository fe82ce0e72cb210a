"""CPU tests of jax_tk.ragged_dot and jax_tk.matmul: argument checks, the float32 reference against an
independent numpy per-group product, gradients against jax.grad of the reference, jit/vmap, the
kernel path's batching rules (with the kernel replaced by a stand-in that runs on the CPU), and the
CUDA lowering (checked without a GPU through jax.export)."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from helpers import needs_extension, randn, rel_err
from jax_tk.gemm import api, launch, reference

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def inputs(seed, m, k, n, sizes, dtype=F32):
    rng = np.random.default_rng(seed)
    g = len(sizes)
    return (randn(rng, (m, k), dtype), randn(rng, (g, k, n), dtype), jnp.asarray(np.asarray(sizes, np.int32)),
            randn(rng, (m, n), dtype))


def numpy_ragged_dot(lhs, rhs, sizes):
    """float64, one product per group, written independently of the library."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for i, s in enumerate(np.asarray(sizes)):
        s = int(max(s, 0))
        end = min(start + s, lhs.shape[0])
        out[start:end] = lhs[start:end] @ rhs[i]
        start = end
    return out


def numpy_contracting(lhs, rhs, sizes):
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((len(sizes), lhs.shape[1], rhs.shape[1]))
    start = 0
    for i, s in enumerate(np.asarray(sizes)):
        end = min(start + int(s), lhs.shape[0])
        out[i] = lhs[start:end].T @ rhs[start:end]
        start = end
    return out


# Odd m/k/n, empty groups (first, middle, last), one group, sizes summing to less than m, 256 groups.
CASES = {
    "odd": (37, 19, 23, [5, 0, 11, 9, 12]),
    "empty_ends": (40, 16, 24, [0, 13, 0, 27, 0]),
    "one_group": (29, 24, 8, [29]),
    "short_sum": (50, 8, 16, [7, 3, 0, 12]),  # rows 22..49 give 0
    "all_empty": (9, 8, 8, [0, 0, 0]),
    "g256": (700, 16, 8, list(np.random.default_rng(3).multinomial(690, np.ones(256) / 256))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_against_numpy(case):
    m, k, n, sizes = CASES[case]
    lhs, rhs, gs, dout = inputs(0, m, k, n, sizes)
    want = numpy_ragged_dot(lhs, rhs, sizes)
    assert rel_err(reference.ragged_dot(lhs, rhs, gs), want) < 1e-6 or np.abs(want).max() == 0
    np.testing.assert_allclose(reference.ragged_dot(lhs, rhs, gs), want, atol=1e-4, rtol=1e-5)
    got_t = reference.ragged_dot(lhs, jnp.swapaxes(rhs, 1, 2), gs, rhs_transposed=True)
    np.testing.assert_allclose(got_t, want, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(reference.ragged_contracting(lhs, dout, gs), numpy_contracting(lhs, dout, sizes),
                               atol=1e-4, rtol=1e-5)
    # The public op (the reference on CPU), and jax.lax.ragged_dot, agree.
    np.testing.assert_allclose(jax_tk.ragged_dot(lhs, rhs, gs), want, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(jax.lax.ragged_dot(lhs, rhs, gs, precision="highest"), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_against_reference(case):
    m, k, n, sizes = CASES[case]
    lhs, rhs, gs, dout = inputs(1, m, k, n, sizes)
    loss = lambda f: (lambda a, b: jnp.sum(f(a, b, gs) * dout))
    got = jax.grad(loss(jax_tk.ragged_dot), argnums=(0, 1))(lhs, rhs)
    want = jax.grad(loss(reference.ragged_dot), argnums=(0, 1))(lhs, rhs)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-5)
    # And against numpy: d lhs = dout rhs_g^T per group, d rhs = the ragged contracting product.
    want_dlhs = numpy_ragged_dot(dout, np.swapaxes(np.asarray(rhs), 1, 2), sizes)
    np.testing.assert_allclose(got[0], want_dlhs, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(got[1], numpy_contracting(lhs, dout, sizes), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("preferred", [None, F32])
def test_low_precision_inputs(dtype, preferred):
    m, k, n, sizes = CASES["odd"]
    lhs, rhs, gs, dout = inputs(2, m, k, n, sizes, dtype)
    out = jax_tk.ragged_dot(lhs, rhs, gs, preferred_element_type=preferred)
    assert out.dtype == (preferred or dtype) and out.shape == (m, n)
    assert rel_err(out, numpy_ragged_dot(lhs, rhs, sizes)) < 1e-2
    dout = dout.astype(out.dtype)
    dl, dr = jax.grad(lambda a, b: jnp.sum((jax_tk.ragged_dot(a, b, gs, preferred_element_type=preferred)
                                            * dout).astype(F32)), argnums=(0, 1))(lhs, rhs)
    assert dl.dtype == dtype and dr.dtype == dtype
    assert rel_err(dl, numpy_ragged_dot(dout, np.swapaxes(np.asarray(rhs, np.float32), 1, 2), sizes)) < 1e-2
    assert rel_err(dr, numpy_contracting(lhs, dout, sizes)) < 1e-2


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, jnp.int16, jnp.uint32, jnp.int32])
def test_group_sizes_any_integer_dtype(dtype):
    m, k, n, sizes = CASES["odd"]
    lhs, rhs, _, _ = inputs(3, m, k, n, sizes)
    got = jax_tk.ragged_dot(lhs, rhs, jnp.asarray(np.asarray(sizes), dtype))
    np.testing.assert_allclose(got, numpy_ragged_dot(lhs, rhs, sizes), atol=1e-4, rtol=1e-5)


def test_group_sizes_clipped_not_wrapped():
    """Negative sizes count as 0; a group reaching past the last row is cut there; 64-bit sizes are
    clipped before narrowing (2**32 + 5 must not become 5)."""
    m = 20
    assert api.group_sizes_int32("t", np.array([2**32 + 5, 3], np.int64), m).tolist() == [20, 0]
    assert api.group_sizes_int32("t", np.array([4, -7, 9, 30], np.int64), m).tolist() == [4, 0, 9, 7]
    assert api.group_sizes_int32("t", jnp.array([4, -7, 9, 30], jnp.int32), m).tolist() == [4, 0, 9, 7]
    assert api.group_sizes_int32("t", jnp.array([255, 3], jnp.uint8), m).tolist() == [20, 0]
    assert api.group_sizes_int32("t", jnp.array([2**32 - 1, 3], jnp.uint32), m).tolist() == [20, 0]
    traced = jax.jit(lambda s: api.group_sizes_int32("t", s, m))(jnp.array([6, 6, 6, 6, 6], jnp.int32))
    assert traced.tolist() == [6, 6, 6, 2, 0]
    lhs, rhs, _, _ = inputs(4, m, 8, 8, [0, 0, 0, 0])
    got = jax_tk.ragged_dot(lhs, rhs, np.array([4, -7, 9, 30], np.int64))
    np.testing.assert_allclose(got, numpy_ragged_dot(lhs, rhs, [4, 0, 9, 7]), atol=1e-4, rtol=1e-5)


def _pad_rows(lhs, start, pad):
    """lhs with its rows from ``start`` on (past the groups) set to non-finite values."""
    if pad == "mixed":  # NaN, inf and -inf rows, and a row with one inf among finite values
        return lhs.at[start::4].set(jnp.nan).at[start + 1::4].set(jnp.inf).at[start + 2::4].set(-jnp.inf) \
                  .at[start + 3, 1].set(jnp.inf)
    return lhs.at[start:].set(jnp.nan if pad == "nan" else jnp.inf)


@pytest.mark.parametrize("implementation", [None, "xla"])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("pad", ["nan", "inf", "mixed"])
def test_nonfinite_rows_past_the_groups(implementation, dtype, pad):
    """Rows of lhs past sum(group_sizes) may hold anything (a padded buffer): they give 0, as in
    jax.lax.ragged_dot, and no NaN reaches either gradient (the reference selects rows, it does not
    multiply them by a one-hot): the gradients are those of the same lhs with those rows zeroed."""
    m, k, n, sizes = 24, 8, 6, [0, 5, 0, 11, 0]  # empty groups first, between and last
    end = sum(sizes)
    lhs, rhs, gs, dout = inputs(5, m, k, n, sizes, dtype)
    padded, clean = _pad_rows(lhs, end, pad), lhs.at[end:].set(0)

    def f(lhs, rhs):
        return jax_tk.ragged_dot(lhs, rhs, gs, implementation=implementation)

    out, vjp = jax.vjp(f, padded, rhs)
    want = jax.lax.ragged_dot(padded, rhs, gs, precision="highest")
    assert out.dtype == dtype and np.all(np.asarray(want[end:], np.float32) == 0)
    assert np.all(np.asarray(out[end:], np.float32) == 0)
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == F32 else dict(atol=5e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), **tol)
    dlhs, drhs = vjp(dout)
    assert np.all(np.isfinite(np.asarray(dlhs, np.float32))) and np.all(np.isfinite(np.asarray(drhs, np.float32)))
    assert np.all(np.asarray(dlhs[end:], np.float32) == 0)
    clean_dlhs, clean_drhs = jax.vjp(f, clean, rhs)[1](dout)
    np.testing.assert_array_equal(np.asarray(dlhs, np.float32), np.asarray(clean_dlhs, np.float32))
    np.testing.assert_array_equal(np.asarray(drhs, np.float32), np.asarray(clean_drhs, np.float32))


@pytest.mark.parametrize("pad", ["nan", "mixed"])
@pytest.mark.parametrize("path,offset", [("kernel", None), ("kernel", 2), ("default", 2), ("xla", 2)])
def test_nonfinite_rows_past_the_groups_kernel_path_and_offset(request, path, offset, pad):
    """As test_nonfinite_rows_past_the_groups, on the kernel path (its stand-in, which gets the rows
    and sizes the kernel would: the Python side of that path, its backward's casts included) and with
    group_offset (rows rolled so that the local groups come first: the rows past every group must
    stay past the local ones): rows past sum(group_sizes) give exact zeros, and the other rows and
    both gradients are exactly those of the same lhs with those rows zeroed (lhs's rows past: 0)."""
    if path == "kernel":
        request.getfixturevalue("fake_kernel")
    m, k, n, sizes = 24, 8, 16, [0, 5, 0, 11, 0]  # rows 16.. in no group
    end = sum(sizes)
    lhs, rhs, gs, dout = inputs(11, m, k, n, sizes, BF16)  # (with offset 2: rhs's last 2 groups past the 5)
    padded, clean = _pad_rows(lhs, end, pad), lhs.at[end:].set(0)
    go = None if offset is None else jnp.asarray([offset], jnp.int32)

    def f(lhs, rhs):
        return jax_tk.ragged_dot(lhs, rhs, gs, group_offset=go, implementation="xla" if path == "xla" else None)

    out, vjp = jax.vjp(f, padded, rhs)
    want, want_vjp = jax.vjp(f, clean, rhs)
    as32 = lambda t: np.asarray(t, np.float32)
    assert np.all(as32(out)[end:] == 0) and np.abs(as32(out)[:end]).max() > 0
    np.testing.assert_array_equal(as32(out), as32(want))
    (dlhs, drhs), (want_dlhs, want_drhs) = vjp(dout), want_vjp(dout)
    assert np.all(np.isfinite(as32(dlhs))) and np.all(np.isfinite(as32(drhs)))
    assert np.all(as32(dlhs)[end:] == 0) and np.abs(as32(drhs)).max() > 0
    np.testing.assert_array_equal(as32(dlhs), as32(want_dlhs))
    np.testing.assert_array_equal(as32(drhs), as32(want_drhs))


@pytest.mark.parametrize("implementation", [None, "xla"])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_group_sizes_past_the_rows_as_lax(implementation, dtype):
    """Sizes summing to more than m: the group reaching past the last row is cut there and the later
    ones are empty, as in jax.lax.ragged_dot (forward and both gradients)."""
    m, k, n, sizes = 20, 8, 6, [6, 0, 9, 12, 3]  # sum 30: the fourth group is cut to 5 rows
    lhs, rhs, gs, dout = inputs(6, m, k, n, sizes, dtype)
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == F32 else dict(atol=5e-2, rtol=2e-2)
    got, got_vjp = jax.vjp(lambda a, b: jax_tk.ragged_dot(a, b, gs, implementation=implementation), lhs, rhs)
    want, want_vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, gs, precision="highest"), lhs, rhs)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)
    np.testing.assert_allclose(np.asarray(want, np.float32), numpy_ragged_dot(lhs, rhs, sizes), **tol)
    for g, w in zip(got_vjp(dout), want_vjp(dout)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), **tol)


@pytest.mark.skipif(not hasattr(jax, "enable_x64"), reason="needs jax.enable_x64")
def test_group_sizes_64_bit_arrays():
    """With 64-bit JAX arrays (x64 on): clipped in 64 bits, never wrapped (-2**32 + 5 is not 5)."""
    with jax.enable_x64(True):
        x = jnp.array([-2**32 + 5, 2**40, 3], jnp.int64)
        assert api.group_sizes_int32("t", x, 20).tolist() == [0, 20, 0]
        f = jax.jit(lambda s: api.group_sizes_int32("t", s, 20))
        assert f(jnp.array([2**33 + 1, 4], jnp.uint64)).tolist() == [20, 0]
        assert f(jnp.array([7, 2**32 + 2], jnp.int64)).tolist() == [7, 13]


def test_local_group_sizes():
    """A shard of rows [start, start + rows) holds a consecutive part of each group."""
    sizes = jnp.array([5, 0, 11, 9, 3], jnp.int32)  # rows 0..27 of 32
    parts = [api.local_group_sizes(sizes, s, 8).tolist() for s in range(0, 32, 8)]
    assert parts == [[5, 0, 3, 0, 0], [0, 0, 8, 0, 0], [0, 0, 0, 8, 0], [0, 0, 0, 1, 3]]
    assert api.local_group_sizes(sizes, 0, 32).tolist() == sizes.tolist()


def test_jit_and_traced_group_sizes():
    m, k, n, sizes = CASES["empty_ends"]
    lhs, rhs, gs, _ = inputs(5, m, k, n, sizes)
    f = jax.jit(jax_tk.ragged_dot)
    np.testing.assert_allclose(f(lhs, rhs, gs), numpy_ragged_dot(lhs, rhs, sizes), atol=1e-4, rtol=1e-5)
    other = [10, 10, 10, 5, 5]  # new sizes, no retrace needed
    np.testing.assert_allclose(f(lhs, rhs, jnp.asarray(other, jnp.int32)), numpy_ragged_dot(lhs, rhs, other),
                               atol=1e-4, rtol=1e-5)


def test_vmap():
    m, k, n, g, e = 21, 8, 16, 3, 4
    rng = np.random.default_rng(6)
    lhs, rhs = randn(rng, (e, m, k), F32), randn(rng, (e, g, k, n), F32)
    sizes = np.array([[5, 0, 16], [7, 7, 7], [0, 0, 3], [21, 0, 0]], np.int32)
    got = jax.vmap(jax_tk.ragged_dot)(lhs, rhs, jnp.asarray(sizes))
    for i in range(e):
        np.testing.assert_allclose(got[i], numpy_ragged_dot(lhs[i], rhs[i], sizes[i]), atol=1e-4, rtol=1e-5)
    # vmap of the gradient (a random cotangent per entry), and an unmapped rhs
    d = randn(rng, (e, m, n), F32)
    grad = jax.grad(lambda a, b, s, d: jnp.sum(jax_tk.ragged_dot(a, b, s) * d), argnums=(0, 1))
    dl, dr = jax.vmap(grad)(lhs, rhs, jnp.asarray(sizes), d)
    for i in range(e):
        np.testing.assert_allclose(dr[i], numpy_contracting(lhs[i], d[i], sizes[i]), atol=1e-4, rtol=1e-5)
        np.testing.assert_allclose(dl[i], numpy_ragged_dot(d[i], np.swapaxes(np.asarray(rhs[i]), 1, 2), sizes[i]),
                                   atol=1e-4, rtol=1e-5)
    got = jax.vmap(jax_tk.ragged_dot, in_axes=(0, None, 0))(lhs, rhs[0], jnp.asarray(sizes))
    np.testing.assert_allclose(got[2], numpy_ragged_dot(lhs[2], rhs[0], sizes[2]), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("shapes", [((13, 24), (24, 16)), ((3, 5, 24), (24, 8)), ((3, 5, 24), (3, 24, 8)),
                                    ((2, 3, 7, 16), (2, 3, 16, 8))])
def test_matmul(shapes):
    rng = np.random.default_rng(7)
    a, b = randn(rng, shapes[0], F32), randn(rng, shapes[1], F32)
    want = np.matmul(np.asarray(a, np.float64), np.asarray(b, np.float64))
    np.testing.assert_allclose(jax_tk.matmul(a, b), want, atol=1e-4, rtol=1e-5)
    dout = randn(rng, want.shape, F32)
    got = jax.grad(lambda a, b: jnp.sum(jax_tk.matmul(a, b) * dout), argnums=(0, 1))(a, b)
    ref = jax.grad(lambda a, b: jnp.sum(jnp.matmul(a, b, precision="highest") * dout), argnums=(0, 1))(a, b)
    for g, w in zip(got, ref):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-5)
    lo = jax_tk.matmul(a.astype(BF16), b.astype(BF16), preferred_element_type=F32)
    assert lo.dtype == F32 and rel_err(lo, want) < 1e-2


# ----------------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------------


def _bad(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


def test_errors():
    lhs, rhs, gs, _ = inputs(8, 12, 8, 16, [4, 4, 4])
    rd = jax_tk.ragged_dot
    _bad(lambda: rd(lhs[0], rhs, gs), ValueError, r"ragged_dot: lhs must have rank 2 \[m, k\]")
    _bad(lambda: rd(lhs, rhs[0], gs), ValueError, r"rhs must have rank 3 \[g, k, n\]")
    _bad(lambda: rd(lhs, rhs[:, :5], gs), ValueError, "contracting dimension k")
    _bad(lambda: rd(lhs, rhs.astype(BF16), gs), TypeError, "same dtype")
    _bad(lambda: rd(lhs.astype(jnp.int32), rhs, gs), TypeError, "lhs must be bfloat16, float16 or float32")
    _bad(lambda: rd(lhs, rhs, gs[:2]), ValueError, r"expected group_sizes to have shape \(3,\)")
    _bad(lambda: rd(lhs, rhs, gs[None]), ValueError, r"group_sizes must have rank 1")
    _bad(lambda: rd(lhs, rhs, gs.astype(F32)), TypeError, "group_sizes must have an integer dtype")
    _bad(lambda: rd(lhs, rhs, [4, 4, 4]), TypeError, "group_sizes must be an integer array")
    _bad(lambda: rd(lhs, rhs, gs, preferred_element_type=jnp.float16), TypeError, "preferred_element_type")
    _bad(lambda: rd(lhs, rhs, gs, preferred_element_type="nonsense"), TypeError, "preferred_element_type")
    _bad(lambda: rd(lhs, rhs, gs, group_offset=jnp.zeros((2,), jnp.int32)), ValueError, r"group_offset must be .* \(1,\)")
    _bad(lambda: rd(lhs, rhs, gs, group_offset=jnp.zeros((1,), F32)), ValueError, r"group_offset must be .* \(1,\)")
    _bad(lambda: rd(lhs, rhs, gs, group_offset=0), TypeError, "group_offset must be an integer array")
    _bad(lambda: rd(lhs, rhs, gs[:2], group_offset=jnp.zeros((1,), jnp.int32)), ValueError, "G >= the 3 groups of rhs")
    _bad(lambda: rd(lhs, rhs, gs, implementation="cuda"), ValueError, "implementation must be one of")
    _bad(lambda: rd(lhs, rhs, gs, precision="nonsense"), ValueError, "precision must be")
    _bad(lambda: rd(lhs, rhs, gs, precision=("highest", 3)), ValueError, "precision must be")
    mm = jax_tk.matmul
    _bad(lambda: mm(lhs, rhs[0][:5]), ValueError, "same k")
    _bad(lambda: mm(lhs[0], rhs[0]), ValueError, "a must have rank >= 2")
    _bad(lambda: mm(lhs[None], rhs[:2]), ValueError, "leading dims")
    _bad(lambda: mm(lhs, "b"), TypeError, "b must be an array")
    _bad(lambda: mm(lhs, rhs[0], precision=1), ValueError, "precision must be")


def test_precision_forms_of_jax_lax_accepted():
    lhs, rhs, gs, _ = inputs(8, 12, 8, 16, [4, 4, 4])
    want = jax_tk.ragged_dot(lhs, rhs, gs)
    for precision in ("highest", "default", jax.lax.Precision.HIGH, ("highest", "bfloat16"),
                      jax.lax.DotAlgorithmPreset.DEFAULT, "BF16_BF16_F32"):
        jax.lax.ragged_dot(lhs, rhs, gs, precision=precision)  # (valid for jax.lax too)
        np.testing.assert_array_equal(jax_tk.ragged_dot(lhs, rhs, gs, precision=precision), want)
    np.testing.assert_array_equal(jax_tk.matmul(lhs, rhs[0], precision="highest"), jax_tk.matmul(lhs, rhs[0]))


@pytest.mark.parametrize("m,k,n,g", [(0, 8, 16, 3), (12, 0, 16, 3), (12, 8, 0, 3), (12, 8, 16, 0)])
def test_empty_dimensions(m, k, n, g):
    """As jax.lax.ragged_dot: an empty dimension gives an empty result or zeros (no groups, or nothing to
    contract), with zero gradients. (jax.lax.ragged_dot itself fails to compile g = 0 for CUDA in jax
    0.11: it runs on the CPU.)"""
    rng = np.random.default_rng(0)
    lhs, rhs = randn(rng, (m, k), BF16), randn(rng, (g, k, n), BF16)
    sizes = jnp.full((g,), 4, jnp.int32)
    out = jax.jit(jax_tk.ragged_dot)(lhs, rhs, sizes)
    assert out.shape == (m, n) and out.dtype == BF16
    np.testing.assert_array_equal(np.asarray(out, np.float32), numpy_ragged_dot(lhs, rhs, sizes))
    with jax.default_device(jax.devices("cpu")[0]):
        want = jax.lax.ragged_dot(*jax.device_put((lhs, rhs, sizes), jax.devices("cpu")[0]))
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    dl, dr = jax.grad(lambda a, b: jax_tk.ragged_dot(a, b, sizes).astype(F32).sum(), argnums=(0, 1))(lhs, rhs)
    assert dl.shape == lhs.shape and dr.shape == rhs.shape and not np.asarray(dl, F32).any()
    a, b = randn(rng, (2, m, k), BF16), randn(rng, (k, n), BF16)
    np.testing.assert_array_equal(np.asarray(jax_tk.matmul(a, b), F32), np.asarray(jnp.matmul(a, b), F32))
    assert jax_tk.matmul(a[:0], b).shape == (0, m, n)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the errors raised without a GPU")
def test_implementation_tk_without_kernel():
    lhs, rhs, gs, _ = inputs(9, 12, 8, 16, [4, 4, 4])
    with pytest.raises((ValueError, RuntimeError), match=r"ragged_dot\(implementation='tk'\)"):
        jax_tk.ragged_dot(lhs, rhs, gs, implementation="tk")  # float32 (and no GPU here)
    with pytest.raises((ValueError, RuntimeError), match=r"ragged_dot\(implementation='tk'\)"):
        jax_tk.ragged_dot(lhs.astype(BF16), rhs.astype(BF16), gs, implementation="tk")
    # implementation="xla" and None give the reference
    np.testing.assert_allclose(jax_tk.ragged_dot(lhs, rhs, gs, implementation="xla"),
                               jax_tk.ragged_dot(lhs, rhs, gs), atol=0)


def test_kernel_unsupported_reasons():
    c = launch.contract()
    mult, most = c["DIM_MULTIPLE"], launch.max_groups()
    assert mult == 8 and (c["MODE_RAGGED"], c["MODE_CONTRACT"]) == (0, 1)
    if launch.extension.has_cuda_kernels() and not launch.extension.has_target(launch.TARGET):
        assert "no grouped GEMM kernel" in launch.kernel_unsupported_reason(BF16, 64, 64, 8, 100)
        return
    assert launch.kernel_unsupported_reason(BF16, 64, 64, 8, 100) is None
    assert launch.kernel_unsupported_reason(F16, 8, 8, most or 100_000, 1) is None
    assert "dtype float32" in launch.kernel_unsupported_reason(F32, 64, 64, 8, 100)
    assert f"multiples of {mult}" in launch.kernel_unsupported_reason(BF16, 60, 64, 8, 100)
    assert f"multiples of {mult}" in launch.kernel_unsupported_reason(BF16, 64, 20, 8, 100)
    if most is not None:
        assert "groups" in launch.kernel_unsupported_reason(BF16, 64, 64, most + 1, 100)


# ----------------------------------------------------------------------------------------------
# The kernel path on the CPU: the kernel replaced by a stand-in with its contract's semantics
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def fake_kernel(monkeypatch):
    """Replaces the FFI call by the reference with the kernel's contract (modes 0, 1 and 2, int32
    sizes, b transposed or not) and records every launch (mode, operand shapes). CPU only: on a GPU the
    real kernel runs (tests/gemm/test_ragged_dot_gpu.py)."""
    if jax.default_backend() != "cpu":
        pytest.skip("the stand-in replaces the kernel on CPU runs")
    if not launch.extension.available():
        pytest.skip("without the compiled extension every op runs its reference")
    launches = []

    def raw_call(mode, a, b, sizes, out_shape, out_dtype, b_transposed, variant, out_init=None):
        assert sizes.dtype == jnp.int32 and a.dtype == b.dtype and a.dtype in (BF16, F16)
        assert variant == launch.dispatch.kernel_variant()
        launches.append((mode, a.shape, b.shape, sizes.shape, bool(b_transposed)))
        if mode == launch.contract()["MODE_SPLIT_K"]:  # a [rows, g k], b [g, k, n] or [n, g k]: part i of k, group i
            g = sizes.shape[0]
            if b_transposed:
                b = b.reshape(b.shape[0], g, -1).transpose(1, 2, 0)
            k = b.shape[1]
            assert b.shape[0] == g and a.shape[1] == g * k
            parts = a.reshape(a.shape[0], g, k).transpose(1, 0, 2)
            out = jnp.einsum("grk,gkn->grn", parts.astype(F32), b.astype(F32)).astype(out_dtype).reshape(-1, b.shape[2])
        elif mode == launch.contract()["MODE_RAGGED"]:
            out = reference.ragged_dot(a, b, sizes, out_dtype=out_dtype, rhs_transposed=b_transposed)
        elif b_transposed:  # (both K-major: a [k, m], b [n, m])
            out = reference.ragged_contracting(a.T, b.T, sizes, out_dtype=out_dtype)
        else:
            out = reference.ragged_contracting(a, b, sizes, out_dtype=out_dtype)
        assert out.shape == tuple(out_shape)
        return out

    monkeypatch.setattr(launch, "_raw_call", raw_call)
    monkeypatch.setattr(jax_tk.gemm.api.dispatch, "platform_dispatch",
                        lambda use, kernel, ref, *args: kernel(*args) if use else ref(*args))
    # (in a process with several devices, unsharded calls would take the custom_partitioning path,
    # which runs vmap as a loop around the op: see jax_tk._core.sharding)
    monkeypatch.setattr(jax_tk.gemm.api.sharding, "_AUTO_PARTITIONING", False)
    return launches


def test_kernel_path_calls(fake_kernel):
    m, k, n, sizes = CASES["short_sum"]
    lhs, rhs, gs, dout = inputs(10, m, k, n, sizes, BF16)
    out, vjp = jax.vjp(lambda a, b: jax_tk.ragged_dot(a, b, gs, preferred_element_type=F32), lhs, rhs)
    dl, dr = vjp(dout.astype(F32))
    assert [(l[0], l[4]) for l in fake_kernel] == [(0, False), (0, True), (1, False)]
    assert fake_kernel[1][2] == (4, k, n)  # d lhs: rhs as it is, read transposed
    assert rel_err(out, numpy_ragged_dot(lhs, rhs, sizes)) < 1e-2
    assert rel_err(dl, numpy_ragged_dot(dout, np.swapaxes(np.asarray(rhs, np.float32), 1, 2), sizes)) < 1e-2
    assert rel_err(dr, numpy_contracting(lhs, dout, sizes)) < 1e-2


@pytest.mark.parametrize("axes", [(0, 0, 0), (0, 0, None), (None, 0, 0), (0, None, 0)])
def test_kernel_path_vmap_folds_into_groups(fake_kernel, axes):
    """vmap over a mapped rhs: one launch per direction, the batch folded into the groups (rows past
    each entry's groups give 0; the contracting form gets one more group per entry)."""
    e, m, k, n, g = 3, 19, 8, 16, 4
    rng = np.random.default_rng(11)
    lhs = randn(rng, (e, m, k) if axes[0] == 0 else (m, k), BF16)
    rhs = randn(rng, (e, g, k, n) if axes[1] == 0 else (g, k, n), BF16)
    sizes = np.array([[5, 0, 6, 2], [0, 19, 0, 0], [4, 4, 4, 4]], np.int32)
    gs = jnp.asarray(sizes if axes[2] == 0 else sizes[0])
    dout = randn(rng, (e, m, n), BF16)

    def one(a, b, s, d):
        out, vjp = jax.vjp(lambda a, b: jax_tk.ragged_dot(a, b, s), a, b)
        return (out, *vjp(d))

    f = jax.vmap(one, in_axes=(*axes, 0))
    out, dl, dr = f(lhs, rhs, gs, dout)
    loops = str(jax.make_jaxpr(f)(lhs, rhs, gs, dout)).count("scan[")
    pick = lambda x, ax, i: np.asarray(x[i] if ax == 0 else x, np.float32)
    for i in range(e):
        a, b, d = pick(lhs, axes[0], i), pick(rhs, axes[1], i), np.asarray(dout[i], np.float32)
        s = sizes[i] if axes[2] == 0 else sizes[0]
        assert rel_err(out[i], numpy_ragged_dot(a, b, s)) < 1e-2
        assert rel_err(dl[i], numpy_ragged_dot(d, np.swapaxes(b, 1, 2), s), floor=1e-3) < 1e-2
        assert rel_err(dr[i], numpy_contracting(a, d, s), floor=1e-3) < 1e-2
    # (the stand-in also records the per-entry traces that custom_vmap makes for the shapes)
    folded = {(l[0], l[4]) for l in fake_kernel if l[1][0] == e * m}
    assert folded == {(0, False), (0, True), (1, False)} and loops == 0, fake_kernel
    groups = {l[3] for l in fake_kernel if l[1][0] == e * m}
    if axes[1] == 0:  # e*g groups (rows) and e*(g+1) (contracting)
        assert groups == {(e * g,), (e * (g + 1),)}
    else:  # one rhs: the entries' rows sorted by group, g groups (rows), e*(g+1) (contracting)
        assert groups == {(g,), (e * (g + 1),)}


@pytest.mark.parametrize("a_axis", [0, None])
def test_kernel_path_vmap_loops_past_max_groups(fake_kernel, monkeypatch, a_axis):
    """Where the kernel bounds the groups and the folded call would exceed it: one launch per entry."""
    monkeypatch.setattr(launch, "max_groups", lambda: 6)
    e, m, k, n, g = 3, 19, 8, 16, 4
    rng = np.random.default_rng(16)
    lhs = randn(rng, (e, m, k) if a_axis == 0 else (m, k), BF16)
    rhs, dout = randn(rng, (e, g, k, n), BF16), randn(rng, (e, m, n), BF16)
    sizes = np.array([[5, 0, 6, 2], [0, 19, 0, 0], [4, 4, 4, 4]], np.int32)

    def one(a, b, s, d):
        out, vjp = jax.vjp(lambda a, b: jax_tk.ragged_dot(a, b, s), a, b)
        return (out, *vjp(d))

    f = jax.vmap(one, in_axes=(a_axis, 0, 0, 0))
    out, dl, dr = f(lhs, rhs, jnp.asarray(sizes), dout)
    assert str(jax.make_jaxpr(f)(lhs, rhs, jnp.asarray(sizes), dout)).count("scan[") == 3
    for i in range(e):
        a = np.asarray(lhs[i] if a_axis == 0 else lhs, np.float32)
        b, d = np.asarray(rhs[i], np.float32), np.asarray(dout[i], np.float32)
        assert rel_err(out[i], numpy_ragged_dot(a, b, sizes[i])) < 1e-2
        assert rel_err(dl[i], numpy_ragged_dot(d, np.swapaxes(b, 1, 2), sizes[i]), floor=1e-3) < 1e-2
        assert rel_err(dr[i], numpy_contracting(a, d, sizes[i]), floor=1e-3) < 1e-2


def test_row_groups():
    sizes = jnp.array([[2, 0, 3], [0, 0, 0], [1, 1, 4]], jnp.int32)
    want = [[0, 0, 2, 2, 2, 3], [3, 3, 3, 3, 3, 3], [0, 1, 2, 2, 2, 2]]
    assert launch._row_groups(sizes, 6).tolist() == want


def test_kernel_path_matmul_is_one_launch(fake_kernel):
    rng = np.random.default_rng(12)
    a, b = randn(rng, (3, 5, 16), BF16), randn(rng, (3, 16, 8), BF16)
    out = jax_tk.matmul(a, b)
    assert rel_err(out, np.matmul(np.asarray(a, np.float32), np.asarray(b, np.float32))) < 1e-2
    assert fake_kernel == [(0, (15, 16), (3, 16, 8), (3,), False)]


# ----------------------------------------------------------------------------------------------
# Lowering for CUDA (no GPU needed)
# ----------------------------------------------------------------------------------------------


def _export_text(f, *args):
    disabled = [jax.export.DisabledSafetyCheck.custom_call(launch.TARGET)]
    return jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=disabled)(*args).mlir_module()


@needs_extension
@pytest.mark.skipif(launch.extension.has_cuda_kernels() and not launch.extension.has_target(launch.TARGET),
                    reason="this build has no grouped GEMM kernel: the reference is lowered")
def test_cuda_lowering_has_the_custom_call():
    m, k, n, sizes = CASES["odd"]
    k, n = 24, 16
    lhs, rhs, gs, dout = inputs(13, m, k, n, sizes, BF16)
    text = _export_text(lambda a, b, s: jax.vjp(lambda a, b: jax_tk.ragged_dot(a, b, s), a, b)[1](
        jnp.ones((m, n), BF16)), lhs, rhs, gs)
    calls = re.findall(r'custom_call @jax_tk_gemm_ragged\(.*', text)
    assert len(calls) == 2, text[-3000:]
    attrs = re.findall(r"b_transposed = (\d+) : i32.*?mode = (\d+) : i32.*?variant = (\d+) : i32", text)
    auto = str(launch.extension.contract("core")["VARIANT_AUTO"])
    assert sorted(attrs) == [("0", "1", auto), ("1", "0", auto)], attrs
    fwd = _export_text(lambda a, b, s: jax_tk.ragged_dot(a, b, s, preferred_element_type=F32), lhs, rhs, gs)
    (call,) = re.findall(r"custom_call @jax_tk_gemm_ragged\(.*", fwd)
    assert "-> tensor<37x16xf32>" in call and "tensor<5xi32>" in call, call
    # float32 inputs and k not a multiple of 8 lower to the reference (no custom call)
    assert "jax_tk_gemm_ragged" not in _export_text(jax_tk.ragged_dot, lhs.astype(F32), rhs.astype(F32), gs)
    odd_lhs, odd_rhs, _, _ = inputs(14, m, 19, n, sizes, BF16)
    assert "jax_tk_gemm_ragged" not in _export_text(jax_tk.ragged_dot, odd_lhs, odd_rhs, gs)


@needs_extension
@pytest.mark.skipif(launch.extension.has_cuda_kernels() and not launch.extension.has_target(launch.TARGET),
                    reason="this build has no grouped GEMM kernel: the reference is lowered")
@pytest.mark.parametrize("rhs_axis", [0, None])
def test_vmap_lowers_to_one_call_per_product(rhs_axis):
    """The real kernel branch under vmap (and grad): traced here with the reference running on the CPU,
    and lowered for CUDA with one custom call per product."""
    e, m, k, n, g = 3, 40, 16, 24, 4
    rng = np.random.default_rng(15)
    lhs = randn(rng, (e, m, k), BF16)
    rhs = randn(rng, (e, g, k, n) if rhs_axis == 0 else (g, k, n), BF16)
    sizes = jnp.asarray(np.array([[10, 0, 20, 5], [40, 0, 0, 0], [1, 2, 3, 4]], np.int32))
    dout = randn(rng, (e, m, n), BF16)

    def one(a, b, s, d):
        out, vjp = jax.vjp(lambda a, b: jax_tk.ragged_dot(a, b, s), a, b)
        return (out, *vjp(d))

    f = jax.vmap(one, in_axes=(0, rhs_axis, 0, 0))
    out, dl, dr = jax.jit(f)(lhs, rhs, sizes, dout)
    for i in range(e):
        b = np.asarray(rhs[i] if rhs_axis == 0 else rhs, np.float32)
        assert rel_err(out[i], numpy_ragged_dot(lhs[i], b, sizes[i])) < 1e-2
        assert rel_err(dr[i], numpy_contracting(lhs[i], dout[i], sizes[i]), floor=1e-3) < 1e-2
    text = _export_text(f, lhs, rhs, sizes, dout)
    assert text.count("custom_call @jax_tk_gemm_ragged(") == 3


def test_build_without_the_gemm_target(monkeypatch):
    """An extension built without the grouped GEMM kernel: implementation=None takes the reference (no
    custom call even when lowered for CUDA), "tk" says why."""
    monkeypatch.setattr(launch.extension, "has_cuda_kernels", lambda: True)
    monkeypatch.setattr(launch.extension, "has_target", lambda name: False)
    lhs, rhs, gs, _ = inputs(17, 12, 8, 16, [4, 4, 4], BF16)
    assert "no grouped GEMM kernel" in launch.kernel_unsupported_reason(BF16, 8, 16, 3, 12)
    with pytest.raises(ValueError, match="no grouped GEMM kernel"):
        jax_tk.ragged_dot(lhs, rhs, gs, implementation="tk")
    assert "jax_tk_gemm_ragged" not in _export_text(jax_tk.ragged_dot, lhs, rhs, gs)
    assert rel_err(jax_tk.ragged_dot(lhs, rhs, gs), numpy_ragged_dot(lhs, rhs, [4, 4, 4])) < 1e-2
