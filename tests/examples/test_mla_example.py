"""CPU tests of examples/mla.py: generation from the absorbed latent cache (contiguous and paged) gives
the logits of the plain forward and of the expanded per-head cache, a few training steps lower the loss,
and the command line runs end to end."""
import os
import subprocess
import sys

import numpy as np
import pytest

import _train_gpt
from helpers import child_env, load_example

pytest.importorskip("optax")

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples", "mla.py")
TINY = ["--layers", "1", "--width", "64", "--heads", "2", "--q-lora-rank", "32", "--kv-lora-rank", "48",
        "--qk-nope", "16", "--qk-rope", "8", "--v-dim", "24", "--seq", "48", "--batch", "4", "--steps", "6",
        "--lr", "3e-3", "--dtype", "float32", "--log-every", "3", "--gen-batch", "3", "--prompt-len", "8",
        "--new-tokens", "10"]


def load_mla():
    _train_gpt.load_example()  # the modules the example imports, as the other examples' tests load them
    load_example("generate.py", "generate")
    return load_example("mla.py", "mla_example")


@pytest.mark.parametrize("layers,q_lora_rank,page_size", [(2, 32, None), (1, 0, 8)],
                         ids=["contiguous", "paged-no-q-lora"])
def test_latent_cache_generation_matches_full_forward(layers, q_lora_rank, page_size):
    import jax

    m = load_mla()
    config = m.Config(layers=layers, width=64, heads=2, q_lora_rank=q_lora_rank, kv_lora_rank=48, qk_nope=16,
                      qk_rope=8, v_dim=24, seq=48)
    params = m.init_params(jax.random.key(1), config)
    # random parameters give near-uniform logits: scale the embedding up so that the logits spread
    params["wte"] = params["wte"] * 20
    prompt = m.generate.prompts(3, 8, seed=1)
    r = m.run_generation(params, config, prompt, 12, path="latent", page_size=page_size, timed=False)
    tokens, logits = r["tokens"], r["logits"]
    assert tokens.shape == (3, 12) and logits.shape == (3, 12, 256)
    full = np.concatenate([prompt, tokens], axis=1)
    want = np.asarray(jax.jit(m.forward, static_argnums=(2, 3))(params, full, config, "reference"))
    want = want[:, prompt.shape[1] - 1:-1]
    assert m.generate.rel_err(logits, want) < 1e-5
    np.testing.assert_array_equal(tokens, want.argmax(-1))  # greedy
    # the expanded per-head cache, fed the same tokens
    x = m.run_generation(params, config, prompt, 12, path="xla", forced=tokens, timed=False)
    assert m.generate.rel_err(x["logits"], logits) < 1e-5


def test_absorbed_attention_equals_expanded_attention():
    """One step's attention: the absorbed query over the latent rows == per-head keys/values."""
    import jax
    import jax.numpy as jnp

    m = load_mla()
    config = m.Config(layers=1, width=32, heads=4, q_lora_rank=0, kv_lora_rank=16, qk_nope=8, qk_rope=4, v_dim=6,
                      seq=16)
    p = m._layer(m.init_params(jax.random.key(3), config), 0)
    x = jax.random.normal(jax.random.key(4), (2, 9, 32))
    pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
    lengths = jnp.array([9, 5])

    @jax.jit
    def both(x, p):
        p = jax.tree_util.tree_map(lambda a: a * 10, p)  # logits far from uniform
        q_nope, q_rope, c_kv, k_rope = m.block_in(x, p, pos, config)
        cache = jnp.concatenate([c_kv[:, :, None], k_rope], axis=-1)  # the latent rows
        got = m.absorbed_attention(q_nope[:, -1:], q_rope[:, -1:], cache, lengths, None, p, config)
        k, v = m.expand_kv(c_kv, k_rope, p, config)
        q = jnp.concatenate([q_nope, q_rope], axis=-1)[:, -1:]
        want = jax.nn.dot_product_attention(q, k, jnp.pad(v, ((0, 0),) * 3 + ((0, 6),)),  # jax.nn: equal head dims
                                            key_value_seq_lengths=lengths, scale=config.scale)[..., :6]
        return got, want

    got, want = both(x, p)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_training_lowers_the_loss():
    m = load_mla()
    config = m.Config(layers=1, width=32, heads=2, q_lora_rank=16, kv_lora_rank=32, qk_nope=16, qk_rope=8, v_dim=16,
                      seq=32)
    _, losses, tok_s = m.train(config, steps=25, batch=8, lr=3e-3, log_every=100)
    assert len(losses) == 25 and np.all(np.isfinite(losses)) and tok_s > 0
    assert np.mean(losses[-5:]) < losses[0] - 1.0, losses


def test_command_line():
    """The script end to end in a fresh process (paged latent cache): it trains, prints the loss and both
    paths' tokens/s, and its check passes (exit status 0)."""
    env = child_env("", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, EXAMPLE, *TINY, "--paged", "--page-size", "8"], env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out[-2000:] + proc.stderr[-2000:]
    assert "step     6  loss" in out and "paged (pages of 8)" in out, out[-2000:]
    assert "latent: prefill" in out and "xla: prefill" in out and "tokens/s" in out, out[-2000:]
    assert "check latent vs full forward: ok" in out and "check xla vs latent: ok" in out, out[-2000:]
