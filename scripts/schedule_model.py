"""How much of the Hopper backward's time goes to the tail of its last wave, by launch order? A
list-scheduling model without a GPU: each thread block (one key block of one key/value head) costs
`overhead` + the number of query blocks it visits, and the blocks go, in launch order, to whichever
of the SMs frees first. Prints each order's time over the perfect-balance bound.

    python scripts/schedule_model.py [--overhead 5] [--sms 132]
    python scripts/schedule_model.py --forward [--overhead 1.5] [--mask-cost 0.3]

With --forward it models the Hopper forward instead: persistent thread blocks taking 128-row query
tiles from a counter, each tile costing `overhead` + its key blocks + `mask-cost` per key block that
needs the elementwise mask. Orders: `index` (fwd_tile's order: a head's query blocks last to first,
then the next head) and `longest-first` (branch fwd-lpt-docs).

Orders: `head-major` (key blocks of one head one after the other: the launch order up to now),
`key-major` (all batch entries and heads of key block 0, then key block 1, ...: measured 40% slower
at T = 2k, the blocks running together then share no queries in L2), `grouped` (key-major within
groups of --group heads, head-major across groups: a wave still shares each head's queries among
about 132 / group blocks), `longest-first` (sorted by cost; needs the costs on the device before
the launch)."""
import argparse
import heapq

import numpy as np

from jax_tk.bench import document_lengths

BK, BQ = 128, 64  # keys per block and query rows per step of the D <= 128 backward


def visits(t: int, causal: bool, window: int | None, docs: int) -> list[int]:
    """Query blocks seen by each key block of one batch row."""
    seg = np.repeat(np.arange(docs), document_lengths(t, docs)[0]) if docs > 1 else np.zeros(t, int)
    out = []
    for j in range(t // BK):
        keys = np.arange(j * BK, (j + 1) * BK)
        n = 0
        for i in range(t // BQ):
            rows = np.arange(i * BQ, (i + 1) * BQ)
            ok = seg[rows][:, None] == seg[keys][None, :]
            if causal:
                ok &= rows[:, None] >= keys[None, :]
            if window is not None:
                ok &= rows[:, None] - keys[None, :] <= window
            n += bool(ok.any())
        out.append(n)
    return out


def forward_tiles(t: int, causal: bool, docs: int, block: int = 128) -> list[tuple[int, int]]:
    """(key blocks visited, of which masked elementwise) for each 128-row query tile of one row."""
    seg = np.repeat(np.arange(docs), document_lengths(t, docs)[0]) if docs > 1 else np.zeros(t, int)
    n = t // block
    qs = [set(seg[i * block:(i + 1) * block]) for i in range(n)]
    out = []
    for i in range(n):
        blocks = masked = 0
        for j in range(i + 1 if causal else n):
            if qs[i] & qs[j]:
                blocks += 1
                masked += len(qs[i] | qs[j]) > 1 or (causal and j == i)
        out.append((blocks, masked))
    return out


def makespan(costs, sms: int) -> float:
    free = [0.0] * sms
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--overhead", type=float, default=None,
                    help="per-block cost in steps (prologue, epilogue); default 5, 1.5 with --forward")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--group", type=int, default=8, help="heads (batch entries x heads) per group of the grouped order")
    ap.add_argument("--forward", action="store_true", help="model the forward's tiles instead")
    ap.add_argument("--mask-cost", type=float, default=0.3, help="--forward: extra cost of a masked key block")
    a = ap.parse_args()
    if a.forward:
        overhead = 1.5 if a.overhead is None else a.overhead
        for docs in (1, 8):
            for causal in (False, True):
                tiles = forward_tiles(16384, causal, docs)
                cost = [overhead + n + a.mask_cost * m for n, m in tiles]
                index = [cost[i] for _ in range(16) for i in reversed(range(len(cost)))]
                bound = sum(index) / a.sms
                row = {"index": makespan(index, a.sms) / bound,
                       "longest-first": makespan(sorted(index, reverse=True), a.sms) / bound}
                label = f"forward T=16384 H=16 causal={causal} docs={docs}"
                print(f"{label:50s} " + "  ".join(f"{k} {x:.3f}" for k, x in row.items()))
        return
    overhead = 5.0 if a.overhead is None else a.overhead
    cases = [(t, 16384 // t, c, None, 1) for t in (2048, 4096, 8192, 16384) for c in (False, True)]
    cases += [(16384, 1, True, 4096, 1), (16384, 1, False, None, 8)]
    heads = 16
    for t, b, causal, window, docs in cases:
        v = visits(t, causal, window, docs)
        head_major = [v[j] + overhead for _ in range(b * heads) for j in range(len(v))]
        key_major = [v[j] + overhead for j in range(len(v)) for _ in range(b * heads)]
        grouped = [v[j] + overhead for g0 in range(0, b * heads, a.group)
                   for j in range(len(v)) for _ in range(min(a.group, b * heads - g0))]
        bound = sum(head_major) / a.sms
        row = {name: makespan(order, a.sms) / bound for name, order in
               (("head-major", head_major), ("key-major", key_major), ("grouped", grouped),
                ("longest-first", sorted(head_major, reverse=True)))}
        label = f"T={t} B={b} causal={causal} window={window} docs={docs}"
        print(f"{label:50s} " + "  ".join(f"{k} {x:.3f}" for k, x in row.items()))


if __name__ == "__main__":
    main()
