"""CPU tests of what makes jax_tk.attention a drop-in for jax.nn.dot_product_attention: rank-3 inputs,
several leading batch dims (Flax's), numpy inputs, implementation="cudnn" (its errors and its mapping
onto jax.nn), return_residual, a traced scale, numpy integer scalars and 64-bit segment ids/lengths."""
import functools
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from helpers import attention_inputs, rel_err
from jax_tk.attention import compat, reference

BF16, F32 = jnp.bfloat16, jnp.float32


def _qkv(seed, b=2, t=8, s=8, n=4, kh=2, d=16, dtype=F32):
    return attention_inputs(seed, b, t, s, n, kh, d, dtype)


def _close(x, y, tol=1e-5):
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=tol, atol=tol)


# ----------------------------------------------------------------------------------------------
# Rank-3 inputs
# ----------------------------------------------------------------------------------------------


def test_rank3_matches_batch_of_one():
    q, k, v = _qkv(0, b=1, t=7, s=9)
    ids_q, ids_k = jnp.array([0, 0, 0, 1, 1, 1, 1]), jnp.array([0, 0, 0, 0, 1, 1, 1, 1, 1])
    opts = dict(is_causal=True, local_window_size=(3, 1))
    out3, lse3 = jax_tk.attention_with_lse(q[0], k[0], v[0], q_segment_ids=ids_q, kv_segment_ids=ids_k,
                                           query_seq_lengths=jnp.array(6), key_value_seq_lengths=jnp.array([8]),
                                           **opts)
    out4, lse4 = jax_tk.attention_with_lse(q, k, v, q_segment_ids=ids_q[None], kv_segment_ids=ids_k[None],
                                           query_seq_lengths=jnp.array([6]), key_value_seq_lengths=jnp.array([8]),
                                           **opts)
    assert out3.shape == (7, 4, 16) and lse3.shape == (4, 7)
    _close(out3, out4[0], 0)
    _close(lse3, lse4[0], 0)
    res = jax_tk.attention(q[0], k[0], v[0], return_residual=True)[1]
    assert res.shape == (7, 4)


def test_rank3_matches_jax_nn_and_has_gradients():
    q, k, v = (x[0] for x in _qkv(1, b=1, t=6, s=10))
    got, res = jax_tk.attention(q, k, v, is_causal=True, return_residual=True)
    want, want_res = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla", return_residual=True)
    assert got.shape == want.shape == q.shape and res.shape == want_res.shape == (6, 4)
    _close(got, want)
    _close(res, want_res)
    f = lambda fn: jax.grad(lambda q, k, v: (fn(q, k, v) ** 2).sum(), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(f(jax_tk.attention), f(functools.partial(jax.nn.dot_product_attention, implementation="xla"))):
        assert g.shape == w.shape and rel_err(g, w) < 1e-5


@pytest.mark.parametrize("ranks", [(3, 4, 4), (4, 3, 3), (3, 3, 4), (4, 4, 3)], ids=str)
def test_mixed_ranks_raise(ranks):
    shapes = {3: (8, 4, 16), 4: (1, 8, 4, 16)}
    q, k, v = (jax.ShapeDtypeStruct(shapes[r], BF16) for r in ranks)
    with pytest.raises(ValueError, match=r"all have rank 4 .* or all rank 3"):
        jax.eval_shape(jax_tk.attention, q, k, v)


# ----------------------------------------------------------------------------------------------
# Several leading batch dims, numpy inputs
# ----------------------------------------------------------------------------------------------


def test_several_batch_dims_match_one():
    """[2, 3, seq, heads, dim] with every masking option is the [6, ...] call, values and gradients."""
    b0, b1, t, s = 2, 3, 7, 9
    q, k, v = (x.reshape(b0, b1, *x.shape[1:]) for x in _qkv(3, b=b0 * b1, t=t, s=s))
    rng = np.random.default_rng(4)
    bias = jnp.asarray(rng.standard_normal((b1, 1, t, s)), F32)  # broadcast over the first batch dim
    mask = jnp.asarray(rng.random((b0, 1, 1, t, s)) < 0.8)       # ... and over the second
    ids_q, ids_k = jnp.asarray(rng.integers(0, 2, (b0, b1, t))), jnp.asarray(rng.integers(0, 2, (b0, b1, s)))
    lens_q, lens_k = jnp.asarray(rng.integers(0, t + 1, (b0, b1))), jnp.asarray(rng.integers(1, s + 1, (b0, b1)))
    dout = jnp.asarray(rng.standard_normal(q.shape), F32)
    dlse = jnp.asarray(rng.standard_normal((b0, b1, 4, t)), F32)
    opts = dict(is_causal=True, local_window_size=(4, 2))

    def loss(fn, q, k, v, bias):
        out, lse = fn(q, k, v, bias)
        lse = jnp.where(jnp.isinf(lse), 0, lse)  # (rows that see no key)
        return jnp.sum(out * dout.reshape(out.shape)) + jnp.sum(lse * dlse.reshape(lse.shape))

    many = lambda q, k, v, bias: jax_tk.attention_with_lse(
        q, k, v, bias, mask, q_segment_ids=ids_q, kv_segment_ids=ids_k, query_seq_lengths=lens_q,
        key_value_seq_lengths=lens_k, **opts)
    flat = lambda q, k, v, bias: jax_tk.attention_with_lse(
        *(x.reshape(b0 * b1, *x.shape[2:]) for x in (q, k, v)), jnp.broadcast_to(bias, (b0, b1, 1, t, s)).reshape(
            b0 * b1, 1, t, s), jnp.broadcast_to(mask, (b0, b1, 1, t, s)).reshape(b0 * b1, 1, t, s),
        q_segment_ids=ids_q.reshape(-1, t), kv_segment_ids=ids_k.reshape(-1, s), query_seq_lengths=lens_q.reshape(-1),
        key_value_seq_lengths=lens_k.reshape(-1), **opts)
    (out, lse), (want, want_lse) = many(q, k, v, bias), flat(q, k, v, bias)
    assert out.shape == q.shape and lse.shape == (b0, b1, 4, t)
    _close(out, want.reshape(out.shape), 0)
    _close(lse, want_lse.reshape(lse.shape), 0)
    grads = jax.jit(jax.grad(functools.partial(loss, many), argnums=(0, 1, 2, 3)))(q, k, v, bias)
    want_grads = jax.grad(functools.partial(loss, flat), argnums=(0, 1, 2, 3))(q, k, v, bias)
    for g, w in zip(grads, want_grads):
        assert g.shape == w.shape and float(jnp.abs(w).max()) > 0
        _close(g, w)


@pytest.mark.parametrize("shapes,match", [
    (((2, 3, 8, 4, 16), (3, 2, 8, 2, 16), (3, 2, 8, 2, 16)), "same leading batch dims"),
    (((2, 3, 8, 4, 16), (6, 8, 2, 16), (6, 8, 2, 16)), "same leading batch dims"),
    (((1, 2, 3, 8, 4, 16), (1, 2, 3, 8, 2, 16), (1, 2, 4, 8, 2, 16)), "same leading batch dims"),
], ids=["swapped", "mixed_ranks", "value"])
def test_several_batch_dims_must_agree(shapes, match):
    q, k, v = (jax.ShapeDtypeStruct(sh, BF16) for sh in shapes)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(jax_tk.attention, q, k, v)


@pytest.mark.parametrize("kwargs,match", [
    (dict(bias=jnp.zeros((2, 2, 4, 8, 8))), "bias of shape .* does not broadcast over the batch dims"),
    (dict(mask=jnp.ones((1, 1, 2, 3, 4, 8, 8), bool)), "mask must have rank <= 5"),
    (dict(q_segment_ids=jnp.zeros((6, 8), jnp.int32), kv_segment_ids=jnp.zeros((6, 8), jnp.int32)),
     r"q_segment_ids must have shape \(2, 3, 8\)"),
    (dict(key_value_seq_lengths=jnp.zeros((6,), jnp.int32)), r"key_value_seq_lengths must have shape \(2, 3\)"),
])
def test_several_batch_dims_bad_masking(kwargs, match):
    q = jnp.zeros((2, 3, 8, 4, 16), BF16)
    with pytest.raises(ValueError, match=match):
        jax_tk.attention(q, q, q, **kwargs)


def test_numpy_float64_inputs_are_taken_as_jax_nn_takes_them():
    q, k, v = (np.asarray(x, np.float64) for x in _qkv(5))
    bias = np.random.default_rng(6).standard_normal((1, 4, 8, 8))
    want = jax.nn.dot_product_attention(q, k, v, bias, is_causal=True, implementation="xla")
    got = jax_tk.attention(q, k, v, bias, is_causal=True)
    assert got.dtype == want.dtype == F32
    _close(got, want)
    _close(jax_tk.attention(q.tolist(), k, v.tolist(), bias, is_causal=True), want)


# ----------------------------------------------------------------------------------------------
# implementation="cudnn"
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("option,kwargs", [
    ("segment_ids", dict(q_segment_ids=jnp.zeros((2, 8), jnp.int32), kv_segment_ids=jnp.zeros((2, 8), jnp.int32))),
    ("logits_soft_cap", dict(logits_soft_cap=30.0)),
    ("deterministic_backward=True", dict(deterministic_backward=True)),
])
@pytest.mark.parametrize("fn", [jax_tk.attention, jax_tk.attention_with_lse], ids=["attention", "with_lse"])
def test_cudnn_unsupported_options(fn, option, kwargs):
    q, k, v = _qkv(2, dtype=BF16)
    with pytest.raises(ValueError, match=rf"implementation='cudnn'.*{option}.*not supported by jax.nn"):
        fn(q, k, v, implementation="cudnn", **kwargs)


def test_cudnn_active_dropout_rejected():
    q, k, v = _qkv(2, dtype=BF16)
    with pytest.raises(NotImplementedError, match="dropout"):
        jax_tk.attention(q, k, v, dropout_rate=0.1, dropout_rng=jax.random.key(0), implementation="cudnn")


def _fake_cudnn(monkeypatch, calls):
    """Replaces jax.nn.dot_product_attention by a recorder that runs jax.nn's XLA path instead of cuDNN."""
    real = jax.nn.dot_product_attention

    def fake(*args, **kwargs):
        calls.append(kwargs)
        assert kwargs["implementation"] == "cudnn"
        return real(*args, **{**kwargs, "implementation": "xla"})

    monkeypatch.setattr(jax.nn, "dot_product_attention", fake)


def test_cudnn_maps_the_options_onto_jax_nn(monkeypatch):
    calls = []
    _fake_cudnn(monkeypatch, calls)
    q, k, v = _qkv(3, t=8, s=8)
    lengths = dict(query_seq_lengths=jnp.array([8, 5]), key_value_seq_lengths=np.array([7, 8], np.int64))
    opts = dict(scale=0.3, is_causal=True, local_window_size=np.int64(3), **lengths)
    out, lse = jax_tk.attention_with_lse(q, k, v, implementation="cudnn", **opts)
    (kw,) = calls
    assert kw["scale"] == 0.3 and kw["is_causal"] is True and kw["local_window_size"] == (3, 3)
    assert kw["return_residual"] is True
    assert kw["query_seq_lengths"].dtype == kw["key_value_seq_lengths"].dtype == jnp.int32
    want_out, want_lse = jax_tk.attention_with_lse(q, k, v, implementation="xla", **opts)
    assert out.shape == q.shape and lse.shape == (2, 4, 8) and lse.dtype == F32
    # jax.nn zeroes the padded query rows too; every row sees at least one key here.
    _close(out, want_out)
    # Rows past their query length: lse -inf here (they see no key), jax.nn's is finite; compare the others.
    valid = (jnp.arange(8) < jnp.array([8, 5])[:, None])[:, None, :]
    assert np.all(np.isneginf(np.asarray(want_lse)[~np.broadcast_to(valid, want_lse.shape)]))
    _close(jnp.where(valid, lse, 0), jnp.where(valid, want_lse, 0))
    # The residual through attention(return_residual=True): jax.nn's layout.
    _, res = jax_tk.attention(q, k, v, implementation="cudnn", return_residual=True, **opts)
    _close(jnp.where(valid, jnp.swapaxes(res, 1, 2), 0), jnp.where(valid, want_lse, 0))
    # Rank 3 and a traced scale go through too (the scale folded into the query, jax.nn's scale 1.0).
    out3 = jax.jit(lambda q, k, v, s: jax_tk.attention(q, k, v, scale=s, implementation="cudnn"))(
        q[0], k[0], v[0], jnp.float32(0.3))
    assert calls[-1]["scale"] == 1.0
    _close(out3, jax_tk.attention(q[0], k[0], v[0], scale=0.3), 1e-5)


def test_cudnn_lowering_for_cuda():
    q = jax.ShapeDtypeStruct((2, 128, 4, 64), BF16)
    f = functools.partial(jax_tk.attention, is_causal=True, implementation="cudnn")
    try:
        text = jax.jit(f).trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
    except RuntimeError as e:
        # Without cuDNN (a CPU-only jaxlib), jax.nn refuses to trace its cuDNN path at all: jax_tk says
        # which call failed and passes jax.nn's error on (raised from jax's cuDNN module).
        assert str(e).startswith("jax_tk.attention(implementation='cudnn')") and "cuDNN is not detected" in str(e)
        frames = [f.filename for f in traceback.extract_tb(e.__cause__.__traceback__)]
        assert any("cudnn" in name and "jax" in name for name in frames), frames
        return
    assert "__cudnn$fmha" in text


# ----------------------------------------------------------------------------------------------
# return_residual
# ----------------------------------------------------------------------------------------------


def test_return_residual_matches_jax_nn():
    q, k, v = _qkv(4, t=6, s=9)  # every row sees a key (jax.nn gives an empty row the mean of V)
    out, res = jax_tk.attention(q, k, v, is_causal=True, local_window_size=(2, 1), return_residual=True)
    want, want_res = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(2, 1),
                                                   implementation="xla", return_residual=True)
    assert res.shape == want_res.shape == (2, 6, 4) and res.dtype == F32
    _close(out, want)
    _close(res, want_res)
    _, lse = jax_tk.attention_with_lse(q, k, v, is_causal=True, local_window_size=(2, 1))
    _close(res, jnp.swapaxes(lse, 1, 2), 0)
    assert jax_tk.attention(q, k, v, return_residual=False).shape == q.shape


@pytest.mark.parametrize("value", [1, "yes", None, jnp.array(True)], ids=repr)
def test_return_residual_not_bool(value):
    q, k, v = _qkv(4)
    with pytest.raises(TypeError, match="return_residual"):
        jax_tk.attention(q, k, v, return_residual=value)


# ----------------------------------------------------------------------------------------------
# Traced scale
# ----------------------------------------------------------------------------------------------


def test_traced_scale_value_matches_static():
    q, k, v = _qkv(5, dtype=BF16)
    for opts in (dict(), dict(is_causal=True, logits_soft_cap=2.0, local_window_size=(2, 3))):
        want = jax_tk.attention(q, k, v, scale=0.7, **opts)
        got = jax_tk.attention(q, k, v, scale=jnp.float32(0.7), **opts)
        got_jit = jax.jit(lambda q, k, v, s: jax_tk.attention(q, k, v, scale=s, **opts))(q, k, v, jnp.float32(0.7))
        assert got.dtype == BF16 and got.shape == q.shape
        assert rel_err(got, want) < 2e-2 and rel_err(got_jit, want) < 2e-2
        _close(got_jit, got, 1e-2)


def test_traced_scale_gradient_matches_reference():
    q, k, v = _qkv(6)
    opts = dict(is_causal=True, logits_soft_cap=3.0)

    def loss(fn, s):
        return (fn(s) ** 2).sum()

    ours = lambda s: jax_tk.attention(q, k, v, scale=s, **opts)
    ref = lambda s: reference.attention(q, k, v, scale=s, local_window_size=None, **opts)
    for s in (0.25, 1.3):
        g = jax.jit(jax.grad(functools.partial(loss, ours)))(jnp.float32(s))
        g_ref = jax.grad(functools.partial(loss, ref))(jnp.float32(s))
        np.testing.assert_allclose(float(g), float(g_ref), rtol=5e-5)
    # Gradients with respect to query, key and value still agree with a static scale's.
    grad_qkv = lambda scale: jax.grad(lambda q, k, v: (jax_tk.attention(q, k, v, scale=scale, **opts) ** 2).sum(),
                                      argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(grad_qkv(jnp.float32(0.4)), grad_qkv(0.4)):
        assert rel_err(g, w) < 1e-5


@pytest.mark.parametrize("scale", [jnp.ones(2, F32), jnp.int32(2), jnp.ones((1,), BF16)], ids=["vector", "int", "shape1"])
def test_bad_array_scale(scale):
    q, k, v = _qkv(7)
    with pytest.raises(TypeError, match=r"scale must be a scalar of a float dtype"):
        jax_tk.attention(q, k, v, scale=scale)


def test_numpy_scale_keeps_static_path():
    assert not compat.is_array_scale(np.float32(0.5)) and not compat.is_array_scale(0.5)
    assert compat.is_array_scale(jnp.float32(0.5))


# ----------------------------------------------------------------------------------------------
# Numpy integer scalars, 64-bit segment ids and lengths
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [np.int64(3), np.int32(3), (np.int64(3), 3), (3, np.int32(3)), [np.int16(3), 3]],
                         ids=repr)
def test_numpy_integer_window(window):
    q, k, v = _qkv(8, t=12, s=12)
    _close(jax_tk.attention(q, k, v, local_window_size=window), jax_tk.attention(q, k, v, local_window_size=(3, 3)), 0)


@pytest.mark.parametrize("window", [np.int64(-1), np.bool_(True), True, 2.0, (np.int64(1),)], ids=repr)
def test_bad_window(window):
    q, k, v = _qkv(8)
    with pytest.raises(ValueError, match="local_window_size"):
        jax_tk.attention(q, k, v, local_window_size=window)


_SMALL_Q = np.array([[0, 0, 1, 1, 2, 2, 2, 3], [5, 5, 5, 5, 6, 6, 7, 7]])
_SMALL_KV = np.array([[0, 1, 1, 1, 2, 3, 3, 3], [5, 6, 6, 6, 6, 7, 7, 9]])


def _big(ids):
    # 2k -> k and 2k + 1 -> 2**40 + k: distinct, but they collide when truncated to int32
    # ((2**40 + k) mod 2**32 == k).
    return (ids // 2 + 2 ** 40 * (ids % 2)).astype(np.int64)


def _want(q, k, v):
    return jax_tk.attention_with_lse(q, k, v, q_segment_ids=jnp.asarray(_SMALL_Q, jnp.int32),
                                     kv_segment_ids=jnp.asarray(_SMALL_KV, jnp.int32))


def test_int64_segment_ids_numpy_without_x64():
    q, k, v = _qkv(9)
    got = jax_tk.attention_with_lse(q, k, v, q_segment_ids=_big(_SMALL_Q), kv_segment_ids=_big(_SMALL_KV))
    for g, w in zip(got, _want(q, k, v)):
        _close(g, w, 0)


def test_int64_segment_ids_with_x64():
    q, k, v = _qkv(9)
    want = _want(q, k, v)
    with jax.enable_x64(True):
        ids_q, ids_kv = jnp.asarray(_big(_SMALL_Q)), jnp.asarray(_big(_SMALL_KV))
        assert ids_q.dtype == jnp.int64
        # the ids truncated to int32 would collide (they are all distinct in 64 bits only)
        assert len(np.unique(_big(_SMALL_Q).astype(np.int32))) < len(np.unique(_big(_SMALL_Q)))
        for fn in (jax_tk.attention_with_lse, jax.jit(jax_tk.attention_with_lse)):
            got = fn(q, k, v, q_segment_ids=ids_q, kv_segment_ids=ids_kv)
            for g, w in zip(got, want):
                _close(g, w, 0)
        # mixed widths (int64 queries, int32 keys) are relabelled jointly
        got = jax_tk.attention_with_lse(q, k, v, q_segment_ids=jnp.asarray(_SMALL_Q, jnp.int64),
                                        kv_segment_ids=jnp.asarray(_SMALL_KV, jnp.int32))
        for g, w in zip(got, want):
            _close(g, w, 0)
        # gradients flow with 64-bit ids
        g = jax.grad(lambda q: jax_tk.attention(q, k, v, q_segment_ids=ids_q, kv_segment_ids=ids_kv).sum())(q)
        assert g.shape == q.shape and np.all(np.isfinite(np.asarray(g)))


def test_dense_rank_is_exact_and_order_preserving():
    with jax.enable_x64(True):
        x = jnp.asarray([2 ** 40 + 3, 3, -2 ** 50, 3, 2 ** 40 + 3, 7, 2 ** 62], jnp.int64)
        r = jax.jit(compat.dense_rank)(x)
        assert r.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(r), [3, 1, 0, 1, 3, 2, 4])


def test_int64_lengths_clamped():
    q, k, v = _qkv(10)
    want = jax_tk.attention_with_lse(q, k, v, query_seq_lengths=jnp.array([8, 0]), key_value_seq_lengths=jnp.array([8, 3]))
    big = dict(query_seq_lengths=np.array([2 ** 40, -2 ** 40]), key_value_seq_lengths=np.array([2 ** 33 + 100, 3]))
    for g, w in zip(jax_tk.attention_with_lse(q, k, v, **big), want):
        _close(g, w, 0)
    with jax.enable_x64(True):
        big = {name: jnp.asarray(x, jnp.int64) for name, x in big.items()}
        for g, w in zip(jax.jit(jax_tk.attention_with_lse)(q, k, v, **big), want):
            _close(g, w, 0)


def test_uint32_lengths_past_int32_clamped():
    """uint32 lengths from 2^31 mean "longer than the sequence", not a negative (wrapped) int32."""
    q, k, v = _qkv(10)
    want = jax_tk.attention_with_lse(q, k, v, key_value_seq_lengths=jnp.array([8, 3]))
    for lens in (np.array([2 ** 31, 3], np.uint32), jnp.array([2 ** 32 - 1, 3], jnp.uint32)):
        for g, w in zip(jax_tk.attention_with_lse(q, k, v, key_value_seq_lengths=lens), want):
            _close(g, w, 0)


def test_implementation_choices_named():
    q, k, v = _qkv(10)
    with pytest.raises(ValueError, match=r"one of \(None, 'tk', 'xla', 'cudnn'\)"):
        jax_tk.attention(q, k, v, implementation="flash")


def test_uint32_segment_ids_beside_signed_ones():
    """uint32 2^32 - 1 is not int32 -1: ids match only where their integer values are equal."""
    q, k, v = _qkv(11, t=6, s=6)
    signed = jnp.array([[-1] * 6, [0, 0, 0, 1, 1, 1]], jnp.int32)
    unsigned = jnp.array([[2 ** 32 - 1] * 6, [0, 0, 0, 1, 1, 1]], jnp.uint32)
    for a, b in ((signed, unsigned), (unsigned, signed)):
        out = jax.jit(jax_tk.attention)(q, k, v, q_segment_ids=a, kv_segment_ids=b)
        assert not np.asarray(out[0]).any()  # no query of sequence 0 sees a key
        _close(out[1], jax_tk.attention(q, k, v, q_segment_ids=signed, kv_segment_ids=signed)[1])


def test_numpy_int64_segment_ids_beside_jax_ones():
    """Without x64, numpy int64 ids next to JAX ids are taken exactly when they fit int32, and refused
    (never truncated into false matches) when they do not."""
    q, k, v = _qkv(12)
    want = _want(q, k, v)
    got = jax_tk.attention_with_lse(q, k, v, q_segment_ids=_SMALL_Q.astype(np.int64),
                                    kv_segment_ids=jnp.asarray(_SMALL_KV, jnp.int32))
    for g, w in zip(got, want):
        _close(g, w, 0)
    with pytest.raises(ValueError, match="q_segment_ids is a numpy int64 array with values outside int32"):
        jax_tk.attention(q, k, v, q_segment_ids=_big(_SMALL_Q), kv_segment_ids=jnp.asarray(_SMALL_KV, jnp.int32))


@pytest.mark.parametrize("b,t,s", [(0, 8, 8), (2, 0, 8), (2, 8, 0)], ids=["batch0", "q_len0", "kv_len0"])
def test_empty_batch_or_sequences(b, t, s):
    """As jax.nn: an empty batch or sequence gives an empty result; no keys at all: rows of 0, lse -inf."""
    q, k, v = (x.astype(BF16) for x in _qkv(13, b=max(b, 1), t=max(t, 1), s=max(s, 1)))
    q, k, v = q[:b, :t], k[:b, :s], v[:b, :s]
    out, lse = jax.jit(jax_tk.attention_with_lse)(q, k, v)
    assert out.shape == jax.nn.dot_product_attention(q, k, v).shape == q.shape and lse.shape == (b, 4, t)
    assert not np.asarray(out, np.float32).any() and np.isneginf(np.asarray(lse)).all()
    grads = jax.grad(lambda q, k, v: jax_tk.attention(q, k, v).astype(F32).sum(), argnums=(0, 1, 2))(q, k, v)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    with pytest.raises(ValueError, match="query has an empty dimension"):
        jax_tk.attention(q[:, :, :0], k[:, :, :0], v[:, :, :0])


# ----------------------------------------------------------------------------------------------
# One normalization pass
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [(6,), (), (3, 2)], ids=["rank4", "rank3", "rank5"])
@pytest.mark.parametrize("fn", ["attention", "attention_with_lse"])
def test_arguments_are_normalized_once(monkeypatch, batch, fn):
    """Every form of call is checked and normalized in one pass (compat.normalize, once), which hands
    the op rank-4 arrays, and the results come back in the caller's batch dims."""
    from jax_tk.attention import api

    calls, runs = [], []
    real_normalize, real_run = compat.normalize, api._run
    monkeypatch.setattr(compat, "normalize", lambda *a, **kw: calls.append(1) or real_normalize(*a, **kw))
    monkeypatch.setattr(api, "_run", lambda call, sinks=None: runs.append(call.query.shape) or real_run(call, sinks))
    q, k, v = (x.reshape(batch + x.shape[1:]) if batch else x[0] for x in _qkv(14, b=6))
    mask = jnp.asarray(np.random.default_rng(14).random((8, 8)) < 0.7)
    result = getattr(jax_tk, fn)(q, k, v, mask=mask, is_causal=True)
    out = result[0] if fn == "attention_with_lse" else result
    assert len(calls) == 1 and len(runs) == 1 and len(runs[0]) == 4
    assert out.shape == q.shape
    want = reference.attention_with_lse(*(x.reshape((-1,) + x.shape[-3:]) for x in (q, k, v)), scale=16 ** -0.5,
                                        is_causal=True, mask=mask)[0]
    _close(out.reshape(want.shape), want)


def test_compat_does_not_run_the_op():
    """compat.py normalizes only: it imports nothing of the op (api, launch, ring)."""
    import ast
    import pathlib

    tree = ast.parse(pathlib.Path(compat.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not imported & {"api", "launch", "ring", "jax_tk.attention", "jax_tk.attention.api"}, imported
