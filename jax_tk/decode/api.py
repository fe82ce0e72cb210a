"""jax_tk.decode: attention of new tokens over a KV cache (serving), and appending to the cache.

Trace-time checks, the static spec of a call, the dispatch between the decode kernel (``cc/decode``,
through ``launch``) and the pure-JAX reference (``reference``), and the partitioning (under ``jit`` with
sharded inputs both ops run on each device's shards, split over batch and key/value heads; see the
layouts at the end of this module).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_tk._core import checks, dispatch, extension, sharding, sinks as sinks_
from jax_tk.decode import launch, reference

FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_OP = "decode.attention"
_UPDATE = "decode.update_kv_cache"

@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """Static description of one decode-attention call (what the kernel's attributes will be).

    window: ``(left, right)`` ints >= 0 or None; softcap: a positive float or None; page_size: rows per
    page of a paged cache, None for a contiguous one.
    """

    scale: float
    is_causal: bool
    use_kernel: bool
    window: tuple[int, int] | None = None
    softcap: float | None = None
    page_size: int | None = None


# ----------------------------------------------------------------------------------------------
# Checks (trace time)
# ----------------------------------------------------------------------------------------------


def _float_array(op, name, x, what, empty_ok=()):
    checks.float_array(op, name, x, 4, what, FLOAT_DTYPES, empty_ok)


def _int_array(op, name, x, shape):
    checks.array(op, name, x, len(shape), "[" + ", ".join(map(str, shape)) + "]")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"jax_tk.{op}: {name} must have an integer dtype (int32), got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"jax_tk.{op}: {name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def _check_cache(op, key_cache, value_cache, batch, page_table, names=("key_cache", "value_cache")):
    """Checks a (key, value) cache pair (or one cache, ``value_cache=None``) and its page table; returns
    (capacity in positions, page_size or None)."""
    layout = "[num_pages, page_size, kv_heads, head_dim]" if page_table is not None else \
        "[batch, max_seq_len, kv_heads, head_dim]"
    empty_ok = (0,) if page_table is None else ()  # a contiguous cache of a batch of 0
    _float_array(op, names[0], key_cache, layout, empty_ok)
    if value_cache is not None:
        _float_array(op, names[1], value_cache, layout, empty_ok)
        if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
            raise ValueError(f"jax_tk.{op}: key_cache and value_cache must have the same shape and dtype, got "
                             f"{tuple(key_cache.shape)} {key_cache.dtype} and {tuple(value_cache.shape)} "
                             f"{value_cache.dtype}")
    name = "/".join(dict.fromkeys(names))
    if page_table is None:
        if key_cache.shape[0] != batch:
            raise ValueError(f"jax_tk.{op}: batch of {name} ({key_cache.shape[0]}) != batch of "
                             f"query/new ({batch}) (a contiguous cache is [batch, max_seq_len, kv_heads, head_dim]; "
                             "pass page_table= for a paged one)")
        return key_cache.shape[1], None
    checks.array(op, "page_table", page_table, 2, "[batch, max_pages]")
    if not jnp.issubdtype(page_table.dtype, jnp.integer):
        raise TypeError(f"jax_tk.{op}: page_table must have an integer dtype (int32), got {page_table.dtype}")
    if page_table.shape[0] != batch or page_table.shape[1] == 0:
        raise ValueError(f"jax_tk.{op}: page_table must have shape [batch={batch}, max_pages >= 1], got "
                         f"{tuple(page_table.shape)}")
    page_size = key_cache.shape[1]
    if page_table.shape[1] * page_size > extension.MAX_INDEX:
        raise ValueError(f"jax_tk.{op}: max_pages * page_size = {page_table.shape[1] * page_size} positions do "
                         "not fit int32")
    return page_table.shape[1] * page_size, page_size


def _check_t_new(op, t, capacity, page_table):
    if t > capacity:
        where = "max_seq_len of the cache" if page_table is None else "max_pages * page_size"
        raise ValueError(f"jax_tk.{op}: T_new ({t}) must be <= {where} ({capacity})")


def _lengths(op, cache_lengths, batch):
    _int_array(op, "cache_lengths", cache_lengths, (batch,))
    # Positions are int32 (as in the kernels): a length past int32 saturates instead of wrapping (a length
    # <= 0 means no key, whatever its value).
    return jnp.asarray(checks.to_int32(cache_lengths, 0, extension.MAX_INDEX))


def _page_table_int32(page_table):
    # Page numbers are int32 in the kernels; a 64-bit entry past int32 maps to -1 (a slot that is unused).
    if page_table is None or jnp.dtype(page_table.dtype) == jnp.int32:
        return page_table
    if jnp.dtype(page_table.dtype).itemsize > 4:
        page_table = jnp.where((page_table < 0) | (page_table > extension.MAX_INDEX), -1, page_table)
    return jnp.asarray(page_table).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# The ops
# ----------------------------------------------------------------------------------------------


def attention(query, key_cache, value_cache, cache_lengths, *, page_table=None, scale=None, is_causal=True,
              local_window_size=None, logits_soft_cap=None, implementation=None, sinks=None):
    """Attention of the newest ``T_new`` tokens of each sequence over its KV cache (decoding / serving).

    Semantics follow FlashAttention's ``flash_attn_with_kvcache``; layouts follow
    ``jax.nn.dot_product_attention``.

    Args:
      query: ``[batch, T_new, heads, head_dim]``, bfloat16, float16 or float32: the LAST ``T_new``
        positions of each sequence; row i of sequence b is at position ``p = cache_lengths[b] - T_new + i``.
      key_cache, value_cache: the cache, already holding the new tokens (``update_kv_cache`` first), same
        dtype as query. Contiguous: ``[batch, max_seq_len, kv_heads, head_dim]``. Paged (with
        ``page_table``): ``[num_pages, page_size, kv_heads, head_dim]``. ``heads % kv_heads == 0``.
      cache_lengths: ``[batch]`` integers (may be traced): keys ``j < cache_lengths[b]`` are valid.
        Rows of the cache past the length may hold anything (NaN included): they are never read into
        the result.
      page_table: ``[batch, max_pages]`` integers: position j of sequence b lives in page
        ``page_table[b, j // page_size]``, row ``j % page_size``. Entries past a sequence's length are
        not used (any value); within it, an entry outside ``[0, num_pages)`` reads as a page of zeros.
      scale: logit multiplier (a Python float), default ``1/sqrt(head_dim)``.
      is_causal: row i sees keys ``j <= p`` (bottom-right aligned: a single new token sees the whole
        cache). ``False``: every valid key.
      local_window_size: ``(left, right)`` (or one int for both): row i sees keys ``p - left <= j <= p + right``.
      logits_soft_cap: logits become ``cap * tanh(logits / cap)``.
      sinks: ``[heads]`` floats (attention sinks, as in gpt-oss), or None: one logit per query head in
        every row's softmax denominator, with no value; as in :func:`jax_tk.attention` (applied exactly to
        the kernel's output and log-sum-exp).
      implementation: ``None``: the decode kernel on CUDA GPUs where it takes the call (bfloat16/float16,
        head_dim 64, 128 or 256), the pure-JAX reference elsewhere; ``"tk"``: the kernel or an error;
        ``"xla"``: the reference.

    A row that sees no key (``cache_lengths[b] == 0``, or ``p < 0`` when ``cache_lengths[b] < T_new``:
    padding rows before the sequence's start) gives 0, never NaN. A batch of 0 or ``T_new = 0`` gives an
    empty result.

    Differentiable in ``query``, ``key_cache`` and ``value_cache`` (under ``jit`` and sharded too): the
    gradient is the reference's, computed by XLA on every platform.

    Several devices: inside ``shard_map`` it runs on the local shards as given (a paged cache may then
    be a pool per shard, its page numbers local). Under ``jit`` with sharded inputs it runs on each
    device's shards without gathering the cache: split over batch and heads as the query is (shard the
    caches, lengths and page table the same way: batch, and the key/value heads of the query's heads).
    A paged pool has no batch dimension: it is split over key/value heads only and replicated over the
    batch axes (a pool split over its pages would be gathered).

    Returns:
      ``[batch, T_new, heads, head_dim]`` in the query's dtype (:func:`attention_with_lse` also returns
      the log-sum-exp of each row).
    """
    return attention_with_lse(query, key_cache, value_cache, cache_lengths, page_table=page_table, scale=scale,
                              is_causal=is_causal, local_window_size=local_window_size,
                              logits_soft_cap=logits_soft_cap, implementation=implementation, sinks=sinks)[0]


def attention_with_lse(query, key_cache, value_cache, cache_lengths, *, page_table=None, scale=None, is_causal=True,
                       local_window_size=None, logits_soft_cap=None, implementation=None, sinks=None):
    """Like :func:`attention`, and also returns the float32 log-sum-exp of each query row.

    Returns:
      ``(out, lse)``: ``out`` ``[batch, T_new, heads, head_dim]`` in the query's dtype; ``lse``
      ``[batch, heads, T_new]`` float32, the natural log of the softmax denominator of the row's scaled
      (and soft-capped) logits over the keys it sees, ``-inf`` for a row that sees no key. Both are
      differentiable. Results over disjoint sets of keys (e.g. a prefix cache shared by the batch and
      each sequence's own cache) merge exactly: with ``lse = logaddexp(lse_a, lse_b)``, ``out =
      exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b`` (the weights per row and head, moved to
      ``[batch, T_new, heads, 1]``).
    """
    spec, cache_lengths, sinks = checked_call(_OP, query, key_cache, value_cache, cache_lengths, page_table, scale,
                                              is_causal, local_window_size, logits_soft_cap, implementation, sinks)
    b, t, n = query.shape[:3]
    if b == 0 or t == 0:
        return sinks_.apply(dispatch.zeros(query.shape, query.dtype, query, key_cache, value_cache),
                            dispatch.zeros((b, n, t), jnp.float32, query, key_cache, value_cache) - jnp.inf, sinks)
    return _attention(spec, query, key_cache, value_cache, cache_lengths, _page_table_int32(page_table), sinks)


def checked_call(op, query, key_cache, value_cache, cache_lengths, page_table, scale, is_causal, local_window_size,
                 logits_soft_cap, implementation, sinks):
    """An attention call's checks (:func:`attention`'s arguments): its spec, and its lengths and sinks as
    the kernel takes them."""
    _float_array(op, "query", query, "[batch, T_new, heads, head_dim]", empty_ok=(0, 1))
    b, t, n, h = query.shape
    capacity, page_size = _check_cache(op, key_cache, value_cache, b, page_table)
    if key_cache.dtype != query.dtype:
        raise TypeError(f"jax_tk.{op}: key_cache/value_cache must have the query's dtype {query.dtype}, got "
                        f"{key_cache.dtype}")
    if key_cache.shape[3] != h:
        raise ValueError(f"jax_tk.{op}: head_dim of key_cache/value_cache ({key_cache.shape[3]}) != head_dim "
                         f"of query ({h})")
    kh = key_cache.shape[2]
    if n % kh != 0:
        raise ValueError(f"jax_tk.{op}: the number of query heads ({n}) must be a multiple of the number of "
                         f"key/value heads ({kh})")
    _check_t_new(op, t, capacity, page_table)
    cache_lengths = _lengths(op, cache_lengths, b)
    scale = checks.positive_float(op, "scale", scale)
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"jax_tk.{op}: is_causal must be a bool, got {is_causal!r}")
    # Positions count from the length as given, which may exceed the capacity: only the right side of a
    # window is bounded by the cache.
    window = checks.window(op, local_window_size, extension.MAX_INDEX, capacity)
    softcap = checks.positive_float(op, "logits_soft_cap", logits_soft_cap)
    use = dispatch.use_kernel(op, implementation, launch.kernel_unsupported_reason(query, key_cache))
    spec = DecodeSpec(scale, bool(is_causal), use, window, softcap, page_size)
    return spec, cache_lengths, sinks_.check(op, sinks, n)


def kernel_unsupported_reason(query, key_cache) -> str | None:
    """Why the decode kernel cannot take a call with this query and key cache (contiguous or paged,
    shaped as :func:`attention` takes them), as ``implementation="tk"``'s error names it; None if it
    can, and then ``implementation=None`` runs it on a CUDA GPU that jax_tk's kernels were built for."""
    return launch.kernel_unsupported_reason(query, key_cache)


# The gradient (query and caches) is the reference's, on every platform: decoding rarely differentiates,
# and the reference's memory, [batch, heads, T_new, cache], is small for few new tokens.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(spec: DecodeSpec, query, key_cache, value_cache, cache_lengths, page_table, sinks):
    """(out, lse); ``sinks`` float32 ``[heads]`` or None."""
    layout = _ATTENTION_LAYOUT if page_table is None else _PAGED_ATTENTION_LAYOUT
    return sharding.call(layout, _local, spec, query, key_cache, value_cache, cache_lengths, page_table, sinks)


def _attention_fwd(spec, *args):
    return _attention(spec, *args), args


def _attention_bwd(spec, args, cotangents):
    paged, sinks = args[4] is not None, args[5] is not None
    grads = sharding.call(_bwd_layout(paged, sinks), _bwd_local, spec, *args, *cotangents,
                          result_like=(0, 1, 2, 5)[:3 + sinks])  # (the sinks' gradient sharded like the sinks)
    # (inside a user's shard_map the sinks' gradient is per device: summed over the devices that share them,
    # e.g. the batch shards, as a custom_vjp cotangent has its primal's type)
    return (*grads[:3], None, None, dispatch.sum_as(grads[3], args[5]) if sinks else None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _reference(spec: DecodeSpec, cache_lengths, page_table, sinks):
    return functools.partial(reference.attention_with_lse, cache_lengths=cache_lengths, scale=spec.scale,
                             page_table=page_table, is_causal=spec.is_causal, local_window_size=spec.window,
                             logits_soft_cap=spec.softcap, sinks=sinks)


def _local(spec: DecodeSpec, query, key_cache, value_cache, cache_lengths, page_table, sinks):
    """(out, lse) on one device's arrays: the kernel on CUDA where it takes the call, else the reference."""
    def reference_fn(q, k, v, lengths, table, s):
        return _reference(spec, lengths, table, s)(q, k, v)

    def kernel_fn(q, k, v, lengths, table, s):
        return launch.kernel(q, k, v, lengths, table, spec, with_lse=True, sinks=s)

    return dispatch.platform_dispatch(spec.use_kernel, kernel_fn, reference_fn, query, key_cache, value_cache,
                                      cache_lengths, page_table, sinks)


def _bwd_local(spec: DecodeSpec, query, key_cache, value_cache, cache_lengths, page_table, sinks, dout, dlse):
    """The reference's gradient in the query and the caches, then with sinks in them."""
    if sinks is None:
        f = _reference(spec, cache_lengths, page_table, None)
        return jax.vjp(f, query, key_cache, value_cache)[1]((dout, dlse))
    f = lambda q, k, v, s: _reference(spec, cache_lengths, page_table, s)(q, k, v)
    return jax.vjp(f, query, key_cache, value_cache, dispatch.vary_as(sinks, query))[1]((dout, dlse))


def update_kv_cache(cache, new, cache_lengths, *, page_table=None):
    """Writes ``new`` ``[batch, T_new, kv_heads, head_dim]`` into ``cache`` at logical positions
    ``cache_lengths[b] .. cache_lengths[b] + T_new - 1`` of each sequence b, and returns the cache.

    ``cache_lengths`` are the lengths BEFORE appending (the caller adds ``T_new`` afterwards, then calls
    ``attention`` with the new lengths). Call it once for the key cache and once for the value cache
    (for ``mla_attention``, once for its one latent cache: ``new`` ``[batch, T_new, 1, D]``).

    Contiguous cache ``[batch, max_seq_len, kv_heads, head_dim]``: one scatter. Paged cache
    ``[num_pages, page_size, kv_heads, head_dim]`` with ``page_table`` ``[batch, max_pages]``: one scatter
    into the pages the table names. Under ``jax.jit`` with the cache donated (``donate_argnums``), XLA
    writes in place: only the new rows move.

    Positions past the cache (``>= max_seq_len``, or past ``max_pages * page_size``), negative positions,
    and rows whose page-table entry is outside ``[0, num_pages)`` are dropped (not written, no error:
    the sizes are traced). Two sequences whose tables name the same page and row write in an
    unspecified order.

    Under ``jit`` with sharded inputs each device writes its own shard of the cache: a contiguous cache
    split over batch and key/value heads; a paged pool split over key/value heads and replicated over
    the batch axes, each replica getting every sequence's new rows (``new`` is gathered, the pool never).
    """
    if not hasattr(cache, "shape") or not hasattr(new, "shape"):
        raise TypeError(f"jax_tk.{_UPDATE}: cache and new must be arrays, got {type(cache).__name__} and "
                        f"{type(new).__name__}")
    _float_array(_UPDATE, "new", new, "[batch, T_new, kv_heads, head_dim]", empty_ok=(0, 1))
    b, t, kh, h = new.shape
    capacity, _ = _check_cache(_UPDATE, cache, None, b, page_table, names=("cache",))
    if cache.dtype != new.dtype:
        raise TypeError(f"jax_tk.{_UPDATE}: new must have the cache's dtype {cache.dtype}, got {new.dtype}")
    if tuple(cache.shape[2:]) != (kh, h):
        raise ValueError(f"jax_tk.{_UPDATE}: new's [kv_heads, head_dim] {(kh, h)} != the cache's "
                         f"{tuple(cache.shape[2:])}")
    _check_t_new(_UPDATE, t, capacity, page_table)
    cache_lengths = _lengths(_UPDATE, cache_lengths, b)
    if b == 0 or t == 0:
        return cache
    layout = _UPDATE_LAYOUT if page_table is None else _PAGED_UPDATE_LAYOUT
    return sharding.call(layout, _update_local, None, cache, new, cache_lengths, _page_table_int32(page_table))[0]


def _update_local(static, cache, new, cache_lengths, page_table):
    """update_kv_cache on one device's arrays (checked; lengths and table int32): one scatter."""
    del static
    b, t = new.shape[:2]
    capacity = cache.shape[1] if page_table is None else page_table.shape[1] * cache.shape[1]
    pos = reference.query_positions(cache_lengths + t, t)  # [B, T]: len .. len + T - 1
    inside = (pos >= 0) & (pos < capacity)
    if page_table is None:
        # Out-of-range rows are sent to index max_seq_len (explicitly, because negative indices would wrap)
        # and dropped by the scatter.
        rows = jnp.where(inside, pos, capacity)
        return (cache.at[jnp.arange(b)[:, None], rows].set(new, mode="drop"),)
    page_size, num_pages = cache.shape[1], cache.shape[0]
    slot = jnp.where(inside, pos // page_size, 0)
    page = jnp.take_along_axis(page_table, slot, axis=1)
    page = jnp.where(inside & (page >= 0) & (page < num_pages), page, num_pages)
    return (cache.at[page, pos % page_size].set(new, mode="drop"),)


# ----------------------------------------------------------------------------------------------
# Partitioning (jax_tk._core.sharding): under jit with sharded inputs each device runs the op on its
# shards, without gathering the caches.
#
# Labels: batch "b" and query heads "n" split, key/value heads "k" split with them (grouped-query:
# each device keeps the key/value heads of its query heads; with more head shards than key/value
# heads, a head is replicated over the devices that share it), T_new "t", cache rows "s", head_dim "d"
# and the page table's slots "m" whole. The query's sharding decides the split (shard it like the
# caches: batch and heads).
#
# A paged cache "p r k d" has no batch dimension: a page may belong to any sequence, so the pool is
# split over key/value heads only and is whole (replicated) over the batch axes, where the page table
# and lengths are split. A pool sharded over its pages would be gathered; to give each batch shard a
# pool of its own (page numbers local to the shard), call the op inside shard_map, where it runs on
# whatever it is given. update_kv_cache of a paged pool leads with the pool, so the batch is not split
# there: every device writes every sequence's new rows into its replica of the pool (the new tokens,
# [batch, T_new, kv_heads, head_dim], are gathered; the pool never is), which keeps the replicas equal.
# ----------------------------------------------------------------------------------------------

_ATTENTION_LAYOUT = sharding.Layout(inputs=("b t n d", "b s k d", "b s k d", "b", "b m", "n"),
                                    outputs=("b t n d", "b n t"), heads="n", grouped="k")
_PAGED_ATTENTION_LAYOUT = sharding.Layout(inputs=("b t n d", "p r k d", "p r k d", "b", "b m", "n"),
                                          outputs=("b t n d", "b n t"), heads="n", grouped="k")


@functools.lru_cache(maxsize=None)
def _bwd_layout(paged: bool, sinks: bool) -> sharding.Layout:
    """The gradient (from the cotangents of out and lse): the query's, the caches' (a paged pool's summed
    over the batch axes it is replicated over), then with sinks theirs (summed over the batch axes)."""
    forward = _PAGED_ATTENTION_LAYOUT if paged else _ATTENTION_LAYOUT
    cache = "p r k d" if paged else "b s k d"
    summed = ((1, 2) if paged else ()) + ((3,) if sinks else ())
    return sharding.Layout(inputs=forward.inputs + ("b t n d", "b n t"),
                           outputs=("b t n d", cache, cache) + (("n",) if sinks else ()), heads="n", grouped="k",
                           summed=summed)
_UPDATE_LAYOUT = sharding.Layout(inputs=("b s k d", "b t k d", "b", "b m"), outputs=("b s k d",), heads="k")
_PAGED_UPDATE_LAYOUT = sharding.Layout(inputs=("p r k d", "b t k d", "b", "b m"), outputs=("p r k d",), heads="k")
