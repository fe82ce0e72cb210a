"""Decode-attention benchmark: jax_tk.decode against cuDNN, FlashAttention-3 and XLA, in bytes of cache read.

Command line::

    python -m benchmarks decode                 # the default set (a few minutes on an H100)
    python -m benchmarks decode --quick         # tiny shapes (seconds, CPU too)
    python -m benchmarks decode --batch 8,64 --cache 8k,32k --heads 32/8 --d 128 --new 1,4 \\
        --layout contiguous,paged16,paged64       # the product of the lists given
    python -m benchmarks decode --full          # every combination below (long)
    python -m benchmarks decode --scan 16       # per step, 16 steps inside one jitted lax.scan
    python -m benchmarks decode --ragged        # lengths uniform in [T_new, S], as a server's batch

A configuration: batch B in {1, 8, 32, 64, 128}, cache length S in {2k, 8k, 32k, 128k} (every sequence
holds S valid positions: the cache is full), query/key-value heads 32/8 or 64/8, head_dim 128 or 256,
T_new in {1, 4, 16} new tokens per sequence (causal, bottom-right aligned; 16 as in speculative
decoding), bf16; the cache contiguous ``[B, S, K, H]`` or paged (pages of 16 or 64 rows,
``[B*S/page, page, K, H]``, the page table a random permutation so that a sequence's pages are
scattered over the pool). Configurations whose inputs do not fit in ``--max-gb`` (default 60% of the
GPU's memory) are skipped. ``--sinks``: every configuration runs twice, without and with attention
sinks (gpt-oss: one logit per query head in every row's softmax denominator, ``sink_values``); only
jax_tk takes them (the peers' sinks rows are skipped, "unsupported"), and the table gives the cost of
the sinks, jax_tk's time with them over its time on the same configuration without.

The default set (``--full`` for the whole product): the grid B x S at 32/8 heads, head_dim 128,
T_new 1, contiguous; and at (B, S) = (8, 32k) and (64, 8k) one row for each other setting: 64/8 heads,
head_dim 256, T_new 4, T_new 16, paged 16, paged 64.

Providers (``decode_providers``): ``jax_tk`` (the decode kernel; the pure-JAX reference without a GPU),
``cudnn`` and ``xla`` (``jax.nn.dot_product_attention`` on the contiguous cache with
``key_value_seq_lengths``; paged rows are "unsupported"), ``fa3`` (``flash_mha_with_kvcache``, the
fastest of num_splits 1/4/16). Timing as for every op (``harness``, ``timers``): jitted calls, inputs
larger than L2, warm-up, median of ``--reps`` samples; each output is checked on batch 0 and key/value
head 0 against the float32 reference.

``--scan N``: each call is timed as N decode steps inside one jitted ``jax.lax.scan`` (the way a
generation loop runs: no dispatch between steps), every provider wrapped the same way
(``decode_providers.in_scan``): step i+1's query is step i's plus ``2**-10`` times its output, a
dependence XLA cannot fold, so no step is hoisted or merged; the time reported is the call's / N, per
step (it includes that update, one small fusion per step). The rows carry N (CSV column ``steps``; 1
for one call per step, and for CSVs from before the column) and the table's title says "per step
inside a lax.scan of N". The check reads the first step's output (the query unchanged). The cache is
the same in every step: one under the L2 (50 MiB on an H100) may be read from L2 by the later steps
(the note says so).

What is counted: bytes = ``2*B*S*K*H*itemsize`` (the valid keys and values, each read once; with
``--ragged``, ``2*sum(lengths)*K*H*itemsize``, each sequence's length uniform in [T_new, S]) plus the
query and the output (``2*B*T_new*N*H*itemsize``); TB/s = bytes / time. The ceiling is measured in the
same run: ``jnp.sum`` over a ``--ceiling-gb`` bf16 array (4 GiB on a GPU) in float32, bytes / time; the
table gives each row's time and TB/s per provider, jax_tk's speed-up over the faster of cudnn and fa3
(their time / jax_tk's: > 1 is faster), and jax_tk's TB/s as a fraction of the ceiling.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import cli, harness, output
from benchmarks.decode_providers import PEERS, PROVIDERS, default_providers, make_provider
from benchmarks.decode_report import plot_panels, ratio_table, tbs
from benchmarks.harness import Result, Skip
from benchmarks.timers import make_timer

DTYPES = {"bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16, "fp16": jnp.float16, "float16": jnp.float16}
LAYOUTS = {"contiguous": 0, "paged16": 16, "paged64": 64, "paged256": 256}

BATCHES = (1, 8, 32, 64, 128)
CACHES = (2048, 8192, 32768, 131072)
HEADS = ((32, 8), (64, 8))
HEAD_DIMS = (128, 256)
NEW_TOKENS = (1, 4, 16)
# The sinks' values: a fixed seed, so that every configuration of a head count gets the same ones.
SINK_SEED = 0
# A ragged batch's lengths: a fixed seed, so that every provider and run of a configuration reads the
# same ones.
LENGTH_SEED = 0
# Where the default set varies one setting at a time: (batch, cache length).
VARIATION_POINTS = ((8, 32768), (64, 8192))

QUICK = dict(batches=(1, 3), caches=(128, 512), heads=((4, 2),), head_dims=(64,), new_tokens=(1,),
             layouts=("contiguous",))
QUICK_POINTS = ((3, 256),)
CPU_MAX_BYTES = 4e9


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """One benchmarked problem. ``page_size`` 0: contiguous cache. ``sinks``: with attention sinks
    (``sink_values``). ``ceiling_tbs``: the read bandwidth measured in the run (not part of the
    configuration's identity). ``steps``: 1, one jitted call per decode step; N > 1, ``--scan N``: N
    steps inside one jitted ``lax.scan``, the time reported per step. ``ragged`` (``--ragged``): each
    sequence holds its own number of valid positions, uniform in [T_new, S] (``lengths``), as a
    server's batch does; else every sequence is full."""

    batch: int
    cache_len: int
    heads: int
    kv_heads: int
    head_dim: int
    new_tokens: int = 1
    page_size: int = 0
    dtype: str = "bf16"
    sinks: bool = False
    steps: int = 1
    ragged: bool = False
    ceiling_tbs: float = dataclasses.field(default=math.nan, compare=False)

    def __post_init__(self):
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.page_size and self.cache_len % self.page_size:
            raise ValueError(f"cache_len {self.cache_len} is not a multiple of page_size {self.page_size}")
        if self.new_tokens > self.cache_len:
            raise ValueError("new_tokens > cache_len")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return jnp.dtype(self.jnp_dtype).itemsize

    @property
    def shape_q(self):
        return (self.batch, self.new_tokens, self.heads, self.head_dim)

    @property
    def shape_cache(self):
        if self.page_size:
            return (self.batch * self.cache_len // self.page_size, self.page_size, self.kv_heads, self.head_dim)
        return (self.batch, self.cache_len, self.kv_heads, self.head_dim)

    @property
    def layout(self) -> str:
        return f"paged{self.page_size}" if self.page_size else "contiguous"

    def sink_values(self) -> np.ndarray | None:
        """The sinks of a ``sinks`` row, ``[heads]`` float32 standard normal (None elsewhere): the scale
        of the logits here (unit-variance q and k, scale 1/sqrt(D)). The kernel's cost does not depend
        on the values; at S in the thousands they change the output by well under the check's
        tolerance (a sink against S keys), so the check only sees them at small S (the tests)."""
        if not self.sinks:
            return None
        return np.random.default_rng(SINK_SEED).standard_normal(self.heads).astype(np.float32)

    def lengths(self) -> np.ndarray:
        """Each sequence's valid positions, int32 ``[batch]``: S, or for a ragged batch uniform in
        [T_new, S] (a fixed seed)."""
        if not self.ragged:
            return np.full((self.batch,), self.cache_len, np.int32)
        rng = np.random.default_rng(LENGTH_SEED)
        return rng.integers(self.new_tokens, self.cache_len, size=self.batch, endpoint=True).astype(np.int32)

    def cache_bytes(self) -> int:
        """The valid keys and values (each read once)."""
        return 2 * int(self.lengths().sum()) * self.kv_heads * self.head_dim * self.itemsize

    def bytes(self) -> int:
        """What a decode step must move: the valid cache, the query and the output."""
        return self.cache_bytes() + 2 * math.prod(self.shape_q) * self.itemsize

    def visible(self) -> int:
        """(query row, key) pairs per head of a full sequence."""
        return visible_keys(self.new_tokens, self.cache_len)

    def flops(self, mode: str = "fwd") -> float:
        pairs = sum(visible_keys(self.new_tokens, int(n)) for n in self.lengths()) if self.ragged else \
            self.batch * self.visible()
        return 4.0 * self.heads * self.head_dim * pairs

    def logits_bytes(self) -> int:
        return self.batch * self.heads * self.new_tokens * self.cache_len * 4

    def label(self) -> str:
        return (f"B={self.batch} S={self.cache_len} H={self.heads}/{self.kv_heads}kv D={self.head_dim} "
                f"T_new={self.new_tokens} {self.layout}" + (" + sinks" if self.sinks else "")
                + (" ragged lengths" if self.ragged else "") + (f" (scan of {self.steps})" if self.steps > 1 else ""))

    CSV_FIELDS = ("dtype", "batch", "cache_len", "heads", "kv_heads", "head_dim", "new_tokens", "page_size",
                  "sinks", "steps", "ragged", "bytes", "ceiling_tbs")

    def csv_row(self) -> dict:
        return {"dtype": self.dtype, "batch": self.batch, "cache_len": self.cache_len, "heads": self.heads,
                "kv_heads": self.kv_heads, "head_dim": self.head_dim, "new_tokens": self.new_tokens,
                "page_size": self.page_size, "sinks": self.sinks or "", "steps": self.steps,
                "ragged": self.ragged or "", "bytes": self.bytes(),
                "ceiling_tbs": harness.fmt_num(self.ceiling_tbs, 4)}

    @classmethod
    def from_row(cls, row: dict) -> "DecodeConfig":
        ceiling = row.get("ceiling_tbs") or ""
        return cls(int(row["batch"]), int(row["cache_len"]), int(row["heads"]), int(row["kv_heads"]),
                   int(row["head_dim"]), int(row["new_tokens"]), int(row["page_size"] or 0), row["dtype"],
                   sinks=row.get("sinks") == "True",  # (CSVs from before the column: no sinks)
                   steps=int(row.get("steps") or 1),  # (CSVs from before the column: one call per step)
                   ragged=row.get("ragged") == "True",  # (CSVs from before the column: full sequences)
                   ceiling_tbs=float(ceiling) if ceiling else math.nan)


def visible_keys(t_new: int, cache_len: int) -> int:
    """(query row, key) pairs per head and sequence, causal bottom-right aligned: row i of T_new sees
    S - T_new + i + 1 keys."""
    return t_new * cache_len - t_new * (t_new - 1) // 2


# ----------------------------------------------------------------------------------------------
# Configurations
# ----------------------------------------------------------------------------------------------


def product_configs(batches, caches, heads, head_dims, new_tokens, layouts, dtype="bf16") -> list[DecodeConfig]:
    return [DecodeConfig(b, s, n, k, d, t, LAYOUTS[lay], dtype)
            for lay in layouts for (n, k) in heads for d in head_dims for t in new_tokens
            for b in batches for s in caches]


def default_configs(quick: bool = False, dtype: str = "bf16") -> list[DecodeConfig]:
    """The grid B x S (first heads, head_dim, T_new, contiguous), then at each variation point one row
    per other setting (the other heads, head dims, T_new and layouts)."""
    q = QUICK if quick else dict(batches=BATCHES, caches=CACHES, heads=HEADS, head_dims=HEAD_DIMS,
                                 new_tokens=NEW_TOKENS, layouts=tuple(LAYOUTS))
    points = QUICK_POINTS if quick else VARIATION_POINTS
    (n, k), d, t = q["heads"][0], q["head_dims"][0], q["new_tokens"][0]
    configs = product_configs(q["batches"], q["caches"], [(n, k)], [d], [t], ["contiguous"], dtype)
    for b, s in points:
        variations = [DecodeConfig(b, s, n2, k2, d, t, 0, dtype) for n2, k2 in q["heads"][1:]]
        variations += [DecodeConfig(b, s, n, k, d2, t, 0, dtype) for d2 in q["head_dims"][1:]]
        variations += [DecodeConfig(b, s, n, k, d, t2, 0, dtype) for t2 in q["new_tokens"][1:]]
        variations += [DecodeConfig(b, s, n, k, d, t, LAYOUTS[lay], dtype) for lay in q["layouts"][1:]]
        configs += [c for c in variations if c not in configs]
    if quick:  # the quick set still goes through T_new > 1 and a paged cache
        b, s = points[0]
        configs += [DecodeConfig(b, s, n, k, d, 4, 0, dtype), DecodeConfig(b, s, n, k, d, 1, 16, dtype)]
    return configs


def with_sinks(configs: Sequence[DecodeConfig]) -> list[DecodeConfig]:
    """Each configuration followed by the same with sinks (the table's pairs)."""
    return [c2 for c in configs for c2 in (c, dataclasses.replace(c, sinks=True))]


# ----------------------------------------------------------------------------------------------
# Inputs, the correctness check, the ceiling
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def normal_rows(key, shape, dtype):
    """Standard normal ``shape`` generated one leading row at a time (no whole-array temporaries)."""
    keys = jax.random.split(key, shape[0])
    return jax.lax.map(lambda k: jax.random.normal(k, shape[1:], dtype), keys)


def input_bytes(cfg: DecodeConfig) -> int:
    """The inputs as allocated: the whole cache (a ragged batch's too) and the query."""
    return dataclasses.replace(cfg, ragged=False).cache_bytes() + math.prod(cfg.shape_q) * cfg.itemsize


def make_inputs(cfg: DecodeConfig, copies: int, max_bytes: float = math.inf, seed: int = 0) -> list[tuple]:
    """``copies`` sets (``timers.copies_for``) of (query, key_cache, value_cache, lengths, page_table or
    None, None), standard normal (never zeros). Raises Skip when they would not fit in ``max_bytes``."""
    check_fits(input_bytes(cfg), copies, max_bytes)
    lengths = jnp.asarray(cfg.lengths())
    table = page_table(cfg, seed)
    sets = []
    for i in range(copies):
        keys = jax.random.split(jax.random.key(seed + i), 3)
        cache_rows = (cfg.batch, cfg.cache_len, cfg.kv_heads, cfg.head_dim)
        k, v = (normal_rows(key, cache_rows, cfg.jnp_dtype).reshape(cfg.shape_cache) for key in keys[1:])
        q = normal_rows(keys[0], cfg.shape_q, cfg.jnp_dtype)
        sets.append((q, k, v, lengths, table, None))
    jax.block_until_ready(sets)
    return sets


def check_fits(set_bytes: int, copies: int, max_bytes: float) -> None:
    """Raises Skip where ``copies`` input sets of ``set_bytes`` would not fit in ``max_bytes``."""
    if set_bytes * copies > max_bytes:
        raise Skip(f"inputs {set_bytes * copies / 1e9:.1f} GB > --max-gb {max_bytes / 1e9:.1f} GB")


def page_table(cfg, seed: int = 0):
    """None for a contiguous cache (``cfg.page_size`` 0); else int32 ``[B, S / page_size]``, a random
    permutation of the pool's pages (a sequence's pages scattered over it)."""
    if not cfg.page_size:
        return None
    pages = cfg.cache_len // cfg.page_size
    perm = np.random.default_rng(seed).permutation(cfg.batch * pages).astype(np.int32)
    return jnp.asarray(perm.reshape(cfg.batch, pages))


def first_step(cfg, out):
    """The output the check reads: in a scan (``steps`` > 1, ``decode_providers.in_scan``) the first
    step's, the one call on the unchanged query."""
    return out[0] if cfg.steps > 1 else out


@functools.partial(jax.jit, static_argnames=("scale", "g"))
def _reference0(q, k, v, lengths, table, sinks, *, scale, g):
    """The float32 reference on sequence 0 and key/value head 0 (with its g query heads, and their
    ``sinks`` ``[g]`` or None)."""
    from jax_tk.decode import reference

    if table is not None:
        k, v = reference.gather_pages(k, table[:1]), reference.gather_pages(v, table[:1])
    return reference.attention(q[:1, :, :g], k[:1, :, :1], v[:1, :, :1], lengths[:1], scale=scale, is_causal=True,
                               sinks=sinks)


def check_fwd(cfg: DecodeConfig, provider, inputs, out) -> float:
    """Sequence 0, key/value head 0 against the float32 reference; in a scan (``steps`` > 1) on the
    first step's output (``decode_providers.in_scan``), the one call on the unchanged query."""
    out = first_step(cfg, out)
    g = cfg.heads // cfg.kv_heads
    q, k, v, lengths, table = inputs
    sinks = None if cfg.sink_values() is None else jnp.asarray(cfg.sink_values()[:g])
    ref = _reference0(q, k, v, lengths, table, sinks, scale=provider.scale, g=g)
    return harness.rel_err([out[:1, :, :g]], [ref])


def read_ceiling(timer, nbytes: int, dtype=jnp.bfloat16) -> float:
    """TB/s of ``jnp.sum`` (float32 accumulation) over a random ``nbytes`` array: the read bandwidth
    this device reaches in a plain XLA reduction."""
    n = nbytes // jnp.dtype(dtype).itemsize
    rows = max(1, n // 2**20)
    x = normal_rows(jax.random.key(123), (rows, n // rows), dtype)
    timing = timer.measure(jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32)), [(x,)])
    return x.size * x.dtype.itemsize / (timing.median_ms * 1e-3) / 1e12


def per_step(r: Result, by_key=None) -> None:
    """A result of a scanned configuration (``steps`` N > 1) timed N steps per call: its times become
    times per step (the call's / N)."""
    steps = r.config.steps
    if steps > 1:
        r.time_ms, r.min_ms, r.max_ms = r.time_ms / steps, r.min_ms / steps, r.max_ms / steps


def bench_decode(configs: Sequence[DecodeConfig], providers: Sequence[str], *, timer=None, check: bool = True,
                 max_bytes: float = math.inf, xla_max_bytes: float = 20e9,
                 on_result: Callable[[Result], None] | None = None,
                 log: Callable[[str], None] | None = print, op: tuple | None = None) -> list[Result]:
    """Times every provider on every configuration (mode ``fwd``), one configuration at a time; the
    times of scanned configurations (``steps`` > 1) per step. ``op``: another decode-style op's
    ``(make_provider, make_inputs, check_fwd)`` (``mla_decode``'s), default this module's."""
    make_p, make_i, check_f = op or (make_provider, make_inputs, check_fwd)
    op = harness.OpBench(make_provider=make_p, make_inputs=functools.partial(make_i, max_bytes=max_bytes),
                         input_bytes=input_bytes, check_fwd=check_f, on_result=per_step)
    return harness.run(op, configs, providers, ("fwd",), timer=timer, check=check,
                       max_scratch_bytes=xla_max_bytes, on_result=on_result, log=log)


# ----------------------------------------------------------------------------------------------
# Table and plot
# ----------------------------------------------------------------------------------------------


def _cell(r: Result) -> str:
    t = tbs(r)
    return f"{r.time_ms * 1e3:.1f} ({t:.3g})" if t == t else "-"


def _sinks_cost(by_key, cfg) -> str:
    """A sinks row: jax_tk's time over its time on the same configuration without sinks, - 1."""
    if not cfg.sinks:
        return ""
    tk = by_key.get((cfg, "jax_tk", "fwd"))
    base = by_key.get((dataclasses.replace(cfg, sinks=False), "jax_tk", "fwd"))
    if tk is None or base is None or tk.status != "ok" or base.status != "ok":
        return "-"
    return f"{tk.time_ms / base.time_ms - 1:+.1%}"


_COLUMNS = (
    ("B", 4, lambda c, m: c.batch), ("S", 7, lambda c, m: c.cache_len),
    ("N/K", 6, lambda c, m: f"{c.heads}/{c.kv_heads}"), ("D", 4, lambda c, m: c.head_dim),
    ("T", 2, lambda c, m: c.new_tokens), ("layout", 10, lambda c, m: c.layout),
    ("MB", 8, lambda c, m: f"{c.bytes() / 1e6:.4g}"),
)
_SINKS_COLUMN = ("sinks", 5, lambda c, m: "sinks" if c.sinks else "")
_LENGTHS_COLUMN = ("lengths", 7, lambda c, m: "ragged" if c.ragged else "full")


def format_table(results: Sequence[Result], providers: Sequence[str] | None = None) -> str:
    """One row per configuration: ``µs (TB/s)`` per provider, jax_tk's speed-up over the faster of
    cudnn/fa3, and jax_tk's TB/s as a fraction of the measured read ceiling; where there are sinks
    rows, a column marking them and one with their cost (``_sinks_cost``)."""
    if not results:
        return "(no results)"
    configs = list(dict.fromkeys(r.config for r in results))
    sinks = any(c.sinks for c in configs)
    columns = _COLUMNS + ((_SINKS_COLUMN,) if sinks else ()) + ((_LENGTHS_COLUMN,) if any(c.ragged for c in configs) else ())
    return ratio_table(results, providers, "decode attention", "TB/s of cache + query + output",
                       columns, _cell, " µs (TB/s)", 18, PEERS,
                       extra=(("sinks cost", 10, _sinks_cost),) if sinks else ())


def plot(results: Sequence[Result], path: str, env: dict) -> list[str]:
    """TB/s against cache length, one panel per (batch, heads, head_dim, T_new, layout) group of rows,
    the ceiling as a dashed line."""
    return plot_panels(
        results, path, env, "decode attention",
        panel=lambda c: (c.heads, c.kv_heads, c.head_dim, c.new_tokens, c.page_size, c.steps, c.ragged),
        panel_title=lambda k: f"N/K={k[0]}/{k[1]} D={k[2]} T_new={k[3]} " + (f"paged{k[4]}" if k[4] else "contiguous")
        + (f", per step in a scan of {k[5]}" if k[5] > 1 else "") + (", ragged lengths" if k[6] else ""),
        series=lambda r: (f"{r.provider}{' + sinks' if r.config.sinks else ''} B={r.config.batch}", r.config.sinks))


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def heads_list(text: str) -> list[tuple[int, int]]:
    """'32/8,64/8' -> [(32, 8), (64, 8)]."""
    out = []
    for part in text.replace(" ", ",").split(","):
        if part:
            n, _, k = part.partition("/")
            out.append((int(n), int(k or n)))
    return out


def _csv(items) -> str:
    return ",".join(map(str, items))


def _heads(heads) -> str:
    return ",".join(f"{n}/{k}" for n, k in heads)


def _steps(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"--scan takes a number of steps >= 1, got {n}")
    return n


def add_arguments(a) -> None:
    a.add_argument("--batch", type=cli.int_list, default=None, help=f"batch sizes (default {_csv(BATCHES)})")
    a.add_argument("--cache", type=cli.int_list, default=None,
                   help=f"cache lengths, 'k' = 1024 (default {_csv(CACHES)})")
    a.add_argument("--heads", type=heads_list, default=None,
                   help=f"query/key-value heads, e.g. 32/8,64/8 (default {_heads(HEADS[:1])}; "
                        f"with --full {_heads(HEADS)})")
    a.add_argument("--d", type=cli.int_list, default=None,
                   help=f"head dims (default {HEAD_DIMS[0]}; with --full {_csv(HEAD_DIMS)})")
    a.add_argument("--new", type=cli.int_list, default=None,
                   help=f"new tokens per sequence (default {NEW_TOKENS[0]}; with --full {_csv(NEW_TOKENS)})")
    a.add_argument("--layout", type=cli.str_list(tuple(LAYOUTS)), default=None,
                   help=f"from {_csv(LAYOUTS)} (default contiguous; with --full all)")
    a.add_argument("--full", action="store_true",
                   help="the whole product of the lists (long); with no list and no --full, the grid of batch "
                        "sizes x cache lengths at the default heads, head dim, new tokens and layout, plus, at a "
                        "few points of that grid, one row for each other setting of these")
    a.add_argument("--sinks", action="store_true",
                   help="run every configuration twice, without and with attention sinks (only jax_tk takes "
                        "them; the table gives their cost against the same call without)")
    a.add_argument("--ragged", action="store_true",
                   help="each sequence's length uniform in [T_new, S] (a fixed seed) instead of S, as a server's "
                        "batch; bytes and FLOPs count each sequence's own length")
    add_run_arguments(a)
    cli.add_common_arguments(a, op="decode", providers=PROVIDERS, default_providers=",".join(PROVIDERS),
                             modes=("fwd",), default_modes=("fwd",), dtypes=DTYPES,
                             quick_help="tiny shapes (runs on CPU in seconds)")


def add_run_arguments(a) -> None:
    """The options of how a decode-style op runs (also ``mla_decode``'s): --scan, --max-gb,
    --xla-max-gb, --ceiling-gb."""
    a.add_argument("--scan", type=_steps, default=1, metavar="N",
                   help="time each call as N dependent decode steps inside one jitted lax.scan (as a generation "
                        "loop runs), the time reported per step (default 1: one jitted call per step)")
    a.add_argument("--max-gb", type=float, default=None,
                   help="skip configurations whose inputs exceed this (default 60%% of the GPU's memory; 4 on CPU)")
    a.add_argument("--xla-max-gb", type=float, default=20.0,
                   help="skip xla where its float32 logits exceed this (default 20)")
    a.add_argument("--ceiling-gb", type=float, default=None, help="GiB of the read-ceiling array (default 4 on a GPU, 1/16 otherwise)")


def _device_bytes() -> float | None:
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend has them
        stats = {}
    return stats.get("bytes_limit")


def dtype_name(args) -> str:
    """--dtype as the configurations name it (bf16, fp16)."""
    return {"bfloat16": "bf16", "float16": "fp16"}.get(args.dtype, args.dtype)


def configs_from(args) -> list[DecodeConfig]:
    dtype = dtype_name(args)
    if args.scan < 1:
        raise ValueError(f"--scan takes a number of steps >= 1, got {args.scan}")
    configs = [dataclasses.replace(c, steps=args.scan, ragged=args.ragged) for c in _configs_from_lists(args, dtype)]
    return with_sinks(configs) if args.sinks else configs


def _configs_from_lists(args, dtype: str) -> list[DecodeConfig]:
    lists = (args.batch, args.cache, args.heads, args.d, args.new, args.layout)
    if not args.full and all(x is None for x in lists):
        return default_configs(args.quick, dtype)
    q = QUICK if args.quick else None
    if args.full:
        default = (BATCHES, CACHES, HEADS, HEAD_DIMS, NEW_TOKENS, tuple(LAYOUTS)) if q is None else \
            (q["batches"], q["caches"], q["heads"], q["head_dims"], (1, 4), ("contiguous", "paged16"))
    else:  # lists not given: the grid's setting
        default = (BATCHES, CACHES, HEADS[:1], HEAD_DIMS[:1], NEW_TOKENS[:1], ("contiguous",)) if q is None else \
            (q["batches"], q["caches"], q["heads"], q["head_dims"], q["new_tokens"], q["layouts"])
    chosen = [given if given is not None else d for given, d in zip(lists, default)]
    return product_configs(*chosen, dtype=dtype)


def run_op(args, command: cli.Command, configs: Sequence, providers: Sequence[str], bytes_note: str,
           op: tuple | None = None) -> int:
    """Runs a decode-style op (``decode``, ``mla_decode``) from its command line: the options of
    ``add_run_arguments`` and the shared ones, the read ceiling measured first (into every
    configuration's ``ceiling_tbs``), then ``bench_decode(..., op=op)``, the CSV, table and plot."""
    reps = cli.reps_from(args)
    timer = make_timer(args.timer, reps, quick=args.quick, rounds=args.rounds)
    device = _device_bytes()
    max_bytes = args.max_gb * 1e9 if args.max_gb is not None else (0.6 * device if device else CPU_MAX_BYTES)
    if args.ceiling_gb is not None:
        ceiling_bytes = int(args.ceiling_gb * 2**30)
    else:
        ceiling_bytes = 4 * 2**30 if harness.has_gpu() and not args.quick else 2**26
    ceiling = read_ceiling(timer, ceiling_bytes)
    configs = [dataclasses.replace(c, ceiling_tbs=ceiling) for c in configs]
    csv_path, png_path = cli.output_paths(args, command.name)
    env = output.environment(timer.name)
    header = [f"# jax_tk {command.name} benchmark: {output.env_header(env)}",
              f"# providers={','.join(providers)} configurations={len(configs)} reps={reps} "
              f"max inputs {max_bytes / 1e9:.3g} GB; {bytes_note}"
              + (f"; per step of {args.scan} inside one jitted lax.scan" if args.scan > 1 else ""),
              f"# read ceiling: jnp.sum over {ceiling_bytes / 2**30:.3g} GiB bf16: {ceiling:.3g} TB/s"]
    bench = functools.partial(bench_decode, configs, providers, timer=timer, check=not args.no_check,
                              max_bytes=max_bytes, xla_max_bytes=args.xla_max_gb * 1e9, op=op)
    return cli.run_and_write(command, env=env, header=header, csv_path=csv_path, png_path=png_path,
                             providers=providers, bench=bench)


def run_decode(args) -> int:
    return run_op(args, COMMAND, configs_from(args), args.providers or default_providers(),
                  ("each without and with sinks; " if args.sinks else "")
                  + ("bytes = 2*sum(lengths)*K*H*itemsize (valid K and V; lengths ragged) + query + output"
                     if args.ragged else "bytes = 2*B*S*K*H*itemsize (valid K and V) + query + output"))


COMMAND = cli.register(cli.Command(
    "decode", "decode attention over a KV cache (bytes of cache read)", add_arguments, run_decode,
    config_type=DecodeConfig, format_table=format_table, plot=plot))
