"""The harness every op's benchmark runs on: providers, results, and the loop that times them.

An op gives the harness an ``OpBench``: how to make a ``Provider`` (one implementation) for a
configuration, random inputs, and optional correctness checks. ``run`` then times every provider on
every configuration, one configuration at a time, the providers seeing the same inputs, in the same
process, with the same timer and the same method for each mode:

- ``fwd``: ``out = fn(*args)``, jitted;
- ``bwd``: the backward pass alone: the forward runs once, untimed, through ``jax.vjp``; the timed
  program is the jitted VJP function applied to the output cotangent (it reads the saved residuals
  and writes the gradients);
- ``fwd_bwd``: forward and backward in one jitted program, ``jax.vjp(fn, *args)``: the output and
  the gradients for ``dout``.

With checks, each mode's results are compared with the op's references before they count as a
timing (``fwd``: the output; ``bwd``: the gradients; ``fwd_bwd``: both): a provider whose results
are wrong is reported as "wrong", not timed (a peer's backward can be wrong where its forward is not).

A provider that fails gets its error recorded and the run goes on; one that does not apply to a
configuration raises ``Skip`` (recorded as skipped), and one whose package is missing raises
``Unavailable`` (recorded as skipped, note "unavailable: ...").

A configuration is any hashable object with ``flops(mode)``, ``label()``, a class attribute
``CSV_FIELDS`` (its CSV columns), ``csv_row()`` and a classmethod ``from_row(row)`` (the inverse).
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
import traceback
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timers import WORKING_SET_BYTES, WallTimer, copies_for, nbytes

MODES = ("fwd", "bwd", "fwd_bwd")
DEFAULT_MODES = ("fwd", "bwd")
ENV_FIELDS = ("date", "gpu", "platform", "jax", "jaxlib", "jax_tk", "commit", "timer", "peers")
RESULT_FIELDS = ("provider", "mode", "status", "time_ms", "min_ms", "max_ms", "tflops", "flops",
                 "vs_plain", "reps", "calls_per_sample", "copies", "host_frac", "rel_err", "note")


def csv_fields(config_type) -> tuple[str, ...]:
    """The CSV columns of an op: environment, configuration, measurement."""
    return ENV_FIELDS + tuple(config_type.CSV_FIELDS) + RESULT_FIELDS


class Skip(Exception):
    """make_provider: this provider does not apply to this configuration (recorded as skipped)."""


class Unavailable(Skip):
    """make_provider: this provider's package is not installed or cannot run on this machine
    (recorded as skipped, the note starting with "unavailable:")."""

    def __str__(self):
        return f"unavailable: {super().__str__()}"


@dataclasses.dataclass
class Provider:
    """One implementation of an op, as the benchmark sees it.

    ``fn(*args) -> out`` computes the op on prepared inputs. ``prepare(*args, dout)`` (untimed)
    converts the benchmark's inputs and output cotangent for it (dtype, pre-scaling). ``scale``: the
    softmax scale ``fn`` applies to its prepared inputs (attention's correctness check compares
    against the reference with it; other ops ignore it). ``fallback(reason)``: another Provider to
    try when every mode failed. ``scratch_bytes``: bytes of the large intermediates it materializes
    (XLA's [B, H, T, S] attention logits), described by ``scratch_what``; ``run`` skips the provider
    where they exceed ``max_scratch_bytes`` (``--xla-max-gb``). ``variants``: settings of one
    implementation to choose from (e.g. FlashAttention's number of KV splits): each is timed, and the
    fastest correct one is reported, its note naming it (``fn`` is then not timed). ``restore(x)``:
    where ``prepare`` changes the layout, maps an array of the provider's layout (a prepared input,
    the output, a gradient) back to the benchmark's, for the op's correctness check. ``per_mode(mode)``:
    where the work timed differs by mode, the Provider to time in ``mode`` (raising Skip for a mode it
    does not run); e.g. FP8 serving quantizes the weights once, in ``prepare``, and FP8 training
    inside the timed call. ``fn`` is then not timed.
    """

    name: str
    fn: Callable
    scale: float = 1.0
    prepare: Callable | None = None
    fallback: Callable[[str], "Provider"] | None = None
    note: str = ""
    scratch_bytes: int = 0
    scratch_what: str = "scratch"
    variants: tuple["Provider", ...] = ()
    restore: Callable | None = None
    per_mode: Callable[[str], "Provider"] | None = None

    @property
    def materializes_logits(self) -> bool:
        return self.scratch_bytes > 0


def factory(factories: dict[str, Callable[..., Provider]], name: str) -> Callable[..., Provider]:
    """An op's provider factory for ``name`` (``factories``: its registry, name -> factory); a
    ValueError naming the choices for an unknown name."""
    if name not in factories:
        raise ValueError(f"unknown provider {name!r}; choose from {', '.join(factories)}")
    return factories[name]


@dataclasses.dataclass(frozen=True)
class OpBench:
    """What an op gives the harness.

    ``make_provider(name, cfg) -> Provider`` (raises Skip/Unavailable where it does not apply);
    ``make_inputs(cfg, copies) -> [(*args, dout), ...]`` random inputs (never zeros) and cotangent
    (raises Skip where the configuration cannot be run here, e.g. does not fit in memory);
    ``input_bytes(cfg)``: bytes of one such set; ``check_fwd(cfg, provider, args, out)`` and
    ``check_bwd(cfg, provider, args, dout, grads)`` -> relative error against a reference;
    ``on_result(result, by_key)``: a hook on every result (e.g. the ratio to a baseline row);
    ``max_rel_err(cfg)``: the check's tolerance for a configuration (default MAX_REL_ERR; FP8 GEMMs
    allow the error of their quantization)."""

    make_provider: Callable[[str, Any], Provider]
    make_inputs: Callable[[Any, int], list]
    input_bytes: Callable[[Any], int]
    check_fwd: Callable | None = None
    check_bwd: Callable | None = None
    on_result: Callable[["Result", dict], None] | None = None
    max_rel_err: Callable[[Any], float] | None = None


@dataclasses.dataclass
class Result:
    config: Any
    provider: str
    mode: str
    status: str  # "ok", "error", "skipped" or "wrong" (timed, but its results failed the check)
    time_ms: float = math.nan
    min_ms: float = math.nan
    max_ms: float = math.nan
    reps: int = 0
    calls_per_sample: int = 0
    copies: int = 0
    host_frac: float = math.nan
    rel_err: float = math.nan
    note: str = ""
    vs_plain: float = math.nan  # tflops / tflops of a baseline row (attention's feature rows)
    kernels: dict | None = None  # (--timer kernels) median ms per call of each kernel

    @property
    def flops(self) -> float:
        return self.config.flops(self.mode)

    @property
    def tflops(self) -> float:
        if self.status != "ok" or not self.time_ms > 0:
            return math.nan
        return self.flops / (self.time_ms * 1e-3) / 1e12

    def row(self, env: dict) -> dict:
        row = {k: env[k] for k in ENV_FIELDS}
        row.update(self.config.csv_row())
        row.update({
            "provider": self.provider, "mode": self.mode, "status": self.status,
            "time_ms": fmt_num(self.time_ms, 5), "min_ms": fmt_num(self.min_ms, 5),
            "max_ms": fmt_num(self.max_ms, 5),
            "tflops": "" if math.isnan(self.tflops) else f"{self.tflops:.4g}",
            "flops": f"{self.flops:.6g}", "vs_plain": fmt_num(self.vs_plain, 4), "reps": self.reps,
            "calls_per_sample": self.calls_per_sample, "copies": self.copies,
            "host_frac": fmt_num(self.host_frac, 3), "rel_err": fmt_num(self.rel_err, 3, sci=True),
            "note": self.note,
        })
        return row


def fmt_num(x: float, digits: int, sci: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    return f"{x:.{digits}e}" if sci else f"{x:.{digits}f}"


def fmt_tflops(x: float) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def short_error(e: BaseException, limit: int = 400) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    if not str(e).strip():  # e.g. a bare assert: say where it failed
        tb = traceback.extract_tb(e.__traceback__)
        if tb:
            text += f" at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno} `{tb[-1].line}`"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    text = " | ".join(lines[:4])
    return text if len(text) <= limit else text[: limit - 3] + "..."


# A correctness check above this (or NaN) makes the result "wrong", not a timing (unless the op sets its
# own tolerance, OpBench.max_rel_err).
MAX_REL_ERR = 2e-2


def rel_err(got, want) -> float:
    """norm(got - want) / norm(want) over lists of arrays, in float32."""
    got = [np.asarray(g, np.float32) for g in got]
    want = [np.asarray(w, np.float32) for w in want]
    num = math.sqrt(sum(float(np.sum((g - w) ** 2)) for g, w in zip(got, want)))
    den = math.sqrt(sum(float(np.sum(w**2)) for w in want))
    return num / den if den > 0 else math.inf


def has_gpu() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def cuda_capability() -> str | None:
    """The first CUDA device's compute capability ("9.0"), "" where jax does not say, None without one."""
    if not has_gpu():
        return None
    return str(getattr(jax.devices("cuda")[0], "compute_capability", "") or "")


def random_normal_sets(shapes: Sequence[tuple], dtype, copies: int, seed: int = 0) -> list[tuple]:
    """``copies`` tuples of standard-normal arrays of ``shapes`` in ``dtype`` (never zeros)."""
    sets = [_random_set(jax.random.key(seed + i), shapes=tuple(map(tuple, shapes)), dtype=dtype)
            for i in range(copies)]
    jax.block_until_ready(sets)
    return sets


def _random_set_impl(key, shapes, dtype):
    sizes = [math.prod(s) for s in shapes]
    flat = jax.random.normal(key, (sum(sizes),), dtype)  # one generator: compiles faster
    parts = jnp.split(flat, np.cumsum(sizes)[:-1].tolist())
    return tuple(p.reshape(s) for p, s in zip(parts, shapes))


_random_set = jax.jit(_random_set_impl, static_argnames=("shapes", "dtype"))


# ----------------------------------------------------------------------------------------------
# Timing one provider, and the run over configurations x providers
# ----------------------------------------------------------------------------------------------


def time_provider(op: OpBench, provider: Provider, cfg, sets, modes, timer, check: bool) -> list[Result]:
    """Times one provider on one configuration in every mode; failures become Results."""
    if provider.per_mode is not None:
        return [r for mode in modes for r in _time_per_mode(op, provider, cfg, sets, mode, timer, check)]
    results = []
    tolerance = op.max_rel_err(cfg) if op.max_rel_err is not None else MAX_REL_ERR
    prepared = [tuple(provider.prepare(*s)) for s in sets] if provider.prepare else list(sets)
    fwd = jax.jit(provider.fn)

    for mode in modes:
        res = Result(cfg, provider.name, mode, "error", note=provider.note)
        arg_sets = []
        checks = {"fwd": (op.check_fwd,), "bwd": (op.check_bwd,), "fwd_bwd": (op.check_fwd, op.check_bwd)}.get(mode, ())
        checked = check and any(c is not None for c in checks)
        try:
            if mode == "fwd":
                arg_sets = [s[:-1] for s in prepared]
                timing = timer.measure(fwd, arg_sets)
                if check and op.check_fwd is not None:
                    res.rel_err = op.check_fwd(cfg, provider, arg_sets[0], fwd(*arg_sets[0]))
            elif mode == "bwd":
                fwd_vjp = jax.jit(lambda *args: jax.vjp(provider.fn, *args)[1])
                bwd = jax.jit(lambda vjp_fn, g: vjp_fn(g))
                # The forward runs here, untimed; its saved residuals (for XLA's attention,
                # [B, H, T, S] arrays) and the cotangent are the inputs of the timed backward. Copies
                # as for the forward, but no more than needed to pass the working-set size.
                for s in prepared:
                    arg_sets.append((fwd_vjp(*s[:-1]), s[-1]))
                    if nbytes(arg_sets) >= WORKING_SET_BYTES:
                        break
                timing = timer.measure(bwd, arg_sets)
                if check and op.check_bwd is not None:
                    res.rel_err = op.check_bwd(cfg, provider, prepared[0][:-1], prepared[0][-1],
                                               bwd(*arg_sets[0]))
            elif mode == "fwd_bwd":
                arg_sets = prepared
                # The forward's output is returned too: for an op linear in its inputs (a GEMM) the
                # gradients do not need it, and XLA would drop the forward from the timed program.
                def step(*a):
                    out, vjp_fn = jax.vjp(provider.fn, *a[:-1])
                    return out, vjp_fn(a[-1])

                step = jax.jit(step)
                timing = timer.measure(step, arg_sets)
                if checked:  # (the output and the gradients, each against its reference: the worse)
                    args, dout = prepared[0][:-1], prepared[0][-1]
                    out, grads = step(*prepared[0])
                    res.rel_err = max(
                        ([op.check_fwd(cfg, provider, args, out)] if op.check_fwd is not None else []) +
                        ([op.check_bwd(cfg, provider, args, dout, grads)] if op.check_bwd is not None else []))
            else:
                raise ValueError(f"unknown mode {mode!r}")
        except Exception as e:  # noqa: BLE001 - any failure of a provider is a result
            res.note = "; ".join(filter(None, [provider.note, short_error(e)]))
            if os.environ.get("JAX_TK_BENCH_TRACEBACK"):
                traceback.print_exc()
            results.append(res)
            continue
        finally:
            copies = len(arg_sets)
            del arg_sets
        # A provider whose results fail the check is not reported as a timing of the op.
        res.status = "ok" if not checked or res.rel_err <= tolerance else "wrong"
        res.time_ms, res.min_ms, res.max_ms = timing.median_ms, timing.min_ms, timing.max_ms
        res.reps, res.calls_per_sample = timing.reps, timing.calls_per_sample
        res.copies = copies
        res.host_frac = timing.host_frac
        res.kernels = timing.kernels
        if timing.host_frac > 0.9:
            res.note = "; ".join(filter(None, [res.note, "host-bound: dispatch kept pace with the device"]))
        results.append(res)
    return results


def _time_per_mode(op, provider, cfg, sets, mode, timer, check) -> list[Result]:
    try:
        chosen = provider.per_mode(mode)
    except Skip as e:
        return [Result(cfg, provider.name, mode, "skipped", note=str(e))]
    return time_provider(op, dataclasses.replace(chosen, name=provider.name), cfg, sets, [mode], timer, check)


def _time_with_fallback(op, provider, cfg, sets, modes, timer, check) -> list[Result]:
    out = time_provider(op, provider, cfg, sets, modes, timer, check)
    if provider.fallback is None or any(r.status != "error" for r in out):
        return out
    why = out[0].note[len(provider.note):].lstrip("; ")[:200]
    second = provider.fallback(why)
    retry = time_provider(op, second, cfg, sets, modes, timer, check)
    if any(r.status == "ok" for r in retry):
        return retry
    for r, r2 in zip(out, retry):  # keep the first error, and say that the retry failed too
        r.note += f" || retry: {r2.note[len(second.note):].lstrip('; ')}"
    return out


def _time_best_variant(op, provider, cfg, sets, modes, timer, check) -> list[Result]:
    """Per mode, the fastest ok result over ``provider.variants`` (else the first variant's failure)."""
    if not provider.variants:
        return _time_with_fallback(op, provider, cfg, sets, modes, timer, check)
    tried = [_time_with_fallback(op, v, cfg, sets, modes, timer, check) for v in provider.variants]
    best = []
    for k, mode in enumerate(modes):
        ok = [rs[k] for rs in tried if rs[k].status == "ok"]
        r = min(ok, key=lambda r: r.time_ms) if ok else tried[0][k]
        r.provider = provider.name
        if ok:
            r.note = "; ".join(filter(None, [r.note, f"fastest of {len(tried)} variants ({len(ok)} ran)"]))
        best.append(r)
    return best


def median_of_rounds(rounds: Sequence[Result]) -> Result:
    """One provider's results of the same configuration and mode over several rounds, as one: the round
    of the median time (the lower of two middle ones: a round's own figures, kernels included), with the
    min and max over every round's samples; the first round that did not run ok, if any."""
    bad = [r for r in rounds if r.status != "ok"]
    if bad:
        return bad[0]
    times = sorted(r.time_ms for r in rounds)
    mid = next(r for r in rounds if r.time_ms == times[(len(times) - 1) // 2])
    spread = (times[-1] - times[0]) / times[(len(times) - 1) // 2]
    return dataclasses.replace(
        mid, min_ms=min(r.min_ms for r in rounds), max_ms=max(r.max_ms for r in rounds), reps=sum(r.reps for r in rounds),
        note="; ".join(filter(None, [mid.note, f"median of {len(rounds)} rounds (their medians within {100 * spread:.1f}%)"])))


def log_line(r: Result) -> str:
    t = f"{r.time_ms:9.4f} ms {fmt_tflops(r.tflops):>7} TFLOP/s" if r.status == "ok" else r.status
    err = f" err={r.rel_err:.1e}" if not math.isnan(r.rel_err) else ""
    extra = f"  [{r.note}]" if r.status != "ok" and r.note else ""
    vs = f" ({r.vs_plain:.0%} of plain)" if not math.isnan(r.vs_plain) else ""
    line = f"  {r.provider:>13} {r.mode:>7}: {t}{vs}{err}{extra}"
    if r.status != "ok" or not r.kernels:
        return line
    # (--timer kernels) where the call's time goes: each kernel's median per call, the longest first
    rows = [f"{'':>17}{ms:9.4f} ms {ms / r.time_ms:4.0%}  {kernel_label(name)}"
            for name, ms in sorted(r.kernels.items(), key=lambda kv: -kv[1])]
    return "\n".join([line, *rows])


def kernel_label(name: str, width: int = 100) -> str:
    """A kernel's name, cut to ``width`` characters keeping both ends (a mangled C++ name's kind and
    its template arguments, which tell its instances apart)."""
    if len(name) <= width:
        return name
    half = (width - 2) // 2
    return name[:half] + ".." + name[-half:]


def run(op: OpBench, configs: Sequence, providers: Sequence[str], modes: Sequence[str] = DEFAULT_MODES,
        *, timer=None, check: bool = True, max_scratch_bytes: float = 20e9,
        on_result: Callable[[Result], None] | None = None,
        log: Callable[[str], None] | None = print) -> list[Result]:
    """Times every provider on every configuration, one configuration at a time (the providers see
    the same inputs, in the same process, with the same timer), in ``timer.rounds`` rounds (default 1)
    of turns, each result the median round (:func:`median_of_rounds`)."""
    timer = timer or WallTimer()
    results: list[Result] = []
    by_key: dict[tuple, Result] = {}

    def emit(r: Result):
        results.append(r)
        by_key[(r.config, r.provider, r.mode)] = r
        if op.on_result is not None:
            op.on_result(r, by_key)
        if on_result is not None:
            on_result(r)
        if log is not None:
            log(log_line(r))

    def emit_all(cfg, name, status, note):
        for mode in modes:
            emit(Result(cfg, name, mode, status, note=note))

    def made(cfg, name) -> Provider | None:  # (None: its results are emitted already)
        try:
            provider = op.make_provider(name, cfg)
        except Skip as e:
            emit_all(cfg, name, "skipped", str(e))
            return None
        except Exception as e:  # noqa: BLE001 - e.g. the Pallas module does not import
            emit_all(cfg, name, "error", short_error(e))
            return None
        if provider.scratch_bytes > max_scratch_bytes:
            emit_all(cfg, name, "skipped", "; ".join(filter(None, [
                provider.note, f"{provider.scratch_what} = {provider.scratch_bytes / 1e9:.1f} GB > "
                               f"{max_scratch_bytes / 1e9:.0f} GB"])))
            return None
        return provider

    rounds = max(1, getattr(timer, "rounds", 1))
    t_start = time.perf_counter()
    for cfg in configs:
        if log is not None:
            log(f"{cfg.label()} {getattr(cfg, 'dtype', '')}  (t={time.perf_counter() - t_start:.0f} s)")
        try:
            sets = op.make_inputs(cfg, copies_for(op.input_bytes(cfg)))
        except Skip as e:  # e.g. the inputs do not fit in memory
            for name in providers:
                emit_all(cfg, name, "skipped", str(e))
            continue
        except Exception as e:  # noqa: BLE001
            for name in providers:
                emit_all(cfg, name, "error", f"inputs: {short_error(e)}")
            continue
        if rounds == 1:  # (one provider alive at a time)
            for name in providers:
                if (provider := made(cfg, name)) is not None:
                    for r in _time_best_variant(op, provider, cfg, sets, modes, timer, check):
                        emit(r)
        else:  # the providers take turns, round after round: a drift of the machine during the
            # configuration (clocks, the host) spreads over all of them
            alive = [p for p in (made(cfg, name) for name in providers) if p is not None]
            timed = [[_time_best_variant(op, p, cfg, sets, modes, timer, check) for p in alive] for _ in range(rounds)]
            for i in range(len(alive)):
                for k in range(len(modes)):
                    emit(median_of_rounds([outs[i][k] for outs in timed]))
        del sets
    if log is not None:
        log(f"({len(configs)} configurations in {time.perf_counter() - t_start:.0f} s)")
    return results
