"""The tables and plots of the decode-style ops (``decode``, ``mla_decode``): time and TB/s per provider,
jax_tk's speed-up over its peers and its share of the read ceiling measured in the same run
(``ceiling_tbs`` of every configuration), TB/s against cache length.

A configuration here has ``bytes()`` (what one call must read and write), ``cache_len``, ``steps`` (1,
or N decode steps inside one ``lax.scan``, the time per step) and ``ceiling_tbs``.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

from benchmarks import output
from benchmarks.harness import Result

STEPS_COLUMN = ("steps", 5, lambda c, m: c.steps)


def tbs(r: Result) -> float:
    """TB/s of a timed result: the configuration's bytes over its median time."""
    if r.status != "ok" or not r.time_ms > 0:
        return math.nan
    return r.config.bytes() / (r.time_ms * 1e-3) / 1e12


def _speedup(by_key, cfg, peers) -> str:
    tk = by_key.get((cfg, "jax_tk", "fwd"))
    peers = [by_key.get((cfg, p, "fwd")) for p in peers]
    peers = [r.time_ms for r in peers if r is not None and r.status == "ok"]
    if tk is None or tk.status != "ok" or not peers:
        return "-"
    return f"{min(peers) / tk.time_ms:.2f}x"


def _of_ceiling(by_key, cfg) -> str:
    tk = by_key.get((cfg, "jax_tk", "fwd"))
    if tk is None or tk.status != "ok" or not cfg.ceiling_tbs > 0:
        return "-"
    return f"{tbs(tk) / cfg.ceiling_tbs:.0%}"


def ratio_table(results, providers, name: str, what: str, columns, cell, cell_head: str, width: int,
                peers: Sequence[str], extra=()) -> str:
    """The decode-style table (also ``mla_decode``'s): a title naming the time per call or per scanned
    step and the read ceilings, one row per configuration (``columns``, then ``cell(result)`` per
    provider), then jax_tk's speed-up over the fastest of ``peers``, jax_tk's TB/s as a share of the
    ceiling, and the ``extra`` columns ``(header, width, fn(by_key, cfg))``; the problems below."""
    providers = providers or list(dict.fromkeys(r.provider for r in results))
    by_key = {(r.config, r.provider, r.mode): r for r in results}
    configs = list(dict.fromkeys(r.config for r in results))
    ceilings = sorted({c.ceiling_tbs for c in configs if c.ceiling_tbs == c.ceiling_tbs})
    steps = sorted({c.steps for c in configs})
    per = ("" if steps == [1] else " per step inside a lax.scan of "
           + ", ".join("1 (one call a step)" if n == 1 else str(n) for n in steps))
    title = (f"{name}, µs{per} ({what}); read ceiling "
             + (", ".join(f"{x:.3g}" for x in ceilings) or "not measured") + " TB/s")
    if len(steps) > 1:  # (a report over CSVs of both modes)
        columns += (STEPS_COLUMN,)
    lines = output.format_grid(title, columns, configs, providers, "fwd", by_key, cell, cell_head, width)
    # the ratio columns after the grid's rows
    lines[1] += " vs peer | of ceil" + "".join(f" | {h:>{w}}" for h, w, _ in extra)
    lines[2] = "-" * len(lines[1])
    for i, cfg in enumerate(configs):
        lines[3 + i] += f" {_speedup(by_key, cfg, peers):>7} | {_of_ceiling(by_key, cfg):>7}"
        lines[3 + i] += "".join(f" | {fn(by_key, cfg):>{w}}" for _, w, fn in extra)
    lines += output.format_problems(results)
    return "\n".join(lines).rstrip() + "\n"


def plot_panels(results: Sequence[Result], path: str, env: dict, name: str, panel: Callable, panel_title: Callable,
                series: Callable) -> list[str]:
    """TB/s against cache length: one panel per ``panel(config)`` key (titled ``panel_title(key)``),
    one line per ``series(result)`` = (label, dashed), the read ceiling as a dashed black line."""
    plt = output.pyplot()
    ok = [r for r in results if r.status == "ok"]
    if plt is None or not ok:
        return []
    panels = sorted({panel(r.config) for r in ok})
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, panels):
        rows = [r for r in ok if panel(r.config) == key]
        for label, dashed in sorted({series(r) for r in rows}):
            pts = sorted((r.config.cache_len, tbs(r)) for r in rows if series(r) == (label, dashed))
            ax.plot(*zip(*pts), "o--" if dashed else "o-", ms=3, label=label)
        ceil = [r.config.ceiling_tbs for r in rows if r.config.ceiling_tbs == r.config.ceiling_tbs]
        if ceil:
            ax.axhline(max(ceil), ls="--", color="k", lw=0.8, label="read ceiling")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cache length")
        ax.set_ylabel("TB/s")
        ax.set_title(panel_title(key), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    output.save_figure(plt, fig, path, output.suptitle(name, env))
    return [path]
