"""Linear attention: ``jax_tk.linear_attention.gated_delta_rule`` (Gated DeltaNet) and ``simple_gla``
(a scalar decay per head, Mamba-2's SSD core), over whole or packed sequences, and their one-token
decoding steps ``gated_delta_rule_step`` and ``simple_gla_step``. Semantics and layout
``[batch, T, heads, K]`` follow flash-linear-attention's ``chunk_*`` functions.

api.py (checks, the implementation= choice, the kernel path's custom_vjp and partitioning), launch.py
(the kernels' operands), reference.py (the token-by-token recurrence and the chunked XLA path). Both
ops run kernels on H100/H200, forward and backward; everything else runs the chunked XLA path (or the
recurrence, on request).
"""
from jax_tk.linear_attention import api, reference
from jax_tk.linear_attention.api import (
    chunk_size, gated_delta_rule, gated_delta_rule_step, simple_gla, simple_gla_step)

__all__ = ["gated_delta_rule", "simple_gla", "gated_delta_rule_step", "simple_gla_step", "chunk_size"]
