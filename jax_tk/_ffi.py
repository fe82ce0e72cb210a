"""Loads the compiled extension (when it was built) and registers its FFI targets for CUDA.

The package works without the extension: every op then runs its pure-JAX reference.
"""
from __future__ import annotations

import jax

try:  # built only when nvcc was found at install time
    from jax_tk import _tk  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the build
    _tk = None

try:
    from jax_tk import _tk_tests  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    _tk_tests = None

_registered: set[str] = set()


def _register(module) -> None:
    if module is None:
        return
    for name, capsule in module.registrations().items():
        if name not in _registered:
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
            _registered.add(name)


_register(_tk)
_register(_tk_tests)


def has_cuda_kernels() -> bool:
    """True when jax_tk was built with its CUDA kernels."""
    return _tk is not None


def has_test_kernels() -> bool:
    """True when the tile-language unit-test kernels were built."""
    return _tk_tests is not None


def cuda_device_capability() -> tuple[int, int] | None:
    """Compute capability of the first local CUDA device, or None without one."""
    try:
        devs = jax.devices("cuda")
    except RuntimeError:
        return None
    if not devs:
        return None
    cc = getattr(devs[0], "compute_capability", None)
    if cc is None:
        return None
    major, minor = str(cc).split(".")
    return int(major), int(minor)
