"""The grouped (mixture-of-experts) GEMM and the dense GEMM: ``jax_tk.ragged_dot``, ``jax_tk.matmul``,
and their FP8 block-scaled forms ``jax_tk.ragged_dot_fp8``, ``jax_tk.matmul_fp8`` (``jax_tk.quantize_fp8``).

api.py (checks, custom_vjp, dispatch, partitioning), launch.py (the kernel's operands and its
batching), reference.py (the float32 pure-JAX reference), fp8.py (FP8 with block scales: quantization
and the pure-JAX path).
"""
from jax_tk.gemm import api, fp8, launch, reference
from jax_tk.gemm.api import local_group_sizes, matmul, ragged_dot
from jax_tk.gemm.fp8 import matmul_fp8, quantize_fp8, ragged_dot_fp8

__all__ = ["local_group_sizes", "matmul", "matmul_fp8", "quantize_fp8", "ragged_dot", "ragged_dot_fp8"]
