"""Attention: ``jax_tk.attention``, ``jax_tk.attention_with_lse``, ring attention and its zig-zag layout.

api.py (the public functions, the custom_vjp, dispatch, partitioning), compat.py (the arguments,
checked and normalized once), launch.py (the kernels' operands), reference.py (the pure-JAX
reference), ring.py (context parallelism).
"""
from jax_tk.attention import api, compat, launch, reference, ring
from jax_tk.attention.api import attention, attention_with_lse, plan_attention
from jax_tk.attention.ring import ring_attention, ring_attention_with_lse, unzigzag, zigzag, zigzag_indices

__all__ = ["attention", "attention_with_lse", "plan_attention", "ring_attention", "ring_attention_with_lse",
           "unzigzag", "zigzag", "zigzag_indices"]
