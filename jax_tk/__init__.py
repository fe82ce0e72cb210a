"""jax_tk: fast, differentiable GPU kernels for JAX, written on a small CUDA tile language."""
from jax_tk._ffi import has_cuda_kernels
from jax_tk.attention import attention, attention_with_lse
from jax_tk import ring, sharding  # noqa: E402  (multi-device: context parallelism, partitioning)
from jax_tk.ring import ring_attention

__version__ = "0.1.0"
__all__ = ["attention", "attention_with_lse", "ring_attention", "has_cuda_kernels", "__version__"]
