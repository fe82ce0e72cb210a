"""What the segment-id operands cost outside the kernels: the XLA ops that work out the segment
ranges and the forward's tiles or the backward's block order (jax_tk.attention._mask_operands),
timed alone with the benchmark's timer, next to the whole forward and backward with segment ids, and
without segment ids. The ids: one segment per row (the same results as none), or with `docs` the
benchmark's 8 packed documents of random lengths per row.
Usage: PYTHONPATH=<built jax_tk> python scripts/prep_probe.py [B T H D] [docs]"""
import sys

import jax
import jax.numpy as jnp

import jax_tk  # noqa: E402
A = sys.modules["jax_tk.attention"]
from jax_tk.bench import WallTimer, document_lengths, segment_ids_from_lengths

B, T, H, D = (int(x) for x in sys.argv[1:5]) if len(sys.argv) > 4 else (8, 2048, 16, 128)
key = jax.random.PRNGKey(0)
q, k, v, do = (jax.random.normal(kk, (B, T, H, D), jnp.bfloat16) for kk in jax.random.split(key, 4))
docs = "docs" in sys.argv[1:]
ids = jnp.asarray(segment_ids_from_lengths(document_lengths(T, 8, 0, B))) if docs else jnp.zeros((B, T), jnp.int32)
timer = WallTimer()


def ms(fn, *args):
    return timer.measure(jax.jit(fn), [args]).median_ms


for causal in (False, True):
    for tag in ("fwd", "bwd"):
        def order(qi, ki, qr, kr):
            if tag == "fwd":
                return A._fwd_tiles(qi, ki, qr, kr, causal, H, A.ORDER_GROUP_HEADS, D)
            kb, qb = A._bwd_order_blocks(D)
            return A._block_order(qr, kr, qb, kb, causal, False, H, A.ORDER_GROUP_HEADS)
        print(f"causal={causal} {tag} prep (ranges + {'tiles' if tag == 'fwd' else 'order'}): "
              f"{ms(lambda i: A._mask_operands(A.Masks(i, i, None, None), order), ids):.4f} ms"
              f"  ranges only: {ms(lambda i: A._mask_operands(A.Masks(i, i, None, None)), ids):.4f} ms")

    def fwd(q, k, v, i=None):
        kw = {} if i is None else dict(q_segment_ids=i, kv_segment_ids=i)
        return jax_tk.attention(q, k, v, is_causal=causal, implementation="tk", **kw)

    for name, i in (("plain", None), ("segments", ids)):
        print(f"causal={causal} {name}: fwd {ms(fwd, q, k, v, i) if i is not None else ms(fwd, q, k, v):.4f} ms", end="")
        vjp = jax.jit(lambda q, k, v, i=i: jax.vjp(lambda q, k, v: fwd(q, k, v, i), q, k, v)[1])(q, k, v)
        print(f"  bwd {timer.measure(jax.jit(lambda f, g: f(g)), [(vjp, do)]).median_ms:.4f} ms")
