"""Train a small mixture-of-experts transformer with jax_tk.ragged_dot, against jax.lax.ragged_dot.

A byte-level language model on Shakespeare whose blocks are causal self-attention
(``jax_tk.attention``) followed by a mixture-of-experts MLP:

1. a router picks the top-k experts of every token (softmax over the experts, the k weights
   renormalized), with the usual load-balancing loss;
2. the (token, expert) pairs are sorted by expert, so every expert's rows are consecutive;
3. each expert's SwiGLU MLP runs as three grouped GEMMs over the sorted rows, ``silu(x W_gate) *
   (x W_up)`` then ``W_down``, with the number of rows of each expert as ``group_sizes``;
4. the rows go back to their tokens (the sort undone), weighted by the router and summed.

The same run (same seed, same batches) is made with each grouped GEMM of ``--gemm`` (default both:
``tk`` = ``jax_tk.ragged_dot``, ``lax`` = ``jax.lax.ragged_dot``) and the tokens/s of each are
printed, with their loss curves (which agree up to rounding).

With ``--fp8`` the run is made with ``jax_tk.ragged_dot`` in ``--dtype`` (``jax.lax.ragged_dot`` with
``--gemm lax``) and again with the experts' GEMMs in FP8, ``jax_tk.ragged_dot_fp8`` (DeepSeek-V3
block scales, straight-through gradients), and the two loss curves, tokens/s and the final loss gap
are printed side by side.

    python examples/moe.py                      # CPU: a tiny model, a few steps; GPU: bf16, 8 experts
    python examples/moe.py --steps 200 --experts 16 --top-k 2
    python examples/moe.py --fp8                # FP8 experts against bf16 (float32 on a CPU)

``moe_layer`` (steps 1-4) and ``route`` are used by ``examples/expert_parallel.py``, which shards the
experts over devices. The module has no side effects on import.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_tk

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "shakespeare.txt")
VOCAB = 256
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
PRESETS = {  # defaults when a flag is not given
    "cpu": dict(layers=2, width=64, heads=2, experts=4, top_k=2, hidden=128, seq=64, batch=8, steps=20,
                dtype="float32"),
    "gpu": dict(layers=4, width=1024, heads=16, experts=8, top_k=2, hidden=2048, seq=1024, batch=16,
                steps=50, dtype="bfloat16"),
}


def ragged_dot_tk(lhs, rhs, group_sizes):
    # On a GPU in bf16/fp16 insist on the kernel (an error rather than a silent fallback if the shapes
    # do not fit it); elsewhere jax_tk runs its reference.
    kernel = jax.default_backend() == "gpu" and lhs.dtype in (jnp.bfloat16, jnp.float16)
    return jax_tk.ragged_dot(lhs, rhs, group_sizes, implementation="tk" if kernel else None)


def fp8_kernel_runs() -> bool:
    """Whether jax_tk's FP8 kernel is the one to run here: it is written for H100/H200 (sm_90a) only."""
    return jax.default_backend() == "gpu" and str(getattr(jax.devices()[0], "compute_capability", "")) == "9.0"


def ragged_dot_fp8(lhs, rhs, group_sizes):
    # Arrays in: the op quantizes the rows in 1x128 blocks along k and the weights in 128x128 blocks,
    # and its gradients pass straight through to them, so the model trains as it would in lhs's dtype.
    # On an H100/H200 insist on the FP8 kernel (an error rather than a silent fallback to the reference
    # if k is not a multiple of 16 or n of 8); elsewhere jax_tk runs its reference.
    return jax_tk.ragged_dot_fp8(lhs, rhs, group_sizes, preferred_element_type=lhs.dtype,
                                 implementation="tk" if fp8_kernel_runs() else None)


GEMMS = {"tk": ragged_dot_tk, "lax": jax.lax.ragged_dot, "fp8": ragged_dot_fp8}
LABELS = {"tk": "jax_tk.ragged_dot", "lax": "jax.lax.ragged_dot", "fp8": "jax_tk.ragged_dot_fp8"}


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int = 2
    width: int = 64
    heads: int = 2
    experts: int = 4
    top_k: int = 2
    hidden: int = 128  # each expert's MLP width
    seq: int = 64
    dtype: str = "float32"
    aux_weight: float = 0.01  # load-balancing loss

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]


def init_params(key, config: Config):
    L, D, E, F = config.layers, config.width, config.experts, config.hidden
    if D % config.heads:
        raise ValueError(f"width {D} is not a multiple of heads {config.heads}")
    k = jax.random.split(key, 8)
    normal = lambda key, shape, s: s * jax.random.normal(key, shape, jnp.float32)  # noqa: E731
    std, res = 0.02, 0.02 / math.sqrt(2 * L)
    return {
        "wte": normal(k[0], (VOCAB, D), std),
        "wpe": normal(k[1], (config.seq, D), std),
        "blocks": {
            "ln1": jnp.ones((L, D)), "ln2": jnp.ones((L, D)),
            "qkv": normal(k[2], (L, D, 3 * D), std), "proj": normal(k[3], (L, D, D), res),
            "router": normal(k[4], (L, D, E), std),
            "w_gate": normal(k[5], (L, E, D, F), std), "w_up": normal(k[6], (L, E, D, F), std),
            "w_down": normal(k[7], (L, E, F, D), res),
        },
        "lnf": jnp.ones((D,)),
    }


def _rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


# ----------------------------------------------------------------------------------------------
# The mixture-of-experts MLP
# ----------------------------------------------------------------------------------------------


def route(x, router, top_k: int):
    """Top-k routing of tokens ``x`` [T, D] over ``router`` [D, E] (float32 logits).

    Returns (weights [T, k] float32, order [T*k] int32: the (token, slot) pairs ``t*k + j`` sorted by
    expert, group_sizes [E] int32: rows per expert, aux: the load-balancing loss)."""
    E = router.shape[1]
    probs = jax.nn.softmax(x.astype(jnp.float32) @ router, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    aux = E * jnp.sum(jnp.mean(probs, axis=0) * sizes / flat.shape[0])  # 1.0 when evenly spread
    return weights, order, sizes, aux


def experts_mlp(rows, w_gate, w_up, w_down, group_sizes, gemm):
    """SwiGLU MLP of each expert over its rows: ``rows`` [R, D] sorted by expert; w_gate, w_up [E, D, F],
    w_down [E, F, D]; rows past the groups give 0."""
    dt = rows.dtype
    h = jax.nn.silu(gemm(rows, w_gate.astype(dt), group_sizes)) * gemm(rows, w_up.astype(dt), group_sizes)
    return gemm(h, w_down.astype(dt), group_sizes)


def moe_layer(x, p, top_k: int, gemm):
    """x [T, D] (compute dtype) -> ([T, D], aux): the mixture of experts of block parameters ``p``."""
    T, D = x.shape
    weights, order, sizes, aux = route(x, p["router"], top_k)
    rows = x[order // top_k]  # token of each sorted (token, slot) pair
    ys = experts_mlp(rows, p["w_gate"], p["w_up"], p["w_down"], sizes, gemm)
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(T, top_k, D)  # back in (token, slot) order
    return jnp.einsum("tk,tkd->td", weights.astype(x.dtype), y), aux


# ----------------------------------------------------------------------------------------------
# The model, the loss and a training step
# ----------------------------------------------------------------------------------------------


def _block(x, p, config: Config, gemm):
    dt = config.compute_dtype
    B, T, D = x.shape
    h = _rms_norm(x, p["ln1"]).astype(dt)
    q, k, v = (t.reshape(B, T, config.heads, D // config.heads) for t in jnp.split(h @ p["qkv"].astype(dt), 3, -1))
    x = x + (jax_tk.attention(q, k, v, is_causal=True).reshape(B, T, D) @ p["proj"].astype(dt)).astype(jnp.float32)
    h = _rms_norm(x, p["ln2"]).astype(dt).reshape(B * T, D)
    y, aux = moe_layer(h, p, config.top_k, gemm)
    return x + y.reshape(B, T, D).astype(jnp.float32), aux


def loss_fn(params, inputs, targets, config: Config, gemm_name: str):
    gemm = GEMMS[gemm_name]
    T = inputs.shape[1]
    x = params["wte"][inputs] + params["wpe"][:T]

    def layer(x, p):
        return _block(x, p, config, gemm)

    x, aux = jax.lax.scan(layer, x, params["blocks"])
    x = _rms_norm(x, params["lnf"]).astype(config.compute_dtype)
    logits = (x @ params["wte"].astype(x.dtype).T).astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return loss + config.aux_weight * jnp.mean(aux), loss


@functools.partial(jax.jit, static_argnames=("config", "optimizer", "gemm_name"), donate_argnums=(0, 1))
def train_step(params, opt_state, inputs, targets, config: Config, optimizer, gemm_name: str):
    """One optimizer step; returns (params, opt_state, cross-entropy loss)."""
    (_, loss), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, inputs, targets, config, gemm_name)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def load_data(path=DATA):
    with open(path, "rb") as f:
        return np.frombuffer(f.read(), np.uint8).astype(np.int32)


def get_batch(data, batch: int, seq: int, seed: int, step: int):
    starts = np.random.default_rng((seed, step)).integers(0, len(data) - seq - 1, batch)
    x = np.stack([data[s:s + seq] for s in starts])
    y = np.stack([data[s + 1:s + seq + 1] for s in starts])
    return x, y


def train(config: Config, gemm_name: str, *, steps: int, batch: int, lr: float, seed: int, data):
    """Trains ``steps`` steps from ``seed``; returns (losses, tokens/s over the steps after the first)."""
    optimizer = optax.adam(lr)
    params = init_params(jax.random.key(seed), config)
    opt_state = optimizer.init(params)
    losses = []
    t0 = None
    for step in range(steps):
        x, y = get_batch(data, batch, config.seq, seed, step)
        params, opt_state, loss = train_step(params, opt_state, x, y, config, optimizer, gemm_name)
        losses.append(loss)
        if step == 0:  # the clock starts after the step that compiles
            jax.block_until_ready(loss)
            t0 = time.perf_counter()
    losses = [float(v) for v in jax.device_get(losses)]  # (waits for the device)
    timed = steps - 1
    tokens_per_s = timed * batch * config.seq / (time.perf_counter() - t0) if timed else float("nan")
    return losses, tokens_per_s


def parse_args(argv):
    preset = PRESETS["gpu" if jax.default_backend() == "gpu" else "cpu"]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--gemm", choices=("both", "tk", "lax"), default="both",
                   help="tk: jax_tk.ragged_dot, lax: jax.lax.ragged_dot")
    p.add_argument("--fp8", action="store_true",
                   help="train with --gemm's product (tk for both) and again, from the same parameters and "
                   "batches, with the experts' GEMMs in FP8 (jax_tk.ragged_dot_fp8, straight-through "
                   "gradients); print both losses, tokens/s and the loss gap. The FP8 kernel (H100/H200) "
                   "needs --width and --hidden multiples of 16 (k a multiple of 16, n of 8), as the GPU "
                   "preset's are; elsewhere jax_tk's reference runs")
    for name in ("layers", "width", "heads", "experts", "top_k", "hidden", "seq", "batch", "steps"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=preset[name])
    p.add_argument("--dtype", choices=tuple(DTYPES), default=preset["dtype"])
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=DATA)
    args = p.parse_args(argv)
    if args.fp8 and fp8_kernel_runs() and (args.width % 16 or args.hidden % 16):
        # Checked here rather than by the kernel's error, which would come after the first run trained.
        p.error(f"--fp8 on this GPU runs the FP8 kernel, which needs --width and --hidden multiples of 16, "
                f"got {args.width} and {args.hidden}")
    return args


def print_fp8_comparison(base: str, results, config: Config):
    """The loss curves of ``base`` and ``fp8`` side by side, the final loss gap and the tokens/s ratio."""
    a, b = results[base]["losses"], results["fp8"]["losses"]
    steps = len(a)
    every = max(1, steps // 10)
    print(f"{'step':>5s} {config.dtype:>9s} {'fp8':>9s} {'fp8 - ' + config.dtype:>15s}")
    for i in sorted(set(range(0, steps, every)) | {steps - 1}):
        print(f"{i:5d} {a[i]:9.4f} {b[i]:9.4f} {b[i] - a[i]:+15.4f}")
    # One step's loss is noisy (a different batch each step, the same in both runs): the gap is also
    # given over the last steps.
    tail = max(1, min(10, steps // 4))
    ma, mb = np.mean(a[-tail:]), np.mean(b[-tail:])
    print(f"final loss gap, fp8 - {config.dtype}: {b[-1] - a[-1]:+.4f} at the last step, "
          f"{mb - ma:+.4f} ({(mb - ma) / ma:+.2%}) over the last {tail} steps")
    ratio = results["fp8"]["tokens_per_s"] / results[base]["tokens_per_s"]
    what = ("whole training step; the FP8 kernel runs the grouped GEMMs and both their gradients"
            if fp8_kernel_runs() else "whole training step; no FP8 kernel runs here: jax_tk's reference "
            "(quantize, dequantize to float32, multiply), not the kernel's speed")
    print(f"{LABELS['fp8']} / {LABELS[base]}: {ratio:.2f}x tokens/s ({what})")


def main(argv=None):
    """Returns {gemm name ("tk", "lax", "fp8"): {"losses": [...], "tokens_per_s": float}}."""
    args = parse_args(argv)
    config = Config(layers=args.layers, width=args.width, heads=args.heads, experts=args.experts,
                    top_k=args.top_k, hidden=args.hidden, seq=args.seq, dtype=args.dtype)
    data = load_data(args.data)
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), {config}, batch {args.batch}: "
          f"{args.batch * config.seq * config.top_k} rows per grouped GEMM")
    names = ["tk", "lax"] if args.gemm == "both" else [args.gemm]
    if args.fp8:
        names = [names[0], "fp8"]
    width = max(20, *(len(LABELS[name]) for name in names))
    results = {}
    for name in names:
        losses, rate = train(config, name, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed,
                             data=data)
        results[name] = {"losses": losses, "tokens_per_s": rate}
        print(f"{LABELS[name]:{width}s} loss {losses[0]:.4f} -> {losses[-1]:.4f}   {rate:,.0f} tokens/s")
    if args.fp8:
        print_fp8_comparison(names[0], results, config)
    elif len(results) == 2:
        ratio = results["tk"]["tokens_per_s"] / results["lax"]["tokens_per_s"]
        kernels = (jax.default_backend() == "gpu" and jax_tk.has_cuda_kernels()
                   and config.dtype in ("bfloat16", "float16"))
        what = "whole training step" + ("" if kernels else "; no GPU kernel runs here: two pure-JAX paths compared, "
                                        "jax_tk's reference and jax.lax's, not jax_tk's kernel")
        print(f"jax_tk.ragged_dot / jax.lax.ragged_dot: {ratio:.2f}x tokens/s ({what})")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
