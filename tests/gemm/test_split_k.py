"""CPU tests of matmul's split k: a dense product with too few output tiles to fill the GPU cuts its
contraction into ranges, one group each of the contracting kernel (mode 1), and sums the float32
partial products (jax_tk/gemm/launch.py: split_k_parts, split_k_dot); on Hopper the forward's equal
parts are the groups of mode 2 (a read as it is; split_k_launch_parts), and so are its input
gradient's (b transposed read in place), or mode 1 with both operands K-major where the parts are not
equal. The kernel is replaced by a
stand-in with its contract's semantics (test_ragged_dot.fake_kernel)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from helpers import randn, rel_err
from jax_tk.gemm import launch
from test_ragged_dot import fake_kernel  # noqa: F401 (a fixture)

BF16 = jnp.bfloat16


def matmul_checked(m, k, n, seed):
    """jax_tk.matmul of fresh bf16 a [m, k], b [k, n] and its gradients for a fresh cotangent, each
    against float64 numpy."""
    rng = np.random.default_rng(seed)
    a, b, dout = randn(rng, (m, k), BF16), randn(rng, (k, n), BF16), randn(rng, (m, n), BF16)
    out, vjp = jax.vjp(jax_tk.matmul, a, b)
    da, db = vjp(dout)
    assert out.dtype == da.dtype == db.dtype == BF16
    a64, b64, d64 = (np.asarray(x, np.float64) for x in (a, b, dout))
    assert rel_err(out, a64 @ b64) < 1e-2
    assert rel_err(da, d64 @ b64.T) < 1e-2 and rel_err(db, a64.T @ d64) < 1e-2


@pytest.mark.parametrize("m, k, n", [(128, 8192, 2048), (64, 3000, 512), (8, 2112, 256)])
def test_matmul_splits_k_of_few_tiles(fake_kernel, m, k, n):  # noqa: F811 (the fixture)
    """A dense product with too few output tiles to fill the GPU: its forward is one launch of the
    contracting kernel (mode 1) on a^T with k cut into launch.split_k_parts ranges (multiples of the
    kernel's steps but the last), whose float32 partial products XLA sums; its gradient is the usual
    pair of launches. Values and gradients against float64 numpy."""
    parts = launch.split_k_parts(m, k, n)
    assert parts > 1
    matmul_checked(m, k, n, seed=m + k)
    modes = [(l[0], l[1], l[3]) for l in fake_kernel]
    assert modes[0] == (1, (k, m), (parts,)), modes  # a^T, one group per range of k
    assert [l[0] for l in fake_kernel[1:]] == [0, 1], modes  # the gradient: d a, then d b


@pytest.mark.parametrize("m, k, n", [(128, 8192, 2048), (64, 3000, 512), (8, 2112, 256)])
def test_matmul_forward_split_on_hopper(fake_kernel, monkeypatch, m, k, n):  # noqa: F811
    """On the sm_90a kernel (launch.split_k_on_sm90) the forward's parts, counted in mode 2's tiles
    (SM90_SPLIT_TILE_N wide), where they are equal (k a multiple of parts x the kernel's steps), are the
    groups of one launch of mode 2 on a and b as they are (a [m, k]; b [parts, k / parts, n], a view of
    it): no transpose of a. Elsewhere mode 1 on a^T with split_k_parts's parts, as without it. Values
    and gradients against float64 numpy."""
    monkeypatch.setattr(launch, "split_k_on_sm90", lambda: True)
    c = launch.contract()
    parts = launch.split_k_parts(m, k, n, c["SM90_SPLIT_TILE_N"])
    assert parts > 1
    matmul_checked(m, k, n, seed=m + k + 1)
    first = fake_kernel[0][:4]
    if k % (parts * c["SM90_TILE_K"]) == 0:
        assert launch.split_k_launch_parts(m, k, n) == parts
        assert first == (2, (m, k), (parts, k // parts, n), (parts,)), fake_kernel
    else:
        parts = launch.split_k_parts(m, k, n)
        assert launch.split_k_launch_parts(m, k, n) == parts
        assert first == (1, (k, m), (k, n), (parts,)), fake_kernel


def test_forward_parts_count_mode_2_tiles(monkeypatch):
    """128 rows against 8192 x 8192 on 132 SMs: 32 tiles of 256 columns (4 parts of 2048) without mode
    2, 64 tiles of 128 columns in 2 parts of 4096 with it."""
    monkeypatch.setattr(launch.extension, "WAVE_BLOCKS", 132)
    monkeypatch.setattr(launch, "split_k_on_sm90", lambda: False)  # (whatever GPU runs the test)
    assert launch.split_k_parts(128, 8192, 8192) == 4
    assert launch.split_k_launch_parts(128, 8192, 8192) == 4  # (no Hopper: mode 1's parts)
    monkeypatch.setattr(launch, "split_k_on_sm90", lambda: True)
    assert launch.split_k_launch_parts(128, 8192, 8192) == 2
    assert launch.split_k_launch_parts(128, 8000, 8192) == 4  # (8000 = 2 x 4000: not whole steps of 64)


@pytest.mark.parametrize("m, k, n", [(128, 2048, 8192), (64, 2200, 4096), (128, 1024, 8000)])
def test_matmul_gradient_splits_too_on_hopper(fake_kernel, monkeypatch, m, k, n):  # noqa: F811
    """On the sm_90a kernel (launch.split_k_on_sm90) the input's gradient d @ b^T, whose [m, k] output
    is as few tiles, splits its contraction (n) the same way, on d and b as they are (no transpose):
    where n cuts into equal parts of whole steps, mode 2 with b transposed (b [k, n] is [k, parts *
    n / parts]); elsewhere mode 1 with b_transposed, one group per range of n (multiples of the kernel's
    steps but the last)."""
    monkeypatch.setattr(launch, "split_k_on_sm90", lambda: True)
    parts = launch.split_k_launch_parts(m, n, k)
    assert parts > 1
    matmul_checked(m, k, n, seed=m + n)
    calls = [(l[0], l[1], l[2], l[3], l[4]) for l in fake_kernel]
    mode = 2 if launch.split_k_in_place(n, parts) else 1
    assert calls[1] == (mode, (m, n), (k, n), (parts,), True), calls  # d a: d and b (b's [k, n] read K-major)
    assert [c[0] for c in calls[2:]] == [1], calls  # d b: the contraction over m, k whole
    if mode == 1:
        assert parts == launch.split_k_parts(m, n, k)


def test_gradient_parts_count_mode_2_tiles(monkeypatch):
    """d a of 128 x 8192 x 8192 ([128, 8192] out, contracting 8192) splits as the forward: 2 parts of
    mode 2's tiles on Hopper."""
    monkeypatch.setattr(launch.extension, "WAVE_BLOCKS", 132)
    monkeypatch.setattr(launch, "split_k_on_sm90", lambda: True)
    assert launch.split_k_launch_parts(128, 8192, 8192) == 2 and launch.split_k_in_place(8192, 2)


def test_matmul_keeps_k_whole_where_tiles_fill_the_gpu(fake_kernel):  # noqa: F811
    """Enough output tiles (or m not a multiple of 8, or one group per matrix of a batched b): one
    launch of the row kernel, k whole."""
    for m, k, n, lead in ((2048, 4096, 4096, ()), (100, 8192, 2048, ()), (128, 8192, 2048, (2,))):
        assert lead or launch.split_k_parts(m, k, n) == 1
        rng = np.random.default_rng(m)
        a, b = randn(rng, (*lead, m, k), BF16), randn(rng, (*lead, k, n), BF16)
        fake_kernel.clear()
        jax_tk.matmul(a, b)
        assert [l[0] for l in fake_kernel] == [0], fake_kernel


def test_matmul_gradient_split_under_vmap(fake_kernel, monkeypatch):  # noqa: F811
    """Under vmap over a (b shared), each entry's product splits as above; the input gradient's
    launches (mode 1 with b transposed) run one per entry (its batching rule does not fold entries:
    their rows are columns there) or, in equal parts, as mode 2 with b transposed. Values against
    float64 numpy."""
    monkeypatch.setattr(launch, "split_k_on_sm90", lambda: True)
    e, m, k, n = 3, 64, 1024, 4096
    rng = np.random.default_rng(5)
    a, b, dout = randn(rng, (e, m, k), BF16), randn(rng, (k, n), BF16), randn(rng, (e, m, n), BF16)
    f = jax.vmap(jax_tk.matmul, in_axes=(0, None))
    out, vjp = jax.vjp(f, a, b)
    da, db = vjp(dout)
    a64, b64, d64 = (np.asarray(x, np.float64) for x in (a, b, dout))
    assert rel_err(out, a64 @ b64) < 1e-2
    assert rel_err(da, d64 @ b64.T) < 1e-2 and rel_err(db, np.einsum("emk,emn->kn", a64, d64)) < 1e-2
    assert any(l[0] in (1, 2) and l[4] for l in fake_kernel), fake_kernel  # the split input gradient ran
