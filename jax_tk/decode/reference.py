"""Pure-JAX reference of decode attention over a KV cache (contiguous or paged), and of multi-head
latent attention over one latent cache.

The path on CPU and for configurations the decode kernel cannot take, the gradient on every platform,
and the tests' oracle. All arithmetic is float32; the output is cast back to the query's dtype.
Arguments are assumed checked (``jax_tk.decode.api``, ``jax_tk.decode.mla``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def gather_pages(cache, page_table):
    """A paged cache ``[num_pages, page_size, K, H]`` read through ``page_table`` ``[B, max_pages]`` as a
    contiguous one ``[B, max_pages * page_size, K, H]`` (logical position j of sequence b is row
    ``j % page_size`` of page ``page_table[b, j // page_size]``).

    Table entries outside ``[0, num_pages)`` (unused slots of a serving engine's table hold anything)
    read as pages of zeros, as in the kernel; past a sequence's length they are masked anyway.
    """
    b, max_pages = page_table.shape
    num_pages, page_size, k, h = cache.shape
    index = page_table.reshape(-1)
    index = jnp.where((index >= 0) & (index < num_pages), index, num_pages)  # (take would wrap negative ones)
    pages = jnp.take(cache, index, axis=0, mode="fill", fill_value=0)
    return pages.reshape(b, max_pages * page_size, k, h)


def query_positions(cache_lengths, t_new: int):
    """``[B, T_new]`` int32: query row i of sequence b is at position ``cache_lengths[b] - T_new + i``."""
    return cache_lengths.astype(jnp.int32)[:, None] - t_new + jnp.arange(t_new, dtype=jnp.int32)[None, :]


def visibility(cache_lengths, t_new: int, s: int, *, is_causal: bool, local_window_size=None):
    """Boolean ``[B, T_new, S]``: whether query row i of sequence b sees key j.

    All of: the key is in the cache (``j < cache_lengths[b]``); the query row is a real token
    (position ``p >= 0``: rows before the start when ``cache_lengths[b] < T_new`` are padding);
    causal ``j <= p`` (bottom-right aligned); window ``p - left <= j <= p + right``.
    """
    p = query_positions(cache_lengths, t_new)[:, :, None]  # [B, T, 1]
    j = jnp.arange(s, dtype=jnp.int32)[None, None, :]  # [1, 1, S]
    mask = (j < cache_lengths.astype(jnp.int32)[:, None, None]) & (p >= 0)
    if is_causal:
        mask &= j <= p
    if local_window_size is not None:
        left, right = local_window_size
        mask &= (j >= p - left) & (j <= p + right)
    return mask


def attention(query, key_cache, value_cache, cache_lengths, *, scale: float, page_table=None,
              is_causal: bool = True, local_window_size=None, logits_soft_cap=None, sinks=None):
    """Softmax attention of the last ``T_new`` positions of each sequence over its cache, in float32:
    the output of :func:`attention_with_lse`."""
    return attention_with_lse(query, key_cache, value_cache, cache_lengths, scale=scale, page_table=page_table,
                              is_causal=is_causal, local_window_size=local_window_size,
                              logits_soft_cap=logits_soft_cap, sinks=sinks)[0]


def attention_with_lse(query, key_cache, value_cache, cache_lengths, *, scale: float, page_table=None,
                       is_causal: bool = True, local_window_size=None, logits_soft_cap=None, sinks=None):
    """Softmax attention of the last ``T_new`` positions of each sequence over its cache, in float32,
    and the log-sum-exp of each row.

    Args:
      query: ``[B, T_new, N, H]``.
      key_cache: ``[B, S_max, K, H]`` (contiguous), or ``[num_pages, page_size, K, H]`` with
        ``page_table`` ``[B, max_pages]`` (paged); ``N % K == 0``.
      value_cache: laid out as ``key_cache``; its head dim ``H_v`` may differ from ``H`` (multi-head
        latent attention reads values of 512 dims beside keys of 576).
      cache_lengths: ``[B]`` integers, the number of valid keys of each sequence (new tokens included).
      scale, is_causal, local_window_size ``(left, right)``, logits_soft_cap: see ``visibility`` and
        ``jax_tk.decode.attention``.
      sinks: None, or ``[N]`` floats, one logit per query head that joins every row's softmax
        denominator and has no value (attention sinks, as in gpt-oss): ``p_j = exp(l_j) / (exp(sink) +
        sum_j exp(l_j))``. A row that sees no key then still gives 0.
    Returns:
      ``(out, lse)``: out ``[B, T_new, N, H_v]`` in ``query.dtype``, lse ``[B, N, T_new]`` float32 (natural
      log of the softmax denominator of the scaled, soft-capped logits, the sink's term included); a row
      that sees no key gives 0 and lse ``-inf`` (with sinks: its sink).
    """
    if page_table is not None:
        key_cache, value_cache = gather_pages(key_cache, page_table), gather_pages(value_cache, page_table)
    b, t, n, h = query.shape
    s, kh = key_cache.shape[1], key_cache.shape[2]
    mask = visibility(cache_lengths, t, s, is_causal=is_causal, local_window_size=local_window_size)
    # Rows past a sequence's length are whatever the cache held (unwritten memory, NaN, other data): zero
    # them so that a masked key's 0 probability times its value stays 0 instead of NaN.
    in_cache = (jnp.arange(s)[None, :] < cache_lengths.astype(jnp.int32)[:, None])[:, :, None, None]
    k = jnp.where(in_cache, key_cache.astype(jnp.float32), 0.0)
    v = jnp.where(in_cache, value_cache.astype(jnp.float32), 0.0)
    # Grouped-query attention without repeating the cache: query heads [K, G] share key/value head k.
    q = query.astype(jnp.float32).reshape(b, t, kh, n // kh, h)
    logits = jnp.einsum("btkgh,bskh->bkgts", q, k, precision=jax.lax.Precision.HIGHEST) * scale
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
    logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
    # The row max (without gradient: it cancels) includes the sink, so that a large sink cannot overflow
    # the exp. An all-masked row without a sink has max -inf: replace it by 0 so that exp gives 0 (not
    # NaN) and the row sums to 0, which the division below turns into an output of 0.
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(1, kh, n // kh, 1, 1)
    if sink is not None:
        row_max = jnp.maximum(row_max, sink)
    row_max = jax.lax.stop_gradient(row_max)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    unnormalized = jnp.exp(logits - row_max)
    denom = jnp.sum(unnormalized, axis=-1, keepdims=True)
    if sink is not None:  # (in the denominator only: a sink has no value)
        denom = denom + jnp.exp(sink - row_max)
    probs = unnormalized / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bkgts,bske->btkge", probs, v, precision=jax.lax.Precision.HIGHEST)
    # (the log of a row that sees no key is taken of 1, so that its gradient is 0, not NaN)
    seen = denom > 0
    lse = jnp.where(seen, jnp.log(jnp.where(seen, denom, 1.0)) + row_max, -jnp.inf)  # [B, K, G, T, 1]
    return out.reshape(b, t, n, v.shape[-1]).astype(query.dtype), lse.reshape(b, n, t)


def mla_attention_with_lse(query, latent_cache, cache_lengths, *, scale: float, v_head_dim: int, page_table=None,
                           is_causal: bool = True, sinks=None):
    """Multi-head latent attention (DeepSeek's MLA, decoding as FlashMLA does it) in float32, and the
    log-sum-exp of each row: every query head attends over one cache of latent rows, which are the keys,
    and whose first ``v_head_dim`` dims are the values.

    Args:
      query: ``[B, T_new, N, D]``, already absorbed into the latent space.
      latent_cache: ``[B, S_max, 1, D]`` (contiguous), or ``[num_pages, page_size, 1, D]`` with
        ``page_table`` ``[B, max_pages]`` (paged).
      cache_lengths, scale, is_causal, sinks: as in :func:`attention_with_lse`.
      v_head_dim: ``<= D``.
    Returns:
      ``(out, lse)``: out ``[B, T_new, N, v_head_dim]`` in ``query.dtype``, lse ``[B, N, T_new]`` float32.
    """
    if page_table is not None:  # gathered once, then read as keys and (sliced) as values
        latent_cache = gather_pages(latent_cache, page_table)
    return attention_with_lse(query, latent_cache, latent_cache[..., :v_head_dim], cache_lengths, scale=scale,
                              is_causal=is_causal, sinks=sinks)
