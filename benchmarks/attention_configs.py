"""Attention benchmark configurations: the problems, the sweep, the feature rows, and their FLOPs.

FLOPs are counted the standard way (FlashAttention's benchmarks): forward ``4*B*H*T*S*D``, halved
when causal; backward 2.5x forward; forward+backward 3.5x. With a value head dim ``Dv`` unlike the
query/key head dim ``D`` (MLA: 192 and 128) the forward's two products are ``2*T*S*D`` (Q K^T) and
``2*T*S*Dv`` (P V): ``2*B*H*T*S*(D + Dv)``, which is ``4*B*H*T*S*D`` when they are equal. Feature rows
(grouped KV, sliding window, packed documents, masks given as a dense boolean mask, an additive bias,
sinks, MLA's head dims) count only the (query, key) pairs their mask leaves visible ("useful FLOPs"),
counted on the host in O(T) per document (``visible_pairs``); each but the MLA rows is compared with
a plain row of about the same useful FLOPs (``plain_baseline``).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax.numpy as jnp
import numpy as np

FEATURES = ("gqa", "window", "documents", "mask", "bias", "sinks", "mla")
# Feature rows without a plain baseline: MLA's rows are compared with the peers running the same
# head dims (the ratio to the best peer), not with an equal-dims problem of other FLOPs.
NO_BASELINE = ("mla",)
# The modes of a run of MLA rows alone (the rows: the forward, and forward + backward).
MLA_MODES = ("fwd", "fwd_bwd")
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


# ----------------------------------------------------------------------------------------------
# FLOPs and masks
# ----------------------------------------------------------------------------------------------


def attention_flops(batch: int, q_len: int, kv_len: int, heads: int, head_dim: int,
                    causal: bool, mode: str = "fwd", v_head_dim: int | None = None) -> float:
    """FLOPs of attention counted the standard way (FlashAttention's benchmarks).

    Forward: two matrix products per (batch, head), ``2*T*S*D`` (Q K^T) and ``2*T*S*Dv`` (P V), so
    ``2*B*H*T*S*(D + Dv)`` (``4*B*H*T*S*D`` when ``v_head_dim`` is None or equal), halved when causal;
    backward 2.5x the forward (five matrix products against two); forward+backward 3.5x.
    """
    pairs = batch * q_len * kv_len / (2.0 if causal else 1.0)
    return useful_flops(heads, head_dim, pairs, mode, v_head_dim)


def useful_flops(heads: int, head_dim: int, visible: int, mode: str = "fwd",
                 v_head_dim: int | None = None) -> float:
    """FLOPs of the (query, key) pairs a mask leaves visible (``visible``, summed over the batch):
    forward ``2*H*(D + Dv)*visible`` (``4*H*D*visible`` for equal head dims), backward 2.5x."""
    if mode not in MODE_FLOP_FACTOR:
        raise ValueError(f"mode must be one of {tuple(MODE_FLOP_FACTOR)}, got {mode!r}")
    dv = head_dim if v_head_dim is None else v_head_dim
    return 2.0 * heads * (head_dim + dv) * visible * MODE_FLOP_FACTOR[mode]


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
# Configurations
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
    as_mask: bool = False  # the causal mask and the documents go to every provider as a dense boolean mask
    bias: bool = False  # every provider takes a random additive bias [1, heads, q_len, kv_len]
    sinks: bool = False  # attention sinks [heads] (sink_values; only jax_tk takes them, the others skip)
    v_head_dim: int | None = None  # the value's (and the output's) head dim; None: = head_dim (normalized)

    def __post_init__(self):
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.window is not None:
            object.__setattr__(self, "window", (int(self.window[0]), int(self.window[1])))
        if self.documents and self.q_len != self.kv_len:
            raise ValueError("packed documents need q_len == kv_len")
        if self.as_mask and (self.window is not None or not (self.causal or self.documents)):
            raise ValueError("as_mask gives the causal mask and the documents as a mask: no window, one of them")

    @property
    def shape_q(self):
        return (self.batch, self.q_len, self.heads, self.head_dim)

    @property
    def shape_kv(self):
        """The key's shape (and the value's where the head dims are equal: ``shape_v``)."""
        return (self.batch, self.kv_len, self.kv_heads, self.head_dim)

    @property
    def shape_v(self):
        return (self.batch, self.kv_len, self.kv_heads, self.v_head_dim)

    @property
    def shape_out(self):
        """The output's shape (and its cotangent's): the query's with the value's head dim."""
        return (self.batch, self.q_len, self.heads, self.v_head_dim)

    @property
    def mla(self) -> bool:
        """The value's head dim differs from the query's and key's (MLA: 192 and 128)."""
        return self.v_head_dim != self.head_dim

    @property
    def d_label(self) -> str:
        """``128``, or ``192/128`` (query/key, value) where they differ."""
        return f"{self.head_dim}/{self.v_head_dim}" if self.mla else str(self.head_dim)

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

    def sink_values(self) -> np.ndarray | None:
        """The sinks of a ``sinks`` row, ``[heads]`` float32 from -2 to 2 (None elsewhere)."""
        return np.linspace(-2.0, 2.0, self.heads, dtype=np.float32) if self.sinks else None

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
                                   self.causal, mode, self.v_head_dim)
        return useful_flops(self.heads, self.head_dim, self.visible(), mode, self.v_head_dim)

    @property
    def bias_shape(self):
        return (1, self.heads, self.q_len, self.kv_len)

    def logits_bytes(self) -> int:
        """Bytes of one float32 [B, H, T, S] logits array (what XLA's attention materializes)."""
        return self.q_len * self.kv_len * self.batch * self.heads * 4

    def mask_label(self) -> str:
        parts = ["causal" if self.causal else "full"]
        if self.window is not None:
            parts.append(f"window={self.window[0]}:{self.window[1]}")
        if self.documents:
            parts.append(f"{self.documents} docs (seed {self.doc_seed})")
        if self.as_mask:
            parts.append("as a mask")
        if self.bias:
            parts.append("+ bias")
        if self.sinks:
            parts.append("+ sinks")
        return " ".join(parts)

    def label(self) -> str:
        h = f"H={self.heads}" + (f"/{self.kv_heads}kv" if self.kv_heads != self.heads else "")
        text = f"B={self.batch} T={self.q_len} S={self.kv_len} {h} D={self.d_label} {self.mask_label()}"
        return f"[{self.feature}] {text}" if self.feature else text


    # The CSV columns (harness.csv_fields puts them between the environment and the measurement).
    CSV_FIELDS = ("dtype", "batch", "q_len", "kv_len", "heads", "head_dim", "causal",
                  "feature", "kv_heads", "window", "documents", "doc_seed", "as_mask", "bias", "sinks",
                  "v_head_dim")

    def csv_row(self) -> dict:
        return {
            "dtype": self.dtype, "batch": self.batch, "q_len": self.q_len, "kv_len": self.kv_len,
            "heads": self.heads, "head_dim": self.head_dim, "causal": self.causal,
            "feature": self.feature, "kv_heads": self.kv_heads,
            "window": "" if self.window is None else f"{self.window[0]}:{self.window[1]}",
            "documents": self.documents or "", "doc_seed": self.doc_seed if self.documents else "",
            "as_mask": self.as_mask or "", "bias": self.bias or "", "sinks": self.sinks or "",
            "v_head_dim": self.v_head_dim,
        }

    @classmethod
    def from_row(cls, row: dict) -> "AttentionConfig":
        """The inverse of ``csv_row`` (a row of a CSV read back)."""
        window = row.get("window") or None
        if window:
            window = tuple(int(w) for w in window.split(":"))
        return cls(int(row["batch"]), int(row["q_len"]), int(row["kv_len"]), int(row["heads"]),
                   int(row["head_dim"]), row["causal"] == "True", row["dtype"],
                   feature=row.get("feature") or "",
                   kv_heads=int(row["kv_heads"]) if row.get("kv_heads") else None,
                   window=window, documents=int(row.get("documents") or 0),
                   doc_seed=int(row.get("doc_seed") or 0), as_mask=row.get("as_mask") == "True",
                   bias=row.get("bias") == "True", sinks=row.get("sinks") == "True",
                   # (CSVs from before the column: the value's head dim is the query's)
                   v_head_dim=int(row["v_head_dim"]) if row.get("v_head_dim") else None)


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
    """Shapes of the feature rows: B*T = ``tokens``, bf16."""

    tokens: int = DEFAULT_TOKENS
    head_dim: int = 128
    gqa_heads: tuple[int, int] = (32, 8)  # query heads, key/value heads
    gqa_seq_lens: tuple[int, ...] = (4096, 16384)
    heads: int = 16  # window, documents, mask and bias rows
    window: tuple[int, int] = (4096, 0)
    documents: int = 8
    doc_seed: int = 0
    bias_seq_len: int = 4096  # bias rows: T = S (B = tokens // T; the bias is [1, heads, T, S])
    mla_head_dims: tuple[int, int] = (192, 128)  # MLA rows: query/key head dim, value head dim
    mla_heads: tuple[int, ...] = (16, 128)  # (as many key/value heads as query heads)
    mla_seq_lens: tuple[int, ...] = (2048, 4096, 8192, 16384)


FEATURE_SIZES = FeatureSizes()
QUICK_FEATURE_SIZES = FeatureSizes(tokens=QUICK_TOKENS, head_dim=64, gqa_heads=(4, 2),
                                   gqa_seq_lens=(128, 256), heads=2, window=(64, 0), documents=8, bias_seq_len=128,
                                   mla_heads=(2,), mla_seq_lens=(128,))


def _align_for(t: float) -> int:
    return 128 if t >= 1024 else 16


def has_baseline(cfg: AttentionConfig) -> bool:
    """Whether ``cfg`` is a feature row compared with a plain row (``plain_baseline``): not the sweep,
    not a plain row itself, not an MLA row (``NO_BASELINE``)."""
    return cfg.feature not in ("", "plain", *NO_BASELINE)


def plain_baseline(cfg: AttentionConfig, batch: int | None = None) -> AttentionConfig:
    """Plain attention (no window, no documents, kv_heads = heads) with about the same useful FLOPs
    as ``cfg``: same batch (or ``batch`` rows, e.g. one per packed document), heads, head_dim, causal
    flag and dtype, and q_len = kv_len chosen (a multiple of 128, or of 16 under 1024) so that its
    visible pairs are closest to ``cfg``'s. For a grouped-KV row that is the same shape with as many
    key/value heads as query heads. (MLA rows have none: ``has_baseline``.)"""
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


def mla_configs(sizes: FeatureSizes = FEATURE_SIZES, dtype: str = "bf16") -> list[AttentionConfig]:
    """MLA's training attention (DeepSeek-V2/V3): causal, query/key head dim 192 and value head dim 128
    (``sizes.mla_head_dims``), as many key/value heads as query heads (``sizes.mla_heads``: 16 and
    128), T = S in ``sizes.mla_seq_lens`` (2k to 16k), batch = tokens // T: 8 rows by default."""
    d, dv = sizes.mla_head_dims
    return [AttentionConfig(max(1, sizes.tokens // t), t, t, h, d, True, dtype, feature="mla", v_head_dim=dv)
            for h in sizes.mla_heads for t in sizes.mla_seq_lens]


def feature_configs(features: Sequence[str] = FEATURES, causals: Sequence[bool] = (False, True), *,
                    sizes: FeatureSizes = FEATURE_SIZES, head_dims: Sequence[int] | None = None,
                    dtype: str = "bf16", baselines: bool = True) -> list[AttentionConfig]:
    """The feature rows, each but the MLA rows preceded by its plain baseline (``plain_baseline``;
    each baseline once):

    - ``gqa``: grouped KV, ``sizes.gqa_heads`` = (32 query, 8 key/value) heads, T = S in
      ``sizes.gqa_seq_lens``, batch = tokens // T, causal and not;
    - ``window``: causal with ``local_window_size = sizes.window`` = (4096, 0), T = tokens, B = 1;
    - ``documents``: ``sizes.documents`` = 8 packed documents of random lengths (seed
      ``sizes.doc_seed``) per row of T = tokens, B = 1, q_segment_ids = kv_segment_ids, causal and not.
    - ``mask``: the same documents given to every provider as a dense boolean mask (``as_mask``),
      causal and not, and the causal mask alone as a mask (causal only);
    - ``bias``: an additive bias ``[1, H, T, S]``, T = S = ``sizes.bias_seq_len``, B = tokens // T,
      causal and not;
    - ``sinks``: attention sinks ``[H]`` (``sinks=``), at the shape of the bias rows, causal and not
      (its baseline: the same call without them);
    - ``mla``: ``mla_configs`` (causal only; their own head dims, whatever ``head_dims`` says; no
      plain baseline: they are compared with the peers at the same head dims).
    """
    bad = [f for f in features if f not in FEATURES]
    if bad:
        raise ValueError(f"unknown features {bad}; choose from {FEATURES}")
    head_dims = list(head_dims or [sizes.head_dim])
    rows: list[AttentionConfig] = []
    for d in head_dims:
        for feature in features:
            if feature == "mla":  # (once, at its own head dims; causal only)
                if d == head_dims[0] and any(causals):
                    rows += mla_configs(sizes, dtype)
                continue
            for causal in causals:
                causal = bool(causal)
                if feature == "gqa":
                    hq, hkv = sizes.gqa_heads
                    for t in sizes.gqa_seq_lens:
                        rows.append(AttentionConfig(max(1, sizes.tokens // t), t, t, hq, d, causal, dtype,
                                                    feature="gqa", kv_heads=hkv))
                elif feature == "window":
                    if not causal:  # a sliding window comes with the causal mask
                        continue
                    rows.append(AttentionConfig(1, sizes.tokens, sizes.tokens, sizes.heads, d, True, dtype,
                                                feature="window", window=sizes.window))
                elif feature in ("documents", "mask"):
                    rows.append(AttentionConfig(1, sizes.tokens, sizes.tokens, sizes.heads, d, causal, dtype,
                                                feature=feature, documents=sizes.documents,
                                                doc_seed=sizes.doc_seed, as_mask=feature == "mask"))
                    if feature == "mask" and causal:
                        rows.append(AttentionConfig(1, sizes.tokens, sizes.tokens, sizes.heads, d, True, dtype,
                                                    feature="mask", as_mask=True))
                else:
                    t = sizes.bias_seq_len
                    rows.append(AttentionConfig(max(1, sizes.tokens // t), t, t, sizes.heads, d, causal, dtype,
                                                feature=feature, bias=feature == "bias",
                                                sinks=feature == "sinks"))
    if not baselines:
        return rows
    out: list[AttentionConfig] = []
    for cfg in rows:
        base = plain_baseline(cfg) if has_baseline(cfg) else None
        if base is not None and base not in out:
            out.append(base)
        out.append(cfg)
    return out


