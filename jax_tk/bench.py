"""Benchmarks: jax_tk against its peers, in one process, with one timer.

Command line::

    python -m jax_tk.bench attention                      # the default sweep
    python -m jax_tk.bench attention --quick              # a tiny sweep (seconds, CPU too)
    python -m jax_tk.bench attention --d 128 --seq 4096,8192 --causal true --providers jax_tk,cudnn
    python -m jax_tk.bench attention --features             # only the feature rows (see below)
    python -m jax_tk.bench attention --features window --quick

Providers (``--providers``):

- ``jax_tk``: ``jax_tk.attention(implementation="tk")`` (``implementation=None``, i.e. the pure-JAX
  reference, when no CUDA device is present, so that the benchmark also runs on CPU);
- ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``;
- ``xla``: ``jax.nn.dot_product_attention(implementation="xla")``; skipped where its ``[B, H, T, S]``
  float32 logits (``T*S*B*H*4`` bytes) would exceed ``--xla-max-gb``;
- ``pallas``: the Pallas Mosaic GPU attention (FlashAttention-3 style, Hopper only),
  ``jax.experimental.pallas.ops.gpu.attention_mgpu.attention`` with a ``TuningConfig``. It has no scale
  argument, so ``query`` is multiplied by the scale before timing; where it rejects bfloat16 it runs in
  float16 (noted in the results); its backward has no causal variant (recorded as an error);
- ``pallas_triton``: the Triton-based Pallas attention,
  ``jax.experimental.pallas.ops.gpu.attention.mha``.

- ``jax_tk_auto``: ``jax_tk.attention(implementation=None)``: the kernel where it takes the call, the
  pure-JAX reference otherwise (said in the note; the ``--xla-max-gb`` limit then applies to it);
- ``cudnn_packed``: cuDNN's packed-sequence attention for the packed-document rows only, through the
  private ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`` (``q_offsets``,
  ``q_seqlen``): ``jax.nn.dot_product_attention`` has no segment ids, and its ``mask`` argument
  becomes a dense bias for cuDNN (every block computed).

A provider that fails for a configuration gets its error recorded and the sweep goes on; one that
does not apply to it (``cudnn_packed`` without documents, Pallas with a window) is recorded as
skipped.

Feature rows (``--features [gqa,window,documents]``, issue #4). They replace the sweep in that run;
they are not part of the default run (14 configurations x 5 providers at 16k tokens: compiling and
autotuning alone take minutes). bf16, D = 128, B*T = 16k tokens:

- ``gqa``: 32 query heads, 8 key/value heads, T = S in 4k (B = 4) and 16k (B = 1), causal and not;
  key/value are passed with 8 heads to every provider.
- ``window``: causal with ``local_window_size=(4096, 0)``, T = 16k, B = 1, H = 16 (cuDNN:
  ``jax.nn.dot_product_attention`` maps it to its sliding window of 4097 keys).
- ``documents``: 8 documents of random lengths (numpy, seed 0) packed in one row of 16k,
  ``q_segment_ids = kv_segment_ids``, B = 1, H = 16, causal and not. jax_tk takes the segment ids;
  ``cudnn`` and ``xla`` get the equivalent dense ``mask``; ``cudnn_packed`` the document offsets.

FLOPs of these rows count only the visible (query, key) pairs of the mask ("useful FLOPs"): forward
``4*B*H*D*visible``, backward 2.5x; ``visible`` is counted on the host in O(T) per document
(``visible_pairs``). Each feature row follows a ``plain`` row: plain attention with the same batch,
heads, head_dim and causal flag and q_len = kv_len (a multiple of 128) chosen so that its useful FLOPs
are closest to the feature row's (within about 2%; for ``gqa`` the same shape with 32 key/value heads).
The table and the CSV column ``vs_plain`` give each feature row's TFLOP/s as a fraction of the same
provider's on its plain row (``cudnn_packed`` against ``cudnn``'s); the issue's target for jax_tk is
>= 90%. The feature PNG shows TFLOP/s bars with the plain rows as black marks.

What is timed (``--modes``):

- ``fwd``: the forward pass, ``out = f(q, k, v)``; FLOPs ``4*B*H*T*S*D``, halved when causal.
- ``bwd``: the backward pass alone, as FlashAttention's and cuDNN's benchmarks report it: the forward
  runs once, untimed, through ``jax.vjp``; the timed program is the jitted VJP function applied to
  the output cotangent (it reads the saved residuals and writes dq, dk, dv). FLOPs 2.5x forward.
- ``fwd_bwd`` (optional): forward and backward in one jitted program, ``jax.vjp(f, q, k, v)[1](do)``;
  FLOPs 3.5x forward. Its time is close to fwd + bwd; it is a consistency check.

The timer (``--timer``):

- ``wall`` (default): each measured sample enqueues a batch of calls of the jitted function (JAX
  dispatches asynchronously, so the device queue stays full) and waits for all their results with
  ``jax.block_until_ready``; the sample is the elapsed host time over the number of calls. The batch
  is sized to last >= 20 ms so the one launch latency per sample is negligible. Warm-up (compilation,
  autotuning, and 200 ms of calls) first, then ``--reps`` (>= 20) samples; the median is reported,
  with min and max. Inputs rotate over several copies whose total size exceeds the L2 cache many
  times. The fraction of each sample that the host spent enqueueing is recorded (``host_frac``); near
  1.0 would mean the host, not the device, set the pace (it is flagged).
- ``cupti``: the summed kernel durations that CUPTI records, through
  ``jax.experimental.mosaic.gpu.profiler.measure`` (the tool JAX's own Pallas GPU benchmarks use);
  GPU only, experimental API; it leaves out the gaps between calls and between kernels.

Both report sustained throughput: after the warm-up the GPU runs at the clock its power limit allows
under back-to-back work. On an H200 (2026-11, jax 0.11.2), cuDNN's bf16 forward at T=8k, D=128 ran
1.59 ms per call at the 1980 MHz boost clock and 1.81 ms once the 690 W power cap had brought the
clock to about 1680 MHz (CUPTI, 60 back-to-back calls); ``wall`` gave 1.82 to 1.87 ms. Numbers from
single isolated calls are therefore 10-15% higher in TFLOP/s than these, for every provider alike.

Results: a table on stdout (time in ms and TFLOP/s per provider, and jax_tk's speed-up over cuDNN),
a CSV (one row per configuration x provider x mode, every row carrying date, GPU, jax/jaxlib versions
and the git commit; feature rows also ``feature``, ``kv_heads``, ``window``, ``documents``,
``doc_seed`` and ``vs_plain``) written as the sweep goes, and a PNG (TFLOP/s against sequence length,
one panel per head_dim x causal x mode; for feature rows, bars per row and provider). A feature run
writes ``attention_features.csv``/``.png`` by default, so it does not overwrite a sweep's files.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import functools
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

PROVIDERS = ("jax_tk", "jax_tk_auto", "cudnn", "cudnn_packed", "xla", "pallas", "pallas_triton")
DEFAULT_PROVIDERS = ("jax_tk", "cudnn", "xla", "pallas")
FEATURE_PROVIDERS = ("jax_tk", "jax_tk_auto", "cudnn", "cudnn_packed", "xla")
FEATURES = ("gqa", "window", "documents")
MODES = ("fwd", "bwd", "fwd_bwd")
DEFAULT_MODES = ("fwd", "bwd")
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
DTYPES = {"bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16, "fp16": jnp.float16, "float16": jnp.float16}

DEFAULT_HEAD_DIMS = (64, 128)
DEFAULT_SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_TOKENS = 16384  # batch * seq_len
DEFAULT_HIDDEN = 2048  # heads * head_dim

QUICK_HEAD_DIMS = (64,)
QUICK_SEQ_LENS = (128, 256)
QUICK_TOKENS = 512
QUICK_HIDDEN = 128

MIN_REPS = 20
# Inputs rotate over copies until this many bytes are touched: several times the L2 of any current
# GPU (50 MB on an H100/H200), so no timed call finds its inputs in cache from the previous call.
WORKING_SET_BYTES = 256 * 2**20
MAX_COPIES = 16
# At most this many bytes of outputs are kept alive by one batch of calls.
BATCH_OUTPUT_BYTES = 4 * 2**30
MAX_CALLS_PER_SAMPLE = 1000

CSV_FIELDS = (
    "date", "gpu", "platform", "jax", "jaxlib", "jax_tk", "commit", "timer",
    "dtype", "batch", "q_len", "kv_len", "heads", "head_dim", "causal",
    "feature", "kv_heads", "window", "documents", "doc_seed",
    "provider", "mode", "status", "time_ms", "min_ms", "max_ms", "tflops", "flops", "vs_plain",
    "reps", "calls_per_sample", "copies", "host_frac", "rel_err", "note",
)


# ----------------------------------------------------------------------------------------------
# FLOPs
# ----------------------------------------------------------------------------------------------


def attention_flops(batch: int, q_len: int, kv_len: int, heads: int, head_dim: int,
                    causal: bool, mode: str = "fwd") -> float:
    """FLOPs of attention counted the standard way (FlashAttention's benchmarks).

    Forward: two matrix products of ``2*T*S*D`` each per (batch, head), ``4*B*H*T*S*D``, halved when
    causal; backward 2.5x the forward (five matrix products against two); forward+backward 3.5x.
    """
    if mode not in MODE_FLOP_FACTOR:
        raise ValueError(f"mode must be one of {tuple(MODE_FLOP_FACTOR)}, got {mode!r}")
    fwd = 4.0 * batch * heads * q_len * kv_len * head_dim
    if causal:
        fwd /= 2.0
    return fwd * MODE_FLOP_FACTOR[mode]


def visible_pairs(q_len: int, kv_len: int, *, causal: bool = False, window=None,
                  q_segment_ids=None, kv_segment_ids=None, query_seq_lengths=None,
                  key_value_seq_lengths=None, batch: int = 1) -> int:
    """The number of (query, key) pairs that a mask leaves visible, summed over the batch.

    Same rules as ``jax_tk.attention`` (all must hold): causal ``j <= i`` (top-left aligned), window
    ``(left, right)``: ``i - left <= j <= i + right``, same segment id, ``i < query length``,
    ``j < key length``. Computed per query row as an interval of keys, so O(q_len + kv_len) per batch
    row, times the number of segments where segment ids are given (never a q_len x kv_len matrix).
    ``batch`` is used when no per-batch array (segment ids, lengths) gives it.
    """
    arrays = [x for x in (q_segment_ids, kv_segment_ids, query_seq_lengths, key_value_seq_lengths)
              if x is not None]
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("give both q_segment_ids and kv_segment_ids, or neither")
    if arrays:
        batch = int(np.shape(arrays[0])[0])
    i = np.arange(q_len, dtype=np.int64)
    lo = np.zeros(q_len, np.int64)
    hi = np.full(q_len, kv_len - 1, np.int64)
    if causal:
        hi = np.minimum(hi, i)
    if window is not None:
        left, right = (window, window) if isinstance(window, (int, np.integer)) else window
        lo = np.maximum(lo, i - int(left))
        hi = np.minimum(hi, i + int(right))
    total = 0
    for b in range(batch):
        lo_b, hi_b = lo, hi
        if key_value_seq_lengths is not None:
            hi_b = np.minimum(hi_b, int(np.asarray(key_value_seq_lengths)[b]) - 1)
        rows = np.ones(q_len, bool)
        if query_seq_lengths is not None:
            rows = i < int(np.asarray(query_seq_lengths)[b])
        hi_b = np.where(rows, hi_b, -1)
        lo_c = np.clip(lo_b, 0, kv_len)
        hi_c = np.clip(hi_b, -1, kv_len - 1)
        if q_segment_ids is None:
            total += int(np.maximum(hi_c - lo_c + 1, 0).sum())
            continue
        q_ids = np.asarray(q_segment_ids)[b]
        kv_ids = np.asarray(kv_segment_ids)[b]
        for g in np.unique(q_ids):
            # prefix[j] = keys of segment g among the first j keys.
            prefix = np.concatenate([[0], np.cumsum(kv_ids == g, dtype=np.int64)])
            sel = q_ids == g
            a, z = lo_c[sel], hi_c[sel]
            total += int(np.where(z >= a, prefix[z + 1] - prefix[a], 0).sum())
    return total


def document_lengths(total: int, documents: int, seed: int = 0, batch: int = 1) -> np.ndarray:
    """[batch, documents] random lengths (each >= 1) that add up to ``total`` in every batch row:
    ``documents - 1`` distinct cut points drawn uniformly from 1..total-1 (numpy, fixed seed)."""
    if not 1 <= documents <= total:
        raise ValueError(f"need 1 <= documents <= total, got documents={documents}, total={total}")
    rng = np.random.default_rng(seed)
    out = np.empty((batch, documents), np.int64)
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, total), documents - 1, replace=False))
        out[b] = np.diff(np.concatenate([[0], cuts, [total]]))
    return out


def segment_ids_from_lengths(lengths: np.ndarray) -> np.ndarray:
    """[batch, total] int32 segment ids (0, 1, ...) from [batch, documents] lengths."""
    lengths = np.asarray(lengths)
    return np.stack([np.repeat(np.arange(len(row), dtype=np.int32), row) for row in lengths])


# ----------------------------------------------------------------------------------------------
# Configurations and results
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """One benchmarked problem. The plain sweep leaves ``feature`` empty (FLOPs counted the standard
    way); feature rows (``feature`` in FEATURES, and ``"plain"`` for their baselines) count only the
    visible (query, key) pairs of their mask ("useful FLOPs")."""

    batch: int
    q_len: int
    kv_len: int
    heads: int
    head_dim: int
    causal: bool
    dtype: str = "bf16"
    feature: str = ""
    kv_heads: int | None = None  # None: = heads (normalized on construction)
    window: tuple[int, int] | None = None  # local_window_size (left, right)
    documents: int = 0  # > 0: packed documents of random lengths (q_segment_ids = kv_segment_ids)
    doc_seed: int = 0

    def __post_init__(self):
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.window is not None:
            object.__setattr__(self, "window", (int(self.window[0]), int(self.window[1])))
        if self.documents and self.q_len != self.kv_len:
            raise ValueError("packed documents need q_len == kv_len")

    @property
    def shape_q(self):
        return (self.batch, self.q_len, self.heads, self.head_dim)

    @property
    def shape_kv(self):
        return (self.batch, self.kv_len, self.kv_heads, self.head_dim)

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    @property
    def useful(self) -> bool:
        """FLOPs count only visible pairs (feature rows and their plain baselines)."""
        return bool(self.feature)

    def document_lengths(self) -> np.ndarray | None:
        if not self.documents:
            return None
        return _document_lengths_cached(self.q_len, self.documents, self.doc_seed, self.batch)

    def segment_ids(self) -> np.ndarray | None:
        """[batch, q_len] int32 segment ids (the same for queries and keys), or None."""
        lengths = self.document_lengths()
        return None if lengths is None else segment_ids_from_lengths(lengths)

    def visible(self) -> int:
        """Visible (query, key) pairs per head, summed over the batch."""
        return _visible_cached(self)

    def flops(self, mode: str) -> float:
        if not self.useful:
            return attention_flops(self.batch, self.q_len, self.kv_len, self.heads, self.head_dim,
                                   self.causal, mode)
        if mode not in MODE_FLOP_FACTOR:
            raise ValueError(f"mode must be one of {tuple(MODE_FLOP_FACTOR)}, got {mode!r}")
        return 4.0 * self.heads * self.head_dim * self.visible() * MODE_FLOP_FACTOR[mode]

    def logits_bytes(self) -> int:
        """Bytes of one float32 [B, H, T, S] logits array (what XLA's attention materializes)."""
        return self.q_len * self.kv_len * self.batch * self.heads * 4

    def mask_label(self) -> str:
        parts = ["causal" if self.causal else "full"]
        if self.window is not None:
            parts.append(f"window={self.window[0]}:{self.window[1]}")
        if self.documents:
            parts.append(f"{self.documents} docs (seed {self.doc_seed})")
        return " ".join(parts)

    def label(self) -> str:
        h = f"H={self.heads}" + (f"/{self.kv_heads}kv" if self.kv_heads != self.heads else "")
        text = f"B={self.batch} T={self.q_len} S={self.kv_len} {h} D={self.head_dim} {self.mask_label()}"
        return f"[{self.feature}] {text}" if self.feature else text


@functools.lru_cache(maxsize=None)
def _document_lengths_cached(total, documents, seed, batch):
    out = document_lengths(total, documents, seed, batch)
    out.setflags(write=False)
    return out


@functools.lru_cache(maxsize=None)
def _visible_cached(cfg: AttentionConfig) -> int:
    seg = cfg.segment_ids()
    return visible_pairs(cfg.q_len, cfg.kv_len, causal=cfg.causal, window=cfg.window,
                         q_segment_ids=seg, kv_segment_ids=seg, batch=cfg.batch)


def sweep_configs(head_dims: Sequence[int], seq_lens: Sequence[int], causals: Sequence[bool], *,
                  tokens: int = DEFAULT_TOKENS, hidden: int = DEFAULT_HIDDEN,
                  dtype: str = "bf16") -> list[AttentionConfig]:
    """The sweep: batch = tokens // seq_len, heads = hidden // head_dim, q_len == kv_len."""
    configs = []
    for d in head_dims:
        if hidden % d:
            raise ValueError(f"hidden size {hidden} is not a multiple of head_dim {d}")
        for causal in causals:
            for t in seq_lens:
                configs.append(AttentionConfig(batch=max(1, tokens // t), q_len=t, kv_len=t,
                                               heads=hidden // d, head_dim=d, causal=bool(causal),
                                               dtype=dtype))
    return configs


@dataclasses.dataclass(frozen=True)
class FeatureSizes:
    """Shapes of the feature rows (issue #4): B*T = ``tokens``, bf16."""

    tokens: int = DEFAULT_TOKENS
    head_dim: int = 128
    gqa_heads: tuple[int, int] = (32, 8)  # query heads, key/value heads
    gqa_seq_lens: tuple[int, ...] = (4096, 16384)
    heads: int = 16  # window and documents rows
    window: tuple[int, int] = (4096, 0)
    documents: int = 8
    doc_seed: int = 0


FEATURE_SIZES = FeatureSizes()
QUICK_FEATURE_SIZES = FeatureSizes(tokens=QUICK_TOKENS, head_dim=64, gqa_heads=(4, 2),
                                   gqa_seq_lens=(128, 256), heads=2, window=(64, 0), documents=8)


def _align_for(t: float) -> int:
    return 128 if t >= 1024 else 16


def plain_baseline(cfg: AttentionConfig, batch: int | None = None) -> AttentionConfig:
    """Plain attention (no window, no documents, kv_heads = heads) with about the same useful FLOPs
    as ``cfg``: same batch (or ``batch`` rows, e.g. one per packed document), heads, head_dim, causal
    flag and dtype, and q_len = kv_len chosen (a multiple of 128, or of 16 under 1024) so that its
    visible pairs are closest to ``cfg``'s. For a grouped-KV row that is the same shape with as many
    key/value heads as query heads."""
    batch = batch or cfg.batch
    per_row = cfg.visible() / batch
    if cfg.causal:  # T (T + 1) / 2 = per_row
        t = (math.sqrt(1.0 + 8.0 * per_row) - 1.0) / 2.0
        pairs = lambda n: n * (n + 1) / 2
    else:
        t = math.sqrt(per_row)
        pairs = lambda n: n * n
    align = _align_for(t)
    lo = max(align, int(t // align) * align)
    best = min((lo, lo + align), key=lambda n: abs(pairs(n) - per_row))
    return AttentionConfig(batch=batch, q_len=best, kv_len=best, heads=cfg.heads,
                           head_dim=cfg.head_dim, causal=cfg.causal, dtype=cfg.dtype, feature="plain")


def feature_configs(features: Sequence[str] = FEATURES, causals: Sequence[bool] = (False, True), *,
                    sizes: FeatureSizes = FEATURE_SIZES, head_dims: Sequence[int] | None = None,
                    dtype: str = "bf16", baselines: bool = True) -> list[AttentionConfig]:
    """The feature rows, each preceded by its plain baseline (``plain_baseline``; each baseline once):

    - ``gqa``: grouped KV, ``sizes.gqa_heads`` = (32 query, 8 key/value) heads, T = S in
      ``sizes.gqa_seq_lens``, batch = tokens // T, causal and not;
    - ``window``: causal with ``local_window_size = sizes.window`` = (4096, 0), T = tokens, B = 1;
    - ``documents``: ``sizes.documents`` = 8 packed documents of random lengths (seed
      ``sizes.doc_seed``) per row of T = tokens, B = 1, q_segment_ids = kv_segment_ids, causal and not.
    """
    bad = [f for f in features if f not in FEATURES]
    if bad:
        raise ValueError(f"unknown features {bad}; choose from {FEATURES}")
    head_dims = list(head_dims or [sizes.head_dim])
    rows: list[AttentionConfig] = []
    for d in head_dims:
        for feature in features:
            for causal in causals:
                causal = bool(causal)
                if feature == "gqa":
                    hq, hkv = sizes.gqa_heads
                    for t in sizes.gqa_seq_lens:
                        rows.append(AttentionConfig(max(1, sizes.tokens // t), t, t, hq, d, causal, dtype,
                                                    feature="gqa", kv_heads=hkv))
                elif feature == "window":
                    if not causal:  # the row: causal + sliding window
                        continue
                    rows.append(AttentionConfig(1, sizes.tokens, sizes.tokens, sizes.heads, d, True, dtype,
                                                feature="window", window=sizes.window))
                else:
                    rows.append(AttentionConfig(1, sizes.tokens, sizes.tokens, sizes.heads, d, causal, dtype,
                                                feature="documents", documents=sizes.documents,
                                                doc_seed=sizes.doc_seed))
    if not baselines:
        return rows
    out: list[AttentionConfig] = []
    for cfg in rows:
        base = plain_baseline(cfg)
        if base not in out:
            out.append(base)
        out.append(cfg)
    return out


@dataclasses.dataclass
class Result:
    config: AttentionConfig
    provider: str
    mode: str
    status: str  # "ok", "error" or "skipped"
    time_ms: float = math.nan
    min_ms: float = math.nan
    max_ms: float = math.nan
    reps: int = 0
    calls_per_sample: int = 0
    copies: int = 0
    host_frac: float = math.nan
    rel_err: float = math.nan
    note: str = ""
    vs_plain: float = math.nan  # feature rows: tflops / tflops of the plain baseline (same provider, mode)

    @property
    def flops(self) -> float:
        return self.config.flops(self.mode)

    @property
    def tflops(self) -> float:
        if self.status != "ok" or not self.time_ms > 0:
            return math.nan
        return self.flops / (self.time_ms * 1e-3) / 1e12

    def row(self, env: dict) -> dict:
        c = self.config
        return {
            "date": env["date"], "gpu": env["gpu"], "platform": env["platform"], "jax": env["jax"],
            "jaxlib": env["jaxlib"], "jax_tk": env["jax_tk"], "commit": env["commit"],
            "timer": env["timer"], "dtype": c.dtype, "batch": c.batch, "q_len": c.q_len,
            "kv_len": c.kv_len, "heads": c.heads, "head_dim": c.head_dim, "causal": c.causal,
            "feature": c.feature, "kv_heads": c.kv_heads,
            "window": "" if c.window is None else f"{c.window[0]}:{c.window[1]}",
            "documents": c.documents or "", "doc_seed": c.doc_seed if c.documents else "",
            "provider": self.provider, "mode": self.mode, "status": self.status,
            "time_ms": _fmt(self.time_ms, 5), "min_ms": _fmt(self.min_ms, 5),
            "max_ms": _fmt(self.max_ms, 5),
            "tflops": "" if math.isnan(self.tflops) else f"{self.tflops:.4g}",
            "flops": f"{self.flops:.6g}", "vs_plain": _fmt(self.vs_plain, 4), "reps": self.reps,
            "calls_per_sample": self.calls_per_sample, "copies": self.copies,
            "host_frac": _fmt(self.host_frac, 3), "rel_err": _fmt(self.rel_err, 3, sci=True),
            "note": self.note,
        }


def _fmt(x: float, digits: int, sci: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    return f"{x:.{digits}e}" if sci else f"{x:.{digits}f}"


def _short_error(e: BaseException, limit: int = 400) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    if not str(e).strip():  # e.g. a bare assert: say where it failed
        tb = traceback.extract_tb(e.__traceback__)
        if tb:
            text += f" at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno} `{tb[-1].line}`"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    text = " | ".join(lines[:4])
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ----------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------


def git_commit(path: str | None = None) -> str:
    """``git describe --always --dirty`` of the repository holding jax_tk; else the environment
    variable JAX_TK_COMMIT (for copies of the tree without .git); else "unknown"."""
    path = path or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], cwd=path,
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("JAX_TK_COMMIT") or "unknown"


def has_gpu() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def environment(timer: str = "wall") -> dict:
    import jaxlib

    try:
        import jax_tk

        tk_version = jax_tk.__version__
        kernels = jax_tk.has_cuda_kernels()
    except Exception:  # pragma: no cover - jax_tk is this package
        tk_version, kernels = "unknown", False
    dev = jax.devices()[0]
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": getattr(dev, "device_kind", str(dev)),
        "platform": dev.platform,
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", "unknown"),
        "jax_tk": tk_version,
        "jax_tk_kernels": kernels,
        "commit": git_commit(),
        "timer": timer,
        "python": platform.python_version(),
        "devices": len(jax.devices()),
    }
    try:
        from jax._src.lib import cuda_versions  # not public; only informative

        if cuda_versions is not None and dev.platform == "gpu":
            env["cudnn"] = str(cuda_versions.cudnn_get_version())
            env["cuda_runtime"] = str(cuda_versions.cuda_runtime_get_version())
    except Exception:
        pass
    return env


# ----------------------------------------------------------------------------------------------
# Timers
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    reps: int
    calls_per_sample: int
    host_frac: float


def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree)
               if hasattr(x, "shape") and hasattr(x, "dtype"))


class WallTimer:
    """Median over samples; one sample = a batch of asynchronously dispatched calls, timed from the
    first dispatch to ``block_until_ready`` of all results, divided by the number of calls."""

    name = "wall"

    def __init__(self, reps: int = MIN_REPS, batch_ms: float = 20.0, warmup_ms: float = 200.0):
        self.reps = max(int(reps), 1)
        self.batch_s = batch_ms * 1e-3
        self.warmup_s = warmup_ms * 1e-3

    @staticmethod
    def _sample(fn, arg_sets, start: int, calls: int) -> tuple[float, float]:
        n = len(arg_sets)
        t0 = time.perf_counter()
        outs = [fn(*arg_sets[(start + i) % n]) for i in range(calls)]
        t1 = time.perf_counter()
        jax.block_until_ready(outs)
        t2 = time.perf_counter()
        return (t2 - t0) / calls, (t1 - t0) / max(t2 - t0, 1e-12)

    def measure(self, fn: Callable, arg_sets: Sequence[tuple]) -> Timing:
        n = len(arg_sets)
        # Warm-up: every copy once (compiles, autotunes), then until warmup_s of device work.
        first = fn(*arg_sets[0])
        jax.block_until_ready(first)
        out_bytes = max(_nbytes(first), 1)
        del first
        for i in range(1, n):
            jax.block_until_ready(fn(*arg_sets[i]))
        t_end = time.perf_counter() + self.warmup_s
        est, _ = self._sample(fn, arg_sets, 0, n)
        while time.perf_counter() < t_end:
            est, _ = self._sample(fn, arg_sets, 0, n)
        max_calls = max(1, min(MAX_CALLS_PER_SAMPLE, BATCH_OUTPUT_BYTES // out_bytes))
        calls = int(min(max_calls, max(1, math.ceil(self.batch_s / max(est, 1e-9)))))
        samples, host = [], []
        start = 0
        for _ in range(self.reps):
            t, h = self._sample(fn, arg_sets, start, calls)
            start = (start + calls) % n
            samples.append(t * 1e3)
            host.append(h)
        return Timing(statistics.median(samples), min(samples), max(samples), len(samples), calls,
                      statistics.median(host))


class CuptiTimer:
    """Median over calls of the summed kernel time of one call, as CUPTI records it, through
    ``jax.experimental.mosaic.gpu.profiler.measure``. Warm-up as for WallTimer; then, for each input
    copy in turn, a run of back-to-back calls on that copy (so on small problems later calls may find
    their inputs in L2)."""

    name = "cupti"

    def __init__(self, reps: int = MIN_REPS, warmup_ms: float = 200.0):
        try:
            from jax.experimental.mosaic.gpu import profiler  # noqa: F401
        except Exception as e:  # pragma: no cover - GPU only
            raise RuntimeError(
                f"--timer cupti needs jax.experimental.mosaic.gpu (a CUDA jaxlib): {_short_error(e)}")
        self._profiler = profiler
        self.reps = max(int(reps), 1)
        self.warmup_s = warmup_ms * 1e-3

    def measure(self, fn: Callable, arg_sets: Sequence[tuple]) -> Timing:  # pragma: no cover - GPU
        n = len(arg_sets)
        for args in arg_sets:
            jax.block_until_ready(fn(*args))
        t_end = time.perf_counter() + self.warmup_s
        while time.perf_counter() < t_end:
            jax.block_until_ready([fn(*args) for args in arg_sets])
        per_copy = max(2, math.ceil(self.reps / n))
        samples: list[float] = []
        for args in arg_sets:
            _, ts = self._profiler.measure(fn, iterations=per_copy)(*args)
            if not ts:
                raise RuntimeError("CUPTI recorded no kernel")
            samples.extend(float(t) for t in ts)
        return Timing(statistics.median(samples), min(samples), max(samples), len(samples),
                      per_copy, math.nan)


def make_timer(name: str, reps: int, quick: bool = False):
    if name == "wall":
        return WallTimer(reps, batch_ms=2.0 if quick else 20.0, warmup_ms=10.0 if quick else 200.0)
    if name == "cupti":
        return CuptiTimer(reps, warmup_ms=10.0 if quick else 200.0)
    raise ValueError(f"unknown timer {name!r}: choose 'wall' or 'cupti'")


# ----------------------------------------------------------------------------------------------
# Providers
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Provider:
    """One attention implementation, as the benchmark sees it.

    ``fn(q, k, v) -> out`` computes ``softmax(scale * q k^T) v`` on prepared inputs.
    ``prepare(q, k, v, dout)`` (untimed) converts the benchmark's inputs and output cotangent for it
    (dtype, pre-scaling);
    ``scale`` is the softmax scale ``fn`` applies to its prepared inputs (the correctness check
    compares against the reference with it). ``fallback(reason)``: another Provider to try when every
    mode failed (the Mosaic GPU attention in float16 when bfloat16 fails). ``materializes_logits``:
    it holds the [B, H, T, S] logits (XLA, the reference), so ``--xla-max-gb`` applies to it.
    """

    name: str
    fn: Callable
    scale: float
    prepare: Callable | None = None
    fallback: Callable[[str], "Provider"] | None = None
    note: str = ""
    materializes_logits: bool = False  # holds [B, H, T, S] float32 logits: the --xla-max-gb limit applies


def _tk_mask_kwargs(cfg: AttentionConfig) -> dict:
    """jax_tk.attention's masking options for a configuration (segment ids as device constants)."""
    kw = {}
    if cfg.window is not None:
        kw["local_window_size"] = cfg.window
    seg = cfg.segment_ids()
    if seg is not None:
        ids = jnp.asarray(seg)
        kw["q_segment_ids"] = kw["kv_segment_ids"] = ids
    return kw


def _jax_tk_provider(cfg: AttentionConfig, scale: float, auto: bool = False) -> Provider:
    """``jax_tk``: the kernel (implementation="tk"; an error where the kernel refuses the options).
    ``jax_tk_auto``: implementation=None (the kernel where it applies, the pure-JAX reference
    otherwise). Without a GPU both run implementation=None."""
    import jax_tk

    gpu = has_gpu()
    impl = "tk" if gpu and not auto else None
    name = "jax_tk_auto" if auto else "jax_tk"
    kw = _tk_mask_kwargs(cfg)
    fn = functools.partial(jax_tk.attention, scale=scale, is_causal=cfg.causal, implementation=impl, **kw)
    if not gpu:
        return Provider(name, fn, scale, note="no GPU: implementation=None (pure-JAX reference)",
                        materializes_logits=True)
    if not auto:
        return Provider(name, fn, scale)
    # implementation=None: find out (at trace time, nothing runs) whether the kernel takes this call;
    # if not, this provider times the reference, which holds [B, H, T, S] float32 logits like XLA.
    probe = functools.partial(jax_tk.attention, scale=scale, is_causal=cfg.causal, implementation="tk", **kw)
    shapes = [jax.ShapeDtypeStruct(cfg.shape_q, cfg.jnp_dtype)] + 2 * [
        jax.ShapeDtypeStruct(cfg.shape_kv, cfg.jnp_dtype)]
    try:
        jax.eval_shape(probe, *shapes)
    except Exception as e:  # noqa: BLE001 - the kernel refused: the reference runs
        return Provider(name, fn, scale, materializes_logits=True,
                        note=f"implementation=None runs the pure-JAX reference (kernel: {_short_error(e, 160)})")
    return Provider(name, fn, scale, note="implementation=None (the kernel)")


def _jax_nn_provider(name: str, cfg: AttentionConfig, scale: float) -> Provider:
    """``jax.nn.dot_product_attention(implementation=name)``: grouped KV by passing key/value with
    fewer heads, the window as ``local_window_size``. It has no segment-id arguments (its
    ``query_seq_lengths``/``key_value_seq_lengths`` only pad: one sequence per batch row), so packed
    documents go in as a dense boolean ``mask`` [B, 1, T, S], built in the timed call from the
    segment ids as a user of this API would; cuDNN turns it into an additive bias and computes every
    block (no skipping), XLA applies it to its materialized logits."""
    kw = {}
    note = ""
    if cfg.window is not None:
        kw["local_window_size"] = cfg.window
    base = functools.partial(jax.nn.dot_product_attention, scale=scale, is_causal=cfg.causal,
                             implementation=name, **kw)
    seg = cfg.segment_ids()
    if seg is None:
        return Provider(name, base, scale)
    ids = jnp.asarray(seg)

    def fn(q, k, v):
        mask = (ids[:, :, None] == ids[:, None, :])[:, None]
        return base(q, k, v, mask=mask)

    note = "documents as a dense [B,1,T,S] mask (jax.nn has no segment ids)"
    return Provider(name, fn, scale, note=note)


def _cudnn_packed_provider(cfg: AttentionConfig, scale: float, padding: bool = False, why: str = "") -> Provider:
    """cuDNN's packed-sequence (ragged, "THD") attention, which skips the blocks between documents.
    jax.nn.dot_product_attention does not expose it (jax 0.10.x): it is reached through the private
    ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`` with per-document lengths
    ``q_seqlen``/``kv_seqlen`` [B, M] and start offsets ``q_offsets``/``kv_offsets`` [B, M + 1]
    (-1 padded), as JAX's own test of it does (test_sdpa_packed_layout: NO_MASK). Mask type
    NO_MASK / CAUSAL first; if every mode fails, PADDING / PADDING_CAUSAL (what jax.nn uses with
    sequence lengths). Needs Hopper or later and cuDNN >= 9.6. Packed-document rows only."""
    if not cfg.documents:
        raise _Skip("only for packed-document rows")
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


class _Skip(Exception):
    """make_provider: this provider does not apply to this configuration (recorded as skipped)."""


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


def make_provider(name: str, cfg: AttentionConfig) -> Provider:
    scale = 1.0 / math.sqrt(cfg.head_dim)
    if name in ("pallas", "pallas_triton", "cudnn_packed") and cfg.window is not None:
        raise _Skip("no sliding-window option")
    if name in ("pallas", "pallas_triton") and cfg.documents:
        raise _Skip("no segment-id option")
    if name == "jax_tk":
        return _jax_tk_provider(cfg, scale)
    if name == "jax_tk_auto":
        return _jax_tk_provider(cfg, scale, auto=True)
    if name == "cudnn":
        return _jax_nn_provider(name, cfg, scale)
    if name == "xla":
        return dataclasses.replace(_jax_nn_provider(name, cfg, scale), materializes_logits=True)
    if name == "cudnn_packed":
        return _cudnn_packed_provider(cfg, scale)
    if name == "pallas":
        return _pallas_mgpu_provider(cfg, scale)
    if name == "pallas_triton":
        return _pallas_triton_provider(cfg, scale)
    raise ValueError(f"unknown provider {name!r}; choose from {PROVIDERS}")


# ----------------------------------------------------------------------------------------------
# Correctness check (on one batch element and one head, against the float32 reference)
# ----------------------------------------------------------------------------------------------


def _slice0(x, heads: int = 1):
    return x[0:1, :, 0:heads, :]


def _rel_err(got, want) -> float:
    got = [np.asarray(g, np.float32) for g in got]
    want = [np.asarray(w, np.float32) for w in want]
    num = math.sqrt(sum(float(np.sum((g - w) ** 2)) for g, w in zip(got, want)))
    den = math.sqrt(sum(float(np.sum(w**2)) for w in want))
    return num / den if den > 0 else math.inf


def _reference(q, k, v, seg, scale, causal, window):
    from jax_tk.attention import reference

    return reference.attention(q, k, v, scale=scale, is_causal=causal, local_window_size=window,
                               q_segment_ids=seg, kv_segment_ids=seg)


@functools.partial(jax.jit, static_argnames=("scale", "causal", "window"))
def _reference_fwd(q, k, v, seg, *, scale, causal, window):
    return _reference(q, k, v, seg, scale, causal, window)


@functools.partial(jax.jit, static_argnames=("scale", "causal", "window"))
def _reference_bwd(q, k, v, seg, dout, *, scale, causal, window):
    f = lambda q, k, v: _reference(q, k, v, seg, scale, causal, window)
    return jax.vjp(f, q, k, v)[1](dout)


def _check_args(cfg: AttentionConfig):
    """The check looks at batch 0, key/value head 0 and the query heads that share it."""
    seg = cfg.segment_ids()
    seg = None if seg is None else jnp.asarray(seg[0:1])
    return cfg.heads // cfg.kv_heads, seg, dict(causal=cfg.causal, window=cfg.window)


def _check_fwd(out, inputs, provider: Provider, cfg: AttentionConfig) -> float:
    g, seg, kw = _check_args(cfg)
    q, k, v = _slice0(inputs[0], g), _slice0(inputs[1]), _slice0(inputs[2])
    ref = _reference_fwd(q, k, v, seg, scale=provider.scale, **kw)
    return _rel_err([_slice0(out, g)], [ref])


def _check_bwd(grads, inputs, dout, provider: Provider, cfg: AttentionConfig) -> float:
    g, seg, kw = _check_args(cfg)
    q, k, v = _slice0(inputs[0], g), _slice0(inputs[1]), _slice0(inputs[2])
    ref = _reference_bwd(q, k, v, seg, _slice0(dout, g), scale=provider.scale, **kw)
    dq, dk, dv = grads
    return _rel_err([_slice0(dq, g), _slice0(dk), _slice0(dv)], ref)


# ----------------------------------------------------------------------------------------------
# Running one configuration
# ----------------------------------------------------------------------------------------------


def _copies_for(set_bytes: int) -> int:
    return int(min(MAX_COPIES, max(2, math.ceil(WORKING_SET_BYTES / max(set_bytes, 1)))))


@functools.partial(jax.jit, static_argnames=("shape_q", "shape_kv", "dtype"))
def _random_set(key, *, shape_q, shape_kv, dtype):
    nq, nkv = math.prod(shape_q), math.prod(shape_kv)
    flat = jax.random.normal(key, (2 * nq + 2 * nkv,), dtype)  # one generator: compiles faster
    q, k, v, do = jnp.split(flat, [nq, nq + nkv, nq + 2 * nkv])
    return q.reshape(shape_q), k.reshape(shape_kv), v.reshape(shape_kv), do.reshape(shape_q)


def _random_inputs(cfg: AttentionConfig, copies: int, seed: int = 0):
    """``copies`` sets of (q, k, v, dout), standard normal in the benchmark dtype (never zeros)."""
    sets = [_random_set(jax.random.key(seed + i), shape_q=cfg.shape_q, shape_kv=cfg.shape_kv,
                        dtype=cfg.jnp_dtype) for i in range(copies)]
    jax.block_until_ready(sets)
    return sets


def _bench_provider(provider: Provider, cfg: AttentionConfig, sets, modes, timer, check: bool):
    """Times one provider on one configuration; returns Results (failures become Results)."""
    results = []
    if provider.prepare is not None:
        prepared = [tuple(provider.prepare(*s)) for s in sets]
    else:
        prepared = list(sets)
    fwd = jax.jit(provider.fn)

    for mode in modes:
        res = Result(cfg, provider.name, mode, "error", note=provider.note)
        arg_sets = []
        try:
            if mode == "fwd":
                arg_sets = [(q, k, v) for q, k, v, _ in prepared]
                timing = timer.measure(fwd, arg_sets)
                if check:
                    res.rel_err = _check_fwd(fwd(*arg_sets[0]), arg_sets[0], provider, cfg)
            elif mode == "bwd":
                fwd_vjp = jax.jit(lambda q, k, v: jax.vjp(provider.fn, q, k, v)[1])
                bwd = jax.jit(lambda vjp_fn, g: vjp_fn(g))
                # The forward runs here, untimed; its saved residuals (for XLA, [B, H, T, S] arrays)
                # and the cotangent are the inputs of the timed backward. Copies as for the forward,
                # but no more than needed to pass the working-set size.
                for q, k, v, do in prepared:
                    arg_sets.append((fwd_vjp(q, k, v), do))
                    if _nbytes(arg_sets) >= WORKING_SET_BYTES:
                        break
                timing = timer.measure(bwd, arg_sets)
                if check:
                    res.rel_err = _check_bwd(bwd(*arg_sets[0]), prepared[0][:3], prepared[0][3],
                                             provider, cfg)
            elif mode == "fwd_bwd":
                arg_sets = prepared
                step = jax.jit(lambda q, k, v, g: jax.vjp(provider.fn, q, k, v)[1](g))
                timing = timer.measure(step, arg_sets)
            else:
                raise ValueError(f"unknown mode {mode!r}")
        except Exception as e:  # noqa: BLE001 - any failure of a provider is a result
            res.note = "; ".join(filter(None, [provider.note, _short_error(e)]))
            if os.environ.get("JAX_TK_BENCH_TRACEBACK"):
                traceback.print_exc()
            results.append(res)
            continue
        finally:
            copies = len(arg_sets)
            del arg_sets
        res.status = "ok"
        res.time_ms, res.min_ms, res.max_ms = timing.median_ms, timing.min_ms, timing.max_ms
        res.reps, res.calls_per_sample = timing.reps, timing.calls_per_sample
        res.copies = copies
        res.host_frac = timing.host_frac
        if timing.host_frac > 0.9:
            res.note = "; ".join(filter(None, [res.note, "host-bound: dispatch kept pace with the device"]))
        results.append(res)
    return results


# The plain baseline of a provider that only runs feature rows (cudnn_packed) is another provider's.
BASELINE_PROVIDER = {"cudnn_packed": "cudnn"}


def set_vs_plain(r: Result, by_key: dict) -> None:
    """Fills ``r.vs_plain`` (TFLOP/s over the plain baseline's, same provider and mode) for a feature
    row whose baseline is in ``by_key`` ({(config, provider, mode): Result}) and ran."""
    c = r.config
    if r.status != "ok" or c.feature in ("", "plain") or not math.isnan(r.vs_plain):
        return
    base = by_key.get((plain_baseline(c), BASELINE_PROVIDER.get(r.provider, r.provider), r.mode))
    if base is not None and base.status == "ok" and base.tflops > 0:
        r.vs_plain = r.tflops / base.tflops


def bench_attention(configs: Sequence[AttentionConfig], providers: Sequence[str],
                    modes: Sequence[str] = DEFAULT_MODES, *, timer=None, check: bool = True,
                    xla_max_bytes: float = 20e9, on_result: Callable[[Result], None] | None = None,
                    log: Callable[[str], None] | None = print) -> list[Result]:
    """Times every provider on every configuration, one configuration at a time (the providers see
    the same inputs, in the same process, with the same timer)."""
    timer = timer or WallTimer()
    results: list[Result] = []

    by_key: dict[tuple, Result] = {}

    def emit(r: Result):
        results.append(r)
        by_key[(r.config, r.provider, r.mode)] = r
        set_vs_plain(r, by_key)
        if on_result is not None:
            on_result(r)
        if log is not None:
            t = (f"{r.time_ms:9.4f} ms {_fmt_tflops(r.tflops):>7} TFLOP/s" if r.status == "ok"
                 else r.status)
            err = f" err={r.rel_err:.1e}" if not math.isnan(r.rel_err) else ""
            extra = f"  [{r.note}]" if r.status != "ok" and r.note else ""
            vs = f" ({r.vs_plain:.0%} of plain)" if not math.isnan(r.vs_plain) else ""
            log(f"  {r.provider:>13} {r.mode:>7}: {t}{vs}{err}{extra}")

    t_start = time.perf_counter()
    for cfg in configs:
        if log is not None:
            log(f"{cfg.label()} {cfg.dtype}  (t={time.perf_counter() - t_start:.0f} s)")
        set_bytes = 2 * math.prod(cfg.shape_q) * 2 + 2 * math.prod(cfg.shape_kv) * 2
        try:
            sets = _random_inputs(cfg, _copies_for(set_bytes))
        except Exception as e:  # noqa: BLE001
            for name in providers:
                for mode in modes:
                    emit(Result(cfg, name, mode, "error", note=f"inputs: {_short_error(e)}"))
            continue
        for name in providers:
            try:
                provider = make_provider(name, cfg)
            except _Skip as e:
                for mode in modes:
                    emit(Result(cfg, name, mode, "skipped", note=str(e)))
                continue
            except Exception as e:  # noqa: BLE001 - e.g. the Pallas module does not import
                for mode in modes:
                    emit(Result(cfg, name, mode, "error", note=_short_error(e)))
                continue
            if provider.materializes_logits and cfg.logits_bytes() > xla_max_bytes:
                for mode in modes:
                    emit(Result(cfg, name, mode, "skipped", note="; ".join(filter(None, [
                        provider.note, f"T*S*B*H*4 = {cfg.logits_bytes() / 1e9:.1f} GB > "
                                       f"{xla_max_bytes / 1e9:.0f} GB"]))))
                continue
            out = _bench_provider(provider, cfg, sets, modes, timer, check)
            if provider.fallback is not None and all(r.status == "error" for r in out):
                why = out[0].note[len(provider.note):].lstrip("; ")[:200]
                second = provider.fallback(why)
                retry = _bench_provider(second, cfg, sets, modes, timer, check)
                if any(r.status == "ok" for r in retry):
                    out = retry
                else:  # keep the first error, and say that the retry failed too
                    for r, r2 in zip(out, retry):
                        r.note += f" || retry: {r2.note[len(second.note):].lstrip('; ')}"
            for r in out:
                emit(r)
        del sets
    if log is not None:
        log(f"({len(configs)} configurations in {time.perf_counter() - t_start:.0f} s)")
    return results


# ----------------------------------------------------------------------------------------------
# Output: table, CSV, plot
# ----------------------------------------------------------------------------------------------


def env_header(env: dict) -> str:
    keys = ("date", "gpu", "platform", "jax", "jaxlib", "cudnn", "cuda_runtime", "jax_tk",
            "jax_tk_kernels", "commit", "timer", "python")
    return "  ".join(f"{k}={env[k]}" for k in keys if k in env)


def _fmt_tflops(x: float) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def format_table(results: Sequence[Result], providers: Sequence[str] | None = None) -> str:
    """Per mode: one row per configuration, ``ms (TFLOP/s)`` per provider, and jax_tk's speed-up over
    cuDNN (cudnn time / jax_tk time, = the ratio of their TFLOP/s; > 1: jax_tk is faster)."""
    if not results:
        return "(no results)"
    if providers is None:
        providers = list(dict.fromkeys(r.provider for r in results))
    lines = []
    sweep = [r for r in results if not r.config.feature]
    features = [r for r in results if r.config.feature]
    if sweep:
        lines.append(_format_sweep(sweep, [p for p in providers if any(r.provider == p for r in sweep)]))
    if features:
        lines.append(_format_features(features, [p for p in providers
                                                 if any(r.provider == p for r in features)]))
    failures: dict[tuple, list] = {}
    for r in results:
        if r.status != "ok":
            failures.setdefault((r.provider, r.status, r.note), []).append(r)
    if failures:
        lines.append("Not timed (provider, modes, status: reason; first configuration):")
        for (provider, status, note), rs in failures.items():
            ms = ",".join(dict.fromkeys(r.mode for r in rs))
            lines.append(f"  {provider} {ms} {status} x{len(rs)}: {note}; e.g. {rs[0].config.label()}")
    bad = [r for r in results if r.status == "ok" and r.rel_err > 2e-2]
    if bad:
        lines.append("Correctness check above 2e-2 (relative error on batch 0, head 0, vs float32):")
        for r in bad:
            lines.append(f"  {r.provider} {r.mode} {r.config.label()}: {r.rel_err:.2e}")
    return "\n".join(lines).rstrip() + "\n"


def _fmt_gflop(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def _format_features(results: Sequence[Result], providers: Sequence[str]) -> str:
    """Per mode: one row per feature configuration (its plain baseline first), ``ms (TFLOP/s)`` per
    provider and, on feature rows, the TFLOP/s as a percentage of the same provider's on the plain
    baseline (the issue's target: >= 90%)."""
    by_key = {(r.config, r.provider, r.mode): r for r in results}
    for r in results:
        set_vs_plain(r, by_key)
    configs = list(dict.fromkeys(r.config for r in results))
    modes = list(dict.fromkeys(r.mode for r in results))
    lines = []
    for mode in modes:
        lines.append(f"== features, {mode}: time per call in ms (TFLOP/s of useful FLOPs, % of the same "
                     "provider's TFLOP/s on the plain row of about the same useful FLOPs) ==")
        head = (f"{'feature':>9} {'mask':>28} {'T':>6} {'B':>3} {'H':>3} {'Hkv':>3} {'D':>4} "
                f"{'GFLOP':>7} |")
        for p in providers:
            head += f" {p + ' ms (TF/s, %)':>26} |"
        lines.append(head)
        lines.append("-" * len(head))
        for cfg in configs:
            row = (f"{cfg.feature:>9} {cfg.mask_label():>28} {cfg.q_len:>6} {cfg.batch:>3} {cfg.heads:>3} "
                   f"{cfg.kv_heads:>3} {cfg.head_dim:>4} {_fmt_gflop(cfg.flops(mode) / 1e9):>7} |")
            for p in providers:
                r = by_key.get((cfg, p, mode))
                if r is None:
                    cell = "-"
                elif r.status == "ok":
                    cell = f"{r.time_ms:.3f} ({_fmt_tflops(r.tflops)}"
                    cell += f", {r.vs_plain:.0%})" if not math.isnan(r.vs_plain) else ")"
                else:
                    cell = r.status
                row += f" {cell:>26} |"
            lines.append(row)
        lines.append("")
    return "\n".join(lines)


def _format_sweep(results: Sequence[Result], providers: Sequence[str]) -> str:
    by_key = {(r.config, r.provider, r.mode): r for r in results}
    configs = sorted(dict.fromkeys(r.config for r in results),
                     key=lambda c: (c.dtype, c.head_dim, c.causal, c.q_len, c.kv_len, c.batch, c.heads))
    modes = list(dict.fromkeys(r.mode for r in results))
    show_ratio = "jax_tk" in providers and "cudnn" in providers
    lines = []
    for mode in modes:
        head = f"{'D':>4} {'causal':>6} {'T':>6} {'S':>6} {'B':>4} {'H':>4} |"
        for p in providers:
            head += f" {p + ' ms (TF/s)':>22} |"
        if show_ratio:
            head += f" {'tk/cudnn':>8}"
        title = f"== {mode}: time per call in ms (TFLOP/s)"
        if show_ratio:
            title += "; tk/cudnn = cudnn time / jax_tk time (> 1: jax_tk is faster)"
        lines.append(title + " ==")
        lines.append(head)
        lines.append("-" * len(head))
        for cfg in configs:
            row = (f"{cfg.head_dim:>4} {str(cfg.causal):>6} {cfg.q_len:>6} {cfg.kv_len:>6} "
                   f"{cfg.batch:>4} {cfg.heads:>4} |")
            for p in providers:
                r = by_key.get((cfg, p, mode))
                if r is None:
                    cell = "-"
                elif r.status == "ok":
                    cell = f"{r.time_ms:.3f} ({_fmt_tflops(r.tflops)})"
                else:
                    cell = r.status
                row += f" {cell:>22} |"
            if show_ratio:
                tk, cu = by_key.get((cfg, "jax_tk", mode)), by_key.get((cfg, "cudnn", mode))
                ratio = "-"
                if tk and cu and tk.status == cu.status == "ok":
                    ratio = f"{cu.time_ms / tk.time_ms:.2f}x"
                row += f" {ratio:>8}"
            lines.append(row)
        lines.append("")
    return "\n".join(lines)


class CsvWriter:
    """Writes rows as they come, so a cut-off run still leaves its numbers."""

    def __init__(self, path: str, env: dict):
        self.path, self.env = path, env
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        self._f = open(path, "w", newline="")
        self._w = csv.DictWriter(self._f, fieldnames=CSV_FIELDS)
        self._w.writeheader()
        self._f.flush()

    def write(self, r: Result):
        self._w.writerow(r.row(self.env))
        self._f.flush()

    def close(self):
        self._f.close()


def write_csv(results: Sequence[Result], path: str, env: dict) -> None:
    w = CsvWriter(path, env)
    try:
        for r in results:
            w.write(r)
    finally:
        w.close()


def features_png_path(path: str) -> str:
    root, ext = os.path.splitext(path)
    return f"{root}_features{ext or '.png'}"


def plot(results: Sequence[Result], path: str, env: dict) -> list[str]:
    """Writes the plots; returns the paths written (empty when matplotlib is missing or there is
    nothing to plot). Sweep rows: TFLOP/s against sequence length at ``path``. Feature rows: bars of
    TFLOP/s per feature row and provider, the plain baseline marked on each bar, at ``path`` when
    there are no sweep rows, else at ``<path stem>_features.png``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    sweep = [r for r in results if not r.config.feature]
    features = [r for r in results if r.config.feature]
    written = []
    if sweep and _plot_sweep(plt, sweep, path, env):
        written.append(path)
    if features:
        fpath = features_png_path(path) if sweep else path
        if _plot_features(plt, features, fpath, env):
            written.append(fpath)
    return written


def _suptitle(env: dict) -> str:
    return (f"attention, {env.get('gpu')}, jax {env.get('jax')}, commit {env.get('commit')}, "
            f"{env.get('date')}, timer={env.get('timer')}")


def _plot_features(plt, results: Sequence[Result], path: str, env: dict) -> bool:
    by_key = {(r.config, r.provider, r.mode): r for r in results}
    configs = [c for c in dict.fromkeys(r.config for r in results) if c.feature != "plain"]
    modes = list(dict.fromkeys(r.mode for r in results))
    providers = [p for p in dict.fromkeys(r.provider for r in results)
                 if any(r.provider == p and r.status == "ok" and r.config.feature != "plain"
                        for r in results)]
    if not configs or not modes or not providers:
        return False
    fig, axes = plt.subplots(len(modes), 1, figsize=(max(6.0, 1.3 * len(configs) * len(providers) / 2 + 2),
                                                      3.8 * len(modes)), squeeze=False)
    width = 0.8 / len(providers)
    for j, mode in enumerate(modes):
        ax = axes[j][0]
        for k, p in enumerate(providers):
            for i, cfg in enumerate(configs):
                r = by_key.get((cfg, p, mode))
                if r is None or r.status != "ok":
                    continue
                x = i - 0.4 + (k + 0.5) * width
                ax.bar(x, r.tflops, width, color=f"C{k % 10}", label=p)
                base = by_key.get((plain_baseline(cfg), BASELINE_PROVIDER.get(p, p), mode))
                if base is not None and base.status == "ok":
                    ax.hlines(base.tflops, x - width / 2, x + width / 2, colors="k", linewidth=1.5)
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels([f"{c.feature}\n{c.mask_label().replace(' (seed', chr(10) + '(seed')}\n"
                            f"T={c.q_len} H={c.heads}/{c.kv_heads}" for c in configs], fontsize=7)
        ax.set_ylabel("TFLOP/s (useful FLOPs)")
        ax.set_title(f"{mode}: bars = feature rows, black lines = plain attention at about the same "
                     "useful FLOPs", fontsize=9)
        ax.set_ylim(bottom=0)
        ax.grid(True, axis="y", alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            uniq = dict(zip(labels, handles))
            ax.legend(uniq.values(), uniq.keys(), fontsize=8)
    fig.suptitle(_suptitle(env), fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_sweep(plt, results: Sequence[Result], path: str, env: dict) -> bool:
    rows = sorted(dict.fromkeys((r.config.head_dim, r.config.causal) for r in results))
    modes = list(dict.fromkeys(r.mode for r in results))
    providers = list(dict.fromkeys(r.provider for r in results))
    if not rows or not modes:
        return False
    fig, axes = plt.subplots(len(rows), len(modes), figsize=(5.5 * len(modes), 3.6 * len(rows)),
                             squeeze=False)
    colors = {p: f"C{i % 10}" for i, p in enumerate(providers)}
    seqs = sorted({r.config.q_len for r in results})
    for i, (d, causal) in enumerate(rows):
        for j, mode in enumerate(modes):
            ax = axes[i][j]
            for p in providers:
                sel = [r for r in results if r.provider == p and r.mode == mode
                       and r.config.head_dim == d and r.config.causal == causal and r.status == "ok"]
                if not sel:
                    continue
                pts = sorted((r.config.q_len, r.tflops) for r in sel)
                label = p + (" (float16)" if all("ran in float16" in r.note for r in sel) else "")
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label,
                        color=colors[p])
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqs)
            ax.set_xticklabels([f"{t // 1024}k" if t >= 1024 and t % 1024 == 0 else str(t)
                                for t in seqs])
            ax.minorticks_off()
            ax.set_title(f"{mode}, head_dim={d}, {'causal' if causal else 'non-causal'}",
                         fontsize=10)
            ax.set_xlabel("sequence length (q = kv)")
            ax.set_ylabel("TFLOP/s")
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            if ax.has_data():
                ax.legend(fontsize=8)
    fig.suptitle(_suptitle(env), fontsize=10)
    fig.tight_layout()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


ENV_FIELDS = ("date", "gpu", "platform", "jax", "jaxlib", "jax_tk", "commit", "timer")


def read_csv(paths: Sequence[str]) -> tuple[list[Result], dict]:
    """Reads CSVs written by this module back into Results, and the environment fields they carry
    (different values across files are joined with ' / ')."""
    results, envs = [], []

    def num(row, key, cast=float):
        v = row.get(key, "")
        return cast(v) if v not in ("", None) else (math.nan if cast is float else 0)

    for path in paths:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                window = row.get("window") or None
                if window:
                    window = tuple(int(w) for w in window.split(":"))
                cfg = AttentionConfig(int(row["batch"]), int(row["q_len"]), int(row["kv_len"]),
                                      int(row["heads"]), int(row["head_dim"]),
                                      row["causal"] == "True", row["dtype"],
                                      feature=row.get("feature") or "",
                                      kv_heads=int(row["kv_heads"]) if row.get("kv_heads") else None,
                                      window=window, documents=int(row.get("documents") or 0),
                                      doc_seed=int(row.get("doc_seed") or 0))
                results.append(Result(
                    cfg, row["provider"], row["mode"], row["status"], time_ms=num(row, "time_ms"),
                    min_ms=num(row, "min_ms"), max_ms=num(row, "max_ms"), reps=num(row, "reps", int),
                    calls_per_sample=num(row, "calls_per_sample", int),
                    copies=num(row, "copies", int), host_frac=num(row, "host_frac"),
                    rel_err=num(row, "rel_err"), note=row.get("note", ""),
                    vs_plain=num(row, "vs_plain")))
                envs.append(row)
    env = {k: " / ".join(dict.fromkeys(str(e.get(k, "")) for e in envs)) for k in ENV_FIELDS}
    return results, env


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    out = []
    for part in text.replace(" ", ",").split(","):
        if not part:
            continue
        part = part.lower()
        mult = 1
        if part.endswith("k"):
            part, mult = part[:-1], 1024
        out.append(int(part) * mult)
    if not out:
        raise argparse.ArgumentTypeError("expected a comma-separated list of integers")
    return out


def _str_list(choices):
    def parse(text: str) -> list[str]:
        items = [s for s in text.replace(" ", ",").split(",") if s]
        bad = [s for s in items if s not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {','.join(choices)}; got {text!r}")
        return items
    return parse


def _causal_list(text: str) -> list[bool]:
    t = text.lower()
    if t in ("both", "all"):
        return [False, True]
    if t in ("true", "1", "yes", "causal"):
        return [True]
    if t in ("false", "0", "no", "full"):
        return [False]
    raise argparse.ArgumentTypeError("--causal takes both, true or false")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jax_tk.bench",
                                description="Benchmarks of jax_tk against cuDNN, XLA and Pallas.")
    sub = p.add_subparsers(dest="op", required=True)
    a = sub.add_parser("attention", help="attention forward and backward",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a.add_argument("--d", type=_int_list, default=None,
                   help=f"head dims, comma-separated (default {','.join(map(str, DEFAULT_HEAD_DIMS))})")
    a.add_argument("--seq", type=_int_list, default=None,
                   help="sequence lengths q = kv, comma-separated, 'k' = 1024 "
                        f"(default {','.join(map(str, DEFAULT_SEQ_LENS))})")
    a.add_argument("--causal", type=_causal_list, default=None, help="both, true or false (default both)")
    a.add_argument("--providers", type=_str_list(PROVIDERS), default=None,
                   help=f"from {','.join(PROVIDERS)} (default {','.join(DEFAULT_PROVIDERS)})")
    a.add_argument("--modes", type=_str_list(MODES), default=None,
                   help=f"from {','.join(MODES)} (default {','.join(DEFAULT_MODES)})")
    a.add_argument("--tokens", type=int, default=None, help=f"batch * seq (default {DEFAULT_TOKENS})")
    a.add_argument("--hidden", type=int, default=None, help=f"heads * head_dim (default {DEFAULT_HIDDEN})")
    a.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    a.add_argument("--timer", choices=("wall", "cupti"), default="wall")
    a.add_argument("--reps", type=int, default=MIN_REPS, help=f"samples per measurement (>= {MIN_REPS})")
    a.add_argument("--xla-max-gb", type=float, default=20.0,
                   help="skip the xla provider where T*S*B*H*4 bytes exceed this")
    a.add_argument("--no-check", action="store_true",
                   help="skip the correctness check against the float32 reference")
    a.add_argument("--quick", action="store_true",
                   help=f"tiny sweep: D={QUICK_HEAD_DIMS}, T={QUICK_SEQ_LENS}, tokens={QUICK_TOKENS}, "
                        f"hidden={QUICK_HIDDEN} (runs on CPU in seconds)")
    a.add_argument("--features", nargs="?", const=",".join(FEATURES), default=None,
                   type=_str_list(FEATURES), metavar="LIST",
                   help=f"run only the feature rows (from {','.join(FEATURES)}; all when no LIST), each "
                        "with a plain baseline at about the same useful FLOPs, instead of the sweep; "
                        f"default providers {','.join(FEATURE_PROVIDERS)}; --seq sets the gqa lengths, "
                        "--tokens B*T, --d the head dim; not part of the default run")
    a.add_argument("--out", default=os.path.join("out", "bench"), help="directory for the CSV and PNG")
    a.add_argument("--csv", default=None,
                   help="CSV path (default OUT/attention.csv; OUT/attention_features.csv with --features)")
    a.add_argument("--png", default=None,
                   help="PNG path (default OUT/attention.png; OUT/attention_features.png with --features); "
                        "'none' to skip")
    r = sub.add_parser("report", help="table and plot from CSVs of earlier runs (merged; no GPU needed)")
    r.add_argument("csvs", nargs="+", help="CSV files written by `attention`")
    r.add_argument("--csv", default=None, help="also write the merged rows to this CSV")
    r.add_argument("--png", default=None, help="write the plot here")
    return p


def run_report(args) -> int:
    results, env = read_csv(args.csvs)
    providers = list(dict.fromkeys(r.provider for r in results))
    print(f"# {env_header(env)}")
    print(format_table(results, providers))
    if args.csv:
        write_csv(results, args.csv, env)
        print(f"CSV: {args.csv}")
    if args.png:
        _print_plots(plot(results, args.png, env))
    return 0


def _print_plots(paths: list[str]) -> None:
    for path in paths:
        print(f"PNG: {path}")
    if not paths:
        print("PNG: skipped (matplotlib is not installed, or nothing to plot)")


def run_attention(args) -> int:
    quick = args.quick
    features = getattr(args, "features", None)
    head_dims = args.d or (QUICK_HEAD_DIMS if quick else DEFAULT_HEAD_DIMS)
    seq_lens = args.seq or (QUICK_SEQ_LENS if quick else DEFAULT_SEQ_LENS)
    causals = args.causal or [False, True]
    tokens = args.tokens or (QUICK_TOKENS if quick else DEFAULT_TOKENS)
    hidden = args.hidden or (QUICK_HIDDEN if quick else DEFAULT_HIDDEN)
    providers = args.providers or list(FEATURE_PROVIDERS if features else DEFAULT_PROVIDERS)
    modes = args.modes or list(DEFAULT_MODES)
    dtype = {"bfloat16": "bf16", "float16": "fp16"}.get(args.dtype, args.dtype)
    if args.reps < MIN_REPS:
        print(f"note: --reps {args.reps} is under {MIN_REPS}; using {MIN_REPS}", file=sys.stderr)
    reps = max(args.reps, MIN_REPS)
    stem = "attention_features" if features else "attention"
    csv_path = args.csv or os.path.join(args.out, stem + ".csv")
    png_path = args.png or os.path.join(args.out, stem + ".png")

    if features:
        sizes = QUICK_FEATURE_SIZES if quick else FEATURE_SIZES
        sizes = dataclasses.replace(sizes, tokens=args.tokens or sizes.tokens,
                                    gqa_seq_lens=tuple(args.seq or sizes.gqa_seq_lens))
        configs = feature_configs(features, causals, sizes=sizes, head_dims=args.d, dtype=dtype)
        flops_note = ("FLOPs: useful only, fwd 4*B*H*D*(visible query-key pairs), bwd 2.5x fwd; % = "
                      "TFLOP/s relative to the plain row of about the same useful FLOPs")
        what = f"features={','.join(features)} tokens={sizes.tokens}"
    else:
        configs = sweep_configs(head_dims, seq_lens, causals, tokens=tokens, hidden=hidden, dtype=dtype)
        flops_note = "FLOPs: fwd 4*B*H*T*S*D (/2 causal), bwd 2.5x fwd, fwd_bwd 3.5x fwd"
        what = f"tokens={tokens} hidden={hidden}"
    timer = make_timer(args.timer, reps, quick=quick)
    env = environment(timer.name)
    print(f"# jax_tk attention benchmark: {env_header(env)}")
    print(f"# providers={','.join(providers)} modes={','.join(modes)} dtype={dtype} {what} "
          f"reps={reps}; {flops_note}; bwd = the backward alone (VJP of saved residuals)")
    sys.stdout.flush()
    writer = CsvWriter(csv_path, env)
    try:
        results = bench_attention(
            configs, providers, modes, timer=timer, check=not args.no_check,
            xla_max_bytes=args.xla_max_gb * 1e9, on_result=writer.write,
            log=lambda s: print(s, flush=True))
    finally:
        writer.close()
    print()
    print(f"# {env_header(env)}")
    print(format_table(results, providers))
    print(f"CSV: {csv_path}")
    if png_path.lower() != "none":
        _print_plots(plot(results, png_path, env))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.op == "attention":
        return run_attention(args)
    if args.op == "report":
        return run_report(args)
    raise AssertionError(args.op)  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
