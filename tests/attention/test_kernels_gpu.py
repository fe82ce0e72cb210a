"""GPU tests of the CUDA attention kernels against the float32 reference (skipped without a GPU).

Every kernel output is poisoned with NaN before the kernel runs (through the ``out_init`` test hook,
whose buffers are aliased to the outputs), so an output element the kernel forgets to write shows up
as a NaN. Errors are relative, ``norm(x - ref) / norm(ref)``, against jax_tk.reference computed in
float32 from the same (rounded) inputs.
"""
import functools
import itertools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from jax_tk.attention import reference
import helpers
from jax_tk._core import dispatch, extension
from jax_tk.attention.api import AttentionSpec
from jax_tk.attention.launch import (
    BWD_TARGET, FWD_TARGET, Masks, bwd_kernel, bwd_workspace_shape, fwd_kernel, padded_rows_keys,
)

# The kernels' variant attributes (JAX_TK_KERNELS's values): the fastest for this GPU, the mma.sync ones.
VARIANT_AUTO, VARIANT_SM80 = dispatch.kernel_variant("auto"), dispatch.kernel_variant("sm80")

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
RTOL = 1e-2  # out, dq, dk, dv: norm(x - ref) / norm(ref)
LSE_TOL = 1e-3  # lse: max |x - ref| / max(1, max |ref|)


# ----------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------


def rel_err(x, ref, floor=1e-4):
    return helpers.rel_err(x, ref, floor)


def assert_finite(name, x):
    x = np.asarray(x).astype(np.float32)
    bad = ~np.isfinite(x)
    assert not bad.any(), f"{name}: {bad.sum()} of {x.size} values are NaN/inf (first at {np.argwhere(bad)[0]})"


def assert_close(name, x, ref, tol=RTOL):
    assert_finite(name, x)
    err = rel_err(x, ref)
    assert err < tol, f"{name}: relative error {err:.3g} >= {tol}"


def assert_lse_close(x, ref, tol=LSE_TOL):
    """Rows that see no key have lse = -inf in the reference and must have exactly that; the others
    are finite and close."""
    x = np.asarray(x).astype(np.float64)
    ref = np.asarray(ref).astype(np.float64)
    assert x.shape == ref.shape, (x.shape, ref.shape)
    empty = np.isneginf(ref)
    assert not np.isnan(x).any(), f"lse: {np.isnan(x).sum()} NaN values"
    assert np.array_equal(np.isneginf(x), empty), "lse: -inf (row sees no key) where the reference has none, or not"
    assert_finite("lse", x[~empty])
    if (~empty).any():
        err = np.max(np.abs(x[~empty] - ref[~empty])) / max(1.0, np.max(np.abs(ref[~empty])))
        assert err < tol, f"lse: max error {err:.3g} >= {tol}"


def make_inputs(seed, b, t, s, n, kh, d, dtype, q_mult=1.0):
    """Fresh standard-normal q, k, v, dout (never zeros or ones), rounded to dtype on the host."""
    rng = np.random.default_rng(seed)
    np_dtype = jnp.dtype(dtype)

    def randn(shape, mult=1.0):
        return jnp.asarray((mult * rng.standard_normal(shape, dtype=np.float32)).astype(np_dtype))

    return randn((b, t, n, d), q_mult), randn((b, s, kh, d)), randn((b, s, kh, d)), randn((b, t, n, d))


def random_dlse(seed, b, n, t):
    """A standard-normal cotangent of the lse, [b, n, t] float32 (a zero one would leave the backward's
    dlse term untested)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal((b, n, t), dtype=np.float32))


_nan = helpers.nan


@functools.partial(jax.jit, static_argnames=("scale", "is_causal", "variant", "window", "softcap", "deterministic"))
def kernel_fwd_bwd(q, k, v, dout, dlse, masks=None, bias=None, *, scale, is_causal, variant=VARIANT_AUTO, window=None,
                   softcap=None, deterministic=False):
    """The forward and backward kernels, called directly, with every output (workspaces included)
    poisoned with NaN: (out, lse, dq, dk, dv), and dbias with a bias. variant: VARIANT_AUTO (the fastest
    kernels for this GPU) or VARIANT_SM80 (the mma.sync ones). masks: None or a Masks (segment ids,
    lengths, a boolean mask); bias: None or an additive bias; window: (left, right) or None; softcap:
    float or None; deterministic: the backward's ordered mode."""
    spec = AttentionSpec(scale, is_causal, True, window, softcap, deterministic)
    b, t, n, _ = q.shape
    out, lse = fwd_kernel(q, k, v, spec, out_init=(_nan(q.shape, q.dtype), _nan((b, n, t), F32)), variant=variant,
                          masks=masks, bias=bias)
    dbias = () if bias is None else (_nan((b, n, *padded_rows_keys(t, k.shape[1])), q.dtype),)
    grads = bwd_kernel(
        q, k, v, out, lse, dout, dlse, spec,
        out_init=(_nan(q.shape, q.dtype), _nan(k.shape, k.dtype), _nan(v.shape, v.dtype), _nan((b, n, t), F32),
                  _nan(bwd_workspace_shape(q).shape, F32), *dbias),
        variant=variant, masks=masks, bias=bias,
    )
    return (out, lse, *grads)


@functools.partial(jax.jit, static_argnames=("scale", "is_causal", "window", "softcap"))
def reference_fwd_bwd(q, k, v, dout, dlse, masks=None, bias=None, *, scale, is_causal, window=None, softcap=None):
    """jax_tk.reference in float32 from the same inputs; gradients of (q, k, v[, bias]) from jax.vjp with
    (dout, dlse). The kernels read a bias in the inputs' dtype: give one whose values are exact in it
    (rounded on the host; XLA may drop a float32 -> bf16 -> float32 round trip)."""
    q, k, v, dout = (x.astype(F32) for x in (q, k, v, dout))
    m = Masks() if masks is None else masks
    f = functools.partial(reference.attention_with_lse, scale=scale, is_causal=is_causal, local_window_size=window,
                          q_segment_ids=m.q_segment_ids, kv_segment_ids=m.kv_segment_ids,
                          query_seq_lengths=m.q_lengths, key_value_seq_lengths=m.kv_lengths, logits_soft_cap=softcap,
                          mask=m.mask)
    if bias is None:
        (out, lse), vjp = jax.vjp(f, q, k, v)
    else:
        (out, lse), vjp = jax.vjp(lambda q, k, v, b: f(q, k, v, bias=b), q, k, v, bias.astype(F32))
    # A row that sees no key has lse = -inf; its cotangent must not matter (the kernels ignore it).
    return (out, lse, *vjp((dout, jnp.where(jnp.isneginf(lse), 0.0, dlse.astype(F32)))))


def check_kernels(q, k, v, dout, dlse, masks=None, *, scale, is_causal, variant=VARIANT_AUTO, window=None,
                  softcap=None, deterministic=False):
    opts = dict(scale=scale, is_causal=is_causal, window=window, softcap=softcap)
    got = kernel_fwd_bwd(q, k, v, dout, dlse, masks, variant=variant, deterministic=deterministic, **opts)
    want = reference_fwd_bwd(q, k, v, dout, dlse, masks, **opts)
    out, lse, dq, dk, dv = got
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == F32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert (dq.dtype, dk.dtype, dv.dtype) == (q.dtype, k.dtype, v.dtype)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    # Every output first: a NaN means an element the kernel never wrote (or a real NaN). lse is -inf
    # exactly for rows that see no key (assert_lse_close).
    for name, x in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv)):
        assert_finite(name, x)
    assert_close("out", out, want[0])
    assert_lse_close(lse, want[1])
    for name, x, r in zip(("dq", "dk", "dv"), got[2:], want[2:]):
        assert_close(name, x, r)
    return got, want


# ----------------------------------------------------------------------------------------------
# Kernel sweep, outputs poisoned, against the reference
# ----------------------------------------------------------------------------------------------

SEQ_LENS = [(128, 128), (1, 1), (17, 33), (65, 64), (200, 130), (130, 200), (1024, 1024)]
HEADS = [(4, 4), (8, 2)]  # (query heads, key/value heads)
HEAD_DIMS = [64, 128]


def _sweep_cases():
    """Every (T, S) with every (heads, head_dim, causal); dtype and batch alternate so that each
    (T, S) also sees both dtypes with both causal values and both batch sizes. 57 cases."""
    cases = []
    for i, (t, s) in enumerate(SEQ_LENS):
        for j, ((n, kh), d, causal) in enumerate(itertools.product(HEADS, HEAD_DIMS, (False, True))):
            dtype = (BF16, F16)[(i + j // 2) % 2]
            b = (1, 2)[(i + j // 4 + j % 2) % 2]
            cases.append((b, t, s, n, kh, d, causal, dtype))
    cases.append((1, 4096, 4096, 8, 2, 128, True, BF16))  # one long case
    return [
        pytest.param(*c, id="B{}_T{}_S{}_N{}_K{}_D{}_{}_{}".format(*c[:6], "causal" if c[6] else "full",
                                                              jnp.dtype(c[7]).name))
        for c in cases
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("b,t,s,n,kh,d,is_causal,dtype", _sweep_cases()[::5])
def test_deterministic_backward_vs_reference(b, t, s, n, kh, d, is_causal, dtype):
    """The ordered (deterministic) Hopper backward on a subset of the sweep."""
    seed = zlib.crc32(repr((b, t, s, n, kh, d, is_causal, jnp.dtype(dtype).name, "det")).encode())
    q, k, v, dout = make_inputs(seed, b, t, s, n, kh, d, dtype)
    dlse = jax.random.normal(jax.random.PRNGKey(seed), (b, n, t), F32)
    check_kernels(q, k, v, dout, dlse, scale=1.0 / math.sqrt(d), is_causal=is_causal, deterministic=True)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [VARIANT_AUTO, VARIANT_SM80], ids=["auto", "sm80"])
@pytest.mark.parametrize("b,t,s,n,kh,d,is_causal,dtype", _sweep_cases())
def test_kernels_vs_reference(b, t, s, n, kh, d, is_causal, dtype, variant):
    seed = zlib.crc32(repr((b, t, s, n, kh, d, is_causal, jnp.dtype(dtype).name)).encode())  # fixed per case
    q, k, v, dout = make_inputs(seed, b, t, s, n, kh, d, dtype)
    dlse = random_dlse(seed + 1, b, n, t)
    check_kernels(q, k, v, dout, dlse, scale=1.0 / math.sqrt(d), is_causal=is_causal, variant=variant)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "b,t,s,n,kh,is_causal,dtype",
    [
        (1, 2048 + 67, 2048 + 300, 4, 2, False, BF16),  # a last tile of 67 rows, a partial key block
        (2, 1024, 1100, 2, 1, False, BF16),  # a last tile of 64 rows: two consumers without rows
        (4, 400, 400, 4, 2, True, BF16),  # a last tile of 16 rows
        (2, 150, 500, 2, 2, False, F16),  # one tile, its third consumer with 22 rows
        (2, 1024 + 5, 1024 + 5, 4, 4, True, F16),
        (2, 4096, 2053, 2, 2, False, F16),
        (1, 2048 + 131, 2048 + 131, 2, 1, True, BF16),
        (1, 3000, 4096 + 5, 4, 1, True, F16),  # more keys than queries
        (1, 4096 + 70, 2100, 2, 2, True, BF16),  # more queries than keys
        (1, 8192 + 131, 8192 + 131, 2, 1, True, BF16),
    ],
)
def test_head_dim_64_long_sequences(b, t, s, n, kh, is_causal, dtype):
    """Plain attention at head dim 64 past a few hundred rows: on H100/H200 the forward runs three consumer
    warpgroups on tiles of 192 rows (fwd_sm90.cu, three_consumers), where
    with the causal mask a consumer stops before the key blocks its rows do not see."""
    q, k, v, dout = make_inputs(11 + t + s, b, t, s, n, kh, 64, dtype)
    dlse = random_dlse(12 + t, b, n, t)
    check_kernels(q, k, v, dout, dlse, scale=1.0 / math.sqrt(64), is_causal=is_causal)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "b,t,s,n,kh,d,is_causal,dtype",
    [
        (2, 65, 64, 8, 2, 64, True, BF16),
        (1, 200, 130, 4, 4, 128, False, F16),
        (1, 130, 200, 8, 2, 128, True, F16),
        (2, 1, 1, 4, 4, 64, False, BF16),
        (1, 512, 512, 4, 4, 64, False, BF16),
    ],
)
def test_kernels_with_lse_cotangent(b, t, s, n, kh, d, is_causal, dtype):
    """A random cotangent for the log-sum-exp (as when a loss uses lse, e.g. merging partial results)."""
    q, k, v, dout = make_inputs(7 + t + s + d, b, t, s, n, kh, d, dtype)
    dlse = random_dlse(8 + t, b, n, t)
    check_kernels(q, k, v, dout, dlse, scale=1.0 / math.sqrt(d), is_causal=is_causal)


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [0.05, 0.3])
def test_kernels_custom_scale(scale):
    q, k, v, dout = make_inputs(11, 2, 130, 200, 8, 2, 64, BF16)
    dlse = random_dlse(11, 2, 8, 130)
    check_kernels(q, k, v, dout, dlse, scale=scale, is_causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_large_magnitude_inputs(dtype, is_causal):
    """q * 10: very peaked softmax (logits of tens); nothing may overflow to NaN/inf, and the values and
    gradients still match the reference."""
    b, t, s, n, kh, d = 2, 300, 257, 8, 2, 128
    q, k, v, dout = make_inputs(12, b, t, s, n, kh, d, dtype, q_mult=10.0)
    dlse = random_dlse(13, b, n, t)
    scale = 1.0 / math.sqrt(d)
    got = kernel_fwd_bwd(q, k, v, dout, dlse, scale=scale, is_causal=is_causal)
    for name, x in zip(("out", "lse", "dq", "dk", "dv"), got):
        assert_finite(name, x)
    want = reference_fwd_bwd(q, k, v, dout, dlse, scale=scale, is_causal=is_causal)
    assert_close("out", got[0], want[0])
    assert_lse_close(got[1], want[1])
    for name, x, ref in zip(("dq", "dk", "dv"), got[2:], want[2:]):
        assert_close(name, x, ref)


# ----------------------------------------------------------------------------------------------
# Masking options: windows, segment ids, sequence lengths, soft cap (and their combinations)
# ----------------------------------------------------------------------------------------------


def sorted_segments(rng, b, n, parts, offset=0):
    """[b, n] int32 ids of `parts` contiguous segments of random lengths (packed sequences)."""
    ids = np.zeros((b, n), np.int32)
    for i in range(b):
        cuts = np.sort(rng.choice(np.arange(1, n), min(parts, n) - 1, replace=False))
        ids[i] = offset + np.searchsorted(cuts, np.arange(n), side="right")
    return ids


def make_masks(seed, b, t, s, segments=None, q_lengths=None, kv_lengths=None):
    """segments: None, "packed" (sorted ids, query and key segments of different lengths; the queries
    have one segment more than the keys: its rows see no key), "documents" (t == s, the same 8 sorted
    segments for queries and keys) or "random" (unsorted ids in 0..2)."""
    rng = np.random.default_rng(seed)
    qs = ks = None
    if segments == "packed":
        qs, ks = sorted_segments(rng, b, t, 4), sorted_segments(rng, b, s, 3)
    elif segments == "documents":  # self-attention over packed documents: whole blocks are skipped
        qs = ks = sorted_segments(rng, b, t, 8)
    elif segments == "random":
        qs, ks = rng.integers(0, 3, (b, t)).astype(np.int32), rng.integers(0, 3, (b, s)).astype(np.int32)
    arr = lambda x: None if x is None else jnp.asarray(np.asarray(x, np.int32))
    return Masks(arr(qs), arr(ks), arr(q_lengths), arr(kv_lengths))


# (id, (b, t, s, n, kh, d, dtype), is_causal, window, segments, q_lengths, kv_lengths, softcap, q_mult)
MASK_CASES = [
    ("window", (1, 200, 130, 8, 2, 64, BF16), False, (16, 8), None, None, None, None, 1.0),
    ("window_left_only_causal_gqa", (2, 333, 1000, 8, 2, 128, F16), True, (64, 0), None, None, None, None, 1.0),
    ("window_right_only", (1, 130, 200, 4, 4, 64, BF16), False, (0, 40), None, None, None, None, 1.0),
    ("window_causal_gqa_long", (1, 1024, 1024, 8, 2, 128, BF16), True, (200, 0), None, None, None, None, 1.0),
    ("segments_packed", (2, 200, 130, 4, 2, 128, BF16), False, None, "packed", None, None, None, 1.0),
    ("documents_causal", (2, 1000, 1000, 4, 2, 128, BF16), True, None, "documents", None, None, None, 1.0),
    ("documents_gqa", (1, 777, 777, 8, 2, 64, F16), False, None, "documents", None, None, None, 1.0),
    # documents with the other options: the Hopper forward's tiles of one document each, with their
    # rule cut by lengths (a query length inside a document, a key length before it) and a window
    ("documents_lengths", (2, 1000, 1000, 4, 2, 128, BF16), False, None, "documents", [1000, 517], [700, 1000], None, 1.0),
    ("documents_everything", (2, 333, 333, 8, 2, 64, BF16), True, (100, 3), "documents", [300, 333], [333, 200], 8.0, 2.0),
    ("segments_random_causal", (1, 333, 1000, 4, 4, 64, F16), True, None, "random", None, None, None, 1.0),
    ("lengths", (3, 200, 130, 4, 2, 64, BF16), False, None, None, [200, 57, 0], [130, 0, 64], None, 1.0),
    ("segments_lengths", (2, 333, 1000, 8, 2, 128, BF16), False, None, "packed", [333, 100], [700, 1000], None, 1.0),
    ("softcap_causal", (2, 200, 130, 8, 2, 128, BF16), True, None, None, None, None, 5.0, 4.0),
    ("softcap", (1, 333, 1000, 4, 4, 64, F16), False, None, None, None, None, 30.0, 2.0),
    ("everything", (2, 333, 1000, 8, 2, 64, BF16), True, (100, 3), "packed", [300, 333], [333, 640], 8.0, 2.0),
    # more than 2048 key blocks with segment ids at D = 128: the Hopper forward's block lists leave no
    # room for its O staging tiles, and its consumers store O themselves
    ("segments_long_keys", (1, 100, 263000, 2, 1, 128, BF16), False, None, "packed", None, None, None, 1.0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [VARIANT_AUTO, VARIANT_SM80], ids=["auto", "sm80"])
@pytest.mark.parametrize("case", MASK_CASES, ids=[c[0] for c in MASK_CASES])
def test_masking_kernels_vs_reference(case, variant):
    name, (b, t, s, n, kh, d, dtype), is_causal, window, segments, q_lengths, kv_lengths, softcap, q_mult = case
    seed = zlib.crc32(name.encode())
    q, k, v, dout = make_inputs(seed, b, t, s, n, kh, d, dtype, q_mult=q_mult)
    dlse = random_dlse(seed + 1, b, n, t)
    masks = make_masks(seed + 2, b, t, s, segments, q_lengths, kv_lengths)
    got, want = check_kernels(q, k, v, dout, dlse, masks, scale=1.0 / math.sqrt(d), is_causal=is_causal,
                              variant=variant, window=window, softcap=softcap)
    # Rows that see no key: out exactly 0 and dq exactly 0.
    empty = np.isneginf(np.asarray(want[1]))  # [b, n, t]
    if empty.any():
        rows = np.transpose(empty, (0, 2, 1))  # [b, t, n]
        assert not np.asarray(got[0], np.float32)[rows].any(), "out of a row that sees no key is not 0"
        assert not np.asarray(got[2], np.float32)[rows].any(), "dq of a row that sees no key is not 0"


@pytest.mark.gpu
def test_masking_public_api_and_grad():
    """jax_tk.attention with every option through the custom_vjp (implementation="tk")."""
    b, t, s, n, kh, d = 2, 200, 130, 8, 2, 128
    q, k, v, dout = make_inputs(21, b, t, s, n, kh, d, BF16, q_mult=2.0)
    m = make_masks(22, b, t, s, "packed", [200, 150], [100, 130])
    kwargs = dict(is_causal=True, local_window_size=(50, 10), q_segment_ids=m.q_segment_ids,
                  kv_segment_ids=m.kv_segment_ids, query_seq_lengths=m.q_lengths,
                  key_value_seq_lengths=m.kv_lengths, logits_soft_cap=10.0)
    f = functools.partial(jax_tk.attention, implementation="tk", **kwargs)
    out = jax.jit(f)(q, k, v)
    grads = jax.jit(jax.grad(_loss(f, dout), argnums=(0, 1, 2)))(q, k, v)
    want = reference_fwd_bwd(q, k, v, dout, jnp.zeros((b, n, t), F32), m, scale=1 / math.sqrt(d), is_causal=True,
                             window=(50, 10), softcap=10.0)
    assert_close("out", out, want[0])
    for name, x, r in zip(("dq", "dk", "dv"), grads, want[2:]):
        assert_close(name, x, r)


# ----------------------------------------------------------------------------------------------
# Public API on the GPU
# ----------------------------------------------------------------------------------------------


def _loss(fn, dout):
    return lambda q, k, v: jnp.sum(fn(q, k, v).astype(F32) * dout.astype(F32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("implementation", ["tk", None])
def test_public_attention_and_grad(dtype, is_causal, implementation):
    b, t, s, n, kh, d = 2, 300, 257, 8, 2, 128
    q, k, v, dout = make_inputs(13, b, t, s, n, kh, d, dtype)
    f = functools.partial(jax_tk.attention, is_causal=is_causal, implementation=implementation)
    out = jax.jit(f)(q, k, v)
    dq, dk, dv = jax.jit(jax.grad(_loss(f, dout), argnums=(0, 1, 2)))(q, k, v)
    want = reference_fwd_bwd(q, k, v, dout, jnp.zeros((b, n, t), F32), scale=1 / math.sqrt(d), is_causal=is_causal)
    assert out.dtype == dtype and dq.dtype == dtype
    assert_close("out", out, want[0])
    for name, x, r in zip(("dq", "dk", "dv"), (dq, dk, dv), want[2:]):
        assert_close(name, x, r)


@pytest.mark.gpu
def test_public_attention_with_lse_grad_through_both_outputs():
    b, t, s, n, kh, d = 1, 200, 333, 8, 2, 64
    q, k, v, dout = make_inputs(14, b, t, s, n, kh, d, BF16)
    dlse = random_dlse(15, b, n, t)

    def loss(q, k, v):
        out, lse = jax_tk.attention_with_lse(q, k, v, is_causal=True, implementation="tk")
        return jnp.sum(out.astype(F32) * dout.astype(F32)) + jnp.sum(lse * dlse)

    out, lse = jax.jit(functools.partial(jax_tk.attention_with_lse, is_causal=True, implementation="tk"))(q, k, v)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    want = reference_fwd_bwd(q, k, v, dout, dlse, scale=1 / math.sqrt(d), is_causal=True)
    assert_close("out", out, want[0])
    assert_lse_close(lse, want[1])
    for name, x, r in zip(("dq", "dk", "dv"), grads, want[2:]):
        assert_close(name, x, r)


@pytest.mark.gpu
def test_default_implementation_picks_kernel_on_gpu():
    q, k, v, dout = make_inputs(16, 1, 128, 128, 4, 4, 64, BF16)
    f = functools.partial(jax_tk.attention, is_causal=True)
    lowered = jax.jit(f).lower(q, k, v)
    assert FWD_TARGET in lowered.as_text()
    assert FWD_TARGET in lowered.compile().as_text()
    grad = jax.grad(_loss(f, dout), argnums=(0, 1, 2))
    assert BWD_TARGET in jax.jit(grad).lower(q, k, v).as_text()


@pytest.mark.gpu
def test_unsupported_config_on_gpu_falls_back_to_reference():
    for dtype, d in ((F32, 64), (BF16, 96)):
        q, k, v, _ = make_inputs(17, 1, 33, 47, 4, 2, d, dtype)
        f = functools.partial(jax_tk.attention, is_causal=True)
        assert FWD_TARGET not in jax.jit(f).lower(q, k, v).as_text()
        want = reference.attention(q.astype(F32), k.astype(F32), v.astype(F32), scale=1 / math.sqrt(d), is_causal=True)
        assert_close("out", jax.jit(f)(q, k, v), want, tol=1e-5 if dtype == F32 else RTOL)
        with pytest.raises(ValueError, match="implementation='tk'"):
            jax_tk.attention(q, k, v, implementation="tk")


@pytest.mark.gpu
def test_vmap_of_kernel():
    e, b, t, s, n, kh, d = 3, 1, 70, 90, 4, 2, 64
    rng = np.random.default_rng(18)
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(jnp.dtype(BF16)))
        for shape in ((e, b, t, n, d), (e, b, s, kh, d), (e, b, s, kh, d))
    )
    out = jax.jit(jax.vmap(functools.partial(jax_tk.attention, implementation="tk")))(q, k, v)
    for i in range(e):
        want = reference.attention(q[i].astype(F32), k[i].astype(F32), v[i].astype(F32), scale=1 / 8, is_causal=False)
        assert_close(f"out[{i}]", out[i], want)


# ----------------------------------------------------------------------------------------------
# Determinism
# ----------------------------------------------------------------------------------------------


def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("variant", [VARIANT_AUTO, VARIANT_SM80], ids=["auto", "sm80"])
def test_backward_is_deterministic(is_causal, variant):
    """With deterministic=True two runs give bitwise identical results (GQA: several query heads
    feed each dk/dv; 16 key blocks add into each dq block), and they match the reference."""
    b, t, s, n, kh, d = 2, 1024, 1030, 8, 2, 128
    q, k, v, dout = make_inputs(19, b, t, s, n, kh, d, BF16)
    dlse = random_dlse(20, b, n, t)
    run = functools.partial(check_kernels, q, k, v, dout, dlse, scale=1 / math.sqrt(d), is_causal=is_causal,
                            variant=variant, deterministic=True)
    first, _ = run()
    for _ in range(2):
        again, _ = run()
        for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), first, again):
            assert _same_bits(x, y), f"{name} differs between two identical runs"
    # Same through the public API.
    if variant == VARIANT_SM80:
        return
    attn = functools.partial(jax_tk.attention, is_causal=is_causal, deterministic_backward=True)
    grad = jax.jit(jax.grad(_loss(attn, dout), argnums=(0, 1, 2)))
    g1, g2 = grad(q, k, v), grad(q, k, v)
    for name, x, y in zip(("dq", "dk", "dv"), g1, g2):
        assert _same_bits(x, y), f"public {name} differs between two identical runs"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "b,t,n,kh,d,is_causal,window,segments,softcap",
    [(1, 1000, 4, 2, 128, True, None, "documents", None),
     (2, 700, 4, 4, 64, False, (100, 20), None, None),
     (2, 200, 4, 2, 128, True, None, None, 5.0),
     (1, 300, 2, 1, 256, True, (64, 0), "documents", None)],
    ids=["documents_causal", "window", "softcap", "d256_window_documents"])
def test_masked_backward_is_deterministic(b, t, n, kh, d, is_causal, window, segments, softcap):
    """The ordered backward with the masking options (each option set has its own Hopper backward
    kernel): against the reference, and bitwise the same in two runs."""
    if d == 256 and not HOPPER:
        pytest.skip("the head-dim-256 kernels run on compute capability 9.0")
    seed = zlib.crc32(f"det{t}{d}{segments}{softcap}".encode())
    q, k, v, dout = make_inputs(seed, b, t, t, n, kh, d, BF16, q_mult=2.0 if softcap else 1.0)
    dlse = random_dlse(seed + 1, b, n, t)
    masks = make_masks(seed + 2, b, t, t, segments) if segments else None
    opts = dict(scale=1 / math.sqrt(d), is_causal=is_causal, window=window, softcap=softcap, deterministic=True)
    got, _ = check_kernels(q, k, v, dout, dlse, masks, **opts)
    again = kernel_fwd_bwd(q, k, v, dout, dlse, masks, **opts)
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), got, again):
        assert _same_bits(x, y), f"{name} differs between two identical runs"


# ----------------------------------------------------------------------------------------------
# Head dim 256: sm_90a kernels only (H100/H200), forward and backward
# ----------------------------------------------------------------------------------------------

HOPPER = extension.cuda_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the head-dim-256 kernels run on compute capability 9.0")
@pytest.mark.parametrize(
    "b,t,s,n,kh,dtype,is_causal,window,segments,softcap,deterministic",
    [(2, 333, 1000, 4, 2, BF16, False, None, None, None, False),
     (1, 1000, 1000, 4, 4, F16, True, None, None, None, False),
     (2, 70, 33, 8, 2, BF16, True, None, None, None, True),
     (1, 777, 777, 4, 2, BF16, True, (100, 0), "documents", None, False),
     (2, 200, 130, 4, 2, F16, False, (16, 8), "packed", 20.0, False),
     (1, 513, 257, 8, 1, BF16, False, None, None, 5.0, True)],
    ids=["cross_gqa", "causal_fp16", "short_causal_deterministic", "window_documents", "window_packed_softcap",
         "mqa_softcap_deterministic"])
def test_head_dim_256_kernels(b, t, s, n, kh, dtype, is_causal, window, segments, softcap, deterministic):
    d = 256
    seed = zlib.crc32(f"{b}{t}{s}{n}{kh}{is_causal}{softcap}".encode())
    q, k, v, dout = make_inputs(seed, b, t, s, n, kh, d, dtype, q_mult=2.0 if softcap else 1.0)
    dlse = random_dlse(seed + 1, b, n, t)
    masks = make_masks(seed + 2, b, t, s, segments) if segments else None
    got, _ = check_kernels(q, k, v, dout, dlse, masks, scale=1 / math.sqrt(d), is_causal=is_causal, window=window,
                           softcap=softcap, deterministic=deterministic)
    if deterministic:
        again = kernel_fwd_bwd(q, k, v, dout, dlse, masks, scale=1 / math.sqrt(d), is_causal=is_causal, window=window,
                               softcap=softcap, deterministic=True)
        for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), got, again):
            assert _same_bits(x, y), f"{name} differs between two identical runs"


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the head-dim-256 kernels run on compute capability 9.0")
def test_head_dim_256_public_api_and_grad():
    """implementation=None and "tk" take both kernels; outputs and gradients match the reference."""
    b, t, n, d = 2, 300, 4, 256
    q, k, v, dout = make_inputs(31, b, t, t, n, 2, d, BF16)
    for impl in (None, "tk"):
        f = functools.partial(jax_tk.attention, is_causal=True, implementation=impl)
        assert FWD_TARGET in jax.jit(f).lower(q, k, v).as_text()
        grad = jax.jit(jax.grad(_loss(f, dout), argnums=(0, 1, 2)))
        assert BWD_TARGET in grad.lower(q, k, v).as_text()
        want = reference_fwd_bwd(q, k, v, dout, jnp.zeros((b, n, t), F32), scale=1 / math.sqrt(d), is_causal=True)
        assert_close("out", jax.jit(f)(q, k, v), want[0])
        for name, x, r in zip(("dq", "dk", "dv"), grad(q, k, v), want[2:]):
            assert_close(name, x, r)
