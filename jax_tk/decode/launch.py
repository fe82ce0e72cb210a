"""The decode kernel's operands: the split count, the workspace, and the call.

The numbers the kernel and this file share (head dims, the split heuristic's constants, the workspace
layout) come from ``cc/decode/decode.h`` through ``jax_tk._core.extension.contract``.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_tk._core import extension
from jax_tk._core.ffi import kernel_call

TARGET = "jax_tk_decode"
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)


def contract() -> dict[str, int]:
    return extension.contract("decode")


def kernel_unsupported_reason(query, key_cache) -> str | None:
    """Why the decode kernel cannot take this call (``key_cache``: contiguous or paged), or None if it can."""
    if not any(query.dtype == d for d in KERNEL_DTYPES):
        return f"dtype {query.dtype} (the decode kernel takes bfloat16 and float16)"
    d, dims = query.shape[-1], contract()["HEAD_DIMS"]
    if d & (d - 1) or not d & dims:
        return f"head_dim {d} (the decode kernel takes {tuple(1 << i for i in range(dims.bit_length()) if dims >> i & 1)})"
    if key_cache.shape[0] * key_cache.shape[1] >= 2 ** 31:  # (the kernel's row indices are int32)
        return f"a cache of {key_cache.shape[0] * key_cache.shape[1]} rows (the decode kernel takes fewer than 2^31)"
    return None


def splits(batch: int, t_new: int, heads: int, kv_heads: int, capacity: int) -> int:
    """How many parts each sequence's keys are split into: as many as keep the grid within one wave of
    TARGET_BLOCKS thread blocks (a second, partial wave would cost as much as the first), each part
    covering at least SPLIT_MIN_KEYS positions of the cache's capacity. A grid of more than half a wave
    is not split."""
    c = contract()
    blocks = batch * kv_heads * math.ceil(heads // kv_heads * t_new / c["TILE_ROWS"])
    want = c["TARGET_BLOCKS"] // blocks
    return max(1, min(want, c["MAX_SPLITS"], capacity // c["SPLIT_MIN_KEYS"]))


def workspace_words(parts: int, batch: int, t_new: int, heads: int, head_dim: int) -> int:
    """cc/decode/decode.h workspace_words(): each part's lse and output of every query row."""
    return parts * batch * t_new * heads * (head_dim + 1) if parts > 1 else 0


def kernel(query, key_cache, value_cache, cache_lengths, page_table, spec, out_init=None, parts=None,
           with_lse=False):
    """The decode kernel's output (and with ``with_lse`` its log-sum-exp ``[batch, heads, T_new]``, float32,
    -inf for a row that sees no key). ``page_table`` None: a contiguous cache. ``parts`` overrides the
    split count (tests); ``out_init`` (tests): buffers aliased to (out, lse, workspace)."""
    b, t, n, h = query.shape
    capacity = key_cache.shape[1] * (page_table.shape[1] if page_table is not None else 1)
    parts = splits(b, t, n, key_cache.shape[2], capacity) if parts is None else parts
    out_types = (jax.ShapeDtypeStruct(query.shape, query.dtype), jax.ShapeDtypeStruct((b, n, t), jnp.float32),
                 jax.ShapeDtypeStruct((max(workspace_words(parts, b, t, n, h), 1),), jnp.float32))
    table = page_table if page_table is not None else jnp.zeros((0,), jnp.int32)
    left, right = spec.window if spec.window is not None else (-1, -1)
    attributes = dict(scale=np.float32(spec.scale), is_causal=np.int32(spec.is_causal), window_left=np.int32(left),
                      window_right=np.int32(right), softcap=np.float32(spec.softcap or 0.0), splits=np.int32(parts))
    out, lse, _ = kernel_call(TARGET, out_types, (query, key_cache, value_cache, cache_lengths, table), attributes,
                              out_init=out_init)
    return (out, lse) if with_lse else out
