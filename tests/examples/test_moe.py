"""CPU smoke test of examples/moe.py: a tiny mixture-of-experts transformer trains with jax_tk.ragged_dot
and with jax.lax.ragged_dot, on the same batches, and both report tokens/s."""
import numpy as np
import pytest

from helpers import load_example

pytest.importorskip("optax")


def load():
    return load_example("moe.py", "moe")


TINY = ["--layers", "1", "--width", "32", "--heads", "2", "--experts", "4", "--top-k", "2", "--hidden", "64",
        "--seq", "32", "--batch", "4", "--dtype", "float32", "--lr", "3e-3"]


def test_trains_with_both_gemms(capsys):
    m = load()
    results = m.main(TINY + ["--steps", "25"])
    out = capsys.readouterr().out
    assert "jax_tk.ragged_dot" in out and "jax.lax.ragged_dot" in out and "tokens/s" in out
    assert "two pure-JAX paths compared" in out  # float32 runs no kernel: the ratio must not read as its speed-up
    tk, lax = (np.asarray(results[k]["losses"]) for k in ("tk", "lax"))
    assert tk.shape == lax.shape == (25,) and np.all(np.isfinite(tk))
    assert tk[-5:].mean() < tk[:3].mean() - 0.5, tk  # it learns
    np.testing.assert_allclose(tk, lax, rtol=2e-3)  # the same run, up to float32 rounding
    assert results["tk"]["tokens_per_s"] > 0 and results["lax"]["tokens_per_s"] > 0


def test_moe_layer_against_a_dense_loop():
    """Routing, sorting, the grouped SwiGLU and the unsorting equal a per-token loop over its experts."""
    import jax

    m = load()
    T, D, E, F, k = 24, 16, 5, 8, 2
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (T, D))
    p = {"router": jax.random.normal(keys[1], (D, E)), "w_gate": jax.random.normal(keys[2], (E, D, F)),
         "w_up": jax.random.normal(keys[3], (E, D, F)), "w_down": jax.random.normal(keys[4], (E, F, D))}
    y, aux = m.moe_layer(x, p, k, m.ragged_dot_tk)
    probs = np.asarray(jax.nn.softmax(x @ p["router"], axis=-1))
    want = np.zeros((T, D))
    for t in range(T):
        top = np.argsort(-probs[t])[:k]
        w = probs[t, top] / probs[t, top].sum()
        for e, we in zip(top, w):
            h = np.asarray(jax.nn.silu(x[t] @ p["w_gate"][e]) * (x[t] @ p["w_up"][e]))
            want[t] += we * (h @ np.asarray(p["w_down"][e]))
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)
    # the load-balancing loss: E * sum over experts of (mean router probability) * (share of the rows)
    counts = np.bincount(np.argsort(-probs, axis=1)[:, :k].reshape(-1), minlength=E)
    np.testing.assert_allclose(float(aux), E * np.sum(probs.mean(0) * counts / (T * k)), rtol=1e-5)
