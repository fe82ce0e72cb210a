"""MLA decode benchmark: jax_tk.decode.mla_attention's kernel against its pure-JAX reference (XLA), in
FLOPs and bytes of latent cache read.

Command line::

    python -m benchmarks mla_decode                  # the default set (16 rows)
    python -m benchmarks mla_decode --quick          # tiny shapes (seconds, CPU too)
    python -m benchmarks mla_decode --batch 1,132 --cache 1k,64k --heads 16,64,128 --new 1,2,4 \\
        --layout contiguous,paged64                    # the product of the lists given
    python -m benchmarks mla_decode --full           # every combination below (long)
    python -m benchmarks mla_decode --scan 16 --timer cupti   # per step, 16 steps inside one lax.scan

MLA (DeepSeek's multi-head latent attention) at decode time, as FlashMLA runs it: every query head
attends over one cache of latent rows of 576 dims (512 latent + 64 rotary); the rows are the keys and
their first 512 dims the values (``jax_tk.decode.mla_attention(query, latent_cache, cache_lengths,
page_table=..., v_head_dim=512)``, query ``[B, T_new, H, 576]``, output ``[B, T_new, H, 512]``).

A configuration: batch B in {1, 8, 32, 64, 132}, cache length S in {1k, 4k, 16k, 64k} (every sequence
holds S valid positions), query heads H in {16, 64, 128}, T_new in {1, 2, 4} new tokens per sequence
(causal, bottom-right aligned), bf16; the latent cache contiguous ``[B, S, 1, 576]`` or paged, pages
of 64 rows (``[B*S/64, 64, 1, 576]``, the page table a random permutation of the pool's pages).
The default set: B in {8, 64}, S in {4k, 16k}, H in {16, 128}, T_new 1, both layouts (16 rows); each
list given replaces its default, ``--full`` makes the others the whole lists above. Configurations
whose inputs do not fit in ``--max-gb`` are skipped.

Providers: ``jax_tk`` (``implementation="tk"``, the kernel; on H100/H200 only: elsewhere skipped,
"unavailable"), ``xla`` (``implementation="xla"``, the pure-JAX reference; it materializes float32
logits ``[B, H, T_new, S]``, and skips rows where these exceed ``--xla-max-gb``). Each output is
checked on batch 0 (every head) against the float32 reference, the ``err`` of the log.

What is counted: FLOPs = ``2*B*H*(576 + 512)*visible``, ``visible`` the (query row, key) pairs of a
head and sequence (``S`` for T_new = 1; row i of T_new > 1 sees ``S - T_new + 1 + i`` keys); bytes =
the latent cache read once (``B*S*576*itemsize``) plus the query and the output
(``B*T_new*H*(576 + 512)*itemsize``), TB/s = bytes / time. Timing, ``--scan N``, the read ceiling and
the CSV are the ``decode`` benchmark's (see ``benchmarks/decode.py``): the table gives each row's time,
TFLOP/s and TB/s per provider, jax_tk's speed-up over xla and jax_tk's TB/s as a share of the read
ceiling measured in the same run.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar, Sequence

import jax
import jax.numpy as jnp

from benchmarks import cli, decode, decode_providers, harness
from benchmarks.decode_report import plot_panels, ratio_table, tbs
from benchmarks.harness import Provider, Result, Unavailable

HEAD_DIM = 576  # DeepSeek's latent rows: 512 latent dims + 64 rotary dims
V_HEAD_DIM = 512
LAYOUTS = {"contiguous": 0, "paged64": 64}

BATCHES = (1, 8, 32, 64, 132)
CACHES = (1024, 4096, 16384, 65536)
HEADS = (16, 64, 128)
NEW_TOKENS = (1, 2, 4)
DEFAULT = dict(batches=(8, 64), caches=(4096, 16384), heads=(16, 128), new_tokens=(1,), layouts=tuple(LAYOUTS))
FULL = dict(batches=BATCHES, caches=CACHES, heads=HEADS, new_tokens=NEW_TOKENS, layouts=tuple(LAYOUTS))
QUICK = dict(batches=(2,), caches=(128,), heads=(4,), new_tokens=(1, 2), layouts=tuple(LAYOUTS))
LOGITS = "float32 [B, H, T_new, S] logits"


@dataclasses.dataclass(frozen=True)
class MlaDecodeConfig(decode.DecodeConfig):
    """A decode configuration with one latent head of ``head_dim`` 576 that is both keys and values
    (the first ``v_head_dim`` dims): ``MlaDecodeConfig(batch, cache_len, heads, new_tokens=...,
    page_size=..., steps=...)``. Its shapes, layout and visible keys are ``decode.DecodeConfig``'s;
    its bytes count the cache once, its FLOPs ``2*(D + Dv)`` per visible (row, key) pair."""

    kv_heads: int = 1
    head_dim: int = HEAD_DIM
    v_head_dim: int = V_HEAD_DIM

    def __post_init__(self):
        super().__post_init__()
        if self.kv_heads != 1 or self.sinks:
            raise ValueError("an MLA configuration has one latent head and no sinks")
        if not 1 <= self.v_head_dim <= self.head_dim:
            raise ValueError(f"v_head_dim {self.v_head_dim} not in [1, head_dim {self.head_dim}]")

    def cache_bytes(self) -> int:
        """The latent rows, each read once (as key and as value)."""
        return self.batch * self.cache_len * self.head_dim * self.itemsize

    def bytes(self) -> int:
        """The latent cache, the query ``[B, T_new, H, D]`` and the output ``[B, T_new, H, Dv]``."""
        return self.cache_bytes() + self.batch * self.new_tokens * self.heads * (
            self.head_dim + self.v_head_dim) * self.itemsize

    def flops(self, mode: str = "fwd") -> float:
        return 2.0 * self.batch * self.heads * (self.head_dim + self.v_head_dim) * self.visible()

    def label(self) -> str:
        return (f"MLA B={self.batch} S={self.cache_len} H={self.heads} D={self.head_dim}/{self.v_head_dim} "
                f"T_new={self.new_tokens} {self.layout}" + (f" (scan of {self.steps})" if self.steps > 1 else ""))

    CSV_FIELDS: ClassVar[tuple] = ("dtype", "batch", "cache_len", "heads", "head_dim", "v_head_dim", "new_tokens",
                                   "page_size", "steps", "bytes", "ceiling_tbs")

    def csv_row(self) -> dict:
        row = super().csv_row()
        return {k: (self.v_head_dim if k == "v_head_dim" else row[k]) for k in self.CSV_FIELDS}

    @classmethod
    def from_row(cls, row: dict) -> "MlaDecodeConfig":
        ceiling = row.get("ceiling_tbs") or ""
        return cls(int(row["batch"]), int(row["cache_len"]), int(row["heads"]), new_tokens=int(row["new_tokens"]),
                   page_size=int(row["page_size"] or 0), dtype=row["dtype"], steps=int(row.get("steps") or 1),
                   head_dim=int(row["head_dim"]), v_head_dim=int(row["v_head_dim"]),
                   ceiling_tbs=float(ceiling) if ceiling else math.nan)


def product_configs(batches, caches, heads, new_tokens, layouts, dtype="bf16", steps=1) -> list[MlaDecodeConfig]:
    return [MlaDecodeConfig(b, s, h, new_tokens=t, page_size=LAYOUTS[lay], dtype=dtype, steps=steps)
            for lay in layouts for h in heads for t in new_tokens for b in batches for s in caches]


# ----------------------------------------------------------------------------------------------
# Providers, inputs, the check
# ----------------------------------------------------------------------------------------------


def _mla_fn(cfg: MlaDecodeConfig, scale: float, implementation: str):
    import jax_tk

    def fn(q, latent_cache, lengths, page_table):
        return jax_tk.decode.mla_attention(q, latent_cache, lengths, page_table=page_table, v_head_dim=cfg.v_head_dim,
                                           scale=scale, is_causal=True, implementation=implementation)

    return fn


def _jax_tk_provider(cfg: MlaDecodeConfig, scale: float) -> Provider:
    from jax_tk.decode import mla

    if not harness.has_gpu():
        raise Unavailable("the MLA kernel needs a CUDA GPU (H100/H200)")
    reason = mla.kernel_unsupported_reason(jax.ShapeDtypeStruct(cfg.shape_q, cfg.jnp_dtype),
                                           jax.ShapeDtypeStruct(cfg.shape_cache, cfg.jnp_dtype), cfg.v_head_dim)
    if reason is not None:
        raise Unavailable(f"the MLA kernel does not take {reason}")
    return Provider("jax_tk", _mla_fn(cfg, scale, "tk"), scale, note="mla_attention(implementation='tk')")


def _xla_provider(cfg: MlaDecodeConfig, scale: float) -> Provider:
    return Provider("xla", _mla_fn(cfg, scale, "xla"), scale, scratch_bytes=cfg.logits_bytes(), scratch_what=LOGITS,
                    note="mla_attention(implementation='xla'): the pure-JAX reference")


FACTORIES = {"jax_tk": _jax_tk_provider, "xla": _xla_provider}
PROVIDERS = tuple(FACTORIES)


def make_provider(name: str, cfg: MlaDecodeConfig) -> Provider:
    p = harness.factory(FACTORIES, name)(cfg, 1.0 / math.sqrt(cfg.head_dim))
    return decode_providers.for_steps(p, cfg)


def make_inputs(cfg: MlaDecodeConfig, copies: int, max_bytes: float = math.inf, seed: int = 0) -> list[tuple]:
    """``copies`` sets of (query, latent_cache, lengths, page_table or None, None), standard normal.
    Raises Skip when they would not fit in ``max_bytes``."""
    decode.check_fits(decode.input_bytes(cfg), copies, max_bytes)
    lengths = jnp.full((cfg.batch,), cfg.cache_len, jnp.int32)
    table = decode.page_table(cfg, seed)
    sets = []
    for i in range(copies):
        kq, kc = jax.random.split(jax.random.key(seed + i))
        rows = (cfg.batch, cfg.cache_len, 1, cfg.head_dim)
        cache = decode.normal_rows(kc, rows, cfg.jnp_dtype).reshape(cfg.shape_cache)
        sets.append((decode.normal_rows(kq, cfg.shape_q, cfg.jnp_dtype), cache, lengths, table, None))
    jax.block_until_ready(sets)
    return sets


@functools.partial(jax.jit, static_argnames=("scale", "v_head_dim"))
def _reference0(q, latent_cache, lengths, table, *, scale, v_head_dim):
    """The float32 reference on sequence 0, every head (its inputs in float32: its output is not
    rounded to the query's dtype, so the xla provider, the same reference in bf16, is checked too)."""
    from jax_tk.decode import reference

    cache = latent_cache[:1] if table is None else reference.gather_pages(latent_cache, table[:1])
    return reference.mla_attention_with_lse(q[:1].astype(jnp.float32), cache.astype(jnp.float32), lengths[:1],
                                            scale=scale, v_head_dim=v_head_dim, is_causal=True)[0]


def check_fwd(cfg: MlaDecodeConfig, provider: Provider, inputs, out) -> float:
    q, latent_cache, lengths, table = inputs
    ref = _reference0(q, latent_cache, lengths, table, scale=provider.scale, v_head_dim=cfg.v_head_dim)
    return harness.rel_err([decode.first_step(cfg, out)[:1]], [ref])


OP = (make_provider, make_inputs, check_fwd)


def bench_mla_decode(configs: Sequence[MlaDecodeConfig], providers: Sequence[str], **kw) -> list[Result]:
    """``decode.bench_decode`` (its keywords: timer, check, max_bytes, xla_max_bytes, on_result, log)
    on MLA configurations."""
    return decode.bench_decode(configs, providers, op=OP, **kw)


# ----------------------------------------------------------------------------------------------
# Table, plot, command line
# ----------------------------------------------------------------------------------------------


def _cell(r: Result) -> str:
    t = tbs(r)
    return f"{r.time_ms * 1e3:.1f} ({r.tflops:.3g}, {t:.3g})" if t == t else "-"


_COLUMNS = (
    ("B", 4, lambda c, m: c.batch), ("S", 6, lambda c, m: c.cache_len), ("H", 4, lambda c, m: c.heads),
    ("T", 2, lambda c, m: c.new_tokens), ("layout", 10, lambda c, m: c.layout),
    ("MB", 8, lambda c, m: f"{c.bytes() / 1e6:.4g}"),
)


def format_table(results: Sequence[Result], providers: Sequence[str] | None = None) -> str:
    """One row per configuration: ``µs (TFLOP/s, TB/s)`` per provider, jax_tk's speed-up over xla, and
    jax_tk's TB/s as a share of the measured read ceiling."""
    if not results:
        return "(no results)"
    return ratio_table(results, providers, "MLA decode (D 576, Dv 512)",
                       "TFLOP/s, TB/s of latent cache + query + output", _COLUMNS, _cell, " µs (TFLOP/s, TB/s)",
                       26, peers=("xla",))


def plot(results: Sequence[Result], path: str, env: dict) -> list[str]:
    """TB/s against cache length, one panel per (heads, T_new, layout), a line per provider and batch."""
    return plot_panels(
        results, path, env, "MLA decode", panel=lambda c: (c.heads, c.new_tokens, c.page_size, c.steps),
        panel_title=lambda k: f"H={k[0]} T_new={k[1]} " + (f"paged{k[2]}" if k[2] else "contiguous")
        + (f", per step in a scan of {k[3]}" if k[3] > 1 else ""),
        series=lambda r: (f"{r.provider} B={r.config.batch}", False))


def _csv(items) -> str:
    return ",".join(map(str, items))


def add_arguments(a) -> None:
    for flag, key, what in (("--batch", "batches", "batch sizes"), ("--cache", "caches", "cache lengths, 'k' = 1024"),
                            ("--heads", "heads", "query heads"), ("--new", "new_tokens", "new tokens per sequence")):
        a.add_argument(flag, type=cli.int_list, default=None,
                       help=f"{what} (default {_csv(DEFAULT[key])}; with --full {_csv(FULL[key])})")
    a.add_argument("--layout", type=cli.str_list(tuple(LAYOUTS)), default=None,
                   help=f"from {_csv(LAYOUTS)} (default both)")
    a.add_argument("--full", action="store_true",
                   help="the whole product of the lists (long); with no --full, the lists not given take their "
                        "default")
    decode.add_run_arguments(a)
    cli.add_common_arguments(a, op="mla_decode", providers=PROVIDERS, default_providers=_csv(PROVIDERS),
                             modes=("fwd",), default_modes=("fwd",), dtypes=decode.DTYPES,
                             quick_help="tiny shapes (runs on CPU in seconds)")


def configs_from(args) -> list[MlaDecodeConfig]:
    if args.scan < 1:
        raise ValueError(f"--scan takes a number of steps >= 1, got {args.scan}")
    base = QUICK if args.quick else FULL if args.full else DEFAULT
    given = dict(batches=args.batch, caches=args.cache, heads=args.heads, new_tokens=args.new, layouts=args.layout)
    chosen = {k: v if v is not None else base[k] for k, v in given.items()}
    return product_configs(**chosen, dtype=decode.dtype_name(args), steps=args.scan)


def run_mla_decode(args) -> int:
    return decode.run_op(args, COMMAND, configs_from(args), args.providers or list(PROVIDERS),
                         "bytes = B*S*576*itemsize (the latent cache, read once) + query + output; "
                         "FLOPs = 2*B*H*(576 + 512)*visible keys", op=OP)


COMMAND = cli.register(cli.Command(
    "mla_decode", "MLA decode attention over one latent cache (FLOPs and bytes of cache read)", add_arguments,
    run_mla_decode, config_type=MlaDecodeConfig, format_table=format_table, plot=plot))
