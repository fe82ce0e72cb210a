"""The benchmark harness: the subcommand registry (a toy op through the whole path), wrong results,
the timers, and the package's shape (outside the wheel, no private jax, no import loops)."""
import ast
import csv
import dataclasses
import math
import pathlib
import statistics
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import attention_configs, cli, harness, output, timers
from helpers import REPO

TINY_TIMER = dict(reps=20, batch_ms=1, warmup_ms=1)


# ----------------------------------------------------------------------------------------------
# The registry: a toy op (matrix product) through the harness, CSV, table and report
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    m: int
    k: int
    n: int
    dtype: str = "bf16"

    CSV_FIELDS = ("dtype", "m", "k", "n")

    def flops(self, mode):
        return 2.0 * self.m * self.k * self.n * {"fwd": 1, "bwd": 2, "fwd_bwd": 3}[mode]

    def label(self):
        return f"m={self.m} k={self.k} n={self.n}"

    def csv_row(self):
        return {"dtype": self.dtype, "m": self.m, "k": self.k, "n": self.n}

    @classmethod
    def from_row(cls, row):
        return cls(int(row["m"]), int(row["k"]), int(row["n"]), row["dtype"])


def _matmul_provider(name, cfg):
    if name == "missing":
        raise harness.Unavailable("not installed")
    return harness.Provider(name, lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype))


def _check(cfg, provider, args, out):
    a, b = (np.asarray(x, np.float32) for x in args)
    return harness.rel_err([out], [a @ b])


TOY_OP = harness.OpBench(
    make_provider=_matmul_provider, input_bytes=lambda c: 2 * (c.m * c.k + c.k * c.n + c.m * c.n),
    make_inputs=lambda c, copies: harness.random_normal_sets([(c.m, c.k), (c.k, c.n), (c.m, c.n)],
                                                             jnp.bfloat16, copies),
    check_fwd=_check)


def _toy_table(results, providers=None):
    providers = providers or list(dict.fromkeys(r.provider for r in results))
    by_key = {(r.config, r.provider, r.mode): r for r in results}
    configs = list(dict.fromkeys(r.config for r in results))
    lines = []
    for mode in dict.fromkeys(r.mode for r in results):
        lines += output.format_grid(f"== toy {mode} ==", [("m", 5, lambda c, m: c.m)], configs, providers,
                                    mode, by_key, lambda r: f"{r.time_ms:.3f}", " ms", 12)
    return "\n".join(lines + output.format_problems(results))


def _toy_add_arguments(p):
    p.add_argument("--m", type=cli.int_list, default=[64])
    cli.add_common_arguments(p, op="toy", providers=("xla", "missing"), default_providers="xla,missing",
                             modes=harness.MODES, default_modes=harness.DEFAULT_MODES,
                             dtypes={"bf16": None}, quick_help="-")


def _toy_run(args):
    env = output.environment(args.timer)
    csv_path, png_path = cli.output_paths(args, "toy")
    providers = args.providers or ["xla", "missing"]
    configs = [MatmulConfig(m, 64, 32) for m in args.m]
    run = lambda **kw: harness.run(TOY_OP, configs, providers, args.modes or ["fwd", "bwd"],
                                   timer=harness.WallTimer(**TINY_TIMER), **kw)
    return cli.run_and_write(cli.COMMANDS["toy"], env=env, header=["# toy"], csv_path=csv_path,
                             png_path=png_path, providers=providers, bench=run)


@pytest.fixture
def toy_command():
    cmd = cli.register(cli.Command("toy", "a matrix product", _toy_add_arguments, _toy_run,
                                   config_type=MatmulConfig, format_table=_toy_table,
                                   plot=lambda results, path, env: []))
    yield cmd
    cli.COMMANDS.pop("toy", None)


def test_registry_has_attention_and_report():
    p = cli.build_parser()
    assert "attention" in cli.COMMANDS and cli.COMMANDS["attention"].config_type is attention_configs.AttentionConfig
    assert {"decode", "ragged_dot", "matmul"} <= set(cli.COMMANDS)
    assert p.parse_args(["report", "x.csv"]).op == "report"
    with pytest.raises(ValueError):
        cli.register(dataclasses.replace(cli.COMMANDS["attention"], name="report"))


def test_registered_op_runs_through_the_harness(toy_command, tmp_path, capsys):
    assert "toy" in cli.build_parser().format_help()
    assert cli.main(["toy", "--m", "32,64", "--out", str(tmp_path), "--png", "none"]) == 0
    out = capsys.readouterr().out
    assert "== toy fwd ==" in out and "== toy bwd ==" in out and "unavailable: not installed" in out
    with open(tmp_path / "toy.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(harness.csv_fields(MatmulConfig))
    assert len(rows) == 2 * 2 * 2  # configurations x providers x modes
    for r in rows:
        if r["provider"] == "missing":
            assert r["status"] == "skipped" and r["note"].startswith("unavailable")
            continue
        assert r["status"] == "ok" and float(r["tflops"]) > 0 and int(r["reps"]) >= 20
        assert math.isclose(float(r["flops"]), MatmulConfig(int(r["m"]), 64, 32).flops(r["mode"]), rel_tol=1e-5)
        if r["mode"] == "fwd":
            assert float(r["rel_err"]) < 1e-2
    # report finds the op from the CSV's columns (the attention columns are not there).
    assert cli.main(["report", str(tmp_path / "toy.csv")]) == 0
    assert "== toy fwd ==" in capsys.readouterr().out
    results, env = output.read_csv([str(tmp_path / "toy.csv")], MatmulConfig.from_row)
    assert {r.config for r in results} == {MatmulConfig(32, 64, 32), MatmulConfig(64, 64, 32)}
    assert env["platform"] == jax.devices()[0].platform


class _ScriptedTimer:
    """Gives the times (ms) in the order it is asked (None: the measurement fails); ``rounds`` as
    timers.make_timer sets it."""

    def __init__(self, times, rounds):
        self.times, self.rounds = iter(times), rounds

    def measure(self, fn, arg_sets):
        t = next(self.times)
        if t is None:
            raise RuntimeError("this round failed")
        return timers.Timing(t, t - 0.5, t + 0.5, 20, 1, 0.1)


def test_rounds_take_turns_and_report_the_median_round():
    """With rounds, the providers of a configuration take turns (a, b, a, b, ...), and each result is
    its median round, with the min and max of every round; a round that failed is the result."""
    cfg, op = MatmulConfig(16, 32, 8), dataclasses.replace(TOY_OP, check_fwd=None)
    # in turns, a gets 5, 1, 3 and b 50, 10, 30 (one provider after the other would give a 5, 50, 1)
    results = harness.run(op, [cfg], ["a", "b"], ["fwd"], timer=_ScriptedTimer([5, 50, 1, 10, 3, 30], 3), log=None)
    by = {r.provider: r for r in results}
    assert len(results) == 2 and by["a"].status == by["b"].status == "ok"
    assert (by["a"].time_ms, by["a"].min_ms, by["a"].max_ms, by["a"].reps) == (3, 0.5, 5.5, 60)
    assert by["b"].time_ms == 30 and "median of 3 rounds (their medians within 133.3%)" in by["b"].note
    assert timers.make_timer("wall", 20, rounds=3).rounds == 3 and timers.make_timer("cupti", 20).rounds == 1
    (r,) = harness.run(op, [cfg], ["a"], ["fwd"], timer=_ScriptedTimer([5, None, 3], 3), log=None)
    assert r.status == "error" and "this round failed" in r.note


def test_wrong_results_are_not_timings(capsys):
    """A provider whose results fail the correctness check is reported as "wrong", not as a timing."""
    def make(name, cfg):
        if name == "broken":
            return harness.Provider(name, lambda a, b: (jnp.dot(a, b) * 1.5).astype(a.dtype))
        return _matmul_provider(name, cfg)

    op = dataclasses.replace(TOY_OP, make_provider=make)
    results = harness.run(op, [MatmulConfig(32, 64, 32)], ["xla", "broken"], ["fwd"],
                          timer=harness.WallTimer(**TINY_TIMER), log=None)
    status = {r.provider: r.status for r in results}
    assert status == {"xla": "ok", "broken": "wrong"}
    text = "\n".join(output.format_problems(results))
    assert "Wrong results" in text and "broken fwd" in text


def test_wrong_gradients_are_not_timings():
    """A provider whose forward is right and whose gradients are wrong is "wrong" in bwd and in
    fwd_bwd (both the output and the gradients are checked there), and "ok" in fwd."""
    @jax.custom_vjp
    def bad_grads(a, b):
        return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)

    bad_grads.defvjp(lambda a, b: (bad_grads(a, b), (a, b)),
                     lambda res, g: (2 * (g @ res[1].T).astype(res[0].dtype), (res[0].T @ g).astype(res[1].dtype)))

    def check_bwd(cfg, provider, args, dout, grads):
        a, b, d = (np.asarray(x, np.float32) for x in (*args, dout))
        return harness.rel_err(grads, [d @ b.T, a.T @ d])

    def make(name, cfg):
        return harness.Provider(name, bad_grads) if name == "bad_grads" else _matmul_provider(name, cfg)

    op = dataclasses.replace(TOY_OP, make_provider=make, check_bwd=check_bwd)
    results = harness.run(op, [MatmulConfig(32, 64, 16)], ["xla", "bad_grads"], ["fwd", "bwd", "fwd_bwd"],
                          timer=harness.WallTimer(**TINY_TIMER), log=None)
    status = {(r.provider, r.mode): r.status for r in results}
    assert status == {("xla", "fwd"): "ok", ("xla", "bwd"): "ok", ("xla", "fwd_bwd"): "ok",
                      ("bad_grads", "fwd"): "ok", ("bad_grads", "bwd"): "wrong", ("bad_grads", "fwd_bwd"): "wrong"}


def test_copies_rotate_until_the_working_set_and_one_set_too_large_for_l2_is_alone():
    
    ws = timers.WORKING_SET_BYTES
    assert timers.copies_for(1) == timers.MAX_COPIES
    assert timers.copies_for(ws // 4) == 4
    assert timers.copies_for(ws // 2 + 1) == 2  # at least 2 below the working set
    assert timers.copies_for(ws) == 1
    assert timers.copies_for(40 * ws) == 1


def test_cupti_timer_holds_at_most_a_batch_of_outputs(monkeypatch):
    """The CUPTI profiler keeps all outputs of a run of calls alive: the timer splits the calls into
    runs whose outputs fit BATCH_OUTPUT_BYTES (a stand-in profiler here; the real one needs a GPU)."""
    
    runs = []

    class Profiler:  # the interface of jax.experimental.mosaic.gpu.profiler.measure
        @staticmethod
        def measure(fn, *, iterations):
            def wrapper(*args):
                outs = [fn(*args) for _ in range(iterations)]
                runs.append(iterations)
                ts = [0.5 + i for i in range(iterations)]
                return outs[0], ts if iterations > 1 else ts[0]
            return wrapper

    out_bytes = 4 * 1024
    monkeypatch.setattr(timers, "BATCH_OUTPUT_BYTES", 3 * out_bytes)
    timer = object.__new__(timers.CuptiTimer)
    timer._profiler, timer.reps, timer.warmup_s, timer.per_kernel = Profiler, 20, 0.0, False
    fn = jax.jit(lambda x: x * 2)
    sets = [(jnp.ones(out_bytes // 4, jnp.float32),), (jnp.full(out_bytes // 4, 3.0, jnp.float32),)]
    timing = timer.measure(fn, sets)
    assert runs == [3, 3, 3, 1] * 2  # 10 calls per copy, at most 3 outputs alive
    assert timing.reps == 20 and timing.calls_per_sample == 10
    assert timing.min_ms == 0.5 and timing.max_ms == 2.5

    runs.clear()
    monkeypatch.setattr(timers, "BATCH_OUTPUT_BYTES", out_bytes // 2)  # one call's outputs are more
    assert timer.measure(fn, sets[:1]).reps == 20 and runs == [1] * 20


def test_cupti_timer_per_kernel():
    """--timer kernels: each kernel's median time per call (a kernel launched twice in a call summed),
    the calls' totals as the samples; the log line lists the kernels under it, the longest first."""
    class Profiler:  # measure(..., aggregate=False): per call, (kernel name, ms) in launch order
        @staticmethod
        def measure(fn, *, iterations, aggregate):
            assert aggregate is False

            def wrapper(*args):
                out = fn(*args)
                calls = [[("gemm", 1.0 + i), ("quantize", 0.25), ("gemm", 0.5)] for i in range(iterations)]
                return out, calls if iterations > 1 else calls[0]
            return wrapper

    timer = timers.make_timer("kernels", 20, quick=True)  # (a CPU jaxlib has the profiler module too)
    timer._profiler, timer.warmup_s = Profiler, 0.0
    assert timer.name == "kernels"
    timing = timer.measure(jax.jit(lambda x: x + 1), [(jnp.ones(8),)])
    assert timing.reps == 20 and timing.min_ms == 1.75 and timing.max_ms == 20.75
    assert timing.kernels == {"gemm": statistics.median(1.5 + i for i in range(20)), "quantize": 0.25}
    r = harness.Result(None, "jax_tk", "fwd", "ok", time_ms=timing.median_ms, kernels=timing.kernels)
    r.config = types.SimpleNamespace(flops=lambda mode: 1e9)
    lines = harness.log_line(r).splitlines()
    assert len(lines) == 3 and "gemm" in lines[1] and "quantize" in lines[2] and "98%" in lines[1]
    assert harness.kernel_label("k" * 60 + "x" * 60, 20) == "k" * 9 + ".." + "x" * 9


# ----------------------------------------------------------------------------------------------
# The package's shape
# ----------------------------------------------------------------------------------------------


PACKAGE = REPO / "benchmarks"


def _modules() -> dict[str, pathlib.Path]:
    return {p.stem: p for p in sorted(PACKAGE.glob("*.py"))}


def _imports(path: pathlib.Path) -> set[str]:
    """The modules ``path`` imports (dotted names; ``from a import b`` gives a and a.b), at the top or
    inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def _package_imports(path: pathlib.Path, modules) -> set[str]:
    """The package's modules that ``path`` imports."""
    return {n.split(".")[1] for n in _imports(path) if n.startswith("benchmarks.") and n.split(".")[1] in modules}


def test_no_import_loops():
    modules = _modules()
    graph = {m: _package_imports(p, modules) - {m} for m, p in modules.items()}
    assert graph["__init__"] == set()  # importing the package imports none of its modules
    assert graph["timers"] == set() and graph["harness"] == {"timers"}
    state = {}

    def visit(m, path):
        if state.get(m) == "done":
            return
        assert state.get(m) != "open", f"import loop: {' -> '.join(path + [m])}"
        state[m] = "open"
        for n in sorted(graph[m]):
            visit(n, path + [m])
        state[m] = "done"

    for m in graph:
        visit(m, [])


def test_no_private_jax():
    for path in sorted(PACKAGE.rglob("*")):
        if path.is_file() and path.suffix in (".py", ".md"):
            assert "jax._src" not in path.read_text(), path


def test_outside_the_wheel():
    if not (REPO / "pyproject.toml").is_file():
        pytest.skip("reads the package's sources: needs a source checkout (not a copy of tests/ beside a wheel)")
    text = (REPO / "pyproject.toml").read_text()
    assert 'wheel.packages = ["jax_tk"]' in text
    assert not list((REPO / "jax_tk" / "bench").glob("*.py"))  # (a stale __pycache__ may stay behind)
    for path in (REPO / "jax_tk").rglob("*.py"):  # the library never needs its benchmark
        assert not {n for n in _imports(path) if n.split(".")[0] == "benchmarks"}, path
