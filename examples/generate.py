"""Sample from the GPT of examples/train_gpt.py with a KV cache, and compare attention implementations.

The prompt (one slice of Shakespeare per sequence) goes through the model once (prefill), filling each
layer's key/value cache with ``jax_tk.decode.update_kv_cache``; then a ``lax.scan`` (or
``lax.while_loop``, ``--loop while``) generates one byte per sequence and step: each layer appends the
new token's key/value to its cache and attends over it. The caches are donated to the jitted loop, so
XLA updates them in place; the blocks' matmul weights are cast to the compute dtype once, as a server
holds them (``serving_params``), not at every step. The same generation runs with each attention implementation
(``--attention``):

- ``tk``: ``jax_tk.decode.append_attention`` (the step's cache update and ``jax_tk.decode.attention`` in
  one call; ``implementation=None``: jax_tk's kernels where they take the call, its pure-JAX reference
  elsewhere) over a contiguous cache, or a paged one with ``--paged``
  (pages of ``--page-size`` rows in a shuffled pool, a page table per sequence);
- ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` of the new token over the
  contiguous cache with ``key_value_seq_lengths`` (GPU only; skipped with a message on CPU);
- ``xla``: the same with ``implementation="xla"``.

(jax.nn has no paged cache: with ``--paged`` only ``tk`` uses one.) The prompt's attention is the
model's own (``jax_tk.attention`` for ``tk``, ``jax.nn.dot_product_attention`` for the others).
Printed: prefill time and decode tokens/s per implementation, and with ``--latency`` (on a GPU by
default) each new token's latency for one sequence alone (the clock starts after a first,
compiling run), and the sample. Then the check: every implementation is run again, fed the first
one's greedy tokens (teacher forcing), and its logits must match the first one's at every step
(relative error under 1e-4 in float32, 3e-2 in bfloat16); the free-running greedy tokens must be the
same, or part where the first implementation's top two logits were within that tolerance (a
near-tie that rounding may break either way).

    python examples/generate.py                               # CPU: a tiny random model, seconds
    python examples/generate.py --ckpt runs/gpt/ckpt.npz      # a model trained by train_gpt.py
    python examples/generate.py --paged --temperature 0.8     # GPU: the serving preset (random init), bf16
    python examples/generate.py --devices 2 --batch 32        # the batch split over two GPUs

``--devices N`` splits the batch (the prompts, the caches and their lengths; a paged cache's page table,
its pool replicated) over the first N devices; jit runs each device's sequences where they are.

Without ``--ckpt`` the parameters are random (GPT-2 initialization, ``--seed``): the text is noise,
but shapes, speed and the agreement of the implementations are those of a trained model of that size.
On a GPU the default is a serving shape: 16 layers of width 2048, 16 query heads of 128 sharing 8
key/value heads (grouped-query attention, as Llama-style models serve), bf16, batch 16, a 1024-byte
prompt and 256 new bytes; on CPU 2 layers of width 64. (GPT-2 small's shape, the earlier preset:
``--layers 12 --width 768 --heads 12 --kv-heads 0 --seq 1024 --prompt-len 128 --new-tokens 512``.)
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_gpt  # noqa: E402  (the model: parameters, blocks, data)

import jax_tk  # noqa: E402

ATTENTIONS = ("tk", "cudnn", "xla")
PRESETS = {
    "cpu": dict(layers=2, width=64, heads=2, kv_heads=0, seq=128, dtype="float32", batch=4, prompt_len=16,
                new_tokens=32, latency=False),
    # A serving shape: Llama-style grouped-query heads (16 of 128 over 8 key/value heads), 16 sequences
    # with 1k-token prompts; each step's attention reads about as many bytes of cache as of weights.
    "gpu": dict(layers=16, width=2048, heads=16, kv_heads=8, seq=2048, dtype="bfloat16", batch=16, prompt_len=1024,
                new_tokens=256, latency=True),
}
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}


# ----------------------------------------------------------------------------------------------
# The model with a KV cache: per layer block_qkv, cache update + attention, block_out
# ----------------------------------------------------------------------------------------------


def _layer(params, l):
    return jax.tree_util.tree_map(lambda a: a[l], params["blocks"])


def _cached_attention(q, k_cache, v_cache, lengths, page_table, attention):
    """Attention of the new token(s) q [B, T, N, H] over the cache (lengths include them): cuDNN's or XLA's
    (jax_tk's comes with the cache's update: forward_cached)."""
    if q.shape[1] != 1:
        raise ValueError("cudnn/xla decode one token at a time here (no bottom-right causal mask)")
    # One new token sees every valid key: the padding mask of the lengths is all it needs.
    return jax.nn.dot_product_attention(q, k_cache, v_cache, key_value_seq_lengths=lengths,
                                        implementation=attention)


def forward_cached(params, tokens, caches, lengths, page_table, config, attention, prefill=False):
    """tokens [B, T] at positions lengths .. lengths + T - 1 -> (logits [B, T, V], caches). ``caches``: a
    tuple of (key, value) caches per layer; ``lengths``: [B] before these tokens. With ``prefill`` (the
    prompt: every sequence starts empty) attention is the model's causal attention over the tokens
    themselves; otherwise the tokens attend over the cache."""
    t = tokens.shape[1]
    pos = lengths[:, None] + jnp.arange(t)[None, :]
    x = params["wte"][tokens] + params["wpe"][pos]
    new_caches = []
    for l, (kc, vc) in enumerate(caches):
        p = _layer(params, l)
        q, k, v = train_gpt.block_qkv(x, p, config)
        if attention == "tk" and not prefill:  # (the cache's update and the attention in one call)
            a, kc, vc = jax_tk.decode.append_attention(q, k, v, kc, vc, lengths, page_table=page_table)
        else:
            kc = jax_tk.decode.update_kv_cache(kc, k, lengths, page_table=page_table)
            vc = jax_tk.decode.update_kv_cache(vc, v, lengths, page_table=page_table)
            a = train_gpt.attend(q, k, v, attention) if prefill else _cached_attention(
                q, kc, vc, lengths + t, page_table, attention)
        x = train_gpt.block_out(x, a, p, config)
        new_caches.append((kc, vc))
    return train_gpt.logits_of(params, x, config), tuple(new_caches)


# The weights the blocks multiply by, cast to the compute dtype at every use (train_gpt.block_qkv,
# block_out); the layer norms' and the embeddings' stay float32 (the embedding table is also read in
# float32 by the token lookup).
_MATMUL_WEIGHTS = ("qkv_w", "qkv_b", "proj_w", "proj_b", "fc_w", "fc_b", "out_w", "out_b")


def serving_params(params, config):
    """The parameters as a server holds them: the blocks' matmul weights in the compute dtype, once.
    train_gpt keeps float32 master weights and casts them at every use; inside a decoding loop that
    cast would re-read every float32 weight at every step (twice the bytes of the bf16 weights, plus
    the copies). The model's results are unchanged: it casts the same values to the same dtype."""
    dt = config.compute_dtype
    blocks = {k: v.astype(dt) if k in _MATMUL_WEIGHTS else v for k, v in params["blocks"].items()}
    return {**params, "blocks": blocks}


def empty_caches(config, batch: int, max_len: int, page_size: int | None, seed: int = 0):
    """Per layer a (key, value) cache for ``max_len`` positions: contiguous [B, max_len, K, H] (K the
    key/value heads), or with ``page_size`` a pool of B * max_len / page_size pages in shuffled order
    and the page table."""
    dt = config.compute_dtype
    if page_size is None:
        shape, table = (batch, max_len, config.kv, config.head_dim), None
    else:
        pages = -(-max_len // page_size)
        shape = (batch * pages, page_size, config.kv, config.head_dim)
        perm = np.random.default_rng(seed).permutation(batch * pages).astype(np.int32)
        table = jnp.asarray(perm.reshape(batch, pages))
    caches = tuple((jnp.zeros(shape, dt), jnp.zeros(shape, dt)) for _ in range(config.layers))
    return caches, table


def _pick(logits, key, temperature):
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "attention"), donate_argnums=(2,))
def prefill(params, prompt, caches, page_table, config, attention):
    """The prompt [B, P] through the model; returns (logits of its last position [B, V], caches)."""
    lengths = jnp.zeros((prompt.shape[0],), jnp.int32)
    logits, caches = forward_cached(params, prompt, caches, lengths, page_table, config, attention, prefill=True)
    return logits[:, -1], caches


@functools.partial(jax.jit, static_argnames=("config", "attention", "steps", "temperature", "loop"),
                   donate_argnums=(2,))
def decode(params, first_logits, caches, lengths, page_table, key, forced, config, attention, steps,
           temperature=0.0, loop="scan"):
    """``steps`` new tokens per sequence after the prompt (``lengths`` [B] long): returns (tokens
    [B, steps], logits [B, steps, V] of the distributions they were drawn from, caches). ``forced``
    [B, steps] or None: feed these tokens instead of the drawn ones (teacher forcing, for comparisons)."""

    def step(i, logits, caches, lengths, key):
        key, sub = jax.random.split(key)
        token = _pick(logits, sub, temperature) if forced is None else forced[:, i]
        new_logits, caches = forward_cached(params, token[:, None], caches, lengths, page_table, config, attention)
        return token, new_logits[:, 0], caches, lengths + 1, key

    if loop == "scan":
        def body(carry, i):
            logits, caches, lengths, key = carry
            token, new_logits, caches, lengths, key = step(i, logits, caches, lengths, key)
            return (new_logits, caches, lengths, key), (token, logits)

        (_, caches, _, _), (tokens, logits) = jax.lax.scan(body, (first_logits, caches, lengths, key),
                                                           jnp.arange(steps))
        return tokens.T, jnp.swapaxes(logits, 0, 1), caches

    b, v = first_logits.shape

    def wbody(c):
        i, logits, caches, lengths, key, tokens, seen = c
        token, new_logits, caches, lengths, key = step(i, logits, caches, lengths, key)
        return (i + 1, new_logits, caches, lengths, key, tokens.at[:, i].set(token), seen.at[:, i].set(logits))

    init = (0, first_logits, caches, lengths, key, jnp.zeros((b, steps), jnp.int32), jnp.zeros((b, steps, v)))
    _, _, caches, _, _, tokens, logits = jax.lax.while_loop(lambda c: c[0] < steps, wbody, init)
    return tokens, logits, caches


def batch_placement(devices: int):
    """put(x, batch_dim): x split over the first ``devices`` devices along its batch dim (None: that dim
    is not split, x replicated); the identity for one device. jit then runs every op on each device's
    sequences (jax_tk's decode ops on the local shards of the cache, with no gather)."""
    if devices <= 1:
        return lambda x, batch_dim=0: x
    # (Auto axes: XLA propagates the batch split through the model's gathers and einsums)
    mesh = jax.make_mesh((devices,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:devices])

    def put(x, batch_dim=0):
        spec = P() if batch_dim is None else P(*([None] * batch_dim), "data")
        return jax.device_put(x, NamedSharding(mesh, spec))

    return put


def generate(params, config, prompt, new_tokens, *, attention="tk", page_size=None, temperature=0.0, seed=0,
             loop="scan", forced=None, timed=True, devices=1):
    """Prefill + decoding loop for int32 prompts [B, P], the batch split over ``devices`` devices (a
    paged cache's pool is then replicated, its page table split). Returns a dict: tokens [B, new_tokens],
    logits [B, new_tokens, V], prefill_s, decode_s, tokens_per_s (with ``timed``: a first run compiles,
    a second is timed)."""
    b, p = prompt.shape
    if p + new_tokens > config.seq:
        raise ValueError(f"prompt ({p}) + new tokens ({new_tokens}) > the model's context ({config.seq})")
    if b % devices:
        raise ValueError(f"the batch ({b}) must split evenly over {devices} devices")
    max_len = p + new_tokens
    put = batch_placement(devices)
    params = jax.tree_util.tree_map(lambda x: put(x, None), serving_params(params, config))
    prompt = put(jnp.asarray(prompt, jnp.int32))
    forced = None if forced is None else put(jnp.asarray(forced, jnp.int32))
    key = jax.random.key(seed)

    def run():
        caches, table = empty_caches(config, b, max_len, page_size, seed)
        caches = jax.tree_util.tree_map(lambda x: put(x, None if page_size else 0), caches)
        table = None if table is None else put(table)
        t0 = time.perf_counter()
        first, caches = jax.block_until_ready(prefill(params, prompt, caches, table, config, attention))
        t1 = time.perf_counter()
        lengths = put(jnp.full((b,), p, jnp.int32))
        out = jax.block_until_ready(decode(params, first, caches, lengths, table, key, forced, config,
                                           attention, new_tokens, temperature, loop))
        return out, t1 - t0, time.perf_counter() - t1

    return timed_result(run, timed, b * new_tokens)


def timed_result(run, timed: bool, tokens_made: int) -> dict:
    """The dict :func:`generate` returns, from ``run() -> ((tokens, logits, _), prefill_s, decode_s)``;
    with ``timed`` a first run compiles and the second is the one timed."""
    (tokens, logits, _), prefill_s, decode_s = run()
    if timed:
        (tokens, logits, _), prefill_s, decode_s = run()
    return dict(tokens=np.asarray(tokens), logits=np.asarray(logits), prefill_s=prefill_s, decode_s=decode_s,
                tokens_per_s=tokens_made / decode_s)


# ----------------------------------------------------------------------------------------------
# Comparing implementations
# ----------------------------------------------------------------------------------------------


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def compare(base: dict, forced: dict, free: dict, tol: float) -> tuple[bool, str]:
    """``forced``: another implementation fed ``base``'s tokens; ``free``: its own greedy run. Its logits
    must match base's within ``tol`` (relative), and its greedy tokens base's up to the first step where
    base's top two logits were closer than ``tol`` times their scale (a near-tie)."""
    err = rel_err(forced["logits"], base["logits"])
    if not err < tol:
        return False, f"logits differ: relative error {err:.2e} >= {tol:g}"
    same = base["tokens"] == free["tokens"]
    if same.all():
        return True, f"same greedy tokens; logits relative error {err:.2e}"
    ties = []
    for b in np.flatnonzero(~same.all(axis=1)):
        s = int(np.argmin(same[b]))  # the first step where sequence b's tokens differ
        lg = base["logits"][b, s]
        top2 = np.sort(lg)[-2:]
        gap, scale = float(top2[1] - top2[0]), float(np.abs(lg).max())
        if gap > tol * scale:
            return False, f"greedy tokens differ at sequence {b} step {s} (top-2 gap {gap:.2e} is no tie)"
        ties.append(f"{b}@{s}")
    return True, (f"greedy tokens agree up to near-ties (sequence@step: {', '.join(ties)}); logits relative "
                  f"error {err:.2e}")


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", help="a checkpoint of train_gpt.py (ckpt.npz); default: random parameters")
    p.add_argument("--attention", default=",".join(ATTENTIONS),
                   help=f"comma-separated, from {','.join(ATTENTIONS)}; the first is the reference of the check")
    p.add_argument("--paged", action="store_true", help="tk uses a paged KV cache")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--loop", choices=("scan", "while"), default="scan")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int)
    p.add_argument("--prompt-len", type=int)
    p.add_argument("--new-tokens", type=int)
    for name in ("layers", "width", "heads", "kv_heads", "seq"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, help="model shape without --ckpt")
    p.add_argument("--dtype", choices=tuple(train_gpt.DTYPES))
    p.add_argument("--devices", type=int, default=1,
                   help="split the batch over the first N devices (decode throughput on several GPUs)")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--latency", action=argparse.BooleanOptionalAction, default=None,
                   help="also time one sequence alone: each new token's latency at batch 1 (default: on a GPU)")
    args = train_gpt.fill_preset(p.parse_args(argv), PRESETS)
    args.attention = [a for a in args.attention.split(",") if a]
    bad = [a for a in args.attention if a not in ATTENTIONS]
    if bad or not args.attention:
        p.error(f"--attention: choose from {','.join(ATTENTIONS)}, got {bad or 'nothing'}")
    return args


def load_model(args):
    if args.ckpt is None:
        config = train_gpt.Config(layers=args.layers, width=args.width, heads=args.heads, seq=args.seq,
                                  dtype=args.dtype, kv_heads=args.kv_heads)
        return train_gpt.init_params(jax.random.key(args.seed), config), config, "random"
    meta = train_gpt.read_checkpoint_meta(args.ckpt)
    config = train_gpt.Config(**meta["config"])
    template = train_gpt.init_params(jax.random.key(0), config)
    optimizer = train_gpt.make_optimizer(1e-3, 1)
    params, _, step, _ = train_gpt.load_checkpoint(args.ckpt, template, optimizer.init(template))
    return params, config, f"{args.ckpt} (step {step})"


def prompts(batch: int, length: int, seed: int) -> np.ndarray:
    data = train_gpt.load_data()[1]
    starts = np.random.default_rng(seed).integers(0, len(data) - length, size=batch)
    return np.stack([data[s:s + length] for s in starts]).astype(np.int32)


def main(argv=None):
    """Runs every implementation; returns {attention: result dict} (plus "check": (ok, message), not ok
    when an implementation failed to run or disagreed)."""
    args = parse_args(argv)
    params, config, source = load_model(args)
    backend = jax.default_backend()
    prompt = prompts(args.batch, args.prompt_len, args.seed)
    page_size = args.page_size if args.paged else None
    print(f"backend {backend} ({jax.devices()[0].device_kind}), model {source}: {config}, batch {args.batch}, "
          f"prompt {args.prompt_len}, new {args.new_tokens}, {args.loop} loop, "
          f"{'paged cache (pages of %d)' % page_size if page_size else 'contiguous cache'} for tk, "
          f"temperature {args.temperature}, {args.devices} device(s)")
    if "tk" in args.attention and not train_gpt.runs_kernels(config.dtype):
        print("no GPU kernel runs here: tk is jax_tk's pure-JAX reference, so the speeds below compare "
              "pure-JAX paths, not jax_tk's kernels")
    results, failed = {}, []
    for attention in args.attention:
        if attention == "cudnn" and backend != "gpu":
            print("cudnn: skipped (cuDNN needs a GPU)")
            continue
        try:
            r = generate(params, config, prompt, args.new_tokens, attention=attention,
                         page_size=page_size if attention == "tk" else None, temperature=args.temperature,
                         seed=args.seed, loop=args.loop, devices=args.devices)
        except Exception as e:  # noqa: BLE001 - report it and time the others
            print(f"{attention:>6}: FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            failed.append(attention)
            continue
        results[attention] = r
        print(f"{attention:>6}: prefill {r['prefill_s'] * 1e3:8.2f} ms, decode {r['tokens_per_s']:12,.0f} tokens/s "
              f"({r['tokens_per_s'] / args.devices:,.0f} per device; {args.batch} x {args.new_tokens} tokens in "
              f"{r['decode_s']:.3f} s)")
        if args.latency:  # (the first prompt alone, on one device: a step's latency, as one user sees it)
            one = generate(params, config, prompt[:1], args.new_tokens, attention=attention,
                           page_size=page_size if attention == "tk" else None, temperature=args.temperature,
                           seed=args.seed, loop=args.loop)
            r["latency_us"] = one["decode_s"] / args.new_tokens * 1e6
            print(f"{'':>6}  batch 1: {r['latency_us']:8.1f} µs per new token")
    if results:
        first = next(iter(results.values()))
        text = bytes(np.concatenate([prompt[0], first["tokens"][0]]).astype(np.uint8).tolist())
        print("-" * 30 + " sample " + "-" * 30)
        print(text.decode("utf-8", errors="replace"))
        print("-" * 68)
    if not args.no_check and len(results) > 1:
        results["check"] = check(params, config, prompt, args, results)
    if failed:
        earlier = results.get("check", (True, ""))[1]
        results["check"] = (False, "\n".join(filter(None, [earlier, f"failed to run: {', '.join(failed)}"])))
    return results


def check(params, config, prompt, args, results):
    """Greedy tokens / teacher-forced logits of every implementation against the first one's."""
    names = [a for a in results]
    base_name = names[0]
    run = functools.partial(generate, params, config, prompt, args.new_tokens, temperature=0.0, seed=args.seed,
                            loop=args.loop, timed=False, devices=args.devices)
    page = lambda a: args.page_size if args.paged and a == "tk" else None  # noqa: E731
    base = results[base_name] if args.temperature == 0 else run(attention=base_name, page_size=page(base_name))
    tol = TOLERANCE[config.dtype]
    ok_all, lines = True, []
    for name in names[1:]:
        free = results[name] if args.temperature == 0 else run(attention=name, page_size=page(name))
        forced = run(attention=name, page_size=page(name), forced=base["tokens"])
        ok, msg = compare(base, forced, free, tol)
        ok_all &= ok
        lines.append(f"check {name} vs {base_name}: {'ok' if ok else 'FAILED'}: {msg}")
    print("\n".join(lines))
    return ok_all, "\n".join(lines)


if __name__ == "__main__":
    out = main(sys.argv[1:])
    sys.exit(0 if out.get("check", (True,))[0] else 1)
