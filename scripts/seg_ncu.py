"""One call each of the masked kernels without and with segment ids on the same problem (a window
wider than the rows: no mask; then one segment per row: the same results), forward or (argv[1] =
bwd) backward, for ncu: ncu -k regex:'fwd_sm90_kernel|bwd_sm90_kernel' python scripts/seg_ncu.py fwd.
Usage: python scripts/seg_ncu.py fwd|bwd [B T]"""
import sys

import jax
import jax.numpy as jnp

import jax_tk

mode = sys.argv[1] if len(sys.argv) > 1 else "fwd"
B, T = (int(x) for x in sys.argv[2:4]) if len(sys.argv) > 3 else (1, 16384)
H, D = 16, 128
key = jax.random.PRNGKey(0)
q, k, v = (jax.random.normal(kk, (B, T, H, D), jnp.bfloat16) for kk in jax.random.split(key, 3))
ids = jnp.zeros((B, T), jnp.int32)
calls = {"window": dict(local_window_size=(T - 1, T - 1)), "one_segment": dict(q_segment_ids=ids, kv_segment_ids=ids)}
for name, kw in calls.items():
    f = lambda q, k, v, kw=kw: jax_tk.attention(q, k, v, implementation="tk", **kw)
    if mode == "bwd":
        f = jax.grad(lambda q, k, v, f=f: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    jax.block_until_ready(jax.jit(f)(q, k, v))
    print(name, "done", flush=True)
