"""Pure-JAX references for every jax_tk op.

They are the test oracle and the path taken where no kernel runs (CPU, unsupported configurations).
All arithmetic is done in float32 and results are cast back to the input dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_mask(t: int, s: int) -> jax.Array:
    """Boolean [t, s] mask: query i sees key j iff j <= i (top-left aligned, as jax.nn does)."""
    return jnp.tril(jnp.ones((t, s), dtype=bool))


def visibility(t, s, *, is_causal=False, local_window_size=None, q_segment_ids=None, kv_segment_ids=None,
               query_seq_lengths=None, key_value_seq_lengths=None):
    """Boolean mask of which key each query row may see, [1 or batch, t, s] (True = visible).

    The rules combine (all must hold): causal (j <= i), window ``(left, right)`` (i - left <= j <=
    i + right), same segment, i < query length, j < key length. (A boolean ``mask`` of
    :func:`attention_with_lse` is combined with this one there.)
    """
    qi = jnp.arange(t)[:, None]
    kj = jnp.arange(s)[None, :]
    mask = jnp.ones((1, t, s), dtype=bool)
    if is_causal:
        mask &= (kj <= qi)[None]
    if local_window_size is not None:
        left, right = local_window_size
        mask &= ((kj >= qi - left) & (kj <= qi + right))[None]
    if q_segment_ids is not None:
        mask = mask & (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])
    if query_seq_lengths is not None:
        mask = mask & (qi[None] < query_seq_lengths[:, None, None])
    if key_value_seq_lengths is not None:
        mask = mask & (kj[None] < key_value_seq_lengths[:, None, None])
    return mask


def attention_with_lse(query, key, value, *, scale: float, is_causal: bool, local_window_size=None,
                       q_segment_ids=None, kv_segment_ids=None, query_seq_lengths=None,
                       key_value_seq_lengths=None, logits_soft_cap=None, bias=None, mask=None, sinks=None):
    """Softmax attention in float32.

    Args:
      query: [B, T, N, D]; key: [B, S, K, D]; value: [B, S, K, D_v] (D_v may differ from D, e.g.
        MLA's D = 192 and D_v = 128); N % K == 0 (grouped-query attention).
      scale: logit multiplier. is_causal, local_window_size, q_segment_ids [B, T],
        kv_segment_ids [B, S], query_seq_lengths [B], key_value_seq_lengths [B]: which keys each
        query row sees (see ``visibility``). logits_soft_cap: logits become cap * tanh(logits / cap)
        (after scaling, before the bias and the masking).
      bias: additive logits bias, rank 4, broadcastable to [B, N, T, S] (query heads), added after
        the soft cap (any float dtype; computed in float32, its gradient in its own dtype and shape).
      mask: boolean, rank 4, broadcastable to [B, N, T, S]: False hides the key from the query row,
        combined with the rules of ``visibility``.
      sinks: None, or [N] floats, one logit per query head that joins every row's softmax denominator
        and has no value (attention sinks, as in gpt-oss): p_j = exp(l_j) / (exp(sink) + sum_j exp(l_j)).
        Computed in float32; its gradient in its own dtype.
    Returns:
      out: [B, T, N, D_v] in query.dtype; lse: [B, N, T] float32, the natural-log log-sum-exp of each
      query row's visible logits (and of its sink). A row that sees no key gets out = 0 and lse = -inf
      (with sinks: lse = its sink), and zero gradients in query, key and value (never NaN).
    """
    b, t, n, _ = query.shape
    s, kh = key.shape[1], key.shape[2]
    q = query.astype(jnp.float32)
    k = jnp.repeat(key.astype(jnp.float32), n // kh, axis=2)
    v = jnp.repeat(value.astype(jnp.float32), n // kh, axis=2)
    logits = jnp.einsum("btnd,bsnd->bnts", q, k, precision=jax.lax.Precision.HIGHEST) * scale
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
    if bias is not None:  # after the cap: it bounds the content logits, not a position bias or an additive mask
        logits = logits + bias.astype(jnp.float32)
    visible = visibility(t, s, is_causal=is_causal, local_window_size=local_window_size,
                         q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                         query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths)[:, None]
    if mask is not None:
        visible = visible & mask
    # Masked logits are -inf before the exp, and the row max of an empty row is replaced by 0, so no
    # branch that jnp.where discards produces inf or NaN (their gradients would leak through). A bias
    # of -inf acts like a mask (a row of them sees no key).
    logits = jnp.where(visible, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(1, n, 1, 1)
    if sink is not None:  # (in the max too, so that a large sink cannot overflow the exp)
        row_max = jnp.maximum(row_max, sink)
    row_max = jax.lax.stop_gradient(row_max)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    unnormalized = jnp.exp(logits - row_max)
    denom = jnp.sum(unnormalized, axis=-1)
    if sink is not None:
        denom = denom + jnp.exp(sink - row_max)[..., 0]
    seen = denom > 0
    safe_denom = jnp.where(seen, denom, 1.0)
    probs = unnormalized / safe_denom[..., None]
    lse = jnp.where(seen, row_max[..., 0] + jnp.log(safe_denom), -jnp.inf)
    out = jnp.einsum("bnts,bsne->btne", probs, v, precision=jax.lax.Precision.HIGHEST)
    return out.astype(query.dtype), lse


def attention(query, key, value, **kwargs):
    """Softmax attention in float32; see attention_with_lse for the arguments."""
    return attention_with_lse(query, key, value, **kwargs)[0]
