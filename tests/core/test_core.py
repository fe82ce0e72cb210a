"""The op-agnostic core (jax_tk._core), tried with a toy op that has no kernel: the contracts (each
header's list against the compiled extension, the formulas), the kernel variant, the implementation=
dispatch, the FFI call's test target, and the sharding driver (on 8 CPU devices, in a subprocess unless
this process has them)."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from helpers import REPO, attention_inputs, multi_device_tests, needs_extension, rel_err
from jax_tk._core import checks, dispatch, extension, sharding
from jax_tk._core.ffi import kernel_call


# ----------------------------------------------------------------------------------------------
# The contract
# ----------------------------------------------------------------------------------------------


# Every contract header: cc/<name>/<name>.h of the source tree (the ops', and cc/core/core.h), or where
# the tests run outside it, the copies installed with the package.
CONTRACTS = (sorted(p.parent.name for p in (REPO / "cc").glob("*/*.h") if p.stem == p.parent.name)
             or sorted(p.stem for p in pathlib.Path(extension.header_path("core")).parent.glob("*.h")))


def test_header_constants_parse():
    c = extension.header_constants("attention")
    assert c["SEGMENT_GRANULE"] == 64
    assert c["HEAD_DIMS_SM80"] == 64 | 128 and c["HEAD_DIMS_SM90"] == 64 | 128 | 256
    assert all(isinstance(v, int) for v in c.values())
    assert {"core", "attention", "decode", "gemm"} <= set(CONTRACTS)
    assert extension.header_constants("decode")["SMALL_GPU_SMEM"] == 99 * 1024


def test_header_parser_reads_the_list_only(tmp_path, monkeypatch):
    """Entries of the X-macro list, with expressions, comments over several lines and the line
    continuations; nothing from comments or from other macros."""
    header = tmp_path / "toy.h"
    header.write_text("\n".join([
        "// X(FROM_A_COMMENT, 1) and #define JAX_TK_TOY_CONTRACT(X) in a comment",
        "#define JAX_TK_TOY_CONTRACT(X)                       \\",
        "  X(PLAIN, 64)       /* a comment                  \\",
        "                        on two lines (with X(NOT, 3)) */ \\",
        "  /* a comment line */                             \\",
        "  X(BITS, 64 | 128)  /* a set */                   \\",
        "  X(EXPR, (1 << 10) - 3 * (2 + 1))",
        "#define JAX_TK_TOY_FORMULAS(F) F(f)",
        "  X(AFTER_THE_LIST, 9)",
    ]))
    monkeypatch.setattr(extension, "header_path", lambda op: str(header))
    assert extension.header_constants("toy") == {"PLAIN": 64, "BITS": 192, "EXPR": 1015}


@needs_extension
@pytest.mark.parametrize("op", CONTRACTS)
def test_header_and_compiled_contract_agree(op):
    """The values the extension was compiled with equal the header's (a stale build, or a parser that
    misreads an entry, would differ); the extension knows exactly the contracts of the source tree."""
    compiled = extension._tk.contract()
    assert sorted(compiled) == CONTRACTS
    assert compiled[op] == extension.header_constants(op)
    assert extension.contract(op) == compiled[op]


@needs_extension
def test_formulas_come_from_the_extension():
    attention, decode = extension.formulas("attention"), extension.formulas("decode")
    # per (batch, head, 64-row block): a 64 x head_dim fp32 tile, 64 lse and 64 delta values, one int
    assert attention.bwd_sm90_workspace_words(2, 100, 4, 64) == 2 * 4 * 2 * (64 * 64 + 2 * 64 + 1)
    assert (attention.padded_rows(129), attention.padded_keys(1), attention.mask_words(129)) == (256, 128, 8)
    assert (attention.fwd_tile_cap(129), attention.bwd_order_rows(128), attention.bwd_order_rows(256)) == (4, 128, 64)
    assert decode.workspace_words(1, 2, 3, 4, 64) == 0 and decode.workspace_words(3, 2, 1, 4, 64) == 3 * 2 * 4 * 65
    assert [decode.block_rows(r) for r in (1, 16, 17, 100, 1000)] == [16, 16, 32, 128, 128]
    # dense products in clusters (66 of them on 132 SMs): the tile width whose waves take least time
    tile_n = extension.formulas("gemm").dense_tile_n
    shapes = ((3000, 7000), (8192, 8192), (16384, 1408), (1100, 264))
    assert [tile_n(m, n, 66) for m, n in shapes] == [320, 256, 256, 192]
    assert [tile_n(1025, n, 66) for n in (2504, 3336)] == [256, 320] and tile_n(3000, 7000, 0) == 256
    assert [tile_n(1032, n, 66) for n in (264, 2504, 3336)] == [192, 256, 320]  # (the contraction's GPU cases)


def test_without_the_extension(monkeypatch):
    """A source tree that was never built: constants from the headers, no formulas, the reference for
    implementation=None and a clear error for "tk"."""
    monkeypatch.setattr(extension, "_tk", None)
    assert extension.contract.__wrapped__("gemm") == extension.header_constants("gemm")
    assert not extension.available() and not extension.has_cuda_kernels()
    with pytest.raises(RuntimeError, match="install the package"):
        extension.formulas("attention")
    assert dispatch.use_kernel("toy_bare", None, None) is False
    with pytest.raises(RuntimeError, match=r"toy_bare\(implementation='tk'\): .*install the package"):
        dispatch.use_kernel("toy_bare", "tk", None)


def test_missing_op_header():
    with pytest.raises(FileNotFoundError, match="nope"):
        extension.header_constants("nope")


def test_kernel_variant_from_the_environment(monkeypatch):
    core = extension.contract("core")
    monkeypatch.delenv(dispatch.KERNELS_ENV, raising=False)
    assert dispatch.kernel_variant() == core["VARIANT_AUTO"]
    cases = (("auto", "VARIANT_AUTO"), ("sm80", "VARIANT_SM80"), (" SM86 ", "VARIANT_SM86"), ("", "VARIANT_AUTO"))
    for value, name in cases:
        monkeypatch.setenv(dispatch.KERNELS_ENV, value)
        assert dispatch.kernel_variant() == core[name]
    assert dispatch.kernel_variant("sm80") == core["VARIANT_SM80"]  # (an argument wins over the environment)
    monkeypatch.setenv(dispatch.KERNELS_ENV, "hopper")
    with pytest.raises(ValueError, match="JAX_TK_KERNELS='hopper': expected one of auto, sm80, sm86"):
        dispatch.kernel_variant()
    assert len(set(core[v] for v in dispatch.KERNELS.values())) == 3


def test_sm90_kernels_only_at_9_0_and_for_auto(monkeypatch):
    core = extension.contract("core")
    monkeypatch.setattr(extension, "kernel_archs", lambda: ("80", "90a"))
    assert extension.takes_sm90_kernels((9, 0), core["VARIANT_AUTO"])
    assert not extension.takes_sm90_kernels((9, 0), core["VARIANT_SM80"])
    assert not extension.takes_sm90_kernels((9, 0), core["VARIANT_SM86"])
    assert not any(extension.takes_sm90_kernels(c, core["VARIANT_AUTO"]) for c in ((8, 0), (8, 9), (10, 0), None))
    monkeypatch.setattr(extension, "kernel_archs", lambda: ("80",))  # a build without sm_90a code
    assert not extension.takes_sm90_kernels((9, 0), core["VARIANT_AUTO"])


# ----------------------------------------------------------------------------------------------
# Dispatch and the FFI call
# ----------------------------------------------------------------------------------------------


def test_implementation_choices():
    assert dispatch.use_kernel("toy", "xla", None) is False
    assert dispatch.use_kernel("toy", None, "head_dim 3") is False
    with pytest.raises(ValueError, match=r"jax_tk.toy\(implementation='tk'\): unsupported head_dim 3"):
        dispatch.use_kernel("toy", "tk", "head_dim 3")
    with pytest.raises(ValueError, match="implementation must be one of"):
        dispatch.use_kernel("toy", "cuda", None)


def test_kernels_run_on_the_architectures_built_for(monkeypatch):
    monkeypatch.setattr(extension, "kernel_archs", lambda: ("80", "90a"))
    assert all(extension.kernels_run_on(c) for c in ((8, 0), (8, 6), (8, 9), (9, 0)))
    assert not any(extension.kernels_run_on(c) for c in ((7, 0), (7, 5), (10, 0), (12, 0)))
    monkeypatch.setattr(extension, "kernel_archs", lambda: ("90a",))  # a build for Hopper only
    assert extension.kernels_run_on((9, 0)) and not extension.kernels_run_on((8, 0))
    monkeypatch.setattr(extension, "kernel_archs", lambda: ("86",))  # sm_86 code: 8.6 and 8.9, not 8.0 or 9.0
    assert extension.kernels_run_on((8, 9)) and not extension.kernels_run_on((8, 0))
    assert not extension.kernels_run_on((9, 0))


@needs_extension
def test_a_gpu_the_kernels_were_not_built_for_runs_the_reference(monkeypatch):
    """On a GPU without kernel code (e.g. compute capability 10.0 for a build of 8.0 and 9.0a, which
    holds no PTX), implementation=None warns and runs the reference; "tk" raises."""
    monkeypatch.setattr(extension, "has_cuda_kernels", lambda: True)
    monkeypatch.setattr(extension, "kernel_archs", lambda: ("80", "90a"))
    monkeypatch.setattr(extension, "cuda_device_capability", lambda: (10, 0))
    with pytest.warns(RuntimeWarning, match=r"built for GPU architectures 80, 90a; this GPU has compute capability 10\.0"):
        assert dispatch.use_kernel("toy_arch", None, None) is False
    with pytest.raises(RuntimeError, match=r"toy_arch\(implementation='tk'\): the kernels are built for .* 10\.0"):
        dispatch.use_kernel("toy_arch", "tk", None)
    monkeypatch.setattr(extension, "cuda_device_capability", lambda: (9, 0))
    assert dispatch.use_kernel("toy_arch", None, None) is True
    assert dispatch.use_kernel("toy_arch", "tk", None) is True


@pytest.mark.skipif(not extension.has_cuda_kernels(), reason="needs the CUDA kernels")
def test_the_build_reports_its_architectures():
    assert extension.kernel_archs() and all(a in ("80", "86", "89", "90a") for a in extension.kernel_archs())
    cap = extension.cuda_device_capability()
    if cap is not None:  # the test GPU is one the build is for
        assert extension.kernels_run_on(cap)


def test_to_int32_saturates_what_int32_cannot_hold():
    big = np.array([2 ** 40, -2 ** 40, 7])
    np.testing.assert_array_equal(checks.to_int32(big, 0, 100), [100, 0, 7])  # on the host (no x64 needed)
    assert isinstance(checks.to_int32(big, 0, 100), np.ndarray)
    np.testing.assert_array_equal(checks.to_int32(np.array([2 ** 32 - 1, 5], np.uint32), 0, 2 ** 31 - 1),
                                  [2 ** 31 - 1, 5])
    got = jax.jit(lambda x: checks.to_int32(x, 0, 2 ** 31 - 1))(jnp.array([2 ** 31, 5], jnp.uint32))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, [2 ** 31 - 1, 5])
    np.testing.assert_array_equal(checks.to_int32(jnp.array([-3, 5], jnp.int8), 0, 4), [-3, 5])  # only cast
    with jax.enable_x64(True):
        np.testing.assert_array_equal(checks.to_int32(jnp.array([2 ** 40, 3], jnp.int64), -1, 9), [9, 3])


@pytest.mark.parametrize("value", [1e39, 1e-50, 0.0, -1.0, float("nan")])
def test_positive_float_in_float32(value):
    with pytest.raises(ValueError, match="toy: scale must be a positive float"):
        checks.positive_float("toy", "scale", value)


def test_platform_dispatch_takes_the_reference_on_cpu():
    cpu = jax.devices("cpu")[0]
    x = jax.device_put(jnp.arange(4.0), cpu)
    kernel = lambda a: a * 0  # would be the FFI call; the CPU never takes it
    with jax.default_device(cpu):
        got = jax.jit(lambda a: dispatch.platform_dispatch(True, kernel, lambda a: a + 1, a))(x)
        np.testing.assert_array_equal(got, x + 1)
        assert dispatch.platform_dispatch(False, kernel, lambda a: a + 1, x) is not None


def _export_text(f, *args):
    exp = jax.export.export(jax.jit(f), platforms=["cuda"],
                            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("toy_op"),
                                             jax.export.DisabledSafetyCheck.custom_call("toy_op_test")])
    return exp(*args).mlir_module()


def test_kernel_call_poisoning_uses_the_test_target():
    x = jnp.ones((4,), jnp.float32)
    out = jax.ShapeDtypeStruct((4,), jnp.float32)
    plain = _export_text(lambda a: kernel_call("toy_op", (out,), (a,), {"k": np.int32(3)}), x)
    poisoned = _export_text(lambda a: kernel_call("toy_op", (out,), (a,), {"k": np.int32(3)}, out_init=(a,)), x)
    assert "@toy_op(" in plain and "toy_op_test" not in plain
    assert "@toy_op_test(" in poisoned and "output_operand_aliases" in poisoned


# ----------------------------------------------------------------------------------------------
# The sharding driver, with a toy op: per (batch entry, head) out = q * mean over s of k (k's head is
# shared by groups of q's heads), whole over t, s and d.
# ----------------------------------------------------------------------------------------------

LAYOUT = sharding.Layout(inputs=("b t n d", "b s k d"), outputs=("b t n d", "b s k d"), heads="n", grouped="k")


def _toy_local(static, q, k):
    g = q.shape[2] // k.shape[2]
    kk = jnp.repeat(k.mean(axis=1, keepdims=True), g, axis=2)
    # second result: a gradient-like value per grouped head, summed over the heads that share it
    dk = jnp.broadcast_to(q.sum(axis=(1, 3)).reshape(q.shape[0], 1, k.shape[2], g).sum(-1)[..., None], k.shape)
    return q * kk * static, dk


def test_plan_rules():
    sizes = {"data": 2, "model": 4}
    p = sharding.plan(LAYOUT, sizes, P("data", None, "model"), [(4, 8, 8, 16), (4, 8, 4, 16)])
    assert (p.batch, p.heads, p.split_grouped) == (("data",), ("model",), True)
    p = sharding.plan(LAYOUT, sizes, P("data", None, "model"), [(4, 8, 8, 16), (4, 8, 2, 16)])
    assert (p.split_grouped, p.group_share, p.grouped_size) == (False, 2, 2)
    assert p.spec(LAYOUT, "b s k d") == P("data", None, None, None)
    assert sharding.plan(LAYOUT, sizes, P(None, "model"), [(4, 8, 8, 16), (4, 8, 8, 16)]) == sharding.Plan()
    with pytest.raises(ValueError, match="operands for the layout"):
        sharding.call(LAYOUT, _toy_local, 1.0, jnp.ones((2, 2, 2, 2)))


test_in_subprocess, needs_devices = multi_device_tests(__file__)


@needs_devices
@pytest.mark.parametrize("kh", [4, 2])
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_toy_op_runs_on_shards(kh, axis_type):
    q, k, _ = attention_inputs(0, 4, 8, 6, 8, kh, 16, jnp.float32)
    want = _toy_local(2.0, q, k)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type, axis_type))
    q = jax.device_put(q, NamedSharding(mesh, P("data", None, "model")))
    k = jax.device_put(k, NamedSharding(mesh, P("data", None, "model" if kh % 4 == 0 else None)))
    f = jax.jit(lambda q, k: sharding.call(LAYOUT, _toy_local, 2.0, q, k, result_like=(None, 1)))
    got = f(q, k)
    text = f.lower(q, k).compile().as_text()
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-6
    assert "all-gather" not in text
    assert tuple(got[0].sharding.spec)[:3] == ("data", None, "model")


# A toy op over rows split unevenly: out[r] = x[r] * (global row index r), and w = the sum over all rows
# of x (a "weight gradient": a result summed over the batch's devices).
ROWS = sharding.Layout(inputs=("b d",), outputs=("b d", "d"), summed=(1,), batch_offset=True)


def _rows_local(static, x, *, batch_start):
    r = batch_start + jnp.arange(x.shape[0], dtype=jnp.int32)
    return x * r[:, None].astype(x.dtype) * static, x.sum(axis=0)


def test_rows_toy_op_unpartitioned():
    x = jnp.arange(12.0).reshape(6, 2)
    out, w = sharding.call(ROWS, _rows_local, 1.0, x)
    np.testing.assert_array_equal(out, x * jnp.arange(6.0)[:, None])
    np.testing.assert_array_equal(w, x.sum(0))


@needs_devices
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_rows_toy_op_batch_offset_and_summed(axis_type):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 3)), jnp.float32)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type, axis_type))
    xs = jax.device_put(x, NamedSharding(mesh, P(("data", "model"))))
    f = jax.jit(lambda x: sharding.call(ROWS, _rows_local, 2.0, x))
    out, w = f(xs)
    np.testing.assert_allclose(out, 2.0 * x * jnp.arange(16.0)[:, None], rtol=1e-6)
    np.testing.assert_allclose(w, x.sum(0), rtol=1e-5)
    text = f.lower(xs).compile().as_text()
    assert "all-gather" not in text and "all-reduce" in text
