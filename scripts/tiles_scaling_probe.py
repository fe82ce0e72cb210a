"""How the forward's tile prep (jax_tk.attention._fwd_tiles and the segment ranges, pure XLA) scales
with the sequence length: the benchmark's 8 packed documents per row, B = 1, H = 16, D = 128, timed
with the benchmark's timer (a jitted call of tiny ops costs ~0.1 ms of dispatch: compare growth).
Usage: python scripts/tiles_scaling_probe.py [T ...]   (needs no built kernels)"""
import sys

import jax
import jax.numpy as jnp

import jax_tk  # noqa: F401
A = sys.modules["jax_tk.attention"]
from jax_tk.bench import WallTimer, document_lengths, segment_ids_from_lengths

timer = WallTimer()
for t in [int(x) for x in sys.argv[1:]] or [16384, 65536, 262144]:
    ids = jnp.asarray(segment_ids_from_lengths(document_lengths(t, 8, 0, 1)))
    for causal in (False, True):
        def prep(i):
            r = A._segment_ranges(i)
            return A._fwd_tiles(i, i, r, r, causal, 16, A.ORDER_GROUP_HEADS, 128)

        ranges = timer.measure(jax.jit(A._segment_ranges), [(ids,)]).median_ms
        full = timer.measure(jax.jit(prep), [(ids,)]).median_ms
        print(f"T={t} causal={causal}: ranges {ranges:.4f} ms, ranges + tiles {full:.4f} ms")
