"""GPU tests of the attention kernels with unequal head dims, MLA's query/key 192 and value 128 (bf16),
against the float32 reference (skipped without a GPU; the pair runs on H100/H200 only).

As in test_kernels_gpu.py, the kernels are called directly with every output (and workspace) poisoned
with NaN through the ``out_init`` test hook, so an element a kernel forgets to write shows up; errors
are relative, ``norm(x - ref) / norm(ref)``, against jax_tk.reference in float32 from the same rounded
inputs. Sweep: causal and full, GQA 16/4 and 8/8, lengths 1 to 1031 (odd ones, T != S); then the
masking options, the deterministic backward, sinks and vmap, the last two through
``jax_tk.attention(implementation="tk")``."""
import functools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
import helpers
from jax_tk._core import dispatch, extension
from jax_tk.attention import api, reference
from jax_tk.attention.api import AttentionSpec
from jax_tk.attention.launch import Masks, bwd_kernel, bwd_workspace_shape, fwd_kernel, padded_rows_keys

pytestmark = pytest.mark.gpu
BF16, F32 = jnp.bfloat16, jnp.float32
D, DV = 192, 128
SCALE = 1 / math.sqrt(D)
RTOL = 1e-2  # out, dq, dk, dv: norm(x - ref) / norm(ref)
LSE_TOL = 1e-3  # lse: max |x - ref| / max(1, max |ref|)


@pytest.fixture(autouse=True)
def _hopper_only():
    if not extension.takes_sm90_kernels(extension.cuda_device_capability(), dispatch.kernel_variant()):
        pytest.skip("head dims (192, 128) run in the sm_90a kernels (H100/H200, JAX_TK_KERNELS=auto) only")


def _seed(*case):
    return zlib.crc32(repr(case).encode())


def _inputs(seed, b, t, s, n, kh):
    """Fresh standard-normal q [b, t, n, 192], k [b, s, kh, 192], v [b, s, kh, 128], dout [b, t, n, 128]
    (bf16) and dlse [b, n, t] (float32)."""
    q, k, v, dout, dlse = helpers.attention_inputs(seed, b, t, s, n, kh, D, BF16, cotangents=True, dv=DV)
    return q, k, v, dout, dlse.astype(F32)


def _assert_close(name, x, ref, tol=RTOL):
    x = np.asarray(x, np.float32)
    bad = ~np.isfinite(x)
    assert not bad.any(), f"{name}: {bad.sum()} of {x.size} values are NaN/inf (first at {np.argwhere(bad)[0]})"
    err = helpers.rel_err(x, ref, floor=1e-4)
    assert err < tol, f"{name}: relative error {err:.3g} >= {tol}"


def _assert_lse_close(x, ref, tol=LSE_TOL):
    """-inf exactly where the reference has it (rows that see no key), the other rows close."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    assert x.shape == ref.shape and not np.isnan(x).any()
    empty = np.isneginf(ref)
    assert np.array_equal(np.isneginf(x), empty), "lse: -inf (row sees no key) where the reference has none, or not"
    if (~empty).any():
        err = np.max(np.abs(x[~empty] - ref[~empty])) / max(1.0, np.max(np.abs(ref[~empty])))
        assert err < tol, f"lse: max error {err:.3g} >= {tol}"


@functools.partial(jax.jit, static_argnames=("is_causal", "window", "softcap", "deterministic"))
def kernel_fwd_bwd(q, k, v, dout, dlse, masks=None, bias=None, *, is_causal, window=None, softcap=None,
                   deterministic=False):
    """The forward and backward kernels, called directly, every output poisoned with NaN: (out, lse, dq,
    dk, dv), and dbias with a bias. out and dout have the value's head dim."""
    spec = AttentionSpec(SCALE, is_causal, True, window, softcap, deterministic)
    b, t, n, _ = q.shape
    nan = helpers.nan
    out, lse = fwd_kernel(q, k, v, spec, out_init=(nan((b, t, n, v.shape[3]), q.dtype), nan((b, n, t), F32)),
                          masks=masks, bias=bias)
    dbias = () if bias is None else (nan((b, n, *padded_rows_keys(t, k.shape[1])), q.dtype),)
    grads = bwd_kernel(q, k, v, out, lse, dout, dlse, spec,
                       out_init=(nan(q.shape, q.dtype), nan(k.shape, k.dtype), nan(v.shape, v.dtype),
                                 nan((b, n, t), F32), nan(bwd_workspace_shape(q).shape, F32), *dbias),
                       masks=masks, bias=bias)
    return (out, lse, *grads)


@functools.partial(jax.jit, static_argnames=("is_causal", "window", "softcap"))
def reference_fwd_bwd(q, k, v, dout, dlse, masks=None, bias=None, *, is_causal, window=None, softcap=None):
    """jax_tk.reference in float32 from the same inputs, gradients from jax.vjp with (dout, dlse) (a row
    that sees no key: its dlse does not count)."""
    m = Masks() if masks is None else masks
    f = functools.partial(reference.attention_with_lse, scale=SCALE, is_causal=is_causal, local_window_size=window,
                          q_segment_ids=m.q_segment_ids, kv_segment_ids=m.kv_segment_ids,
                          query_seq_lengths=m.q_lengths, key_value_seq_lengths=m.kv_lengths, logits_soft_cap=softcap,
                          mask=m.mask)
    q, k, v, dout = (x.astype(F32) for x in (q, k, v, dout))
    if bias is None:
        (out, lse), vjp = jax.vjp(f, q, k, v)
    else:
        (out, lse), vjp = jax.vjp(lambda q, k, v, b: f(q, k, v, bias=b), q, k, v, bias.astype(F32))
    return (out, lse, *vjp((dout, jnp.where(jnp.isneginf(lse), 0.0, dlse))))


def check_kernels(q, k, v, dout, dlse, masks=None, bias=None, **opts):
    got = kernel_fwd_bwd(q, k, v, dout, dlse, masks, bias, **opts)
    opts.pop("deterministic", None)
    want = reference_fwd_bwd(q, k, v, dout, dlse, masks, bias, **opts)
    b, t, n, _ = q.shape
    out, lse, dq, dk, dv = got[:5]
    assert out.shape == (b, t, n, DV) and out.dtype == BF16 and lse.shape == (b, n, t) and lse.dtype == F32
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    _assert_close("out", out, want[0])
    _assert_lse_close(lse, want[1])
    for name, x, r in zip(("dq", "dk", "dv", "dbias"), got[2:], want[2:]):
        _assert_close(name, x, r)
    return got, want


# ----------------------------------------------------------------------------------------------
# Sweep: lengths, heads, causal (20 cases)
# ----------------------------------------------------------------------------------------------

SEQ_LENS = [(1, 77), (77, 77), (128, 300), (300, 128), (1031, 1031)]
HEADS = [(16, 4), (8, 8)]


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("n,kh", HEADS, ids=lambda x: str(x))
@pytest.mark.parametrize("t,s", SEQ_LENS, ids=lambda x: str(x))
def test_kernels_vs_reference(t, s, n, kh, is_causal):
    b = 1 if t * s > 100_000 else 2
    q, k, v, dout, dlse = _inputs(_seed(t, s, n, kh, is_causal), b, t, s, n, kh)
    check_kernels(q, k, v, dout, dlse, is_causal=is_causal)


# ----------------------------------------------------------------------------------------------
# Masking options, soft cap, bias (8 cases)
# ----------------------------------------------------------------------------------------------


def _masking(name, rng, b, t, s, n):
    """(masks, bias, options) of one case; "lengths" has an entry that sees no key."""
    ids = lambda length, runs: jnp.asarray(np.sort(rng.integers(0, runs, (b, length)), axis=1).astype(np.int32))
    # (a bias exact in bf16: the kernels read it in the inputs' dtype)
    rounded = lambda shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(jnp.bfloat16)
                                        .astype(np.float32))
    if name == "window":
        return None, None, dict(window=(100, 20))
    if name == "segments":
        return Masks(ids(t, 4), ids(s, 4)), None, {}
    if name == "packed_documents":
        doc = ids(t, 5)
        return Masks(doc, doc), None, {}
    if name == "lengths":
        return Masks(q_lengths=jnp.array([t, t // 2], jnp.int32), kv_lengths=jnp.array([0, s - 5], jnp.int32)), None, {}
    if name == "mask":
        return Masks(mask=jnp.asarray(rng.random((b, 1, t, s)) > 0.3)), None, {}
    if name == "bias":
        return None, rounded((1, n, t, s)), {}
    if name == "softcap":
        return None, None, dict(softcap=5.0)
    if name == "all":  # every option the kernels combine (not the bias with the soft cap)
        masks = Masks(ids(t, 3), ids(s, 3), jnp.array([t, t - 7], jnp.int32), jnp.array([s - 3, s], jnp.int32),
                      jnp.asarray(rng.random((b, 1, t, s)) > 0.2))
        return masks, rounded((b, 1, t, s)), dict(window=(150, 40))
    raise ValueError(name)


@pytest.mark.parametrize("name", ["window", "segments", "packed_documents", "lengths", "mask", "bias", "softcap",
                                  "all"])
def test_masking_options(name):
    b, t, n, kh = 2, 300, 16, 4
    s = t if name == "packed_documents" else 333
    rng = np.random.default_rng(_seed(name))
    q, k, v, dout, dlse = _inputs(_seed(name, "inputs"), b, t, s, n, kh)
    masks, bias, opts = _masking(name, rng, b, t, s, n)
    got, want = check_kernels(q, k, v, dout, dlse, masks, bias, is_causal=name in ("lengths", "all"), **opts)
    if name == "lengths":  # entry 0 sees no key: out 0, lse -inf, no gradient
        assert not np.asarray(got[0][0], np.float32).any() and np.isneginf(np.asarray(got[1][0])).all()
        assert not np.asarray(got[3][0], np.float32).any() and not np.asarray(got[4][0], np.float32).any()


# ----------------------------------------------------------------------------------------------
# Deterministic backward (3 cases)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t,s,n,kh,is_causal", [(300, 300, 16, 4, True), (1031, 1031, 8, 8, False),
                                                (77, 1031, 16, 4, False)])
def test_deterministic_backward(t, s, n, kh, is_causal):
    q, k, v, dout, dlse = _inputs(_seed(t, s, n, kh, "det"), 1, t, s, n, kh)
    got, _ = check_kernels(q, k, v, dout, dlse, is_causal=is_causal, deterministic=True)
    again = kernel_fwd_bwd(q, k, v, dout, dlse, is_causal=is_causal, deterministic=True)
    for name, x, y in zip(("dq", "dk", "dv"), got[2:5], again[2:5]):
        assert np.array_equal(np.asarray(x).view(np.uint16), np.asarray(y).view(np.uint16)), f"{name} differs"


# ----------------------------------------------------------------------------------------------
# Through jax_tk.attention(implementation="tk"): the dispatch, sinks, vmap (9 cases)
# ----------------------------------------------------------------------------------------------


def _sinks(n, seed):
    s = np.random.default_rng(seed).normal(size=n).astype(np.float32)
    s[0], s[-1] = 6.0, -np.inf  # a strong sink, and none
    return jnp.asarray(s)


def _loss(fn, dout, dlse):
    def loss(q, k, v, sinks):
        out, lse = fn(q, k, v, sinks)
        fin = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(F32) * dout.astype(F32)) + jnp.sum(fin * dlse), (out, lse)

    return loss


@pytest.mark.parametrize("t,s,is_causal,lengths", [(77, 77, True, False), (300, 1031, False, True),
                                                   (1031, 1031, True, False)])
def test_sinks_through_the_op(t, s, is_causal, lengths):
    b, n, kh = 2, 16, 4
    q, k, v, dout, dlse = _inputs(_seed(t, s, "sinks"), b, t, s, n, kh)
    kv_len = jnp.array([s, 0], jnp.int32) if lengths else None
    assert api.use_kernel(q, k, v, None)
    op = lambda q, k, v, sinks: jax_tk.attention_with_lse(q, k, v, is_causal=is_causal, key_value_seq_lengths=kv_len,
                                                           sinks=sinks, implementation="tk")
    ref = lambda q, k, v, sinks: reference.attention_with_lse(*(x.astype(F32) for x in (q, k, v)), scale=SCALE,
                                                              is_causal=is_causal, key_value_seq_lengths=kv_len,
                                                              sinks=sinks)
    sinks = _sinks(n, t + s)
    run = lambda fn: jax.jit(jax.value_and_grad(_loss(fn, dout, dlse), (0, 1, 2, 3), has_aux=True))(q, k, v, sinks)
    (_, (out, lse)), grads = run(op)
    (_, want), want_grads = run(ref)
    assert out.shape == (b, t, n, DV)
    _assert_close("out", out, want[0])
    _assert_lse_close(lse, want[1])
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
        _assert_close(name, g, w)
    _assert_close("dsinks", np.asarray(grads[3])[:-1], np.asarray(want_grads[3])[:-1])
    assert np.asarray(grads[3])[-1] == 0  # a sink of -inf is no sink
    if lengths:  # entry 1 sees no key: out 0, lse the sink
        assert not np.asarray(out[1], np.float32).any()
        np.testing.assert_allclose(np.asarray(lse[1]), np.broadcast_to(np.asarray(sinks)[:, None], (n, t)), rtol=1e-6)


@pytest.mark.parametrize("mapped", ["qkv", "q", "kv"])
def test_vmap(mapped):
    """The vmapped dims folded into the kernels' batch (one launch): values and gradients equal each entry's."""
    e, b, t, s, n, kh = 3, 2, 200, 333, 8, 2
    sets = [_inputs(_seed(mapped, i), b, t, s, n, kh) for i in range(e)]
    q, k, v = (jnp.stack(x) for x in list(zip(*sets))[:3])
    axes = {"qkv": (0, 0, 0), "q": (0, None, None), "kv": (None, 0, 0)}[mapped]
    args = [x if a is not None else x[0] for x, a in zip((q, k, v), axes)]

    def loss(q, k, v):
        out, lse = jax_tk.attention_with_lse(q, k, v, is_causal=True, implementation="tk")
        return jnp.sum(jnp.sin(out.astype(F32))) + jnp.sum(jnp.cos(lse))

    def ref_loss(q, k, v):
        out, lse = reference.attention_with_lse(*(x.astype(F32) for x in (q, k, v)), scale=SCALE, is_causal=True)
        return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(lse))

    out = jax.jit(jax.vmap(lambda q, k, v: jax_tk.attention(q, k, v, is_causal=True, implementation="tk"),
                           in_axes=axes))(*args)
    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=axes))(*args)
    assert out.shape == (e, b, t, n, DV)
    for i in range(e):  # (vmap of grad: every operand's gradient per entry, mapped or not)
        one = [x[i] if a is not None else x for x, a in zip(args, axes)]
        want = reference.attention(*(x.astype(F32) for x in one), scale=SCALE, is_causal=True)
        _assert_close("out", out[i], want)
        want_grads = jax.jit(jax.grad(ref_loss, argnums=(0, 1, 2)))(*one)
        for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
            _assert_close(name, g[i], w)
