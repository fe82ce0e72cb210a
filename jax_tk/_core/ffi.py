"""Building the FFI calls of the kernels, and what their batching rules (``custom_vmap``) share."""
from __future__ import annotations

import jax
import jax.numpy as jnp

TEST_SUFFIX = "_test"  # every op registers <target>_test beside <target> (cc/<op>/ffi.cc)
_TARGETS: list[str] = []


def target(name: str) -> str:
    """Declares one of an op's FFI targets (``TARGET = ffi.target("jax_tk_myop")`` in its launch
    module) and returns its name: :func:`export_checks` lists every declared target."""
    if name not in _TARGETS:
        _TARGETS.append(name)
    return name


def export_checks() -> list:
    """``disabled_checks`` for ``jax.export.export`` of a function that calls jax_tk's kernels: one
    ``jax.export.DisabledSafetyCheck.custom_call`` per kernel. (JAX refuses custom calls outside its
    own list unless told; the program that loads the export must import jax_tk, of the same version,
    so that the kernels are registered under these names with these operands.)"""
    return [jax.export.DisabledSafetyCheck.custom_call(name) for name in _TARGETS]


def kernel_call(target: str, out_types, operands, attributes: dict, *, out_init=None, vmap_method="sequential",
                aliases=None):
    """Calls the FFI ``target`` on ``operands`` with ``attributes`` (numpy scalars: their dtype is the
    attribute's type); returns its results (``out_types``: ShapeDtypeStructs, workspaces included).

    ``aliases``: ``{operand index: result index}`` of results written in place of operands.
    ``out_init`` (tests only): arrays that are aliased to the first outputs, in order, so that a test can
    poison them before the kernel runs. They travel as extra trailing operands of the op's
    test target, ``<target>_test``: the same handler plus trailing operands that it ignores (the
    production target's signature has none)."""
    aliases = dict(aliases or {})
    if out_init is not None:
        aliases.update({len(operands) + i: i for i in range(len(out_init))})
        operands = (*operands, *out_init)
        target = f"{target}{TEST_SUFFIX}"
    aliases = aliases or None
    call = jax.ffi.ffi_call(target, out_types, vmap_method=vmap_method, input_output_aliases=aliases)
    return call(*operands, **attributes)


def broadcast_mapped(x, batched: bool, size: int):
    """``x`` with the mapped axis in front: as it is when mapped, else broadcast to ``size`` entries."""
    return x if batched else jnp.broadcast_to(x, (size, *x.shape))


def map_entries(fn, in_batched, args):
    """``fn`` over the mapped axis, one launch per entry (for a batching rule where folding does not
    apply): ``lax.map`` over the mapped arguments, the others passed whole."""
    mapped = [a for a, b in zip(args, in_batched) if b]

    def one(xs):
        it = iter(xs)
        return fn(*(next(it) if b else a for a, b in zip(args, in_batched)))

    return jax.lax.map(one, mapped)
