"""CPU tests of jax_tk.attention's bias= and mask= (jax.nn's): values and gradients against
jax.nn.dot_product_attention, broadcast shapes, the order with the soft cap, the checks, the routing
(the kernels do not take them yet), vmap, implementation="cudnn", and the kernels' mask operands (the
bits and the per-block summary)."""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from helpers import attention_inputs, needs_extension, randn, rel_err, seen_rows
from jax_tk.attention import api, launch, reference

F32, BF16 = jnp.float32, jnp.bfloat16
B, T, S, N, KH, D = 2, 6, 9, 4, 2, 8


def _qkv(seed, b=B, t=T, s=S, n=N, kh=KH, d=D, dtype=F32):
    return attention_inputs(seed, b, t, s, n, kh, d, dtype)


def _mask(rng, shape, p=0.3):
    """A random mask, its first and last keys always visible (so that no row is empty, causal or not:
    jax.nn gives an empty row the mean of V, jax_tk 0)."""
    m = rng.random(shape) > p
    m[..., 0] = m[..., -1] = True
    return jnp.asarray(m)


def _jax_nn(*args, **kwargs):
    return jax.nn.dot_product_attention(*args, implementation="xla", **kwargs)


def _err(g, w):
    # floor: a bias constant along the keys has an analytically zero gradient (softmax is shift
    # invariant), which both sides give as float32 rounding noise
    return rel_err(g, w, floor=0.1)


def _grads(fn, q, k, v, bias, mask, rows=None, **opts):
    """Values and the gradients with respect to query, key, value and bias of a fixed random loss;
    ``rows`` ([b, t, n] bool, broadcast): the query rows that count (the others' outputs are zeroed
    and take no part in the loss)."""
    w = randn(np.random.default_rng(99), q.shape, F32)
    w = w if rows is None else w * rows[..., None]
    loss = lambda q, k, v, bias: jnp.sum(fn(q, k, v, bias, mask, **opts).astype(F32) * w)
    out = fn(q, k, v, bias, mask, **opts)
    out = out if rows is None else jnp.where(rows[..., None], out, 0)
    return (out, *jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias))


BROADCASTS = [(B, N, T, S), (1, N, T, S), (B, 1, T, S), (1, 1, T, S), (B, 1, 1, S), (1, 1, T, 1), (N, T, S), (T, S),
              (S,)]


@pytest.mark.parametrize("bias_shape", BROADCASTS, ids=str)
def test_bias_broadcasts_like_jax_nn(bias_shape):
    rng = np.random.default_rng(1)
    q, k, v = _qkv(1)
    bias = randn(rng, bias_shape, F32)
    mask = _mask(rng, (B, 1, T, S))
    got = _grads(jax_tk.attention, q, k, v, bias, mask, is_causal=False)
    want = _grads(_jax_nn, q, k, v, bias, mask)
    assert got[4].shape == bias.shape  # the bias gradient summed over the dims it is broadcast over
    for name, g, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
        assert _err(g, w) < 1e-5, name


@pytest.mark.parametrize("mask_shape", BROADCASTS, ids=str)
def test_mask_broadcasts_like_jax_nn(mask_shape):
    rng = np.random.default_rng(2)
    q, k, v = _qkv(2)
    bias = randn(rng, (1, N, T, S), F32)
    mask = _mask(rng, mask_shape)
    mask4 = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    for opts in (dict(), dict(is_causal=True), dict(local_window_size=(2, 3)),
                 dict(key_value_seq_lengths=jnp.array([S, S - 2]))):
        vis = {"local_window_size" if k == "local_window_size" else k: x for k, x in opts.items()}
        rows = seen_rows(T, S, mask4, **vis)
        got = _grads(jax_tk.attention, q, k, v, bias, mask, rows, **opts)
        want = _grads(_jax_nn, q, k, v, bias, mask, rows, **opts)
        for name, g, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
            assert _err(g, w) < 1e-5, (name, opts)
        # The rows that see no key: 0 here (the mean of V in jax.nn)
        empty = ~np.broadcast_to(np.asarray(rows), (B, T, N))
        assert np.all(np.asarray(jax_tk.attention(q, k, v, bias, mask, **opts))[empty] == 0)


def test_bias_and_mask_with_every_option_match_the_reference():
    """Segment ids, lengths, window, causal, GQA and the soft cap with a bias and a mask, jit and grad:
    the reference written out by hand (logits = cap * tanh(scale q.k / cap) + bias, then every mask)."""
    rng = np.random.default_rng(3)
    q, k, v = _qkv(3, dtype=BF16)
    bias, mask = randn(rng, (B, 1, T, S), BF16), _mask(rng, (1, N, T, S))
    qs, ks = jnp.array([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 2, 2]]), jnp.array([[0] * 5 + [1] * 4, [0, 0, 0, 1, 1, 1, 2, 2, 2]])
    opts = dict(scale=0.4, is_causal=True, local_window_size=(3, 1), logits_soft_cap=2.0, q_segment_ids=qs,
                kv_segment_ids=ks, query_seq_lengths=jnp.array([6, 4]), key_value_seq_lengths=jnp.array([9, 7]))

    def by_hand(q, k, v, bias, mask):
        qf, kf, vf = (jnp.repeat(x.astype(F32), N // x.shape[2], axis=2) for x in (q, k, v))
        logits = jnp.einsum("btnd,bsnd->bnts", qf, kf) * 0.4
        logits = 2.0 * jnp.tanh(logits / 2.0) + bias.astype(F32)
        i, j = np.arange(T)[:, None], np.arange(S)[None]
        vis = (j <= i) & (j >= i - 3) & (j <= i + 1)
        vis = vis & (qs[:, :, None] == ks[:, None, :]) & (i < jnp.array([6, 4])[:, None, None])
        vis = vis & (j < jnp.array([9, 7])[:, None, None])
        vis = vis[:, None] & mask
        logits = jnp.where(vis, logits, -jnp.inf)
        p = jnp.exp(logits - jnp.max(jnp.where(vis, logits, -1e30), -1, keepdims=True))
        p = jnp.where(vis, p, 0)
        denom = p.sum(-1, keepdims=True)
        p = p / jnp.where(denom > 0, denom, 1)
        return jnp.einsum("bnts,bsnd->btnd", p, vf).astype(q.dtype)

    f = jax.jit(lambda q, k, v, bias, mask: jax_tk.attention(q, k, v, bias, mask, **opts))
    got = _grads(lambda *a, **kw: f(*a), q, k, v, bias, mask)
    want = _grads(lambda *a, **kw: by_hand(*a), q, k, v, bias, mask)
    assert np.isfinite(np.asarray(got[0], np.float32)).all()
    for name, g, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
        assert g.dtype == w.dtype and rel_err(g, w) < 2e-2, name
    # Rows past their query length and rows that see no key give 0.
    assert np.all(np.asarray(got[0][1, 4:], np.float32) == 0)


def test_rank3_inputs():
    rng = np.random.default_rng(4)
    q, k, v = (x[0] for x in _qkv(4, b=1))
    for bias_shape, mask_shape in (((N, T, S), (1, T, S)), ((1, N, T, S), (T, S)), ((S,), (1, 1, 1, S))):
        bias, mask = randn(rng, bias_shape, F32), _mask(rng, mask_shape)
        got = _grads(jax_tk.attention, q, k, v, bias, mask, is_causal=True)
        want = _grads(_jax_nn, q, k, v, bias, mask, is_causal=True)
        assert got[0].shape == q.shape and got[4].shape == bias.shape
        for name, g, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
            assert _err(g, w) < 1e-5, (name, bias_shape)


def test_traced_scale_with_bias():
    rng = np.random.default_rng(5)
    q, k, v = _qkv(5)
    bias, mask = randn(rng, (1, N, T, S), F32), _mask(rng, (B, 1, T, S))
    loss = lambda fn, s, b: jnp.sum(fn(q, k, v, b, mask, scale=s) ** 2)
    g = jax.jit(jax.grad(functools.partial(loss, jax_tk.attention), argnums=(0, 1)))(jnp.float32(0.6), bias)
    w = jax.grad(functools.partial(loss, _jax_nn), argnums=(0, 1))(jnp.float32(0.6), bias)
    assert rel_err(g[0], w[0]) < 1e-5 and rel_err(g[1], w[1]) < 1e-5


def test_neg_inf_bias_acts_as_mask_and_empty_rows_give_zero():
    q, k, v = _qkv(6)
    bias = randn(np.random.default_rng(7), (1, 1, T, S), F32).at[..., 1::2].set(-jnp.inf).at[:, :, 2].set(-jnp.inf)
    mask = jnp.ones((1, 1, T, S), bool).at[:, :, 4].set(False)
    got = _grads(jax_tk.attention, q, k, v, bias, mask)
    for g in got:
        assert np.isfinite(np.asarray(g)).all()
    out = np.asarray(got[0])
    assert np.all(out[:, 2] == 0) and np.all(out[:, 4] == 0)
    assert np.all(np.asarray(got[4])[..., 1::2] == 0)
    finite = jnp.where(jnp.isfinite(bias), bias, 0.0)
    want = _jax_nn(q, k, v, finite, mask & jnp.isfinite(bias))
    keep = np.ones(T, bool)
    keep[[2, 4]] = False  # jax.nn gives an empty row the mean of V
    np.testing.assert_allclose(out[:, keep], np.asarray(want)[:, keep], rtol=1e-5, atol=1e-5)
    _, lse = jax_tk.attention_with_lse(q, k, v, bias, mask)
    assert np.all(np.isneginf(np.asarray(lse)[:, :, [2, 4]]))


def test_vmap_over_bias_and_mask():
    rng = np.random.default_rng(7)
    q, k, v = _qkv(7)
    biases = randn(rng, (3, 1, N, T, S), F32)
    masks = _mask(rng, (3, B, 1, T, S))
    f = lambda b, m: jax_tk.attention(q, k, v, b, m, is_causal=True)
    got = jax.jit(jax.vmap(f))(biases, masks)
    want = jnp.stack([_jax_nn(q, k, v, biases[i], masks[i], is_causal=True) for i in range(3)])
    assert rel_err(got, want) < 1e-5
    g = jax.vmap(jax.grad(lambda b, m: jnp.sum(f(b, m) ** 2)))(biases, masks)
    w = jnp.stack([jax.grad(lambda b: jnp.sum(_jax_nn(q, k, v, b, masks[i], is_causal=True) ** 2))(biases[i])
                   for i in range(3)])
    assert g.shape == biases.shape and rel_err(g, w) < 1e-5
    # vmap over the query only, bias and mask shared
    qs = jnp.stack([q, 0.5 * q])
    got = jax.vmap(lambda q: jax_tk.attention(q, k, v, biases[0], masks[0]))(qs)
    assert rel_err(got[1], _jax_nn(qs[1], k, v, biases[0], masks[0])) < 1e-5


# ----------------------------------------------------------------------------------------------
# Checks and routing
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,x,error,match", [
    ("bias", jnp.ones((B, N, T, S), bool), TypeError, r"bias must have a float dtype.*mask="),
    ("bias", jnp.ones((B, N, T, S), jnp.int32), TypeError, r"bias must have a float dtype"),
    ("mask", jnp.ones((B, N, T, S), jnp.complex64), TypeError, r"mask must be boolean"),
    ("bias", jnp.ones((1, B, N, T, S), F32), ValueError, r"bias must have rank <= 4"),
    ("mask", jnp.ones((B, N, T, S + 1), bool), ValueError, r"mask of shape .* does not broadcast .* \(2, 4, 6, 9\)"),
    ("bias", jnp.ones((B, KH, T, S), F32), ValueError, r"bias of shape .*\(heads: the query heads\)"),
    ("bias", jnp.ones((3, 1, T, S), F32), ValueError, r"bias of shape \(3, 1, 6, 9\) does not broadcast"),
    ("mask", [[True]], TypeError, r"mask must be an array"),
], ids=["bool_bias", "int_bias", "complex_mask", "rank5", "kv_len", "kv_heads", "batch", "list"])
def test_bad_bias_mask(name, x, error, match):
    q, k, v = _qkv(8)
    with pytest.raises(error, match=match):
        jax_tk.attention(q, k, v, **{name: x})


def test_numeric_mask_is_read_as_flax_does():
    # Flax's masks are 0/1 floats (nn.make_attention_mask): any value but 0 attends.
    rng = np.random.default_rng(8)
    q, k, v = _qkv(8)
    mask = _mask(rng, (B, 1, T, S))
    want = jax_tk.attention(q, k, v, mask=mask)
    for dtype in (F32, BF16, jnp.int32, jnp.int8):
        np.testing.assert_array_equal(np.asarray(jax_tk.attention(q, k, v, mask=mask.astype(dtype))), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(jax_tk.attention(q, k, v, mask=mask * 2.5)), np.asarray(want))


def test_rank3_bias_batch_must_be_one():
    q, k, v = (x[0] for x in _qkv(8, b=1))
    with pytest.raises(ValueError, match=r"bias of shape \(2, 4, 6, 9\) does not broadcast .* \(1, 4, 6, 9\)"):
        jax_tk.attention(q, k, v, jnp.ones((2, N, T, S), F32))


@needs_extension
@pytest.mark.parametrize("name", ["bias", "mask"])
def test_kernel_routing(name):
    # The kernels take bias= and mask=: implementation=None lowers for CUDA to jax_tk's kernel calls,
    # forward and backward, with no reference logits.
    x = jnp.ones((1, 1, T, S), F32 if name == "bias" else bool)
    q, k, v = _qkv(9, d=64, dtype=BF16)
    assert launch.kernel_unsupported_reason(q, k, **({"bias": x} if name == "bias" else {})) is None
    f = lambda q, k, v, x: jax_tk.attention(q, k, v, **{name: x})
    text = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(F32)))).trace(q, k, v, x).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "jax_tk_attention_fwd" in text and "jax_tk_attention_bwd" in text


def test_bias_with_soft_cap_runs_the_reference():
    q, k, v = _qkv(9, d=64, dtype=BF16)
    bias = jnp.ones((1, 1, T, S), F32)
    assert "soft_cap" in launch.kernel_unsupported_reason(q, k, bias=bias, softcap=5.0)
    with pytest.raises(ValueError, match=r"implementation='tk'.*bias with logits_soft_cap"):
        jax_tk.attention(q, k, v, bias, logits_soft_cap=5.0, implementation="tk")
    text = jax.jit(lambda q, k, v: jax_tk.attention(q, k, v, bias, logits_soft_cap=5.0)).trace(q, k, v).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "jax_tk_attention" not in text


@needs_extension
@pytest.mark.parametrize("shape", [(B, N, T, S), (1, 1, T, S), (B, 1, 1, S), (1, N, T, 1)], ids=str)
def test_bias_operand_and_its_gradient(shape):
    """The kernels' bias: broadcast over rows and keys, the query's dtype, zero-padded to whole 128 x 128
    blocks; the gradient from the kernels' [B, H, T', S'] logits' gradient: cut to T x S and summed over
    the bias's broadcast dims, in its dtype."""
    rng = np.random.default_rng(sum(shape))
    q, k = _qkv(3, dtype=BF16)[:2]
    bias = jnp.asarray(rng.standard_normal(shape), F32)
    op = np.asarray(launch.bias_operand(bias, q, k), np.float32)
    assert op.shape == (*shape[:2], 128, 128) and launch.bias_operand(bias, q, k).dtype == BF16
    np.testing.assert_array_equal(op[..., :T, :S], np.broadcast_to(np.asarray(bias.astype(BF16), np.float32),
                                                                    (*shape[:2], T, S)))
    assert not op[..., T:, :].any() and not op[..., S:].any()
    dlogits = rng.standard_normal((B, N, 128, 128)).astype(np.float32)
    got = launch.dbias_from_kernel(jnp.asarray(dlogits, BF16), bias, q, k)
    want = np.asarray(jnp.asarray(dlogits, BF16), np.float32)[..., :T, :S]
    want = want.sum(axis=tuple(i for i in range(4) if shape[i] == 1), keepdims=True)
    assert got.dtype == F32 and got.shape == shape
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert launch.bias_operand(None, q, k).shape == (0,)


def test_bias_gradient_sum_ignores_what_the_kernel_leaves_unwritten():
    """A bias broadcast over some dim has its gradient summed over it; the kernels then leave the blocks
    no query sees unwritten (no memset): the sum takes the pairs the masking hides as 0, whatever the
    buffer holds there (NaN here), for every masking rule and the boolean mask."""
    rng = np.random.default_rng(7)
    q, k = _qkv(3, dtype=BF16)[:2]
    spec = api.AttentionSpec(1.0, False, True, (3, 4))
    masks = launch.Masks(q_segment_ids=jnp.asarray(np.repeat([[0, 1, 2]], B, 0).repeat([T // 3, T // 3, T - 2 * (T // 3)], 1)),
                         kv_segment_ids=jnp.asarray(np.repeat([[0, 1, 2]], B, 0).repeat([S // 3, S // 3, S - 2 * (S // 3)], 1)),
                         q_lengths=jnp.asarray([T, T - 2]), kv_lengths=jnp.asarray([S - 3, S]),
                         mask=jnp.asarray(rng.random((1, N, T, S)) < 0.8))
    visible = np.asarray(launch.visible_pairs(spec, masks, T, S))
    want_visible = np.asarray(reference.visibility(
        T, S, is_causal=False, local_window_size=(3, 4), q_segment_ids=masks.q_segment_ids,
        kv_segment_ids=masks.kv_segment_ids, query_seq_lengths=masks.q_lengths,
        key_value_seq_lengths=masks.kv_lengths))[:, None] & np.asarray(masks.mask)
    np.testing.assert_array_equal(np.broadcast_to(visible, (B, N, T, S)), np.broadcast_to(want_visible, (B, N, T, S)))
    assert 0.1 < visible.mean() < 0.9
    dlogits = rng.standard_normal((B, N, 128, 128)).astype(np.float32)
    written = np.zeros_like(dlogits, bool)
    written[..., :T, :S] = np.broadcast_to(visible, (B, N, T, S))
    poisoned = np.where(written, dlogits, np.nan)
    bias = jnp.zeros((1, N, T, S), F32)
    got = launch.dbias_from_kernel(jnp.asarray(poisoned, BF16), bias, q, k, visible)
    want = np.where(written, np.asarray(jnp.asarray(dlogits, BF16), np.float32), 0)[..., :T, :S].sum(0, keepdims=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@needs_extension
@pytest.mark.parametrize("shape", [(2, 3, 37, 200), (1, 3, 37, 200), (2, 1, 1, 129), (1, 1, 5, 1), (1, 1, 4, 256)], ids=str)
def test_mask_bits(shape):
    """Params::mask_bits: bit j % 32 of word j // 32 of a row is key j's mask, the rows padded with zeros
    to whole blocks of MASK_BLOCK_KEYS keys; size-1 rows and keys broadcast."""
    t, s = 37 if shape[2] == 1 else shape[2], 70 if shape[3] == 1 else shape[3]
    m = np.random.default_rng(sum(shape)).random(shape) > 0.4
    bits = np.asarray(jax.jit(launch.mask_bits, static_argnums=(1, 2))(jnp.asarray(m), t, s))
    keys = launch.contract()["MASK_BLOCK_KEYS"]
    words = -(-s // keys) * keys // 32
    assert bits.dtype == np.uint32 and bits.shape == (*shape[:2], t, words)
    unpacked = (bits[..., :, None] >> np.arange(32, dtype=np.uint32)) & 1  # [.., words, 32]
    unpacked = unpacked.reshape(*bits.shape[:3], 32 * words).astype(bool)
    np.testing.assert_array_equal(unpacked[..., :s], np.broadcast_to(m, (*shape[:2], t, s)))
    assert not unpacked[..., s:].any()


@needs_extension
def test_mask_operands():
    """The kernels' masking operands with a mask: the ints absent (shape (0,)), then the bits and the
    summary; without one, uint32 and int8 of shape (0,)."""
    t, s = 130, 70
    mask = jnp.asarray(np.random.default_rng(3).random((2, 1, t, s)) > 0.5)
    ops = launch.mask_operands(launch.Masks(mask=mask), t, s)
    assert len(ops) == 9 and all(x.shape == (0,) and x.dtype == jnp.int32 for x in ops[:7])
    np.testing.assert_array_equal(ops[7], launch.mask_bits(mask, t, s))
    np.testing.assert_array_equal(ops[8], launch.mask_summary(mask, t, s))
    ops = launch.mask_operands(None, t, s)
    assert ops[7].dtype == jnp.uint32 and ops[8].dtype == jnp.int8 and ops[7].shape == ops[8].shape == (0,)


@needs_extension
def test_documents_tiles_are_left_out_with_a_mask():
    """A document's tiles start inside the mask's blocks: with a mask the forward gets the fixed grid."""
    ids = jnp.asarray(np.repeat(np.arange(4), 100)[None], jnp.int32)
    ranges = launch.segment_ranges(ids)
    tiles = lambda documents: np.asarray(launch.fwd_tiles(ids, ids, ranges, ranges, True, 2, 4, 64, documents)).reshape(-1, 4)
    assert (tiles(True)[:, 3] >= 0).any()
    grid = tiles(False)
    assert (grid[:, 3] == -1).all() and (grid[grid[:, 0] >= 0, 1] % launch.contract()["FWD_TILE_ROWS"] == 0).all()


def test_cudnn_passes_bias_and_mask(monkeypatch):
    calls = []
    real = jax.nn.dot_product_attention

    def fake(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **{**kwargs, "implementation": "xla"})

    monkeypatch.setattr(jax.nn, "dot_product_attention", fake)
    rng = np.random.default_rng(10)
    q, k, v = _qkv(10)
    bias, mask = randn(rng, (N, T, S), F32), _mask(rng, (T, S))
    out = jax_tk.attention(q, k, v, bias, mask, implementation="cudnn")
    (args, kwargs), = calls
    assert args[3].shape == (1, N, T, S) and args[4].shape == (1, 1, T, S) and kwargs["implementation"] == "cudnn"
    assert rel_err(out, real(q, k, v, bias, mask, implementation="xla")) < 1e-6


# ----------------------------------------------------------------------------------------------
# The per-block mask summary
# ----------------------------------------------------------------------------------------------


def _summary_by_loops(mask, t, s, rows, keys):
    m = np.broadcast_to(np.asarray(mask), mask.shape[:2] + (t, s))
    out = np.zeros(mask.shape[:2] + (-(-t // rows), -(-s // keys)), np.int8)
    c = launch.contract()
    for b, n, i, j in itertools.product(*map(range, out.shape)):
        block = m[b, n, i * rows:(i + 1) * rows, j * keys:(j + 1) * keys]
        out[b, n, i, j] = c["MASK_EMPTY"] if not block.any() else c["MASK_FULL"] if block.all() else c["MASK_MIXED"]
    return out


@pytest.mark.parametrize("t,s,rows,keys", [(37, 50, 8, 16), (32, 32, 16, 8), (5, 70, 4, 64), (130, 3, 128, 128)])
@pytest.mark.parametrize("shape", ["full", "b1", "n1", "t1", "s1"])
def test_mask_block_summary(t, s, rows, keys, shape):
    rng = np.random.default_rng(t * s)
    dims = {"full": (2, 3, t, s), "b1": (1, 3, t, s), "n1": (2, 1, t, s), "t1": (2, 3, 1, s), "s1": (2, 3, t, 1)}[shape]
    # Blocks of every kind: mostly-true and mostly-false regions plus random ones.
    m = rng.random(dims) > 0.5
    m[..., : dims[2] // 2, :] = True
    m[0, ..., : dims[3] // 3] = False
    m[-1, -1] = rng.random(dims[2:]) > 0.02
    mask = jnp.asarray(m)
    got = jax.jit(launch.mask_block_summary, static_argnums=(1, 2, 3, 4))(mask, t, s, rows, keys)
    want = _summary_by_loops(m, t, s, rows, keys)
    assert got.dtype == jnp.int8 and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got), want)
    assert {0, 1, 2} >= set(np.unique(want)) and len(np.unique(want)) >= 2


@needs_extension
def test_mask_summary_uses_the_contract_blocks():
    c = launch.contract()
    rows, keys = c["MASK_BLOCK_ROWS"], c["MASK_BLOCK_KEYS"]
    assert len({c["MASK_EMPTY"], c["MASK_FULL"], c["MASK_MIXED"]}) == 3
    # every kernel block lies inside one summary block
    for head_dim in (64, 128, 256):
        q_rows, k_rows = launch.fwd_order_blocks(head_dim)
        b_keys, b_rows = launch.bwd_order_blocks(head_dim)
        assert rows % q_rows == 0 and keys % k_rows == 0 and rows % b_rows == 0 and keys % b_keys == 0
    t, s = 2 * rows + 5, 3 * keys - 1
    mask = jnp.ones((1, 1, t, s), bool).at[..., rows:, :].set(False).at[..., -1, 0].set(True)
    got = np.asarray(launch.mask_summary(mask, t, s))
    assert got.shape == (1, 1, 3, 3)
    full, empty, mixed = c["MASK_FULL"], c["MASK_EMPTY"], c["MASK_MIXED"]
    np.testing.assert_array_equal(got[0, 0], [[full] * 3, [empty] * 3, [mixed, empty, empty]])
