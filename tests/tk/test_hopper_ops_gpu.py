"""GPU unit tests of the Hopper (sm_90a) layer of the tile language, against numpy.

The kernels live in cc/tests/hopper_ops.cu (built into jax_tk._tk_tests), one launch per case:
  - TMA load of a [rows, dim] tile of a [batch, seq, heads, dim] tensor into a swizzled shared tile
    (semaphore: arrive_expect_bytes + wait), written out element by element;
  - wgmma: mma_ABt, mma_AtB and mma_AB (A in shared memory or in registers) on whole tiles and on
    windows of them, with and without accumulating onto a previous value; the result stored from
    registers, through shared memory in fragment order (store_fragments / fragment_offset), or added
    twice into a zeroed global buffer in fragment order (reduce_add_fragments); mma_ABt on FP8 (e4m3)
    tiles;
  - bulk reduce-add: several blocks add fp32 shared tiles into one global buffer;
  - a producer/consumer ring: tiles (tensor copies) and per-row weights (plain bulk copies) through
    2 slots with full/empty semaphores, several wraps.
Every output is aliased to an input that holds its initial value: NaN (so an element the kernel
forgets to write shows up), or for the reduce-add the random values it adds to. The kernels are
sm_90a code, so these tests run only on compute capability 9.0 GPUs (H100, H200).
"""
import pathlib
import re

import ml_dtypes
import numpy as np
import pytest

from jax_tk._core import extension


def _skip_reason():
    cap = extension.cuda_device_capability()
    if cap != (9, 0):
        return f"sm_90a kernels: needs a compute capability 9.0 GPU (H100/H200), found {cap}"
    if not extension.has_test_kernels():
        return "jax_tk was built without its test kernels (rebuild with JAX_TK_TEST_KERNELS=ON)"
    return None


_SKIP = _skip_reason()


def hopper(test):
    """Marks a test that runs the kernels: `gpu`, and skipped unless the GPU is sm_90."""
    return pytest.mark.gpu(pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))(test))


DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def run(target, init, *args, **attrs):
    """Calls FFI `target` on args; its one output starts as `init` (aliased to it)."""
    import jax

    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(init.shape, init.dtype),
                            input_output_aliases={len(args): 0})
    attrs = {k: np.int32(v) for k, v in attrs.items()}
    return np.asarray(jax.jit(lambda *xs: call(*xs, **attrs))(*args, init))


def normal(shape, dtype, rng, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(DTYPES[dtype] if isinstance(dtype, str) else dtype)


def nan(shape, dtype):
    return np.full(shape, np.nan, dtype)


# ----------------------------------------------------------------------------------------------
# 1. TMA load -> swizzled shared tile -> out
# ----------------------------------------------------------------------------------------------

@hopper
@pytest.mark.parametrize("where", ["inside", "past_end", "before_start"])
@pytest.mark.parametrize("rows", [64, 128])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_tma_load(dtype, dim, rows, where):
    rng = np.random.default_rng([1, dim, rows, len(where)])
    seq, b, h = 300, 1, 2
    x = normal((2, seq, 3, dim), dtype, rng)
    s0 = {"inside": 72, "past_end": seq - 20, "before_start": -16}[where]
    out = run("jax_tk_test_hopper_tma_load", nan((rows, dim), x.dtype), x, b=b, s0=s0, h=h)
    want = np.zeros((rows, dim), np.float32)  # rows outside the sequence arrive as zeros
    lo, hi = max(s0, 0), min(s0 + rows, seq)
    want[lo - s0:hi - s0] = x[b, lo:hi, h].astype(np.float32)
    np.testing.assert_array_equal(out.astype(np.float32), want)


# ----------------------------------------------------------------------------------------------
# 2. wgmma
# ----------------------------------------------------------------------------------------------

PRODUCTS = {"ABT": 0, "ATB": 1, "AB_SHARED": 2, "AB_REGS": 3}
# (product, n, k, A tile shape, B tile shape): mirrors TK_WGMMA_CASES in cc/tests/hopper_ops.cu.
# The product reads the bottom-right window of each tile that it needs (see product_ref), so a tile
# larger than that window tests window<>() operands: rows 64.. of a 128-row tile, columns 64.. of a
# 128-column tile (or 32.. of a 64-column one), as in the Hopper backward.
WGMMA_CASES = [
    ("ABT", 32, 64, (64, 64), (32, 64)),
    ("ABT", 64, 64, (64, 64), (64, 64)),
    ("ABT", 128, 64, (64, 64), (128, 64)),
    ("ABT", 32, 128, (64, 128), (32, 128)),
    ("ABT", 64, 128, (64, 128), (64, 128)),
    ("ABT", 128, 128, (64, 128), (128, 128)),
    ("ABT", 64, 64, (128, 64), (64, 64)),
    ("ABT", 64, 128, (128, 128), (64, 128)),
    ("ABT", 64, 64, (64, 128), (64, 128)),
    ("ABT", 64, 64, (64, 64), (128, 64)),
    ("ABT", 256, 64, (128, 64), (256, 64)),
    ("ATB", 64, 64, (64, 64), (64, 64)),
    ("ATB", 128, 64, (64, 64), (64, 128)),
    ("ATB", 64, 128, (128, 64), (128, 64)),
    ("ATB", 128, 128, (128, 64), (128, 128)),
    ("ATB", 64, 128, (128, 64), (128, 128)),
    ("ATB", 32, 128, (128, 64), (128, 64)),
    ("ATB", 64, 64, (64, 128), (64, 64)),
    ("ATB", 64, 64, (128, 64), (128, 64)),
    ("ATB", 256, 64, (64, 128), (64, 256)),
    ("AB_SHARED", 64, 64, (64, 64), (64, 64)),
    ("AB_SHARED", 128, 64, (64, 64), (64, 128)),
    ("AB_SHARED", 64, 128, (64, 128), (128, 64)),
    ("AB_SHARED", 128, 128, (64, 128), (128, 128)),
    ("AB_SHARED", 64, 64, (128, 64), (64, 64)),
    ("AB_SHARED", 128, 64, (128, 64), (64, 128)),
    ("AB_SHARED", 64, 64, (64, 128), (128, 128)),
    ("AB_SHARED", 32, 64, (64, 64), (64, 64)),
    ("AB_SHARED", 256, 64, (128, 64), (64, 256)),
    ("AB_REGS", 64, 64, (64, 64), (64, 64)),
    ("AB_REGS", 128, 64, (64, 64), (64, 128)),
    ("AB_REGS", 64, 128, (64, 128), (128, 64)),
    ("AB_REGS", 128, 128, (64, 128), (128, 128)),
    ("AB_REGS", 64, 64, (128, 128), (128, 128)),
    ("AB_REGS", 32, 64, (64, 64), (64, 64)),
]


# FP8 (e4m3): mma_ABt only (8-bit wgmma reads both operands K-major), 128-byte-wide tiles, k steps of
# 32; mirrors TK_WGMMA_FP8_CASES.
WGMMA_FP8_CASES = [
    ("ABT", 64, 128, (64, 128), (64, 128)),
    ("ABT", 128, 128, (64, 128), (128, 128)),
    ("ABT", 256, 128, (64, 128), (256, 128)),
    ("ABT", 128, 256, (64, 256), (128, 256)),
    ("ABT", 64, 128, (128, 128), (64, 128)),
    ("ABT", 64, 128, (64, 256), (64, 256)),
]


def case_id(case):
    product, n, k, (ar, ac), (br, bc) = case
    return f"{product}-n{n}-k{k}-a{ar}x{ac}-b{br}x{bc}"


def product_ref(product, n, k, a, b):
    """The product of the operands' bottom-right windows, in float32."""
    a, b = a.astype(np.float32), b.astype(np.float32)
    if product == "ABT":
        return a[-64:, -k:] @ b[-n:, -k:].T
    if product == "ATB":
        return a[-k:, -64:].T @ b[-k:, -n:]
    return a[-64:, -k:] @ b[-k:, -n:]  # AB_SHARED, AB_REGS


def test_wgmma_cases_mirror_the_kernel_file():
    """WGMMA_CASES lists exactly the cases compiled in cc/tests/hopper_ops.cu (runs without a GPU)."""
    src = pathlib.Path(__file__).parents[2] / "cc" / "tests" / "hopper_ops.cu"
    if not src.exists():
        pytest.skip("not in a source checkout")
    compiled = [(p, int(n), int(k), (int(ar), int(ac)), (int(br), int(bc))) for p, n, k, ar, ac, br, bc in
                re.findall(r"X\((\w+), (\d+), (\d+), (\d+), (\d+), (\d+), (\d+)\)", src.read_text())]
    assert compiled == WGMMA_CASES + WGMMA_FP8_CASES


@hopper
@pytest.mark.parametrize("mode", ["set", "accumulate", "accumulate-fragments", "accumulate-reduce"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", WGMMA_CASES, ids=case_id)
def test_wgmma(case, dtype, mode):
    product, n, k, a_shape, b_shape = case
    accumulate = mode != "set"
    fragments = {"fragments": 1, "reduce": 2}.get(mode.rsplit("-")[-1], 0)
    rng = np.random.default_rng([2, PRODUCTS[product], n, k, *a_shape, *b_shape, len(mode)])
    a, b = normal(a_shape, dtype, rng), normal(b_shape, dtype, rng)
    c = normal((64, n), np.float32, rng, scale=np.sqrt(k))  # the accumulator's previous value
    out = run("jax_tk_test_hopper_wgmma", nan((64, n), np.float32), a, b, c,
              product=PRODUCTS[product], k=k, accumulate=int(accumulate), fragments=int(fragments))
    want = product_ref(product, n, k, a, b) + (c if accumulate else 0)
    if fragments == 2:  # added twice into a zeroed buffer
        want = 2 * want
    assert np.isfinite(out).all(), f"{np.sum(~np.isfinite(out))} of {out.size} outputs are NaN/inf"
    rms = np.sqrt(np.mean(want.astype(np.float64) ** 2))
    np.testing.assert_allclose(out, want, rtol=1e-2, atol=1e-2 * rms)


@hopper
@pytest.mark.parametrize("accumulate", [False, True], ids=["set", "accumulate"])
@pytest.mark.parametrize("case", WGMMA_FP8_CASES, ids=case_id)
def test_wgmma_fp8(case, accumulate):
    """e4m3 operands (finite values of every magnitude the format has near 1) against their float32
    product: the tensor cores add the k products in float32-range arithmetic, so the tolerance is the
    16-bit cases'."""
    product, n, k, a_shape, b_shape = case
    rng = np.random.default_rng([4, n, k, *a_shape, *b_shape, int(accumulate)])
    a = normal(a_shape, ml_dtypes.float8_e4m3fn, rng, scale=2.0)
    b = normal(b_shape, ml_dtypes.float8_e4m3fn, rng, scale=2.0)
    c = normal((64, n), np.float32, rng, scale=np.sqrt(k))
    out = run("jax_tk_test_hopper_wgmma", nan((64, n), np.float32), a, b, c,
              product=PRODUCTS[product], k=k, accumulate=int(accumulate), fragments=0)
    want = product_ref(product, n, k, a, b) + (c if accumulate else 0)
    assert np.isfinite(out).all(), f"{np.sum(~np.isfinite(out))} of {out.size} outputs are NaN/inf"
    rms = np.sqrt(np.mean(want.astype(np.float64) ** 2))
    np.testing.assert_allclose(out, want, rtol=1e-2, atol=1e-2 * rms)


# ----------------------------------------------------------------------------------------------
# 3. Bulk reduce-add
# ----------------------------------------------------------------------------------------------

@hopper
@pytest.mark.parametrize("blocks,rounds", [(2, 1), (4, 3), (16, 2)])
def test_reduce_add(blocks, rounds):
    rng = np.random.default_rng([3, blocks, rounds])
    x = normal((blocks, rounds, 64, 64), np.float32, rng)
    init = normal((64, 64), np.float32, rng, scale=4.0)
    out = run("jax_tk_test_hopper_reduce_add", init, x)
    want = init.astype(np.float64) + x.sum(axis=(0, 1), dtype=np.float64)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------------------------
# 4. Producer/consumer ring
# ----------------------------------------------------------------------------------------------

@hopper
@pytest.mark.parametrize("n_tiles", [1, 2, 7, 16])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_ring(dtype, dim, n_tiles):
    rng = np.random.default_rng([4, dim, n_tiles])
    seq, b, h = 128 * n_tiles - 37, 1, 2  # the last tile runs past the end (zero-filled)
    x = normal((2, seq, 3, dim), dtype, rng)
    w = rng.uniform(0.5, 2.0, 128 * n_tiles).astype(np.float32)  # a weight per row of every tile
    out = run("jax_tk_test_hopper_ring", nan((128, dim), np.float32), x, w, b=b, h=h, n_tiles=n_tiles)
    padded = np.zeros((128 * n_tiles, dim), np.float64)
    padded[:seq] = x[b, :, h].astype(np.float64)
    want = (padded * w[:, None]).reshape(n_tiles, 128, dim).sum(axis=0)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=5e-5)
