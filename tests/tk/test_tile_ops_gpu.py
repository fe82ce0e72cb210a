"""GPU unit tests of the tile language: each operation against a numpy reference.

The kernels live in cc/tests/tile_ops.cu (built as jax_tk._tk_tests); the op ids below mirror its
`Op` enum. Every case loads its inputs global -> shared (cp.async) -> registers, in the row or the
column register layout, so loads and stores are exercised by every op.
"""
import zlib

import ml_dtypes
import numpy as np
import pytest

from jax_tk._core import extension

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not extension.has_test_kernels(),
                       reason="jax_tk was built without its test kernels (rebuild with JAX_TK_TEST_KERNELS=ON)"),
]

OPS = dict(
    COPY=0, SHARED_RT=1, GLOBAL_RT=2, EXP=3, EXP2=4, LOG=5, ABS=6, NEG=7, ADD=8, SUB=9, MUL=10, DIV=11,
    MAX=12, MIN=13, ADD_SCALAR=14, ROW_MAX=15, ROW_SUM=16, COL_MAX=17, COL_SUM=18, ADD_ROW=19,
    SUB_ROW=20, MUL_ROW=21, DIV_ROW=22, ADD_COL=23, SUB_COL=24, MUL_COL=25, DIV_COL=26, TRIL=27,
    TRIU=28, BOUNDS=29, MMA_AB=30, MMA_ABT=31, MMA_ATB=32, MMA_ATBT=33, FILL=34, ZERO=35, CAST=36,
    SHARED_ST=37, KEEP_BITS=38, KEEP_BITS_BY_COL=39, CHUNKS=40, CHUNKS_T=41, CHUNKS_STORE=42, CHUNKS_STORE_T=43,
    ROW_SUM_LANES=44, RING_BEFORE_2=45, RING_BEFORE_3=46, RING_AFTER_3=47,
)
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
RTOL = {"float32": 2e-6, "bfloat16": 8e-3, "float16": 1e-3}


def run_op(op, a, b, v, layout, param=0.0):
    """The op's (out, vec), both written over NaN (the handler checks that they are aliased to it): an
    element the op should write and does not stays NaN and fails the comparison."""
    import jax
    import jax.numpy as jnp

    call = jax.ffi.ffi_call(
        "jax_tk_test_tile_op",
        (jax.ShapeDtypeStruct(a.shape, jnp.float32), jax.ShapeDtypeStruct((64,), jnp.float32)),
        input_output_aliases={3: 0, 4: 1},
    )
    poison = (np.full(a.shape, np.nan, np.float32), np.full((64,), np.nan, np.float32))
    out, vec = jax.jit(lambda *args: call(*args, op=np.int32(OPS[op]), layout=np.int32(layout),
                                          param=np.float32(param)))(a, b, v, *poison)
    return np.asarray(out), np.asarray(vec)


def inputs(dtype, shape, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(shape).astype(DTYPES[dtype])
    b = (rng.standard_normal(shape) + np.sign(rng.standard_normal(shape)) * 0.5).astype(DTYPES[dtype])  # away from 0
    v = (rng.uniform(0.5, 2.0, 64) * np.sign(rng.standard_normal(64))).astype(np.float32)
    return a, b, v


def rounded(x, dtype):
    return np.asarray(x, np.float32).astype(DTYPES[dtype]).astype(np.float32)


def close(got, want, dtype, rtol=None, atol=1e-6):
    rtol = RTOL[dtype] if rtol is None else rtol
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


ELEMENTWISE = {
    "COPY": lambda a, b, v: a,
    "SHARED_RT": lambda a, b, v: a,
    "SHARED_ST": lambda a, b, v: a,  # the store alone (stmatrix for 16-bit tiles on sm_90)
    "CAST": lambda a, b, v: a,
    "EXP": lambda a, b, v: np.exp(a),
    "EXP2": lambda a, b, v: np.exp2(a),
    "LOG": lambda a, b, v: np.log(np.abs(a) + 0.5),  # the kernel rounds |a| + 0.5 first: see below
    "ABS": lambda a, b, v: np.abs(a),
    "NEG": lambda a, b, v: -a,
    "ADD": lambda a, b, v: a + b,
    "SUB": lambda a, b, v: a - b,
    "MUL": lambda a, b, v: a * b,
    "DIV": lambda a, b, v: a / b,
    "MAX": lambda a, b, v: np.maximum(a, b),
    "MIN": lambda a, b, v: np.minimum(a, b),
    "ADD_SCALAR": lambda a, b, v: a + 1.5,
    "ADD_ROW": lambda a, b, v: a + v[: a.shape[0], None],
    "SUB_ROW": lambda a, b, v: a - v[: a.shape[0], None],
    "MUL_ROW": lambda a, b, v: a * v[: a.shape[0], None],
    "DIV_ROW": lambda a, b, v: a / v[: a.shape[0], None],
    "ADD_COL": lambda a, b, v: a + v[None, : a.shape[1]],
    "SUB_COL": lambda a, b, v: a - v[None, : a.shape[1]],
    "MUL_COL": lambda a, b, v: a * v[None, : a.shape[1]],
    "DIV_COL": lambda a, b, v: a / v[None, : a.shape[1]],
    "FILL": lambda a, b, v: np.full_like(a, 1.5),
    "ZERO": lambda a, b, v: np.zeros_like(a),
}


@pytest.mark.parametrize("layout", [0, 1], ids=["row", "col"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", list(ELEMENTWISE))
def test_elementwise(op, dtype, layout):
    a, b, v = inputs(dtype, (32, 64), seed=zlib.crc32(repr((op, dtype, layout)).encode()))  # (not hash(): salted)
    out, _ = run_op(op, a, b, v, layout, param=1.5)
    af, bf = a.astype(np.float32), b.astype(np.float32)
    if op == "LOG":  # abs, add and log are three ops on a tile of dtype: |a| + 0.5 is rounded too
        want = rounded(np.log(rounded(np.abs(af) + 0.5, dtype)), dtype)
    else:
        want = rounded(ELEMENTWISE[op](af, bf, v), dtype)  # the tile holds dtype: one rounding
    extra = 4e-6 if op in ("EXP", "EXP2", "LOG") and dtype == "float32" else None  # approx. ex2/lg2
    close(out, want, dtype, rtol=extra)


@pytest.mark.parametrize("layout", [0, 1], ids=["row", "col"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_global_load_short_view(dtype, layout):
    a, b, v = inputs(dtype, (32, 64), seed=7)
    out, _ = run_op("GLOBAL_RT", a, b, v, layout)
    want = a.astype(np.float32).copy()
    want[-3:] = 0  # rows past the view's end read as zero
    close(out, want, dtype, rtol=0, atol=0)


@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("layout", [0, 1], ids=["row", "col"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", ["ROW_MAX", "ROW_SUM", "COL_MAX", "COL_SUM"])
def test_reductions(op, dtype, layout, init):
    a, b, v = inputs(dtype, (32, 64), seed=11)
    _, vec = run_op(op, a, b, v, layout, param=1.0 if init else 0.0)
    af = a.astype(np.float32)
    axis = 1 if op.startswith("ROW") else 0
    red = af.max(axis=axis) if op.endswith("MAX") else af.sum(axis=axis)
    n = red.shape[0]
    if init:
        red = np.maximum(red, v[:n]) if op.endswith("MAX") else red + v[:n]
    np.testing.assert_allclose(vec[:n], red, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", [0, 1], ids=["row", "col"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_row_sum_lanes(dtype, layout):
    # each lane's part of the row sums over two tiles (row_sum_lane), completed by sum_lanes
    a, b, v = inputs(dtype, (32, 64), seed=13)
    _, vec = run_op("ROW_SUM_LANES", a, b, v, layout)
    want = a.astype(np.float32).sum(axis=1) + b.astype(np.float32).sum(axis=1)
    np.testing.assert_allclose(vec[:32], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("diag", [-5, 0, 3])
@pytest.mark.parametrize("layout", [0, 1], ids=["row", "col"])
@pytest.mark.parametrize("op", ["TRIL", "TRIU"])
def test_triangular(op, layout, diag):
    a, b, v = inputs("bfloat16", (32, 64), seed=3)
    out, _ = run_op(op, a, b, v, layout, param=float(diag))
    r, c = np.indices(a.shape)
    keep = (c - r <= diag) if op == "TRIL" else (c - r >= diag)
    want = np.where(keep, a.astype(np.float32), -np.inf)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("layout", [0, 1], ids=["row", "col"])
def test_bounds(layout):
    a, b, v = inputs("float16", (32, 64), seed=5)
    out, _ = run_op("BOUNDS", a, b, v, layout)
    r, c = np.indices(a.shape)
    want = np.where((r < 32 - 5) & (c < 64 - 7), a.astype(np.float32), 7.0)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("op", ["MMA_AB", "MMA_ABT", "MMA_ATB", "MMA_ATBT"])
def test_mma(op, dtype):
    a, b, v = inputs(dtype, (32, 32), seed=13)
    out, _ = run_op(op, a, b, v, 0)
    A, B = a.astype(np.float64), b.astype(np.float64)
    A = A.T if op in ("MMA_ATB", "MMA_ATBT") else A
    B = B.T if op in ("MMA_ABT", "MMA_ATBT") else B
    want = A @ B + v[0]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("layout", [0, 1], ids=["row", "col"])
@pytest.mark.parametrize("op,shape,offset", [("KEEP_BITS", (32, 64), 0), ("KEEP_BITS", (32, 32), 16),
                                             ("KEEP_BITS", (32, 32), 32), ("KEEP_BITS_BY_COL", (32, 32), 0),
                                             ("KEEP_BITS_BY_COL", (32, 32), 16), ("KEEP_BITS_BY_COL", (32, 32), 32)])
def test_keep_bits(op, shape, offset, layout):
    """keep_bits / keep_bits_by_col: a bit matrix of 32-bit words (the bits of v), read from a bit
    offset (a multiple of 16), against numpy."""
    a, b, _ = inputs("bfloat16", shape, seed=7 + offset)
    words = np.random.default_rng(offset).integers(0, 2**32, 64, dtype=np.uint64).astype(np.uint32)
    out, _ = run_op(op, a, b, words.view(np.float32), layout, param=float(offset))
    rows, cols = shape
    along, across = (cols, rows) if op == "KEEP_BITS" else (rows, cols)
    n = (offset + along + 31) // 32  # words per row (per column)
    bits = (words[: across * n].reshape(across, n, 1) >> np.arange(32, dtype=np.uint32)) & 1
    bits = bits.reshape(across, 32 * n)[:, offset:offset + along].astype(bool)  # [row, col] or [col, row]
    keep = bits if op == "KEEP_BITS" else bits.T
    want = np.where(keep, a.astype(np.float32), -np.inf)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("op", ["CHUNKS", "CHUNKS_T"])
def test_chunks_load(op, dtype):
    """A block read in 16-byte chunks (rows past the view read as 0), put in shared memory and read
    from there into registers, as it is or transposed (ldmatrix .trans)."""
    a, b, v = inputs(dtype, (32, 32), seed=11)
    out, _ = run_op(op, a, b, v, 0)
    want = a.astype(np.float32)
    want[-3:] = 0
    np.testing.assert_array_equal(out, want.T if op == "CHUNKS_T" else want)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("op", ["CHUNKS_STORE", "CHUNKS_STORE_T"])
def test_chunks_store(op, dtype):
    """A register tile to shared memory, as it is or transposed (stmatrix .trans, sm_90), then in
    16-byte chunks to global memory; rows past the view are not written."""
    cap = extension.cuda_device_capability()
    if op == "CHUNKS_STORE_T" and cap != (9, 0):
        pytest.skip(f"stmatrix: sm_90 (H100/H200), found {cap}")
    a, b, v = inputs(dtype, (32, 32), seed=12)
    out, _ = run_op(op, a, b, v, 0)
    got = out.view(DTYPES[dtype]).reshape(-1)[: 32 * 32].reshape(32, 32).astype(np.float32)
    ones = np.ones((32, 32), np.float32).view(DTYPES[dtype]).reshape(-1)[: 32 * 32].reshape(32, 32).astype(np.float32)
    want = a.astype(np.float32)
    want = want.T if op == "CHUNKS_STORE_T" else want
    np.testing.assert_array_equal(got[:30], want[:30])
    np.testing.assert_array_equal(got[30:], ones[30:])


@pytest.mark.parametrize("uses", [0, 1, 2, 3, 8])
@pytest.mark.parametrize("layout", [0, 1], ids=["row", "col"])
@pytest.mark.parametrize("op", ["RING_BEFORE_2", "RING_BEFORE_3", "RING_AFTER_3"])
def test_cp_async_ring(op, layout, uses):
    """Blocks streamed through a cp.async stage ring (tk::cp_async_ring) of two or three slots, refilled
    before or after the wait: use n is a with its rows rotated up by n (so every use differs from the
    ones a wrong slot or an early read would show), b a group loaded before the ring's; out = b +
    sum_n (n + 1) use_n."""
    a, b, v = inputs("bfloat16", (32, 64), seed=13 + uses)
    out, _ = run_op(op, a, b, v, layout, param=uses)
    want = b.astype(np.float32)
    for n in range(uses):
        want = want + (n + 1) * np.roll(a.astype(np.float32), -n, axis=0)
    close(out, want, "float32", rtol=1e-5, atol=1e-4)
