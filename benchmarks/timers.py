"""Timers: one measurement method for every provider of every op.

``WallTimer`` (``--timer wall``, the default): each measured sample enqueues a batch of calls of the
jitted function (JAX dispatches asynchronously, so the device queue stays full) and waits for all
their results with ``jax.block_until_ready``; the sample is the elapsed host time over the number of
calls. The batch is sized to last >= 20 ms so the one launch latency per sample is negligible.
Warm-up (compilation, autotuning, and 200 ms of calls) first, then ``reps`` (>= 20) samples; the
median is reported, with min and max. The fraction of each sample that the host spent enqueueing is
recorded (``host_frac``); near 1.0 would mean the host, not the device, set the pace.

``CuptiTimer`` (``--timer cupti``): the summed kernel durations that CUPTI records, through
``jax.experimental.mosaic.gpu.profiler.measure`` (the tool JAX's own Pallas GPU benchmarks use); GPU
only, experimental API; it leaves out the gaps between calls and between kernels. ``--timer kernels``
is the same timer that also keeps each kernel's median time per call (``Timing.kernels``): where a
call's time goes, printed under its line.

Both take ``measure(fn, arg_sets)``: ``fn`` is jitted, ``arg_sets`` a list of argument tuples that
the calls rotate over (copies whose total size exceeds the L2 cache many times).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Callable, Sequence

import jax
import numpy as np

MIN_REPS = 20
# Inputs rotate over copies until this many bytes are touched: several times the L2 of any current
# GPU (50 MB on an H100/H200), so no timed call finds its inputs in cache from the previous call.
WORKING_SET_BYTES = 256 * 2**20
MAX_COPIES = 16
# At most this many bytes of outputs are kept alive by one batch of calls.
BATCH_OUTPUT_BYTES = 4 * 2**30
MAX_CALLS_PER_SAMPLE = 1000
TIMERS = ("wall", "cupti", "kernels")


@dataclasses.dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    reps: int
    calls_per_sample: int
    host_frac: float
    kernels: dict[str, float] | None = None  # (--timer kernels) median ms per call of each kernel name


def nbytes(tree) -> int:
    """Bytes of the arrays in a pytree."""
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree)
               if hasattr(x, "shape") and hasattr(x, "dtype"))


def copies_for(set_bytes: int) -> int:
    """How many copies of a set of inputs of ``set_bytes`` to rotate over: 2 to MAX_COPIES, or 1 when a
    set alone passes the working set (no call can find its inputs in L2, and a second copy of inputs
    that large may not fit beside the call's own memory)."""
    if set_bytes >= WORKING_SET_BYTES:
        return 1
    return int(min(MAX_COPIES, max(2, math.ceil(WORKING_SET_BYTES / max(set_bytes, 1)))))


def _run_each(fn: Callable, arg_sets: Sequence[tuple]) -> int:
    """Calls ``fn`` once on every input copy (compiling and autotuning it), one at a time; returns the
    bytes of one call's outputs."""
    first = fn(*arg_sets[0])
    jax.block_until_ready(first)
    out_bytes = max(nbytes(first), 1)
    del first
    for args in arg_sets[1:]:
        jax.block_until_ready(fn(*args))
    return out_bytes


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
        out_bytes = _run_each(fn, arg_sets)
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
    copy in turn, back-to-back calls on that copy (so on small problems later calls may find their
    inputs in L2), in runs whose outputs together stay under BATCH_OUTPUT_BYTES."""

    name = "cupti"

    def __init__(self, reps: int = MIN_REPS, warmup_ms: float = 200.0, per_kernel: bool = False):
        try:
            from jax.experimental.mosaic.gpu import profiler  # noqa: F401
        except Exception as e:  # pragma: no cover - GPU only
            raise RuntimeError(f"--timer cupti needs jax.experimental.mosaic.gpu (a CUDA jaxlib): "
                               f"{type(e).__name__}: {e}") from None
        self._profiler = profiler
        self.reps = max(int(reps), 1)
        self.warmup_s = warmup_ms * 1e-3
        self.per_kernel = per_kernel
        self.name = "kernels" if per_kernel else "cupti"

    def measure(self, fn: Callable, arg_sets: Sequence[tuple]) -> Timing:
        n = len(arg_sets)
        out_bytes = _run_each(fn, arg_sets)
        t_end = time.perf_counter() + self.warmup_s
        while time.perf_counter() < t_end:
            jax.block_until_ready([fn(*args) for args in arg_sets])
        per_copy = max(2, math.ceil(self.reps / n))
        # The profiler keeps every call's outputs until the last one ends: runs of at most
        # BATCH_OUTPUT_BYTES of them (a large grouped GEMM's gradients are 10 GB a call).
        run = max(1, min(per_copy, BATCH_OUTPUT_BYTES // out_bytes))
        samples: list[float] = []
        kernels: dict[str, list[float]] = {}
        for args in arg_sets:
            for done in range(0, per_copy, run):
                calls = min(run, per_copy - done)
                if self.per_kernel:
                    _, ts = self._profiler.measure(fn, iterations=calls, aggregate=False)(*args)
                    calls_ts = _per_call(ts, calls)
                    for call in calls_ts:
                        for name, t in _summed(call).items():
                            kernels.setdefault(name, []).append(float(t))
                    samples.extend(sum(t for _, t in call) for call in calls_ts)
                    continue
                _, ts = self._profiler.measure(fn, iterations=calls)(*args)
                if ts is None:
                    raise RuntimeError("CUPTI recorded no kernel")
                samples.extend(float(t) for t in (ts if calls > 1 else [ts]))
        return Timing(statistics.median(samples), min(samples), max(samples), len(samples),
                      per_copy, math.nan,
                      {k: statistics.median(v) for k, v in kernels.items()} if self.per_kernel else None)


def _per_call(ts, calls: int) -> list[list[tuple[str, float]]]:
    """The profiler's per-kernel timings as one list of (name, ms) per call."""
    if not ts:
        raise RuntimeError("CUPTI recorded no kernel")
    return ts if calls > 1 else [ts]


def _summed(call: list[tuple[str, float]]) -> dict[str, float]:
    """One call's kernel times by name (a kernel launched twice in a call: its two times summed)."""
    out: dict[str, float] = {}
    for name, t in call:
        out[name] = out.get(name, 0.0) + float(t)
    return out


def make_timer(name: str, reps: int, quick: bool = False, rounds: int = 1):
    """The timer ``name``; ``rounds``: how many turns the harness gives every provider of a
    configuration (harness.run)."""
    if name == "wall":
        timer = WallTimer(reps, batch_ms=2.0 if quick else 20.0, warmup_ms=10.0 if quick else 200.0)
    elif name in ("cupti", "kernels"):
        timer = CuptiTimer(reps, warmup_ms=10.0 if quick else 200.0, per_kernel=name == "kernels")
    else:
        raise ValueError(f"unknown timer {name!r}: choose 'wall', 'cupti' or 'kernels'")
    timer.rounds = max(1, int(rounds))
    return timer
