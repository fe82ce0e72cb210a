"""GEMM benchmarks: the grouped GEMM of mixtures of experts (``ragged_dot``) and the dense GEMM
(``matmul``), jax_tk against its peers, in one process, with one timer.

    python -m benchmarks ragged_dot                         # every shape, uniform and routed sizes
    python -m benchmarks ragged_dot --shapes mixtral,qwen --dist dirichlet --modes fwd
    python -m benchmarks ragged_dot --quick                 # tiny shapes (seconds, CPU too)
    python -m benchmarks matmul                             # 8192^3, odd, skinny, the grouped shapes dense
    python -m benchmarks matmul --shapes cube8k --modes fwd
    python -m benchmarks ragged_dot --dtype fp8             # FP8 (e4m3) GEMMs of the same shapes

Grouped shapes (bf16; ``m`` rows of ``k`` times one ``[k, n]`` matrix per expert):

- ``mixtral``: 16384 x 4096 -> 14336, 8 experts (Mixtral-8x7B's up projection, 8k tokens top-2)
- ``qwen``: 16384 x 2048 -> 1408, 64 experts (Qwen-MoE-like)
- ``deepseek``: 32768 x 7168 -> 2048, 64 experts (DeepSeek-like)
- ``deepseek-v3``: 256 experts, top-8 routing of 16k tokens: m = 16384 * 8 = 131072, k = 7168, n = 2048

Group sizes (``--dist``, default ``uniform,routed``): ``uniform`` (m / g each), ``routed`` (each
token's top-k of a router whose experts are uneven, see ROUTER_BIAS_STD) and ``dirichlet`` (shares
drawn from a Dirichlet with alpha 0.5, numpy seed 0: a few experts get most tokens, some almost
none), passed as a traced int32 array to every provider. Dense shapes (``[m, k] @ [k, n]``):
``cube8k`` 8192 x 8192 x 8192, ``odd`` 3000 x 5000 x 7000 (no size a multiple of a tile: partial
tiles at every edge; ``--dtype fp8`` skips jax_tk there, its FP8 kernel takes k a multiple of 16),
``skinny`` 128 x 8192 x 8192 (few rows: too few output tiles to fill the GPU), and the grouped
shapes without their groups.

Providers (``gemm_providers``): ragged_dot ``jax_tk``, ``lax`` (``jax.lax.ragged_dot``), ``dense``
(XLA's GEMM of the same FLOPs, the ceiling), ``tokamax`` and ``jla`` where installed; matmul
``jax_tk`` and ``xla``. Modes: ``fwd``; ``bwd`` (the backward alone: d lhs and d rhs); ``fwd_bwd``.
FLOPs are counted the standard way: ``2*m*k*n`` for the forward (m = rows in groups), twice that
for the backward alone (two GEMMs), three times for forward + backward. The table gives ms and
TFLOP/s per provider and jax_tk's speed over the baselines (ragged_dot: ``lax`` and ``dense``;
matmul: ``xla``). Each timed result is checked on its first 256 rows (and 64 columns of one group's
d rhs) against float32 products.

``--dtype fp8``: the same bf16 inputs, which each provider quantizes to float8_e4m3fn itself (the
weights once, untimed, for ``fwd``; both operands inside the timed call for ``bwd`` and ``fwd_bwd``);
the providers of the same names are in ``gemm_fp8_providers``. FLOPs as for bf16; the check compares
with the float32 product of the unquantized inputs, to FP8_MAX_REL_ERR.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import cli, gemm_fp8_providers, gemm_providers, harness, output, peers
from benchmarks.harness import Result, fmt_tflops
from benchmarks.timers import make_timer

# fp8: the inputs are bf16, and each provider quantizes them to float8_e4m3fn (gemm_fp8_providers).
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp8": jnp.bfloat16}
MODES = ("fwd", "bwd", "fwd_bwd")
DEFAULT_MODES = ("fwd", "fwd_bwd")
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.0, "fwd_bwd": 3.0}
DISTRIBUTIONS = ("uniform", "dirichlet", "routed")
DEFAULT_DISTRIBUTIONS = ("uniform", "routed")  # even experts, and uneven ones as a trained router makes them
DIRICHLET_ALPHA = 0.5  # skewed: a few groups get most rows, some nearly none
# "routed": each of m / top_k tokens takes the top_k of standard-normal logits plus a per-expert bias
# of this standard deviation (drawn once per seed): uneven the way trained routers are, the busiest
# expert getting 2-3x the mean at 64-128 experts and the idlest a fifth of it or less.
ROUTER_BIAS_STD = 0.3
CHECK_ROWS = 256  # the correctness check looks at the first rows (and a few columns of d rhs)
CHECK_COLS = 64
# The check of the fp8 rows compares with the float32 product of the unquantized bf16 inputs, so it
# must allow the error of quantizing them. float8_e4m3fn keeps 3 mantissa bits: in the binade
# [2^e, 2^(e+1)) its step is 2^(e-3), and rounding to nearest moves an element by at most half a step,
# 2^-4 of its magnitude (elements under e4m3's smallest normal, 2^-6 of the scale amax / 448, move by
# at most 2^-10 of the scale; for standard-normal inputs they are few). Spread evenly over that half
# step, the error of a quantized standard-normal operand is about 0.026 of its Frobenius norm (the
# RMS, not the bound). For independent random operands each operand's error passes through the
# product at its own relative size, uncorrelated with the other's: the forward (both quantized) is off
# by about sqrt(2) * 0.026 = 0.036, each backward GEMM (the cotangent is not quantized) by about
# 0.026, whatever k. The per-element bound, 2^-4, leaves 1.7x over that, and stays far below a wrong
# product: a dropped scale (a factor of about 100 for standard-normal inputs), a transposed or
# misgrouped operand (about 1.4), even one scale 10% off (about 0.1). A provider that skips the
# quantization passes (its error is bf16's): that is not what this check is for.
FP8_MAX_REL_ERR = 2.0**-4


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One problem: ``m`` rows of k in ``groups`` groups (sizes drawn by ``dist``: "uniform",
    "dirichlet", "routed" (the rows of m / top_k tokens routed to top_k groups each), or "dense" for a
    plain GEMM), times [k, n] per group."""

    name: str
    m: int
    k: int
    n: int
    groups: int = 1
    dist: str = "dense"
    dtype: str = "bf16"
    seed: int = 0
    top_k: int = 1  # (routed: groups per token)

    def flops(self, mode: str) -> float:
        if mode not in MODE_FLOP_FACTOR:
            raise ValueError(f"unknown mode {mode!r}")
        return 2.0 * self.m * self.k * self.n * MODE_FLOP_FACTOR[mode]

    def max_rel_err(self) -> float:
        """The correctness check's tolerance: FP8's quantization error for fp8 rows."""
        return FP8_MAX_REL_ERR if self.dtype == "fp8" else harness.MAX_REL_ERR

    def label(self) -> str:
        routed = f" top-{self.top_k}" if self.dist == "routed" else ""
        grouped = f" g={self.groups} {self.dist}{routed}" if self.dist != "dense" else ""
        return f"{self.name} {self.m}x{self.k}->{self.n}{grouped}"

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    def group_sizes(self) -> np.ndarray:
        return group_sizes(self.m, self.groups, self.dist, self.seed, self.top_k)

    CSV_FIELDS = ("name", "dtype", "m", "k", "n", "groups", "dist", "seed", "top_k")

    def csv_row(self) -> dict:
        return {f: getattr(self, f) for f in self.CSV_FIELDS}

    @classmethod
    def from_row(cls, row: dict) -> "GemmConfig":
        ints = ("m", "k", "n", "groups", "seed", "top_k")
        return cls(**{f: int(row[f]) if f in ints else row[f] for f in cls.CSV_FIELDS if row.get(f, "") != ""})


def group_sizes(m: int, groups: int, dist: str, seed: int = 0, top_k: int = 1) -> np.ndarray:
    """int32 [groups] summing to m: equal (the remainder spread over the first groups), drawn from a
    Dirichlet(DIRICHLET_ALPHA) share per group (numpy, ``seed``), routed (the counts of m / top_k
    tokens' top_k choices, see ROUTER_BIAS_STD; m a multiple of top_k), or [m] for "dense"."""
    if dist == "dense":
        return np.array([m], np.int32)
    if dist == "uniform":
        sizes = np.full(groups, m // groups, np.int64)
        sizes[: m % groups] += 1
    elif dist == "dirichlet":
        rng = np.random.default_rng(seed)
        sizes = rng.multinomial(m, rng.dirichlet(np.full(groups, DIRICHLET_ALPHA)))
    elif dist == "routed":
        if not 1 <= top_k <= groups or m % top_k:
            raise ValueError(f"routed group sizes: top_k={top_k} must be in [1, {groups}] and divide m={m}")
        rng = np.random.default_rng(seed)
        bias = rng.standard_normal(groups).astype(np.float32) * np.float32(ROUTER_BIAS_STD)
        logits = rng.standard_normal((m // top_k, groups), dtype=np.float32) + bias
        chosen = np.argpartition(-logits, top_k - 1, axis=1)[:, :top_k]
        sizes = np.bincount(chosen.ravel(), minlength=groups)
    else:
        raise ValueError(f"unknown group size distribution {dist!r}: choose from {DISTRIBUTIONS}")
    return sizes.astype(np.int32)


def input_bytes(cfg: GemmConfig) -> int:
    item = jnp.dtype(cfg.jnp_dtype).itemsize
    return item * (cfg.m * cfg.k + cfg.groups * cfg.k * cfg.n + cfg.m * cfg.n)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def random_normal(key, shape, dtype):
    """Standard normal ``shape`` in ``dtype``, one draw per leading index (no single draw reaches
    2**31 elements, which the largest rhs, 256 x 7168 x 2048, would)."""
    keys = jax.random.split(key, shape[0])
    return jax.vmap(lambda k: jax.random.normal(k, shape[1:], dtype))(keys)


def make_inputs(cfg: GemmConfig, copies: int):
    """``copies`` sets of (lhs [m, k], rhs [g, k, n], group_sizes [g] int32, dout [m, n]): standard
    normal in the benchmark dtype (never zeros), the group sizes of the configuration."""
    sizes = jnp.asarray(cfg.group_sizes())
    sets = []
    for i in range(copies):
        k = jax.random.split(jax.random.key(cfg.seed * 1000 + i), 3)
        sets.append((random_normal(k[0], (cfg.m, cfg.k), cfg.jnp_dtype),
                     random_normal(k[1], (cfg.groups, cfg.k, cfg.n), cfg.jnp_dtype), sizes,
                     random_normal(k[2], (cfg.m, cfg.n), cfg.jnp_dtype)))
        jax.block_until_ready(sets[-1])
    return sets


# ----------------------------------------------------------------------------------------------
# Correctness checks: the first CHECK_ROWS rows of out and d lhs, and CHECK_COLS columns of one
# group's d rhs, against float32 products (the groups are sliced so that the check stays cheap)
# ----------------------------------------------------------------------------------------------


def _f32_dot(a, b):
    return jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def _head_groups(sizes: np.ndarray, rows: int):
    """The groups of the first ``rows`` rows: [(group, start, end)] with end <= rows."""
    out, start = [], 0
    for i, s in enumerate(sizes):
        end = min(start + int(s), rows)
        if end > start:
            out.append((i, start, end))
        start += int(s)
        if start >= rows:
            break
    return out


def _rel(got, want) -> float:
    num = float(jnp.sqrt(sum(jnp.sum((g.astype(jnp.float32) - w) ** 2) for g, w in zip(got, want))))
    den = float(jnp.sqrt(sum(jnp.sum(w ** 2) for w in want)))
    return num / den if den > 0 else math.inf


def check_fwd(cfg: GemmConfig, lhs, rhs, out) -> float:
    """rhs: [g, k, n] (grouped) or [k, n] (dense)."""
    sizes = cfg.group_sizes() if rhs.ndim == 3 else np.array([cfg.m])
    r = min(cfg.m, CHECK_ROWS)
    got, want = [], []
    for i, s, e in _head_groups(sizes, r):
        got.append(out[s:e])
        want.append(_f32_dot(lhs[s:e], rhs[i] if rhs.ndim == 3 else rhs))
    return _rel(got, want)


def check_bwd(cfg: GemmConfig, lhs, rhs, dout, dlhs, drhs) -> float:
    sizes = cfg.group_sizes() if rhs.ndim == 3 else np.array([cfg.m])
    r = min(cfg.m, CHECK_ROWS)
    got, want = [], []
    for i, s, e in _head_groups(sizes, r):
        got.append(dlhs[s:e])
        want.append(_f32_dot(dout[s:e], (rhs[i] if rhs.ndim == 3 else rhs).T))
    nonempty = [i for i in range(len(sizes)) if sizes[i] > 0]
    j = min(nonempty, key=lambda i: sizes[i])  # the smallest group that has rows: the cheapest to check
    s = int(np.sum(sizes[:j]))
    e = s + int(sizes[j])
    got.append((drhs[j] if rhs.ndim == 3 else drhs)[:, :CHECK_COLS])
    want.append(_f32_dot(lhs[s:e].T, dout[s:e, :CHECK_COLS]))
    return _rel(got, want)


# ----------------------------------------------------------------------------------------------
# Table and plot
# ----------------------------------------------------------------------------------------------


_COLUMNS = (
    ("shape", 12, lambda c, m: c.name), ("m", 7, lambda c, m: c.m), ("k", 6, lambda c, m: c.k),
    ("n", 6, lambda c, m: c.n), ("g", 4, lambda c, m: c.groups if c.dist != "dense" else "-"),
    ("sizes", 9, lambda c, m: c.dist),
)


def format_table(results: Sequence[Result], providers: Sequence[str], baselines: Sequence[str]) -> str:
    """Per mode: one row per configuration, ``ms (TFLOP/s)`` per provider, then jax_tk's TFLOP/s as a
    multiple of each provider's in ``baselines`` (their time / jax_tk's time)."""
    if not results:
        return "(no results)"
    by_key = {(r.config, r.provider, r.mode): r for r in results}
    configs = list(dict.fromkeys(r.config for r in results))
    present = [b for b in baselines if b in providers and "jax_tk" in providers]
    lines = []
    for mode in dict.fromkeys(r.mode for r in results):
        title = f"== {mode}: time per call in ms (TFLOP/s)"
        if present:
            title += "; tk/X = X's time / jax_tk's time (> 1: jax_tk is faster)"
        ratios = " ".join(f"{'tk/' + b:>10}" for b in present)

        def ratio(cfg, m):
            cells = []
            for b in present:
                tk, other = by_key.get((cfg, "jax_tk", m)), by_key.get((cfg, b, m))
                ok = tk is not None and other is not None and tk.status == other.status == "ok"
                cells.append(f"{other.time_ms / tk.time_ms:.2f}x" if ok else "-")
            return " ".join(f"{c:>10}" for c in cells)

        lines += output.format_grid(title + " ==", _COLUMNS, configs, providers, mode, by_key,
                                    lambda r: f"{r.time_ms:.3f} ({fmt_tflops(r.tflops)})", " ms (TF/s)", 22,
                                    extra=(ratios, len(ratios), ratio) if present else None)
    lines += output.format_problems(results)
    return "\n".join(lines).rstrip() + "\n"


def plot(results: Sequence[Result], path: str, env: dict, op: str) -> list[str]:
    """Bars of TFLOP/s per configuration and provider, one panel per mode."""
    plt = output.pyplot()
    ok = [r for r in results if r.status == "ok"]
    if plt is None or not ok:
        return []
    configs = list(dict.fromkeys(r.config for r in results))
    modes = list(dict.fromkeys(r.mode for r in results))
    providers = list(dict.fromkeys(r.provider for r in ok))
    by_key = {(r.config, r.provider, r.mode): r for r in ok}
    fig, axes = plt.subplots(len(modes), 1, figsize=(max(6.0, 1.1 * len(configs) * max(len(providers), 2) / 2 + 2),
                                                      3.8 * len(modes)), squeeze=False)
    width = 0.8 / len(providers)
    for j, mode in enumerate(modes):
        ax = axes[j][0]
        for k, p in enumerate(providers):
            xs = [i - 0.4 + (k + 0.5) * width for i, c in enumerate(configs) if (c, p, mode) in by_key]
            ys = [by_key[(c, p, mode)].tflops for c in configs if (c, p, mode) in by_key]
            ax.bar(xs, ys, width, color=f"C{k % 10}", label=p)
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels([c.label().replace(" ", "\n", 1) for c in configs], fontsize=7)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(mode, fontsize=9)
        ax.set_ylim(bottom=0)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    output.save_figure(plt, fig, path, output.suptitle(op, env), fontsize=9)
    return [path]


def command(op: str, help: str, factories: dict, fp8_factories: dict, *, baselines: Sequence[str], shapes: dict,
            quick_shapes: dict, make_configs: Callable, header_note: str = "", extra_arguments=None):
    """Registers the subcommand ``python -m benchmarks OP`` of a GEMM benchmark; returns it and its
    ``bench(configs, providers, modes, *, timer, check, on_result, log) -> results``.
    ``factories``: the providers (name -> factory(cfg)), by default all but the peers that are not
    installed; ``fp8_factories``: the same names' providers for ``--dtype fp8`` (gemm_fp8_providers);
    ``make_configs(shapes, names, args)`` turns the chosen shape names (and ``extra_arguments``'
    options) into GemmConfigs."""
    own = [p for p in factories if p not in peers.PEERS]
    peer_names = [p for p in factories if p in peers.PEERS]

    def default_providers() -> list[str]:
        return own + peers.installed_peers(peer_names)

    assert set(fp8_factories) == set(factories), "an FP8 provider for every provider name (a Skip where none)"

    def make_provider(name: str, cfg: GemmConfig):
        return harness.factory(fp8_factories if cfg.dtype == "fp8" else factories, name)(cfg)

    bench_op = harness.OpBench(
        make_provider=make_provider, make_inputs=make_inputs, max_rel_err=GemmConfig.max_rel_err,
        input_bytes=input_bytes, check_fwd=lambda cfg, provider, args, out: check_fwd(cfg, args[0], args[1], out),
        check_bwd=lambda cfg, provider, args, dout, grads: check_bwd(cfg, args[0], args[1], dout, grads[0], grads[1]))

    def bench(configs: Sequence[GemmConfig], providers: Sequence[str] | None = None,
              modes: Sequence[str] = DEFAULT_MODES, *, timer=None, check: bool = True,
              on_result: Callable[[Result], None] | None = None,
              log: Callable[[str], None] | None = print) -> list[Result]:
        return harness.run(bench_op, configs, providers or default_providers(), modes, timer=timer, check=check,
                           on_result=on_result, log=log)

    def table(results, shown=None) -> str:
        return format_table(results, shown or list(dict.fromkeys(r.provider for r in results)), baselines)

    def add_arguments(a) -> None:
        a.add_argument("--shapes", type=cli.str_list(tuple(shapes)), default=None,
                       help=f"from {','.join(shapes)} (default all)")
        if extra_arguments is not None:
            extra_arguments(a)
        cli.add_common_arguments(a, op=op, providers=tuple(factories),
                                 default_providers=",".join(own) + (f", and {','.join(peer_names)} where installed"
                                                                    if peer_names else ""),
                                 modes=MODES, default_modes=DEFAULT_MODES, dtypes=tuple(DTYPES),
                                 dtype_help="bf16 or fp16 inputs; fp8: bf16 inputs that each provider quantizes to "
                                            "float8_e4m3fn (fwd: the weights once, untimed, the activations per call; "
                                            "bwd, fwd_bwd: both per call, straight-through gradients)",
                                 quick_help=f"tiny shapes {quick_shapes} (runs on CPU in seconds)")

    def run(args) -> int:
        chosen = quick_shapes if args.quick else shapes
        names = list(chosen) if args.quick or not args.shapes else args.shapes
        shown = args.providers or default_providers()
        modes = args.modes or list(DEFAULT_MODES)
        reps = cli.reps_from(args)
        csv_path, png_path = cli.output_paths(args, op)
        timer = make_timer(args.timer, reps, quick=args.quick, rounds=args.rounds)
        env = output.environment(timer.name)
        header = [f"# jax_tk {op} benchmark: {output.env_header(env)}",
                  f"# providers={','.join(shown)} modes={','.join(modes)} dtype={args.dtype} reps={reps}; "
                  "FLOPs 2*m*k*n per GEMM (fwd 1, bwd 2, fwd_bwd 3 GEMMs)" + header_note]
        if args.dtype == "fp8":
            header.append("# fp8: bf16 inputs, quantized to float8_e4m3fn by each provider: fwd with the weights "
                          "quantized once (untimed) and the activations per call, bf16 out; bwd and fwd_bwd "
                          f"quantize both per call; checked against the unquantized product to {FP8_MAX_REL_ERR:g}")
        run_bench = functools.partial(bench, make_configs(chosen, names, args), shown, modes, timer=timer,
                                      check=not args.no_check)
        return cli.run_and_write(cmd, env=env, header=header, csv_path=csv_path, png_path=png_path,
                                 providers=shown, bench=run_bench)

    cmd = cli.register(cli.Command(op, help, add_arguments, run, config_type=GemmConfig, format_table=table,
                                   plot=lambda results, path, env: plot(results, path, env, op)))
    return cmd, bench


# ----------------------------------------------------------------------------------------------
# The subcommands: ragged_dot and matmul
# ----------------------------------------------------------------------------------------------


RAGGED_SHAPES = {  # name: (m, k, n, groups, top_k): m = tokens x top_k rows
    "mixtral": (16384, 4096, 14336, 8, 2),
    "qwen": (16384, 2048, 1408, 64, 4),
    "deepseek": (32768, 7168, 2048, 64, 8),
    "deepseek-v3": (16384 * 8, 7168, 2048, 256, 8),
    # 8k tokens through the experts of current models (gate and up projections fused where named "up")
    "qwen3-up": (8192 * 8, 2048, 1536, 128, 8),      # Qwen3-30B-A3B
    "qwen3-down": (8192 * 8, 768, 2048, 128, 8),
    "gpt-oss": (8192 * 4, 2880, 5760, 128, 4),       # gpt-oss-120b
    "olmoe": (8192 * 8, 2048, 2048, 64, 8),          # OLMoE
    "mixtral-8x22b": (8192 * 2, 6144, 16384, 8, 2),
}
RAGGED_QUICK_SHAPES = {"tiny": (256, 64, 128, 4, 2), "tiny-many": (384, 32, 64, 32, 4)}
MATMUL_SHAPES = {  # name: (m, k, n)
    "cube8k": (8192, 8192, 8192),
    "odd": (3000, 5000, 7000),  # partial tiles at every edge (k and n multiples of 8, as the kernel needs)
    "skinny": (128, 8192, 8192),  # few rows: too few output tiles to fill the GPU
    **{name: s[:3] for name, s in RAGGED_SHAPES.items()},  # the grouped shapes without their groups
}
MATMUL_QUICK_SHAPES = {"tiny": (128, 64, 96), "tiny-tall": (512, 32, 48)}


def ragged_configs(shapes: dict, names: Sequence[str], dists: Sequence[str], dtype: str = "bf16") -> list[GemmConfig]:
    return [GemmConfig(name, *shapes[name][:4], dist=dist, dtype=dtype, top_k=shapes[name][4])
            for name in names for dist in dists]


def matmul_configs(shapes: dict, names: Sequence[str], dtype: str = "bf16") -> list[GemmConfig]:
    return [GemmConfig(name, *shapes[name], dtype=dtype) for name in names]


def _dist_argument(a) -> None:
    a.add_argument("--dist", type=cli.str_list(DISTRIBUTIONS), default=None,
                   help="group sizes: uniform, dirichlet, routed (each shape's tokens through a top-k "
                        f"router with uneven experts) (default {','.join(DEFAULT_DISTRIBUTIONS)})")


RAGGED_DOT, bench_ragged_dot = command(
    "ragged_dot", "grouped GEMM (mixture of experts) forward and backward", gemm_providers.RAGGED_FACTORIES,
    gemm_fp8_providers.RAGGED_FACTORIES,
    baselines=gemm_providers.RAGGED_BASELINES,
    shapes=RAGGED_SHAPES, quick_shapes=RAGGED_QUICK_SHAPES, extra_arguments=_dist_argument,
    make_configs=lambda shapes, names, args: ragged_configs(shapes, names, args.dist or list(DEFAULT_DISTRIBUTIONS),
                                                            args.dtype),
    header_note="; dense = XLA's [m,k]@[k,n], the ceiling")
MATMUL, bench_matmul = command(
    "matmul", "dense GEMM forward and backward", gemm_providers.MATMUL_FACTORIES, gemm_fp8_providers.MATMUL_FACTORIES,
    baselines=gemm_providers.MATMUL_BASELINES,
    shapes=MATMUL_SHAPES, quick_shapes=MATMUL_QUICK_SHAPES,
    make_configs=lambda shapes, names, args: matmul_configs(shapes, names, args.dtype))
