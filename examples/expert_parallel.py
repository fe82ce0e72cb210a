"""Expert parallelism: the mixture-of-experts layer of examples/moe.py with its experts sharded over
devices and the tokens exchanged with ``all_to_all``.

Inside ``jax.shard_map`` over a mesh axis of D devices, each device holds T tokens and E/D of the E
experts (their ``[E/D, ...]`` slices of the expert weights; the router is replicated):

1. route its own tokens (top-k) and sort the (token, slot) rows by expert, as ``moe.moe_layer`` does;
   the rows for device j's experts are then one consecutive run;
2. ``all_to_all`` the runs: device j receives from every device the rows for its experts (and how many
   rows per expert). The buffers have room for all T*k rows of a device, so no token is dropped (a
   production layer would bound them by a capacity factor, or use ``jax.lax.ragged_all_to_all``);
3. order the received rows by (local expert, source device) and run the expert MLPs as grouped GEMMs
   (``jax_tk.ragged_dot``) with the summed counts as ``group_sizes``: the unused rows of the buffers
   come last, past the groups, and give 0 at no cost in the kernel;
4. undo the ordering, ``all_to_all`` the results back, and combine them per token as in step 4 of
   ``moe.moe_layer``.

Everything is differentiable (the transpose of ``all_to_all`` is ``all_to_all``); the result equals
``moe.moe_layer`` on one device with all the experts.

``exchange="all_gather"`` (``moe_layer_gathered``) is the simpler layout that ``group_offset`` serves:
every device gathers every device's sorted rows, orders them by (expert, source) into one grouped
array of all E experts, and runs its E/D experts over it with ``jax_tk.ragged_dot(...,
group_offset=[first local expert])`` (the other experts' rows give 0); ``psum_scatter`` then sums each
row's one nonzero result and hands each device its own rows. It moves D times the rows that
``all_to_all`` moves, so it suits few devices or short batches. Run it on 8 CPU devices::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/expert_parallel.py

(the script adds that flag itself when it is not set; it only affects the CPU platform), or on GPUs
as it is (two experts per device). ``--bench`` times the layer's forward and backward instead, on every
device against one (each device holding as many tokens; on GPUs 8192 tokens of width 2048, 64 experts
of hidden size 1408, top-4, in bf16): tokens/s in total and per device. ``--bench --fp8`` runs the
experts' GEMMs in FP8 (``jax_tk.ragged_dot_fp8``, as ``moe.py --fp8``), beside the bf16 ones.
"""
from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__" and "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe  # noqa: E402  (examples/moe.py)

import jax_tk  # noqa: E402

EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


def moe_layer_expert_parallel(x, p, top_k: int, axis: str, gemm=moe.ragged_dot_tk):
    """Inside ``shard_map``: x [T, D] this device's tokens; p["router"] [D, E] (replicated) and
    p["w_gate"], p["w_up"] [E/n, D, F], p["w_down"] [E/n, F, D] this device's experts, n the size of
    mesh axis ``axis``. Returns ([T, D], this device's load-balancing loss)."""
    n = jax.lax.axis_size(axis)
    T, D = x.shape
    local = p["w_gate"].shape[0]
    weights, order, sizes, aux = moe.route(x, p["router"], top_k)  # sizes: [E], E = n * local
    rows = x[order // top_k]  # [R, D] sorted by expert, R = T * top_k
    R = rows.shape[0]

    # 2. device j's run of rows (its experts j*local .. (j+1)*local - 1) at the front of slot j.
    per_device = sizes.reshape(n, local).sum(axis=1)
    start = jnp.cumsum(per_device) - per_device
    r = jnp.arange(R, dtype=jnp.int32)
    take = start[:, None] + r[None, :]  # [n, R]: the row of xs in slot j, position r
    valid = r[None, :] < per_device[:, None]
    send = jnp.where(valid[..., None], rows[jnp.minimum(take, R - 1)], jnp.zeros((), rows.dtype))
    recv = jax.lax.all_to_all(send, axis, 0, 0)  # [n, R, D]: recv[s] = what device s sent here
    counts = jax.lax.all_to_all(sizes.reshape(n, local), axis, 0, 0)  # [n, local]: per source, per expert

    # 3. order by (local expert, source); rows that carry nothing get expert `local` and go last.
    ends = jnp.cumsum(counts, axis=1)  # [n, local]
    expert = jnp.sum(r[None, :, None] >= ends[:, None, :], axis=2)  # [n, R], `local` past the source's rows
    key = (expert * n + jnp.arange(n, dtype=jnp.int32)[:, None]) * R + r[None, :]
    perm = jnp.argsort(key.reshape(-1))
    mine = recv.reshape(n * R, D)[perm]
    ys = moe.experts_mlp(mine, p["w_gate"], p["w_up"], p["w_down"], counts.sum(axis=0), gemm)

    # 4. back to the buffers' order, back to the devices the rows came from, back to the sorted rows.
    back = jnp.zeros_like(ys).at[perm].set(ys).reshape(n, R, D)
    returned = jax.lax.all_to_all(back, axis, 0, 0)  # [n, R, D]: returned[j] = my rows sent to device j
    ys = jnp.zeros((R, D), ys.dtype).at[jnp.where(valid, take, R)].set(returned, mode="drop")
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(T, top_k, D)
    return jnp.einsum("tk,tkd->td", weights.astype(x.dtype), y), aux


def moe_layer_gathered(x, p, top_k: int, axis: str):
    """As ``moe_layer_expert_parallel``, with ``all_gather`` and ``group_offset`` in place of
    ``all_to_all`` (see the module's docstring)."""
    n, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    T, D = x.shape
    local = p["w_gate"].shape[0]
    weights, order, sizes, aux = moe.route(x, p["router"], top_k)
    rows = x[order // top_k]  # [R, D] sorted by expert
    R = rows.shape[0]
    every = jax.lax.all_gather(rows, axis)  # [n, R, D]: every device's sorted rows
    counts = jax.lax.all_gather(sizes, axis)  # [n, E]
    # One grouped array of every device's rows, ordered by (expert, source device).
    r = jnp.arange(R, dtype=jnp.int32)
    expert = jnp.sum(r[None, :, None] >= jnp.cumsum(counts, axis=1)[:, None, :], axis=2)  # [n, R]
    perm = jnp.argsort(((expert * n + jnp.arange(n, dtype=jnp.int32)[:, None]) * R + r[None, :]).reshape(-1))
    offset = (me * local).astype(jnp.int32)[None]
    gemm = lambda a, b, s: jax_tk.ragged_dot(a, b, s, group_offset=offset)
    ys = moe.experts_mlp(every.reshape(n * R, D)[perm], p["w_gate"], p["w_up"], p["w_down"], counts.sum(axis=0), gemm)
    back = jnp.zeros_like(ys).at[perm].set(ys).reshape(n, R, D)  # (0 but for this device's experts' rows)
    ys = jax.lax.psum_scatter(back, axis, scatter_dimension=0)  # [R, D]: this device's rows, each summed
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(T, top_k, D)
    return jnp.einsum("tk,tkd->td", weights.astype(x.dtype), y), aux


EXCHANGES = {"all_to_all": moe_layer_expert_parallel, "all_gather": moe_layer_gathered}


def param_specs(axis: str):
    return {"router": P(), **{name: P(axis) for name in EXPERT_WEIGHTS}}


def sharded_moe(mesh, axis: str, top_k: int, gemm=moe.ragged_dot_tk, exchange: str = "all_to_all"):
    """The layer over ``mesh``: x [N, D] split over ``axis`` by rows (tokens), the expert weights split
    over it by expert (``param_specs``), the router replicated; the rows exchanged by ``exchange``
    (``EXCHANGES``; ``gemm`` is the all-to-all layer's). Returns f(x, p) -> [N, D]."""
    specs = param_specs(axis)

    def f(x, p):
        if exchange == "all_gather":
            return moe_layer_gathered(x, p, top_k, axis)[0]
        y, _ = moe_layer_expert_parallel(x, p, top_k, axis, gemm)
        return y

    return jax.shard_map(f, mesh=mesh, in_specs=(P(axis), specs), out_specs=P(axis))


def example_params(key, width: int, hidden: int, experts: int):
    k = jax.random.split(key, 4)
    return {"router": jax.random.normal(k[0], (width, experts)),
            "w_gate": jax.random.normal(k[1], (experts, width, hidden)) / np.sqrt(width),
            "w_up": jax.random.normal(k[2], (experts, width, hidden)) / np.sqrt(width),
            "w_down": jax.random.normal(k[3], (experts, hidden, width)) / np.sqrt(hidden)}


def main():
    devices = jax.device_count()
    mesh = jax.make_mesh((devices,), ("expert",))
    tokens, width, hidden, experts, top_k = 64 * devices, 64, 128, 2 * devices, 2
    p = example_params(jax.random.key(0), width, hidden, experts)
    x = jax.random.normal(jax.random.key(1), (tokens, width))
    # The reference: one device, every expert.
    one = jax.jit(lambda x, p: moe.moe_layer(x, p, top_k, moe.ragged_dot_tk)[0])
    want = one(x, p)
    want_grads = jax.grad(lambda x, p: jnp.sum(one(x, p) ** 2), argnums=(0, 1))(x, p)

    x = jax.device_put(x, NamedSharding(mesh, P("expert")))
    p = jax.device_put(p, {k: NamedSharding(mesh, s) for k, s in param_specs("expert").items()})
    errs = []
    for exchange in EXCHANGES:
        f = jax.jit(sharded_moe(mesh, "expert", top_k, exchange=exchange))
        y = f(x, p)
        err = float(jnp.linalg.norm(y - want) / jnp.linalg.norm(want))
        grads = jax.jit(jax.grad(lambda x, p: jnp.sum(f(x, p) ** 2), argnums=(0, 1)))(x, p)
        gerr = max(float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w))
                   for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)))
        hlo = f.lower(x, p).compile().as_text()
        op = exchange.replace("_", "-")
        print(f"{exchange}: {devices} devices, {experts} experts ({experts // devices} per device), top-{top_k}, "
              f"{tokens} tokens: relative error against one device {err:.2e}, gradients {gerr:.2e}; "
              f"{op} ops in the program: {hlo.count(op + '(') + hlo.count(op + '-start(')}")
        errs.append((err, gerr))
    return max(e for e, _ in errs), max(g for _, g in errs)


def bench(devices: int, tokens_per_device: int, width: int, hidden: int, experts: int, top_k: int,
          steps: int = 10, exchange: str = "all_to_all", gemm: str = "tk") -> dict:
    """Tokens/s of the layer's forward and backward (bf16, random routing) on 1 device and on ``devices``
    devices, each device holding ``tokens_per_device`` tokens and experts / n of the experts; printed
    and returned as {n: tokens/s}. ``gemm``: the experts' GEMMs, a name of ``moe.GEMMS`` ("fp8": in FP8;
    the all_to_all exchange only)."""
    if gemm != "tk" and exchange != "all_to_all":
        raise ValueError(f"gemm {gemm!r} runs with the all_to_all exchange only")
    import time

    p = jax.tree.map(lambda w: w.astype(jnp.bfloat16), example_params(jax.random.key(0), width, hidden, experts))
    if not (jax.default_backend() == "gpu" and jax_tk.has_cuda_kernels()):
        print("no GPU kernel runs here: the grouped GEMMs are jax_tk's pure-JAX reference, so these speeds "
              "are not those of jax_tk's kernels")
    result = {}
    for n in sorted({1, devices}):
        mesh = jax.make_mesh((n,), ("expert",), devices=jax.devices()[:n])
        layer = sharded_moe(mesh, "expert", top_k, gemm=moe.GEMMS[gemm], exchange=exchange)
        step = jax.jit(jax.grad(lambda x, p: jnp.sum(layer(x, p).astype(jnp.float32) ** 2), argnums=(0, 1)))
        x = jax.random.normal(jax.random.key(1), (tokens_per_device * n, width), jnp.bfloat16)
        x = jax.device_put(x, NamedSharding(mesh, P("expert")))
        ps = jax.device_put(p, {k: NamedSharding(mesh, s) for k, s in param_specs("expert").items()})
        jax.block_until_ready(step(x, ps))
        t0 = time.perf_counter()
        for _ in range(steps):
            out = step(x, ps)
        jax.block_until_ready(out)
        result[n] = tokens_per_device * n * steps / (time.perf_counter() - t0)
        print(f"{exchange}, {moe.LABELS[gemm]}: {n} device(s), {experts // n} experts each, "
              f"{tokens_per_device} tokens each, width {width}, hidden "
              f"{hidden}, top-{top_k}: forward + backward {result[n]:,.0f} tokens/s ({result[n] / n:,.0f} per device)")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench", action="store_true",
                        help="time the layer's forward and backward on every device against one, instead of "
                             "checking it against the one-device layer")
    parser.add_argument("--exchange", choices=tuple(EXCHANGES), default="all_to_all",
                        help="with --bench: how the rows reach their experts' devices")
    parser.add_argument("--fp8", action="store_true",
                        help="with --bench: also time the layer with its experts' GEMMs in FP8 "
                             "(jax_tk.ragged_dot_fp8; all_to_all exchange)")
    args = parser.parse_args()
    if args.bench:  # e.g. python examples/expert_parallel.py --bench  (all devices against one)
        gpu = jax.default_backend() == "gpu"
        sizes = (8192 if gpu else 64, 2048 if gpu else 64, 1408 if gpu else 128, 64 if gpu else 8, 4 if gpu else 2)
        for gemm in ("tk", "fp8") if args.fp8 else ("tk",):
            bench(jax.device_count(), *sizes, steps=10 if gpu else 2, exchange=args.exchange, gemm=gemm)
    else:
        main()
