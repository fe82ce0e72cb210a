"""Attention results as text tables and PNG plots, and CSVs read back (the ``report`` subcommand).

Tables: per mode, one row per configuration, ``ms (TFLOP/s)`` per provider and jax_tk's speed-up over
cuDNN; feature rows with the TFLOP/s as a percentage of the same provider's on the plain row of about
the same useful FLOPs (``vs_plain``); MLA's rows (no plain row) in a table of their own with jax_tk's
speed-up over the fastest peer. Plots: TFLOP/s against sequence length, one panel per head_dim x
causal x mode; for feature rows, bars per row and provider with the plain rows as black marks.
"""
from __future__ import annotations

import math
import os
from typing import Sequence

from benchmarks import output
from benchmarks.attention_configs import AttentionConfig, has_baseline, plain_baseline
from benchmarks.harness import Result, fmt_tflops

# The plain baseline of a provider that only runs feature rows (cudnn_packed) is another provider's.
BASELINE_PROVIDER = {"cudnn_packed": "cudnn"}


def set_vs_plain(r: Result, by_key: dict) -> None:
    """Fills ``r.vs_plain`` (TFLOP/s over the plain baseline's, same provider and mode) for a feature
    row whose baseline is in ``by_key`` ({(config, provider, mode): Result}) and ran."""
    c = r.config
    if r.status != "ok" or not has_baseline(c) or not math.isnan(r.vs_plain):
        return
    base = by_key.get((plain_baseline(c), BASELINE_PROVIDER.get(r.provider, r.provider), r.mode))
    if base is not None and base.status == "ok" and base.tflops > 0:
        r.vs_plain = r.tflops / base.tflops


def read_csv(paths: Sequence[str]) -> tuple[list[Result], dict]:
    """Reads attention CSVs back into Results, and the environment fields they carry (different
    values across files are joined with ' / ')."""
    return output.read_csv(paths, AttentionConfig.from_row)


# ----------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------


def format_table(results: Sequence[Result], providers: Sequence[str] | None = None) -> str:
    """Per mode: one row per configuration, ``ms (TFLOP/s)`` per provider, and jax_tk's speed-up over
    cuDNN (cudnn time / jax_tk time, = the ratio of their TFLOP/s; > 1: jax_tk is faster); MLA's rows
    apart, with jax_tk's speed-up over the fastest peer."""
    if not results:
        return "(no results)"
    if providers is None:
        providers = list(dict.fromkeys(r.provider for r in results))
    lines = []
    sweep = [r for r in results if not r.config.feature]
    features = [r for r in results if r.config.feature and r.config.feature != "mla"]
    mla = [r for r in results if r.config.feature == "mla"]
    ran = lambda rs: [p for p in providers if any(r.provider == p for r in rs)]
    if sweep:
        lines.append(_format_sweep(sweep, ran(sweep)))
    if features:
        lines.append(_format_features(features, ran(features)))
    if mla:
        lines.append(_format_mla(mla, ran(mla)))
    lines += output.format_problems(results)
    return "\n".join(lines).rstrip() + "\n"


def _fmt_gflop(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


_FEATURE_COLUMNS = (
    ("feature", 9, lambda c, m: c.feature), ("mask", 28, lambda c, m: c.mask_label()),
    ("T", 6, lambda c, m: c.q_len), ("B", 3, lambda c, m: c.batch), ("H", 3, lambda c, m: c.heads),
    ("Hkv", 3, lambda c, m: c.kv_heads), ("D", 4, lambda c, m: c.d_label),
    ("GFLOP", 7, lambda c, m: _fmt_gflop(c.flops(m) / 1e9)),
)
_SWEEP_COLUMNS = (
    ("D", 4, lambda c, m: c.d_label), ("causal", 6, lambda c, m: c.causal), ("T", 6, lambda c, m: c.q_len),
    ("S", 6, lambda c, m: c.kv_len), ("B", 4, lambda c, m: c.batch), ("H", 4, lambda c, m: c.heads),
)
_MLA_COLUMNS = (
    ("D", 7, lambda c, m: c.d_label), ("mask", 6, lambda c, m: c.mask_label()), ("T", 6, lambda c, m: c.q_len),
    ("B", 3, lambda c, m: c.batch), ("H", 4, lambda c, m: c.heads), ("Hkv", 4, lambda c, m: c.kv_heads),
    ("GFLOP", 7, lambda c, m: _fmt_gflop(c.flops(m) / 1e9)),
)


def best_peer(by_key: dict, cfg, mode: str) -> Result | None:
    """The fastest timed result of a provider other than jax_tk's (``jax_tk``, ``jax_tk_auto``) on
    ``cfg`` in ``mode`` (``by_key``: {(config, provider, mode): Result}), or None."""
    ok = [r for (c, p, m), r in by_key.items()
          if c == cfg and m == mode and not p.startswith("jax_tk") and r.status == "ok"]
    return min(ok, key=lambda r: r.time_ms, default=None)


def vs_best_peer(by_key: dict, cfg, mode: str) -> str:
    """``1.23x cudnn``: the fastest peer's time over jax_tk's (> 1: jax_tk is faster), "-" where either
    did not run."""
    tk, peer = by_key.get((cfg, "jax_tk", mode)), best_peer(by_key, cfg, mode)
    if tk is None or tk.status != "ok" or peer is None:
        return "-"
    return f"{peer.time_ms / tk.time_ms:.2f}x {peer.provider}"


def best_peer_grids(results: Sequence[Result], providers: Sequence[str], name: str, flops: str, columns,
                    tk_width: int = 16) -> list[str]:
    """Per mode: a grid titled ``== NAME, MODE: ... (TFLOP/s of FLOPS) ...`` with one row per
    configuration (``columns``), ``ms (TFLOP/s)`` per provider, and jax_tk's speed-up over the fastest
    peer (``vs_best_peer``, the ``tk/best`` column)."""
    by_key = {(r.config, r.provider, r.mode): r for r in results}
    configs = list(dict.fromkeys(r.config for r in results))
    lines = []
    for mode in dict.fromkeys(r.mode for r in results):
        title = (f"== {name}, {mode}: time per call in ms (TFLOP/s of {flops}); tk/best = the fastest peer's "
                 "time / jax_tk's (> 1: jax_tk is faster) ==")
        lines += output.format_grid(title, columns, configs, providers, mode, by_key,
                                    lambda r: f"{r.time_ms:.3f} ({fmt_tflops(r.tflops)})", " ms (TF/s)", 22,
                                    extra=("tk/best", tk_width, lambda c, m: vs_best_peer(by_key, c, m)))
    return lines


def _format_mla(results: Sequence[Result], providers: Sequence[str]) -> str:
    """Per mode: one row per MLA configuration, ``ms (TFLOP/s)`` per provider, and jax_tk's speed-up
    over the fastest peer (``vs_best_peer``)."""
    return "\n".join(best_peer_grids(results, providers, "mla",
                                     "useful FLOPs, 2*B*H*(D+Dv)*visible pairs per forward", _MLA_COLUMNS))


def _format_features(results: Sequence[Result], providers: Sequence[str]) -> str:
    """Per mode: one row per feature configuration (its plain baseline first), ``ms (TFLOP/s)`` per
    provider and, on feature rows, the TFLOP/s as a percentage of the same provider's on the plain
    baseline (jax_tk aims at >= 90%)."""
    by_key = {(r.config, r.provider, r.mode): r for r in results}
    for r in results:
        set_vs_plain(r, by_key)
    configs = list(dict.fromkeys(r.config for r in results))

    def cell(r):
        text = f"{r.time_ms:.3f} ({fmt_tflops(r.tflops)}"
        return text + (f", {r.vs_plain:.0%})" if not math.isnan(r.vs_plain) else ")")

    lines = []
    for mode in dict.fromkeys(r.mode for r in results):
        title = (f"== features, {mode}: time per call in ms (TFLOP/s of useful FLOPs, % of the same "
                 "provider's TFLOP/s on the plain row of about the same useful FLOPs) ==")
        lines += output.format_grid(title, _FEATURE_COLUMNS, configs, providers, mode, by_key, cell,
                                    " ms (TF/s, %)", 26)
    return "\n".join(lines)


def _format_sweep(results: Sequence[Result], providers: Sequence[str]) -> str:
    by_key = {(r.config, r.provider, r.mode): r for r in results}
    configs = sorted(dict.fromkeys(r.config for r in results),
                     key=lambda c: (c.dtype, c.head_dim, c.causal, c.q_len, c.kv_len, c.batch, c.heads))
    show_ratio = "jax_tk" in providers and "cudnn" in providers

    def ratio(cfg, mode):
        tk, cu = by_key.get((cfg, "jax_tk", mode)), by_key.get((cfg, "cudnn", mode))
        return f"{cu.time_ms / tk.time_ms:.2f}x" if tk and cu and tk.status == cu.status == "ok" else "-"

    lines = []
    for mode in dict.fromkeys(r.mode for r in results):
        title = f"== {mode}: time per call in ms (TFLOP/s)"
        if show_ratio:
            title += "; tk/cudnn = cudnn time / jax_tk time (> 1: jax_tk is faster)"
        lines += output.format_grid(title + " ==", _SWEEP_COLUMNS, configs, providers, mode, by_key,
                                    lambda r: f"{r.time_ms:.3f} ({fmt_tflops(r.tflops)})", " ms (TF/s)",
                                    22, extra=("tk/cudnn", 8, ratio) if show_ratio else None)
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------


def features_png_path(path: str) -> str:
    root, ext = os.path.splitext(path)
    return f"{root}_features{ext or '.png'}"


def plot(results: Sequence[Result], path: str, env: dict) -> list[str]:
    """Writes the plots; returns the paths written (empty when matplotlib is missing or there is
    nothing to plot). Sweep rows: TFLOP/s against sequence length at ``path``. Feature rows: bars of
    TFLOP/s per feature row and provider, the plain baseline marked on each bar, at ``path`` when
    there are no sweep rows, else at ``<path stem>_features.png``."""
    plt = output.pyplot()
    if plt is None:
        return []
    sweep = [r for r in results if not r.config.feature]
    features = [r for r in results if r.config.feature]
    written = []
    if sweep and _plot_sweep(plt, sweep, path, env):
        written.append(path)
    if features:
        fpath = features_png_path(path) if sweep else path
        if _plot_features(plt, features, fpath, env):
            written.append(fpath)
    return written


def _plot_features(plt, results: Sequence[Result], path: str, env: dict) -> bool:
    by_key = {(r.config, r.provider, r.mode): r for r in results}
    configs = [c for c in dict.fromkeys(r.config for r in results) if c.feature != "plain"]
    modes = list(dict.fromkeys(r.mode for r in results))
    providers = [p for p in dict.fromkeys(r.provider for r in results)
                 if any(r.provider == p and r.status == "ok" and r.config.feature != "plain"
                        for r in results)]
    if not configs or not modes or not providers:
        return False
    fig, axes = plt.subplots(len(modes), 1, figsize=(max(6.0, 1.3 * len(configs) * len(providers) / 2 + 2),
                                                      3.8 * len(modes)), squeeze=False)
    width = 0.8 / len(providers)
    for j, mode in enumerate(modes):
        ax = axes[j][0]
        for k, p in enumerate(providers):
            for i, cfg in enumerate(configs):
                r = by_key.get((cfg, p, mode))
                if r is None or r.status != "ok":
                    continue
                x = i - 0.4 + (k + 0.5) * width
                ax.bar(x, r.tflops, width, color=f"C{k % 10}", label=p)
                base = (by_key.get((plain_baseline(cfg), BASELINE_PROVIDER.get(p, p), mode))
                        if has_baseline(cfg) else None)
                if base is not None and base.status == "ok":
                    ax.hlines(base.tflops, x - width / 2, x + width / 2, colors="k", linewidth=1.5)
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels([f"{c.feature}\n{c.mask_label().replace(' (seed', chr(10) + '(seed')}\n"
                            f"T={c.q_len} H={c.heads}/{c.kv_heads}" + (f"\nD={c.d_label}" if c.mla else "")
                            for c in configs], fontsize=7)
        ax.set_ylabel("TFLOP/s (useful FLOPs)")
        ax.set_title(f"{mode}: bars = feature rows, black lines = plain attention at about the same "
                     "useful FLOPs" + (" (mla: none)" if any(c.feature == "mla" for c in configs) else ""),
                     fontsize=9)
        ax.set_ylim(bottom=0)
        ax.grid(True, axis="y", alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            uniq = dict(zip(labels, handles))
            ax.legend(uniq.values(), uniq.keys(), fontsize=8)
    output.save_figure(plt, fig, path, output.suptitle("attention", env), fontsize=9)
    return True


def _plot_sweep(plt, results: Sequence[Result], path: str, env: dict) -> bool:
    rows = sorted(dict.fromkeys((r.config.head_dim, r.config.causal) for r in results))
    modes = list(dict.fromkeys(r.mode for r in results))
    providers = list(dict.fromkeys(r.provider for r in results))
    if not rows or not modes:
        return False
    fig, axes = plt.subplots(len(rows), len(modes), figsize=(5.5 * len(modes), 3.6 * len(rows)),
                             squeeze=False)
    colors = {p: f"C{i % 10}" for i, p in enumerate(providers)}
    seqs = sorted({r.config.q_len for r in results})
    for i, (d, causal) in enumerate(rows):
        for j, mode in enumerate(modes):
            ax = axes[i][j]
            for p in providers:
                sel = [r for r in results if r.provider == p and r.mode == mode
                       and r.config.head_dim == d and r.config.causal == causal and r.status == "ok"]
                if not sel:
                    continue
                pts = sorted((r.config.q_len, r.tflops) for r in sel)
                label = p + (" (float16)" if all("ran in float16" in r.note for r in sel) else "")
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label,
                        color=colors[p])
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqs)
            ax.set_xticklabels([f"{t // 1024}k" if t >= 1024 and t % 1024 == 0 else str(t)
                                for t in seqs])
            ax.minorticks_off()
            ax.set_title(f"{mode}, head_dim={d}, {'causal' if causal else 'non-causal'}",
                         fontsize=10)
            ax.set_xlabel("sequence length (q = kv)")
            ax.set_ylabel("TFLOP/s")
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            if ax.has_data():
                ax.legend(fontsize=8)
    output.save_figure(plt, fig, path, output.suptitle("attention", env), fontsize=10)
    return True


