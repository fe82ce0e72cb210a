"""The benchmark harness: the subcommand registry (a toy op through the whole path) and the fa3
provider (unavailable without flash_attn3_jax; its wiring through a stand-in module, on CPU)."""
import csv
import dataclasses
import importlib.machinery
import math
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_tk import bench
from jax_tk.bench import attention_providers, cli, harness, output

TINY_TIMER = dict(reps=20, batch_ms=1, warmup_ms=1)


# ----------------------------------------------------------------------------------------------
# FlashAttention-3
# ----------------------------------------------------------------------------------------------


def test_fa3_unavailable_without_the_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn3_jax", None)  # import raises ImportError
    cfg = bench.AttentionConfig(batch=1, q_len=64, kv_len=64, heads=2, head_dim=128, causal=True)
    with pytest.raises(bench.Unavailable, match="flash_attn3_jax"):
        bench.make_provider("fa3", cfg)
    assert issubclass(bench.Unavailable, bench.Skip)
    results = bench.bench_attention([cfg], ["fa3", "xla"], ["fwd", "bwd"], log=None,
                                    timer=bench.WallTimer(**TINY_TIMER))
    by = {(r.provider, r.mode): r for r in results}
    for mode in ("fwd", "bwd"):
        assert by[("fa3", mode)].status == "skipped"
        assert by[("fa3", mode)].note.startswith("unavailable: ") and "pip install" in by[("fa3", mode)].note
        assert by[("xla", mode)].status == "ok"
    assert "fa3" not in bench.default_providers()
    assert "unavailable" in bench.format_table(results)


def _fake_fa3(calls):
    """A stand-in for flash_attn3_jax with its signatures, computing with jax_tk's reference."""
    ref = bench.reference()

    def window(w):
        return None if tuple(w) == (-1, -1) else tuple(x if x >= 0 else 1 << 30 for x in w)

    def flash_mha(q, k, v, softmax_scale=None, is_causal=False, window_size=(-1, -1)):
        assert type(softmax_scale) is float and q.ndim == k.ndim == 4  # as the real one asserts
        calls.append(("flash_mha", q.shape, k.shape, window_size))
        return ref.attention(q, k, v, scale=softmax_scale, is_causal=is_causal,
                             local_window_size=window(window_size))

    def flash_mha_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k=None, seqused_k=None, max_seqlen_q=-1,
                         max_seqlen_k=-1, softmax_scale=None, is_causal=False, window_size=(-1, -1)):
        assert q.ndim == 3 and type(softmax_scale) is float
        calls.append(("flash_mha_varlen", q.shape, max_seqlen_q))
        ids = jnp.searchsorted(cu_seqlens_q[1:], jnp.arange(q.shape[0]), side="right")[None]
        return ref.attention(q[None], k[None], v[None], scale=softmax_scale, is_causal=is_causal,
                             local_window_size=window(window_size), q_segment_ids=ids,
                             kv_segment_ids=ids)[0]

    mod = types.ModuleType("flash_attn3_jax")
    mod.__spec__ = importlib.machinery.ModuleSpec("flash_attn3_jax", None)
    mod.flash_mha, mod.flash_mha_varlen = flash_mha, flash_mha_varlen
    return mod


def test_fa3_wiring_with_a_stand_in(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn3_jax", _fake_fa3(calls))
    monkeypatch.setattr(attention_providers, "cuda_capability", lambda: "9.0")
    assert bench.default_providers()[-1] == "fa3"
    C = bench.AttentionConfig
    gqa = C(2, 64, 64, 4, 128, True, feature="gqa", kv_heads=2)
    win = C(1, 128, 128, 2, 128, True, feature="window", window=(32, 0))
    docs = C(1, 128, 128, 2, 128, False, feature="documents", documents=4)
    results = bench.bench_attention([gqa, win, docs], ["fa3"], ["fwd", "bwd"], log=None,
                                    timer=bench.WallTimer(**TINY_TIMER))
    for r in results:
        assert r.status == "ok" and r.rel_err < 2e-2, r
    assert ("flash_mha", (2, 64, 4, 128), (2, 64, 2, 128), (-1, -1)) in calls  # GQA: kv with 2 heads
    assert ("flash_mha", (1, 128, 2, 128), (1, 128, 2, 128), (32, 0)) in calls
    assert ("flash_mha_varlen", (128, 2, 128), int(docs.document_lengths().max())) in calls
    # Not built for head_dim 64, no fp32, not off Hopper: skipped, not unavailable.
    with pytest.raises(bench.Skip, match="head_dim 64") as e:
        bench.make_provider("fa3", C(1, 64, 64, 2, 64, False))
    assert not isinstance(e.value, bench.Unavailable)
    monkeypatch.setenv("JAX_TK_FA3_HEAD_DIMS", "64,128")
    assert bench.make_provider("fa3", C(1, 64, 64, 2, 64, False)).name == "fa3"
    monkeypatch.setattr(attention_providers, "cuda_capability", lambda: "10.0")
    with pytest.raises(bench.Skip, match="sm90"):
        bench.make_provider("fa3", gqa)
    monkeypatch.setattr(attention_providers, "cuda_capability", lambda: None)
    with pytest.raises(bench.Unavailable, match="CUDA GPU"):
        bench.make_provider("fa3", gqa)


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
    p = bench.build_parser()
    assert "attention" in cli.COMMANDS and bench.COMMANDS["attention"].config_type is bench.AttentionConfig
    assert p.parse_args(["report", "x.csv"]).op == "report"
    with pytest.raises(ValueError):
        cli.register(dataclasses.replace(cli.COMMANDS["attention"], name="report"))


def test_registered_op_runs_through_the_harness(toy_command, tmp_path, capsys):
    assert "toy" in bench.build_parser().format_help()
    assert bench.main(["toy", "--m", "32,64", "--out", str(tmp_path), "--png", "none"]) == 0
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
    assert bench.main(["report", str(tmp_path / "toy.csv")]) == 0
    assert "== toy fwd ==" in capsys.readouterr().out
    results, env = output.read_csv([str(tmp_path / "toy.csv")], MatmulConfig.from_row)
    assert {r.config for r in results} == {MatmulConfig(32, 64, 32), MatmulConfig(64, 64, 32)}
    assert env["platform"] == jax.devices()[0].platform


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


def test_copies_rotate_until_the_working_set_and_one_set_too_large_for_l2_is_alone():
    from jax_tk.bench import timers

    ws = timers.WORKING_SET_BYTES
    assert timers.copies_for(1) == timers.MAX_COPIES
    assert timers.copies_for(ws // 4) == 4
    assert timers.copies_for(ws // 2 + 1) == 2  # at least 2 below the working set
    assert timers.copies_for(ws) == 1
    assert timers.copies_for(40 * ws) == 1


def test_cupti_timer_holds_at_most_a_batch_of_outputs(monkeypatch):
    """The CUPTI profiler keeps all outputs of a run of calls alive: the timer splits the calls into
    runs whose outputs fit BATCH_OUTPUT_BYTES (a stand-in profiler here; the real one needs a GPU)."""
    from jax_tk.bench import timers

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
    timer._profiler, timer.reps, timer.warmup_s = Profiler, 20, 0.0
    fn = jax.jit(lambda x: x * 2)
    sets = [(jnp.ones(out_bytes // 4, jnp.float32),), (jnp.full(out_bytes // 4, 3.0, jnp.float32),)]
    timing = timer.measure(fn, sets)
    assert runs == [3, 3, 3, 1] * 2  # 10 calls per copy, at most 3 outputs alive
    assert timing.reps == 20 and timing.calls_per_sample == 10
    assert timing.min_ms == 0.5 and timing.max_ms == 2.5

    runs.clear()
    monkeypatch.setattr(timers, "BATCH_OUTPUT_BYTES", out_bytes // 2)  # one call's outputs are more
    assert timer.measure(fn, sets[:1]).reps == 20 and runs == [1] * 20
