"""The linear-attention benchmark (python -m benchmarks linear_attention): the FLOP formula on known
rows, the CSV's columns and round trip, the command line's parsing, and tiny runs on CPU through the
harness and the command line (jax_tk and xla timed and checked; jla skipped as unavailable)."""
import csv
import math

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import cli, harness, linear_attention, output
from benchmarks import linear_attention_providers as lap

C = linear_attention.LinearAttentionConfig
TINY_TIMER = dict(reps=20, batch_ms=1, warmup_ms=1)
NO_GPU = not harness.has_gpu()


def test_flops_of_known_rows():
    gla = C("simple_gla", "4x4k", 4, 4096, 16, 128, 128)
    # per token and head: QK^T 2*64*128, PV 2*64*128, QS 2*128*128, K^T V 2*128*128
    assert linear_attention.flops_per_token_head("simple_gla", 128, 128) == 98304
    assert gla.flops("fwd") == 4 * 4096 * 16 * 98304
    assert gla.flops("bwd") == 2 * gla.flops() and gla.flops("fwd_bwd") == 3 * gla.flops()
    gdr = C("gated_delta_rule", "16x2k", 16, 2048, 16, 64, 64)
    per = 2 * (3 * 64 * 64 + 2 * 64 * 64 + 3 * 64 * 64) + 64 ** 3 / 3 / 64
    assert math.isclose(gdr.flops(), 16 * 2048 * 16 * per)
    assert math.isclose(linear_attention.flops_per_token_head("gated_delta_rule", 128, 128), 180224 + 4096 / 3)
    r = harness.Result(gla, "xla", "fwd", "ok", time_ms=2.0)
    assert math.isclose(r.tflops, gla.flops() / 2e-3 / 1e12)
    assert gla.value_heads == 16 and gla.scale == 128 ** -0.5
    assert gla.shape_qk == (4, 4096, 16, 128) and gla.shape_v == (4, 4096, 16, 128) and gla.shape_gate == (4, 4096, 16)
    with pytest.raises(ValueError):
        C("gla", "x", 1, 64, 2, 64, 64)
    with pytest.raises(ValueError):
        C("simple_gla", "x", 1, 64, 2, 64, 64, value_heads=3)


def test_csv_round_trip():
    c = C("gated_delta_rule", "1x32k", 1, 32768, 32, 128, 128, value_heads=64)
    row = {k: str(v) for k, v in c.csv_row().items()}
    assert tuple(row) == C.CSV_FIELDS and row["op"] == "gated_delta_rule" and row["chunk"] == "64"
    assert C.from_row(row) == c


def _args(*argv):
    return cli.build_parser().parse_args(["linear_attention", *argv])


def test_command_line_parsing():
    default = linear_attention.configs_from(_args())
    assert [(c.shape, c.op) for c in default] == [(s, op) for s in ("4x4k", "1x32k", "16x2k")
                                                  for op in ("gated_delta_rule", "simple_gla")]
    assert {(c.batch, c.seq_len, c.heads, c.head_dim, c.v_head_dim) for c in default} == {
        (4, 4096, 16, 128, 128), (1, 32768, 32, 128, 128), (16, 2048, 16, 64, 64)}
    some = linear_attention.configs_from(_args("--ops", "simple_gla", "--shapes", "1x32k,16x2k"))
    assert [(c.op, c.shape) for c in some] == [("simple_gla", "1x32k"), ("simple_gla", "16x2k")]
    quick = linear_attention.configs_from(_args("--quick", "--shapes", "4x4k"))
    assert [(c.batch, c.seq_len, c.heads, c.head_dim) for c in quick] == [(1, 256, 2, 64)] * 2
    a = _args("--providers", "jax_tk,jla", "--modes", "fwd,fwd_bwd", "--no-check", "--timer", "cupti", "--out", "x")
    assert a.providers == ["jax_tk", "jla"] and a.modes == ["fwd", "fwd_bwd"] and a.no_check and a.timer == "cupti"
    for bad in (["--ops", "gla"], ["--shapes", "8x8k"], ["--providers", "fla"], ["--modes", "bwd2"]):
        with pytest.raises(SystemExit):
            _args(*bad)
    assert linear_attention.default_providers()[:2] == ["jax_tk", "xla"]  # (then jla where installed)


def test_inputs():
    c = C("gated_delta_rule", "t", 2, 128, 2, 64, 32, value_heads=4)
    sets = linear_attention.make_inputs(c, 2)
    assert len(sets) == 2
    q, k, v, g, beta, dout = sets[0]
    assert q.shape == k.shape == (2, 128, 2, 64) and v.shape == dout.shape == (2, 128, 4, 32)
    assert q.dtype == jnp.bfloat16 and g.dtype == beta.dtype == jnp.float32 and g.shape == beta.shape == (2, 128, 4)
    g, beta = np.asarray(g), np.asarray(beta)
    assert g.max() <= 0 and g.min() >= -linear_attention.DECAY and 0 < beta.min() and beta.max() < 1
    assert not np.array_equal(np.asarray(sets[0][0]), np.asarray(sets[1][0]))
    assert len(linear_attention.make_inputs(C("simple_gla", "t", 1, 64, 2, 64, 64), 1)[0]) == 5
    assert linear_attention.input_bytes(c) == 2 * 2 * 128 * 2 * 64 * 2 + 2 * 2 * 128 * 4 * 32 * 2 + 2 * 2 * 128 * 4 * 4


@pytest.mark.skipif(not NO_GPU, reason="on a GPU jla may run")
def test_tiny_run_cpu(tmp_path):
    configs = [C(op, "tiny", 1, 128, 2, 64, 64) for op in lap.OPS]
    results = linear_attention.bench_linear_attention(configs, ["jax_tk", "xla", "jla"], ["fwd", "bwd", "fwd_bwd"],
                                                      timer=harness.WallTimer(**TINY_TIMER), log=None)
    by = {(r.config, r.provider, r.mode): r for r in results}
    for c in configs:
        for p in ("jax_tk", "xla"):
            for mode in ("fwd", "bwd"):
                r = by[(c, p, mode)]
                assert r.status == "ok" and 0 < r.rel_err < 1e-2 and r.time_ms > 0, r  # (bf16 against float32)
            assert by[(c, p, "fwd_bwd")].status == "ok"
        jla = by[(c, "jla", "fwd")]
        assert jla.status == "skipped" and jla.note.startswith("unavailable:"), jla
    table = linear_attention.format_table(results)
    assert all(word in table for word in ("tk/best", "unavailable", "gated_delta_rule", "simple_gla"))
    png = str(tmp_path / "la.png")
    assert linear_attention.plot(results, png, {"gpu": "cpu"}) == ([png] if output.pyplot() else [])


def test_wrong_output_is_caught(monkeypatch):
    """An xla provider that drops the decay is reported "wrong", in fwd and in bwd."""
    real = lap._jax_tk_call

    def no_decay(op, impl):
        call = real(op, impl)
        return (lambda q, k, v, g, *rest, **kw: call(q, k, v, g * 0, *rest, **kw)) if impl == "xla" else call

    c = C("simple_gla", "tiny", 1, 128, 2, 64, 64)
    sets = linear_attention.make_inputs(c, 1)
    monkeypatch.setattr(lap, "_jax_tk_call", no_decay)
    p = lap.make_provider("xla", c)
    monkeypatch.setattr(lap, "_jax_tk_call", real)
    results = harness.time_provider(linear_attention.BENCH, p, c, sets, ["fwd", "bwd"],
                                    harness.WallTimer(**TINY_TIMER), True)
    assert [r.status for r in results] == ["wrong", "wrong"] and all(r.rel_err > harness.MAX_REL_ERR for r in results)


def test_command_line_quick(tmp_path, capsys):
    rc = cli.main(["linear_attention", "--quick", "--providers", "jax_tk,xla,jla", "--out", str(tmp_path),
                   "--png", "none", "--reps", "20"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "linear attention, fwd" in out and "linear attention, fwd_bwd" in out and "tk/best" in out
    path = tmp_path / "linear_attention.csv"
    with open(path) as f:
        header = next(csv.reader(f))
    assert set(C.CSV_FIELDS) <= set(header) and {"time_ms", "tflops", "flops", "rel_err", "note"} <= set(header)
    results, _ = output.read_csv([str(path)], C.from_row)
    assert len(results) == 2 * 3 * 2  # 2 ops x 3 providers x 2 modes
    for r in results:
        assert (r.config.batch, r.config.seq_len, r.config.heads, r.config.head_dim) == (1, 256, 2, 64)
        if r.provider in ("jax_tk", "xla"):
            assert r.status == "ok" and math.isclose(r.flops, r.config.flops(r.mode), rel_tol=1e-5)
            if r.mode == "fwd":
                assert r.rel_err < 1e-2
        elif NO_GPU:
            assert r.status == "skipped" and "unavailable" in r.note and "pip install jax-linear-attention" in r.note
    assert cli.detect_op(str(path)).name == "linear_attention"
    assert cli.main(["report", str(path)]) == 0 and "linear attention" in capsys.readouterr().out
