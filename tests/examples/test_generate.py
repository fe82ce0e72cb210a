"""CPU tests of examples/generate.py: KV-cache generation of the example GPT (contiguous and paged
caches, scan and while_loop) gives the logits of the plain forward over the whole sequence, sampling
works, and the command line compares implementations (and notices a wrong one)."""
import os
import subprocess
import sys

import numpy as np
import pytest

import _train_gpt
from helpers import child_env, load_example

pytest.importorskip("optax")

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples", "generate.py")
TINY = ["--layers", "2", "--width", "64", "--heads", "2", "--seq", "64", "--dtype", "float32", "--batch", "3",
        "--prompt-len", "8", "--new-tokens", "12"]


def load_generate():
    _train_gpt.load_example()  # the model module, as the example imports it
    return load_example("generate.py", "generate_example")


@pytest.mark.parametrize("paged,loop,heads,kv_heads", [(False, "scan", 2, 0), (True, "scan", 2, 0), (True, "while", 2, 0),
                                                       (False, "scan", 4, 2), (True, "scan", 4, 1)],
                         ids=["contiguous-scan", "paged-scan", "paged-while", "gqa-contiguous", "mqa-paged"])
def test_cached_generation_matches_full_forward(paged, loop, heads, kv_heads):
    import jax

    g = load_generate()
    m = _train_gpt.load_example()
    config = m.Config(layers=2, width=64, heads=heads, seq=64, kv_heads=kv_heads)
    params = m.init_params(jax.random.key(1), config)
    prompt = g.prompts(3, 8, seed=1)
    r = g.generate(params, config, prompt, 10, attention="tk", page_size=8 if paged else None, loop=loop,
                   timed=False)
    tokens, logits = r["tokens"], r["logits"]
    assert tokens.shape == (3, 10) and logits.shape == (3, 10, 256)
    caches, _ = g.empty_caches(config, 3, 24, 8 if paged else None)
    assert caches[0][0].shape[-2:] == (kv_heads or heads, 64 // heads)  # (the cache holds the kv heads)
    # logits[:, i] is the distribution of token i: the plain forward's at the last position before it
    full = np.concatenate([prompt, tokens], axis=1)
    want = np.asarray(jax.jit(m.forward, static_argnums=(2, 3))(params, full, config, "reference"))
    want = want[:, prompt.shape[1] - 1:-1]
    assert g.rel_err(logits, want) < 1e-5
    np.testing.assert_array_equal(tokens, want.argmax(-1))  # greedy


def test_serving_params_cast_the_matmul_weights_once_and_change_nothing():
    import jax
    import jax.numpy as jnp

    g = load_generate()
    m = _train_gpt.load_example()
    config = m.Config(layers=2, width=64, heads=4, seq=32, kv_heads=2, dtype="bfloat16")
    params = m.init_params(jax.random.key(3), config)
    served = g.serving_params(params, config)
    for name, leaf in served["blocks"].items():
        want = jnp.bfloat16 if name.endswith(("_w", "_b")) and not name.startswith("ln") else jnp.float32
        assert leaf.dtype == want, name
    assert served["wte"].dtype == served["wpe"].dtype == jnp.float32
    prompt = jnp.asarray(g.prompts(2, 6, seed=2))
    caches, _ = g.empty_caches(config, 2, 8, None)
    lengths = jnp.zeros((2,), jnp.int32)
    run = jax.jit(g.forward_cached, static_argnames=("config", "attention", "prefill"))
    want, _ = run(params, prompt, caches, lengths, None, config=config, attention="tk", prefill=True)
    got, _ = run(served, prompt, caches, lengths, None, config=config, attention="tk", prefill=True)
    assert np.isfinite(np.asarray(want)).all() and np.abs(np.asarray(want)).max() > 0
    assert g.rel_err(got, want) < 1e-6


def test_sampling_with_temperature():
    import jax

    g = load_generate()
    m = _train_gpt.load_example()
    config = m.Config(layers=1, width=32, heads=2, seq=32)
    params = m.init_params(jax.random.key(2), config)
    prompt = g.prompts(2, 4, seed=0)
    a = g.generate(params, config, prompt, 16, temperature=1.0, seed=0, timed=False)["tokens"]
    b = g.generate(params, config, prompt, 16, temperature=1.0, seed=1, timed=False)["tokens"]
    again = g.generate(params, config, prompt, 16, temperature=1.0, seed=0, timed=False)["tokens"]
    assert a.min() >= 0 and a.max() < 256
    np.testing.assert_array_equal(a, again)
    assert not np.array_equal(a, b)
    with pytest.raises(ValueError, match="context"):
        g.generate(params, config, prompt, 40, timed=False)


def test_command_line(capsys):
    g = load_generate()
    out = g.main(TINY + ["--paged", "--page-size", "8"])  # (float32: cuDNN, which needs 16-bit inputs, is skipped or fails)
    printed = capsys.readouterr().out
    assert {"tk", "xla", "check"} <= set(out) and "check xla vs tk: ok" in out["check"][1], out["check"]
    assert "tokens/s" in printed
    assert out["tk"]["tokens_per_s"] > 0


def test_command_line_grouped_query_heads():
    """--heads 4 --kv-heads 2: a grouped-query model, every implementation agreeing (the command's check)."""
    g = load_generate()
    out = g.main(TINY + ["--heads", "4", "--kv-heads", "2", "--paged", "--page-size", "8"])
    assert "check xla vs tk: ok" in out["check"][1], out["check"]


def test_latency_at_batch_one(capsys):
    """--latency times the first prompt alone: a step's latency in µs per new token, printed and returned."""
    g = load_generate()
    out = g.main(TINY + ["--attention", "tk", "--latency", "--no-check"])
    assert out["tk"]["latency_us"] > 0 and "batch 1:" in capsys.readouterr().out


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_command_line_on_two_devices(paged):
    """--devices 2: the batch split over two (CPU) devices gives the same tokens and logits as the
    reference implementation (the command's own check), in a fresh process with two host devices."""
    env = child_env("--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, EXAMPLE, *TINY, "--batch", "4", "--devices", "2", "--attention", "tk,xla"]
    proc = subprocess.run(cmd + (["--paged"] if paged else []), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "2 device(s)" in proc.stdout and "check xla vs tk: ok" in proc.stdout, proc.stdout[-2000:]


def test_compare_notices_wrong_logits_and_tokens():
    g = load_generate()
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 5, 256)).astype(np.float32) * 3
    base = dict(tokens=logits.argmax(-1), logits=logits)
    assert g.compare(base, base, base, 1e-4)[0]
    off = dict(tokens=base["tokens"], logits=logits * 1.01)
    assert not g.compare(base, off, base, 1e-4)[0]
    flipped = dict(tokens=base["tokens"].copy(), logits=logits)
    flipped["tokens"][1, 2] = (flipped["tokens"][1, 2] + 1) % 256  # a clear winner lost: wrong
    ok, msg = g.compare(base, base, flipped, 1e-4)
    assert not ok and "sequence 1 step 2" in msg
    tie = logits.copy()
    second = np.argsort(tie[1, 2])[-2]
    tie[1, 2, second] = tie[1, 2].max() - 1e-6  # a near-tie: either token is acceptable
    flipped["tokens"][1, 2] = second
    base_tie = dict(tokens=tie.argmax(-1), logits=tie)
    assert g.compare(base_tie, base_tie, flipped, 1e-4)[0]
