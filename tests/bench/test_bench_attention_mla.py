"""MLA's rows in the attention benchmark (python -m benchmarks attention --features mla): query/key head
dim 192 and value head dim 128. Their configurations, FLOPs, CSV columns (old CSVs without
``v_head_dim``), the value's shape as the providers receive it, the correctness check on CPU, the
table, and the command line."""
import csv
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from benchmarks import attention, cli, harness, output, timers
from benchmarks import attention_configs
from benchmarks import attention_providers as providers
from benchmarks import attention_report as report

C = attention_configs.AttentionConfig
TINY_TIMER = dict(reps=20, batch_ms=1, warmup_ms=1)
# A tiny MLA row: causal, query/key 192, value 128, as many key/value heads as query heads.
TINY = C(2, 64, 64, 2, 192, True, feature="mla", v_head_dim=128)


def _run(cfgs, names, modes=("fwd", "bwd", "fwd_bwd"), **kw):
    return attention.bench_attention(cfgs, names, list(modes), log=None, timer=timers.WallTimer(**TINY_TIMER), **kw)


def _tk_stand_in(monkeypatch, calls):
    """jax_tk.attention replaced by the reference, recording the shapes it is given (for the wiring
    tests, whether or not the library takes MLA's head dims yet)."""
    ref = attention.reference()

    def fake(q, k, v, bias=None, mask=None, *, scale=None, is_causal=False, implementation=None, **kw):
        calls.append((q.shape, k.shape, v.shape, scale, is_causal))
        return ref.attention(q, k, v, bias=bias, mask=mask, scale=scale, is_causal=is_causal, **kw)

    monkeypatch.setattr(jax_tk, "attention", fake)


# ----------------------------------------------------------------------------------------------
# FLOPs
# ----------------------------------------------------------------------------------------------


def test_flops_with_a_value_head_dim_of_its_own():
    b, t, s, h = 2, 256, 512, 4
    flops = attention_configs.attention_flops
    # Q K^T: 2*T*S*D; P V: 2*T*S*Dv.
    assert flops(b, t, s, h, 192, False, v_head_dim=128) == b * h * (2 * t * s * 192 + 2 * t * s * 128)
    assert flops(b, t, s, h, 192, False, v_head_dim=128) == 2 * b * h * t * s * (192 + 128)
    assert flops(b, t, s, h, 192, True, v_head_dim=128) == flops(b, t, s, h, 192, False, v_head_dim=128) / 2
    for mode, factor in (("bwd", 2.5), ("fwd_bwd", 3.5)):
        assert flops(b, t, s, h, 192, True, mode, 128) == factor * flops(b, t, s, h, 192, True, "fwd", 128)
    # Equal head dims: the standard 4*B*H*T*S*D, given or not.
    assert flops(b, t, s, h, 128, False, v_head_dim=128) == flops(b, t, s, h, 128, False) == 4 * b * h * t * s * 128
    with pytest.raises(ValueError):
        flops(b, t, s, h, 192, False, "sideways", 128)


def test_useful_flops_of_mla_rows():
    useful = attention_configs.useful_flops
    assert useful(16, 192, 1000, "fwd", 128) == 2 * 16 * (192 + 128) * 1000
    assert useful(16, 128, 1000) == useful(16, 128, 1000, v_head_dim=128) == 4 * 16 * 128 * 1000
    assert useful(16, 192, 1000, "bwd", 128) == 2.5 * useful(16, 192, 1000, "fwd", 128)
    # An MLA row counts its causal pairs exactly: B=4, T=S=4096, H=16.
    c = C(4, 4096, 4096, 16, 192, True, feature="mla", v_head_dim=128)
    visible = 4 * 4096 * 4097 // 2
    assert c.visible() == visible
    assert c.flops("fwd") == 2 * 16 * 320 * visible
    assert c.flops("fwd_bwd") == 3.5 * c.flops("fwd")
    # Within 0.03% of the standard count (T^2 / 2 pairs), and 5/4 of the D = 128 row's.
    std = attention_configs.attention_flops(4, 4096, 4096, 16, 192, True, v_head_dim=128)
    assert abs(c.flops("fwd") / std - 1) < 3e-4
    assert math.isclose(c.flops("fwd") / C(4, 4096, 4096, 16, 128, True, feature="mla").flops("fwd"), 320 / 256)
    # The sweep's path (no feature) counts the standard way with both head dims.
    assert C(4, 4096, 4096, 16, 192, True, v_head_dim=128).flops("bwd") == 2.5 * std


# ----------------------------------------------------------------------------------------------
# Configurations
# ----------------------------------------------------------------------------------------------


def test_mla_configs_are_the_issues_rows():
    rows = attention_configs.feature_configs(["mla"])
    assert len(rows) == 8 and all(c.feature == "mla" for c in rows)  # no plain baselines
    assert sorted((c.heads, c.q_len) for c in rows) == [
        (h, t) for h in (16, 128) for t in (2048, 4096, 8192, 16384)]
    for c in rows:
        assert c.causal and c.q_len == c.kv_len and c.batch * c.q_len == 16384 and c.dtype == "bf16"
        assert (c.head_dim, c.v_head_dim, c.kv_heads) == (192, 128, c.heads) and c.mla
        assert c.shape_q == (c.batch, c.q_len, c.heads, 192)
        assert c.shape_kv == (c.batch, c.q_len, c.heads, 192)
        assert c.shape_v == (c.batch, c.q_len, c.heads, 128)
        assert c.shape_out == (c.batch, c.q_len, c.heads, 128)
        assert "D=192/128" in c.label() and c.label().startswith("[mla]")
        assert not attention_configs.has_baseline(c)
    assert rows == attention_configs.mla_configs()
    # Causal only; their own head dims whatever --d says, once.
    assert attention_configs.feature_configs(["mla"], [False]) == []
    assert attention_configs.feature_configs(["mla"], head_dims=[64, 128]) == rows
    # Beside other features: only the others get plain rows.
    mixed = attention_configs.feature_configs(["sinks", "mla"])
    assert [c.feature for c in mixed].count("plain") == 2 and mixed[-8:] == rows


def test_value_head_dim_is_normalized_and_part_of_the_identity():
    plain = C(1, 128, 128, 2, 128, True)
    assert plain.v_head_dim == 128 and not plain.mla and plain.shape_v == plain.shape_kv
    assert plain.shape_out == plain.shape_q and plain.d_label == "128" and "D=128 " in plain.label()
    assert C(1, 128, 128, 2, 128, True, v_head_dim=128) == plain
    assert C(1, 128, 128, 2, 192, True, v_head_dim=128) != C(1, 128, 128, 2, 192, True)
    assert TINY.d_label == "192/128"


def test_quick_mla_sizes():
    rows = attention_configs.mla_configs(attention_configs.QUICK_FEATURE_SIZES)
    assert rows == [C(4, 128, 128, 2, 192, True, feature="mla", v_head_dim=128)]


# ----------------------------------------------------------------------------------------------
# CSV
# ----------------------------------------------------------------------------------------------


def test_csv_round_trip_and_old_csvs(tmp_path):
    assert "v_head_dim" in C.CSV_FIELDS
    row = {k: str(v) for k, v in TINY.csv_row().items()}
    assert row["v_head_dim"] == "128" and row["head_dim"] == "192" and row["feature"] == "mla"
    assert C.from_row(row) == TINY
    # A CSV from before the column: its rows had equal head dims.
    plain = C(2, 64, 64, 2, 128, True, feature="gqa", kv_heads=1)
    old = {k: str(v) for k, v in plain.csv_row().items() if k != "v_head_dim"}
    assert C.from_row(old) == plain and C.from_row(old).v_head_dim == 128
    # Whole files: written, read back, and an old file (no v_head_dim column) read by `report`.
    env = {k: "x" for k in harness.ENV_FIELDS}
    results = [harness.Result(TINY, "jax_tk", "fwd", "ok", time_ms=1.0, reps=20),
               harness.Result(TINY, "xla", "fwd", "ok", time_ms=2.0, reps=20)]
    output.write_csv(results, str(tmp_path / "new.csv"), env, output.csv_fields(C))
    back, _ = report.read_csv([str(tmp_path / "new.csv")])
    assert [r.config for r in back] == [TINY, TINY]
    assert math.isclose(back[0].tflops, TINY.flops("fwd") / 1e-3 / 1e12, rel_tol=1e-4)
    output.write_csv([harness.Result(plain, "jax_tk", "fwd", "ok", time_ms=1.0, reps=20)],
                     str(tmp_path / "plain.csv"), env, output.csv_fields(C))
    with open(tmp_path / "plain.csv") as f, open(tmp_path / "old.csv", "w", newline="") as g:
        rows = list(csv.DictReader(f))
        w = csv.DictWriter(g, [k for k in rows[0] if k != "v_head_dim"], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    assert "v_head_dim" not in output.csv_header(str(tmp_path / "old.csv"))
    assert cli.detect_op(str(tmp_path / "old.csv")).name == "attention"
    (old_result,), _ = report.read_csv([str(tmp_path / "old.csv")])
    assert old_result.config == plain and old_result.config.v_head_dim == 128


# ----------------------------------------------------------------------------------------------
# Inputs, providers, the check
# ----------------------------------------------------------------------------------------------


def test_inputs_have_the_values_head_dim():
    assert attention._input_shapes(TINY) == [(2, 64, 2, 192), (2, 64, 2, 192), (2, 64, 2, 128), (2, 64, 2, 128)]
    (q, k, v, dout), = attention._random_inputs(TINY, 1)
    assert v.shape == dout.shape == (2, 64, 2, 128) and float(jnp.std(v.astype(jnp.float32))) > 0.5
    assert attention._input_bytes(TINY) == 2 * (2 * 64 * 2 * (192 + 192 + 128 + 128))


def test_providers_receive_the_value_as_it_is(monkeypatch):
    """jax_tk gets v [B, S, K, 128] and scale 1/sqrt(192); the check (forward, backward: dq, dk, dv)
    passes against the reference with the same shapes; the output cotangent is [B, T, N, 128]."""
    calls = []
    _tk_stand_in(monkeypatch, calls)
    results = _run([TINY], ["jax_tk"])
    assert [r.status for r in results] == ["ok"] * 3, results
    assert all(r.rel_err < 1e-2 for r in results if r.mode != "fwd_bwd")
    assert {c[:3] for c in calls} == {((2, 64, 2, 192), (2, 64, 2, 192), (2, 64, 2, 128))}
    assert {c[3:] for c in calls} == {(1 / math.sqrt(192), True)}


def test_the_check_runs_at_mlas_shapes(monkeypatch):
    """A provider whose output is off (here: the scale doubled) is "wrong", not a timing: the check
    compares [B, T, N, 128] outputs with the reference's."""
    ref = attention.reference()

    def off(q, k, v, bias=None, mask=None, *, scale=None, is_causal=False, implementation=None, **kw):
        return ref.attention(q, k, v, scale=scale * 2, is_causal=is_causal)  # the wrong scale

    monkeypatch.setattr(jax_tk, "attention", off)
    r = _run([TINY], ["jax_tk"], ["fwd"])[0]
    assert r.status == "wrong" and r.rel_err > harness.MAX_REL_ERR


def test_jax_tk_on_cpu_takes_mla():
    """jax_tk itself (implementation=None: its reference on CPU), forward and backward, against the
    check."""
    results = _run([TINY], ["jax_tk", "jax_tk_auto"])
    for r in results:
        assert r.status == "ok" and (r.mode == "fwd_bwd" or r.rel_err < 1e-2), r


def test_jax_nn_rows_pad_the_value():
    """jax.nn.dot_product_attention takes one head dim for key and value: the xla and cudnn rows give it
    the value zero-padded to 192 and cut the output back to 128 (in the timed call), and the xla row
    matches the reference, forward and backward."""
    spec = lambda d: jax.ShapeDtypeStruct((1, 64, 2, d), jnp.bfloat16)
    with pytest.raises(ValueError, match="value shape"):
        jax.eval_shape(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla"),
                       spec(192), spec(192), spec(128))
    for name in ("xla", "cudnn"):  # (cuDNN's own call needs a GPU: only its note here)
        p = providers.make_provider(name, TINY)
        assert "zero-padded to head dim 192" in p.note and p.scale == 1 / math.sqrt(192)
    assert jax.eval_shape(providers.make_provider("xla", TINY).fn, spec(192), spec(192), spec(128)).shape == (1, 64, 2, 128)
    assert providers.make_provider("xla", TINY).materializes_logits
    results = _run([TINY], ["xla"])
    for r in results:
        assert r.status == "ok" and (r.mode == "fwd_bwd" or r.rel_err < 1e-2), r
    skipped = _run([TINY], ["xla"], ["fwd"], xla_max_bytes=1)[0]
    assert skipped.status == "skipped" and "GB" in skipped.note
    # Equal head dims: jax.nn as it is.
    assert "padded" not in providers.make_provider("xla", C(2, 64, 64, 2, 128, True)).note


def test_providers_without_unequal_head_dims_skip():
    for name in ("pallas", "pallas_triton", "cudnn_packed"):
        with pytest.raises(harness.Skip) as e:
            providers.make_provider(name, TINY)
        assert not isinstance(e.value, harness.Unavailable)
    with pytest.raises(harness.Skip, match="one head dim"):
        providers.make_provider("pallas", TINY)


# ----------------------------------------------------------------------------------------------
# The table and the command line
# ----------------------------------------------------------------------------------------------


def test_table_gives_the_speed_up_over_the_fastest_peer():
    other = C(1, 128, 128, 16, 192, True, feature="mla", v_head_dim=128)
    rs = [harness.Result(TINY, "jax_tk", "fwd", "ok", time_ms=1.0),
          harness.Result(TINY, "jax_tk_auto", "fwd", "ok", time_ms=0.5),  # not a peer
          harness.Result(TINY, "cudnn", "fwd", "ok", time_ms=1.5),
          harness.Result(TINY, "jla", "fwd", "ok", time_ms=1.25),
          harness.Result(TINY, "xla", "fwd", "ok", time_ms=9.0),
          harness.Result(TINY, "fa3", "fwd", "skipped", note="head_dim 192"),
          harness.Result(other, "jax_tk", "fwd", "ok", time_ms=2.0),
          harness.Result(other, "cudnn", "fwd", "error", note="boom")]
    by = {(r.config, r.provider, r.mode): r for r in rs}
    assert report.vs_best_peer(by, TINY, "fwd") == "1.25x jla"
    assert report.vs_best_peer(by, other, "fwd") == "-"
    for r in rs:
        report.set_vs_plain(r, by)
        assert math.isnan(r.vs_plain)  # no plain rows
    table = report.format_table(rs)
    assert "== mla, fwd" in table and "tk/best" in table and "1.25x jla" in table and "== features" not in table
    (line,) = [ln for ln in table.splitlines() if "1.25x jla" in ln]
    assert f"1.000 ({harness.fmt_tflops(TINY.flops('fwd') / 1e-3 / 1e12)})" in line
    assert "boom" in table


def test_command_line(tmp_path, capsys):
    p = cli.build_parser()
    assert p.parse_args(["attention", "--features", "mla"]).features == ["mla"]
    assert "mla" in p.parse_args(["attention", "--features"]).features
    assert providers.feature_providers(["mla"])[:3] == ["jax_tk", "cudnn", "xla"]
    assert providers.feature_providers(["gqa", "mla"]) == list(providers.FEATURE_PROVIDERS)
    rc = cli.main(["attention", "--features", "mla", "--quick", "--seq", "64", "--tokens", "128",
                   "--providers", "xla,pallas", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "== mla, fwd:" in out and "== mla, fwd_bwd:" in out and "== mla, bwd" not in out  # MLA's modes
    with open(tmp_path / "attention_features.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 2  # one configuration x two providers x two modes
    for r in rows:
        assert (r["feature"], r["head_dim"], r["v_head_dim"]) == ("mla", "192", "128")
        assert (r["batch"], r["q_len"], r["heads"], r["kv_heads"], r["causal"]) == ("2", "64", "2", "2", "True")
        if r["provider"] == "pallas":
            assert r["status"] == "skipped", r
            continue
        assert r["status"] == "ok" and float(r["tflops"]) > 0 and r["vs_plain"] == "", r
        assert math.isclose(float(r["flops"]), TINY.flops(r["mode"]), rel_tol=1e-5)
    assert cli.main(["report", str(tmp_path / "attention_features.csv")]) == 0
    assert "== mla, fwd_bwd:" in capsys.readouterr().out
    # --modes still chooses.
    rc = cli.main(["attention", "--features", "mla", "--quick", "--seq", "64", "--tokens", "128",
                   "--providers", "xla", "--modes", "bwd", "--png", "none", "--out", str(tmp_path / "b")])
    assert rc == 0 and "== mla, bwd:" in capsys.readouterr().out
