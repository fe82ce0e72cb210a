"""Dense GEMM benchmark: jax_tk.matmul (the grouped GEMM kernel with one group) against XLA's dot.

    python -m jax_tk.bench matmul                    # 8192^3 and the mixture-of-experts shapes, dense
    python -m jax_tk.bench matmul --shapes cube8k --modes fwd
    python -m jax_tk.bench matmul --quick            # tiny shapes (seconds, CPU too)

Shapes (bf16, ``[m, k] @ [k, n]``): ``cube8k`` 8192 x 8192 x 8192, and ``ragged_dot``'s shapes without
the groups: ``mixtral`` 16384 x 4096 -> 14336, ``qwen`` 16384 x 2048 -> 1408, ``deepseek`` 32768 x
7168 -> 2048, ``deepseek-v3`` 131072 x 7168 -> 2048. Providers: ``jax_tk`` (``jax_tk.matmul``; on a GPU
with ``implementation="tk"``) and ``xla`` (``jnp.dot``). FLOPs ``2*m*k*n`` per GEMM; modes as in
``ragged_dot`` (``bwd``: d a and d b, two GEMMs). The table gives jax_tk's speed over XLA's.
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax.numpy as jnp

import jax_tk
from jax_tk.bench import _gemm, cli, harness, output
from jax_tk.bench._gemm import DEFAULT_MODES, DTYPES, MODES, GemmConfig
from jax_tk.bench.harness import Provider, Result, Skip, Unavailable
from jax_tk.bench.ragged_dot import SHAPES as MOE_SHAPES
from jax_tk.bench.timers import make_timer

SHAPES = {"cube8k": (8192, 8192, 8192), **{name: s[:3] for name, s in MOE_SHAPES.items()}}
QUICK_SHAPES = {"tiny": (128, 64, 96), "tiny-tall": (512, 32, 48)}
PROVIDERS = ("jax_tk", "xla")
BASELINES = ("xla",)


def configs(shapes: dict, names: Sequence[str], dtype: str = "bf16") -> list[GemmConfig]:
    return [GemmConfig(name, *shapes[name], dtype=dtype) for name in names]


def _prepare(lhs, rhs, sizes, dout):
    return lhs, rhs[0], dout


def make_provider(name: str, cfg: GemmConfig) -> Provider:
    if name == "jax_tk":
        note, impl = "", None
        if harness.has_gpu():
            from jax_tk.gemm import launch

            impl = "tk"
            reason = launch.kernel_unsupported_reason(cfg.jnp_dtype, cfg.k, cfg.n, 1, cfg.m)
            if reason is not None:
                raise Skip(f"the kernel does not take {reason}")
            if not jax_tk.has_cuda_kernels():
                raise Unavailable("jax_tk was built without its CUDA kernels")
        else:
            note = "the float32 reference (no GPU)"
        return Provider(name, lambda a, b: jax_tk.matmul(a, b, implementation=impl), prepare=_prepare, note=note)
    if name == "xla":
        return Provider(name, lambda a, b: jnp.dot(a, b), prepare=_prepare)
    raise ValueError(f"unknown provider {name!r}: choose from {PROVIDERS}")


OP = _gemm.op_bench(make_provider)


def bench_matmul(configs: Sequence[GemmConfig], providers: Sequence[str] = PROVIDERS,
                 modes: Sequence[str] = DEFAULT_MODES, *, timer=None, check: bool = True,
                 on_result: Callable[[Result], None] | None = None,
                 log: Callable[[str], None] | None = print) -> list[Result]:
    return harness.run(OP, configs, providers, modes, timer=timer, check=check, on_result=on_result, log=log)


def format_table(results, providers=None) -> str:
    providers = providers or list(dict.fromkeys(r.provider for r in results))
    return _gemm.format_table(results, providers, BASELINES)


def plot(results, path, env):
    return _gemm.plot(results, path, env, "matmul")


def add_arguments(a) -> None:
    a.add_argument("--shapes", type=cli.str_list(tuple(SHAPES)), default=None,
                   help=f"from {','.join(SHAPES)} (default all)")
    cli.add_common_arguments(a, op="matmul", providers=PROVIDERS, default_providers=",".join(PROVIDERS),
                             modes=MODES, default_modes=DEFAULT_MODES, dtypes=tuple(DTYPES),
                             quick_help=f"tiny shapes {QUICK_SHAPES} (runs on CPU in seconds)")


def run_matmul(args) -> int:
    shapes = QUICK_SHAPES if args.quick else SHAPES
    names = list(shapes) if args.quick or not args.shapes else args.shapes
    providers = args.providers or list(PROVIDERS)
    modes = args.modes or list(DEFAULT_MODES)
    reps = cli.reps_from(args)
    csv_path, png_path = cli.output_paths(args, "matmul")
    timer = make_timer(args.timer, reps, quick=args.quick)
    env = output.environment(timer.name)
    header = [f"# jax_tk matmul benchmark: {output.env_header(env)}",
              f"# providers={','.join(providers)} modes={','.join(modes)} dtype={args.dtype} reps={reps}; "
              "FLOPs 2*m*k*n per GEMM (fwd 1, bwd 2, fwd_bwd 3 GEMMs)"]
    bench = functools.partial(bench_matmul, configs(shapes, names, args.dtype), providers, modes, timer=timer,
                              check=not args.no_check)
    return cli.run_and_write(COMMAND, env=env, header=header, csv_path=csv_path, png_path=png_path,
                             providers=providers, bench=bench)


COMMAND = cli.register(cli.Command(
    "matmul", "dense GEMM forward and backward", add_arguments, run_matmul,
    config_type=GemmConfig, format_table=format_table, plot=plot))
