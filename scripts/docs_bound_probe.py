"""How much of the packed-documents gap is packing, and how much is short attention?

Times, with the benchmark's timer, useful TFLOP/s (only visible pairs count):
  - the benchmark's documents row (8 random lengths packed in one row of T);
  - 8 equal documents packed in one row of T;
  - the same 8 equal documents as a batch of 8 plain rows of T / 8 (what packing could at best reach);
  - a batch of 8 plain rows with as many visible pairs as the random documents (plain_baseline with
    batch = 8: the plain attention a user would run instead of packing, at the same useful FLOPs);
  - the benchmark's plain baseline for the documents row (one row with as many visible pairs).
Packed equal documents against the batch is the cost of packing (segment masks, block lists); the
batch against the baseline is the cost of short attention, which every implementation pays.
PROBE_SET=steps (jax_tk only) splits the packing cost between the batch of 8 plain rows and the packed
equal documents: the same batch through the masked kernel (a window as wide as the rows: no mask, but
FULL = true), then with one segment per row (segment ids: block lists, block order), then packed.
Usage: [PROBE_MODES=fwd,bwd] [PROBE_PROVIDERS=jax_tk,cudnn,cudnn_packed] [PROBE_SET=steps]
       python scripts/docs_bound_probe.py [T H D]"""
import dataclasses
import os
import sys

import numpy as np

from jax_tk.bench import AttentionConfig, bench_attention, plain_baseline

T, H, D = (int(x) for x in sys.argv[1:4]) if len(sys.argv) > 3 else (16384, 16, 128)
DOCS = 8


@dataclasses.dataclass(frozen=True)
class EqualDocuments(AttentionConfig):
    """Packed documents of equal lengths (T / documents each) instead of random ones."""

    def document_lengths(self):
        return np.full((self.batch, self.documents), self.q_len // self.documents, np.int64)

    def mask_label(self):
        return super().mask_label().split(" (seed")[0].replace(" docs", " equal docs")


configs = []
steps = os.environ.get("PROBE_SET") == "steps"
for causal in (False, True):
    if steps:
        n = T // DOCS
        configs += [
            AttentionConfig(DOCS, n, n, H, D, causal, feature="plain"),
            AttentionConfig(DOCS, n, n, H, D, causal, feature="window", window=(n - 1, n - 1)),
            AttentionConfig(DOCS, n, n, H, D, causal, feature="documents", documents=1),
            EqualDocuments(1, T, T, H, D, causal, feature="documents", documents=DOCS),
        ]
        continue
    packed = AttentionConfig(1, T, T, H, D, causal, feature="documents", documents=DOCS)
    configs += [
        packed,
        EqualDocuments(1, T, T, H, D, causal, feature="documents", documents=DOCS),
        AttentionConfig(DOCS, T // DOCS, T // DOCS, H, D, causal, feature="plain"),
        plain_baseline(packed, batch=DOCS),
        plain_baseline(packed),
    ]
modes = tuple(os.environ.get("PROBE_MODES", "fwd,bwd").split(","))
providers = os.environ.get("PROBE_PROVIDERS", "jax_tk" if steps else "jax_tk,cudnn,cudnn_packed").split(",")
results = bench_attention(configs, providers, modes, check=False, log=None)
for r in results:
    if r.status == "ok":
        print(f"{r.mode} {r.provider:>13} {r.config.label():70s} {r.time_ms:8.3f} ms {r.tflops:6.1f} TF/s")
