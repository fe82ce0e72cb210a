"""The ``implementation=`` choice, the kernel variant, and the platform dispatch shared by every op.

``implementation=None`` runs the kernel where the configuration is supported (and the local GPU is one
the kernels were built for) and the pure-JAX reference elsewhere; the choice between them is made per
platform by ``platform_dependent``, so the same program lowers for CPU (the reference) and for CUDA
(the kernel). ``"tk"`` forces the kernel (or raises), ``"xla"`` the reference.

Which kernels a call runs on the GPU is one environment variable, ``JAX_TK_KERNELS`` (see
:func:`kernel_variant`), passed to every kernel as its FFI call's ``variant`` attribute.
"""
from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jax_tk._core import extension

IMPLEMENTATIONS = (None, "tk", "xla")
KERNELS_ENV = "JAX_TK_KERNELS"
# Its values and the variant codes (cc/core/core.h's VARIANT_*) they stand for.
KERNELS = {"auto": "VARIANT_AUTO", "sm80": "VARIANT_SM80", "sm86": "VARIANT_SM86"}


def kernel_variant(kernels: str | None = None) -> int:
    """The ``variant`` attribute of the kernels' FFI calls: the code of ``kernels``, or where None of the
    environment variable ``JAX_TK_KERNELS``:

    - unset or ``auto``: the fastest kernels for the device (the sm_90a ones on H100/H200);
    - ``sm80``: the portable mma.sync kernels on every GPU (to test or time them on Hopper);
    - ``sm86``: as ``sm80``, and within the shared memory of sm_86/sm_89 GPUs (RTX 30xx/40xx, A10, L4),
      where a kernel sizes itself by it (decode): what those GPUs run, on a larger one.

    The variable is read when a call is traced: set it before tracing (``jax.jit`` caches traced
    calls, so a change applies to functions traced afterwards only)."""
    name = os.environ.get(KERNELS_ENV, "auto") if kernels is None else kernels
    key = name.strip().lower() or "auto"
    if key not in KERNELS:
        where = f"{KERNELS_ENV}={name!r}" if kernels is None else f"kernels {name!r}"
        raise ValueError(f"jax_tk: {where}: expected one of {', '.join(KERNELS)}")
    return extension.contract("core")[KERNELS[key]]


def check_implementation(op: str, implementation, extra: tuple = ()) -> None:
    """``implementation`` must be one of IMPLEMENTATIONS or of the op's own ``extra`` choices."""
    if implementation not in IMPLEMENTATIONS + extra:
        raise ValueError(f"jax_tk.{op}: implementation must be one of {IMPLEMENTATIONS + extra}, got {implementation!r}")


_NO_KERNELS = "installed without nvcc, on a machine without a GPU, or with JAX_TK_CUDA=OFF"


@functools.lru_cache(maxsize=None)
def _warn_once(message: str):
    """Why an op runs the reference on this GPU, said once per message (at the op's caller)."""
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def use_kernel(op: str, implementation, unsupported_reason: str | None) -> bool:
    """Whether the call takes the kernel: ``unsupported_reason`` is why the kernel cannot take this
    configuration (None if it can). Raises for ``implementation="tk"`` when the kernel cannot run."""
    check_implementation(op, implementation)
    if implementation == "xla":
        return False
    capability = extension.cuda_device_capability()
    local_gpu = capability is not None
    if implementation == "tk":
        if unsupported_reason is not None:
            raise ValueError(f"jax_tk.{op}(implementation='tk'): unsupported {unsupported_reason}")
        if not extension.available():
            raise RuntimeError(f"jax_tk.{op}(implementation='tk'): this copy of jax_tk has no compiled extension "
                               "(run from a source tree that was never built): install the package, e.g. "
                               "`pip install -e .`")
        if not extension.has_cuda_kernels():
            raise RuntimeError(f"jax_tk.{op}(implementation='tk'): jax_tk was built without CUDA kernels "
                               f"({_NO_KERNELS})")
        if not local_gpu:
            raise RuntimeError(f"jax_tk.{op}(implementation='tk') needs a CUDA GPU")
        if not extension.kernels_run_on(capability):
            raise RuntimeError(f"jax_tk.{op}(implementation='tk'): the kernels are built for GPU architectures "
                               f"{', '.join(extension.kernel_archs())}, which do not run on this GPU (compute "
                               f"capability {capability[0]}.{capability[1]})")
        return True
    # implementation=None: the kernel where it applies. Without local CUDA devices the kernel is still
    # emitted in the CUDA branch, so that programs exported or lowered for CUDA use it.
    # Without the extension (a bare source tree) the kernel's operands cannot be worked out: the reference.
    if unsupported_reason is not None or not extension.available():
        return False
    if local_gpu and not extension.has_cuda_kernels():
        _warn_once(f"jax_tk was installed without its CUDA kernels ({_NO_KERNELS}); {op} runs the pure-JAX "
                   "reference on the GPU. Install the binary wheel, or reinstall here with nvcc, to get the kernels.")
        return False
    if local_gpu and not extension.kernels_run_on(capability):
        _warn_once(f"jax_tk's kernels are built for GPU architectures {', '.join(extension.kernel_archs())}; this GPU "
                   f"has compute capability {capability[0]}.{capability[1]}, so {op} runs the pure-JAX reference.")
        return False
    return True


def warn_reference(op: str, why: str) -> None:
    """Says once, where there is a GPU, that ``op`` runs the pure-JAX reference on it and why (a
    configuration whose kernels run on other GPUs only, e.g. MLA's head dims off Hopper)."""
    if extension.cuda_device_capability() is not None:
        _warn_once(f"jax_tk.{op}: {why}: it runs the pure-JAX reference on this GPU")


def platform_dispatch(use_kernel: bool, kernel_fn: Callable, reference_fn: Callable, *args):
    """``kernel_fn(*args)`` on CUDA and ``reference_fn(*args)`` elsewhere (only the reference when
    ``use_kernel`` is False). ``args`` may hold pytrees and Nones."""
    if not use_kernel:
        return reference_fn(*args)
    # vary_like: inside shard_map(check_vma=True) the ffi_call's results must be typed as varying over
    # the inputs' manual axes, like the reference branch's, or the branches do not type-check.
    return jax.lax.platform_dependent(*args, cuda=functools.partial(vary_like, kernel_fn), default=reference_fn)


def vma(x) -> frozenset:
    """The manual mesh axes over which ``x`` varies (``aval.manual_axis_type.varying`` in JAX >= 0.10,
    ``aval.vma`` before)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(getattr(mat, "varying", None) or ())
    return frozenset(getattr(aval, "vma", None) or ())


def _pcast_varying(x, axes: tuple):
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)  # pragma: no cover - older JAX


def vary_like(fn: Callable, *args):
    """``fn(*args)`` with its results typed as varying over every manual mesh axis its inputs vary over.

    An ``ffi_call``'s results carry no varying-manual-axes (vma) type, so inside
    ``shard_map(check_vma=True)`` the kernel branch of ``platform_dependent`` would not type like the
    reference branch; this fixes that (a type-level cast, no data movement)."""
    outs = fn(*args)
    axes = frozenset().union(*(vma(a) for a in jax.tree.leaves(args)))
    if not axes:
        return outs
    fix = lambda o: _pcast_varying(o, tuple(sorted(axes - vma(o)))) if axes - vma(o) else o
    return type(outs)(fix(o) for o in outs) if isinstance(outs, (tuple, list)) else fix(outs)


def vary_as(x, *like):
    """``x`` typed as varying over every manual mesh axis one of ``like`` varies over (a type-level cast;
    None entries are skipped). The gradient with respect to the result is then per device, as a kernel
    gives it, instead of summed by autodiff over the axes ``x`` is invariant over."""
    missing = frozenset().union(*(vma(y) for y in like if y is not None)) - vma(x)
    return _pcast_varying(x, tuple(sorted(missing))) if missing else x


def zeros(shape, dtype, *like):
    """Zeros typed as varying over every manual mesh axis one of ``like`` varies over (None entries
    skipped): the result of an op with nothing to compute (an empty dimension), or a stand-in for a
    result, typed as its computed result would be."""
    return vary_as(jnp.zeros(shape, dtype), *like)


def sum_as(cotangent, primal):
    """``cotangent`` summed over the manual mesh axes it varies over and ``primal`` does not: the
    gradient of an operand shared by those devices (e.g. a bias replicated inside ``shard_map``) is the
    sum of their parts, and a custom_vjp's cotangent must have its primal's type."""
    extra = vma(cotangent) - vma(primal)
    return jax.lax.psum(cotangent, tuple(sorted(extra))) if extra else cotangent
