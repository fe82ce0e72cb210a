"""An estimate of the share of its plain baseline's TFLOP/s that the documents backward row can reach
with the Hopper backward's structure, worked out on the host (no GPU).

The model: the main kernel computes every (key block, query block) pair of BK x BQ that has a visible
pair, at the rate per computed pair of the plain baseline's main kernel; the per-token passes (the
prep kernel and the dq pass, memory-bound: they read and write each token's rows) cost PASS_US per
16k tokens in both rows. What the documents pay beyond that (elementwise masks, block lists, shorter
key ranges per thread block) is left out. It is not a strict bound: the baseline's rate includes its
own launch tail, which the documents' blocks (more of them, longest first) can avoid. The non-causal
baseline's 832 equal blocks make 6.3 waves on 132 SMs, and at `066278e` the non-causal row ran at
2.067 ms against this estimate's 2.090 ms (91% against 90%). The causal baseline's blocks go longest
first, so its tail is short and the causal estimate is the closer one to a bound (84.5%; the row ran
at 81%).

Prints per row (non-causal, causal): computed / useful pairs for the documents with the kernel's fixed
tiles and with tiles that would start at each document (both sides), the same for the baseline, and
the bound as a share of the baseline's useful TFLOP/s.

    python scripts/docs_ceiling.py [BASE_MS BASE_CAUSAL_MS [PASS_US]]

BASE_MS, BASE_CAUSAL_MS: the baseline's backward times (ms) measured in a feature run (default: the H100
run at 066278e, 1.857 and 0.986 ms); PASS_US: the prep and dq passes at 16k tokens (default 160 us:
ncu at B = 8, T = 2k, H = 16, D = 128: prep 91.6 us, dq pass 70 us).
"""
import sys

import numpy as np

from jax_tk.bench import FEATURE_SIZES, feature_configs, plain_baseline

BK, BQ = 128, 64  # keys per thread block and query rows per step of the D = 128 backward


def computed_pairs(lengths, causal: bool, aligned: bool) -> int:
    """Pairs of the (key block, query block) tiles with a visible pair, for documents packed in one
    row: on the row's fixed BK / BQ grid, or (aligned) on grids starting at each document."""
    if aligned:
        return sum(computed_pairs([n], causal, False) for n in lengths)
    total = int(sum(lengths))
    seg = np.repeat(np.arange(len(lengths)), lengths)
    pos = np.arange(total)
    n = 0
    for k0 in range(0, total, BK):
        ks, kp = seg[k0:k0 + BK], pos[k0:k0 + BK]
        for q0 in range(0, total, BQ):
            qs, qp = seg[q0:q0 + BQ], pos[q0:q0 + BQ]
            same = ks[:, None] == qs[None, :]
            if (same & (kp[:, None] <= qp[None, :]) if causal else same).any():
                n += BK * BQ
    return n


def main():
    base_ms = [float(x) for x in sys.argv[1:3]] if len(sys.argv) > 2 else [1.857, 0.986]
    pass_us = float(sys.argv[3]) if len(sys.argv) > 3 else 160.0
    rows = [c for c in feature_configs(["documents"], baselines=False) if c.head_dim == FEATURE_SIZES.head_dim]
    for cfg, ms in zip(sorted(rows, key=lambda c: c.causal), base_ms):
        base = plain_baseline(cfg)
        lengths = [int(n) for n in cfg.document_lengths()[0]]
        passes = lambda c: pass_us * 1e-3 * c.batch * c.q_len / 16384  # ms
        useful, base_useful = cfg.visible(), base.visible()
        base_work = computed_pairs([base.q_len], base.causal, False)
        rate = base_work / (ms - passes(base))  # computed pairs per ms of the baseline's main kernel
        print(f"{cfg.label()} against {base.label()} ({ms} ms, passes {passes(base) * 1e3:.0f} us):")
        for aligned in (False, True):
            work = computed_pairs(lengths, cfg.causal, aligned)
            t = work / rate + passes(cfg)
            print(f"  {'tiles from each document' if aligned else 'fixed tiles (the kernel)':26s} computed / useful "
                  f"{work / useful:.3f} (baseline {base_work / base_useful:.3f}): estimate {t:.3f} ms, "
                  f"{(useful / t) / (base_useful / ms):.1%} of the baseline's TFLOP/s")


if __name__ == "__main__":
    main()
