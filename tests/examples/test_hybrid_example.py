"""CPU tests of examples/hybrid.py (three Gated DeltaNet layers to each attention layer): a few training
steps lower the loss, the linear-attention paths give one forward and one gradient where no kernel runs,
and the command line runs end to end."""
import numpy as np
import pytest

import _train_gpt
from helpers import load_example

pytest.importorskip("optax")

TINY = ["--groups", "1", "--width", "32", "--heads", "2", "--la-heads", "2", "--key-dim", "16", "--value-dim", "16",
        "--seq", "40", "--batch", "4", "--steps", "12", "--lr", "3e-3", "--dtype", "float32", "--log-every", "6",
        "--compare-steps", "1"]


def load_hybrid():
    _train_gpt.load_example()
    return load_example("hybrid.py", "hybrid_example")


def test_paths_agree_and_the_gradients_too():
    import jax

    m = load_hybrid()
    config = m.Config(groups=1, width=32, heads=2, la_heads=2, key_dim=16, value_dim=16, seq=40)
    params = m.init_params(jax.random.key(3), config)
    tokens = np.random.default_rng(0).integers(0, 256, (2, 41)).astype(np.int32)
    f = lambda path: jax.jit(jax.value_and_grad(m.loss_fn), static_argnums=(3, 4))(
        params, tokens[:, :-1], tokens[:, 1:], config, path)
    (loss_tk, grads_tk), (loss_xla, grads_xla) = f("tk"), f("xla")
    assert np.isfinite(loss_tk) and abs(float(loss_tk) - float(loss_xla)) < 1e-5
    for a, b in zip(jax.tree_util.tree_leaves(grads_tk), jax.tree_util.tree_leaves(grads_xla)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_command_line_trains(capsys):
    m = load_hybrid()
    out = m.main(TINY)
    losses = out["losses"]
    assert len(losses) == 12 and np.isfinite(losses).all()
    assert np.mean(losses[-3:]) < losses[0] - 0.3, losses  # learning, from about ln(256)
    assert set(out["tokens_per_s"]) == {"tk", "xla"} and all(v > 0 for v in out["tokens_per_s"].values())
    text = capsys.readouterr().out
    assert "3 Gated DeltaNet and 1 attention layers" in text and "the chunked XLA path (the kernels do not take" in text
