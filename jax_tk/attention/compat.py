"""The arguments of jax_tk.attention, checked and normalized once (trace time).

:func:`normalize` turns everything ``jax_tk.attention`` and ``attention_with_lse`` accept into one
:class:`Call`, the rank-4 form the op runs: what ``jax.nn.dot_product_attention`` and Flax's
``attention_fn`` take (numpy inputs, rank-3 inputs, several leading batch dims, a traced ``scale``,
``bias``/``mask`` shapes, Flax's keywords and dropout arguments), 64-bit segment ids and lengths, and
the checks of every argument. Nothing here runs the op.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_tk._core import checks, dispatch

FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


# ----------------------------------------------------------------------------------------------
# The normalized call
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of jax_tk.attention, checked, in the form the op runs.

    query ``[batch, q_len, heads, head_dim]`` (a traced scale already folded in), key
    ``[batch, kv_len, kv_heads, head_dim]``, value ``[batch, kv_len, kv_heads, v_head_dim]``
    (``v_head_dim <= head_dim``); bias and mask rank 4 (each dim 1 or full), the mask
    boolean; segment ids and lengths int32 or None; ``window`` ``(left, right)`` or None; ``softcap`` a
    float or None; ``deterministic``: the reproducible backward. ``batch``: the caller's batch dims,
    which :meth:`restore` gives the results back (None: the call was rank 4 already; ``()``: rank 3).
    """

    query: jax.Array
    key: jax.Array
    value: jax.Array
    bias: jax.Array | None
    mask: jax.Array | None
    q_segment_ids: jax.Array | None
    kv_segment_ids: jax.Array | None
    query_seq_lengths: jax.Array | None
    key_value_seq_lengths: jax.Array | None
    scale: float
    is_causal: bool
    window: tuple[int, int] | None
    softcap: float | None
    implementation: str | None
    deterministic: bool
    batch: tuple[int, ...] | None

    def restore(self, out, lse):
        """``(out [batch, q_len, heads, v_head_dim], lse [batch, heads, q_len])`` in the caller's batch dims."""
        if self.batch is None:
            return out, lse
        return out.reshape(self.batch + out.shape[1:]), lse.reshape(self.batch + lse.shape[1:])


def normalize(query, key, value, bias, mask, *, scale, is_causal, local_window_size, q_segment_ids, kv_segment_ids,
              query_seq_lengths, key_value_seq_lengths, logits_soft_cap, implementation, deterministic_backward,
              deterministic, dropout_rate, dropout_rng, dtype=None, module=None, qk_attn_weights_einsum=None,
              attn_weights_value_einsum=None) -> Call:
    """The arguments of ``jax_tk.attention`` (Flax's keywords included) checked and normalized in one
    pass: raises the ``TypeError``/``ValueError``/``NotImplementedError`` that names a bad argument."""
    query, key, value = flax_options(query, key, value, dtype, module, qk_attn_weights_einsum,
                                     attn_weights_value_einsum)
    reproducible = reproducible_backward(deterministic, deterministic_backward, dropout_rate, dropout_rng)
    check_dropout(dropout_rate, dropout_rng, deterministic)
    query, key, value, bias = (as_array(x) for x in (query, key, value, bias))
    ids, lengths = (q_segment_ids, kv_segment_ids), (query_seq_lengths, key_value_seq_lengths)
    batch = leading_batch(query, key, value)
    if batch is not None:  # [*batch, seq, heads, head_dim]: the batch dims run as one
        t, s = query.shape[-3], key.shape[-3]
        query, key, value = (x.reshape((math.prod(batch),) + x.shape[-3:]) for x in (query, key, value))
        bias, mask = flat_dense("bias", bias, batch), flat_dense("mask", mask, batch)
        ids = (flat_exact("q_segment_ids", ids[0], batch + (t,), batch),
               flat_exact("kv_segment_ids", ids[1], batch + (s,), batch))
        lengths = (flat_exact("query_seq_lengths", lengths[0], batch, batch),
                   flat_exact("key_value_seq_lengths", lengths[1], batch, batch))
    elif unbatched(query, key, value):  # [seq, heads, head_dim]: a batch of one
        batch = ()
        query, key, value = query[None], key[None], value[None]
        ids, lengths = tuple(add_batch(x, 1) for x in ids), tuple(add_batch(x, 0) for x in lengths)
    array_scale = scale if is_array_scale(scale) else None
    if array_scale is not None:
        check_array_scale(array_scale)
    scale = check_inputs(query, key, value, 1.0 if array_scale is not None else scale, is_causal, implementation)
    full = (query.shape[0], query.shape[2], query.shape[1], key.shape[1])
    bias, mask = dense_4d("bias", bias, full), dense_4d("mask", mask, full)
    window, cap = check_masking(query, key, local_window_size, *ids, *lengths, logits_soft_cap)
    # 64-bit ids and lengths become exact int32 ones before anything else reads them.
    ids = segment_ids_int32(*ids)
    lengths = lengths_int32(lengths[0], query.shape[1]), lengths_int32(lengths[1], key.shape[1])
    if array_scale is not None:  # logits = (scale * q) k^T: the op runs with scale 1.0
        query = fold_scale(query, array_scale)
    return Call(query, key, value, bias, mask, *ids, *lengths, float(scale), bool(is_causal), window, cap,
                implementation, reproducible, batch)


# ----------------------------------------------------------------------------------------------
# Checks of rank-4 inputs and of the masking options
# ----------------------------------------------------------------------------------------------


def check_inputs(query, key, value, scale, is_causal, implementation, op="attention", extra=("cudnn",),
                 empty_ok=(0, 1)):
    """The checks that attention and ring_attention share (``op`` names the function in the errors,
    ``extra`` its implementations beyond None, "tk" and "xla", ``empty_ok`` the dims that may be 0:
    batch and sequence); returns the scale (default ``1/sqrt(D_qk)``).

    query ``[B, T, N, D_qk]``, key ``[B, S, K, D_qk]``, value ``[B, S, K, D_v]`` with ``D_v <= D_qk``
    (MLA's 192 and 128): key and value agree on every dim but the last."""
    for name, x in zip(("query", "key", "value"), (query, key, value)):
        checks.float_array(op, name, x, 4, "[batch, seq, heads, head_dim]", FLOAT_DTYPES, empty_ok)
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"jax_tk.{op}: query, key and value must have the same dtype, got "
            f"{query.dtype}, {key.dtype}, {value.dtype}"
        )
    if key.shape[:-1] != value.shape[:-1]:
        raise ValueError(
            f"jax_tk.{op}: key and value must have the same shape but for head_dim ([batch, seq, heads] of "
            f"both), got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    b, _, n, d = query.shape
    kb, _, kh, kd = key.shape
    dv = value.shape[-1]
    if kb != b:
        raise ValueError(f"jax_tk.{op}: batch of key/value ({kb}) != batch of query ({b})")
    if kd != d:
        raise ValueError(f"jax_tk.{op}: head_dim of key ({kd}) != head_dim of query ({d})")
    if dv > d:
        raise ValueError(
            f"jax_tk.{op}: head_dim of value ({dv}) must be <= head_dim of query and key ({d}) (a smaller "
            "value head_dim is taken, e.g. MLA's 192 and 128; a larger one is not)"
        )
    if n % kh != 0:
        raise ValueError(
            f"jax_tk.{op}: the number of query heads ({n}) must be a multiple of the number "
            f"of key/value heads ({kh})"
        )
    scale = checks.positive_float(op, "scale", scale)
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"jax_tk.{op}: is_causal must be a bool, got {is_causal!r}")
    dispatch.check_implementation(op, implementation, extra=extra)
    return 1.0 / math.sqrt(d) if scale is None else scale


def check_masking(query, key, local_window_size, q_segment_ids, kv_segment_ids, query_seq_lengths,
                  key_value_seq_lengths, logits_soft_cap):
    """Validates the masking/soft-cap options; returns the window (a pair of ints or None) and the cap."""
    b, t, s = query.shape[0], query.shape[1], key.shape[1]
    local_window_size = checks.window("attention", local_window_size, t, s)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("jax_tk.attention: give both q_segment_ids and kv_segment_ids, or neither")
    for name, x, shape in (("q_segment_ids", q_segment_ids, (b, t)), ("kv_segment_ids", kv_segment_ids, (b, s)),
                           ("query_seq_lengths", query_seq_lengths, (b,)),
                           ("key_value_seq_lengths", key_value_seq_lengths, (b,))):
        if x is None:
            continue
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"jax_tk.attention: {name} must be an integer array, got {type(x).__name__}")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"jax_tk.attention: {name} must have an integer dtype (int32), got {x.dtype}")
        if tuple(x.shape) != shape:
            raise ValueError(f"jax_tk.attention: {name} must have shape {shape}, got {tuple(x.shape)}")
    return local_window_size, checks.positive_float("attention", "logits_soft_cap", logits_soft_cap)


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


_INT32 = np.iinfo(np.int32)  # (the ids' dtype range, not a kernel limit: that is extension.MAX_INDEX)


def _host_ids_narrowed(ids, other, name):
    """A numpy 64-bit ``ids`` beside a JAX ``other`` without x64 (jnp would truncate it): as int32 when
    its values fit, else an error (its values past int32 would need a joint relabelling with traced ids)."""
    if not (isinstance(ids, np.ndarray) and _is_64bit(ids)) or isinstance(other, np.ndarray) or \
            jax.config.jax_enable_x64:
        return ids
    if ids.size and (ids.min() < _INT32.min or ids.max() > _INT32.max):
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
            return jnp.where(x <= np.uint32(_INT32.max), x.astype(jnp.int32), -1)
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
