"""jax_tk.attention: scaled dot-product attention on jax_tk's kernels, differentiable and jit-friendly.

The public functions hand their arguments to ``compat.normalize`` (checks and normalization, once) and
run the call it describes: the static spec of the call, the kernel/reference dispatch on the core,
partitioning over batch and heads, the custom_vjp, the short-query path on ``jax_tk.decode``'s public
API, and ``implementation="cudnn"`` (``jax.nn.dot_product_attention``). The kernels' operands are
worked out in ``launch``; the pure-JAX reference is ``reference``.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import jax.numpy as jnp

from jax_tk import decode
from jax_tk._core import dispatch, sharding, sinks as sinks_
from jax_tk.attention import compat, launch, reference
from jax_tk.attention.launch import Masks


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Static description of one attention call (hashable: it is a custom_vjp nondiff argument).

    window: ``(left, right)`` (ints >= 0, as given to ``local_window_size``) or None.
    softcap: the logit soft cap (a positive float) or None.
    sinks: the call has attention sinks (``_core.sinks``): the forward kernel takes them, so its out and
      lse include them, and the backward also returns ``delta = rowsum(dout * out) - dlse``, from which
      the sinks' gradient follows.
    """

    scale: float
    is_causal: bool
    use_kernel: bool
    window: tuple[int, int] | None = None
    softcap: float | None = None
    deterministic: bool = False  # backward: same bits every run (the Hopper kernel orders its dq sums)
    sinks: bool = False


def use_kernel(query, key, value, implementation, bias=None, softcap=None) -> bool:
    """Whether the call runs the kernels; a value head dim unlike the key's that they do not take here
    (MLA's pair off Hopper) runs the reference with a warning."""
    reason = launch.kernel_unsupported_reason(query, key, value=value, bias=bias, softcap=softcap)
    use = dispatch.use_kernel("attention", implementation, reason)
    if implementation is None and reason is not None and value.shape[-1] != key.shape[-1]:
        dispatch.warn_reference("attention", f"unsupported {reason}")
    return use


# ----------------------------------------------------------------------------------------------
# The op: reference, dispatch, partitioning, custom_vjp
# ----------------------------------------------------------------------------------------------


def _reference_options(spec: AttentionSpec, masks: Masks | None) -> dict:
    masks = Masks() if masks is None else masks
    return dict(scale=spec.scale, is_causal=spec.is_causal, local_window_size=spec.window,
                q_segment_ids=masks.q_segment_ids, kv_segment_ids=masks.kv_segment_ids,
                query_seq_lengths=masks.q_lengths, key_value_seq_lengths=masks.kv_lengths,
                logits_soft_cap=spec.softcap, mask=masks.mask)


def _fwd_reference(query, key, value, spec: AttentionSpec, masks=None, bias=None, sinks=None):
    return reference.attention_with_lse(query, key, value, bias=bias, sinks=sinks, **_reference_options(spec, masks))


def _bwd_reference(query, key, value, out, lse, dout, dlse, spec: AttentionSpec, masks=None, bias=None, sinks=None):
    # (the forward's lse includes the sinks: the reference with them has the same softmax)
    f = functools.partial(reference.attention_with_lse, sinks=sinks, **_reference_options(spec, masks))
    if bias is None:
        _, vjp = jax.vjp(f, query, key, value)
    else:
        # dbias per device, like the kernels' (sharding sums it over the devices that share the bias)
        bias = dispatch.vary_as(bias, query)
        _, vjp = jax.vjp(lambda q, k, v, b: f(q, k, v, bias=b), query, key, value, bias)
    grads = vjp((dout, dlse))
    return (*grads, sinks_.delta(out, dout, dlse)) if spec.sinks else grads


# The arrays of the op for the partitioning (jax_tk._core.sharding): batch "b" and query heads "n"
# split, key/value heads "k" grouped (GQA), rows "t", keys "s", the query/key head_dim "d" and the
# value head_dim "e" whole ("e" is a label of its own: it may be smaller than "d", as in MLA). The
# masking arrays (Masks, flat, None where absent) and the bias follow the operands; the mask's and the
# bias's broadcast dims have labels of their own (compat.dense_labels), which stay whole, and the
# bias's gradient is summed over the devices that split a dim it is broadcast over.
_MASK_LABELS = ("b t", "b s", "b", "b")


@functools.lru_cache(maxsize=None)
def layouts(mask_labels: str = "b n t s", bias_labels: str | None = None, sinks: bool = False):
    """(forward, backward) layouts; with ``bias_labels``, the backward also returns dbias; with sinks,
    the forward takes them (``[q_heads]``) and the backward also returns delta (``[batch, q_heads, q_len]``)."""
    extra = (*_MASK_LABELS, mask_labels, bias_labels or "b n t s")
    fwd = sharding.Layout(inputs=("b t n d", "b s k d", "b s k e", *extra, "n"), outputs=("b t n e", "b n t"),
                          heads="n", grouped="k")
    grads = ("b t n d", "b s k d", "b s k e") + ((bias_labels,) if bias_labels else ()) + (("b n t",) if sinks else ())
    bwd = sharding.Layout(inputs=("b t n d", "b s k d", "b s k e", "b t n e", "b n t", "b t n e", "b n t", *extra, "n"),
                          outputs=grads, heads="n", grouped="k", summed=(3,) if bias_labels else ())
    return fwd, bwd


FWD_LAYOUT, BWD_LAYOUT = layouts()


def plan_attention(axis_sizes, q_spec, q_shape, kv_shape) -> sharding.Plan:
    """How ``jax_tk.attention`` splits a call under ``jit`` whose query ``[B, T, N, D]`` is sharded as
    ``q_spec`` (a ``PartitionSpec``) over a mesh with ``axis_sizes`` (``{axis name: size}``), the key
    of shape ``kv_shape`` (the value's differs at most in its head_dim, which stays whole). Returns a
    ``Plan``: ``batch`` and ``heads`` are the mesh axes that split B and N; with fewer key/value heads
    than head shards, ``split_grouped`` is False and each key/value head is shared by ``group_share``
    consecutive head shards."""
    return sharding.plan(FWD_LAYOUT, axis_sizes, q_spec, [q_shape, kv_shape])


def fwd_local(spec: AttentionSpec, query, key, value, *rest):
    """The forward on one device's shards: the kernel on CUDA, the reference elsewhere. ``rest``: the
    five entries of Masks, the bias, then the sinks (None without them)."""
    masks, bias, sinks = _masks(rest[:5]), rest[5], rest[6] if len(rest) > 6 else None
    return dispatch.platform_dispatch(
        spec.use_kernel,
        lambda q, k, v, m, b, s: launch.fwd_kernel(q, k, v, spec, masks=m, bias=b, sinks=s),
        lambda q, k, v, m, b, s: _fwd_reference(q, k, v, spec, m, b, s),
        query, key, value, masks, bias, sinks)


def bwd_local(spec: AttentionSpec, query, key, value, out, lse, dout, dlse, *rest):
    """The backward on one device's shards: (dq, dk, dv), then dbias with a bias, then delta with sinks
    (``rest``: the five entries of Masks, the bias, then with sinks the sinks)."""
    masks, bias, sinks = _masks(rest[:5]), rest[5], rest[6] if len(rest) > 6 else None
    return dispatch.platform_dispatch(
        spec.use_kernel,
        lambda *a: launch.bwd_kernel(*a[:7], spec, masks=a[7], bias=a[8], with_delta=spec.sinks),
        lambda *a: _bwd_reference(*a[:7], spec, a[7], a[8], a[9]),
        query, key, value, out, lse, dout, dlse, masks, bias, sinks)


def _masks(entries):
    return Masks(*entries) if any(m is not None for m in entries) else None


def _dense_layouts(query, key, masks, bias, sinks=False):
    full = (query.shape[0], query.shape[2], query.shape[1], key.shape[1])
    mask = None if masks is None else masks.mask
    return layouts(compat.dense_labels(mask.shape, full) if mask is not None else "b n t s",
                   compat.dense_labels(bias.shape, full) if bias is not None else None, sinks)


def fwd(spec: AttentionSpec, query, key, value, masks=None, bias=None, sinks=None):
    """(out, lse), partitioned over batch and heads under jit with sharded inputs (a few queries over
    many keys: jax_tk.decode's kernel, see :func:`takes_decode`)."""
    if takes_decode(query, key, value, spec, masks, bias):
        return _decode_fwd(query, key, value, spec, sinks)
    layout, _ = _dense_layouts(query, key, masks, bias, spec.sinks)
    return sharding.call(layout, fwd_local, spec, query, key, value, *(masks or Masks()), bias, sinks)


def bwd(spec: AttentionSpec, query, key, value, out, lse, dout, dlse, masks=None, bias=None, sinks=None):
    """(dq, dk, dv), then dbias with a bias, then delta with sinks (``spec.sinks``), partitioned like
    :func:`fwd` (each gradient sharded like its input, delta like lse)."""
    _, layout = _dense_layouts(query, key, masks, bias, spec.sinks)
    like = (0, 1, 2) + ((len(layout.inputs) - 2,) if bias is not None else ()) + ((4,) if spec.sinks else ())
    return sharding.call(layout, bwd_local, spec, query, key, value, out, lse, dout, dlse, *(masks or Masks()), bias,
                         sinks, result_like=like)


# masks (segment ids, lengths: integer arrays; the boolean mask) is an input of the custom_vjp like
# query/key/value, so that it may be traced; its cotangent is None (not differentiable). The bias is
# differentiable: its cotangent has its own (broadcast) shape. The sinks (float32 [q_heads], with
# spec.sinks) are differentiable too.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def attention_vjp(query, key, value, spec: AttentionSpec, masks=None, bias=None, sinks=None):
    return fwd(spec, query, key, value, masks, bias, sinks)


def _attention_fwd(query, key, value, spec, masks=None, bias=None, sinks=None):
    out, lse = attention_vjp(query, key, value, spec, masks, bias, sinks)
    return (out, lse), (query, key, value, out, lse, masks, bias, sinks)


def _attention_bwd(spec, residuals, cotangents):
    # The log-sum-exp's cotangent enters as dS = P * (dP - (rowsum(dO * O) - dlse)), so the kernel
    # takes it as one more input and both outputs stay differentiable at no extra cost. With sinks,
    # out and lse include them, so P is the rows' softmax with the sink and the kernel needs nothing
    # more; the sinks' gradient comes from the delta it returns.
    query, key, value, out, lse, masks, bias, sinks = residuals
    dout, dlse = cotangents
    grads = bwd(spec, query, key, value, out, lse, dout, dlse, masks, bias, sinks)
    dbias = dispatch.sum_as(grads[3], bias) if bias is not None else None
    # The sinks' gradient has the sinks' type (a custom_vjp cotangent has its primal's): inside a user's
    # shard_map it is summed over the manual axes the sinks are shared over (e.g. replicated over the batch
    # shards); under explicit sharding it gets the sinks' sharding (e.g. replicated, with the heads split).
    dsinks = None
    if sinks is not None:
        dsinks = sharding.typed_like(dispatch.sum_as(sinks_.grad(sinks, lse, grads[-1]), sinks), sinks)
    return (*grads[:3], None, dbias, dsinks)


attention_vjp.defvjp(_attention_fwd, _attention_bwd)


# Short queries against long keys (decoding through the plain API): jax_tk.decode's kernel reads each
# key once per KV head and splits the keys over the SMs, where the forward's 128-row tiles would be
# mostly padding. It takes the kernel calls whose masking it means the same way: no causal mask and no
# window (decode aligns positions at the end of the keys), no segment ids, lengths, bias or mask, and
# key and value of one head_dim. The backward stays attention's, from the lse that decode returns.
DECODE_MAX_QUERIES = 16
DECODE_MIN_KEYS = 512


def takes_decode(query, key, value, spec: AttentionSpec, masks=None, bias=None) -> bool:
    if not spec.use_kernel or spec.is_causal or spec.window is not None or bias is not None:
        return False
    if masks is not None and any(m is not None for m in masks):
        return False
    if value.shape[-1] != key.shape[-1]:  # (decode's caches are key and value of one shape)
        return False
    return (query.shape[1] <= DECODE_MAX_QUERIES and key.shape[1] >= DECODE_MIN_KEYS
            and decode.kernel_unsupported_reason(query, key) is None)


def _decode_fwd(query, key, value, spec: AttentionSpec, sinks=None):
    """(out, lse) through jax_tk.decode, every key valid (the kernel on CUDA, as the attention kernel
    would have run; decode's reference elsewhere)."""
    lengths = jnp.full((query.shape[0],), key.shape[1], jnp.int32)
    return decode.attention_with_lse(query, key, value, lengths, scale=spec.scale, is_causal=False,
                                     logits_soft_cap=spec.softcap, sinks=sinks)


# ----------------------------------------------------------------------------------------------
# A normalized call: nothing to compute, jax.nn's cuDNN path, or the op
# ----------------------------------------------------------------------------------------------


def _run(call: compat.Call, sinks=None):
    """(out, lse) of a normalized call (rank 4), with the attention sinks (``_core.sinks``) if given."""
    sinks = sinks_.check("attention", sinks, call.query.shape[2])
    if sinks is not None and call.implementation == "cudnn":
        raise ValueError("jax_tk.attention(implementation='cudnn'): sinks are not supported by "
                         "jax.nn.dot_product_attention (its lse carries no gradient); use implementation=None, "
                         "'tk' or 'xla'")
    query, key, value = call.query, call.key, call.value
    if value.shape[-1] != key.shape[-1] and call.implementation == "cudnn":
        raise ValueError(f"jax_tk.attention(implementation='cudnn'): query/key head_dim {key.shape[-1]} with value "
                         f"head_dim {value.shape[-1]} is not supported by jax.nn.dot_product_attention (it takes key "
                         "and value of one shape); use implementation=None, 'tk' or 'xla'")
    if 0 in (query.shape[0], query.shape[1], key.shape[1]):  # nothing to compute (no row sees a key)
        b, t, n, _ = query.shape
        return sinks_.apply(dispatch.zeros((b, t, n, value.shape[-1]), query.dtype, query, key, value),
                            dispatch.zeros((b, n, t), jnp.float32, query, key, value) - jnp.inf, sinks)
    if call.implementation == "cudnn":
        return _cudnn_attention_with_lse(call)
    spec = AttentionSpec(call.scale, call.is_causal,
                         use_kernel(query, key, value, call.implementation, call.bias, call.softcap),
                         call.window, call.softcap, call.deterministic, sinks is not None)
    masks = Masks(call.q_segment_ids, call.kv_segment_ids, call.query_seq_lengths, call.key_value_seq_lengths,
                  call.mask)
    return attention_vjp(query, key, value, spec, _masks(masks), call.bias, sinks)


def _cudnn_attention_with_lse(call: compat.Call):
    """``jax.nn.dot_product_attention(..., implementation="cudnn", return_residual=True)``; returns
    ``(out, lse)`` with lse ``[batch, heads, q_len]`` float32 (jax.nn's residual is the natural-log
    log-sum-exp of the scaled logits, ``[batch, q_len, heads]`` in the input dtype; cuDNN's backward
    ignores its cotangent, so it is returned under stop_gradient)."""
    for name, unsupported in (("q_segment_ids/kv_segment_ids", call.q_segment_ids is not None),
                              ("logits_soft_cap", call.softcap is not None),
                              ("deterministic_backward=True", call.deterministic)):
        if unsupported:
            raise ValueError(f"jax_tk.attention(implementation='cudnn'): {name} is not supported by "
                             "jax.nn.dot_product_attention; use implementation=None, 'tk' or 'xla'")
    lengths = [None if x is None else jnp.asarray(x).astype(jnp.int32)
               for x in (call.query_seq_lengths, call.key_value_seq_lengths)]
    try:
        out, residual = jax.nn.dot_product_attention(
            call.query, call.key, call.value, call.bias, call.mask, scale=call.scale, is_causal=call.is_causal,
            query_seq_lengths=lengths[0], key_value_seq_lengths=lengths[1], local_window_size=call.window,
            implementation="cudnn", return_residual=True)
    except RuntimeError as e:  # e.g. no cuDNN on this machine
        raise RuntimeError(f"jax_tk.attention(implementation='cudnn'): jax.nn.dot_product_attention failed: {e} "
                           "(cuDNN attention needs an NVIDIA GPU; use implementation=None, 'tk' or 'xla')") from e
    lse = jax.lax.stop_gradient(jnp.swapaxes(residual, 1, 2).astype(jnp.float32))
    return out, lse


# ----------------------------------------------------------------------------------------------
# The public functions
# ----------------------------------------------------------------------------------------------


def attention_with_lse(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                       local_window_size=None, q_segment_ids=None, kv_segment_ids=None, query_seq_lengths=None,
                       key_value_seq_lengths=None, logits_soft_cap=None, implementation=None,
                       deterministic_backward=None, deterministic=None, dropout_rate=None, dropout_rng=None,
                       broadcast_dropout=True, sinks=None):
    """Like :func:`attention`, and also returns the float32 log-sum-exp of each query row.

    Returns:
      ``(out, lse)``: ``out`` is ``[batch, q_len, q_heads, v_head_dim]`` (the value's head_dim) in the
      input dtype, ``lse`` is ``[batch, q_heads, q_len]`` float32 (natural log of the softmax denominator
      of the scaled logits, the sink's term included; ``-inf`` for a row that sees no key, its sink with
      sinks); rank-3 inputs give ``[q_len, q_heads, v_head_dim]``
      and ``[q_heads, q_len]``, several batch dims ``[*batch, ...]``. Both are differentiable, except
      the lse of ``implementation="cudnn"`` (jax.nn's residual: cuDNN's backward ignores its
      cotangent, so it is returned under ``stop_gradient``; it is also rounded to the input dtype by
      jax.nn).
    """
    del broadcast_dropout  # (meaningless without dropout)
    call = compat.normalize(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal, local_window_size=local_window_size,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, logits_soft_cap=logits_soft_cap, implementation=implementation,
        deterministic_backward=deterministic_backward, deterministic=deterministic, dropout_rate=dropout_rate,
        dropout_rng=dropout_rng)
    return call.restore(*_run(call, sinks))


def attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False, local_window_size=None,
              q_segment_ids=None, kv_segment_ids=None, query_seq_lengths=None, key_value_seq_lengths=None,
              logits_soft_cap=None, implementation=None, deterministic_backward=None, return_residual=False,
              deterministic=None, dropout_rate=None, dropout_rng=None, broadcast_dropout=True, dtype=None,
              precision=None, module=None, qk_attn_weights_einsum=None, attn_weights_value_einsum=None,
              sinks=None):
    """Scaled dot-product attention, ``softmax(scale * query @ key^T + bias) @ value``.

    Same layout and meaning as :func:`jax.nn.dot_product_attention` (README: "Differences from
    jax.nn.dot_product_attention" lists what differs), and usable as the ``attention_fn`` of Flax's
    ``linen.MultiHeadDotProductAttention`` and ``nnx.MultiHeadAttention``.

    Args:
      query: ``[batch, q_len, q_heads, head_dim]`` (or ``[q_len, q_heads, head_dim]``, or several
        batch dims ``[*batch, q_len, q_heads, head_dim]``), bfloat16, float16 or float32.
      key: ``[batch, kv_len, kv_heads, head_dim]`` (rank 3 with a rank-3 query), same dtype;
        ``q_heads`` must be a multiple of ``kv_heads`` (grouped-query attention).
      value: ``[batch, kv_len, kv_heads, v_head_dim]``, as ``key`` but for its head_dim, which may be
        smaller than the query/key head_dim (``v_head_dim <= head_dim``; Multi-head Latent Attention
        trains with 192 and 128); the output has it. The kernels take MLA's (192, 128) pair, and a
        smaller value head_dim beside a query/key head_dim they take (the value padded); other pairs
        run the reference (docs/attention.md, "Head dims (MLA)").
      bias: additive bias of the logits, as in jax.nn: a float array broadcastable to ``[batch, q_heads,
        q_len, kv_len]`` (rank <= 4, leading dims added; each dim 1 or full size; ``[q_heads, q_len,
        kv_len]`` for rank-3 inputs), added after the scale and the soft cap, before the masking.
        Differentiable (its gradient is summed over the dims it is broadcast over). A ``-inf`` entry
        hides the key like the mask does. The kernels read it in the inputs' dtype (a float32 bias is
        rounded to it); with ``logits_soft_cap`` the reference runs.
      mask: boolean (integer and float masks are read as Flax reads them: any value but 0 attends),
        broadcastable like ``bias``: False hides the key from the query row. Combines
        with every other masking option. The kernels read it as bits and skip the 128 x 128 blocks it
        hides whole.
      scale: multiplier of the logits; default ``1/sqrt(head_dim)`` (the query/key head_dim). A Python
        or numpy float is static; a JAX scalar array (traced, e.g. a learned temperature) is
        differentiable: the op then runs with scale 1.0 on ``scale * query``, computed in float32 and
        rounded to the query's dtype (one more rounding than a static scale, which is applied to the
        float32 logits).
      is_causal: query ``i`` attends to keys ``j <= i`` (top-left aligned when ``q_len != kv_len``,
        like ``jax.nn.dot_product_attention``).
      local_window_size: ``(left, right)`` (or one int for both): query ``i`` attends to keys
        ``i - left <= j <= i + right``, as in ``jax.nn.dot_product_attention``.
      q_segment_ids, kv_segment_ids: ``[batch, q_len]`` and ``[batch, kv_len]`` integers (packed
        sequences; ``[q_len]``, ``[kv_len]`` with rank-3 inputs): a query attends only to keys of its
        own segment. 64-bit ids are relabelled exactly to int32 (on the device).
      query_seq_lengths, key_value_seq_lengths: ``[batch]`` integers (padded batches): query rows at or
        past their length give 0, keys at or past their length are not attended to.
      logits_soft_cap: if set, logits become ``cap * tanh(logits / cap)`` (as in Gemma 2), before the
        bias is added.
      implementation: ``None`` (the CUDA kernel where the configuration is supported, the pure-JAX
        reference otherwise), ``"tk"`` (the kernel, or an error), ``"xla"`` (jax_tk's pure-JAX
        reference: XLA code with jax_tk's semantics, which differ from
        ``jax.nn.dot_product_attention(implementation="xla")`` for a row that sees no key: 0 here, the
        mean of the values there), ``"cudnn"`` (``jax.nn.dot_product_attention(...,
        implementation="cudnn")``, with jax.nn's semantics; segment ids, ``logits_soft_cap`` and
        ``deterministic_backward=True`` raise ``ValueError`` there, and so do unequal head dims, which
        jax.nn does not take).
      deterministic_backward: make the backward give the same bits on every run. The Hopper backward
        adds the query gradient's partial sums with atomics in whatever order blocks finish; with
        ``True`` they take turns in a fixed order (somewhat slower). The mma.sync backward (pre-Hopper
        GPUs) and the reference are always deterministic.
      return_residual: as in jax.nn, also return the log-sum-exp of each query row, ``[batch, q_len,
        q_heads]`` (``[q_len, q_heads]`` for rank-3 inputs); float32 and differentiable here
        (``attention_with_lse``'s lse, transposed).
      deterministic, dropout_rate, dropout_rng, broadcast_dropout: Flax's attention-dropout arguments.
        Dropout is not implemented: an active one (``dropout_rate > 0`` and not ``deterministic``) raises
        ``NotImplementedError``, never ignored. ``deterministic=True`` given with no dropout argument
        keeps its former jax_tk meaning, ``deterministic_backward=True`` (with a DeprecationWarning).
      sinks: ``[q_heads]`` floats (attention sinks, as in gpt-oss), or None: one learned logit per query
        head that joins every row's softmax denominator and has no value, ``p_j = exp(l_j) / (exp(sink)
        + sum_j exp(l_j))``. Differentiable (its gradient in its own dtype); combines with every option
        (not with ``implementation="cudnn"``). The kernels take them into their softmax, forward and
        backward; the reference adds ``exp(sink)`` to each row's denominator.
      dtype, precision, module, qk_attn_weights_einsum, attn_weights_value_einsum: the other keywords
        Flax passes to an ``attention_fn``. ``dtype`` casts query, key and value to it; ``precision`` is
        ignored (products accumulate in float32, and the float32 reference computes them at full
        precision); ``module`` (``sow_weights=True``) and custom einsums raise ``NotImplementedError``:
        jax_tk never forms the attention weights.

    The masking options combine (a query sees a key only if every rule allows it), also with
    ``is_causal``, cross attention and grouped-query attention, and the kernels take all of them,
    ``mask`` and ``bias`` included (forward and backward; ``bias`` with ``logits_soft_cap`` runs the
    reference). A query row that sees no key at all gives 0, log-sum-exp
    ``-inf`` and zero gradients (never NaN).

    Returns:
      ``[batch, q_len, q_heads, v_head_dim]`` in the input dtype (the query's shape but for the value's
      head_dim); with ``return_residual=True``, ``(out, residual)``.
    """
    if not isinstance(return_residual, (bool, np.bool_)):
        raise TypeError(f"jax_tk.attention: return_residual must be a bool, got {return_residual!r}")
    del precision, broadcast_dropout  # (see the docstring; meaningless without dropout)
    call = compat.normalize(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal, local_window_size=local_window_size,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, logits_soft_cap=logits_soft_cap, implementation=implementation,
        deterministic_backward=deterministic_backward, deterministic=deterministic, dropout_rate=dropout_rate,
        dropout_rng=dropout_rng, dtype=dtype, module=module, qk_attn_weights_einsum=qk_attn_weights_einsum,
        attn_weights_value_einsum=attn_weights_value_einsum)
    out, lse = call.restore(*_run(call, sinks))
    return (out, jnp.swapaxes(lse, -1, -2)) if return_residual else out
