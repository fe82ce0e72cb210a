"""Attention providers: jax_tk and its peers, each as a ``harness.Provider`` for one configuration.

- ``jax_tk``: ``jax_tk.attention(implementation="tk")`` (``implementation=None``, i.e. the pure-JAX
  reference, when no CUDA device is present, so that the benchmark also runs on CPU);
- ``jax_tk_auto``: ``jax_tk.attention(implementation=None)``: the kernel where it takes the call, the
  pure-JAX reference otherwise (said in the note; the ``--xla-max-gb`` limit then applies to it);
- ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``;
- ``cudnn_packed``: cuDNN on the packed-document rows without a dense mask: before timing, each
  document becomes one row of a padded batch (``[documents, L, H, D]``, L the longest document
  rounded up to 128, zeros past each document's end), and ``jax.nn.dot_product_attention`` takes the
  documents' lengths as ``query_seq_lengths``/``key_value_seq_lengths`` (cuDNN's padding mask: each
  row's attention ends at its length). jax's public API has no way to cuDNN's packed ("THD")
  layout, so this is the padded layout of the same problem; the check maps its results back;
- ``fa3``: FlashAttention-3 through the ``flash-attn3-jax`` wheel (``flash_attn3_jax.flash_mha``;
  packed documents through ``flash_mha_varlen``), Hopper only, head_dim 128 only in the PyPI wheel
  (``JAX_TK_FA3_HEAD_DIMS=64,128,256`` for a build from source with more), bf16/fp16;
- ``tokamax``: ``tokamax.dot_product_attention(..., implementation="mosaic")`` (its Pallas Mosaic GPU
  kernel), with the arguments of ``jax.nn.dot_product_attention`` (documents as the same dense mask);
- ``jla``: jax-linear-attention's ``jla.ops.mosaic_gpu.attention.flash_attention`` (Pallas Mosaic
  GPU, Hopper): causal only, queries and keys of one length, the head dims its own
  ``supported(q, k, v)`` takes (given the value's own shape); documents as
  ``segment_ids``, the window ``(left, 0)`` as ``sliding_window=left + 1`` (it counts the query);
- ``xla``: ``jax.nn.dot_product_attention(implementation="xla")``; skipped where its ``[B, H, T, S]``
  float32 logits (``T*S*B*H*4`` bytes) would exceed ``--xla-max-gb``;
- ``pallas``: the Pallas Mosaic GPU attention (FlashAttention-3 style, Hopper only),
  ``jax.experimental.pallas.ops.gpu.attention_mgpu.attention`` with a ``TuningConfig``. It has no scale
  argument, so ``query`` is multiplied by the scale before timing; where it rejects bfloat16 it runs in
  float16 (noted in the results); its backward has no causal variant (recorded as an error);
- ``pallas_triton``: the Triton-based Pallas attention,
  ``jax.experimental.pallas.ops.gpu.attention.mha``.

The peers (fa3, tokamax, jla: ``peers``) are recorded as skipped, "unavailable: ...", where their
package is not installed or there is no CUDA GPU. Every provider takes ``(q, k, v)`` as ``[B, T, H, D]``,
``[B, S, Hkv, D]`` and ``[B, S, Hkv, Dv]`` (grouped KV passed with its fewer heads; ``Dv = D`` but on
MLA's rows), and on bias rows ``(q, k, v, bias)``
with ``bias`` ``[1, H, T, S]``, and is timed by the same harness in the same way. On rows with
``as_mask`` every provider that takes a mask (jax_tk, cuDNN, tokamax, XLA) gets the causal mask and
the documents as one dense boolean mask ``[B, 1, T, S]``, built inside the timed call
(``dense_mask``); the others are skipped there.

Value head dim unlike the query's (MLA's rows: query/key 192, value 128; the output ``[B, T, H, 128]``):

- ``jax_tk``, ``jax_tk_auto``: ``jax_tk.attention`` takes the value with its own head dim;
- ``cudnn``, ``xla``: ``jax.nn.dot_product_attention`` takes one head dim for key and value, so they
  get the value zero-padded to the key's head dim and their output cut back to the value's, inside the
  timed call: what a user of jax.nn does for MLA today;
- ``tokamax``: ``tokamax.dot_product_attention`` documents a value (and output) head dim of its own,
  and its Mosaic kernel sizes the value's and the output's tiles by it: it gets the value as it is;
- ``jla``: its own ``supported(q, k, v)`` gets the value's true shape and decides (the MLA issue says
  it takes 192/128; where it does not, the row is skipped with its reason);
- ``fa3``: ``flash_attn3_jax.flash_mha`` declares its output with the query's shape and its lowering
  asserts that key and value have one shape (0.2.x; its PyPI wheel has head dim 128 only besides):
  skipped, after asking the installed module (``jax.eval_shape``) what output shape it gives;
- ``pallas``, ``pallas_triton``, ``cudnn_packed``: skipped (one head dim for query, key and value; jax
  0.10's ``attention_mgpu`` checks the key's shape twice and never the value's, so it would not refuse
  such a value itself; ``cudnn_packed`` goes through jax.nn).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import peers
from benchmarks.attention_configs import AttentionConfig
from benchmarks.harness import Provider, Skip, factory, has_gpu, short_error

DEFAULT_PROVIDERS = ("jax_tk", "cudnn", "xla", "pallas")  # and the installed peers: default_providers()
PEERS = ("fa3", "tokamax", "jla")
FEATURE_PROVIDERS = ("jax_tk", "jax_tk_auto", "cudnn", "cudnn_packed", "xla")
MLA_PROVIDERS = ("jax_tk", "cudnn", "xla")  # and the installed peers: feature_providers(["mla"])
LOGITS = "T*S*B*H*4"  # what XLA and the reference materialize (Provider.scratch_what)


def default_providers() -> list[str]:
    """The plain sweep's providers: DEFAULT_PROVIDERS, and the peers that are installed."""
    return list(DEFAULT_PROVIDERS) + peers.installed_peers(PEERS)


def feature_providers(features) -> list[str]:
    """A feature run's providers: FEATURE_PROVIDERS; for MLA's rows alone MLA_PROVIDERS and the installed
    peers (the rows' ratio is against the fastest peer)."""
    if features and set(features) == {"mla"}:
        return list(MLA_PROVIDERS) + peers.installed_peers(PEERS)
    return list(FEATURE_PROVIDERS)


def _logits(p: Provider, cfg: AttentionConfig) -> Provider:
    return dataclasses.replace(p, scratch_bytes=cfg.logits_bytes(), scratch_what=LOGITS)


def _tk_mask_kwargs(cfg: AttentionConfig) -> dict:
    """jax_tk.attention's masking options for a configuration (segment ids as device constants; none
    on ``as_mask`` rows, whose masking is the dense mask), and its sinks."""
    kw = {}
    if cfg.window is not None:
        kw["local_window_size"] = cfg.window
    seg = cfg.segment_ids()
    if seg is not None and not cfg.as_mask:
        ids = jnp.asarray(seg)
        kw["q_segment_ids"] = kw["kv_segment_ids"] = ids
    if cfg.sinks:
        kw["sinks"] = jnp.asarray(cfg.sink_values())
    return kw


def dense_mask(cfg: AttentionConfig):
    """A function making the row's dense boolean mask ``[B, 1, T, S]`` inside the caller's program, as a
    user of ``mask=`` would: the documents' (same segment id, the ids a device constant) and, on
    ``as_mask`` rows, the causal mask too; None where the row has neither to give."""
    seg = cfg.segment_ids()
    causal = cfg.as_mask and cfg.causal
    if seg is None and not causal:
        return None
    ids = None if seg is None else jnp.asarray(seg)

    def make():
        m = jnp.ones((cfg.batch, 1, cfg.q_len, cfg.kv_len), bool)
        if ids is not None:
            m &= (ids[:, :, None] == ids[:, None, :])[:, None]
        if causal:
            m &= jnp.arange(cfg.q_len)[:, None] >= jnp.arange(cfg.kv_len)[None, :]
        return m

    return make


def _with_mask_and_bias(cfg: AttentionConfig, base, mask):
    """``base(q, k, v, bias=None, mask=None)`` as the provider's ``fn``: taking the bias on bias rows,
    making the mask in the call where ``mask`` (dense_mask) is given."""
    if cfg.bias:
        return (lambda q, k, v, bias: base(q, k, v, bias, mask())) if mask else base
    return (lambda q, k, v: base(q, k, v, None, mask())) if mask else base


def _jax_tk_provider(cfg: AttentionConfig, scale: float, auto: bool = False) -> Provider:
    """``jax_tk``: the kernel (implementation="tk"; an error where the kernel refuses the options).
    ``jax_tk_auto``: implementation=None (the kernel where it applies, the pure-JAX reference
    otherwise). Without a GPU both run implementation=None."""
    import jax_tk

    gpu = has_gpu()
    impl = "tk" if gpu and not auto else None
    name = "jax_tk_auto" if auto else "jax_tk"
    kw = _tk_mask_kwargs(cfg)
    causal = cfg.causal and not cfg.as_mask
    fn = _with_mask_and_bias(cfg, functools.partial(jax_tk.attention, scale=scale, is_causal=causal,
                                                    implementation=impl, **kw), dense_mask(cfg) if cfg.as_mask else None)
    if not gpu:
        return _logits(Provider(name, fn, scale, note="no GPU: implementation=None (pure-JAX reference)"),
                       cfg)
    if not auto:
        return Provider(name, fn, scale)
    # implementation=None: find out (at trace time, nothing runs) whether the kernel takes this call;
    # if not, this provider times the reference, which holds [B, H, T, S] float32 logits like XLA.
    probe = _with_mask_and_bias(cfg, functools.partial(jax_tk.attention, scale=scale, is_causal=causal,
                                                       implementation="tk", **kw), dense_mask(cfg) if cfg.as_mask else None)
    shapes = [jax.ShapeDtypeStruct(s, cfg.jnp_dtype) for s in (cfg.shape_q, cfg.shape_kv, cfg.shape_v)] + (
        [jax.ShapeDtypeStruct(cfg.bias_shape, cfg.jnp_dtype)] if cfg.bias else [])
    try:
        jax.eval_shape(probe, *shapes)
    except Exception as e:  # noqa: BLE001 - the kernel refused: the reference runs
        return _logits(Provider(name, fn, scale, note="implementation=None runs the pure-JAX reference "
                                f"(kernel: {short_error(e, 160)})"), cfg)
    return Provider(name, fn, scale, note="implementation=None (the kernel)")


def _jax_nn_style(name: str, attention, cfg: AttentionConfig, scale: float, **kw) -> Provider:
    """A provider calling ``attention(q, k, v, bias, mask, *, scale, is_causal, local_window_size, **kw)``
    with the arguments of ``jax.nn.dot_product_attention``: grouped KV by passing key/value with
    fewer heads, the window as ``local_window_size``. Having no segment-id arguments (its
    ``query_seq_lengths``/``key_value_seq_lengths`` only pad: one sequence per batch row), it gets
    packed documents as a dense boolean ``mask`` [B, 1, T, S], built in the timed call from the
    segment ids as a user of this API would (cuDNN turns it into an additive bias and computes every
    block, XLA applies it to its materialized logits)."""
    if cfg.window is not None:
        kw["local_window_size"] = cfg.window
    base = functools.partial(attention, scale=scale, is_causal=cfg.causal and not cfg.as_mask, **kw)
    mask = dense_mask(cfg)
    note = "documents as a dense [B,1,T,S] mask (no segment ids)" if mask and not cfg.as_mask else ""
    return Provider(name, _with_mask_and_bias(cfg, base, mask), scale, note=note)


def _padded_value(attention):
    """``attention`` (jax.nn's signature) given the value zero-padded to the key's head dim, its output
    cut back to the value's: what a user of jax.nn.dot_product_attention, which takes one head dim for
    key and value, does for MLA's (192, 128) today (the pad and the cut are inside the timed call)."""

    def fn(query, key, value, *args, **kw):
        d, dv = key.shape[-1], value.shape[-1]
        value = jnp.pad(value, [(0, 0)] * (value.ndim - 1) + [(0, d - dv)])
        return attention(query, key, value, *args, **kw)[..., :dv]

    return fn


def _jax_nn_provider(name: str, cfg: AttentionConfig, scale: float) -> Provider:
    """``jax.nn.dot_product_attention(implementation=name)`` (cudnn, xla); at unequal head dims (MLA),
    which jax.nn refuses, on the value zero-padded to the key's head dim (``_padded_value``)."""
    attention = _padded_value(jax.nn.dot_product_attention) if cfg.mla else jax.nn.dot_product_attention
    p = _jax_nn_style(name, attention, cfg, scale, implementation=name)
    if cfg.mla:
        note = f"value zero-padded to head dim {cfg.head_dim}, output cut to {cfg.v_head_dim} (jax.nn takes one head dim)"
        p = dataclasses.replace(p, note="; ".join(filter(None, [note, p.note])))
    return _logits(p, cfg) if name == "xla" else p


def _tokamax_provider(cfg: AttentionConfig, scale: float) -> Provider:
    tokamax, _ = peers.load("tokamax")
    p = _jax_nn_style("tokamax", tokamax.dot_product_attention, cfg, scale, implementation="mosaic")
    return dataclasses.replace(p, note="; ".join(filter(None, ['implementation="mosaic"', p.note])))


def padded_documents(lengths: np.ndarray, total: int, align: int = 128):
    """Index maps between a packed batch ``[B, total]`` of documents (``lengths`` ``[B, M]``) and a
    padded one ``[B*M, L]`` (L = the longest document rounded up to ``align``), both flattened:
    ``gather [B*M*L]``: the packed row of each padded row (0 past a document's end, see ``valid``);
    ``valid [B*M*L]``: whether a padded row holds a token; ``back [B*total]``: the padded row of each
    packed row."""
    b, m = lengths.shape
    longest = -(-int(lengths.max()) // align) * align
    starts = np.cumsum(lengths, axis=1) - lengths
    offset = np.arange(longest)[None, None, :]
    valid = offset < lengths[..., None]  # [B, M, L]
    gather = np.where(valid, np.arange(b)[:, None, None] * total + starts[..., None] + offset, 0)
    back = np.flatnonzero(valid)  # padded rows in order are the packed rows in order
    return gather.reshape(-1), valid.reshape(-1), back, longest


def _cudnn_packed_provider(cfg: AttentionConfig, scale: float, implementation: str = "cudnn") -> Provider:
    """cuDNN on packed documents through jax's public API: a padded batch with sequence lengths (see
    the module's docstring). The re-layout happens before timing (``prepare``); ``restore`` maps
    inputs, outputs and gradients back to the packed rows for the correctness check.
    (``implementation="xla"`` runs the same layout anywhere: the tests' CPU check of it.)"""
    if not cfg.documents:
        raise Skip("only for packed-document rows")
    lengths = cfg.document_lengths()
    gather, valid, back, longest = padded_documents(lengths, cfg.q_len)
    gather, valid, back = jnp.asarray(gather), jnp.asarray(valid), jnp.asarray(back)
    seq = jnp.asarray(lengths.reshape(-1), jnp.int32)

    @jax.jit
    def prepare(q, k, v, dout):
        def pad(x):  # [B, T, h, D] -> [B*M, L, h, D], zeros past each document's end
            rows = jnp.take(x.reshape(-1, *x.shape[2:]), gather, axis=0)
            return jnp.where(valid[:, None, None], rows, 0).reshape(-1, longest, *x.shape[2:])
        return pad(q), pad(k), pad(v), pad(dout)

    def restore(x):  # [B*M, L, h, D] -> [B, T, h, D]
        rows = jnp.take(x.reshape(-1, *x.shape[2:]), back, axis=0)
        return rows.reshape(cfg.batch, cfg.q_len, *x.shape[2:])

    def fn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=cfg.causal, query_seq_lengths=seq,
                                            key_value_seq_lengths=seq, implementation=implementation)

    return Provider("cudnn_packed", fn, scale, prepare=prepare, restore=restore,
                    note=f"padded batch of {lengths.size} documents x {longest} rows with query/key_value_seq_lengths")


def _fa3_provider(cfg: AttentionConfig, scale: float) -> Provider:
    """FlashAttention-3 (``flash-attn3-jax``): ``flash_mha(q, k, v, softmax_scale, is_causal,
    window_size)`` on ``[B, T, H, D]`` (grouped KV when key/value have fewer heads; the window as
    ``(left, right)``, -1 = unbounded), its own custom_vjp for the backward. Packed documents go
    through ``flash_mha_varlen`` on the rows flattened to ``[B*T, H, D]`` with ``cu_seqlens`` = the
    documents' offsets (FA3's ragged layout, which skips the blocks between documents)."""
    fa3 = peers.fa3(cfg)
    kw = dict(softmax_scale=float(scale), is_causal=cfg.causal,
              window_size=(-1, -1) if cfg.window is None else tuple(cfg.window))
    if cfg.mla:
        _fa3_check_unequal_dims(fa3, cfg, kw)
    if not cfg.documents:
        return Provider("fa3", functools.partial(fa3.flash_mha, **kw), scale, note="flash_attn3_jax.flash_mha")
    lengths = cfg.document_lengths()
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths.reshape(-1))]), jnp.int32)
    longest = int(lengths.max())

    def fn(q, k, v):
        b, t, h, d = q.shape
        flat = lambda x: x.reshape(b * t, x.shape[2], d)  # free: contiguous
        out = fa3.flash_mha_varlen(flat(q), flat(k), flat(v), cu, cu, max_seqlen_q=longest,
                                   max_seqlen_k=longest, **kw)
        return out.reshape(b, t, h, d)

    return Provider("fa3", fn, scale, note="flash_attn3_jax.flash_mha_varlen (cu_seqlens = documents)")


def _fa3_check_unequal_dims(fa3, cfg: AttentionConfig, kw: dict) -> None:
    """Skip unless the installed ``flash_mha`` gives the output the value's head dim (0.2.x declares it
    with the query's shape, and its lowering asserts that key and value have one shape)."""
    if cfg.documents:
        raise Skip("unequal head dims: flash_mha_varlen not tried")
    spec = lambda shape: jax.ShapeDtypeStruct(shape, cfg.jnp_dtype)
    try:
        out = jax.eval_shape(functools.partial(fa3.flash_mha, **kw), spec(cfg.shape_q), spec(cfg.shape_kv),
                             spec(cfg.shape_v))
    except Exception as e:  # noqa: BLE001 - it refuses the shapes
        raise Skip(f"flash_mha refuses value head dim {cfg.v_head_dim} with {cfg.head_dim}: "
                   f"{short_error(e, 160)}") from None
    if tuple(out.shape) != cfg.shape_out:
        raise Skip(f"flash_attn3_jax.flash_mha gives its output the query's shape {tuple(out.shape)}, not "
                   f"{cfg.shape_out} (key and value of one shape only)")


def _jla_provider(cfg: AttentionConfig, scale: float) -> Provider:
    """jax-linear-attention's ``flash_attention(q, k, v, *, segment_ids, sliding_window, scale)``:
    causal grouped-query attention on ``[B, T, H, D]`` with keys as long as the queries; skipped
    elsewhere, and where its own ``supported(q, k, v)`` gives a reason (head dims, dtypes, GPU)."""
    attention, _ = peers.load("jla", "jla.ops.mosaic_gpu.attention")
    if not cfg.causal:
        raise Skip("causal attention only")
    if cfg.q_len != cfg.kv_len:
        raise Skip("keys as long as the queries only")
    spec = lambda shape: jax.ShapeDtypeStruct(shape, cfg.jnp_dtype)
    reason = attention.supported(spec(cfg.shape_q), spec(cfg.shape_kv), spec(cfg.shape_v))
    if reason is not None:
        raise Skip(reason)
    kw = dict(scale=float(scale))
    if cfg.window is not None:
        kw["sliding_window"] = cfg.window[0] + 1  # keys i - left .. i: left + 1 of them (causal)
    seg = cfg.segment_ids()
    if seg is not None:
        kw["segment_ids"] = jnp.asarray(seg)
    return Provider("jla", functools.partial(attention.flash_attention, **kw), scale,
                    note="jla.ops.mosaic_gpu.attention.flash_attention")


def _pallas_mgpu_provider(cfg: AttentionConfig, scale: float, dtype=None, why: str = "") -> Provider:
    from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu

    d = cfg.head_dim
    # Forward blocks as JAX's own attention_mgpu benchmark picks them: block_q=64 and the largest
    # block_kv whose buffers fit in shared memory; backward blocks as its tests use them.
    smem = lambda bkv: 2 * 64 * d * 2 + 2 * 2 * bkv * d * 2  # q/o for 2 warpgroups, 2 stages of k, v
    block_kv = next((b for b in (256, 128, 64) if smem(b) <= 227 * 1024 and cfg.kv_len % b == 0), 64)
    config = mgpu.TuningConfig(
        block_q=64, block_kv=block_kv, max_concurrent_steps=2, causal=cfg.causal,
        compute_wgs_bwd=2 if d <= 128 else 1,
        block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64,
    )
    fn = functools.partial(mgpu.attention, config=config)

    def prepare(q, k, v, do):
        if dtype is not None:
            q, k, v, do = (x.astype(dtype) for x in (q, k, v, do))
        # The kernel applies no softmax scale: fold it into q, outside the timed region.
        return (q * jnp.asarray(scale, q.dtype)).astype(q.dtype), k, v, do

    fallback = None
    note = f"attention_mgpu block_q=64 block_kv={block_kv}"
    if dtype is None and cfg.jnp_dtype != jnp.float16:
        fallback = lambda why: _pallas_mgpu_provider(cfg, scale, jnp.float16, why)
    if dtype is not None:
        note += f"; ran in {jnp.dtype(dtype).name}, {cfg.dtype} failed: {why}"
    return Provider("pallas", fn, 1.0, prepare=prepare, fallback=fallback, note=note)


def _pallas_triton_provider(cfg: AttentionConfig, scale: float) -> Provider:
    from jax.experimental.pallas.ops.gpu import attention as triton_attention

    def fn(q, k, v):
        return triton_attention.mha(q, k, v, None, sm_scale=scale, causal=cfg.causal)

    return Provider("pallas_triton", fn, scale, note="pallas.ops.gpu.attention.mha, default blocks")


FACTORIES = {
    "jax_tk": _jax_tk_provider,
    "jax_tk_auto": functools.partial(_jax_tk_provider, auto=True),
    "cudnn": functools.partial(_jax_nn_provider, "cudnn"),
    "cudnn_packed": _cudnn_packed_provider,
    "fa3": _fa3_provider,
    "tokamax": _tokamax_provider,
    "jla": _jla_provider,
    "xla": functools.partial(_jax_nn_provider, "xla"),
    "pallas": _pallas_mgpu_provider,
    "pallas_triton": _pallas_triton_provider,
}
PROVIDERS = tuple(FACTORIES)

# What each provider has no option for: its rows are skipped (the rest of a provider's limits are
# checked where it is built).
NO_WINDOW = ("pallas", "pallas_triton", "cudnn_packed")
NO_DOCUMENTS = ("pallas", "pallas_triton")
NO_MASK_OR_BIAS = ("pallas", "pallas_triton", "cudnn_packed", "fa3", "jla")
NO_UNEQUAL_HEAD_DIMS = ("pallas", "pallas_triton", "cudnn_packed")


def make_provider(name: str, cfg: AttentionConfig) -> Provider:
    make = factory(FACTORIES, name)
    if name in NO_WINDOW and cfg.window is not None:
        raise Skip("no sliding-window option")
    if name in NO_DOCUMENTS and cfg.documents:
        raise Skip("no segment-id option")
    if name in NO_MASK_OR_BIAS and (cfg.as_mask or cfg.bias):
        raise Skip("no mask option" if cfg.as_mask else "no bias option")
    if cfg.sinks and not name.startswith("jax_tk"):
        raise Skip("no sinks option")
    if cfg.mla and name in NO_UNEQUAL_HEAD_DIMS:
        raise Skip(f"one head dim for query, key and value (value head dim {cfg.v_head_dim} with {cfg.head_dim})")
    return make(cfg, 1.0 / math.sqrt(cfg.head_dim))
