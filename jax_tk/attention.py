"""jax_tk.attention: scaled dot-product attention on jax_tk's kernels, differentiable and jit-friendly."""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_tk import _ffi, reference, sharding

IMPLEMENTATIONS = (None, "tk", "xla")
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)
KERNEL_HEAD_DIMS = (64, 128)  # forward and backward, every GPU path
HOPPER_HEAD_DIMS = (256,)  # forward and backward, the sm_90a kernels only (H100/H200)
FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)

FWD_TARGET = "jax_tk_attention_fwd"
BWD_TARGET = "jax_tk_attention_bwd"


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Static description of one attention call (hashable: it is a custom_vjp nondiff argument).

    window: ``(left, right)`` (ints >= 0, as given to ``local_window_size``) or None.
    softcap: the logit soft cap (a positive float) or None.
    """

    scale: float
    is_causal: bool
    use_kernel: bool
    window: tuple[int, int] | None = None
    softcap: float | None = None
    deterministic: bool = False  # backward: same bits every run (the Hopper kernel orders its dq sums)


class Masks(NamedTuple):
    """The array-valued masking options of one call (None where not given): ``q_segment_ids``
    ``[batch, q_len]``, ``kv_segment_ids`` ``[batch, kv_len]``, ``q_lengths`` and ``kv_lengths``
    ``[batch]``, integers. A pytree: an input of the custom_vjp (not differentiable)."""

    q_segment_ids: jax.Array | None = None
    kv_segment_ids: jax.Array | None = None
    q_lengths: jax.Array | None = None
    kv_lengths: jax.Array | None = None


# ----------------------------------------------------------------------------------------------
# Input checks (trace time)
# ----------------------------------------------------------------------------------------------


def _positive_float(name, value):
    """None, or value as a positive finite float (TypeError for strings, bools and non-numbers)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, bool, np.bool_)):
        raise TypeError(f"jax_tk.attention: {name} must be a Python float or None, got {value!r}")
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"jax_tk.attention: {name} must be a Python float or None, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"jax_tk.attention: {name} must be a positive finite float, got {value}")
    return value


def _check_inputs(query, key, value, scale, is_causal, implementation):
    names = ("query", "key", "value")
    for name, x in zip(names, (query, key, value)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"jax_tk.attention: {name} must be an array, got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(
                f"jax_tk.attention: {name} must have rank 4 [batch, seq, heads, head_dim], "
                f"got shape {tuple(x.shape)}"
            )
        if not any(x.dtype == d for d in FLOAT_DTYPES):
            raise TypeError(
                f"jax_tk.attention: {name} must be bfloat16, float16 or float32, got {x.dtype}"
            )
        if any(dim == 0 for dim in x.shape):
            raise ValueError(f"jax_tk.attention: {name} has an empty dimension: {tuple(x.shape)}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            "jax_tk.attention: query, key and value must have the same dtype, got "
            f"{query.dtype}, {key.dtype}, {value.dtype}"
        )
    if key.shape != value.shape:
        raise ValueError(
            f"jax_tk.attention: key and value must have the same shape, got {tuple(key.shape)} "
            f"and {tuple(value.shape)}"
        )
    b, _, n, d = query.shape
    kb, _, kh, kd = key.shape
    if kb != b:
        raise ValueError(f"jax_tk.attention: batch of key/value ({kb}) != batch of query ({b})")
    if kd != d:
        raise ValueError(f"jax_tk.attention: head_dim of key/value ({kd}) != head_dim of query ({d})")
    if n % kh != 0:
        raise ValueError(
            f"jax_tk.attention: the number of query heads ({n}) must be a multiple of the number "
            f"of key/value heads ({kh})"
        )
    scale = _positive_float("scale", scale)
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"jax_tk.attention: is_causal must be a bool, got {is_causal!r}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"jax_tk.attention: implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}"
        )
    return 1.0 / math.sqrt(d) if scale is None else scale


def kernel_unsupported_reason(query, key) -> str | None:
    """Why the CUDA kernel cannot take this configuration, or None if it can."""
    if not any(query.dtype == d for d in KERNEL_DTYPES):
        return f"dtype {query.dtype} (the kernel takes bfloat16 and float16)"
    d = query.shape[-1]
    if d in HOPPER_HEAD_DIMS:
        if _ffi.cuda_device_capability() != (9, 0) or _default_variant() != VARIANT_AUTO:
            return f"head_dim {d} (kernels on H100/H200 only; elsewhere the kernels take {KERNEL_HEAD_DIMS})"
        return None
    if d not in KERNEL_HEAD_DIMS:
        return f"head_dim {d} (the kernels take {KERNEL_HEAD_DIMS}, and {HOPPER_HEAD_DIMS} on H100/H200)"
    return None


def _local_cuda_devices() -> bool:
    return _ffi.cuda_device_capability() is not None


@functools.lru_cache(maxsize=None)
def _warn_no_kernels():
    warnings.warn(
        "jax_tk was installed without its CUDA kernels (no nvcc at build time); attention runs the "
        "pure-JAX reference on the GPU. Reinstall on a machine with nvcc to get the kernels.",
        RuntimeWarning,
        stacklevel=3,
    )


def _use_kernel(query, key, implementation) -> bool:
    reason = kernel_unsupported_reason(query, key)
    if implementation == "xla":
        return False
    if implementation == "tk":
        if reason is not None:
            raise ValueError(f"jax_tk.attention(implementation='tk'): unsupported {reason}")
        if not _ffi.has_cuda_kernels():
            raise RuntimeError(
                "jax_tk.attention(implementation='tk'): jax_tk was built without CUDA kernels "
                "(no nvcc at install time)"
            )
        if not _local_cuda_devices():
            raise RuntimeError("jax_tk.attention(implementation='tk') needs a CUDA GPU")
        return True
    # implementation=None: the kernel where it applies. Without local CUDA devices we still emit the
    # kernel in the CUDA branch, so that programs exported or lowered for CUDA use it.
    if reason is not None:
        return False
    if _local_cuda_devices() and not _ffi.has_cuda_kernels():
        _warn_no_kernels()
        return False
    return True


# ----------------------------------------------------------------------------------------------
# Kernel calls
# ----------------------------------------------------------------------------------------------


def _lse_shape(query):
    b, t, n, _ = query.shape
    return jax.ShapeDtypeStruct((b, n, t), jnp.float32)


# Kernel variants: 0 = the fastest for the device (sm_90a kernels on H100/H200), 1 = the mma.sync
# (sm_80) kernels on every GPU. Tests and benchmarks use 1 to check and time the portable path.
# The environment variable JAX_TK_ATTENTION_KERNELS=sm80 makes the mma.sync kernels the default.
VARIANT_AUTO, VARIANT_SM80 = 0, 1


def _default_variant() -> int:
    return VARIANT_SM80 if os.environ.get("JAX_TK_ATTENTION_KERNELS", "").lower() == "sm80" else VARIANT_AUTO


SEGMENT_GRANULE = 64  # rows per segment range (SEGMENT_GRANULE in cc/attention/attention.h)


def _segment_ranges(ids):
    """[batch, ceil(n / 64), 2]: the smallest and largest segment id of every 64 rows of ``ids``
    ``[batch, n]`` (the last group padded with its own last id). The kernels skip a block of queries
    and keys whose id ranges do not meet, and need no elementwise mask where both hold one id."""
    b, n = ids.shape
    pad = -n % SEGMENT_GRANULE
    groups = jnp.pad(ids, ((0, 0), (0, pad)), mode="edge").reshape(b, -1, SEGMENT_GRANULE)
    return jnp.stack([groups.min(axis=-1), groups.max(axis=-1)], axis=-1)


def _block_spans(ranges, block):
    """[batch, ceil(n / block), 2]: the smallest and largest segment id of every ``block`` rows (a
    multiple of 64), from the 64-row ``ranges`` of ``_segment_ranges``."""
    k = block // SEGMENT_GRANULE
    b, g, _ = ranges.shape
    r = jnp.pad(ranges, ((0, 0), (0, -g % k), (0, 0)), mode="edge").reshape(b, -1, k, 2)
    return jnp.stack([r[..., 0].min(axis=-1), r[..., 1].max(axis=-1)], axis=-1)


# The blocks of the sm_90a kernels' orders (Params::fwd_tiles and bwd_order_rows in
# cc/attention/attention.h): the forward's 128-row query tiles visit key blocks of 128 (64 at
# head_dim 256); the backward's key blocks (128 keys, 64 at head_dim 256) visit 64-row query blocks.
def _fwd_order_blocks(head_dim):
    return 128, (128 if head_dim <= 128 else 64)  # query rows, keys per block


def _bwd_order_blocks(head_dim):
    return (128 if head_dim <= 128 else 64), 64  # keys per block, query rows


# Heads per group of the block order (_block_order). Measured on an H100 (8 documents of random
# lengths in 16k, 16 heads, D = 128): groups of 4 heads ran the forward 6% and the backward 3-4%
# faster than the kernels' own order; groups of 1, 2 or 8 heads less so (8: 3% slower on the causal
# backward), and one group of all 16 heads ran the causal backward at 0.7x (the blocks running at one
# time then read the queries and keys of all heads of a document: L2).
ORDER_GROUP_HEADS = 4


def _order_group(group, heads):
    """Heads per group of the orders: the largest divisor of ``heads`` up to ``group``."""
    return max(g for g in range(1, min(group, heads) + 1) if heads % g == 0)


def _block_order(q_ranges, kv_ranges, q_block, kv_block, causal, by_queries, heads, group):
    """With segment ids, the Hopper kernels take their blocks of the fixed grid in this order (the
    backward's ``Params::block_order``; the forward's grid tiles, ``_fwd_tiles``):
    the (batch entry, head, block) triples ``(b * heads + h) * blocks + i``, longest first within
    groups of ``group`` heads (the largest divisor of ``heads`` up to it; ORDER_GROUP_HEADS says why
    groups): the (batch entry, block) pairs sorted by how many blocks of the other side they visit,
    most first (ties in index order), each for the group's heads, then the next group. The forward's
    blocks are its query tiles (``by_queries``), the backward's its key blocks. The count sees the
    segments and the causal mask (not windows or lengths: the order only moves work between SMs, the
    results do not depend on it)."""
    q, k = _block_spans(q_ranges, q_block), _block_spans(kv_ranges, kv_block)
    meet = (q[:, :, None, 0] <= k[:, None, :, 1]) & (k[:, None, :, 0] <= q[:, :, None, 1])  # [b, q blocks, kv blocks]
    if causal:  # key block j starts at or before query block i ends
        i = jnp.arange(q.shape[1])[:, None]
        j = jnp.arange(k.shape[1])[None, :]
        meet &= j * kv_block <= i * q_block + q_block - 1
    work = meet.sum(axis=2 if by_queries else 1, dtype=jnp.int32)  # [b, blocks]
    blocks = work.shape[1]
    pairs = jnp.argsort(-work.reshape(-1), stable=True).astype(jnp.int32)  # b * blocks + i
    group = _order_group(group, heads)
    # (iota, not numpy constants: a custom_partitioning rule traces this and takes no constants)
    h = jnp.arange(heads // group, dtype=jnp.int32)[:, None, None] * group + jnp.arange(group, dtype=jnp.int32)
    b, i = (pairs // blocks)[None, :, None], (pairs % blocks)[None, :, None]
    return ((b * heads + h) * blocks + i).reshape(-1)


def _fwd_tiles(q_ids, kv_ids, q_ranges, kv_ranges, causal, heads, group, head_dim):
    """With segment ids, the Hopper forward's tiles (``Params::fwd_tiles``): ``fwd_tile_cap(T)`` entries
    per (batch entry, head), four int32 each, {b * heads + h (-1: none), q0, end, key base}, flattened;
    the unused entries last.

    Where the query and key ids are the same sorted runs (packed documents: ``T == S``, ids
    non-decreasing along each row, head_dim <= 128) and the tiles fit, each document gets tiles of its
    own, 128 rows from its start (the last one shorter), that visit only its keys, in blocks from its
    start: no tile cuts through a document boundary, and none needs the elementwise segment test. The
    (batch entry, tile) pairs go longest first (keys visited), in groups of ``group`` heads as in
    ``_block_order``. Otherwise (other ids, or more documents than the room allows) the tiles of the
    fixed grid, in ``_block_order``'s order, with key base -1. The choice is made on the device."""
    q_block, kv_block = _fwd_order_blocks(head_dim)
    b, t = q_ids.shape
    qblocks = -(-t // q_block)
    cap = 2 * qblocks  # fwd_tile_cap in cc/attention/attention.h
    n = b * heads * cap
    # (-1, 0, 0, -1), from an iota: a custom_partitioning rule traces this and takes no constants
    unused = -(jnp.arange(4, dtype=jnp.int32) % 3 == 0).astype(jnp.int32)
    order = _block_order(q_ranges, kv_ranges, q_block, kv_block, causal, True, heads, group)  # (b * heads + h) * qblocks + i
    grid = jnp.stack([order // qblocks, order % qblocks * q_block, jnp.full_like(order, t), jnp.full_like(order, -1)], -1)
    grid = jnp.concatenate([grid, jnp.broadcast_to(unused, (n - grid.shape[0], 4))])
    if kv_ids.shape[1] != t or head_dim > 128:
        return grid.reshape(-1)
    # Documents: where each row's runs of ids start and end, and where their tiles start.
    pos = jnp.arange(t, dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones((b, 1), bool), q_ids[:, 1:] != q_ids[:, :-1]], axis=1)
    doc_start = jax.lax.cummax(jnp.where(starts, pos, 0), axis=1)
    next_start = jax.lax.cummin(jnp.where(starts, pos, t), axis=1, reverse=True)
    doc_end = jnp.concatenate([next_start[:, 1:], jnp.full((b, 1), t, jnp.int32)], axis=1)
    tile_starts = (pos - doc_start) % q_block == 0
    count = tile_starts.sum(axis=1)
    documents = (jnp.all(q_ids == kv_ids) & jnp.all(q_ids[:, 1:] >= q_ids[:, :-1]) & jnp.all(count <= cap))
    rank = jnp.where(tile_starts, jnp.cumsum(tile_starts, axis=1, dtype=jnp.int32) - 1, cap)
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    q0 = jnp.full((b, cap), t, jnp.int32).at[rows, rank].set(jnp.broadcast_to(pos, (b, t)), mode="drop")  # [b, cap]
    valid = q0 < t
    at = jnp.minimum(q0, t - 1)
    start, end = jnp.take_along_axis(doc_start, at, axis=1), jnp.take_along_axis(doc_end, at, axis=1)
    keys = (jnp.minimum(q0 + q_block, end) if causal else end) - start
    work = jnp.where(valid, -(-keys // kv_block), -1).reshape(-1)
    pairs = jnp.argsort(-work, stable=True).astype(jnp.int32)  # b * cap + i, the unused ones last
    used = valid.sum(dtype=jnp.int32)
    group = _order_group(group, heads)
    # entry e: group e // (used * group) of heads, then the pairs, each for the group's heads
    e = jnp.arange(n, dtype=jnp.int32)
    per_group = jnp.maximum(used, 1) * group
    g, rest = e // per_group, e % per_group
    pair = pairs[jnp.minimum(rest // group, b * cap - 1)]
    bb, i = pair // cap, pair % cap
    h = g * group + rest % group
    docs = jnp.stack([bb * heads + h, q0[bb, i], end[bb, i], start[bb, i]], -1)
    docs = jnp.where((e < heads * used)[:, None], docs, unused)
    return jnp.where(documents, docs, grid).reshape(-1)


def _mask_operands(masks: Masks | None, order=None):
    """The masking operands of the kernels: the four options of ``masks``, the two segment ranges,
    then with segment ids ``order(q_ids, kv_ids, q_ranges, kv_ranges)`` (the forward's tiles,
    ``_fwd_tiles``, or the backward's block order, ``_block_order``; None: the kernel's own), as int32
    arrays, or int32 arrays of shape (0,) where an option is absent (the handler decodes those as
    "none")."""
    masks = Masks() if masks is None else masks
    ints = [None if x is None else jnp.asarray(x).astype(jnp.int32) for x in masks]
    ranges = [None if x is None else _segment_ranges(x) for x in ints[:2]]
    block_order = None if ranges[0] is None or order is None else order(*ints[:2], *ranges)
    return tuple(jnp.zeros((0,), jnp.int32) if x is None else x for x in (*ints, *ranges, block_order))


def _mask_attributes(spec: AttentionSpec, q_len: int, kv_len: int) -> dict:
    """window_left/window_right (-1: unbounded; a side that reaches past the sequence is unbounded, which
    also keeps the attribute in int32) and softcap (0: none)."""
    left, right = spec.window if spec.window is not None else (-1, -1)
    left = -1 if left < 0 or left >= q_len else left
    right = -1 if right < 0 or right >= kv_len else right
    return dict(window_left=np.int32(left), window_right=np.int32(right),
                softcap=np.float32(spec.softcap if spec.softcap is not None else 0.0))


def _kernel_call(target, out_types, args, spec, out_init, variant=None, masks=None, seq_lens=None, order=None,
                 **attrs):
    """Calls an FFI target with ``args`` followed by the masking operands (``_mask_operands``, with
    ``order``). ``out_init`` (tests only) gives buffers that are aliased to the outputs, so that a test
    can poison every output before the kernel runs; the handler ignores them as inputs. ``attrs``: the
    target's own attributes."""
    variant = _default_variant() if variant is None else variant
    if variant == VARIANT_SM80:
        order = None  # (only the Hopper kernels take it)
    args = (*args, *_mask_operands(masks, order))
    aliases = None
    if out_init is not None:
        aliases = {len(args) + i: i for i in range(len(out_init))}
        args = (*args, *out_init)
    call = jax.ffi.ffi_call(target, out_types, vmap_method="sequential", input_output_aliases=aliases)
    return call(*args, scale=np.float32(spec.scale), is_causal=np.int32(spec.is_causal), variant=np.int32(variant),
                **_mask_attributes(spec, *seq_lens), **attrs)


def _fwd_kernel(query, key, value, spec: AttentionSpec, out_init=None, variant=None, masks=None):
    out_types = (
        jax.ShapeDtypeStruct(query.shape, query.dtype),
        _lse_shape(query),
        jax.ShapeDtypeStruct((1,), jnp.int32),  # workspace: the Hopper kernel's tile counter
    )
    order = functools.partial(_fwd_tiles, causal=spec.is_causal, heads=query.shape[2], group=ORDER_GROUP_HEADS,
                              head_dim=query.shape[3])
    out, lse, _ = _kernel_call(FWD_TARGET, out_types, (query, key, value), spec, out_init, variant, masks,
                               (query.shape[1], key.shape[1]), order=order)
    return out, lse


def _bwd_kernel(query, key, value, out, lse, dout, dlse, spec: AttentionSpec, out_init=None, variant=None,
                masks=None):
    out_types = (
        jax.ShapeDtypeStruct(query.shape, query.dtype),
        jax.ShapeDtypeStruct(key.shape, key.dtype),
        jax.ShapeDtypeStruct(value.shape, value.dtype),
        _lse_shape(query),  # workspace: delta = rowsum(dout * out) - dlse, fp32
        _bwd_workspace_shape(query),  # workspace of the Hopper kernel: fp32 dq accumulator + locks
    )
    args = (query, key, value, out, lse, dout, dlse)
    order = None  # (the deterministic mode's turns need each head's key blocks in order)
    if not spec.deterministic:
        kv_block, q_block = _bwd_order_blocks(query.shape[3])

        def order(q_ids, kv_ids, q_ranges, kv_ranges):  # (the ids themselves are not needed)
            return _block_order(q_ranges, kv_ranges, q_block, kv_block, spec.is_causal, False, key.shape[2],
                                ORDER_GROUP_HEADS)
    dq, dk, dv, *_ = _kernel_call(BWD_TARGET, out_types, args, spec, out_init, variant, masks,
                                  (query.shape[1], key.shape[1]), order=order, deterministic=np.int32(spec.deterministic))
    return dq, dk, dv


def _bwd_workspace_shape(query):
    # Must match bwd_sm90_workspace_words() in cc/attention/attention.h: per (batch, head,
    # 64-row query block) an fp32 64 x head_dim dq accumulator tile, 64 lse and 64 delta values
    # and one int32.
    b, t, n, d = query.shape
    return jax.ShapeDtypeStruct((b * n * -(-t // 64) * (64 * d + 2 * 64 + 1),), jnp.float32)


def _reference_options(spec: AttentionSpec, masks: Masks | None) -> dict:
    masks = Masks() if masks is None else masks
    return dict(scale=spec.scale, is_causal=spec.is_causal, local_window_size=spec.window,
                q_segment_ids=masks.q_segment_ids, kv_segment_ids=masks.kv_segment_ids,
                query_seq_lengths=masks.q_lengths, key_value_seq_lengths=masks.kv_lengths,
                logits_soft_cap=spec.softcap)


def _fwd_reference(query, key, value, spec: AttentionSpec, masks=None):
    return reference.attention_with_lse(query, key, value, **_reference_options(spec, masks))


def _bwd_reference(query, key, value, out, lse, dout, dlse, spec: AttentionSpec, masks=None):
    del out, lse
    f = functools.partial(reference.attention_with_lse, **_reference_options(spec, masks))
    _, vjp = jax.vjp(f, query, key, value)
    return vjp((dout, dlse))


def _dispatch(kernel_fn, reference_fn, spec, *args, masks=None):
    """``kernel_fn`` on CUDA, ``reference_fn`` elsewhere, both called as ``fn(*args, spec=spec)`` (plus
    ``masks=masks`` when masks are given)."""

    def branch(fn):
        def call(*operands):
            *arrays, m = operands
            return fn(*arrays, spec=spec) if m is None else fn(*arrays, spec=spec, masks=m)

        return call

    if not spec.use_kernel:
        return branch(reference_fn)(*args, masks)
    return jax.lax.platform_dependent(
        *args,
        masks,
        # vary_like: inside shard_map(check_vma=True) the ffi_call's results must be typed as varying
        # over the inputs' manual axes, like the reference branch's, or the branches do not type-check.
        cuda=functools.partial(sharding.vary_like, branch(kernel_fn)),
        default=branch(reference_fn),
    )


# The per-shard forward/backward (kernel on CUDA, reference elsewhere). jax_tk.sharding wraps them so
# that under jit with sharded inputs each device runs them on its own batch/head shard (no gathers).
def _fwd_local(spec: AttentionSpec, query, key, value, masks=None):
    return _dispatch(_fwd_kernel, _fwd_reference, spec, query, key, value, masks=masks)


def _bwd_local(spec: AttentionSpec, query, key, value, out, lse, dout, dlse, masks=None):
    return _dispatch(_bwd_kernel, _bwd_reference, spec, query, key, value, out, lse, dout, dlse, masks=masks)


# masks (segment ids, lengths: integer arrays) is an input of the custom_vjp like query/key/value, so
# that it may be traced; its cotangent is None (not differentiable).
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(query, key, value, spec: AttentionSpec, masks=None):
    return sharding.fwd(_fwd_local, spec, query, key, value, masks=masks)


def _attention_fwd(query, key, value, spec, masks=None):
    out, lse = _attention(query, key, value, spec, masks)
    return (out, lse), (query, key, value, out, lse, masks)


def _attention_bwd(spec, residuals, cotangents):
    # The log-sum-exp's cotangent enters as dS = P * (dP - (rowsum(dO * O) - dlse)), so the kernel
    # takes it as one more input and both outputs stay differentiable at no extra cost.
    query, key, value, out, lse, masks = residuals
    dout, dlse = cotangents
    dq, dk, dv = sharding.bwd(_bwd_local, spec, query, key, value, out, lse, dout, dlse, masks=masks)
    return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _check_masking(query, key, local_window_size, q_segment_ids, kv_segment_ids, query_seq_lengths,
                   key_value_seq_lengths, logits_soft_cap):
    """Validates the masking/soft-cap options; returns them normalized (window as a pair of ints)."""
    b, t, s = query.shape[0], query.shape[1], key.shape[1]
    if local_window_size is not None:
        window = (local_window_size, local_window_size) if isinstance(local_window_size, int) else local_window_size
        if (not isinstance(window, (tuple, list)) or len(window) != 2
                or not all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) and w >= 0 for w in window)):
            raise ValueError(
                "jax_tk.attention: local_window_size must be None, an int >= 0 or a pair (left, right) of "
                f"ints >= 0, got {local_window_size!r}"
            )
        # A side longer than the sequence it reaches over bounds nothing: clamp (same meaning, and the
        # values stay small enough for int32 index arithmetic in the reference and the kernels).
        local_window_size = (min(int(window[0]), t), min(int(window[1]), s))
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("jax_tk.attention: give both q_segment_ids and kv_segment_ids, or neither")
    for name, x, shape in (("q_segment_ids", q_segment_ids, (b, t)), ("kv_segment_ids", kv_segment_ids, (b, s)),
                           ("query_seq_lengths", query_seq_lengths, (b,)),
                           ("key_value_seq_lengths", key_value_seq_lengths, (b,))):
        if x is None:
            continue
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"jax_tk.attention: {name} must be an integer array, got {type(x).__name__}")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"jax_tk.attention: {name} must have an integer dtype (int32), got {x.dtype}")
        if tuple(x.shape) != shape:
            raise ValueError(f"jax_tk.attention: {name} must have shape {shape}, got {tuple(x.shape)}")
    return local_window_size, _positive_float("logits_soft_cap", logits_soft_cap)


def _reject_unsupported(bias, mask, dropout_rate, dropout_rng):
    """bias, mask and dropout are in the signature so that no framework can pass them and have them
    dropped silently (flax passes ``mask=`` and dropout keywords to an ``attention_fn`` only when it
    accepts them); until the kernels take them, setting any of them is an error."""
    for name, x in (("bias", bias), ("mask", mask)):
        if x is not None:
            raise NotImplementedError(
                f"jax_tk.attention: {name}= is not supported yet. Express the masking with is_causal, "
                "local_window_size, q_segment_ids/kv_segment_ids or query_seq_lengths/key_value_seq_lengths, "
                "or use jax.nn.dot_product_attention."
            )
    if dropout_rng is not None and dropout_rate != 0:
        raise NotImplementedError(
            f"jax_tk.attention: attention dropout (dropout_rate={dropout_rate!r}) is not supported; set the "
            "attention dropout rate to 0 or use jax.nn.dot_product_attention."
        )


def attention_with_lse(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                       local_window_size=None, q_segment_ids=None, kv_segment_ids=None, query_seq_lengths=None,
                       key_value_seq_lengths=None, logits_soft_cap=None, implementation=None,
                       deterministic=False, dropout_rate=0.0, dropout_rng=None, broadcast_dropout=True):
    """Like :func:`attention`, and also returns the float32 log-sum-exp of each query row.

    Returns:
      ``(out, lse)``: ``out`` is ``[batch, q_len, q_heads, head_dim]`` in the input dtype, ``lse`` is
      ``[batch, q_heads, q_len]`` float32 (natural log of the softmax denominator of the scaled
      logits; ``-inf`` for a row that sees no key). Both are differentiable.
    """
    del broadcast_dropout  # (meaningless without dropout)
    _reject_unsupported(bias, mask, dropout_rate, dropout_rng)
    scale = _check_inputs(query, key, value, scale, is_causal, implementation)
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"jax_tk.attention: deterministic must be a bool, got {deterministic!r}")
    window, cap = _check_masking(query, key, local_window_size, q_segment_ids, kv_segment_ids,
                                 query_seq_lengths, key_value_seq_lengths, logits_soft_cap)
    spec = AttentionSpec(float(scale), bool(is_causal), _use_kernel(query, key, implementation), window, cap,
                         bool(deterministic))
    masks = Masks(q_segment_ids, kv_segment_ids, query_seq_lengths, key_value_seq_lengths)
    masks = None if all(x is None for x in masks) else masks
    return _attention(query, key, value, spec, masks)


def attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False, local_window_size=None,
              q_segment_ids=None, kv_segment_ids=None, query_seq_lengths=None, key_value_seq_lengths=None,
              logits_soft_cap=None, implementation=None, deterministic=False, dropout_rate=0.0, dropout_rng=None,
              broadcast_dropout=True):
    """Scaled dot-product attention, ``softmax(scale * query @ key^T) @ value``.

    Same layout and meaning as :func:`jax.nn.dot_product_attention`.

    Args:
      query: ``[batch, q_len, q_heads, head_dim]``, bfloat16, float16 or float32.
      key, value: ``[batch, kv_len, kv_heads, head_dim]``, same dtype; ``q_heads`` must be a multiple
        of ``kv_heads`` (grouped-query attention).
      scale: multiplier of the logits; default ``1/sqrt(head_dim)``.
      is_causal: query ``i`` attends to keys ``j <= i`` (top-left aligned when ``q_len != kv_len``,
        like ``jax.nn.dot_product_attention``).
      local_window_size: ``(left, right)`` (or one int for both): query ``i`` attends to keys
        ``i - left <= j <= i + right``, as in ``jax.nn.dot_product_attention``.
      q_segment_ids, kv_segment_ids: ``[batch, q_len]`` and ``[batch, kv_len]`` integers (packed
        sequences): a query attends only to keys of its own segment.
      query_seq_lengths, key_value_seq_lengths: ``[batch]`` integers (padded batches): query rows at or
        past their length give 0, keys at or past their length are not attended to.
      logits_soft_cap: if set, logits become ``cap * tanh(logits / cap)`` (as in Gemma 2).
      implementation: ``None`` (the CUDA kernel where the configuration is supported, the pure-JAX
        reference otherwise), ``"tk"`` (the kernel, or an error), ``"xla"`` (the reference).
      deterministic: make the backward give the same bits on every run. The Hopper backward adds
        the query gradient's partial sums with atomics in whatever order blocks finish; with
        ``deterministic=True`` they take turns in a fixed order (somewhat slower). The mma.sync
        backward (pre-Hopper GPUs) and the reference are always deterministic.
      bias, mask: jax.nn's additive bias and boolean mask: not supported yet, and an error when given
        (never ignored).
      dropout_rate, dropout_rng, broadcast_dropout: flax's attention-dropout arguments; dropout is not
        supported, so ``dropout_rate > 0`` with a ``dropout_rng`` (dropout active) is an error.

    The masking options combine (a query sees a key only if every rule allows it), also with
    ``is_causal``, cross attention and grouped-query attention, and the kernels take all of them
    (forward and backward). A query row that sees no key at all gives 0, log-sum-exp ``-inf`` and
    zero gradients (never NaN).

    Returns:
      ``[batch, q_len, q_heads, head_dim]`` in the input dtype.
    """
    return attention_with_lse(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal, local_window_size=local_window_size,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, logits_soft_cap=logits_soft_cap,
        implementation=implementation, deterministic=deterministic, dropout_rate=dropout_rate,
        dropout_rng=dropout_rng, broadcast_dropout=broadcast_dropout,
    )[0]
