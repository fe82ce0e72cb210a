"""Grouped GEMM (mixture of experts) benchmark: jax_tk.ragged_dot against jax.lax.ragged_dot, with the
dense GEMM of the same FLOPs as the ceiling.

    python -m jax_tk.bench ragged_dot                         # every shape, uniform and skewed sizes
    python -m jax_tk.bench ragged_dot --shapes mixtral,qwen --dist dirichlet --modes fwd
    python -m jax_tk.bench ragged_dot --quick                 # tiny shapes (seconds, CPU too)

Shapes (bf16; ``m`` rows of ``k`` times one ``[k, n]`` matrix per expert):

- ``mixtral``: 16384 x 4096 -> 14336, 8 experts (Mixtral-8x7B's up projection, 8k tokens top-2)
- ``qwen``: 16384 x 2048 -> 1408, 64 experts (Qwen-MoE-like)
- ``deepseek``: 32768 x 7168 -> 2048, 64 experts (DeepSeek-like)
- ``deepseek-v3``: 256 experts, top-8 routing of 16k tokens: m = 16384 * 8 = 131072, k = 7168, n = 2048

Group sizes (``--dist``): ``uniform`` (m / g each) and ``dirichlet`` (shares drawn from a Dirichlet
with alpha 0.5, numpy seed 0: a few experts get most tokens, some almost none). Group sizes are passed
as a traced int32 array to every provider.

Providers: ``jax_tk`` (``jax_tk.ragged_dot``; on a GPU with ``implementation="tk"``, skipped with the
reason where the kernel does not take the shape), ``lax`` (``jax.lax.ragged_dot``), ``dense`` (XLA's
``[m, k] @ [k, n]``: the same FLOPs without groups, the ceiling). Modes: ``fwd``; ``bwd`` (the
backward alone: d lhs and d rhs, 2x the forward's FLOPs); ``fwd_bwd`` (3x). FLOPs ``2*m*k*n`` per
GEMM. The table gives ms and TFLOP/s per provider and jax_tk's speed over ``lax`` and ``dense``.
Timing and outputs as for every op (``jax_tk.bench.harness``, ``timers``): CSV and PNG in ``--out``.
Each timed result is checked on its first 256 rows (and 64 columns of one group's d rhs) against
float32 products.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

import jax_tk
from jax_tk.bench import _gemm, cli, harness
from jax_tk.bench._gemm import DISTRIBUTIONS, GemmConfig
from jax_tk.bench.harness import Provider, Skip, Unavailable

SHAPES = {  # name: (m, k, n, groups)
    "mixtral": (16384, 4096, 14336, 8),
    "qwen": (16384, 2048, 1408, 64),
    "deepseek": (32768, 7168, 2048, 64),
    "deepseek-v3": (16384 * 8, 7168, 2048, 256),
}
QUICK_SHAPES = {"tiny": (256, 64, 128, 4), "tiny-many": (384, 32, 64, 32)}
PROVIDERS = ("jax_tk", "lax", "dense")
BASELINES = ("lax", "dense")


def configs(shapes: dict, names: Sequence[str], dists: Sequence[str], dtype: str = "bf16") -> list[GemmConfig]:
    return [GemmConfig(name, *shapes[name], dist=dist, dtype=dtype) for name in names for dist in dists]


def make_provider(name: str, cfg: GemmConfig) -> Provider:
    if name == "jax_tk":
        note, impl = "", None
        if harness.has_gpu():
            from jax_tk.gemm import launch

            impl = "tk"
            reason = launch.kernel_unsupported_reason(cfg.jnp_dtype, cfg.k, cfg.n, cfg.groups, cfg.m)
            if reason is not None:
                raise Skip(f"the kernel does not take {reason}")
            if not jax_tk.has_cuda_kernels():
                raise Unavailable("jax_tk was built without its CUDA kernels")
        else:
            note = "the float32 reference (no GPU)"
        return Provider(name, lambda lhs, rhs, sizes: jax_tk.ragged_dot(lhs, rhs, sizes, implementation=impl),
                        note=note)
    if name == "lax":
        return Provider(name, lambda lhs, rhs, sizes: jax.lax.ragged_dot(lhs, rhs, sizes))
    if name == "dense":
        return Provider(name, lambda a, b: jnp.dot(a, b), prepare=lambda lhs, rhs, sizes, dout: (lhs, rhs[0], dout),
                        note="dense [m, k] @ [k, n]: the same FLOPs")
    raise ValueError(f"unknown provider {name!r}: choose from {PROVIDERS}")


def _dist_argument(a) -> None:
    a.add_argument("--dist", type=cli.str_list(DISTRIBUTIONS), default=None,
                   help="group sizes: uniform, dirichlet (default both)")


COMMAND, bench_ragged_dot = _gemm.command(
    "ragged_dot", "grouped GEMM (mixture of experts) forward and backward", make_provider, shapes=SHAPES,
    quick_shapes=QUICK_SHAPES, providers=PROVIDERS, baselines=BASELINES, extra_arguments=_dist_argument,
    make_configs=lambda shapes, names, args: configs(shapes, names, args.dist or list(DISTRIBUTIONS), args.dtype),
    header_note="; dense = XLA's [m,k]@[k,n], the ceiling")
format_table = COMMAND.format_table
