"""Loads the compiled extension (when it was built), registers its FFI targets for CUDA, and reads the
ops' contracts.

The package works without the extension: every op then runs its pure-JAX reference. An op's
*contract* is the set of integer constants that its Python launch layer and its C++ kernels must
agree on (block sizes, workspace layouts, supported head dims). They are written once, as
``constexpr int NAME = value;`` lines in the op's header ``cc/<op>/<op>.h``; the extension reports
the values it was compiled with, and without the extension the header itself is read (it is
installed with the package, and found in the source tree otherwise).
"""
from __future__ import annotations

import functools
import os
import re

import jax

try:  # built only when nvcc was found at install time
    from jax_tk import _tk  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the build
    _tk = None

try:  # the tile-language unit-test kernels: developer builds only
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


def has_target(name: str) -> bool:
    """True when the built extension registered the FFI target ``name`` (an extension built before an
    op's kernels existed lacks their targets)."""
    return name in _registered


def has_test_kernels() -> bool:
    """True when the tile-language unit-test kernels were built."""
    return _tk_tests is not None


def test_kernels():
    """The unit-test kernel module (``jax_tk._tk_tests``), or None."""
    return _tk_tests


def kernel_archs() -> tuple[str, ...]:
    """The GPU architectures the kernels were compiled for, e.g. ``("80", "90a")``; () without them."""
    if _tk is None:
        return ()
    return tuple(a for a in _tk.archs().split(",") if a)


def kernels_run_on(capability: tuple[int, int]) -> bool:
    """Whether the built kernels run on a GPU of this compute capability: 9.0 (H100, H200) takes the
    sm_90a build (the handlers launch the Hopper kernels there), 8.x an sm_8y build with y <= x (A100,
    A10, L4, ...). The binaries hold no PTX, so other GPUs (before sm_80, or Blackwell and later) have
    no kernel to run."""
    major, minor = capability
    archs = kernel_archs()
    if (major, minor) == (9, 0):
        return "90a" in archs
    if major == 8:
        return any(len(a) == 2 and a[0] == "8" and int(a[1]) <= minor for a in archs)
    return False


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


# `constexpr int NAME = <integer expression of literals: digits, spaces, | & + - * ( ) << >>>;`
_CONSTEXPR = re.compile(r"^\s*constexpr\s+int\s+([A-Z][A-Z0-9_]*)\s*=\s*([0-9|&+\-*()<> ]+);", re.MULTILINE)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def header_path(op: str) -> str:
    """The op's contract header: installed with the package (``jax_tk/_contract/<op>.h``), else in the
    source tree (``cc/<op>/<op>.h``)."""
    for path in (os.path.join(_PACKAGE, "_contract", f"{op}.h"),
                 os.path.join(os.path.dirname(_PACKAGE), "cc", op, f"{op}.h")):
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"jax_tk: the contract header of op {op!r} is missing (looked for _contract/{op}.h "
                            "in the package and cc/{op}/{op}.h in the source tree)")


def header_constants(op: str) -> dict[str, int]:
    """The ``constexpr int`` constants of the op's header, parsed from its text."""
    with open(header_path(op)) as f:
        # (the pattern admits only integer literals and operators, so eval sees no names)
        return {name: int(eval(value, {"__builtins__": {}})) for name, value in _CONSTEXPR.findall(f.read())}


@functools.lru_cache(maxsize=None)
def contract(op: str) -> dict[str, int]:
    """The op's contract constants: as compiled into the extension where it was built, else from the
    header."""
    if _tk is not None:
        compiled = _tk.contract().get(op)
        if compiled is not None:
            return dict(compiled)
    return header_constants(op)
