"""GPU tests of the attention kernels' dense operands, jax.nn's ``mask=`` and ``bias=`` (skipped without
a GPU).

The kernels read the mask as bits (``launch.mask_bits``) and skip the blocks its per-block summary
(``launch.mask_summary``) marks empty; these tests compare them with the float32 reference over masks
whose blocks are empty, full and mixed, broadcast over batch, heads, rows or keys, alone and with every
other masking option, both kernel families, outputs poisoned (``check_kernels``). The bias (padded,
in the inputs' dtype: ``launch.bias_operand``) and its gradient (``launch.dbias_from_kernel``) are
compared the same way, with each broadcast shape and with the other options."""
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from helpers import rel_err
from jax_tk._core import extension
from jax_tk.attention import launch
from jax_tk.attention.launch import Masks
from test_kernels_gpu import (BF16, F16, F32, VARIANT_AUTO, VARIANT_SM80, assert_close, assert_lse_close, check_kernels,
                              kernel_fwd_bwd, make_inputs, make_masks, random_dlse, reference_fwd_bwd)

pytestmark = pytest.mark.gpu


def make_mask(seed, shape, kind):
    """A boolean mask of ``shape`` (rank 4, dims 1 or full): "random" (about 70% visible: every block
    mixed), "blocks" (random 128 x 128 regions hidden or shown whole, or mixed: the summary's three
    codes), "documents" (block-diagonal: 5 packed documents of random lengths), "rows" (some query
    rows see no key at all)."""
    rng = np.random.default_rng(seed)
    b, n, t, s = shape
    if kind == "random":
        m = rng.random(shape) > 0.3
    elif kind == "blocks":
        cell = 128  # (the summary's blocks)
        coarse = rng.integers(0, 3, (b, n, -(-t // cell), -(-s // cell)))  # 0 hidden, 1 shown, 2 random
        m = np.repeat(np.repeat(coarse, cell, axis=2), cell, axis=3)[:, :, :t, :s]
        m = np.where(m == 2, rng.random(shape) > 0.5, m == 1)
    elif kind == "documents":
        cuts = np.sort(rng.choice(np.arange(1, max(t, s)), 4, replace=False))
        qd = np.searchsorted(cuts, np.arange(t) * max(t, s) // max(t, 1), side="right")
        kd = np.searchsorted(cuts, np.arange(s) * max(t, s) // max(s, 1), side="right")
        m = np.broadcast_to(qd[:, None] == kd[None, :], shape)
    elif kind == "rows":
        m = rng.random(shape) > 0.5
        m[..., :: max(t // 5, 1) if t > 1 else 2, :] = False
    else:
        raise ValueError(kind)
    return jnp.asarray(np.ascontiguousarray(m))


# (id, (b, t, s, n, kh, d, dtype), mask shape (0: that dim of the call, 1: broadcast), mask kind,
#  is_causal, window, segments, q_lengths, kv_lengths, softcap)
CASES = [
    ("random", (2, 200, 130, 4, 2, 64, BF16), (0, 0, 0, 0), "random", False, None, None, None, None, None),
    ("blocks_causal", (2, 333, 400, 4, 2, 128, BF16), (0, 0, 0, 0), "blocks", True, None, None, None, None, None),
    ("blocks_broadcast_batch_heads", (2, 300, 300, 8, 2, 64, F16), (1, 1, 0, 0), "blocks", False, None, None, None, None,
     None),
    ("per_head_gqa", (1, 260, 700, 8, 2, 128, BF16), (1, 0, 0, 0), "blocks", False, None, None, None, None, None),
    ("per_batch", (3, 130, 129, 4, 4, 64, BF16), (0, 1, 0, 0), "blocks", True, None, None, None, None, None),
    ("key_padding", (2, 200, 300, 4, 2, 128, F16), (0, 1, 1, 0), "random", False, None, None, None, None, None),
    ("query_rows", (2, 200, 300, 4, 2, 64, BF16), (0, 1, 0, 1), "random", False, None, None, None, None, None),
    ("documents", (1, 1000, 1000, 4, 2, 128, BF16), (1, 1, 0, 0), "documents", False, None, None, None, None, None),
    ("documents_causal", (2, 1000, 1000, 4, 2, 64, BF16), (1, 1, 0, 0), "documents", True, None, None, None, None, None),
    ("empty_rows", (2, 150, 260, 4, 2, 64, BF16), (0, 0, 0, 0), "rows", False, None, None, None, None, None),
    ("one_query", (2, 1, 1000, 8, 2, 128, BF16), (0, 0, 0, 0), "blocks", False, None, None, None, None, None),
    ("one_key", (1, 100, 1, 4, 4, 64, F16), (0, 0, 0, 0), "random", False, None, None, None, None, None),
    ("with_window", (1, 500, 500, 4, 2, 128, BF16), (0, 1, 0, 0), "blocks", True, (100, 0), None, None, None, None),
    ("with_segments", (2, 333, 333, 4, 2, 64, BF16), (1, 1, 0, 0), "blocks", False, None, "documents", None, None, None),
    ("with_lengths", (2, 200, 300, 4, 2, 128, BF16), (0, 0, 0, 0), "random", False, None, None, [200, 77], [300, 1],
     None),
    ("with_softcap", (1, 333, 257, 8, 2, 64, F16), (0, 0, 0, 0), "blocks", True, None, None, None, None, 8.0),
    ("everything", (2, 333, 1000, 8, 2, 64, BF16), (0, 0, 0, 0), "blocks", True, (100, 3), "packed", [300, 333],
     [333, 640], 8.0),
]


def _call_shape(b, t, s, n, mask_dims):
    return tuple(full if keep == 0 else 1 for full, keep in zip((b, n, t, s), mask_dims))


def _run(case, variant, deterministic=False, d=None):
    name, (b, t, s, n, kh, d0, dtype), dims, kind, is_causal, window, segments, q_lengths, kv_lengths, softcap = case
    d = d or d0
    seed = zlib.crc32((name + str(d)).encode())
    q, k, v, dout = make_inputs(seed, b, t, s, n, kh, d, dtype, q_mult=2.0 if softcap else 1.0)
    dlse = random_dlse(seed + 1, b, n, t)
    masks = make_masks(seed + 2, b, t, s, segments, q_lengths, kv_lengths)
    masks = masks._replace(mask=make_mask(seed + 3, _call_shape(b, t, s, n, dims), kind))
    got, want = check_kernels(q, k, v, dout, dlse, masks, scale=1.0 / math.sqrt(d), is_causal=is_causal,
                              variant=variant, window=window, softcap=softcap, deterministic=deterministic)
    empty = np.isneginf(np.asarray(want[1]))  # rows that see no key: out and dq exactly 0
    if empty.any():
        rows = np.transpose(empty, (0, 2, 1))
        assert not np.asarray(got[0], np.float32)[rows].any(), "out of a row that sees no key is not 0"
        assert not np.asarray(got[2], np.float32)[rows].any(), "dq of a row that sees no key is not 0"


@pytest.mark.parametrize("variant", [VARIANT_AUTO, VARIANT_SM80], ids=["auto", "sm80"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_mask_kernels_vs_reference(case, variant):
    _run(case, variant)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in ("per_head_gqa", "documents_causal", "everything")],
                         ids=lambda c: c[0])
def test_mask_deterministic_backward(case):
    _run(case, VARIANT_AUTO, deterministic=True)


def _hopper():
    return extension.cuda_device_capability() == (9, 0)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in ("blocks_causal", "per_head_gqa", "everything")],
                         ids=lambda c: c[0])
def test_mask_head_dim_256(case):
    if not _hopper():
        pytest.skip("head_dim 256 runs on H100/H200 only")
    _run(case, VARIANT_AUTO, d=256)


def test_mask_bits_past_the_keys_are_ignored(monkeypatch):
    """The bits of a row's padding past kv_len are never read as keys: set them all."""
    b, t, s, n, kh, d = 1, 130, 70, 4, 2, 64
    q, k, v, dout = make_inputs(5, b, t, s, n, kh, d, BF16)
    mask = make_mask(6, (1, 1, t, s), "random")
    bits = launch.mask_bits(mask, t, s)
    width = 32 * bits.shape[-1]
    padding = jnp.broadcast_to(jnp.arange(width) >= s, (1, 1, t, width))
    padded = bits | launch.mask_bits(padding, t, width)
    assert (padded != bits).any()
    monkeypatch.setattr(launch, "mask_bits", lambda *a: padded)
    # mask_bits is read when kernel_fwd_bwd is traced: drop its compiled programs before and after, so that
    # the patch takes effect and leaves nothing behind for later calls with these shapes
    kernel_fwd_bwd.clear_cache()
    try:
        check_kernels(q, k, v, dout, random_dlse(7, b, n, t), Masks(mask=mask), scale=0.125, is_causal=False)
    finally:
        kernel_fwd_bwd.clear_cache()


def test_public_api_with_mask_values_and_grads():
    """jax_tk.attention(mask=...) on the kernels (implementation="tk"), under jit and grad, against
    jax.nn.dot_product_attention's XLA path; and vmapped (the vmapped entries fold into the kernels'
    batch, the mask's broadcast dims with them)."""
    b, t, s, n, kh, d = 2, 300, 200, 8, 2, 64
    q, k, v, _ = make_inputs(11, b, t, s, n, kh, d, BF16)
    mask = make_mask(12, (b, 1, t, s), "blocks")
    mask = mask.at[..., 0].set(True)  # no empty rows: jax.nn gives them the mean of V, jax_tk 0
    f32 = lambda *a: [x.astype(F32) for x in a]
    ours = lambda q, k, v, m: jax_tk.attention(q, k, v, mask=m, is_causal=True, implementation="tk")
    theirs = lambda q, k, v, m: jax.nn.dot_product_attention(*f32(q, k, v), mask=m, is_causal=True, implementation="xla")
    assert "jax_tk_attention_fwd" in jax.jit(ours).lower(q, k, v, mask).as_text()
    w = jnp.asarray(np.random.default_rng(13).standard_normal((b, t, n, d)), F32)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v, mask).astype(F32) * w)
    assert rel_err(jax.jit(ours)(q, k, v, mask), theirs(q, k, v, mask)) < 1e-2
    got, want = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v), jax.grad(loss(theirs), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(got, want):
        assert rel_err(g, r) < 1e-2
    # vmap over a leading axis of 3: q and the mask mapped, k and v shared
    qs = jnp.stack([q, q * 0.5, -q])
    masks = jnp.stack([mask, ~mask | mask[..., :1], mask])
    got = jax.jit(jax.vmap(ours, in_axes=(0, None, None, 0)))(qs, k, v, masks)
    for i in range(3):
        assert rel_err(got[i], theirs(qs[i], k, v, masks[i])) < 1e-2


# ----------------------------------------------------------------------------------------------
# The bias
# ----------------------------------------------------------------------------------------------


# (id, (b, t, s, n, kh, d, dtype), bias shape (0: that dim of the call, 1: broadcast), is_causal,
#  window, segments, q_lengths, kv_lengths, mask kind or None)
BIAS_CASES = [
    ("full", (2, 200, 130, 4, 2, 64, BF16), (0, 0, 0, 0), False, None, None, None, None, None),
    ("causal", (2, 333, 400, 8, 2, 128, BF16), (0, 0, 0, 0), True, None, None, None, None, None),
    ("shared", (2, 300, 300, 4, 2, 64, F16), (1, 1, 0, 0), True, None, None, None, None, None),
    ("per_head", (3, 130, 257, 4, 4, 128, BF16), (1, 0, 0, 0), False, None, None, None, None, None),
    ("per_batch", (2, 129, 130, 4, 2, 64, BF16), (0, 1, 0, 0), False, None, None, None, None, None),
    ("keys_only", (2, 200, 300, 4, 2, 128, F16), (0, 1, 1, 0), False, None, None, None, None, None),
    # (a bias constant along the keys has a zero gradient, which bf16 rounding cannot match relatively)
    ("keys_shared", (2, 200, 300, 4, 2, 64, BF16), (1, 1, 1, 0), True, None, None, None, None, None),
    ("one_query", (2, 1, 700, 8, 2, 128, BF16), (0, 0, 0, 0), False, None, None, None, None, None),
    ("with_mask", (2, 333, 400, 4, 2, 64, BF16), (1, 0, 0, 0), False, None, None, None, None, "blocks"),
    ("everything", (2, 333, 1000, 8, 2, 64, BF16), (0, 0, 0, 0), True, (100, 3), "packed", [300, 333], [333, 640],
     "random"),
]


def _bias_run(case, variant, deterministic=False, d=None):
    name, (b, t, s, n, kh, d0, dtype), dims, is_causal, window, segments, q_lengths, kv_lengths, mask_kind = case
    d = d or d0
    seed = zlib.crc32(("bias" + name + str(d)).encode())
    q, k, v, dout = make_inputs(seed, b, t, s, n, kh, d, dtype)
    rng = np.random.default_rng(seed + 1)
    dlse = jnp.asarray(rng.standard_normal((b, n, t), dtype=np.float32))
    # A float32 bias whose values are exact in the inputs' dtype: the kernels read it in that dtype, and
    # XLA may drop the reference's float32 -> bf16 -> float32 round trip (excess precision).
    bias = jnp.asarray((2.0 * rng.standard_normal(_call_shape(b, t, s, n, dims))).astype(jnp.dtype(dtype)), F32)
    masks = make_masks(seed + 2, b, t, s, segments, q_lengths, kv_lengths)
    if mask_kind:
        masks = masks._replace(mask=make_mask(seed + 3, (b, n, t, s), mask_kind))
    opts = dict(scale=1.0 / math.sqrt(d), is_causal=is_causal, window=window)
    got = kernel_fwd_bwd(q, k, v, dout, dlse, masks, bias, variant=variant, deterministic=deterministic, **opts)
    want = reference_fwd_bwd(q, k, v, dout, dlse, masks, bias, **opts)
    assert got[5].shape == bias.shape and got[5].dtype == bias.dtype
    _check_with_bias(got, want)


def _check_with_bias(got, want):
    """(out, lse, dq, dk, dv, dbias) of the kernels against the reference's."""
    for name, x, r in zip(("out", "dq", "dk", "dv", "dbias"), (got[0], *got[2:]), (want[0], *want[2:])):
        assert_close(name, x, r)
    assert_lse_close(got[1], want[1])


@pytest.mark.parametrize("variant", [VARIANT_AUTO, VARIANT_SM80], ids=["auto", "sm80"])
@pytest.mark.parametrize("case", BIAS_CASES, ids=[c[0] for c in BIAS_CASES])
def test_bias_kernels_vs_reference(case, variant):
    _bias_run(case, variant)


@pytest.mark.parametrize("case", [c for c in BIAS_CASES if c[0] in ("causal", "everything")], ids=lambda c: c[0])
def test_bias_deterministic_backward(case):
    _bias_run(case, VARIANT_AUTO, deterministic=True)


@pytest.mark.parametrize("case", [c for c in BIAS_CASES if c[0] in ("causal", "with_mask")], ids=lambda c: c[0])
def test_bias_head_dim_256(case):
    if not _hopper():
        pytest.skip("head_dim 256 runs on H100/H200 only")
    _bias_run(case, VARIANT_AUTO, d=256)


def test_public_api_with_bias_values_and_grads():
    """jax_tk.attention(bias) on the kernels under jit and grad (the bias's gradient too) against
    jax.nn.dot_product_attention's XLA path, and vmapped."""
    b, t, s, n, kh, d = 2, 300, 200, 8, 2, 64
    q, k, v, _ = make_inputs(21, b, t, s, n, kh, d, BF16)
    bias = jnp.asarray(np.random.default_rng(22).standard_normal((1, n, t, s)), BF16)
    f32 = lambda *a: [x.astype(F32) for x in a]
    ours = lambda q, k, v, bias: jax_tk.attention(q, k, v, bias, is_causal=True, implementation="tk")
    theirs = lambda q, k, v, bias: jax.nn.dot_product_attention(*f32(q, k, v, bias), is_causal=True, implementation="xla")
    assert "jax_tk_attention_bwd" in jax.jit(jax.grad(lambda *a: jnp.sum(ours(*a).astype(F32)))).lower(
        q, k, v, bias).as_text()
    w = jnp.asarray(np.random.default_rng(23).standard_normal((b, t, n, d)), F32)
    loss = lambda f: lambda *a: jnp.sum(f(*a).astype(F32) * w)
    assert rel_err(jax.jit(ours)(q, k, v, bias), theirs(q, k, v, bias)) < 1e-2
    got = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2, 3)))(q, k, v, bias)
    want = jax.grad(loss(theirs), argnums=(0, 1, 2, 3))(q, k, v, bias)
    for g, r in zip(got, want):
        assert rel_err(g, r) < 1e-2
    biases = jnp.stack([bias, -bias, 0.5 * bias])
    got = jax.jit(jax.vmap(ours, in_axes=(None, None, None, 0)))(q, k, v, biases)
    for i in range(3):
        assert rel_err(got[i], theirs(q, k, v, biases[i])) < 1e-2


@pytest.mark.parametrize("variant", [VARIANT_AUTO, VARIANT_SM80], ids=["auto", "sm80"])
def test_minus_inf_bias_hides_keys(variant):
    """A -inf bias entry hides its key, as the mask does: scattered ones, a whole 128 x 128 block, and
    rows that see no key at all (output 0, lse -inf, zero gradients, the bias's included)."""
    b, t, s, n, kh, d = 2, 300, 260, 4, 2, 64
    q, k, v, dout = make_inputs(31, b, t, s, n, kh, d, BF16)
    rng = np.random.default_rng(32)
    dlse = jnp.asarray(rng.standard_normal((b, n, t), dtype=np.float32))
    bias = (2.0 * rng.standard_normal((b, n, t, s))).astype(jnp.dtype(BF16)).astype(np.float32)
    bias[rng.random(bias.shape) < 0.3] = -np.inf
    bias[:, :, 128:256, 128:256] = -np.inf
    bias[:, 1, 5:9] = -np.inf
    bias = jnp.asarray(bias)
    opts = dict(scale=1.0 / math.sqrt(d), is_causal=False)
    got = kernel_fwd_bwd(q, k, v, dout, dlse, None, bias, variant=variant, **opts)
    want = reference_fwd_bwd(q, k, v, dout, dlse, None, bias, **opts)
    _check_with_bias(got, want)
    assert np.all(np.isneginf(np.asarray(got[1])[:, 1, 5:9]))
    assert not np.asarray(got[0])[:, 5:9, 1].astype(np.float32).any()
    assert not np.asarray(got[5])[np.isneginf(np.asarray(bias))].any()
