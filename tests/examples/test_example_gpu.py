"""GPU: training the example GPT with jax_tk's kernel follows the same loss curve as with its reference.

Two runs of examples/train_gpt.py from the same seed and the same batches, bf16, head_dim 64: one
with ``--attention tk`` (the CUDA kernels, forward and backward), one with ``--attention reference``
(``jax_tk.attention(implementation="xla")``, float32 softmax). bf16 rounding differs between the
two, so the curves drift apart a little step by step, but they must stay together:

- the smoothed curves (EMA 0.9) differ by less than ``SMOOTH_TOL`` nats at every step, and
- the mean loss of the last 10 steps agrees within ``FINAL_RTOL`` (relative),
- and both actually learn (the loss falls by more than 1.5 nats from ~ln 256).
"""

import numpy as np
import pytest

import _train_gpt

pytestmark = pytest.mark.gpu

SMOOTH_TOL = 0.05
FINAL_RTOL = 0.02
STEPS = 100


# 2 layers, width 256 = 4 heads of 64, context 256: small, but the kernel path with causal masking
# over several 64-row tiles, forward and backward.
MODEL = ["--layers", "2", "--width", "256", "--heads", "4", "--seq", "256", "--batch", "16",
         "--lr", "2e-3", "--dtype", "bfloat16", "--seed", "0", "--steps", str(STEPS),
         "--log-every", "10", "--eval-every", "0", "--eval-batches", "2", "--sample-len", "0",
         "--save-every", "0", "--no-progress"]


def load_example():
    pytest.importorskip("optax")
    pytest.importorskip("matplotlib")
    return _train_gpt.load_example()


def test_tk_training_matches_reference(tmp_path):
    m = load_example()
    tk = m.main(MODEL + ["--attention", "tk", "--out", str(tmp_path / "tk")])
    ref = m.main(MODEL + ["--attention", "reference", "--out", str(tmp_path / "ref")])
    a, b = np.asarray(tk["losses"]), np.asarray(ref["losses"])
    assert a.shape == b.shape == (STEPS,)
    assert np.all(np.isfinite(a)) and np.all(np.isfinite(b))
    assert a[-10:].mean() < a[:5].mean() - 1.5, a  # it learns
    smooth_diff = np.abs(np.asarray(m.ema(a)) - np.asarray(m.ema(b)))
    assert smooth_diff.max() < SMOOTH_TOL, (smooth_diff.max(), int(smooth_diff.argmax()))
    fa, fb = a[-10:].mean(), b[-10:].mean()
    assert abs(fa - fb) / fb < FINAL_RTOL, (fa, fb)
    print(f"tk: final {fa:.4f}, {tk['tokens_per_s']:,.0f} tokens/s; reference: final {fb:.4f}, "
          f"{ref['tokens_per_s']:,.0f} tokens/s; max smoothed difference {smooth_diff.max():.4f}")
