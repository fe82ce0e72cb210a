"""CPU tests of jax_tk.quantize_fp8, jax_tk.ragged_dot_fp8 and jax_tk.matmul_fp8 (the pure-JAX path):
quantization error bounds, zero and ragged edge blocks, saturation; the products against float64
numpy products of the dequantized operands; pair and array inputs; straight-through gradients;
jit/vmap; argument checks; implementation="tk"'s errors; the kernel path (the FP8 kernel replaced by a
stand-in with its contract) against the reference, values and gradients; NaN and inf in lhs's rows
past the groups, on every path."""
from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from helpers import randn

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
FP8 = jnp.float8_e4m3fn


def np_dequantize(values, scales, block):
    """float64, written independently of the library: each element times its block's scale."""
    v, s = np.asarray(values.astype(F32), np.float64), np.asarray(scales, np.float64)
    rows, cols = v.shape[-2:]
    r = np.arange(rows) // block[0]
    c = np.arange(cols) // block[1]
    return v * s[..., r[:, None], c[None, :]]


def np_ragged_dot(lhs, rhs, sizes):
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for i, s in enumerate(sizes):
        out[start:start + s] = lhs[start:start + s] @ rhs[i]
        start += s
    return out


def check_product(got, want, out_dtype):
    """float32 accumulation of exact products: float32 rounding only (then the output's rounding)."""
    got = np.asarray(got.astype(F32), np.float64)
    tol = {F32: 1e-5, BF16: 2 ** -8, F16: 2 ** -11}[out_dtype]
    scale = max(np.abs(want).max(), 1e-30)
    np.testing.assert_allclose(got, want, atol=tol * scale, rtol=tol)


# ----------------------------------------------------------------------------------------------
# quantize_fp8
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape,block", [((37, 300), (1, 128)), ((300, 257), (128, 128)), ((3, 129, 131), (128, 128)),
                                         ((5, 7), (2, 3))])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_quantize_error_bound(shape, block, dtype):
    rng = np.random.default_rng(0)
    # Magnitudes spread over many binades, so some elements fall into e4m3's subnormals.
    x = randn(rng, shape, F32) * jnp.exp2(jnp.asarray(rng.integers(-12, 4, shape), F32))
    x = x.astype(dtype)
    values, scales = jax_tk.quantize_fp8(x, block)
    assert values.dtype == FP8 and values.shape == x.shape
    *lead, rows, cols = shape
    assert scales.dtype == F32 and scales.shape == (*lead, -(-rows // block[0]), -(-cols // block[1]))
    xs = np.asarray(x.astype(F32), np.float64)
    # scale = amax(|block|) / 448, ragged edge blocks covering the remainder.
    pad = [(0, 0)] * len(lead) + [(0, scales.shape[-2] * block[0] - rows), (0, scales.shape[-1] * block[1] - cols)]
    blocks = np.pad(np.abs(xs), pad).reshape(*lead, scales.shape[-2], block[0], scales.shape[-1], block[1])
    np.testing.assert_allclose(scales, blocks.max(axis=(-3, -1)) / 448, rtol=1e-6)
    # Half a float8 step: 2^-4 relative for normals, 2^-10 * scale absolute for subnormals.
    s = np_dequantize(jnp.ones(shape, FP8), scales, block)
    err = np.abs(np_dequantize(values, scales, block) - xs)
    assert np.all(err <= np.maximum(2 ** -4 * np.abs(xs), 2 ** -10 * s) * (1 + 1e-6))
    assert np.abs(np.asarray(values.astype(F32))).max() == 448.0


def test_quantize_exact_for_representable_values():
    """Blocks of float8 values times a power of two whose largest is 448: scale is that power, and the
    round trip is exact (a wrong scale or rounding would show)."""
    rng = np.random.default_rng(1)
    v = jnp.asarray(rng.standard_normal((4, 256)) * 100, F32).astype(FP8).astype(F32)
    v = v.at[:, 0].set(448.0).at[:, 128].set(-448.0)
    powers = jnp.asarray(2.0 ** np.arange(-3, 5), F32).reshape(4, 2)  # (exact; exp2 on a GPU need not be)
    x = v * jnp.repeat(powers, 128, axis=1)
    values, scales = jax_tk.quantize_fp8(x, (1, 128))
    np.testing.assert_array_equal(scales, powers)
    np.testing.assert_array_equal(values.astype(F32), v)
    np.testing.assert_array_equal(jax_tk.gemm.fp8.dequantize(values, scales, (1, 128)), x)


def test_quantize_zero_blocks():
    x = jnp.zeros((3, 300), F32).at[1, 200].set(5.0)
    values, scales = jax_tk.quantize_fp8(x, (1, 128))
    np.testing.assert_array_equal(scales, np.float32([[1, 1, 1], [1, np.float32(5) / np.float32(448), 1], [1, 1, 1]]))
    deq = jax_tk.gemm.fp8.dequantize(values, scales, (1, 128))
    assert not np.any(np.isnan(deq))
    np.testing.assert_allclose(deq, x, rtol=1e-6, atol=0)


def test_quantize_ragged_edge_blocks():
    """A last block holding one column has its own scale (not the previous block's, not padded)."""
    x = jnp.ones((2, 129), F32).at[:, 128].set(jnp.asarray([3.0, -1e-3]))
    values, scales = jax_tk.quantize_fp8(x, (1, 128))
    np.testing.assert_allclose(scales, [[1 / 448, 3 / 448], [1 / 448, 1e-3 / 448]], rtol=1e-7)
    np.testing.assert_array_equal(values[:, 128].astype(F32), [448.0, -448.0])
    values, scales = jax_tk.quantize_fp8(jnp.arange(1.0, 131.0 * 3 + 1).reshape(131, 3), (128, 128))
    np.testing.assert_allclose(scales, [[384 / 448], [393 / 448]], rtol=1e-7)


def test_quantize_saturates():
    """Huge and tiny values in one block: the largest maps to +-448, nothing to inf or NaN."""
    x = jnp.asarray([[3e38, -3e38, 1e-30, 1.0, 0.0]], F32)
    values, scales = jax_tk.quantize_fp8(x, (1, 128))
    v = np.asarray(values.astype(F32))
    assert np.all(np.isfinite(v)) and np.isfinite(scales).all()
    np.testing.assert_array_equal(v, [[448.0, -448.0, 0.0, 0.0, 0.0]])
    # Every block's largest element becomes exactly +-448 (no overflow past e4m3's range).
    x = randn(np.random.default_rng(2), (64, 256), F32) * 1e4
    v = np.abs(np.asarray(jax_tk.quantize_fp8(x, (1, 128))[0].astype(F32)))
    np.testing.assert_array_equal(v.reshape(64, 2, 128).max(axis=-1), 448.0)


@pytest.mark.parametrize("bad", [(128,), (0, 128), (1, -1), (1.0, 128), "128", None, (1, 128, 1)])
def test_quantize_bad_block_shape(bad):
    with pytest.raises(ValueError, match="block_shape"):
        jax_tk.quantize_fp8(jnp.ones((4, 4)), bad)


def test_quantize_bad_input():
    with pytest.raises(ValueError, match="x must have rank 2"):
        jax_tk.quantize_fp8(jnp.ones((4,)), (1, 128))
    with pytest.raises(TypeError, match="x must be bfloat16"):
        jax_tk.quantize_fp8(jnp.ones((4, 4), jnp.int32), (1, 128))
    with pytest.raises(TypeError, match="x must be an array"):
        jax_tk.quantize_fp8([[1.0]], (1, 128))


# ----------------------------------------------------------------------------------------------
# ragged_dot_fp8 and matmul_fp8
# ----------------------------------------------------------------------------------------------

# Odd m/k/n (k not a multiple of 128), empty groups (first, middle, last), sizes summing to less than m.
CASES = {
    "odd": (37, 300, 150, [5, 0, 11, 9, 12]),
    "empty_ends": (40, 129, 24, [0, 13, 0, 27, 0]),
    "short_sum": (50, 64, 257, [7, 3, 0, 12]),  # rows 22..49 give 0
}


def fp8_inputs(seed, m, k, n, g, dtype=F32):
    rng = np.random.default_rng(seed)
    return randn(rng, (m, k), dtype), randn(rng, (g, k, n), dtype) * 0.1


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("out", [None, F32, F16])
def test_ragged_dot_fp8_against_numpy(case, out):
    m, k, n, sizes = CASES[case]
    x, w = fp8_inputs(0, m, k, n, len(sizes))
    lq, rq = jax_tk.quantize_fp8(x, (1, 128)), jax_tk.quantize_fp8(w, (128, 128))
    want = np_ragged_dot(np_dequantize(*lq, (1, 128)), np_dequantize(*rq, (128, 128)), sizes)
    gs = jnp.asarray(sizes, jnp.int32)
    got = jax_tk.ragged_dot_fp8(x, w, gs, preferred_element_type=out)
    assert got.dtype == (out or BF16) and got.shape == (m, n)
    check_product(got, want, out or BF16)
    assert np.all(np.asarray(got.astype(F32))[sum(sizes):] == 0)
    # Pair and array inputs (and a mix) give the same result; "xla" is the same path.
    for lhs, rhs in ((lq, rq), (x, rq), (lq, w)):
        np.testing.assert_array_equal(jax_tk.ragged_dot_fp8(lhs, rhs, gs, preferred_element_type=out,
                                                            implementation="xla"), got)
    # The quantization is not a no-op: the float32 product differs.
    exact = np_ragged_dot(np.asarray(x, np.float64), np.asarray(w, np.float64), sizes)
    assert np.abs(exact - want).max() > 1e-3 * np.abs(want).max()


@pytest.mark.parametrize("m,k,n", [(37, 300, 150), (1, 1, 1), (200, 128, 129)])
def test_matmul_fp8_against_numpy(m, k, n):
    a, b = fp8_inputs(1, m, k, n, 1, BF16)
    b = b[0]
    aq, bq = jax_tk.quantize_fp8(a, (1, 128)), jax_tk.quantize_fp8(b, (128, 128))
    assert bq[1].shape == (-(-k // 128), -(-n // 128))
    want = np_dequantize(*aq, (1, 128)) @ np_dequantize(*bq, (128, 128))
    got = jax_tk.matmul_fp8(a, b, preferred_element_type=F32)
    check_product(got, want, F32)
    np.testing.assert_array_equal(jax_tk.matmul_fp8(aq, bq, preferred_element_type=F32), got)
    assert jax_tk.matmul_fp8(aq, b).dtype == BF16


def test_empty_dimensions():
    x, w = fp8_inputs(2, 0, 130, 7, 2)
    assert jax_tk.ragged_dot_fp8(x, w, jnp.zeros(2, jnp.int32)).shape == (0, 7)
    out = jax_tk.matmul_fp8(jnp.ones((3, 0)), jnp.ones((0, 5)), preferred_element_type=F32)
    np.testing.assert_array_equal(out, np.zeros((3, 5)))


def dequantized_product(op, sizes=None):
    """The function the straight-through gradient must match: the product of the dequantized
    operands, differentiated with respect to those (the quantized values held fixed)."""
    def f(da, db):
        if sizes is None:
            return jnp.dot(da, db, precision="highest").astype(F32)
        return jax_tk.gemm.reference.ragged_dot(da, db, sizes, out_dtype=F32)
    return f


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_straight_through_gradients(dtype):
    m, k, n, sizes = CASES["odd"]
    x, w = fp8_inputs(3, m, k, n, len(sizes), dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    dout = randn(np.random.default_rng(4), (m, n), F32)
    loss = lambda a, b: jnp.sum(jax_tk.ragged_dot_fp8(a, b, gs, preferred_element_type=F32) * dout)
    dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
    assert dx.dtype == dtype and dw.dtype == dtype
    da = jax_tk.gemm.fp8.dequantize(*jax_tk.quantize_fp8(x, (1, 128)), (1, 128))
    db = jax_tk.gemm.fp8.dequantize(*jax_tk.quantize_fp8(w, (128, 128)), (128, 128))
    f = dequantized_product("ragged", gs)
    wx, ww = jax.grad(lambda a, b: jnp.sum(f(a, b) * dout), argnums=(0, 1))(da, db)
    np.testing.assert_allclose(dx.astype(F32), wx.astype(dtype).astype(F32), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw.astype(F32), ww.astype(dtype).astype(F32), rtol=1e-5, atol=1e-5)
    # Straight-through, not the gradient at the unquantized operands (which differs).
    ex = jax.grad(lambda a: jnp.sum(jax_tk.gemm.reference.ragged_dot(a, w.astype(F32), gs) * dout))(x.astype(F32))
    assert np.abs(np.asarray(ex) - np.asarray(dx.astype(F32))).max() > 1e-3 * np.abs(np.asarray(ex)).max()

    # matmul_fp8; a pair operand is a constant (zero gradients), the array one still straight-through.
    a, b = x, w[0]
    bq = jax_tk.quantize_fp8(b, (128, 128))
    mloss = lambda a, b: jnp.sum(jax_tk.matmul_fp8(a, b, preferred_element_type=F32) * dout)
    ga, gbq = jax.grad(mloss, argnums=(0, 1))(a, bq)
    want = jax.grad(lambda d: jnp.sum(dequantized_product("dense")(d, db[0]) * dout))(da)
    np.testing.assert_allclose(ga.astype(F32), want.astype(dtype).astype(F32), rtol=1e-5, atol=1e-5)
    assert gbq[0].dtype == FP8 and not np.any(np.asarray(gbq[0].astype(F32)))
    assert not np.any(np.asarray(gbq[1]))


def test_jit_and_vmap():
    m, k, n, sizes = CASES["odd"]
    x, w = fp8_inputs(5, m, k, n, len(sizes))
    gs = jnp.asarray(sizes, jnp.int32)
    op = lambda a, b: jax_tk.ragged_dot_fp8(a, b, gs, preferred_element_type=F32)
    close = lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    eager = op(x, w)
    close(jax.jit(op)(x, w), eager)
    xs = jnp.stack([x, 2 * x])
    got = jax.vmap(op, in_axes=(0, None))(xs, w)
    close(got[0], eager)
    close(got[1], op(2 * x, w))
    # vmap over pairs (quantized per entry) and over matmul_fp8's b.
    qs = jax.vmap(lambda t: jax_tk.quantize_fp8(t, (1, 128)))(xs)
    close(jax.vmap(lambda q: op(q, w))(qs), got)
    bs = jnp.stack([w[0], w[1]])
    mm = lambda a, b: jax_tk.matmul_fp8(a, b, preferred_element_type=F32)
    got = jax.jit(jax.vmap(lambda b: mm(x, b)))(bs)
    close(got[1], mm(x, w[1]))
    # and the gradient under jit
    dx = jax.jit(jax.grad(lambda a: jnp.sum(op(a, w))))(x)
    close(dx, jax.grad(lambda a: jnp.sum(op(a, w)))(x))


def test_argument_errors():
    x, w = fp8_inputs(6, 8, 130, 5, 2)
    gs = jnp.asarray([3, 5], jnp.int32)
    xq, wq = jax_tk.quantize_fp8(x, (1, 128)), jax_tk.quantize_fp8(w, (128, 128))
    f = jax_tk.ragged_dot_fp8
    with pytest.raises(ValueError, match=r"lhs must have rank 2"):
        f(x[0], w, gs)
    with pytest.raises(ValueError, match=r"contracting dimension k"):
        f(x[:, :129], w, gs)
    with pytest.raises(TypeError, match=r"rhs must be bfloat16"):
        f(x, w.astype(jnp.int32), gs)
    with pytest.raises(TypeError, match=r"lhs's values must be float8_e4m3fn"):
        f((x, xq[1]), w, gs)
    with pytest.raises(ValueError, match=r"lhs's scales must have shape \(8, 2\)"):
        f((xq[0], xq[1][:, :1]), w, gs)
    with pytest.raises(ValueError, match=r"rhs's scales must have shape \(2, 2, 1\)"):
        f(xq, (wq[0], jnp.ones((2, 3, 1), F32)), gs)
    with pytest.raises(TypeError, match=r"rhs's scales must be float32"):
        f(xq, (wq[0], wq[1].astype(BF16)), gs)
    with pytest.raises(TypeError, match=r"lhs must be an array or a \(values, scales\) pair"):
        f((xq[0],), w, gs)
    with pytest.raises(ValueError, match=r"group_sizes to have shape \(2,\)"):
        f(x, w, gs[:1])
    with pytest.raises(ValueError, match=r"group_offset must be an integer array of shape \(1,\)"):
        f(x, w, gs, group_offset=jnp.asarray([0, 1]))
    with pytest.raises(TypeError, match="preferred_element_type"):
        f(x, w, gs, preferred_element_type=jnp.int32)
    with pytest.raises(ValueError, match="implementation must be one of"):
        f(x, w, gs, implementation="cuda")
    with pytest.raises(ValueError, match=r"b's scales must have shape \(2, 1\)"):
        jax_tk.matmul_fp8(x, (wq[0][0], wq[1][0, :1]))
    with pytest.raises(ValueError, match="must have the same k"):
        jax_tk.matmul_fp8(x, w[0, :129])


def test_implementation_tk_raises():
    x, w = fp8_inputs(7, 4, 128, 128, 1, BF16)
    gs = jnp.asarray([4], jnp.int32)
    with pytest.raises(ValueError, match=r"ragged_dot_fp8\(implementation='tk'\): unsupported sizes k=120"):
        jax_tk.ragged_dot_fp8(x[:, :120], w[:, :120], gs, implementation="tk")
    with pytest.raises(ValueError, match=r"matmul_fp8\(implementation='tk'\): unsupported sizes k=128, n=60"):
        jax_tk.matmul_fp8(x, w[0, :, :60], implementation="tk")
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match=r"ragged_dot_fp8\(implementation='tk'\): unsupported this GPU"):
            jax_tk.ragged_dot_fp8(x, w, gs, implementation="tk")
        with pytest.raises(ValueError, match=r"matmul_fp8\(implementation='tk'\): unsupported this GPU"):
            jax_tk.matmul_fp8(x, w[0], implementation="tk")


def no_derivative(f, *args):
    """f(*args), which, like an FFI call, cannot be differentiated: a JVP of it raises."""
    @jax.custom_jvp
    def call(*args):
        return f(*args)

    def jvp(primals, tangents):
        raise AssertionError("the stand-in of a kernel call was differentiated")

    call.defjvp(jvp)
    return call(*args)


def same_types_dispatch(use, kernel, ref, *args):
    """The kernel's branch, after checking that the reference's has the same output types (as
    lax.platform_dependent requires on CUDA)."""
    got = kernel(*args)
    if use:
        want = jax.eval_shape(ref, *args)
        types = lambda t: [(x.shape, jnp.dtype(x.dtype)) for x in jax.tree.leaves(t)]
        assert types(got) == types(want), (types(got), types(want))
    return got


@pytest.fixture
def fake_fp8_kernel(monkeypatch):
    """The kernel path on the CPU: use_kernel says yes, and the FFI call is replaced by the reference
    on the dequantized (values, scales) it is handed (the kernel's contract); records the calls."""
    if jax.default_backend() != "cpu":
        pytest.skip("the stand-in replaces the kernel on CPU runs")
    from jax_tk.gemm import fp8, launch, reference
    calls = []

    def fp8_call(a, sa, b, sb, sizes, out_dtype, out_init=None):
        assert a.dtype == b.dtype == FP8 and sa.dtype == sb.dtype == F32 and sizes.dtype == jnp.int32
        assert jnp.dtype(out_dtype) in (jnp.dtype(BF16), jnp.dtype(F32))
        calls.append((a.shape, b.shape))
        # (b as the kernel reads it, [g, n, k], its scales those of b [g, k, n])
        deq_a, deq_b = fp8.dequantize(a, sa, fp8.LHS_BLOCK), fp8.dequantize(jnp.swapaxes(b, 1, 2), sb, fp8.RHS_BLOCK)
        return reference.ragged_dot(deq_a, deq_b, sizes, out_dtype=out_dtype)

    def fp8_contract_call(at, sat, bt, sbt, sizes, out_dtype=F32, out_init=None):
        assert at.dtype == bt.dtype == FP8 and sat.dtype == sbt.dtype == F32 and sizes.dtype == jnp.int32
        assert jnp.dtype(out_dtype) in (jnp.dtype(BF16), jnp.dtype(F32))
        assert at.shape[1] == bt.shape[1] and at.shape[1] % 16 == 0
        calls.append((at.shape, bt.shape))
        deq_a, deq_b = fp8.dequantize(at, sat, fp8.LHS_BLOCK), fp8.dequantize(bt, sbt, fp8.RHS_BLOCK)
        ends = jnp.cumsum(sizes)
        rows = jnp.arange(at.shape[1])
        member = (rows >= (ends - sizes)[:, None]) & (rows < ends[:, None])  # [g, m]
        return jnp.einsum("km,gm,nm->gkn", deq_a, member.astype(F32), deq_b, precision="highest").astype(out_dtype)

    def quantize_call(x, block_rows, *, x_scales=None, transposed=False, row_limit=None, out_shape=None):
        assert block_rows in (1, 128) and (x_scales is None) == (x.dtype != FP8)
        assert row_limit is None or (row_limit.shape == (1,) and row_limit.dtype == jnp.int32)
        return no_derivative(lambda x, xs, lim: fp8._requantize_xla(x, xs, lim, block_rows, transposed, out_shape),
                             x, x_scales, row_limit)

    monkeypatch.setattr(launch, "fp8_call", fp8_call)
    monkeypatch.setattr(launch, "fp8_contract_call", fp8_contract_call)
    monkeypatch.setattr(launch, "quantize_call", quantize_call)
    monkeypatch.setattr(launch, "quantize_unsupported_reason", lambda: None)
    # (fp8's own view of dispatch only: the backward's ragged_dot keeps the real one, its CPU reference)
    shim = types.SimpleNamespace(**vars(fp8.dispatch))
    shim.use_kernel = lambda op, implementation, reason: implementation != "xla"
    shim.platform_dispatch = same_types_dispatch
    monkeypatch.setattr(fp8, "dispatch", shim)
    return calls


@pytest.mark.parametrize("pairs", [False, True], ids=["arrays", "pairs"])
@pytest.mark.parametrize("offset", [None, 1])
def test_kernel_path_against_the_reference(fake_fp8_kernel, pairs, offset):
    """ragged_dot_fp8 on the kernel path (its stand-in) against implementation='xla': values, and the
    straight-through gradients of array operands (lhs's on the FP8 kernel from the re-quantized
    cotangent, rhs's on the bfloat16 ragged_dot)."""
    x, w = fp8_inputs(8, 40, 256, 64, 3, F32)
    gs = jnp.asarray([10, 0, 25, 5] if offset is not None else [10, 25, 5], jnp.int32)
    go = None if offset is None else jnp.asarray([offset], jnp.int32)
    if offset is None:
        w = w[:3]
    lhs = jax_tk.quantize_fp8(x, (1, 128)) if pairs else x
    rhs = jax_tk.quantize_fp8(w, (128, 128)) if pairs else w
    f = lambda impl: lambda a, b: jax_tk.ragged_dot_fp8(a, b, gs, group_offset=go, preferred_element_type=F32,
                                                        implementation=impl)
    got, got_vjp = jax.vjp(f(None), lhs, rhs)
    want, want_vjp = jax.vjp(f("xla"), lhs, rhs)
    groups, k, n = rhs_shape(rhs)
    assert fake_fp8_kernel and fake_fp8_kernel[0][1] == (groups, n, k)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    if not pairs:
        dout = jnp.asarray(np.random.default_rng(9).standard_normal(got.shape), F32)
        (dx, dw), (wx, ww) = got_vjp(dout), want_vjp(dout)
        # dx on the FP8 kernel (its second call): the straight-through gradient of the re-quantized
        # cotangent (linear in it), up to float32 sums ...
        m = got.shape[0]
        assert fake_fp8_kernel[1:] == [((m, n), (groups, k, n)), ((k, m + (-m) % 16), (n, m + (-m) % 16))]
        (qx, _) = want_vjp(jax_tk.gemm.fp8.dequantize(*jax_tk.quantize_fp8(dout, (1, 128)), (1, 128)))
        np.testing.assert_allclose(np.asarray(dx), np.asarray(qx), rtol=1e-5, atol=1e-5 * np.abs(np.asarray(qx)).max())
        # dw on it too (the third call): lhs's rows and the cotangent re-quantized along the rows.
        np.testing.assert_allclose(np.asarray(dw), wgrad_of_requantized(x, dout, gs, go, w.shape[0]), rtol=1e-4,
                                   atol=1e-5 * np.abs(np.asarray(dw)).max())
        # Both within that quantization of the exact straight-through gradients.
        for g, wg, tol in ((dx, wx, 4e-2), (dw, ww, 6e-2)):
            err = np.linalg.norm(np.asarray(g) - np.asarray(wg)) / np.linalg.norm(np.asarray(wg))
            assert 0 < err < tol, err


@pytest.mark.parametrize("transposed", [False, True], ids=["kn", "nk"])
def test_kernel_path_gradients_in_the_inputs_dtype(fake_fp8_kernel, transposed):
    """bf16 arrays on the kernel path: the gradients come in bf16 and in the weights' layout (the
    kernels write them so), near the reference path's."""
    x, w = fp8_inputs(14, 40, 256, 64, 3, BF16)
    w = jnp.swapaxes(w, 1, 2) if transposed else w
    gs = jnp.asarray([10, 0, 25], jnp.int32)
    dout = randn(np.random.default_rng(15), (40, 64), F32)
    loss = lambda impl: lambda a, b: jnp.sum(jax_tk.ragged_dot_fp8(a, b, gs, rhs_transposed=transposed,
                                                                   implementation=impl).astype(F32) * dout)
    got = jax.grad(loss(None), argnums=(0, 1))(x, w)
    want = jax.grad(loss("xla"), argnums=(0, 1))(x, w)
    for g, wg in zip(got, want):
        assert g.dtype == BF16 and g.shape == wg.shape
        g, wg = np.asarray(g, np.float32), np.asarray(wg, np.float32)
        assert np.linalg.norm(g - wg) / np.linalg.norm(wg) < 6e-2


def test_matmul_fp8_kernel_path(fake_fp8_kernel):
    """matmul_fp8 on the kernel path: one group of every row, b as a stack of one."""
    x, w = fp8_inputs(10, 33, 256, 64, 1, F32)
    got = jax_tk.matmul_fp8(x, w[0], preferred_element_type=F32)
    want = jax_tk.matmul_fp8(x, w[0], preferred_element_type=F32, implementation="xla")
    assert fake_fp8_kernel == [((33, 256), (1, 64, 256))]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def rhs_shape(rhs):
    return tuple((rhs[0] if isinstance(rhs, tuple) else rhs).shape)


@pytest.mark.parametrize("path", ["reference", "kernel"])
def test_transposed_weights(request, path):
    """rhs_transposed / b_transposed: the weights given as [g, n, k] (arrays, and pairs quantized in that
    layout) give what [g, k, n] gives, values and gradients (the gradient in the given layout); a
    pair's scales are checked against that layout."""
    calls = request.getfixturevalue("fake_fp8_kernel") if path == "kernel" else None
    x, w = fp8_inputs(12, 40, 272, 136, 3, F32)
    gs = jnp.asarray([10, 0, 25], jnp.int32)
    wt = jnp.swapaxes(w, 1, 2)
    dout = randn(np.random.default_rng(13), (40, 136), F32)
    impl = "xla" if calls is None else None  # (on an H100, None is the kernel: its own test covers it)
    op = lambda a, b, t: jax_tk.ragged_dot_fp8(a, b, gs, preferred_element_type=F32, rhs_transposed=t,
                                               implementation=impl)
    close = lambda got, want: np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    close(op(x, wt, True), op(x, w, False))
    close(op(x, jax_tk.quantize_fp8(wt, (128, 128)), True), op(x, jax_tk.quantize_fp8(w, (128, 128)), False))
    grad = lambda b, t: jax.grad(lambda a, b: jnp.sum(op(a, b, t) * dout), argnums=(0, 1))(x, b)
    (gx_t, gw_t), (gx, gw) = grad(wt, True), grad(w, False)
    close(gx_t, gx)
    if calls is None:
        close(gw_t, jnp.swapaxes(gw, 1, 2))
    else:  # (formed as [g, n, k] on the kernel: dout^T in 1x128 blocks, x^T in 128x128 ones)
        want = wgrad_of_requantized(x, dout, gs, None, 3, transposed=True)
        np.testing.assert_allclose(np.asarray(gw_t), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
        assert ((136, 48), (272, 48)) in calls  # (the cotangent^T [n, m] first)
    mm = lambda b, t: jax_tk.matmul_fp8(x, b, preferred_element_type=F32, b_transposed=t, implementation=impl)
    close(mm(wt[0], True), mm(w[0], False))
    if calls is not None:  # (the kernel reads [g, n, k]: the call gets the given values as they are)
        assert calls[0][1] == (3, 136, 272)
    values, scales = jax_tk.quantize_fp8(w, (128, 128))
    with pytest.raises(ValueError, match=r"rhs's scales must have shape \(3, 2, 3\)"):
        jax_tk.ragged_dot_fp8(x, (jnp.swapaxes(values, 1, 2), scales), gs, rhs_transposed=True)
    with pytest.raises(ValueError, match=r"contracting dimension k"):
        jax_tk.ragged_dot_fp8(x, w, gs, rhs_transposed=True)


def wgrad_of_requantized(x, dout, sizes, group_offset, local, transposed=False):
    """float64: per local group, (x quantized in 1x128 blocks along k, dequantized; then transposed
    and quantized in 1x128 blocks along the rows) times (dout transposed, quantized in 128x128
    blocks), the blocks over all m rows from row 0, as the kernel path's wgrad forms them; rows
    rolled so that the local groups come first (group_offset), rows past them zeroed. ``transposed``
    (weights given as [g, n, k]): the result [g, n, k], dout^T in 1x128 blocks and x^T in 128x128."""
    sizes = np.asarray(sizes)
    first = 0 if group_offset is None else int(np.asarray(group_offset)[0])
    start = int(sizes[:first].sum())
    local_sizes = sizes[first:first + local]
    m = x.shape[0]
    rows = lambda t: np.roll(np.asarray(t, np.float64), -start, axis=0)
    deq_x = rows(np_dequantize(*jax_tk.quantize_fp8(x, (1, 128)), (1, 128)))
    d = rows(dout)
    keep = (np.arange(m) < local_sizes.sum())[:, None]
    pad = ((0, 0), (0, -m % 16))
    at = np.pad(np.where(keep, deq_x, 0).T, pad)
    gt = np.pad(np.where(keep, d, 0).T, pad)
    if transposed:
        at, gt = gt, at
    qa = np_dequantize(*jax_tk.quantize_fp8(jnp.asarray(at, F32), (1, 128)), (1, 128))
    qg = np_dequantize(*jax_tk.quantize_fp8(jnp.asarray(gt, F32), (128, 128)), (128, 128))
    ends = np.cumsum(local_sizes)
    return np.stack([qa[:, e - s:e] @ qg[:, e - s:e].T for s, e in zip(local_sizes, ends)])


# ----------------------------------------------------------------------------------------------
# Rows past the groups holding NaN or inf (a padded buffer)
# ----------------------------------------------------------------------------------------------


def pad_rows(x, start, pad):
    """``x`` with its rows from ``start`` on set to non-finite values (made on the host): all NaN,
    all inf, or ("mixed") NaN, +inf and -inf rows and rows with one inf among finite values."""
    y = np.array(x.astype(F32))
    if pad == "mixed":
        y[start::4], y[start + 1::4], y[start + 2::4] = np.nan, np.inf, -np.inf
        y[start + 3::4, 1] = np.inf
    else:
        y[start:] = np.nan if pad == "nan" else np.inf
    return jnp.asarray(y).astype(x.dtype)


@pytest.mark.parametrize("pad,offset", [("nan", None), ("mixed", None), ("inf", 2)])
@pytest.mark.parametrize("lhs_kind", ["f32", "bf16", "pair"])
@pytest.mark.parametrize("path", ["default", "xla", "kernel"])
def test_nonfinite_rows_past_the_groups(request, path, lhs_kind, pad, offset):
    """Rows of lhs past sum(group_sizes) may hold anything (a padded buffer), NaN and inf included,
    given as an array or quantized into a pair: they give exact zeros, and the other rows and both
    gradients are exactly those of the same lhs with those rows zeroed (lhs's rows past: 0). A NaN
    could leak through a block scale (the kernel path's rhs gradient re-quantizes lhs^T in blocks of
    128 rows, here mixing rows inside and past the groups) or through a product with a 0/1 mask.
    "default" (implementation=None) is the FP8 kernels on an H100/H200 and the reference ("xla")
    elsewhere; "kernel" is the kernel path with the FP8 kernels replaced by their stand-in (its
    Python side: the custom_vjp, the re-quantizations, the row limit of rhs's gradient)."""
    if path == "kernel":
        request.getfixturevalue("fake_fp8_kernel")
    m, k, n, sizes = 40, 144, 24, [0, 9, 0, 14, 0]  # empty groups first, between and last; rows 23.. in none
    end = sum(sizes)
    dtype = BF16 if lhs_kind == "bf16" else F32
    x, w = fp8_inputs(16, m, k, n, len(sizes), dtype)  # (with offset 2: rhs's last 2 groups past the 5)
    gs = jnp.asarray(sizes, jnp.int32)
    go = None if offset is None else jnp.asarray([offset], jnp.int32)
    out_dtype = BF16 if lhs_kind == "bf16" else F32
    dout = randn(np.random.default_rng(17), (m, n), out_dtype)
    padded, clean = pad_rows(x, end, pad), x.at[end:].set(0)
    if lhs_kind == "pair":
        padded, clean = jax_tk.quantize_fp8(padded, (1, 128)), jax_tk.quantize_fp8(clean, (1, 128))
        assert not np.isfinite(np.asarray(padded[0][end:].astype(F32))).all(axis=1).any()
        if pad == "nan":  # (quantizing gives NaN rows scale 1: a pair from elsewhere may have NaN scales too)
            padded = (padded[0], padded[1].at[end:].set(jnp.nan))

    def f(a, b):
        return jax_tk.ragged_dot_fp8(a, b, gs, group_offset=go, preferred_element_type=out_dtype,
                                     implementation="xla" if path == "xla" else None)

    out, vjp = jax.vjp(f, padded, w)
    want, want_vjp = jax.vjp(f, clean, w)
    assert out.dtype == out_dtype
    got32 = np.asarray(out.astype(F32))
    assert np.all(got32[end:] == 0) and np.all(np.isfinite(got32))
    assert np.abs(got32[:end]).max() > 0  # (not vacuous: the groups' rows have values)
    np.testing.assert_array_equal(got32, np.asarray(want.astype(F32)))
    (dl, dw), (want_dl, want_dw) = vjp(dout), want_vjp(dout)
    as32 = lambda t: np.asarray(t.astype(F32))
    if lhs_kind == "pair":  # a constant: zero gradients, for its values and its scales
        assert not np.any(as32(dl[0])) and not np.any(as32(dl[1]))
    else:
        assert dl.dtype == dtype and np.all(np.isfinite(as32(dl))) and np.all(as32(dl)[end:] == 0)
        assert np.abs(as32(dl)[:end]).max() > 0
        np.testing.assert_array_equal(as32(dl), as32(want_dl))
    assert dw.dtype == dtype and np.all(np.isfinite(as32(dw))) and np.abs(as32(dw)).max() > 0
    np.testing.assert_array_equal(as32(dw), as32(want_dw))
