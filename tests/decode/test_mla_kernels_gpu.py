"""The MLA decode kernel (DeepSeek's latent rows, D = 576 with values the first 512 dims; H100/H200) on
the GPU against test_mla's float32 oracle: contiguous and paged latent caches (pages shuffled, stray NaN
pages, NaN past each length), ragged lengths in one batch (0, shorter than T_new, odd, long), page
sizes 16/32/64/256 and one that is not a multiple of 16, T_new 1-4, 16/64/128 heads, bf16 and fp16,
split counts 1 to many. The output, lse and workspace are poisoned with NaN before the kernel runs:
every element must be written, and nothing unread may leak in."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from helpers import nan, randn, rel_err
from jax_tk._core import extension
from jax_tk.decode import launch, mla
from test_decode import poison_past, to_pages
from test_decode_kernels_gpu import check_part
from test_mla import oracle

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(extension.cuda_device_capability() != (9, 0), reason="the MLA kernel runs on sm_90a")]
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
TOL = {BF16: 1.2e-2, F16: 3e-3}
D, DV = 576, 512
SCALE = 1 / np.sqrt(192)  # (DeepSeek's: the training attention's head dim, not the latent rows')


@functools.partial(jax.jit, static_argnames=("spec", "parts"))
def kernel(q, cache, lengths, table, *, spec, parts):
    b, t, n, _ = q.shape
    out_init = (nan((b, t, n, DV), q.dtype), nan((b, n, t), F32), nan((launch.workspace_words(parts, b, t, n, DV),), F32))
    return mla._kernel(spec, q, cache, lengths, table, out_init=out_init, parts=parts)


def check(seed, b, t, n, lengths, dtype, page_size=None, parts=(1, 3, None)):
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths)
    unit = page_size or 1
    s = unit * ((int(lengths.max()) + unit) // unit)
    q, cache = randn(rng, (b, t, n, D), dtype), randn(rng, (b, s, 1, D), dtype)
    lens = jnp.asarray(lengths, jnp.int32)
    ref, ref_lse = (np.asarray(x) for x in oracle(q, cache, lens, float(SCALE), DV))
    cache = poison_past(cache, lengths)
    table = None
    if page_size:
        cache, _, table = to_pages(rng, cache, cache, page_size)
    spec = mla.MlaSpec(float(SCALE), True, DV, True, page_size)
    for p in parts:
        p = launch.splits(b, t, n, 1, s, D) if p is None else p
        out, lse = kernel(q, cache, lens, table, spec=spec, parts=p)
        check_part(p, out, lse, ref, ref_lse, TOL[dtype])

# (B, T_new, heads, lengths, dtype, page_size)
CASES = [
    (3, 1, 16, (0, 1, 37), BF16, None),
    (2, 4, 128, (3, 100), BF16, 64),
    (2, 2, 16, (129, 326), F16, 256),
    (3, 3, 64, (0, 5, 1000), BF16, 16),
    (2, 2, 16, (200, 33), BF16, 32),
    (2, 1, 16, (95, 50), BF16, 48),  # (pages of 48: no TMA boxes, every block row by row)
    (4, 1, 128, (4113, 77, 1, 2048), BF16, None),
    (1, 4, 16, (8192 + 5,), F16, 64),
]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"case{i}" for i in range(len(CASES))])
def test_against_oracle(case):
    b, t, n, lengths, dtype, page_size = CASES[case]
    check(case, b, t, n, lengths, dtype, page_size)


def test_mla_attention_takes_the_kernel():
    """jax_tk.decode.mla_attention runs the kernel by default for DeepSeek's dims on this GPU (its lowering
    calls the decode target), and agrees with implementation="xla"; sinks join both alike."""
    rng = np.random.default_rng(7)
    q, cache = randn(rng, (2, 2, 32, D), BF16), randn(rng, (2, 300, 1, D), BF16)
    lens, sinks = jnp.asarray([300, 41], jnp.int32), jnp.asarray(rng.standard_normal(32), F32)
    f = lambda impl: jax.jit(functools.partial(jax_tk.decode.mla_attention, scale=float(SCALE), sinks=sinks,
                                               implementation=impl))
    assert "jax_tk_decode" in f(None).lower(q, cache, lens).as_text()
    got, want = (np.asarray(f(i)(q, cache, lens).astype(F32)) for i in (None, "xla"))
    assert rel_err(got, want) < TOL[BF16]
