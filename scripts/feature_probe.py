"""Where do the masking features lose time? Times jax_tk on plain attention and on the same work
through the masked (FULL) kernels, with the benchmark's timer.
Usage: [PROBE_ROWS=0,1,...] [PROBE_MODES=fwd,bwd] python scripts/feature_probe.py [T H D]"""
import os
import sys

from jax_tk.bench import AttentionConfig as C, bench_attention

T, H, D = (int(x) for x in sys.argv[1:4]) if len(sys.argv) > 3 else (16384, 16, 128)
configs = [
    C(1, T, T, H, D, True, feature="plain"),
    C(1, T, T, H, D, True, feature="plain", window=(T, 0)),  # the masked kernels, the same mask
    C(1, T, T, H, D, True, feature="plain", window=(T // 4, 0)),
    C(1, T * 85 // 128, T * 85 // 128, H, D, True, feature="plain"),
    C(1, T, T, H, D, False, feature="plain"),
    C(1, T, T, H, D, False, feature="plain", documents=1),  # segment ids, one segment
    C(1, T, T, H, D, False, feature="plain", documents=8),
    C(1, T * 13 // 32, T * 13 // 32, H, D, False, feature="plain"),
]
rows = os.environ.get("PROBE_ROWS")
if rows:
    configs = [configs[int(i)] for i in rows.split(",")]
modes = tuple(os.environ.get("PROBE_MODES", "fwd,bwd").split(","))
results = bench_attention(configs, ["jax_tk"], modes, check=False, log=None)
for r in results:
    c = r.config
    print(f"{r.mode} causal={c.causal} T={c.q_len} window={c.window} docs={c.documents}: "
          f"{r.time_ms:.3f} ms {getattr(r, 'tflops', float('nan')):.1f} TF/s {r.status}")
