"""Pure-JAX linear attention: the token-by-token recurrence (the oracle) and the chunked XLA path.

Both ops are one recurrence over a state ``S`` ``[K, V]`` per sequence and value head, float32:

- gated delta rule (``beta`` given): ``S <- S * exp(g_t)``; ``u_t = beta_t * (v_t - S^T k_t)``;
  ``S <- S + k_t u_t^T``; ``o_t = scale * S^T q_t``;
- simple GLA (``beta=None``): ``S <- S * exp(g_t) + k_t v_t^T``; ``o_t = scale * S^T q_t``.

:func:`recurrent` runs it one token at a time in a ``lax.scan``: short, obviously right, and slow on a
long sequence (one step per token). :func:`chunked` gives the same results a chunk of tokens at a time
(the form the kernels will take): inside a chunk the tokens are solved together with matrix products,
and only the state is carried from chunk to chunk. Its derivation (one chunk, positions ``i, j`` in it,
``G_i = g_0 + ... + g_i`` the cumulative log decay, ``S0`` the state the chunk starts from):

- the state after token i is ``exp(G_i) S0 + sum_{j <= i} exp(G_i - G_j) k_j u_j^T``, so the delta
  rule's new values satisfy ``u_i + sum_{j < i} beta_i exp(G_i - G_j) (k_i . k_j) u_j =
  beta_i (v_i - exp(G_i) S0^T k_i)``: a unit lower-triangular system ``(I + A) U = ...``. Solved
  once per chunk (the "WY"/"UT" form), ``U = U' - W S0`` with ``U' = (I + A)^-1 diag(beta) V`` and
  ``W = (I + A)^-1 diag(beta exp(G)) K``, neither of which depends on the state;
- ``o_i = scale * (exp(G_i) q_i^T S0 + sum_{j <= i} exp(G_i - G_j) (q_i . k_j) u_j)``;
- the state after the chunk is ``exp(G_last) S0 + sum_j exp(G_last - G_j) k_j u_j^T``.

Every decay factor is ``exp`` of a difference ``G_i - G_j`` with ``i >= j`` (or of ``G_i``, or of
``G_last - G_j``), which is <= 0 for ``g <= 0``: no factor exceeds 1, at any sequence length, and the
entries with ``i < j`` (whose differences would be large and positive) are masked before ``exp``
rather than after, so they never overflow into the values or the gradients. (Cumulative sums run
within a chunk only, so they stay small too.)

Packed sequences (``cu_seqlens``): the chunked path moves each sequence to start on a chunk of its own
(the tokens scattered into a longer stream whose padding tokens have ``k = q = v = 0``, ``g = 0``,
``beta = 0``: they leave the state as it is), so that no chunk holds two sequences; the state carried
into a sequence's first chunk is that sequence's initial state. Exact, and simple; it costs at most
``N * (chunk - 1)`` padding tokens.

Arguments are assumed checked (``jax_tk.linear_attention.api``). Gradients are JAX's autodiff of these
functions.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_tk._core import dispatch

F32 = jnp.float32
HI = jax.lax.Precision.HIGHEST
# flash-linear-attention's l2norm: x / sqrt(sum(x^2) + eps), with this eps.
L2NORM_EPS = 1e-6


def l2norm(x, eps: float = L2NORM_EPS):
    """``x`` (float32) divided by ``sqrt(sum(x**2) + eps)`` over its last axis (K)."""
    x = x.astype(F32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(q, k, v, g, beta, use_qk_l2norm: bool):
    """float32 inputs, q and k normalized if asked and repeated to the value heads: value head j uses
    q/k head ``j // (HV // H)`` (axis -2 of q/k, -1 of g, is the head axis)."""
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    group = v.shape[-2] // q.shape[-2]
    if group > 1:
        q, k = jnp.repeat(q, group, axis=-2), jnp.repeat(k, group, axis=-2)
    as32 = lambda x: None if x is None else x.astype(F32)
    return as32(q), as32(k), as32(v), as32(g), as32(beta)


def update(state, q, k, v, g, beta, scale: float):
    """One token of the recurrence: ``state`` ``[..., HV, K, V]`` float32; ``q, k`` ``[..., HV, K]``;
    ``v`` ``[..., HV, V]``; ``g, beta`` ``[..., HV]`` (``beta=None``: simple GLA), all float32 (q and k
    already normalized and repeated to the value heads). Returns ``(o [..., HV, V], new state)``."""
    state = state * jnp.exp(g)[..., None, None]
    if beta is not None:
        v = (v - jnp.einsum("...kv,...k->...v", state, k, precision=HI)) * beta[..., None]
    state = state + k[..., :, None] * v[..., None, :]
    return scale * jnp.einsum("...kv,...k->...v", state, q, precision=HI), state


def step(q, k, v, g, beta, state, *, scale: float, use_qk_l2norm: bool = False):
    """One new token per sequence: ``q, k`` ``[B, H, K]``, ``v`` ``[B, HV, V]``, ``g, beta`` ``[B, HV]``,
    ``state`` ``[B, HV, K, V]``. Returns ``(o [B, HV, V] in v's dtype, new state float32)``."""
    q32, k32, v32, g32, b32 = _prepare(q, k, v, g, beta, use_qk_l2norm)
    o, state = update(state.astype(F32), q32, k32, v32, g32, b32, scale)
    return o.astype(v.dtype), state


def _start(q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm: bool):
    """What both paths start from: the float32 inputs (``_prepare``), the initial states ``[N, HV, K,
    V]`` (zeros where None), and the state the scan starts with: the initial states of the batch, or
    for packed sequences a placeholder that the first sequence's replaces at once."""
    (b, _, _, kd), (hv, vd) = q.shape, v.shape[2:]
    n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    init = jnp.zeros((n, hv, kd, vd), F32) if initial_state is None else initial_state.astype(F32)
    # Inside shard_map the carried state varies over every manual mesh axis that the inputs vary over:
    # the state it starts from is typed so too (a cast of the type, no data moved), as the scan requires.
    init = dispatch.vary_as(init, q, k, v, g, beta)
    state0 = init if cu_seqlens is None else dispatch.zeros((1, hv, kd, vd), F32, init)
    return _prepare(q, k, v, g, beta, use_qk_l2norm), init, state0


def _sequences(cu_seqlens):
    """int32 ``(starts [N], lengths [N])`` of the packed sequences."""
    cu = cu_seqlens.astype(jnp.int32)
    return cu[:-1], cu[1:] - cu[:-1]


def recurrent(q, k, v, g, beta, *, scale: float, initial_state=None, cu_seqlens=None,
              output_final_state: bool = False, use_qk_l2norm: bool = False):
    """The recurrence one token at a time (``lax.scan`` over T), float32: the oracle.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` (``HV % H == 0``); g, beta: ``[B, T, HV]``
        (``beta=None``: simple GLA).
      initial_state: ``[N, HV, K, V]`` or None (zeros); N is B, or the number of packed sequences.
      cu_seqlens: ``[N + 1]`` integers with ``B == 1``: sequence n is tokens ``cu[n] .. cu[n+1] - 1``,
        its state starting from ``initial_state[n]``.
    Returns:
      ``(o [B, T, HV, V] in v's dtype, final state [N, HV, K, V] float32 or None)``.
    """
    t = q.shape[1]
    (q32, k32, v32, g32, b32), init, state0 = _start(q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm)
    resets = None
    if cu_seqlens is not None:
        # resets[t]: the sequence that starts at token t (its state replaced by its initial one), else -1.
        starts, lengths = _sequences(cu_seqlens)
        resets = jnp.full((t,), -1, jnp.int32).at[jnp.where(lengths > 0, starts, t)].set(
            jnp.arange(init.shape[0], dtype=jnp.int32), mode="drop")
    keep_states = cu_seqlens is not None and output_final_state

    def body(state, xs):
        qt, kt, vt, gt, bt, reset = xs
        if reset is not None:
            state = jnp.where(reset >= 0, init[jnp.maximum(reset, 0)][None], state)
        o, state = update(state, qt, kt, vt, gt, bt, scale)
        return state, (o, state if keep_states else None)

    time_major = lambda x: None if x is None else jnp.moveaxis(x, 1, 0)
    xs = (*map(time_major, (q32, k32, v32, g32, b32)), resets)
    final, (o, states) = jax.lax.scan(body, state0, xs)
    o = jnp.moveaxis(o, 0, 1).astype(v.dtype)
    if not output_final_state:
        return o, None
    if cu_seqlens is None:
        return o, final
    # Sequence n's state after its last token (an empty sequence keeps its initial state).
    starts, lengths = _sequences(cu_seqlens)
    last = states[jnp.maximum(starts + lengths - 1, 0), 0]
    return o, jnp.where((lengths > 0)[:, None, None, None], last, init)


def _varlen_layout(cu_seqlens, t: int, chunk: int):
    """Where the packed tokens go when each sequence starts on a chunk of its own.

    Returns ``(pos [T]: each token's position in the padded stream, chunks: the stream's length in
    chunks (static), resets [chunks]: the sequence starting at each chunk or -1, last [N]: each
    sequence's last chunk, lengths [N])``. A sequence of L tokens takes ``ceil(L / chunk)`` chunks;
    together at most ``(T + N * (chunk - 1)) // chunk``, the static length."""
    n = cu_seqlens.shape[0] - 1
    starts, lengths = _sequences(cu_seqlens)
    per_seq = (lengths + chunk - 1) // chunk
    first = jnp.cumsum(per_seq) - per_seq  # each sequence's first chunk
    chunks = max((t + n * (chunk - 1)) // chunk, 1)
    token = jnp.arange(t, dtype=jnp.int32)
    # The sequence of each token: how many sequences end at or before it.
    seq = jnp.clip(jnp.searchsorted(starts + lengths, token, side="right"), 0, n - 1)
    pos = first[seq] * chunk + token - starts[seq]
    resets = jnp.full((chunks,), -1, jnp.int32).at[jnp.where(lengths > 0, first, chunks)].set(
        jnp.arange(n, dtype=jnp.int32), mode="drop")
    return pos, chunks, resets, first + per_seq - 1, lengths


def _to_chunks(x, chunks: int, chunk: int):
    """``[B, L, HV, ...]`` (L <= chunks * chunk) zero-padded and split: ``[B, chunks, HV, chunk, ...]``."""
    pad = chunks * chunk - x.shape[1]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(x.shape[0], chunks, chunk, *x.shape[2:])
    return jnp.moveaxis(x, 2, 3)


def chunked(q, k, v, g, beta, *, scale: float, initial_state=None, cu_seqlens=None,
            output_final_state: bool = False, use_qk_l2norm: bool = False, chunk_size: int = 64):
    """The recurrence ``chunk_size`` tokens at a time (see the module's docstring); arguments and
    results as :func:`recurrent`. T need not be a multiple of the chunk: the tail is padded with tokens
    that leave the state unchanged (``k = 0``, ``g = 0``, ``beta = 0``) and the output sliced."""
    b, t = q.shape[:2]
    hv, vd = v.shape[2:]
    (q32, k32, v32, g32, b32), init, state0 = _start(q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm)
    if cu_seqlens is None:
        chunks, resets, pos = -(-t // chunk_size), None, None
    else:
        pos, chunks, resets, last, lengths = _varlen_layout(cu_seqlens, t, chunk_size)
        # The token at each position of the padded stream; t: a padding token (zeros, appended below).
        src = jnp.full((chunks * chunk_size,), t, jnp.int32).at[pos].set(jnp.arange(t, dtype=jnp.int32))

    def split(x):
        """``[B, chunks, HV, chunk, ...]``, packed sequences moved to chunks of their own first (a gather of
        the tokens rather than a scatter into zeros: the result keeps x's sharding, e.g. over heads)."""
        if x is None:
            return None
        if pos is not None:
            x = jnp.pad(x, [(0, 0), (0, 1)] + [(0, 0)] * (x.ndim - 2))[:, src]
        return _to_chunks(x, chunks, chunk_size)

    qc, kc, vc, gc, bc = map(split, (q32, k32, v32, g32, b32))  # g, beta: [B, chunks, HV, chunk]
    o, final, states = _chunk_scan(qc, kc, vc, gc, bc, state0, init, resets, scale,
                                   keep_states=cu_seqlens is not None and output_final_state)
    o = jnp.moveaxis(o, 2, 3).reshape(b, -1, hv, vd)  # [B, chunks * chunk, HV, V]
    o = (o[:, :t] if cu_seqlens is None else o[:, pos]).astype(v.dtype)
    if not output_final_state:
        return o, None
    if cu_seqlens is None:
        return o, final
    # Sequence n's state after its last chunk (the padding after its last token leaves it unchanged).
    return o, jnp.where((lengths > 0)[:, None, None, None], states[jnp.maximum(last, 0), 0], init)


def unit_lower_inverse(a):
    """``(I + a)^-1`` for strictly lower-triangular ``a`` ``[..., L, L]`` (L a power of 2), by blocks.

    The inverse of ``[[X, 0], [Y, Z]]`` is ``[[X^-1, 0], [-Z^-1 Y X^-1, Z^-1]]``: with ``inv`` holding
    the inverses of the diagonal blocks of size s (and zeros elsewhere), ``inv - inv (a's lower-left
    s-blocks of the diagonal blocks of size 2s) inv`` holds those of size 2s. From s = 1 (the identity)
    to L, each step is two matrix products, where XLA's triangular solve loops over the rows (tens of
    times slower on a CPU). Each step's blocks are inverses of blocks of ``I + a``, whose entries stay
    those of the inverse: no series in powers of ``a``, whose terms can grow without bound."""
    length = a.shape[-1]
    if length & (length - 1):
        raise ValueError(f"jax_tk.linear_attention: the chunk ({length} tokens) must be a power of 2")
    i = jnp.arange(length)
    inv = jnp.eye(length, dtype=F32)
    size = 1
    while size < length:
        # (i, j) in the lower-left s-block of a diagonal block of size 2s: row block = column block + 1,
        # the column block even.
        rows, cols = i[:, None] // size, i[None, :] // size
        corner = jnp.where((rows == cols + 1) & (cols % 2 == 0), a, 0.0)
        inv = inv - jnp.einsum("...ij,...jk,...kl->...il", inv, corner, inv, precision=HI)
        size *= 2
    return inv


def _chunk_scan(q, k, v, g, beta, state0, init, resets, scale: float, keep_states: bool):
    """The chunked recurrence on ``[B, C, HV, L, ...]`` chunks (C chunks of L tokens; ``g`` ``[B, C, HV,
    L]``, ``beta`` likewise or None). The state-free parts of every chunk are computed at once; the scan
    over chunks then only applies the state. Returns ``(o [B, C, HV, L, V], final state, the state after
    every chunk [C, B, HV, K, V] or None)``; ``resets`` ``[C]`` (or None): the initial state (an index
    into ``init``) that replaces the carried one at the chunk's start."""
    length = q.shape[3]
    i = jnp.arange(length)
    causal, strict = i[:, None] >= i[None, :], i[:, None] > i[None, :]
    cum = jnp.cumsum(g, axis=-1)  # G_i, within the chunk
    # exp(G_i - G_j) for j <= i, 0 above the diagonal: the difference is masked before exp, so the
    # large positive differences of j > i never overflow (nor poison the gradient through where).
    diff = cum[..., :, None] - cum[..., None, :]
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)  # [B, C, HV, L, L]
    scores = decay * jnp.einsum("...id,...jd->...ij", q, k, precision=HI)  # causal q.k, decayed
    q_in = q * jnp.exp(cum)[..., None]  # reads the incoming state
    k_out = k * jnp.exp(cum[..., -1:] - cum)[..., None]  # writes into the outgoing state
    state_decay = jnp.exp(cum[..., -1])  # [B, C, HV]
    if beta is None:
        values, w = v, None
    else:
        # The delta rule's triangular system (I + A) U = diag(beta) (V - diag(exp(G)) K S0), solved for
        # both right-hand sides at once: U' (the values) and W (what the state takes off them).
        a = jnp.where(strict, beta[..., :, None] * decay * jnp.einsum("...id,...jd->...ij", k, k, precision=HI), 0.0)
        rhs = jnp.concatenate([beta[..., None] * v, (beta * jnp.exp(cum))[..., None] * k], axis=-1)
        solved = jnp.einsum("...ij,...jd->...id", unit_lower_inverse(a), rhs, precision=HI)
        values, w = solved[..., :v.shape[-1]], solved[..., v.shape[-1]:]

    def body(state, xs):
        q_in_c, k_out_c, scores_c, values_c, w_c, decay_c, reset = xs
        if reset is not None:
            state = jnp.where(reset >= 0, init[jnp.maximum(reset, 0)][None], state)
        u = values_c if w_c is None else values_c - jnp.einsum("bhlk,bhkv->bhlv", w_c, state, precision=HI)
        o = scale * (jnp.einsum("bhlk,bhkv->bhlv", q_in_c, state, precision=HI)
                     + jnp.einsum("bhij,bhjv->bhiv", scores_c, u, precision=HI))
        state = decay_c[..., None, None] * state + jnp.einsum("bhlk,bhlv->bhkv", k_out_c, u, precision=HI)
        return state, (o, state if keep_states else None)

    chunk_major = lambda x: None if x is None else jnp.moveaxis(x, 1, 0)
    xs = (*map(chunk_major, (q_in, k_out, scores, values, w, state_decay)), resets)
    final, (o, states) = jax.lax.scan(body, state0, xs)
    return jnp.moveaxis(o, 0, 1), final, states
