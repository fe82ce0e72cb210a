"""GPU tests of the grouped GEMM kernels (cc/gemm/), called through their FFI target directly,
against a float64 numpy reference of the same (rounded) inputs.

The target's contract is at the top of cc/gemm/gemm.h. The output is poisoned with NaN before each
run (the ``_test`` target, whose trailing operand is aliased to the output), so an element the kernel
forgets to write shows up as NaN; the rows of ``a`` (and ``b`` in mode 1) past the groups' sum hold
inf, so a kernel that lets them into a product shows NaN/inf too. The ``sm80`` variant (the call's
``variant`` attribute, ``JAX_TK_KERNELS``'s value) runs the mma.sync kernels on Hopper as well.
"""
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from jax_tk._core import dispatch, extension
from jax_tk._core.ffi import kernel_call

TARGET = "jax_tk_gemm_ragged"
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
RAGGED, RAGGED_BT, CONTRACT, CONTRACT_BT = "ragged", "ragged_bt", "contract", "contract_bt"
CONTRACTS = (CONTRACT, CONTRACT_BT)


def contract():
    return extension.contract("gemm")


@functools.partial(jax.jit, static_argnames=("kind", "out_dtype", "out_shape", "kernels"))
def kernel(a, b, sizes, *, kind, out_dtype, out_shape, kernels="auto"):
    c = contract()
    mode = c["MODE_CONTRACT"] if kind in CONTRACTS else c["MODE_RAGGED"]
    out_init = (jnp.full(out_shape, jnp.nan, out_dtype),)
    attributes = {"mode": np.int32(mode), "b_transposed": np.int32(kind in (RAGGED_BT, CONTRACT_BT)),
                  "variant": np.int32(dispatch.kernel_variant(kernels))}
    (out,) = kernel_call(TARGET, (jax.ShapeDtypeStruct(out_shape, out_dtype),), (a, b, sizes), attributes,
                         out_init=out_init)
    return out


def group_rows(sizes, m):
    """[(start, end)] of each group: exclusive cumsum, negative sizes as 0, clipped to [0, m)."""
    rows, off = [], 0
    for s in sizes:
        s = min(max(int(s), 0), m - off)
        rows.append((off, off + s))
        off += s
    return rows


def reference(a, b, sizes, kind):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if kind == CONTRACT_BT:  # (a [k, m], b [n, m]: the contraction's rows are their columns)
        a, b = a.T, b.T
    m, k = a.shape
    rows = group_rows(sizes, m)
    if kind in CONTRACTS:
        out = np.zeros((len(sizes), k, b.shape[1]))
        for i, (r0, r1) in enumerate(rows):
            out[i] = a[r0:r1].T @ b[r0:r1]
        return out
    out = np.zeros((m, b.shape[1] if kind == RAGGED_BT else b.shape[2]))
    for i, (r0, r1) in enumerate(rows):
        out[r0:r1] = a[r0:r1] @ (b[i].T if kind == RAGGED_BT else b[i])
    return out


def make_inputs(seed, m, k, n, sizes, kind, dtype):
    """Fresh normal a and b (never zeros or ones); the rows past the groups' sum are inf (CONTRACT_BT:
    a's columns, a [k, m] and b [n, m]; b's stay finite there, as its contract asks)."""
    rng = np.random.default_rng(seed)
    g = len(sizes)
    a = rng.standard_normal((m, k), dtype=np.float32)
    if kind in CONTRACTS:
        b = rng.standard_normal((m, n), dtype=np.float32)
    else:
        b = rng.standard_normal((g, n, k) if kind == RAGGED_BT else (g, k, n), dtype=np.float32)
    total = group_rows(sizes, m)[-1][1] if g else 0
    a[total:] = np.inf
    if kind == CONTRACT:
        b[total:] = -np.inf
    if kind == CONTRACT_BT:
        a, b = np.ascontiguousarray(a.T), np.ascontiguousarray(b.T)
    np_dtype = jnp.dtype(dtype)
    return a.astype(np_dtype), b.astype(np_dtype), np.asarray(sizes, np.int32)


def check(m, k, n, sizes, kind, dtype=BF16, out_dtype=None, seed=None, kernels="auto"):
    out_dtype = out_dtype or dtype
    g = len(sizes)
    seed = zlib.crc32(repr((m, k, n, tuple(sizes), kind, jnp.dtype(dtype).name)).encode()) if seed is None else seed
    a, b, gs = make_inputs(seed, m, k, n, sizes, kind, dtype)
    out_shape = (g, k, n) if kind in CONTRACTS else (m, n)
    got = np.asarray(kernel(a, b, gs, kind=kind, out_dtype=out_dtype, out_shape=out_shape, kernels=kernels))
    got = got.astype(np.float64)
    want = reference(a, b, sizes, kind)
    assert got.shape == want.shape
    bad = ~np.isfinite(got)
    assert not bad.any(), f"{bad.sum()} of {got.size} outputs are NaN/inf (first at {np.argwhere(bad)[0]})"
    # What must be exactly zero is: rows past the groups' sum (ragged), empty groups (contract).
    zero = np.zeros(want.shape, bool)
    if kind in CONTRACTS:
        for i, (r0, r1) in enumerate(group_rows(sizes, m)):
            zero[i] = r0 == r1
    else:
        zero[group_rows(sizes, m)[-1][1] if g else 0:] = True
    assert np.all(got[zero] == 0), f"{np.sum(got[zero] != 0)} outputs that must be 0 are not"
    tol = 1e-4 if out_dtype == F32 else 1e-2
    err = helpers.rel_err(got, want)
    assert err < tol, f"relative error {err:.3g} >= {tol}"
    return got


@pytest.fixture(params=["auto", "sm80"])
def kernels(request):
    """The kernels the handler picks for this GPU, or the mma.sync ones."""
    return request.param


def _sizes(seed, g, m, zeros=0.3, fill=1.0):
    """g random group sizes (some zero) summing to about fill * m (never more than m)."""
    rng = np.random.default_rng(seed)
    w = rng.random(g) * (rng.random(g) > zeros)
    if w.sum() == 0:
        w[0] = 1
    s = np.floor(w / w.sum() * fill * m).astype(int)
    return [int(x) for x in s]


# (m, k, n, group sizes): odd sizes (multiples of 8 for k and n), empty groups, one group, many groups,
# sums below m, negative sizes and sums past m (clipped), tiles that cut through group boundaries.
CASES = [
    (1, 8, 8, [1]),
    (300, 72, 136, [300]),                      # dense, one group, odd
    (257, 64, 256, [0, 100, 0, 157]),           # empty groups
    (130, 8, 264, [65, 65]),                    # a boundary inside a tile, k < one step
    (1000, 200, 392, _sizes(1, 7, 1000, fill=0.8)),   # sum < m
    (777, 96, 40, [-5, 300, 0, 600, 100]),      # negative size, sum past m (clipped)
    (4099, 136, 520, _sizes(2, 256, 4099)),     # 256 groups, many empty
    (2048, 1024, 1536, [2048]),                 # dense, many steps
    (3000, 512, 768, _sizes(3, 8, 3000, zeros=0.0, fill=0.95)),  # MoE-like
    (64, 8, 8, [0, 0, 0]),                      # every group empty: all zeros
    # Products of 1024 rows or more run on Hopper in clusters of two blocks (gemm_sm90.cu), each block one
    # tile of a pair; dense ones 192, 256 or 320 columns wide (gemm.h's dense_tile_n; the widths named are
    # its picks on 132 SMs, which tests/core/test_core.py checks):
    (1100, 72, 264, [1100]),                    # the last tile's second half wholly past m (192)
    (3000, 200, 392, [2900]),                   # a half that crosses the group's end; rows past it (192)
    (1025, 72, 2504, [1025]),                   # 256, a last row block of one row
    (1284, 72, 2824, [1284]),                   # 320: five panels of b, two to one block, three to the other
    (3000, 200, 392, [1500, 1000]),             # long groups: pairs one above the other, an odd last row block's side by side
    (2000, 264, 1408, [256, 130, 0, 128, 1, 385, 640, 200]),  # Qwen-like widths: 5.5 tiles of 256 columns
    (1300, 136, 520, [129, 0, 500, 371]),       # three column tiles (a pair's second past n); rows past the groups
    (700, 72, 520, [64, 1, 63, 300, 0, 200]),   # groups ending in tiles of 64, 1 and 63 rows
    (300, 64, 264, [10, 50, 64, 128, 30]),      # a last tile of 18 rows past the groups' sum
]


def _case_id(c):
    m, k, n, s = c
    return f"m{m}_k{k}_n{n}_g{len(s)}"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [RAGGED, RAGGED_BT, CONTRACT])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernels_vs_reference(case, kind, kernels):
    m, k, n, sizes = case
    i = CASES.index(case)
    dtype = (BF16, F16)[i % 2]
    out_dtype = (None, F32)[(i // 2) % 2]
    check(m, k, n, sizes, kind, dtype, out_dtype, kernels=kernels)


# One group's contraction (a dense product's weight gradient) whose output has 1024 rows (k) or more,
# over 1024 rows or more, runs on Hopper in clusters of two, each block 128 of a 256-row tile's rows of
# out, b's tile of a step multicast; widths as dense_tile_n picks for [k, n] (192, 256 and 320 here;
# test_core checks the picks). m = 1086: a last step of 62 rows (rows of both operands past the group
# zeroed, every panel of b), k = 1032: a last tile whose second half is all past k.
@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [None, F32], ids=["same", "f32"])
@pytest.mark.parametrize("n", [264, 2504, 3336])
def test_contraction_in_clusters(n, out_dtype):
    check(1086, 1032, n, [1086], CONTRACT, F16 if n == 2504 else BF16, out_dtype)
    check(1200, 1032, n, [1086], CONTRACT, BF16, out_dtype)  # (rows past the group: -inf in b, inf in a)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [None, F32], ids=["same", "f32"])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("kind", [RAGGED, RAGGED_BT, CONTRACT])
def test_dtypes(kind, dtype, out_dtype, kernels):
    check(520, 264, 392, [100, 0, 333, 7], kind, dtype, out_dtype, kernels=kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [RAGGED, CONTRACT])
def test_deterministic(kind, kernels):
    """No atomics: the same bits every run."""
    a = check(1000, 256, 512, _sizes(4, 16, 1000), kind, kernels=kernels)
    b = check(1000, 256, 512, _sizes(4, 16, 1000), kind, kernels=kernels)
    np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
def test_hopper_matches_sm80():
    """The two kernels agree closely (both fp32 accumulation; the order of sums differs)."""
    sizes = _sizes(5, 12, 3000, fill=0.9)
    x = check(3000, 320, 640, sizes, RAGGED, out_dtype=F32)
    y = check(3000, 320, 640, sizes, RAGGED, out_dtype=F32, kernels="sm80")
    assert helpers.rel_err(x, y) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,kind,match", [
    (64, 12, 16, RAGGED, "multiples of 8"),
    (64, 16, 12, CONTRACT, "multiples of 8"),
    (60, 16, 16, CONTRACT_BT, "m must be a multiple of 8"),
])
def test_rejects_unsupported(m, k, n, kind, match):
    a, b, gs = make_inputs(0, m, k, n, [m], kind, BF16)
    out_shape = (1, k, n) if kind in CONTRACTS else (m, n)
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(kernel(a, b, gs, kind=kind, out_dtype=BF16, out_shape=out_shape))


# Mode 1 with both operands K-major (a split-k product's input gradient): the sm_90a kernel's only.
# (m, k, n, sizes): groups that start and end inside the kernel's 64-wide steps (their other groups'
# columns zeroed), empty groups, columns past the groups, ranges as split-k cuts them.
CONTRACT_BT_CASES = [
    (1000, 136, 264, _sizes(6, 5, 1000, fill=0.9)),
    (520, 264, 392, [100, 0, 333, 7]),
    (8192, 128, 520, [2048] * 4),
    (2200, 64, 136, [1152, 1048]),
    (72, 8, 8, [72]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [None, F32], ids=["same", "f32"])
@pytest.mark.parametrize("case", CONTRACT_BT_CASES, ids=_case_id)
def test_contract_bt_vs_reference(case, out_dtype):
    if extension.cuda_device_capability() != (9, 0):
        pytest.skip("mode 1 with b transposed runs on the sm_90a kernel")
    m, k, n, sizes = case
    check(m, k, n, sizes, CONTRACT_BT, BF16, out_dtype)
    check(m, k, n, sizes, CONTRACT_BT, F16, out_dtype)


@pytest.mark.gpu
def test_contract_bt_is_refused_by_the_mma_sync_kernel():
    a, b, gs = make_inputs(0, 64, 16, 16, [64], CONTRACT_BT, BF16)
    with pytest.raises(Exception, match="sm_90a kernel"):
        jax.block_until_ready(kernel(a, b, gs, kind=CONTRACT_BT, out_dtype=BF16, out_shape=(1, 16, 16), kernels="sm80"))


# Mode 2 (a dense product's split-k parts as the groups of the row kernel; the sm_90a kernel's only):
# a [rows, g k], b [g, k, n] (or transposed, [n, g k]), out [g rows, n] with rows i of part p =
# a[i, p k : (p + 1) k] @ b[p]. Rows that fill the kernel's 128-row tiles and that do not (a part's
# last tile reads the next part's rows of a as rows past a's end: zeros, not stored), n past a tile
# (SM90_SPLIT_TILE_N wide), one step of k and many.
SPLIT_K_CASES = [(128, 3, 1024, 256), (100, 2, 64, 520), (300, 4, 512, 264), (8, 2, 2048, 8)]


@functools.partial(jax.jit, static_argnames=("rows", "groups", "b_transposed", "kernels"))
def split_k_kernel(a, b, *, rows, groups, b_transposed=False, kernels="auto"):
    n = b.shape[0] if b_transposed else b.shape[2]
    attributes = {"mode": np.int32(contract()["MODE_SPLIT_K"]), "b_transposed": np.int32(b_transposed),
                  "variant": np.int32(dispatch.kernel_variant(kernels))}
    shape = (groups * rows, n)
    (out,) = kernel_call(TARGET, (jax.ShapeDtypeStruct(shape, F32),), (a, b, jnp.full((groups,), rows, jnp.int32)),
                         attributes, out_init=(jnp.full(shape, jnp.nan, F32),))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("b_transposed", [False, True], ids=["b", "bt"])
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("case", SPLIT_K_CASES, ids=lambda c: "rows%d_g%d_k%d_n%d" % c)
def test_split_k_mode_vs_reference(case, dtype, b_transposed):
    if extension.cuda_device_capability() != (9, 0):
        pytest.skip("mode 2 runs on the sm_90a kernel")
    rows, g, k, n = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    a = rng.standard_normal((rows, g * k), dtype=np.float32).astype(jnp.dtype(dtype))
    b = rng.standard_normal((g, k, n), dtype=np.float32).astype(jnp.dtype(dtype))
    b_given = jnp.asarray(b).transpose(2, 0, 1).reshape(n, g * k) if b_transposed else b
    got = np.asarray(split_k_kernel(a, b_given, rows=rows, groups=g, b_transposed=b_transposed), np.float64)
    parts = np.asarray(a, np.float64).reshape(rows, g, k).transpose(1, 0, 2)
    want = np.einsum("grk,gkn->grn", parts, np.asarray(b, np.float64)).reshape(g * rows, n)
    assert np.isfinite(got).all(), f"{np.sum(~np.isfinite(got))} outputs are NaN/inf"
    assert helpers.rel_err(got, want) < 1e-4


@pytest.mark.gpu
def test_split_k_mode_checks():
    a, b = jnp.ones((64, 256), BF16), jnp.ones((2, 64, 16), BF16)  # (a's columns: 4 x 64, not 2 x 64)
    with pytest.raises(Exception, match="in mode 2, b must be"):
        jax.block_until_ready(split_k_kernel(a, b, rows=64, groups=2))
    with pytest.raises(Exception, match=r"in mode 2, b must be \[n, g \* k\]"):  # (b transposed: [16, 128])
        jax.block_until_ready(split_k_kernel(a, jnp.ones((16, 128), BF16), rows=64, groups=2, b_transposed=True))
    with pytest.raises(Exception, match="sm_90a kernel"):
        jax.block_until_ready(split_k_kernel(a[:, :128], b, rows=64, groups=2, kernels="sm80"))


def test_contract_constants():
    """The header's contract (what Python reads without the extension) has what the tests use."""
    c = extension.header_constants("gemm")
    assert c["MODE_RAGGED"] == 0 and c["MODE_CONTRACT"] == 1 and c["MODE_SPLIT_K"] == 2 and c["DIM_MULTIPLE"] == 8
