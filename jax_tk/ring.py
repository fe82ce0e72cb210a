"""Ring attention (context parallelism) and the zig-zag layout: ``jax_tk.attention.ring``, under the
name the documentation uses."""
from jax_tk.attention.ring import (  # noqa: F401
    LAYOUTS, ring_attention, ring_attention_with_lse, unzigzag, zigzag, zigzag_indices)

__all__ = ["ring_attention", "ring_attention_with_lse", "zigzag", "unzigzag", "zigzag_indices"]
