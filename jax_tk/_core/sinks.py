"""Attention sinks: one learned logit per query head that joins every row's softmax denominator and
has no value (gpt-oss): ``p_j = exp(l_j) / (exp(sink) + sum_j exp(l_j))``.

The attention and decode kernels take the sinks themselves: their ``(out, lse)`` include them. The
backward of a softmax with sinks is the one without them, run from that ``(out, lse)`` (``P = exp(S -
lse)`` is then the softmax with the sink), plus the sink's own gradient, ``-sum over rows of
exp(sink - lse) * delta`` with ``delta = rowsum(dout * out) - dlse`` (:func:`grad`), which the attention
backward kernel computes anyway.

Elsewhere (ring attention's merged softmax, a call with nothing to compute, MLA's reference) a softmax
with a sink is the one without it, rescaled (:func:`apply`): with ``lse`` the log of the denominator
without the sink, ``lse' = logaddexp(lse, sink)`` and every weight shrinks by ``exp(lse - lse')``.
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
    """``(out, lse)`` of a softmax without sinks -> with them. ``out`` ``[batch, T, heads, D_v]`` in its
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


def delta(out, dout, dlse):
    """``rowsum(dout * out) - dlse``, float32 ``[batch, heads, T]`` (out, dout ``[batch, T, heads, D_v]``)."""
    d = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), dout.astype(jnp.float32))
    return d - dlse.astype(jnp.float32)


def grad(sinks, lse, delta):
    """The sinks' gradient, float32 ``[heads]``, from a softmax with them: its ``lse`` (which includes
    them) and the rows' ``delta`` (:func:`delta`), both ``[batch, heads, T]``. A sink of ``-inf`` (no
    sink) gets 0; a finite sink makes every lse finite."""
    s = sinks[None, :, None]
    finite = jnp.isfinite(s)
    weight = jnp.where(finite, jnp.exp(jnp.where(finite, s, 0.0) - jnp.where(finite, lse, 0.0)), 0.0)
    return -(weight * delta).sum(axis=(0, 2))
