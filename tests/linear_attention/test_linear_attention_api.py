"""CPU tests of jax_tk.linear_attention's API: the decoding steps against the recurrence (in a
``lax.scan`` after a chunked prefill), vmap and jit, the implementation= choice, and every input check."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from helpers import needs_extension, rel_err
from jax_tk import linear_attention as la
from jax_tk._core import extension, ffi
from jax_tk.linear_attention import launch
from test_linear_attention import SHAPE, TOL, evaluate, inputs, run

F16, F32 = jnp.float16, jnp.float32


@pytest.mark.parametrize("delta", [True, False])
def test_steps_match_the_recurrence(delta):
    """Steps in a lax.scan (the decoding loop), after a chunked prefill of 40 tokens for the delta rule
    (from the initial state for simple GLA): outputs and states equal the recurrence's over all 49."""
    q, k, v, g, beta, state, _ = inputs(20, 2, 49, 2, 4, 16, 16, delta=delta)
    prefill = 40 if delta else 0

    @jax.jit
    def generate(q, k, v, g, beta, state):
        head = lambda x: None if x is None else x[:, :prefill]
        o = jnp.zeros((q.shape[0], 0, *v.shape[2:]), v.dtype)
        if prefill:
            o, state = la.gated_delta_rule(*map(head, (q, k, v, g, beta)), initial_state=state,
                                           output_final_state=True, use_qk_l2norm=True)

        def body(s, xs):
            qt, kt, vt, gt, bt = xs
            if delta:
                return la.gated_delta_rule_step(qt, kt, vt, gt, bt, s, use_qk_l2norm=True)[::-1]
            return la.simple_gla_step(qt, kt, vt, gt, s)[::-1]

        tail = lambda x: None if x is None else jnp.moveaxis(x[:, prefill:], 1, 0)
        state, o_steps = jax.lax.scan(body, state, tuple(map(tail, (q, k, v, g, beta))))
        return jnp.concatenate([o, jnp.moveaxis(o_steps, 0, 1)], axis=1), state

    o, s = generate(q, k, v, g, beta, state)
    (o_ref, s_ref), _ = evaluate(q, k, v, g, beta, state, implementation="reference", use_qk_l2norm=delta)
    assert s.dtype == F32 and o.shape == v.shape
    assert rel_err(o, o_ref) < TOL and rel_err(s, s_ref) < TOL


def test_step_dtypes_and_default_scale():
    """A float16 step: the output in float16, the state float32; the default scale is K ** -0.5."""
    q, k, v, g, beta, state, _ = inputs(21, 3, 1, 1, 2, 4, 8)
    cast = lambda x: x[:, 0].astype(F16)
    o, s = jax.jit(la.gated_delta_rule_step)(cast(q), cast(k), cast(v), g[:, 0], beta[:, 0], state)
    assert o.dtype == F16 and s.dtype == F32
    o2, s2 = jax.jit(functools.partial(la.gated_delta_rule_step, scale=0.125))(cast(q), cast(k), cast(v), g[:, 0],
                                                                                beta[:, 0], state)
    np.testing.assert_array_equal(s, s2)  # (the scale reads the state; it does not write it)
    assert rel_err(o2.astype(F32) * 4, o.astype(F32)) < 2e-3  # default 4 ** -0.5 = 4 * 0.125


def test_vmap_and_implementations():
    """vmap over the batch (each example a batch of 1) equals the batched call; "xla" is the default
    path; no final state unless asked."""
    q, k, v, g, beta, state, ct = inputs(3, **SHAPE)  # (the batched call's compilation is shared)

    def one(q, k, v, g, beta, state):
        o, f = la.gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], initial_state=state[None],
                                   output_final_state=True, use_qk_l2norm=True, implementation="xla")
        return o[0], f[0]

    o_mapped, f_mapped = jax.jit(jax.vmap(one))(q, k, v, g, beta, state)
    (o, f), _ = evaluate(q, k, v, g, beta, state, ct, use_qk_l2norm=True)
    np.testing.assert_allclose(o_mapped, o, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(f_mapped, f, rtol=1e-6, atol=1e-6)
    assert jax.eval_shape(lambda: la.gated_delta_rule(q, k, v, g, beta))[1] is None


def test_exported_from_the_package():
    assert jax_tk.linear_attention is la
    assert {"gated_delta_rule", "simple_gla", "gated_delta_rule_step", "simple_gla_step"} <= set(la.__all__)


def test_the_kernels_refuse_with_the_reason():
    """The forward kernels refuse float32 (these inputs) with the reason, as any unsupported call."""
    q, k, v, g, beta, _, _ = inputs(23, 1, 8, 1, 1, 4, 4)
    with pytest.raises(ValueError, match=r"gated_delta_rule\(implementation='tk'\): unsupported dtype float32"):
        la.gated_delta_rule(q, k, v, g, beta, implementation="tk")
    with pytest.raises(ValueError, match=r"simple_gla\(implementation='tk'\): unsupported dtype float32"):
        la.simple_gla(q, k, v, g, implementation="tk")
    with pytest.raises(ValueError, match="implementation must be one of"):
        la.gated_delta_rule(q, k, v, g, beta, implementation="cuda")


def test_cuda_lowering_without_the_kernel():
    """Lowered for CUDA where the kernel does not run (no H100/H200 here), simple_gla is the chunked path:
    no custom call."""
    sds = jax.ShapeDtypeStruct
    args = (sds((2, 128, 2, 128), jnp.bfloat16),) * 2 + (sds((2, 128, 2, 128), jnp.bfloat16), sds((2, 128, 2), F32))
    if extension.cuda_device_capability() == (9, 0):
        pytest.skip("an H100/H200 here: the dispatch takes the kernel (tests/linear_attention/test_gla_kernel_gpu.py)")
    text = jax.export.export(jax.jit(lambda q, k, v, g: la.simple_gla(q, k, v, g)[0]), platforms=["cuda"])(*args).mlir_module()
    assert "custom_call" not in text


@needs_extension
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_cuda_lowering_of_the_gla_kernel(packed):
    """The forward kernel's call exported for CUDA: q, k, v as given, g float32 head-major [B, HV, T], the
    offsets and initial states (or empty operands), o in q's dtype and the float32 final states."""
    sds = jax.ShapeDtypeStruct
    b, n = (1, 3) if packed else (2, 2)
    q, v, g = sds((b, 100, 2, 128), jnp.bfloat16), sds((b, 100, 4, 64), jnp.bfloat16), sds((b, 100, 4), jnp.bfloat16)
    cu = sds((n + 1,), jnp.int32) if packed else None
    h0 = sds((n, 4, 128, 64), F32)
    fn = jax.jit(lambda q, k, v, g, cu, h0: launch.gla_fwd(q, k, v, g, cu, h0, 0.25))
    exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=ffi.export_checks())(q, q, v, g, cu, h0)
    assert [a.shape for a in exported.out_avals] == [(b, 100, 4, 64), (n, 4, 128, 64)]
    assert exported.out_avals[0].dtype == jnp.bfloat16 and exported.out_avals[1].dtype == F32
    call = re.search(r"@jax_tk_simple_gla_fwd\(.*?\) \{.*?\} : \((.*?)\) -> \((.*?)\)", exported.mlir_module(), re.S)
    operands = re.findall(r"tensor<[^>]*>", call.group(1))
    assert operands[3] == f"tensor<{b}x4x100xf32>"  # g, head-major
    assert operands[4] == (f"tensor<{n + 1}xi32>" if packed else "tensor<0xi32>")
    assert operands[5] == f"tensor<{n}x4x128x64xf32>"


@needs_extension
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_cuda_lowering_of_the_gla_backward(packed):
    """simple_gla's gradient exported for CUDA: the forward keeps the chunks' states ([state_slots, HV, K,
    V] in q's dtype: batch x chunks, or packed T // 64 + sequences) for the backward target, which returns
    dq and dk per value head in float32, dv, dg head-major, dh0 and its workspace."""
    sds = jax.ShapeDtypeStruct
    b, n = (1, 3) if packed else (2, 2)
    q, v, g = sds((b, 100, 2, 128), jnp.bfloat16), sds((b, 100, 4, 64), jnp.bfloat16), sds((b, 100, 4), F32)
    cu = sds((n + 1,), jnp.int32) if packed else None
    slots = 100 // 64 + n if packed else b * 2

    def loss(q, k, v, g, cu):  # (the kernel path itself: the op would see no Hopper GPU here)
        o, s = la.api._kernel_path(la.api._Spec(0.25, False), q, k, v, g, None, cu, None)
        return jnp.sum(o.astype(F32)) + jnp.sum(s)
    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    text = jax.export.export(fn, platforms=["cuda"], disabled_checks=ffi.export_checks())(q, q, v, g, cu).mlir_module()
    fwd = re.search(r"@jax_tk_simple_gla_fwd\(.*?\) \{.*?\} : \((.*?)\) -> \((.*?)\)", text, re.S)
    assert re.findall(r"tensor<[^>]*>", fwd.group(2))[2] == f"tensor<{slots}x4x128x64xbf16>"
    bwd = re.search(r"@jax_tk_simple_gla_bwd\(.*?\) \{.*?\} : \((.*?)\) -> \((.*?)\)", text, re.S)
    operands, results = (re.findall(r"tensor<[^>]*>", bwd.group(i)) for i in (1, 2))
    assert operands[5] == f"tensor<{slots}x4x128x64xbf16>" and operands[6] == f"tensor<{b}x100x4x64xbf16>"
    assert results[:4] == [f"tensor<{b}x100x4x128xf32>"] * 2 + [f"tensor<{b}x100x4x64xbf16>", f"tensor<{b}x4x100xf32>"]


@needs_extension
def test_cuda_lowering_of_the_delta_rule_kernel():
    """The gated delta rule's call: beta head-major after g; the solve's T as a workspace after the states."""
    sds = jax.ShapeDtypeStruct
    q, v, g = sds((2, 100, 2, 64), jnp.float16), sds((2, 100, 4, 128), jnp.float16), sds((2, 100, 4), F32)
    fn = jax.jit(lambda q, k, v, g, beta: launch.gdr_fwd(q, k, v, g, beta, None, None, 0.25))
    exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=ffi.export_checks())(q, q, v, g, g)
    assert [a.shape for a in exported.out_avals] == [(2, 100, 4, 128), (2, 4, 64, 128)]
    call = re.search(r"@jax_tk_gated_delta_rule_fwd\(.*?\) \{.*?\} : \((.*?)\) -> \((.*?)\)", exported.mlir_module(), re.S)
    assert re.findall(r"tensor<[^>]*>", call.group(1))[3:5] == ["tensor<2x4x100xf32>"] * 2
    assert re.findall(r"tensor<[^>]*>", call.group(2)) == ["tensor<2x100x4x128xf16>", "tensor<2x4x64x128xf32>",
                                                           "tensor<2x100x4x64xf16>", *["tensor<0xf16>"] * 3]  # (nothing kept)


@needs_extension
def test_cuda_lowering_of_the_delta_rule_backward():
    """The gated delta rule's gradient exported for CUDA: the forward keeps the states, W, U and T, which
    the backward target takes after beta and the offsets; it returns dbeta after dg."""
    sds = jax.ShapeDtypeStruct
    q, v, g = sds((2, 100, 2, 64), jnp.bfloat16), sds((2, 100, 4, 128), jnp.bfloat16), sds((2, 100, 4), F32)

    def loss(q, k, v, g, beta):  # (the kernel path itself: the op would see no Hopper GPU here)
        o, s = la.api._kernel_path(la.api._Spec(0.25, True), q, k, v, g, beta, None, None)
        return jnp.sum(o.astype(F32)) + jnp.sum(s)
    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    text = jax.export.export(fn, platforms=["cuda"], disabled_checks=ffi.export_checks())(q, q, v, g, g).mlir_module()
    fwd = re.search(r"@jax_tk_gated_delta_rule_fwd\(.*?\) \{.*?\} : \((.*?)\) -> \((.*?)\)", text, re.S)
    assert re.findall(r"tensor<[^>]*>", fwd.group(2))[2:] == ["tensor<2x100x4x64xbf16>", "tensor<2x100x4x64xbf16>",
                                                              "tensor<4x4x64x128xbf16>", "tensor<2x100x4x128xbf16>"]
    bwd = re.search(r"@jax_tk_gated_delta_rule_bwd\(.*?\) \{.*?\} : \((.*?)\) -> \((.*?)\)", text, re.S)
    operands, results = (re.findall(r"tensor<[^>]*>", bwd.group(i)) for i in (1, 2))
    assert operands[4] == "tensor<2x4x100xf32>" and operands[6:10] == [
        "tensor<4x4x64x128xbf16>", "tensor<2x100x4x64xbf16>", "tensor<2x100x4x128xbf16>", "tensor<2x100x4x64xbf16>"]
    assert results[:5] == ["tensor<2x100x4x64xf32>"] * 2 + ["tensor<2x100x4x128xbf16>"] + ["tensor<2x4x100xf32>"] * 2


@needs_extension
@pytest.mark.parametrize("delta", [False, True], ids=["gla", "delta"])
def test_cuda_lowering_of_a_backward_without_groups(delta):
    """With a value head per head the backward targets write dq and dk like q (no float32 per value head
    for the caller to sum)."""
    sds = jax.ShapeDtypeStruct
    q, v, g = sds((2, 100, 4, 64), jnp.bfloat16), sds((2, 100, 4, 128), jnp.bfloat16), sds((2, 100, 4), F32)

    def loss(q, k, v, g, beta):
        o, s = la.api._kernel_path(la.api._Spec(0.25, delta), q, k, v, g, beta if delta else None, None, None)
        return jnp.sum(o.astype(F32)) + jnp.sum(s)
    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    text = jax.export.export(fn, platforms=["cuda"], disabled_checks=ffi.export_checks())(q, q, v, g, g).mlir_module()
    target = "jax_tk_gated_delta_rule_bwd" if delta else "jax_tk_simple_gla_bwd"
    bwd = re.search(rf"@{target}\(.*?\) \{{.*?\}} : \((.*?)\) -> \((.*?)\)", text, re.S)
    assert re.findall(r"tensor<[^>]*>", bwd.group(2))[:3] == ["tensor<2x100x4x64xbf16>"] * 2 + ["tensor<2x100x4x128xbf16>"]


# ----------------------------------------------------------------------------------------------
# Input checks: every bad argument raises, at trace time, naming it
# ----------------------------------------------------------------------------------------------

B, T, H, HV, K, V = 1, 8, 2, 4, 4, 6


def good(**changes):
    """Valid gated_delta_rule arguments (numpy: checked, never computed), with ``changes``."""
    z = lambda *shape, dtype=np.float32: np.zeros(shape, dtype)
    args = dict(q=z(B, T, H, K), k=z(B, T, H, K), v=z(B, T, HV, V), g=z(B, T, HV), beta=z(B, T, HV))
    args.update(changes)
    return args


BAD = [
    (dict(q=np.zeros((B, T, K), np.float32)), ValueError, "q must have rank 4"),
    (dict(q=np.zeros((B, T, H, K), np.int32)), TypeError, "q must be bfloat16, float16 or float32"),
    (dict(q="q"), TypeError, "q must be an array"),
    (dict(k=np.zeros((B, T, H, K + 1), np.float32)), ValueError, "k must have q's shape"),
    (dict(v=np.zeros((B, T, HV, V), np.float16)), TypeError, "one dtype"),
    (dict(v=np.zeros((B, T + 1, HV, V), np.float32)), ValueError, r"\[batch, T\] of v"),
    (dict(v=np.zeros((B, T, 3, V), np.float32)), ValueError, "multiple of the number of q/k heads"),
    (dict(g=np.zeros((B, T, H), np.float32)), ValueError, "g must have shape"),
    (dict(g=np.zeros((B, T, HV), np.float64)), TypeError, "g must be bfloat16"),
    (dict(beta=np.zeros((B, T, HV, 1), np.float32)), ValueError, "beta must have rank 3"),
    (dict(q=np.zeros((B, 0, H, K), np.float32), k=np.zeros((B, 0, H, K), np.float32)), ValueError, "empty"),
    (dict(initial_state=np.zeros((B, HV, K, V + 1), np.float32)), ValueError,
     r"initial_state must have shape.*N = batch"),
    (dict(initial_state=np.zeros((B, HV, K), np.float32)), ValueError, "initial_state must have rank 4"),
    (dict(cu_seqlens=np.array([0, 3, 8], np.float32)), TypeError, "integer dtype"),
    (dict(cu_seqlens=np.array([[0, 8]], np.int32)), ValueError, "cu_seqlens must have rank 1"),
    (dict(cu_seqlens=np.array([0], np.int32)), ValueError, "N \\+ 1 >= 2"),
    (dict(cu_seqlens=np.array([0, 3, 7], np.int32)), ValueError, "rise from 0 to T = 8"),
    (dict(cu_seqlens=np.array([0, 5, 3, 8], np.int32)), ValueError, "never falling"),
    (dict(cu_seqlens=np.array([1, 8], np.int32)), ValueError, "rise from 0"),
    (dict(cu_seqlens=np.array([0, 3, 8], np.int32), initial_state=np.zeros((1, HV, K, V), np.float32)),
     ValueError, "number of sequences of cu_seqlens"),
    (dict(scale=-1.0), ValueError, "scale must be a positive float"),
    (dict(scale="big"), TypeError, "scale must be a Python float"),
    (dict(output_final_state=1), TypeError, "output_final_state must be a bool"),
    (dict(use_qk_l2norm="yes"), TypeError, "use_qk_l2norm must be a bool"),
]


@pytest.mark.parametrize("changes,error,match", BAD)
def test_bad_inputs(changes, error, match):
    with pytest.raises(error, match=match):
        la.gated_delta_rule(**good(**changes))


def test_cu_seqlens_needs_a_batch_of_one():
    args = good(**{x: np.zeros((2, *good()[x].shape[1:]), np.float32) for x in ("q", "k", "v", "g", "beta")})
    with pytest.raises(ValueError, match="batch of 1, got batch 2"):
        la.gated_delta_rule(**args, cu_seqlens=np.array([0, 8], np.int32))


def test_bad_simple_gla_and_step_inputs():
    a = good()
    with pytest.raises(ValueError, match="simple_gla: g must have shape"):
        la.simple_gla(a["q"], a["k"], a["v"], a["g"][..., :H])
    state = np.zeros((B, HV, K, V), np.float32)
    step = lambda x: x[:, 0]
    with pytest.raises(ValueError, match="gated_delta_rule_step: q must have rank 3"):
        la.gated_delta_rule_step(a["q"], a["k"], step(a["v"]), step(a["g"]), step(a["beta"]), state)
    with pytest.raises(ValueError, match=r"simple_gla_step: state must have shape .*\(1, 4, 4, 6\)"):
        la.simple_gla_step(step(a["q"]), step(a["k"]), step(a["v"]), step(a["g"]), state[..., :3])
    with pytest.raises(ValueError, match="gated_delta_rule_step: beta must have shape"):
        la.gated_delta_rule_step(step(a["q"]), step(a["k"]), step(a["v"]), step(a["g"]), step(a["g"])[:, :2], state)


@pytest.mark.parametrize("delta", [False, True], ids=["gla", "delta"])
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_the_kernel_path_off_the_gpu(packed, delta):
    """The kernel path's wrapping (custom_vjp, partitioning, dispatch), which runs the chunked path off
    CUDA: the same outputs, final states and gradients as the op's chunked path, with and without an
    initial state (the delta rule with l2 normalization)."""
    with jax.default_device(jax.local_devices(backend="cpu")[0]):  # (on a GPU the path would take the kernels)
        q, k, v, g, beta, state, (do, dstate) = inputs(31, 1 if packed else 2, 70, 2, 4, 8, 8, delta=delta,
                                                       n_states=3 if packed else None)
        cu = jnp.asarray([0, 1, 33, 70], jnp.int32) if packed else None
        spec = la.api._Spec(0.3, delta)
        for h0 in (state, None):
            def loss(fn, q, k, v, g, beta, h0):
                o, s = fn(q, k, v, g, beta, h0)
                return jnp.sum(o * do) + jnp.sum(s * dstate)
            path = lambda q, k, v, g, beta, h0: la.api._kernel_path(spec, q, k, v, g, beta, cu, h0)
            xla = lambda q, k, v, g, beta, h0: run("xla", q, k, v, g, beta, h0, scale=0.3, cu_seqlens=cu,
                                                   use_qk_l2norm=delta)
            argnums = (0, 1, 2, 3) + ((4,) if delta else ()) + ((5,) if h0 is not None else ())
            got, want = (jax.jit(jax.value_and_grad(functools.partial(loss, fn), argnums=argnums))(q, k, v, g, beta, h0)
                         for fn in (path, xla))
            assert rel_err(got[0], want[0]) < TOL
            for a, b in zip(got[1], want[1]):
                assert rel_err(np.asarray(a), np.asarray(b)) < TOL
