"""The linear-attention kernels' FFI calls (cc/linear_attention/ffi.cc): operands and attributes.

Simple GLA's forward (Hopper): ``q, k [B, T, H, K]``, ``v [B, T, HV, V]`` in bfloat16 or float16, the
log decays as float32 ``[B, HV, T]`` (head-major, so that a chunk's decays are contiguous), the packed
sequences' offsets (int32 ``[N + 1]``, or shape ``(0,)``) and the initial states (float32
``[N, HV, K, V]``, or shape ``(0,)``: zeros); results ``o [B, T, HV, V]`` in q's dtype and the final
states float32 ``[N, HV, K, V]``. The gated delta rule's: beta (float32 ``[B, HV, T]``) after g, and
two workspaces after the final states (each chunk's W and U', in q's dtype).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_tk._core import dispatch, extension, ffi
from jax_tk._core.ffi import kernel_call

GLA_FWD = ffi.target("jax_tk_simple_gla_fwd")
GDR_FWD = ffi.target("jax_tk_gated_delta_rule_fwd")
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


def _attributes(scale: float) -> dict:
    return dict(scale=np.float32(scale), variant=np.int32(dispatch.kernel_variant()))


def gla_fwd(q, k, v, g, cu_seqlens, initial_state, scale: float, out_init=None):
    """``(o, final_state)`` of simple GLA's forward kernel (``cu_seqlens``, ``initial_state``: None
    or arrays, as the op takes them). ``out_init`` (tests): buffers aliased to (o, final_state)."""
    operands = (q, k, v, _head_major(g), *_sequence_operands(cu_seqlens, initial_state))
    return kernel_call(GLA_FWD, _out_types(q, v, cu_seqlens), operands, _attributes(scale), out_init=out_init)


def gdr_fwd(q, k, v, g, beta, cu_seqlens, initial_state, scale: float, out_init=None):
    """``(o, final_state)`` of the gated delta rule's forward kernels (q and k already normalized where
    the op asks); as :func:`gla_fwd`, ``out_init`` aliased to (o, final_state, W, U')."""
    b, t, _, kd = q.shape
    hv = v.shape[2]
    out_types = (*_out_types(q, v, cu_seqlens), jax.ShapeDtypeStruct((b, t, hv, kd), q.dtype),
                 jax.ShapeDtypeStruct(v.shape, q.dtype))
    operands = (q, k, v, _head_major(g), _head_major(beta), *_sequence_operands(cu_seqlens, initial_state))
    return kernel_call(GDR_FWD, out_types, operands, _attributes(scale), out_init=out_init)[:2]
