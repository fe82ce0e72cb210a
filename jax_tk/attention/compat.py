"""Drop-in helpers of jax_tk.attention (what makes it take what jax.nn.dot_product_attention takes):
rank-3 inputs, a traced ``scale``, 64-bit segment ids and lengths, and the ``implementation="cudnn"``
passthrough to ``jax.nn.dot_product_attention``."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


# ----------------------------------------------------------------------------------------------
# Rank-3 inputs [seq, heads, head_dim]
# ----------------------------------------------------------------------------------------------


def unbatched(query, key, value) -> bool:
    """True when query, key and value are all rank 3 ([seq, heads, head_dim], as jax.nn accepts); False
    when none is. Mixed ranks 3 and 4: ValueError. Other ranks are left to the rank-4 checks."""
    ranks = [getattr(x, "ndim", None) for x in (query, key, value)]
    if all(r == 3 for r in ranks):
        return True
    if 3 in ranks and all(r in (3, 4) for r in ranks):
        raise ValueError(
            "jax_tk.attention: query, key and value must all have rank 4 [batch, seq, heads, head_dim] or all "
            "rank 3 [seq, heads, head_dim], got ranks " + ", ".join(f"{n} {r}" for n, r in zip(("query", "key", "value"), ranks))
        )
    return False


def add_batch(x, rank: int):
    """A masking array of an unbatched call with its batch dim of 1 added: segment ids of rank 1 and
    lengths of rank 0 (other ranks are left to the shape checks)."""
    if x is None or getattr(x, "ndim", None) != rank:
        return x
    return x[None] if isinstance(x, (np.ndarray, np.generic)) else jnp.expand_dims(x, 0)


# ----------------------------------------------------------------------------------------------
# Traced scale
# ----------------------------------------------------------------------------------------------


def is_array_scale(scale) -> bool:
    """A JAX array (or tracer) scale takes the traced path; Python and numpy scalars the static one."""
    return isinstance(scale, jax.Array)


def check_array_scale(scale):
    if scale.ndim != 0 or not jnp.issubdtype(scale.dtype, jnp.floating):
        raise TypeError(
            "jax_tk.attention: a JAX array scale must be a scalar of a float dtype, got "
            f"shape {tuple(scale.shape)} dtype {scale.dtype}"
        )


def fold_scale(query, scale):
    """``scale * query`` computed in float32 and rounded to the query's dtype: the op then runs with
    scale 1.0, and autodiff gives the gradient with respect to ``scale``."""
    return (query.astype(jnp.float32) * scale.astype(jnp.float32)).astype(query.dtype)


# ----------------------------------------------------------------------------------------------
# 64-bit segment ids and lengths
# ----------------------------------------------------------------------------------------------


def _is_64bit(x) -> bool:
    return x is not None and hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.integer) and \
        np.dtype(x.dtype).itemsize == 8


def dense_rank(flat):
    """The dense rank (0, 1, ...) of each element of a 1-d array, int32, order-preserving and exact,
    on the device (sort, count the value changes, scatter back; works on traced values)."""
    order = jnp.argsort(flat, stable=True)
    ordered = flat[order]
    change = jnp.concatenate([jnp.zeros((1,), jnp.int32), (ordered[1:] != ordered[:-1]).astype(jnp.int32)])
    return jnp.zeros(flat.shape, jnp.int32).at[order].set(jnp.cumsum(change, dtype=jnp.int32))


def segment_ids_int32(q_ids, kv_ids):
    """Segment ids with a 64-bit dtype relabelled jointly to int32 (an exact, order-preserving dense
    ranking), so that no later cast truncates them into false matches. Others are returned as given."""
    if q_ids is None or not (_is_64bit(q_ids) or _is_64bit(kv_ids)):
        return q_ids, kv_ids
    n = int(np.prod(q_ids.shape))
    if isinstance(q_ids, np.ndarray) and isinstance(kv_ids, np.ndarray):
        # Concrete host arrays (e.g. numpy int64 without jax x64, which jnp would truncate): on the host.
        _, ranks = np.unique(np.concatenate([q_ids.ravel(), kv_ids.ravel()]), return_inverse=True)
        ranks = ranks.astype(np.int32).ravel()
        return ranks[:n].reshape(q_ids.shape), ranks[n:].reshape(kv_ids.shape)
    dtypes = {np.dtype(q_ids.dtype), np.dtype(kv_ids.dtype)}
    if any(d.kind == "u" for d in dtypes) and any(d.kind == "i" for d in dtypes):
        raise TypeError("jax_tk.attention: q_segment_ids and kv_segment_ids must both be signed or both unsigned "
                        f"when one is 64-bit, got {q_ids.dtype} and {kv_ids.dtype}")
    wide = max(dtypes, key=lambda d: d.itemsize)
    flat = jnp.concatenate([jnp.asarray(q_ids).astype(wide).reshape(-1), jnp.asarray(kv_ids).astype(wide).reshape(-1)])
    ranks = dense_rank(flat)
    return ranks[:n].reshape(q_ids.shape), ranks[n:].reshape(kv_ids.shape)


def lengths_int32(lengths, seq_len: int):
    """64-bit lengths clamped to [0, seq_len] in their own dtype, then cast to int32 (same meaning)."""
    if not _is_64bit(lengths):
        return lengths
    if isinstance(lengths, np.ndarray):
        return np.clip(lengths, 0, seq_len).astype(np.int32)
    return jnp.clip(lengths, 0, seq_len).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# implementation="cudnn": jax.nn.dot_product_attention's cuDNN path
# ----------------------------------------------------------------------------------------------


def cudnn_attention_with_lse(query, key, value, *, scale, is_causal, window, q_segment_ids, softcap,
                             deterministic, query_seq_lengths, key_value_seq_lengths):
    """``jax.nn.dot_product_attention(..., implementation="cudnn", return_residual=True)`` on rank-4
    inputs; returns ``(out, lse)`` with lse ``[batch, heads, q_len]`` float32 (jax.nn's residual is the
    natural-log log-sum-exp of the scaled logits, ``[batch, q_len, heads]`` in the input dtype; cuDNN's
    backward ignores its cotangent, so it is returned under stop_gradient)."""
    for name, unsupported in (("q_segment_ids/kv_segment_ids", q_segment_ids is not None),
                              ("logits_soft_cap", softcap is not None), ("deterministic=True", deterministic)):
        if unsupported:
            raise ValueError(f"jax_tk.attention(implementation='cudnn'): {name} is not supported by "
                             "jax.nn.dot_product_attention; use implementation=None, 'tk' or 'xla'")
    lengths = [None if x is None else jnp.asarray(x).astype(jnp.int32)
               for x in (query_seq_lengths, key_value_seq_lengths)]
    out, residual = jax.nn.dot_product_attention(
        query, key, value, scale=scale, is_causal=is_causal, query_seq_lengths=lengths[0],
        key_value_seq_lengths=lengths[1], local_window_size=window, implementation="cudnn", return_residual=True)
    lse = jax.lax.stop_gradient(jnp.swapaxes(residual, 1, 2).astype(jnp.float32))
    return out, lse
