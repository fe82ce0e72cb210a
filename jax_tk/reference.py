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


def attention_with_lse(query, key, value, *, scale: float, is_causal: bool):
    """Softmax attention in float32.

    Args:
      query: [B, T, N, D]; key, value: [B, S, K, D] with N % K == 0 (grouped-query attention).
    Returns:
      out: [B, T, N, D] in query.dtype; lse: [B, N, T] float32, the natural-log log-sum-exp of each
      query row's scaled logits.
    """
    b, t, n, d = query.shape
    s, kh = key.shape[1], key.shape[2]
    q = query.astype(jnp.float32)
    k = jnp.repeat(key.astype(jnp.float32), n // kh, axis=2)
    v = jnp.repeat(value.astype(jnp.float32), n // kh, axis=2)
    logits = jnp.einsum("btnd,bsnd->bnts", q, k, precision=jax.lax.Precision.HIGHEST) * scale
    if is_causal:
        logits = jnp.where(causal_mask(t, s)[None, None], logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)
    probs = jnp.exp(logits - lse[..., None])
    out = jnp.einsum("bnts,bsnd->btnd", probs, v, precision=jax.lax.Precision.HIGHEST)
    return out.astype(query.dtype), lse


def attention(query, key, value, *, scale: float, is_causal: bool):
    """Softmax attention in float32; see attention_with_lse for shapes."""
    return attention_with_lse(query, key, value, scale=scale, is_causal=is_causal)[0]
