"""CPU smoke test of examples/moe.py: a tiny mixture-of-experts transformer trains with jax_tk.ragged_dot
and with jax.lax.ragged_dot, on the same batches, and both report tokens/s; with --fp8, with
jax_tk.ragged_dot and with jax_tk.ragged_dot_fp8 (its reference here)."""
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


def test_fp8_trains_next_to_the_unquantized_run(capsys):
    m = load()
    results = m.main(TINY + ["--steps", "15", "--fp8"])
    out = capsys.readouterr().out
    assert set(results) == {"tk", "fp8"}  # --fp8 compares with jax_tk.ragged_dot, not also jax.lax's
    assert "jax_tk.ragged_dot_fp8" in out and "final loss gap, fp8 - float32" in out
    assert "no FP8 kernel runs here" in out  # the reference's speed must not read as the kernel's
    assert out.count("tokens/s") == 3  # each run's, then their ratio
    base, fp8 = (np.asarray(results[k]["losses"]) for k in ("tk", "fp8"))
    assert fp8.shape == base.shape == (15,) and np.all(np.isfinite(fp8))
    assert fp8[-3:].mean() < fp8[:3].mean() - 0.5, fp8  # it learns
    # The same parameters and batches: only the experts' forward products differ, by FP8 rounding
    # (a few % of the MoE output, which is a small part of the residual stream). Measured here: at
    # most 2.4e-4 apart (relative) over the 15 steps; 0.5% leaves room for other platforms' rounding.
    np.testing.assert_allclose(fp8, base, rtol=5e-3)
    assert results["fp8"]["tokens_per_s"] > 0 and results["tk"]["tokens_per_s"] > 0


def test_moe_layer_fp8_against_the_dequantized_product():
    """With ragged_dot_fp8 the layer is the float32 MoE of the dequantized operands: each expert's rows
    quantized in 1x128 blocks along k, its weights in 128x128 blocks, and the SwiGLU output quantized
    again before W_down."""
    import jax
    from jax_tk.gemm.fp8 import dequantize

    import jax_tk

    m = load()
    # D = 160: two blocks of k for W_gate / W_up, the second ragged; F = 48 < 128: a ragged one for W_down.
    T, D, E, F, k = 24, 160, 5, 48, 2
    keys = jax.random.split(jax.random.key(1), 5)
    x = jax.random.normal(keys[0], (T, D))
    p = {"router": jax.random.normal(keys[1], (D, E)), "w_gate": jax.random.normal(keys[2], (E, D, F)) / D**0.5,
         "w_up": jax.random.normal(keys[3], (E, D, F)) / D**0.5, "w_down": jax.random.normal(keys[4], (E, F, D))}
    # (jit: one compilation instead of one per op, which takes most of the test's time)
    layer = jax.jit(m.moe_layer, static_argnums=(2, 3))
    y, _ = layer(x, p, k, m.ragged_dot_fp8)
    fake_quant = jax.jit(lambda a, block: dequantize(*jax_tk.quantize_fp8(a, block), block), static_argnums=1)
    deq = lambda a, block: np.asarray(fake_quant(a, block), np.float64)  # noqa: E731
    wg, wu, wd = (deq(p[w], (128, 128)) for w in ("w_gate", "w_up", "w_down"))
    xq = deq(x, (1, 128))  # (a row's blocks do not depend on the other rows: all the tokens at once)
    probs = np.asarray(jax.nn.softmax(x @ p["router"], axis=-1))
    top = np.argsort(-probs, axis=1)[:, :k]  # [T, k] experts
    w = np.take_along_axis(probs, top, 1)
    w = w / w.sum(1, keepdims=True)
    gate, up = np.einsum("td,tkdf->tkf", xq, wg[top]), np.einsum("td,tkdf->tkf", xq, wu[top])
    h = gate / (1 + np.exp(-gate)) * up  # [T, k, F], SwiGLU
    hq = deq(np.float32(h).reshape(T * k, F), (1, 128)).reshape(T, k, F)
    want = np.einsum("tk,tkf,tkfd->td", w, hq, wd[top])
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)
    # ... and not the unquantized layer: FP8 rounding moves it by a few %, far past that tolerance.
    exact, _ = layer(x, p, k, m.ragged_dot_tk)
    err = np.abs(np.asarray(y) - np.asarray(exact)).max() / np.abs(np.asarray(exact)).max()
    assert 1e-3 < err < 0.1, err
