"""The command line: ``python -m benchmarks <op> [options]`` and ``python -m benchmarks report``.

Each op registers one ``Command`` (its options, how to run it, how to read its CSVs back and print
and plot them). Adding an op: write ``benchmarks/<op>.py`` ending in ``register(Command(...))``;
the modules of this package are found and imported when the command line starts (no list to edit).

Options every op shares (``add_common_arguments``): ``--providers``, ``--modes``, ``--dtype``,
``--timer``, ``--reps``, ``--no-check``, ``--quick``, ``--out``, ``--csv``, ``--png``.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from typing import Callable, Sequence

from benchmarks import output
from benchmarks.timers import MIN_REPS, TIMERS

# The harness's own modules; every other module of the package may register an op's subcommand.
HARNESS_MODULES = ("cli", "harness", "output", "peers", "timers")


@dataclasses.dataclass(frozen=True)
class Command:
    """An op's subcommand. ``add_arguments(parser)`` adds its options; ``run(args) -> exit code``.
    For ``report``: ``config_type`` (``CSV_FIELDS``, ``from_row``) reads its CSVs back,
    ``format_table(results, providers) -> str`` and ``plot(results, path, env) -> [paths]``."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    config_type: type | None = None
    format_table: Callable | None = None
    plot: Callable | None = None


COMMANDS: dict[str, Command] = {}


def register(command: Command) -> Command:
    """Makes ``command`` a subcommand of ``python -m benchmarks`` (replacing one of that name)."""
    if command.name == "report":
        raise ValueError("'report' is the harness's own subcommand")
    COMMANDS[command.name] = command
    return command


def load_ops() -> dict[str, Command]:
    package = os.path.dirname(os.path.abspath(__file__))
    for name in sorted(os.listdir(package)):
        module, ext = os.path.splitext(name)
        if ext == ".py" and not module.startswith("_") and module not in HARNESS_MODULES:
            importlib.import_module(f"{__package__}.{module}")
    return COMMANDS


# ----------------------------------------------------------------------------------------------
# Argument types and the shared options
# ----------------------------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    """'1k,2048 4096' -> [1024, 2048, 4096] ('k' = 1024)."""
    out = []
    for part in text.replace(" ", ",").split(","):
        if not part:
            continue
        part = part.lower()
        mult = 1
        if part.endswith("k"):
            part, mult = part[:-1], 1024
        out.append(int(part) * mult)
    if not out:
        raise argparse.ArgumentTypeError("expected a comma-separated list of integers")
    return out


def str_list(choices):
    def parse(text: str) -> list[str]:
        items = [s for s in text.replace(" ", ",").split(",") if s]
        bad = [s for s in items if s not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {','.join(choices)}; got {text!r}")
        return items
    return parse


def bool_list(text: str) -> list[bool]:
    """both/all -> [False, True]; true/1/yes/causal -> [True]; false/0/no/full -> [False]."""
    t = text.lower()
    if t in ("both", "all"):
        return [False, True]
    if t in ("true", "1", "yes", "causal"):
        return [True]
    if t in ("false", "0", "no", "full"):
        return [False]
    raise argparse.ArgumentTypeError("--causal takes both, true or false")


def add_common_arguments(p: argparse.ArgumentParser, *, op: str, providers: Sequence[str],
                         default_providers: str, modes: Sequence[str], default_modes: Sequence[str],
                         dtypes: Sequence[str], quick_help: str, stem_help: str = "",
                         dtype_help: str = "dtype of the inputs") -> None:
    p.add_argument("--providers", type=str_list(providers), default=None,
                   help=f"from {','.join(providers)} (default {default_providers})")
    p.add_argument("--modes", type=str_list(modes), default=None,
                   help=f"from {','.join(modes)} (default {','.join(default_modes)})")
    p.add_argument("--dtype", choices=sorted(dtypes), default="bf16", help=f"{dtype_help} (default bf16)")
    p.add_argument("--timer", choices=TIMERS, default="wall",
                   help="wall: batches of dispatched calls, including the host's share; cupti: the sum of each "
                        "call's kernels as CUPTI records them; kernels: cupti, and each kernel's share printed "
                        "under its line (default wall)")
    p.add_argument("--reps", type=int, default=MIN_REPS,
                   help=f"samples per measurement (>= {MIN_REPS}; default {MIN_REPS})")
    p.add_argument("--rounds", type=int, default=1,
                   help="time each configuration's providers this many times, taking turns, and report each "
                        "one's median round (default 1)")
    p.add_argument("--no-check", action="store_true",
                   help="skip the correctness check against the float32 reference")
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--out", default=os.path.join("out", "bench"),
                   help=f"directory for the CSV and PNG (default {os.path.join('out', 'bench')})")
    p.add_argument("--csv", default=None, help=f"CSV path (default OUT/{op}.csv{stem_help})")
    p.add_argument("--png", default=None, help=f"PNG path (default OUT/{op}.png{stem_help}); 'none' to skip")


def reps_from(args) -> int:
    if args.reps < MIN_REPS:
        print(f"note: --reps {args.reps} is under {MIN_REPS}; using {MIN_REPS}", file=sys.stderr)
    return max(args.reps, MIN_REPS)


def output_paths(args, stem: str) -> tuple[str, str]:
    return (args.csv or os.path.join(args.out, stem + ".csv"),
            args.png or os.path.join(args.out, stem + ".png"))


def run_and_write(command: Command, *, env: dict, header: Sequence[str], csv_path: str, png_path: str,
                  providers: Sequence[str], bench: Callable) -> int:
    """Prints the header lines, runs ``bench(on_result=..., log=...)`` writing the CSV as results
    come, then prints the table and writes the plot."""
    for line in header:
        print(line)
    sys.stdout.flush()
    writer = output.CsvWriter(csv_path, env, output.csv_fields(command.config_type))
    try:
        results = bench(on_result=writer.write, log=lambda s: print(s, flush=True))
    finally:
        writer.close()
    print()
    print(f"# {output.env_header(env)}")
    print(command.format_table(results, providers))
    print(f"CSV: {csv_path}")
    if png_path.lower() != "none":
        output.print_plots(command.plot(results, png_path, env))
    return 0


# ----------------------------------------------------------------------------------------------
# The parser, report, main
# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    commands = load_ops()
    p = argparse.ArgumentParser(prog="python -m benchmarks",
                                description="Benchmarks of jax_tk against its peers (cuDNN, FlashAttention-3, "
                                            "tokamax, jax-linear-attention, XLA, Pallas), in one process, "
                                            "one timer.")
    sub = p.add_subparsers(dest="op", required=True)
    for c in commands.values():
        c.add_arguments(sub.add_parser(c.name, help=c.help))
    r = sub.add_parser("report", help="table and plot from CSVs of earlier runs (merged; no GPU needed)")
    r.add_argument("csvs", nargs="+", help="CSV files written by an op's subcommand")
    r.add_argument("--op", dest="report_op", choices=list(commands), default=None,
                   help="the op that wrote the CSVs (default: found from their columns)")
    r.add_argument("--csv", default=None, help="also write the merged rows to this CSV")
    r.add_argument("--png", default=None, help="write the plot here")
    return p


def detect_op(path: str) -> Command:
    """The registered op that wrote a CSV: the one with the largest share of its configuration
    columns in the CSV's header (older CSVs may lack columns added since; ``--op`` to choose)."""
    header = set(output.csv_header(path))
    share = {c.name: len(set(c.config_type.CSV_FIELDS) & header) / len(c.config_type.CSV_FIELDS)
             for c in load_ops().values() if c.config_type is not None}
    best = max(share, key=share.get, default=None)
    if best is None or share[best] < 0.5:
        raise SystemExit(f"report: {path}: no registered op has these columns; use --op")
    return COMMANDS[best]


def run_report(args) -> int:
    command = COMMANDS[args.report_op] if args.report_op else detect_op(args.csvs[0])
    results, env = output.read_csv(args.csvs, command.config_type.from_row)
    providers = list(dict.fromkeys(r.provider for r in results))
    print(f"# {output.env_header(env)}")
    print(command.format_table(results, providers))
    if args.csv:
        output.write_csv(results, args.csv, env, output.csv_fields(command.config_type))
        print(f"CSV: {args.csv}")
    if args.png:
        output.print_plots(command.plot(results, args.png, env))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.op == "report":
        return run_report(args)
    return COMMANDS[args.op].run(args)
