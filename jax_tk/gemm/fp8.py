"""FP8 (e4m3) GEMMs with block scales, as DeepSeek-V3 does them: ``jax_tk.quantize_fp8``,
``jax_tk.ragged_dot_fp8`` and ``jax_tk.matmul_fp8``.

Activations are quantized in 1x128 blocks along k, weights in 128x128 blocks; each block has one
float32 scale ``amax(|block|) / 448`` (448: the largest float8_e4m3fn value). The result is the
product of the dequantized operands (``values * scale``), accumulated in float32.

Both run jax_tk's FP8 kernel on H100/H200, forward and backward, and the pure-JAX reference
elsewhere (their gradients there on jax_tk.ragged_dot in bfloat16).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jax_tk._core import checks, dispatch
from jax_tk.gemm import api, launch, reference

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn value
BLOCK = 128  # DeepSeek-V3's block: activations 1 x BLOCK, weights BLOCK x BLOCK
LHS_BLOCK = (1, BLOCK)
RHS_BLOCK = (BLOCK, BLOCK)
FLOAT_DTYPES = api.FLOAT_DTYPES
_HIGHEST = jax.lax.Precision.HIGHEST


# ----------------------------------------------------------------------------------------------
# Quantization
# ----------------------------------------------------------------------------------------------


def _check_block_shape(op: str, block_shape) -> tuple[int, int]:
    if (not isinstance(block_shape, (tuple, list)) or len(block_shape) != 2
            or not all(checks.is_int(b) and b > 0 for b in block_shape)):
        raise ValueError(f"jax_tk.{op}: block_shape must be a pair of positive ints (rows, cols), e.g. (1, 128) "
                         f"for activations or (128, 128) for weights, got {block_shape!r}")
    return int(block_shape[0]), int(block_shape[1])


def scale_shape(shape, block_shape) -> tuple[int, ...]:
    """The scales' shape for an array of ``shape`` quantized in ``block_shape`` blocks over its last
    two dims: those dims rounded up to whole blocks (a ragged edge block covers the remainder)."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block_shape[0]), -(-cols // block_shape[1]))


def _expand(scales, block_shape, shape):
    """``scales`` [..., R, C] repeated over each block and cut to ``shape`` [..., rows, cols]."""
    br, bc = block_shape
    s = jnp.repeat(jnp.repeat(scales, br, axis=-2), bc, axis=-1)
    return s[..., :shape[-2], :shape[-1]]


def _quantize(x, block_shape):
    """(values float8_e4m3fn, scales float32), no checks."""
    br, bc = block_shape
    *lead, rows, cols = x.shape
    nr, nc = scale_shape(x.shape, block_shape)[-2:]
    xf = x.astype(jnp.float32)
    pad = [(0, 0)] * len(lead) + [(0, nr * br - rows), (0, nc * bc - cols)]
    blocks = jnp.pad(jnp.abs(xf), pad).reshape(*lead, nr, br, nc, bc)
    amax = jnp.max(blocks, axis=(-3, -1), initial=0.0)
    # A block of zeros gets scale 1 (its values are 0 and dequantize to 0, never 0/0).
    scales = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
    # Saturating: x / scale can reach past 448 by a float32 rounding, and float8_e4m3fn has no inf.
    values = jnp.clip(xf / _expand(scales, block_shape, x.shape), -FP8_MAX, FP8_MAX).astype(FP8)
    return values, scales


def dequantize(values, scales, block_shape):
    """``values * scale`` in float32 (each element times its block's scale)."""
    # The barrier keeps the float8 rounding: XLA on GPU (allowing excess precision, its default) folds
    # a convert to float8 followed by one back to float32 into nothing, which under jit would skip the
    # quantization that the values came from in the same computation.
    values = jax.lax.optimization_barrier(values)
    return values.astype(jnp.float32) * _expand(scales, block_shape, values.shape)


def _requantize_xla(x, x_scales, row_limit, block_rows: int, transposed: bool, out_shape):
    """What the quantization kernel computes (launch.quantize_call), in XLA: ``_quantize`` of x
    (dequantized with ``x_scales`` if given), its rows at or past ``row_limit`` zeroed, transposed,
    zero-padded to ``out_shape``."""
    y = x.astype(jnp.float32) if x_scales is None else dequantize(x, x_scales, LHS_BLOCK)
    if row_limit is not None:
        y = jnp.where((jnp.arange(y.shape[-2]) < row_limit[0])[:, None], y, 0.0)
    if transposed:
        y = _swap(y)
    if out_shape is not None:
        y = jnp.pad(y, [(0, 0)] * (y.ndim - 2) + [(0, out_shape[0] - y.shape[-2]), (0, out_shape[1] - y.shape[-1])])
    return _quantize(y, (block_rows, BLOCK))


def _requantize(x, block_rows: int, *, x_scales=None, row_limit=None, transposed=False, out_shape=None):
    """``_requantize_xla``'s (values, scales), on the quantization kernel (one pass over x) on CUDA
    where the build has it (the same up to XLA's float32 rounding of the divisions: a float8 step in
    a few elements)."""
    static = dict(block_rows=block_rows, transposed=transposed, out_shape=out_shape)
    xla = lambda x, xs, lim: _requantize_xla(x, xs, lim, **static)
    if launch.quantize_unsupported_reason() is not None:
        return xla(x, x_scales, row_limit)
    kernel = lambda x, xs, lim: launch.quantize_call(x, block_rows, x_scales=xs, transposed=transposed,
                                                      row_limit=lim, out_shape=out_shape)
    return dispatch.platform_dispatch(True, kernel, xla, x, x_scales, row_limit)


def quantize_fp8(x, block_shape):
    """Quantizes ``x`` to float8_e4m3fn with one float32 scale per block.

    Args:
      x: ``[rows, cols]``, or ``[g, rows, cols]`` (per-expert weights; blocks over the last two dims),
        bfloat16, float16 or float32.
      block_shape: ``(block_rows, block_cols)``, positive ints: ``(1, 128)`` for activations (1x128
        blocks along k, DeepSeek-V3), ``(128, 128)`` for weights. A block at a ragged edge covers the
        remainder.

    Returns:
      ``(values, scales)``: values float8_e4m3fn of x's shape, ``x / scale`` rounded to nearest
      (saturating at +-448); scales float32 ``[..., ceil(rows / block_rows), ceil(cols / block_cols)]``,
      ``amax(|block|) / 448``, so that each block's largest element becomes +-448. A block of zeros
      has scale 1 (values 0, dequantizing to 0). ``values * scale`` is within half a float8 step of x:
      a relative error <= 2^-4 for elements above ``2^-6 * scale``, an absolute one <= ``2^-10 * scale``
      below. Non-finite inputs are not supported (a block holding inf or NaN gives NaN).
    """
    op = "quantize_fp8"
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"jax_tk.{op}: x must be an array, got {type(x).__name__}")
    if x.ndim not in (2, 3):
        raise ValueError(f"jax_tk.{op}: x must have rank 2 [rows, cols] or 3 [g, rows, cols], got shape "
                         f"{tuple(x.shape)}")
    checks.float_array(op, "x", x, x.ndim, "[rows, cols] or [g, rows, cols]", FLOAT_DTYPES, empty_ok=range(x.ndim))
    return _quantize(x, _check_block_shape(op, block_shape))


# ----------------------------------------------------------------------------------------------
# Operands: a (values, scales) pair, or an array quantized here (straight-through gradient)
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _fake_quant(x, block_shape):
    """x quantized and dequantized (float32); its gradient passes straight through to x."""
    return dequantize(*_quantize(x, block_shape), block_shape)


def _fake_quant_fwd(x, block_shape):
    return _fake_quant(x, block_shape), jnp.zeros((0,), x.dtype)  # (x's dtype, as a residual)


def _fake_quant_bwd(block_shape, like, g):
    return (g.astype(like.dtype),)


_fake_quant.defvjp(_fake_quant_fwd, _fake_quant_bwd)


def _operand(op: str, name: str, x, what: str, block_shape, transposed: bool = False):
    """(the operand as given: the float array, or a pair's float8 values; the dequantized float32
    operand, as a function; its (values, scales); its shape). ``x`` is a (values, scales) pair
    (checked, treated as a constant) or a float array (quantized here, straight-through gradient
    through the dequantized operand; ``transposed``: its (values, scales) those of its transpose, in
    the same pass). (The dequantized operand is formed only where it is used: the reference's path.)"""
    ndim = len(what.split(","))
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise TypeError(f"jax_tk.{op}: {name} must be an array or a (values, scales) pair, got a "
                            f"{type(x).__name__} of {len(x)} items")
        values, scales = x
        checks.array(op, f"{name}'s values", values, ndim, what)
        if values.dtype != FP8:
            raise TypeError(f"jax_tk.{op}: {name}'s values must be float8_e4m3fn, got {values.dtype} (quantize "
                            f"with jax_tk.quantize_fp8, or pass the bf16/fp16/float32 array)")
        want = scale_shape(values.shape, block_shape)
        checks.array(op, f"{name}'s scales", scales, ndim, str(list(want)))
        if scales.dtype != jnp.float32:
            raise TypeError(f"jax_tk.{op}: {name}'s scales must be float32, got {scales.dtype}")
        if tuple(scales.shape) != want:
            raise ValueError(f"jax_tk.{op}: {name}'s scales must have shape {want} (one per "
                             f"{block_shape[0]}x{block_shape[1]} block of values {tuple(values.shape)}), got "
                             f"{tuple(scales.shape)}")
        # Not differentiable: the pair is a constant (zero gradients, which jax.grad gives float8 values).
        deq = lambda: jax.lax.stop_gradient(dequantize(values, scales, block_shape))
        return values, deq, (values, scales), tuple(values.shape)
    checks.float_array(op, name, x, ndim, what, FLOAT_DTYPES, empty_ok=range(ndim))
    # (the input's gradient stopped, not only the output's: the kernel's call has no derivative rule)
    q = _requantize(jax.lax.stop_gradient(x), block_shape[0], transposed=transposed)
    return x, lambda: _fake_quant(x, block_shape), q, tuple(x.shape)


def _swap(x):
    return jnp.swapaxes(x, -1, -2)


def _weights(op: str, name: str, x, transposed: bool, lead: str = ""):
    """rhs (or b), given as ``[lead k, n]`` or, ``transposed``, ``[lead n, k]``: (the operand as given,
    as ``_operand``; the dequantized float32 operand as ``[.., k, n]``, a function; its (values,
    scales) in the FP8 kernel's layout (values ``[.., n, k]``, scales ``[.., ceil(k/128),
    ceil(n/128)]``); its shape as ``[.., k, n]``). Swapping the last two axes of values or scales is
    one transpose in XLA, of a pair given in the kernel's layout none; an array given as ``[.., k, n]``
    is quantized straight into that layout (a 128 x 128 block's transpose is the transpose's block)."""
    what = f"[{lead}n, k]" if transposed else f"[{lead}k, n]"
    if not transposed and not isinstance(x, (tuple, list)):
        given, deq, (values, scales), shape = _operand(op, name, x, what, RHS_BLOCK, transposed=True)
        return given, deq, (values, _swap(scales)), shape
    given, deq, (values, scales), shape = _operand(op, name, x, what, RHS_BLOCK)
    if transposed:
        return given, lambda: _swap(deq()), (values, _swap(scales)), (*shape[:-2], shape[-1], shape[-2])
    return given, deq, (_swap(values), scales), shape


def _kernel_deq(qb):
    """The dequantized float32 ``[.., k, n]`` of b's (values, scales) in the kernel's layout."""
    values, scales = qb
    return _swap(dequantize(values, _swap(scales), RHS_BLOCK))


# ----------------------------------------------------------------------------------------------
# The grouped product on the FP8 kernel
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _kernel_product(a, b, qa, qb, sizes, out_dtype, b_transposed):
    """deq(a) @ deq(b) per group: the FP8 kernel on ``qa``, ``qb`` (the operands' (values, scales), b's
    in the kernel's layout) on CUDA, the float32 reference on them elsewhere. ``a`` and ``b`` are the
    operands as given (``[m, k]``; ``[g, k, n]``, or ``[g, n, k]`` where ``b_transposed``): float arrays,
    whose gradients (straight-through: those of the product of the dequantized operands) come in their
    dtype and layout, or float8 values of a pair (a constant: zero gradient). The gradients run on the
    FP8 kernel from re-quantized operands where it takes the sizes (CUDA), by jax_tk.ragged_dot in
    bfloat16 elsewhere."""
    def kernel(qa, qb, sizes):
        out = launch.fp8_call(*qa, *qb, sizes, _kernel_out(out_dtype))
        return out.astype(out_dtype)

    def ref(qa, qb, sizes):
        return reference.ragged_dot(dequantize(*qa, LHS_BLOCK), _kernel_deq(qb), sizes, out_dtype=out_dtype)

    return dispatch.platform_dispatch(True, kernel, ref, qa, qb, sizes)


def _kernel_out(dtype):
    """The FP8 kernel's output dtype for a result in ``dtype``: bfloat16 or float32 (float16 from float32)."""
    return jnp.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else jnp.float32


def _kernel_product_fwd(a, b, qa, qb, sizes, out_dtype, b_transposed):
    like = (jnp.zeros((0,), a.dtype), jnp.zeros((0,), b.dtype))  # (the operands' dtypes, as residuals)
    return _kernel_product(a, b, qa, qb, sizes, out_dtype, b_transposed), (*like, qa, qb, sizes)


def _kernel_product_bwd(out_dtype, b_transposed, res, g):
    a, b, qa, qb, sizes = res  # (a and b: empty, of the operands' dtypes)
    (m, k), (groups, n) = qa[0].shape, qb[0].shape[:2]
    b_shape = (groups, n, k) if b_transposed else (groups, k, n)

    def bf16(g):  # (where the FP8 kernel does not take them)
        bf = lambda x: x.astype(jnp.bfloat16)
        _, vjp = jax.vjp(lambda a, b: api.ragged_dot(bf(a), bf(b), sizes, preferred_element_type=jnp.float32),
                         dequantize(*qa, LHS_BLOCK), _kernel_deq(qb))
        return vjp(g.astype(jnp.float32))

    # Both on the FP8 kernel where it takes the sizes (CUDA), else on the bfloat16 ones: the rows'
    # gradient g @ deq(b)^T is the forward's product with n and k swapped (n padded to 16 there);
    # the weights' the contraction over each group's rows, formed in b's layout. A pair's values
    # get zeros (constants).
    if a.dtype == FP8:
        da = jnp.zeros((m, k), FP8)
    else:
        out = _kernel_out(a.dtype)
        da = _on_fp8(launch.fp8_unsupported_reason(n + -n % 16, k, groups, m),
                     functools.partial(_dgrad_fp8, out_dtype=out),
                     lambda g, qb, sizes: bf16(g)[0].astype(out), g, qb, sizes)
    if b.dtype == FP8:
        db = jnp.zeros(b_shape, FP8)
    else:
        out = _kernel_out(b.dtype)
        db = _on_fp8(launch.fp8_contract_unsupported_reason(k if b_transposed else n, groups, m),
                     functools.partial(_wgrad_fp8, out_dtype=out, transposed=b_transposed),
                     lambda qa, g, sizes: (_swap(bf16(g)[1]) if b_transposed else bf16(g)[1]).astype(out),
                     qa, g, sizes)
    zeros = jax.tree.map(jnp.zeros_like, (qa, qb))  # (constants: float8 values and their scales)
    return da.astype(a.dtype), db.astype(b.dtype), *zeros, None


def _on_fp8(reason, kernel, fallback, *args):
    """``kernel(*args)`` on CUDA where the FP8 kernel takes the call (``reason`` None), else ``fallback``."""
    if dispatch.use_kernel("ragged_dot_fp8", None, reason):
        return dispatch.platform_dispatch(True, kernel, fallback, *args)
    return fallback(*args)


def _dgrad_fp8(g, qb, sizes, out_dtype):
    """``deq(quantize(g)) @ deq(b)^T`` per group, in ``out_dtype`` (bfloat16 or float32), on the FP8
    kernel: g re-quantized in 1 x 128 blocks along n (DeepSeek-V3's backward); b's values and 128 x
    128 block scales (``qb``, the kernel's layout: [g, n, k] and [g, kb, nb]) serve transposed (a block
    of b^T is a block of b). n, contracted here, is padded with zeros to the kernel's multiple of 16
    (the scales' blocks stay)."""
    values, scales = qb
    m, n = g.shape
    pad = -n % 16
    if pad:
        values = jnp.pad(values, ((0, 0), (0, pad), (0, 0)))
    qg = _requantize(g, 1, out_shape=(m, n + pad))
    return launch.fp8_call(*qg, _swap(values), _swap(scales), sizes, out_dtype)


def _wgrad_fp8(qa, g, sizes, out_dtype, transposed):
    """``deq(a)[rows_i]^T @ g[rows_i]`` per group, ``[groups, k, n]`` (its transpose ``[groups, n, k]``
    where ``transposed``: b's layout) in ``out_dtype``, on the FP8 kernel's contraction of two
    operands transposed and re-quantized along the rows, each in one pass of the quantization kernel:
    a's rows (its float8 values times their scales, ``qa``) and g. The operand whose rows become the
    result's rows goes in 1 x 128 blocks, the other in 128 x 128 ones (DeepSeek-V3's wgrad). The rows
    past the groups are zeroed first (a block's scale would take in their values, NaN or inf
    included), and the rows padded to a multiple of 16 (the kernel reads both operands along them)."""
    (m, k), n = qa[0].shape, g.shape[1]
    rows, mp = jnp.sum(sizes)[None], m + -m % 16
    at = lambda block: _requantize(qa[0], block, x_scales=qa[1], row_limit=rows, transposed=True, out_shape=(k, mp))
    gt = lambda block: _requantize(g, block, row_limit=rows, transposed=True, out_shape=(n, mp))
    if transposed:
        return launch.fp8_contract_call(*gt(1), *at(BLOCK), sizes, out_dtype)
    return launch.fp8_contract_call(*at(1), *gt(BLOCK), sizes, out_dtype)


_kernel_product.defvjp(_kernel_product_fwd, _kernel_product_bwd)


def _out_dtype(op: str, preferred_element_type) -> str:
    if preferred_element_type is None:
        return "bfloat16"
    try:
        want = jnp.dtype(preferred_element_type)
    except TypeError:
        want = None
    if want is None or not any(want == d for d in FLOAT_DTYPES):
        raise TypeError(f"jax_tk.{op}: preferred_element_type must be None (bfloat16), bfloat16, float16 or "
                        f"float32, got {preferred_element_type!r}")
    return want.name


# ----------------------------------------------------------------------------------------------
# The public ops
# ----------------------------------------------------------------------------------------------


def ragged_dot_fp8(lhs, rhs, group_sizes, *, preferred_element_type=None, group_offset=None, rhs_transposed=False,
                   implementation=None):
    """Grouped matrix product (mixture of experts) of FP8 operands with block scales (DeepSeek-V3):
    ``out[r] = deq(lhs)[r] @ deq(rhs)[i]`` for the rows r of group i, ``deq`` the dequantized operand
    (``values * scale``, float32), accumulated in float32.

    Args:
      lhs: ``[m, k]``: a pair ``(values, scales)`` (values float8_e4m3fn ``[m, k]``, scales float32
        ``[m, ceil(k/128)]``: 1x128 blocks along k, e.g. from ``quantize_fp8(x, (1, 128))``), or a
        bfloat16/float16/float32 array, quantized here in 1x128 blocks. Rows sorted by group, as for
        :func:`jax_tk.ragged_dot`.
      rhs: ``[g, k, n]``: a pair (values float8_e4m3fn ``[g, k, n]``, scales float32
        ``[g, ceil(k/128), ceil(n/128)]``: 128x128 blocks, ``quantize_fp8(w, (128, 128))``), or a
        float array, quantized here in 128x128 blocks.
      group_sizes: ``[g]`` (``[G]`` with group_offset) integers, as for :func:`jax_tk.ragged_dot` (sizes
        may be 0; rows past their sum give 0).
      preferred_element_type: the result's dtype: None (bfloat16), bfloat16, float16 or float32.
      group_offset: as for :func:`jax_tk.ragged_dot` (expert parallelism: rhs holds g of the
        group_sizes' G groups, from ``group_offset[0]`` on).
      rhs_transposed: rhs given as ``[g, n, k]`` (each expert's matrix transposed; a pair's scales
        ``[g, ceil(n/128), ceil(k/128)]``, as ``quantize_fp8`` gives for that array). The FP8 kernel
        reads the weights in this layout (8-bit operands are read K-major): weights kept so, e.g. by
        a server that quantizes them once, spare the transpose of ``[g, k, n]`` in every call.
      implementation: ``None`` (the FP8 kernel on H100/H200 where it applies: k a multiple of 16, n of
        8; the reference elsewhere), ``"tk"`` (the kernel, or an error saying why not), ``"xla"``
        (the pure-JAX reference: dequantize to float32, then the grouped product).

    Gradients: an operand given as an array gets the straight-through estimator: the gradient of the
    product of the dequantized operands with respect to that dequantized operand, passed unchanged to
    the unquantized input (in its dtype), as if quantization were the identity. A ``(values, scales)``
    pair is a constant: its gradients are zero. Works under ``jit`` and ``vmap``. On the kernel path
    (H100/H200) lhs's gradient runs on the FP8 kernel too, as in DeepSeek-V3's backward: the result's
    cotangent is quantized in 1 x 128 blocks along n and multiplied by rhs's float8 values, so it
    carries that quantization's error (a relative 2^-4 at most per cotangent element). rhs's gradient
    too: lhs's rows (dequantized) and the cotangent re-quantized along the rows, ``lhs^T`` in 1 x 128
    blocks and the cotangent's transpose in 128 x 128 ones, their product per group on the kernel.

    Returns:
      ``[m, n]`` in ``preferred_element_type`` (default bfloat16).
    """
    op = "ragged_dot_fp8"
    a, deq_a, qa, (m, k) = _operand(op, "lhs", lhs, "[m, k]", LHS_BLOCK)
    b, deq_b, qb, (g, kr, n) = _weights(op, "rhs", rhs, rhs_transposed, "g, ")
    if k != kr:
        raise ValueError(f"jax_tk.{op}: the contracting dimension k of lhs [m, k] and rhs [g, k, n] must be "
                         f"equal, got lhs {(m, k)} and rhs {(g, kr, n)}")
    api.check_groups(op, group_sizes, group_offset, g)
    out_dtype = _out_dtype(op, preferred_element_type)
    use = dispatch.use_kernel(op, implementation, launch.fp8_unsupported_reason(k, n, g, m))
    if 0 in (m, k, g, n):
        return dispatch.zeros((m, n), out_dtype, a, b)  # nothing to multiply
    sizes = api.group_sizes_int32(op, group_sizes, m)
    if use:
        product = lambda x, s: _kernel_product(x[0], b, x[1], qb, s, out_dtype, rhs_transposed)
        return api.with_offset(product, (a, qa), sizes, group_offset, g)
    b = deq_b()
    return api.with_offset(lambda x, s: reference.ragged_dot(x, b, s, out_dtype=out_dtype), deq_a(), sizes,
                           group_offset, g)


def matmul_fp8(a, b, *, preferred_element_type=None, b_transposed=False, implementation=None):
    """Dense matrix product of FP8 operands with block scales (DeepSeek-V3): ``deq(a) @ deq(b)``,
    accumulated in float32.

    Args:
      a: ``[m, k]``: a pair (values float8_e4m3fn ``[m, k]``, scales float32 ``[m, ceil(k/128)]``), or a
        bfloat16/float16/float32 array, quantized here in 1x128 blocks.
      b: ``[k, n]``: a pair (values float8_e4m3fn ``[k, n]``, scales float32
        ``[ceil(k/128), ceil(n/128)]``), or a float array, quantized here in 128x128 blocks.
      b_transposed: b given as ``[n, k]`` (as ``rhs_transposed`` of :func:`ragged_dot_fp8`).
      preferred_element_type, implementation: as for :func:`ragged_dot_fp8` (the kernel: one group of
        all of a's rows).

    Gradients as for :func:`ragged_dot_fp8` (straight-through for array operands, zero for pairs).

    Returns:
      ``[m, n]`` in ``preferred_element_type`` (default bfloat16).
    """
    op = "matmul_fp8"
    x, deq_x, qx, (m, k) = _operand(op, "a", a, "[m, k]", LHS_BLOCK)
    y, deq_y, qy, (kb, n) = _weights(op, "b", b, b_transposed)
    if k != kb:
        raise ValueError(f"jax_tk.{op}: a [m, k] and b [k, n] must have the same k, got a {(m, k)} and b {(kb, n)}")
    out_dtype = _out_dtype(op, preferred_element_type)
    use = dispatch.use_kernel(op, implementation, launch.fp8_unsupported_reason(k, n, 1, m))
    if 0 in (m, k, n):
        return dispatch.zeros((m, n), out_dtype, x, y)
    if use:  # one group: b as a [1, k, n] (or [1, n, k]) stack of experts
        sizes = jnp.full((1,), m, jnp.int32)
        return _kernel_product(x, y[None], qx, jax.tree.map(lambda t: t[None], qy), sizes, out_dtype, b_transposed)
    return jnp.dot(deq_x(), deq_y(), precision=_HIGHEST, preferred_element_type=jnp.float32).astype(out_dtype)


__all__ = ["dequantize", "matmul_fp8", "quantize_fp8", "ragged_dot_fp8", "scale_shape"]
