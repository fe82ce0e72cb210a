"""One jitted gradient (or with `fwd`, forward) of attention, for kernel durations under ncu:
  ncu --metrics gpu__time_duration.sum python3 -P scripts/kernel_times_probe.py tk|cudnn B T H D [causal] [fwd]"""
import sys

import jax
import jax.numpy as jnp

import jax_tk

impl = sys.argv[1]
B, T, H, D = (int(x) for x in sys.argv[2:6])
causal, forward_only = "causal" in sys.argv[6:], "fwd" in sys.argv[6:]
q, k, v = (jax.random.normal(kk, (B, T, H, D), jnp.bfloat16) for kk in jax.random.split(jax.random.PRNGKey(0), 3))
if impl == "tk":
    attn = lambda q, k, v: jax_tk.attention(q, k, v, implementation="tk", is_causal=causal)
else:
    attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn", is_causal=causal)
if forward_only:
    f = jax.jit(attn)
else:
    f = jax.jit(jax.grad(lambda q, k, v: attn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
jax.block_until_ready(f(q, k, v))
