"""One forward call each of plain causal, the same mask through the masked kernels, and 8 packed
documents (for ncu: ncu -k regex:fwd_sm90 python scripts/ncu_probe.py)."""
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
for name, kw in calls.items():
    out = jax.jit(lambda q, k, v: jax_tk.attention(q, k, v, implementation="tk", **kw))(q, k, v)
    out.block_until_ready()
    print(name, "done")
