"""Drop-in helpers of jax_tk.attention (what makes it take what jax.nn.dot_product_attention and
Flax's ``attention_fn`` take): numpy inputs, rank-3 inputs, several leading batch dims, a traced
``scale``, 64-bit segment ids and lengths, the ``implementation="cudnn"`` passthrough to
``jax.nn.dot_product_attention``, ``bias``/``mask`` shapes, and Flax's keywords."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_tk._core import checks


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


def as_array(x):
    """numpy arrays and nested lists become JAX arrays as ``jax.nn`` takes them (``jnp.asarray``:
    float64 is float32 unless 64-bit mode is on); anything else is left to the checks."""
    return jnp.asarray(x) if isinstance(x, (np.ndarray, np.generic, list, tuple)) else x


# ----------------------------------------------------------------------------------------------
# Several leading batch dims [*batch, seq, heads, head_dim] (Flax's modules pass them through)
# ----------------------------------------------------------------------------------------------


def leading_batch(query, key, value):
    """The batch dims of inputs of rank > 4 (all three of the same rank, the same batch dims), which
    the op runs as one batch; None for ranks up to 4 (left to the rank-3/4 checks)."""
    ranks = [getattr(x, "ndim", None) for x in (query, key, value)]
    if any(r is None for r in ranks) or max(ranks) <= 4:
        return None
    batch = tuple(query.shape[:-3])
    if len(set(ranks)) != 1 or any(tuple(x.shape[:-3]) != batch for x in (key, value)):
        raise ValueError(
            "jax_tk.attention: query, key and value of rank > 4 must have the same leading batch dims "
            "[*batch, seq, heads, head_dim], got shapes " + ", ".join(
                f"{n} {tuple(x.shape)}" for n, x in zip(("query", "key", "value"), (query, key, value))))
    return batch


def flat_dense(name: str, x, batch: tuple):
    """``bias`` or ``mask`` of a call with several batch dims, broadcast over them (missing leading
    dims added, as in jax.nn) and given one batch dim: 1 where it was 1 in all of them."""
    if x is None or not hasattr(x, "shape"):
        return x
    nb, r = len(batch), len(batch) + 3
    if x.ndim > r:
        raise ValueError(f"jax_tk.attention: {name} must have rank <= {r} (that of query), got shape {tuple(x.shape)}")
    shape = (1,) * (r - x.ndim) + tuple(x.shape)
    if any(d not in (1, b) for d, b in zip(shape, batch)):
        raise ValueError(f"jax_tk.attention: {name} of shape {tuple(x.shape)} does not broadcast over the batch "
                         f"dims {batch}")
    x = x.reshape(shape)
    if any(d != 1 for d in shape[:nb]):
        x = jnp.broadcast_to(x, batch + shape[nb:])
        return x.reshape((math.prod(batch),) + shape[nb:])
    return x.reshape((1,) + shape[nb:])


def flat_exact(name: str, x, shape: tuple, batch: tuple):
    """Segment ids ``[*batch, len]`` or lengths ``[*batch]`` with their batch dims made one."""
    if x is None or not hasattr(x, "shape"):
        return x
    if tuple(x.shape) != shape:
        raise ValueError(f"jax_tk.attention: {name} must have shape {shape}, got {tuple(x.shape)}")
    return x.reshape((math.prod(batch),) + shape[len(batch):])


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


def _host_ids_narrowed(ids, other, name):
    """A numpy 64-bit ``ids`` beside a JAX ``other`` without x64 (jnp would truncate it): as int32 when
    its values fit, else an error (its values past int32 would need a joint relabelling with traced ids)."""
    if not (isinstance(ids, np.ndarray) and _is_64bit(ids)) or isinstance(other, np.ndarray) or \
            jax.config.jax_enable_x64:
        return ids
    if ids.size and (ids.min() < -2 ** 31 or ids.max() >= 2 ** 31):
        raise ValueError(f"jax_tk.attention: {name} is a numpy {ids.dtype} array with values outside int32 and the "
                         "other segment ids a JAX array: pass both as numpy arrays, or enable jax_enable_x64")
    return ids.astype(np.int32)


def _signed_beside_uint32(q_ids, kv_ids):
    """A uint32 side beside a signed one (neither 64-bit): a plain cast to int32 would let 2^32 - 1 match
    -1. Equal ids are equal non-negative int32 values, so the values that cannot match become sentinels
    that match nothing: uint32 ids from 2^31 -> -1, negative signed ids -> -2."""
    kinds = [np.dtype(x.dtype) for x in (q_ids, kv_ids)]
    if not any(d == np.uint32 for d in kinds) or not any(d.kind == "i" for d in kinds):
        return q_ids, kv_ids

    def fix(x, dtype):
        x = jnp.asarray(x)
        if dtype == np.uint32:
            return jnp.where(x < np.uint32(2 ** 31), x.astype(jnp.int32), -1)
        return jnp.where(x >= 0, x.astype(jnp.int32), -2)

    return fix(q_ids, kinds[0]), fix(kv_ids, kinds[1])


def segment_ids_int32(q_ids, kv_ids):
    """Segment ids as int32 with the same matches: 64-bit ids relabelled jointly (an exact, order-preserving
    dense ranking), so that no later cast truncates them into false matches; uint32 ids beside signed
    ones given sentinels where they cannot match. Others are returned as given."""
    if q_ids is None:
        return q_ids, kv_ids
    q_ids, kv_ids = (_host_ids_narrowed(q_ids, kv_ids, "q_segment_ids"),
                     _host_ids_narrowed(kv_ids, q_ids, "kv_segment_ids"))
    if not (_is_64bit(q_ids) or _is_64bit(kv_ids)):
        return _signed_beside_uint32(q_ids, kv_ids)
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
    """Lengths of any integer dtype as int32 with the same meaning (values past int32 clamped to
    [0, seq_len] first, never wrapped)."""
    return None if lengths is None else checks.to_int32(lengths, 0, seq_len)


# ----------------------------------------------------------------------------------------------
# implementation="cudnn": jax.nn.dot_product_attention's cuDNN path
# ----------------------------------------------------------------------------------------------


def cudnn_attention_with_lse(query, key, value, bias, mask, *, scale, is_causal, window, q_segment_ids, softcap,
                             deterministic, query_seq_lengths, key_value_seq_lengths):
    """``jax.nn.dot_product_attention(..., implementation="cudnn", return_residual=True)`` on rank-4
    inputs (``bias``/``mask`` rank 4 or None); returns ``(out, lse)`` with lse ``[batch, heads, q_len]``
    float32 (jax.nn's residual is the natural-log log-sum-exp of the scaled logits, ``[batch, q_len,
    heads]`` in the input dtype; cuDNN's backward ignores its cotangent, so it is returned under
    stop_gradient)."""
    for name, unsupported in (("q_segment_ids/kv_segment_ids", q_segment_ids is not None),
                              ("logits_soft_cap", softcap is not None), ("deterministic_backward=True", deterministic)):
        if unsupported:
            raise ValueError(f"jax_tk.attention(implementation='cudnn'): {name} is not supported by "
                             "jax.nn.dot_product_attention; use implementation=None, 'tk' or 'xla'")
    lengths = [None if x is None else jnp.asarray(x).astype(jnp.int32)
               for x in (query_seq_lengths, key_value_seq_lengths)]
    try:
        out, residual = jax.nn.dot_product_attention(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal, query_seq_lengths=lengths[0],
            key_value_seq_lengths=lengths[1], local_window_size=window, implementation="cudnn",
            return_residual=True)
    except RuntimeError as e:  # e.g. no cuDNN on this machine
        raise RuntimeError(f"jax_tk.attention(implementation='cudnn'): jax.nn.dot_product_attention failed: {e} "
                           "(cuDNN attention needs an NVIDIA GPU; use implementation=None, 'tk' or 'xla')") from e
    lse = jax.lax.stop_gradient(jnp.swapaxes(residual, 1, 2).astype(jnp.float32))
    return out, lse


# ----------------------------------------------------------------------------------------------
# bias and mask (jax.nn's): rank 4 after adding leading dims, each dim 1 or [batch, heads, q_len, kv_len]
# ----------------------------------------------------------------------------------------------


def _check_dense_dtype(name, x):
    if name == "bias":
        if not jnp.issubdtype(x.dtype, jnp.floating):
            hint = " (a boolean mask goes in mask=)" if x.dtype == jnp.bool_ else ""
            raise TypeError(f"jax_tk.attention: bias must have a float dtype, got {x.dtype}{hint}")
    elif not (x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.integer) or jnp.issubdtype(x.dtype, jnp.floating)):
        raise TypeError(f"jax_tk.attention: mask must be boolean (True: the query attends to the key), got {x.dtype}")


def dense_4d(name: str, x, full: tuple[int, int, int, int]):
    """``bias`` or ``mask`` checked and given rank 4: as in jax.nn, a rank below 4 gets leading dims of
    1, and each dim is 1 (broadcast) or that of ``full`` = (batch, q_heads, q_len, kv_len) (batch 1
    for rank-3 inputs)."""
    if x is None:
        return None
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"jax_tk.attention: {name} must be an array, got {type(x).__name__}")
    _check_dense_dtype(name, x)
    if x.ndim > 4:
        raise ValueError(f"jax_tk.attention: {name} must have rank <= 4, broadcastable to [batch, heads, q_len, "
                         f"kv_len], got shape {tuple(x.shape)}")
    shape = (1,) * (4 - x.ndim) + tuple(x.shape)
    if any(d not in (1, f) for d, f in zip(shape, full)):
        raise ValueError(
            f"jax_tk.attention: {name} of shape {tuple(x.shape)} does not broadcast to [batch, heads, q_len, kv_len] "
            f"= {full}: each dim must be 1 or that size (heads: the query heads)")
    x = x if isinstance(x, jax.Array) else jnp.asarray(x)
    if name == "mask" and x.dtype != jnp.bool_:
        x = x != 0  # Flax's masks are 0/1 floats: as in Flax, any value but 0 attends
    return x.reshape(shape) if x.ndim < 4 else x


def dense_labels(shape, full) -> str:
    """The sharding labels of a rank-4 bias or mask: "b n t s", with a broadcast dim (1 where the full
    size is larger) named apart ("b1", ...) so that it stays whole (replicated) on every device."""
    return " ".join(l if d == f else l + "1" for l, d, f in zip("bnts", shape, full))


# ----------------------------------------------------------------------------------------------
# Flax's attention_fn keywords: dropout, deterministic, dtype, precision, module, custom einsums
# ----------------------------------------------------------------------------------------------


def reproducible_backward(deterministic, deterministic_backward, dropout_rate, dropout_rng) -> bool:
    """Resolves ``deterministic`` (Flax's flag: True = no dropout) and ``deterministic_backward`` (the
    same bits from every backward run). ``deterministic=True`` with no dropout argument at all is
    read as its former meaning in jax_tk, a reproducible backward (with a DeprecationWarning): no
    Flax module calls that way (they always pass ``dropout_rate``), and without dropout Flax's
    meaning of it is void."""
    for name, x in (("deterministic", deterministic), ("deterministic_backward", deterministic_backward)):
        if x is not None and not isinstance(x, (bool, np.bool_)):
            raise TypeError(f"jax_tk.attention: {name} must be a bool, got {x!r}")
    legacy = bool(deterministic) and dropout_rate is None and dropout_rng is None
    if legacy and deterministic_backward is None:
        import warnings

        warnings.warn("jax_tk.attention: deterministic=True now has Flax's meaning (no dropout); for a "
                      "reproducible backward pass deterministic_backward=True", DeprecationWarning, stacklevel=4)
        return True
    return bool(deterministic_backward)


def check_dropout(dropout_rate, dropout_rng, deterministic):
    """Dropout is active (as in Flax) when ``dropout_rate > 0`` and not ``deterministic``; jax_tk does
    not implement it, so an active one is an error, never ignored."""
    if dropout_rate is None:
        return
    if isinstance(dropout_rate, (bool, np.bool_)) or not isinstance(dropout_rate, (int, float, np.number)):
        raise TypeError(f"jax_tk.attention: dropout_rate must be a Python float, got {dropout_rate!r}")
    if not 0 <= float(dropout_rate) < 1:
        raise ValueError(f"jax_tk.attention: dropout_rate must be in [0, 1), got {dropout_rate}")
    if dropout_rate > 0 and not deterministic:
        raise NotImplementedError(
            f"jax_tk.attention: attention dropout (dropout_rate={dropout_rate!r} with deterministic=False) is not "
            "supported; set the attention dropout rate to 0, run with deterministic=True (inference), or use "
            "Flax's or jax.nn's attention")
    del dropout_rng


def flax_options(query, key, value, dtype, module, qk_attn_weights_einsum, attn_weights_value_einsum):
    """Flax's other ``attention_fn`` keywords: ``dtype`` casts query, key and value (Flax's
    promote_dtype with an explicit dtype); ``module`` (Flax's ``sow_weights``) and custom einsums
    (e.g. quantized ones) need the attention weights, which jax_tk never forms: errors."""
    if module is not None:
        raise NotImplementedError("jax_tk.attention: module= (Flax's sow_weights) needs the attention weights, "
                                  "which jax_tk never forms; call the Flax module with sow_weights=False")
    for name, x in (("qk_attn_weights_einsum", qk_attn_weights_einsum),
                    ("attn_weights_value_einsum", attn_weights_value_einsum)):
        if x is not None:
            raise NotImplementedError(f"jax_tk.attention: {name} (a custom einsum, e.g. quantized) is not supported")
    if dtype is None:
        return query, key, value
    return tuple(as_array(x).astype(dtype) for x in (query, key, value))
