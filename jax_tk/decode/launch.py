"""The decode kernel's operands: the split count, the workspace, and the call.

The numbers the kernel and this file share (head dims, the split heuristic's constants) come from
``cc/decode/decode.h`` through ``jax_tk._core.extension.contract``, and its formulas (the rows of a
thread block, the workspace's size) through ``extension.formulas``.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_tk._core import dispatch, extension, ffi
from jax_tk._core.ffi import broadcast_mapped, kernel_call, map_entries

TARGET = ffi.target("jax_tk_decode")
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)


def contract() -> dict[str, int]:
    return extension.contract("decode")


def formulas():
    return extension.formulas("decode")


def kernel_unsupported_reason(query, key_cache) -> str | None:
    """Why the decode kernel cannot take this call (``key_cache``: contiguous or paged), or None if it can."""
    if not any(query.dtype == d for d in KERNEL_DTYPES):
        return f"dtype {query.dtype} (the decode kernel takes bfloat16 and float16)"
    d, dims = query.shape[-1], contract()["HEAD_DIMS"]
    if d & (d - 1) or not d & dims:
        return f"head_dim {d} (the decode kernel takes {tuple(1 << i for i in range(dims.bit_length()) if dims >> i & 1)})"
    if key_cache.shape[0] * key_cache.shape[1] > extension.MAX_INDEX:  # (the kernel's row indices are int32)
        return f"a cache of {key_cache.shape[0] * key_cache.shape[1]} rows (the decode kernel takes fewer than 2^31)"
    return None


# Where the grid fills a wave without splitting: the positions of capacity per part (see splits).
SPLIT_UNIT_KEYS = 4096


def splits(batch: int, t_new: int, heads: int, kv_heads: int, capacity: int, head_dim: int = 0) -> int:
    """How many parts each sequence's keys are split into: as many as keep the grid within one wave of
    the core contract's WAVE_BLOCKS thread blocks (a second, partial wave would cost as much as the first), each part
    covering at least SPLIT_MIN_KEYS positions of the cache's capacity. (``head_dim``: MLA's latent rows
    take blocks of MLA_BLOCK_ROWS rows.)

    A grid of more than half a wave is not split to fill the GPU. But where its blocks are decode.cu's
    (a KV head's rows fit one block of at most 64) and the capacity holds two SPLIT_UNIT_KEYS or more,
    each sequence is split into parts of SPLIT_UNIT_KEYS positions: the lengths are known on the device
    only, and in a batch of uneven ones (a server's) one block per sequence leaves the step waiting on
    the longest sequences' blocks, while parts of bounded length let the block scheduler hand the long
    sequences' parts to the SMs that the short ones free. (Full sequences pay the parts' merge, a few
    microseconds.)"""
    c = contract()
    rows = heads // kv_heads * t_new
    mla = head_dim == c["MLA_HEAD_DIM"]
    chunk = c["MLA_BLOCK_ROWS"] if mla else formulas().block_rows(rows)
    blocks = batch * kv_heads * math.ceil(rows / chunk)
    want = extension.WAVE_BLOCKS // blocks
    if want <= 1 and not mla and chunk < c["MAX_TILE_ROWS"] and capacity >= 2 * SPLIT_UNIT_KEYS:
        return min(capacity // SPLIT_UNIT_KEYS, c["MAX_SPLITS"])
    return max(1, min(want, c["MAX_SPLITS"], capacity // c["SPLIT_MIN_KEYS"]))


def kernel(query, key_cache, value_cache, cache_lengths, page_table, spec, out_init=None, parts=None,
           with_lse=False, variant=None, sinks=None):
    """The decode kernel's output (and with ``with_lse`` its log-sum-exp ``[batch, heads, T_new]``, float32,
    -inf for a row that sees no key). ``page_table`` None: a contiguous cache. ``sinks``: float32
    ``[heads]`` (attention sinks, in out and lse) or None. ``parts`` overrides the split count (tests);
    ``out_init`` (tests): buffers aliased to (out, lse, workspace); ``variant``: the kernels
    (``dispatch.kernel_variant``; None: from ``JAX_TK_KERNELS``). Under ``vmap`` the mapped entries run
    as one launch (``_fold``)."""
    table = page_table if page_table is not None else jnp.zeros((0,), jnp.int32)
    args = (query, key_cache, value_cache, cache_lengths, table)
    if sinks is not None:
        args += (sinks.astype(jnp.float32),)
    variant = dispatch.kernel_variant() if variant is None else variant
    if out_init is not None:
        out, lse = _call(*args, spec=spec, parts=parts, variant=variant, out_init=out_init)
    else:
        out, lse = _batched(spec, parts, variant, sinks is not None)(*args)
    return (out, lse) if with_lse else out


def workspace_words(parts: int, batch: int, t_new: int, heads: int, head_dim: int) -> int:
    """The workspace's float32 words (at least 1: an FFI result cannot be empty here; decode.h's
    ``workspace_words``, 0 for an unsplit call, says what it holds)."""
    return max(formulas().workspace_words(parts, batch, t_new, heads, head_dim), 1)


def _attention_results(query, key_cache, table, spec, parts):
    """The split count (``parts``, else :func:`splits`'s) and the types of the decode kernel's results:
    out, lse and workspace."""
    b, t, n, h = query.shape
    dv = formulas().v_head_dim(h)  # (the output's: MLA's values are the first dims of its latent rows)
    capacity = key_cache.shape[1] * (table.shape[1] if spec.page_size is not None else 1)
    parts = splits(b, t, n, key_cache.shape[2], capacity, h) if parts is None else parts
    return parts, (jax.ShapeDtypeStruct((b, t, n, dv), query.dtype), jax.ShapeDtypeStruct((b, n, t), jnp.float32),
                   jax.ShapeDtypeStruct((workspace_words(parts, b, t, n, dv),), jnp.float32))


def _sinks_operand(sinks):
    return jnp.zeros((0,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)


def _call(query, key_cache, value_cache, cache_lengths, table, sinks=None, *, spec, parts, variant, out_init=None):
    parts, out_types = _attention_results(query, key_cache, table, spec, parts)
    out, lse, _ = kernel_call(TARGET, out_types, (query, key_cache, value_cache, cache_lengths, table, _sinks_operand(sinks)),
                              _attributes(spec, parts, variant), out_init=out_init)
    return out, lse


APPEND_TARGET = ffi.target("jax_tk_decode_append")


def append_kernel(query, new_key, new_value, key_cache, value_cache, cache_lengths, page_table, spec, sinks=None,
                  parts=None, variant=None, out_init=None):
    """The append-then-attend call (one launch of each kernel, one FFI call): ``new_key`` and
    ``new_value`` ``[batch, T_new, kv_heads, head_dim]`` written into the caches at positions
    ``cache_lengths[b] + t`` (in place: the caches are aliased to the results; where XLA still gives
    the results buffers of their own, the handler copies the caches there first), then the decode
    kernel over the lengths after them. Returns ``(out, lse, key_cache, value_cache)``. ``out_init``
    (tests): buffers aliased to (out, lse, workspace, lengths after). Under ``vmap`` the entries run one
    after the other (the FFI call's sequential rule)."""
    table = page_table if page_table is not None else jnp.zeros((0,), jnp.int32)
    parts, attention = _attention_results(query, key_cache, table, spec, parts)
    out_types = (*attention, jax.ShapeDtypeStruct((query.shape[0],), jnp.int32),
                 jax.ShapeDtypeStruct(key_cache.shape, key_cache.dtype), jax.ShapeDtypeStruct(value_cache.shape, value_cache.dtype))
    variant = dispatch.kernel_variant() if variant is None else variant
    operands = (query, new_key, new_value, key_cache, value_cache, cache_lengths, table, _sinks_operand(sinks))
    out, lse, _, _, key_cache, value_cache = kernel_call(
        APPEND_TARGET, out_types, operands, _attributes(spec, parts, variant), out_init=out_init, aliases={3: 4, 4: 5})
    return out, lse, key_cache, value_cache


def _attributes(spec, parts: int, variant: int) -> dict:
    left, right = spec.window if spec.window is not None else (-1, -1)
    return dict(scale=np.float32(spec.scale), is_causal=np.int32(spec.is_causal), window_left=np.int32(left),
                window_right=np.int32(right), softcap=np.float32(spec.softcap or 0.0), splits=np.int32(parts),
                variant=np.int32(variant))


# ----------------------------------------------------------------------------------------------
# Batching: a vmapped call becomes one launch
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _batched(spec, parts, variant, with_sinks: bool):
    call = functools.partial(_call, spec=spec, parts=parts, variant=variant)
    if with_sinks:
        fn = jax.custom_batching.custom_vmap(lambda q, k, v, lengths, table, sinks: call(q, k, v, lengths, table, sinks))
    else:
        fn = jax.custom_batching.custom_vmap(lambda q, k, v, lengths, table: call(q, k, v, lengths, table))

    @fn.def_vmap
    def rule(axis_size, in_batched, *args):
        return _fold(fn, spec.page_size is not None, axis_size, in_batched, args), (True, True)

    return fn


def _fold(fn, paged: bool, e: int, in_batched, args):
    """``vmap`` of ``fn`` (the kernel call) over ``e`` entries as one call of ``fn``.

    - Only the query mapped: every entry reads the same cache, so the entries become more query heads
      (``[B, T, N, E, H]`` as ``N * E`` heads: head ``n * E + i`` still shares KV head ``n // (N / K)``)
      and each key and value is read once for all of them.
    - Otherwise the entries become more sequences: a contiguous cache stacks along the batch; a paged
      pool that is mapped stacks its pages, and each entry's table is offset to its own pages (an entry
      outside its pool stays outside: the kernel reads it as zeros).
    - A contiguous cache that is not mapped beside mapped lengths would be copied once per entry to
      stack it, and a stack of 2^31 cache rows or more is past the kernel's indices: one launch per
      entry (``lax.map``).
    - The sinks (``[heads]``, or ``[batch, heads]`` as this stacking makes them) follow the heads: to
      ``[..., N * E]``, or the sequences: to ``[E * B, N]``."""
    query, key_cache, value_cache, lengths, table = args[:5]
    q_mapped, k_mapped, v_mapped, l_mapped, t_mapped = in_batched[:5]
    sinks, s_mapped = (args[5], in_batched[5]) if len(args) > 5 else (None, False)
    if not (k_mapped or v_mapped or l_mapped or t_mapped):
        query = broadcast_mapped(query, q_mapped, e)  # (only the sinks may be mapped)
        b, t, n, h = query.shape[1:]
        extra = ()
        if sinks is not None:  # head n * E + i: entry i's head n
            s = jnp.moveaxis(broadcast_mapped(sinks, s_mapped, e), 0, -1)
            extra = (s.reshape(*s.shape[:-2], n * e),)
        out, lse = fn(jnp.moveaxis(query, 0, 3).reshape(b, t, n * e, h), key_cache, value_cache, lengths, table, *extra)
        return jnp.moveaxis(out.reshape(b, t, n, e, out.shape[-1]), 3, 0), jnp.moveaxis(lse.reshape(b, n, e, t), 2, 0)
    cache_mapped = k_mapped or v_mapped
    rows = math.prod((key_cache if k_mapped else value_cache).shape[:3]) if cache_mapped else 0
    if (not paged and not cache_mapped) or rows > extension.MAX_INDEX:
        return map_entries(fn, in_batched, args)
    query, lengths = broadcast_mapped(query, q_mapped, e), broadcast_mapped(lengths, l_mapped, e)
    b = query.shape[1]
    if cache_mapped:
        key_cache, value_cache = broadcast_mapped(key_cache, k_mapped, e), broadcast_mapped(value_cache, v_mapped, e)
        if paged:  # entry i's pages become pages [i * P, (i + 1) * P) of one pool
            pages, table = key_cache.shape[1], broadcast_mapped(table, t_mapped, e)
            offset = pages * jnp.arange(e, dtype=jnp.int32)[:, None, None]
            table = jnp.where((table >= 0) & (table < pages), table + offset, -1)
        key_cache, value_cache = (x.reshape(-1, *x.shape[2:]) for x in (key_cache, value_cache))
    if paged:
        table = broadcast_mapped(table, t_mapped or cache_mapped, e).reshape(e * b, -1)
    extra = ()
    if sinks is not None:  # one row per sequence
        s = broadcast_mapped(sinks, s_mapped, e)
        extra = (jnp.broadcast_to(s.reshape(e, -1, s.shape[-1]), (e, b, s.shape[-1])).reshape(e * b, -1),)
    out, lse = fn(query.reshape(e * b, *query.shape[2:]), key_cache, value_cache, lengths.reshape(-1), table, *extra)
    return out.reshape(e, b, *out.shape[1:]), lse.reshape(e, b, *lse.shape[1:])
