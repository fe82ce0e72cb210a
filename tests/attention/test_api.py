"""CPU tests of jax_tk.attention's public API: input checks at trace time, output shapes and dtypes,
jit and vmap."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from helpers import attention_inputs, randn as _randn, rel_err
from jax_tk._core import extension

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
FUNCTIONS = {"attention": jax_tk.attention, "attention_with_lse": jax_tk.attention_with_lse}


def _gpu_present() -> bool:
    return extension.cuda_device_capability() is not None


def _sds(shape, dtype=BF16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _abstract_qkv(b=2, t=8, s=8, n=4, kh=2, d=64, dtype=BF16):
    return _sds((b, t, n, d), dtype), _sds((b, s, kh, d), dtype), _sds((b, s, kh, d), dtype)


def _qkv(seed, b=2, t=8, s=8, n=4, kh=2, d=32, dtype=BF16):
    return attention_inputs(seed, b, t, s, n, kh, d, dtype)


def _trace(fn, q, k, v, **kwargs):
    """Traces fn abstractly (no data, no computation): any error here is a trace-time error."""
    return jax.eval_shape(functools.partial(fn, **kwargs), q, k, v)


_rel_err = rel_err


# ----------------------------------------------------------------------------------------------
# Bad inputs raise at trace time, naming the argument
# ----------------------------------------------------------------------------------------------

_D = dict(b=2, t=8, s=8, n=4, kh=2, d=64)


def _shapes(**over):
    p = {**_D, **over}
    q = (p["b"], p["t"], p["n"], p["d"])
    kv = (p["b"], p["s"], p["kh"], p["d"])
    return q, kv, kv


# (id, (q shape, k shape, v shape), (q dtype, k dtype, v dtype), exception, regex on the message)
_BAD_INPUTS = [
    ("query_rank3", ((2, 8, 64), (2, 8, 2, 64), (2, 8, 2, 64)), None, ValueError, r"query.*rank 4"),
    ("query_rank5", ((1, 2, 8, 4, 64), (2, 8, 2, 64), (2, 8, 2, 64)), None, ValueError,
     r"rank > 4 must have the same leading batch dims"),
    ("key_rank3", ((2, 8, 4, 64), (2, 8, 64), (2, 8, 2, 64)), None, ValueError, r"key.*rank 4"),
    ("value_rank5", ((2, 8, 4, 64), (2, 8, 2, 64), (1, 2, 8, 2, 64)), None, ValueError,
     r"rank > 4 must have the same leading batch dims"),
    ("query_int32", _shapes(), (jnp.int32, BF16, BF16), TypeError, r"query.*bfloat16, float16 or float32"),
    ("key_int32", _shapes(), (BF16, jnp.int32, BF16), TypeError, r"key.*bfloat16, float16 or float32"),
    ("value_int32", _shapes(), (BF16, BF16, jnp.int32), TypeError, r"value.*bfloat16, float16 or float32"),
    ("all_int32", _shapes(), (jnp.int32,) * 3, TypeError, r"query.*float"),
    ("query_bool", _shapes(), (jnp.bool_, BF16, BF16), TypeError, r"query.*float"),
    ("mixed_bf16_fp16", _shapes(), (BF16, F16, BF16), TypeError, r"query, key and value.*same dtype"),
    ("mixed_fp32_bf16", _shapes(), (F32, F32, BF16), TypeError, r"query, key and value.*same dtype"),
    ("kv_seq_mismatch", ((2, 8, 4, 64), (2, 8, 2, 64), (2, 9, 2, 64)), None, ValueError,
     r"key and value.*same shape"),
    ("kv_heads_mismatch", ((2, 8, 4, 64), (2, 8, 2, 64), (2, 8, 4, 64)), None, ValueError,
     r"key and value.*same shape"),
    ("value_head_dim_larger", ((2, 8, 4, 64), (2, 8, 2, 64), (2, 8, 2, 128)), None, ValueError,
     r"head_dim of value \(128\) must be <= head_dim of query and key \(64\)"),
    ("batch_mismatch", ((2, 8, 4, 64), (3, 8, 2, 64), (3, 8, 2, 64)), None, ValueError, r"batch"),
    ("head_dim_mismatch", ((2, 8, 4, 64), (2, 8, 2, 32), (2, 8, 2, 32)), None, ValueError, r"head_dim"),
    ("heads_not_multiple", _shapes(n=4, kh=3), None, ValueError, r"query heads.*multiple.*key/value heads"),
    ("more_kv_heads", _shapes(n=2, kh=4), None, ValueError, r"query heads.*multiple.*key/value heads"),
    ("empty_heads", ((2, 8, 0, 64), (2, 8, 2, 64), (2, 8, 2, 64)), None, ValueError, r"query.*empty"),
    ("empty_head_dim", _shapes(d=0), None, ValueError, r"query.*empty"),
]


@pytest.mark.parametrize("fn_name", sorted(FUNCTIONS))
@pytest.mark.parametrize(
    "shapes,dtypes,exc,match", [c[1:] for c in _BAD_INPUTS], ids=[c[0] for c in _BAD_INPUTS]
)
def test_bad_inputs_raise_at_trace_time(fn_name, shapes, dtypes, exc, match):
    dtypes = dtypes or (BF16,) * 3
    q, k, v = (_sds(s, dt) for s, dt in zip(shapes, dtypes))
    with pytest.raises(exc, match=match):
        _trace(FUNCTIONS[fn_name], q, k, v)


def test_bad_input_raises_inside_jit_and_eagerly():
    q, k, v = _qkv(0, n=4, kh=3)  # concrete arrays; 4 query heads, 3 kv heads
    with pytest.raises(ValueError, match=r"multiple"):
        jax.jit(jax_tk.attention)(q, k, v)
    with pytest.raises(ValueError, match=r"multiple"):
        jax_tk.attention(q, k, v)


def test_non_array_input_raises():
    q, k, v = _abstract_qkv()
    with pytest.raises(TypeError, match=r"query must be an array"):
        _trace(lambda q, k, v: jax_tk.attention("query", k, v), q, k, v)
    with pytest.raises(ValueError, match=r"query must have rank 4"):  # array-likes are arrays, as in jax.nn
        _trace(jax_tk.attention, [[1.0]], k, v)


@pytest.mark.parametrize("scale", [-1.0, -0.125, 0.0, float("nan"), float("inf"), -float("inf")])
def test_bad_scale_value(scale):
    q, k, v = _abstract_qkv()
    with pytest.raises(ValueError, match=r"scale"):
        _trace(jax_tk.attention, q, k, v, scale=scale)


# Fixed ids: repr(object()) holds an address, which differs between pytest-xdist workers.
@pytest.mark.parametrize("scale", [[0.5], (0.5, 0.5), object(), np.ones(3, np.float32)],
                         ids=["list", "tuple", "object", "array"])
def test_bad_scale_type(scale):
    q, k, v = _abstract_qkv()
    with pytest.raises(TypeError, match=r"scale"):
        _trace(jax_tk.attention, q, k, v, scale=scale)


@pytest.mark.parametrize("scale", ["abc", "0.5", "", True])
def test_bad_scale_string(scale):
    q, k, v = _abstract_qkv()
    with pytest.raises(TypeError, match=r"scale"):
        _trace(jax_tk.attention, q, k, v, scale=scale)


def test_scale_accepts_python_and_numpy_floats():
    q, k, v = _abstract_qkv()
    for scale in (0.5, 1, np.float32(0.5), np.float64(0.25)):
        out = _trace(jax_tk.attention, q, k, v, scale=scale)
        assert out.shape == q.shape


@pytest.mark.parametrize("is_causal", [1, 0, "yes", None, 1.0, jnp.array(True), np.array([True])], ids=repr)
def test_is_causal_not_bool(is_causal):
    q, k, v = _abstract_qkv()
    with pytest.raises(TypeError, match=r"is_causal"):
        _trace(jax_tk.attention, q, k, v, is_causal=is_causal)


def test_is_causal_numpy_bool_accepted():
    q, k, v = _abstract_qkv()
    assert _trace(jax_tk.attention, q, k, v, is_causal=np.bool_(True)).shape == q.shape


@pytest.mark.parametrize("implementation", ["CUDNN", "TK", "XLA", "", "pallas", 0])
def test_unknown_implementation(implementation):
    q, k, v = _abstract_qkv()
    with pytest.raises(ValueError, match=r"implementation"):
        _trace(jax_tk.attention, q, k, v, implementation=implementation)


@pytest.mark.skipif(_gpu_present(), reason="checks the error raised without a GPU")
@pytest.mark.parametrize("fn_name", sorted(FUNCTIONS))
def test_tk_without_gpu_raises(fn_name):
    q, k, v = _abstract_qkv(dtype=BF16, d=64)  # a configuration the kernel supports
    with pytest.raises((RuntimeError, ValueError), match=r"implementation='tk'.*(CUDA|GPU)"):
        _trace(FUNCTIONS[fn_name], q, k, v, implementation="tk")
    # Same eagerly, with data.
    q, k, v = _qkv(1, d=64)
    with pytest.raises((RuntimeError, ValueError), match=r"(CUDA|GPU)"):
        FUNCTIONS[fn_name](q, k, v, implementation="tk")


@pytest.mark.parametrize(
    "dtype,d,match",
    [(F32, 64, r"float32"), (F32, 128, r"float32"), (BF16, 80, r"head_dim 80"), (F16, 80, r"head_dim 80"),
     (BF16, 32, r"head_dim 32"), (F16, 256, r"head_dim 256")],
)
def test_tk_unsupported_config_raises_value_error(dtype, d, match):
    # Raised whether or not a GPU is present: the configuration check comes first.
    if d == 256 and extension.cuda_device_capability() == (9, 0):
        pytest.skip("head_dim 256 has kernels on H100/H200 (test_kernels_gpu covers them)")
    q, k, v = _abstract_qkv(dtype=dtype, d=d)
    with pytest.raises(ValueError, match=r"implementation='tk'.*" + match):
        _trace(jax_tk.attention, q, k, v, implementation="tk")


# ----------------------------------------------------------------------------------------------
# Shapes and dtypes of the outputs
# ----------------------------------------------------------------------------------------------


@jax.jit
def _all_outputs(q, k, v):
    """attention and attention_with_lse, implementation None and "xla", full and causal: one compilation."""
    return {
        (str(implementation), c): (
            jax_tk.attention(q, k, v, is_causal=c, implementation=implementation),
            jax_tk.attention_with_lse(q, k, v, is_causal=c, implementation=implementation),
        )
        for implementation in ("xla", None)
        for c in (False, True)
    }


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize(
    "b,t,s,n,kh,d", [(2, 8, 8, 4, 4, 32), (1, 5, 12, 4, 2, 16), (2, 12, 5, 6, 1, 64), (1, 1, 1, 1, 1, 8)]
)
def test_output_shape_dtype(dtype, b, t, s, n, kh, d):
    q, k, v = _qkv(2, b=b, t=t, s=s, n=n, kh=kh, d=d, dtype=dtype)
    results = _all_outputs(q, k, v)
    for (implementation, is_causal), (out, (out2, lse)) in results.items():
        implementation = None if implementation == "None" else implementation
        msg = f"implementation={implementation} is_causal={is_causal}"
        assert out.shape == (b, t, n, d), msg
        assert out.dtype == dtype, msg
        assert np.all(np.isfinite(np.asarray(out, np.float32))), msg
        assert out2.shape == (b, t, n, d) and out2.dtype == dtype, msg
        assert lse.shape == (b, n, t) and lse.dtype == F32, msg
        assert np.all(np.isfinite(np.asarray(lse))), msg
        np.testing.assert_array_equal(np.asarray(out2, np.float32), np.asarray(out, np.float32), err_msg=msg)
        # Abstract evaluation agrees with the concrete result.
        abstract = _trace(jax_tk.attention_with_lse, q, k, v, is_causal=is_causal, implementation=implementation)
        assert (abstract[0].shape, abstract[0].dtype) == (out.shape, out.dtype), msg
        assert (abstract[1].shape, abstract[1].dtype) == (lse.shape, lse.dtype), msg


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=lambda d: jnp.dtype(d).name)
def test_eager_call(dtype):
    q, k, v = _qkv(3, b=1, t=5, s=12, n=4, kh=2, d=16, dtype=dtype)
    for implementation in (None, "xla"):
        out, lse = jax_tk.attention_with_lse(q, k, v, is_causal=True, implementation=implementation)
        assert out.shape == q.shape and out.dtype == dtype
        assert lse.shape == (1, 4, 5) and lse.dtype == F32
        want = _all_outputs(q, k, v)[(str(implementation), True)][1]
        assert _rel_err(out, want[0]) < (1e-5 if dtype == F32 else 1e-2)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(want[1]), rtol=1e-5, atol=1e-5)


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = _qkv(3, d=32, dtype=F32)

    @jax.jit
    def f(q, k, v):
        return (
            jax_tk.attention(q, k, v),
            jax_tk.attention(q, k, v, scale=1.0 / math.sqrt(32)),
            jax_tk.attention(q, k, v, scale=0.5),
        )

    out_default, out_explicit, out_other = f(q, k, v)
    np.testing.assert_allclose(np.asarray(out_default), np.asarray(out_explicit), rtol=1e-6, atol=1e-6)
    assert _rel_err(out_other, out_default) > 1e-3  # the scale is actually used


# ----------------------------------------------------------------------------------------------
# jit and vmap
# ----------------------------------------------------------------------------------------------

_tk_attention = jax.jit(jax_tk.attention, static_argnames=("scale", "is_causal", "implementation"))
_tk_attention_with_lse = jax.jit(jax_tk.attention_with_lse, static_argnames=("scale", "is_causal", "implementation"))


@pytest.mark.parametrize("dtype,is_causal", [(BF16, True), (F32, False)], ids=["bfloat16-causal", "float32-full"])
def test_jit_matches_eager(dtype, is_causal):
    q, k, v = _qkv(4, t=9, s=7, dtype=dtype)
    f = functools.partial(jax_tk.attention_with_lse, is_causal=is_causal, scale=0.3)
    out, lse = f(q, k, v)
    out_j, lse_j = jax.jit(f)(q, k, v)
    assert out_j.dtype == dtype and out_j.shape == q.shape
    tol = 1e-2 if dtype == BF16 else 1e-5
    np.testing.assert_allclose(np.asarray(out_j, np.float32), np.asarray(out, np.float32), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(lse_j), np.asarray(lse), rtol=1e-5, atol=1e-5)


def test_jit_with_static_keyword_arguments():
    q, k, v = _qkv(5, dtype=F32)
    a = _tk_attention(q, k, v, scale=0.2, is_causal=True, implementation="xla")
    b = jax.jit(functools.partial(jax_tk.attention, scale=0.2, is_causal=True, implementation="xla"))(q, k, v)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [BF16, F32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("use_jit", [False, True])
def test_vmap_over_leading_axis(dtype, use_jit):
    rng = np.random.default_rng(6)
    e, b, t, s, n, kh, d = 3, 2, 6, 10, 4, 2, 16
    q = _randn(rng, (e, b, t, n, d), dtype)
    k = _randn(rng, (e, b, s, kh, d), dtype)
    v = _randn(rng, (e, b, s, kh, d), dtype)
    g = jax.vmap(functools.partial(jax_tk.attention_with_lse, is_causal=True))
    if use_jit:
        g = jax.jit(g)
    out, lse = g(q, k, v)
    assert out.shape == (e, b, t, n, d) and out.dtype == dtype
    assert lse.shape == (e, b, n, t) and lse.dtype == F32
    tol = 1e-5 if dtype == F32 else 1e-2
    qn, kn, vn = (np.asarray(x) for x in (q, k, v))
    for i in range(e):
        out_i, lse_i = _tk_attention_with_lse(qn[i], kn[i], vn[i], is_causal=True)
        assert _rel_err(out[i], out_i) < tol
        np.testing.assert_allclose(np.asarray(lse[i]), np.asarray(lse_i), rtol=1e-5, atol=1e-5)


def test_vmap_with_unbatched_key_value():
    rng = np.random.default_rng(7)
    q = _randn(rng, (3, 1, 5, 4, 16), F32)
    k = _randn(rng, (1, 7, 2, 16), F32)
    v = _randn(rng, (1, 7, 2, 16), F32)
    out = jax.jit(jax.vmap(jax_tk.attention, in_axes=(0, None, None)))(q, k, v)
    assert out.shape == q.shape
    for i in range(3):
        assert _rel_err(out[i], _tk_attention(np.asarray(q)[i], k, v)) < 1e-5


def test_vmap_on_axis_1():
    rng = np.random.default_rng(8)
    q = _randn(rng, (1, 3, 5, 4, 16), F32)
    k = _randn(rng, (1, 3, 7, 4, 16), F32)
    v = _randn(rng, (1, 3, 7, 4, 16), F32)
    out = jax.jit(jax.vmap(jax_tk.attention, in_axes=1, out_axes=1))(q, k, v)
    assert out.shape == q.shape
    qn, kn, vn = (np.asarray(x) for x in (q, k, v))
    for i in range(3):
        assert _rel_err(out[:, i], _tk_attention(qn[:, i], kn[:, i], vn[:, i])) < 1e-5


# bias and mask take jax.nn's positional places after value.
@pytest.mark.parametrize("fn_name", sorted(FUNCTIONS))
def test_bias_and_mask_positional(fn_name):
    q, k, v = _qkv(0)
    rng = np.random.default_rng(0)
    bias = jnp.asarray(rng.standard_normal((1, 4, 8, 8)), F32)
    mask = jnp.asarray(rng.random((2, 1, 8, 8)) > 0.3).at[..., 0].set(True)
    fn = FUNCTIONS[fn_name]
    by_name = fn(q, k, v, bias=bias, mask=mask)
    for got, want in zip(jax.tree.leaves(fn(q, k, v, bias, mask)), jax.tree.leaves(by_name)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    plain = jax.tree.leaves(fn(q, k, v))
    assert not np.allclose(np.asarray(plain[0]), np.asarray(jax.tree.leaves(by_name)[0]))


def test_bias_and_mask_none_are_the_plain_call():
    q, k, v = _qkv(1)
    want = jax_tk.attention(q, k, v, is_causal=True)
    got = jax_tk.attention(q, k, v, None, None, is_causal=True, dropout_rate=0.1, dropout_rng=jax.random.key(0),
                           deterministic=True)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# Dropout is Flax's (active when dropout_rate > 0 and not deterministic); jax_tk does not implement it,
# so an active one raises, with or without a key, never ignored.
@pytest.mark.parametrize("kwargs", [dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)),
                                    dict(dropout_rate=0.1, dropout_rng=jax.random.key(0), deterministic=False),
                                    dict(dropout_rate=0.5), dict(dropout_rate=0.1, deterministic=False)], ids=str)
@pytest.mark.parametrize("fn_name", sorted(FUNCTIONS))
def test_active_dropout_raises(fn_name, kwargs):
    q, k, v = _qkv(2)
    with pytest.raises(NotImplementedError, match=r"dropout_rate=0\.\d with deterministic=False"):
        FUNCTIONS[fn_name](q, k, v, **kwargs)


def test_inactive_dropout_runs():
    q, k, v = _qkv(2)
    want = np.asarray(jax_tk.attention(q, k, v))
    for kwargs in (dict(dropout_rate=0.0, dropout_rng=jax.random.key(0)), dict(dropout_rate=0.0, deterministic=False),
                   dict(dropout_rate=0.3, deterministic=True, dropout_rng=jax.random.key(1)),
                   dict(dropout_rate=0.3, deterministic=True)):
        np.testing.assert_array_equal(np.asarray(jax_tk.attention(q, k, v, **kwargs)), want)


@pytest.mark.parametrize("kwargs,error", [(dict(dropout_rate=1.0, deterministic=True), ValueError),
                                          (dict(dropout_rate=-0.1), ValueError),
                                          (dict(dropout_rate="0.1"), TypeError),
                                          (dict(dropout_rate=True), TypeError),
                                          (dict(deterministic=1), TypeError),
                                          (dict(deterministic_backward="yes"), TypeError)], ids=str)
def test_bad_dropout_arguments(kwargs, error):
    q, k, v = _qkv(2)
    with pytest.raises(error, match=next(iter(kwargs))):
        jax_tk.attention(q, k, v, **kwargs)


def test_deterministic_true_without_dropout_arguments_keeps_its_former_meaning():
    """deterministic=True with no dropout argument is read as deterministic_backward=True, with a
    DeprecationWarning; with a dropout argument (as Flax always passes) it is Flax's flag only."""
    from jax_tk.attention import api

    q, k, v = _qkv(3)
    seen = []
    real = api.attention_vjp

    def spy(q, k, v, spec, *rest):
        seen.append(spec.deterministic)
        return real(q, k, v, spec, *rest)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(api, "attention_vjp", spy)
        with pytest.warns(DeprecationWarning, match="deterministic_backward=True"):
            jax_tk.attention(q, k, v, deterministic=True)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            jax_tk.attention(q, k, v, deterministic=True, dropout_rate=0.0)
            jax_tk.attention(q, k, v, deterministic=True, deterministic_backward=False)
            jax_tk.attention(q, k, v, deterministic_backward=True)
            jax_tk.attention(q, k, v, deterministic=False)
    assert seen == [True, False, False, True, False]
