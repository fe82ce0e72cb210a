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

from typing import Sequence

import jax.numpy as jnp

import jax_tk
from jax_tk.bench import _gemm, harness
from jax_tk.bench._gemm import GemmConfig
from jax_tk.bench.harness import Provider, Skip, Unavailable
from jax_tk.bench.ragged_dot import SHAPES as MOE_SHAPES

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


COMMAND, bench_matmul = _gemm.command(
    "matmul", "dense GEMM forward and backward", make_provider, shapes=SHAPES, quick_shapes=QUICK_SHAPES,
    providers=PROVIDERS, baselines=BASELINES,
    make_configs=lambda shapes, names, args: configs(shapes, names, args.dtype))
format_table = COMMAND.format_table
