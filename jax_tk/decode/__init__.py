"""Decode attention over a KV cache (serving): ``jax_tk.decode.attention`` (and ``attention_with_lse``,
which also returns the log-sum-exp) and ``jax_tk.decode.update_kv_cache``.

api.py (checks, custom_vjp, dispatch, partitioning), launch.py (the decode kernel's operands),
reference.py (the pure-JAX reference: the path off CUDA and where the kernel does not apply).
"""
from jax_tk.decode import api, reference
from jax_tk.decode.api import attention, attention_with_lse, kernel_unsupported_reason, update_kv_cache

__all__ = ["attention", "attention_with_lse", "kernel_unsupported_reason", "update_kv_cache"]
