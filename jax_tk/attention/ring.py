"""Ring attention: attention over a sequence that is sharded across devices (context parallelism).

Use inside ``jax.shard_map`` with the sequence dimension of query, key and value split over the mesh
axis ``axis_name`` (``n`` devices). Each device keeps its query block; the key/value blocks travel
around the ring with ``jax.lax.ppermute`` (one hop per step, ``n - 1`` steps) while the local
attention of the block at hand runs (the kernel on GPU; XLA can overlap the transfer with it since
neither depends on the other). The partial results merge exactly through their log-sum-exps:

    lse = logaddexp(lse_a, lse_b),   out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b.

The backward (a ``jax.custom_vjp``) rotates key/value again, together with their gradient
accumulators: each block's backward runs the attention backward kernel with the *final* output and
log-sum-exp, which makes it exact — with ``P = exp(scale * q k^T - lse)`` the global probabilities,
``delta = rowsum(dout * out) - dlse`` (of the final out), ``dS = P * (dP - delta)`` restricted to the
block is the block's share of the gradient. dQ accumulates locally; dK/dV accumulate while they travel
and arrive back at their owner after ``n`` hops.

Causal masking ("top-left" positions: query i sees keys j <= i of the global sequence):

* ``layout="contiguous"``: device ``i`` holds the i-th contiguous block of the global sequence. Blocks
  from later devices are entirely in the future and are skipped (``lax.cond``), the own block is
  causal, earlier blocks are full. Simple, but device ``i`` does ``i + 1`` blocks of work: the last
  device bounds the step time.
* ``layout="zigzag"``: the global sequence is cut into ``2n`` chunks and device ``i`` holds chunks
  ``i`` and ``2n-1-i`` (reorder with :func:`zigzag` before sharding, :func:`unzigzag` after). Every
  (query chunk, key chunk) pair is then fully visible, fully hidden, or the causal diagonal, and each
  step does the same work on every device: the own block is causal (local order is global order),
  a block from an earlier device is seen fully by all local queries through its first chunk only,
  and a block from a later device is seen fully by the local second chunk only.

Without ``is_causal`` the layout does not matter (every block is full).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np

from jax_tk._core import checks, dispatch, sharding, sinks as sinks_
from jax_tk.attention import api, compat, launch
from jax_tk.attention.api import AttentionSpec

__all__ = ["ring_attention", "ring_attention_with_lse", "zigzag", "unzigzag", "zigzag_indices"]

LAYOUTS = ("contiguous", "zigzag")


# ----------------------------------------------------------------------------------------------
# Zig-zag reordering of a global sequence
# ----------------------------------------------------------------------------------------------


def _chunk(seq_len: int, axis_size: int) -> int:
    if not checks.is_int(axis_size) or axis_size < 1:
        raise ValueError(f"jax_tk.zigzag: axis_size must be an int >= 1, got {axis_size!r}")
    if seq_len % (2 * axis_size):
        raise ValueError(
            f"jax_tk.zigzag: the sequence length ({seq_len}) must be a multiple of "
            f"2 * axis_size ({2 * axis_size})"
        )
    return seq_len // (2 * axis_size)


def zigzag_indices(seq_len: int, axis_size: int) -> np.ndarray:
    """Global positions in zig-zag order: device ``i`` of ``axis_size`` gets chunks ``i`` and
    ``2*axis_size-1-i`` of ``2*axis_size`` equal chunks. ``x[zigzag_indices(...)]`` == ``zigzag(x)``.
    Useful for position ids (e.g. rotary embeddings) of a zig-zag ordered sequence."""
    n2 = 2 * axis_size
    chunk = _chunk(seq_len, axis_size)
    order = [j for i in range(axis_size) for j in (i, n2 - 1 - i)]
    return np.concatenate([np.arange(j * chunk, (j + 1) * chunk) for j in order])


def _axis(x, axis) -> int:
    if not checks.is_int(axis) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"jax_tk.zigzag: axis {axis!r} is out of range for an array of rank {x.ndim}")
    return int(axis) % x.ndim


def _split_axis(x, axis, shape):
    return x.reshape(x.shape[:axis] + shape + x.shape[axis + 1 :])


def zigzag(x, axis_size: int, axis: int = 1):
    """Reorders the global sequence axis of ``x`` so that, once split into ``axis_size`` contiguous
    shards, shard ``i`` holds chunks ``i`` and ``2*axis_size-1-i`` (load-balanced causal ring
    attention). Apply to every per-position input (tokens, positions, labels) before sharding.

    Equal to ``jnp.take(x, zigzag_indices(x.shape[axis], axis_size), axis)``, written with
    reshapes, a reversal and a stack, which the partitioner handles well."""
    axis = _axis(x, axis)
    n = axis_size
    c = _chunk(x.shape[axis], n)
    y = _split_axis(x, axis, (2, n, c))  # [..., half, chunk, c, ...]
    first = jax.lax.index_in_dim(y, 0, axis, keepdims=False)  # chunks 0 .. n-1
    second = jnp.flip(jax.lax.index_in_dim(y, 1, axis, keepdims=False), axis)  # 2n-1 .. n
    return jnp.stack([first, second], axis=axis + 1).reshape(x.shape)


def unzigzag(x, axis_size: int, axis: int = 1):
    """Inverse of :func:`zigzag`."""
    axis = _axis(x, axis)
    n = axis_size
    c = _chunk(x.shape[axis], n)
    y = _split_axis(x, axis, (n, 2, c))  # [..., device, pair, c, ...]
    first = jax.lax.index_in_dim(y, 0, axis + 1, keepdims=False)
    second = jnp.flip(jax.lax.index_in_dim(y, 1, axis + 1, keepdims=False), axis)
    return jnp.concatenate([first, second], axis=axis).reshape(x.shape)


# ----------------------------------------------------------------------------------------------
# Per-block forward/backward (kernel on CUDA, reference elsewhere)
# ----------------------------------------------------------------------------------------------


def _block_bwd_reference(query, key, value, out, lse, dout, dlse, spec):
    """Attention backward of one key/value block given the *final* out and lse of the rows (float32).

    Unlike ``jax.vjp`` of the reference (which would renormalize within the block), this is exactly
    what the backward kernel computes, so it is correct for a block of a longer sequence."""
    b, t, n, _ = query.shape
    s, kh = key.shape[1], key.shape[2]
    g = n // kh
    hi = jax.lax.Precision.HIGHEST
    q = query.astype(jnp.float32)
    k = jnp.repeat(key.astype(jnp.float32), g, axis=2)
    v = jnp.repeat(value.astype(jnp.float32), g, axis=2)
    logits = jnp.einsum("btnd,bsnd->bnts", q, k, precision=hi) * spec.scale
    if spec.is_causal:
        logits = jnp.where(jnp.tril(jnp.ones((t, s), bool))[None, None], logits, -jnp.inf)
    p = jnp.exp(logits - lse[..., None])
    do = dout.astype(jnp.float32)
    delta = jnp.einsum("btnd,btnd->bnt", do, out.astype(jnp.float32), precision=hi) - dlse
    dv = jnp.einsum("bnts,btnd->bsnd", p, do, precision=hi)
    dp = jnp.einsum("btnd,bsnd->bnts", do, v, precision=hi)
    ds = p * (dp - delta[..., None])
    dq = jnp.einsum("bnts,bsnd->btnd", ds, k, precision=hi) * spec.scale
    dk = jnp.einsum("bnts,btnd->bsnd", ds, q, precision=hi) * spec.scale
    dk = dk.reshape(b, s, kh, g, key.shape[3]).sum(axis=3)
    dv = dv.reshape(b, s, kh, g, value.shape[3]).sum(axis=3)
    return dq.astype(query.dtype), dk.astype(key.dtype), dv.astype(value.dtype)


def _block_bwd_local(spec, *args):
    return dispatch.platform_dispatch(spec.use_kernel, lambda *a: launch.bwd_kernel(*a, spec),
                                      lambda *a: _block_bwd_reference(*a, spec), *args)


_BLOCK_BWD_LAYOUT = dataclasses.replace(api.BWD_LAYOUT, inputs=api.BWD_LAYOUT.inputs[:7])


def _block_bwd(spec, *args):  # (partitioned over batch/heads mesh axes that are not manual here)
    return sharding.call(_BLOCK_BWD_LAYOUT, _block_bwd_local, spec, *args, result_like=(0, 1, 2))


def _block_fwd(spec, q, k, v):
    return api.fwd(spec, q, k, v)


# ----------------------------------------------------------------------------------------------
# The ring
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RingSpec:
    axis_name: Hashable
    axis_size: int
    scale: float
    is_causal: bool
    layout: str
    use_kernel: bool
    ring: tuple = ()  # ppermute's (axes, pairs) for device i -> i + 1 (see _ring_perm)

    def block(self, causal: bool) -> AttentionSpec:
        return AttentionSpec(self.scale, causal, self.use_kernel)


def _axis_size(axis_name) -> int:
    if hasattr(jax.lax, "axis_size"):
        return int(jax.lax.axis_size(axis_name))
    return int(jax.lax.psum(1, axis_name))  # pragma: no cover - older JAX


def _ring_perm(axis_name, n: int):
    """(axes, pairs) for ppermute that send the block of device i to device i + 1, where i is the
    device's place in the sequence (``axis_index(axis_name)``: over a tuple of axes, the first one
    major). ppermute takes a tuple of axes in the mesh's order (newer JAX refuses another) and numbers
    the devices in that order: a tuple in another order is translated."""
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    mesh_order = tuple(getattr(jax.sharding.get_abstract_mesh(), "axis_names", ()) or ())
    ring = tuple((i, (i + 1) % n) for i in range(n))
    if len(names) == 1 or not set(names) <= set(mesh_order):
        return axis_name, ring
    sizes = {a: _axis_size(a) for a in names}
    ordered = tuple(a for a in mesh_order if a in names)

    def ppermute_index(i):
        coords = {}
        for a in reversed(names):
            i, coords[a] = divmod(i, sizes[a])
        j = 0
        for a in ordered:
            j = j * sizes[a] + coords[a]
        return j

    return ordered, tuple((ppermute_index(i), ppermute_index(j)) for i, j in ring)


def _rotate(x, spec: RingSpec):
    """Sends to the next device of the ring (device i -> i+1): at step s, device i holds the block of
    device i - s."""
    return jax.lax.ppermute(x, spec.ring[0], perm=spec.ring[1])


def _t_rows(lse_like):  # [B, N, T] -> [B, T, N, 1], to scale out rows
    return jnp.swapaxes(lse_like, 1, 2)[..., None]


def _merge(acc, block, rows=None):
    """Merges a block result (out [B,t,N,D_v], lse [B,N,t]) into the float32 accumulator; ``rows`` (a
    slice of T) when the block covers only some of the rows."""
    o_acc, l_acc = acc
    o_b, l_b = block
    if rows is not None:
        sub_o, sub_l = _merge((o_acc[:, rows], l_acc[..., rows]), block)
        return o_acc.at[:, rows].set(sub_o), l_acc.at[..., rows].set(sub_l)
    l_new = jnp.logaddexp(l_acc, l_b)
    o_new = o_acc * _t_rows(jnp.exp(l_acc - l_new)) + o_b.astype(jnp.float32) * _t_rows(
        jnp.exp(l_b - l_new)
    )
    return o_new, l_new


def _ring_forward(q, k, v, spec: RingSpec):
    n = spec.axis_size
    me = jax.lax.axis_index(spec.axis_name)
    full, diag = spec.block(False), spec.block(spec.is_causal)
    c = q.shape[1] // 2  # zig-zag chunk length

    o, lse = _block_fwd(diag, q, k, v)  # step 0: our own block
    acc = (o.astype(jnp.float32), lse)
    kv = (k, v)
    for s in range(1, n):
        kv = _rotate(kv, spec)  # now holding the block of device me - s (mod n)
        if not spec.is_causal:
            acc = _merge(acc, _block_fwd(full, q, *kv))
        elif spec.layout == "contiguous":
            # Block of device me - s: in the past when me >= s, else entirely in the future.
            acc = jax.lax.cond(
                me >= s,
                lambda acc, kv: _merge(acc, _block_fwd(full, q, *kv)),
                lambda acc, kv: acc,
                acc,
                kv,
            )
        else:  # zigzag
            acc = jax.lax.cond(
                me >= s,
                # earlier device: all our rows see its first chunk, none its second
                lambda acc, kv: _merge(acc, _block_fwd(full, q, kv[0][:, :c], kv[1][:, :c])),
                # later device: only our second chunk sees it, fully
                lambda acc, kv: _merge(acc, _block_fwd(full, q[:, c:], *kv), rows=slice(c, None)),
                acc,
                kv,
            )
    o, lse = acc
    return o.astype(q.dtype), lse


def _ring_backward(spec: RingSpec, residuals, cotangents):
    q, k, v, out, lse = residuals
    dout, dlse = cotangents
    n = spec.axis_size
    me = jax.lax.axis_index(spec.axis_name)
    full, diag = spec.block(False), spec.block(spec.is_causal)
    c = q.shape[1] // 2
    f32 = lambda *xs: tuple(x.astype(jnp.float32) for x in xs)
    zeros = lambda x, length=None: jnp.zeros(
        x.shape[:1] + ((length if length is not None else x.shape[1]),) + x.shape[2:], jnp.float32
    )

    # The gradient contributions (dq, dk, dv) of the key/value block in hand. They take only the
    # block (not the travelling dK/dV accumulators), so that the block's backward kernel can run
    # while the accumulators are still in flight; they are added afterwards.
    def whole(kv):
        return f32(*_block_bwd(full, q, *kv, out, lse, dout, dlse))

    def nothing(kv):  # contiguous, later device: entirely in the future
        # (typed as varying over the mesh axes like the other branch's results)
        return dispatch.vary_like(lambda *xs: tuple(map(zeros, xs)), q, *kv)

    def first_chunk(kv):  # zigzag, earlier device: all our rows see its first chunk only
        gq, gk, gv = f32(*_block_bwd(full, q, kv[0][:, :c], kv[1][:, :c], out, lse, dout, dlse))
        pad = lambda g: jnp.concatenate([g, zeros(g, c)], axis=1)
        return gq, pad(gk), pad(gv)

    def second_half(kv):  # zigzag, later device: only our second chunk sees it, fully
        r = slice(c, None)
        gq, gk, gv = f32(
            *_block_bwd(full, q[:, r], *kv, out[:, r], lse[..., r], dout[:, r], dlse[..., r])
        )
        return jnp.concatenate([zeros(gq, c), gq], axis=1), gk, gv

    dq, dk, dv = f32(*_block_bwd(diag, q, k, v, out, lse, dout, dlse))  # own block
    kv = (k, v)
    for s in range(1, n):
        # The key/value block of device me - s arrives, and so do its gradient accumulators.
        kv = _rotate(kv, spec)
        dk, dv = _rotate((dk, dv), spec)
        if not spec.is_causal:
            g = whole(kv)
        elif spec.layout == "contiguous":
            g = jax.lax.cond(me >= s, whole, nothing, kv)
        else:
            g = jax.lax.cond(me >= s, first_chunk, second_half, kv)
        dq, dk, dv = dq + g[0], dk + g[1], dv + g[2]
    # One more hop brings every dK/dV accumulator home (it left home n - 1 hops ago).
    dk, dv = _rotate((dk, dv), spec)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ring(q, k, v, spec: RingSpec):
    return _ring_forward(q, k, v, spec)


def _ring_fwd(q, k, v, spec):
    out, lse = _ring_forward(q, k, v, spec)
    return (out, lse), (q, k, v, out, lse)


_ring.defvjp(_ring_fwd, _ring_backward)


def ring_attention_with_lse(
    query,
    key,
    value,
    *,
    axis_name,
    is_causal=False,
    scale=None,
    layout="contiguous",
    implementation=None,
    sinks=None,
):
    """Like :func:`ring_attention`, and also returns the float32 log-sum-exp ``[batch, heads, q_len]``
    of the local query rows over the whole (global) key sequence. Both outputs are differentiable."""
    scale = compat.check_inputs(query, key, value, scale, is_causal, implementation, op="ring_attention", extra=(),
                                empty_ok=())
    if layout not in LAYOUTS:
        raise ValueError(f"jax_tk.ring_attention: layout must be one of {LAYOUTS}, got {layout!r}")
    try:
        n = _axis_size(axis_name)
    except NameError as e:
        raise ValueError(
            f"jax_tk.ring_attention: axis_name {axis_name!r} is not a mesh axis in scope; call it "
            "inside jax.shard_map with the sequence split over that axis"
        ) from e
    t, s = query.shape[1], key.shape[1]
    if is_causal and t != s:
        raise ValueError(
            "jax_tk.ring_attention: is_causal needs query and key/value blocks of the same length, "
            f"got {t} and {s}"
        )
    if is_causal and layout == "zigzag" and t % 2:
        raise ValueError(
            f"jax_tk.ring_attention(layout='zigzag'): the local sequence length ({t}) must be even "
            "(two chunks per device)"
        )
    use_kernel = api.use_kernel(query, key, value, implementation)
    spec = RingSpec(axis_name, n, float(scale), bool(is_causal), layout, use_kernel, _ring_perm(axis_name, n))
    sinks = sinks_.check("ring_attention", sinks, query.shape[2])
    if n == 1:
        return sinks_.apply(*api.attention_vjp(query, key, value, spec.block(spec.is_causal)), sinks)
    return sinks_.apply(*_ring(query, key, value, spec), sinks)  # (the sink joins the merged softmax)


def ring_attention(
    query,
    key,
    value,
    *,
    axis_name,
    is_causal=False,
    scale=None,
    layout="contiguous",
    implementation=None,
    sinks=None,
):
    """Attention over a sequence sharded across the mesh axis ``axis_name`` (call inside shard_map).

    Args:
      query: local block ``[batch, q_len, q_heads, head_dim]`` of the global query sequence.
      key: local block ``[batch, kv_len, kv_heads, head_dim]`` (same sharding of the sequence;
        ``q_heads`` a multiple of ``kv_heads``).
      value: local block ``[batch, kv_len, kv_heads, v_head_dim]``, ``v_head_dim <= head_dim`` (e.g.
        MLA's 192 and 128), as in :func:`jax_tk.attention`.
      axis_name: the mesh axis (or tuple of axes) the sequence is split over, in device order.
      is_causal: causal mask over *global* positions (needs ``q_len == kv_len``).
      scale: logit multiplier (a Python float), default ``1/sqrt(head_dim)`` (the query/key head_dim).
      layout: how the global sequence is laid out over the devices when ``is_causal``:
        ``"contiguous"`` (device i holds the i-th block) or ``"zigzag"`` (device i holds chunks i and
        2n-1-i; see :func:`zigzag`), which balances the work.
      implementation: as in :func:`jax_tk.attention` (``None``, ``"tk"`` or ``"xla"``).
      sinks: ``[q_heads]`` floats or None: attention sinks, as in :func:`jax_tk.attention`.

    Returns:
      The local block of the output, ``[batch, q_len, q_heads, v_head_dim]``, equal to the
      corresponding rows of unsharded attention over the whole sequence.
    """
    return ring_attention_with_lse(
        query,
        key,
        value,
        axis_name=axis_name,
        is_causal=is_causal,
        scale=scale,
        layout=layout,
        implementation=implementation,
        sinks=sinks,
    )[0]
