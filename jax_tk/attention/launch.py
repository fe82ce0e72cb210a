"""The attention kernels' operands: what Python works out for them and how they are called.

The numbers the kernels and this file share (block sizes, the head dims, the mask's block codes)
come from ``cc/attention/attention.h`` through ``jax_tk._core.extension.contract``, and its formulas
(the workspace's size, the bias's padding, the mask's words) through ``extension.formulas``; nothing
here copies them.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_tk._core import dispatch, extension, ffi
from jax_tk._core.ffi import kernel_call
from jax_tk.attention import reference

FWD_TARGET = ffi.target("jax_tk_attention_fwd")
BWD_TARGET = ffi.target("jax_tk_attention_bwd")
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)


def contract() -> dict[str, int]:
    return extension.contract("attention")


def formulas():
    return extension.formulas("attention")


def _head_dims(mask: int) -> tuple[int, ...]:
    return tuple(1 << i for i in range(mask.bit_length()) if mask >> i & 1)


def mla_pair() -> tuple[int, int]:
    """The one pair of unequal head dims (query/key, value) with kernels of their own (sm_90a)."""
    c = contract()
    return c["MLA_HEAD_DIM_QK"], c["MLA_HEAD_DIM_V"]


def kernel_unsupported_reason(query, key, bias=None, softcap=None, value=None) -> str | None:
    """Why the CUDA kernels cannot take this configuration, or None if they can. A value head dim
    below the query's runs on the kernels of the query's (its columns padded, see :func:`fwd_kernel`),
    or MLA's pair (192, 128) on H100/H200."""
    del key
    if bias is not None and softcap:
        return "bias with logits_soft_cap (the kernels do not combine them; the pure-JAX reference does)"
    if not any(query.dtype == d for d in KERNEL_DTYPES):
        return f"dtype {query.dtype} (the kernel takes bfloat16 and float16)"
    c, d = contract(), query.shape[-1]
    everywhere, hopper = _head_dims(c["HEAD_DIMS_SM80"]), _head_dims(c["HEAD_DIMS_SM90"])
    sm90 = lambda: extension.takes_sm90_kernels(extension.cuda_device_capability(), dispatch.kernel_variant())
    if value is not None and (d, value.shape[-1]) == mla_pair():
        return None if sm90() else f"head dims {mla_pair()} (kernels on H100/H200 only)"
    if d in everywhere:
        return None
    if d in hopper:
        if not sm90():
            return f"head_dim {d} (kernels on H100/H200 only; elsewhere the kernels take {everywhere})"
        return None
    return f"head_dim {d} (the kernels take {everywhere}, and {hopper} on H100/H200, and {mla_pair()} with value head dims)"


def _pad_dim(x, d: int, value=0):
    """x with its last dim padded to d with ``value`` (zeros; NaN for the tests' poisoned outputs)."""
    return x if x.shape[-1] == d else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, d - x.shape[-1])],
                                              constant_values=value)


class Masks(NamedTuple):
    """The array-valued masking options of one call (None where not given): ``q_segment_ids``
    ``[batch, q_len]``, ``kv_segment_ids`` ``[batch, kv_len]``, ``q_lengths`` and ``kv_lengths``
    ``[batch]``, integers; ``mask``, boolean, rank 4, each dim 1 or ``[batch, heads, q_len, kv_len]``."""

    q_segment_ids: jax.Array | None = None
    kv_segment_ids: jax.Array | None = None
    q_lengths: jax.Array | None = None
    kv_lengths: jax.Array | None = None
    mask: jax.Array | None = None


# ----------------------------------------------------------------------------------------------
# The per-block summary of a boolean mask
# ----------------------------------------------------------------------------------------------

def _blocks_reduce(x, axis, n, block, op, pad):
    """``op`` (jnp.any / jnp.all) over blocks of ``block`` along ``axis`` (of full size ``n``; a size of
    1 is broadcast: each block sees that one value), padding the last block with ``pad`` (neutral)."""
    blocks = -(-n // block)
    if x.shape[axis] == 1:
        return jnp.repeat(x, blocks, axis=axis) if blocks > 1 else x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, blocks * block - n)
    x = jnp.pad(x, widths, constant_values=pad)
    x = x.reshape(x.shape[:axis] + (blocks, block) + x.shape[axis + 1:])
    return op(x, axis=axis + 1)


def mask_block_summary(mask, q_len: int, kv_len: int, rows: int, keys: int):
    """int8 ``[mask batch, mask heads, ceil(q_len / rows), ceil(kv_len / keys)]`` for a boolean mask of
    rank 4 (dims 1 or ``[batch, heads, q_len, kv_len]``; the size-1 batch/heads dims stay 1): for each
    block of ``rows`` queries and ``keys`` keys, the contract's MASK_EMPTY where the mask hides every
    pair (the kernel skips the block), MASK_FULL where it shows every one (no elementwise mask needed
    there), else MASK_MIXED. Pairs past the ends of the sequences (the last blocks' padding) do not
    count."""
    c = contract()
    any_ = _blocks_reduce(_blocks_reduce(mask, 2, q_len, rows, jnp.any, False), 3, kv_len, keys, jnp.any, False)
    all_ = _blocks_reduce(_blocks_reduce(mask, 2, q_len, rows, jnp.all, True), 3, kv_len, keys, jnp.all, True)
    return jnp.where(~any_, c["MASK_EMPTY"], jnp.where(all_, c["MASK_FULL"], c["MASK_MIXED"])).astype(jnp.int8)


def mask_summary(mask, q_len, kv_len):
    """:func:`mask_block_summary` in the kernels' blocks (``Params::mask_blocks``: MASK_BLOCK_ROWS x
    MASK_BLOCK_KEYS; every kernel's blocks lie inside one of them)."""
    c = contract()
    return mask_block_summary(mask, q_len, kv_len, c["MASK_BLOCK_ROWS"], c["MASK_BLOCK_KEYS"])


def mask_bits(mask, q_len, kv_len):
    """uint32 ``[mask batch, mask heads, q_len, words]`` (``Params::mask_bits``): bit ``j % 32`` of word
    ``j // 32`` of a row is the mask of key j, the row padded with zeros to whole blocks of
    MASK_BLOCK_KEYS keys (attention.h's ``mask_words``)."""
    words = formulas().mask_words(kv_len)
    m = jnp.broadcast_to(mask, (*mask.shape[:2], q_len, kv_len))
    m = jnp.pad(m, ((0, 0), (0, 0), (0, 0), (0, 32 * words - kv_len))).reshape(*m.shape[:3], words, 32)
    return jnp.sum(m.astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)


# ----------------------------------------------------------------------------------------------
# Segment ranges and the Hopper kernels' orders of their blocks
# ----------------------------------------------------------------------------------------------


def segment_ranges(ids):
    """[batch, ceil(n / g), 2]: the smallest and largest segment id of every g = SEGMENT_GRANULE rows
    of ``ids`` ``[batch, n]`` (the last group padded with its own last id). The kernels skip a block of
    queries and keys whose id ranges do not meet, and need no elementwise mask where both hold one id."""
    g = contract()["SEGMENT_GRANULE"]
    b, n = ids.shape
    groups = jnp.pad(ids, ((0, 0), (0, -n % g)), mode="edge").reshape(b, -1, g)
    return jnp.stack([groups.min(axis=-1), groups.max(axis=-1)], axis=-1)


def block_spans(ranges, block):
    """[batch, ceil(n / block), 2]: the smallest and largest segment id of every ``block`` rows (a
    multiple of the granule), from the ``ranges`` of :func:`segment_ranges`."""
    k = block // contract()["SEGMENT_GRANULE"]
    b, g, _ = ranges.shape
    r = jnp.pad(ranges, ((0, 0), (0, -g % k), (0, 0)), mode="edge").reshape(b, -1, k, 2)
    return jnp.stack([r[..., 0].min(axis=-1), r[..., 1].max(axis=-1)], axis=-1)


def fwd_order_blocks(head_dim):
    """The sm_90a forward's tiles: (query rows, keys per key block)."""
    c = contract()
    return c["FWD_TILE_ROWS"], formulas().fwd_tile_keys(head_dim)


def bwd_order_blocks(head_dim):
    """The sm_90a backward's blocks: (keys per block, query rows per step)."""
    return formulas().bwd_order_rows(head_dim), contract()["BWD_QUERY_ROWS"]


# Heads per group of the block order (block_order). Groups of 4 heads ran packed documents faster
# than the kernels' own order in both directions; one group of all heads made the blocks running at
# one time read the queries and keys of all heads of a document, which L2 does not hold.
ORDER_GROUP_HEADS = 4


def order_group(group, heads):
    """Heads per group of the orders: the largest divisor of ``heads`` up to ``group``."""
    return max(g for g in range(1, min(group, heads) + 1) if heads % g == 0)


def block_order(q_ranges, kv_ranges, q_block, kv_block, causal, by_queries, heads, group):
    """With segment ids, the Hopper kernels take their blocks of the fixed grid in this order (the
    backward's ``Params::block_order``; the forward's grid tiles, :func:`fwd_tiles`):
    the (batch entry, head, block) triples ``(b * heads + h) * blocks + i``, longest first within
    groups of ``group`` heads (the largest divisor of ``heads`` up to it; ORDER_GROUP_HEADS says why
    groups): the (batch entry, block) pairs sorted by how many blocks of the other side they visit,
    most first (ties in index order), each for the group's heads, then the next group. The forward's
    blocks are its query tiles (``by_queries``), the backward's its key blocks. The count sees the
    segments and the causal mask (not windows or lengths: the order only moves work between SMs, the
    results do not depend on it)."""
    q, k = block_spans(q_ranges, q_block), block_spans(kv_ranges, kv_block)
    meet = (q[:, :, None, 0] <= k[:, None, :, 1]) & (k[:, None, :, 0] <= q[:, :, None, 1])  # [b, q blocks, kv blocks]
    if causal:  # key block j starts at or before query block i ends
        i = jnp.arange(q.shape[1])[:, None]
        j = jnp.arange(k.shape[1])[None, :]
        meet &= j * kv_block <= i * q_block + q_block - 1
    work = meet.sum(axis=2 if by_queries else 1, dtype=jnp.int32)  # [b, blocks]
    blocks = work.shape[1]
    pairs = jnp.argsort(-work.reshape(-1), stable=True).astype(jnp.int32)  # b * blocks + i
    group = order_group(group, heads)
    # (iota, not numpy constants: a custom_partitioning rule traces this and takes no constants)
    h = jnp.arange(heads // group, dtype=jnp.int32)[:, None, None] * group + jnp.arange(group, dtype=jnp.int32)
    b, i = (pairs // blocks)[None, :, None], (pairs % blocks)[None, :, None]
    return ((b * heads + h) * blocks + i).reshape(-1)


def fwd_tiles(q_ids, kv_ids, q_ranges, kv_ranges, causal, heads, group, head_dim, documents=True):
    """With segment ids, the Hopper forward's tiles (``Params::fwd_tiles``): ``fwd_tile_cap(T)`` entries
    per (batch entry, head), four int32 each, {b * heads + h (-1: none), q0, end, key base}, flattened;
    the unused entries last.

    Where the query and key ids are the same sorted runs (packed documents: ``T == S``, ids
    non-decreasing along each row, head_dim <= FWD_DOCS_MAX_HEAD_DIM) and the tiles fit, each document
    gets tiles of its own, FWD_TILE_ROWS rows from its start (the last one shorter), that visit only its
    keys, in blocks from its start: no tile cuts through a document boundary, and none needs the
    elementwise segment test. The (batch entry, tile) pairs go longest first (keys visited), in groups
    of ``group`` heads as in :func:`block_order`. Otherwise (other ids, more documents than the room
    allows, or not ``documents``) the tiles of the fixed grid, in :func:`block_order`'s order, with key
    base -1. The choice is made on the device."""
    c = contract()
    q_block, kv_block = fwd_order_blocks(head_dim)
    b, t = q_ids.shape
    qblocks = -(-t // q_block)
    cap = formulas().fwd_tile_cap(t)
    n = b * heads * cap
    # (-1, 0, 0, -1), from an iota: a custom_partitioning rule traces this and takes no constants
    unused = -(jnp.arange(4, dtype=jnp.int32) % 3 == 0).astype(jnp.int32)
    order = block_order(q_ranges, kv_ranges, q_block, kv_block, causal, True, heads, group)  # (b * heads + h) * qblocks + i
    grid = jnp.stack([order // qblocks, order % qblocks * q_block, jnp.full_like(order, t), jnp.full_like(order, -1)], -1)
    grid = jnp.concatenate([grid, jnp.broadcast_to(unused, (n - grid.shape[0], 4))])
    if not documents or kv_ids.shape[1] != t or head_dim > c["FWD_DOCS_MAX_HEAD_DIM"]:
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
    group = order_group(group, heads)
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


# ----------------------------------------------------------------------------------------------
# The kernel calls
# ----------------------------------------------------------------------------------------------


def _int32_options(masks: Masks):
    """The four integer options of ``masks`` (segment ids, lengths) as int32 arrays, None where absent."""
    return [None if x is None else jnp.asarray(x).astype(jnp.int32) for x in masks[:4]]


def mask_operands(masks: Masks | None, q_len: int, kv_len: int, order=None):
    """The masking operands of the kernels: the four options of ``masks``, the two segment ranges,
    then with segment ids ``order(q_ids, kv_ids, q_ranges, kv_ranges)`` (the forward's tiles,
    :func:`fwd_tiles`, or the backward's block order, :func:`block_order`; None: the kernel's own), as
    int32 arrays, or int32 arrays of shape (0,) where an option is absent (the handler decodes those as
    "none"); then the boolean mask as :func:`mask_bits` and :func:`mask_summary` (uint32 and int8 of
    shape (0,) without one)."""
    masks = Masks() if masks is None else masks
    ints = _int32_options(masks)
    ranges = [None if x is None else segment_ranges(x) for x in ints[:2]]
    order = None if ranges[0] is None or order is None else order(*ints[:2], *ranges)
    ints = tuple(jnp.zeros((0,), jnp.int32) if x is None else x for x in (*ints, *ranges, order))
    if masks.mask is None:
        return (*ints, jnp.zeros((0,), jnp.uint32), jnp.zeros((0,), jnp.int8))
    mask = jnp.asarray(masks.mask, bool)
    return (*ints, mask_bits(mask, q_len, kv_len), mask_summary(mask, q_len, kv_len))


def _attributes(spec, variant: int) -> dict:
    """scale, is_causal, variant, window_left/window_right (-1: unbounded; the api clamps each side to
    its sequence's length, which keeps it in int32, and the handler reads a side that reaches past the
    sequence as unbounded) and softcap (0: none)."""
    left, right = spec.window if spec.window is not None else (-1, -1)
    return dict(scale=np.float32(spec.scale), is_causal=np.int32(spec.is_causal), variant=np.int32(variant),
                window_left=np.int32(left), window_right=np.int32(right),
                softcap=np.float32(spec.softcap if spec.softcap is not None else 0.0))


def _call(target, out_types, args, spec, out_init, variant, masks, order, bias, extra=(), **attrs):
    variant = dispatch.kernel_variant() if variant is None else variant
    if variant != extension.contract("core")["VARIANT_AUTO"]:
        order = None  # (only the Hopper kernels take it)
    q, k = args[0], args[1]
    operands = (*args, *mask_operands(masks, q.shape[1], k.shape[1], order), bias_operand(bias, q, k), *extra)
    # Under vmap the handlers fold the mapped dimensions (in front of every operand) into the batch:
    # one launch for the whole vmapped call.
    return kernel_call(target, out_types, operands, {**_attributes(spec, variant), **attrs},
                       out_init=out_init, vmap_method="broadcast_all")


def lse_shape(query):
    b, t, n, _ = query.shape
    return jax.ShapeDtypeStruct((b, n, t), jnp.float32)


def bwd_workspace_shape(query):
    """The sm_90a backward's workspace (attention.h's ``bwd_sm90_workspace_words``): per (batch, head,
    block of BWD_QUERY_ROWS query rows) an fp32 dq accumulator tile, the rows' lse and delta values and
    one int32."""
    b, t, n, d = query.shape
    return jax.ShapeDtypeStruct((formulas().bwd_sm90_workspace_words(b, t, n, d),), jnp.float32)


def bias_operand(bias, query, key):
    """The kernels' bias (``Params::bias``): ``bias`` (rank 4, each dim 1 or full) broadcast over rows
    and keys, in the query's dtype, padded with zeros to whole blocks of MASK_BLOCK_ROWS x
    MASK_BLOCK_KEYS (``padded_rows``, ``padded_keys``): ``[bias batch, bias heads, T', S']``; shape (0,)
    without a bias."""
    if bias is None:
        return jnp.zeros((0,), query.dtype)
    t, s = query.shape[1], key.shape[1]
    rows, keys = padded_rows_keys(t, s)
    b = jnp.broadcast_to(bias.astype(query.dtype), (*bias.shape[:2], t, s))
    return jnp.pad(b, ((0, 0), (0, 0), (0, rows - t), (0, keys - s)))


def padded_rows_keys(q_len: int, kv_len: int) -> tuple[int, int]:
    """attention.h's ``padded_rows`` and ``padded_keys``: whole blocks of MASK_BLOCK_ROWS x MASK_BLOCK_KEYS."""
    return formulas().padded_rows(q_len), formulas().padded_keys(kv_len)


def dbias_from_kernel(dbias, bias, query, key, visible=None):
    """The bias's gradient from the kernel's ``dbias`` (the logits' gradient, ``[B, H, T', S']``): its
    rows and keys, summed over the dims the bias is broadcast over, in the bias's dtype and shape.
    ``visible`` (boolean, broadcastable to ``[B, H, T, S]``): the pairs some query sees; the others are
    taken as 0, whatever dbias holds there."""
    d = dbias[:, :, :query.shape[1], :key.shape[1]].astype(jnp.float32)
    if visible is not None:
        d = jnp.where(visible, d, 0.0)
    return d.sum(axis=_broadcast_axes(bias.shape, d.shape), keepdims=True).astype(bias.dtype)


def _broadcast_axes(bias_shape, full_shape) -> tuple[int, ...]:
    """The dims a bias is broadcast over (its size 1 against a larger one of the call)."""
    return tuple(i for i in range(4) if bias_shape[i] == 1 and full_shape[i] != 1)


def visible_pairs(spec, masks, t: int, s: int):
    """Boolean ``[B or 1, H or 1, t, s]``: the (query, key) pairs the call's masking leaves visible (the
    kernels' rule, the reference's ``visibility`` and the boolean mask)."""
    m = Masks() if masks is None else masks
    ids = _int32_options(m)
    rule = reference.visibility(t, s, is_causal=spec.is_causal, local_window_size=spec.window, q_segment_ids=ids[0],
                                kv_segment_ids=ids[1], query_seq_lengths=ids[2], key_value_seq_lengths=ids[3])
    return rule[:, None] if m.mask is None else rule[:, None] & m.mask


def fwd_kernel(query, key, value, spec, out_init=None, variant=None, masks=None, bias=None, sinks=None):
    """(out, lse) of the forward kernel. ``out_init`` (tests): buffers aliased to (out, lse, scratch).
    ``sinks``: float32 ``[q_heads]`` (attention sinks, in out and lse) or None. A value head dim below
    the query's, but in MLA's pair, is padded to it (zero columns, sliced off the output)."""
    d, dv = query.shape[-1], value.shape[-1]
    if dv != d and (d, dv) != mla_pair():
        if out_init is not None:
            out_init = (_pad_dim(out_init[0], d, jnp.nan), *out_init[1:])
        out, lse = fwd_kernel(query, key, _pad_dim(value, d), spec, out_init, variant, masks, bias, sinks)
        return out[..., :dv], lse
    out_types = (
        jax.ShapeDtypeStruct((*query.shape[:-1], dv), query.dtype),
        lse_shape(query),
        jax.ShapeDtypeStruct((1,), jnp.int32),  # workspace: the Hopper kernel's tile counter
    )
    # (a document's tiles are not aligned to the mask's blocks: with a mask, the fixed grid's)
    order = functools.partial(fwd_tiles, causal=spec.is_causal, heads=query.shape[2], group=ORDER_GROUP_HEADS,
                              head_dim=query.shape[3], documents=masks is None or masks.mask is None)
    sinks = jnp.zeros((0,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    out, lse, _ = _call(FWD_TARGET, out_types, (query, key, value), spec, out_init, variant, masks, order, bias,
                        extra=(sinks,))
    return out, lse


def bwd_kernel(query, key, value, out, lse, dout, dlse, spec, out_init=None, variant=None, masks=None, bias=None,
               with_delta=False):
    """(dq, dk, dv) of the backward kernel, given the forward's out and lse and the cotangents (with a
    bias, also its gradient: ``(dq, dk, dv, dbias)``; with ``with_delta``, then the rows' ``rowsum(dout
    * out) - dlse``, float32 ``[batch, heads, T]``, which the kernel computes first). A value head dim
    below the query's, but in MLA's pair, is padded to it, as in :func:`fwd_kernel`."""
    d, dv = query.shape[-1], value.shape[-1]
    if dv != d and (d, dv) != mla_pair():
        value, out, dout = (_pad_dim(x, d) for x in (value, out, dout))
        if out_init is not None:  # (dq, dk, dv, delta, workspace, dbias): dv's buffer widened
            out_init = (*out_init[:2], _pad_dim(out_init[2], d, jnp.nan), *out_init[3:])
        grads = bwd_kernel(query, key, value, out, lse, dout, dlse, spec, out_init, variant, masks, bias, with_delta)
        return (grads[0], grads[1], grads[2][..., :dv], *grads[3:])
    b, t, n, _ = query.shape
    dbias_shape = (0,) if bias is None else (b, n, *padded_rows_keys(t, key.shape[1]))
    out_types = (
        jax.ShapeDtypeStruct(query.shape, query.dtype),
        jax.ShapeDtypeStruct(key.shape, key.dtype),
        jax.ShapeDtypeStruct(value.shape, value.dtype),
        lse_shape(query),  # workspace: delta = rowsum(dout * out) - dlse, fp32
        bwd_workspace_shape(query),  # workspace of the Hopper kernel: fp32 dq accumulator + locks
        jax.ShapeDtypeStruct(dbias_shape, query.dtype),  # the logits' gradient (with a bias)
    )
    kv_block, q_block = bwd_order_blocks(query.shape[3])

    def order(q_ids, kv_ids, q_ranges, kv_ranges):  # (the ids themselves are not needed)
        return block_order(q_ranges, kv_ranges, q_block, kv_block, spec.is_causal, False, key.shape[2],
                           ORDER_GROUP_HEADS)

    # (the deterministic mode's turns need each head's key blocks in the kernel's own order)
    order = None if spec.deterministic else order
    # A bias broadcast over some dim has its gradient summed over it, and that sum masks out the pairs
    # no query sees (the kernel leaves their blocks unwritten) in the same pass, so the handler need
    # not zero dbias first.
    summed = bias is not None and bool(_broadcast_axes(bias.shape, (b, n, t, key.shape[1])))
    dq, dk, dv, delta, _, dbias = _call(BWD_TARGET, out_types, (query, key, value, out, lse, dout, dlse), spec, out_init,
                                    variant, masks, order, bias, deterministic=np.int32(spec.deterministic),
                                    zero_dbias=np.int32(not summed))
    grads = (dq, dk, dv)
    if bias is not None:
        visible = visible_pairs(spec, masks, t, key.shape[1]) if summed else None
        grads += (dbias_from_kernel(dbias, bias, query, key, visible),)
    return grads + (delta,) if with_delta else grads
