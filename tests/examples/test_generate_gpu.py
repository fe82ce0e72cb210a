"""GPU: examples/generate.py runs jax_tk.decode, cuDNN and XLA in bf16 and they agree (teacher-forced
logits within the bf16 tolerance, greedy tokens the same up to near-ties), contiguous and paged."""
import jax
import jax.numpy as jnp
import pytest

from jax_tk._core import extension
from jax_tk.decode import launch
from test_generate import load_generate

pytestmark = pytest.mark.gpu

MODEL = ["--layers", "2", "--width", "256", "--heads", "4", "--seq", "256", "--dtype", "bfloat16", "--batch", "8",
         "--prompt-len", "64", "--new-tokens", "96"]


@pytest.mark.parametrize("extra", [[], ["--paged", "--page-size", "16", "--loop", "while"]],
                         ids=["contiguous-scan", "paged-while"])
def test_three_implementations_agree(extra, capsys):
    # "tk" is implementation=None: the decode kernel must take this model's calls (bf16, head_dim 64), or
    # the three would only compare the reference with cuDNN and XLA
    q, cache = jax.ShapeDtypeStruct((8, 1, 4, 64), jnp.bfloat16), jax.ShapeDtypeStruct((8, 256, 4, 64), jnp.bfloat16)
    assert extension.has_cuda_kernels() and launch.kernel_unsupported_reason(q, cache) is None
    g = load_generate()
    out = g.main(MODEL + extra)
    print(capsys.readouterr().out)
    assert {"tk", "cudnn", "xla"} <= set(out)
    assert out["check"][0], out["check"][1]
    assert all(out[a]["tokens_per_s"] > 0 for a in ("tk", "cudnn", "xla"))
