"""What the segment-id operands cost outside the kernels: the XLA ops that work out the segment
ranges and the forward's tiles or the backward's block order (jax_tk.attention._mask_operands),
timed alone with the benchmark's timer, next to the whole forward and backward with segment ids, and
without segment ids; then the forward and backward with the same operands worked out beforehand and
passed in (their difference from the whole call is what the operands cost inside it), and the
forward with the ids a constant of the program (as the benchmark passes them: XLA folds the
operands' ops at compile time). The ids: one segment per row (the same results as none), or with
`docs` the benchmark's 8 packed documents of random lengths per row.
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


def operands(ids, order=None):  # the masking operands of a call with these segment ids
    return A._mask_operands(A.Masks(ids, ids, None, None), order)


def order_of(tag, causal):  # the forward's tiles or the backward's block order
    if tag == "fwd":
        return lambda qi, ki, qr, kr: A._fwd_tiles(qi, ki, qr, kr, causal, H, A.ORDER_GROUP_HEADS, D)
    kb, qb = A._bwd_order_blocks(D)
    return lambda qi, ki, qr, kr: A._block_order(qr, kr, qb, kb, causal, False, H, A.ORDER_GROUP_HEADS)


def given(ops, fn):
    """fn with the masking operands `ops` passed in: _mask_operands replaced by them while it is traced."""
    real = A._mask_operands

    def call(ops, *args):
        A._mask_operands = lambda masks, order=None: ops
        try:
            return fn(*args)
        finally:
            A._mask_operands = real
    return call


for causal in (False, True):
    for tag in ("fwd", "bwd"):
        print(f"causal={causal} {tag} prep (ranges + {'tiles' if tag == 'fwd' else 'order'}): "
              f"{ms(lambda i: operands(i, order_of(tag, causal)), ids):.4f} ms"
              f"  ranges only: {ms(operands, ids):.4f} ms")

    def fwd(q, k, v, i=None):
        kw = {} if i is None else dict(q_segment_ids=i, kv_segment_ids=i)
        return jax_tk.attention(q, k, v, is_causal=causal, implementation="tk", **kw)

    vjps = {}
    for name, i in (("plain", None), ("segments", ids)):
        print(f"causal={causal} {name}: fwd {ms(fwd, q, k, v, i) if i is not None else ms(fwd, q, k, v):.4f} ms", end="")
        vjps[name] = jax.jit(lambda q, k, v, i=i: jax.vjp(lambda q, k, v: fwd(q, k, v, i), q, k, v)[1])(q, k, v)
        print(f"  bwd {timer.measure(jax.jit(lambda f, g: f(g)), [(vjps[name], do)]).median_ms:.4f} ms")

    # The same calls with the operands worked out beforehand and passed in.
    ops_f, ops_b = (jax.jit(lambda i, tag=tag: operands(i, order_of(tag, causal)))(ids) for tag in ("fwd", "bwd"))
    f_ms = timer.measure(jax.jit(given(ops_f, fwd)), [(ops_f, q, k, v, ids)]).median_ms
    b_ms = timer.measure(jax.jit(given(ops_b, lambda f, g: f(g))), [(ops_b, vjps["segments"], do)]).median_ms
    print(f"causal={causal} segments, operands given: fwd {f_ms:.4f} ms  bwd {b_ms:.4f} ms")
    # (The backward's residuals, the ids among them, are arguments of the timed program either way.)
    print(f"causal={causal} segments, ids constant: fwd {ms(lambda q, k, v: fwd(q, k, v, ids), q, k, v):.4f} ms")
