"""Attention: ``jax_tk.attention``, ``jax_tk.attention_with_lse`` and ring attention.

api.py (checks, custom_vjp, dispatch, partitioning), launch.py (the kernels' operands),
reference.py (the pure-JAX reference), ring.py (context parallelism).
"""
from jax_tk.attention import api, launch, reference, ring
from jax_tk.attention.api import attention, attention_with_lse
from jax_tk.attention.ring import ring_attention, ring_attention_with_lse

__all__ = ["attention", "attention_with_lse", "ring_attention", "ring_attention_with_lse"]
