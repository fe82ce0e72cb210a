"""The grouped and dense GEMM benchmarks (benchmarks/gemm.py: ragged_dot, matmul): shapes, FLOP counts,
group sizes, the correctness checks, and tiny end-to-end runs on the CPU (CSV, table, report)."""
import csv
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import cli, gemm, gemm_fp8_providers, gemm_providers, harness, peers, timers
from benchmarks.gemm import GemmConfig
from test_bench_peers import _module


def test_shapes_of_the_issue():
    assert gemm.RAGGED_SHAPES == {
        "mixtral": (16384, 4096, 14336, 8, 2), "qwen": (16384, 2048, 1408, 64, 4),
        "deepseek": (32768, 7168, 2048, 64, 8), "deepseek-v3": (131072, 7168, 2048, 256, 8),
        "qwen3-up": (65536, 2048, 1536, 128, 8), "qwen3-down": (65536, 768, 2048, 128, 8),
        "gpt-oss": (32768, 2880, 5760, 128, 4), "olmoe": (65536, 2048, 2048, 64, 8),
        "mixtral-8x22b": (16384, 6144, 16384, 8, 2)}
    for m, k, n, g, top_k in gemm.RAGGED_SHAPES.values():  # (whole tokens; the FP8 kernel's k and n)
        assert m % top_k == 0 and k % 16 == 0 and n % 8 == 0
    # the issue's dense rows: 8192^3, odd sizes (partial tiles at every edge), few rows; then the
    # grouped shapes without their groups
    assert {n: gemm.MATMUL_SHAPES[n] for n in ("cube8k", "odd", "skinny")} == {
        "cube8k": (8192, 8192, 8192), "odd": (3000, 5000, 7000), "skinny": (128, 8192, 8192)}
    assert list(gemm.MATMUL_SHAPES) == ["cube8k", "odd", "skinny", *gemm.RAGGED_SHAPES]
    assert all(gemm.MATMUL_SHAPES[n] == s[:3] for n, s in gemm.RAGGED_SHAPES.items())
    for m, k, n in gemm.MATMUL_SHAPES.values():  # (the bf16 kernel's k and n)
        assert k % 8 == 0 and n % 8 == 0
    assert {"ragged_dot", "matmul"} <= set(cli.load_ops())


def test_flops():
    c = GemmConfig("x", 16384, 4096, 14336, 8, "uniform")
    assert c.flops("fwd") == 2 * 16384 * 4096 * 14336
    assert c.flops("bwd") == 2 * c.flops("fwd") and c.flops("fwd_bwd") == 3 * c.flops("fwd")
    with pytest.raises(ValueError):
        c.flops("sideways")


@pytest.mark.parametrize("m,g", [(16384, 8), (131072, 256), (1000, 7)])
def test_group_sizes(m, g):
    u = gemm.group_sizes(m, g, "uniform")
    assert u.sum() == m and u.max() - u.min() <= 1 and u.dtype == np.int32
    d = gemm.group_sizes(m, g, "dirichlet", seed=0)
    assert d.sum() == m and len(d) == g and (d >= 0).all()
    assert (d == gemm.group_sizes(m, g, "dirichlet", seed=0)).all()  # fixed seed
    assert d.max() > 1.5 * m / g  # skewed
    with pytest.raises(ValueError):
        gemm.group_sizes(m, g, "zipf")


@pytest.mark.parametrize("m,g,top_k", [(65536, 128, 8), (16384, 8, 2), (96, 7, 3)])
def test_routed_group_sizes(m, g, top_k):
    """Routed sizes: every token's top_k rows counted once per chosen group (at most m / top_k per
    group), fixed by the seed, and uneven (the per-expert bias)."""
    r = gemm.group_sizes(m, g, "routed", seed=1, top_k=top_k)
    assert r.sum() == m and len(r) == g and r.dtype == np.int32 and (r >= 0).all()
    assert r.max() <= m // top_k
    assert (r == gemm.group_sizes(m, g, "routed", seed=1, top_k=top_k)).all()
    if m >= 16384:
        assert r.max() > 1.25 * m / g and r.min() < 0.8 * m / g
    with pytest.raises(ValueError, match="divide m"):
        gemm.group_sizes(m + 1, g, "routed", top_k=top_k)
    with pytest.raises(ValueError, match="top_k"):
        gemm.group_sizes(m, g, "routed", top_k=g + 1)


def test_default_group_sizes_uniform_and_routed(tmp_path):
    """Without --dist, every shape runs with uniform and routed group sizes (the issue's rows)."""
    assert gemm.DEFAULT_DISTRIBUTIONS == ("uniform", "routed")
    if harness.has_gpu():
        pytest.skip("the CPU run")
    assert cli.main(["ragged_dot", "--quick", "--modes", "fwd", "--providers", "dense", "--no-check",
                     "--out", str(tmp_path), "--png", "none"]) == 0
    rows = _rows(tmp_path / "ragged_dot.csv")
    assert [(r["name"], r["dist"]) for r in rows] == [(name, d) for name in gemm.RAGGED_QUICK_SHAPES
                                                      for d in ("uniform", "routed")]
    assert all(r["status"] == "ok" for r in rows), rows


def test_routed_configs():
    (c,) = gemm.ragged_configs(gemm.RAGGED_SHAPES, ["qwen3-up"], ["routed"])
    assert (c.m, c.groups, c.top_k, c.dist) == (65536, 128, 8, "routed")
    assert c.label() == "qwen3-up 65536x2048->1536 g=128 routed top-8"
    assert GemmConfig.from_row({k: str(v) for k, v in c.csv_row().items()}) == c
    row = {k: str(v) for k, v in c.csv_row().items() if k != "top_k"}  # (a CSV from before top_k)
    assert GemmConfig.from_row(row).top_k == 1


def test_config_csv_round_trip():
    c = GemmConfig("qwen", 16384, 2048, 1408, 64, "dirichlet", "fp16", 3)
    assert GemmConfig.from_row({k: str(v) for k, v in c.csv_row().items()}) == c


def test_checks_catch_wrong_results():
    cfg = GemmConfig("t", 300, 16, 24, 5, "dirichlet")
    lhs, rhs, sizes, dout = gemm.make_inputs(cfg, 1)[0]
    out = jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)
    assert gemm.check_fwd(cfg, lhs, rhs, out) < 1e-6
    assert gemm.check_fwd(cfg, lhs, rhs, out.at[3].add(1.0)) > 1e-3
    dl, dr = jax.grad(lambda a, b: jnp.sum(jax.lax.ragged_dot(a, b, sizes, preferred_element_type=jnp.float32)
                                           * dout.astype(jnp.float32)), argnums=(0, 1))(
        lhs.astype(jnp.float32), rhs.astype(jnp.float32))
    assert gemm.check_bwd(cfg, lhs, rhs, dout, dl, dr) < 1e-6
    assert gemm.check_bwd(cfg, lhs, rhs, dout, dl, dr * 1.1) > 1e-3


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("op,providers", [("ragged_dot", ("jax_tk", "lax", "dense")), ("matmul", ("jax_tk", "xla"))])
def test_quick_run_cpu(op, providers, tmp_path, capsys):
    if harness.has_gpu():
        pytest.skip("the CPU run")
    out = tmp_path / "out"
    dist = ["--dist", "dirichlet"] if op == "ragged_dot" else []  # (skewed group sizes; uniform ones as well
    # would double the test's compiles)
    assert cli.main([op, "--quick", "--modes", "fwd,bwd", "--providers", ",".join(providers), *dist,
                     "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "== fwd" in text and "== bwd" in text and "tk/" in text
    rows = _rows(out / f"{op}.csv")
    configs = len(gemm.RAGGED_QUICK_SHAPES) if op == "ragged_dot" else len(gemm.MATMUL_QUICK_SHAPES)
    assert len(rows) == configs * len(providers) * 2
    for r in rows:
        assert r["status"] == "ok", r
        assert float(r["time_ms"]) > 0 and float(r["tflops"]) > 0
        assert float(r["rel_err"]) < 1e-2
    assert cli.main(["report", str(out / f"{op}.csv"), "--op", op]) == 0
    assert "== fwd" in capsys.readouterr().out


def test_ratio_columns():
    c = GemmConfig("t", 64, 8, 8, 2, "uniform")
    rs = [harness.Result(c, "jax_tk", "fwd", "ok", time_ms=1.0), harness.Result(c, "lax", "fwd", "ok", time_ms=2.0),
          harness.Result(c, "dense", "fwd", "ok", time_ms=0.5)]
    table = gemm.RAGGED_DOT.format_table(rs, ["jax_tk", "lax", "dense"])
    assert "2.00x" in table and "0.50x" in table


# ----------------------------------------------------------------------------------------------
# FP8 (--dtype fp8): bf16 inputs that each provider quantizes; checked against the unquantized product
# ----------------------------------------------------------------------------------------------

TINY_TIMER = dict(reps=20, batch_ms=1, warmup_ms=1)
FP8_RAGGED = GemmConfig("t", 256, 192, 128, 4, "dirichlet", "fp8")  # k: one whole 128-block, one ragged
FP8_MATMUL = GemmConfig("t", 128, 192, 96, dtype="fp8")


def _bench(op, cfg, providers, modes):
    bench = gemm.bench_ragged_dot if op == "ragged_dot" else gemm.bench_matmul
    return bench([cfg], providers, list(modes), log=None, timer=timers.WallTimer(**TINY_TIMER))


def test_fp8_option():
    assert "fp8" in gemm.DTYPES and gemm.DTYPES["fp8"] == jnp.bfloat16  # inputs in bf16
    assert FP8_RAGGED.flops("fwd") == GemmConfig("t", 256, 192, 128, 4, "dirichlet").flops("fwd")
    assert FP8_RAGGED.max_rel_err() == gemm.FP8_MAX_REL_ERR == 2.0**-4
    assert GemmConfig("t", 8, 8, 8).max_rel_err() == harness.MAX_REL_ERR
    # Every provider name has an FP8 provider (or an FP8 skip).
    assert set(gemm_fp8_providers.RAGGED_FACTORIES) == set(gemm_providers.RAGGED_FACTORIES)
    assert set(gemm_fp8_providers.MATMUL_FACTORIES) == set(gemm_providers.MATMUL_FACTORIES)


# (fwd_bwd, not checked, runs the same code as fwd and bwd: timed on the dense GEMM only, to keep it quick)
@pytest.mark.parametrize("op,provider", [("ragged_dot", "jax_tk"), ("ragged_dot", "lax"), ("ragged_dot", "dense"),
                                         ("matmul", "jax_tk"), ("matmul", "xla")])
def test_fp8_providers_pass_their_check(op, provider):
    if harness.has_gpu():
        pytest.skip("the CPU run")
    modes = ("fwd", "bwd") if op == "ragged_dot" else ("fwd", "bwd", "fwd_bwd")
    results = _bench(op, FP8_RAGGED if op == "ragged_dot" else FP8_MATMUL, [provider], modes)
    assert [(r.provider, r.mode) for r in results] == [(provider, m) for m in modes]
    for r in results:
        assert r.status == "ok" and r.time_ms > 0, (r.mode, r.note)
        if r.mode != "fwd_bwd":
            # Quantized: above bf16's error (about 4e-3), within FP8's (about 0.036 forward, 0.026 backward).
            assert 1e-2 < r.rel_err <= gemm.FP8_MAX_REL_ERR, (r.mode, r.rel_err)


def test_fp8_command_line(tmp_path, capsys):
    if harness.has_gpu():
        pytest.skip("the CPU run")
    assert cli.main(["matmul", "--quick", "--dtype", "fp8", "--modes", "fwd", "--providers", "xla",
                     "--out", str(tmp_path), "--png", "none"]) == 0
    assert "# fp8: bf16 inputs, quantized to float8_e4m3fn by each provider" in capsys.readouterr().out
    rows = _rows(tmp_path / "matmul.csv")
    assert len(rows) == len(gemm.MATMUL_QUICK_SHAPES)
    assert all(r["dtype"] == "fp8" and r["status"] == "ok" for r in rows), rows


def test_fp8_check_catches_wrong_products(monkeypatch):
    """The FP8 tolerance passes an unquantized product and fails a wrong one (a dropped scale, a
    scale 10% off, a transposed operand); a wrong provider is recorded as "wrong", not timed."""
    cfg = GemmConfig("t", 128, 96, 96, dtype="fp8")
    lhs, rhs, _, _ = gemm.make_inputs(cfg, 1)[0]
    a, b = gemm_fp8_providers.per_tensor_fp8(lhs), gemm_fp8_providers.per_tensor_fp8(rhs[0])
    dot = lambda x, y: jax.lax.dot_general(x, y, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    right = gemm_fp8_providers._dot_fp8(a, b)
    assert gemm.check_fwd(cfg, lhs, rhs[0], right) <= gemm.FP8_MAX_REL_ERR
    assert gemm.check_fwd(cfg, lhs, rhs[0], jnp.dot(lhs, rhs[0])) <= gemm.FP8_MAX_REL_ERR  # unquantized: passes
    for wrong in (dot(a[0], b[0]) * a[1],  # b's scale dropped
                  right * 1.1,  # a scale 10% off
                  gemm_fp8_providers._dot_fp8(a, b, b_kn=False)):  # b [k, n] read as [n, k] (k = n here)
        assert gemm.check_fwd(cfg, lhs, rhs[0], wrong) > gemm.FP8_MAX_REL_ERR

    quantize = gemm_fp8_providers.per_tensor_fp8
    no_scales = harness.Provider("jax_tk", lambda x, y: dot(quantize(x)[0], quantize(y)[0]),
                                 prepare=gemm_providers._first_group)
    monkeypatch.setitem(gemm_fp8_providers.MATMUL_FACTORIES, "jax_tk", lambda cfg: no_scales)
    (r,) = _bench("matmul", cfg, ["jax_tk"], ["fwd"])
    assert r.status == "wrong" and r.rel_err > 10, r


def _fake_jla_fp8(monkeypatch, calls, supported=True):
    """jla.ops.mosaic_gpu.ragged_dot_fp8 as documented: float8 lhs [M, K] and rhs_t [G, N, K], no
    scales, float32 accumulation, bf16 out."""
    def supports_fp8(lhs, rhs_t, group_sizes):
        calls.append(("supports", lhs.shape, lhs.dtype, rhs_t.shape, rhs_t.dtype))
        return supported

    def ragged_dot_fp8(lhs, rhs_t, group_sizes):
        assert lhs.dtype == rhs_t.dtype == jnp.float8_e4m3fn
        calls.append(("ragged_dot_fp8", lhs.shape, rhs_t.shape))
        out = jax.lax.ragged_dot(lhs.astype(jnp.float32), jnp.swapaxes(rhs_t, 1, 2).astype(jnp.float32), group_sizes)
        return out.astype(jnp.bfloat16)

    kernels = _module("jla.ops.mosaic_gpu.ragged_dot_fp8", supports_fp8=supports_fp8, ragged_dot_fp8=ragged_dot_fp8)
    for name, mod in [("jla", _module("jla")), ("jla.ops", _module("jla.ops")),
                      ("jla.ops.mosaic_gpu", _module("jla.ops.mosaic_gpu")),
                      ("jla.ops.mosaic_gpu.ragged_dot_fp8", kernels)]:
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(peers, "cuda_capability", lambda: "9.0")




def test_fp8_jla_with_a_stand_in(monkeypatch):
    """jla's FP8 kernel gets float8 operands, the weights as [G, N, K]; forward only."""
    calls = []
    _fake_jla_fp8(monkeypatch, calls)
    fwd, bwd = _bench("ragged_dot", FP8_RAGGED, ["jla"], ("fwd", "bwd"))
    assert fwd.status == "ok" and 1e-2 < fwd.rel_err <= gemm.FP8_MAX_REL_ERR, fwd
    assert bwd.status == "skipped" and "forward only" in bwd.note
    assert calls[0] == ("supports", (256, 192), jnp.float8_e4m3fn, (4, 128, 192), jnp.float8_e4m3fn)
    assert ("ragged_dot_fp8", (256, 192), (4, 128, 192)) in calls
    _fake_jla_fp8(monkeypatch, [], supported=False)
    with pytest.raises(harness.Skip, match="supports_fp8 rejects"):
        gemm_fp8_providers.RAGGED_FACTORIES["jla"](FP8_RAGGED)


def test_fp8_tokamax_is_skipped_with_the_reason():
    r = _bench("ragged_dot", FP8_RAGGED, ["tokamax"], ("fwd",))[0]
    assert r.status == "skipped" and "no FP8 GEMM on Hopper" in r.note
