"""Running an op on per-device shards under ``jit`` with sharded inputs, for any op.

XLA cannot see inside a custom call, so left alone it would replicate (all-gather) a kernel's operands
before running it. Most kernels are independent over some dimensions (batch entries, heads, groups),
so each device can run the kernel on its own shard. An op describes its arrays with a ``Layout`` (one
string of dimension labels per operand and result) and calls :func:`call` with its per-shard
function (usually the ``platform_dependent`` kernel/reference dispatch, so that the CPU path goes
through exactly the same partitioning as the GPU path).

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
   (custom_partitioning has no batching rule: under ``vmap`` the op becomes another partitioned op
   whose per-shard function is the vmapped one, so the kernels fold the mapped axis as on one device.)

Both 2 and 3 use one ``Plan`` (:func:`plan`), decided by the sharding of the leading operand
(operand 0): the ``batch`` label is split over the mesh axes that split that dimension there (when
divisible); the ``heads`` label over the axes that split its heads dimension (when divisible). A
``grouped`` label (heads shared by groups of ``heads``, e.g. grouped-query attention's key/value
heads) is split over the same axes when its size is divisible too; when instead each grouped head is
shared by several devices, those arrays stay replicated over the head axes, each device slices the
one grouped head it uses, and results with the grouped label are summed over the devices that share
it (an all-reduce: the inherent cost of that layout). Every other label must stay whole on a device
(sharded inputs are gathered there). Results get the sharding of the leading operand back where they
share its labels, so types are preserved.

Operands may be None (optional arrays, e.g. masks): they take no part in the partitioning and reach
the per-shard function as None.

For ops whose rows are split unevenly among their own groups (the grouped GEMM's rows, sorted by
group), ``Layout(batch_offset=True)`` gives the per-shard function the index of its first batch entry
(``batch_start=``, 0 when nothing is split), so that it can work out which part of each group it holds.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_tk._core import dispatch

__all__ = ["Layout", "Plan", "plan", "call", "set_auto_partitioning"]

_AUTO_PARTITIONING = True


def set_auto_partitioning(enabled: bool) -> None:
    """Enables (default) or disables custom_partitioning for auto-sharded (``AxisType.Auto``) inputs.

    Disabled, XLA replicates the kernels' operands for auto-sharded inputs (correct, but every device
    then computes everything); explicit sharding and ``shard_map`` are not affected. Read when a
    function is traced: it applies to functions jitted (traced) afterwards."""
    global _AUTO_PARTITIONING
    _AUTO_PARTITIONING = bool(enabled)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The dimension labels of an op's operands and results, e.g. ``("b t n d", "b s k d")``.

    batch: the label that may be split over any mesh axes; heads: the label split over the axes that
    split the heads of the leading operand (None: no head dimension); grouped: the label of heads
    shared by groups of ``heads`` (None: none). Every other label stays whole on each device.
    summed: the indices of the outputs that each device computes a part of, to be summed over the
    axes that split the batch or heads label when the output lacks that label (and, for heads, the
    grouped label): e.g. the gradient of an operand broadcast over batch or heads, whose size-1 dim has
    a label of its own, or of a pool of pages shared by the batch.
    batch_offset: the per-shard function takes ``batch_start=`` (the global index of its first batch
    entry along the leading operand's batch dimension)."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    batch: str = "b"
    heads: str | None = None
    grouped: str | None = None
    summed: tuple[int, ...] = ()
    batch_offset: bool = False

    def dim(self, labels: str, label) -> int | None:
        names = labels.split()
        return names.index(label) if label in names else None


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one call is split over a mesh.

    batch: mesh axes splitting the batch label. heads: mesh axes splitting the heads label.
    split_grouped: True: the grouped label is split over ``heads`` too. False (with ``heads``):
      arrays with the grouped label are replicated over ``heads``, and each device uses grouped head
      ``axis_index(heads) // group_share`` of ``grouped_size``.
    """

    batch: tuple[str, ...] = ()
    heads: tuple[str, ...] = ()
    split_grouped: bool = True
    group_share: int = 1
    grouped_size: int = 0

    def spec(self, layout: Layout, labels: str) -> P:
        entry = lambda axes: None if not axes else (axes[0] if len(axes) == 1 else axes)
        table = {layout.batch: entry(self.batch), layout.heads: entry(self.heads),
                 layout.grouped: entry(self.heads if self.split_grouped else ())}
        return P(*(table.get(label) for label in labels.split()))


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


def plan(layout: Layout, axis_sizes: Mapping[str, int], lead_spec: Sequence, shapes: Sequence[Sequence[int]],
         present: Sequence[int] | None = None) -> Plan:
    """The plan for a leading operand sharded as ``lead_spec`` over a mesh with ``axis_sizes``;
    ``shapes`` are the operands' shapes: of ``layout.inputs[i]`` for each ``i`` of ``present``
    (default: all of them, in order)."""
    labels = [layout.inputs[i] for i in present] if present is not None else list(layout.inputs)
    lead, lead_shape = layout.inputs[0], shapes[0]
    lead_spec = _spec_entries(lead_spec, len(lead_shape))
    size = lambda axes: math.prod(axis_sizes[a] for a in axes)
    b = layout.dim(lead, layout.batch)
    batch = () if b is None else tuple(a for a in _axes(lead_spec[b]) if a in axis_sizes)
    if batch and lead_shape[b] % size(batch):
        batch = ()
    h = layout.dim(lead, layout.heads) if layout.heads else None
    if h is None:
        return Plan(batch=batch)
    heads = tuple(a for a in _axes(lead_spec[h]) if a in axis_sizes and a not in batch)
    m = size(heads)
    if m == 1 or lead_shape[h] % m:
        return Plan(batch=batch)
    grouped = [s[layout.dim(l, layout.grouped)] for l, s in zip(labels, shapes)
               if layout.grouped and layout.dim(l, layout.grouped) is not None]
    if not grouped or grouped[0] % m == 0:
        return Plan(batch=batch, heads=heads)
    if m % grouped[0] == 0:
        return Plan(batch=batch, heads=heads, split_grouped=False, group_share=m // grouped[0],
                    grouped_size=grouped[0])
    return Plan(batch=batch)


# ----------------------------------------------------------------------------------------------
# The per-shard computation (shared by the shard_map and the custom_partitioning paths)
# ----------------------------------------------------------------------------------------------


def _local(layout: Layout, local_fn: Callable, static, p: Plan, present: tuple[int, ...], n_inputs: int, *args):
    """Runs ``local_fn(static, ...)`` on this device's shards (``args``: the operands that are not None, whose
    indices are ``present``), inside a manual-sharding context."""
    full = [None] * n_inputs
    for i, x in zip(present, args):
        full[i] = x
    sliced = bool(p.heads) and not p.split_grouped
    if sliced:  # arrays with the grouped label are replicated over the head axes: take our grouped head
        idx = jax.lax.axis_index(p.heads) // p.group_share
        for i in present:
            g = layout.dim(layout.inputs[i], layout.grouped)
            if g is not None:
                full[i] = jax.lax.dynamic_slice_in_dim(full[i], idx, 1, axis=g)
    kwargs = {}
    if layout.batch_offset:
        b = layout.dim(layout.inputs[0], layout.batch)
        kwargs["batch_start"] = jax.lax.axis_index(p.batch) * full[0].shape[b] if p.batch and b is not None else 0
    outs = tuple(local_fn(static, *full, **kwargs))
    if layout.summed:
        tracked = any(dispatch.vma(x) for x in args)
        outs = tuple(_sum_parts(layout, p, o, labels, tracked) if k in layout.summed else o
                     for k, (o, labels) in enumerate(zip(outs, layout.outputs)))
    if not sliced:
        return outs

    def place(o, labels):  # a result of our grouped head: put in place and summed over its sharers
        g = layout.dim(labels, layout.grouped)
        if g is None:
            return o
        whole = jnp.zeros(o.shape[:g] + (p.grouped_size,) + o.shape[g + 1:], o.dtype)
        return jax.lax.psum(jax.lax.dynamic_update_slice_in_dim(whole, o, idx, axis=g), p.heads)

    return tuple(place(o, labels) for o, labels in zip(outs, layout.outputs))


def _sum_parts(layout: Layout, p: Plan, o, labels: str, tracked: bool):
    """An output of ``Layout.summed``: summed over the axes that split a label it lacks. Where the
    manual axes' types are tracked (shard_map with check_vma) and autodiff inside ``local_fn`` already
    summed it (the transpose of the implicit broadcast of an operand invariant over an axis is a psum),
    the output is invariant over that axis: only the axes it still varies over are summed."""
    names = labels.split()
    # (an output with the grouped label is split over the head axes like the heads, or put together
    # over them by _local)
    split_by_heads = layout.heads in names or (layout.grouped is not None and layout.grouped in names)
    axes = (p.batch if layout.batch not in names else ()) + (p.heads if layout.heads and not split_by_heads else ())
    if tracked:
        axes = tuple(a for a in axes if a in dispatch.vma(o))
    return jax.lax.psum(o, axes) if axes else o


def _sharding_of(x):
    try:
        return jax.typeof(x).sharding
    except Exception:  # pragma: no cover - unusual tracers
        return None


def _axis_types(mesh) -> dict:
    """{axis name: AxisType} of the axes of ``mesh`` (empty for None)."""
    return dict(zip(getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ()) or ()))


def _mesh_axis_types(x) -> tuple[object, dict]:
    """The (abstract) mesh in the type of ``x`` and {axis name: AxisType} of its axes."""
    mesh = getattr(_sharding_of(x), "mesh", None)
    return (mesh, _axis_types(mesh)) if mesh is not None else (None, {})


def explicit(x) -> bool:
    """Whether ``x`` is typed as sharded over a mesh with an Explicit axis (where ``call`` runs its
    function in a shard_map of its own)."""
    return any(t == jax.sharding.AxisType.Explicit for t in _mesh_axis_types(x)[1].values())


def _same(spec_a, spec_b, ndim) -> bool:
    a, b = _spec_entries(spec_a, ndim), _spec_entries(spec_b, ndim)
    return all(_axes(x) == _axes(y) for x, y in zip(a, b))


def _reshard(x, mesh, spec):
    if _same(_sharding_of(x).spec, spec, x.ndim):
        return x
    return jax.sharding.reshard(x, NamedSharding(mesh, P(*_spec_entries(spec, x.ndim))))


def typed_like(cotangent, primal):
    """``cotangent`` with ``primal``'s sharding where that is explicit, a part of the type that a custom_vjp
    cotangent must share with its primal (e.g. the sinks' gradient, reduced from rows split over the heads,
    for sinks replicated over those axes)."""
    if not explicit(primal):
        return cotangent
    return _reshard(cotangent, _mesh_axis_types(primal)[0], jax.typeof(primal).sharding.spec)


def _caller_spec(layout: Layout, labels: str, lead_labels: str, lead_spec, own_spec):
    """The sharding a result is given back: the leading operand's entries for the labels it shares
    with it, else (the results of operands of their own, e.g. their gradients) ``own_spec``."""
    if own_spec is not None:
        return own_spec
    lead = dict(zip(lead_labels.split(), lead_spec))
    return P(*(lead.get(label) for label in labels.split()))


# ----------------------------------------------------------------------------------------------
# Path 2: explicit sharding -> shard_map
# ----------------------------------------------------------------------------------------------


def _explicit_call(layout, local_fn, static, mesh, explicit_axes, args, present, n_inputs, result_like):
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    caller_specs = {i: _spec_entries(_sharding_of(a).spec, a.ndim) for i, a in zip(present, args)}
    p = plan(layout, sizes, caller_specs[0], [a.shape for a in args], present)
    in_specs = tuple(p.spec(layout, layout.inputs[i]) for i in present)
    out_specs = tuple(p.spec(layout, labels) for labels in layout.outputs)
    args = [_reshard(a, mesh, s) for a, s in zip(args, in_specs)]
    outs = jax.shard_map(
        functools.partial(_local, layout, local_fn, static, p, present, n_inputs),
        mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=frozenset(explicit_axes), check_vma=True,
    )(*args)
    # Give the results the caller's layout back. For the usual layouts this is a no-op; where we
    # gathered (a whole label was sharded) it is a local slice.
    targets = [_caller_spec(layout, labels, layout.inputs[0], caller_specs[0],
                            caller_specs.get(result_like[k]) if result_like[k] is not None else None)
               for k, labels in enumerate(layout.outputs)]
    return tuple(_reshard(o, mesh, t) for o, t in zip(outs, targets))


# ----------------------------------------------------------------------------------------------
# Path 3: auto sharding -> custom_partitioning
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _auto_op(layout: Layout, local_fn: Callable, static, present: tuple[int, ...], n_inputs: int):
    from jax.experimental.custom_partitioning import custom_partitioning

    in_labels = tuple(layout.inputs[i] for i in present)

    def whole(*args):  # the op unpartitioned: used on one device and for abstract evaluation
        return _local(layout, local_fn, static, Plan(), present, n_inputs, *args)

    partitioned = custom_partitioning(whole)

    def plan_for(mesh, arg_shapes):
        lead = arg_shapes[0]
        if mesh.empty or not isinstance(lead.sharding, NamedSharding):
            return Plan()
        return plan(layout, dict(mesh.shape), lead.sharding.spec, [a.shape for a in arg_shapes], present)

    def shardings(mesh, p, labels):
        return tuple(NamedSharding(mesh, p.spec(layout, l)) for l in labels)

    def partition(mesh, arg_shapes, result_shape):
        p = plan_for(mesh, arg_shapes)
        lower = functools.partial(_local, layout, local_fn, static, p, present, n_inputs)
        return mesh, lower, shardings(mesh, p, layout.outputs), shardings(mesh, p, in_labels)

    def infer_sharding_from_operands(mesh, arg_shapes, result_shape):  # GSPMD only
        return shardings(mesh, plan_for(mesh, arg_shapes), layout.outputs)

    def sharding_rule(mesh, operand_types, result_types):  # Shardy
        from jax.interpreters.mlir import ir

        shapes = [ir.RankedTensorType(t).shape for t in operand_types]
        rename = {}
        if layout.grouped and layout.heads:  # grouped heads as many as heads: one factor
            lead_heads = shapes[0][layout.dim(in_labels[0], layout.heads)]
            for labels, shape in zip(in_labels, shapes):
                g = layout.dim(labels, layout.grouped)
                if g is not None and shape[g] == lead_heads:
                    rename[layout.grouped] = layout.heads
        name = lambda labels: " ".join(rename.get(l, l) for l in labels.split())
        rule = ", ".join(map(name, in_labels)) + " -> " + ", ".join(map(name, layout.outputs))
        # Whole labels per device; Shardy wants these factors listed in the order in which they first
        # appear in the rule.
        order = rule.replace(",", " ").replace("->", " ").split()
        split = {layout.batch, layout.heads, layout.grouped}
        need = tuple(sorted({l for l in order if l not in split}, key=order.index))
        return rule, {"need_replication_factors": need}

    partitioned.def_partition(partition=partition, infer_sharding_from_operands=infer_sharding_from_operands,
                              sharding_rule=sharding_rule)

    # custom_partitioning has no batching rule. Under vmap, the op becomes another partitioned op: its
    # mapped operands and its results get a leading dimension of their own (kept whole on each device),
    # and its per-shard function is the vmapped one, so that the kernels' own batching rules fold the
    # mapped axis (one launch per shard).
    @jax.custom_batching.custom_vmap
    def op_fn(*args):
        return partitioned(*args)

    @op_fn.def_vmap
    def _vmap_rule(axis_size, in_batched, *args):
        del axis_size
        mapped = [False] * n_inputs
        for i, b in zip(present, in_batched):
            mapped[i] = bool(b)
        label = f"vmapped{sum(l.startswith('vmapped') for l in layout.outputs[0].split())}"  # (one per nesting)
        add = lambda labels, m: f"{label} {labels}" if m else labels
        vlayout = dataclasses.replace(layout, inputs=tuple(map(add, layout.inputs, mapped)),
                                      outputs=tuple(add(l, True) for l in layout.outputs))
        outs = _auto_op(vlayout, _Vmapped(local_fn, tuple(mapped)), static, present, n_inputs)(*args)
        return tuple(outs), (True,) * len(outs)

    return op_fn


@dataclasses.dataclass(frozen=True)
class _Vmapped:
    """A per-shard function vmapped over the leading dimension of the operands marked ``mapped``
    (hashable by value: ``_auto_op`` caches on it)."""

    local_fn: Callable
    mapped: tuple[bool, ...]

    def __call__(self, static, *args, **kwargs):
        axes = tuple(0 if m and a is not None else None for m, a in zip(self.mapped, args))
        return jax.vmap(lambda *xs: tuple(self.local_fn(static, *xs, **kwargs)), in_axes=axes)(*args)


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------


def _multi_device() -> bool:
    try:
        return jax.device_count() > 1
    except RuntimeError:  # pragma: no cover
        return False


def _explicit_context() -> tuple[object, dict]:
    """The mesh of ``jax.set_mesh`` and {axis name: AxisType} of its axes, where some axis is Explicit;
    else (None, {})."""
    context = getattr(jax.sharding, "get_abstract_mesh", lambda: None)()
    types = _axis_types(context)
    if not any(t == jax.sharding.AxisType.Explicit for t in types.values()):
        return None, {}
    return context, types


def _context(lead) -> tuple[object, dict, list, list]:
    """The mesh a call with leading operand ``lead`` runs on, {axis: AxisType}, its Explicit and its
    Manual axes."""
    mesh, types = _mesh_axis_types(lead)
    if not types:
        # Not on a mesh (e.g. left on one device) inside jax.set_mesh of an explicit mesh: XLA replicates
        # such an operand over the mesh, and the op runs whole on each device, through the explicit path.
        # (custom_partitioning, the auto path, does not compile there.)
        mesh, types = _explicit_context()
    explicit = [a for a, t in types.items() if t == jax.sharding.AxisType.Explicit]
    manual = [a for a, t in types.items() if t == jax.sharding.AxisType.Manual]
    return mesh, types, explicit, manual


def runs_locally(lead) -> bool:
    """Whether :func:`call` with leading operand ``lead`` runs its function on the operands as they are
    (one device, or local shards inside ``shard_map``), rather than partitioning the call."""
    _, _, explicit, manual = _context(lead)
    return _is_local(explicit, manual)


def _is_local(explicit, manual) -> bool:  # (runs_locally, from the context's axes)
    return not explicit and (bool(manual) or not _AUTO_PARTITIONING or not _multi_device())


def call(layout: Layout, local_fn: Callable, static, *args, result_like: Sequence[int | None] | None = None):
    """``local_fn(static, *args)`` (a tuple of results, ``layout.outputs``) run on per-device shards.

    ``local_fn`` (a module-level function) and ``static`` (the call's static options) must be hashable:
    the auto-sharding path caches on them. ``result_like[k]``: the operand
    whose sharding result ``k`` is given back (e.g. a gradient's), None: from the leading operand."""
    if len(args) != len(layout.inputs) or len(layout.inputs[0].split()) != args[0].ndim:
        raise ValueError(f"jax_tk: {len(args)} operands for the layout {layout.inputs}")
    mesh, _, explicit, manual = _context(args[0])
    if _is_local(explicit, manual):  # local shards (shard_map, pmap), or nothing to partition
        return tuple(local_fn(static, *args, **({"batch_start": 0} if layout.batch_offset else {})))
    present = tuple(i for i, a in enumerate(args) if a is not None)
    given = tuple(args[i] for i in present)
    result_like = tuple(result_like) if result_like is not None else (None,) * len(layout.outputs)
    if explicit:
        return _explicit_call(layout, local_fn, static, mesh, explicit, given, present, len(args), result_like)
    return tuple(_auto_op(layout, local_fn, static, present, len(args))(*given))
