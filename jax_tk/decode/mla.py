"""jax_tk.decode.mla_attention: multi-head latent attention (DeepSeek's MLA) of new tokens over one
latent cache, with FlashMLA's decode semantics.

Trace-time checks (those of ``jax_tk.decode.attention`` where the arguments are the same), the static
spec of a call, the dispatch, and the partitioning (under ``jit`` with sharded inputs it runs on each
device's shards, split over batch and query heads; see the layouts at the end of this module). On
H100/H200 DeepSeek's dims (576, 512) run the decode kernel (cc/decode/mla_sm90.cu) with the latent cache
as both of its caches; any other call runs the pure-JAX reference (``reference.mla_attention_with_lse``).
The gradient is the reference's on every platform.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_tk._core import checks, dispatch, extension, sharding, sinks as sinks_
from jax_tk.decode import api, launch, reference

_OP = "decode.mla_attention"


@dataclasses.dataclass(frozen=True)
class MlaSpec:
    """Static description of one MLA call. page_size: rows per page of a paged cache, None for a
    contiguous one."""

    scale: float
    is_causal: bool
    v_head_dim: int
    use_kernel: bool
    page_size: int | None = None


def kernel_unsupported_reason(query, latent_cache, v_head_dim: int) -> str | None:
    """Why the MLA kernel cannot take a call with this query, latent cache and value head dim, as
    ``implementation="tk"``'s error names it; None if it can."""
    c = launch.contract()
    dims = (c["MLA_HEAD_DIM"], c["MLA_V_HEAD_DIM"])
    if (query.shape[-1], v_head_dim) != dims:
        return f"head dims ({query.shape[-1]}, {v_head_dim}) (the MLA kernel takes {dims}, DeepSeek's)"
    if not any(query.dtype == d for d in launch.KERNEL_DTYPES):
        return f"dtype {query.dtype} (the MLA kernel takes bfloat16 and float16)"
    if latent_cache.shape[0] * latent_cache.shape[1] > extension.MAX_INDEX:
        return f"a cache of {latent_cache.shape[0] * latent_cache.shape[1]} rows (the kernel takes fewer than 2^31)"
    if not extension.takes_sm90_kernels(extension.cuda_device_capability(), dispatch.kernel_variant()):
        return "this GPU (the MLA kernel runs on H100/H200, sm_90a, only)"
    return None


def mla_attention(query, latent_cache, cache_lengths, *, page_table=None, v_head_dim=512, scale=None,
                  is_causal=True, implementation=None, sinks=None):
    """Multi-head latent attention of the newest ``T_new`` tokens of each sequence over its latent cache
    (DeepSeek's MLA at decode time, with the semantics of FlashMLA's ``flash_mla_with_kvcache``).

    All query heads attend over one cache of latent rows: the rows are the keys, and their first
    ``v_head_dim`` dims are the values. The caller absorbs the key and value up-projections into the
    query and the output (in DeepSeek-V2/V3: ``D = 576`` = 512 latent dims + 64 rotary dims, values the
    512 latent dims, 16 to 128 query heads).

    Args:
      query: ``[batch, T_new, heads, D]``, bfloat16, float16 or float32: the LAST ``T_new`` positions of
        each sequence (in the latent space); row i of sequence b is at position
        ``p = cache_lengths[b] - T_new + i``.
      latent_cache: the cache, already holding the new tokens (``update_kv_cache`` first), in the
        query's dtype. Contiguous: ``[batch, max_seq_len, 1, D]``. Paged (with ``page_table``):
        ``[num_pages, page_size, 1, D]``.
      cache_lengths: ``[batch]`` integers (may be traced): keys ``j < cache_lengths[b]`` are valid; rows
        of the cache past the length may hold anything (NaN included).
      page_table: ``[batch, max_pages]`` integers, as in :func:`jax_tk.decode.attention`: position j of
        sequence b lives in page ``page_table[b, j // page_size]``, row ``j % page_size``; within the
        length, an entry outside ``[0, num_pages)`` reads as a page of zeros.
      v_head_dim: the values' dims, the first ``v_head_dim`` of each row, ``1 <= v_head_dim <= D``
        (default 512, DeepSeek's; pass it for another ``D``).
      scale: logit multiplier (a Python float), default ``1/sqrt(D)`` (DeepSeek's models pass their own,
        ``1/sqrt(192)`` times a YaRN factor).
      is_causal: row i sees keys ``j <= p`` (bottom-right aligned: a single new token sees the whole
        cache). ``False``: every valid key.
      sinks: ``[heads]`` floats or None: attention sinks, as in :func:`jax_tk.decode.attention`.
      implementation: ``None``: the kernel on H100/H200 for DeepSeek's dims (``D = 576``,
        ``v_head_dim = 512``) in bfloat16 or float16, else the pure-JAX reference (float32 math);
        ``"xla"``: the reference; ``"tk"``: the kernel, a ``ValueError`` naming why where it cannot run.

    A row that sees no key (``cache_lengths[b] == 0``, or ``p < 0``) gives 0, never NaN. A batch of 0
    or ``T_new = 0`` gives an empty result. Differentiable in ``query`` and ``latent_cache`` (the
    gradient of the cache sums its use as keys and as values).

    Several devices: as :func:`jax_tk.decode.attention`. Inside ``shard_map`` it runs on the local
    shards as given; under ``jit`` with sharded inputs it runs on each device's shards, split over
    batch and query heads as the query is, without gathering the cache (shard the cache, lengths and
    page table over the batch axes; the one latent head is whole on each device of a head shard). A
    paged pool is replicated over the batch axes.

    Returns:
      ``[batch, T_new, heads, v_head_dim]`` in the query's dtype (:func:`mla_attention_with_lse` also
      returns the log-sum-exp of each row).
    """
    return mla_attention_with_lse(query, latent_cache, cache_lengths, page_table=page_table, v_head_dim=v_head_dim,
                                  scale=scale, is_causal=is_causal, implementation=implementation, sinks=sinks)[0]


def mla_attention_with_lse(query, latent_cache, cache_lengths, *, page_table=None, v_head_dim=512, scale=None,
                           is_causal=True, implementation=None, sinks=None):
    """Like :func:`mla_attention`, and also returns the float32 log-sum-exp of each query row.

    Returns:
      ``(out, lse)``: ``out`` ``[batch, T_new, heads, v_head_dim]`` in the query's dtype; ``lse``
      ``[batch, heads, T_new]`` float32, ``-inf`` for a row that sees no key (as
      :func:`jax_tk.decode.attention_with_lse`'s, and merged the same way). Both are differentiable.
    """
    api._float_array(_OP, "query", query, "[batch, T_new, heads, head_dim]", empty_ok=(0, 1))
    b, t, n, d = query.shape
    capacity, page_size = api._check_cache(_OP, latent_cache, None, b, page_table, names=("latent_cache",))
    if latent_cache.dtype != query.dtype:
        raise TypeError(f"jax_tk.{_OP}: latent_cache must have the query's dtype {query.dtype}, got "
                        f"{latent_cache.dtype}")
    if latent_cache.shape[2] != 1:
        raise ValueError(f"jax_tk.{_OP}: latent_cache must have one head (dim 2 of size 1: every query head "
                         f"reads the same latent rows), got shape {tuple(latent_cache.shape)}")
    if latent_cache.shape[3] != d:
        raise ValueError(f"jax_tk.{_OP}: head_dim of latent_cache ({latent_cache.shape[3]}) != head_dim of "
                         f"query ({d})")
    if not checks.is_int(v_head_dim):
        raise TypeError(f"jax_tk.{_OP}: v_head_dim must be an int, got {v_head_dim!r}")
    if not 1 <= v_head_dim <= d:
        raise ValueError(f"jax_tk.{_OP}: v_head_dim ({v_head_dim}) must be in [1, head_dim of query ({d})]: the "
                         "values are the first v_head_dim dims of the latent rows")
    api._check_t_new(_OP, t, capacity, page_table)
    cache_lengths = api._lengths(_OP, cache_lengths, b)
    scale = checks.positive_float(_OP, "scale", scale)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"jax_tk.{_OP}: is_causal must be a bool, got {is_causal!r}")
    use = dispatch.use_kernel(_OP, implementation, kernel_unsupported_reason(query, latent_cache, v_head_dim))
    spec = MlaSpec(scale, bool(is_causal), int(v_head_dim), use, page_size)
    sinks = sinks_.check(_OP, sinks, n)
    if b == 0 or t == 0:
        return (dispatch.zeros((b, t, n, spec.v_head_dim), query.dtype, query, latent_cache),
                dispatch.zeros((b, n, t), jnp.float32, query, latent_cache) - jnp.inf)
    return sinks_.apply(*_mla(spec, query, latent_cache, cache_lengths, api._page_table_int32(page_table)), sinks)


# As decode.attention's: the gradient is the reference's on every platform (decoding rarely
# differentiates, and the reference's memory, [batch, heads, T_new, cache], is small for few new tokens).
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mla(spec: MlaSpec, query, latent_cache, cache_lengths, page_table):
    """(out, lse)."""
    layout = _LAYOUT if page_table is None else _PAGED_LAYOUT
    return sharding.call(layout, _local, spec, query, latent_cache, cache_lengths, page_table)


def _mla_fwd(spec, *args):
    return _mla(spec, *args), args


def _mla_bwd(spec, args, cotangents):
    layout = _BWD_LAYOUT if args[-1] is None else _PAGED_BWD_LAYOUT
    grads = sharding.call(layout, _bwd_local, spec, *args, *cotangents, result_like=(0, 1))
    return (*grads, None, None)


_mla.defvjp(_mla_fwd, _mla_bwd)


def _reference(spec: MlaSpec, query, latent_cache, cache_lengths, page_table):
    return reference.mla_attention_with_lse(query, latent_cache, cache_lengths, scale=spec.scale,
                                            v_head_dim=spec.v_head_dim, page_table=page_table,
                                            is_causal=spec.is_causal)


def _kernel(spec: MlaSpec, query, latent_cache, cache_lengths, page_table, out_init=None, parts=None):
    """(out, lse) of the decode kernel on the latent cache, passed as both key and value cache (the
    kernel reads each row once for both). ``out_init``, ``parts``: as ``launch.kernel``'s (tests)."""
    decode_spec = api.DecodeSpec(spec.scale, spec.is_causal, True, page_size=spec.page_size)
    return launch.kernel(query, latent_cache, latent_cache, cache_lengths, page_table, decode_spec, out_init=out_init,
                         parts=parts, with_lse=True)


def _local(spec: MlaSpec, query, latent_cache, cache_lengths, page_table):
    """(out, lse) on one device's arrays: the kernel on CUDA where it takes the call, else the reference."""
    return dispatch.platform_dispatch(spec.use_kernel, functools.partial(_kernel, spec), functools.partial(_reference, spec),
                                      query, latent_cache, cache_lengths, page_table)


def _bwd_local(spec: MlaSpec, query, latent_cache, cache_lengths, page_table, dout, dlse):
    def f(q, c):
        return _reference(spec, q, c, cache_lengths, page_table)
    return jax.vjp(f, query, latent_cache)[1]((dout, dlse))


# ----------------------------------------------------------------------------------------------
# Partitioning (jax_tk._core.sharding), as decode.attention's with one key/value head "k" that all
# query heads share: batch "b" and query heads "n" split; the latent head is replicated over the head
# axes (each device uses it whole), and its gradient summed over them. The output's last dim "e"
# (v_head_dim) is a label of its own: it differs from the query's "d". A paged pool "p r k d" is
# replicated over the batch axes (any page may belong to any sequence), its gradient summed over them.
# ----------------------------------------------------------------------------------------------

_LAYOUT = sharding.Layout(inputs=("b t n d", "b s k d", "b", "b m"), outputs=("b t n e", "b n t"), heads="n",
                          grouped="k")
_PAGED_LAYOUT = sharding.Layout(inputs=("b t n d", "p r k d", "b", "b m"), outputs=("b t n e", "b n t"),
                                heads="n", grouped="k")
_BWD_LAYOUT = sharding.Layout(inputs=_LAYOUT.inputs + ("b t n e", "b n t"), outputs=("b t n d", "b s k d"),
                              heads="n", grouped="k")
_PAGED_BWD_LAYOUT = sharding.Layout(inputs=_PAGED_LAYOUT.inputs + ("b t n e", "b n t"),
                                    outputs=("b t n d", "p r k d"), heads="n", grouped="k", summed=(1,))
