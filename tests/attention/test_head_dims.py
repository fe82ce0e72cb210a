"""CPU tests of unequal head dims in jax_tk.attention: key ``[..., S, K, D_qk]``, value ``[..., S, K, D_v]``
with ``D_v <= D_qk`` (Multi-head Latent Attention trains with 192 and 128). The reference path (through
the op, ``implementation="xla"``) against an independent float64 numpy attention with an analytic
backward, for every masking option, GQA, bias, soft cap and sinks on odd lengths; the op's shapes on
its other paths (rank 3, several batch dims, vmap, jit, a traced scale, empty calls, short queries
that would take the decode kernel); the default scale ``1/sqrt(D_qk)``; the errors; the lowering for
CUDA. Ring attention and sharding with (192, 128): test_ring.py and test_sharding.py."""
import functools
import math
import re
import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from helpers import attention_inputs, needs_extension, randn, rel_err
from jax_tk.attention import api, launch, reference
from jax_tk.attention.api import AttentionSpec

BF16, F32 = jnp.bfloat16, jnp.float32
PAIRS = [(192, 128), (128, 64), (64, 32), (64, 64)]  # (D_qk, D_v)
_pair_ids = [f"qk{a}_v{b}" for a, b in PAIRS]
B, T, S = 2, 77, 131


def _f64(x):
    return np.asarray(x).astype(np.float64)


# ----------------------------------------------------------------------------------------------
# The float64 numpy oracle: forward and its analytic backward
# ----------------------------------------------------------------------------------------------


def numpy_visible(b, t, s, *, is_causal=False, local_window_size=None, q_segment_ids=None, kv_segment_ids=None,
                  query_seq_lengths=None, key_value_seq_lengths=None, mask=None):
    """Boolean [b, 1 or heads, t, s]: which key each query row sees (every rule must hold)."""
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    vis = np.ones((b, 1, t, s), bool)
    if is_causal:
        vis &= j <= i
    if local_window_size is not None:
        left, right = local_window_size
        vis &= (j >= i - left) & (j <= i + right)
    if q_segment_ids is not None:
        vis &= (np.asarray(q_segment_ids)[:, :, None] == np.asarray(kv_segment_ids)[:, None, :])[:, None]
    if query_seq_lengths is not None:
        vis &= (i[None] < np.asarray(query_seq_lengths)[:, None, None])[:, None]
    if key_value_seq_lengths is not None:
        vis &= (j[None] < np.asarray(key_value_seq_lengths)[:, None, None])[:, None]
    if mask is not None:
        vis = vis & np.asarray(mask)
    return vis


def numpy_attention(q, k, v, visible, scale, *, softcap=None, bias=None, sinks=None, dout=None, dlse=None):
    """Softmax attention in float64, written out: q [B, T, N, D_qk], k [B, S, K, D_qk], v [B, S, K, D_v],
    query head h reads key/value head h // (N // K); ``visible`` [B, 1 or N, T, S]; logits
    ``cap * tanh(scale q.k / cap) + bias``; ``sinks`` [N]: one more logit per row, without a value.
    Returns (out [B, T, N, D_v], lse [B, N, T]; a row that sees nothing: 0 and -inf) and, given the
    cotangents ``dout``, ``dlse`` of out and lse, also (dq, dk, dv, dlogits [B, N, T, S], dsinks [N])."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    b, t, n, _ = q.shape
    g = n // k.shape[2]
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    raw = scale * np.einsum("btnd,bsnd->bnts", q, kr)
    tanh = np.tanh(raw / softcap) if softcap else None
    logits = softcap * tanh if softcap else raw
    if bias is not None:
        logits = logits + _f64(bias)
    logits = np.where(np.broadcast_to(visible, logits.shape), logits, -np.inf)
    if sinks is not None:
        logits = np.concatenate([np.broadcast_to(_f64(sinks)[None, :, None, None], (b, n, t, 1)), logits], -1)
    m = logits.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(logits - m)
    denom = e.sum(axis=-1)
    seen = denom > 0
    p = e / np.where(seen, denom, 1.0)[..., None]
    lse = np.where(seen, m[..., 0] + np.log(np.where(seen, denom, 1.0)), -np.inf)
    p_sink, p = (p[..., 0], p[..., 1:]) if sinks is not None else (None, p)
    out = np.einsum("bnts,bsne->btne", p, vr)
    if dout is None:
        return out, lse
    do, dl = _f64(dout), np.where(seen, _f64(dlse), 0.0)
    delta = np.einsum("btne,btne->bnt", do, out)  # rowsum(dout * out)
    dp = np.einsum("btne,bsne->bnts", do, vr)
    dlogits = p * (dp - delta[..., None] + dl[..., None])  # (d lse / d logit_j = p_j)
    draw = dlogits * (1 - tanh ** 2) if softcap else dlogits
    dq = scale * np.einsum("bnts,bsnd->btnd", draw, kr)
    group_sum = lambda x: x.reshape(*x.shape[:2], -1, g, x.shape[-1]).sum(axis=3)
    dk = group_sum(scale * np.einsum("bnts,btnd->bsnd", draw, q))
    dv = group_sum(np.einsum("bnts,btne->bsne", p, do))
    dsinks = None if sinks is None else (p_sink * (dl - delta)).sum(axis=(0, 2))
    return out, lse, dq, dk, dv, dlogits, dsinks


# ----------------------------------------------------------------------------------------------
# The reference path against the oracle
# ----------------------------------------------------------------------------------------------


def _options(name, rng):
    """The keyword arguments of one case (arrays fresh from ``rng``); "all" combines every one."""
    ids = lambda n: jnp.asarray(np.sort(rng.integers(0, 3, (B, n)), axis=1).astype(np.int32))
    masks = {
        "plain": {},
        "causal": dict(is_causal=True),
        "window": dict(local_window_size=(20, 7)),
        "segments": dict(q_segment_ids=ids(T), kv_segment_ids=ids(S)),
        # entry 0 sees no key at all
        "lengths": dict(query_seq_lengths=jnp.array([T, 50], jnp.int32),
                        key_value_seq_lengths=jnp.array([0, 100], jnp.int32)),
        "mask": dict(mask=jnp.asarray(rng.random((B, 1, T, S)) > 0.3)),
        "bias": dict(bias=randn(rng, (1, 8, T, S), F32)),
        "softcap": dict(logits_soft_cap=3.0),
        "sinks": dict(sinks=jnp.asarray(rng.normal(size=8), F32).at[1].set(4.0)),
    }
    if name != "all":
        return masks[name]
    opts = {}
    for part in masks.values():
        opts.update(part)
    opts["key_value_seq_lengths"] = jnp.array([S, 0], jnp.int32)
    return opts


@functools.partial(jax.jit, static_argnames=("static",))
def _op_values_and_grads(q, k, v, do, dl, bias, sinks, arrays, static):
    """(out, lse) of jax_tk.attention_with_lse(implementation="xla") and the gradients of
    sum(out * do) + sum(lse * dl) (rows whose lse is -inf left out) w.r.t. q, k, v, bias, sinks."""
    opts = dict(static, **arrays)

    def loss(q, k, v, bias, sinks):
        out, lse = jax_tk.attention_with_lse(q, k, v, bias, implementation="xla", sinks=sinks, **opts)
        fin = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out * do) + jnp.sum(fin * dl), (out, lse)

    argnums = (0, 1, 2) + ((3,) if bias is not None else ()) + ((4,) if sinks is not None else ())
    (_, (out, lse)), grads = jax.value_and_grad(loss, argnums, has_aux=True)(q, k, v, bias, sinks)
    return out, lse, grads


def _check(name, got, want, tol=2e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert not np.isnan(got).any(), name
    assert np.array_equal(np.isneginf(got), np.isneginf(want)), f"{name}: -inf in other places"
    fin = np.isfinite(want)
    err = rel_err(got[fin], want[fin], floor=1e-3)
    assert err < tol, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("case", ["plain", "causal", "window", "segments", "lengths", "mask", "bias", "softcap",
                                  "sinks", "all"])
@pytest.mark.parametrize("d,dv", PAIRS, ids=_pair_ids)
def test_reference_matches_numpy(d, dv, case):
    rng = np.random.default_rng(zlib.crc32(repr((d, dv, case)).encode()))
    n, kh = (8, 2) if case != "plain" else (8, 8)  # GQA, and plain multi-head
    q, k, v, do, dl = attention_inputs(d * 7 + dv, B, T, S, n, kh, d, F32, cotangents=True, dv=dv)
    opts = _options(case, rng)
    bias, sinks = opts.pop("bias", None), opts.pop("sinks", None)
    arrays = {key: x for key, x in opts.items() if isinstance(x, jax.Array)}
    static = tuple(sorted((key, x) for key, x in opts.items() if key not in arrays))
    out, lse, grads = _op_values_and_grads(q, k, v, do, dl, bias, sinks, arrays, static)

    scale = 1 / math.sqrt(d)
    masking = {key: x for key, x in opts.items() if key != "logits_soft_cap"}
    vis = numpy_visible(B, T, S, **masking)
    want = numpy_attention(q, k, v, vis, scale, softcap=opts.get("logits_soft_cap"), bias=bias, sinks=sinks,
                           dout=do, dlse=dl)
    assert out.shape == (B, T, n, dv) and lse.shape == (B, n, T)
    _check("out", out, want[0])
    _check("lse", lse, want[1])
    if case in ("lengths", "all"):  # the rows that see no key: out 0, lse -inf (the sink with sinks)
        assert np.all(np.asarray(out[0] if case == "lengths" else out[1]) == 0)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want[2:5]):
        _check(name, g, w)
    rest = list(grads[3:])
    if bias is not None:
        _check("dbias", rest.pop(0), want[5].sum(axis=0, keepdims=True))
    if sinks is not None:
        _check("dsinks", rest.pop(0), want[6], tol=1e-4)


@pytest.mark.parametrize("d,dv", PAIRS[:2], ids=_pair_ids[:2])
def test_reference_module_directly(d, dv):
    """jax_tk.attention.reference itself (the oracle of the GPU tests), with jax.vjp."""
    q, k, v, do, dl = attention_inputs(3, B, T, S, 8, 2, d, F32, cotangents=True, dv=dv)
    scale = 0.3
    f = functools.partial(reference.attention_with_lse, scale=scale, is_causal=True, local_window_size=(40, 3))
    (out, lse), vjp = jax.vjp(f, q, k, v)
    grads = vjp((do, dl))
    want = numpy_attention(q, k, v, numpy_visible(B, T, S, is_causal=True, local_window_size=(40, 3)), scale,
                           dout=do, dlse=dl)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), want):
        _check(name, g, w)


# ----------------------------------------------------------------------------------------------
# The op's shapes on its other paths
# ----------------------------------------------------------------------------------------------


def _qkv(seed, b=2, t=9, s=13, n=4, kh=2, d=192, dv=128, dtype=F32):
    return attention_inputs(seed, b, t, s, n, kh, d, dtype, dv=dv)


def _ref(q, k, v, scale=None, **kw):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    f32 = lambda x: x.astype(F32)
    out, lse = reference.attention_with_lse(f32(q), f32(k), f32(v), scale=scale, is_causal=kw.pop("is_causal", False),
                                            **kw)
    return out, lse


def _close(got, want, tol=1e-5):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("implementation", ["xla", None], ids=["xla", "default"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("d,dv", PAIRS[:3], ids=_pair_ids[:3])
def test_output_shapes_and_default_scale(d, dv, dtype, implementation):
    q, k, v = _qkv(1, d=d, dv=dv, dtype=dtype)
    fn = jax.jit(functools.partial(jax_tk.attention_with_lse, is_causal=True, implementation=implementation))
    out, lse = fn(q, k, v)
    assert out.shape == (2, 9, 4, dv) and out.dtype == dtype and lse.shape == (2, 4, 9) and lse.dtype == F32
    want = _ref(q, k, v, is_causal=True)  # scale 1/sqrt(D_qk)
    tol = 1e-5 if dtype == F32 else 2e-2
    _close(out, want[0].astype(dtype), tol)
    _close(lse, want[1], tol)
    explicit = jax_tk.attention(q, k, v, is_causal=True, scale=1 / math.sqrt(d), implementation=implementation)
    _close(out, explicit, 1e-6)
    if d != dv:
        other = jax_tk.attention(q, k, v, is_causal=True, scale=1 / math.sqrt(dv), implementation=implementation)
        assert not np.allclose(np.asarray(out, np.float32), np.asarray(other, np.float32), atol=1e-3)
    res = jax_tk.attention(q, k, v, is_causal=True, return_residual=True, implementation=implementation)[1]
    assert res.shape == (2, 9, 4)


def test_rank3_and_several_batch_dims():
    q, k, v = _qkv(2, b=6)
    out3, lse3 = jax_tk.attention_with_lse(q[0], k[0], v[0], is_causal=True)
    assert out3.shape == (9, 4, 128) and lse3.shape == (4, 9)
    out4, lse4 = jax_tk.attention_with_lse(q[:1], k[:1], v[:1], is_causal=True)
    _close(out3, out4[0], 1e-6)
    _close(lse3, lse4[0], 1e-6)
    split = lambda x: x.reshape(2, 3, *x.shape[1:])
    ids = jnp.asarray(np.repeat(np.arange(3), [4, 3, 2])[None].repeat(6, 0).reshape(2, 3, 9), jnp.int32)
    kv_ids = jnp.asarray(np.repeat(np.arange(3), [5, 4, 4])[None].repeat(6, 0).reshape(2, 3, 13), jnp.int32)
    out5, lse5 = jax_tk.attention_with_lse(split(q), split(k), split(v), q_segment_ids=ids, kv_segment_ids=kv_ids)
    assert out5.shape == (2, 3, 9, 4, 128) and lse5.shape == (2, 3, 4, 9)
    want = jax_tk.attention_with_lse(q, k, v, q_segment_ids=ids.reshape(6, 9), kv_segment_ids=kv_ids.reshape(6, 13))
    _close(out5.reshape(want[0].shape), want[0], 1e-6)
    _close(lse5.reshape(want[1].shape), want[1], 1e-6)


@pytest.mark.parametrize("mapped", ["qkv", "q", "kv"])
def test_vmap(mapped):
    e = 3
    sets = [_qkv(10 + i) for i in range(e)]
    q, k, v = (jnp.stack(x) for x in zip(*sets))
    axes = {"qkv": (0, 0, 0), "q": (0, None, None), "kv": (None, 0, 0)}[mapped]
    args = [x if a is not None else x[0] for x, a in zip((q, k, v), axes)]
    op = lambda q, k, v: jax_tk.attention_with_lse(q, k, v, is_causal=True)
    out, lse = jax.jit(jax.vmap(op, in_axes=axes))(*args)
    assert out.shape == (e, 2, 9, 4, 128)
    loss = lambda q, k, v: jnp.sum(jnp.sin(op(q, k, v)[0]))
    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=axes))(*args)
    for i in range(e):
        one = [x[i] if a is not None else x for x, a in zip(args, axes)]
        want = _ref(*one, is_causal=True)
        _close(out[i], want[0])
        _close(lse[i], want[1])
        ref_loss = lambda q, k, v: jnp.sum(jnp.sin(_ref(q, k, v, is_causal=True)[0]))
        want_grads = jax.grad(ref_loss, argnums=(0, 1, 2))(*one)
        for g, w in zip(grads, want_grads):
            assert g[i].shape == w.shape and rel_err(g[i], w) < 1e-5


def test_traced_scale_bias_gradient_and_deterministic_backward():
    q, k, v = _qkv(4)
    bias = randn(np.random.default_rng(5), (1, 4, 9, 13), F32)
    loss = lambda fn: lambda q, k, v, b, s: jnp.sum(jnp.sin(fn(q, k, v, b, s)))
    op = lambda q, k, v, b, s: jax_tk.attention(q, k, v, b, scale=s, deterministic_backward=True)
    ref = lambda q, k, v, b, s: reference.attention(q * s, k, v, bias=b, scale=1.0, is_causal=False)
    args = (q, k, v, bias, jnp.float32(0.2))
    got = jax.jit(jax.grad(loss(op), argnums=(0, 1, 2, 3, 4)))(*args)
    want = jax.grad(loss(ref), argnums=(0, 1, 2, 3, 4))(*args)
    for g, w in zip(got, want):
        assert g.shape == w.shape and rel_err(g, w) < 1e-5


def test_flax_keywords():
    """The keywords Flax passes to an attention_fn (dtype casts, no active dropout)."""
    q, k, v = _qkv(6, dtype=BF16)
    out = jax_tk.attention(q, k, v, dtype=F32, dropout_rate=0.0, deterministic=True, precision=None,
                           broadcast_dropout=True)
    assert out.shape == (2, 9, 4, 128) and out.dtype == F32
    _close(out, _ref(q, k, v)[0])


@pytest.mark.parametrize("b,t,s", [(0, 9, 13), (2, 0, 13), (2, 9, 0)])
def test_empty_calls(b, t, s):
    q, k, v = _qkv(7, b=b, t=t, s=s)
    sinks = jnp.array([0.5, -1.0, 2.0, 0.0], F32)
    for kw in ({}, {"sinks": sinks}):
        out, lse = jax.jit(lambda q, k, v: jax_tk.attention_with_lse(q, k, v, **kw))(q, k, v)
        assert out.shape == (b, t, 4, 128) and lse.shape == (b, 4, t)
        assert not np.asarray(out).any()
        grads = jax.grad(lambda q, k, v: jnp.sum(jax_tk.attention(q, k, v, **kw)), argnums=(0, 1, 2))(q, k, v)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize("d,dv", PAIRS[:2], ids=_pair_ids[:2])
def test_short_queries_over_many_keys(d, dv):
    """The shapes that take jax_tk.decode's kernel for equal head dims (whose caches are key and value of one
    shape) take attention's path instead."""
    q, k, v = _qkv(8, t=3, s=600, n=8, kh=2, d=d, dv=dv, dtype=BF16)
    assert not api.takes_decode(q, k, v, AttentionSpec(0.1, False, True))
    out, lse = jax.jit(jax_tk.attention_with_lse)(q, k, v)
    want = _ref(q, k, v)
    assert out.shape == (2, 3, 8, dv)
    assert rel_err(out, want[0]) < 1e-2 and rel_err(lse, want[1]) < 1e-3


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------

_sds = lambda shape, dtype=BF16: jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("fn", [jax_tk.attention, jax_tk.attention_with_lse], ids=["attention", "with_lse"])
@pytest.mark.parametrize("v_shape,match", [
    ((2, 16, 2, 256), r"head_dim of value \(256\) must be <= head_dim of query and key \(192\)"),
    ((3, 16, 2, 128),
     r"key and value must have the same shape but for head_dim.*\(2, 16, 2, 192\) and \(3, 16, 2, 128\)"),
    ((2, 15, 2, 128), r"key and value must have the same shape but for head_dim"),
    ((2, 16, 4, 128), r"key and value must have the same shape but for head_dim"),
], ids=["value_larger", "batch", "seq", "heads"])
def test_bad_value_shapes(fn, v_shape, match):
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(fn, _sds((2, 8, 4, 192)), _sds((2, 16, 2, 192)), _sds(v_shape))


def test_bad_value_shapes_rank3_and_several_batch_dims():
    with pytest.raises(ValueError, match=r"head_dim of value \(96\) must be <= head_dim of query and key \(64\)"):
        jax.eval_shape(jax_tk.attention, _sds((8, 4, 64)), _sds((16, 2, 64)), _sds((16, 2, 96)))
    with pytest.raises(ValueError, match=r"same leading batch dims"):
        jax.eval_shape(jax_tk.attention, _sds((2, 3, 8, 4, 64)), _sds((2, 3, 16, 2, 64)), _sds((3, 2, 16, 2, 32)))


def test_cudnn_refuses_unequal_head_dims():
    q, k, v = _qkv(9, dtype=BF16)
    match = r"implementation='cudnn'.*query/key head_dim 192 with value head_dim 128.*use implementation=None"
    for fn in (jax_tk.attention, jax_tk.attention_with_lse):
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(functools.partial(fn, implementation="cudnn"), q, k, v)


def test_ring_attention_refuses_larger_value_head_dim():
    mesh = jax.make_mesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    f = lambda q, k, v: jax_tk.ring_attention(q, k, v, axis_name="sp")
    seq = jax.sharding.PartitionSpec(None, "sp")
    with pytest.raises(ValueError, match=r"ring_attention: head_dim of value \(256\) must be <="):
        jax.eval_shape(jax.shard_map(f, mesh=mesh, in_specs=(seq,) * 3, out_specs=seq),
                       _sds((1, 8, 2, 192)), _sds((1, 8, 2, 192)), _sds((1, 8, 2, 256)))


# ----------------------------------------------------------------------------------------------
# Lowering for CUDA (no GPU needed)
# ----------------------------------------------------------------------------------------------


@needs_extension
@pytest.mark.parametrize("d,dv", PAIRS[:3], ids=_pair_ids[:3])
def test_cuda_lowering(d, dv):
    """The program exported for CUDA has the value's head dim in its output and dv, and calls the kernels
    exactly where the dispatch says they take the call."""
    q, k, v = (_sds(x.shape) for x in _qkv(0, d=d, dv=dv, dtype=BF16))
    loss = lambda q, k, v: jnp.sum(jax_tk.attention(q, k, v, is_causal=True).astype(F32))
    fn = jax.jit(lambda q, k, v: (jax_tk.attention(q, k, v, is_causal=True),
                                  jax.grad(loss, argnums=(0, 1, 2))(q, k, v)))
    names = ("jax_tk_attention_fwd", "jax_tk_attention_bwd")
    checks = [jax.export.DisabledSafetyCheck.custom_call(name) for name in names]
    exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=checks)(q, k, v)
    assert [a.shape for a in exported.out_avals] == [(2, 9, 4, dv), q.shape, k.shape, v.shape]
    text = exported.mlir_module()
    calls = [name for name in names if f"stablehlo.custom_call @{name}" in text]
    assert bool(calls) == api.use_kernel(q, k, v, None), calls
    if calls:
        assert calls == list(names)


@needs_extension
@pytest.mark.parametrize("d,dv", PAIRS[:3], ids=_pair_ids[:3])
def test_backward_kernel_operands(d, dv):
    """The backward kernel's call, exported for CUDA: MLA's pair goes in as it is (its own kernel); a
    smaller value head dim otherwise is padded to the query's (value, out and dout), and dv sliced back."""
    q, k, v = (_sds(x.shape) for x in _qkv(0, d=d, dv=dv, dtype=BF16))
    b, t, n, _ = q.shape
    out, dout = _sds((b, t, n, dv)), _sds((b, t, n, dv))
    lse = dlse = jax.ShapeDtypeStruct((b, n, t), F32)
    spec = AttentionSpec(0.1, True, True)
    fn = jax.jit(lambda *a: launch.bwd_kernel(*a, spec))
    check = jax.export.DisabledSafetyCheck.custom_call("jax_tk_attention_bwd")
    exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=[check])(q, k, v, out, lse, dout, dlse)
    assert [a.shape for a in exported.out_avals] == [q.shape, k.shape, v.shape]
    call = re.search(r"@jax_tk_attention_bwd\(.*?\) \{.*?\} : \((.*?)\) ->", exported.mlir_module(), re.S)
    types = re.findall(r"tensor<([^>]*)>", call.group(1))
    width = dv if (d, dv) == launch.mla_pair() else d
    assert [x.split("x")[3] for i, x in enumerate(types[:6]) if i in (2, 3, 5)] == [str(width)] * 3, types[:6]


@needs_extension
def test_mla_pair_off_hopper_warns(monkeypatch):
    """On a GPU without the sm_90a kernels (an A100, say) MLA's pair runs the reference, and says so;
    where there is no GPU, nothing is said."""
    from jax_tk._core import dispatch, extension

    q, k, v = (_sds(x.shape) for x in _qkv(0, d=192, dv=128, dtype=BF16))
    monkeypatch.setattr(extension, "cuda_device_capability", lambda: (8, 0))
    dispatch._warn_once.cache_clear()
    with pytest.warns(RuntimeWarning, match="192, 128.*runs the pure-JAX reference"):
        assert not api.use_kernel(q, k, v, None)
    monkeypatch.setattr(extension, "cuda_device_capability", lambda: None)
    dispatch._warn_once.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not api.use_kernel(q, k, v, None)
