"""jax_tk.linear_attention on several devices (CPU, 8 fake host devices): gated_delta_rule and simple_gla
under jit with inputs sharded over batch, over heads and over both (explicit and auto sharding; grouped
value heads split with their q/k head, or sharing one q/k head among several devices), inside shard_map
and vmap, and packed sequences (cu_seqlens) with their heads split. Outputs, final states and the
gradients in q, k, v, g, beta and initial_state match one device's; the compiled programs have no
collectives, except the sums of dq and dk over the devices that share a q/k head.

Two paths are partitioned. The op as it runs off H100/H200 (here, and for float32) is the chunked XLA
path: XLA partitions it under auto sharding, and under explicit sharding jax_tk runs it on the shards
(a shard_map, differentiated by JAX). The kernel path (``api._kernel_path``: the custom_vjp and the
partitioning around the CUDA kernels, which runs the chunked path off CUDA) is split by jax_tk itself:
shard_map for explicit sharding, custom_partitioning for auto. Its CUDA lowering (checked without a GPU
through jax.export) runs the kernels on the local shards.

Unless this process already has 8 CPU devices, ``test_in_subprocess`` reruns this file in a fresh
Python with them (see tests/helpers.py).
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from helpers import collectives, multi_device_tests, needs_extension, rel_err
from jax_tk import linear_attention as la
from jax_tk._core import ffi

F32 = jnp.float32


test_in_subprocess, needs_devices = multi_device_tests(__file__)

# ----------------------------------------------------------------------------------------------
# Inputs, the two ops on both paths, and their gradients
# ----------------------------------------------------------------------------------------------

# Two chunks of 64 tokens (the second one partial); grouped value heads (4 per q/k head).
B, T, H, HV, K, V = 4, 72, 2, 8, 16, 16
SCALE = K ** -0.5
TOL = 1e-5  # float32 on one device and on shards: the same arithmetic up to the order of some sums
# Every program is compiled at XLA's backend optimization level 0: the partitioning and its collectives are
# the same (the SPMD partitioner runs before the backend), at about half the time of compiling the CPU code.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}
GDR_NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state")
GLA_NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dinitial_state")


def _inputs(seed, b=B, n=None):
    """(q, k, v, g, beta, initial_state) and the cotangents of (o, final_state), float32 numpy arrays
    (placed on the devices from the host), random (never zeros); ``n`` initial states (packed
    sequences), default ``b``."""
    rng = np.random.default_rng(seed)
    randn = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
    q, k, v = randn(b, T, H, K), randn(b, T, H, K), randn(b, T, HV, V)
    g = rng.uniform(-0.12, -0.002, (b, T, HV)).astype(np.float32)
    beta = rng.uniform(0.05, 1.0, (b, T, HV)).astype(np.float32)
    h0 = randn(n or b, HV, K, V)
    return (q, k, v, g, beta, h0), (randn(*v.shape), randn(*h0.shape))


def _ops(path, cu_seqlens=None):
    """Both ops, ``(o, final_state)`` each, on (q, k, v, g, beta, initial_state): through the public op
    (``path="op"``, the chunked XLA path here) or the kernel path (``"kernel"``)."""
    def gdr(q, k, v, g, beta, h0):
        if path == "op":
            return la.gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                       cu_seqlens=cu_seqlens, use_qk_l2norm=True)
        return la.api._kernel_path(la.api._Spec(SCALE, True), q, k, v, g, beta, cu_seqlens, h0)

    def gla(q, k, v, g, beta, h0):
        del beta
        if path == "op":
            return la.simple_gla(q, k, v, g, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
        return la.api._kernel_path(la.api._Spec(SCALE, False), q, k, v, g, None, cu_seqlens, h0)

    return gdr, gla


def _with_gradients(gdr, gla):
    """A function of (inputs, cotangents) giving, for each op, its (o, final_state) and the gradients of
    <o, do> + <final_state, dstate> in its inputs: gated_delta_rule's in all six, simple_gla's in all but
    beta. Both ops in one program: one compilation per configuration."""
    def run(args, cotangents):
        results = []
        for op, drop_beta in ((gdr, False), (gla, True)):
            out, vjp = jax.vjp(op, *args)
            grads = vjp(tuple(cotangents))
            results.append((*out, *(grads[:4] + grads[5:] if drop_beta else grads)))
        return tuple(results)

    return run


def _compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile(compiler_options=COMPILER_OPTIONS)


@functools.lru_cache(maxsize=None)
def _one_device(seed, packed=False, zero_state=False):
    """Results of the op on one device (the reference of every comparison), per input set; with
    ``zero_state``, from an initial state of zeros (the op's default)."""
    inputs, cotangents = _packed_inputs(seed) if packed else _inputs(seed)
    if zero_state:
        inputs = (*inputs[:5], np.zeros_like(inputs[5]))
    results = _compiled(_with_gradients(*_ops("op", _CU if packed else None)), inputs, cotangents)(inputs, cotangents)
    for names, values in zip((GDR_NAMES, GLA_NAMES), results):  # (a comparison with zeros would prove nothing)
        assert all(np.isfinite(x).all() and np.abs(x).max() > 0 for x in values), names
    return results


def _check_close(got, want):
    for results, reference, names in zip(got, want, (GDR_NAMES, GLA_NAMES)):
        assert len(results) == len(reference)
        for name, x, ref in zip(names, results, reference):
            assert x.shape == ref.shape, (name, x.shape, ref.shape)
            err = rel_err(x, ref)
            assert err < TOL, f"{name}: relative error {err:.2e}"


# ----------------------------------------------------------------------------------------------
# Meshes and layouts
# ----------------------------------------------------------------------------------------------


def _mesh(axis_type, shape=(4, 2)):
    return jax.make_mesh(shape, ("data", "model"), axis_types=(axis_type,) * 2)


def _put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def _placed(mesh, qk_spec, v_spec, state_spec, seed=0):
    """The inputs and cotangents placed: q, k as ``qk_spec``; v, g, beta and do as ``v_spec`` (g and beta
    its first three entries); initial_state and its cotangent as ``state_spec``."""
    (q, k, v, g, beta, h0), (do, ds) = _inputs(seed)
    gate = P(*tuple(v_spec)[:3])
    args = [_put(x, mesh, s) for x, s in zip((q, k, v, g, beta, h0), (qk_spec,) * 2 + (v_spec, gate, gate, state_spec))]
    return args, [_put(do, mesh, v_spec), _put(ds, mesh, state_spec)]


# (name, mesh shape, q/k spec, v spec, state spec). On the 4 x 2 mesh the batch (4) splits over "data" and
# the heads over "model": one q/k head and its 4 value heads per device. On the 2 x 4 mesh the 8 value heads
# split 4 ways but the 2 q/k heads cannot: q and k are replicated over "model", each q/k head shared by the
# 2 devices that hold its value heads.
CASES = [
    ("batch", (4, 2), P("data"), P("data"), P("data")),
    ("heads", (4, 2), P(None, None, "model"), P(None, None, "model"), P(None, "model")),
    ("batch_heads", (4, 2), P("data", None, "model"), P("data", None, "model"), P("data", "model")),
    ("heads_shared", (2, 4), P("data"), P("data", None, "model"), P("data", "model")),
]
CASE = {c[0]: c for c in CASES}


def _collective_shapes(hlo_text):
    """[(collective, result shape)] of the collectives of a compiled HLO text (a tuple result gives one
    entry per element)."""
    found = []
    for m in re.finditer(r"=\s*(\(.*?\)|\S+)\s+(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)"
                         r"(?:-start)?\(", hlo_text):
        for dims in re.findall(r"\w+\[([\d,]*)\]", m.group(1)):
            found.append((m.group(2), tuple(int(d) for d in dims.split(",") if d)))
    return found


def _check_collectives(hlo_text, case, allowed=("all-reduce",)):
    """No collectives, except (heads_shared) collectives in ``allowed`` of parts of dq and dk: each
    device's sum over the value heads it holds of a q/k head's gradient, summed over (or gathered from)
    the devices that share that head ([local batch, T, <= H, K]; nothing of T chunks, nothing per value
    head)."""
    found = _collective_shapes(hlo_text)
    if case[0] != "heads_shared":
        assert not collectives(hlo_text) and not found, found
        return
    local_batch = B // case[1][0]
    parts = {(local_batch, T, h, K) for h in range(1, H + 1)}
    assert collectives(hlo_text) <= set(allowed), collectives(hlo_text)
    assert found and all(kind in allowed and shape in parts for kind, shape in found), found


def _check_layouts(got, args):
    """Outputs and gradients keep their operands' shardings: o like v, the final state and its gradient
    like initial_state, dq and dk like q, dv, dg, dbeta like theirs."""
    q, k, v, g, beta, h0 = args
    for results, likes in zip(got, ((v, h0, q, k, v, g, beta, h0), (v, h0, q, k, v, g, h0))):
        for x, like in zip(results, likes):
            assert x.sharding.is_equivalent_to(like.sharding, x.ndim), (x.sharding, like.sharding)


def _check_jit_sharded(path, case, axis_type, allowed=("all-reduce",)):
    name, shape, qk_spec, v_spec, state_spec = case
    mesh = _mesh(axis_type, shape)
    args, cotangents = _placed(mesh, qk_spec, v_spec, state_spec)
    lowered = jax.jit(_with_gradients(*_ops(path))).lower(args, cotangents)
    compiled = lowered.compile(compiler_options=COMPILER_OPTIONS)
    _check_collectives(compiled.as_text(), case, allowed)
    text = lowered.as_text()
    # The kernel path is split by jax_tk (a shard_map for explicit sharding, custom_partitioning for auto);
    # the op's chunked path by a shard_map of jax_tk's for explicit sharding, else by XLA alone.
    assert ("manual_computation" in text) == (axis_type == AxisType.Explicit)
    assert ("CustomSPMDPartitioning" in text) == (path == "kernel" and axis_type == AxisType.Auto)
    got = compiled(args, cotangents)
    _check_close(got, _one_device(0))
    _check_layouts(got, args)


# ----------------------------------------------------------------------------------------------
# jit with sharded inputs
# ----------------------------------------------------------------------------------------------


@needs_devices
@pytest.mark.parametrize("case,axis_type", [
    (CASE["batch"], AxisType.Explicit), (CASE["heads"], AxisType.Auto), (CASE["batch_heads"], AxisType.Explicit),
    (CASE["heads_shared"], AxisType.Auto), (CASE["heads_shared"], AxisType.Explicit),
], ids=["batch-explicit", "heads-auto", "batch_heads-explicit", "heads_shared-auto", "heads_shared-explicit"])
def test_op_jit_sharded(case, axis_type):
    """The op (the chunked XLA path): values and layouts of one device, no collectives; with a q/k head
    shared by head shards, only dq and dk are communicated (under auto sharding XLA sums each device's part
    over the 2 devices that share a q/k head, then all-gathers the 2 q/k heads; under explicit sharding
    each device slices the q/k head it uses, and one all-reduce sums dq and dk over its sharers)."""
    _check_jit_sharded("op", case, axis_type, allowed=("all-reduce", "all-gather"))


@needs_devices
@pytest.mark.parametrize("case,axis_type", [
    (CASE["batch_heads"], AxisType.Explicit), (CASE["heads_shared"], AxisType.Explicit),
    (CASE["heads_shared"], AxisType.Auto),
], ids=["batch_heads-explicit", "heads_shared-explicit", "heads_shared-auto"])
def test_kernel_path_jit_sharded(case, axis_type):
    """The kernel path, split by jax_tk: values and layouts of one device, no collectives; with a q/k head
    shared by head shards, each device slices the q/k head it uses and one all-reduce sums dq and dk over
    the devices that share it."""
    _check_jit_sharded("kernel", case, axis_type)


# ----------------------------------------------------------------------------------------------
# shard_map, vmap
# ----------------------------------------------------------------------------------------------


@needs_devices
def test_op_in_shard_map():
    """Inside shard_map (batch over "data", heads over "model"; the default check_vma=True) the op runs on
    the local shards, each device's q/k head with its 4 value heads, from no initial state (zeros, typed
    as varying like the inputs): the values and gradients of one device."""
    name, shape, qk_spec, v_spec, state_spec = CASE["batch_heads"]
    mesh = _mesh(AxisType.Explicit, shape)
    args, cotangents = _placed(mesh, qk_spec, v_spec, state_spec)
    gate = P(*tuple(v_spec)[:3])
    in_specs = (qk_spec, qk_spec, v_spec, gate, gate)
    local = [jax.shard_map(lambda q, k, v, g, beta, op=op: op(q, k, v, g, beta, None), mesh=mesh, in_specs=in_specs,
                           out_specs=(v_spec, state_spec)) for op in _ops("op")]
    got = _compiled(_with_gradients(*local), args[:5], cotangents)(args[:5], cotangents)
    want = _one_device(0, zero_state=True)
    _check_close(got, [results[:-1] for results in want])  # (no initial state: no gradient for it)


@needs_devices
def test_op_vmap_over_a_leading_axis():
    """vmap of the op (default implementation) over a leading axis of 2 batches of 2: the values and
    gradients of the op on the batch of 4."""
    args, cotangents = _inputs(0)
    split = lambda x: x.reshape(2, B // 2, *x.shape[1:])
    merge = lambda x: x.reshape(B, *x.shape[2:])
    mapped = [jax.vmap(op) for op in _ops("op")]
    args, cotangents = [split(x) for x in args], [split(x) for x in cotangents]
    got = _compiled(_with_gradients(*mapped), args, cotangents)(args, cotangents)
    _check_close(jax.tree.map(merge, got), _one_device(0))


# ----------------------------------------------------------------------------------------------
# Packed sequences (cu_seqlens)
# ----------------------------------------------------------------------------------------------

# 4 sequences packed in one batch row: 5, 35, 0 (empty) and 32 tokens.
_CU = np.array([0, 5, 40, 40, 72], np.int32)


def _packed_inputs(seed):
    return _inputs(seed, b=1, n=_CU.shape[0] - 1)


@needs_devices
def test_packed_sequences_split_over_heads():
    """Packed sequences are one batch row, which cannot split over "data" (a batch of 1: JAX refuses such
    a layout): the arrays stay whole over "data" and split their heads over "model" (explicit sharding),
    the offsets replicated. Both paths give one device's values and gradients with no collectives."""
    mesh = _mesh(AxisType.Explicit)
    (q, k, v, g, beta, h0), (do, ds) = _packed_inputs(1)
    heads, states = P(None, None, "model"), P(None, "model")
    args = [_put(x, mesh, s) for x, s in zip((q, k, v, g, beta, h0), (heads,) * 5 + (states,))]
    cotangents = [_put(do, mesh, heads), _put(ds, mesh, states)]
    with pytest.raises(ValueError):
        _put(q, mesh, P("data"))
    cu = _put(_CU, mesh, P())

    def both_paths(args, cotangents, cu):
        return tuple(_with_gradients(*_ops(path, cu))(args, cotangents) for path in ("op", "kernel"))

    compiled = _compiled(both_paths, args, cotangents, cu)
    assert not collectives(compiled.as_text()), collectives(compiled.as_text())
    for got in compiled(args, cotangents, cu):
        _check_close(got, _one_device(1, packed=True))
        _check_layouts(got, args)


# ----------------------------------------------------------------------------------------------
# The CUDA lowering (without a GPU): the kernels run on the local shards
# ----------------------------------------------------------------------------------------------


@needs_extension
@needs_devices
def test_cuda_lowering_runs_the_kernels_on_local_shards():
    """The kernel path's forward and backward targets of both ops, exported for CUDA with bfloat16 inputs
    split over batch and heads (explicit sharding): every call sits in the shard_map and takes the local
    shards, [B/4, T, H/2, 64] and [B/4, T, HV/2, 64]."""
    mesh = _mesh(AxisType.Explicit)
    bf16, kd, vd = jnp.bfloat16, 64, 64
    sds = lambda shape, spec, dtype=bf16: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
    split = P("data", None, "model")
    qk, vs = sds((B, T, H, kd), split), sds((B, T, HV, vd), split)
    gate = sds((B, T, HV), split, F32)

    def loss(q, k, v, g, beta):
        o1, s1 = la.api._kernel_path(la.api._Spec(0.125, True), q, k, v, g, beta, None, None)
        o2, s2 = la.api._kernel_path(la.api._Spec(0.125, False), q, k, v, g, None, None, None)
        return jnp.sum(o1.astype(F32) * o2.astype(F32)) + jnp.sum(s1 * s2)

    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=ffi.export_checks())(qk, qk, vs, gate, gate)
    text = exported.mlir_module()
    assert "sdy.manual_computation" in text
    calls = [line for line in text.splitlines()
             if re.search(r"stablehlo.custom_call @jax_tk_(simple_gla|gated_delta_rule)", line)]
    targets = {re.search(r"@(jax_tk_\w+)", line).group(1) for line in calls}
    assert targets == {f"jax_tk_{op}_{d}" for op in ("simple_gla", "gated_delta_rule") for d in ("fwd", "bwd")}, targets
    local_qk, local_v = f"tensor<{B // 4}x{T}x{H // 2}x{kd}xbf16>", f"tensor<{B // 4}x{T}x{HV // 2}x{vd}xbf16>"
    for line in calls:
        assert local_qk in line and local_v in line, line
        assert f"x{T}x{H}x{kd}xbf16>" not in line and f"x{T}x{HV}x{vd}xbf16>" not in line, line
