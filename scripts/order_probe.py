"""The block order's effect with segment ids: forward and backward times of one segment per row (the
same results as plain attention) and of 8 random documents per row, with the order in groups of
1, 4 (the default) or 16 heads, and with no order (the kernels' own).
Usage: PYTHONPATH=<built jax_tk> python scripts/order_probe.py"""
import sys

import jax
import jax.numpy as jnp

import jax_tk
from jax_tk.bench import AttentionConfig, WallTimer

A = sys.modules["jax_tk.attention"]
timer = WallTimer()
order_fn = A._block_order
H, D = 16, 128


def run(B, T, causal, ids, label):
    key = jax.random.PRNGKey(0)
    q, k, v, do = (jax.random.normal(kk, (B, T, H, D), jnp.bfloat16) for kk in jax.random.split(key, 4))

    def fwd(q, k, v, i):
        kw = {} if i is None else dict(q_segment_ids=i, kv_segment_ids=i)
        return jax_tk.attention(q, k, v, is_causal=causal, implementation="tk", **kw)

    variants = [("plain", None, None)] if ids is not None and label == "1 segment" else []
    variants += [(f"group {g}", ids, g) for g in (1, 4, 16)] + [("no order", ids, 0)]
    for name, i, g in variants:
        A._block_order = order_fn if g else (lambda *a, **k: None)
        A.ORDER_GROUP_HEADS = g or 4
        f = jax.jit(lambda q, k, v: fwd(q, k, v, i))
        t_f = timer.measure(f, [(q, k, v)]).median_ms
        vjp = jax.jit(lambda q, k, v: jax.vjp(lambda q, k, v: fwd(q, k, v, i), q, k, v)[1])(q, k, v)
        t_b = timer.measure(jax.jit(lambda fn, g: fn(g)), [(vjp, do)]).median_ms
        print(f"B={B} T={T} causal={causal:d} {label:10s} {name:9s} fwd {t_f:7.4f} ms  bwd {t_b:7.4f} ms", flush=True)


for causal in (False, True):
    for B, T in ((8, 2048), (1, 16384)):
        run(B, T, causal, jnp.zeros((B, T), jnp.int32), "1 segment")
    docs = AttentionConfig(1, 16384, 16384, H, D, causal, feature="documents", documents=8).segment_ids()
    run(1, 16384, causal, jnp.asarray(docs), "8 docs")
