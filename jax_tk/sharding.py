"""Partitioning of jax_tk's attention over batch and heads.

XLA cannot see inside a custom call, so left alone it would replicate (all-gather) the operands of
the attention kernel before running it. Attention is independent per (batch, head), so each device
can run the kernel on its own shard; this module makes that happen. It wraps the whole
``platform_dependent(cuda=kernel, default=reference)`` dispatch, forward and backward, so that the
CPU path (used by the tests) goes through exactly the same partitioning as the GPU path.

How the shards are found, in order:

1. Inside ``shard_map``/``pmap`` (manual mesh axes), or on a single device: the op runs on what it
   is given (the local shards); nothing to do.
2. **Explicit sharding** (``jax.sharding.AxisType.Explicit``, the default of ``jax.make_mesh``): the
   sharding of the inputs is part of their type, known at trace time, so the op is wrapped in a
   ``jax.shard_map`` over the mesh of the inputs. This lowers to plain StableHLO (no Python
   callbacks), so the persistent compilation cache works as for any other program.
3. **Auto sharding** (``AxisType.Auto``, e.g. ``jax.sharding.Mesh(devices, names)``) on more than one
   device: the sharding is only decided inside XLA, so the op is wrapped in
   ``jax.experimental.custom_partitioning`` with a Shardy sharding rule; XLA asks us, while
   partitioning, how to split it. Caveat (JAX's, not ours): custom_partitioning puts a per-process
   pointer into the program, so such programs miss the *persistent* compilation cache across
   processes (the in-process cache is unaffected). Use explicit sharding, or call the op inside
   ``shard_map``, to get persistent-cache hits. ``set_auto_partitioning(False)`` turns this path off.
   (custom_partitioning has no batching rule: under ``vmap`` the op loops over the mapped axis with
   ``lax.map``, like the kernel's own ``vmap_method="sequential"``, each step still partitioned.)

Both 2 and 3 use one plan (``plan_attention``): batch is split over the mesh axes that split the
query's batch dimension; heads over the axes that split the query's head dimension, when the
query-head count is divisible by them. Key/value heads (grouped-query attention) are split over the
same axes when their count is divisible too; when instead each key/value head is shared by several
devices (kv_heads < shards), key/value stay replicated over those axes and each device slices the one
head its query heads use (the backward then sums dK/dV over those devices: an all-reduce, the
inherent cost of that layout). Sequence or head_dim sharding is gathered (the kernel needs whole
rows); use ``jax_tk.ring_attention`` for context parallelism. Outputs get the sharding of the
inputs back (out like the query, dK/dV like key/value), so types are preserved.

The optional masking arrays (``masks``: segment ids ``[B, T]``/``[B, S]``, sequence lengths ``[B]``)
are split over batch like the query and replicated over heads; only the ones given take part.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

__all__ = ["AttentionPlan", "plan_attention", "set_auto_partitioning", "fwd", "bwd", "vary_like"]

_AUTO_PARTITIONING = True


def set_auto_partitioning(enabled: bool) -> None:
    """Enables (default) or disables custom_partitioning for auto-sharded (``AxisType.Auto``) inputs.

    Disabled, XLA replicates the kernel's operands for auto-sharded inputs (correct, but every device
    then computes everything); explicit sharding and ``shard_map`` are not affected. Read when a
    function is traced: it applies to functions jitted (traced) afterwards."""
    global _AUTO_PARTITIONING
    _AUTO_PARTITIONING = bool(enabled)


# ----------------------------------------------------------------------------------------------
# The plan: which mesh axes split batch and heads
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """How one attention call is split over a mesh.

    batch: mesh axes splitting the batch dimension (of every operand).
    heads: mesh axes splitting the query heads (and out, lse, dq).
    kv_split: True: key/value heads are split over ``heads`` too. False (and ``heads`` non-empty):
      key/value are replicated over ``heads`` and each device uses key/value head
      ``axis_index(heads) // kv_share``.
    kv_share: number of consecutive head shards that use one key/value head (when not kv_split).
    kv_heads: the global number of key/value heads (used when not kv_split).
    """

    batch: tuple[str, ...] = ()
    heads: tuple[str, ...] = ()
    kv_split: bool = True
    kv_share: int = 1
    kv_heads: int = 0

    def _entry(self, axes):
        if not axes:
            return None
        return axes[0] if len(axes) == 1 else axes

    @property
    def q_spec(self) -> P:  # query, out, dout, dq: [B, T, N, D]
        return P(self._entry(self.batch), None, self._entry(self.heads), None)

    @property
    def kv_spec(self) -> P:  # key, value, dk, dv: [B, S, K, D]
        heads = self.heads if self.kv_split else ()
        return P(self._entry(self.batch), None, self._entry(heads), None)

    @property
    def lse_spec(self) -> P:  # lse, dlse: [B, N, T]
        return P(self._entry(self.batch), self._entry(self.heads), None)


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    try:
        return tuple(a for a in entry if isinstance(a, str))
    except TypeError:  # P.UNCONSTRAINED and the like
        return ()


def _spec_entries(spec, ndim) -> tuple:
    entries = tuple(spec) if spec is not None else ()
    return entries + (None,) * (ndim - len(entries))


def plan_attention(
    axis_sizes: Mapping[str, int],
    q_spec: Sequence,
    q_shape: Sequence[int],
    kv_shape: Sequence[int],
) -> AttentionPlan:
    """The plan for a query sharded as ``q_spec`` over a mesh with ``axis_sizes``.

    Only the query's sharding decides (key/value are resharded to follow it: for the usual
    layouts, where key/value are split like the query or replicated, that is free)."""
    q_spec = _spec_entries(q_spec, 4)
    size = lambda axes: math.prod(axis_sizes[a] for a in axes)
    batch = tuple(a for a in _axes(q_spec[0]) if a in axis_sizes)
    if q_shape[0] % size(batch):
        batch = ()
    heads = tuple(a for a in _axes(q_spec[2]) if a in axis_sizes and a not in batch)
    m = size(heads)
    n, kh = q_shape[2], kv_shape[2]
    if m == 1 or n % m:
        return AttentionPlan(batch=batch)
    if kh % m == 0:
        return AttentionPlan(batch=batch, heads=heads, kv_split=True)
    if m % kh == 0:
        return AttentionPlan(batch=batch, heads=heads, kv_split=False, kv_share=m // kh, kv_heads=kh)
    return AttentionPlan(batch=batch)


# ----------------------------------------------------------------------------------------------
# The per-shard computation (shared by the shard_map and the custom_partitioning paths)
# ----------------------------------------------------------------------------------------------

# Operand/result kinds of the two ops, in order: "q" [B,T,N,D], "kv" [B,S,K,D], "lse" [B,N,T].
_KINDS = {
    "fwd": (("q", "kv", "kv"), ("q", "lse")),
    "bwd": (("q", "kv", "kv", "q", "lse", "q", "lse"), ("q", "kv", "kv")),
}
# Kinds of the masking arrays (the fields of jax_tk.attention.Masks, in order): "q_ids" [B,T],
# "kv_ids" [B,S], "rows" [B]. They follow the operands above, the absent ones left out.
_MASK_KINDS = ("q_ids", "kv_ids", "rows", "rows")


def _specs(plan: AttentionPlan, kinds) -> tuple[P, ...]:
    batch = plan._entry(plan.batch)
    table = {"q": plan.q_spec, "kv": plan.kv_spec, "lse": plan.lse_spec,
             "q_ids": P(batch, None), "kv_ids": P(batch, None), "rows": P(batch)}
    return tuple(table[k] for k in kinds)


def _present(masks) -> tuple[int, ...]:
    """Indices of the masking arrays that are given (a static tuple: part of the traced program)."""
    return () if masks is None else tuple(i for i, x in enumerate(masks) if x is not None)


@functools.lru_cache(maxsize=None)  # one function per configuration: _auto_op caches on it
def _with_masks(local_fn: Callable, n_args: int, present: tuple[int, ...], masks_type) -> Callable:
    """``local_fn`` taking its masking arrays flat after its ``n_args`` operands (as sharding passes
    them) instead of as one ``masks`` tuple."""
    if not present:
        return local_fn

    def flat(spec, *args):
        fields = [None] * len(_MASK_KINDS)
        for i, x in zip(present, args[n_args:]):
            fields[i] = x
        return local_fn(spec, *args[:n_args], masks=masks_type(*fields))

    return flat


def _local(op: str, local_fn: Callable, spec, plan: AttentionPlan, *args):
    """Runs ``local_fn(spec, *args)`` on this device's shards, inside a manual-sharding context."""
    if not plan.heads or plan.kv_split:
        return tuple(local_fn(spec, *args))
    # Key/value are replicated over the head axes: use the one kv head our query heads attend with.
    idx = jax.lax.axis_index(plan.heads) // plan.kv_share
    args = list(args)
    for i in (1, 2):
        args[i] = jax.lax.dynamic_slice_in_dim(args[i], idx, 1, axis=2)
    outs = tuple(local_fn(spec, *args))
    if op == "bwd":
        # dK/dV of that head, put in place and summed over the devices that share it.
        def place(d):
            full = jnp.zeros(d.shape[:2] + (plan.kv_heads,) + d.shape[3:], d.dtype)
            return jax.lax.psum(jax.lax.dynamic_update_slice_in_dim(full, d, idx, axis=2), plan.heads)

        dq, dk, dv = outs
        outs = (dq, place(dk), place(dv))
    return outs


def _vma(x) -> frozenset:
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
    vma = frozenset().union(*(_vma(a) for a in jax.tree.leaves(args)))
    if not vma:
        return outs
    fix = lambda o: _pcast_varying(o, tuple(sorted(vma - _vma(o)))) if vma - _vma(o) else o
    return type(outs)(fix(o) for o in outs) if isinstance(outs, (tuple, list)) else fix(outs)


# ----------------------------------------------------------------------------------------------
# Path 2: explicit sharding -> shard_map
# ----------------------------------------------------------------------------------------------


def _sharding_of(x):
    try:
        return jax.typeof(x).sharding
    except Exception:  # pragma: no cover - unusual tracers
        return None


def _mesh_axis_types(x) -> tuple[object, dict]:
    """The (abstract) mesh in the type of ``x`` and {axis name: AxisType} of its axes."""
    sharding = _sharding_of(x)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None:
        return None, {}
    names = tuple(getattr(mesh, "axis_names", ()))
    types = tuple(getattr(mesh, "axis_types", ()) or ())
    return mesh, dict(zip(names, types))


def _same(spec_a, spec_b, ndim) -> bool:
    a, b = _spec_entries(spec_a, ndim), _spec_entries(spec_b, ndim)
    return all(_axes(x) == _axes(y) for x, y in zip(a, b))


def _reshard(x, mesh, spec):
    if _same(_sharding_of(x).spec, spec, x.ndim):
        return x
    return jax.sharding.reshard(x, NamedSharding(mesh, P(*_spec_entries(spec, x.ndim))))


def _explicit_call(op, local_fn, spec, mesh, explicit_axes, args, in_kinds):
    out_kinds = _KINDS[op][1]
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    caller_specs = [_spec_entries(_sharding_of(a).spec, a.ndim) for a in args]
    q_spec = caller_specs[0]
    plan = plan_attention(sizes, q_spec, args[0].shape, args[1].shape)
    in_specs, out_specs = _specs(plan, in_kinds), _specs(plan, out_kinds)
    args = [_reshard(a, mesh, s) for a, s in zip(args, in_specs)]
    outs = jax.shard_map(
        functools.partial(_local, op, local_fn, spec, plan),
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=frozenset(explicit_axes),
        check_vma=True,
    )(*args)
    # Give the results the caller's layout back: out/dq like the query, lse like the query's
    # (B, N, T), dk/dv like key/value. For the usual layouts this is a no-op; where we gathered
    # (sequence or head_dim sharding) it is a local slice.
    if op == "fwd":
        targets = (q_spec, (q_spec[0], q_spec[2], q_spec[1]))
    else:
        targets = tuple(caller_specs[:3])
    return tuple(_reshard(o, mesh, t) for o, t in zip(outs, targets))


# ----------------------------------------------------------------------------------------------
# Path 3: auto sharding -> custom_partitioning
# ----------------------------------------------------------------------------------------------


def _dims_rule(in_kinds, out_kinds, same_heads: bool):
    dims = {"q": "b t n d", "kv": "b s n d" if same_heads else "b s k d", "lse": "b n t",
            "q_ids": "b t", "kv_ids": "b s", "rows": "b"}
    return ", ".join(dims[k] for k in in_kinds) + " -> " + ", ".join(dims[k] for k in out_kinds)


@functools.lru_cache(maxsize=None)
def _auto_op(op: str, local_fn: Callable, spec, in_kinds: tuple[str, ...]):
    from jax.experimental.custom_partitioning import custom_partitioning

    out_kinds = _KINDS[op][1]

    def whole(*args):  # the op unpartitioned: used on one device and for abstract evaluation
        return tuple(local_fn(spec, *args))

    partitioned = custom_partitioning(whole)

    def plan_for(mesh, arg_shapes):
        q = arg_shapes[0]
        if mesh.empty or not isinstance(q.sharding, NamedSharding):
            return AttentionPlan()
        return plan_attention(dict(mesh.shape), q.sharding.spec, q.shape, arg_shapes[1].shape)

    def shardings(mesh, plan, kinds):
        return tuple(NamedSharding(mesh, s) for s in _specs(plan, kinds))

    def partition(mesh, arg_shapes, result_shape):
        plan = plan_for(mesh, arg_shapes)
        lower = functools.partial(_local, op, local_fn, spec, plan)
        return mesh, lower, shardings(mesh, plan, out_kinds), shardings(mesh, plan, in_kinds)

    def infer_sharding_from_operands(mesh, arg_shapes, result_shape):  # GSPMD only
        return shardings(mesh, plan_for(mesh, arg_shapes), out_kinds)

    def sharding_rule(mesh, operand_types, result_types):  # Shardy
        from jax.interpreters.mlir import ir

        n = ir.RankedTensorType(operand_types[0]).shape[2]
        kh = ir.RankedTensorType(operand_types[1]).shape[2]
        rule = _dims_rule(in_kinds, out_kinds, same_heads=(n == kh))
        # Whole rows (t), keys (s) and head_dim (d) per device; Shardy wants these factors listed in
        # the order in which they first appear in the rule.
        order = rule.replace(",", " ").replace("->", " ").split()
        need = tuple(sorted(("t", "s", "d"), key=order.index))
        return rule, {"need_replication_factors": need}

    partitioned.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer_sharding_from_operands,
        sharding_rule=sharding_rule,
    )

    # custom_partitioning has no batching rule. Under vmap, loop over the mapped axis (lax.map), as
    # the kernel's own ffi_call does (vmap_method="sequential"), each step still partitioned.
    @jax.custom_batching.custom_vmap
    def op_fn(*args):
        return partitioned(*args)

    @op_fn.def_vmap
    def _vmap_rule(axis_size, in_batched, *args):
        del axis_size

        def one(mapped):
            it = iter(mapped)
            return op_fn(*(next(it) if b else a for a, b in zip(args, in_batched)))

        outs = jax.lax.map(one, [a for a, b in zip(args, in_batched) if b])
        return tuple(outs), (True,) * len(outs)

    return op_fn


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------


def _multi_device() -> bool:
    try:
        return jax.device_count() > 1
    except RuntimeError:  # pragma: no cover
        return False


def _call(op: str, local_fn: Callable, spec, args, masks=None):
    mesh, types = _mesh_axis_types(args[0])
    explicit = [a for a, t in types.items() if t == jax.sharding.AxisType.Explicit]
    manual = [a for a, t in types.items() if t == jax.sharding.AxisType.Manual]
    if not explicit and (manual or not _AUTO_PARTITIONING or not _multi_device()):
        # Local shards (shard_map, pmap), or nothing to partition.
        return tuple(local_fn(spec, *args) if masks is None else local_fn(spec, *args, masks=masks))
    # Partitioned: the masking arrays given travel flat after the operands.
    present = _present(masks)
    in_kinds = _KINDS[op][0] + tuple(_MASK_KINDS[i] for i in present)
    local_fn = _with_masks(local_fn, len(args), present, type(masks))
    args = (*args, *(masks[i] for i in present))
    if explicit:
        return _explicit_call(op, local_fn, spec, mesh, explicit, args, in_kinds)
    return tuple(_auto_op(op, local_fn, spec, in_kinds)(*args))


def fwd(local_fn: Callable, spec, query, key, value, masks=None):
    """Partitioned ``local_fn(spec, query, key, value[, masks=masks]) -> (out [B,T,N,D], lse [B,N,T])``.

    ``masks``: None, or a tuple of optional arrays (``jax_tk.attention.Masks``), split over batch."""
    return _call("fwd", local_fn, spec, (query, key, value), masks)


def bwd(local_fn: Callable, spec, query, key, value, out, lse, dout, dlse, masks=None):
    """Partitioned ``local_fn(spec, q, k, v, out, lse, dout, dlse[, masks=masks]) -> (dq, dk, dv)``."""
    return _call("bwd", local_fn, spec, (query, key, value, out, lse, dout, dlse), masks)
