"""The grouped and dense GEMM benchmarks (benchmarks/gemm.py: ragged_dot, matmul): shapes, FLOP counts,
group sizes, the correctness checks, and tiny end-to-end runs on the CPU (CSV, table, report)."""
import csv

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import cli, gemm, harness
from benchmarks.gemm import GemmConfig


def test_shapes_of_the_issue():
    assert gemm.RAGGED_SHAPES == {"mixtral": (16384, 4096, 14336, 8), "qwen": (16384, 2048, 1408, 64),
                                 "deepseek": (32768, 7168, 2048, 64), "deepseek-v3": (131072, 7168, 2048, 256)}
    assert gemm.MATMUL_SHAPES["cube8k"] == (8192, 8192, 8192)
    assert set(gemm.MATMUL_SHAPES) == {"cube8k", *gemm.RAGGED_SHAPES}
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
