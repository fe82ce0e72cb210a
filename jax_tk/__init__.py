"""jax_tk: fast, differentiable GPU kernels for JAX, written on a small CUDA tile language."""
from jax_tk._core.extension import has_cuda_kernels
from jax_tk._core.ffi import export_checks
from jax_tk._core.sharding import set_auto_partitioning
from jax_tk.attention import (  # (binds jax_tk.attention to the function)
    attention, attention_with_lse, plan_attention, ring_attention, ring_attention_with_lse, unzigzag, zigzag,
    zigzag_indices)
from jax_tk import decode, linear_attention
from jax_tk.gemm import matmul, matmul_fp8, quantize_fp8, ragged_dot, ragged_dot_fp8

__version__ = "0.1.0"
__all__ = ["attention", "attention_with_lse", "matmul", "matmul_fp8", "quantize_fp8", "ragged_dot", "ragged_dot_fp8",
           "ring_attention", "ring_attention_with_lse", "zigzag", "unzigzag", "zigzag_indices", "plan_attention", "set_auto_partitioning", "decode",
           "linear_attention", "has_cuda_kernels", "export_checks", "__version__"]
