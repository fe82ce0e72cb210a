"""jax_tk.linear_attention: the gated delta rule and simple GLA (chunked, over whole sequences) and
their one-token decoding steps.

Trace-time checks and the ``implementation=`` choice. Both ops, forward and backward, run CUDA kernels
on H100/H200 (bfloat16/float16, K 64 or 128, V a multiple of 64); everything else runs the pure-JAX
paths of ``reference`` (the chunked one by default, the token-by-token recurrence on request), with
JAX's autodiff of them.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_tk._core import checks, dispatch, extension, sharding
from jax_tk.linear_attention import launch, reference

FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_GDR, _GLA = "linear_attention.gated_delta_rule", "linear_attention.simple_gla"
_GDR_STEP, _GLA_STEP = "linear_attention.gated_delta_rule_step", "linear_attention.simple_gla_step"


def chunk_size() -> int:
    """Tokens per chunk of the chunked path: the op's contract constant ``CHUNK``
    (``cc/linear_attention/linear_attention.h``), the chunk the kernels will take too."""
    return extension.contract("linear_attention")["CHUNK"]


# ----------------------------------------------------------------------------------------------
# Checks (trace time)
# ----------------------------------------------------------------------------------------------


def _check_qkv(op, q, k, v, lead: str):
    """q, k ``[lead, H, K]`` and v ``[lead, HV, V]``, of one float dtype, ``HV % H == 0``."""
    rank = lead.count(",") + 3
    checks.float_array(op, "q", q, rank, f"[{lead}, heads, K]", FLOAT_DTYPES)
    checks.float_array(op, "k", k, rank, f"[{lead}, heads, K]", FLOAT_DTYPES)
    checks.float_array(op, "v", v, rank, f"[{lead}, value_heads, V]", FLOAT_DTYPES)
    if k.shape != q.shape:
        raise ValueError(f"jax_tk.{op}: k must have q's shape {tuple(q.shape)} ([{lead}, heads, K]), got "
                         f"{tuple(k.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"jax_tk.{op}: q, k and v must have one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if v.shape[:-2] != q.shape[:-2]:
        raise ValueError(f"jax_tk.{op}: [{lead}] of v {tuple(v.shape[:-2])} != that of q and k "
                         f"{tuple(q.shape[:-2])}")
    h, hv = q.shape[-2], v.shape[-2]
    if hv % h != 0:
        raise ValueError(f"jax_tk.{op}: the number of value heads ({hv}) must be a multiple of the number of "
                         f"q/k heads ({h}): value head j uses q/k head j // (value_heads // heads)")


def _check_gate(op, name, x, v, lead: str):
    """A per-token, per-value-head scalar: ``[lead, HV]``, float."""
    checks.float_array(op, name, x, v.ndim - 1, f"[{lead}, value_heads]", FLOAT_DTYPES)
    if x.shape != v.shape[:-1]:
        raise ValueError(f"jax_tk.{op}: {name} must have shape [{lead}, value_heads] = {tuple(v.shape[:-1])}, "
                         f"got {tuple(x.shape)}")


def _check_state(op, name, state, shape, n_is: str):
    checks.float_array(op, name, state, 4, "[N, value_heads, K, V]", FLOAT_DTYPES)
    if state.shape != shape:
        raise ValueError(f"jax_tk.{op}: {name} must have shape [N, value_heads, K, V] = {shape} (N = {n_is}), "
                         f"got {tuple(state.shape)}")


def _check_bool(op, name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"jax_tk.{op}: {name} must be a bool, got {value!r}")
    return bool(value)


def _scale(op, scale, kd: int) -> float:
    scale = checks.positive_float(op, "scale", scale)
    return 1.0 / math.sqrt(kd) if scale is None else scale


def _cu_seqlens(op, cu_seqlens, b: int, t: int):
    """``cu_seqlens`` as int32 (None stays None); checked where its values are known at trace time."""
    if cu_seqlens is None:
        return None
    checks.array(op, "cu_seqlens", cu_seqlens, 1, "[N + 1]")
    if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        raise TypeError(f"jax_tk.{op}: cu_seqlens must have an integer dtype (int32), got {cu_seqlens.dtype}")
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"jax_tk.{op}: cu_seqlens must hold N + 1 >= 2 offsets, got shape {tuple(cu_seqlens.shape)}")
    if b != 1:
        raise ValueError(f"jax_tk.{op}: cu_seqlens packs the sequences along T of a batch of 1, got batch {b}")
    try:
        values = np.asarray(cu_seqlens)
    except jax.errors.TracerArrayConversionError:
        values = None  # traced: the caller vouches for them (see the docstrings)
    if values is not None and (values[0] != 0 or values[-1] != t or np.any(np.diff(values) < 0)):
        raise ValueError(f"jax_tk.{op}: cu_seqlens must rise from 0 to T = {t} (never falling), got {values.tolist()}")
    # (values past [0, T], possible only traced, are clamped: they then index no token out of bounds)
    return jnp.asarray(checks.to_int32(cu_seqlens, 0, t))


def _sequence_call(op, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    """Checks a whole-sequence call; returns ``(scale, int32 cu_seqlens or None)``."""
    lead = "batch, T"
    _check_qkv(op, q, k, v, lead)
    _check_gate(op, "g", g, v, lead)
    if beta is not None:
        _check_gate(op, "beta", beta, v, lead)
    (b, t, _, kd), (hv, vd) = q.shape, v.shape[2:]
    cu = _cu_seqlens(op, cu_seqlens, b, t)
    n = b if cu is None else cu.shape[0] - 1
    if initial_state is not None:
        n_is = "batch" if cu is None else "the number of sequences of cu_seqlens"
        _check_state(op, "initial_state", initial_state, (n, hv, kd, vd), n_is)
    _check_bool(op, "output_final_state", output_final_state)
    return _scale(op, scale, kd), cu


def _reference_path(op, implementation):
    """The pure-JAX function that runs the call: ``reference.recurrent`` ("reference") or
    ``reference.chunked`` (None, "xla")."""
    dispatch.check_implementation(op, implementation, ("reference",))
    if implementation == "reference":
        return reference.recurrent
    return functools.partial(reference.chunked, chunk_size=chunk_size())


# ----------------------------------------------------------------------------------------------
# The ops
# ----------------------------------------------------------------------------------------------


def gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                     use_qk_l2norm=False, implementation=None):
    """The gated delta rule (Gated DeltaNet), with the semantics of flash-linear-attention's
    ``chunk_gated_delta_rule``.

    A state ``S`` ``[K, V]`` per sequence and value head runs through the tokens; at token t::

        S <- S * exp(g_t)
        u_t = beta_t * (v_t - S^T k_t)
        S <- S + k_t u_t^T
        o_t = scale * S^T q_t

    Args:
      q, k: ``[batch, T, heads, K]``, bfloat16, float16 or float32.
      v: ``[batch, T, value_heads, V]``, the dtype of q and k; ``value_heads`` a multiple of ``heads``
        (grouped value heads: value head j uses q/k head ``j // (value_heads // heads)``).
      g: ``[batch, T, value_heads]``, the log decay of the state (finite, <= 0), any float dtype.
      beta: ``[batch, T, value_heads]``, the delta rule's write strength (usually in [0, 1]).
      scale: output multiplier (a Python float), default ``K ** -0.5``.
      initial_state: ``[N, value_heads, K, V]`` (N = batch, or the number of sequences of
        ``cu_seqlens``), any float dtype, read as float32; None starts from zeros.
      output_final_state: also return the state after each sequence's last token.
      cu_seqlens: ``[N + 1]`` integers, with ``batch == 1``: the T tokens pack N sequences, sequence n
        being tokens ``cu_seqlens[n] .. cu_seqlens[n+1] - 1``, each starting from its own initial state
        (no token sees another sequence's). The offsets must rise from 0 to T (checked where they are
        known at trace time; traced ones are trusted); a sequence may be empty.
      use_qk_l2norm: normalize q and k over K first, as flash-linear-attention's ``use_qk_l2norm_in_kernel``:
        ``x / sqrt(sum(x**2) + 1e-6)``, in float32.
      implementation: ``None`` or ``"xla"``: the chunked XLA path (chunks of ``chunk_size()`` = 64
        tokens, matrix products inside a chunk and a scan over chunks); ``"reference"``: the recurrence
        one token at a time (float32, slow on long sequences: the tests' oracle); ``"tk"``: the forward
        kernels (H100/H200: bfloat16/float16, K 64 or 128, V a multiple of 64), which ``None`` also
        takes where they apply, with their backward kernels.

    Arithmetic is float32 on every path. Differentiable in q, k, v, g, beta and initial_state (JAX's
    autodiff of the path that runs). Works under ``jit`` and ``vmap``.

    Returns:
      ``(o, final_state)``: o ``[batch, T, value_heads, V]`` in v's dtype; final_state
      ``[N, value_heads, K, V]`` float32, or None unless ``output_final_state``.
    """
    scale, cu = _sequence_call(_GDR, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    l2 = _check_bool(_GDR, "use_qk_l2norm", use_qk_l2norm)
    return _run(_GDR, implementation, _Spec(scale, l2), q, k, v, g, beta, cu, initial_state, output_final_state,
                use_qk_l2norm=l2)


def simple_gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
               implementation=None):
    """Simple gated linear attention (a scalar decay per head), with the semantics of
    flash-linear-attention's ``chunk_simple_gla``. At token t::

        S <- S * exp(g_t) + k_t v_t^T
        o_t = scale * S^T q_t

    This is the core of Mamba-2's SSD (state space duality) layer, with ``q = C``, ``k = B``,
    ``v = dt * x`` and ``g = dt * A`` (per head: A < 0 a scalar, dt > 0 the step of each token); its
    ``D * x`` skip term and gating are outside.

    Arguments, results, paths and gradients as :func:`gated_delta_rule` (without beta and l2
    normalization): q, k ``[batch, T, heads, K]``, v ``[batch, T, value_heads, V]`` (``value_heads`` a
    multiple of ``heads``; flash-linear-attention's op has them equal), g ``[batch, T, value_heads]``.

    On H100/H200 the forward runs jax_tk's kernel (``implementation=None`` or ``"tk"``) for bfloat16 and
    float16 inputs with K 64 or 128 and V a multiple of 64, and its backward kernels for the gradient.
    """
    scale, cu = _sequence_call(_GLA, q, k, v, g, None, scale, initial_state, output_final_state, cu_seqlens)
    return _run(_GLA, implementation, _Spec(scale, False), q, k, v, g, None, cu, initial_state, output_final_state)


def _run(op, implementation, spec, q, k, v, g, beta, cu, initial_state, output_final_state, **reference_options):
    """A checked whole-sequence call: the kernel path where ``implementation`` and the call allow it,
    else the pure-JAX path it names."""
    run = _reference_path(op, implementation)
    if implementation == "reference" or not dispatch.use_kernel(op, implementation, launch.unsupported_reason(q, v)):
        if implementation == "reference" or not sharding.explicit(v):
            return run(q, k, v, g, beta, scale=spec.scale, initial_state=initial_state, cu_seqlens=cu,
                       output_final_state=bool(output_final_state), **reference_options)
        # Under explicit sharding the chunked path runs on the shards as the kernel path does, differentiated
        # by JAX: partitioned by XLA, a q/k head shared by several head shards was repeated to the value
        # heads replicated, and its backward gathered every value head's per-chunk cotangents.
        o, final = sharding.call(_layout(cu), _local_chunked, spec, v, q, k, g, beta, initial_state, cu)
    else:
        o, final = _kernel_path(spec, q, k, v, g, beta, cu, initial_state)
    return o, (final if output_final_state else None)


# The forward kernels (simple GLA's; the gated delta rule's where beta is given), with their backward
# kernels as the custom_vjp's backward on CUDA (_kernel_path_bwd); both go through the partitioning
# below, so that sharded inputs run on their shards.
@dataclasses.dataclass(frozen=True)
class _Spec:
    scale: float
    use_qk_l2norm: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kernel_path(spec: _Spec, q, k, v, g, beta, cu_seqlens, initial_state):
    """(o, final_state)."""
    return sharding.call(_layout(cu_seqlens), _local, spec, v, q, k, g, beta, initial_state, cu_seqlens)


def _layout(cu_seqlens):
    return _LAYOUT if cu_seqlens is None else _PACKED_LAYOUT


def _chunked(spec: _Spec, q, k, v, g, beta, cu_seqlens, initial_state):
    return reference.chunked(q, k, v, g, beta, scale=spec.scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                             output_final_state=True, use_qk_l2norm=spec.use_qk_l2norm, chunk_size=chunk_size())


def _local_chunked(spec: _Spec, v, q, k, g, beta, initial_state, cu_seqlens):
    """(o, final_state) of the chunked path on one device's arrays (the operands in _LAYOUT's order)."""
    return _chunked(spec, q, k, v, g, beta, cu_seqlens, initial_state)


def _kernel(spec: _Spec, q, k, v, g, beta, cu_seqlens, initial_state):
    if beta is None:
        return launch.gla_fwd(q, k, v, g, cu_seqlens, initial_state, spec.scale)
    if spec.use_qk_l2norm:
        q, k = _normalized(q), _normalized(k)
    return launch.gdr_fwd(q, k, v, g, beta, cu_seqlens, initial_state, spec.scale)


def _local(spec: _Spec, v, q, k, g, beta, initial_state, cu_seqlens):
    """(o, final_state) on one device's arrays: the kernels on CUDA, the chunked path elsewhere."""
    return dispatch.platform_dispatch(True, functools.partial(_kernel, spec), functools.partial(_chunked, spec),
                                      q, k, v, g, beta, cu_seqlens, initial_state)


def _kernel_path_fwd(spec, q, k, v, g, beta, cu_seqlens, initial_state):
    packed = cu_seqlens is not None
    if beta is None:
        layout = _PACKED_GLA_KEEP if packed else _GLA_KEEP
        o, ht, states = sharding.call(layout, _local_keep, spec, v, q, k, g, initial_state, cu_seqlens)
        return (o, ht), (q, k, v, g, beta, cu_seqlens, initial_state, states)
    # The gated delta rule: normalized here (its gradient by autodiff), then the kernels on q and k as
    # normalized, keeping what their backward takes.
    qn, kn = (_normalized(q), _normalized(k)) if spec.use_qk_l2norm else (q, k)
    layout = _PACKED_GDR_KEEP if packed else _GDR_KEEP
    o, ht, *kept = sharding.call(layout, _local_gdr_keep, _Spec(spec.scale, False), v, qn, kn, g, beta, initial_state,
                                 cu_seqlens)
    return (o, ht), (q, k, v, g, beta, cu_seqlens, initial_state, (qn, kn, *kept))


def _kernel_path_bwd(spec, res, cotangents):
    q, k, v, g, beta, cu_seqlens, initial_state, kept = res
    do, dht = cotangents
    packed = cu_seqlens is not None
    if beta is None:
        layout = _PACKED_GLA_BWD if packed else _GLA_BWD
        dv, dq, dk, dg, dh0 = sharding.call(layout, _local_gla_bwd, spec, v, q, k, g, initial_state, cu_seqlens, kept,
                                            do, dht, result_like=(0, 1, 2, 3, 4))
        dbeta = None
    else:
        qn, kn, *kept = kept
        layout = _PACKED_GDR_BWD if packed else _GDR_BWD
        dv, dq, dk, dg, dbeta, dh0 = sharding.call(layout, _local_gdr_bwd, _Spec(spec.scale, False), v, qn, kn, g, beta,
                                                   initial_state, cu_seqlens, *kept, do, dht,
                                                   result_like=(0, 1, 2, 3, 4, 5))
        if spec.use_qk_l2norm:
            dq, dk = jax.vjp(lambda q, k: (_normalized(q), _normalized(k)), q, k)[1]((dq, dk))
    return dq, dk, dv, dg, dbeta, None, None if initial_state is None else dh0.astype(initial_state.dtype)


def _normalized(x):
    return reference.l2norm(x).astype(x.dtype)


def _local_keep(spec: _Spec, v, q, k, g, initial_state, cu_seqlens):
    """Simple GLA's (o, final_state, the chunks' states) on one device's arrays; off CUDA the chunked
    path, with zeros for the states (its backward does not read them)."""
    def kernel(q, k, v, g, cu_seqlens, initial_state):
        o, ht, states = launch.gla_fwd(q, k, v, g, cu_seqlens, initial_state, spec.scale, keep_states=True)
        return o, ht, _states_view(states, q, cu_seqlens)

    def chunked(q, k, v, g, cu_seqlens, initial_state):
        o, ht = _chunked(spec, q, k, v, g, None, cu_seqlens, initial_state)
        shape = (launch.state_slots(q, cu_seqlens), v.shape[2], q.shape[3], v.shape[3])
        # (stand-ins for what the chunked backward does not read, typed as the kernel branch's results
        # inside shard_map, so that the platform dispatch's two branches have one type; likewise the zero
        # initial states of the backward's chunked branches, whose gradient is a per-device part)
        states = dispatch.zeros(shape, q.dtype, q, k, v, g, cu_seqlens, initial_state)
        return o, ht, _states_view(states, q, cu_seqlens)
    return dispatch.platform_dispatch(True, kernel, chunked, q, k, v, g, cu_seqlens, initial_state)


def _states_view(states, q, cu_seqlens):
    """The kernels' chunk states [slots, HV, K, V], batch-major ([B, chunks, HV, K, V]) where not packed,
    so that they split with the batch."""
    return states if cu_seqlens is not None else states.reshape(q.shape[0], -1, *states.shape[1:])


def _local_gdr_keep(spec: _Spec, v, q, k, g, beta, initial_state, cu_seqlens):
    """The gated delta rule's (o, final_state, states, W, U, T) on one device's arrays (q, k as the kernels
    take them); off CUDA the chunked path, with zeros for what its backward does not read."""
    def kernel(q, k, v, g, beta, cu_seqlens, initial_state):
        o, ht, states, w, u, tk = launch.gdr_fwd(q, k, v, g, beta, cu_seqlens, initial_state, spec.scale, keep=True)
        return o, ht, _states_view(states, q, cu_seqlens), w, u, tk

    def chunked(q, k, v, g, beta, cu_seqlens, initial_state):
        o, ht = _chunked(spec, q, k, v, g, beta, cu_seqlens, initial_state)
        (b, t, _, kd), (hv, vd) = q.shape, v.shape[2:]
        args = (q, k, v, g, beta, cu_seqlens, initial_state)
        states = dispatch.zeros((launch.state_slots(q, cu_seqlens), hv, kd, vd), q.dtype, *args)
        zeros = [dispatch.zeros(shape, q.dtype, *args) for shape in ((b, t, hv, kd), v.shape, (b, t, hv, chunk_size()))]
        return o, ht, _states_view(states, q, cu_seqlens), *zeros
    return dispatch.platform_dispatch(True, kernel, chunked, q, k, v, g, beta, cu_seqlens, initial_state)


def _local_gdr_bwd(spec: _Spec, v, q, k, g, beta, initial_state, cu_seqlens, states, w, u, tk, do, dht):
    """(dv, dq, dk, dg, dbeta, dh0) of the gated delta rule on one device's arrays (q, k as the kernels
    took them): the backward kernels on CUDA, the chunked path's gradient elsewhere."""
    def kernel(q, k, v, g, beta, cu_seqlens, initial_state, states, w, u, tk, do, dht):
        kept = (states.reshape(-1, *states.shape[-3:]), w, u, tk)
        dq, dk, dv, dg, dbeta, dh0 = launch.gdr_bwd(q, k, v, g, beta, cu_seqlens, kept, do, dht, spec.scale)
        return dv, dq, dk, dg.astype(g.dtype), dbeta.astype(beta.dtype), dh0

    def chunked(q, k, v, g, beta, cu_seqlens, initial_state, states, w, u, tk, do, dht):
        h0 = initial_state if initial_state is not None else dispatch.zeros(dht.shape, jnp.float32, q, k, v, g, beta,
                                                                            do, dht)
        f = lambda q, k, v, g, beta, h0: _chunked(spec, q, k, v, g, beta, cu_seqlens, h0)
        dq, dk, dv, dg, dbeta, dh0 = jax.vjp(f, q, k, v, g, beta, h0)[1]((do, dht))
        return dv, dq, dk, dg, dbeta, dh0.astype(jnp.float32)
    return dispatch.platform_dispatch(True, kernel, chunked, q, k, v, g, beta, cu_seqlens, initial_state, states, w, u,
                                      tk, do, dht)


def _local_gla_bwd(spec: _Spec, v, q, k, g, initial_state, cu_seqlens, states, do, dht):
    """(dv, dq, dk, dg, dh0) of simple GLA on one device's arrays: the backward kernels on CUDA, the
    chunked path's gradient elsewhere."""
    def kernel(q, k, v, g, cu_seqlens, initial_state, states, do, dht):
        flat = states.reshape(-1, *states.shape[-3:])
        dq, dk, dv, dg, dh0 = launch.gla_bwd(q, k, v, g, cu_seqlens, flat, do, dht, spec.scale)
        return dv, dq, dk, dg.astype(g.dtype), dh0

    def chunked(q, k, v, g, cu_seqlens, initial_state, states, do, dht):
        h0 = initial_state if initial_state is not None else dispatch.zeros(dht.shape, jnp.float32, q, k, v, g, do, dht)
        f = lambda q, k, v, g, h0: _chunked(spec, q, k, v, g, None, cu_seqlens, h0)
        dq, dk, dv, dg, dh0 = jax.vjp(f, q, k, v, g, h0)[1]((do, dht))
        return dv, dq, dk, dg, dh0.astype(jnp.float32)
    return dispatch.platform_dispatch(True, kernel, chunked, q, k, v, g, cu_seqlens, initial_state, states, do, dht)


_kernel_path.defvjp(_kernel_path_fwd, _kernel_path_bwd)

# Partitioning (jax_tk._core.sharding): batch "b" and value heads "n" split, q/k heads "k" their groups
# (beta "b t n", or None for simple GLA);
# packed sequences (batch 1) keep their states' "s" whole.
_LAYOUT = sharding.Layout(inputs=("b t n e", "b t k d", "b t k d", "b t n", "b t n", "b n d e", "c"),
                          outputs=("b t n e", "b n d e"), heads="n", grouped="k")
_PACKED_LAYOUT = sharding.Layout(inputs=("b t n e", "b t k d", "b t k d", "b t n", "b t n", "s n d e", "c"),
                                 outputs=("b t n e", "s n d e"), heads="n", grouped="k")
# Simple GLA's forward keeping the chunks' states ([B, chunks, HV, K, V], packed [slots, HV, K, V]), and
# its backward (v, q, k, g, initial state, offsets, states, do, dht -> dv, dq, dk, dg, dh0).
_GLA_KEEP = sharding.Layout(inputs=("b t n e", "b t k d", "b t k d", "b t n", "b n d e", "c"),
                            outputs=("b t n e", "b n d e", "b x n d e"), heads="n", grouped="k")
_PACKED_GLA_KEEP = sharding.Layout(inputs=("b t n e", "b t k d", "b t k d", "b t n", "s n d e", "c"),
                                   outputs=("b t n e", "s n d e", "x n d e"), heads="n", grouped="k")
# The gated delta rule's forward keeping (states, W, U, T) and its backward (v, q, k, g, beta, initial
# state, offsets, states, W, U, T, do, dht -> dv, dq, dk, dg, dbeta, dh0).
_GDR_KEEP = sharding.Layout(inputs=("b t n e", "b t k d", "b t k d", "b t n", "b t n", "b n d e", "c"),
                            outputs=("b t n e", "b n d e", "b x n d e", "b t n d", "b t n e", "b t n y"),
                            heads="n", grouped="k")
_PACKED_GDR_KEEP = sharding.Layout(inputs=("b t n e", "b t k d", "b t k d", "b t n", "b t n", "s n d e", "c"),
                                   outputs=("b t n e", "s n d e", "x n d e", "b t n d", "b t n e", "b t n y"),
                                   heads="n", grouped="k")
_GDR_BWD = sharding.Layout(inputs=("b t n e", "b t k d", "b t k d", "b t n", "b t n", "b n d e", "c", "b x n d e",
                                   "b t n d", "b t n e", "b t n y", "b t n e", "b n d e"),
                           outputs=("b t n e", "b t k d", "b t k d", "b t n", "b t n", "b n d e"), heads="n",
                           grouped="k")
_PACKED_GDR_BWD = sharding.Layout(inputs=("b t n e", "b t k d", "b t k d", "b t n", "b t n", "s n d e", "c", "x n d e",
                                          "b t n d", "b t n e", "b t n y", "b t n e", "s n d e"),
                                  outputs=("b t n e", "b t k d", "b t k d", "b t n", "b t n", "s n d e"), heads="n",
                                  grouped="k")
_GLA_BWD = sharding.Layout(inputs=("b t n e", "b t k d", "b t k d", "b t n", "b n d e", "c", "b x n d e", "b t n e",
                                   "b n d e"),
                           outputs=("b t n e", "b t k d", "b t k d", "b t n", "b n d e"), heads="n", grouped="k")
_PACKED_GLA_BWD = sharding.Layout(inputs=("b t n e", "b t k d", "b t k d", "b t n", "s n d e", "c", "x n d e",
                                          "b t n e", "s n d e"),
                                  outputs=("b t n e", "b t k d", "b t k d", "b t n", "s n d e"), heads="n", grouped="k")


def _step_call(op, q, k, v, g, beta, state, scale):
    lead = "batch"
    _check_qkv(op, q, k, v, lead)
    _check_gate(op, "g", g, v, lead)
    if beta is not None:
        _check_gate(op, "beta", beta, v, lead)
    (b, _, kd), (hv, vd) = q.shape, v.shape[1:]
    _check_state(op, "state", state, (b, hv, kd, vd), "batch")
    return _scale(op, scale, kd)


def gated_delta_rule_step(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm=False):
    """One new token per sequence of :func:`gated_delta_rule` (decoding): the recurrence's step, as a
    few fused XLA operations (element-wise products and two reductions over K; no kernel), exactly
    what the recurrence does at each token.

    Args:
      q, k: ``[batch, heads, K]``; v: ``[batch, value_heads, V]`` (one dtype, bfloat16, float16 or
        float32); g, beta: ``[batch, value_heads]``; state: ``[batch, value_heads, K, V]`` (the
        ``final_state`` of a :func:`gated_delta_rule` call, or of the previous step), read as float32.
      scale, use_qk_l2norm: as :func:`gated_delta_rule`.

    Returns:
      ``(o [batch, value_heads, V] in v's dtype, new_state [batch, value_heads, K, V] float32)``. With
      a float32 state the carry keeps its type, so the step can be the body of a ``lax.scan`` over
      generated tokens. Differentiable in every input.
    """
    scale = _step_call(_GDR_STEP, q, k, v, g, beta, state, scale)
    l2 = _check_bool(_GDR_STEP, "use_qk_l2norm", use_qk_l2norm)
    return reference.step(q, k, v, g, beta, state, scale=scale, use_qk_l2norm=l2)


def simple_gla_step(q, k, v, g, state, *, scale=None):
    """One new token per sequence of :func:`simple_gla` (decoding): ``S <- S * exp(g) + k v^T``,
    ``o = scale * S^T q``, as a few fused XLA operations. Shapes and results as
    :func:`gated_delta_rule_step` (without beta)."""
    scale = _step_call(_GLA_STEP, q, k, v, g, None, state, scale)
    return reference.step(q, k, v, g, None, state, scale=scale)
