"""One jitted gradient (or with `fwd`, forward) of attention, for kernel durations under ncu:
  ncu --metrics gpu__time_duration.sum python3 -P scripts/kernel_times_probe.py tk|cudnn B T H D [causal] [fwd] [docs]
With `docs` (jax_tk only): 8 packed documents of random lengths per row (the benchmark's), as segment
ids, so that the XLA ops preparing the kernels' tiles show too."""
import sys

import jax
import jax.numpy as jnp

import jax_tk
from jax_tk.bench import document_lengths, segment_ids_from_lengths

impl = sys.argv[1]
B, T, H, D = (int(x) for x in sys.argv[2:6])
causal, forward_only, docs = ("causal" in sys.argv[6:], "fwd" in sys.argv[6:], "docs" in sys.argv[6:])
q, k, v = (jax.random.normal(kk, (B, T, H, D), jnp.bfloat16) for kk in jax.random.split(jax.random.PRNGKey(0), 3))
ids = jnp.asarray(segment_ids_from_lengths(document_lengths(T, 8, 0, B))) if docs else None
if impl == "tk":
    attn = lambda q, k, v, ids: jax_tk.attention(q, k, v, implementation="tk", is_causal=causal, q_segment_ids=ids,
                                                 kv_segment_ids=ids)
else:
    attn = lambda q, k, v, ids: jax.nn.dot_product_attention(q, k, v, implementation="cudnn", is_causal=causal)
if forward_only:
    f = jax.jit(attn)
else:
    f = jax.jit(jax.grad(lambda q, k, v, ids: attn(q, k, v, ids).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
jax.block_until_ready(f(q, k, v, ids))
