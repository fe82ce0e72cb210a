"""Loads the compiled extension, registers its FFI targets for CUDA, and reads the ops' contracts.

The extension ``jax_tk._tk`` is built on every install: the ops' contracts and formulas always, the
CUDA kernels where the install compiled them (``has_cuda_kernels()``). Run straight from a source tree
that was never built, the package has no extension: every op then runs its pure-JAX reference.

An op's *contract* is the set of integer constants that its Python launch layer and its C++ kernels
must agree on (block sizes, supported head dims, enum codes, kernel variants). They are written once,
as the X-macro list ``JAX_TK_<OP>_CONTRACT`` of the op's header ``cc/<op>/<op>.h`` (``cc/core/core.h``
for the ones every op shares, op ``"core"``); the extension reports the values it was compiled with,
and without the extension the header itself is read (it is installed with the package, and found in
the source tree otherwise). Its *formulas* (workspace sizes, block counts) are the header's C++
functions, called through the extension (``formulas(op)``): they have no Python copy.
"""
from __future__ import annotations

import functools
import os
import re

import jax

try:  # absent only when running from a source tree that was never built
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


def available() -> bool:
    """True when the extension was built (the package was installed, not run from a bare source tree)."""
    return _tk is not None


def has_cuda_kernels() -> bool:
    """True when jax_tk was built with its CUDA kernels."""
    return bool(kernel_archs())


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


# The device rule of cc/ffi/common.h's pick_kernels: sm_90a code runs at this compute capability only.
_SM90 = (9, 0)


def kernels_run_on(capability: tuple[int, int]) -> bool:
    """Whether the built kernels run on a GPU of this compute capability: 9.0 (H100, H200) takes the
    sm_90a build (the handlers launch the Hopper kernels there), 8.x an sm_8y build with y <= x (A100,
    A10, L4, ...). The binaries hold no PTX, so other GPUs (before sm_80, or Blackwell and later) have
    no kernel to run."""
    major, minor = capability
    archs = kernel_archs()
    if (major, minor) == _SM90:
        return "90a" in archs
    if major == 8:
        return any(len(a) == 2 and a[0] == "8" and int(a[1]) <= minor for a in archs)
    return False


def takes_sm90_kernels(capability: tuple[int, int] | None, variant: int) -> bool:
    """Whether a call with kernel ``variant`` (``dispatch.kernel_variant``) runs the sm_90a kernels on a
    GPU of this compute capability (False for None: no local GPU), as the handlers decide."""
    return variant == contract("core")["VARIANT_AUTO"] and capability == _SM90 and kernels_run_on(capability)


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


# One entry of a contract list: `X(NAME, <integer expression of literals: digits, spaces, | & + - * ( ) << >>>)`
# at the start of a line (anything after it, a comment and the line continuation, is ignored).
_ENTRY = re.compile(r"\s*X\(\s*([A-Z][A-Z0-9_]*)\s*,\s*([0-9|&+\-*()<> ]+)\)")
_LIST = re.compile(r"^\s*#define\s+JAX_TK_[A-Z0-9_]+_CONTRACT\(X\)((?:.*\\\n)*.*)$", re.MULTILINE)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SOURCE_CC = os.path.join(os.path.dirname(_PACKAGE), "cc")


def header_path(op: str) -> str:
    """The op's contract header: installed with the package (``jax_tk/_contract/<op>.h``), else in the
    source tree (``cc/<op>/<op>.h``)."""
    for path in (os.path.join(_PACKAGE, "_contract", f"{op}.h"), os.path.join(_SOURCE_CC, op, f"{op}.h")):
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"jax_tk: the contract header of op {op!r} is missing (looked for _contract/{op}.h "
                            f"in the package and cc/{op}/{op}.h in the source tree)")


def header_constants(op: str) -> dict[str, int]:
    """The entries of the op's contract list (``JAX_TK_<OP>_CONTRACT``), parsed from its header's text."""
    with open(header_path(op)) as f:
        lists = _LIST.findall(f.read())
    if len(lists) != 1:
        raise ValueError(f"jax_tk: {header_path(op)} must define one JAX_TK_<OP>_CONTRACT(X) list, found {len(lists)}")
    entries = [_ENTRY.match(line) for line in lists[0].splitlines()]
    # (the pattern admits only integer literals and operators, so eval sees no names)
    return {m[1]: int(eval(m[2], {"__builtins__": {}})) for m in entries if m}


@functools.lru_cache(maxsize=None)
def contract(op: str) -> dict[str, int]:
    """The op's contract constants: as compiled into the extension where it was built, else from the
    header. ``"core"`` holds those every op shares (the kernel variants, ``MAX_INDEX``)."""
    if _tk is not None:
        compiled = _tk.contract().get(op)
        if compiled is not None:
            return dict(compiled)
    return header_constants(op)


def formulas(op: str):
    """The op's formulas (the functions of ``JAX_TK_<OP>_FORMULAS`` in its header), e.g.
    ``formulas("decode").workspace_words(...)``. They come from the extension only: without it (a
    source tree that was never built) this raises, and ``dispatch.use_kernel`` keeps every op on its
    reference."""
    if _tk is None:
        raise RuntimeError(f"jax_tk: the {op} kernels' formulas come from the compiled extension jax_tk._tk, "
                           "which this copy of jax_tk lacks (run from a source tree that was never built): "
                           "install the package, e.g. `pip install -e .`")
    return getattr(_tk, op)


# The largest index, size or length the kernels take (their indices are int32).
MAX_INDEX = contract("core")["MAX_INDEX"]
# Thread blocks of one wave of whole-SM blocks: grids of few blocks are sized to fill it.
WAVE_BLOCKS = contract("core")["WAVE_BLOCKS"]
