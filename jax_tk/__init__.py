"""jax_tk: fast, differentiable GPU kernels for JAX, written on a small CUDA tile language."""
from jax_tk._ffi import has_cuda_kernels
from jax_tk.attention import attention, attention_with_lse

__version__ = "0.1.0"
__all__ = ["attention", "attention_with_lse", "has_cuda_kernels", "__version__"]
