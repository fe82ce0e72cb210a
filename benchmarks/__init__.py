"""Benchmarks of jax_tk against its peers, in one process, with one timer.

This package sits beside the library, outside the wheel; run it from the repository root::

    python -m benchmarks attention [--quick] [--features] [--providers jax_tk,cudnn,fa3,...] ...
    python -m benchmarks decode [--quick] [--full] [--batch 8,64 --cache 8k ...]
    python -m benchmarks mla_decode [--quick] [--full] [--heads 16,128 --new 1,2,4 ...]
    python -m benchmarks ragged_dot [--quick] [--shapes mixtral,qwen] [--dist dirichlet]
    python -m benchmarks matmul [--quick] [--shapes cube8k]
    python -m benchmarks linear_attention [--quick] [--ops simple_gla,gated_delta_rule] [--shapes 4x4k]
    python -m benchmarks report a.csv b.csv [--png merged.png]    # merge earlier runs, no GPU
    python -m benchmarks attention --help

One harness, shared by every op:

- ``timers``: WallTimer (default) and CuptiTimer, the one measurement method for every provider;
- ``harness``: Provider, Result, OpBench, the run over configurations x providers x modes (fwd, bwd
  alone, fwd_bwd), Skip/Unavailable for providers that do not apply or are not installed;
- ``peers``: the other libraries timed beside jax_tk (FlashAttention-3, tokamax,
  jax-linear-attention), imported only when asked for;
- ``output``: environment and git commit, CSV writer/reader, table and plot helpers;
- ``cli``: the subcommand registry, shared options, ``report``, ``main``.

Then one module per op, with its providers (and, for attention, its configurations and report) beside
it: ``attention``, ``decode`` (and ``mla_decode``, which runs on its machinery), ``gemm`` (the ``ragged_dot`` and ``matmul`` subcommands), ``linear_attention``. A new op
adds ``benchmarks/<op>.py`` (configurations with ``flops``/``label``/``CSV_FIELDS``/``csv_row``/
``from_row``, a ``harness.OpBench``, a ``cli.Command`` passed to ``cli.register``); the command line
finds it by itself. See README.md beside this file.

Modules import each other in one direction only (timers <- harness <- peers <- output <- cli <- the
op modules); this file imports none of them.
"""
