"""One jitted call of attention (forward, or with --bwd the gradient), for profilers: run it under
ncu or nsys, e.g. through scripts/ncu_profile.sh, which profiles its kernels.

    python scripts/ncu_probe.py [--impl tk|cudnn|fa3|xla] [--shape B T H D] [--kv-heads N] [--causal]
                                [--window LEFT] [--documents N] [--bias] [--bwd] [--calls N]

--impl tk (default): jax_tk.attention(implementation="tk"); xla: jax_tk.attention's pure-JAX reference
(runs on CPU too); cudnn: jax.nn.dot_product_attention(implementation="cudnn"); fa3:
FlashAttention-3's flash_attn3_jax.flash_mha (the flash-attn3-jax wheel).
--documents N: N packed documents of random lengths per row (the benchmark's, seed 0) as segment ids
(jax_tk only), so that the XLA ops preparing the kernels' tiles show too.
--bias adds a random bias [1, H, T, T] (its gradient too with --bwd).
--calls N runs the call N times after the first (compiling) one, e.g. to skip it with ncu's
--launch-skip or to profile a warm call.
"""
import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp

import jax_tk

# The benchmark's documents, from benchmarks/ beside scripts/ (appended: the jax_tk being profiled,
# e.g. an install on PYTHONPATH, stays the one imported).
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.attention_configs import document_lengths, segment_ids_from_lengths  # noqa: E402


def main():
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--impl", choices=("tk", "cudnn", "fa3", "xla"), default="tk")
    a.add_argument("--shape", type=int, nargs=4, default=(1, 16384, 16, 128), metavar=("B", "T", "H", "D"))
    a.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default H)")
    a.add_argument("--causal", action="store_true")
    a.add_argument("--window", type=int, default=None, help="local_window_size=(LEFT, 0)")
    a.add_argument("--documents", type=int, default=None, help="packed documents per row (segment ids)")
    a.add_argument("--bias", action="store_true", help="an additive bias [1, H, T, T]")
    a.add_argument("--bwd", action="store_true", help="the gradient with respect to q, k and v (and the bias)")
    a.add_argument("--calls", type=int, default=0, help="calls after the first")
    a.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    args = a.parse_args()

    B, T, H, D = args.shape
    KH = args.kv_heads or H
    dtype = jnp.bfloat16 if args.dtype == "bf16" else jnp.float16
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(kq, (B, T, H, D), dtype)
    k = jax.random.normal(kk, (B, T, KH, D), dtype)
    v = jax.random.normal(kv, (B, T, KH, D), dtype)
    ids = None
    if args.impl in ("cudnn", "fa3") and args.documents:
        a.error("--documents: jax_tk only (--impl tk or xla)")
    if args.documents:
        ids = jnp.asarray(segment_ids_from_lengths(document_lengths(T, args.documents, 0, B)))
    window = None if args.window is None else (args.window, 0)
    bias = jax.random.normal(jax.random.PRNGKey(1), (1, H, T, T), dtype) if args.bias else None

    if args.impl == "cudnn":
        def attn(q, k, v, ids, bias):
            return jax.nn.dot_product_attention(q, k, v, bias, implementation="cudnn", is_causal=args.causal,
                                                local_window_size=window)
    elif args.impl == "fa3":
        import flash_attn3_jax
        if args.bias:
            a.error("--bias: flash_attn3_jax has no bias")

        def attn(q, k, v, ids, bias):
            return flash_attn3_jax.flash_mha(q, k, v, softmax_scale=D ** -0.5, is_causal=args.causal,
                                             window_size=(-1, -1) if window is None else window)
    else:
        def attn(q, k, v, ids, bias):
            return jax_tk.attention(q, k, v, bias, implementation=args.impl, is_causal=args.causal,
                                    local_window_size=window, q_segment_ids=ids, kv_segment_ids=ids)
    if args.bwd:
        f = jax.jit(jax.grad(lambda q, k, v, ids, bias: attn(q, k, v, ids, bias).astype(jnp.float32).sum(),
                             argnums=(0, 1, 2) + ((4,) if args.bias else ())))
    else:
        f = jax.jit(attn)
    for _ in range(1 + args.calls):
        jax.block_until_ready(f(q, k, v, ids, bias))
    print(f"{args.impl} {'bwd' if args.bwd else 'fwd'} B={B} T={T} H={H}/{KH} D={D} done", flush=True)


if __name__ == "__main__":
    main()
