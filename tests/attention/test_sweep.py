"""The drop-in sweep: jax_tk.attention against jax.nn.dot_product_attention(implementation="xla") over
seeded random combinations of every argument they share: bias and mask (shapes, ranks and broadcasts),
is_causal, windows, sequence lengths, grouped-query attention, q_len != kv_len, rank-3 inputs, static
and traced scales; values, the residual (log-sum-exp), and the gradients with respect to query, key,
value, bias and a traced scale.

The one deliberate difference, a query row that sees no key (0 here, the mean of V in jax.nn), is left
out: those rows take no part in the loss or the comparisons, and are checked to be 0 here."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from helpers import rel_err, seen_rows

F32 = jnp.float32
CASES = 24
TOL = 2e-5


def _dense_shape(rng, full):
    """A shape that broadcasts to ``full`` = (b, n, t, s): each dim full or 1, and a random number of
    leading dims dropped (jax.nn adds them back)."""
    shape = tuple(int(f) if rng.random() < 0.6 else 1 for f in full)
    drop = int(rng.integers(0, 3))
    while drop and shape[0] == 1:
        shape, drop = shape[1:], drop - 1
    return shape


def _case(seed):
    rng = np.random.default_rng(1000 + seed)
    rank3 = rng.random() < 0.2
    b = 1 if rank3 else int(rng.integers(1, 4))
    t, s = int(rng.integers(1, 12)), int(rng.integers(1, 12))
    if rng.random() < 0.3:
        s = t
    kh = int(rng.integers(1, 3))
    n = kh * int(rng.integers(1, 4))
    d = int(rng.choice([4, 8, 16]))
    c = dict(seed=seed, rank3=rank3, b=b, t=t, s=s, n=n, kh=kh, d=d)
    opts = {}
    if rng.random() < 0.4:
        opts["is_causal"] = True
    if rng.random() < 0.35:
        left, right = (int(x) for x in rng.integers(0, max(t, s) + 1, 2))
        opts["local_window_size"] = left if rng.random() < 0.3 else (left, right)
    if not rank3 and rng.random() < 0.35:
        opts["query_seq_lengths"] = rng.integers(0, t + 1, b).astype(np.int32)
    if not rank3 and rng.random() < 0.35:
        opts["key_value_seq_lengths"] = rng.integers(1, s + 1, b).astype(np.int32)
    c["opts"] = opts
    c["bias"] = _dense_shape(rng, (b, n, t, s)) if rng.random() < 0.6 else None
    c["mask"] = _dense_shape(rng, (b, n, t, s)) if rng.random() < 0.6 else None
    c["scale"] = rng.choice(["default", "static", "traced"])
    return c


def _arrays(c):
    rng = np.random.default_rng(c["seed"])
    lead = () if c["rank3"] else (c["b"],)
    q = rng.standard_normal(lead + (c["t"], c["n"], c["d"]))
    k, v = (rng.standard_normal(lead + (c["s"], c["kh"], c["d"])) for _ in range(2))
    bias = None if c["bias"] is None else rng.standard_normal(c["bias"])
    mask = None if c["mask"] is None else rng.random(c["mask"]) > 0.25
    w = rng.standard_normal(q.shape)
    return [None if x is None else jnp.asarray(x, bool if x.dtype == bool else F32) for x in (q, k, v, bias, mask, w)]


def _run(fn, c, q, k, v, bias, mask, w, rows):
    """(out, residual, grads): grads with respect to query, key, value, and bias and the scale where
    they are arrays. The loss weighs only the ``rows`` that see a key."""
    opts = {name: jnp.asarray(x) if isinstance(x, np.ndarray) else x for name, x in c["opts"].items()}
    static_scale = {"default": None, "static": 0.37}.get(c["scale"])

    def loss(q, k, v, bias, scale):
        out, res = fn(q, k, v, bias, mask, scale=scale if c["scale"] == "traced" else static_scale,
                      return_residual=True, **opts)
        return jnp.sum(out * w * rows[..., None]), (out, res)

    argnums = (0, 1, 2) + ((3,) if bias is not None else ()) + ((4,) if c["scale"] == "traced" else ())
    grads, (out, res) = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(q, k, v, bias, jnp.float32(0.37))
    return out, res, grads


def _jax_nn(q, k, v, bias, mask, **kwargs):
    return jax.nn.dot_product_attention(q, k, v, bias, mask, implementation="xla", **kwargs)


@pytest.mark.parametrize("seed", range(CASES))
def test_against_jax_nn(seed):
    c = _case(seed)
    q, k, v, bias, mask, w = _arrays(c)
    full = (c["b"], c["n"], c["t"], c["s"])
    mask4 = None if mask is None else mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    vis = {name: jnp.asarray(x) if isinstance(x, np.ndarray) else x for name, x in c["opts"].items()}
    if isinstance(vis.get("local_window_size"), int):
        vis["local_window_size"] = (vis["local_window_size"],) * 2
    rows = jnp.broadcast_to(seen_rows(c["t"], c["s"], mask4, **vis), (c["b"], c["t"], c["n"])).astype(F32)
    if c["rank3"]:
        rows = rows[0]
    got = _run(jax_tk.attention, c, q, k, v, bias, mask, w, rows)
    want = _run(_jax_nn, c, q, k, v, bias, mask, w, rows)
    where = f"case {c}"
    seen = np.asarray(rows, bool)
    out, want_out = np.asarray(got[0]), np.asarray(want[0])
    assert out.shape == want_out.shape == q.shape, where
    assert rel_err(out[seen], want_out[seen], floor=0.1) < TOL, f"out: {where}"
    assert np.all(out[~seen] == 0), f"rows that see no key must give 0: {where}"
    res, want_res = np.asarray(got[1]), np.asarray(want[1])
    assert res.shape == want_res.shape == q.shape[:-1], where
    assert rel_err(res[seen], want_res[seen], floor=0.1) < TOL, f"residual: {where}"
    assert np.all(np.isneginf(res[~seen])), where
    names = ["dq", "dk", "dv"] + (["dbias"] if bias is not None else []) + (["dscale"] if c["scale"] == "traced" else [])
    assert len(got[2]) == len(want[2]) == len(names)
    for name, g, r in zip(names, got[2], want[2]):
        assert g.shape == r.shape, (name, where)
        assert np.all(np.isfinite(np.asarray(g))), (name, where)
        assert rel_err(g, r, floor=0.1) < TOL, f"{name}: {rel_err(g, r, floor=0.1):.2e} {where}"


def test_the_sweep_covers_every_argument():
    """The seeded cases include each option and each broadcast of bias and mask (so that a change of the
    generator cannot quietly drop one)."""
    cases = [_case(i) for i in range(CASES)]
    assert any(c["rank3"] for c in cases) and any(c["t"] != c["s"] for c in cases)
    assert any(c["n"] != c["kh"] for c in cases) and any(c["scale"] == "traced" for c in cases)
    for opt in ("is_causal", "local_window_size", "query_seq_lengths", "key_value_seq_lengths"):
        assert any(opt in c["opts"] for c in cases), opt
    for name in ("bias", "mask"):
        shapes = [c[name] for c in cases if c[name] is not None]
        assert any(len(x) < 4 for x in shapes), name
        assert any(x[-4] == 1 for x in shapes if len(x) == 4) and any(x[-3] == 1 for x in shapes if len(x) >= 3), name
    # and some rows see no key (the deliberate difference is exercised, not only avoided)
    assert any(c["mask"] is not None and "is_causal" in c["opts"] for c in cases)
