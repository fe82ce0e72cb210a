"""Building the FFI calls of the kernels."""
from __future__ import annotations

import jax

TEST_SUFFIX = "_test"  # every op registers <target>_test beside <target> (cc/<op>/ffi.cc)


def kernel_call(target: str, out_types, operands, attributes: dict, *, out_init=None, vmap_method="sequential"):
    """Calls the FFI ``target`` on ``operands`` with ``attributes`` (numpy scalars: their dtype is the
    attribute's type); returns its results (``out_types``: ShapeDtypeStructs, workspaces included).

    ``out_init`` (tests only): arrays that are aliased to the outputs, in order, so that a test can
    poison every output before the kernel runs. They travel as extra trailing operands of the op's
    test target, ``<target>_test``: the same handler plus trailing operands that it ignores (the
    production target's signature has none)."""
    aliases = None
    if out_init is not None:
        aliases = {len(operands) + i: i for i in range(len(out_init))}
        operands = (*operands, *out_init)
        target = f"{target}{TEST_SUFFIX}"
    call = jax.ffi.ffi_call(target, out_types, vmap_method=vmap_method, input_output_aliases=aliases)
    return call(*operands, **attributes)
