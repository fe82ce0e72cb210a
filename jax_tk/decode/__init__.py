"""Decode attention over a KV cache (serving): ``jax_tk.decode.attention`` (and ``attention_with_lse``,
which also returns the log-sum-exp), ``jax_tk.decode.mla_attention`` (multi-head latent attention over
one latent cache, and ``mla_attention_with_lse``), ``jax_tk.decode.update_kv_cache``, and
``jax_tk.decode.append_attention`` (a step's update of the cache and its attention in one call).

api.py (checks, custom_vjp, dispatch, partitioning), mla.py (the same for mla_attention), append.py
(append_attention), launch.py
(the decode kernel's operands), reference.py (the pure-JAX reference: the path off CUDA and where the
kernel does not apply).
"""
from jax_tk.decode import api, append, mla, reference
from jax_tk.decode.api import attention, attention_with_lse, kernel_unsupported_reason, update_kv_cache
from jax_tk.decode.append import append_attention
from jax_tk.decode.mla import mla_attention, mla_attention_with_lse

__all__ = ["append_attention", "attention", "attention_with_lse", "kernel_unsupported_reason", "mla_attention", "mla_attention_with_lse",
           "update_kv_cache"]
