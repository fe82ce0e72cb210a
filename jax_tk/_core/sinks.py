"""Attention sinks: one learned logit per query head that joins every row's softmax denominator and
has no value (gpt-oss): ``p_j = exp(l_j) / (exp(sink) + sum_j exp(l_j))``.

A softmax with a sink is the one without it, rescaled: with ``lse`` the log of the denominator without
the sink, ``lse' = logaddexp(lse, sink)`` and every weight shrinks by ``exp(lse - lse')``. So the ops
apply the sink exactly to the ``(out, lse)`` their kernels (or references) return, which also gives
the sink's gradient (``-sum over rows of exp(sink - lse') * (rowsum(dout * out) - dlse)``) through
the kernels' own backward, which takes the lse's cotangent.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def check(op: str, sinks, heads: int):
    """None, or ``sinks`` as a float32 ``[heads]`` array (the caller's array may be any float dtype,
    traced; its gradient comes back in that dtype)."""
    if sinks is None:
        return None
    if not hasattr(sinks, "shape") or not hasattr(sinks, "dtype"):
        sinks = np.asarray(sinks)
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise TypeError(f"jax_tk.{op}: sinks must be a float array (one logit per query head), got dtype "
                        f"{sinks.dtype}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"jax_tk.{op}: sinks must have shape [q_heads] = ({heads},), got {tuple(sinks.shape)}")
    return jnp.asarray(sinks).astype(jnp.float32)


def apply(out, lse, sinks):
    """``(out, lse)`` of a softmax without sinks -> with them. ``out`` ``[batch, T, heads, D]`` in its
    dtype, ``lse`` ``[batch, heads, T]`` float32, ``sinks`` float32 ``[heads]`` or None.

    A row that sees no key (lse ``-inf``) keeps its output 0 and gets ``lse' = sink``; a sink of
    ``-inf`` is no sink. No NaN in the values or the gradients: the sink enters the logaddexp clamped to
    a finite value, and the rows whose sink is ``-inf`` keep their lse."""
    if sinks is None:
        return out, lse
    s = sinks[None, :, None]
    finite = jnp.isfinite(s)
    new_lse = jnp.where(finite, jnp.logaddexp(lse, jnp.where(finite, s, 0.0)), lse)
    # exp(lse - new_lse) <= 1; where both are -inf (no key, no sink) the row's output is 0 anyway.
    gap = jnp.where(jnp.isneginf(new_lse), -jnp.inf, lse - jnp.where(jnp.isneginf(new_lse), 0.0, new_lse))
    factor = jnp.swapaxes(jnp.exp(gap), 1, 2)[..., None]  # [batch, T, heads, 1]
    return (out.astype(jnp.float32) * factor).astype(out.dtype), new_lse
