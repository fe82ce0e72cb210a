"""Multi-device training with jax_tk: data + head (tensor) parallelism, and ring attention.

Two runs of a small byte-level transformer (RMSNorm, rotary positions, grouped-query attention on
``jax_tk``), each printing its loss and throughput (tokens/s in total and per device):

``--mode dp-tp`` (default)
    A 2-D mesh ``("data", "model")``. The batch is split over ``data``; the attention heads and the
    MLP's hidden units over ``model`` (Megatron-style: the q/k/v and MLP-up projections are split by
    columns, the output and MLP-down projections by rows, whose partial sums are all-reduced).
    ``jax_tk.attention`` gets q/k/v split over batch and heads and runs the kernel on each device's
    shard, with no gather. ``--sharding explicit`` (default) types the shardings
    (``AxisType.Explicit``: jax_tk wraps the kernel in ``shard_map``); ``--sharding auto`` leaves them
    to XLA (jax_tk's custom_partitioning rule).

``--mode ring``
    Long context: a mesh ``("data", "sp")``; each sequence is split over ``sp`` in the zig-zag
    layout (``jax_tk.zigzag``: device i holds chunks i and 2n-1-i, which balances the causal
    work) and the model runs inside ``shard_map``, its attention being ``jax_tk.ring_attention``.

Examples::

    python examples/multi_gpu.py                           # CPU smoke run: 8 fake devices, tiny
    python examples/multi_gpu.py --mode ring               # ditto, ring attention
    # two GPUs
    python examples/multi_gpu.py --mode dp-tp --data 1 --model 2
    python examples/multi_gpu.py --mode ring --seq 131072 --sp 2       # 128k tokens on 2 GPUs
    python examples/multi_gpu.py --mode ring --seq 65536 --devices 1   # vs 64k on one GPU

Works with several processes (``--distributed`` calls ``jax.distributed.initialize()``): meshes are
built from ``jax.devices()``, every process makes the same global batch and contributes its
addressable shards, and only process 0 prints.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import time

if __name__ == "__main__" and "--cpu-devices" in " ".join(sys.argv):  # before JAX starts
    _n = sys.argv[sys.argv.index("--cpu-devices") + 1]
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_n}"
    )

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_tk

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "shakespeare.txt")
VOCAB = 256


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int = 2
    width: int = 64
    heads: int = 4
    kv_heads: int = 2
    seq: int = 256
    dtype: str = "float32"
    remat: bool = False

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------


def init_params(key, cfg: Config):
    L, D, N, K, H, F = cfg.layers, cfg.width, cfg.heads, cfg.kv_heads, cfg.head_dim, 4 * cfg.width
    ks = jax.random.split(key, 7)
    normal = lambda k, shape, std: std * jax.random.normal(k, shape, jnp.float32)
    res = 0.02 / math.sqrt(2 * L)
    return {
        "emb": normal(ks[0], (VOCAB, D), 0.02),
        "ln_f": jnp.ones((D,)),
        "blocks": {
            "ln1": jnp.ones((L, D)), "ln2": jnp.ones((L, D)),
            "wq": normal(ks[1], (L, D, N, H), 0.02),
            "wk": normal(ks[2], (L, D, K, H), 0.02),
            "wv": normal(ks[3], (L, D, K, H), 0.02),
            "wo": normal(ks[4], (L, N, H, D), res),
            "w1": normal(ks[5], (L, D, F), 0.02),
            "w2": normal(ks[6], (L, F, D), res),
        },
    }


def param_specs(cfg: Config, model_axis: str | None, model_size: int):
    """Tensor parallelism over ``model_axis``: heads and MLP hidden units split (kv heads too when
    they divide; else key/value projections stay replicated and jax_tk shares each kv head)."""
    m = model_axis
    kv = m if cfg.kv_heads % max(model_size, 1) == 0 else None
    return {
        "emb": P(), "ln_f": P(),
        "blocks": {
            "ln1": P(), "ln2": P(),
            "wq": P(None, None, m, None), "wk": P(None, None, kv, None), "wv": P(None, None, kv, None),
            "wo": P(None, m, None, None), "w1": P(None, None, m), "w2": P(None, m, None),
        },
    }


def _rmsnorm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _rope(x, pos):
    """Rotary embedding of x [B, T, heads, H] at integer positions pos [B, T]."""
    h = x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(h, dtype=jnp.float32) / h))
    ang = pos.astype(jnp.float32)[..., None, None] * freq  # [B, T, 1, h]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x1, x2 = x[..., :h].astype(jnp.float32), x[..., h:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x.dtype)


def _block(x, p, pos, cfg: Config, attend, project):
    """One pre-norm layer. ``attend(q, k, v)`` is the attention; ``project(eq, a, w)`` the matmuls
    whose contraction is split over devices (row-parallel: it sums the partial products)."""
    dt = cfg.compute_dtype
    h = _rmsnorm(x, p["ln1"]).astype(dt)
    q = _rope(jnp.einsum("btd,dnh->btnh", h, p["wq"].astype(dt)), pos)
    k = _rope(jnp.einsum("btd,dkh->btkh", h, p["wk"].astype(dt)), pos)
    v = jnp.einsum("btd,dkh->btkh", h, p["wv"].astype(dt))
    x = x + project("btnh,nhd->btd", attend(q, k, v), p["wo"].astype(dt)).astype(jnp.float32)
    h = _rmsnorm(x, p["ln2"]).astype(dt)
    u = jax.nn.gelu(jnp.einsum("btd,df->btf", h, p["w1"].astype(dt)))
    return x + project("btf,fd->btd", u, p["w2"].astype(dt)).astype(jnp.float32)


def token_losses(params, tokens, targets, pos, cfg: Config, attend, project):
    """Per-token cross-entropy [B, T] (float32)."""
    # Embedding as a one-hot matmul (vocabulary 256): a plain einsum, which every sharding handles.
    x = jnp.einsum("btv,vd->btd", jax.nn.one_hot(tokens, VOCAB, dtype=jnp.float32), params["emb"])
    block = functools.partial(_block, pos=pos, cfg=cfg, attend=attend, project=project)
    if cfg.remat:
        block = jax.checkpoint(block)
    x, _ = jax.lax.scan(lambda x, p: (block(x, p), None), x, params["blocks"])
    x = _rmsnorm(x, params["ln_f"])
    dt = cfg.compute_dtype
    logits = jnp.einsum("btd,vd->btv", x.astype(dt), params["emb"].astype(dt)).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


# ----------------------------------------------------------------------------------------------
# The two parallel set-ups: a loss function of (params, tokens, targets, positions)
# ----------------------------------------------------------------------------------------------


def _attention_impl():
    return "tk" if jax.default_backend() == "gpu" else None  # the kernel, or a clear error, on GPU


def dp_tp_loss(cfg: Config, mesh, explicit: bool):
    """Batch over "data", heads and MLP over "model"; jax_tk.attention partitions itself."""
    act = P("data", None, None)

    def project(eq, a, w):  # row-parallel: the contraction is split over "model"
        if explicit:
            return jnp.einsum(eq, a, w, out_sharding=NamedSharding(mesh, act))
        return jax.lax.with_sharding_constraint(jnp.einsum(eq, a, w), NamedSharding(mesh, act))

    def attend(q, k, v):
        return jax_tk.attention(q, k, v, is_causal=True, implementation=_attention_impl())

    def loss(params, tokens, targets, pos):
        return jnp.mean(token_losses(params, tokens, targets, pos, cfg, attend, project))

    return loss


def ring_loss(cfg: Config, mesh):
    """Sequence over "sp" (zig-zag order), batch over "data": the model runs in shard_map."""
    seq = P("data", "sp")

    def local(params, tokens, targets, pos):
        def attend(q, k, v):
            return jax_tk.ring_attention(q, k, v, axis_name="sp", is_causal=True, layout="zigzag",
                                         implementation=_attention_impl())

        per_token = token_losses(params, tokens, targets, pos, cfg, attend, jnp.einsum)
        return jax.lax.psum(jnp.sum(per_token), ("data", "sp"))

    smap = jax.shard_map(local, mesh=mesh, in_specs=(P(), seq, seq, seq), out_specs=P())

    def loss(params, tokens, targets, pos):
        return smap(params, tokens, targets, pos) / tokens.size

    return loss


# ----------------------------------------------------------------------------------------------
# Data (every process builds the same global batch; each contributes its own shards)
# ----------------------------------------------------------------------------------------------


def _text() -> np.ndarray:
    if os.path.exists(DATA):
        return np.frombuffer(open(DATA, "rb").read(), dtype=np.uint8)
    return np.random.default_rng(0).integers(0, VOCAB, 1 << 20, dtype=np.uint8)


def global_batch(text, step, batch, seq, seed=0):
    """int32 (inputs, targets) [batch, seq]; windows wrap around a short text."""
    rng = np.random.default_rng((seed, step))
    starts = rng.integers(0, len(text), batch)
    idx = (starts[:, None] + np.arange(seq + 1)[None]) % len(text)
    w = text[idx].astype(np.int32)
    return w[:, :-1], w[:, 1:]


def put_global(x: np.ndarray, sharding):
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------


def log(*args):
    if jax.process_index() == 0:
        print(*args, flush=True)


def run(args) -> dict:
    devices = jax.devices()[: args.devices] if args.devices else jax.devices()
    n = len(devices)
    on_gpu = jax.default_backend() == "gpu"
    cfg = Config(
        layers=args.layers, width=args.width, heads=args.heads, kv_heads=args.kv_heads, seq=args.seq,
        dtype=args.dtype or ("bfloat16" if on_gpu else "float32"), remat=args.remat,
    )
    types = lambda k: (AxisType.Explicit,) * k
    if args.mode == "dp-tp":
        model = args.model or (2 if n % 2 == 0 and cfg.heads % 2 == 0 else 1)
        data = args.data or n // model
        explicit = args.sharding == "explicit"
        axis_types = types(2) if explicit else (AxisType.Auto,) * 2
        mesh = jax.make_mesh((data, model), ("data", "model"), axis_types=axis_types,
                             devices=devices[: data * model])
        specs = param_specs(cfg, "model", model)
        batch_spec = P("data", None)
        loss = dp_tp_loss(cfg, mesh, explicit)
        layout = f"mesh data={data} x model={model} ({args.sharding} sharding)"
    else:
        sp = args.sp or n
        data = args.data or n // sp
        mesh = jax.make_mesh((data, sp), ("data", "sp"), axis_types=types(2),
                             devices=devices[: data * sp])
        specs = jax.tree.map(lambda _: P(), param_specs(cfg, None, 1))
        batch_spec = P("data", "sp")
        loss = ring_loss(cfg, mesh)
        layout = f"mesh data={data} x sp={sp} (ring attention, zig-zag)"
    used = mesh.devices.size
    batch = args.batch or data
    log(f"jax {jax.__version__} on {used} x {devices[0].device_kind}; {layout}; "
        f"{cfg}; batch {batch} x {cfg.seq} tokens")
    if not (on_gpu and jax_tk.has_cuda_kernels() and cfg.dtype in ("bfloat16", "float16")):
        log("no GPU kernel runs here: attention is jax_tk's pure-JAX reference, so the speeds below are "
            "not those of jax_tk's kernels")

    with jax.set_mesh(mesh):  # explicit sharding wants the mesh in context
        return _train(args, cfg, mesh, specs, batch_spec, loss, batch)


def _train(args, cfg, mesh, specs, batch_spec, loss, batch) -> dict:
    used = mesh.devices.size
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    params = jax.jit(init_params, static_argnums=1, out_shardings=shardings)(jax.random.key(0), cfg)
    optimizer = optax.adamw(args.lr, b1=0.9, b2=0.95, weight_decay=0.1)
    opt_state = jax.jit(optimizer.init)(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, tokens, targets, pos):
        value, grads = jax.value_and_grad(loss)(params, tokens, targets, pos)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    text = _text()
    positions = np.broadcast_to(np.arange(cfg.seq, dtype=np.int32), (batch, cfg.seq))
    if args.mode == "ring":
        # Zig-zag order: every per-position input is permuted the same way (once, on the host).
        order = jax_tk.zigzag_indices(cfg.seq, mesh.shape["sp"])
        positions = positions[:, order]
    in_sharding = NamedSharding(mesh, batch_spec)
    pos = put_global(np.ascontiguousarray(positions), in_sharding)

    def batch_at(i):
        x, y = global_batch(text, i, batch, cfg.seq)
        if args.mode == "ring":
            x, y = x[:, order], y[:, order]
        return put_global(np.ascontiguousarray(x), in_sharding), put_global(np.ascontiguousarray(y), in_sharding)

    t0 = time.perf_counter()
    if args.hlo_out:  # the compiled step, to look at its collectives
        with open(args.hlo_out, "w") as f:
            f.write(step.lower(params, opt_state, *batch_at(0), pos).compile().as_text())
    params, opt_state, value = step(params, opt_state, *batch_at(0), pos)
    first = float(value)
    log(f"step 0: loss {first:.3f} (compile + first step {time.perf_counter() - t0:.1f} s)")
    losses, times = [first], []
    for i in range(1, args.steps):
        tokens, targets = batch_at(i)
        t = time.perf_counter()
        params, opt_state, value = step(params, opt_state, tokens, targets, pos)
        value = float(value)  # waits for the step
        times.append(time.perf_counter() - t)
        losses.append(value)
        if i % args.log_every == 0 or i == args.steps - 1:
            log(f"step {i}: loss {value:.3f}  {batch * cfg.seq / times[-1]:,.0f} tokens/s")
    result = {"losses": losses, "devices": used}
    if times:
        dt = float(np.median(times))
        tps = batch * cfg.seq / dt
        tflops = train_flops(cfg, batch) / dt / used / 1e12
        result.update(step_s=dt, tokens_per_s=tps, tokens_per_s_per_device=tps / used,
                      model_tflops_per_device=tflops)
        log(f"median step {dt * 1e3:.1f} ms: {tps:,.0f} tokens/s, {tps / used:,.0f} tokens/s per device, "
            f"{tflops:.1f} model TFLOP/s per device")
    return result


def train_flops(cfg: Config, batch: int) -> float:
    """Model FLOPs of one training step (no recomputation counted): 6 per parameter of every matmul
    per token, plus causal attention, 2*B*heads*T^2*head_dim forward and 2.5x that backward. At long
    context attention dominates and grows with T, so compare runs of different lengths by FLOP/s."""
    D, N, K, H, F, T = cfg.width, cfg.heads, cfg.kv_heads, cfg.head_dim, 4 * cfg.width, cfg.seq
    matmul_params = cfg.layers * (D * N * H + 2 * D * K * H + N * H * D + 2 * D * F) + VOCAB * D
    attention = cfg.layers * 3.5 * 2 * batch * N * T * T * H
    return 6 * matmul_params * batch * T + attention


def parse_args(argv=None):
    on_gpu = jax.default_backend() == "gpu"
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("dp-tp", "ring"), default="dp-tp")
    p.add_argument("--sharding", choices=("explicit", "auto"), default="explicit",
                   help="dp-tp: typed (explicit) shardings, or left to XLA (auto)")
    p.add_argument("--devices", type=int, default=0, help="use the first N devices (0: all)")
    p.add_argument("--data", type=int, default=0, help="size of the data axis (0: what is left)")
    p.add_argument("--model", type=int, default=0, help="dp-tp: size of the model axis (0: 2 if possible)")
    p.add_argument("--sp", type=int, default=0, help="ring: size of the sequence axis (0: all devices)")
    p.add_argument("--layers", type=int, default=12 if on_gpu else 2)
    p.add_argument("--width", type=int, default=768 if on_gpu else 64)
    p.add_argument("--heads", type=int, default=6 if on_gpu else 4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048 if on_gpu else 128)
    p.add_argument("--batch", type=int, default=0, help="global batch (0: one sequence per data shard)")
    p.add_argument("--dtype", default=None, help="compute dtype (default bfloat16 on GPU, else float32)")
    p.add_argument("--remat", action="store_true", help="recompute each layer in the backward")
    p.add_argument("--steps", type=int, default=20 if on_gpu else 4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--hlo-out", default="", help="write the compiled training step's HLO here")
    p.add_argument("--distributed", action="store_true", help="call jax.distributed.initialize()")
    p.add_argument("--cpu-devices", type=int, default=0,
                   help="fake N CPU devices (sets XLA_FLAGS; only when run as a script)")
    return p.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--distributed" in argv:
        jax.distributed.initialize()
    return run(parse_args(argv))


if __name__ == "__main__":
    if ("--distributed" not in sys.argv and "--cpu-devices" not in sys.argv
            and jax.default_backend() == "cpu" and jax.device_count() == 1):
        # A CPU smoke run wants several devices: restart with 8 fake ones.
        os.execv(sys.executable, [sys.executable, *sys.argv, "--cpu-devices", "8"])
    main()
