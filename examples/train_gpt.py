"""Train a small GPT on Shakespeare with jax_tk.attention.

A byte-level (vocabulary 256) GPT-2-style transformer in plain JAX + optax: the parameters are a
pytree of arrays, the model is a few pure functions, and the layers are stacked and run with
``jax.lax.scan``. Its attention is ``jax_tk.attention(q, k, v, is_causal=True)``; ``--attention``
swaps in ``jax.nn.dot_product_attention`` (cuDNN or XLA) or jax_tk's own pure-JAX reference, to
compare speed and loss.

    python examples/train_gpt.py                      # CPU: a tiny model; GPU: GPT-2 small, bf16
    python examples/train_gpt.py --attention cudnn    # the same run on cuDNN's attention
    python examples/train_gpt.py --resume --steps 2000

It writes into ``--out`` (default ``runs/gpt``): ``loss.png`` (the loss curve), ``ckpt.npz`` (the
parameters, the optimizer state and the step) and ``summary.json``; at the end it prints a sample of
generated text (``examples/generate.py`` samples with a KV cache, from a checkpoint of this script).

The module has no side effects on import, so that tests can use ``init_params``, ``loss_fn``,
``train_step`` and ``main(argv)``.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
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
VOCAB = 256  # bytes
ATTENTIONS = ("tk", "reference", "cudnn", "xla")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# Defaults when a flag is not given: a tiny model that learns visibly in a few CPU minutes, and
# GPT-2 small (124M parameters, head_dim 64, so the jax_tk kernel runs) on a GPU.
PRESETS = {
    "cpu": dict(layers=4, width=128, heads=4, kv_heads=0, seq=128, batch=8, steps=600, lr=3e-3,
                dtype="float32", log_every=10, eval_every=200, sample_len=300),
    "gpu": dict(layers=12, width=768, heads=12, kv_heads=0, seq=1024, batch=16, steps=1000, lr=6e-4,
                dtype="bfloat16", log_every=10, eval_every=200, sample_len=600),
}


@dataclasses.dataclass(frozen=True)
class Config:
    """Model shape and compute dtype (hashable: a static argument of the jitted functions)."""

    layers: int = 4
    width: int = 128
    heads: int = 4
    seq: int = 128
    dtype: str = "float32"
    vocab: int = VOCAB
    kv_heads: int = 0  # key/value heads, each shared by heads / kv_heads query heads (0: heads)

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def kv(self) -> int:
        """The key/value heads (grouped-query attention where fewer than the query heads)."""
        return self.kv_heads or self.heads

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]


# ----------------------------------------------------------------------------------------------
# Model: parameters are float32; matmuls and attention run in config.dtype; layer norms, the
# residual stream, the logits and the loss stay float32.
# ----------------------------------------------------------------------------------------------


def init_params(key, config: Config):
    """GPT-2 initialization: normal(0.02), residual output projections scaled by 1/sqrt(2 layers).

    Returns a dict; ``params["blocks"]`` holds every layer's arrays stacked on a leading axis.
    """
    L, D, V, T = config.layers, config.width, config.vocab, config.seq
    if D % config.heads:
        raise ValueError(f"width {D} is not a multiple of heads {config.heads}")
    if config.kv_heads < 0 or config.heads % config.kv:
        raise ValueError(f"kv_heads {config.kv_heads} must divide heads {config.heads} (0: as many as heads)")
    QKV = D + 2 * config.kv * config.head_dim  # (the query's width, the keys' and values')
    k = jax.random.split(key, 6)
    std, res_std = 0.02, 0.02 / math.sqrt(2 * L)
    normal = lambda key, shape, s: s * jax.random.normal(key, shape, jnp.float32)  # noqa: E731
    zeros, ones = (lambda *s: jnp.zeros(s, jnp.float32)), (lambda *s: jnp.ones(s, jnp.float32))
    blocks = {
        "ln1_scale": ones(L, D), "ln1_bias": zeros(L, D),
        "qkv_w": normal(k[0], (L, D, QKV), std), "qkv_b": zeros(L, QKV),
        "proj_w": normal(k[1], (L, D, D), res_std), "proj_b": zeros(L, D),
        "ln2_scale": ones(L, D), "ln2_bias": zeros(L, D),
        "fc_w": normal(k[2], (L, D, 4 * D), std), "fc_b": zeros(L, 4 * D),
        "out_w": normal(k[3], (L, 4 * D, D), res_std), "out_b": zeros(L, D),
    }
    return {
        "wte": normal(k[4], (V, D), std),  # tied with the output projection
        "wpe": normal(k[5], (T, D), std),
        "blocks": blocks,
        "lnf_scale": ones(D), "lnf_bias": zeros(D),
    }


def count_params(params) -> int:
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))


def runs_kernels(dtype: str) -> bool:
    """Whether jax_tk's GPU kernels run here for this compute dtype. Elsewhere (a CPU, a jax_tk built
    without its kernels, float32) jax_tk runs its pure-JAX reference: the speed lines then say so, so
    that they are not read as the kernels' speed."""
    return jax.default_backend() == "gpu" and jax_tk.has_cuda_kernels() and dtype in ("bfloat16", "float16")


def attend(q, k, v, attention: str):
    """Causal self-attention of [batch, seq, heads, head_dim] tensors by the chosen implementation."""
    if attention == "tk":
        # On a GPU in bf16/fp16 insist on the kernel (a clear error, not a silent fallback, if the
        # configuration does not fit it); elsewhere (CPU, float32) jax_tk runs its reference.
        kernel_dtype = q.dtype in (jnp.bfloat16, jnp.float16)
        impl = "tk" if jax.default_backend() == "gpu" and kernel_dtype else None
        return jax_tk.attention(q, k, v, is_causal=True, implementation=impl)
    if attention == "reference":
        return jax_tk.attention(q, k, v, is_causal=True, implementation="xla")
    if attention in ("cudnn", "xla"):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention)
    raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")


def _layer_norm(x, scale, bias, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def block_qkv(x, p, config: Config):
    """A block's attention inputs: q [batch, seq, heads, head_dim] and k, v [batch, seq, kv heads,
    head_dim] of the residual stream x."""
    dt = config.compute_dtype
    B, T, D = x.shape
    h = _layer_norm(x, p["ln1_scale"], p["ln1_bias"]).astype(dt)
    qkv = h @ p["qkv_w"].astype(dt) + p["qkv_b"].astype(dt)
    kv_width = config.kv * config.head_dim
    q, k, v = jnp.split(qkv, [D, D + kv_width], axis=-1)
    return (q.reshape(B, T, config.heads, config.head_dim), k.reshape(B, T, config.kv, config.head_dim),
            v.reshape(B, T, config.kv, config.head_dim))


def block_out(x, a, p, config: Config):
    """The rest of a block after attention: a [batch, seq, heads, head_dim] -> the new residual stream.
    (examples/generate.py runs blocks as block_qkv, attention over a KV cache, block_out.)"""
    dt = config.compute_dtype
    a = a.reshape(x.shape)
    x = x + (a @ p["proj_w"].astype(dt) + p["proj_b"].astype(dt)).astype(jnp.float32)
    h = _layer_norm(x, p["ln2_scale"], p["ln2_bias"]).astype(dt)
    h = jax.nn.gelu(h @ p["fc_w"].astype(dt) + p["fc_b"].astype(dt))
    return x + (h @ p["out_w"].astype(dt) + p["out_b"].astype(dt)).astype(jnp.float32)


def _block(x, p, config: Config, attention: str):
    q, k, v = block_qkv(x, p, config)
    return block_out(x, attend(q, k, v, attention), p, config)


def logits_of(params, x, config: Config):
    """float32 logits [..., vocab] of the final residual stream x (final layer norm, tied embedding)."""
    x = _layer_norm(x, params["lnf_scale"], params["lnf_bias"])
    dt = config.compute_dtype
    return (x.astype(dt) @ params["wte"].astype(dt).T).astype(jnp.float32)


def forward(params, tokens, config: Config, attention: str = "tk"):
    """tokens: int32 [batch, seq <= config.seq] -> float32 logits [batch, seq, vocab]."""
    T = tokens.shape[1]
    x = params["wte"][tokens] + params["wpe"][:T]
    x, _ = jax.lax.scan(lambda x, p: (_block(x, p, config, attention), None), x, params["blocks"])
    return logits_of(params, x, config)


def loss_fn(params, inputs, targets, config: Config, attention: str = "tk"):
    """Mean next-byte cross-entropy (nats) of int32 [batch, seq] inputs and targets."""
    logits = forward(params, inputs, config, attention)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_optimizer(lr: float, steps: int, weight_decay: float = 0.1):
    """AdamW, linear warm-up then cosine decay to lr/10, gradient clipping at norm 1. Matrices and
    embeddings are decayed; biases and layer-norm parameters are not."""
    warmup = max(1, min(100, steps // 10))
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr / 10)

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: _leaf_name(path).endswith("_w") or _leaf_name(path) in ("wte", "wpe"),
            params,
        )

    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay_mask),
    )


def _leaf_name(path) -> str:
    last = path[-1]
    return str(getattr(last, "key", getattr(last, "name", last)))


@functools.partial(jax.jit, static_argnames=("config", "optimizer", "attention"),
                   donate_argnums=(0, 1))
def train_step(params, opt_state, inputs, targets, config: Config, optimizer, attention="tk"):
    """One optimizer step; returns (params, opt_state, loss). params and opt_state are donated."""
    loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets, config, attention)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


@functools.partial(jax.jit, static_argnames=("config", "attention"))
def eval_loss(params, inputs, targets, config: Config, attention="tk"):
    return loss_fn(params, inputs, targets, config, attention)


# ----------------------------------------------------------------------------------------------
# Data: the bytes of a text file; batches are drawn at random offsets, reproducibly from
# (seed, step), so that a resumed run sees the same batches as an uninterrupted one.
# ----------------------------------------------------------------------------------------------


def load_data(path: str = DATA, val_fraction: float = 0.1):
    with open(path, "rb") as f:
        data = np.frombuffer(f.read(), dtype=np.uint8)
    n = int(len(data) * (1 - val_fraction))
    return data[:n], data[n:]


def get_batch(data, batch: int, seq: int, seed: int, step: int):
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(data) - seq - 1, size=batch)
    idx = starts[:, None] + np.arange(seq + 1)[None, :]
    chunk = data[idx].astype(np.int32)
    return chunk[:, :-1], chunk[:, 1:]


def fit(step, params, optimizer, data, *, steps: int, batch: int, seq: int, seed: int = 0, log_every: int = 10):
    """The training loop of the examples built on this one: ``step(params, opt_state, x, y) -> (params,
    opt_state, loss)`` over ``steps`` batches of ``get_batch``, from a fresh optimizer state, the loss
    printed every ``log_every`` steps. Returns (params, opt_state, losses, tokens/s over the steps after
    the first, which compiles)."""
    opt_state = optimizer.init(params)
    losses, t0 = [], None
    for i in range(steps):
        x, y = get_batch(data, batch, seq, seed, i)
        params, opt_state, loss = step(params, opt_state, x, y)
        if t0 is None:
            jax.block_until_ready(loss)
            t0 = time.perf_counter()
        losses.append(loss)
        if (i + 1) % log_every == 0 or i + 1 == steps:
            print(f"step {i + 1:5d}  loss {float(loss):.4f}", flush=True)
    losses = [float(v) for v in jax.device_get(losses)]  # (waits for the device)
    tokens_per_s = (steps - 1) * batch * seq / (time.perf_counter() - t0) if steps > 1 else float("nan")
    return params, opt_state, losses, tokens_per_s


# ----------------------------------------------------------------------------------------------
# Checkpoints: one .npz with every leaf of (params, opt_state) under its tree path, the step, the
# loss history and the config as JSON. Restored into the tree structure of a freshly built state.
# ----------------------------------------------------------------------------------------------


def _flatten(tree, prefix):
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {prefix + jax.tree_util.keystr(path): np.asarray(x) for path, x in leaves}


def save_checkpoint(path, params, opt_state, step, losses, config: Config, extra=None):
    arrays = {**_flatten(params, "params"), **_flatten(opt_state, "opt_state")}
    meta = {"config": dataclasses.asdict(config), "step": int(step), **(extra or {})}
    tmp = path + ".tmp.npz"
    np.savez(tmp, __meta__=np.array(json.dumps(meta)), __losses__=np.asarray(losses, np.float32),
             **arrays)
    os.replace(tmp, path)


def read_checkpoint_meta(path):
    with np.load(path) as f:
        return json.loads(str(f["__meta__"]))


def load_checkpoint(path, params_template, opt_state_template):
    """Returns (params, opt_state, step, losses) with the structure of the templates."""
    with np.load(path) as f:
        meta = json.loads(str(f["__meta__"]))

        def restore(tree, prefix):
            paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
            leaves = []
            for p, like in paths:
                name = prefix + jax.tree_util.keystr(p)
                if name not in f:
                    raise ValueError(f"checkpoint {path} has no array {name}")
                x = f[name]
                if x.shape != like.shape:
                    raise ValueError(f"{name}: checkpoint shape {x.shape} != model shape {like.shape}")
                leaves.append(jnp.asarray(x, dtype=like.dtype))
            return jax.tree_util.tree_unflatten(treedef, leaves)

        params = restore(params_template, "params")
        opt_state = restore(opt_state_template, "opt_state")
        losses = f["__losses__"].tolist()
    return params, opt_state, meta["step"], losses


# ----------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------


def generate(params, config: Config, prompt: bytes, length: int, *, attention="tk",
             temperature=0.8, seed=0) -> bytes:
    """Samples ``length`` bytes after ``prompt`` (no KV cache: one forward over the last
    ``config.seq`` bytes per new byte, in one compiled function)."""
    T = config.seq

    @jax.jit
    def next_token(params, window, pos, key):
        logits = forward(params, window[None], config, attention)[0, pos]
        return jax.random.categorical(key, logits / temperature)

    tokens = list(prompt) or [ord("\n")]
    key = jax.random.key(seed)
    for _ in range(length):
        ctx = tokens[-T:]
        window = np.zeros(T, np.int32)
        window[: len(ctx)] = ctx  # right-padding is invisible to causal attention
        key, sub = jax.random.split(key)
        tokens.append(int(next_token(params, window, len(ctx) - 1, sub)))
    return bytes(tokens)


# ----------------------------------------------------------------------------------------------
# Plot
# ----------------------------------------------------------------------------------------------


def ema(values, alpha=0.9):
    """Exponential moving average, bias-corrected (like Adam's moments) so it starts on the data."""
    out, m = [], 0.0
    for t, v in enumerate(values, 1):
        m = alpha * m + (1 - alpha) * v
        out.append(m / (1 - alpha**t))
    return out


def plot_losses(path, losses, val_points, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    steps = np.arange(1, len(losses) + 1)
    ax.plot(steps, losses, color="tab:blue", alpha=0.25, lw=0.8, label="train (per step)")
    ax.plot(steps, ema(losses), color="tab:blue", lw=1.6, label="train (EMA 0.9)")
    if val_points:
        vs, vl = zip(*val_points)
        ax.plot(vs, vl, "o-", color="tab:orange", ms=4, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Flags left out take per-backend defaults: "
        + "; ".join(f"{k}: " + " ".join(f"--{n.replace('_', '-')} {v}" for n, v in d.items())
                    for k, d in PRESETS.items()),
    )
    p.add_argument("--attention", choices=ATTENTIONS, default="tk",
                   help="tk: jax_tk.attention (the CUDA kernel on a GPU); reference: "
                   "jax_tk.attention(implementation='xla'); cudnn / xla: "
                   "jax.nn.dot_product_attention(implementation=...)")
    p.add_argument("--steps", type=int, help="total optimizer steps (a resumed run continues to it)")
    p.add_argument("--batch", type=int, help="sequences per step")
    p.add_argument("--seq", type=int, help="context length in bytes")
    p.add_argument("--layers", type=int)
    p.add_argument("--width", type=int, help="model width (heads * head_dim)")
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int, help="key/value heads (grouped-query attention; 0: as many as heads)")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=tuple(DTYPES), help="compute dtype (parameters stay float32)")
    p.add_argument("--out", default=os.path.join("runs", "gpt"), help="output directory")
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.npz")
    p.add_argument("--data", default=DATA, help="training text (bytes)")
    p.add_argument("--log-every", type=int, help="steps between loss read-backs / progress updates")
    p.add_argument("--eval-every", type=int, help="steps between validation losses (0: end only)")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--save-every", type=int, default=500, help="steps between checkpoints")
    p.add_argument("--sample-len", type=int, help="bytes of text to generate at the end (0: none)")
    p.add_argument("--prompt", default="\n", help="start of the generated sample")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines instead)")
    args = p.parse_args(argv)
    args.given = {name for name in PRESETS["cpu"] if getattr(args, name) is not None}
    return fill_preset(args, PRESETS)


def fill_preset(args, presets: dict):
    """``args`` with every option left unset (None) taken from ``presets["gpu"]`` on a GPU, else
    ``presets["cpu"]`` (the examples' presets)."""
    for name, value in presets["gpu" if jax.default_backend() == "gpu" else "cpu"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv=None):
    """Runs training; returns a dict of results: losses, val_points, step, tokens_per_s, sample,
    the final params and opt_state, ..."""
    args = parse_args(argv)
    backend = jax.default_backend()
    os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, "ckpt.npz")

    config = Config(layers=args.layers, width=args.width, heads=args.heads, seq=args.seq,
                    dtype=args.dtype, kv_heads=args.kv_heads)
    if args.resume:
        if not os.path.exists(ckpt_path):
            raise SystemExit(f"--resume: no checkpoint at {ckpt_path}")
        saved = Config(**read_checkpoint_meta(ckpt_path)["config"])
        ignored = [f"--{k} {getattr(config, k)}" for k in ("layers", "width", "heads", "kv_heads", "seq", "dtype")
                   if k in args.given and getattr(config, k) != getattr(saved, k)]
        if ignored:
            print(f"resume: the checkpoint's model is {saved}; ignoring {', '.join(ignored)}")
        config = saved
    if args.attention == "cudnn" and backend != "gpu":
        raise SystemExit("--attention cudnn needs a GPU")

    train_data, val_data = load_data(args.data)
    optimizer = make_optimizer(args.lr, args.steps)
    params = init_params(jax.random.key(args.seed), config)
    opt_state = optimizer.init(params)
    step, losses, val_points = 0, [], []
    if args.resume:
        params, opt_state, step, losses = load_checkpoint(ckpt_path, params, opt_state)
        val_points = [tuple(v) for v in read_checkpoint_meta(ckpt_path).get("val_points", [])]
        print(f"resumed from {ckpt_path} at step {step}")

    tokens_per_step = args.batch * config.seq
    reference = args.attention == "reference" or (args.attention == "tk" and not runs_kernels(config.dtype))
    note = " (no GPU kernel runs here: jax_tk's pure-JAX reference attention)" if reference else ""
    print(f"backend {backend} ({jax.devices()[0].device_kind}), attention {args.attention}{note}, "
          f"{count_params(params) / 1e6:.2f}M parameters, {config}, batch {args.batch}, "
          f"{len(train_data) / 1e3:.0f} KB of training text")

    def validate():
        total = 0.0
        for i in range(args.eval_batches):  # the same batches every time
            x, y = get_batch(val_data, args.batch, config.seq, args.seed, step=10**9 + i)
            total += float(eval_loss(params, x, y, config, args.attention))
        return total / args.eval_batches

    def save():
        save_checkpoint(ckpt_path, params, opt_state, step, losses, config,
                        extra={"val_points": val_points, "attention": args.attention})

    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=args.steps, initial=step, unit="step", dynamic_ncols=True)

    # Timing: the clock starts once the first step of this run (the one that compiles) has finished.
    # Every reading waits for the device (the losses are read back), and the time spent validating
    # and saving checkpoints is left out.
    t0 = None
    paused = 0.0
    timed_steps = 0
    tokens_per_s = float("nan")
    pending = []  # device losses not yet read back
    start_time = time.perf_counter()
    first_step = step

    def flush():
        """Reads back the pending losses (waiting for the device) and updates the rate."""
        nonlocal pending, tokens_per_s
        if not pending:
            return
        values = [float(v) for v in jax.device_get(pending)]
        losses.extend(values)
        if progress is not None:
            progress.update(len(pending))
        pending = []
        if timed_steps:
            tokens_per_s = timed_steps * tokens_per_step / (time.perf_counter() - t0 - paused)
        if not math.isfinite(values[-1]):
            raise FloatingPointError(f"loss is {values[-1]} at step {step}")
        rate = f"{tokens_per_s:,.0f}" if timed_steps else "-"
        if progress is not None:
            progress.set_postfix(loss=f"{values[-1]:.3f}", tok_s=rate)
        else:
            print(f"step {step:6d}  loss {values[-1]:.4f}  tokens/s {rate}", flush=True)

    while step < args.steps:
        x, y = get_batch(train_data, args.batch, config.seq, args.seed, step)
        params, opt_state, loss = train_step(params, opt_state, x, y, config, optimizer,
                                             args.attention)
        step += 1
        pending.append(loss)
        if t0 is None:
            jax.block_until_ready(loss)
            compile_s = time.perf_counter() - start_time
            t0 = time.perf_counter()
        else:
            timed_steps += 1
        if step % args.log_every == 0 or step == args.steps or step == first_step + 1:
            flush()
        evaluate = args.eval_every and step % args.eval_every == 0 and step != args.steps
        checkpoint = args.save_every and step % args.save_every == 0 and step != args.steps
        if evaluate or checkpoint:
            flush()
            pause_start = time.perf_counter()
            if evaluate:
                val_points.append((step, validate()))
                msg = f"step {step}: validation loss {val_points[-1][1]:.4f}"
                progress.write(msg) if progress is not None else print(msg, flush=True)
            if checkpoint:
                save()
            paused += time.perf_counter() - pause_start
    flush()
    if progress is not None:
        progress.close()
    train_s = time.perf_counter() - start_time

    if step > first_step or not val_points or val_points[-1][0] != step:
        val_points.append((step, validate()))
    save()
    png = os.path.join(args.out, "loss.png")
    plot_losses(png, losses, val_points,
                f"byte-level GPT {config.layers}x{config.width} ({config.heads} heads of "
                f"{config.head_dim}, {config.kv} kv), {config.dtype}, attention={args.attention}, {backend}")

    ran = step - first_step
    print(f"trained steps {first_step}..{step} in {train_s:.1f} s"
          + (f" (first step, with compilation: {compile_s:.1f} s)" if ran else ""))
    if losses:
        window = min(10, len(losses))
        print(f"train loss: first {losses[0]:.4f}, last {losses[-1]:.4f} "
              f"(mean of last {window}: {np.mean(losses[-window:]):.4f}); "
              f"validation loss {val_points[-1][1]:.4f}")
    if timed_steps:
        print(f"throughput: {tokens_per_s:,.0f} tokens/s over {timed_steps} steps "
              f"(after the first), {tokens_per_step} tokens per step"
              + ("; the speed of jax_tk's pure-JAX reference attention, not of its kernels" if reference else ""))
    print(f"wrote {png} and {ckpt_path}")

    sample = None
    if args.sample_len > 0:
        sample = generate(params, config, args.prompt.encode(), args.sample_len,
                          attention=args.attention, seed=args.seed)
        text = sample.decode("utf-8", errors="replace")
        print("-" * 30 + " sample " + "-" * 30)
        print(text)
        print("-" * 68)

    result = {
        "step": step, "first_step": first_step, "losses": losses, "val_points": val_points,
        "tokens_per_s": tokens_per_s, "train_seconds": train_s, "config": dataclasses.asdict(config),
        "attention": args.attention, "backend": backend,
    }
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({k: v for k, v in result.items() if k != "losses"}, f, indent=1)
    result.update(sample=sample, params=params, opt_state=opt_state)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
