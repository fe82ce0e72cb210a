"""The pure-JAX reference of the grouped GEMM: float32 inside, the CPU path and the tests' oracle.

Rows ``[off_i, off_i + size_i)`` of the left operand belong to group ``i`` (``off`` the exclusive
cumulative sum of the sizes); rows past the last group belong to none (and may hold anything: they
are selected away, never multiplied). The reference spreads each row over a group axis and does one
dense contraction, so it costs ``groups`` times the
FLOPs of the grouped product: fine for tests and small CPU runs, not a fast path.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def row_groups(group_sizes, rows: int):
    """[rows] int32: the group of each row (``len(group_sizes)`` for rows past the last group).
    Negative sizes count as 0."""
    ends = jnp.cumsum(jnp.maximum(jnp.asarray(group_sizes).astype(jnp.int32), 0))
    # (a comparison with every group end: O(rows * groups), like the one-hot product that follows)
    return jnp.sum(jnp.arange(rows, dtype=jnp.int32)[:, None] >= ends[None, :], axis=1, dtype=jnp.int32)


def _spread_rows(x, group_sizes, groups: int):
    """[rows, groups, k] float32: row r of ``x`` [rows, k] at its group, 0 elsewhere. Selected, not
    multiplied by a one-hot: a row past the last group (whose values may be anything, NaN included,
    as in a padded buffer) then gives exact zeros, and no NaN reaches any gradient."""
    member = row_groups(group_sizes, x.shape[0])[:, None] == jnp.arange(groups, dtype=jnp.int32)
    return jnp.where(member[:, :, None], x.astype(jnp.float32)[:, None, :], 0.0)


def ragged_dot(lhs, rhs, group_sizes, *, out_dtype=None, rhs_transposed=False):
    """``out[r] = lhs[r] @ rhs[group(r)]`` (0 for rows past the last group).

    lhs ``[m, k]``, rhs ``[g, k, n]`` (``[g, n, k]`` with ``rhs_transposed``), group_sizes ``[g]``
    integers; out ``[m, n]`` in ``out_dtype`` (default lhs's dtype), computed in float32."""
    spec = "mgk,gnk->mn" if rhs_transposed else "mgk,gkn->mn"
    out = jnp.einsum(spec, _spread_rows(lhs, group_sizes, rhs.shape[0]), rhs.astype(jnp.float32), precision=_HIGHEST)
    return out.astype(out_dtype or lhs.dtype)


def ragged_contracting(lhs, rhs, group_sizes, *, out_dtype=None):
    """``out[i] = lhs[rows_i]^T @ rhs[rows_i]`` for each group i (0 for an empty group).

    lhs ``[m, k]``, rhs ``[m, n]``, group_sizes ``[g]``; out ``[g, k, n]`` in ``out_dtype`` (default
    lhs's dtype), computed in float32."""
    m, g = lhs.shape[0], group_sizes.shape[0]
    inside = (row_groups(group_sizes, m) < g)[:, None]  # (rhs's rows past the groups: zeros too)
    out = jnp.einsum("mgk,mn->gkn", _spread_rows(lhs, group_sizes, g), jnp.where(inside, rhs.astype(jnp.float32), 0.0),
                     precision=_HIGHEST)
    return out.astype(out_dtype or lhs.dtype)
