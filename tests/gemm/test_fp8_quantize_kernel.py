"""The FP8 quantization kernel (launch.quantize_call, any CUDA GPU from sm_80) against its definition
in numpy float32, to the bit, and near the XLA composition it replaces (fp8._requantize_xla: XLA may
turn a division into a product with the reciprocal, one float32 ulp apart): bfloat16/float16/float32
and FP8 (with its scales) inputs, 1 x 128 and 128 x 128 blocks, batched weights and rows, transposed,
rows cut by a limit (inside, past and before the rows; NaN past it), zero padding, edges that are not
multiples of 128 or of the 16-byte loads, a block of zeros, magnitudes from 2^-20 to 2^20 (float16:
2^-8 to 2^8); both outputs poisoned first. Plus, without a GPU, the call's CUDA lowering."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from helpers import needs_extension
from jax_tk._core import extension
from jax_tk.gemm import fp8, launch

BF16, F16, F32, FP8 = jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn
on_gpu = pytest.mark.skipif(extension.cuda_device_capability() is None
                            or not extension.has_target(launch.QUANTIZE_TARGET),
                            reason="the quantization kernel runs on CUDA GPUs")

CASES = {  # shape, dtype, block rows, transposed, row limit, out shape (None: x's or x^T's)
    "activations": ((300, 272), BF16, 1, False, None, None),
    "activations_f16": ((129, 136), F16, 1, False, None, None),
    "cotangent_padded": ((300, 200), BF16, 1, False, None, (300, 208)),
    "weights": ((3, 272, 136), F32, 128, False, None, None),
    "weights_bf16_odd": ((2, 130, 36), BF16, 128, False, None, None),  # (36: not whole 16-byte loads)
    "weights_t": ((3, 272, 136), BF16, 128, True, None, None),         # ([g, k, n] into the kernel's [g, n, k])
    "weights_t_odd": ((2, 130, 36), F32, 128, True, None, None),
    "odd_cols": ((70, 37), F32, 1, False, None, None),                  # (37: byte stores)
    "rows_t": ((300, 272), FP8, 1, True, 270, (272, 304)),              # (the weights' gradient: a^T)
    "cotangent_t": ((300, 200), BF16, 128, True, 270, (200, 304)),      # (... and g^T)
    "cotangent_t_f32": ((129, 136), F32, 128, True, 129, (136, 144)),
    "limit_past": ((40, 128), BF16, 1, True, 1000, (128, 48)),
    "limit_negative": ((40, 128), F32, 128, True, -3, (128, 48)),
    "rows_fp8_limit": ((300, 272), FP8, 1, False, 250, (300, 400)),     # (FP8 in, untransposed)
    "rows_batched": ((2, 130, 256), BF16, 1, False, None, None),
    "nan_past_limit": ((300, 272), BF16, 1, False, 201, None),          # (rows past the limit hold NaN)
    "nan_past_limit_t": ((300, 272), BF16, 128, True, 201, (272, 304)),
}


def inputs(case):
    shape, dtype, *_ = CASES[case]
    rng = np.random.default_rng(len(case))
    e = 8 if dtype == F16 else 20  # (float16's range)
    x = rng.standard_normal(shape) * 2.0 ** rng.integers(-e, e + 1, size=shape[:-1] + (1,))
    x[..., 5, :] = 0.0  # (a row of zeros: its 1 x 128 blocks get scale 1)
    if case.startswith("nan"):
        x[..., CASES[case][4]:, :] = np.nan  # (must give zeros, not a NaN block, whatever it holds)
    if dtype != FP8:
        return jnp.asarray(x, dtype), None
    return fp8.quantize_fp8(jnp.asarray(x, F32), (1, 128))


def numpy_requantize(x, xs, limit, block_rows, transposed, out_shape):
    """The definition, in numpy float32: (amax / 448, or 1 for a block of zeros) per block, y / scale
    clipped to +-448 and rounded to the nearest float8_e4m3fn (ties to even)."""
    if xs is None:
        y = np.asarray(x, np.float32)
    else:
        y = np.asarray(x).astype(np.float32) * np.repeat(np.asarray(xs), 128, axis=-1)[:, :x.shape[1]]
    if limit is not None:
        y = np.where((np.arange(y.shape[-2]) < limit)[:, None], y, np.float32(0))
    if transposed:
        y = np.swapaxes(y, -1, -2)
    shape = y.shape[:-2] + (out_shape or y.shape[-2:])
    nr, nc = -(-shape[-2] // block_rows), -(-shape[-1] // 128)
    padded = np.zeros(y.shape[:-2] + (nr * block_rows, nc * 128), np.float32)
    padded[..., :y.shape[-2], :y.shape[-1]] = y
    amax = np.abs(padded).reshape(*y.shape[:-2], nr, block_rows, nc, 128).max(axis=(-3, -1))
    scales = np.where(amax > 0, amax / np.float32(448), np.float32(1)).astype(np.float32)
    full = np.repeat(np.repeat(scales, block_rows, axis=-2), 128, axis=-1)
    values = np.clip(padded / full, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return values[..., :shape[-2], :shape[-1]], scales


@on_gpu
@pytest.mark.parametrize("case", list(CASES))
def test_against_the_definition(case):
    """To the bit against numpy's float32; XLA's scales within a float32 ulp, its values within a
    float8 step."""
    _, _, block_rows, transposed, limit, out_shape = CASES[case]
    x, xs = inputs(case)
    lim = None if limit is None else jnp.asarray([limit], jnp.int32)
    want_v, want_s = numpy_requantize(x, xs, limit, block_rows, transposed, out_shape)
    poison = (jnp.full(want_v.shape, jnp.nan, FP8), jnp.full(want_s.shape, jnp.nan, F32))
    got = jax.jit(lambda x, xs, lim: launch.quantize_call(x, block_rows, x_scales=xs, transposed=transposed,
                                                          row_limit=lim, out_shape=out_shape, out_init=poison))(x, xs, lim)
    gv, gs = np.asarray(got[0].astype(F32)), np.asarray(got[1])
    wv = want_v.astype(np.float32)
    assert gs.shape == want_s.shape and np.array_equal(gs, want_s), f"{np.sum(gs != want_s)} of {gs.size} scales differ"
    assert gv.shape == wv.shape and np.array_equal(gv, wv), f"{np.sum(gv != wv)} of {gv.size} values differ"
    xv, xsc = fp8._requantize_xla(x, xs, lim, block_rows, transposed, out_shape)
    np.testing.assert_allclose(np.asarray(xsc), gs, rtol=2e-7)
    # (each element's scale: its block's, repeated over the block and cut to the values' shape)
    per_element = lambda s: np.repeat(np.repeat(s, block_rows, -2), 128, -1)[..., :gv.shape[-2], :gv.shape[-1]]
    ours, xla = gv * per_element(gs), np.asarray(xv.astype(F32)) * per_element(np.asarray(xsc))
    assert np.all(np.abs(xla - ours) <= 2.0 ** -3 * np.abs(ours) + 2.0 ** -9 * per_element(gs))


@on_gpu
def test_ragged_dot_fp8_uses_it():
    """ragged_dot_fp8's forward and both gradients quantize on the kernel under jit on a GPU (one call
    for lhs and one for rhs, one for the cotangent's rows, two for the transposed rows)."""
    x = jnp.ones((256, 256), BF16)
    w = jnp.ones((2, 256, 128), BF16)
    gs = jnp.asarray([100, 156], jnp.int32)
    f = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(fp8.ragged_dot_fp8(x, w, gs).astype(F32)), argnums=(0, 1)))
    assert f.lower(x, w).as_text().count("jax_tk_fp8_quantize(") == 5


def test_transposed_weights_shapes():
    """A batch of weights quantized transposed: each matrix's last two dims swapped (values [g, n, k],
    scales [g, ceil(n/128), ceil(k/128)]); ragged_dot_fp8 quantizes [g, k, n] weights so, into the
    kernel's layout, with no transpose after it."""
    x = jax.ShapeDtypeStruct((3, 272, 136), BF16)
    values, scales = jax.eval_shape(lambda x: launch.quantize_call(x, 128, transposed=True), x)
    assert (values.shape, values.dtype, scales.shape) == ((3, 136, 272), FP8, (3, 2, 3))
    v, s = fp8._requantize_xla(jnp.ones(x.shape, BF16), None, None, 128, True, None)
    assert v.shape == values.shape and s.shape == scales.shape


@needs_extension
@pytest.mark.skipif(extension.has_cuda_kernels() and not extension.has_target(launch.QUANTIZE_TARGET),
                    reason="this build has no FP8 quantization kernel")
def test_cuda_lowering():
    """The transposed call exported for CUDA: x, its scales, the limit; values and scales padded."""
    x, xs = fp8.quantize_fp8(jnp.ones((40, 272), F32), (1, 128))
    fn = jax.jit(lambda x, xs, lim: launch.quantize_call(x, 1, x_scales=xs, transposed=True, row_limit=lim,
                                                         out_shape=(272, 48)))
    text = jax.export.export(fn, platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call(launch.QUANTIZE_TARGET)])(x, xs, jnp.asarray([30])).mlir_module()
    (call,) = re.findall(r"@jax_tk_fp8_quantize\(.*?\) \{(.*?)\} : \((.*?)\) -> (.*?)\n", text, re.S)
    attrs, ins, outs = (re.findall(pattern, part) for pattern, part in
                        zip((r"(\w+) = (\d+) : i32", r"tensor<[^>]*>", r"tensor<[^>]*>"), call))
    assert ins == ["tensor<40x272xf8E4M3FN>", "tensor<40x3xf32>", "tensor<1xi32>"], ins
    assert outs == ["tensor<272x48xf8E4M3FN>", "tensor<272x1xf32>"], outs
    assert dict(attrs) == {"block_rows": "1", "transposed": "1"}, attrs
