"""Partitioning of jax_tk's ops under ``jit`` with sharded inputs (see ``jax_tk._core.sharding``).

``set_auto_partitioning(False)`` turns off the custom_partitioning path for auto-sharded inputs;
``plan_attention`` says how an attention call with a query sharded as ``q_spec`` is split.
"""
from jax_tk._core.sharding import Plan, set_auto_partitioning
from jax_tk.attention.api import FWD_LAYOUT as _ATTENTION


def plan_attention(axis_sizes, q_spec, q_shape, kv_shape) -> Plan:
    """The plan for an attention call whose query ``[B, T, N, D]`` is sharded as ``q_spec`` over a mesh
    with ``axis_sizes``: ``batch`` and ``heads`` are the mesh axes that split B and N; with fewer
    key/value heads than head shards, ``split_grouped`` is False and each key/value head is shared by
    ``group_share`` consecutive head shards."""
    from jax_tk._core.sharding import plan

    return plan(_ATTENTION, axis_sizes, q_spec, [q_shape, kv_shape])


__all__ = ["Plan", "plan_attention", "set_auto_partitioning"]
