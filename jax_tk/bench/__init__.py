"""Benchmarks: jax_tk against its peers, in one process, with one timer.

    python -m jax_tk.bench attention [--quick] [--features] [--providers jax_tk,cudnn,fa3,...] ...
    python -m jax_tk.bench decode [--quick] [--full] [--batch 8,64 --cache 8k ...]
    python -m jax_tk.bench report a.csv b.csv [--png merged.png]    # merge earlier runs, no GPU
    python -m jax_tk.bench attention --help

The package is one harness shared by every op and one set of modules per op:

- ``timers``: WallTimer (default) and CuptiTimer, the one measurement method for every provider;
- ``harness``: Provider, Result, the run over configurations x providers x modes (fwd, bwd alone,
  fwd_bwd), Skip/Unavailable for providers that do not apply or are not installed;
- ``output``: environment and git commit, CSV writer/reader, table and plot helpers;
- ``cli``: the subcommand registry, shared options, ``report``, ``main``;
- ``attention`` (+ ``attention_configs``, ``attention_providers``, ``attention_report``): the
  attention sweep and feature rows, FLOP counting, the providers jax_tk, jax_tk_auto, cudnn,
  cudnn_packed, fa3 (FlashAttention-3, ``pip install flash-attn3-jax``), xla, pallas, pallas_triton;
- ``ragged_dot`` and ``matmul`` (+ ``_gemm``, what they share): the grouped GEMM against
  ``jax.lax.ragged_dot`` and a dense GEMM of the same FLOPs, and the dense GEMM against XLA's dot;
- ``decode`` (+ ``decode_providers``): decode attention over a KV cache (contiguous and paged), in TB/s of
  cache read beside a read-bandwidth ceiling measured in the same run; providers jax_tk, cudnn, fa3
  (``flash_mha_with_kvcache``, the fastest of num_splits 1/4/16), xla.

A new op adds ``jax_tk/bench/<op>.py`` (configurations with ``flops``/``label``/``CSV_FIELDS``/
``csv_row``/``from_row``, a ``harness.OpBench``, a ``cli.Command`` passed to ``cli.register``); the
command line finds it by itself.
"""
from jax_tk.bench.attention import COMMAND as _ATTENTION, bench_attention, reference
from jax_tk.bench.attention_configs import (
    DEFAULT_HEAD_DIMS, DEFAULT_HIDDEN, DEFAULT_SEQ_LENS, DEFAULT_TOKENS, DTYPES, FEATURE_SIZES, FEATURES,
    MODE_FLOP_FACTOR, QUICK_FEATURE_SIZES, AttentionConfig, FeatureSizes, attention_flops,
    document_lengths, feature_configs, plain_baseline, segment_ids_from_lengths, sweep_configs,
    visible_pairs)
from jax_tk.bench.attention_providers import (
    DEFAULT_PROVIDERS, FEATURE_PROVIDERS, PROVIDERS, default_providers, fa3_installed, make_provider)
from jax_tk.bench.attention_report import (
    BASELINE_PROVIDER, features_png_path, format_table, plot, read_csv, set_vs_plain)
from jax_tk.bench.cli import COMMANDS, Command, build_parser, main, register, run_report
from jax_tk.bench.harness import (
    DEFAULT_MODES, ENV_FIELDS, MODES, RESULT_FIELDS, OpBench, Provider, Result, Skip, Unavailable, has_gpu, run)
from jax_tk.bench.output import CsvWriter, env_header, environment, git_commit, write_csv
from jax_tk.bench.timers import MIN_REPS, CuptiTimer, Timing, WallTimer, make_timer

CSV_FIELDS = ENV_FIELDS + AttentionConfig.CSV_FIELDS + RESULT_FIELDS  # the attention CSV's columns
# The names of bench.py before the split (scripts and tests use them).
_parser = build_parser
_Skip = Skip
