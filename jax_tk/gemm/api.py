"""jax_tk.ragged_dot and jax_tk.matmul: the grouped (mixture-of-experts) GEMM and the dense GEMM.

Checks (trace time), the static spec of a call, the kernel/reference dispatch on the core, the
partitioning over rows, and the custom_vjp. The kernel's operands are in ``launch``; the float32
reference is ``reference``.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_tk._core import checks, dispatch, sharding
from jax_tk.gemm import launch, reference

FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class GemmSpec:
    """Static description of one grouped GEMM (hashable: a custom_vjp nondiff argument).

    out_dtype: the result's dtype name (the inputs' or float32). use_kernel: the CUDA kernel on CUDA
    devices (the reference elsewhere). dense: one group of all the rows (matmul), whose forward may
    split k where its output tiles are few (launch.split_k_parts)."""

    out_dtype: str
    use_kernel: bool
    dense: bool = False


# ----------------------------------------------------------------------------------------------
# Checks (trace time)
# ----------------------------------------------------------------------------------------------


def _out_dtype(op: str, dtype, preferred_element_type) -> str:
    if preferred_element_type is None:
        return jnp.dtype(dtype).name
    try:
        want = jnp.dtype(preferred_element_type)
    except TypeError:
        raise TypeError(f"jax_tk.{op}: preferred_element_type must be None, float32 or the inputs' dtype "
                        f"({jnp.dtype(dtype).name}), got {preferred_element_type!r}") from None
    if want not in (jnp.dtype(jnp.float32), jnp.dtype(dtype)):
        raise TypeError(f"jax_tk.{op}: preferred_element_type must be None, float32 or the inputs' dtype "
                        f"({jnp.dtype(dtype).name}), got {want.name}")
    return want.name


def group_sizes_int32(op: str, group_sizes, rows: int):
    """``group_sizes`` (any integer dtype, numpy or JAX, maybe traced) as int32 sizes that are >= 0
    and sum to at most ``rows``: negative sizes count as 0, and a group reaching past the last row is
    cut there (the rows it would own do not exist). Clipped before narrowing, so 64-bit sizes are
    never wrapped into int32."""
    if isinstance(group_sizes, np.ndarray):  # concrete: exactly, in 64 bits, on the host
        ends = np.minimum(np.cumsum(np.clip(group_sizes, 0, rows).astype(np.int64)), rows)
        return jnp.asarray(np.diff(ends, prepend=0).astype(np.int32))
    x = jnp.clip(checks.to_int32(group_sizes, 0, rows), 0, rows)
    # Cumulative sum that stops at `rows` (associative for sizes >= 0; a + b <= 2 * rows fits uint32).
    ends = jax.lax.associative_scan(lambda a, b: jnp.minimum(a + b, np.uint32(rows)), x.astype(jnp.uint32))
    ends = ends.astype(jnp.int32)
    return jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))


def _check_group_sizes(op: str, group_sizes, groups: int):
    if not hasattr(group_sizes, "shape") or not hasattr(group_sizes, "dtype"):
        raise TypeError(f"jax_tk.{op}: group_sizes must be an integer array, got {type(group_sizes).__name__}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"jax_tk.{op}: group_sizes must have an integer dtype (int32), got {group_sizes.dtype}")
    if group_sizes.ndim != 1:
        raise ValueError(f"jax_tk.{op}: group_sizes must have rank 1 [g], got shape {tuple(group_sizes.shape)}")
    if group_sizes.shape[0] != groups:
        raise ValueError(f"jax_tk.{op}: expected group_sizes to have shape ({groups},) (the groups of rhs "
                         f"[g, k, n]), got {tuple(group_sizes.shape)}")


def check_groups(op: str, group_sizes, group_offset, groups: int):
    """group_sizes ``[g]`` for rhs's ``g`` groups; with ``group_offset`` (an integer ``(1,)`` array,
    maybe traced), ``[G]`` for ``G >= g`` groups of which rhs holds g, from group ``group_offset[0]``."""
    if group_offset is None:
        _check_group_sizes(op, group_sizes, groups)
        return
    if not hasattr(group_offset, "shape") or not hasattr(group_offset, "dtype"):
        raise TypeError(f"jax_tk.{op}: group_offset must be an integer array of shape (1,), got "
                        f"{type(group_offset).__name__}")
    if not jnp.issubdtype(group_offset.dtype, jnp.integer) or tuple(group_offset.shape) != (1,):
        raise ValueError(f"jax_tk.{op}: group_offset must be an integer array of shape (1,), got "
                         f"{group_offset.dtype} {tuple(group_offset.shape)}")
    total = group_sizes.shape[0] if getattr(group_sizes, "ndim", None) == 1 else None
    if total is None or total < groups:
        raise ValueError(f"jax_tk.{op}: with group_offset, group_sizes must have shape (G,) with G >= the "
                         f"{groups} groups of rhs (rhs holds groups group_offset[0] .. + {groups} of the G), "
                         f"got {tuple(getattr(group_sizes, 'shape', ()))}")
    _check_group_sizes(op, group_sizes, total)


def offset_groups(sizes, group_offset, groups: int):
    """For ``group_offset``: ``(start, local)``, the first row of groups ``o .. o + groups - 1`` (``o =
    group_offset[0]``, clipped to ``[0, G]``) and their sizes (groups past G: empty). ``sizes``: the
    G groups' int32 sizes, >= 0 (group_sizes_int32)."""
    total = sizes.shape[0]
    o = jnp.clip(jnp.asarray(group_offset)[0].astype(jnp.int32), 0, total)
    start = jnp.sum(jnp.where(jnp.arange(total, dtype=jnp.int32) < o, sizes, 0), dtype=jnp.int32)
    local = jax.lax.dynamic_slice(jnp.concatenate([sizes, jnp.zeros((groups,), jnp.int32)]), (o,), (groups,))
    return start, local


def with_offset(product, lhs, sizes, group_offset, groups: int):
    """``product(lhs', local_sizes)`` for the groups rhs holds: lhs's rows rolled so that those groups'
    rows come first (every other row then lies past the local groups: 0 out, no gradient), the result
    rolled back. Without group_offset, ``product(lhs, sizes)``. ``lhs`` may be a pytree of arrays with
    lhs's rows (e.g. FP8 values and their scales). (The rolls are two passes over lhs and the result:
    the kernels take their groups from row 0.)"""
    if group_offset is None:
        return product(lhs, sizes)
    start, local = offset_groups(sizes, group_offset, groups)
    rolled = jax.tree.map(lambda x: jnp.roll(x, -start, axis=0), lhs)
    return jnp.roll(product(rolled, local), start, axis=0)


def _check_precision(op: str, precision):
    """``precision`` as jax.lax takes it (None, a ``lax.Precision`` or its name, a pair of them, a
    ``lax.DotAlgorithmPreset`` or its name, a ``lax.DotAlgorithm``). Accepted for compatibility only: every
    path multiplies exactly and accumulates in float32."""
    def one(p):
        if p is None or isinstance(p, jax.lax.Precision):
            return True
        if not isinstance(p, str):
            return False
        try:
            jax.lax.Precision(p)
            return True
        except ValueError:
            return p.upper() in jax.lax.DotAlgorithmPreset.__members__

    pair = isinstance(precision, (tuple, list)) and len(precision) == 2 and all(one(p) for p in precision)
    if not (one(precision) or pair or isinstance(precision, (jax.lax.DotAlgorithmPreset, jax.lax.DotAlgorithm))):
        raise ValueError(f"jax_tk.{op}: precision must be None, a jax.lax.Precision or its name, a pair of them, "
                         f"or a jax.lax.DotAlgorithmPreset or DotAlgorithm (as in jax.lax), got {precision!r}")


def check_ragged_dot(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset, implementation) -> str:
    """Validates a ragged_dot call; returns the output dtype's name."""
    op = "ragged_dot"
    checks.float_array(op, "lhs", lhs, 2, "[m, k]", FLOAT_DTYPES, empty_ok=(0, 1))
    checks.float_array(op, "rhs", rhs, 3, "[g, k, n]", FLOAT_DTYPES, empty_ok=(0, 1, 2))
    if lhs.dtype != rhs.dtype:
        raise TypeError(f"jax_tk.{op}: lhs and rhs must have the same dtype, got {lhs.dtype} and {rhs.dtype}")
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"jax_tk.{op}: the contracting dimension k of lhs [m, k] and rhs [g, k, n] must be "
                         f"equal, got lhs {tuple(lhs.shape)} and rhs {tuple(rhs.shape)}")
    check_groups(op, group_sizes, group_offset, rhs.shape[0])
    _check_precision(op, precision)
    dispatch.check_implementation(op, implementation)
    return _out_dtype(op, lhs.dtype, preferred_element_type)


def use_kernel(op: str, dtype, k: int, n: int, groups: int, rows: int, implementation) -> bool:
    return dispatch.use_kernel(op, implementation, launch.kernel_unsupported_reason(dtype, k, n, groups, rows))


# ----------------------------------------------------------------------------------------------
# The op on one device's shards, partitioned over rows
# ----------------------------------------------------------------------------------------------


def local_group_sizes(group_sizes, start, rows: int):
    """The sizes of the groups' parts within rows ``[start, start + rows)`` of the global rows (sizes
    >= 0 summing to at most the global rows): a shard of rows holds a consecutive part of each group,
    so these sizes describe its rows exactly. Inside ``shard_map`` with lhs's rows split over axis
    ``x``: ``local_group_sizes(global_sizes, jax.lax.axis_index("x") * rows, rows)``."""
    ends = jnp.cumsum(group_sizes, dtype=jnp.int32)
    starts = ends - group_sizes
    lo = jnp.asarray(start, jnp.int32)
    hi = lo + rows
    return jnp.clip(ends, lo, hi) - jnp.clip(starts, lo, hi)


def _fwd_kernel(spec: GemmSpec, lhs, rhs, sizes):
    (m, k), n = lhs.shape, rhs.shape[2]
    parts = launch.split_k_launch_parts(m, k, n) if spec.dense and rhs.shape[0] == 1 else 1
    if parts > 1:  # (every row is group 0's: the sizes say nothing more)
        return launch.split_k_dot(lhs, rhs[0], parts, out_dtype=spec.out_dtype)
    return launch.ragged_dot(lhs, rhs, sizes, out_dtype=spec.out_dtype)


def fwd_local(spec: GemmSpec, lhs, rhs, group_sizes, *, batch_start):
    sizes = local_group_sizes(group_sizes, batch_start, lhs.shape[0])
    out = dispatch.platform_dispatch(
        spec.use_kernel,
        functools.partial(_fwd_kernel, spec),
        lambda a, b, s: reference.ragged_dot(a, b, s, out_dtype=spec.out_dtype),
        lhs, rhs, sizes)
    return (out,)


def _bwd_kernel(spec: GemmSpec, lhs, rhs, sizes, dout):
    # A float32 cotangent (preferred_element_type=float32) is rounded to the inputs' dtype: the
    # kernel multiplies bf16/fp16 operands (accumulating in float32).
    d = dout.astype(lhs.dtype)
    (m, k), n = lhs.shape, rhs.shape[2]
    # d lhs = d @ rhs^T contracts n: split where its [m, k] output is few tiles, as the forward
    parts = launch.split_k_launch_parts(m, n, k) if spec.dense and rhs.shape[0] == 1 else 1
    if parts > 1 and launch.split_k_on_sm90():
        dlhs = launch.split_k_dot(d, rhs[0], parts, out_dtype=lhs.dtype, b_transposed=True)
    else:
        dlhs = launch.ragged_dot(d, rhs, sizes, out_dtype=lhs.dtype, b_transposed=True)
    drhs = launch.ragged_contracting(lhs, d, sizes, out_dtype=rhs.dtype)
    return dlhs, drhs


def _bwd_reference(spec: GemmSpec, lhs, rhs, sizes, dout):
    # Inside shard_map, the VJP of an array replicated over an axis would sum its cotangent over
    # that axis by itself; typed as varying like the rest, each input gets this shard's part, as the
    # kernel branch does (the two branches must have the same types), and bwd_local sums both alike.
    lhs, rhs = (dispatch.vary_as(x, lhs, rhs, sizes, dout) for x in (lhs, rhs))
    f = lambda a, b: reference.ragged_dot(a, b, sizes, out_dtype=spec.out_dtype)
    return jax.vjp(f, lhs, rhs)[1](dout)


def bwd_local(spec: GemmSpec, lhs, rhs, group_sizes, dout, *, batch_start):
    sizes = local_group_sizes(group_sizes, batch_start, lhs.shape[0])
    dlhs, drhs = dispatch.platform_dispatch(
        spec.use_kernel, functools.partial(_bwd_kernel, spec), functools.partial(_bwd_reference, spec), lhs, rhs, sizes,
        dout)
    # (rhs is usually replicated over the axes that split the rows: its gradient is summed over them)
    return dispatch.sum_as(dlhs, lhs), dispatch.sum_as(drhs, rhs)


# Rows "b" may be split over any mesh axes (each device then works out its part of every group from
# its first row); groups "g", k and n stay whole. The rhs gradient is a sum over the rows: each
# device's partial sum is added over the rows' mesh axes.
FWD_LAYOUT = sharding.Layout(inputs=("b k", "g k n", "g"), outputs=("b n",), batch_offset=True)
BWD_LAYOUT = sharding.Layout(inputs=("b k", "g k n", "g", "b n"), outputs=("b k", "g k n"), summed=(1,),
                             batch_offset=True)


def fwd(spec: GemmSpec, lhs, rhs, group_sizes):
    return sharding.call(FWD_LAYOUT, fwd_local, spec, lhs, rhs, group_sizes)[0]


def bwd(spec: GemmSpec, lhs, rhs, group_sizes, dout):
    return sharding.call(BWD_LAYOUT, bwd_local, spec, lhs, rhs, group_sizes, dout, result_like=(0, 1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def ragged_dot_vjp(lhs, rhs, group_sizes, spec: GemmSpec):
    return fwd(spec, lhs, rhs, group_sizes)


def _ragged_fwd(lhs, rhs, group_sizes, spec):
    return ragged_dot_vjp(lhs, rhs, group_sizes, spec), (lhs, rhs, group_sizes)


def _ragged_bwd(spec, residuals, dout):
    lhs, rhs, group_sizes = residuals
    dlhs, drhs = bwd(spec, lhs, rhs, group_sizes, dout)
    return dlhs, drhs, None


ragged_dot_vjp.defvjp(_ragged_fwd, _ragged_bwd)


# ----------------------------------------------------------------------------------------------
# The public functions
# ----------------------------------------------------------------------------------------------


def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None, *,
               implementation=None):
    """Grouped matrix product (mixture of experts): ``out[r] = lhs[r] @ rhs[i]`` for the rows r of group i.

    Same arguments and meaning as :func:`jax.lax.ragged_dot`, but for ``out_sharding`` (not taken: the
    result follows lhs's sharding, see below).

    Args:
      lhs: ``[m, k]``, bfloat16, float16 or float32; its rows sorted by group: group i owns rows
        ``[off_i, off_i + group_sizes[i])``, ``off`` the exclusive cumulative sum of the sizes.
      rhs: ``[g, k, n]``, lhs's dtype: one ``[k, n]`` matrix per group.
      group_sizes: ``[g]`` (with group_offset ``[G]``) integers of any integer dtype (traced values are
        fine). Sizes may be 0 and need not be multiples of anything; their sum may be less than m
        (rows past it give 0, whatever they hold, and add nothing to either gradient). A negative size
        counts as 0, and a group reaching past row m is cut there.
      precision: as in jax.lax (checked), accepted for compatibility: every path multiplies exactly and
        accumulates in float32 (float32 inputs: the reference at ``Precision.HIGHEST``).
      preferred_element_type: the result's dtype: None (lhs's dtype), float32, or lhs's dtype.
      group_offset: None, or an integer ``(1,)`` array (traced values are fine) for expert parallelism:
        group_sizes then has the G groups of every expert, and rhs ``[g, k, n]`` the g experts from
        ``group_offset[0]`` on (clipped to ``[0, G]``; experts past G have no rows). Rows of other
        groups give 0 and have zero gradient.
      implementation: ``None`` (the CUDA kernel where it applies: bfloat16/float16, k and n multiples of
        8; the float32 reference otherwise), ``"tk"`` (the kernel, or an error),
        ``"xla"`` (the reference).

    Differentiable in lhs and rhs (the gradients are grouped GEMMs too: lhs's with rhs transposed,
    rhs's a per-group ``lhs_i^T dout_i``). With ``preferred_element_type=float32`` and bf16/fp16
    inputs, the kernel path rounds the cotangent to the inputs' dtype. Works under ``jit``,
    ``grad``, ``vmap`` (one launch: a mapped rhs's entries become more groups; with one rhs for every
    entry, the entries' rows are sorted by group; in a process with several devices, outside
    ``shard_map`` and explicit meshes, vmap is a loop around the partitioned op, as for every jax_tk
    op) and ``shard_map``; under ``jit`` with lhs's rows sharded, each device computes its rows' part
    of every group without gathering lhs.

    Returns:
      ``[m, n]`` in ``preferred_element_type`` (default lhs's dtype).
    """
    out_dtype = check_ragged_dot(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset,
                                 implementation)
    m, k = lhs.shape
    g, _, n = rhs.shape
    if 0 in (m, k, g, n):
        return dispatch.zeros((m, n), out_dtype, lhs, rhs)  # nothing to multiply
    sizes = group_sizes_int32("ragged_dot", group_sizes, m)
    spec = GemmSpec(out_dtype, use_kernel("ragged_dot", lhs.dtype, k, n, g, m, implementation))
    return with_offset(lambda x, s: ragged_dot_vjp(x, rhs, s, spec), lhs, sizes, group_offset, g)


def matmul(a, b, *, precision=None, preferred_element_type=None, implementation=None):
    """Dense matrix product on the grouped GEMM kernel: ``a @ b``.

    Args:
      a: ``[..., m, k]``, bfloat16, float16 or float32.
      b: ``[k, n]`` (shared by every matrix of a), or ``[..., k, n]`` with the same leading dims as a
        (one product per leading index; no broadcasting). Same dtype as a.
      precision: as for :func:`ragged_dot` (checked, for compatibility).
      preferred_element_type: None (the inputs' dtype), float32, or the inputs' dtype.
      implementation: as for :func:`ragged_dot` (``"xla"``: the float32 reference).

    One launch either way: a's rows are one group (2-D b), or each leading index is a group of m rows.
    Where a's rows are too few for the kernel's output tiles to fill the GPU (e.g. 128 rows against a
    large 2-D b), the forward splits k instead: one launch of the contracting kernel on ``a^T``, one
    group per range of k, and XLA's sum of the float32 partial products.
    Differentiable; works under ``jit``, ``vmap`` and sharded ``jit`` (rows of a split) like
    :func:`ragged_dot`.

    Returns:
      ``[..., m, n]`` in ``preferred_element_type`` (default the inputs' dtype).
    """
    op = "matmul"
    for name, x in (("a", a), ("b", b)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"jax_tk.{op}: {name} must be an array, got {type(x).__name__}")
        if x.ndim < 2:
            raise ValueError(f"jax_tk.{op}: {name} must have rank >= 2, got shape {tuple(x.shape)}")
        checks.float_array(op, name, x, x.ndim, "", FLOAT_DTYPES, empty_ok=range(x.ndim))
    if a.dtype != b.dtype:
        raise TypeError(f"jax_tk.{op}: a and b must have the same dtype, got {a.dtype} and {b.dtype}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"jax_tk.{op}: a [..., m, k] and b [..., k, n] must have the same k, got a "
                         f"{tuple(a.shape)} and b {tuple(b.shape)}")
    if b.ndim > 2 and b.shape[:-2] != a.shape[:-2]:
        raise ValueError(f"jax_tk.{op}: b [..., k, n] must be 2-D or have a's leading dims {tuple(a.shape[:-2])}, "
                         f"got b {tuple(b.shape)}")
    _check_precision(op, precision)
    dispatch.check_implementation(op, implementation)
    out_dtype = _out_dtype(op, a.dtype, preferred_element_type)
    lead, (m, k), n = a.shape[:-2], a.shape[-2:], b.shape[-1]
    rows = math.prod(lead) * m
    if 0 in (rows, k, n):
        return dispatch.zeros((*lead, m, n), out_dtype, a, b)
    rhs = b[None] if b.ndim == 2 else b.reshape(-1, k, n)
    g = rhs.shape[0]
    if rows > launch.MAX_ROWS:
        raise ValueError(f"jax_tk.{op}: {rows} rows of a do not fit int32 indices")
    sizes = jnp.asarray(np.full((g,), rows // g, np.int32))
    spec = GemmSpec(out_dtype, use_kernel(op, a.dtype, k, n, g, rows, implementation), dense=True)
    out = ragged_dot_vjp(a.reshape(rows, k), rhs, sizes, spec)
    return out.reshape(*lead, m, n)
