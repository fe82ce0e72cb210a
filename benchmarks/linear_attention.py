"""Linear-attention benchmark: ``jax_tk.linear_attention.simple_gla`` and ``gated_delta_rule`` (whole
sequences, training) against the chunked XLA path and jax-linear-attention's Mosaic GPU kernels.

Command line::

    python -m benchmarks linear_attention                      # both ops, the three rows, fwd and fwd_bwd
    python -m benchmarks linear_attention --quick              # a tiny row (seconds, CPU too)
    python -m benchmarks linear_attention --ops gated_delta_rule --shapes 1x32k --modes fwd --timer cupti

Rows (``--shapes``; q, k ``[B, T, H, K]``, v ``[B, T, H, V]``, as many value heads as q/k heads):

- ``4x4k``: B=4, T=4096, H=16, K=V=128
- ``1x32k``: B=1, T=32768, H=32, K=V=128 (one long sequence)
- ``16x2k``: B=16, T=2048, H=16, K=V=64
- ``--quick``: ``tiny``, B=1, T=256, H=2, K=V=64

Inputs: q, k, v and the output cotangent standard normal in bf16 (``--dtype``); g, the log decay,
``-0.1 * uniform[0, 1)`` in float32 (a state that carries across chunks: about ``exp(-3.2)`` per chunk
of 64); beta ``sigmoid(normal)`` in float32, in (0, 1). The scale is ``K ** -0.5``; the gated delta rule
runs with ``use_qk_l2norm=True`` (Qwen3-Next); no initial state, no final state returned.

Providers (``linear_attention_providers``): ``jax_tk`` (``implementation=None``), ``xla``
(``implementation="xla"``, the chunked XLA path), ``jla`` (jax-linear-attention's Mosaic GPU kernels,
Hopper; default where installed). Modes: ``fwd``, ``bwd`` (the backward alone), ``fwd_bwd`` (default
``fwd,fwd_bwd``); the backward is the gradient w.r.t. q, k, v, g (and beta) of ``sum(o * dout)``,
``dout`` a fixed random cotangent. Every ``fwd`` output (``bwd``: every gradient; ``fwd_bwd``: both) is
checked on batch 0 against the chunked XLA path in float32.

What is counted (the chunked algorithm, chunks of C = 64 tokens, per token and per value head):

- simple GLA: ``Q K^T`` (2*C*K), ``(P) V`` (2*C*V), ``Q S`` (2*K*V), ``K^T V`` into the state (2*K*V):
  ``2*(C*K + C*V + 2*K*V)``;
- gated delta rule (the WY/UT form): those four, plus ``beta K K^T`` (2*C*K), the unit lower-triangular
  inverse ``T = (I + A)^-1`` of a C x C matrix (C**3/3 per chunk: C**2/3 per token), ``W = T beta K``
  (2*C*K), ``U = T beta V`` (2*C*V), and ``W S`` (2*K*V): ``2*(3*C*K + 2*C*V + 3*K*V) + C**2/3``.

times B*T*HV. The intra-chunk products are counted whole (the kernels compute them whole, then mask),
the gating, the l2 norm and the cumulated decays not at all. The backward is counted as 2x the forward
(``bwd`` 2x, ``fwd_bwd`` 3x, as the GEMMs: every product has two gradient products). For K=V=128 that
is 98,304 FLOPs per token and head for simple GLA and 181,589 for the gated delta rule.

The table: per mode, one row per (shape, op), ``ms (TFLOP/s)`` per provider, and jax_tk's speed-up over
the fastest peer (``tk/best``: xla or jla).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from benchmarks import cli, gemm, harness, output, peers
from benchmarks import linear_attention_providers as lap
from benchmarks.attention_report import best_peer_grids
from benchmarks.harness import Result
from benchmarks.timers import make_timer

CHUNK = 64  # the chunk of the FLOP formula (jax_tk's and jla's kernels both take 64 tokens)
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
MODES = ("fwd", "bwd", "fwd_bwd")
DEFAULT_MODES = ("fwd", "fwd_bwd")
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.0, "fwd_bwd": 3.0}
SHAPES = {  # name: (B, T, H, K, V)
    "4x4k": (4, 4096, 16, 128, 128),
    "1x32k": (1, 32768, 32, 128, 128),
    "16x2k": (16, 2048, 16, 64, 64),
}
QUICK_SHAPES = {"tiny": (1, 256, 2, 64, 64)}
OPS = lap.OPS
DECAY = 0.1  # g = -DECAY * uniform[0, 1)


def flops_per_token_head(op: str, k: int, v: int, chunk: int = CHUNK) -> float:
    """Forward FLOPs per token and value head of the chunked algorithm (the module's docstring)."""
    if op == lap.GLA:
        return 2.0 * (chunk * k + chunk * v + 2 * k * v)
    if op == lap.GDR:
        return 2.0 * (3 * chunk * k + 2 * chunk * v + 3 * k * v) + chunk * chunk / 3.0
    raise ValueError(f"unknown op {op!r}: choose from {', '.join(OPS)}")


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
    """One call: ``op`` on q, k ``[batch, seq_len, heads, head_dim]``, v ``[batch, seq_len,
    value_heads, v_head_dim]`` (value_heads 0: as many as heads)."""

    op: str
    shape: str
    batch: int
    seq_len: int
    heads: int
    head_dim: int
    v_head_dim: int
    value_heads: int = 0
    dtype: str = "bf16"
    chunk: int = CHUNK

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}: choose from {', '.join(OPS)}")
        if self.value_heads == 0:
            object.__setattr__(self, "value_heads", self.heads)
        if self.value_heads % self.heads:
            raise ValueError(f"value_heads {self.value_heads} must be a multiple of heads {self.heads}")

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def shape_qk(self) -> tuple:
        return (self.batch, self.seq_len, self.heads, self.head_dim)

    @property
    def shape_v(self) -> tuple:
        return (self.batch, self.seq_len, self.value_heads, self.v_head_dim)

    @property
    def shape_gate(self) -> tuple:
        return (self.batch, self.seq_len, self.value_heads)

    def flops(self, mode: str = "fwd") -> float:
        if mode not in MODE_FLOP_FACTOR:
            raise ValueError(f"unknown mode {mode!r}")
        tokens = self.batch * self.seq_len * self.value_heads
        per_token = flops_per_token_head(self.op, self.head_dim, self.v_head_dim, self.chunk)
        return tokens * per_token * MODE_FLOP_FACTOR[mode]

    def label(self) -> str:
        hv = f"/{self.value_heads}" if self.value_heads != self.heads else ""
        return (f"{self.op} B={self.batch} T={self.seq_len} H={self.heads}{hv} "
                f"K={self.head_dim} V={self.v_head_dim}")

    CSV_FIELDS = ("op", "shape", "dtype", "batch", "seq_len", "heads", "value_heads", "head_dim", "v_head_dim",
                  "chunk")

    def csv_row(self) -> dict:
        return {f: getattr(self, f) for f in self.CSV_FIELDS}

    @classmethod
    def from_row(cls, row: dict) -> "LinearAttentionConfig":
        text = ("op", "shape", "dtype")
        return cls(**{f: row[f] if f in text else int(row[f]) for f in cls.CSV_FIELDS if row.get(f, "") != ""})


def configs(shapes: dict, names: Sequence[str], ops: Sequence[str],
            dtype: str = "bf16") -> list[LinearAttentionConfig]:
    return [LinearAttentionConfig(op, name, *shapes[name], dtype=dtype) for name in names for op in ops]


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


def input_bytes(cfg: LinearAttentionConfig) -> int:
    item = jnp.dtype(cfg.jnp_dtype).itemsize
    gates = 2 if cfg.op == lap.GDR else 1
    return (2 * math.prod(cfg.shape_qk) * item + 2 * math.prod(cfg.shape_v) * item
            + gates * math.prod(cfg.shape_gate) * 4)


@functools.partial(jax.jit, static_argnames=("shape",))
def _gates(key, shape):
    """g = -DECAY * uniform[0, 1) and beta = sigmoid(normal), float32."""
    kg, kb = jax.random.split(key)
    return -DECAY * jax.random.uniform(kg, shape), jax.nn.sigmoid(jax.random.normal(kb, shape))


def make_inputs(cfg: LinearAttentionConfig, copies: int, seed: int = 0) -> list[tuple]:
    """``copies`` sets of (q, k, v, g[, beta], dout): q, k, v, dout standard normal in the benchmark
    dtype, g and beta float32 (``_gates``); beta only for the gated delta rule."""
    sets = []
    normal = harness.random_normal_sets([cfg.shape_qk, cfg.shape_qk, cfg.shape_v, cfg.shape_v], cfg.jnp_dtype,
                                        copies, seed)
    for i, (q, k, v, dout) in enumerate(normal):
        g, beta = _gates(jax.random.key(10_000 + seed + i), cfg.shape_gate)
        sets.append((q, k, v, g, beta, dout) if cfg.op == lap.GDR else (q, k, v, g, dout))
    jax.block_until_ready(sets)
    return sets


BENCH = harness.OpBench(make_provider=lap.make_provider, make_inputs=make_inputs, input_bytes=input_bytes,
                        check_fwd=lap.check_fwd, check_bwd=lap.check_bwd)


def default_providers() -> list[str]:
    return [p for p in lap.PROVIDERS if p not in peers.PEERS] + peers.installed_peers(
        [p for p in lap.PROVIDERS if p in peers.PEERS])


def bench_linear_attention(configs: Sequence[LinearAttentionConfig], providers: Sequence[str] | None = None,
                           modes: Sequence[str] = DEFAULT_MODES, *, timer=None, check: bool = True,
                           on_result: Callable[[Result], None] | None = None,
                           log: Callable[[str], None] | None = print) -> list[Result]:
    return harness.run(BENCH, configs, providers or default_providers(), modes, timer=timer, check=check,
                       on_result=on_result, log=log)


# ----------------------------------------------------------------------------------------------
# Table, plot, command line
# ----------------------------------------------------------------------------------------------


_COLUMNS = (
    ("op", 16, lambda c, m: c.op), ("B", 3, lambda c, m: c.batch), ("T", 6, lambda c, m: c.seq_len),
    ("H", 3, lambda c, m: c.heads), ("K", 4, lambda c, m: c.head_dim), ("V", 4, lambda c, m: c.v_head_dim),
    ("GFLOP", 8, lambda c, m: f"{c.flops(m) / 1e9:.4g}"),
)


def format_table(results: Sequence[Result], providers: Sequence[str] | None = None) -> str:
    """Per mode: one row per (shape, op), ``ms (TFLOP/s)`` per provider, and jax_tk's speed-up over the
    fastest peer (``tk/best``); the results not timed and the wrong ones below."""
    if not results:
        return "(no results)"
    providers = providers or list(dict.fromkeys(r.provider for r in results))
    lines = best_peer_grids(results, providers, "linear attention",
                            f"the chunked algorithm, C={CHUNK}; backward 2x forward", _COLUMNS, tk_width=12)
    lines += output.format_problems(results)
    return "\n".join(lines).rstrip() + "\n"


def plot(results: Sequence[Result], path: str, env: dict) -> list[str]:
    """Bars of TFLOP/s per configuration and provider, one panel per mode (the GEMMs' plot)."""
    return gemm.plot(results, path, env, "linear_attention")


def add_arguments(a) -> None:
    a.add_argument("--ops", type=cli.str_list(OPS), default=None, help=f"from {','.join(OPS)} (default both)")
    a.add_argument("--shapes", type=cli.str_list(tuple(SHAPES)), default=None,
                   help=f"from {','.join(SHAPES)} (default all)")
    peer_names = [p for p in lap.PROVIDERS if p in peers.PEERS]
    cli.add_common_arguments(a, op="linear_attention", providers=lap.PROVIDERS,
                             default_providers="jax_tk,xla, and " + ",".join(peer_names) + " where installed",
                             modes=MODES, default_modes=DEFAULT_MODES, dtypes=tuple(DTYPES),
                             quick_help=f"tiny shapes {QUICK_SHAPES} (runs on CPU in seconds)")


def configs_from(args) -> list[LinearAttentionConfig]:
    chosen = QUICK_SHAPES if args.quick else SHAPES
    names = list(chosen) if args.quick or not args.shapes else args.shapes
    return configs(chosen, names, args.ops or list(OPS), args.dtype)


def run_linear_attention(args) -> int:
    shown = args.providers or default_providers()
    modes = args.modes or list(DEFAULT_MODES)
    reps = cli.reps_from(args)
    csv_path, png_path = cli.output_paths(args, "linear_attention")
    timer = make_timer(args.timer, reps, quick=args.quick, rounds=args.rounds)
    env = output.environment(timer.name)
    header = [f"# jax_tk linear_attention benchmark: {output.env_header(env)}",
              f"# providers={','.join(shown)} modes={','.join(modes)} dtype={args.dtype} reps={reps}; FLOPs per "
              f"token and value head (C={CHUNK}): simple_gla 2*(C*K + C*V + 2*K*V), gated_delta_rule "
              "2*(3*C*K + 2*C*V + 3*K*V) + C^2/3; bwd 2x, fwd_bwd 3x"]
    run_bench = functools.partial(bench_linear_attention, configs_from(args), shown, modes, timer=timer,
                                  check=not args.no_check)
    return cli.run_and_write(COMMAND, env=env, header=header, csv_path=csv_path, png_path=png_path,
                             providers=shown, bench=run_bench)


COMMAND = cli.register(cli.Command(
    "linear_attention", "simple GLA and the gated delta rule over whole sequences (forward and backward)",
    add_arguments, run_linear_attention, config_type=LinearAttentionConfig, format_table=format_table, plot=plot))
