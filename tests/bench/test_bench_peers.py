"""The peers (benchmarks/peers.py): FlashAttention-3, tokamax and jax-linear-attention as providers of
the attention and grouped-GEMM benchmarks. Their real kernels need a Hopper GPU; here each is replaced
by a stand-in module with the peer's signature and documented semantics, computing with jax_tk's
reference, so that the arguments the providers pass (layouts, grouped KV, windows, documents, masks,
implementation names) are checked against the float32 reference on CPU. Without the package, or
without a GPU, a peer is "unavailable"."""
import importlib.machinery
import sys
import types

import jax
import jax.numpy as jnp
import pytest

from benchmarks import attention, gemm, gemm_providers, harness, peers, timers
from benchmarks import attention_configs
from benchmarks import attention_providers as providers
from benchmarks import attention_report as report

TINY_TIMER = dict(reps=20, batch_ms=1, warmup_ms=1)
C = attention_configs.AttentionConfig


def _module(name, **attrs):
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)  # so that find_spec sees it installed
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


def _run(cfgs, names, modes=("fwd", "bwd")):
    return attention.bench_attention(cfgs, names, list(modes), log=None, timer=timers.WallTimer(**TINY_TIMER))


@pytest.fixture
def hopper(monkeypatch):
    """A CUDA GPU of compute capability 9.0, as the peers see it."""
    monkeypatch.setattr(peers, "cuda_capability", lambda: "9.0")


# ----------------------------------------------------------------------------------------------
# FlashAttention-3
# ----------------------------------------------------------------------------------------------


def test_fa3_unavailable_without_the_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn3_jax", None)  # import raises ImportError
    cfg = attention_configs.AttentionConfig(batch=1, q_len=64, kv_len=64, heads=2, head_dim=128, causal=True)
    with pytest.raises(harness.Unavailable, match="flash_attn3_jax"):
        providers.make_provider("fa3", cfg)
    assert issubclass(harness.Unavailable, harness.Skip)
    results = attention.bench_attention([cfg], ["fa3", "xla"], ["fwd", "bwd"], log=None,
                                        timer=timers.WallTimer(**TINY_TIMER))
    by = {(r.provider, r.mode): r for r in results}
    for mode in ("fwd", "bwd"):
        assert by[("fa3", mode)].status == "skipped"
        assert by[("fa3", mode)].note.startswith("unavailable: ") and "pip install" in by[("fa3", mode)].note
        assert by[("xla", mode)].status == "ok"
    assert "fa3" not in providers.default_providers()
    assert "unavailable" in report.format_table(results)


def _fake_fa3(calls):
    """A stand-in for flash_attn3_jax with its signatures, computing with jax_tk's reference."""
    ref = attention.reference()

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
    monkeypatch.setattr(peers, "cuda_capability", lambda: "9.0")
    assert "fa3" in providers.default_providers()
    C = attention_configs.AttentionConfig
    gqa = C(2, 64, 64, 4, 128, True, feature="gqa", kv_heads=2)
    win = C(1, 128, 128, 2, 128, True, feature="window", window=(32, 0))
    docs = C(1, 128, 128, 2, 128, False, feature="documents", documents=4)
    results = attention.bench_attention([gqa, win, docs], ["fa3"], ["fwd", "bwd"], log=None,
                                        timer=timers.WallTimer(**TINY_TIMER))
    for r in results:
        assert r.status == "ok" and r.rel_err < 2e-2, r
    assert ("flash_mha", (2, 64, 4, 128), (2, 64, 2, 128), (-1, -1)) in calls  # GQA: kv with 2 heads
    assert ("flash_mha", (1, 128, 2, 128), (1, 128, 2, 128), (32, 0)) in calls
    assert ("flash_mha_varlen", (128, 2, 128), int(docs.document_lengths().max())) in calls
    # Not built for head_dim 64, no fp32, not off Hopper: skipped, not unavailable.
    with pytest.raises(harness.Skip, match="head_dim 64") as e:
        providers.make_provider("fa3", C(1, 64, 64, 2, 64, False))
    assert not isinstance(e.value, harness.Unavailable)
    monkeypatch.setenv("JAX_TK_FA3_HEAD_DIMS", "64,128")
    assert providers.make_provider("fa3", C(1, 64, 64, 2, 64, False)).name == "fa3"
    monkeypatch.setattr(peers, "cuda_capability", lambda: "10.0")
    with pytest.raises(harness.Skip, match="sm90"):
        providers.make_provider("fa3", gqa)
    monkeypatch.setattr(peers, "cuda_capability", lambda: None)
    with pytest.raises(harness.Unavailable, match="CUDA GPU"):
        providers.make_provider("fa3", gqa)


def test_fa3_skips_mla_where_flash_mha_gives_the_querys_head_dim(monkeypatch):
    """flash_attn3_jax 0.2.x declares flash_mha's output with the query's shape (and its lowering asserts
    that key and value have one shape): at 192/128 the provider asks the installed module for the output
    shape and skips; the PyPI wheel (head dim 128 only) is skipped before that."""
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn3_jax", _fake_fa3(calls))
    monkeypatch.setattr(peers, "cuda_capability", lambda: "9.0")
    mla = C(2, 64, 64, 2, 192, True, feature="mla", v_head_dim=128)
    with pytest.raises(harness.Skip, match="head_dim 192"):
        providers.make_provider("fa3", mla)
    monkeypatch.setenv("JAX_TK_FA3_HEAD_DIMS", "128,192")
    fa3 = sys.modules["flash_attn3_jax"]
    real = fa3.flash_mha
    fa3.flash_mha = lambda q, k, v, **kw: jnp.zeros(q.shape, q.dtype) + real(q, k, k, **kw)  # the query's shape
    with pytest.raises(harness.Skip, match="query's shape") as e:
        providers.make_provider("fa3", mla)
    assert not isinstance(e.value, harness.Unavailable)
    fa3.flash_mha = real  # one that gives the value's head dim is timed
    results = _run([mla], ["fa3"])
    assert all(r.status == "ok" and r.rel_err < 2e-2 for r in results), results
    assert ("flash_mha", (2, 64, 2, 192), (2, 64, 2, 192), (-1, -1)) in calls


# ----------------------------------------------------------------------------------------------
# tokamax
# ----------------------------------------------------------------------------------------------


def _fake_tokamax(calls):
    """tokamax's dot_product_attention (jax.nn's signature) and ragged_dot (jax.lax's)."""
    ref = attention.reference()

    def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                              query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                              logits_soft_cap=None, precision=None, implementation=None, q_sharding=None):
        calls.append(("attention", implementation, key.shape, local_window_size,
                      None if mask is None else mask.shape, bias is not None))
        if isinstance(local_window_size, int):
            local_window_size = (local_window_size, local_window_size)
        return ref.attention(query, key, value, bias=bias, mask=mask, scale=scale, is_causal=is_causal,
                             local_window_size=local_window_size).astype(query.dtype)

    def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None,
                   activation=None, manual_axis_type=None, *, implementation=None, **kw):
        calls.append(("ragged_dot", implementation, lhs.shape, rhs.shape))
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)

    return _module("tokamax", dot_product_attention=dot_product_attention, ragged_dot=ragged_dot)


def test_tokamax_attention_with_a_stand_in(monkeypatch, hopper):
    calls = []
    monkeypatch.setitem(sys.modules, "tokamax", _fake_tokamax(calls))
    assert "tokamax" in providers.default_providers()
    rows = [C(2, 64, 64, 4, 64, True, feature="gqa", kv_heads=2),
            C(1, 128, 128, 2, 64, True, feature="window", window=(32, 0)),
            C(1, 128, 128, 2, 64, False, feature="documents", documents=4),
            C(2, 64, 64, 2, 64, True, feature="bias", bias=True)]
    results = _run(rows, ["tokamax"])
    for r in results:
        assert r.status == "ok" and r.rel_err < 2e-2, r
        assert 'implementation="mosaic"' in r.note
    assert {c[1] for c in calls} == {"mosaic"}
    assert ("attention", "mosaic", (2, 64, 2, 64), None, None, False) in calls  # GQA: kv with its 2 heads
    assert ("attention", "mosaic", (1, 128, 2, 64), (32, 0), None, False) in calls
    assert ("attention", "mosaic", (1, 128, 2, 64), None, (1, 1, 128, 128), False) in calls  # documents: a mask
    assert any(c[0] == "attention" and c[5] for c in calls)  # the bias


def test_tokamax_takes_mlas_value_as_it_is(monkeypatch, hopper):
    """tokamax documents a value (and output) head dim of its own: at 192/128 it gets v [B, S, K, 128]."""
    calls = []
    monkeypatch.setitem(sys.modules, "tokamax", _fake_tokamax(calls))
    mla = C(2, 64, 64, 2, 192, True, feature="mla", v_head_dim=128)
    results = _run([mla], ["tokamax"])
    assert all(r.status == "ok" and r.rel_err < 2e-2 for r in results), results
    assert calls and {c[:3] for c in calls} == {("attention", "mosaic", (2, 64, 2, 192))}


def test_tokamax_ragged_dot_with_a_stand_in(monkeypatch, hopper):
    calls = []
    monkeypatch.setitem(sys.modules, "tokamax", _fake_tokamax(calls))
    cfgs = gemm.ragged_configs(gemm.RAGGED_QUICK_SHAPES, ["tiny"], ["dirichlet"])
    results = gemm.bench_ragged_dot(cfgs, ["tokamax"], ["fwd", "bwd"], log=None,
                                    timer=timers.WallTimer(**TINY_TIMER))
    assert [r.status for r in results] == ["ok", "ok"] and all(r.rel_err < 1e-2 for r in results)
    assert ("ragged_dot", "mosaic", (256, 64), (4, 64, 128)) in calls


def test_tokamax_without_xprof_says_what_to_do(monkeypatch):
    def fail(module):
        raise ModuleNotFoundError("No module named 'xprof'", name="xprof")

    monkeypatch.setattr(peers, "_import", fail)
    with pytest.raises(harness.Unavailable, match="pip install tokamax") as e:
        providers.make_provider("tokamax", C(1, 64, 64, 2, 64, True))
    assert "xprof" in str(e.value) and "stub" in str(e.value)


# ----------------------------------------------------------------------------------------------
# jax-linear-attention
# ----------------------------------------------------------------------------------------------


def _fake_jla(monkeypatch, calls, reason=None):
    """jla.ops.mosaic_gpu's attention (causal; ``sliding_window`` counts the query itself) and
    ragged_dot modules, with their ``supported``/``supports`` answering ``reason``."""
    ref = attention.reference()

    def flash_attention(q, k, v, *, segment_ids=None, sliding_window=None, scale=None, backward="ranged",
                        sinks=None, persistent_forward=None):
        assert type(scale) is float
        calls.append(("flash_attention", k.shape, sliding_window, None if segment_ids is None else segment_ids.shape))
        window = None if sliding_window is None else (sliding_window - 1, 0)
        return ref.attention(q, k, v, scale=scale, is_causal=True, local_window_size=window,
                             q_segment_ids=segment_ids, kv_segment_ids=segment_ids).astype(q.dtype)

    def ragged_dot(lhs, rhs, group_sizes, *, full_groups=False, config=None):
        calls.append(("ragged_dot", lhs.shape, rhs.shape))
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)

    attention_mod = _module("jla.ops.mosaic_gpu.attention", flash_attention=flash_attention,
                            supported=lambda q, k, v: reason)
    ragged_mod = _module("jla.ops.mosaic_gpu.ragged_dot", ragged_dot=ragged_dot,
                         supports=lambda lhs, rhs, sizes, config=None: reason is None)
    for name, mod in [("jla", _module("jla")), ("jla.ops", _module("jla.ops")),
                      ("jla.ops.mosaic_gpu", _module("jla.ops.mosaic_gpu")),
                      ("jla.ops.mosaic_gpu.attention", attention_mod), ("jla.ops.mosaic_gpu.ragged_dot", ragged_mod)]:
        monkeypatch.setitem(sys.modules, name, mod)


def test_jla_attention_with_a_stand_in(monkeypatch, hopper):
    calls = []
    _fake_jla(monkeypatch, calls)
    assert "jla" in providers.default_providers()
    gqa = C(2, 64, 64, 4, 64, True, feature="gqa", kv_heads=2)
    win = C(1, 128, 128, 2, 64, True, feature="window", window=(32, 0))
    docs = C(1, 128, 128, 2, 64, True, feature="documents", documents=4)
    full = C(1, 64, 64, 2, 64, False)
    bias = C(2, 64, 64, 2, 64, True, feature="bias", bias=True)
    results = _run([gqa, win, docs, full, bias], ["jla"])
    by = {(r.config, r.mode): r for r in results}
    for cfg in (gqa, win, docs):
        for mode in ("fwd", "bwd"):
            assert by[(cfg, mode)].status == "ok" and by[(cfg, mode)].rel_err < 2e-2, by[(cfg, mode)]
    assert by[(full, "fwd")].status == "skipped" and "causal" in by[(full, "fwd")].note
    assert by[(bias, "fwd")].status == "skipped" and "bias" in by[(bias, "fwd")].note
    assert ("flash_attention", (2, 64, 2, 64), None, None) in calls  # GQA: kv with its 2 heads
    assert ("flash_attention", (1, 128, 2, 64), 33, None) in calls  # (32, 0): 33 keys with the query
    assert ("flash_attention", (1, 128, 2, 64), None, (1, 128)) in calls


def test_jla_gets_mlas_true_value_shape(monkeypatch, hopper):
    """jla's own supported(q, k, v) sees v [B, S, K, 128], and flash_attention gets it."""
    calls, asked = [], []
    _fake_jla(monkeypatch, calls)
    mod = sys.modules["jla.ops.mosaic_gpu.attention"]
    mod.supported = lambda q, k, v: asked.append((q.shape, k.shape, v.shape))
    fa = mod.flash_attention
    mod.flash_attention = lambda q, k, v, **kw: (calls.append(("v", v.shape)), fa(q, k, v, **kw))[1]
    mla = C(2, 64, 64, 2, 192, True, feature="mla", v_head_dim=128)
    results = _run([mla], ["jla"])
    assert all(r.status == "ok" and r.rel_err < 2e-2 for r in results), results
    assert asked == [((2, 64, 2, 192), (2, 64, 2, 192), (2, 64, 2, 128))]
    assert ("v", (2, 64, 2, 128)) in calls


def test_jla_skips_what_its_kernels_refuse(monkeypatch, hopper):
    _fake_jla(monkeypatch, [], reason="head dims (q/k 96, v 96) must be one of (64, 64), (128, 128)")
    with pytest.raises(harness.Skip, match="head dims") as e:
        providers.make_provider("jla", C(1, 64, 64, 2, 96, True))
    assert not isinstance(e.value, harness.Unavailable)
    with pytest.raises(harness.Skip, match="supports rejects"):
        gemm_providers.RAGGED_FACTORIES["jla"](gemm.GemmConfig("t", 256, 64, 128, 4, "uniform"))


def test_jla_ragged_dot_with_a_stand_in(monkeypatch, hopper):
    calls = []
    _fake_jla(monkeypatch, calls)
    cfgs = gemm.ragged_configs(gemm.RAGGED_QUICK_SHAPES, ["tiny"], ["uniform"])
    results = gemm.bench_ragged_dot(cfgs, None, ["fwd", "bwd"], log=None, timer=timers.WallTimer(**TINY_TIMER))
    by = {(r.provider, r.mode): r for r in results}
    assert by[("jla", "fwd")].status == by[("jla", "bwd")].status == "ok"  # a default provider where installed
    assert by[("jla", "bwd")].rel_err < 1e-2
    assert ("ragged_dot", (256, 64), (4, 64, 128)) in calls


# ----------------------------------------------------------------------------------------------
# Not installed, no GPU
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,module", [("tokamax", "tokamax"), ("jla", "jla"), ("fa3", "flash_attn3_jax")])
def test_unavailable_without_the_package(monkeypatch, name, module):
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    assert not peers.installed(name) and name not in providers.default_providers()
    cfg = C(1, 64, 64, 2, 128, True)
    results = _run([cfg], [name, "xla"], ["fwd"])
    assert results[0].status == "skipped" and results[0].note.startswith("unavailable: ")
    assert f"pip install {peers.PEERS[name].pip}" in results[0].note
    assert results[1].status == "ok"
    assert "unavailable" in report.format_table(results)


@pytest.mark.parametrize("name", ["tokamax", "jla"])
def test_unavailable_without_a_gpu(monkeypatch, name):
    monkeypatch.setitem(sys.modules, "tokamax", _fake_tokamax([]))
    _fake_jla(monkeypatch, [])
    monkeypatch.setattr(peers, "cuda_capability", lambda: None)
    with pytest.raises(harness.Unavailable, match="CUDA GPU"):
        providers.make_provider(name, C(1, 64, 64, 2, 64, True))


def test_versions_name_the_installed_peers(monkeypatch):
    def version(pip):
        if pip != "tokamax":
            raise peers.importlib.metadata.PackageNotFoundError(pip)
        return "0.0.17"

    monkeypatch.setattr(peers.importlib.metadata, "version", version)
    assert peers.versions() == "tokamax 0.0.17"
