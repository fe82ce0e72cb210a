"""The attention benchmark (python -m benchmarks attention): FLOP counting, the sweep, the feature rows,
the providers' options, and tiny end-to-end runs (CPU everywhere)."""
import csv
import dataclasses
import math
import subprocess
import sys

import numpy as np
import pytest

from helpers import REPO
from benchmarks import attention, cli, harness, output, timers
from benchmarks import attention_configs
from benchmarks import attention_providers as providers
from benchmarks import attention_report as report

ROOT = str(REPO)


def test_flops_forward():
    # Two matrix products per (batch, head): Q K^T and P V, each 2*T*S*D.
    b, t, s, h, d = 2, 256, 512, 4, 64
    assert attention_configs.attention_flops(b, t, s, h, d, causal=False) == 2 * (2 * t * s * d) * b * h
    assert attention_configs.attention_flops(b, t, s, h, d, causal=False) == 4 * b * h * t * s * d


def test_flops_causal_and_backward():
    args = (4, 1024, 1024, 16, 128)
    fwd = attention_configs.attention_flops(*args, causal=False)
    assert attention_configs.attention_flops(*args, causal=True) == fwd / 2
    assert attention_configs.attention_flops(*args, causal=False, mode="bwd") == 2.5 * fwd
    assert attention_configs.attention_flops(*args, causal=True, mode="bwd") == 2.5 * fwd / 2
    assert attention_configs.attention_flops(*args, causal=False, mode="fwd_bwd") == 3.5 * fwd
    with pytest.raises(ValueError):
        attention_configs.attention_flops(*args, causal=False, mode="sideways")


def test_flops_known_value():
    # B=8, T=S=2048, H=16, D=128: 4*8*16*2048^2*128 = 274.9 GFLOP forward.
    assert attention_configs.attention_flops(8, 2048, 2048, 16, 128, False) == 274877906944.0


def test_result_tflops():
    cfg = attention_configs.AttentionConfig(batch=1, q_len=1024, kv_len=1024, heads=8, head_dim=64, causal=False)
    r = harness.Result(cfg, "xla", "fwd", "ok", time_ms=1.0)
    assert math.isclose(r.tflops, cfg.flops("fwd") / 1e-3 / 1e12)
    assert math.isnan(harness.Result(cfg, "xla", "fwd", "error").tflops)


def test_default_sweep():
    configs = attention_configs.sweep_configs(attention_configs.DEFAULT_HEAD_DIMS, attention_configs.DEFAULT_SEQ_LENS, [False, True])
    assert len(configs) == 2 * 2 * 6
    for c in configs:
        assert c.batch * c.q_len == 16384
        assert c.heads * c.head_dim == 2048
        assert c.q_len == c.kv_len and c.dtype == "bf16"


def test_cli_parsing():
    args = cli.build_parser().parse_args(
        ["attention", "--d", "64", "--seq", "1k,2048", "--causal", "true", "--providers", "xla,cudnn"])
    assert args.d == [64] and args.seq == [1024, 2048] and args.causal == [True]
    assert args.providers == ["xla", "cudnn"]
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["attention", "--providers", "nope"])


def test_quick_run_cpu(tmp_path, capsys):
    # On CPU jax_tk runs its reference (implementation=None); on a GPU it would take the kernel,
    # which this tiny shape is not meant to exercise, so there only xla runs.
    providers = ["xla"] if harness.has_gpu() else ["xla", "jax_tk"]
    csv_path, png_path = tmp_path / "a.csv", tmp_path / "a.png"
    rc = cli.main(["attention", "--quick", "--seq", "64", "--providers", ",".join(providers),
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
    cfg = attention_configs.AttentionConfig(batch=1, q_len=64, kv_len=64, heads=2, head_dim=64, causal=True)
    if harness.has_gpu():
        pytest.skip("on a GPU cuDNN may well run")
    results = attention.bench_attention([cfg], ["cudnn", "xla"], ["fwd"], timer=timers.WallTimer(
        reps=20, batch_ms=1, warmup_ms=1), log=None)
    by = {r.provider: r for r in results}
    assert by["cudnn"].status == "error" and by["cudnn"].note
    assert by["xla"].status == "ok"


def test_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "benchmarks", "attention", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--providers" in out.stdout


def test_report_merges_csvs(tmp_path, capsys):
    cfg = attention_configs.AttentionConfig(batch=1, q_len=64, kv_len=64, heads=2, head_dim=64, causal=False)
    cfg2 = dataclasses.replace(cfg, q_len=128, kv_len=128, causal=True)
    env = {k: "x" for k in harness.ENV_FIELDS}
    rows1 = [harness.Result(cfg, "cudnn", "fwd", "ok", time_ms=2.0, reps=20),
             harness.Result(cfg, "jax_tk", "fwd", "ok", time_ms=1.0, reps=20, rel_err=1e-3)]
    rows2 = [harness.Result(cfg2, "cudnn", "fwd", "error", note="boom"),
             harness.Result(cfg2, "jax_tk", "fwd", "ok", time_ms=4.0, reps=20)]
    output.write_csv(rows1, str(tmp_path / "a.csv"), env)
    output.write_csv(rows2, str(tmp_path / "b.csv"), dict(env, date="y"))
    assert cli.main(["report", str(tmp_path / "a.csv"), str(tmp_path / "b.csv"),
                       "--csv", str(tmp_path / "m.csv")]) == 0
    out = capsys.readouterr().out
    assert "2.00x" in out  # cudnn 2 ms / jax_tk 1 ms
    assert "boom" in out and "date=x / y" in out
    results, _ = report.read_csv([str(tmp_path / "m.csv")])
    assert len(results) == 4
    got = {(r.config, r.provider): r for r in results}
    assert math.isclose(got[(cfg, "jax_tk")].tflops, cfg.flops("fwd") / 1e-3 / 1e12, rel_tol=1e-4)
    assert got[(cfg2, "cudnn")].status == "error"


# ----------------------------------------------------------------------------------------------
# Feature rows (issue #4): grouped KV, sliding window, packed documents; useful FLOPs; plain baselines
# ----------------------------------------------------------------------------------------------


def _brute_mask(t, s, *, causal=False, window=None, q_ids=None, kv_ids=None, q_lens=None, kv_lens=None,
                batch=1):
    """[batch, t, s] boolean visibility, spelled out element by element (the oracle)."""
    import numpy as np

    if q_ids is not None:
        batch = len(q_ids)
    elif q_lens is not None:
        batch = len(q_lens)
    m = np.zeros((batch, t, s), bool)
    for b in range(batch):
        for i in range(t):
            for j in range(s):
                ok = True
                if causal and j > i:
                    ok = False
                if window is not None and not (i - window[0] <= j <= i + window[1]):
                    ok = False
                if q_ids is not None and q_ids[b][i] != kv_ids[b][j]:
                    ok = False
                if q_lens is not None and i >= q_lens[b]:
                    ok = False
                if kv_lens is not None and j >= kv_lens[b]:
                    ok = False
                m[b, i, j] = ok
    return m


@pytest.mark.parametrize("t,s", [(37, 37), (24, 53), (61, 19)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, (0, 0), (5, 0), (3, 7), (100, 100)])
def test_visible_pairs_causal_window(t, s, causal, window):
    want = int(_brute_mask(t, s, causal=causal, window=window).sum())
    assert attention_configs.visible_pairs(t, s, causal=causal, window=window) == want
    assert attention_configs.visible_pairs(t, s, causal=causal, window=window, batch=3) == 3 * want


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, (6, 0), (4, 2)])
@pytest.mark.parametrize("contiguous", [True, False])
def test_visible_pairs_segments(causal, window, contiguous):
    import numpy as np

    rng = np.random.default_rng(1)
    t = 48
    if contiguous:  # packed documents
        ids = attention_configs.segment_ids_from_lengths(attention_configs.document_lengths(t, 5, seed=3, batch=2))
    else:  # any ids, in any order
        ids = rng.integers(0, 4, size=(2, t)).astype(np.int32)
    want = int(_brute_mask(t, t, causal=causal, window=window, q_ids=ids, kv_ids=ids).sum())
    got = attention_configs.visible_pairs(t, t, causal=causal, window=window, q_segment_ids=ids, kv_segment_ids=ids)
    assert got == want
    # Cross attention with other key ids.
    kv = rng.integers(0, 4, size=(2, 29)).astype(np.int32)
    want = int(_brute_mask(t, 29, causal=causal, window=window, q_ids=ids, kv_ids=kv).sum())
    assert attention_configs.visible_pairs(t, 29, causal=causal, window=window, q_segment_ids=ids,
                               kv_segment_ids=kv) == want


def test_visible_pairs_lengths_and_library_semantics():
    import numpy as np

    from jax_tk.attention import reference

    t, s = 40, 33
    q_lens, kv_lens = np.array([40, 17, 0], np.int32), np.array([5, 33, 20], np.int32)
    ids = attention_configs.segment_ids_from_lengths(attention_configs.document_lengths(t, 4, seed=0, batch=3))
    kv_ids = ids[:, :s]
    for causal in (False, True):
        for window in (None, (7, 3)):
            kw = dict(causal=causal, window=window)
            want = int(_brute_mask(t, s, q_ids=ids, kv_ids=kv_ids, q_lens=q_lens, kv_lens=kv_lens, **kw).sum())
            got = attention_configs.visible_pairs(t, s, q_segment_ids=ids, kv_segment_ids=kv_ids,
                                      query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens, **kw)
            assert got == want
            # The same count as the mask jax_tk's reference applies.
            lib = reference.visibility(t, s, is_causal=causal, local_window_size=window,
                                       q_segment_ids=ids, kv_segment_ids=kv_ids,
                                       query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens)
            assert int(np.asarray(lib).sum()) == got


def test_visible_pairs_closed_forms_at_16k():
    # O(T) counting at the benchmark's sizes, against closed forms.
    t = 16384
    assert attention_configs.visible_pairs(t, t) == t * t
    assert attention_configs.visible_pairs(t, t, causal=True) == t * (t + 1) // 2
    w = 4096  # causal + window (w, 0): row i sees min(i, w) + 1 keys
    assert attention_configs.visible_pairs(t, t, causal=True, window=(w, 0)) == (w + 1) * (t - w) + w * (w + 1) // 2
    lengths = attention_configs.document_lengths(t, 8, seed=0)
    ids = attention_configs.segment_ids_from_lengths(lengths)
    assert attention_configs.visible_pairs(t, t, q_segment_ids=ids, kv_segment_ids=ids) == int((lengths**2).sum())
    assert (attention_configs.visible_pairs(t, t, causal=True, q_segment_ids=ids, kv_segment_ids=ids)
            == int((lengths * (lengths + 1) // 2).sum()))


def test_document_lengths():
    import numpy as np

    a = attention_configs.document_lengths(16384, 8, seed=0, batch=2)
    assert a.shape == (2, 8) and (a.sum(axis=1) == 16384).all() and (a >= 1).all()
    assert (a == attention_configs.document_lengths(16384, 8, seed=0, batch=2)).all()  # fixed seed
    assert not (a == attention_configs.document_lengths(16384, 8, seed=1, batch=2)).all()
    assert len(np.unique(a)) > 1  # random lengths, not equal ones
    ids = attention_configs.segment_ids_from_lengths(a)
    assert ids.shape == (2, 16384) and ids.dtype == np.int32
    assert (np.diff(ids, axis=1) >= 0).all() and (ids[:, -1] == 7).all()
    assert (np.bincount(ids[0]) == a[0]).all()
    with pytest.raises(ValueError):
        attention_configs.document_lengths(4, 5)


def test_feature_configs_default():
    configs = attention_configs.feature_configs()
    feats = [c for c in configs if c.feature != "plain"]
    assert {c.feature for c in feats} == set(attention_configs.FEATURES)
    for c in configs:
        assert c.dtype == "bf16" and c.batch * c.q_len <= 16384
        assert (c.head_dim, c.v_head_dim) == ((192, 128) if c.feature == "mla" else (128, 128))
    gqa = [c for c in feats if c.feature == "gqa"]
    assert sorted((c.q_len, c.batch, c.causal) for c in gqa) == [
        (4096, 4, False), (4096, 4, True), (16384, 1, False), (16384, 1, True)]
    assert all(c.heads == 32 and c.kv_heads == 8 and c.shape_kv[2] == 8 for c in gqa)
    (win,) = [c for c in feats if c.feature == "window"]
    assert win.window == (4096, 0) and win.causal and (win.batch, win.q_len, win.heads) == (1, 16384, 16)
    docs = [c for c in feats if c.feature == "documents"]
    assert sorted(c.causal for c in docs) == [False, True]
    for c in docs:
        assert (c.batch, c.q_len, c.heads, c.documents) == (1, 16384, 16, 8)
        assert c.segment_ids().shape == (1, 16384)
    # Each feature row but MLA's comes after its plain baseline; baselines appear once.
    assert len(set(configs)) == len(configs)
    for i, c in enumerate(configs):
        if c.feature in ("plain", "mla"):
            continue
        base = attention_configs.plain_baseline(c)
        assert base in configs[:i]
        assert base.feature == "plain" and base.window is None and not base.documents
        assert base.kv_heads == base.heads == c.heads and base.causal == c.causal
        assert base.q_len % 128 == 0
        assert abs(base.flops("fwd") / c.flops("fwd") - 1) < 0.02  # about the same useful FLOPs
        if c.feature == "gqa":  # the same problem with as many kv heads as query heads
            assert (base.batch, base.q_len, base.kv_len) == (c.batch, c.q_len, c.kv_len)


def test_mask_and_bias_feature_rows():
    """mask: the documents (causal and not) and the causal mask alone, as a dense mask; bias: [1, H, T, S]
    at T = 4k, B = 4; their FLOPs are those of the same masking given the usual way."""
    rows = attention_configs.feature_configs(["mask", "bias"], baselines=False)
    masks = [c for c in rows if c.feature == "mask"]
    assert sorted((c.causal, c.documents) for c in masks) == [(False, 8), (True, 0), (True, 8)]
    assert all(c.as_mask and (c.batch, c.q_len, c.heads) == (1, 16384, 16) for c in masks)
    docs = attention_configs.AttentionConfig(1, 16384, 16384, 16, 128, True, feature="documents", documents=8)
    assert [c for c in masks if c.documents and c.causal][0].flops("fwd") == docs.flops("fwd")
    biases = [c for c in rows if c.feature == "bias"]
    assert sorted(c.causal for c in biases) == [False, True]
    assert all(c.bias and (c.batch, c.q_len, c.kv_len) == (4, 4096, 4096) and c.bias_shape == (1, 16, 4096, 4096)
               for c in biases)
    for c in masks + biases:
        assert attention_configs.AttentionConfig.from_row({k: str(v) for k, v in c.csv_row().items()}) == c
        for name in ("fa3", "pallas", "cudnn_packed"):
            with pytest.raises(harness.Skip):
                providers.make_provider(name, c)
    with pytest.raises(ValueError, match="as_mask"):
        attention_configs.AttentionConfig(1, 128, 128, 2, 64, False, as_mask=True)


def test_dense_mask_is_the_rows_masking():

    c = attention_configs.AttentionConfig(1, 200, 200, 2, 64, True, feature="mask", documents=3, as_mask=True)
    ids = c.segment_ids()[0]
    want = (ids[:, None] == ids[None, :]) & np.tri(200, dtype=bool)
    np.testing.assert_array_equal(np.asarray(providers.dense_mask(c)())[0, 0], want)
    assert providers.dense_mask(attention_configs.AttentionConfig(1, 64, 64, 2, 64, True)) is None


def test_feature_configs_filters():
    only = attention_configs.feature_configs(["window"], [False])
    assert only == []  # the window row is causal only
    c = attention_configs.feature_configs(["documents"], [True], baselines=False)
    assert [x.feature for x in c] == ["documents"] and c[0].causal
    c = attention_configs.feature_configs(["gqa"], [False], head_dims=[64], baselines=False)
    assert {x.head_dim for x in c} == {64}
    with pytest.raises(ValueError):
        attention_configs.feature_configs(["bogus"])


def test_useful_flops():
    t, h, d = 16384, 16, 128
    win = attention_configs.AttentionConfig(1, t, t, h, d, True, feature="window", window=(4096, 0))
    visible = 4097 * (t - 4096) + 4096 * 4097 // 2
    assert win.flops("fwd") == 4 * h * d * visible
    assert win.flops("bwd") == 2.5 * win.flops("fwd")
    plain = attention_configs.AttentionConfig(2, 1024, 1024, h, d, True, feature="plain")
    assert plain.flops("fwd") == 4 * 2 * h * d * (1024 * 1025 // 2)  # exact count, not T^2/2
    # The sweep keeps the standard count.
    sweep = attention_configs.AttentionConfig(2, 1024, 1024, h, d, True)
    assert sweep.flops("fwd") == attention_configs.attention_flops(2, 1024, 1024, h, d, True)
    # GQA: FLOPs by query heads, the same as the MHA problem.
    gqa = attention_configs.AttentionConfig(4, 4096, 4096, 32, d, False, feature="gqa", kv_heads=8)
    assert gqa.flops("fwd") == attention_configs.attention_flops(4, 4096, 4096, 32, d, False)
    docs = attention_configs.AttentionConfig(1, 4096, 4096, h, d, False, feature="documents", documents=8)
    assert docs.flops("fwd") == 4 * h * d * int((docs.document_lengths() ** 2).sum())
    with pytest.raises(ValueError):
        attention_configs.AttentionConfig(1, 64, 64, 6, 64, False, kv_heads=4)


def test_plain_baseline_small():
    c = attention_configs.AttentionConfig(1, 512, 512, 2, 64, True, feature="window", window=(64, 0))
    base = attention_configs.plain_baseline(c)
    assert base.q_len % 16 == 0 and base.causal and base.feature == "plain"
    # The closest aligned length: neighbours are no closer.
    per = c.visible()
    err = lambda n: abs(n * (n + 1) // 2 - per)
    assert err(base.q_len) <= min(err(base.q_len - 16), err(base.q_len + 16))


def test_plain_baseline_with_a_batch_of_its_own():
    """batch = the documents: one plain row per document, as many visible pairs in all."""
    c = attention_configs.AttentionConfig(1, 4096, 4096, 2, 64, False, feature="documents", documents=8)
    base = attention_configs.plain_baseline(c, batch=8)
    assert (base.batch, base.heads, base.head_dim, base.causal) == (8, 2, 64, False)
    per = c.visible() / 8
    err = lambda n: abs(n * n - per)
    a = 16  # (rows under 1024: multiples of 16)
    assert base.q_len < 1024 and base.q_len % a == 0 and err(base.q_len) <= min(err(base.q_len - a), err(base.q_len + a))
    assert attention_configs.plain_baseline(c) == attention_configs.plain_baseline(c, batch=1)


def test_vs_plain_and_table():
    c = attention_configs.AttentionConfig(1, 512, 512, 2, 64, False, feature="documents", documents=8)
    base = attention_configs.plain_baseline(c)
    rs = [harness.Result(base, "jax_tk", "fwd", "ok", time_ms=1.0),
          harness.Result(base, "cudnn", "fwd", "ok", time_ms=0.5),
          harness.Result(c, "jax_tk", "fwd", "ok", time_ms=2.0),
          harness.Result(c, "cudnn_packed", "fwd", "ok", time_ms=0.5),
          harness.Result(c, "xla", "fwd", "error", note="boom")]
    by = {(r.config, r.provider, r.mode): r for r in rs}
    for r in rs:
        report.set_vs_plain(r, by)
    want = (c.flops("fwd") / 2.0) / (base.flops("fwd") / 1.0)
    assert math.isclose(rs[2].vs_plain, want)
    assert math.isclose(rs[3].vs_plain, c.flops("fwd") / base.flops("fwd"))  # against cudnn's plain row
    assert math.isnan(rs[0].vs_plain) and math.isnan(rs[4].vs_plain)
    table = report.format_table(rs)
    assert "== features, fwd" in table and f"{want:.0%}" in table and "boom" in table


def test_providers_for_feature_rows():
    win = attention_configs.AttentionConfig(1, 128, 128, 2, 64, True, feature="window", window=(64, 0))
    plain = attention_configs.plain_baseline(win)
    for cfg in (win, plain):
        with pytest.raises(harness.Skip):
            providers.make_provider("cudnn_packed", cfg)
    with pytest.raises(harness.Skip):
        providers.make_provider("pallas", win)
    assert providers.make_provider("xla", win).materializes_logits
    docs = attention_configs.AttentionConfig(1, 128, 128, 2, 64, True, feature="documents", documents=8)
    p = providers.make_provider("cudnn_packed", docs)
    assert "padded batch of 8 documents x 128 rows" in p.note


def test_padded_documents_index_maps():
    lengths = np.array([[3, 1, 4], [5, 2, 1]])
    gather, valid, back, longest = providers.padded_documents(lengths, 8, align=4)
    assert longest == 8 and gather.shape == valid.shape == (2 * 3 * 8,) and back.shape == (16,)
    packed = np.arange(16) * 10
    padded = np.where(valid, packed[gather], -1).reshape(6, 8)
    assert padded[0].tolist() == [0, 10, 20] + [-1] * 5
    assert padded[2].tolist() == [40, 50, 60, 70] + [-1] * 4
    assert padded[3].tolist() == [80, 90, 100, 110, 120] + [-1] * 3  # batch row 1 starts at 8
    assert (padded.reshape(-1)[back] == packed).all()


@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_packed_layout_against_the_reference(monkeypatch, causal):
    """cudnn_packed's padded batch (prepare, sequence lengths, restore) through the whole harness,
    forward and backward, with jax.nn's XLA implementation standing in for cuDNN on CPU."""
    docs = attention_configs.AttentionConfig(2, 160, 160, 2, 32, causal, feature="documents", documents=5)
    monkeypatch.setitem(providers.FACTORIES, "cudnn_packed",
                        lambda cfg, scale: providers._cudnn_packed_provider(cfg, scale, implementation="xla"))
    results = attention.bench_attention([docs], ["cudnn_packed"], ["fwd", "bwd"], log=None,
                                        timer=timers.WallTimer(reps=20, batch_ms=1, warmup_ms=1))
    for r in results:
        assert r.status == "ok" and r.rel_err < 2e-2, r
    p = providers.make_provider("cudnn_packed", docs)
    q, k, v, dout = harness.random_normal_sets([docs.shape_q] * 4, docs.jnp_dtype, 1)[0]
    padded = p.prepare(q, k, v, dout)
    longest = -(-int(docs.document_lengths().max()) // 128) * 128
    assert padded[0].shape == (10, longest, 2, 32)  # 2 x 5 documents, the longest rounded up to 128
    for x, want in zip(padded, (q, k, v, dout)):
        np.testing.assert_array_equal(np.asarray(p.restore(x)), np.asarray(want))


def test_features_cli():
    p = cli.build_parser()
    assert p.parse_args(["attention", "--features"]).features == list(attention_configs.FEATURES)
    assert p.parse_args(["attention", "--features", "window,gqa"]).features == ["window", "gqa"]
    assert p.parse_args(["attention"]).features is None  # the default run has no feature rows
    with pytest.raises(SystemExit):
        p.parse_args(["attention", "--features", "nope"])


def test_features_quick_run_cpu(tmp_path, capsys):
    # Every feature through the whole path (providers, timer, check, vs plain, CSV, PNG, report). (On a
    # CPU jax_tk runs the reference, xla's program: jax_tk alone, which also takes the sinks rows.)
    providers = ["xla"] if harness.has_gpu() else ["jax_tk", "cudnn_packed"]
    rc = cli.main(["attention", "--features", "--quick", "--tokens", "128", "--seq", "64",
                     "--causal", "true", "--providers", ",".join(providers), "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "== features, fwd" in out and "== features, bwd" in out
    csv_path, png_path = tmp_path / "attention_features.csv", tmp_path / "attention_features.png"
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    # gqa, window, documents, mask (documents and causal as a mask), bias (causal), sinks (causal), and
    # their plain baselines (4: documents and mask share one, the causal mask, the bias and the sinks
    # another), and one MLA row (no baseline), x providers x 2 modes.
    assert len(rows) == 12 * len(providers) * 2
    assert {r["feature"] for r in rows} == {"plain", *attention_configs.FEATURES}
    for r in rows:
        if r["provider"] == "cudnn_packed":
            want = "error" if r["feature"] == "documents" else "skipped"  # no cuDNN on CPU
            assert r["status"] == want and r["note"], r
            continue
        if r["feature"] == "sinks" and r["provider"] != "jax_tk":  # (only jax_tk takes sinks)
            assert r["status"] == "skipped" and "sinks" in r["note"], r
            continue
        assert r["status"] == "ok", r
        assert float(r["tflops"]) > 0 and float(r["rel_err"]) < 2e-2
        if r["feature"] == "mla":
            assert r["v_head_dim"] == "128" and r["head_dim"] == "192" and r["vs_plain"] == ""
        elif r["feature"] != "plain":
            assert float(r["vs_plain"]) > 0
    win = [r for r in rows if r["feature"] == "window"][0]
    assert win["window"] == "64:0"
    assert [r for r in rows if r["feature"] == "gqa"][0]["kv_heads"] == "2"
    assert [r for r in rows if r["feature"] == "documents"][0]["documents"] == "8"
    masks = [r for r in rows if r["feature"] == "mask"]
    assert {r["as_mask"] for r in masks} == {"True"} and {r["documents"] for r in masks} == {"8", ""}
    assert {r["bias"] for r in rows if r["feature"] == "bias"} == {"True"}
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        assert png_path.stat().st_size > 0
    # The report reads the feature columns back.
    results, _ = report.read_csv([str(csv_path)])
    assert {r.config.feature for r in results} == {"plain", *attention_configs.FEATURES}
    assert any(not math.isnan(r.vs_plain) for r in results)
    assert cli.main(["report", str(csv_path), "--png", str(tmp_path / "r.png")]) == 0
    assert "== features, fwd" in capsys.readouterr().out


def test_memory_limit_applies_to_reference_providers():
    cfg = attention_configs.AttentionConfig(1, 64, 64, 2, 64, True, feature="window", window=(16, 0))
    results = attention.bench_attention([cfg], ["xla"], ["fwd"], xla_max_bytes=1, log=None,
                                    timer=timers.WallTimer(reps=20, batch_ms=1, warmup_ms=1))
    assert [r.status for r in results] == ["skipped"] and "GB" in results[0].note
