"""One jitted grouped or dense product (forward, or with --bwd its gradients), for profilers: run it
under ncu or nsys, e.g. through scripts/ncu_profile.sh (PROBE=scripts/ncu_probe_gemm.py), which
profiles its kernels.

    python scripts/ncu_probe_gemm.py [--impl tk|xla|dense] [--shape NAME | --mkn M K N] [--groups G]
                                     [--dist uniform|routed|dirichlet|dense] [--bwd] [--calls N]

--shape: a shape of the benchmark (benchmarks/gemm.py: RAGGED_SHAPES and MATMUL_SHAPES, e.g. qwen,
odd, skinny), its groups and top-k with it; --mkn and --groups give one instead. --dist: the
benchmark's group sizes (seed 0); "dense" (one group) runs jax_tk.matmul. --impl tk (default):
jax_tk.ragged_dot / jax_tk.matmul (implementation="tk"); xla: their pure-JAX reference; dense: XLA's
[m, k] @ [k, n] of the same size (the ceiling the benchmark compares with).
--calls N runs the call N times after the first (compiling) one, e.g. to skip it with ncu's
--launch-skip or to profile a warm call.
"""
import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp

import jax_tk

# The benchmark's shapes and group sizes, from benchmarks/ beside scripts/ (appended: the jax_tk being
# profiled, e.g. an install on PYTHONPATH, stays the one imported).
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.gemm import DISTRIBUTIONS, MATMUL_SHAPES, RAGGED_SHAPES, group_sizes  # noqa: E402


def main():
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--impl", choices=("tk", "xla", "dense"), default="tk")
    a.add_argument("--shape", choices=sorted({*RAGGED_SHAPES, *MATMUL_SHAPES}), default="qwen")
    a.add_argument("--mkn", type=int, nargs=3, default=None, metavar=("M", "K", "N"), help="instead of --shape")
    a.add_argument("--groups", type=int, default=None, help="groups (default: the shape's, 1 with --mkn)")
    a.add_argument("--dist", choices=(*DISTRIBUTIONS, "dense"), default="uniform")
    a.add_argument("--bwd", action="store_true", help="the gradients with respect to both operands")
    a.add_argument("--calls", type=int, default=0, help="calls after the first")
    args = a.parse_args()

    shape = RAGGED_SHAPES.get(args.shape, (*MATMUL_SHAPES[args.shape], 1, 1))
    (m, k, n), groups, top_k = (args.mkn or shape[:3]), shape[3], shape[4]
    groups = args.groups or (1 if args.mkn else groups)
    dense = args.dist == "dense" or groups == 1
    sizes = jnp.asarray(group_sizes(m, 1 if dense else groups, "dense" if dense else args.dist, 0, top_k))
    kl, kr = jax.random.split(jax.random.PRNGKey(0))
    lhs = jax.random.normal(kl, (m, k), jnp.bfloat16)
    rhs = jax.random.normal(kr, (k, n) if dense or args.impl == "dense" else (groups, k, n), jnp.bfloat16)

    if args.impl == "dense":
        def product(lhs, rhs):
            return lhs @ rhs
    elif dense:
        def product(lhs, rhs):
            return jax_tk.matmul(lhs, rhs, implementation=args.impl)
    else:
        def product(lhs, rhs):
            return jax_tk.ragged_dot(lhs, rhs, sizes, implementation=args.impl)
    if args.bwd:
        f = jax.jit(jax.grad(lambda l, r: product(l, r).astype(jnp.float32).sum(), argnums=(0, 1)))
    else:
        f = jax.jit(product)
    for _ in range(1 + args.calls):
        jax.block_until_ready(f(lhs, rhs))
    what = "dense" if dense else f"{groups} groups {args.dist}"
    print(f"{args.impl} {'bwd' if args.bwd else 'fwd'} {m} x {k} -> {n}, {what} done", flush=True)


if __name__ == "__main__":
    main()
