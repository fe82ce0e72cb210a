"""CPU smoke test of examples/train_gpt.py: a tiny GPT trains, plots, checkpoints and resumes."""
import json
import math
import os
import sys

import numpy as np
import pytest

import _train_gpt

pytest.importorskip("optax")
pytest.importorskip("matplotlib")





# 2 layers, width 64, 2 heads of 32: a few seconds of compilation and ~0.05 s a step on 2 cores.
TINY = ["--layers", "2", "--width", "64", "--heads", "2", "--seq", "64", "--batch", "8",
        "--lr", "3e-3", "--dtype", "float32", "--attention", "tk", "--eval-batches", "2",
        "--eval-every", "0", "--log-every", "5", "--sample-len", "16", "--no-progress"]


def test_import_has_no_side_effects(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "train_gpt", raising=False)  # a fresh import
    module = _train_gpt.load_example()
    assert callable(module.main) and callable(module.train_step)
    assert not os.listdir(tmp_path)


def test_model_functions():
    import jax
    import jax.numpy as jnp
    import optax

    m = _train_gpt.load_example()
    config = m.Config(layers=2, width=64, heads=2, seq=32)
    params = m.init_params(jax.random.key(0), config)
    x, y = m.get_batch(m.load_data()[0], 4, config.seq, seed=0, step=0)
    assert x.shape == y.shape == (4, 32) and x.dtype == np.int32
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    # Causality: changing later bytes does not change earlier logits.
    x2 = x.copy()
    x2[:, 20:] = (x2[:, 20:] + 1) % 256
    logits = jax.jit(m.forward, static_argnums=2)(params, np.concatenate([x, x2]), config)
    a, b = logits[:4], logits[4:]
    np.testing.assert_allclose(a[:, :20], b[:, :20], atol=1e-5)
    assert not np.allclose(a[:, 20:], b[:, 20:])
    loss = float(optax.softmax_cross_entropy_with_integer_labels(a, y).mean())
    assert abs(loss - math.log(256)) < 0.2  # a fresh model is close to uniform over bytes
    # Grouped-query heads: 4 query heads over 2 key/value heads (the projection 64 + 2 * 2 * 16 wide).
    gqa = m.Config(layers=2, width=64, heads=4, seq=32, kv_heads=2)
    gp = m.init_params(jax.random.key(0), gqa)
    assert gp["blocks"]["qkv_w"].shape == (2, 64, 128)
    q, k, v = m.block_qkv(jnp.zeros((4, 32, 64)), jax.tree.map(lambda t: t[0], gp["blocks"]), gqa)
    assert q.shape == (4, 32, 4, 16) and k.shape == v.shape == (4, 32, 2, 16)
    assert jax.jit(m.forward, static_argnums=2)(gp, x, gqa).shape == (4, 32, 256)
    with pytest.raises(ValueError, match="kv_heads 3 must divide heads 4"):
        m.init_params(jax.random.key(0), m.Config(layers=1, width=64, heads=4, seq=32, kv_heads=3))


def test_train_plot_checkpoint_resume(tmp_path, capsys):
    import jax

    m = _train_gpt.load_example()
    out = str(tmp_path / "run")
    first = m.main(TINY + ["--steps", "30", "--out", out])
    losses = np.asarray(first["losses"])
    assert first["step"] == 30 and len(losses) == 30
    assert np.all(np.isfinite(losses))
    assert losses[-5:].mean() < losses[:5].mean() - 1.0, losses  # from ~5.5 nats to under ~4
    assert math.isfinite(first["tokens_per_s"]) and first["tokens_per_s"] > 0
    assert os.path.getsize(os.path.join(out, "loss.png")) > 1000
    assert os.path.exists(os.path.join(out, "ckpt.npz"))
    assert m.read_checkpoint_meta(os.path.join(out, "ckpt.npz"))["step"] == 30
    with open(os.path.join(out, "summary.json")) as f:
        assert json.load(f)["step"] == 30
    assert isinstance(first["sample"], bytes) and len(first["sample"]) == 1 + 16

    # The checkpoint holds the final parameters and optimizer state (Adam moments, counts) exactly.
    config = m.Config(**m.read_checkpoint_meta(os.path.join(out, "ckpt.npz"))["config"])
    assert (config.layers, config.width, config.heads, config.seq) == (2, 64, 2, 64)
    template = m.init_params(jax.random.key(1), config)
    optimizer = m.make_optimizer(1e-3, 10)
    params, opt_state, step, saved_losses = m.load_checkpoint(
        os.path.join(out, "ckpt.npz"), template, optimizer.init(template))
    assert step == 30 and np.allclose(saved_losses, first["losses"])
    want = jax.tree_util.tree_leaves((first["params"], first["opt_state"]))
    got = jax.tree_util.tree_leaves((params, opt_state))
    assert len(want) == len(got)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(np.asarray(w), np.asarray(g))

    second = m.main(TINY + ["--steps", "40", "--out", out, "--resume"])
    assert "resumed from" in capsys.readouterr().out
    assert second["first_step"] == 30 and second["step"] == 40
    assert second["losses"][:30] == first["losses"]  # the history is carried over
    assert len(second["losses"]) == 40 and np.all(np.isfinite(second["losses"]))
    # It continues from the trained state rather than starting again near log(256).
    assert second["losses"][30] < first["losses"][0] - 1.0
    assert m.read_checkpoint_meta(os.path.join(out, "ckpt.npz"))["step"] == 40
