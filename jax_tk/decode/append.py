"""``jax_tk.decode.append_attention``: a decoding step's new keys and values written into the cache and
attended over, in one call.

A generation step calls ``update_kv_cache`` twice (keys, values) and then ``attention``: three XLA
operations per layer, each launched on its own. Inside a decoding loop, where every kernel is short,
the launches themselves take a share of the step. Here one FFI call launches a small kernel that
writes the new rows into the caches (in place: the caches are aliased to its results) and then the
decode kernel, which starts as the write ends (programmatic dependent launch) and reads the lengths
after the new tokens that the write leaves on the device.

Its meaning is the composition ``update_kv_cache`` x 2 then ``attention`` with the lengths after the
new tokens, which is also its gradient and what runs where the fused call does not apply (off CUDA,
calls the decode kernel does not take, and calls that jit partitions over several devices: the fused
call runs on the arrays as they are, on one device or on shard_map's shards).
"""
from __future__ import annotations

import functools

import jax

from jax_tk._core import dispatch, sharding
from jax_tk.decode import api, launch

_OP = "decode.append_attention"


def append_attention(query, new_key, new_value, key_cache, value_cache, cache_lengths, *, page_table=None, scale=None,
                     is_causal=True, local_window_size=None, logits_soft_cap=None, implementation=None, sinks=None):
    """Appends the new tokens' keys and values to the cache, then attends over it: one decoding step.

    The same as::

        key_cache = update_kv_cache(key_cache, new_key, cache_lengths, page_table=page_table)
        value_cache = update_kv_cache(value_cache, new_value, cache_lengths, page_table=page_table)
        out = attention(query, key_cache, value_cache, cache_lengths + T_new, page_table=page_table, ...)

    in one call on CUDA GPUs where the decode kernel takes it, on one device or inside ``shard_map``
    (elsewhere, and under ``jit`` with sharded inputs, it runs as written above, split over batch and
    heads as those are).

    Args:
      query: ``[batch, T_new, heads, head_dim]``, as :func:`attention` takes it.
      new_key, new_value: ``[batch, T_new, kv_heads, head_dim]`` in the cache's dtype: the new tokens'
        keys and values, written at positions ``cache_lengths[b] .. cache_lengths[b] + T_new - 1``
        (positions outside the cache, and rows whose page-table entry is outside the pool, are dropped,
        as :func:`update_kv_cache` drops them).
      key_cache, value_cache: the cache BEFORE the new tokens, contiguous or paged, as :func:`attention`
        takes it. Donate them (``jax.jit(..., donate_argnums=...)``) for the write to happen in place.
      cache_lengths: ``[batch]`` integers: the lengths BEFORE the new tokens.
      page_table, scale, is_causal, local_window_size, logits_soft_cap, sinks: as in :func:`attention`
        (the query's rows sit at the positions of the new tokens).
      implementation: ``None``: the fused call where it applies, else the composition above (the decode
        kernel where it takes the attention); ``"tk"``: the kernels or an error; ``"xla"``: the reference.

    Differentiable as the composition is, in the query, the new keys and values and the caches.

    Returns:
      ``(out, key_cache, value_cache)``: the attention's output ``[batch, T_new, heads, head_dim]`` and
      the caches holding the new tokens.
    """
    spec, lengths, sinks = api.checked_call(_OP, query, key_cache, value_cache, cache_lengths, page_table, scale,
                                            is_causal, local_window_size, logits_soft_cap, implementation, sinks)
    b, t = query.shape[:2]
    for name, x in (("new_key", new_key), ("new_value", new_value)):
        api._float_array(_OP, name, x, "[batch, T_new, kv_heads, head_dim]", empty_ok=(0, 1))
        if x.dtype != key_cache.dtype:
            raise TypeError(f"jax_tk.{_OP}: {name} must have the cache's dtype {key_cache.dtype}, got {x.dtype}")
        if tuple(x.shape) != (b, t, *key_cache.shape[2:]):
            raise ValueError(f"jax_tk.{_OP}: {name} must be [batch, T_new, kv_heads, head_dim] = "
                             f"{(b, t, *key_cache.shape[2:])}, got {tuple(x.shape)}")
    table = api._page_table_int32(page_table)
    if spec.use_kernel and b > 0 and t > 0 and sharding.runs_locally(query):
        out, _, key_cache, value_cache = _fused(spec, query, new_key, new_value, key_cache, value_cache, lengths, table,
                                                sinks)
        return out, key_cache, value_cache
    key_cache = api.update_kv_cache(key_cache, new_key, lengths, page_table=page_table)
    value_cache = api.update_kv_cache(value_cache, new_value, lengths, page_table=page_table)
    out = api.attention(query, key_cache, value_cache, lengths + t, page_table=page_table, scale=spec.scale,
                        is_causal=spec.is_causal, local_window_size=spec.window, logits_soft_cap=spec.softcap,
                        implementation=implementation, sinks=sinks)
    return out, key_cache, value_cache


def _composed(spec, query, new_key, new_value, key_cache, value_cache, cache_lengths, page_table, sinks):
    """(out, lse, key_cache, value_cache) of the composition: the fused call's meaning and its gradient."""
    key_cache = api.update_kv_cache(key_cache, new_key, cache_lengths, page_table=page_table)
    value_cache = api.update_kv_cache(value_cache, new_value, cache_lengths, page_table=page_table)
    out, lse = api._attention(spec, query, key_cache, value_cache, cache_lengths + query.shape[1], page_table, sinks)
    return out, lse, key_cache, value_cache


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(spec, query, new_key, new_value, key_cache, value_cache, cache_lengths, page_table, sinks):
    """(out, lse, key_cache, value_cache) on the arrays as they are (one device, or shard_map's shards):
    the fused kernels on CUDA, else the composition's reference."""
    def kernel_fn(q, k, v, kc, vc, lengths, table, s):
        return launch.append_kernel(q, k, v, kc, vc, lengths, table, spec, sinks=s)

    def reference_fn(q, k, v, kc, vc, lengths, table, s):
        (kc,), (vc,) = api._update_local(None, kc, k, lengths, table), api._update_local(None, vc, v, lengths, table)
        out, lse = api._reference(spec, lengths + q.shape[1], table, s)(q, kc, vc)
        return out, lse, kc, vc

    return dispatch.platform_dispatch(spec.use_kernel, kernel_fn, reference_fn, query, new_key, new_value, key_cache,
                                      value_cache, cache_lengths, page_table, sinks)


def _fused_fwd(spec, *args):
    return _fused(spec, *args), args


def _fused_bwd(spec, args, cotangents):
    query, new_key, new_value, key_cache, value_cache, cache_lengths, page_table, sinks = args
    f = lambda q, k, v, kc, vc, s: _composed(spec, q, k, v, kc, vc, cache_lengths, page_table, s)
    grads = jax.vjp(f, query, new_key, new_value, key_cache, value_cache, sinks)[1](cotangents)
    return (*grads[:5], None, None, grads[5])


_fused.defvjp(_fused_fwd, _fused_bwd)
