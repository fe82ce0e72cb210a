"""One jitted linear-attention call (forward, or with --bwd its gradients), for profilers: run it under
ncu or nsys, e.g. through scripts/ncu_profile.sh (PROBE=scripts/ncu_probe_linear.py), which profiles its
kernels.

    python scripts/ncu_probe_linear.py [--op gated_delta_rule|simple_gla] [--shape NAME] [--impl tk|jla]
                                       [--bwd] [--calls N]

--shape: a row of the benchmark (benchmarks/linear_attention.py: 4x4k, 1x32k, 16x2k), with its inputs
(seed 0) and options (the gated delta rule with use_qk_l2norm). --impl tk (default):
jax_tk.linear_attention (implementation=None); jla: jax-linear-attention's Mosaic GPU kernels.
--calls N runs the call N times after the first (compiling) one, e.g. to skip it with ncu's
--launch-skip or to profile a warm call.
"""
import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp

# The benchmark's rows, inputs and providers, from benchmarks/ beside scripts/ (appended: the jax_tk
# being profiled, e.g. an install on PYTHONPATH, stays the one imported).
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks import linear_attention as bench  # noqa: E402
from benchmarks import linear_attention_providers as lap  # noqa: E402


def main():
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--op", choices=lap.OPS, default=lap.GDR)
    a.add_argument("--shape", choices=sorted(bench.SHAPES), default="4x4k")
    a.add_argument("--impl", choices=("tk", "jla"), default="tk")
    a.add_argument("--bwd", action="store_true", help="the gradients with respect to every input")
    a.add_argument("--calls", type=int, default=0, help="calls after the first")
    args = a.parse_args()

    cfg = bench.configs(bench.SHAPES, [args.shape], [args.op])[0]
    *inputs, dout = bench.make_inputs(cfg, 1)[0]
    fn = lap.make_provider("jax_tk" if args.impl == "tk" else "jla", cfg).fn
    if args.bwd:
        f = jax.jit(jax.grad(lambda *x: (fn(*x).astype(jnp.float32) * dout).sum(), argnums=tuple(range(len(inputs)))))
    else:
        f = jax.jit(fn)
    for _ in range(1 + args.calls):
        jax.block_until_ready(f(*inputs))
    print(f"{args.impl} {args.op} {args.shape} {'bwd' if args.bwd else 'fwd'} done", flush=True)


if __name__ == "__main__":
    main()
