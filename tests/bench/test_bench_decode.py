"""The decode benchmark (python -m benchmarks decode): configurations and byte counts, the providers'
masks and wiring (FlashAttention-3 through a stand-in module), inputs that do not fit, and tiny runs
through the harness and the command line on CPU."""
import dataclasses
import importlib.machinery
import math
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from benchmarks import cli, decode, decode_providers, harness, output, peers

TINY_TIMER = dict(reps=20, batch_ms=1, warmup_ms=1)
C = decode.DecodeConfig
# The command line's read ceiling over 1 MiB rather than --quick's 64 MiB: the same measurement and
# output (its jnp.sum timed, the TB/s in every row), without summing 64 MiB unoptimized on a CPU for
# seconds in each run.
CEILING = ["--ceiling-gb", str(2**-10)]


def test_bytes_and_flops():
    c = C(batch=8, cache_len=4096, heads=32, kv_heads=8, head_dim=128, new_tokens=1)
    assert c.cache_bytes() == 2 * 8 * 4096 * 8 * 128 * 2
    assert c.bytes() == c.cache_bytes() + 2 * 8 * 1 * 32 * 128 * 2
    assert c.flops() == 4 * 8 * 32 * 128 * 4096
    # T_new = 4, bottom-right causal: rows see S-3, S-2, S-1, S keys
    c4 = C(2, 100, 4, 2, 64, new_tokens=4)
    assert c4.visible() == 97 + 98 + 99 + 100
    r = harness.Result(c, "xla", "fwd", "ok", time_ms=2.0)
    assert math.isclose(decode.tbs(r), c.bytes() / 2e-3 / 1e12)
    assert math.isnan(decode.tbs(harness.Result(c, "xla", "fwd", "error")))
    paged = C(4, 1024, 8, 2, 64, page_size=16)
    assert paged.shape_cache == (4 * 1024 // 16, 16, 2, 64) and paged.layout == "paged16"
    assert paged.cache_bytes() == C(4, 1024, 8, 2, 64).cache_bytes()
    with pytest.raises(ValueError):
        C(1, 100, 8, 2, 64, page_size=16)
    with pytest.raises(ValueError):
        C(1, 128, 6, 4, 64)


def test_csv_round_trip():
    c = C(3, 2048, 64, 8, 256, 4, 64, "bf16", ceiling_tbs=3.1)
    back = C.from_row({k: str(v) for k, v in c.csv_row().items()})
    assert back == c and back.ceiling_tbs == 3.1
    assert C(1, 64, 2, 2, 64, ceiling_tbs=1.0) == C(1, 64, 2, 2, 64)  # the ceiling is not identity
    s = C(3, 2048, 64, 8, 256, 4, 64, "bf16", sinks=True, ceiling_tbs=3.1)
    row = {k: str(v) for k, v in s.csv_row().items()}
    assert row["sinks"] == "True" and C.from_row(row) == s and s != C(3, 2048, 64, 8, 256, 4, 64, "bf16")
    old = {k: str(v) for k, v in c.csv_row().items() if k != "sinks"}  # a CSV from before the column
    assert C.from_row(old) == c and not C.from_row(old).sinks


def test_sinks_configs():
    c = C(8, 4096, 32, 8, 128)
    s = decode.with_sinks([c])
    assert s == [c, C(8, 4096, 32, 8, 128, sinks=True)]
    assert "sinks" in s[1].label() and "sinks" not in c.label() and s[1].bytes() == c.bytes()
    assert c.sink_values() is None
    v = s[1].sink_values()
    assert v.dtype == np.float32 and v.shape == (32,) and 0.5 < v.std() < 2  # the logits' scale
    # the same values for every configuration of a head count
    np.testing.assert_array_equal(v, C(1, 128, 32, 4, 64, new_tokens=4, page_size=16, sinks=True).sink_values())
    p = cli.build_parser()
    assert decode.configs_from(p.parse_args(["decode", "--quick", "--sinks"])) == \
        decode.with_sinks(decode.default_configs(quick=True))
    assert decode.configs_from(p.parse_args(["decode", "--batch", "2", "--cache", "1k", "--sinks"])) == \
        [C(2, 1024, 32, 8, 128), C(2, 1024, 32, 8, 128, sinks=True)]


def test_default_configs():
    configs = decode.default_configs()
    assert len(set(configs)) == len(configs)
    grid = [c for c in configs if (c.heads, c.kv_heads, c.head_dim, c.new_tokens, c.page_size) == (32, 8, 128, 1, 0)]
    assert {(c.batch, c.cache_len) for c in grid} == {(b, s) for b in decode.BATCHES for s in decode.CACHES}
    others = [c for c in configs if c not in grid]
    assert {(c.batch, c.cache_len) for c in others} == set(decode.VARIATION_POINTS)
    # every setting of the issue appears: 64/8 heads, head_dim 256, T_new 4 (and 16), pages of 16 and 64
    assert {c.heads for c in others} == {32, 64} and {c.head_dim for c in others} == {128, 256}
    assert {c.new_tokens for c in others} == {1, 4, 16} and {c.page_size for c in others} == {0, 16, 64, 256}
    quick = decode.default_configs(quick=True)
    assert max(c.bytes() for c in quick) < 2e6 and {c.page_size for c in quick} == {0, 16}


def test_cli_configs():
    p = cli.build_parser()
    args = p.parse_args(["decode", "--batch", "2,4", "--cache", "1k", "--heads", "8/2", "--layout", "paged16"])
    configs = decode.configs_from(args)
    assert [(c.batch, c.cache_len, c.heads, c.kv_heads, c.page_size) for c in configs] == \
        [(2, 1024, 8, 2, 16), (4, 1024, 8, 2, 16)]
    assert all(c.head_dim == 128 and c.new_tokens == 1 for c in configs)
    full = decode.configs_from(p.parse_args(["decode", "--full"]))
    assert len(full) == 5 * 4 * 2 * 2 * 3 * 4
    assert decode.configs_from(p.parse_args(["decode"])) == decode.default_configs()
    assert decode.heads_list("32/8,64/8,16") == [(32, 8), (64, 8), (16, 16)]


def test_bottom_right_mask_is_the_decode_visibility():
    lengths = jnp.array([0, 2, 5, 9], jnp.int32)
    mask = decode_providers.bottom_right_mask(lengths, 4, 9)
    want = jax_tk.decode.reference.visibility(lengths, 4, 9, is_causal=True)
    np.testing.assert_array_equal(np.asarray(mask[:, 0]), np.asarray(want))


def _run(configs, providers, **kw):
    return decode.bench_decode(configs, providers, timer=harness.WallTimer(**TINY_TIMER), log=None, **kw)


def test_tiny_run_cpu(tmp_path):
    configs = [C(2, 64, 4, 2, 64), C(2, 64, 4, 2, 64, new_tokens=4), C(2, 64, 4, 2, 64, page_size=16)]  # (head_dim 64: the kernel's smallest, on a GPU)
    results = _run(configs, ["jax_tk", "xla", "cudnn"])
    by = {(r.config, r.provider): r for r in results}
    for c in configs:
        assert by[(c, "jax_tk")].status == "ok" and by[(c, "jax_tk")].rel_err < 1e-2
        if jax.default_backend() == "cpu":
            assert by[(c, "cudnn")].status == "skipped"
    # xla: checked against the float32 reference, T_new = 4 through the bottom-right mask
    for c in configs[:2]:
        assert by[(c, "xla")].status == "ok" and by[(c, "xla")].rel_err < 1e-2
    assert by[(configs[2], "xla")].status == "skipped" and "unsupported" in by[(configs[2], "xla")].note
    table = decode.format_table(results)
    assert "vs peer" in table and "of ceil" in table and "unsupported" in table
    if output.pyplot() is not None:
        paths = decode.plot(results, str(tmp_path / "decode.png"), {"gpu": "cpu"})
        assert paths and (tmp_path / "decode.png").stat().st_size > 1000


# A short cache (a sink against 32 keys) and 8 query heads per key/value head: the sinks move the
# checked output by far more than the check's tolerance.
SINKS_SAMPLE = C(2, 32, 8, 1, 64, sinks=True)


def test_sinks_rows_cpu():
    """jax_tk takes the sinks and passes the check against the reference with them; the peers are
    skipped as unsupported (not timed without sinks); the table gives the sinks' cost."""
    configs = decode.with_sinks([C(2, 32, 8, 1, 64), C(2, 32, 8, 1, 64, page_size=16)])
    results = _run(configs, ["jax_tk", "xla", "cudnn", "fa3"])
    by = {(r.config, r.provider): r for r in results}
    for c in configs:
        assert by[(c, "jax_tk")].status == "ok" and by[(c, "jax_tk")].rel_err < 1e-2, by[(c, "jax_tk")]
        if c.sinks:
            assert "sinks" in by[(c, "jax_tk")].note
            for p in ("xla", "cudnn", "fa3"):
                r = by[(c, p)]
                assert r.status == "skipped" and "unsupported" in r.note and "sinks" in r.note, r
    assert by[(configs[0], "xla")].status == "ok"
    table = decode.format_table(results)
    assert "sinks cost" in table and "attention sinks" in table
    cost_rows = [ln for ln in table.splitlines()[3:] if " sinks |" in ln]  # (after the header)
    assert len(cost_rows) == 2 and all(ln.rstrip().endswith("%") for ln in cost_rows)


def test_check_sees_the_sinks(monkeypatch):
    """The reference with the sinks differs from the one without, and jax_tk with its sinks dropped is
    reported "wrong"."""
    c = SINKS_SAMPLE
    q, k, v, lengths, table, _ = decode.make_inputs(c, 1)[0]
    sinks = jnp.asarray(c.sink_values()[:8])
    with_ = decode._reference0(q, k, v, lengths, table, sinks, scale=0.125, g=8)
    without = decode._reference0(q, k, v, lengths, table, None, scale=0.125, g=8)
    assert harness.rel_err([without], [with_]) > 2 * harness.MAX_REL_ERR
    real = jax_tk.decode.attention
    monkeypatch.setattr(jax_tk.decode, "attention", lambda *a, sinks=None, **kw: real(*a, **kw))
    r = _run([c], ["jax_tk"])[0]
    assert r.status == "wrong" and r.rel_err > harness.MAX_REL_ERR


def test_wrong_provider_is_not_a_timing(monkeypatch):
    """A provider whose output is off (here: the mask one position short) is reported "wrong"."""
    real = decode_providers.bottom_right_mask
    monkeypatch.setattr(decode_providers, "bottom_right_mask", lambda lengths, t, s: real(lengths - 1, t, s))
    r = _run([C(2, 64, 4, 2, 32, new_tokens=4)], ["xla"])[0]
    assert r.status == "wrong" and r.rel_err > 2e-2


def test_inputs_that_do_not_fit_are_skipped():
    c = C(2, 64, 4, 2, 32)
    results = _run([c], ["jax_tk", "xla"], max_bytes=1000)
    assert [r.status for r in results] == ["skipped", "skipped"]
    assert "--max-gb" in results[0].note
    sets = decode.make_inputs(c, 3)
    assert len(sets) == 3 and sets[0][4] is None and sets[0][5] is None
    q, k = np.asarray(sets[0][0].astype(jnp.float32)), np.asarray(sets[0][1].astype(jnp.float32))
    assert q.std() > 0.5 and k.std() > 0.5 and not np.array_equal(q, np.asarray(sets[1][0].astype(jnp.float32)))
    paged = decode.make_inputs(C(2, 64, 4, 2, 32, page_size=16), 1)[0]
    assert paged[1].shape == (8, 16, 2, 32)
    assert sorted(np.asarray(paged[4]).reshape(-1).tolist()) == list(range(8))


def _fake_fa3(calls):
    """A stand-in for flash_attn3_jax.flash_mha_with_kvcache with its signature, computing with jax_tk's
    reference; num_splits 4 is made slow so that the fastest variant is not simply the first."""
    def flash_mha_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, cache_batch_idx=None,
                               cache_leftpad=None, page_table=None, rotary_cos=None, rotary_sin=None,
                               softmax_scale=None, is_causal=False, window_size=(-1, -1), num_splits=1,
                               return_softmax_lse=False):
        assert type(softmax_scale) is float and k is None and page_table is None or page_table.dtype == jnp.int32
        calls.append((num_splits, is_causal, page_table is not None))
        out = jax_tk.decode.reference.attention(q, k_cache, v_cache, cache_seqlens, scale=softmax_scale,
                                                page_table=page_table, is_causal=is_causal)
        if num_splits == 4:  # 100 dependent matrix products on the output (not folded away): slower than
            # the other variants on a CPU (their FLOPs) and on a GPU (a kernel each, in sequence)
            x = jnp.broadcast_to(out.reshape(-1)[:1].astype(jnp.float32), (128, 128)) + jnp.eye(128)
            x = jax.lax.fori_loop(0, 100, lambda i, x: x @ x / 128, x)
            out = out + (0 * x[0, 0]).astype(out.dtype)
        return out

    mod = types.ModuleType("flash_attn3_jax")
    mod.__spec__ = importlib.machinery.ModuleSpec("flash_attn3_jax", None)
    mod.flash_mha_with_kvcache = flash_mha_with_kvcache
    return mod


def test_fa3_best_of_num_splits_with_a_stand_in(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn3_jax", _fake_fa3(calls))
    monkeypatch.setattr(peers, "cuda_capability", lambda: "9.0")
    configs = [C(2, 64, 4, 2, 128, new_tokens=4), C(2, 64, 4, 2, 128, page_size=16), C(2, 64, 4, 2, 256)]
    results = _run(configs, ["fa3"])
    assert [r.status for r in results] == ["ok", "ok", "skipped"]
    assert "head_dim 256" in results[2].note
    assert {c[0] for c in calls} == {1, 4, 16}
    assert (1, True, False) in calls and (16, False, True) in calls  # causal for T_new > 1; the page table
    for r in results[:2]:
        assert r.provider == "fa3" and "fastest of 3 variants" in r.note and r.rel_err < 1e-2
        assert "flash_mha_with_kvcache num_splits=4" not in r.note  # (the stand-in's fastest is num_splits=1)


def test_fa3_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn3_jax", None)
    r = _run([C(1, 64, 2, 2, 128)], ["fa3"])[0]
    assert r.status == "skipped" and r.note.startswith("unavailable:")


def test_command_line_quick(tmp_path, capsys):
    rc = cli.main(["decode", "--quick", *CEILING, "--batch", "2", "--cache", "64", "--new", "1,4", "--providers",
                   "jax_tk,xla", "--out", str(tmp_path), "--png", "none"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "read ceiling: jnp.sum over" in out and "vs peer" in out
    results, _ = output.read_csv([str(tmp_path / "decode.csv")], C.from_row)
    assert len(results) == 4 and all(r.status == "ok" for r in results)
    assert all(r.config.ceiling_tbs > 0 for r in results)
    assert cli.detect_op(str(tmp_path / "decode.csv")).name == "decode"


def test_command_line_quick_sinks(tmp_path, capsys):
    rc = cli.main(["decode", "--quick", *CEILING, "--sinks", "--batch", "2", "--cache", "64", "--out", str(tmp_path),
                   "--png", "none"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "sinks cost" in out and "without and with sinks" in out
    results, _ = output.read_csv([str(tmp_path / "decode.csv")], C.from_row)
    configs = list(dict.fromkeys(r.config for r in results))
    assert configs == decode.with_sinks([C(2, 64, 4, 2, 64)])  # both rows, read back from the CSV
    tk = {r.config.sinks: r for r in results if r.provider == "jax_tk"}
    assert tk[False].status == "ok" and tk[True].status == "ok" and tk[True].rel_err < 1e-2
    assert all(r.status == "skipped" for r in results if r.config.sinks and r.provider != "jax_tk")
    merged = cli.main(["report", str(tmp_path / "decode.csv")])
    assert merged == 0 and "sinks cost" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------
# --scan N: decode steps inside one jitted lax.scan
# ----------------------------------------------------------------------------------------------


def _stub_provider(calls, sleep_s=0.0):
    """A stand-in provider: jax_tk's reference, plus a host callback per executed call that counts it
    (and sleeps ``sleep_s``, so that a call's time is known)."""
    import time

    def on_call():
        calls.append(1)
        time.sleep(sleep_s)

    def make(cfg, scale):
        def fn(q, k, v, lengths, page_table):
            jax.debug.callback(on_call)
            return jax_tk.decode.reference.attention(q, k, v, lengths, scale=scale, page_table=page_table,
                                                    is_causal=True)

        return harness.Provider("stub", fn, scale, note="stand-in")

    return make


def test_in_scan_traces_the_call_once_inside_one_scan():
    traced = []

    def fn(q, k, v, lengths, page_table):
        traced.append(1)
        return jnp.tanh(q) + jnp.sum(k) * 0.0

    q = jnp.full((1, 1, 2, 8), 0.5, jnp.float32)  # (in bf16 the update mostly rounds away: by design)
    scanned = decode_providers.in_scan(fn, 5)
    jaxpr = jax.make_jaxpr(scanned)(q, q, q, jnp.ones((1,), jnp.int32), None)
    scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) == 1 and scans[0].params["length"] == 5 and len(traced) == 1
    first, last = jax.jit(scanned)(q, q, q, jnp.ones((1,), jnp.int32), None)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(jnp.tanh(q)))  # step 0, the query unchanged
    assert not np.array_equal(np.asarray(last), np.asarray(q))  # the steps carried the output forward


def test_scan_gives_per_step_times(monkeypatch):
    """N calls run inside each timed call of a scanned configuration, its time is reported per step
    (about one call's, not N calls'), and the check reads one call's output."""
    calls = []
    monkeypatch.setitem(decode_providers.FACTORIES, "stub", _stub_provider(calls, sleep_s=0.004))
    timer = harness.WallTimer(reps=20, batch_ms=1, warmup_ms=1)
    c = C(2, 64, 4, 2, 32, new_tokens=4, steps=4)
    provider = decode.make_provider("stub", c)
    assert "4 steps in one lax.scan" in provider.note
    sets = decode.make_inputs(c, 1)
    jax.block_until_ready(jax.jit(provider.fn)(*sets[0][:-1]))
    assert len(calls) == 4  # one jitted call, N steps
    calls.clear()
    r = decode.bench_decode([c], ["stub"], timer=timer, log=None)[0]
    assert r.status == "ok" and r.rel_err < 1e-2, r
    assert len(calls) % 4 == 0 and len(calls) >= 4 * 20
    assert 3.5 < r.time_ms < 10 and r.min_ms <= r.time_ms <= r.max_ms  # ~4 ms a step, not 16
    assert "scan of 4" in decode.format_table([r]).splitlines()[0]


def test_scan_csv_round_trip():
    c = C(3, 2048, 64, 8, 256, 4, 64, "bf16", sinks=True, steps=16, ceiling_tbs=3.1)
    row = {k: str(v) for k, v in c.csv_row().items()}
    assert row["steps"] == "16" and C.from_row(row) == c
    assert c != dataclasses.replace(c, steps=1)  # the mode is part of the row's identity
    old = {k: v for k, v in row.items() if k != "steps"}  # a CSV from before the column
    assert C.from_row(old).steps == 1 and C.from_row(old) == dataclasses.replace(c, steps=1)
    assert C.from_row(dict(old, steps="")).steps == 1
    with pytest.raises(ValueError):
        C(1, 64, 2, 2, 64, steps=0)


def test_command_line_quick_scan(tmp_path, capsys):
    rc = cli.main(["decode", "--quick", *CEILING, "--scan", "4", "--batch", "2", "--cache", "64", "--new", "1,4",
                   "--providers", "jax_tk,xla", "--out", str(tmp_path), "--png", "none"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "per step inside a lax.scan of 4" in out and "per step of 4 inside one jitted lax.scan" in out
    results, _ = output.read_csv([str(tmp_path / "decode.csv")], C.from_row)
    assert len(results) == 4 and all(r.status == "ok" and r.config.steps == 4 for r in results)
    assert all(r.rel_err < 1e-2 and "4 steps in one lax.scan" in r.note for r in results)
    # a report over a per-call CSV and a scanned one: both titles' modes, a steps column
    rc = cli.main(["decode", "--quick", *CEILING, "--batch", "2", "--cache", "64", "--providers", "jax_tk",
                   "--csv", str(tmp_path / "percall.csv"), "--png", "none"])
    assert rc == 0
    capsys.readouterr()
    assert cli.main(["report", str(tmp_path / "percall.csv"), str(tmp_path / "decode.csv")]) == 0
    table = capsys.readouterr().out
    assert "lax.scan of 1 (one call a step), 4" in table and " steps |" in table
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["decode", "--scan", "0"])


def test_ragged_lengths():
    c = C(32, 16384, 32, 8, 128, ragged=True)
    n = c.lengths()
    assert n.dtype == np.int32 and n.shape == (32,) and n.min() >= 1 and n.max() <= 16384
    assert len(set(n.tolist())) > 16 and (c.lengths() == n).all()  # uneven, and the same every time
    assert c.cache_bytes() == 2 * int(n.sum()) * 8 * 128 * 2 < C(32, 16384, 32, 8, 128).cache_bytes()
    assert c.flops() == 4.0 * 32 * 128 * int(n.sum())  # T_new = 1: each row sees its sequence's keys
    t4 = C(4, 100, 4, 2, 64, new_tokens=4, ragged=True)
    assert t4.lengths().min() >= 4 and t4.flops() == 4.0 * 4 * 64 * sum(decode.visible_keys(4, int(x)) for x in t4.lengths())
    assert decode.input_bytes(c) == decode.input_bytes(C(32, 16384, 32, 8, 128))  # the whole cache is allocated
    assert "ragged" in c.label() and c != C(32, 16384, 32, 8, 128)
    row = {k: str(v) for k, v in c.csv_row().items()}
    assert row["ragged"] == "True" and C.from_row(row) == c
    assert (C(3, 64, 2, 2, 64).lengths() == 64).all()


def test_command_line_quick_ragged(tmp_path, capsys):
    """--ragged: every configuration with uneven lengths; the check runs on them (sequence 0's own length)."""
    p = cli.build_parser()
    args = p.parse_args(["decode", "--quick", "--ragged", "--batch", "3", "--cache", "256", "--providers", "jax_tk,xla"])
    configs = decode.configs_from(args)
    assert configs and all(c.ragged for c in configs)
    rc = cli.main(["decode", "--quick", *CEILING, "--ragged", "--batch", "3", "--cache", "256", "--providers",
                   "jax_tk,xla", "--out", str(tmp_path), "--png", "none"])
    out = capsys.readouterr().out
    assert rc == 0 and "ragged" in out
    results, _ = output.read_csv([str(tmp_path / "decode.csv")], C.from_row)
    assert results and all(r.config.ragged and r.status == "ok" for r in results)
    assert {r.provider for r in results} == {"jax_tk", "xla"}
