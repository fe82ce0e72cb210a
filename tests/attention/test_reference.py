"""CPU tests of the pure-JAX reference (jax_tk.reference) against an independent float64 numpy
implementation, and of jax_tk.attention on CPU against jax.nn.dot_product_attention."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from jax_tk.attention import reference
from helpers import attention_inputs, rel_err, sink_attention_oracle

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
TOL = {F32: 1e-5, BF16: 1e-2, F16: 2e-3}

# Jitted entry points (one compilation per shape/option set instead of one per eager op).
ref_attention = jax.jit(reference.attention, static_argnames=("scale", "is_causal"))
ref_attention_with_lse = jax.jit(reference.attention_with_lse, static_argnames=("scale", "is_causal"))


_qkv = attention_inputs


def _f64(x):
    return np.asarray(x).astype(np.float64)


_rel_err = rel_err


def numpy_attention(q, k, v, scale, is_causal):
    """softmax(scale * q k^T) v in float64 numpy, written out head by head.

    q: [B, T, N, D]; k, v: [B, S, K, D]; query head h reads key/value head h // (N // K).
    Causal: query i sees key j iff j <= i (top-left aligned).
    Returns out [B, T, N, D] and lse [B, N, T], both float64.
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    b, t, n, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    group = n // kh
    out = np.empty((b, t, n, d))
    lse = np.empty((b, n, t))
    allowed = np.arange(s)[None, :] <= np.arange(t)[:, None]  # [T, S]
    for bi in range(b):
        for h in range(n):
            g = h // group
            logits = scale * (q[bi, :, h, :] @ k[bi, :, g, :].T)  # [T, S]
            if is_causal:
                logits = np.where(allowed, logits, -np.inf)
            m = logits.max(axis=1, keepdims=True)
            e = np.exp(logits - m)
            denom = e.sum(axis=1, keepdims=True)
            out[bi, :, h, :] = (e / denom) @ v[bi, :, g, :]
            lse[bi, h, :] = (m + np.log(denom))[:, 0]
    return out, lse


# (B, T, S, N, K, D): square, cross attention (T < S and T > S), grouped-query, odd lengths.
SHAPES = [
    (2, 16, 16, 4, 4, 32),
    (1, 17, 33, 4, 2, 16),  # T < S, GQA
    (2, 33, 17, 4, 1, 16),  # T > S, multi-query
    (1, 1, 1, 2, 2, 8),
    (1, 1, 65, 4, 2, 16),  # single query row
    (1, 65, 1, 2, 1, 16),  # single key
    (1, 130, 65, 2, 2, 64),
    (1, 65, 130, 6, 3, 128),
]
_ids = ["B{}_T{}_S{}_N{}_K{}_D{}".format(*s) for s in SHAPES]


@functools.partial(jax.jit, static_argnames=("scale",))
def _ref_both(q, k, v, scale):
    """reference.attention_with_lse, full and causal, in one compilation."""
    return tuple(reference.attention_with_lse(q, k, v, scale=scale, is_causal=c) for c in (False, True))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_reference_vs_numpy(shape, dtype):
    b, t, s, n, kh, d = shape
    q, k, v = _qkv(10 + sum(shape), b, t, s, n, kh, d, dtype)
    scale = 1.0 / math.sqrt(d)
    for is_causal, (out, lse) in zip((False, True), _ref_both(q, k, v, scale=scale)):
        assert out.shape == (b, t, n, d) and out.dtype == dtype
        assert lse.shape == (b, n, t) and lse.dtype == F32
        ref_out, ref_lse = numpy_attention(q, k, v, scale, is_causal)
        assert _rel_err(out, ref_out) < TOL[dtype], f"is_causal={is_causal}"
        # lse is float32 whatever the input dtype (computed from the same rounded inputs).
        assert _rel_err(lse, ref_lse) < 1e-5, f"is_causal={is_causal}"
        np.testing.assert_allclose(_f64(lse), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale", [0.05, 2.5])
def test_reference_custom_scale(scale):
    q, k, v = _qkv(20, 2, 9, 13, 4, 2, 16, F32)
    for is_causal, (out, lse) in zip((False, True), _ref_both(q, k, v, scale=scale)):
        ref_out, ref_lse = numpy_attention(q, k, v, scale, is_causal)
        assert _rel_err(out, ref_out) < 1e-5
        np.testing.assert_allclose(_f64(lse), ref_lse, rtol=1e-5, atol=1e-5)


def test_reference_fp16():
    q, k, v = _qkv(21, 1, 17, 33, 4, 2, 32, F16)
    for is_causal, (out, lse) in zip((False, True), _ref_both(q, k, v, scale=0.2)):
        assert out.dtype == F16
        ref_out, ref_lse = numpy_attention(q, k, v, 0.2, is_causal)
        assert _rel_err(out, ref_out) < TOL[F16]
        np.testing.assert_allclose(_f64(lse), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t,s", [(9, 9), (5, 12), (12, 5)])
def test_causal_semantics(t, s):
    """Causal row i equals full attention over the first i + 1 keys only (top-left alignment)."""
    q, k, v = _qkv(22, 1, t, s, 2, 1, 8, F32)
    out, lse = ref_attention_with_lse(q, k, v, scale=0.4, is_causal=True)
    qn, kn, vn, out, lse = (np.asarray(x) for x in (q, k, v, out, lse))
    for i in range(t):
        j = min(i + 1, s)
        row_out, row_lse = numpy_attention(qn[:, i : i + 1], kn[:, :j], vn[:, :j], 0.4, False)
        np.testing.assert_allclose(out[:, i : i + 1], row_out, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse[:, :, i : i + 1], row_lse, rtol=1e-5, atol=1e-5)
    # Changing keys/values that no row can see (j >= t) leaves the output unchanged.
    if s > t:
        rng = np.random.default_rng(23)
        k2, v2 = kn.copy(), vn.copy()
        k2[:, t:] = rng.standard_normal(k2[:, t:].shape)
        v2[:, t:] = rng.standard_normal(v2[:, t:].shape)
        out2, lse2 = ref_attention_with_lse(q, k2, v2, scale=0.4, is_causal=True)
        np.testing.assert_array_equal(np.asarray(out2), np.asarray(out))
        np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))


def test_gqa_matches_repeated_heads():
    """Grouped-query attention equals multi-head attention with each kv head repeated N//K times."""
    q, k, v = _qkv(24, 2, 11, 7, 6, 2, 16, F32)
    out = ref_attention(q, k, v, scale=0.25, is_causal=False)
    k_rep = np.repeat(np.asarray(k), 3, axis=2)
    v_rep = np.repeat(np.asarray(v), 3, axis=2)
    ref_out, _ = numpy_attention(q, k_rep, v_rep, 0.25, False)
    assert _rel_err(out, ref_out) < 1e-5


def test_causal_mask_helper():
    m = np.asarray(reference.causal_mask(3, 5))
    expected = np.array(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=bool
    )
    np.testing.assert_array_equal(m, expected)
    np.testing.assert_array_equal(np.asarray(reference.causal_mask(4, 2)), np.tril(np.ones((4, 2), bool)))


# ----------------------------------------------------------------------------------------------
# jax_tk.attention on CPU vs jax.nn.dot_product_attention
# ----------------------------------------------------------------------------------------------

NN_SHAPES = [
    (2, 16, 16, 4, 4, 32),
    (1, 17, 33, 4, 2, 64),
    (2, 33, 17, 8, 2, 16),
    (1, 1, 65, 4, 1, 64),
    (1, 65, 1, 2, 2, 16),
]


@jax.jit
def _all_implementations(q, k, v):
    """jax_tk.attention (None and "xla") and jax.nn.dot_product_attention (in the input dtype and
    in float32 from the same rounded inputs), full and causal, in one compilation."""
    q32, k32, v32 = (x.astype(F32) for x in (q, k, v))
    results = {}
    for c in (False, True):
        results[c] = dict(
            none=jax_tk.attention(q, k, v, is_causal=c, implementation=None),
            xla=jax_tk.attention(q, k, v, is_causal=c, implementation="xla"),
            nn=jax.nn.dot_product_attention(q, k, v, is_causal=c, implementation="xla"),
            nn32=jax.nn.dot_product_attention(q32, k32, v32, is_causal=c, implementation="xla"),
        )
    return results


@pytest.mark.parametrize("dtype", [F32, BF16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", NN_SHAPES, ids=["B{}_T{}_S{}_N{}_K{}_D{}".format(*s) for s in NN_SHAPES])
def test_attention_vs_jax_nn(shape, dtype):
    b, t, s, n, kh, d = shape
    q, k, v = _qkv(30 + sum(shape), b, t, s, n, kh, d, dtype)
    scale = 1.0 / math.sqrt(d)
    results = _all_implementations(q, k, v)
    for is_causal in (False, True):
        r = results[is_causal]
        ref = numpy_attention(q, k, v, scale, is_causal)[0]
        assert r["nn"].dtype == dtype
        for implementation in ("none", "xla"):
            ours = r[implementation]
            msg = f"implementation={implementation} is_causal={is_causal}"
            assert ours.shape == (b, t, n, d) and ours.dtype == dtype, msg
            # jax.nn in float32 from the same rounded inputs: the better oracle for low precision.
            assert _rel_err(ours, r["nn32"]) < TOL[dtype], msg
            assert _rel_err(ours, r["nn"]) < TOL[dtype], msg
            # And the independent numpy oracle.
            assert _rel_err(ours, ref) < TOL[dtype], msg


@functools.partial(jax.jit, static_argnames=("scale",))
def _custom_scale(q, k, v, scale):
    results = {}
    for c in (False, True):
        results[c] = dict(
            none=jax_tk.attention_with_lse(q, k, v, scale=scale, is_causal=c, implementation=None),
            xla=jax_tk.attention_with_lse(q, k, v, scale=scale, is_causal=c, implementation="xla"),
            nn=jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=c, implementation="xla"),
        )
    return results


@pytest.mark.parametrize("dtype,scale", [(F32, 0.1), (BF16, 0.7)], ids=["float32-0.1", "bfloat16-0.7"])
def test_custom_scale_and_lse(dtype, scale):
    q, k, v = _qkv(40, 2, 19, 23, 4, 2, 64, dtype)
    results = _custom_scale(q, k, v, scale=scale)
    for is_causal in (False, True):
        r = results[is_causal]
        ref_out, ref_lse = numpy_attention(q, k, v, scale, is_causal)
        for implementation in ("none", "xla"):
            out, lse = r[implementation]
            msg = f"implementation={implementation} is_causal={is_causal}"
            assert _rel_err(out, ref_out) < TOL[dtype], msg
            assert _rel_err(out, r["nn"]) < TOL[dtype], msg
            np.testing.assert_allclose(_f64(lse), ref_lse, rtol=1e-5, atol=1e-5, err_msg=msg)


# ----------------------------------------------------------------------------------------------
# Attention sinks (the reference only)
# ----------------------------------------------------------------------------------------------


def _sink_oracle(q, k, v, scale, sinks, is_causal, kv_lengths):
    """The dense oracle (helpers.sink_attention_oracle): query i sees key j < kv_lengths[b] (and j <= i
    if causal)."""
    i, j = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
    visible = (j[None] < kv_lengths[:, None, None]) & ((j <= i)[None] if is_causal else True)  # [B, T, S]
    return sink_attention_oracle(q, k, v, visible, scale, sinks)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_reference_sinks(is_causal):
    """sinks [heads] join each row's softmax denominator (no value): out, lse, and the gradients in q,
    k, v and sinks equal a dense oracle; a row that sees no key (key length 0) gives 0 and lse = its
    sink; a sink far above the logits (100) does not overflow; sinks=None is the plain softmax."""
    b, t, s, n, kh, d = 3, 9, 13, 4, 2, 16
    q, k, v, dout, dlse = _qkv(50, b, t, s, n, kh, d, F32, cotangents=True)
    sinks = jnp.array([0.3, -2.0, 100.0, 1.5], F32)
    kv_lengths = jnp.array([13, 0, 6], jnp.int32)

    def grad(fn):
        def f(q, k, v, sinks):
            out, lse = fn(q, k, v, sinks)
            return jnp.sum(out * dout) + jnp.sum(lse * dlse), (out, lse)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3), has_aux=True))

    grads, (out, lse) = grad(lambda q, k, v, sk: reference.attention_with_lse(
        q, k, v, scale=0.3, is_causal=is_causal, key_value_seq_lengths=kv_lengths, sinks=sk))(q, k, v, sinks)
    want_grads, (want_out, want_lse) = grad(
        lambda q, k, v, sk: _sink_oracle(q, k, v, 0.3, sk, is_causal, kv_lengths))(q, k, v, sinks)
    assert _rel_err(out, want_out) < 1e-5
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)
    assert not np.asarray(out[1]).any()
    np.testing.assert_array_equal(np.asarray(lse[1]), np.broadcast_to(np.asarray(sinks)[:, None], (n, t)))
    for name, g, w in zip(("q", "k", "v", "sinks"), grads, want_grads):
        assert np.isfinite(np.asarray(g)).all() and _rel_err(g, w) < 1e-5, name
    # a sink of -inf is no sink
    none, minus_inf = jax.jit(lambda q, k, v: [reference.attention_with_lse(q, k, v, scale=0.3, is_causal=is_causal,
                                                                            sinks=sk)
                                               for sk in (None, jnp.full((n,), -jnp.inf))])(q, k, v)
    np.testing.assert_allclose(np.asarray(minus_inf[0]), np.asarray(none[0]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(minus_inf[1]), np.asarray(none[1]), rtol=1e-6, atol=1e-6)
