"""Train a small DeepSeek-style multi-head latent attention (MLA) model, and generate from its latent cache.

A byte-level language model on Shakespeare (the data, optimizer and logits of ``examples/train_gpt.py``)
whose attention is DeepSeek-V2/V3's multi-head latent attention. Per layer, with ``H`` heads:

- queries: ``x W_q`` (or through a low-rank latent, ``rms(x W_dq) W_uq``, with ``--q-lora-rank``),
  split per head into ``q_nope`` (``qk_nope`` dims) and ``q_rope`` (``qk_rope`` dims, rotary);
- keys and values come from one latent per token, ``c_kv = rms(x W_dkv)`` (``kv_lora_rank`` dims),
  plus one rotary key ``k_rope`` (``qk_rope`` dims) that all heads share:
  ``k_h = [c_kv W_uk_h | rope(k_rope)]`` (``qk_nope + qk_rope`` dims), ``v_h = c_kv W_uv_h``
  (``v_dim`` dims).

Training runs ``jax_tk.attention(q, k, v, is_causal=True)`` with query/key head dim ``qk_nope + qk_rope``
and value head dim ``v_dim`` (192 and 128 in DeepSeek's models).

Generation caches, per layer and token, only the latent row ``[c_kv | rope(k_rope)]``
(``kv_lora_rank + qk_rope`` dims, one "head"), contiguous ``[B, S, 1, D]`` or paged (``--paged``),
written with ``jax_tk.decode.update_kv_cache``. At decode the key up-projection is absorbed into the
query (``q_latent_h = q_nope_h W_uk_h^T``, since ``q_nope_h . (c_kv W_uk_h) = (q_nope_h W_uk_h^T) . c_kv``),
so every head attends over the latent rows with ``jax_tk.decode.mla_attention`` (values: the first
``kv_lora_rank`` dims of the rows, i.e. ``c_kv``), and the value up-projection is applied to the
output (``out_h = o_latent_h W_uv_h``). The XLA path to compare with caches the expanded per-head keys and
values (``H (qk_nope + qk_rope + v_dim)`` numbers per token and layer instead of ``kv_lora_rank + qk_rope``)
and attends with ``jax_tk.attention(implementation="xla")``. Both prefill the prompt with the training
attention. Printed: loss while training, decode tokens/s of both paths (the clock starts after a
compiling run), and the check: both paths fed the latent path's greedy tokens give the same logits,
and those of a plain forward over the whole sequence (relative error under 1e-4 in float32).

    python examples/mla.py                         # CPU: a tiny model, seconds; GPU: DeepSeek head dims, bf16
    python examples/mla.py --paged --steps 300     # a paged latent cache

On an H100/H200 with DeepSeek's latent dims (the GPU preset: 512 + 64) the latent path runs jax_tk's MLA
decode kernel; elsewhere ``mla_attention`` runs its pure-JAX reference, and the line says so. The module
has no side effects on import.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generate  # noqa: E402  (prompts, greedy picking, the comparison of two generations)
import train_gpt  # noqa: E402  (data, optimizer, layer norm, logits, attention by name)

import jax_tk  # noqa: E402

PATHS = ("latent", "xla")  # the absorbed latent cache (mla_attention) / the expanded per-head cache
PRESETS = {  # defaults when a flag is not given
    "cpu": dict(layers=2, width=64, heads=2, q_lora_rank=48, kv_lora_rank=64, qk_nope=32, qk_rope=16, v_dim=32,
                seq=64, batch=8, steps=40, lr=3e-3, dtype="float32", log_every=10, gen_batch=4, prompt_len=16,
                new_tokens=32),
    # DeepSeek-V2/V3's head dims (192/128, latent 512 + rope 64) at a small width.
    "gpu": dict(layers=4, width=1024, heads=16, q_lora_rank=512, kv_lora_rank=512, qk_nope=128, qk_rope=64,
                v_dim=128, seq=1024, batch=16, steps=300, lr=1e-3, dtype="bfloat16", log_every=20, gen_batch=16,
                prompt_len=128, new_tokens=512),
}


@dataclasses.dataclass(frozen=True)
class Config:
    """Model shape and compute dtype (hashable: a static argument of the jitted functions).
    q_lora_rank 0: the queries are a plain projection of the residual stream."""

    layers: int = 2
    width: int = 64
    heads: int = 2
    q_lora_rank: int = 48
    kv_lora_rank: int = 64
    qk_nope: int = 32
    qk_rope: int = 16
    v_dim: int = 32
    seq: int = 64
    dtype: str = "float32"
    vocab: int = train_gpt.VOCAB

    @property
    def qk_dim(self) -> int:
        return self.qk_nope + self.qk_rope

    @property
    def latent_dim(self) -> int:  # one row of the latent cache
        return self.kv_lora_rank + self.qk_rope

    @property
    def scale(self) -> float:  # the training attention's, also the absorbed attention's
        return 1.0 / math.sqrt(self.qk_dim)

    @property
    def compute_dtype(self):
        return train_gpt.DTYPES[self.dtype]


# ----------------------------------------------------------------------------------------------
# Model: float32 parameters; matmuls and attention in config.dtype; norms, residual stream, logits
# and loss float32 (as in train_gpt.py).
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(1,))  # one compiled program, not one per array shape
def init_params(key, config: Config):
    """normal(0.02), residual output projections scaled by 1/sqrt(2 layers); every layer's arrays stacked
    on a leading axis in ``params["blocks"]``. Matrices end in ``_w`` (train_gpt's optimizer decays them)."""
    c, L, D, H = config, config.layers, config.width, config.heads
    if c.qk_rope % 2:
        raise ValueError(f"qk_rope ({c.qk_rope}) must be even (rotary pairs)")
    k = iter(jax.random.split(key, 12))
    std, res_std = 0.02, 0.02 / math.sqrt(2 * L)
    normal = lambda shape, s=std: s * jax.random.normal(next(k), shape, jnp.float32)  # noqa: E731
    zeros, ones = (lambda *s: jnp.zeros(s, jnp.float32)), (lambda *s: jnp.ones(s, jnp.float32))
    blocks = {
        "ln1_scale": ones(L, D), "ln1_bias": zeros(L, D),
        "wkv_a_w": normal((L, D, c.latent_dim)), "kv_norm_scale": ones(L, c.kv_lora_rank),
        "wk_up_w": normal((L, c.kv_lora_rank, H, c.qk_nope)), "wv_up_w": normal((L, c.kv_lora_rank, H, c.v_dim)),
        "proj_w": normal((L, H * c.v_dim, D), res_std), "proj_b": zeros(L, D),
        "ln2_scale": ones(L, D), "ln2_bias": zeros(L, D),
        "fc_w": normal((L, D, 4 * D)), "fc_b": zeros(L, 4 * D),
        "out_w": normal((L, 4 * D, D), res_std), "out_b": zeros(L, D),
    }
    if c.q_lora_rank:
        blocks.update(wq_a_w=normal((L, D, c.q_lora_rank)), q_norm_scale=ones(L, c.q_lora_rank),
                      wq_b_w=normal((L, c.q_lora_rank, H * c.qk_dim)))
    else:
        blocks.update(wq_w=normal((L, D, H * c.qk_dim)))
    return {"wte": normal((c.vocab, D)), "blocks": blocks, "lnf_scale": ones(D), "lnf_bias": zeros(D)}


def _rms_norm(x, scale, eps=1e-6):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps) * scale).astype(x.dtype)


def rope(x, pos, base=10000.0):
    """Rotary embedding of x [B, T, heads, r] at integer positions pos [B, T] (halves rotated as pairs)."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = pos.astype(jnp.float32)[:, :, None, None] * inv_freq
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def block_in(x, p, pos, config: Config):
    """A block's attention inputs from the residual stream x [B, T, width] at positions pos [B, T]:
    q_nope [B, T, H, qk_nope], q_rope [B, T, H, qk_rope] (rotated), c_kv [B, T, kv_lora_rank] (normed),
    k_rope [B, T, 1, qk_rope] (rotated)."""
    c, dt = config, config.compute_dtype
    B, T, _ = x.shape
    h = train_gpt._layer_norm(x, p["ln1_scale"], p["ln1_bias"]).astype(dt)
    if c.q_lora_rank:
        q = _rms_norm(h @ p["wq_a_w"].astype(dt), p["q_norm_scale"]) @ p["wq_b_w"].astype(dt)
    else:
        q = h @ p["wq_w"].astype(dt)
    q_nope, q_rope = jnp.split(q.reshape(B, T, c.heads, c.qk_dim), [c.qk_nope], axis=-1)
    c_kv, k_rope = jnp.split(h @ p["wkv_a_w"].astype(dt), [c.kv_lora_rank], axis=-1)
    return q_nope, rope(q_rope, pos), _rms_norm(c_kv, p["kv_norm_scale"]), rope(k_rope[:, :, None], pos)


def expand_kv(c_kv, k_rope, p, config: Config):
    """Per-head keys [B, T, H, qk_nope + qk_rope] and values [B, T, H, v_dim] of the latents."""
    dt = config.compute_dtype
    k_nope = jnp.einsum("btr,rhn->bthn", c_kv, p["wk_up_w"].astype(dt))
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (*k_nope.shape[:3], config.qk_rope))], axis=-1)
    return k, jnp.einsum("btr,rhv->bthv", c_kv, p["wv_up_w"].astype(dt))


def block_out(x, a, p, config: Config):
    """The rest of a block after attention: a [B, T, H, v_dim] -> the new residual stream (output
    projection, then train_gpt.py's layer norm + GELU MLP)."""
    dt = config.compute_dtype
    a = a.reshape(*x.shape[:2], -1)
    x = x + (a @ p["proj_w"].astype(dt) + p["proj_b"].astype(dt)).astype(jnp.float32)
    h = train_gpt._layer_norm(x, p["ln2_scale"], p["ln2_bias"]).astype(dt)
    h = jax.nn.gelu(h @ p["fc_w"].astype(dt) + p["fc_b"].astype(dt))
    return x + (h @ p["out_w"].astype(dt) + p["out_b"].astype(dt)).astype(jnp.float32)


def _self_attention(q_nope, q_rope, c_kv, k_rope, p, config, attention):
    """The training attention: causal, over the expanded keys and values (head dims qk_dim / v_dim)."""
    k, v = expand_kv(c_kv, k_rope, p, config)
    return train_gpt.attend(jnp.concatenate([q_nope, q_rope], axis=-1), k, v, attention)


def forward(params, tokens, config: Config, attention: str = "tk"):
    """tokens int32 [B, T <= config.seq] -> float32 logits [B, T, vocab]. ``attention``: "tk"
    (jax_tk.attention; the kernel on a GPU in bf16/fp16) or "reference" (its pure-JAX reference)."""
    B, T = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))

    def layer(x, p):
        return block_out(x, _self_attention(*block_in(x, p, pos, config), p, config, attention), p, config), None

    x, _ = jax.lax.scan(layer, params["wte"][tokens], params["blocks"])
    return train_gpt.logits_of(params, x, config)


def loss_fn(params, inputs, targets, config: Config, attention: str = "tk"):
    logits = forward(params, inputs, config, attention)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@functools.partial(jax.jit, static_argnames=("config", "optimizer", "attention"), donate_argnums=(0, 1))
def train_step(params, opt_state, inputs, targets, config: Config, optimizer, attention="tk"):
    loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets, config, attention)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def train(config: Config, *, steps, batch, lr, seed=0, attention="tk", log_every=10, data=None):
    """Trains from a fresh initialization on train_gpt's batches; returns (params, losses, tokens/s after
    the first, compiling, step)."""
    data = train_gpt.load_data()[0] if data is None else data
    optimizer = train_gpt.make_optimizer(lr, steps)
    step = lambda params, opt_state, x, y: train_step(params, opt_state, x, y, config, optimizer, attention)
    params, _, losses, tokens_per_s = train_gpt.fit(step, init_params(jax.random.key(seed), config), optimizer, data,
                                                    steps=steps, batch=batch, seq=config.seq, seed=seed,
                                                    log_every=log_every)
    return params, losses, tokens_per_s


# ----------------------------------------------------------------------------------------------
# Generation with a cache. "latent": one latent cache per layer, mla_attention with the absorbed
# query. "xla": per-head key and value caches, jax_tk.attention(implementation="xla").
# ----------------------------------------------------------------------------------------------


def _layer(params, l):
    return jax.tree_util.tree_map(lambda a: a[l], params["blocks"])


def absorbed_attention(q_nope, q_rope, cache, lengths, page_table, p, config: Config):
    """The new tokens' attention over the latent cache (lengths include them): the query absorbs W_uk,
    mla_attention attends over the latent rows, the output is up-projected by W_uv. -> [B, T, H, v_dim]."""
    dt = config.compute_dtype
    q_latent = jnp.einsum("bthn,rhn->bthr", q_nope, p["wk_up_w"].astype(dt))
    query = jnp.concatenate([q_latent, q_rope], axis=-1)  # [B, T, H, kv_lora_rank + qk_rope]
    o = jax_tk.decode.mla_attention(query, cache, lengths, page_table=page_table, v_head_dim=config.kv_lora_rank,
                                    scale=config.scale)
    return jnp.einsum("bthr,rhv->bthv", o, p["wv_up_w"].astype(dt))


def forward_cached(params, tokens, caches, lengths, page_table, config: Config, path, prefill=False):
    """tokens [B, T] at positions lengths .. lengths + T - 1 -> (logits [B, T, V], caches). ``caches``: per
    layer the latent cache (path "latent") or a (key, value) pair ("xla"). With ``prefill`` (every
    sequence empty) the tokens attend over themselves with the training attention."""
    t = tokens.shape[1]
    pos = lengths[:, None] + jnp.arange(t)[None, :]
    x = params["wte"][tokens]
    new_caches = []
    for l, cache in enumerate(caches):
        p = _layer(params, l)
        q_nope, q_rope, c_kv, k_rope = block_in(x, p, pos, config)
        if path == "latent":
            row = jnp.concatenate([c_kv[:, :, None], k_rope], axis=-1)  # [B, T, 1, kv_lora_rank + qk_rope]
            cache = jax_tk.decode.update_kv_cache(cache, row, lengths, page_table=page_table)
            if not prefill:
                a = absorbed_attention(q_nope, q_rope, cache, lengths + t, page_table, p, config)
        else:
            k, v = expand_kv(c_kv, k_rope, p, config)
            cache = tuple(jax_tk.decode.update_kv_cache(c, new, lengths) for c, new in zip(cache, (k, v)))
            if not prefill:
                if t != 1:
                    raise ValueError("the xla path decodes one token at a time (no bottom-right causal mask)")
                q = jnp.concatenate([q_nope, q_rope], axis=-1)
                a = jax_tk.attention(q, *cache, key_value_seq_lengths=lengths + t, scale=config.scale,
                                     implementation="xla")
        if prefill:
            a = _self_attention(q_nope, q_rope, c_kv, k_rope, p, config, "tk")
        x = block_out(x, a, p, config)
        new_caches.append(cache)
    return train_gpt.logits_of(params, x, config), tuple(new_caches)


def empty_caches(config: Config, path, batch, max_len, page_size=None, seed=0):
    """Per layer: "latent": [B, max_len, 1, kv_lora_rank + qk_rope], or with page_size a pool of
    B * ceil(max_len / page_size) pages in shuffled order and its page table; "xla": keys
    [B, max_len, H, qk_dim] and values [B, max_len, H, v_dim]. Returns (caches, page_table or None)."""
    dt, c = config.compute_dtype, config
    if path == "xla":
        return tuple((jnp.zeros((batch, max_len, c.heads, c.qk_dim), dt),
                      jnp.zeros((batch, max_len, c.heads, c.v_dim), dt)) for _ in range(c.layers)), None
    if page_size is None:
        return tuple(jnp.zeros((batch, max_len, 1, c.latent_dim), dt) for _ in range(c.layers)), None
    pages = -(-max_len // page_size)
    perm = np.random.default_rng(seed).permutation(batch * pages).astype(np.int32)
    shape = (batch * pages, page_size, 1, c.latent_dim)
    return tuple(jnp.zeros(shape, dt) for _ in range(c.layers)), jnp.asarray(perm.reshape(batch, pages))


@functools.partial(jax.jit, static_argnames=("config", "path"), donate_argnums=(2,))
def prefill(params, prompt, caches, page_table, config, path):
    lengths = jnp.zeros((prompt.shape[0],), jnp.int32)
    logits, caches = forward_cached(params, prompt, caches, lengths, page_table, config, path, prefill=True)
    return logits[:, -1], caches


@functools.partial(jax.jit, static_argnames=("config", "path", "steps"), donate_argnums=(2,))
def decode(params, first_logits, caches, lengths, page_table, forced, config, path, steps):
    """``steps`` greedy tokens per sequence (``forced`` [B, steps] or None: feed these instead) in a
    lax.scan; returns (tokens [B, steps], logits [B, steps, V] they were picked from, caches)."""

    def body(carry, i):
        logits, caches, lengths = carry
        token = generate._pick(logits, None, 0.0) if forced is None else forced[:, i]
        new_logits, caches = forward_cached(params, token[:, None], caches, lengths, page_table, config, path)
        return (new_logits[:, 0], caches, lengths + 1), (token, logits)

    (_, caches, _), (tokens, logits) = jax.lax.scan(body, (first_logits, caches, lengths), jnp.arange(steps))
    return tokens.T, jnp.swapaxes(logits, 0, 1), caches


def run_generation(params, config: Config, prompt, new_tokens, *, path="latent", page_size=None, forced=None,
                   timed=True, seed=0):
    """Greedy prefill + decode of int32 prompts [B, P]. Returns a dict: tokens [B, new_tokens], logits
    [B, new_tokens, V], prefill_s, decode_s, tokens_per_s (with ``timed``: a first run compiles, a second
    is timed)."""
    b, p = prompt.shape
    if p + new_tokens > config.seq:
        raise ValueError(f"prompt ({p}) + new tokens ({new_tokens}) > the model's context ({config.seq})")
    prompt = jnp.asarray(prompt, jnp.int32)
    forced = None if forced is None else jnp.asarray(forced, jnp.int32)

    def run():
        caches, table = empty_caches(config, path, b, p + new_tokens, page_size, seed)
        t0 = time.perf_counter()
        first, caches = jax.block_until_ready(prefill(params, prompt, caches, table, config, path))
        t1 = time.perf_counter()
        lengths = jnp.full((b,), p, jnp.int32)
        out = jax.block_until_ready(decode(params, first, caches, lengths, table, forced, config, path, new_tokens))
        return out, t1 - t0, time.perf_counter() - t1

    return generate.timed_result(run, timed, b * new_tokens)


def cache_numbers_per_token(config: Config, path) -> int:
    """Cached numbers per token and layer."""
    return config.latent_dim if path == "latent" else config.heads * (config.qk_dim + config.v_dim)


def check(params, config: Config, prompt, new_tokens, results, page_size, tol):
    """Both paths fed the latent path's greedy tokens, and the plain forward over prompt + tokens: their
    logits must agree (relative error < tol); the xla path's free-running greedy tokens too (up to
    near-ties, generate.compare)."""
    base = results["latent"]
    lines, ok_all = [], True
    full = np.concatenate([prompt, base["tokens"]], axis=1)
    want = np.asarray(jax.jit(forward, static_argnums=(2, 3))(params, full, config, "tk"))[:, prompt.shape[1] - 1:-1]
    err = generate.rel_err(base["logits"], want)
    ok = err < tol
    ok_all &= ok
    lines.append(f"check latent vs full forward: {'ok' if ok else 'FAILED'}: logits relative error {err:.2e}")
    if "xla" in results:
        forced = run_generation(params, config, prompt, new_tokens, path="xla", forced=base["tokens"], timed=False)
        ok, msg = generate.compare(base, forced, results["xla"], tol)
        ok_all &= ok
        lines.append(f"check xla vs latent: {'ok' if ok else 'FAILED'}: {msg}")
    print("\n".join(lines))
    return ok_all, "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Flags left out take per-backend defaults: " + "; ".join(
            f"{k}: " + " ".join(f"--{n.replace('_', '-')} {v}" for n, v in d.items()) for k, d in PRESETS.items()))
    for name in ("layers", "width", "heads", "q_lora_rank", "kv_lora_rank", "qk_nope", "qk_rope", "v_dim", "seq",
                 "batch", "steps", "log_every", "gen_batch", "prompt_len", "new_tokens"):
        p.add_argument("--" + name.replace("_", "-"), type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--dtype", choices=tuple(train_gpt.DTYPES))
    p.add_argument("--attention", choices=("tk", "reference"), default="tk",
                   help="training attention: jax_tk.attention (the kernel on a GPU) or its pure-JAX reference")
    p.add_argument("--paths", default=",".join(PATHS),
                   help="generation paths, comma-separated: latent (absorbed, mla_attention), xla (per-head cache)")
    p.add_argument("--paged", action="store_true", help="a paged latent cache")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true")
    args = train_gpt.fill_preset(p.parse_args(argv), PRESETS)
    args.paths = [a for a in args.paths.split(",") if a]
    if "latent" not in args.paths or any(a not in PATHS for a in args.paths):
        p.error(f"--paths: latent and optionally xla, got {args.paths}")
    return args


def latent_decode_runs(config, batch):
    """What the latent path's mla_attention runs here: jax_tk's MLA kernel, or the reference and why."""
    d = config.kv_lora_rank + config.qk_rope
    query = jax.ShapeDtypeStruct((batch, 1, config.heads, d), jnp.dtype(config.dtype))
    cache = jax.ShapeDtypeStruct((batch, 1, 1, d), jnp.dtype(config.dtype))
    why = jax_tk.decode.mla.kernel_unsupported_reason(query, cache, config.kv_lora_rank)
    return "jax_tk's MLA kernel" if why is None else f"mla_attention's pure-JAX reference (the kernel does not take {why})"


def main(argv=None):
    """Trains, then generates with each path; returns a dict: losses, train_tokens_per_s, params, config,
    {path: generation result}, and "check": (ok, message)."""
    args = parse_args(argv)
    config = Config(layers=args.layers, width=args.width, heads=args.heads, q_lora_rank=args.q_lora_rank,
                    kv_lora_rank=args.kv_lora_rank, qk_nope=args.qk_nope, qk_rope=args.qk_rope, v_dim=args.v_dim,
                    seq=args.seq, dtype=args.dtype)
    backend = jax.default_backend()
    kernels = train_gpt.runs_kernels(config.dtype) and args.attention == "tk"
    print(f"backend {backend} ({jax.devices()[0].device_kind}), {config}, batch {args.batch}; training attention "
          f"head dims {config.qk_dim}/{config.v_dim}"
          + ("" if kernels else " (no GPU kernel runs here: jax_tk's pure-JAX reference attention)"))
    params, losses, tok_s = train(config, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed,
                                  attention=args.attention, log_every=args.log_every)
    print(f"{sum(int(x.size) for x in jax.tree_util.tree_leaves(params)) / 1e6:.2f}M parameters; train loss: "
          f"first {losses[0]:.4f}, last {losses[-1]:.4f}; {tok_s:,.0f} tokens/s (after the first step)")

    prompt = generate.prompts(args.gen_batch, args.prompt_len, args.seed)
    page_size = args.page_size if args.paged else None
    print(f"generation: batch {args.gen_batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy; "
          f"latent cache {'paged (pages of %d)' % page_size if page_size else 'contiguous'}; cached numbers per "
          f"token and layer: latent {cache_numbers_per_token(config, 'latent')}, xla "
          f"{cache_numbers_per_token(config, 'xla')}; the latent path: {latent_decode_runs(config, args.gen_batch)}")
    out = {"losses": losses, "train_tokens_per_s": tok_s, "params": params, "config": config}
    for path in args.paths:
        r = run_generation(params, config, prompt, args.new_tokens, path=path,
                           page_size=page_size if path == "latent" else None, seed=args.seed)
        out[path] = r
        print(f"{path:>6}: prefill {r['prefill_s'] * 1e3:8.2f} ms, decode {r['tokens_per_s']:12,.0f} tokens/s "
              f"({args.gen_batch} x {args.new_tokens} tokens in {r['decode_s']:.3f} s)")
    text = bytes(np.concatenate([prompt[0], out["latent"]["tokens"][0]]).astype(np.uint8).tolist())
    print("-" * 30 + " sample " + "-" * 30 + "\n" + text.decode("utf-8", errors="replace") + "\n" + "-" * 68)
    if not args.no_check:
        out["check"] = check(params, config, prompt, args.new_tokens, out, page_size,
                             generate.TOLERANCE[config.dtype])
    return out


if __name__ == "__main__":
    result = main(sys.argv[1:])
    sys.exit(0 if result.get("check", (True,))[0] else 1)
