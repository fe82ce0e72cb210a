"""jax.vmap of jax_tk.attention on the GPU: the kernels take the vmapped dimensions folded into the
batch (one launch per direction); values and gradients equal those of each vmapped entry on its own,
for every combination of mapped operands, nested vmaps and the masking options."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from helpers import attention_inputs, rel_err

pytestmark = pytest.mark.gpu
BF16, F32 = jnp.bfloat16, jnp.float32


def _loss(q, k, v, *masks, **kw):
    out, lse = jax_tk.attention_with_lse(q, k, v, *masks, implementation="tk", **kw)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return jnp.sum(jnp.sin(out.astype(F32))) + jnp.sum(jnp.cos(lse))


def _masked_loss(q, k, v, qs, ks, kl, **kw):
    return _loss(q, k, v, q_segment_ids=qs, kv_segment_ids=ks, key_value_seq_lengths=kl, **kw)


def _stack(seed, e, b, t, s, n, kh, d):
    sets = [attention_inputs(seed + i, b, t, s, n, kh, d, BF16) for i in range(e)]
    return [jnp.stack(x) for x in zip(*sets)]


@pytest.mark.parametrize("mapped", ["qkv", "q", "kv"])
@pytest.mark.parametrize("d,causal", [(64, False), (128, True), (256, True)])
def test_vmap_matches_each_entry(mapped, d, causal):
    if d == 256 and jax_tk._core.extension.cuda_device_capability() != (9, 0):
        pytest.skip("head_dim 256 runs on H100/H200 only")
    e, b, t, s, n, kh = 3, 2, 200, 333, 4, 2
    q, k, v = _stack(0, e, b, t, s, n, kh, d)
    axes = {"qkv": (0, 0, 0), "q": (0, None, None), "kv": (None, 0, 0)}[mapped]
    args = [x if a == 0 else x[0] for x, a in zip((q, k, v), axes)]
    f = jax.jit(jax.vmap(jax.value_and_grad(functools.partial(_loss, is_causal=causal), argnums=(0, 1, 2)),
                         in_axes=axes))
    val, grads = f(*args)
    one = jax.jit(jax.value_and_grad(functools.partial(_loss, is_causal=causal), argnums=(0, 1, 2)))
    want = [one(*[x[i] if a == 0 else x for x, a in zip(args, axes)]) for i in range(e)]
    for i in range(e):
        assert abs(float(val[i]) - float(want[i][0])) <= 1e-3 * abs(float(want[i][0])) + 1e-3
    for j, g in enumerate(grads):  # (vmap of grad: every operand's gradient is per entry, mapped or not)
        for i in range(e):
            assert rel_err(g[i], want[i][1][j], 1e-4) < 1e-2


def test_nested_vmap_with_masks():
    e1, e2, b, t, n, kh, d = 2, 3, 2, 300, 4, 1, 128
    q, k, v = (x.reshape(e1, e2, *x.shape[1:]) for x in _stack(5, e1 * e2, b, t, t, n, kh, d))
    rng = np.random.default_rng(1)
    ids = jnp.asarray(np.sort(rng.integers(0, 4, (e1, e2, b, t)), axis=-1).astype(np.int32))
    kl = jnp.asarray(rng.integers(0, t + 1, (e1, e2, b)).astype(np.int32))
    g = jax.value_and_grad(functools.partial(_masked_loss, is_causal=True), argnums=(0, 1, 2))
    val, grads = jax.jit(jax.vmap(jax.vmap(g)))(q, k, v, ids, ids, kl)
    one = jax.jit(g)
    for i in range(e1):
        for j in range(e2):
            want_val, want = one(q[i, j], k[i, j], v[i, j], ids[i, j], ids[i, j], kl[i, j])
            assert abs(float(val[i, j]) - float(want_val)) <= 1e-3 * abs(float(want_val)) + 1e-3
            for got, w in zip(grads, want):
                assert rel_err(got[i, j], w, 1e-4) < 1e-2
                assert np.all(np.isfinite(np.asarray(got[i, j], np.float32)))
