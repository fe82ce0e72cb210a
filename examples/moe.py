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

    python examples/moe.py                      # CPU: a tiny model, a few steps; GPU: bf16, 8 experts
    python examples/moe.py --steps 200 --experts 16 --top-k 2

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


GEMMS = {"tk": ragged_dot_tk, "lax": jax.lax.ragged_dot}


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
    p.add_argument("--gemm", choices=("both", *GEMMS), default="both",
                   help="tk: jax_tk.ragged_dot, lax: jax.lax.ragged_dot")
    for name in ("layers", "width", "heads", "experts", "top_k", "hidden", "seq", "batch", "steps"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=preset[name])
    p.add_argument("--dtype", choices=tuple(DTYPES), default=preset["dtype"])
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=DATA)
    return p.parse_args(argv)


def main(argv=None):
    """Returns {gemm name: {"losses": [...], "tokens_per_s": float}}."""
    args = parse_args(argv)
    config = Config(layers=args.layers, width=args.width, heads=args.heads, experts=args.experts,
                    top_k=args.top_k, hidden=args.hidden, seq=args.seq, dtype=args.dtype)
    data = load_data(args.data)
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), {config}, batch {args.batch}: "
          f"{args.batch * config.seq * config.top_k} rows per grouped GEMM")
    results = {}
    for name in (GEMMS if args.gemm == "both" else [args.gemm]):
        losses, rate = train(config, name, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed,
                             data=data)
        results[name] = {"losses": losses, "tokens_per_s": rate}
        label = {"tk": "jax_tk.ragged_dot", "lax": "jax.lax.ragged_dot"}[name]
        print(f"{label:20s} loss {losses[0]:.4f} -> {losses[-1]:.4f}   {rate:,.0f} tokens/s")
    if len(results) == 2:
        ratio = results["tk"]["tokens_per_s"] / results["lax"]["tokens_per_s"]
        kernels = (jax.default_backend() == "gpu" and jax_tk.has_cuda_kernels()
                   and config.dtype in ("bfloat16", "float16"))
        what = "whole training step" + ("" if kernels else "; no GPU kernel runs here: two pure-JAX paths compared, "
                                        "jax_tk's reference and jax.lax's, not jax_tk's kernel")
        print(f"jax_tk.ragged_dot / jax.lax.ragged_dot: {ratio:.2f}x tokens/s ({what})")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
