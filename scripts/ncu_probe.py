"""One call each of plain causal, the same mask through the masked kernels, and 8 packed documents,
forward or (NCU_PROBE=bwd) backward, plus plain non-causal for the backward
(for ncu: ncu -k regex:fwd_sm90 python scripts/ncu_probe.py)."""
import os

import jax
import jax.numpy as jnp

import jax_tk
from jax_tk.bench import AttentionConfig

T, H, D = 16384, 16, 128
key = jax.random.PRNGKey(0)
q, k, v = (jax.random.normal(kk, (1, T, H, D), jnp.bfloat16) for kk in jax.random.split(key, 3))
ids = jnp.asarray(AttentionConfig(1, T, T, H, D, False, documents=8).segment_ids())
calls = {
    "plain_causal": dict(is_causal=True),
    "masked_causal": dict(is_causal=True, local_window_size=(T, 0)),
    "documents": dict(q_segment_ids=ids, kv_segment_ids=ids),
}
backward = os.environ.get("NCU_PROBE") == "bwd"
if backward:
    calls = {"plain": {}, **calls}
for name, kw in calls.items():
    f = lambda q, k, v: jax_tk.attention(q, k, v, implementation="tk", **kw)
    if backward:
        f = jax.grad(lambda q, k, v, f=f: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    jax.block_until_ready(jax.jit(f)(q, k, v))
    print(name, "done")
