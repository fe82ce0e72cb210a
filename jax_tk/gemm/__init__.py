"""The grouped (mixture-of-experts) GEMM and the dense GEMM: ``jax_tk.ragged_dot``, ``jax_tk.matmul``.

api.py (checks, custom_vjp, dispatch, partitioning), launch.py (the kernel's operands and its
batching), reference.py (the float32 pure-JAX reference).
"""
from jax_tk.gemm import api, launch, reference
from jax_tk.gemm.api import local_group_sizes, matmul, ragged_dot

__all__ = ["local_group_sizes", "matmul", "ragged_dot"]
