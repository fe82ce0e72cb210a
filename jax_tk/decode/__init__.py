"""Decode attention over a KV cache (serving): ``jax_tk.decode.attention`` and ``jax_tk.decode.update_kv_cache``.

api.py (checks, spec, dispatch), reference.py (the pure-JAX reference). No kernel yet: every call runs
the reference, on the GPU too.
"""
from jax_tk.decode import api, reference
from jax_tk.decode.api import attention, update_kv_cache

__all__ = ["attention", "update_kv_cache"]
