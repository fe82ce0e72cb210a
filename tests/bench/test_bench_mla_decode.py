"""The MLA decode benchmark (python -m benchmarks mla_decode): FLOPs and bytes of a known row, the CSV's
columns and round trip, the configuration sets of the command line, and tiny runs on CPU through the
harness and the command line (xla timed and checked; jax_tk, the kernel, skipped as unavailable
without an H100/H200)."""
import csv
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import cli, decode, decode_providers, harness, mla_decode, output

M = mla_decode.MlaDecodeConfig
TINY_TIMER = dict(reps=20, batch_ms=1, warmup_ms=1)
NO_GPU = not harness.has_gpu()
CEILING = ["--ceiling-gb", str(2**-10)]  # (a read ceiling over 1 MiB: see test_bench_decode.py)


def test_flops_and_bytes_of_a_known_row():
    c = M(8, 4096, 128)
    assert (c.head_dim, c.v_head_dim, c.kv_heads) == (576, 512, 1)
    assert c.shape_q == (8, 1, 128, 576) and c.shape_cache == (8, 4096, 1, 576)
    assert c.flops() == 2 * 8 * 128 * 1 * 4096 * (576 + 512)
    assert c.bytes() == 8 * 4096 * 576 * 2 + 8 * 1 * 128 * 576 * 2 + 8 * 1 * 128 * 512 * 2
    assert c.logits_bytes() == 8 * 128 * 1 * 4096 * 4
    # T_new = 4, causal: rows see S-3 .. S keys
    c4 = M(2, 1024, 16, new_tokens=4, page_size=64)
    assert c4.flops() == 2 * 2 * 16 * (576 + 512) * (1021 + 1022 + 1023 + 1024)
    assert c4.shape_cache == (2 * 1024 // 64, 64, 1, 576) and c4.layout == "paged64"
    assert c4.bytes() == 2 * 1024 * 576 * 2 + 2 * 4 * 16 * (576 + 512) * 2
    r = harness.Result(c, "xla", "fwd", "ok", time_ms=2.0)
    assert math.isclose(decode.tbs(r), c.bytes() / 2e-3 / 1e12)
    assert math.isclose(r.tflops, c.flops() / 2e-3 / 1e12)
    assert c != decode.DecodeConfig(8, 4096, 128, 1, 576)  # (not a decode row)
    with pytest.raises(ValueError):
        M(1, 100, 16, page_size=64)
    with pytest.raises(ValueError):
        M(1, 128, 16, sinks=True)


def test_csv_round_trip():
    c = M(132, 65536, 64, new_tokens=2, page_size=64, steps=16, ceiling_tbs=3.2)
    row = {k: str(v) for k, v in c.csv_row().items()}
    assert tuple(row) == M.CSV_FIELDS and row["v_head_dim"] == "512" and row["head_dim"] == "576"
    back = M.from_row(row)
    assert back == c and back.ceiling_tbs == 3.2


def _args(*argv):
    return cli.build_parser().parse_args(["mla_decode", *argv])


def test_configuration_sets():
    default = mla_decode.configs_from(_args())
    assert len(default) == 16 and {c.heads for c in default} == {16, 128}
    assert {(c.batch, c.cache_len, c.new_tokens) for c in default} >= {(8, 4096, 1), (64, 16384, 1)}
    assert {c.layout for c in default} == {"contiguous", "paged64"}
    full = mla_decode.configs_from(_args("--full"))
    assert len(full) == 5 * 4 * 3 * 3 * 2 and max(c.batch for c in full) == 132
    some = mla_decode.configs_from(_args("--batch", "1", "--cache", "1k,64k", "--new", "4", "--layout", "paged64",
                                         "--scan", "8"))
    assert [(c.cache_len, c.heads) for c in some] == [(1024, 16), (65536, 16), (1024, 128), (65536, 128)]
    assert all(c.page_size == 64 and c.new_tokens == 4 and c.steps == 8 for c in some)
    with pytest.raises(SystemExit):
        _args("--layout", "paged16")


def _run(configs, providers, **kw):
    return mla_decode.bench_mla_decode(configs, providers, timer=harness.WallTimer(**TINY_TIMER), log=None, **kw)


@pytest.mark.skipif(not NO_GPU, reason="the jax_tk row runs the kernel on a GPU")
def test_tiny_run_cpu(tmp_path):
    configs = [M(2, 128, 4), M(2, 128, 4, new_tokens=4), M(2, 128, 4, new_tokens=2, page_size=64)]
    results = _run(configs, ["jax_tk", "xla"])
    by = {(r.config, r.provider): r for r in results}
    for c in configs:
        tk, x = by[(c, "jax_tk")], by[(c, "xla")]
        assert tk.status == "skipped" and tk.note.startswith("unavailable:"), tk
        assert x.status == "ok" and 0 < x.rel_err < 1e-2 and x.time_ms > 0, x  # (bf16 against float32)
        assert math.isclose(x.tflops, c.flops() / (x.time_ms * 1e-3) / 1e12)
    table = mla_decode.format_table(results)
    assert "µs (TFLOP/s, TB/s)" in table and "of ceil" in table and "unavailable" in table
    if output.pyplot() is not None:
        assert mla_decode.plot(results, str(tmp_path / "mla.png"), {"gpu": "cpu"})


def test_wrong_output_is_caught(monkeypatch):
    """An xla provider reading the cache one position short is reported "wrong"."""
    real = mla_decode._mla_fn
    monkeypatch.setattr(mla_decode, "_mla_fn", lambda cfg, scale, impl: (
        lambda q, cache, lengths, table: real(cfg, scale, impl)(q, cache, lengths - 1, table)))
    r = _run([M(2, 64, 4)], ["xla"])[0]
    assert r.status == "wrong" and r.rel_err > harness.MAX_REL_ERR


def test_xla_logits_limit_and_inputs():
    c = M(2, 128, 4, new_tokens=2)
    r = _run([c], ["xla"], xla_max_bytes=c.logits_bytes() - 1)[0]
    assert r.status == "skipped" and "float32 [B, H, T_new, S] logits" in r.note
    assert [r.status for r in _run([c], ["xla"], max_bytes=1000)] == ["skipped"]
    q, cache, lengths, table, dout = mla_decode.make_inputs(M(2, 128, 4, page_size=64), 1)[0]
    assert q.shape == (2, 1, 4, 576) and cache.shape == (4, 64, 1, 576) and dout is None
    assert sorted(np.asarray(table).reshape(-1).tolist()) == [0, 1, 2, 3]
    assert np.asarray(lengths).tolist() == [128, 128] and float(jnp.std(cache.astype(jnp.float32))) > 0.5


def test_scan_of_a_narrower_output():
    """in_scan carries MLA's 512-dim output into the 576-dim query; the check reads step 0's output."""
    c = M(2, 64, 4, steps=3)
    p = mla_decode.make_provider("xla", c)
    assert "3 steps in one lax.scan" in p.note
    args = mla_decode.make_inputs(c, 1)[0][:-1]
    first, last = jax.jit(p.fn)(*args)
    one = jax.jit(decode_providers.in_scan(mla_decode._mla_fn(c, p.scale, "xla"), 1))(*args)[0]
    assert first.shape == (2, 1, 4, 512) and last.shape == (2, 1, 4, 576)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(one))
    assert not np.array_equal(np.asarray(last), np.asarray(args[0]))
    r = _run([c], ["xla"])[0]
    assert r.status == "ok" and r.rel_err < 1e-2


def test_command_line_quick(tmp_path, capsys):
    rc = cli.main(["mla_decode", "--quick", *CEILING, "--new", "1,4", "--out", str(tmp_path), "--png", "none"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "read ceiling: jnp.sum over" in out and "MLA decode" in out and "vs peer" in out
    path = tmp_path / "mla_decode.csv"
    with open(path) as f:
        header = next(csv.reader(line for line in f if not line.startswith("#")))
    assert set(M.CSV_FIELDS) <= set(header) and {"time_ms", "tflops", "flops", "rel_err"} <= set(header)
    results, _ = output.read_csv([str(path)], M.from_row)
    assert len(results) == 8  # 2 layouts x 2 T_new x 2 providers
    for r in results:
        assert r.config.ceiling_tbs > 0 and r.config.bytes() == int(
            2 * 128 * 576 * 2 + 2 * r.config.new_tokens * 4 * (576 + 512) * 2)
        if r.provider == "xla":
            assert r.status == "ok" and math.isclose(r.flops, r.config.flops(), rel_tol=1e-5)
        elif NO_GPU:
            assert r.status == "skipped" and "unavailable" in r.note
    assert cli.detect_op(str(path)).name == "mla_decode"
    assert cli.main(["report", str(path)]) == 0 and "MLA decode" in capsys.readouterr().out
