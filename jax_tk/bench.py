"""Benchmarks: jax_tk against its peers, in one process, with one timer.

Command line::

    python -m jax_tk.bench attention                      # the default sweep
    python -m jax_tk.bench attention --quick              # a tiny sweep (seconds, CPU too)
    python -m jax_tk.bench attention --d 128 --seq 4096,8192 --causal true --providers jax_tk,cudnn

Providers (``--providers``):

- ``jax_tk``: ``jax_tk.attention(implementation="tk")`` (``implementation=None``, i.e. the pure-JAX
  reference, when no CUDA device is present, so that the benchmark also runs on CPU);
- ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``;
- ``xla``: ``jax.nn.dot_product_attention(implementation="xla")``; skipped where its ``[B, H, T, S]``
  float32 logits (``T*S*B*H*4`` bytes) would exceed ``--xla-max-gb``;
- ``pallas``: the Pallas Mosaic GPU attention (FlashAttention-3 style, Hopper only),
  ``jax.experimental.pallas.ops.gpu.attention_mgpu.attention`` with a ``TuningConfig``. It has no scale
  argument, so ``query`` is multiplied by the scale before timing; where it rejects bfloat16 it runs in
  float16 (noted in the results); its backward has no causal variant (recorded as an error);
- ``pallas_triton``: the Triton-based Pallas attention,
  ``jax.experimental.pallas.ops.gpu.attention.mha``.

A provider that fails for a configuration gets its error recorded and the sweep goes on.

What is timed (``--modes``):

- ``fwd``: the forward pass, ``out = f(q, k, v)``; FLOPs ``4*B*H*T*S*D``, halved when causal.
- ``bwd``: the backward pass alone, as FlashAttention's and cuDNN's benchmarks report it: the forward
  runs once, untimed, through ``jax.vjp``; the timed program is the jitted VJP function applied to
  the output cotangent (it reads the saved residuals and writes dq, dk, dv). FLOPs 2.5x forward.
- ``fwd_bwd`` (optional): forward and backward in one jitted program, ``jax.vjp(f, q, k, v)[1](do)``;
  FLOPs 3.5x forward. Its time is close to fwd + bwd; it is a consistency check.

The timer (``--timer``):

- ``wall`` (default): each measured sample enqueues a batch of calls of the jitted function (JAX
  dispatches asynchronously, so the device queue stays full) and waits for all their results with
  ``jax.block_until_ready``; the sample is the elapsed host time over the number of calls. The batch
  is sized to last >= 20 ms so the one launch latency per sample is negligible. Warm-up (compilation,
  autotuning, and 200 ms of calls) first, then ``--reps`` (>= 20) samples; the median is reported,
  with min and max. Inputs rotate over several copies whose total size exceeds the L2 cache many
  times. The fraction of each sample that the host spent enqueueing is recorded (``host_frac``); near
  1.0 would mean the host, not the device, set the pace (it is flagged).
- ``cupti``: the summed kernel durations that CUPTI records, through
  ``jax.experimental.mosaic.gpu.profiler.measure`` (the tool JAX's own Pallas GPU benchmarks use);
  GPU only, experimental API; it leaves out the gaps between calls and between kernels.

Both report sustained throughput: after the warm-up the GPU runs at the clock its power limit allows
under back-to-back work. On an H200 (2026-11, jax 0.11.2), cuDNN's bf16 forward at T=8k, D=128 ran
1.59 ms per call at the 1980 MHz boost clock and 1.81 ms once the 690 W power cap had brought the
clock to about 1680 MHz (CUPTI, 60 back-to-back calls); ``wall`` gave 1.82 to 1.87 ms. Numbers from
single isolated calls are therefore 10-15% higher in TFLOP/s than these, for every provider alike.

Results: a table on stdout (time in ms and TFLOP/s per provider, and jax_tk's speed-up over cuDNN),
a CSV (one row per configuration x provider x mode, every row carrying date, GPU, jax/jaxlib versions
and the git commit) written as the sweep goes, and a PNG (TFLOP/s against sequence length, one panel
per head_dim x causal x mode).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import functools
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

PROVIDERS = ("jax_tk", "cudnn", "xla", "pallas", "pallas_triton")
DEFAULT_PROVIDERS = ("jax_tk", "cudnn", "xla", "pallas")
MODES = ("fwd", "bwd", "fwd_bwd")
DEFAULT_MODES = ("fwd", "bwd")
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
DTYPES = {"bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16, "fp16": jnp.float16, "float16": jnp.float16}

DEFAULT_HEAD_DIMS = (64, 128)
DEFAULT_SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_TOKENS = 16384  # batch * seq_len
DEFAULT_HIDDEN = 2048  # heads * head_dim

QUICK_HEAD_DIMS = (64,)
QUICK_SEQ_LENS = (128, 256)
QUICK_TOKENS = 512
QUICK_HIDDEN = 128

MIN_REPS = 20
# Inputs rotate over copies until this many bytes are touched: several times the L2 of any current
# GPU (50 MB on an H100/H200), so no timed call finds its inputs in cache from the previous call.
WORKING_SET_BYTES = 256 * 2**20
MAX_COPIES = 16
# At most this many bytes of outputs are kept alive by one batch of calls.
BATCH_OUTPUT_BYTES = 4 * 2**30
MAX_CALLS_PER_SAMPLE = 1000

CSV_FIELDS = (
    "date", "gpu", "platform", "jax", "jaxlib", "jax_tk", "commit", "timer",
    "dtype", "batch", "q_len", "kv_len", "heads", "head_dim", "causal",
    "provider", "mode", "status", "time_ms", "min_ms", "max_ms", "tflops", "flops",
    "reps", "calls_per_sample", "copies", "host_frac", "rel_err", "note",
)


# ----------------------------------------------------------------------------------------------
# FLOPs
# ----------------------------------------------------------------------------------------------


def attention_flops(batch: int, q_len: int, kv_len: int, heads: int, head_dim: int,
                    causal: bool, mode: str = "fwd") -> float:
    """FLOPs of attention counted the standard way (FlashAttention's benchmarks).

    Forward: two matrix products of ``2*T*S*D`` each per (batch, head), ``4*B*H*T*S*D``, halved when
    causal; backward 2.5x the forward (five matrix products against two); forward+backward 3.5x.
    """
    if mode not in MODE_FLOP_FACTOR:
        raise ValueError(f"mode must be one of {tuple(MODE_FLOP_FACTOR)}, got {mode!r}")
    fwd = 4.0 * batch * heads * q_len * kv_len * head_dim
    if causal:
        fwd /= 2.0
    return fwd * MODE_FLOP_FACTOR[mode]


# ----------------------------------------------------------------------------------------------
# Configurations and results
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    batch: int
    q_len: int
    kv_len: int
    heads: int
    head_dim: int
    causal: bool
    dtype: str = "bf16"

    @property
    def shape_q(self):
        return (self.batch, self.q_len, self.heads, self.head_dim)

    @property
    def shape_kv(self):
        return (self.batch, self.kv_len, self.heads, self.head_dim)

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    def flops(self, mode: str) -> float:
        return attention_flops(self.batch, self.q_len, self.kv_len, self.heads, self.head_dim,
                               self.causal, mode)

    def logits_bytes(self) -> int:
        """Bytes of one float32 [B, H, T, S] logits array (what XLA's attention materializes)."""
        return self.q_len * self.kv_len * self.batch * self.heads * 4

    def label(self) -> str:
        c = "causal" if self.causal else "full"
        return f"B={self.batch} T={self.q_len} S={self.kv_len} H={self.heads} D={self.head_dim} {c}"


def sweep_configs(head_dims: Sequence[int], seq_lens: Sequence[int], causals: Sequence[bool], *,
                  tokens: int = DEFAULT_TOKENS, hidden: int = DEFAULT_HIDDEN,
                  dtype: str = "bf16") -> list[AttentionConfig]:
    """The sweep: batch = tokens // seq_len, heads = hidden // head_dim, q_len == kv_len."""
    configs = []
    for d in head_dims:
        if hidden % d:
            raise ValueError(f"hidden size {hidden} is not a multiple of head_dim {d}")
        for causal in causals:
            for t in seq_lens:
                configs.append(AttentionConfig(batch=max(1, tokens // t), q_len=t, kv_len=t,
                                               heads=hidden // d, head_dim=d, causal=bool(causal),
                                               dtype=dtype))
    return configs


@dataclasses.dataclass
class Result:
    config: AttentionConfig
    provider: str
    mode: str
    status: str  # "ok", "error" or "skipped"
    time_ms: float = math.nan
    min_ms: float = math.nan
    max_ms: float = math.nan
    reps: int = 0
    calls_per_sample: int = 0
    copies: int = 0
    host_frac: float = math.nan
    rel_err: float = math.nan
    note: str = ""

    @property
    def flops(self) -> float:
        return self.config.flops(self.mode)

    @property
    def tflops(self) -> float:
        if self.status != "ok" or not self.time_ms > 0:
            return math.nan
        return self.flops / (self.time_ms * 1e-3) / 1e12

    def row(self, env: dict) -> dict:
        c = self.config
        return {
            "date": env["date"], "gpu": env["gpu"], "platform": env["platform"], "jax": env["jax"],
            "jaxlib": env["jaxlib"], "jax_tk": env["jax_tk"], "commit": env["commit"],
            "timer": env["timer"], "dtype": c.dtype, "batch": c.batch, "q_len": c.q_len,
            "kv_len": c.kv_len, "heads": c.heads, "head_dim": c.head_dim, "causal": c.causal,
            "provider": self.provider, "mode": self.mode, "status": self.status,
            "time_ms": _fmt(self.time_ms, 5), "min_ms": _fmt(self.min_ms, 5),
            "max_ms": _fmt(self.max_ms, 5),
            "tflops": "" if math.isnan(self.tflops) else f"{self.tflops:.4g}",
            "flops": f"{self.flops:.6g}", "reps": self.reps,
            "calls_per_sample": self.calls_per_sample, "copies": self.copies,
            "host_frac": _fmt(self.host_frac, 3), "rel_err": _fmt(self.rel_err, 3, sci=True),
            "note": self.note,
        }


def _fmt(x: float, digits: int, sci: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    return f"{x:.{digits}e}" if sci else f"{x:.{digits}f}"


def _short_error(e: BaseException, limit: int = 400) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    if not str(e).strip():  # e.g. a bare assert: say where it failed
        tb = traceback.extract_tb(e.__traceback__)
        if tb:
            text += f" at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno} `{tb[-1].line}`"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    text = " | ".join(lines[:4])
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ----------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------


def git_commit(path: str | None = None) -> str:
    """``git describe --always --dirty`` of the repository holding jax_tk; else the environment
    variable JAX_TK_COMMIT (for copies of the tree without .git); else "unknown"."""
    path = path or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], cwd=path,
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("JAX_TK_COMMIT") or "unknown"


def has_gpu() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def environment(timer: str = "wall") -> dict:
    import jaxlib

    try:
        import jax_tk

        tk_version = jax_tk.__version__
        kernels = jax_tk.has_cuda_kernels()
    except Exception:  # pragma: no cover - jax_tk is this package
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
        "python": platform.python_version(),
        "devices": len(jax.devices()),
    }
    try:
        from jax._src.lib import cuda_versions  # not public; only informative

        if cuda_versions is not None and dev.platform == "gpu":
            env["cudnn"] = str(cuda_versions.cudnn_get_version())
            env["cuda_runtime"] = str(cuda_versions.cuda_runtime_get_version())
    except Exception:
        pass
    return env


# ----------------------------------------------------------------------------------------------
# Timers
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    reps: int
    calls_per_sample: int
    host_frac: float


def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree)
               if hasattr(x, "shape") and hasattr(x, "dtype"))


class WallTimer:
    """Median over samples; one sample = a batch of asynchronously dispatched calls, timed from the
    first dispatch to ``block_until_ready`` of all results, divided by the number of calls."""

    name = "wall"

    def __init__(self, reps: int = MIN_REPS, batch_ms: float = 20.0, warmup_ms: float = 200.0):
        self.reps = max(int(reps), 1)
        self.batch_s = batch_ms * 1e-3
        self.warmup_s = warmup_ms * 1e-3

    @staticmethod
    def _sample(fn, arg_sets, start: int, calls: int) -> tuple[float, float]:
        n = len(arg_sets)
        t0 = time.perf_counter()
        outs = [fn(*arg_sets[(start + i) % n]) for i in range(calls)]
        t1 = time.perf_counter()
        jax.block_until_ready(outs)
        t2 = time.perf_counter()
        return (t2 - t0) / calls, (t1 - t0) / max(t2 - t0, 1e-12)

    def measure(self, fn: Callable, arg_sets: Sequence[tuple]) -> Timing:
        n = len(arg_sets)
        # Warm-up: every copy once (compiles, autotunes), then until warmup_s of device work.
        first = fn(*arg_sets[0])
        jax.block_until_ready(first)
        out_bytes = max(_nbytes(first), 1)
        del first
        for i in range(1, n):
            jax.block_until_ready(fn(*arg_sets[i]))
        t_end = time.perf_counter() + self.warmup_s
        est, _ = self._sample(fn, arg_sets, 0, n)
        while time.perf_counter() < t_end:
            est, _ = self._sample(fn, arg_sets, 0, n)
        max_calls = max(1, min(MAX_CALLS_PER_SAMPLE, BATCH_OUTPUT_BYTES // out_bytes))
        calls = int(min(max_calls, max(1, math.ceil(self.batch_s / max(est, 1e-9)))))
        samples, host = [], []
        start = 0
        for _ in range(self.reps):
            t, h = self._sample(fn, arg_sets, start, calls)
            start = (start + calls) % n
            samples.append(t * 1e3)
            host.append(h)
        return Timing(statistics.median(samples), min(samples), max(samples), len(samples), calls,
                      statistics.median(host))


class CuptiTimer:
    """Median over calls of the summed kernel time of one call, as CUPTI records it, through
    ``jax.experimental.mosaic.gpu.profiler.measure``. Warm-up as for WallTimer; then, for each input
    copy in turn, a run of back-to-back calls on that copy (so on small problems later calls may find
    their inputs in L2)."""

    name = "cupti"

    def __init__(self, reps: int = MIN_REPS, warmup_ms: float = 200.0):
        try:
            from jax.experimental.mosaic.gpu import profiler  # noqa: F401
        except Exception as e:  # pragma: no cover - GPU only
            raise RuntimeError(
                f"--timer cupti needs jax.experimental.mosaic.gpu (a CUDA jaxlib): {_short_error(e)}")
        self._profiler = profiler
        self.reps = max(int(reps), 1)
        self.warmup_s = warmup_ms * 1e-3

    def measure(self, fn: Callable, arg_sets: Sequence[tuple]) -> Timing:  # pragma: no cover - GPU
        n = len(arg_sets)
        for args in arg_sets:
            jax.block_until_ready(fn(*args))
        t_end = time.perf_counter() + self.warmup_s
        while time.perf_counter() < t_end:
            jax.block_until_ready([fn(*args) for args in arg_sets])
        per_copy = max(2, math.ceil(self.reps / n))
        samples: list[float] = []
        for args in arg_sets:
            _, ts = self._profiler.measure(fn, iterations=per_copy)(*args)
            if not ts:
                raise RuntimeError("CUPTI recorded no kernel")
            samples.extend(float(t) for t in ts)
        return Timing(statistics.median(samples), min(samples), max(samples), len(samples),
                      per_copy, math.nan)


def make_timer(name: str, reps: int, quick: bool = False):
    if name == "wall":
        return WallTimer(reps, batch_ms=2.0 if quick else 20.0, warmup_ms=10.0 if quick else 200.0)
    if name == "cupti":
        return CuptiTimer(reps, warmup_ms=10.0 if quick else 200.0)
    raise ValueError(f"unknown timer {name!r}: choose 'wall' or 'cupti'")


# ----------------------------------------------------------------------------------------------
# Providers
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Provider:
    """One attention implementation, as the benchmark sees it.

    ``fn(q, k, v) -> out`` computes ``softmax(scale * q k^T) v`` on prepared inputs.
    ``prepare(q, k, v, dout)`` (untimed) converts the benchmark's inputs and output cotangent for it
    (dtype, pre-scaling);
    ``scale`` is the softmax scale ``fn`` applies to its prepared inputs (the correctness check
    compares against the reference with it). ``fallback(reason)``: another Provider to try when every
    mode failed (the Mosaic GPU attention in float16 when bfloat16 fails).
    """

    name: str
    fn: Callable
    scale: float
    prepare: Callable | None = None
    fallback: Callable[[str], "Provider"] | None = None
    note: str = ""


def _jax_tk_provider(cfg: AttentionConfig, scale: float) -> Provider:
    import jax_tk

    impl = "tk" if has_gpu() else None
    note = "" if impl == "tk" else "no GPU: implementation=None (pure-JAX reference)"
    fn = functools.partial(jax_tk.attention, scale=scale, is_causal=cfg.causal, implementation=impl)
    return Provider("jax_tk", fn, scale, note=note)


def _jax_nn_provider(name: str, cfg: AttentionConfig, scale: float) -> Provider:
    fn = functools.partial(jax.nn.dot_product_attention, scale=scale, is_causal=cfg.causal,
                           implementation=name)
    return Provider(name, fn, scale)


def _pallas_mgpu_provider(cfg: AttentionConfig, scale: float, dtype=None, why: str = "") -> Provider:
    from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu

    d = cfg.head_dim
    # Forward blocks as JAX's own attention_mgpu benchmark picks them: block_q=64 and the largest
    # block_kv whose buffers fit in shared memory; backward blocks as its tests use them.
    smem = lambda bkv: 2 * 64 * d * 2 + 2 * 2 * bkv * d * 2  # q/o for 2 warpgroups, 2 stages of k, v
    block_kv = next((b for b in (256, 128, 64) if smem(b) <= 227 * 1024 and cfg.kv_len % b == 0), 64)
    config = mgpu.TuningConfig(
        block_q=64, block_kv=block_kv, max_concurrent_steps=2, causal=cfg.causal,
        compute_wgs_bwd=2 if d <= 128 else 1,
        block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64,
    )
    fn = functools.partial(mgpu.attention, config=config)

    def prepare(q, k, v, do):
        if dtype is not None:
            q, k, v, do = (x.astype(dtype) for x in (q, k, v, do))
        # The kernel applies no softmax scale: fold it into q, outside the timed region.
        return (q * jnp.asarray(scale, q.dtype)).astype(q.dtype), k, v, do

    fallback = None
    note = f"attention_mgpu block_q=64 block_kv={block_kv}"
    if dtype is None and cfg.jnp_dtype != jnp.float16:
        fallback = lambda why: _pallas_mgpu_provider(cfg, scale, jnp.float16, why)
    if dtype is not None:
        note += f"; ran in {jnp.dtype(dtype).name}, {cfg.dtype} failed: {why}"
    return Provider("pallas", fn, 1.0, prepare=prepare, fallback=fallback, note=note)


def _pallas_triton_provider(cfg: AttentionConfig, scale: float) -> Provider:
    from jax.experimental.pallas.ops.gpu import attention as triton_attention

    def fn(q, k, v):
        return triton_attention.mha(q, k, v, None, sm_scale=scale, causal=cfg.causal)

    return Provider("pallas_triton", fn, scale, note="pallas.ops.gpu.attention.mha, default blocks")


def make_provider(name: str, cfg: AttentionConfig) -> Provider:
    scale = 1.0 / math.sqrt(cfg.head_dim)
    if name == "jax_tk":
        return _jax_tk_provider(cfg, scale)
    if name in ("cudnn", "xla"):
        return _jax_nn_provider(name, cfg, scale)
    if name == "pallas":
        return _pallas_mgpu_provider(cfg, scale)
    if name == "pallas_triton":
        return _pallas_triton_provider(cfg, scale)
    raise ValueError(f"unknown provider {name!r}; choose from {PROVIDERS}")


# ----------------------------------------------------------------------------------------------
# Correctness check (on one batch element and one head, against the float32 reference)
# ----------------------------------------------------------------------------------------------


def _slice0(x):
    return x[0:1, :, 0:1, :]


def _rel_err(got, want) -> float:
    got = [np.asarray(g, np.float32) for g in got]
    want = [np.asarray(w, np.float32) for w in want]
    num = math.sqrt(sum(float(np.sum((g - w) ** 2)) for g, w in zip(got, want)))
    den = math.sqrt(sum(float(np.sum(w**2)) for w in want))
    return num / den if den > 0 else math.inf


def _reference(q, k, v, scale, causal):
    from jax_tk import reference

    return reference.attention(q, k, v, scale=scale, is_causal=causal)


@functools.partial(jax.jit, static_argnames=("scale", "causal"))
def _reference_fwd(q, k, v, *, scale, causal):
    return _reference(q, k, v, scale, causal)


@functools.partial(jax.jit, static_argnames=("scale", "causal"))
def _reference_bwd(q, k, v, dout, *, scale, causal):
    f = functools.partial(_reference, scale=scale, causal=causal)
    return jax.vjp(f, q, k, v)[1](dout)


def _check_fwd(out, inputs, provider: Provider, cfg: AttentionConfig) -> float:
    q, k, v = (_slice0(x) for x in inputs)
    ref = _reference_fwd(q, k, v, scale=provider.scale, causal=cfg.causal)
    return _rel_err([_slice0(out)], [ref])


def _check_bwd(grads, inputs, dout, provider: Provider, cfg: AttentionConfig) -> float:
    q, k, v = (_slice0(x) for x in inputs)
    ref = _reference_bwd(q, k, v, _slice0(dout), scale=provider.scale, causal=cfg.causal)
    return _rel_err([_slice0(g) for g in grads], ref)


# ----------------------------------------------------------------------------------------------
# Running one configuration
# ----------------------------------------------------------------------------------------------


def _copies_for(set_bytes: int) -> int:
    return int(min(MAX_COPIES, max(2, math.ceil(WORKING_SET_BYTES / max(set_bytes, 1)))))


@functools.partial(jax.jit, static_argnames=("shape_q", "shape_kv", "dtype"))
def _random_set(key, *, shape_q, shape_kv, dtype):
    nq, nkv = math.prod(shape_q), math.prod(shape_kv)
    flat = jax.random.normal(key, (2 * nq + 2 * nkv,), dtype)  # one generator: compiles faster
    q, k, v, do = jnp.split(flat, [nq, nq + nkv, nq + 2 * nkv])
    return q.reshape(shape_q), k.reshape(shape_kv), v.reshape(shape_kv), do.reshape(shape_q)


def _random_inputs(cfg: AttentionConfig, copies: int, seed: int = 0):
    """``copies`` sets of (q, k, v, dout), standard normal in the benchmark dtype (never zeros)."""
    sets = [_random_set(jax.random.key(seed + i), shape_q=cfg.shape_q, shape_kv=cfg.shape_kv,
                        dtype=cfg.jnp_dtype) for i in range(copies)]
    jax.block_until_ready(sets)
    return sets


def _bench_provider(provider: Provider, cfg: AttentionConfig, sets, modes, timer, check: bool):
    """Times one provider on one configuration; returns Results (failures become Results)."""
    results = []
    if provider.prepare is not None:
        prepared = [tuple(provider.prepare(*s)) for s in sets]
    else:
        prepared = list(sets)
    fwd = jax.jit(provider.fn)

    for mode in modes:
        res = Result(cfg, provider.name, mode, "error", note=provider.note)
        arg_sets = []
        try:
            if mode == "fwd":
                arg_sets = [(q, k, v) for q, k, v, _ in prepared]
                timing = timer.measure(fwd, arg_sets)
                if check:
                    res.rel_err = _check_fwd(fwd(*arg_sets[0]), arg_sets[0], provider, cfg)
            elif mode == "bwd":
                fwd_vjp = jax.jit(lambda q, k, v: jax.vjp(provider.fn, q, k, v)[1])
                bwd = jax.jit(lambda vjp_fn, g: vjp_fn(g))
                # The forward runs here, untimed; its saved residuals (for XLA, [B, H, T, S] arrays)
                # and the cotangent are the inputs of the timed backward. Copies as for the forward,
                # but no more than needed to pass the working-set size.
                for q, k, v, do in prepared:
                    arg_sets.append((fwd_vjp(q, k, v), do))
                    if _nbytes(arg_sets) >= WORKING_SET_BYTES:
                        break
                timing = timer.measure(bwd, arg_sets)
                if check:
                    res.rel_err = _check_bwd(bwd(*arg_sets[0]), prepared[0][:3], prepared[0][3],
                                             provider, cfg)
            elif mode == "fwd_bwd":
                arg_sets = prepared
                step = jax.jit(lambda q, k, v, g: jax.vjp(provider.fn, q, k, v)[1](g))
                timing = timer.measure(step, arg_sets)
            else:
                raise ValueError(f"unknown mode {mode!r}")
        except Exception as e:  # noqa: BLE001 - any failure of a provider is a result
            res.note = "; ".join(filter(None, [provider.note, _short_error(e)]))
            if os.environ.get("JAX_TK_BENCH_TRACEBACK"):
                traceback.print_exc()
            results.append(res)
            continue
        finally:
            copies = len(arg_sets)
            del arg_sets
        res.status = "ok"
        res.time_ms, res.min_ms, res.max_ms = timing.median_ms, timing.min_ms, timing.max_ms
        res.reps, res.calls_per_sample = timing.reps, timing.calls_per_sample
        res.copies = copies
        res.host_frac = timing.host_frac
        if timing.host_frac > 0.9:
            res.note = "; ".join(filter(None, [res.note, "host-bound: dispatch kept pace with the device"]))
        results.append(res)
    return results


def bench_attention(configs: Sequence[AttentionConfig], providers: Sequence[str],
                    modes: Sequence[str] = DEFAULT_MODES, *, timer=None, check: bool = True,
                    xla_max_bytes: float = 20e9, on_result: Callable[[Result], None] | None = None,
                    log: Callable[[str], None] | None = print) -> list[Result]:
    """Times every provider on every configuration, one configuration at a time (the providers see
    the same inputs, in the same process, with the same timer)."""
    timer = timer or WallTimer()
    results: list[Result] = []

    def emit(r: Result):
        results.append(r)
        if on_result is not None:
            on_result(r)
        if log is not None:
            t = (f"{r.time_ms:9.4f} ms {_fmt_tflops(r.tflops):>7} TFLOP/s" if r.status == "ok"
                 else r.status)
            err = f" err={r.rel_err:.1e}" if not math.isnan(r.rel_err) else ""
            extra = f"  [{r.note}]" if r.status != "ok" and r.note else ""
            log(f"  {r.provider:>13} {r.mode:>7}: {t}{err}{extra}")

    t_start = time.perf_counter()
    for cfg in configs:
        if log is not None:
            log(f"{cfg.label()} {cfg.dtype}  (t={time.perf_counter() - t_start:.0f} s)")
        set_bytes = 2 * math.prod(cfg.shape_q) * 2 + 2 * math.prod(cfg.shape_kv) * 2
        try:
            sets = _random_inputs(cfg, _copies_for(set_bytes))
        except Exception as e:  # noqa: BLE001
            for name in providers:
                for mode in modes:
                    emit(Result(cfg, name, mode, "error", note=f"inputs: {_short_error(e)}"))
            continue
        for name in providers:
            if name == "xla" and cfg.logits_bytes() > xla_max_bytes:
                for mode in modes:
                    emit(Result(cfg, name, mode, "skipped",
                                note=f"T*S*B*H*4 = {cfg.logits_bytes() / 1e9:.1f} GB > "
                                     f"{xla_max_bytes / 1e9:.0f} GB"))
                continue
            try:
                provider = make_provider(name, cfg)
            except Exception as e:  # noqa: BLE001 - e.g. the Pallas module does not import
                for mode in modes:
                    emit(Result(cfg, name, mode, "error", note=_short_error(e)))
                continue
            out = _bench_provider(provider, cfg, sets, modes, timer, check)
            if provider.fallback is not None and all(r.status == "error" for r in out):
                why = out[0].note[len(provider.note):].lstrip("; ")[:200]
                second = provider.fallback(why)
                retry = _bench_provider(second, cfg, sets, modes, timer, check)
                if any(r.status == "ok" for r in retry):
                    out = retry
                else:  # keep the first error, and say that the retry failed too
                    for r, r2 in zip(out, retry):
                        r.note += f" || retry: {r2.note[len(second.note):].lstrip('; ')}"
            for r in out:
                emit(r)
        del sets
    if log is not None:
        log(f"({len(configs)} configurations in {time.perf_counter() - t_start:.0f} s)")
    return results


# ----------------------------------------------------------------------------------------------
# Output: table, CSV, plot
# ----------------------------------------------------------------------------------------------


def env_header(env: dict) -> str:
    keys = ("date", "gpu", "platform", "jax", "jaxlib", "cudnn", "cuda_runtime", "jax_tk",
            "jax_tk_kernels", "commit", "timer", "python")
    return "  ".join(f"{k}={env[k]}" for k in keys if k in env)


def _fmt_tflops(x: float) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def format_table(results: Sequence[Result], providers: Sequence[str] | None = None) -> str:
    """Per mode: one row per configuration, ``ms (TFLOP/s)`` per provider, and jax_tk's speed-up over
    cuDNN (cudnn time / jax_tk time, = the ratio of their TFLOP/s; > 1: jax_tk is faster)."""
    if not results:
        return "(no results)"
    if providers is None:
        providers = list(dict.fromkeys(r.provider for r in results))
    by_key = {(r.config, r.provider, r.mode): r for r in results}
    configs = sorted(dict.fromkeys(r.config for r in results),
                     key=lambda c: (c.dtype, c.head_dim, c.causal, c.q_len, c.kv_len, c.batch, c.heads))
    modes = list(dict.fromkeys(r.mode for r in results))
    show_ratio = "jax_tk" in providers and "cudnn" in providers
    lines = []
    for mode in modes:
        head = f"{'D':>4} {'causal':>6} {'T':>6} {'S':>6} {'B':>4} {'H':>4} |"
        for p in providers:
            head += f" {p + ' ms (TF/s)':>22} |"
        if show_ratio:
            head += f" {'tk/cudnn':>8}"
        title = f"== {mode}: time per call in ms (TFLOP/s)"
        if show_ratio:
            title += "; tk/cudnn = cudnn time / jax_tk time (> 1: jax_tk is faster)"
        lines.append(title + " ==")
        lines.append(head)
        lines.append("-" * len(head))
        for cfg in configs:
            row = (f"{cfg.head_dim:>4} {str(cfg.causal):>6} {cfg.q_len:>6} {cfg.kv_len:>6} "
                   f"{cfg.batch:>4} {cfg.heads:>4} |")
            for p in providers:
                r = by_key.get((cfg, p, mode))
                if r is None:
                    cell = "-"
                elif r.status == "ok":
                    cell = f"{r.time_ms:.3f} ({_fmt_tflops(r.tflops)})"
                else:
                    cell = r.status
                row += f" {cell:>22} |"
            if show_ratio:
                tk, cu = by_key.get((cfg, "jax_tk", mode)), by_key.get((cfg, "cudnn", mode))
                ratio = "-"
                if tk and cu and tk.status == cu.status == "ok":
                    ratio = f"{cu.time_ms / tk.time_ms:.2f}x"
                row += f" {ratio:>8}"
            lines.append(row)
        lines.append("")
    failures: dict[tuple, list] = {}
    for r in results:
        if r.status != "ok":
            failures.setdefault((r.provider, r.status, r.note), []).append(r)
    if failures:
        lines.append("Not timed (provider, modes, status: reason; first configuration):")
        for (provider, status, note), rs in failures.items():
            ms = ",".join(dict.fromkeys(r.mode for r in rs))
            lines.append(f"  {provider} {ms} {status} x{len(rs)}: {note}; e.g. {rs[0].config.label()}")
    bad = [r for r in results if r.status == "ok" and r.rel_err > 2e-2]
    if bad:
        lines.append("Correctness check above 2e-2 (relative error on batch 0, head 0, vs float32):")
        for r in bad:
            lines.append(f"  {r.provider} {r.mode} {r.config.label()}: {r.rel_err:.2e}")
    return "\n".join(lines).rstrip() + "\n"


class CsvWriter:
    """Writes rows as they come, so a cut-off run still leaves its numbers."""

    def __init__(self, path: str, env: dict):
        self.path, self.env = path, env
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        self._f = open(path, "w", newline="")
        self._w = csv.DictWriter(self._f, fieldnames=CSV_FIELDS)
        self._w.writeheader()
        self._f.flush()

    def write(self, r: Result):
        self._w.writerow(r.row(self.env))
        self._f.flush()

    def close(self):
        self._f.close()


def write_csv(results: Sequence[Result], path: str, env: dict) -> None:
    w = CsvWriter(path, env)
    try:
        for r in results:
            w.write(r)
    finally:
        w.close()


def plot(results: Sequence[Result], path: str, env: dict) -> bool:
    """TFLOP/s against sequence length, one panel per (head_dim, causal) row and mode column.
    Returns False (and writes nothing) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
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
    fig.suptitle(f"attention, {env.get('gpu')}, jax {env.get('jax')}, commit {env.get('commit')}, "
                 f"{env.get('date')}, timer={env.get('timer')}", fontsize=10)
    fig.tight_layout()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


ENV_FIELDS = ("date", "gpu", "platform", "jax", "jaxlib", "jax_tk", "commit", "timer")


def read_csv(paths: Sequence[str]) -> tuple[list[Result], dict]:
    """Reads CSVs written by this module back into Results, and the environment fields they carry
    (different values across files are joined with ' / ')."""
    results, envs = [], []

    def num(row, key, cast=float):
        v = row.get(key, "")
        return cast(v) if v not in ("", None) else (math.nan if cast is float else 0)

    for path in paths:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                cfg = AttentionConfig(int(row["batch"]), int(row["q_len"]), int(row["kv_len"]),
                                      int(row["heads"]), int(row["head_dim"]),
                                      row["causal"] == "True", row["dtype"])
                results.append(Result(
                    cfg, row["provider"], row["mode"], row["status"], time_ms=num(row, "time_ms"),
                    min_ms=num(row, "min_ms"), max_ms=num(row, "max_ms"), reps=num(row, "reps", int),
                    calls_per_sample=num(row, "calls_per_sample", int),
                    copies=num(row, "copies", int), host_frac=num(row, "host_frac"),
                    rel_err=num(row, "rel_err"), note=row.get("note", "")))
                envs.append(row)
    env = {k: " / ".join(dict.fromkeys(str(e.get(k, "")) for e in envs)) for k in ENV_FIELDS}
    return results, env


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
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


def _str_list(choices):
    def parse(text: str) -> list[str]:
        items = [s for s in text.replace(" ", ",").split(",") if s]
        bad = [s for s in items if s not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {','.join(choices)}; got {text!r}")
        return items
    return parse


def _causal_list(text: str) -> list[bool]:
    t = text.lower()
    if t in ("both", "all"):
        return [False, True]
    if t in ("true", "1", "yes", "causal"):
        return [True]
    if t in ("false", "0", "no", "full"):
        return [False]
    raise argparse.ArgumentTypeError("--causal takes both, true or false")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jax_tk.bench",
                                description="Benchmarks of jax_tk against cuDNN, XLA and Pallas.")
    sub = p.add_subparsers(dest="op", required=True)
    a = sub.add_parser("attention", help="attention forward and backward",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a.add_argument("--d", type=_int_list, default=None,
                   help=f"head dims, comma-separated (default {','.join(map(str, DEFAULT_HEAD_DIMS))})")
    a.add_argument("--seq", type=_int_list, default=None,
                   help="sequence lengths q = kv, comma-separated, 'k' = 1024 "
                        f"(default {','.join(map(str, DEFAULT_SEQ_LENS))})")
    a.add_argument("--causal", type=_causal_list, default=None, help="both, true or false (default both)")
    a.add_argument("--providers", type=_str_list(PROVIDERS), default=None,
                   help=f"from {','.join(PROVIDERS)} (default {','.join(DEFAULT_PROVIDERS)})")
    a.add_argument("--modes", type=_str_list(MODES), default=None,
                   help=f"from {','.join(MODES)} (default {','.join(DEFAULT_MODES)})")
    a.add_argument("--tokens", type=int, default=None, help=f"batch * seq (default {DEFAULT_TOKENS})")
    a.add_argument("--hidden", type=int, default=None, help=f"heads * head_dim (default {DEFAULT_HIDDEN})")
    a.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    a.add_argument("--timer", choices=("wall", "cupti"), default="wall")
    a.add_argument("--reps", type=int, default=MIN_REPS, help=f"samples per measurement (>= {MIN_REPS})")
    a.add_argument("--xla-max-gb", type=float, default=20.0,
                   help="skip the xla provider where T*S*B*H*4 bytes exceed this")
    a.add_argument("--no-check", action="store_true",
                   help="skip the correctness check against the float32 reference")
    a.add_argument("--quick", action="store_true",
                   help=f"tiny sweep: D={QUICK_HEAD_DIMS}, T={QUICK_SEQ_LENS}, tokens={QUICK_TOKENS}, "
                        f"hidden={QUICK_HIDDEN} (runs on CPU in seconds)")
    a.add_argument("--out", default=os.path.join("out", "bench"), help="directory for the CSV and PNG")
    a.add_argument("--csv", default=None, help="CSV path (default OUT/attention.csv)")
    a.add_argument("--png", default=None, help="PNG path (default OUT/attention.png); 'none' to skip")
    r = sub.add_parser("report", help="table and plot from CSVs of earlier runs (merged; no GPU needed)")
    r.add_argument("csvs", nargs="+", help="CSV files written by `attention`")
    r.add_argument("--csv", default=None, help="also write the merged rows to this CSV")
    r.add_argument("--png", default=None, help="write the plot here")
    return p


def run_report(args) -> int:
    results, env = read_csv(args.csvs)
    providers = list(dict.fromkeys(r.provider for r in results))
    print(f"# {env_header(env)}")
    print(format_table(results, providers))
    if args.csv:
        write_csv(results, args.csv, env)
        print(f"CSV: {args.csv}")
    if args.png:
        if plot(results, args.png, env):
            print(f"PNG: {args.png}")
        else:
            print("PNG: skipped (matplotlib is not installed)")
    return 0


def run_attention(args) -> int:
    quick = args.quick
    head_dims = args.d or (QUICK_HEAD_DIMS if quick else DEFAULT_HEAD_DIMS)
    seq_lens = args.seq or (QUICK_SEQ_LENS if quick else DEFAULT_SEQ_LENS)
    causals = args.causal or [False, True]
    tokens = args.tokens or (QUICK_TOKENS if quick else DEFAULT_TOKENS)
    hidden = args.hidden or (QUICK_HIDDEN if quick else DEFAULT_HIDDEN)
    providers = args.providers or list(DEFAULT_PROVIDERS)
    modes = args.modes or list(DEFAULT_MODES)
    dtype = {"bfloat16": "bf16", "float16": "fp16"}.get(args.dtype, args.dtype)
    if args.reps < MIN_REPS:
        print(f"note: --reps {args.reps} is under {MIN_REPS}; using {MIN_REPS}", file=sys.stderr)
    reps = max(args.reps, MIN_REPS)
    csv_path = args.csv or os.path.join(args.out, "attention.csv")
    png_path = args.png or os.path.join(args.out, "attention.png")

    configs = sweep_configs(head_dims, seq_lens, causals, tokens=tokens, hidden=hidden, dtype=dtype)
    timer = make_timer(args.timer, reps, quick=quick)
    env = environment(timer.name)
    print(f"# jax_tk attention benchmark: {env_header(env)}")
    print(f"# providers={','.join(providers)} modes={','.join(modes)} dtype={dtype} tokens={tokens} "
          f"hidden={hidden} reps={reps}; FLOPs: fwd 4*B*H*T*S*D (/2 causal), bwd 2.5x fwd, "
          f"fwd_bwd 3.5x fwd; bwd = the backward alone (VJP of saved residuals)")
    sys.stdout.flush()
    writer = CsvWriter(csv_path, env)
    try:
        results = bench_attention(
            configs, providers, modes, timer=timer, check=not args.no_check,
            xla_max_bytes=args.xla_max_gb * 1e9, on_result=writer.write,
            log=lambda s: print(s, flush=True))
    finally:
        writer.close()
    print()
    print(f"# {env_header(env)}")
    print(format_table(results, providers))
    print(f"CSV: {csv_path}")
    if png_path.lower() != "none":
        if plot(results, png_path, env):
            print(f"PNG: {png_path}")
        else:
            print("PNG: skipped (matplotlib is not installed)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.op == "attention":
        return run_attention(args)
    if args.op == "report":
        return run_report(args)
    raise AssertionError(args.op)  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
