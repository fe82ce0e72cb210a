"""Decode-attention providers: jax_tk and its peers, each as a ``harness.Provider`` for one configuration.

Every provider's ``fn(query, key_cache, value_cache, lengths, page_table)`` attends ``query`` ``[B, T_new,
N, H]`` (the last T_new positions of each sequence) over a cache holding ``lengths[b]`` valid positions
(contiguous ``[B, S, K, H]``, or a pool of pages with ``page_table`` ``[B, S / page_size]``), causal
bottom-right aligned for T_new > 1 (a new token sees itself and everything before it).

- ``jax_tk``: ``jax_tk.decode.attention(implementation="tk")``, the decode kernel (an error where the
  kernel refuses the call); without a CUDA device ``implementation=None``, the pure-JAX reference.
- ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` on the contiguous cache with
  ``key_value_seq_lengths=lengths`` (cuDNN's padding mask). T_new = 1 needs no other mask. For
  T_new > 1 jax.nn's ``is_causal`` is top-left aligned (query i sees keys j <= i), which is wrong for
  decoding, and it has no bottom-right option, so the bottom-right causal mask goes in as a boolean
  ``mask`` [B, 1, T_new, S] built from the lengths inside the timed call (cuDNN adds it as a bias: it
  reads T_new*S extra numbers per sequence, against 2*K*H per position of the cache: under 1%).
  ``jax.nn`` has no paged cache: paged rows are skipped ("unsupported"), not timed on a gathered copy.
- ``xla``: the same call with ``implementation="xla"`` (it materializes [B, N, T_new, S] logits).
- ``fa3``: ``flash_attn3_jax.flash_mha_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
  page_table=..., is_causal=T_new > 1, num_splits=n)`` (FlashAttention-3's causal mask is bottom-right
  aligned to ``cache_seqlens``; its page table is int32 ``[B, max_pages]`` into a pool ``[num_pages,
  page_size, K, H]``, as ours). Timed with ``num_splits`` 1, 4 and 16 (KV split into that many parts
  combined afterwards); the fastest is reported. The PyPI wheel (0.2.3) is built for Hopper and
  head_dim 128 only (``JAX_TK_FA3_HEAD_DIMS`` for a source build with more).

Attention sinks (``cfg.sinks``, the values ``cfg.sink_values()``): jax_tk passes them to
``jax_tk.decode.attention(sinks=...)``; neither jax.nn nor ``flash_mha_with_kvcache`` has an option for
them, so the peers' sinks rows are skipped ("unsupported") rather than timed without them.

Steps in a scan (``cfg.steps`` > 1, ``--scan N``): every provider's call, its variants' too, is wrapped
by ``in_scan`` into N dependent steps inside one ``jax.lax.scan`` (one jitted program, no dispatch
between steps, as a generation loop runs); the timed function returns the first step's output (the
one the correctness check reads) and the last step's query.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from benchmarks import peers
from benchmarks.harness import Provider, Skip, Unavailable, factory, has_gpu

PEERS = ("cudnn", "fa3")  # the ratio column compares jax_tk with the faster of these
# What each peer calls, for the note of its skipped sinks rows.
NO_SINKS = {"cudnn": "jax.nn.dot_product_attention", "xla": "jax.nn.dot_product_attention",
            "fa3": "flash_mha_with_kvcache"}
FA3_SPLITS = (1, 4, 16)
LOGITS = "float32 [B, N, T_new, S] logits"


def bottom_right_mask(lengths, t_new: int, s: int):
    """Boolean ``[B, 1, T_new, S]``: query row i of sequence b (position ``lengths[b] - T_new + i``) sees
    key j iff ``j <= lengths[b] - T_new + i`` (which also keeps j < lengths[b])."""
    pos = lengths[:, None] - t_new + jnp.arange(t_new, dtype=lengths.dtype)[None, :]
    return (jnp.arange(s, dtype=lengths.dtype)[None, None, :] <= pos[:, :, None])[:, None]


def _jax_tk_provider(cfg, scale: float) -> Provider:
    import jax_tk

    gpu = has_gpu()
    impl = "tk" if gpu else None
    sinks = None if cfg.sink_values() is None else jnp.asarray(cfg.sink_values())

    def fn(q, k, v, lengths, page_table):
        return jax_tk.decode.attention(q, k, v, lengths, page_table=page_table, scale=scale, is_causal=True,
                                       implementation=impl, sinks=sinks)

    with_sinks = ", sinks" if cfg.sinks else ""
    if gpu:
        return Provider("jax_tk", fn, scale, note=f"implementation='tk'{with_sinks}")
    return Provider("jax_tk", fn, scale, note=f"no GPU: implementation=None (pure-JAX reference){with_sinks}",
                    scratch_bytes=cfg.logits_bytes(), scratch_what=LOGITS)


def _jax_nn_provider(name: str, cfg, scale: float) -> Provider:
    if cfg.page_size:
        raise Skip("unsupported: jax.nn.dot_product_attention has no paged KV cache")
    if name == "cudnn" and not has_gpu():
        raise Unavailable("cuDNN needs a CUDA GPU")
    t, s = cfg.new_tokens, cfg.cache_len
    base = functools.partial(jax.nn.dot_product_attention, scale=scale, implementation=name)
    if t == 1:
        def fn(q, k, v, lengths, page_table):
            del page_table
            return base(q, k, v, key_value_seq_lengths=lengths)

        note = "key_value_seq_lengths"
    else:
        def fn(q, k, v, lengths, page_table):
            del page_table
            return base(q, k, v, mask=bottom_right_mask(lengths, t, s), key_value_seq_lengths=lengths)

        note = "key_value_seq_lengths + bottom-right causal mask [B,1,T,S] (jax.nn's is_causal is top-left)"
    p = Provider(name, fn, scale, note=note)
    if name == "xla":
        p = dataclasses.replace(p, scratch_bytes=cfg.logits_bytes(), scratch_what=LOGITS)
    return p


def _fa3_provider(cfg, scale: float) -> Provider:
    fa3 = peers.fa3(cfg)

    def variant(splits):
        def fn(q, k, v, lengths, page_table):
            return fa3.flash_mha_with_kvcache(q, k, v, cache_seqlens=lengths, page_table=page_table,
                                              softmax_scale=float(scale), is_causal=cfg.new_tokens > 1,
                                              num_splits=splits)

        return Provider("fa3", fn, scale, note=f"flash_mha_with_kvcache num_splits={splits}")

    variants = tuple(variant(n) for n in FA3_SPLITS)
    return Provider("fa3", variants[0].fn, scale, variants=variants,
                    note=f"flash_mha_with_kvcache, fastest of num_splits {'/'.join(map(str, FA3_SPLITS))}")


FACTORIES = {
    "jax_tk": _jax_tk_provider,
    "cudnn": functools.partial(_jax_nn_provider, "cudnn"),
    "fa3": _fa3_provider,
    "xla": functools.partial(_jax_nn_provider, "xla"),
}
PROVIDERS = tuple(FACTORIES)


def default_providers() -> list[str]:
    return list(PROVIDERS)


# Each scanned step's query is the previous one plus EPS times the previous step's output: a tiny
# change (in bf16 it mostly rounds away), but one that XLA cannot fold, so no step can be hoisted out
# of the loop or merged with another.
EPS = 2.0**-10
# The L2 of an H100/H200: a cache under it may be read from L2 by every step but the first.
L2_BYTES = 50 * 2**20


def in_scan(fn, steps: int):
    """``fn(q, *cache_args) -> out`` (``out`` of the query's shape, or narrower in the last dim: MLA's
    512 value dims of a 576-dim query) as ``steps`` calls inside one ``jax.lax.scan``. Step i+1's query
    is ``q_i + EPS * out_i`` (``out_i`` in the first dims of the query where it is narrower; a data
    dependence through the carry: XLA cannot hoist the call out of the loop nor dedupe steps; ``0 *
    out`` would be folded).
    The cost per step beyond the call: one elementwise fusion over the query-sized arrays (the update,
    and keeping step 0's output), the same for every provider. Returns ``(out_0, q_steps)``: the first
    step's output (the query unchanged: what the correctness check compares) and the last query (which
    depends on every step, so none is dead code)."""
    def scanned(q, *cache_args):
        widths = []  # the output's last dim, seen when scan traces the step

        def step(carry, i):
            q_i, first = carry
            out = fn(q_i, *cache_args)
            if out.shape[:-1] != q_i.shape[:-1] or out.shape[-1] > q_i.shape[-1]:
                raise ValueError(f"in_scan: the output {out.shape} does not fit in the query's shape {q_i.shape}")
            widths.append(out.shape[-1])
            out = jnp.pad(out, [(0, 0)] * (out.ndim - 1) + [(0, q_i.shape[-1] - out.shape[-1])])
            first = jnp.where(i == 0, out.astype(first.dtype), first)
            return (q_i + (out.astype(jnp.float32) * EPS).astype(q_i.dtype), first), None

        (q_last, first), _ = jax.lax.scan(step, (q, jnp.zeros_like(q)), jnp.arange(steps))
        return first[..., :widths[-1]], q_last

    return scanned


def _scanned(p: Provider, steps: int, cfg) -> Provider:
    note = f"{steps} steps in one lax.scan, time per step"
    if cfg.cache_bytes() < L2_BYTES:
        note += f" (cache {cfg.cache_bytes() / 2**20:.3g} MiB < L2: steps after the first may read it from L2)"
    return dataclasses.replace(p, fn=in_scan(p.fn, steps), note="; ".join(filter(None, [p.note, note])),
                               variants=tuple(_scanned(v, steps, cfg) for v in p.variants))


def for_steps(p: Provider, cfg) -> Provider:
    """``p`` as the configuration runs it: one call, or ``cfg.steps`` > 1 calls inside one scan."""
    return _scanned(p, cfg.steps, cfg) if cfg.steps > 1 else p


def make_provider(name: str, cfg) -> Provider:
    make = factory(FACTORIES, name)
    # Every provider but jax_tk (a new peer too, until it passes them), before its own checks: no
    # sinks is the reason for the whole row.
    if cfg.sinks and name != "jax_tk":
        raise Skip(f"unsupported: {NO_SINKS.get(name, name)} has no attention sinks")
    return for_steps(make(cfg, 1.0 / math.sqrt(cfg.head_dim)), cfg)
