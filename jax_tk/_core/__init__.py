"""The op-agnostic core every jax_tk op is built on.

- ``extension``: loads the compiled extension, registers every FFI target, reads the ops' C++
  contracts (constants defined once, in ``cc/<op>/<op>.h``) and calls their formulas.
- ``ffi``: builds an ``ffi_call`` from operands and attributes (with the test-only output poisoning).
- ``dispatch``: the ``implementation=`` choice (kernel, reference, or a clear error), the kernel
  variant (``JAX_TK_KERNELS``) and the ``platform_dependent`` branch between them.
- ``checks``: trace-time checks of options several ops share (positive floats, windows).
- ``sharding``: runs an op on per-device shards under ``jit`` with sharded inputs (``shard_map`` for
  explicit meshes, ``custom_partitioning`` for auto ones), from the op's description of its operands.

docs/adding_an_op.md walks through a new op end to end.
"""
