"""Attention providers: jax_tk and its peers, each as a ``harness.Provider`` for one configuration.

- ``jax_tk``: ``jax_tk.attention(implementation="tk")`` (``implementation=None``, i.e. the pure-JAX
  reference, when no CUDA device is present, so that the benchmark also runs on CPU);
- ``jax_tk_auto``: ``jax_tk.attention(implementation=None)``: the kernel where it takes the call, the
  pure-JAX reference otherwise (said in the note; the ``--xla-max-gb`` limit then applies to it);
- ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``;
- ``cudnn_packed``: cuDNN's packed-sequence attention for the packed-document rows only, through the
  private ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`` (``q_offsets``,
  ``q_seqlen``): ``jax.nn.dot_product_attention`` has no segment ids, and its ``mask`` argument
  becomes a dense bias for cuDNN (every block computed);
- ``fa3``: FlashAttention-3 through the ``flash-attn3-jax`` wheel (``flash_attn3_jax.flash_mha``;
  packed documents through ``flash_mha_varlen``), Hopper only, head_dim 128 only in the PyPI wheel
  (``JAX_TK_FA3_HEAD_DIMS=64,128,256`` for a build from source with more), bf16/fp16. Install::

      pip install flash-attn3-jax        # Linux x86_64, CPython 3.11/3.12, CUDA >= 12.3, jax >= 0.6
      # offline: pip install --no-deps flash_attn3_jax-0.2.3-cp312-cp312-manylinux_2_28_x86_64.whl \\
      #          einops-0.8.2-py3-none-any.whl

  Without the package (or without a CUDA GPU) it is recorded as skipped, "unavailable: ...";
- ``xla``: ``jax.nn.dot_product_attention(implementation="xla")``; skipped where its ``[B, H, T, S]``
  float32 logits (``T*S*B*H*4`` bytes) would exceed ``--xla-max-gb``;
- ``pallas``: the Pallas Mosaic GPU attention (FlashAttention-3 style, Hopper only),
  ``jax.experimental.pallas.ops.gpu.attention_mgpu.attention`` with a ``TuningConfig``. It has no scale
  argument, so ``query`` is multiplied by the scale before timing; where it rejects bfloat16 it runs in
  float16 (noted in the results); its backward has no causal variant (recorded as an error);
- ``pallas_triton``: the Triton-based Pallas attention,
  ``jax.experimental.pallas.ops.gpu.attention.mha``.

Every provider takes ``(q, k, v)`` as ``[B, T, H, D]`` and ``[B, S, Hkv, D]`` (grouped KV passed with
its fewer heads), and on bias rows ``(q, k, v, bias)`` with ``bias`` ``[1, H, T, S]``, and is timed by
the same harness in the same way. On rows with ``as_mask`` every provider that takes a mask (jax_tk,
cuDNN, XLA) gets the causal mask and the documents as one dense boolean mask ``[B, 1, T, S]``, built
inside the timed call (``dense_mask``); the others are skipped there.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_tk.bench.attention_configs import AttentionConfig
from jax_tk.bench.harness import Provider, Skip, Unavailable, cuda_capability, has_gpu, short_error

PROVIDERS = ("jax_tk", "jax_tk_auto", "cudnn", "cudnn_packed", "fa3", "xla", "pallas", "pallas_triton")
DEFAULT_PROVIDERS = ("jax_tk", "cudnn", "xla", "pallas")  # and fa3 where installed: default_providers()
FEATURE_PROVIDERS = ("jax_tk", "jax_tk_auto", "cudnn", "cudnn_packed", "xla")
LOGITS = "T*S*B*H*4"  # what XLA and the reference materialize (Provider.scratch_what)


def fa3_installed() -> bool:
    """Whether ``flash_attn3_jax`` can be found (without importing it: its library is 110 MB)."""
    try:
        return importlib.util.find_spec("flash_attn3_jax") is not None
    except (ImportError, ValueError):
        return False


def default_providers() -> list[str]:
    """The plain sweep's providers: DEFAULT_PROVIDERS, and ``fa3`` where flash_attn3_jax is installed."""
    return list(DEFAULT_PROVIDERS) + (["fa3"] if fa3_installed() else [])


def _logits(p: Provider, cfg: AttentionConfig) -> Provider:
    return dataclasses.replace(p, scratch_bytes=cfg.logits_bytes(), scratch_what=LOGITS)


def _tk_mask_kwargs(cfg: AttentionConfig) -> dict:
    """jax_tk.attention's masking options for a configuration (segment ids as device constants; none
    on ``as_mask`` rows, whose masking is the dense mask)."""
    kw = {}
    if cfg.window is not None:
        kw["local_window_size"] = cfg.window
    seg = cfg.segment_ids()
    if seg is not None and not cfg.as_mask:
        ids = jnp.asarray(seg)
        kw["q_segment_ids"] = kw["kv_segment_ids"] = ids
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
    shapes = [jax.ShapeDtypeStruct(cfg.shape_q, cfg.jnp_dtype)] + 2 * [
        jax.ShapeDtypeStruct(cfg.shape_kv, cfg.jnp_dtype)] + ([jax.ShapeDtypeStruct(cfg.bias_shape, cfg.jnp_dtype)]
                                                             if cfg.bias else [])
    try:
        jax.eval_shape(probe, *shapes)
    except Exception as e:  # noqa: BLE001 - the kernel refused: the reference runs
        return _logits(Provider(name, fn, scale, note="implementation=None runs the pure-JAX reference "
                                f"(kernel: {short_error(e, 160)})"), cfg)
    return Provider(name, fn, scale, note="implementation=None (the kernel)")


def _jax_nn_provider(name: str, cfg: AttentionConfig, scale: float) -> Provider:
    """``jax.nn.dot_product_attention(implementation=name)``: grouped KV by passing key/value with
    fewer heads, the window as ``local_window_size``. It has no segment-id arguments (its
    ``query_seq_lengths``/``key_value_seq_lengths`` only pad: one sequence per batch row), so packed
    documents go in as a dense boolean ``mask`` [B, 1, T, S], built in the timed call from the
    segment ids as a user of this API would; cuDNN turns it into an additive bias and computes every
    block (no skipping), XLA applies it to its materialized logits."""
    kw = {}
    if cfg.window is not None:
        kw["local_window_size"] = cfg.window
    base = functools.partial(jax.nn.dot_product_attention, scale=scale, is_causal=cfg.causal and not cfg.as_mask,
                             implementation=name, **kw)
    mask = dense_mask(cfg)
    note = "documents as a dense [B,1,T,S] mask (jax.nn has no segment ids)" if mask and not cfg.as_mask else ""
    return Provider(name, _with_mask_and_bias(cfg, base, mask), scale, note=note)


def _cudnn_packed_provider(cfg: AttentionConfig, scale: float, padding: bool = False, why: str = "") -> Provider:
    """cuDNN's packed-sequence (ragged, "THD") attention, which skips the blocks between documents.
    jax.nn.dot_product_attention does not expose it (jax 0.10.x): it is reached through the private
    ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`` with per-document lengths
    ``q_seqlen``/``kv_seqlen`` [B, M] and start offsets ``q_offsets``/``kv_offsets`` [B, M + 1]
    (-1 padded), as JAX's own test of it does (test_sdpa_packed_layout: NO_MASK). Mask type
    NO_MASK / CAUSAL first; if every mode fails, PADDING / PADDING_CAUSAL (what jax.nn uses with
    sequence lengths). Needs Hopper or later and cuDNN >= 9.6. Packed-document rows only."""
    if not cfg.documents:
        raise Skip("only for packed-document rows")
    from jax._src.cudnn import fused_attention_stablehlo as fa  # private API

    lengths = cfg.document_lengths()
    b = lengths.shape[0]
    starts = np.concatenate([np.zeros((b, 1), np.int64), np.cumsum(lengths, axis=1)[:, :-1]], axis=1)
    seqlen = jnp.asarray(lengths, jnp.int32)
    offsets = jnp.asarray(np.concatenate([starts, -np.ones((b, 1), np.int64)], axis=1), jnp.int32)
    if padding:
        mask_type = fa.MaskType.PADDING_CAUSAL if cfg.causal else fa.MaskType.PADDING
    else:
        mask_type = fa.MaskType.CAUSAL if cfg.causal else fa.MaskType.NO_MASK

    def fn(q, k, v):
        return fa.dot_product_attention(q, k, v, None, None, seqlen, seqlen, offsets, offsets,
                                        scale=scale, mask_type=mask_type)

    note = f"private jax._src.cudnn API, packed layout (q/kv_offsets), mask_type={mask_type.name}"
    if padding:
        note += f"; the non-padding mask type failed: {why}"
    fallback = None if padding else (lambda why: _cudnn_packed_provider(cfg, scale, True, why))
    return Provider("cudnn_packed", fn, scale, note=note, fallback=fallback)


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


FA3_HEAD_DIMS = (128,)  # what the PyPI wheel of flash-attn3-jax compiles (0.2.3: hdim128 only)


def fa3_head_dims() -> tuple[int, ...]:
    """Head dims the installed FlashAttention-3 supports: FA3_HEAD_DIMS, or JAX_TK_FA3_HEAD_DIMS
    (comma-separated) for a build from source with more."""
    env = os.environ.get("JAX_TK_FA3_HEAD_DIMS", "")
    return tuple(int(x) for x in env.replace(" ", ",").split(",") if x) or FA3_HEAD_DIMS


def import_fa3(cfg, cc):
    """The ``flash_attn3_jax`` module for a configuration (its ``head_dim``, ``dtype``, ``jnp_dtype``) on a
    GPU of compute capability ``cc`` (``cuda_capability()``); Unavailable without the package or a CUDA
    GPU, Skip off Hopper and for head dims and dtypes the build does not take."""
    try:
        import flash_attn3_jax as fa3
    except Exception as e:  # noqa: BLE001 - ImportError, or its CUDA library does not load
        raise Unavailable(f"flash_attn3_jax does not import (pip install flash-attn3-jax): "
                          f"{short_error(e, 160)}") from None
    if cc is None:
        raise Unavailable("flash_attn3_jax needs a CUDA GPU (Hopper)")
    if cc and not cc.startswith("9"):
        raise Skip(f"FlashAttention-3's kernels are built for sm90 (Hopper), this GPU is sm{cc}")
    if cfg.head_dim not in fa3_head_dims():
        raise Skip(f"head_dim {cfg.head_dim}: the flash_attn3_jax build has {fa3_head_dims()} "
                   "(JAX_TK_FA3_HEAD_DIMS for a source build)")
    if cfg.jnp_dtype not in (jnp.bfloat16, jnp.float16):
        raise Skip(f"dtype {cfg.dtype}: FlashAttention-3 takes bf16 or fp16")
    return fa3


def _fa3_provider(cfg: AttentionConfig, scale: float) -> Provider:
    """FlashAttention-3 (``flash-attn3-jax``): ``flash_mha(q, k, v, softmax_scale, is_causal,
    window_size)`` on ``[B, T, H, D]`` (grouped KV when key/value have fewer heads; the window as
    ``(left, right)``, -1 = unbounded), its own custom_vjp for the backward. Packed documents go
    through ``flash_mha_varlen`` on the rows flattened to ``[B*T, H, D]`` with ``cu_seqlens`` = the
    documents' offsets (FA3's ragged layout, which skips the blocks between documents). Unavailable
    without the package or a CUDA GPU; skipped off Hopper, for head dims it was not built for and
    dtypes other than bf16/fp16."""
    fa3 = import_fa3(cfg, cuda_capability())
    kw = dict(softmax_scale=float(scale), is_causal=cfg.causal,
              window_size=(-1, -1) if cfg.window is None else tuple(cfg.window))
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


def make_provider(name: str, cfg: AttentionConfig) -> Provider:
    scale = 1.0 / math.sqrt(cfg.head_dim)
    if name in ("pallas", "pallas_triton", "cudnn_packed") and cfg.window is not None:
        raise Skip("no sliding-window option")
    if name in ("pallas", "pallas_triton") and cfg.documents:
        raise Skip("no segment-id option")
    if name in ("pallas", "pallas_triton", "cudnn_packed", "fa3") and (cfg.as_mask or cfg.bias):
        raise Skip("no mask option" if cfg.as_mask else "no bias option")
    if name == "jax_tk":
        return _jax_tk_provider(cfg, scale)
    if name == "jax_tk_auto":
        return _jax_tk_provider(cfg, scale, auto=True)
    if name == "cudnn":
        return _jax_nn_provider(name, cfg, scale)
    if name == "xla":
        return _logits(_jax_nn_provider(name, cfg, scale), cfg)
    if name == "cudnn_packed":
        return _cudnn_packed_provider(cfg, scale)
    if name == "fa3":
        return _fa3_provider(cfg, scale)
    if name == "pallas":
        return _pallas_mgpu_provider(cfg, scale)
    if name == "pallas_triton":
        return _pallas_triton_provider(cfg, scale)
    raise ValueError(f"unknown provider {name!r}; choose from {PROVIDERS}")


