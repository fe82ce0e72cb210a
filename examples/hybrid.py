"""Train a small hybrid language model: three Gated DeltaNet layers to each softmax-attention layer, as in
Qwen3-Next, on the bytes of Shakespeare (the data, optimizer, embeddings, MLP and logits of
``examples/train_gpt.py``).

Each group of four layers is three linear-attention layers and one causal attention layer
(``train_gpt.py``'s block). A Gated DeltaNet layer, with ``H`` heads of key dim ``K`` and value dim ``V``:

- ``q, k, v = h W_q, h W_k, h W_v`` (``h`` the layer-normed residual stream), q and k l2-normalized in
  the op (``use_qk_l2norm``);
- the decay ``g = -exp(A_log) * softplus(h W_a + dt_bias)`` (<= 0, Mamba-2's parameterization) and the
  write strength ``beta = sigmoid(h W_b)``, one per head and token;
- ``o = jax_tk.linear_attention.gated_delta_rule(q, k, v, g, beta)``, then an output gate
  ``rms(o) * silu(h W_gate)`` and the projection back to the width, then the MLP.

(Qwen3-Next also runs a short causal convolution over q, k and v; it is left out here.)

    python examples/hybrid.py                       # CPU: a tiny model, seconds; GPU: bf16, K = V = 128
    python examples/hybrid.py --steps 300 --compare-steps 20

Printed: the loss while training, then the training step's tokens/s with each linear-attention path
timed on the same batch after a compiling step: ``tk`` (``implementation=None``: jax_tk's forward
and backward kernels on an H100/H200 in bf16/fp16) and ``xla`` (the chunked XLA
path). The line says which path the kernels take here. The module has no side effects on import.
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
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_gpt  # noqa: E402  (data, optimizer, layer norm, attention block, logits)

import jax_tk  # noqa: E402
from jax_tk import linear_attention as la  # noqa: E402

PATHS = {"tk": None, "xla": "xla"}  # linear-attention path -> implementation=
GROUP = 4  # layers per group: GROUP - 1 Gated DeltaNet layers, then one attention layer
PRESETS = {  # defaults when a flag is not given
    "cpu": dict(groups=1, width=64, heads=2, la_heads=2, key_dim=16, value_dim=16, seq=64, batch=8, steps=40,
                lr=3e-3, dtype="float32", log_every=10, compare_steps=3),
    "gpu": dict(groups=2, width=1024, heads=16, la_heads=8, key_dim=128, value_dim=128, seq=2048, batch=8,
                steps=300, lr=1e-3, dtype="bfloat16", log_every=20, compare_steps=20),
}


@dataclasses.dataclass(frozen=True)
class Config:
    """Model shape and compute dtype (hashable: a static argument of the jitted functions). ``heads``: the
    attention layers' (head dim width / heads); ``la_heads``, ``key_dim``, ``value_dim``: the Gated
    DeltaNet layers'."""

    groups: int = 1
    width: int = 64
    heads: int = 2
    la_heads: int = 2
    key_dim: int = 16
    value_dim: int = 16
    seq: int = 64
    dtype: str = "float32"
    vocab: int = train_gpt.VOCAB

    @property
    def compute_dtype(self):
        return train_gpt.DTYPES[self.dtype]

    def attention_config(self) -> train_gpt.Config:
        return train_gpt.Config(layers=self.groups, width=self.width, heads=self.heads, seq=self.seq,
                                dtype=self.dtype, vocab=self.vocab)


@functools.partial(jax.jit, static_argnums=(1,))
def init_params(key, config: Config):
    """train_gpt.py's parameters (its blocks: the attention layers, one per group) and the Gated DeltaNet
    layers' ``params["delta"]``, stacked [groups, GROUP - 1, ...]. Matrices end in ``_w`` (decayed)."""
    c = config
    k_attn, k = jax.random.split(key)
    params = train_gpt.init_params(k_attn, c.attention_config())
    G, L, D, H, K, V = c.groups, GROUP - 1, c.width, c.la_heads, c.key_dim, c.value_dim
    keys = iter(jax.random.split(k, 9))
    std, res_std = 0.02, 0.02 / math.sqrt(2 * GROUP * G)
    normal = lambda shape, s=std: s * jax.random.normal(next(keys), (G, L, *shape), jnp.float32)  # noqa: E731
    zeros, ones = (lambda *s: jnp.zeros((G, L, *s), jnp.float32)), (lambda *s: jnp.ones((G, L, *s), jnp.float32))
    params["delta"] = {
        "ln1_scale": ones(D), "ln1_bias": zeros(D),
        "q_w": normal((D, H * K)), "k_w": normal((D, H * K)), "v_w": normal((D, H * V)),
        "a_w": normal((D, H)), "dt_bias": zeros(H), "A_log": jnp.log(jnp.broadcast_to(jnp.linspace(1, 16, H), (G, L, H))),
        "b_w": normal((D, H)), "gate_w": normal((D, H * V)), "o_norm_scale": ones(V),
        "proj_w": normal((H * V, D), res_std), "proj_b": zeros(D),
        "ln2_scale": ones(D), "ln2_bias": zeros(D),
        "fc_w": normal((D, 4 * D)), "fc_b": zeros(4 * D),
        "out_w": normal((4 * D, D), res_std), "out_b": zeros(D),
    }
    return params


def delta_layer(x, p, config: Config, implementation):
    """A Gated DeltaNet layer and its MLP: the residual stream x [B, T, width] -> the new one."""
    c, dt = config, config.compute_dtype
    B, T, _ = x.shape
    H, K, V = c.la_heads, c.key_dim, c.value_dim
    h = train_gpt._layer_norm(x, p["ln1_scale"], p["ln1_bias"]).astype(dt)
    q, k = ((h @ p[n].astype(dt)).reshape(B, T, H, K) for n in ("q_w", "k_w"))
    v = (h @ p["v_w"].astype(dt)).reshape(B, T, H, V)
    h32 = h.astype(jnp.float32)
    g = -jnp.exp(p["A_log"]) * jax.nn.softplus(h32 @ p["a_w"] + p["dt_bias"])
    beta = jax.nn.sigmoid(h32 @ p["b_w"])
    o, _ = la.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, implementation=implementation)
    o32 = o.astype(jnp.float32)
    o32 = o32 * jax.lax.rsqrt(jnp.square(o32).mean(-1, keepdims=True) + 1e-6) * p["o_norm_scale"]
    gate = jax.nn.silu((h @ p["gate_w"].astype(dt)).astype(jnp.float32)).reshape(B, T, H, V)
    a = (o32 * gate).astype(dt).reshape(B, T, H * V)
    x = x + (a @ p["proj_w"].astype(dt) + p["proj_b"].astype(dt)).astype(jnp.float32)
    h = train_gpt._layer_norm(x, p["ln2_scale"], p["ln2_bias"]).astype(dt)
    h = jax.nn.gelu(h @ p["fc_w"].astype(dt) + p["fc_b"].astype(dt))
    return x + (h @ p["out_w"].astype(dt) + p["out_b"].astype(dt)).astype(jnp.float32)


def forward(params, tokens, config: Config, path: str = "tk"):
    """tokens int32 [B, T <= config.seq] -> float32 logits [B, T, vocab]; ``path``: the linear-attention
    layers' (``PATHS``). The attention layers run jax_tk.attention (train_gpt.py's "tk")."""
    T = tokens.shape[1]
    x = params["wte"][tokens] + params["wpe"][:T]
    attn_config = config.attention_config()

    def group(x, p):
        delta, attn = p
        x, _ = jax.lax.scan(lambda x, d: (delta_layer(x, d, config, PATHS[path]), None), x, delta)
        return train_gpt._block(x, attn, attn_config, "tk"), None

    x, _ = jax.lax.scan(group, x, (params["delta"], params["blocks"]))
    return train_gpt.logits_of(params, x, attn_config)


def loss_fn(params, inputs, targets, config: Config, path: str = "tk"):
    logits = forward(params, inputs, config, path)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@functools.partial(jax.jit, static_argnames=("config", "optimizer", "path"), donate_argnums=(0, 1))
def train_step(params, opt_state, inputs, targets, config: Config, optimizer, path="tk"):
    loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets, config, path)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def train(config: Config, *, steps, batch, lr, seed=0, path="tk", log_every=10, data=None):
    """Trains from a fresh initialization on train_gpt's batches; returns (params, opt_state, optimizer,
    losses)."""
    data = train_gpt.load_data()[0] if data is None else data
    optimizer = train_gpt.make_optimizer(lr, steps)
    step = lambda params, opt_state, x, y: train_step(params, opt_state, x, y, config, optimizer, path)
    params, opt_state, losses, _ = train_gpt.fit(step, init_params(jax.random.key(seed), config), optimizer, data,
                                                 steps=steps, batch=batch, seq=config.seq, seed=seed,
                                                 log_every=log_every)
    return params, opt_state, optimizer, losses


def step_tokens_per_s(params, opt_state, optimizer, config: Config, batch: int, steps: int, path: str, data) -> float:
    """Training-step tokens/s of ``path`` over ``steps`` steps after a compiling one (on copies: the
    steps donate their inputs)."""
    params, opt_state = jax.tree_util.tree_map(jnp.copy, (params, opt_state))
    x, y = train_gpt.get_batch(data, batch, config.seq, 0, 0)
    params, opt_state, loss = train_step(params, opt_state, x, y, config, optimizer, path)
    jax.block_until_ready(loss)
    t0 = time.perf_counter()
    for _ in range(steps):
        params, opt_state, loss = train_step(params, opt_state, x, y, config, optimizer, path)
    jax.block_until_ready(loss)
    return steps * batch * config.seq / (time.perf_counter() - t0)


def kernels_line(config: Config, batch: int) -> str:
    """Which forward the "tk" path's gated_delta_rule runs here, and why not the kernels where not."""
    q = jax.ShapeDtypeStruct((batch, config.seq, config.la_heads, config.key_dim), config.compute_dtype)
    v = jax.ShapeDtypeStruct((batch, config.seq, config.la_heads, config.value_dim), config.compute_dtype)
    why = la.launch.unsupported_reason(q, v)
    return "jax_tk's forward kernels" if why is None else f"the chunked XLA path (the kernels do not take {why})"


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Flags left out take per-backend defaults: " + "; ".join(
            f"{k}: " + " ".join(f"--{n.replace('_', '-')} {v}" for n, v in d.items()) for k, d in PRESETS.items()))
    for name in ("groups", "width", "heads", "la_heads", "key_dim", "value_dim", "seq", "batch", "steps", "log_every",
                 "compare_steps"):
        p.add_argument("--" + name.replace("_", "-"), type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--dtype", choices=tuple(train_gpt.DTYPES))
    p.add_argument("--seed", type=int, default=0)
    return train_gpt.fill_preset(p.parse_args(argv), PRESETS)


def main(argv=None):
    """Trains, then times the training step with each linear-attention path; returns a dict: losses,
    tokens_per_s {path: value}, params, config."""
    args = parse_args(argv)
    config = Config(groups=args.groups, width=args.width, heads=args.heads, la_heads=args.la_heads,
                    key_dim=args.key_dim, value_dim=args.value_dim, seq=args.seq, dtype=args.dtype)
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), {config}, batch {args.batch}: "
          f"{config.groups * (GROUP - 1)} Gated DeltaNet and {config.groups} attention layers")
    data = train_gpt.load_data()[0]
    params, opt_state, optimizer, losses = train(config, steps=args.steps, batch=args.batch, lr=args.lr,
                                                 seed=args.seed, log_every=args.log_every, data=data)
    n = sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
    print(f"{n / 1e6:.2f}M parameters; train loss: first {losses[0]:.4f}, last {losses[-1]:.4f}")
    print(f"training step, {args.compare_steps} steps each; the tk path runs {kernels_line(config, args.batch)}")
    speeds = {}
    for path in PATHS:
        speeds[path] = step_tokens_per_s(params, opt_state, optimizer, config, args.batch, args.compare_steps, path, data)
        print(f"{path:>4}: {speeds[path]:12,.0f} tokens/s")
    return {"losses": losses, "tokens_per_s": speeds, "params": params, "config": config}


if __name__ == "__main__":
    main(sys.argv[1:])
