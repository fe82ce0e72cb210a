"""The benchmark module: FLOP counting, the sweep, and a tiny end-to-end run (CPU everywhere)."""
import csv
import dataclasses
import math
import os
import subprocess
import sys

import pytest

from jax_tk import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_flops_forward():
    # Two matrix products per (batch, head): Q K^T and P V, each 2*T*S*D.
    b, t, s, h, d = 2, 256, 512, 4, 64
    assert bench.attention_flops(b, t, s, h, d, causal=False) == 2 * (2 * t * s * d) * b * h
    assert bench.attention_flops(b, t, s, h, d, causal=False) == 4 * b * h * t * s * d


def test_flops_causal_and_backward():
    args = (4, 1024, 1024, 16, 128)
    fwd = bench.attention_flops(*args, causal=False)
    assert bench.attention_flops(*args, causal=True) == fwd / 2
    assert bench.attention_flops(*args, causal=False, mode="bwd") == 2.5 * fwd
    assert bench.attention_flops(*args, causal=True, mode="bwd") == 2.5 * fwd / 2
    assert bench.attention_flops(*args, causal=False, mode="fwd_bwd") == 3.5 * fwd
    with pytest.raises(ValueError):
        bench.attention_flops(*args, causal=False, mode="sideways")


def test_flops_known_value():
    # B=8, T=S=2048, H=16, D=128: 4*8*16*2048^2*128 = 274.9 GFLOP forward.
    assert bench.attention_flops(8, 2048, 2048, 16, 128, False) == 274877906944.0


def test_result_tflops():
    cfg = bench.AttentionConfig(batch=1, q_len=1024, kv_len=1024, heads=8, head_dim=64, causal=False)
    r = bench.Result(cfg, "xla", "fwd", "ok", time_ms=1.0)
    assert math.isclose(r.tflops, cfg.flops("fwd") / 1e-3 / 1e12)
    assert math.isnan(bench.Result(cfg, "xla", "fwd", "error").tflops)


def test_default_sweep():
    configs = bench.sweep_configs(bench.DEFAULT_HEAD_DIMS, bench.DEFAULT_SEQ_LENS, [False, True])
    assert len(configs) == 2 * 2 * 6
    for c in configs:
        assert c.batch * c.q_len == 16384
        assert c.heads * c.head_dim == 2048
        assert c.q_len == c.kv_len and c.dtype == "bf16"


def test_cli_parsing():
    args = bench._parser().parse_args(
        ["attention", "--d", "64", "--seq", "1k,2048", "--causal", "true", "--providers", "xla,cudnn"])
    assert args.d == [64] and args.seq == [1024, 2048] and args.causal == [True]
    assert args.providers == ["xla", "cudnn"]
    with pytest.raises(SystemExit):
        bench._parser().parse_args(["attention", "--providers", "nope"])


def test_quick_run_cpu(tmp_path, capsys):
    # On CPU jax_tk runs its reference (implementation=None); on a GPU it would take the kernel,
    # which this tiny shape is not meant to exercise, so there only xla runs.
    providers = ["xla"] if bench.has_gpu() else ["xla", "jax_tk"]
    csv_path, png_path = tmp_path / "a.csv", tmp_path / "a.png"
    rc = bench.main(["attention", "--quick", "--seq", "64", "--providers", ",".join(providers),
                     "--csv", str(csv_path), "--png", str(png_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "== fwd" in out and "== bwd" in out
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    # 1 sequence length x 2 causal settings x providers x 2 modes.
    assert len(rows) == 2 * len(providers) * 2
    assert {r["provider"] for r in rows} == set(providers)
    assert {r["mode"] for r in rows} == {"fwd", "bwd"}
    for r in rows:
        assert r["status"] == "ok", r
        assert float(r["time_ms"]) > 0 and float(r["tflops"]) > 0
        assert int(r["reps"]) >= 20
        assert float(r["rel_err"]) < 2e-2  # both are checked against the float32 reference
        assert r["date"] and r["gpu"] and r["jax"] and r["jaxlib"] and r["commit"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not png_path.exists()
    else:
        assert png_path.stat().st_size > 0


def test_failing_provider_is_recorded(tmp_path):
    # cuDNN does not exist on CPU: the run records the error and goes on.
    cfg = bench.AttentionConfig(batch=1, q_len=64, kv_len=64, heads=2, head_dim=64, causal=True)
    if bench.has_gpu():
        pytest.skip("on a GPU cuDNN may well run")
    results = bench.bench_attention([cfg], ["cudnn", "xla"], ["fwd"], timer=bench.WallTimer(
        reps=20, batch_ms=1, warmup_ms=1), log=None)
    by = {r.provider: r for r in results}
    assert by["cudnn"].status == "error" and by["cudnn"].note
    assert by["xla"].status == "ok"


def test_script_entry_point():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "attention.py"), "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--providers" in out.stdout


def test_report_merges_csvs(tmp_path, capsys):
    cfg = bench.AttentionConfig(batch=1, q_len=64, kv_len=64, heads=2, head_dim=64, causal=False)
    cfg2 = dataclasses.replace(cfg, q_len=128, kv_len=128, causal=True)
    env = {k: "x" for k in bench.ENV_FIELDS}
    rows1 = [bench.Result(cfg, "cudnn", "fwd", "ok", time_ms=2.0, reps=20),
             bench.Result(cfg, "jax_tk", "fwd", "ok", time_ms=1.0, reps=20, rel_err=1e-3)]
    rows2 = [bench.Result(cfg2, "cudnn", "fwd", "error", note="boom"),
             bench.Result(cfg2, "jax_tk", "fwd", "ok", time_ms=4.0, reps=20)]
    bench.write_csv(rows1, str(tmp_path / "a.csv"), env)
    bench.write_csv(rows2, str(tmp_path / "b.csv"), dict(env, date="y"))
    assert bench.main(["report", str(tmp_path / "a.csv"), str(tmp_path / "b.csv"),
                       "--csv", str(tmp_path / "m.csv")]) == 0
    out = capsys.readouterr().out
    assert "2.00x" in out  # cudnn 2 ms / jax_tk 1 ms
    assert "boom" in out and "date=x / y" in out
    results, _ = bench.read_csv([str(tmp_path / "m.csv")])
    assert len(results) == 4
    got = {(r.config, r.provider): r for r in results}
    assert math.isclose(got[(cfg, "jax_tk")].tflops, cfg.flops("fwd") / 1e-3 / 1e12, rel_tol=1e-4)
    assert got[(cfg2, "cudnn")].status == "error"
