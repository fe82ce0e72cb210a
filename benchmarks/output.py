"""What a benchmark writes: the environment it ran in, CSV files, text tables and PNG plots.

Every CSV row carries the environment (date, GPU, platform, jax/jaxlib/jax_tk versions, git commit,
timer, the installed peers' versions), the configuration's columns and the measurement (``harness.csv_fields``). CSV files are
written row by row as the run goes, so a cut-off run still leaves its numbers; ``read_csv`` reads
them back into Results (the ``report`` subcommand merges several).
"""
from __future__ import annotations

import csv
import datetime
import importlib.metadata
import importlib.util
import math
import os
import platform
import subprocess
from typing import Callable, Sequence

import jax

from benchmarks import peers
from benchmarks.harness import ENV_FIELDS, MAX_REL_ERR, Result, csv_fields


# ----------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------


def git_commit(path: str | None = None) -> str:
    """``git describe --always --dirty`` of the repository holding the imported jax_tk (``path``: of
    that folder); else the environment variable JAX_TK_COMMIT (for copies of the tree without .git,
    such as a build installed into a folder of its own); else "unknown"."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"],
                             cwd=path or _jax_tk_folder(), capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("JAX_TK_COMMIT") or "unknown"


def _jax_tk_folder() -> str:
    """The folder holding the jax_tk package that is timed (the source tree, or an install)."""
    spec = importlib.util.find_spec("jax_tk")
    if spec is None or not spec.origin:
        return os.getcwd()
    return os.path.dirname(os.path.dirname(os.path.abspath(spec.origin)))


def _distribution_version(*names: str) -> str | None:
    """The version of the first of these installed distributions (pip names), or None."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def environment(timer: str = "wall") -> dict:
    import jaxlib

    try:
        import jax_tk

        tk_version = jax_tk.__version__
        kernels = jax_tk.has_cuda_kernels()
    except Exception:  # noqa: BLE001 - a broken install still gets its numbers labelled
        tk_version, kernels = "unknown", False
    dev = jax.devices()[0]
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": getattr(dev, "device_kind", str(dev)),
        "platform": dev.platform,
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", "unknown"),
        "jax_tk": tk_version,
        "jax_tk_kernels": kernels,
        "commit": git_commit(),
        "timer": timer,
        "peers": peers.versions() or "none",
        "python": platform.python_version(),
        "devices": len(jax.devices()),
    }
    if dev.platform == "gpu":
        # The versions of the NVIDIA wheels that jax[cuda12]/jax[cuda13] installs (informative only;
        # a system-wide CUDA has no such record).
        cudnn = _distribution_version("nvidia-cudnn-cu13", "nvidia-cudnn-cu12", "nvidia-cudnn")
        runtime = _distribution_version("nvidia-cuda-runtime", "nvidia-cuda-runtime-cu13",
                                        "nvidia-cuda-runtime-cu12")
        if cudnn:
            env["cudnn"] = cudnn
        if runtime:
            env["cuda_runtime"] = runtime
    return env


def env_header(env: dict) -> str:
    keys = ("date", "gpu", "platform", "jax", "jaxlib", "cudnn", "cuda_runtime", "jax_tk",
            "jax_tk_kernels", "commit", "timer", "peers", "python")
    return "  ".join(f"{k}={env[k]}" for k in keys if k in env)


# ----------------------------------------------------------------------------------------------
# CSV
# ----------------------------------------------------------------------------------------------


class CsvWriter:
    """Writes rows as they come, so a cut-off run still leaves its numbers. ``fields``: the columns
    (``harness.csv_fields(ConfigType)``)."""

    def __init__(self, path: str, env: dict, fields: Sequence[str]):
        self.path, self.env = path, env
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._f = open(path, "w", newline="")
        self._w = csv.DictWriter(self._f, fieldnames=list(fields))
        self._w.writeheader()
        self._f.flush()

    def write(self, r: Result):
        self._w.writerow(r.row(self.env))
        self._f.flush()

    def close(self):
        self._f.close()


def write_csv(results: Sequence[Result], path: str, env: dict, fields: Sequence[str] | None = None) -> None:
    """Writes Results (of one op) to a CSV; the columns follow the first result's configuration."""
    if fields is None:
        if not results:
            raise ValueError("write_csv: no results and no fields")
        fields = csv_fields(type(results[0].config))
    w = CsvWriter(path, env, fields)
    try:
        for r in results:
            w.write(r)
    finally:
        w.close()


def csv_header(path: str) -> list[str]:
    with open(path, newline="") as f:
        return next(csv.reader(f), [])


def read_csv(paths: Sequence[str], config_from_row: Callable[[dict], object]) -> tuple[list[Result], dict]:
    """Reads CSVs written by ``CsvWriter`` back into Results (configurations through
    ``config_from_row``), and the environment fields they carry (different values across files are
    joined with ' / ')."""
    results, envs = [], []

    def num(row, key, cast=float):
        v = row.get(key, "")
        return cast(v) if v not in ("", None) else (math.nan if cast is float else 0)

    for path in paths:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                results.append(Result(
                    config_from_row(row), row["provider"], row["mode"], row["status"],
                    time_ms=num(row, "time_ms"), min_ms=num(row, "min_ms"), max_ms=num(row, "max_ms"),
                    reps=num(row, "reps", int), calls_per_sample=num(row, "calls_per_sample", int),
                    copies=num(row, "copies", int), host_frac=num(row, "host_frac"),
                    rel_err=num(row, "rel_err"), note=row.get("note", ""), vs_plain=num(row, "vs_plain")))
                envs.append(row)
    env = {k: " / ".join(dict.fromkeys(str(e.get(k, "")) for e in envs)) for k in ENV_FIELDS}
    return results, env


# ----------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------


def format_grid(title: str, columns: Sequence[tuple], configs: Sequence, providers: Sequence[str],
                mode: str, by_key: dict, cell: Callable[[Result], str], cell_head: str,
                cell_width: int, extra: tuple | None = None) -> list[str]:
    """One table: a title line, a header, a rule, and one row per configuration.

    ``columns``: (header, width, fn(cfg, mode)) describing the configuration; then one cell per
    provider, ``cell(result)`` (``-`` where there is no result, the status where it is not ok),
    headed ``provider + cell_head``; then optionally ``extra`` = (header, width, fn(cfg, mode)).
    """
    head = " ".join(f"{h:>{w}}" for h, w, _ in columns) + " |"
    for p in providers:
        head += f" {p + cell_head:>{cell_width}} |"
    if extra:
        head += f" {extra[0]:>{extra[1]}}"
    lines = [title, head, "-" * len(head)]
    for cfg in configs:
        row = " ".join(f"{str(fn(cfg, mode)):>{w}}" for _, w, fn in columns) + " |"
        for p in providers:
            r = by_key.get((cfg, p, mode))
            text = "-" if r is None else (cell(r) if r.status == "ok" else r.status)
            row += f" {text:>{cell_width}} |"
        if extra:
            row += f" {extra[2](cfg, mode):>{extra[1]}}"
        lines.append(row)
    lines.append("")
    return lines


def format_problems(results: Sequence[Result]) -> list[str]:
    """The results that were not timed (grouped by provider, status and reason) and the timed ones
    whose correctness check failed (status "wrong": above the tolerance, or NaN)."""
    lines = []
    failures: dict[tuple, list] = {}
    for r in results:
        if r.status not in ("ok", "wrong"):
            failures.setdefault((r.provider, r.status, r.note), []).append(r)
    if failures:
        lines.append("Not timed (provider, modes, status: reason; first configuration):")
        for (provider, status, note), rs in failures.items():
            ms = ",".join(dict.fromkeys(r.mode for r in rs))
            lines.append(f"  {provider} {ms} {status} x{len(rs)}: {note}; e.g. {rs[0].config.label()}")
    bad = [r for r in results if r.status == "wrong"]
    if bad:
        lines.append(f"Wrong results, not reported as timings: correctness check above {MAX_REL_ERR:g}, or the "
                     "op's own tolerance (FP8 GEMMs), relative error vs float32 on a slice:")
        for r in bad:
            lines.append(f"  {r.provider} {r.mode} {r.config.label()}: {r.rel_err:.2e}")
    return lines


# ----------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def suptitle(op: str, env: dict) -> str:
    return (f"{op}, {env.get('gpu')}, jax {env.get('jax')}, commit {env.get('commit')}, "
            f"{env.get('date')}, timer={env.get('timer')}")


def save_figure(plt, fig, path: str, title: str, fontsize: int = 10) -> None:
    fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_plots(paths: list[str]) -> None:
    for path in paths:
        print(f"PNG: {path}")
    if not paths:
        print("PNG: skipped (matplotlib is not installed, or nothing to plot)")
