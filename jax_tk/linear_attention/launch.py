"""The linear-attention kernels' FFI calls (cc/linear_attention/ffi.cc): operands and attributes.

Simple GLA's forward (Hopper): ``q, k [B, T, H, K]``, ``v [B, T, HV, V]`` in bfloat16 or float16, the
log decays as float32 ``[B, HV, T]`` (head-major, so that a chunk's decays are contiguous), the packed
sequences' offsets (int32 ``[N + 1]``, or shape ``(0,)``) and the initial states (float32
``[N, HV, K, V]``, or shape ``(0,)``: zeros); results ``o [B, T, HV, V]`` in q's dtype, the final
states float32 ``[N, HV, K, V]`` and, for the backward, each chunk's starting state (``[state_slots,
HV, K, V]`` in q's dtype, or shape ``(0,)``: not kept). Its backward takes the same inputs, the states,
``dout`` and the final states' cotangent, and returns dq, dk (float32 per value head; like q where
``HV == H``), dv, dg (float32 ``[B, HV, T]``), the initial states' gradient and a workspace. The gated
delta rule's forward: beta (float32 ``[B, HV, T]``) after g; after the final states the solve's T
(``[B, T, HV, 64]`` in q's dtype, a workspace where not kept), then what its backward keeps besides T
(W ``[B, T, HV, K]``, the states, U ``[B, T, HV, V]``; shape ``(0,)``: not kept); its backward also
returns dbeta.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_tk._core import dispatch, extension, ffi
from jax_tk._core.ffi import kernel_call

GLA_FWD = ffi.target("jax_tk_simple_gla_fwd")
GLA_BWD = ffi.target("jax_tk_simple_gla_bwd")
GDR_FWD = ffi.target("jax_tk_gated_delta_rule_fwd")
GDR_BWD = ffi.target("jax_tk_gated_delta_rule_bwd")
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)
K_DIMS = (64, 128)


def contract() -> dict[str, int]:
    return extension.contract("linear_attention")


def unsupported_reason(q, v) -> str | None:
    """Why the forward kernels (simple GLA's, the gated delta rule's) cannot take a call with these q
    and v, as ``implementation="tk"``'s error names it; None if they can."""
    if not any(q.dtype == d for d in KERNEL_DTYPES):
        return f"dtype {q.dtype} (the kernel takes bfloat16 and float16)"
    if q.shape[-1] not in K_DIMS:
        return f"K = {q.shape[-1]} (the kernel takes K = 64 or 128)"
    if v.shape[-1] % contract()["V_SLICE"] != 0:
        return f"V = {v.shape[-1]} (the kernel takes a multiple of {contract()['V_SLICE']})"
    if not extension.takes_sm90_kernels(extension.cuda_device_capability(), dispatch.kernel_variant()):
        return "this GPU (the linear-attention kernels run on H100/H200, sm_90a, only)"
    return None


def _head_major(x):
    return jnp.transpose(x.astype(jnp.float32), (0, 2, 1))


def _sequence_operands(cu_seqlens, initial_state):
    return (jnp.zeros((0,), jnp.int32) if cu_seqlens is None else cu_seqlens.astype(jnp.int32),
            jnp.zeros((0,), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32))


def _out_types(q, v, cu_seqlens):
    b, t, _, kd = q.shape
    hv, vd = v.shape[2:]
    n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return jax.ShapeDtypeStruct((b, t, hv, vd), q.dtype), jax.ShapeDtypeStruct((n, hv, kd, vd), jnp.float32)


def state_slots(q, cu_seqlens) -> int:
    """Slots of the chunks' kept states (the header's formula ``state_slots``)."""
    b, t = q.shape[:2]
    n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return extension.formulas("linear_attention").state_slots(b, t, n, cu_seqlens is not None)


def _attributes(scale: float) -> dict:
    return dict(scale=np.float32(scale), variant=np.int32(dispatch.kernel_variant()))


def gla_fwd(q, k, v, g, cu_seqlens, initial_state, scale: float, out_init=None, keep_states: bool = False):
    """``(o, final_state)`` of simple GLA's forward kernel (``cu_seqlens``, ``initial_state``: None
    or arrays, as the op takes them), and with ``keep_states`` each chunk's starting state
    ``[state_slots, HV, K, V]`` for :func:`gla_bwd`. ``out_init`` (tests): buffers aliased to the
    results."""
    hv, kd, vd = v.shape[2], q.shape[3], v.shape[3]
    states = (state_slots(q, cu_seqlens), hv, kd, vd) if keep_states else (0,)
    out_types = (*_out_types(q, v, cu_seqlens), jax.ShapeDtypeStruct(states, q.dtype))
    operands = (q, k, v, _head_major(g), *_sequence_operands(cu_seqlens, initial_state))
    o, ht, s = kernel_call(GLA_FWD, out_types, operands, _attributes(scale), out_init=out_init)
    return (o, ht, s) if keep_states else (o, ht)


def _dqk(q, v):
    """The backward kernels' dq and dk type, and what makes q's gradient of them: with one value head a
    head, the kernels write q's dtype; with a group, float32 per value head, which the group sums."""
    b, t, h, kd = q.shape
    hv = v.shape[2]
    if hv == h:
        return jax.ShapeDtypeStruct(q.shape, q.dtype), lambda x: x
    return (jax.ShapeDtypeStruct((b, t, hv, kd), jnp.float32),
            lambda x: x.reshape(b, t, h, hv // h, kd).sum(axis=3).astype(q.dtype))


def gla_bwd(q, k, v, g, cu_seqlens, states, dout, dht, scale: float, out_init=None):
    """Simple GLA's backward kernels: ``(dq, dk, dv, dg, dh0)`` with dq, dk in q's dtype (a group's
    value heads summed), dv in v's, dg float32 ``[B, T, HV]`` and dh0 float32 ``[N, HV, K, V]``;
    ``states`` from :func:`gla_fwd`, ``dht`` the final states' cotangent or None."""
    per_head, group = _dqk(q, v)
    b, t, hv = v.shape[:3]
    out_types = (per_head, per_head, jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct((b, hv, t), jnp.float32),
                 _out_types(q, v, cu_seqlens)[1], jax.ShapeDtypeStruct(states.shape, states.dtype))
    seq = _sequence_operands(cu_seqlens, None)[0]
    dht = jnp.zeros((0,), jnp.float32) if dht is None else dht.astype(jnp.float32)
    operands = (q, k, v, _head_major(g), seq, states, dout.astype(v.dtype), dht)
    dq, dk, dv, dg, dh0, _ = kernel_call(GLA_BWD, out_types, operands, _attributes(scale), out_init=out_init)
    return group(dq), group(dk), dv, jnp.transpose(dg, (0, 2, 1)), dh0


def gdr_fwd(q, k, v, g, beta, cu_seqlens, initial_state, scale: float, out_init=None, keep: bool = False):
    """``(o, final_state)`` of the gated delta rule's forward kernels (q and k already normalized where
    the op asks), and with ``keep`` what :func:`gdr_bwd` takes: the chunks' states ``[state_slots, HV,
    K, V]``, W ``[B, T, HV, K]``, U ``[B, T, HV, V]`` and T ``[B, T, HV, 64]``, all in q's dtype.
    ``out_init`` (tests): buffers aliased to the results (o, final_state, T, W, states, U)."""
    b, t, _, kd = q.shape
    hv, vd = v.shape[2:]
    sds = jax.ShapeDtypeStruct
    kept = ((b, t, hv, kd), (state_slots(q, cu_seqlens), hv, kd, vd), v.shape) if keep else ((0,),) * 3
    out_types = (*_out_types(q, v, cu_seqlens), sds((b, t, hv, contract()["CHUNK"]), q.dtype),
                 *(sds(shape, q.dtype) for shape in kept))
    operands = (q, k, v, _head_major(g), _head_major(beta), *_sequence_operands(cu_seqlens, initial_state))
    o, ht, tk, w, states, u = kernel_call(GDR_FWD, out_types, operands, _attributes(scale), out_init=out_init)
    return (o, ht, states, w, u, tk) if keep else (o, ht)


def gdr_bwd(q, k, v, g, beta, cu_seqlens, kept, dout, dht, scale: float, out_init=None):
    """The gated delta rule's backward kernels: ``(dq, dk, dv, dg, dbeta, dh0)`` as :func:`gla_bwd`'s,
    dbeta float32 ``[B, T, HV]``; ``kept``: (states, W, U, T) from :func:`gdr_fwd`, q and k as it took
    them (normalized where the op asks; their gradients are those of the normalized q and k)."""
    states, w, u, tk = kept
    per_head, group = _dqk(q, v)
    gate = jax.ShapeDtypeStruct((v.shape[0], v.shape[2], v.shape[1]), jnp.float32)
    out_types = (per_head, per_head, jax.ShapeDtypeStruct(v.shape, v.dtype), gate, gate, _out_types(q, v, cu_seqlens)[1],
                 jax.ShapeDtypeStruct(states.shape, states.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
    seq = _sequence_operands(cu_seqlens, None)[0]
    dht = jnp.zeros((0,), jnp.float32) if dht is None else dht.astype(jnp.float32)
    operands = (q, k, v, _head_major(g), _head_major(beta), seq, states, w, u, tk, dout.astype(v.dtype), dht)
    dq, dk, dv, dg, dbeta, dh0, _, _ = kernel_call(GDR_BWD, out_types, operands, _attributes(scale), out_init=out_init)
    return group(dq), group(dk), dv, jnp.transpose(dg, (0, 2, 1)), jnp.transpose(dbeta, (0, 2, 1)), dh0
