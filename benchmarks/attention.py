"""Attention benchmark: jax_tk against cuDNN, FlashAttention-3, tokamax, jax-linear-attention, XLA and
Pallas, in one process, with one timer.

Command line::

    python -m benchmarks attention                      # the default sweep
    python -m benchmarks attention --quick              # a tiny sweep (seconds, CPU too)
    python -m benchmarks attention --d 128 --seq 4096,8192 --causal true --providers jax_tk,cudnn,fa3
    python -m benchmarks attention --features             # only the feature rows (see below)
    python -m benchmarks attention --features window --quick
    python -m benchmarks attention --features mla          # MLA's head dims 192/128 (fwd, fwd_bwd)
    python -m benchmarks report out/bench/attention.csv other.csv --png merged.png

The sweep: head_dim in (64, 128), T = S in 512..16k, causal and not, B*T = 16k tokens, H*D = 2048,
bf16. Default providers ``jax_tk,cudnn,xla,pallas``, and each peer that is installed: ``fa3``
(``pip install flash-attn3-jax``; Hopper, head_dim 128), ``tokamax`` and ``jla`` (``pip install
tokamax jax-linear-attention``). Every provider is described in ``attention_providers``; one that
fails for a configuration gets its error recorded and the sweep goes on; one that does not apply to
it (``cudnn_packed`` without documents, Pallas with a window, FA3 at head_dim 64, jla without the
causal mask) is recorded as skipped, and one whose package is missing as skipped, "unavailable".

Feature rows (``--features [gqa,window,documents,mask,bias,sinks,mla]``). They replace the sweep in
that run; they are not part of the default run (tens of configurations x 5 providers at 16k tokens:
compiling and autotuning alone take minutes). bf16, D = 128 (MLA: 192/128), B*T = 16k tokens:

- ``gqa``: 32 query heads, 8 key/value heads, T = S in 4k (B = 4) and 16k (B = 1), causal and not;
  key/value are passed with 8 heads to every provider.
- ``window``: causal with ``local_window_size=(4096, 0)``, T = 16k, B = 1, H = 16 (cuDNN:
  ``jax.nn.dot_product_attention`` maps it to its sliding window of 4097 keys).
- ``documents``: 8 documents of random lengths (numpy, seed 0) packed in one row of 16k,
  ``q_segment_ids = kv_segment_ids``, B = 1, H = 16, causal and not. jax_tk takes the segment ids;
  ``cudnn``, ``tokamax`` and ``xla`` get the equivalent dense ``mask``; ``cudnn_packed`` the documents
  as a padded batch with sequence lengths, ``fa3`` (with ``--providers``) ``cu_seqlens``, ``jla`` the
  segment ids.
- ``mask``: the same documents, and (causal only) the causal mask alone, given to every provider as
  one dense boolean ``mask`` ``[B, 1, T, S]`` made inside the timed call (jax_tk too).
- ``bias``: a random bf16 bias ``[1, H, T, S]`` (an input of the timed call; the backward returns its
  gradient), T = S = 4k, B = 4, H = 16, causal and not: jax_tk, cuDNN and XLA.
- ``sinks``: attention sinks ``[H]`` at the bias rows' shape (jax_tk only; the others skip).
- ``mla``: MLA's training attention (DeepSeek-V2/V3): query/key head dim 192, value head dim 128
  (``key`` ``[B, S, H, 192]``, ``value`` ``[B, S, H, 128]``, output ``[B, T, H, 128]``, scale
  1/sqrt(192)), causal, T = S in 2k, 4k, 8k, 16k, B = 16k // T, H = 16 and 128 with as many key/value
  heads: 8 rows. FLOPs ``2*B*H*(D + Dv)*visible`` (``visible``: the causal pairs), backward 2.5x. No
  plain baseline (an equal-dims problem is another problem): the table gives jax_tk's speed-up over
  the fastest peer instead. A run of MLA rows alone times ``fwd`` and ``fwd_bwd`` unless ``--modes``
  says otherwise, and its default providers are jax_tk, cudnn, xla and the installed peers. How each
  provider takes the unequal head dims (or why it is skipped) is in ``attention_providers``.

FLOPs of these rows count only the visible (query, key) pairs of the mask ("useful FLOPs"): forward
``4*B*H*D*visible`` (``2*B*H*(D + Dv)*visible`` for MLA), backward 2.5x; ``visible`` is counted on the
host in O(T) per document (``visible_pairs``). Each feature row but MLA's follows a ``plain`` row:
plain attention with the same batch, heads, head_dim and causal flag and q_len = kv_len (a multiple of
128) chosen so that its useful FLOPs are closest to the feature row's (within about 2%; for ``gqa`` the
same shape with 32 key/value heads).
The table and the CSV column ``vs_plain`` give each feature row's TFLOP/s as a fraction of the same
provider's on its plain row (``cudnn_packed`` against ``cudnn``'s); jax_tk aims at >= 90%. The
feature PNG shows TFLOP/s bars with the plain rows as black marks.

What is timed (``--modes``; the same harness and method for every provider, see ``harness``):

- ``fwd``: the forward pass, ``out = f(q, k, v)``; FLOPs ``4*B*H*T*S*D`` (``2*B*H*T*S*(D + Dv)`` where
  the value's head dim ``Dv`` differs), halved when causal.
- ``bwd``: the backward pass alone, as FlashAttention's and cuDNN's benchmarks report it: the forward
  runs once, untimed, through ``jax.vjp``; the timed program is the jitted VJP function applied to
  the output cotangent (it reads the saved residuals and writes dq, dk, dv). FLOPs 2.5x forward.
- ``fwd_bwd`` (optional): forward and backward in one jitted program, ``jax.vjp(f, q, k, v)[1](do)``;
  FLOPs 3.5x forward. Its time is close to fwd + bwd; it is a consistency check.

The timer (``--timer wall`` by default, or ``cupti``) is described in ``timers``. Inputs are standard
normal (never zeros) and rotate over copies whose total size exceeds the L2 cache many times. Both
timers report sustained throughput: after the warm-up the GPU runs at the clock its power limit
allows under back-to-back work. On an H200 (2026-11, jax 0.11.2), cuDNN's bf16 forward at T=8k,
D=128 ran 1.59 ms per call at the 1980 MHz boost clock and 1.81 ms once the 690 W power cap had
brought the clock to about 1680 MHz (CUPTI, 60 back-to-back calls); ``wall`` gave 1.82 to 1.87 ms.
Numbers from single isolated calls are therefore 10-15% higher in TFLOP/s than these, for every
provider alike. Each timed result (the output, the gradients, or in ``fwd_bwd`` both) is checked on
batch 0 and key/value head 0 against the float32 reference (``rel_err``; ``--no-check`` to skip).

Results: a table on stdout (time in ms and TFLOP/s per provider, and jax_tk's speed-up over cuDNN),
a CSV (one row per configuration x provider x mode, every row carrying date, GPU, jax/jaxlib versions
and the git commit; feature rows also ``feature``, ``kv_heads``, ``window``, ``documents``,
``doc_seed`` and ``vs_plain``) written as the sweep goes, and a PNG (TFLOP/s against sequence length,
one panel per head_dim x causal x mode; for feature rows, bars per row and provider). A feature run
writes ``attention_features.csv``/``.png`` by default, so it does not overwrite a sweep's files.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from benchmarks import cli, harness, output
from benchmarks.attention_configs import (
    DTYPES, FEATURES, MLA_MODES, QUICK_HEAD_DIMS, QUICK_HIDDEN, QUICK_SEQ_LENS, QUICK_TOKENS, DEFAULT_HEAD_DIMS,
    DEFAULT_HIDDEN, DEFAULT_SEQ_LENS, DEFAULT_TOKENS, FEATURE_SIZES, QUICK_FEATURE_SIZES, AttentionConfig,
    feature_configs, sweep_configs)
from benchmarks.attention_providers import (
    DEFAULT_PROVIDERS, FEATURE_PROVIDERS, PROVIDERS, default_providers, feature_providers, make_provider)
from benchmarks.attention_report import format_table, plot, set_vs_plain
from benchmarks.harness import DEFAULT_MODES, MODES, Provider, Result
from benchmarks.timers import make_timer


def reference():
    """jax_tk's pure-JAX attention reference module."""
    from jax_tk.attention import reference as ref

    return ref


# ----------------------------------------------------------------------------------------------
# Inputs and the correctness check (batch 0, one key/value head, against the float32 reference)
# ----------------------------------------------------------------------------------------------


def _input_shapes(cfg: AttentionConfig) -> list[tuple]:
    """(q, k, v, [bias,] dout); v and dout (the output's cotangent) with the value's head dim."""
    return [cfg.shape_q, cfg.shape_kv, cfg.shape_v] + ([cfg.bias_shape] if cfg.bias else []) + [cfg.shape_out]


def _input_bytes(cfg: AttentionConfig) -> int:
    return sum(math.prod(s) for s in _input_shapes(cfg)) * 2


def _random_inputs(cfg: AttentionConfig, copies: int, seed: int = 0):
    """``copies`` sets of (q, k, v, [bias,] dout), standard normal in the benchmark dtype (never zeros)."""
    return harness.random_normal_sets(_input_shapes(cfg), cfg.jnp_dtype, copies, seed)


def _slice0(x, heads: int = 1):
    return x[0:1, :, 0:heads, :]


def _reference(q, k, v, bias, seg, sinks, scale, causal, window):
    return reference().attention(q, k, v, bias=bias, scale=scale, is_causal=causal, local_window_size=window,
                                 q_segment_ids=seg, kv_segment_ids=seg, sinks=sinks)


@functools.partial(jax.jit, static_argnames=("scale", "causal", "window"))
def _reference_fwd(q, k, v, bias, seg, sinks, *, scale, causal, window):
    return _reference(q, k, v, bias, seg, sinks, scale, causal, window)


@functools.partial(jax.jit, static_argnames=("scale", "causal", "window"))
def _reference_bwd(q, k, v, bias, seg, sinks, dout, *, scale, causal, window):
    f = lambda q, k, v: _reference(q, k, v, bias, seg, sinks, scale, causal, window)
    return jax.vjp(f, q, k, v)[1](dout)


def _check_args(cfg: AttentionConfig, inputs):
    """The check looks at batch 0, key/value head 0 and the query heads that share it (q, k, v, the
    bias and the sinks sliced so; the mask of ``as_mask`` rows is the same causal flag and segment ids)."""
    g = cfg.heads // cfg.kv_heads
    seg = cfg.segment_ids()
    seg = None if seg is None else jnp.asarray(seg[0:1])
    bias = inputs[3][:, 0:g] if cfg.bias else None
    sinks = None if cfg.sink_values() is None else jnp.asarray(cfg.sink_values()[0:g])
    return g, (_slice0(inputs[0], g), _slice0(inputs[1]), _slice0(inputs[2]), bias, seg, sinks), dict(
        causal=cfg.causal, window=cfg.window)


def _restored(provider: Provider, arrays):
    """The provider's arrays in the benchmark's layout (``Provider.restore``)."""
    return list(arrays) if provider.restore is None else [provider.restore(x) for x in arrays]


def _check_fwd(cfg: AttentionConfig, provider: Provider, inputs, out) -> float:
    inputs, (out,) = _restored(provider, inputs[:3]) + list(inputs[3:]), _restored(provider, [out])
    g, args, kw = _check_args(cfg, inputs)
    ref = _reference_fwd(*args, scale=provider.scale, **kw)
    return harness.rel_err([_slice0(out, g)], [ref])


def _check_bwd(cfg: AttentionConfig, provider: Provider, inputs, dout, grads) -> float:
    """dq, dk, dv (on bias rows the bias's gradient, summed over the batch, is not checked here; the
    GPU tests check it)."""
    inputs = _restored(provider, inputs[:3]) + list(inputs[3:])
    (dout,), (dq, dk, dv) = _restored(provider, [dout]), _restored(provider, grads[:3])
    g, args, kw = _check_args(cfg, inputs)
    ref = _reference_bwd(*args, _slice0(dout, g), scale=provider.scale, **kw)
    return harness.rel_err([_slice0(dq, g), _slice0(dk), _slice0(dv)], ref)


OP = harness.OpBench(make_provider=make_provider, make_inputs=_random_inputs, input_bytes=_input_bytes,
                     check_fwd=_check_fwd, check_bwd=_check_bwd, on_result=set_vs_plain)


def bench_attention(configs: Sequence[AttentionConfig], providers: Sequence[str],
                    modes: Sequence[str] = DEFAULT_MODES, *, timer=None, check: bool = True,
                    xla_max_bytes: float = 20e9, on_result: Callable[[Result], None] | None = None,
                    log: Callable[[str], None] | None = print) -> list[Result]:
    """Times every provider on every configuration, one configuration at a time (the providers see
    the same inputs, in the same process, with the same timer). Providers that materialize the
    [B, H, T, S] logits (xla, the reference) are skipped where they exceed ``xla_max_bytes``."""
    return harness.run(OP, configs, providers, modes, timer=timer, check=check,
                       max_scratch_bytes=xla_max_bytes, on_result=on_result, log=log)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def add_arguments(a) -> None:
    a.add_argument("--d", type=cli.int_list, default=None,
                   help=f"head dims, comma-separated (default {','.join(map(str, DEFAULT_HEAD_DIMS))})")
    a.add_argument("--seq", type=cli.int_list, default=None,
                   help="sequence lengths q = kv, comma-separated, 'k' = 1024 "
                        f"(default {','.join(map(str, DEFAULT_SEQ_LENS))})")
    a.add_argument("--causal", type=cli.bool_list, default=None, help="both, true or false (default both)")
    a.add_argument("--tokens", type=int, default=None, help=f"batch * seq (default {DEFAULT_TOKENS})")
    a.add_argument("--hidden", type=int, default=None, help=f"heads * head_dim (default {DEFAULT_HIDDEN})")
    a.add_argument("--xla-max-gb", type=float, default=20.0,
                   help="skip the xla provider where T*S*B*H*4 bytes exceed this (default 20)")
    a.add_argument("--features", nargs="?", const=",".join(FEATURES), default=None,
                   type=cli.str_list(FEATURES), metavar="LIST",
                   help=f"run only the feature rows (from {','.join(FEATURES)}; all when no LIST), each "
                        "with a plain baseline at about the same useful FLOPs (mla: none; its table gives "
                        "jax_tk's speed-up over the fastest peer), instead of the sweep; default providers "
                        f"{','.join(FEATURE_PROVIDERS)} (mla alone: jax_tk,cudnn,xla and the installed peers; "
                        f"modes {','.join(MLA_MODES)}); --seq sets the gqa and mla lengths, --tokens B*T, --d "
                        "the head dim (not mla's: 192/128); not part of the default run")
    cli.add_common_arguments(
        a, op="attention", providers=PROVIDERS, modes=MODES, default_modes=DEFAULT_MODES,
        dtypes=DTYPES, default_providers=f"{','.join(DEFAULT_PROVIDERS)}, and the peers fa3, tokamax, jla "
                                         "where installed",
        quick_help=f"tiny sweep: D={QUICK_HEAD_DIMS}, T={QUICK_SEQ_LENS}, tokens={QUICK_TOKENS}, "
                   f"hidden={QUICK_HIDDEN} (runs on CPU in seconds)",
        stem_help="; OUT/attention_features.* with --features")


def run_attention(args) -> int:
    quick = args.quick
    features = getattr(args, "features", None)
    causals = args.causal or [False, True]
    tokens = args.tokens or (QUICK_TOKENS if quick else DEFAULT_TOKENS)
    hidden = args.hidden or (QUICK_HIDDEN if quick else DEFAULT_HIDDEN)
    providers = args.providers or (feature_providers(features) if features else default_providers())
    mla_only = bool(features) and set(features) == {"mla"}
    modes = args.modes or list(MLA_MODES if mla_only else DEFAULT_MODES)
    dtype = {"bfloat16": "bf16", "float16": "fp16"}.get(args.dtype, args.dtype)
    reps = cli.reps_from(args)
    csv_path, png_path = cli.output_paths(args, "attention_features" if features else "attention")

    if features:
        sizes = QUICK_FEATURE_SIZES if quick else FEATURE_SIZES
        sizes = dataclasses.replace(sizes, tokens=args.tokens or sizes.tokens,
                                    gqa_seq_lens=tuple(args.seq or sizes.gqa_seq_lens),
                                    mla_seq_lens=tuple(args.seq or sizes.mla_seq_lens))
        configs = feature_configs(features, causals, sizes=sizes, head_dims=args.d, dtype=dtype)
        flops_note = ("FLOPs: useful only, fwd 2*B*H*(D+Dv)*(visible query-key pairs) (= 4*B*H*D*visible "
                      "where Dv = D), bwd 2.5x fwd, fwd_bwd 3.5x fwd; % = TFLOP/s relative to the plain row "
                      "of about the same useful FLOPs")
        what = f"features={','.join(features)} tokens={sizes.tokens}"
    else:
        head_dims = args.d or (QUICK_HEAD_DIMS if quick else DEFAULT_HEAD_DIMS)
        seq_lens = args.seq or (QUICK_SEQ_LENS if quick else DEFAULT_SEQ_LENS)
        configs = sweep_configs(head_dims, seq_lens, causals, tokens=tokens, hidden=hidden, dtype=dtype)
        flops_note = "FLOPs: fwd 4*B*H*T*S*D (/2 causal), bwd 2.5x fwd, fwd_bwd 3.5x fwd"
        what = f"tokens={tokens} hidden={hidden}"
    timer = make_timer(args.timer, reps, quick=quick, rounds=args.rounds)
    env = output.environment(timer.name)
    header = [f"# jax_tk attention benchmark: {output.env_header(env)}",
              f"# providers={','.join(providers)} modes={','.join(modes)} dtype={dtype} {what} "
              f"reps={reps}; {flops_note}; bwd = the backward alone (VJP of saved residuals)"]
    bench = functools.partial(bench_attention, configs, providers, modes, timer=timer,
                              check=not args.no_check, xla_max_bytes=args.xla_max_gb * 1e9)
    return cli.run_and_write(COMMAND, env=env, header=header, csv_path=csv_path, png_path=png_path,
                             providers=providers, bench=bench)


COMMAND = cli.register(cli.Command(
    "attention", "attention forward and backward", add_arguments, run_attention,
    config_type=AttentionConfig, format_table=format_table, plot=plot))
