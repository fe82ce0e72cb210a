"""The FP8 grouped GEMM kernel (H100/H200, launch.fp8_call) against float64 products of the
dequantized operands: m, k and n not multiples of the 128-wide blocks (k a multiple of 16), empty
groups first, between and last, rows past the groups (0 out), one group (dense), 256 groups; bf16 and
float32 out; the output poisoned with NaN before the kernel runs. The same for its contraction
(launch.fp8_contract_call, the weights' gradient), and ragged_dot_fp8's gradients on both. Plus,
without a GPU, the CUDA lowering of both calls."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from helpers import needs_extension
from jax_tk._core import extension
from jax_tk.gemm import launch
from test_fp8 import np_dequantize, np_ragged_dot, wgrad_of_requantized

BF16, F32, FP8 = jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn
on_hopper = pytest.mark.skipif(extension.cuda_device_capability() != (9, 0), reason="the FP8 kernel runs on sm_90a")

CASES = {  # m, k, n, group sizes
    "odd": (300, 272, 200, [100, 0, 150, 20]),    # k: two blocks, the second 16 wide; 30 rows past the groups
    "dense": (256, 512, 384, [256]),
    "empties": (129, 128, 136, [0, 64, 0, 65, 0]),
    "g256": (1000, 144, 64, list(np.random.default_rng(1).multinomial(990, np.ones(256) / 256))),
    "clusters": (2200, 256, 392, [2100]),  # dense: clusters of two on Hopper, the odd last row block a pair side by side
}


def operands(seed, m, k, n, sizes):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)) * 3, F32)
    w = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), F32)
    return jax_tk.quantize_fp8(x, (1, 128)), jax_tk.quantize_fp8(w, (128, 128)), jnp.asarray(sizes, jnp.int32)


@on_hopper
@pytest.mark.parametrize("out_dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("case", list(CASES))
def test_against_the_dequantized_product(case, out_dtype):
    m, k, n, sizes = CASES[case]
    (a, sa), (b, sb), gs = operands(len(case), m, k, n, sizes)
    poison = jnp.full((m, n), jnp.nan, out_dtype)
    out = jax.jit(lambda *x: launch.fp8_call(*x, out_dtype, out_init=poison))(a, sa, jnp.swapaxes(b, 1, 2), sb, gs)
    want = np_ragged_dot(np_dequantize(a, sa, (1, 128)), np_dequantize(b, sb, (128, 128)), sizes)
    got = np.asarray(out.astype(F32), np.float64)
    assert np.isfinite(got).all(), f"{np.sum(~np.isfinite(got))} unwritten or non-finite outputs"
    assert np.all(got[sum(sizes):] == 0)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < (1e-2 if out_dtype == BF16 else 2e-3), err


@on_hopper
@pytest.mark.parametrize("out_dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("case", list(CASES))
def test_contraction_against_the_dequantized_product(case, out_dtype):
    """launch.fp8_contract_call (the weights' gradient): out[i] = deq(at)[:, rows_i] @ deq(bt)[:, rows_i]^T
    against float64, groups starting and ending inside the 128-row blocks, empty groups (zeros), rows
    past the groups (large, finite: they must add nothing), the output poisoned first."""
    m, k, n, sizes = CASES[case]
    rng = np.random.default_rng(len(case) + 7)
    mp = m + (-m) % 16
    at = jax_tk.quantize_fp8(jnp.asarray(rng.standard_normal((k, mp)) * 2, F32), (1, 128))
    bt = jax_tk.quantize_fp8(jnp.asarray(rng.standard_normal((n, mp)), F32), (128, 128))
    gs = jnp.asarray(sizes, jnp.int32)
    poison = jnp.full((len(sizes), k, n), jnp.nan, out_dtype)
    out = jax.jit(lambda *x: launch.fp8_contract_call(*x, out_dtype, out_init=poison))(*at, *bt, gs)
    assert out.dtype == out_dtype
    da, db = np_dequantize(*at, (1, 128)), np_dequantize(*bt, (128, 128))
    ends = np.cumsum(sizes)
    want = np.stack([da[:, e - s:e] @ db[:, e - s:e].T for s, e in zip(sizes, ends)])
    got = np.asarray(out.astype(F32), np.float64)
    assert np.isfinite(got).all(), f"{np.sum(~np.isfinite(got))} unwritten or non-finite outputs"
    for i, s in enumerate(sizes):
        if s == 0:
            assert np.all(got[i] == 0)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < (1e-2 if out_dtype == BF16 else 2e-3)


@on_hopper
@pytest.mark.parametrize("case,dtype,transposed", [("odd", F32, False), ("empties", F32, False), ("odd", BF16, True),
                                                   ("empties", BF16, False)],
                         ids=["odd-f32", "empties-f32", "odd-bf16-transposed", "empties-bf16"])
def test_gradients(case, dtype, transposed):
    """ragged_dot_fp8's gradients on arrays under jit, both on the FP8 kernel and in the inputs' dtype
    and layout (weights [g, n, k] where transposed): lhs's (the cotangent re-quantized) against float64
    products of the dequantized cotangent and weights, rhs's (rows and cotangent re-quantized along
    the rows) against float64 products of those; both near the exact straight-through gradients."""
    m, k, n, sizes = CASES[case]
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), dtype)
    dout = jnp.asarray(rng.standard_normal((m, n)), dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    given = jnp.swapaxes(w, 1, 2) if transposed else w
    loss = lambda x, w: jnp.sum(jax_tk.ragged_dot_fp8(x, w, gs, preferred_element_type=dtype, rhs_transposed=transposed)
                                .astype(F32) * dout.astype(F32))
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))  # (the value keeps the forward's call)
    text = grad.lower(x, given).as_text()
    assert text.count("jax_tk_gemm_fp8(") == 2 and text.count("jax_tk_gemm_fp8_contract(") == 1
    dx, dw = grad(x, given)[1]
    assert dx.dtype == dw.dtype == dtype and dw.shape == given.shape
    dx, dw = (np.asarray(t.astype(F32), np.float64) for t in (dx, dw))
    dw = np.swapaxes(dw, 1, 2) if transposed else dw
    tol = 2e-3 if dtype == F32 else 1e-2  # (bfloat16 out: its rounding)
    deq_w = np_dequantize(*jax_tk.quantize_fp8(w, (128, 128)), (128, 128))
    deq_x = np_dequantize(*jax_tk.quantize_fp8(x, (1, 128)), (1, 128))
    deq_d = np_dequantize(*jax_tk.quantize_fp8(dout, (1, 128)), (1, 128))
    want_dx = np_ragged_dot(deq_d, np.swapaxes(deq_w, 1, 2), sizes)
    assert np.all(dx[sum(sizes):] == 0)
    assert np.linalg.norm(dx - want_dx) / np.linalg.norm(want_dx) < tol
    bounds = np.cumsum([0] + list(sizes))
    want_dw = np.stack([deq_x[s:e].T @ np.asarray(dout, np.float64)[s:e] for s, e in zip(bounds[:-1], bounds[1:])])
    assert np.linalg.norm(dw - want_dw) / np.linalg.norm(want_dw) < 6e-2  # (re-quantized operands)
    requantized = wgrad_of_requantized(x, dout, sizes, None, len(sizes), transposed)
    requantized = np.swapaxes(requantized, 1, 2) if transposed else requantized
    assert np.linalg.norm(dw - requantized) / np.linalg.norm(requantized) < tol


@needs_extension
@pytest.mark.skipif(extension.has_cuda_kernels() and not extension.has_target(launch.FP8_TARGET),
                    reason="this build has no FP8 kernel")
def test_cuda_lowering():
    """The call exported for CUDA: a's scales k-block major, b [g, n, k], the sizes int32."""
    (a, sa), (b, sb), gs = operands(0, 40, 272, 24, [10, 30])
    fn = jax.jit(lambda *x: launch.fp8_call(*x, BF16))
    text = jax.export.export(fn, platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call(launch.FP8_TARGET)])(a, sa, jnp.swapaxes(b, 1, 2), sb, gs).mlir_module()
    (call,) = re.findall(r"@jax_tk_gemm_fp8\(.*?\) \{.*?\} : \((.*?)\) -> (\S+)", text, re.S)
    ins, outs = (re.findall(r"tensor<[^>]*>", part) for part in call)
    assert ins == ["tensor<40x272xf8E4M3FN>", "tensor<3x40xf32>", "tensor<2x24x272xf8E4M3FN>", "tensor<2x3x1xf32>",
                   "tensor<2xi32>"], ins
    assert outs == ["tensor<40x24xbf16>"], outs


@needs_extension
@pytest.mark.skipif(extension.has_cuda_kernels() and not extension.has_target(launch.FP8_CONTRACT_TARGET),
                    reason="this build has no FP8 contraction kernel")
def test_cuda_lowering_of_the_contraction():
    """The contraction exported for CUDA: both scales m-block major, out float32 [g, k, n]."""
    rng = np.random.default_rng(2)
    at = jax_tk.quantize_fp8(jnp.asarray(rng.standard_normal((72, 304)), F32), (1, 128))
    bt = jax_tk.quantize_fp8(jnp.asarray(rng.standard_normal((40, 304)), F32), (128, 128))
    gs = jnp.asarray([100, 0, 150], jnp.int32)
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in (launch.FP8_TARGET, launch.FP8_CONTRACT_TARGET)]
    text = jax.export.export(jax.jit(launch.fp8_contract_call), platforms=["cuda"],
                             disabled_checks=checks)(*at, *bt, gs).mlir_module()
    (call,) = re.findall(r"@jax_tk_gemm_fp8_contract\(.*?\) \{.*?\} : \((.*?)\) -> (\S+)", text, re.S)
    ins, outs = (re.findall(r"tensor<[^>]*>", part) for part in call)
    assert ins == ["tensor<72x304xf8E4M3FN>", "tensor<3x72xf32>", "tensor<40x304xf8E4M3FN>", "tensor<3x1xf32>",
                   "tensor<3xi32>"], ins
    assert outs == ["tensor<3x72x40xf32>"], outs
