"""CPU tests of the Hopper attention kernels' work order, built in Python from the segment ids
(jax_tk.attention.launch): the block order (longest first, group by group) and the forward's tiles
(packed documents get tiles of their own, else the fixed grid in the block order). Both must trace
without constants (a custom_partitioning rule traces them under sharded jit)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import needs_extension
from jax_tk.attention.launch import block_order, bwd_order_blocks, fwd_order_blocks, fwd_tiles, segment_ranges


# ----------------------------------------------------------------------------------------------
# The Hopper kernels' block order (segment ids): longest first
# ----------------------------------------------------------------------------------------------


def _work_numpy(q_ids, kv_ids, row_block, col_block, causal, by_queries):
    """Per (batch entry, block) the blocks of the other side that it visits, from the ids themselves:
    a query block and a key block meet when they share a segment id (and, causal, the key block
    starts at or before the query block ends)."""
    (b, t), s = q_ids.shape, kv_ids.shape[1]
    qb, kb = (row_block, col_block) if by_queries else (col_block, row_block)
    nq, nk = -(-t // qb), -(-s // kb)
    work = np.zeros((b, nq if by_queries else nk), np.int64)
    for e in range(b):
        for i in range(nq):
            for j in range(nk):
                meet = set(q_ids[e, i * qb:(i + 1) * qb]) & set(kv_ids[e, j * kb:(j + 1) * kb])
                if meet and (not causal or j * kb <= i * qb + qb - 1):
                    work[e, i if by_queries else j] += 1
    return work.reshape(-1)


@needs_extension
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("forward", [True, False], ids=["fwd", "bwd"])
def test_block_order_is_longest_first(causal, d, forward):
    rng = np.random.default_rng(7)
    b, t, s = 3, 777, 901  # odd lengths: partial last blocks
    q_ids = np.sort(rng.integers(0, 6, (b, t)), axis=1).astype(np.int32)
    kv_ids = np.sort(rng.integers(0, 6, (b, s)), axis=1).astype(np.int32)
    q_ids[1] = 2  # one segment
    if forward:
        q_block, kv_block = fwd_order_blocks(d)
        work = _work_numpy(q_ids, kv_ids, q_block, kv_block, causal, True)
    else:
        kv_block, q_block = bwd_order_blocks(d)
        work = _work_numpy(q_ids, kv_ids, kv_block, q_block, causal, False)
    heads, group = 6, 2
    order = np.asarray(block_order(segment_ranges(jnp.asarray(q_ids)), segment_ranges(jnp.asarray(kv_ids)),
                                    q_block, kv_block, causal, forward, heads, group))
    assert order.dtype == np.int32
    blocks = len(work) // b
    assert sorted(order.tolist()) == list(range(b * heads * blocks))  # a permutation of (entry, head, block)
    head = order // blocks % heads
    pair = order // blocks // heads * blocks + order % blocks  # b * blocks + i
    for g in range(heads // group):  # group after group, each with its heads
        part = slice(g * b * blocks * group, (g + 1) * b * blocks * group)
        assert set(head[part].tolist()) == set(range(g * group, (g + 1) * group))
        pairs = pair[part].reshape(-1, group)
        assert np.all(pairs == pairs[:, :1])  # the group's heads of one pair one after the other
        assert np.all(head[part].reshape(-1, group) == np.arange(g * group, (g + 1) * group))
        p = pairs[:, 0]
        assert sorted(p.tolist()) == list(range(b * blocks))
        assert np.all(np.diff(work[p]) <= 0)  # most work first
        for w in set(work.tolist()):  # ties keep index order
            assert np.all(np.diff(p[work[p] == w]) > 0)
    assert len(set(work.tolist())) > 2  # (the case has blocks of different work)


def test_block_order_traces_without_constants():
    """Under jit with sharded inputs a custom_partitioning rule traces the kernel call, and it takes
    no constants (jax asserts that): the order must be built from iotas, not numpy arrays."""
    ids = jnp.zeros((2, 300), jnp.int32)
    for causal in (False, True):
        jaxpr = jax.make_jaxpr(lambda a, b: block_order(segment_ranges(a), segment_ranges(b), 128, 128, causal,
                                                         True, 16, 4))(ids, ids)
        assert not jaxpr.consts


# ----------------------------------------------------------------------------------------------
# The Hopper forward's tiles: packed documents get tiles of their own
# ----------------------------------------------------------------------------------------------


def _fwd_tiles_numpy(ids, heads, causal, head_dim=128):
    x = jnp.asarray(ids)
    r = segment_ranges(x)
    return np.asarray(fwd_tiles(x, x, r, r, causal, heads, 2, head_dim)).reshape(-1, 4)


@needs_extension
@pytest.mark.parametrize("causal", [False, True])
def test_fwd_tiles_of_documents(causal):
    """Sorted ids, the same for queries and keys: every row belongs to exactly one tile of its own
    document, 128 rows from the document's start, and the tiles come longest first in groups of heads."""
    rng = np.random.default_rng(3)
    b, t, heads = 2, 1000, 4
    ids = np.zeros((b, t), np.int32)
    for e in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t), 6, replace=False))
        ids[e] = 10 + 3 * np.searchsorted(cuts, np.arange(t), side="right")  # increasing, not 0..n-1
    tiles = _fwd_tiles_numpy(ids, heads, causal)
    assert tiles.dtype == np.int32 and tiles.shape == (b * heads * 2 * 8, 4)
    used = tiles[:, 0] >= 0
    n_used = used.sum()
    assert used[:n_used].all() and not used[n_used:].any()  # the unused entries last
    expected = 0
    for e in range(b):
        starts = np.flatnonzero(np.r_[True, ids[e, 1:] != ids[e, :-1]])
        ends = np.r_[starts[1:], t]
        expected += sum(-(-(z - a) // 128) for a, z in zip(starts, ends))
        for h in range(heads):
            mine = tiles[used & (tiles[:, 0] == e * heads + h)]
            covered = np.zeros(t, np.int32)
            for _, q0, end, base in mine:
                assert base >= 0  # a document's tile
                d = np.searchsorted(starts, q0, side="right") - 1
                assert (base, end) == (starts[d], ends[d]) and (q0 - base) % 128 == 0
                covered[q0:min(q0 + 128, end)] += 1
            assert np.all(covered == 1)
    assert n_used == expected * heads
    # longest first within each group of 2 heads: keys visited, in 128-key blocks
    q0, end, base = tiles[:n_used, 1], tiles[:n_used, 2], tiles[:n_used, 3]
    keys = (np.minimum(q0 + 128, end) if causal else end) - base
    work = -(-keys // 128)
    group_of = (tiles[:n_used, 0] % heads) // 2
    assert np.all(np.diff(group_of) >= 0)
    for g in range(heads // 2):
        assert np.all(np.diff(work[group_of == g][::2]) <= 0)


@needs_extension
@pytest.mark.parametrize("case", ["unsorted", "different_kv", "too_many", "head_dim_256"])
def test_fwd_tiles_fall_back_to_the_grid(case):
    """Ids that are not the same sorted runs for queries and keys, more documents than the room
    allows, or head_dim 256: the tiles of the fixed grid (key base -1), in the block order."""
    rng = np.random.default_rng(5)
    b, t, heads = 2, 300, 4
    ids = np.sort(rng.integers(0, 4, (b, t)), axis=1).astype(np.int32)
    kv = ids.copy()
    head_dim = 256 if case == "head_dim_256" else 128
    if case == "unsorted":
        ids[0, :10] = 3
        kv = ids
    elif case == "different_kv":
        kv = ids.copy()
        kv[1, -1] += 1
    elif case == "too_many":
        ids = np.arange(b * t, dtype=np.int32).reshape(b, t) // 2  # 150 documents of 2 rows
        kv = ids
    q, k = jnp.asarray(ids), jnp.asarray(kv)
    tiles = np.asarray(fwd_tiles(q, k, segment_ranges(q), segment_ranges(k), True, heads, 2, head_dim)).reshape(-1, 4)
    order = np.asarray(block_order(segment_ranges(q), segment_ranges(k), 128, 128 if head_dim <= 128 else 64,
                                    True, True, heads, 2))
    qblocks = 3
    assert tiles.shape == (b * heads * 2 * qblocks, 4)
    n = len(order)
    np.testing.assert_array_equal(tiles[:n, 0], order // qblocks)
    np.testing.assert_array_equal(tiles[:n, 1], order % qblocks * 128)
    assert np.all(tiles[:n, 2] == t) and np.all(tiles[:n, 3] == -1)
    assert np.all(tiles[n:] == [-1, 0, 0, -1])


@needs_extension
def test_fwd_tiles_trace_without_constants():
    """(See test_block_order_traces_without_constants.)"""
    ids = jnp.zeros((2, 300), jnp.int32)
    for causal in (False, True):
        jaxpr = jax.make_jaxpr(lambda a, b: fwd_tiles(a, b, segment_ranges(a), segment_ranges(b), causal, 16, 4,
                                                       128))(ids, ids)
        assert not jaxpr.consts
