"""FP8 GEMM providers (``--dtype fp8``): jax_tk and its peers on float8_e4m3fn operands, each as a
``harness.Provider`` for one ``gemm.GemmConfig``, under the names of the bf16 providers.

The inputs are the bf16 inputs of the bf16 rows; every provider quantizes them itself, and times the
same work in each mode:

- ``fwd`` (serving): the weights (rhs) quantized once, untimed (``prepare``), as a served model
  holds them; the activations (lhs) quantized inside the timed call, as a model does per call; the
  product in bf16. The timed function also receives the unquantized weights, which it does not read:
  they are there for the correctness check, which compares with the product of the unquantized
  inputs.
- ``bwd``, ``fwd_bwd`` (training): both operands bf16 arrays quantized inside the timed call; the
  gradients with respect to both are straight-through: those of the product of the dequantized
  operands, passed unchanged to the unquantized inputs: jax_tk's own backward (both gradients on its
  FP8 kernel, from operands quantized again); the peers', which have no FP8 backward, formed by bf16
  GEMMs.

Grouped GEMM (``ragged_dot``):

- ``jax_tk``: ``jax_tk.ragged_dot_fp8``, block scales as DeepSeek-V3 (activations 1x128 along k,
  weights 128x128); on a GPU ``implementation="tk"``, skipped with the reason where the FP8 kernel
  does not take the shape (``launch.fp8_unsupported_reason``); without one, ``implementation=None``
  (the reference). Its serving call gets the weights as ``jax_tk.quantize_fp8``'s (values, scales)
  of the ``[g, n, k]`` weights, with ``rhs_transposed=True`` (the kernel's layout, as ``dense``'s).
- ``dense``: XLA's FP8 GEMM, the ceiling: the dense product of the first group's matrix (the same
  FLOPs, as the bf16 ``dense``), per-tensor scales (amax / 448), the float8 operands straight into
  ``jax.lax.dot_general`` with a bf16 result, times the two scales; served weights stored as
  ``[n, k]`` (K-major, as cuBLASLt's FP8 GEMM reads them).
- ``lax``: ``jax.lax.ragged_dot`` on the float8 operands (it accepts them), per-tensor scales as
  ``dense``; what XLA makes of it on a GPU (an FP8 GEMM, or an upcast to bf16) is up to XLA.
- ``jla``: jax-linear-attention's ``jla.ops.mosaic_gpu.ragged_dot_fp8.ragged_dot_fp8`` (Pallas Mosaic
  GPU, Hopper): float8 operands, the weights as ``[G, N, K]`` (laid out in ``prepare``), no scales
  (per-tensor ones applied to its bf16 result, as ``dense``); skipped where its own ``supports_fp8``
  rejects the call (M >= 128 and a multiple of 8, K and N multiples of 128). Forward only: the
  kernel is not differentiable, so ``bwd`` and ``fwd_bwd`` are skipped.
- ``tokamax``: skipped. tokamax 0.0.17's ``ragged_dot`` takes qwix-quantized operands, but on Hopper
  (sm90) it dequantizes a quantized lhs and runs a weight-only kernel (the weights dequantized in the
  kernel, a bf16 MMA): not an FP8 GEMM; its FP8-activation kernel is for Blackwell (sm100).

Dense GEMM (``matmul``): ``jax_tk`` (``jax_tk.matmul_fp8``) and ``xla`` (XLA's FP8 GEMM as ``dense``).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from benchmarks import peers
from benchmarks.gemm_providers import _first_group
from benchmarks.harness import Provider, Skip, Unavailable, has_gpu

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn value
WEIGHT_BLOCK = (128, 128)  # jax_tk's (DeepSeek-V3's) weight blocks; activations get 1x128 inside the op


def _by_mode(name: str, serve: Provider, train: Provider | None, note: str = "", why_no_train: str = "") -> Provider:
    """The provider ``name``: ``serve`` timed in fwd, ``train`` in bwd and fwd_bwd (None: skipped, why_no_train)."""
    def per_mode(mode):
        if mode == "fwd":
            return dataclasses.replace(serve, note=note)
        if train is None:
            raise Skip(why_no_train)
        return dataclasses.replace(train, note=note)

    return Provider(name, serve.fn, note=note, per_mode=per_mode)


def _with_weights(quantize):
    """``prepare`` of a serving provider: (lhs, rhs, sizes, dout) -> (lhs, rhs, sizes, quantize(rhs), dout)."""
    quantize = jax.jit(quantize)
    return lambda lhs, rhs, sizes, dout: (lhs, rhs, sizes, quantize(rhs), dout)


def _first_group_with_weights(quantize):
    """``prepare`` of a dense serving provider: (lhs, rhs[0], quantize(rhs[0]), dout)."""
    quantize = jax.jit(quantize)
    return lambda lhs, rhs, sizes, dout: (lhs, rhs[0], quantize(rhs[0]), dout)


# ----------------------------------------------------------------------------------------------
# Per-tensor FP8 (XLA, lax, jla): one scale per operand
# ----------------------------------------------------------------------------------------------


def per_tensor_fp8(x):
    """(values float8_e4m3fn, scale float32 scalar): ``x / scale`` rounded to nearest, the scale
    ``amax(|x|) / 448`` (1 for zeros), so that the largest element becomes +-448."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf))
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
    # Clipped: x / scale can pass 448 by a float32 rounding, and float8_e4m3fn has no inf.
    return jnp.clip(xf / scale, -FP8_MAX, FP8_MAX).astype(FP8), scale


def _scaled(out, sa, sb):
    """The bf16 product of the float8 values times the two operands' scales."""
    return out * (sa * sb).astype(out.dtype)


def _dot_fp8(qa, qb, b_kn: bool = True):
    """XLA's FP8 GEMM: ``[m, k] @ [k, n]`` (``b_kn=False``: b given as ``[n, k]``) of (values, scale)
    pairs, bf16 out. The float8 operands go into the dot as they are (Flax's "direct" FP8 dot), which
    XLA's GPU compiler runs as a cuBLASLt FP8 GEMM; the scales multiply its result. Dequantizing first
    (convert to a wider type, times the scale, then the dot) would put a float8 -> wider convert right
    after the quantizing convert, a pair XLA on GPU may fold under jit (see
    jax_tk.gemm.fp8.dequantize), losing the FP8 GEMM."""
    dims = (((1,), (0 if b_kn else 1,)), ((), ()))
    out = jax.lax.dot_general(qa[0], qb[0], dims, preferred_element_type=jnp.bfloat16)
    return _scaled(out, qa[1], qb[1])


def _ragged_fp8(qa, qb, sizes):
    out = jax.lax.ragged_dot(qa[0], qb[0], sizes, preferred_element_type=jnp.bfloat16)
    return _scaled(out, qa[1], qb[1])


def _dequantize(q):
    return (q[0].astype(jnp.float32) * q[1]).astype(jnp.bfloat16)


def _straight_through(fp8_product, bf16_product):
    """``f(a, b, *rest)``: ``fp8_product`` of a and b quantized per tensor (bf16 arrays in, bf16 out);
    its gradient with respect to a and b is that of ``bf16_product`` at the dequantized operands
    (straight-through), none for ``rest`` (the group sizes)."""
    @jax.custom_vjp
    def f(a, b, *rest):
        return fp8_product(per_tensor_fp8(a), per_tensor_fp8(b), *rest)

    def f_fwd(a, b, *rest):
        qa, qb = per_tensor_fp8(a), per_tensor_fp8(b)
        # The float8 operands are the residuals (half the bytes of bf16 ones); the backward
        # dequantizes them into its GEMMs.
        return fp8_product(qa, qb, *rest), (qa, qb, rest)

    def f_bwd(res, g):
        qa, qb, rest = res
        _, vjp = jax.vjp(lambda a, b: bf16_product(a, b, *rest), _dequantize(qa), _dequantize(qb))
        return (*vjp(g), *(None for _ in rest))

    f.defvjp(f_fwd, f_bwd)
    return f


_dense_train = _straight_through(_dot_fp8, jnp.dot)
_ragged_train = _straight_through(_ragged_fp8, jax.lax.ragged_dot)


def _weights_nk(w):
    """Served weights as [n, k], K-major: the layout cuBLASLt's FP8 GEMM reads both operands in (for
    [k, n] weights XLA would transpose them in every call)."""
    values, scale = per_tensor_fp8(w)
    return values.T, scale


def _dense_xla(name: str) -> Provider:
    serve = Provider(name, lambda a, b, w: _dot_fp8(per_tensor_fp8(a), w, b_kn=False),
                     prepare=_first_group_with_weights(_weights_nk))
    train = Provider(name, _dense_train, prepare=_first_group)
    return _by_mode(name, serve, train, note="XLA's FP8 GEMM, per-tensor scales" +
                    (": dense [m, k] @ [k, n], the same FLOPs" if name == "dense" else ""))


def _lax(cfg) -> Provider:
    serve = Provider("lax", lambda lhs, rhs, sizes, w: _ragged_fp8(per_tensor_fp8(lhs), w, sizes),
                     prepare=_with_weights(per_tensor_fp8))
    return _by_mode("lax", serve, Provider("lax", _ragged_train),
                    note="jax.lax.ragged_dot on float8 operands, per-tensor scales")


def _jla(cfg) -> Provider:
    kernels, _ = peers.load("jla", "jla.ops.mosaic_gpu.ragged_dot_fp8")
    spec = jax.ShapeDtypeStruct
    if not kernels.supports_fp8(spec((cfg.m, cfg.k), FP8), spec((cfg.groups, cfg.n, cfg.k), FP8),
                                spec((cfg.groups,), jnp.int32)):
        raise Skip(f"jla.ops.mosaic_gpu.ragged_dot_fp8.supports_fp8 rejects m={cfg.m} k={cfg.k} n={cfg.n} "
                   f"groups={cfg.groups} on this GPU")

    def weights(rhs):  # [G, N, K]: the kernel reads 8-bit weights K-major
        values, scale = per_tensor_fp8(rhs)
        return jnp.swapaxes(values, 1, 2), scale

    def serve(lhs, rhs, sizes, w):
        a, sa = per_tensor_fp8(lhs)
        return _scaled(kernels.ragged_dot_fp8(a, w[0], sizes), sa, w[1])

    return _by_mode("jla", Provider("jla", serve, prepare=_with_weights(weights)), None,
                    note="jla.ops.mosaic_gpu.ragged_dot_fp8, per-tensor scales",
                    why_no_train="jla's ragged_dot_fp8 is forward only (not differentiable)")


# ----------------------------------------------------------------------------------------------
# jax_tk: block scales
# ----------------------------------------------------------------------------------------------


def _jax_tk_implementation(cfg, groups: int) -> tuple[str | None, str]:
    """As gemm_providers' for the bf16 kernel, for the FP8 kernel."""
    if not has_gpu():
        return None, "the float32 reference (no GPU)"
    import jax_tk
    from jax_tk.gemm import launch

    reason = launch.fp8_unsupported_reason(cfg.k, cfg.n, groups, cfg.m)
    if reason is not None:
        raise Skip(f"the FP8 kernel does not take {reason}")
    if not jax_tk.has_cuda_kernels():
        raise Unavailable("jax_tk was built without its CUDA kernels")
    return "tk", ""


def _block_weights(w):
    """Served weights as [.., n, k] (K-major, the layout jax_tk's FP8 kernel reads: passed with
    rhs_transposed / b_transposed, no transpose per call), 128x128 block scales."""
    import jax_tk

    return jax_tk.quantize_fp8(jnp.swapaxes(w, -1, -2), WEIGHT_BLOCK)


def _ragged_jax_tk(cfg) -> Provider:
    import jax_tk

    impl, note = _jax_tk_implementation(cfg, cfg.groups)
    op = functools.partial(jax_tk.ragged_dot_fp8, implementation=impl)
    serve = Provider("jax_tk", lambda lhs, rhs, sizes, w: op(lhs, w, sizes, rhs_transposed=True),
                     prepare=_with_weights(_block_weights))
    return _by_mode("jax_tk", serve, Provider("jax_tk", op), note=note)


def _matmul_jax_tk(cfg) -> Provider:
    import jax_tk

    impl, note = _jax_tk_implementation(cfg, 1)
    op = functools.partial(jax_tk.matmul_fp8, implementation=impl)
    serve = Provider("jax_tk", lambda a, b, w: op(a, w, b_transposed=True), prepare=_first_group_with_weights(_block_weights))
    return _by_mode("jax_tk", serve, Provider("jax_tk", op, prepare=_first_group), note=note)


def _tokamax(cfg) -> Provider:
    raise Skip("no FP8 GEMM on Hopper: tokamax 0.0.17's ragged_dot dequantizes a quantized lhs on sm90 and runs "
               "a weight-only kernel (bf16 MMA); its FP8-activation kernel is for Blackwell (sm100)")


RAGGED_FACTORIES = {
    "jax_tk": _ragged_jax_tk,
    "lax": _lax,
    "dense": lambda cfg: _dense_xla("dense"),
    "tokamax": _tokamax,
    "jla": _jla,
}
MATMUL_FACTORIES = {
    "jax_tk": _matmul_jax_tk,
    "xla": lambda cfg: _dense_xla("xla"),
}
