"""GEMM providers: jax_tk and its peers, each as a ``harness.Provider`` for one ``gemm.GemmConfig``.

Grouped GEMM (``ragged_dot``; every ``fn(lhs [m, k], rhs [g, k, n], group_sizes [g] int32)``, the
group sizes a traced array):

- ``jax_tk``: ``jax_tk.ragged_dot``; on a GPU with ``implementation="tk"``, skipped with the reason
  where the kernel does not take the shape; without one, ``implementation=None`` (the reference);
- ``lax``: ``jax.lax.ragged_dot``;
- ``dense``: XLA's ``[m, k] @ [k, n]`` on the first group's matrix: the same FLOPs without groups,
  the ceiling;
- ``tokamax``: ``tokamax.ragged_dot(..., implementation="mosaic")`` (its Pallas Mosaic GPU kernel);
- ``jla``: jax-linear-attention's ``jla.ops.mosaic_gpu.ragged_dot.ragged_dot`` (Pallas Mosaic GPU,
  Hopper), skipped where its own ``supports`` rejects the call (K and N multiples of 128, at least
  128 rows, at most 512 groups).

Dense GEMM (``matmul``; ``fn(a [m, k], b [k, n])``): ``jax_tk`` (``jax_tk.matmul``, the grouped kernel
with one group) and ``xla`` (``jnp.dot``).

The peers (``peers``) are recorded as skipped, "unavailable: ...", where their package is not
installed or there is no CUDA GPU.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks import peers
from benchmarks.harness import Provider, Skip, Unavailable, has_gpu

def _jax_tk_implementation(cfg, groups: int) -> tuple[str | None, str]:
    """``implementation`` for jax_tk on this machine, and the note: the kernel on a GPU (Skip where it
    does not take the shape), the reference without one."""
    if not has_gpu():
        return None, "the float32 reference (no GPU)"
    import jax_tk
    from jax_tk.gemm import launch

    reason = launch.kernel_unsupported_reason(cfg.jnp_dtype, cfg.k, cfg.n, groups, cfg.m)
    if reason is not None:
        raise Skip(f"the kernel does not take {reason}")
    if not jax_tk.has_cuda_kernels():
        raise Unavailable("jax_tk was built without its CUDA kernels")
    return "tk", ""


def _first_group(lhs, rhs, sizes, dout):
    return lhs, rhs[0], dout


# ----------------------------------------------------------------------------------------------
# ragged_dot
# ----------------------------------------------------------------------------------------------


def _ragged_jax_tk(cfg) -> Provider:
    import jax_tk

    impl, note = _jax_tk_implementation(cfg, cfg.groups)
    return Provider("jax_tk", lambda lhs, rhs, sizes: jax_tk.ragged_dot(lhs, rhs, sizes, implementation=impl),
                    note=note)


def _tokamax(cfg) -> Provider:
    tokamax, _ = peers.load("tokamax")
    return Provider("tokamax", lambda lhs, rhs, sizes: tokamax.ragged_dot(lhs, rhs, sizes, implementation="mosaic"),
                    note='tokamax.ragged_dot(implementation="mosaic")')


def _jla(cfg) -> Provider:
    kernels, _ = peers.load("jla", "jla.ops.mosaic_gpu.ragged_dot")
    spec = lambda shape, dtype=cfg.jnp_dtype: jax.ShapeDtypeStruct(shape, dtype)
    if not kernels.supports(spec((cfg.m, cfg.k)), spec((cfg.groups, cfg.k, cfg.n)), spec((cfg.groups,), jnp.int32)):
        raise Skip(f"jla.ops.mosaic_gpu.ragged_dot.supports rejects m={cfg.m} k={cfg.k} n={cfg.n} "
                   f"groups={cfg.groups} {cfg.dtype} on this GPU")
    return Provider("jla", lambda lhs, rhs, sizes: kernels.ragged_dot(lhs, rhs, sizes),
                    note="jla.ops.mosaic_gpu.ragged_dot.ragged_dot")


RAGGED_FACTORIES = {
    "jax_tk": _ragged_jax_tk,
    "lax": lambda cfg: Provider("lax", lambda lhs, rhs, sizes: jax.lax.ragged_dot(lhs, rhs, sizes)),
    "dense": lambda cfg: Provider("dense", lambda a, b: jnp.dot(a, b), prepare=_first_group,
                                  note="dense [m, k] @ [k, n]: the same FLOPs"),
    "tokamax": _tokamax,
    "jla": _jla,
}
RAGGED_BASELINES = ("lax", "dense")


# ----------------------------------------------------------------------------------------------
# matmul
# ----------------------------------------------------------------------------------------------


def _matmul_jax_tk(cfg) -> Provider:
    import jax_tk

    impl, note = _jax_tk_implementation(cfg, 1)
    return Provider("jax_tk", lambda a, b: jax_tk.matmul(a, b, implementation=impl), prepare=_first_group,
                    note=note)


MATMUL_FACTORIES = {
    "jax_tk": _matmul_jax_tk,
    "xla": lambda cfg: Provider("xla", lambda a, b: jnp.dot(a, b), prepare=_first_group),
}
MATMUL_BASELINES = ("xla",)
