"""CPU tests of ``group_offset`` (expert parallelism) in jax_tk.ragged_dot and jax_tk.ragged_dot_fp8:
rhs holds g of the G groups, from group_offset[0] on. The oracle: the same call without an offset on
a G-group rhs that holds the local experts in their places and zeros elsewhere (forward and both
gradients; the local part of that rhs's gradient is the local rhs's)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from jax_tk._core import extension
from helpers import randn
from test_ragged_dot import fake_kernel, numpy_ragged_dot  # noqa: F401 (a fixture)

BF16, F32 = jnp.bfloat16, jnp.float32
SIZES = [5, 0, 11, 9, 3, 7]  # G = 6 groups over 40 of 44 rows (the last 4 rows in none)
M, K, N, G_LOCAL = 44, 16, 24, 3


def inputs(seed, dtype):
    rng = np.random.default_rng(seed)
    return (randn(rng, (M, K), dtype), randn(rng, (G_LOCAL, K, N), dtype), jnp.asarray(SIZES, jnp.int32),
            randn(rng, (M, N), dtype))


def full_rhs(rhs, offset):
    """[G, K, N]: the local experts at groups offset .. offset + g - 1 (those below G), zeros elsewhere."""
    full = jnp.zeros((len(SIZES), K, N), rhs.dtype)
    for i in range(G_LOCAL):
        if 0 <= offset + i < len(SIZES):
            full = full.at[offset + i].set(rhs[i])
    return full


def check_against_full(f, offset, dtype, rhs_grad_err=None):
    """f(lhs, rhs, sizes, group_offset) against f on full_rhs without an offset: the output, d lhs,
    and d rhs against the local slice of the full rhs's gradient (elementwise, or within relative
    error ``rhs_grad_err`` where the two calls round it differently)."""
    lhs, rhs, gs, dout = inputs(offset + 3, dtype)
    go = jnp.asarray([offset], jnp.int32)
    out, vjp = jax.vjp(lambda a, b: f(a, b, gs, go), lhs, rhs)
    want, want_vjp = jax.vjp(lambda a, b: f(a, b, gs, None), lhs, full_rhs(rhs, offset))
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == F32 else dict(atol=5e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), **tol)
    (dl, dr), (wdl, wdr) = vjp(dout.astype(out.dtype)), want_vjp(dout.astype(want.dtype))
    np.testing.assert_allclose(np.asarray(dl, np.float32), np.asarray(wdl, np.float32), **tol)
    dr, wdr = np.asarray(dr, np.float64), np.asarray(full_rhs_grad(wdr, offset), np.float64)
    if rhs_grad_err is None:
        np.testing.assert_allclose(dr, wdr, **tol)
    else:
        assert np.linalg.norm(dr - wdr) / np.linalg.norm(wdr) < rhs_grad_err
    return lhs, rhs, out


def full_rhs_grad(d_full, offset):
    """The local experts' part of a G-group gradient (zeros for those past G)."""
    return jnp.stack([d_full[offset + i] if offset + i < len(SIZES) else jnp.zeros_like(d_full[0])
                      for i in range(G_LOCAL)])


@pytest.mark.parametrize("implementation,dtype,offset", [
    (None, F32, 0), (None, BF16, 2), (None, F32, 3), ("xla", F32, 5), (None, BF16, 6)])  # 5, 6: experts past G
def test_ragged_dot_offset(implementation, dtype, offset):
    f = lambda a, b, s, o: jax_tk.ragged_dot(a, b, s, group_offset=o, implementation=implementation)
    lhs, rhs, out = check_against_full(f, offset, dtype)
    # independently: the local groups' rows, and zeros everywhere else
    starts = np.concatenate([[0], np.cumsum(SIZES)])
    want = np.zeros((M, N))
    for i in range(G_LOCAL):
        if offset + i < len(SIZES):
            lo, hi = starts[offset + i], starts[offset + i + 1]
            want[lo:hi] = numpy_ragged_dot(lhs[lo:hi], rhs[i:i + 1], [hi - lo])
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == F32 else dict(atol=5e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(out, np.float32), want, **tol)


def test_offset_traced_under_jit():
    """One compilation for every offset: the offset is a traced array."""
    lhs, rhs, gs, _ = inputs(1, F32)
    f = jax.jit(lambda o: jax_tk.ragged_dot(lhs, rhs, gs, group_offset=o))
    for offset in (0, 1, 4):
        want = jax_tk.ragged_dot(lhs, full_rhs(rhs, offset), gs)
        np.testing.assert_allclose(f(jnp.asarray([offset], jnp.int32)), want, atol=1e-4, rtol=1e-5)
    assert f._cache_size() == 1


def test_other_groups_rows_may_hold_nan():
    """Rows of other groups (and past every group) give 0 and no NaN in either gradient."""
    lhs, rhs, gs, dout = inputs(2, F32)
    starts = np.cumsum([0] + SIZES)
    local = np.zeros(M, bool)
    local[starts[2]:starts[5]] = True  # groups 2, 3, 4
    poisoned = jnp.where(jnp.asarray(local)[:, None], lhs, jnp.nan)
    f = lambda a, b: jax_tk.ragged_dot(a, b, gs, group_offset=jnp.asarray([2], jnp.int32))
    out, vjp = jax.vjp(f, poisoned, rhs)
    assert np.all(np.asarray(out)[~local] == 0) and np.all(np.isfinite(np.asarray(out)))
    dl, dr = vjp(dout)
    assert np.all(np.asarray(dl)[~local] == 0) and np.all(np.isfinite(np.asarray(dr)))


def test_kernel_path_with_offset(fake_kernel):  # noqa: F811 (the fixture)
    """The kernel path (the kernel replaced by its stand-in): the local groups' call (its forward the
    first launch), and the full rhs's."""
    f = lambda a, b, s, o: jax_tk.ragged_dot(a, b, s, group_offset=o)
    check_against_full(f, 2, BF16)
    assert len(fake_kernel) == 6 and fake_kernel[0][2:4] == ((G_LOCAL, K, N), (G_LOCAL,))


@pytest.mark.parametrize("offset", [1, 5])
def test_ragged_dot_fp8_offset(offset):
    """On the FP8 kernel (H100/H200) the rhs's gradient re-quantizes the rows in 128-row blocks from
    the first local row, the full call's from row 0: the two differ by FP8 rounding there."""
    f = lambda a, b, s, o: jax_tk.ragged_dot_fp8(a, b, s, group_offset=o, preferred_element_type=F32)
    check_against_full(f, offset, F32, rhs_grad_err=6e-2 if extension.cuda_device_capability() == (9, 0) else None)
