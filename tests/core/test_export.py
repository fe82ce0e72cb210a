"""jax.export of programs that call jax_tk: with ``jax_tk.export_checks()`` a jitted model step
(attention forward and backward, decode, grouped GEMM) exports for CUDA, also from a machine without
a GPU; exported for CPU and CUDA together, it serializes, loads back and gives the same results; on
the GPU, the loaded program runs the kernels and gives what the direct call gives."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from helpers import needs_extension, randn, rel_err

BF16 = jnp.bfloat16
TARGETS = ("jax_tk_attention_fwd", "jax_tk_attention_bwd", "jax_tk_decode", "jax_tk_gemm_ragged")


def _step(q, k, v, cache, lengths, x, w, sizes):
    """Every kernel: attention with its gradient, decode, and the grouped GEMM."""
    loss = lambda q: jnp.sum(jax_tk.attention(q, k, v, is_causal=True).astype(jnp.float32) ** 2)
    dq = jax.grad(loss)(q)
    out = jax_tk.decode.attention(q[:, -1:], cache, cache, lengths)
    return dq, out, jax_tk.ragged_dot(x, w, sizes)


def _args(seed=0):
    rng = np.random.default_rng(seed)
    return (randn(rng, (2, 128, 4, 64), BF16), randn(rng, (2, 128, 2, 64), BF16), randn(rng, (2, 128, 2, 64), BF16),
            randn(rng, (2, 256, 2, 64), BF16), jnp.asarray([200, 77], jnp.int32), randn(rng, (96, 64), BF16),
            randn(rng, (3, 64, 128), BF16), jnp.asarray([40, 0, 50], jnp.int32))


def test_export_checks_name_every_kernel():
    names = {str(c) for c in jax_tk.export_checks()}
    assert all(any(t in n for n in names) for t in TARGETS), names


@needs_extension
def test_export_for_cuda_needs_and_takes_the_checks():
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _args()]
    fn = jax.jit(_step)
    with pytest.raises(ValueError, match="custom call"):
        jax.export.export(fn, platforms=["cuda"])(*args)
    text = jax.export.export(fn, platforms=["cuda"], disabled_checks=jax_tk.export_checks())(*args).mlir_module()
    for t in TARGETS:
        assert f"stablehlo.custom_call @{t}" in text, t


@pytest.mark.parametrize("serialized", [False, True], ids=["exported", "serialized"])
def test_export_runs_where_it_is_loaded(serialized):
    """Exported for CPU and CUDA: this machine's platform runs the exported program (loaded back from
    its bytes too), with the results of the direct call (the kernels on a GPU, the reference elsewhere)."""
    if serialized:
        pytest.importorskip("flatbuffers", reason="JAX serializes exports with flatbuffers (a test extra)")
    args = _args(1)
    exported = jax.export.export(jax.jit(_step), platforms=["cpu", "cuda"],
                                 disabled_checks=jax_tk.export_checks())(*args)
    if serialized:
        exported = jax.export.deserialize(exported.serialize())
    for got, want in zip(jax.tree.leaves(exported.call(*args)), jax.tree.leaves(jax.jit(_step)(*args))):
        # (the same computation; XLA may fuse the bf16 parts around the kernels differently: a few ulps)
        assert got.shape == want.shape and got.dtype == want.dtype and rel_err(got, want) < 1e-3
