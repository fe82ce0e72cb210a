"""jax_tk: fast, differentiable GPU kernels for JAX, written on a small CUDA tile language."""
from jax_tk._core.extension import has_cuda_kernels
from jax_tk._core.ffi import export_checks
from jax_tk.attention import attention, attention_with_lse, ring_attention  # (binds jax_tk.attention to the function)
from jax_tk.attention import ring
from jax_tk import sharding
from jax_tk import decode
from jax_tk.gemm import matmul, ragged_dot

__version__ = "0.1.0"
__all__ = ["attention", "attention_with_lse", "matmul", "ragged_dot", "ring_attention", "has_cuda_kernels",
           "export_checks", "__version__"]
