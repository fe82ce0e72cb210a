"""CPU tests (no GPU needed) of what jax_tk.attention lowers to for CUDA: the StableHLO must contain our
FFI custom calls with the right operands and attributes, and only where the kernel applies.

Operands: forward q, k, v, then the seven masking operands (q_segment_ids, kv_segment_ids, q_lengths,
kv_lengths, then the segment ranges q_segment_ranges [b, ceil(t/64), 2] and kv_segment_ranges, then
the Hopper kernel's block order: int32, shape (0,) when absent); backward q, k, v, out, lse, dout,
dlse, then the same seven (the block order of the backward's blocks). Both then take the boolean mask's
two and the bias; the forward last the attention sinks (float32 [q_heads], shape (0,) without them).
Attributes: scale, is_causal, variant (cc/core/core.h's VARIANT_*, from JAX_TK_KERNELS), window_left,
window_right (-1: unbounded; at most the sequence's length), softcap (0: none)."""
from __future__ import annotations

import dataclasses
import functools
import math
import re
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tk
from helpers import needs_extension
from jax_tk._core import extension
from jax_tk.attention import reference
from jax_tk.attention.launch import BWD_TARGET, FWD_TARGET

pytestmark = needs_extension  # (the kernels' operands come from the extension's formulas)

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
TARGETS = (FWD_TARGET, BWD_TARGET)
assert FWD_TARGET == "jax_tk_attention_fwd" and BWD_TARGET == "jax_tk_attention_bwd"

# ----------------------------------------------------------------------------------------------
# Lowering and parsing helpers
# ----------------------------------------------------------------------------------------------


def lower_jit(f, *args, platforms=("cuda",)):
    return jax.jit(f).trace(*args).lower(lowering_platforms=tuple(platforms)).as_text()


def export(f, *args, platforms=("cuda",)):
    disabled = [jax.export.DisabledSafetyCheck.custom_call(name) for name in TARGETS]
    return jax.export.export(jax.jit(f), platforms=list(platforms), disabled_checks=disabled)(*args)


def lower_export(f, *args, platforms=("cuda",)):
    return export(f, *args, platforms=platforms).mlir_module()


LOWERERS = {"jit_lower": lower_jit, "export": lower_export}


@pytest.fixture(params=sorted(LOWERERS))
def lower(request):
    return LOWERERS[request.param]


@dataclasses.dataclass
class CustomCall:
    target: str
    operands: list[str]
    operand_types: list[str]
    result_types: list[str]
    attrs: dict[str, tuple[str, str]]  # name -> (printed value, type)
    line: str
    sinks: str | None = None  # the forward's last operand's type (tk_calls takes it off the operands)

    def attr_float(self, name):
        value, typ = self.attrs[name]
        assert typ == "f32", f"{name} should be an f32 attribute, got {typ}"
        if value.lower().startswith("0x"):  # MLIR prints some floats as their bits
            return struct.unpack("<f", struct.pack("<I", int(value, 16)))[0]
        return float(value)

    def attr_int(self, name):
        value, typ = self.attrs[name]
        assert typ == "i32", f"{name} should be an i32 attribute, got {typ}"
        return int(value)


# Pretty form: stablehlo.custom_call @target(%a, %b) {...} : (types) -> types
_PRETTY = re.compile(r"stablehlo\.custom_call @(?P<target>[\w.$-]+)\((?P<operands>[^)]*)\)")
# Generic form: "stablehlo.custom_call"(%a, %b) <{call_target_name = "target", ...}> : ...
_GENERIC = re.compile(r'"stablehlo\.custom_call"\((?P<operands>[^)]*)\).*?call_target_name = "(?P<target>[^"]+)"')
_SIGNATURE = re.compile(r":\s*\((?P<inputs>[^()]*)\)\s*->\s*(?P<outputs>\([^()]*\)|tensor<[^>]*>)")
_ATTR = re.compile(r"\b(?P<name>\w+) = (?P<value>[-+]?(?:0x[0-9A-Fa-f]+|[0-9][0-9.]*(?:[eE][-+]?[0-9]+)?)) : (?P<type>[fi]\d+)")
_TENSOR = re.compile(r"tensor<[^>]*>")


def custom_calls(text: str) -> list[CustomCall]:
    calls = []
    for line in text.splitlines():
        m = _PRETTY.search(line) or _GENERIC.search(line)
        if m is None:
            continue
        operands = [o.strip() for o in m.group("operands").split(",") if o.strip()]
        sigs = _SIGNATURE.findall(line)
        inputs, outputs = sigs[-1] if sigs else ("", "")
        attrs = {a.group("name"): (a.group("value"), a.group("type")) for a in _ATTR.finditer(line)}
        calls.append(
            CustomCall(m.group("target"), operands, _TENSOR.findall(inputs), _TENSOR.findall(outputs), attrs, line)
        )
    return calls


def tk_calls(text: str, target: str | None = None) -> list[CustomCall]:
    """jax_tk's calls; the forward's last operand, the attention sinks, goes to ``sinks`` (so that both
    directions end with the masking operands)."""
    calls = [c for c in custom_calls(text) if c.target.startswith("jax_tk")]
    for c in calls:
        if c.target == FWD_TARGET:
            c.operands.pop()
            c.sinks = c.operand_types.pop()
    return [c for c in calls if target is None or c.target == target]


def assert_no_tk_calls(text: str):
    assert tk_calls(text) == []
    for name in TARGETS:
        assert name not in text


def tensor_type(shape, dtype):
    names = {BF16: "bf16", F16: "f16", F32: "f32", I32: "i32", U32: "ui32", I8: "i8"}
    return "tensor<" + "x".join(str(d) for d in shape) + "x" + names[dtype] + ">"


I32, U32, I8 = jnp.int32, jnp.uint32, jnp.int8
NO_BIAS = tensor_type((0,), BF16)  # the bias operand, absent (of the inputs' dtype)
NO_MASK = [tensor_type((0,), U32), tensor_type((0,), I8), NO_BIAS]  # the boolean mask's two operands and the bias
NO_MASKS = [tensor_type((0,), I32)] * 7 + NO_MASK  # the ten masking operands when no option is given


def no_masks(dtype):
    return NO_MASKS[:-1] + [tensor_type((0,), dtype)]
TILE_COUNTER = tensor_type((1,), I32)  # the forward's third result: scratch for the Hopper kernel's tile counter


def assert_no_masking(call):
    assert call.operand_types[-10:-1] == NO_MASKS[:-1]
    assert (call.attr_int("window_left"), call.attr_int("window_right")) == (-1, -1)
    assert call.attr_float("softcap") == 0.0


def _abstract(b=2, t=16, s=24, n=4, kh=2, d=64, dtype=BF16):
    return (
        jax.ShapeDtypeStruct((b, t, n, d), dtype),
        jax.ShapeDtypeStruct((b, s, kh, d), dtype),
        jax.ShapeDtypeStruct((b, s, kh, d), dtype),
    )


def _grad_fn(fn, **kwargs):
    def loss(q, k, v):
        return jnp.sum(jnp.sin(fn(q, k, v, **kwargs).astype(F32)))

    return jax.grad(loss, argnums=(0, 1, 2))


def test_parser_on_known_line():
    line = (
        '    %2:2 = stablehlo.custom_call @jax_tk_attention_fwd(%arg0, %arg1, %arg2) {backend_config = "", '
        "mhlo.backend_config = {is_causal = 1 : i32, scale = 3.000000e-01 : f32}} : (tensor<1x16x4x64xbf16>, "
        "tensor<1x24x2x64xbf16>, tensor<1x24x2x64xbf16>) -> (tensor<1x16x4x64xbf16>, tensor<1x4x16xf32>) loc(#loc3)"
    )
    (call,) = custom_calls(line)
    assert call.target == FWD_TARGET and call.operands == ["%arg0", "%arg1", "%arg2"]
    assert call.attr_int("is_causal") == 1 and call.attr_float("scale") == pytest.approx(0.3)
    assert call.result_types == ["tensor<1x16x4x64xbf16>", "tensor<1x4x16xf32>"]
    assert len(call.operand_types) == 3
    hexline = line.replace("3.000000e-01", "0x3E99999A")
    assert custom_calls(hexline)[0].attr_float("scale") == np.float32(0.3)


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3], ids=["default_scale", "scale0.3"])
def test_forward_custom_call(lower, dtype, is_causal, scale):
    b, t, s, n, kh, d = 2, 16, 24, 4, 2, 64
    args = _abstract(b, t, s, n, kh, d, dtype)
    text = lower(functools.partial(jax_tk.attention, scale=scale, is_causal=is_causal), *args)
    (call,) = tk_calls(text, FWD_TARGET)
    assert tk_calls(text, BWD_TARGET) == []
    assert len(call.operands) == 13
    assert call.sinks == tensor_type((0,), F32)  # no sinks
    assert call.operand_types == [tensor_type((b, t, n, d), dtype)] + [tensor_type((b, s, kh, d), dtype)] * 2 + no_masks(dtype)
    assert call.result_types == [tensor_type((b, t, n, d), dtype), tensor_type((b, n, t), F32), TILE_COUNTER]
    expected_scale = 1.0 / math.sqrt(d) if scale is None else scale
    assert np.float32(call.attr_float("scale")) == np.float32(expected_scale)
    assert call.attr_int("is_causal") == int(is_causal)
    assert_no_masking(call)


def test_sinks_operand(lower):
    """The sinks go to the forward kernel as float32 [q_heads]; the backward needs nothing more (it runs
    from the forward's out and lse, which include them)."""
    q, k, v = _abstract(2, 16, 24, 4, 2, 64, BF16)
    sinks = jax.ShapeDtypeStruct((4,), BF16)  # (any float dtype: the op takes float32 to the kernel)
    f = lambda q, k, v, s: jax.grad(lambda *a: jax_tk.attention(*a, sinks=s, is_causal=True).astype(F32).sum(),
                                    argnums=(0, 1, 2))(q, k, v)
    text = lower(f, q, k, v, sinks)
    (fwd,) = tk_calls(text, FWD_TARGET)
    (bwd,) = tk_calls(text, BWD_TARGET)
    assert fwd.sinks == tensor_type((4,), F32)
    assert len(bwd.operands) == 17


@pytest.mark.parametrize("d", [64, 128])
def test_forward_default_scale_per_head_dim(lower, d):
    text = lower(jax_tk.attention, *_abstract(d=d))
    (call,) = tk_calls(text, FWD_TARGET)
    assert np.float32(call.attr_float("scale")) == np.float32(1.0 / math.sqrt(d))
    assert call.attr_int("is_causal") == 0


@pytest.mark.parametrize("scale", [0.01, 1.0, 2.5])
def test_forward_custom_scale_value(lower, scale):
    text = lower(functools.partial(jax_tk.attention_with_lse, scale=scale, is_causal=True), *_abstract())
    (call,) = tk_calls(text, FWD_TARGET)
    assert np.float32(call.attr_float("scale")) == np.float32(scale)
    assert call.attr_int("is_causal") == 1


@pytest.mark.parametrize(
    "b,t,s,n,kh,d", [(1, 1, 1, 1, 1, 64), (3, 17, 130, 8, 2, 128), (1, 200, 65, 6, 1, 64), (2, 128, 128, 4, 4, 128)]
)
def test_forward_shapes(b, t, s, n, kh, d):
    text = lower_jit(functools.partial(jax_tk.attention, is_causal=True), *_abstract(b, t, s, n, kh, d))
    (call,) = tk_calls(text, FWD_TARGET)
    assert call.operand_types == [tensor_type((b, t, n, d), BF16)] + [tensor_type((b, s, kh, d), BF16)] * 2 + NO_MASKS
    assert call.result_types == [tensor_type((b, t, n, d), BF16), tensor_type((b, n, t), F32), TILE_COUNTER]


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_grad_contains_backward_call(lower, dtype, is_causal):
    b, t, s, n, kh, d = 2, 16, 24, 4, 2, 64
    text = lower(_grad_fn(jax_tk.attention, scale=0.2, is_causal=is_causal), *_abstract(b, t, s, n, kh, d, dtype))
    (fwd,) = tk_calls(text, FWD_TARGET)
    (bwd,) = tk_calls(text, BWD_TARGET)
    # q, k, v, out, lse, dout, dlse, and the ten (absent) masking operands
    assert len(bwd.operands) == 17
    q_t, kv_t, lse_t = tensor_type((b, t, n, d), dtype), tensor_type((b, s, kh, d), dtype), tensor_type((b, n, t), F32)
    assert bwd.operand_types == [q_t, kv_t, kv_t, q_t, lse_t, q_t, lse_t] + no_masks(dtype)
    # dq, dk, dv, and the fp32 workspaces: delta, and the Hopper kernel's: a 64 x d dq accumulator
    # and a lock per (batch, head, 64-row query block)
    ws_t = tensor_type((b * n * -(-t // 64) * (64 * d + 2 * 64 + 1),), F32)
    assert bwd.result_types == [q_t, kv_t, kv_t, lse_t, ws_t, tensor_type((0,), dtype)]  # (dbias: none without a bias)
    for call in (fwd, bwd):
        assert np.float32(call.attr_float("scale")) == np.float32(0.2)
        assert call.attr_int("is_causal") == int(is_causal)
        assert call.attr_int("variant") == extension.contract("core")["VARIANT_AUTO"]
        assert_no_masking(call)
    assert bwd.attr_int("deterministic") == 0


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_attribute(lower, deterministic):
    fn = _grad_fn(jax_tk.attention, is_causal=True, deterministic_backward=deterministic)
    (bwd,) = tk_calls(lower(fn, *_abstract(t=130)), BWD_TARGET)
    assert bwd.attr_int("deterministic") == int(deterministic)
    assert bwd.result_types[-2] == tensor_type((2 * 4 * 3 * (64 * 64 + 2 * 64 + 1),), F32)


def test_deterministic_must_be_bool():
    q, k, v = (jnp.zeros(x.shape, x.dtype) for x in _abstract())
    with pytest.raises(TypeError, match="deterministic_backward must be a bool"):
        jax_tk.attention(q, k, v, deterministic_backward=1)


def test_grad_of_attention_with_lse_contains_backward_call(lower):
    def loss(q, k, v):
        out, lse = jax_tk.attention_with_lse(q, k, v, is_causal=True)
        return jnp.sum(out.astype(F32) ** 2) + jnp.sum(jnp.cos(lse))

    text = lower(jax.grad(loss, argnums=(0, 1, 2)), *_abstract())
    assert len(tk_calls(text, FWD_TARGET)) == 1
    (bwd,) = tk_calls(text, BWD_TARGET)
    assert len(bwd.operands) == 17
    assert bwd.attr_int("is_causal") == 1
    assert np.float32(bwd.attr_float("scale")) == np.float32(0.125)


def test_grad_wrt_query_only_still_uses_backward_kernel():
    def loss(q, k, v):
        return jnp.sum(jax_tk.attention(q, k, v).astype(F32) ** 2)

    text = lower_jit(jax.grad(loss), *_abstract())
    assert len(tk_calls(text, BWD_TARGET)) == 1


# ----------------------------------------------------------------------------------------------
# Masking options: windows, segment ids, sequence lengths, soft cap
# ----------------------------------------------------------------------------------------------

B_, T_, S_ = 2, 16, 24  # the shapes of _abstract()
Q_IDS, KV_IDS, LENS = tensor_type((B_, T_), I32), tensor_type((B_, S_), I32), tensor_type((B_,), I32)
ABSENT = tensor_type((0,), I32)
# segment ranges (min, max per 64 rows) follow the four options, then the block order (one entry per
# batch entry and 128-row block: forward query tiles, backward key blocks): present exactly with
# segment ids
RANGES = [tensor_type((B_, 1, 2), I32), tensor_type((B_, 1, 2), I32)]
# the forward's tiles (batch entries x 4 query heads x fwd_tile_cap = 2 x 128-row blocks, 4 ints each)
# and the backward's block order (batch entries x 2 key/value heads x 128-key blocks)
ORDER_FWD, ORDER_BWD = tensor_type((B_ * 4 * 2 * 4,), I32), tensor_type((B_ * 2 * 1,), I32)


def _ids(shape, dtype=I32):
    return jax.ShapeDtypeStruct(shape, dtype)


# (id, attention kwargs (arrays as abstract values), expected masking operand types,
#  expected (window_left, window_right), expected softcap)
MASKING_CASES = [
    ("window", dict(local_window_size=(3, 5)), [ABSENT] * 6, (3, 5), 0.0),
    ("window_int", dict(local_window_size=4), [ABSENT] * 6, (4, 4), 0.0),
    ("window_one_sided_causal", dict(local_window_size=(7, 0), is_causal=True), [ABSENT] * 6, (7, 0), 0.0),
    # a side reaching past the sequence is unbounded (-1): also keeps huge values out of int32
    # a side longer than its sequence is clamped to it (the handler reads >= the length as unbounded)
    ("window_huge_right", dict(local_window_size=(5, 10**12)), [ABSENT] * 6, (5, S_), 0.0),
    ("window_huge_left", dict(local_window_size=(T_, 2)), [ABSENT] * 6, (T_, 2), 0.0),
    ("segments", dict(q_segment_ids=_ids((B_, T_)), kv_segment_ids=_ids((B_, S_))),
     [Q_IDS, KV_IDS, ABSENT, ABSENT, *RANGES], (-1, -1), 0.0),
    ("segments_int16", dict(q_segment_ids=_ids((B_, T_), jnp.int16), kv_segment_ids=_ids((B_, S_), jnp.int16)),
     [Q_IDS, KV_IDS, ABSENT, ABSENT, *RANGES], (-1, -1), 0.0),
    ("q_lengths", dict(query_seq_lengths=_ids((B_,))), [ABSENT, ABSENT, LENS, ABSENT, ABSENT, ABSENT], (-1, -1), 0.0),
    ("kv_lengths", dict(key_value_seq_lengths=_ids((B_,))), [ABSENT, ABSENT, ABSENT, LENS, ABSENT, ABSENT], (-1, -1), 0.0),
    ("softcap", dict(logits_soft_cap=30.0), [ABSENT] * 6, (-1, -1), 30.0),
    ("all", dict(is_causal=True, local_window_size=(6, 2), q_segment_ids=_ids((B_, T_)),
                 kv_segment_ids=_ids((B_, S_)), query_seq_lengths=_ids((B_,)), key_value_seq_lengths=_ids((B_,)),
                 logits_soft_cap=2.5), [Q_IDS, KV_IDS, LENS, LENS, *RANGES], (6, 2), 2.5),
]


def _split_arrays(kwargs):
    """(static kwargs, names of the array kwargs, their abstract values)."""
    names = sorted(k for k, v in kwargs.items() if isinstance(v, jax.ShapeDtypeStruct))
    static = {k: v for k, v in kwargs.items() if k not in names}
    return static, names, [kwargs[k] for k in names]


@pytest.mark.parametrize("case", MASKING_CASES, ids=[c[0] for c in MASKING_CASES])
def test_masking_options_lower_to_kernels(lower, case):
    _, kwargs, mask_types, window, softcap = case
    static, names, arrays = _split_arrays(kwargs)

    def loss(q, k, v, *masks):
        out, lse = jax_tk.attention_with_lse(q, k, v, **static, **dict(zip(names, masks)))
        return jnp.sum(jnp.sin(out.astype(F32))) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    q, k, v = _abstract(B_, T_, S_)
    fwd_text = lower(lambda q, k, v, *m: jax_tk.attention_with_lse(q, k, v, **static, **dict(zip(names, m))),
                     q, k, v, *arrays)
    grad_text = lower(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, *arrays)
    (fwd_only,) = tk_calls(fwd_text, FWD_TARGET)
    assert tk_calls(fwd_text, BWD_TARGET) == []
    (fwd,) = tk_calls(grad_text, FWD_TARGET)
    (bwd,) = tk_calls(grad_text, BWD_TARGET)
    q_t, kv_t, lse_t = tensor_type(q.shape, BF16), tensor_type(k.shape, BF16), tensor_type((B_, 4, T_), F32)
    segments = mask_types[0] != ABSENT
    for call in (fwd_only, fwd):
        assert call.operand_types == [q_t, kv_t, kv_t] + mask_types + [ORDER_FWD if segments else ABSENT] + NO_MASK
    assert bwd.operand_types == ([q_t, kv_t, kv_t, q_t, lse_t, q_t, lse_t] + mask_types + [ORDER_BWD if segments else ABSENT]
                                 + NO_MASK)
    for call in (fwd_only, fwd, bwd):
        assert (call.attr_int("window_left"), call.attr_int("window_right")) == window
        assert np.float32(call.attr_float("softcap")) == np.float32(softcap)
        assert call.attr_int("is_causal") == int(static.get("is_causal", False))
        assert np.float32(call.attr_float("scale")) == np.float32(0.125)


def test_masking_arrays_are_operands_not_constants():
    """Segment ids and lengths given as jit arguments reach the custom call as those arguments."""
    q, k, v = _abstract(B_, T_, S_)
    f = lambda q, k, v, qs, ks, ql, kl: jax_tk.attention(
        q, k, v, q_segment_ids=qs, kv_segment_ids=ks, query_seq_lengths=ql, key_value_seq_lengths=kl)
    text = lower_jit(f, q, k, v, _ids((B_, T_)), _ids((B_, S_)), _ids((B_,)), _ids((B_,)))
    (call,) = tk_calls(text, FWD_TARGET)
    assert call.operands[:7] == [f"%arg{i}" for i in range(7)]  # then the ranges, computed from the ids


def test_masking_under_vmap_lowers_to_kernel():
    """vmap over a stack of problems, each with its own segment ids and lengths: one call, the vmapped
    dimension in front of every operand (the handler folds it into the batch)."""
    e = 3
    q, k, v = _abstract(B_, T_, S_)
    stack = lambda x: jax.ShapeDtypeStruct((e, *x.shape), x.dtype)
    f = jax.vmap(lambda q, k, v, qs, ks, kl: jax_tk.attention(
        q, k, v, q_segment_ids=qs, kv_segment_ids=ks, key_value_seq_lengths=kl, local_window_size=(2, 3)))
    text = lower_jit(f, *map(stack, (q, k, v, _ids((B_, T_)), _ids((B_, S_)), _ids((B_,)))))
    (call,) = tk_calls(text, FWD_TARGET)
    lead = lambda t: t.replace("tensor<", f"tensor<{e}x")
    assert call.operand_types[3:] == [lead(x) for x in (Q_IDS, KV_IDS, ABSENT, LENS, *RANGES, ORDER_FWD, *NO_MASK)]
    assert (call.attr_int("window_left"), call.attr_int("window_right")) == (2, 3)
    assert "stablehlo.while" not in text


@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "grad"])
@pytest.mark.parametrize("dtype,implementation", [(F32, None), (BF16, "xla")], ids=["f32", "xla"])
def test_masking_without_kernel_has_no_custom_call(lower, grad, dtype, implementation):
    fn = functools.partial(jax_tk.attention, local_window_size=3, logits_soft_cap=5.0, implementation=implementation)
    assert_no_tk_calls(lower(_grad_fn(fn) if grad else fn, *_abstract(dtype=dtype)))


# ----------------------------------------------------------------------------------------------
# Where no custom call may appear
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "grad"])
def test_xla_implementation_has_no_custom_call(lower, grad):
    fn = functools.partial(jax_tk.attention, is_causal=True, implementation="xla")
    text = lower(_grad_fn(fn) if grad else fn, *_abstract())
    assert_no_tk_calls(text)


@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "grad"])
@pytest.mark.parametrize(
    "dtype,d", [(F32, 64), (F32, 128), (BF16, 96), (F16, 96), (BF16, 32)], ids=["f32_d64", "f32_d128", "bf16_d96", "f16_d96", "bf16_d32"]
)
def test_unsupported_config_has_no_custom_call(lower, dtype, d, grad):
    fn = jax_tk.attention
    text = lower(_grad_fn(fn) if grad else fn, *_abstract(d=d, dtype=dtype))
    assert_no_tk_calls(text)


@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "grad"])
def test_cpu_lowering_has_no_custom_call(grad):
    fn = functools.partial(jax_tk.attention, is_causal=True)
    f = _grad_fn(fn) if grad else fn
    assert_no_tk_calls(lower_jit(f, *_abstract(), platforms=("cpu",)))
    assert_no_tk_calls(lower_export(f, *_abstract(), platforms=("cpu",)))


# ----------------------------------------------------------------------------------------------
# Other programs
# ----------------------------------------------------------------------------------------------


def test_multi_platform_export_contains_kernel_and_runs_on_cpu():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 9, 4, 64), dtype=np.float32).astype(jnp.dtype(BF16)))
    k = jnp.asarray(rng.standard_normal((1, 13, 2, 64), dtype=np.float32).astype(jnp.dtype(BF16)))
    v = jnp.asarray(rng.standard_normal((1, 13, 2, 64), dtype=np.float32).astype(jnp.dtype(BF16)))
    fn = functools.partial(jax_tk.attention_with_lse, is_causal=True)
    exp = export(fn, q, k, v, platforms=("cuda", "cpu"))
    assert tuple(exp.platforms) == ("cuda", "cpu")
    text = exp.mlir_module()
    assert len(tk_calls(text, FWD_TARGET)) == 1
    assert "stablehlo.case" in text
    # Runs here: the CPU branch is the reference.
    out, lse = exp.call(q, k, v)
    ref_out, ref_lse = reference.attention_with_lse(q, k, v, scale=0.125, is_causal=True)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-5, atol=1e-5)


def test_multi_platform_export_of_grad():
    text = lower_export(_grad_fn(jax_tk.attention), *_abstract(), platforms=("cuda", "cpu"))
    assert len(tk_calls(text, FWD_TARGET)) == 1
    assert len(tk_calls(text, BWD_TARGET)) == 1


@pytest.mark.parametrize("mapped", ["qkv", "q", "kv", "nested"])
def test_vmap_is_one_launch(mapped):
    """vmap, forward and backward, for each combination of mapped operands (and nested vmaps): one
    custom call per direction with the vmapped dimensions in front of its operands, no loop."""
    q, k, v = _abstract(b=2, t=8, s=8, n=4, kh=2, d=64)
    stack = lambda x, n=3: jax.ShapeDtypeStruct((n, *x.shape), x.dtype)
    axes = {"qkv": (0, 0, 0), "q": (0, None, None), "kv": (None, 0, 0), "nested": (0, 0, 0)}[mapped]
    args = [stack(x) if a == 0 else x for x, a in zip((q, k, v), axes)]
    loss = lambda q, k, v: jnp.sum(jax_tk.attention(q, k, v, is_causal=True).astype(F32) ** 2)
    fn = jax.vmap(jax.value_and_grad(loss, argnums=(0, 1, 2)), in_axes=axes)
    lead = (3,)
    if mapped == "nested":
        fn, args, lead = jax.vmap(fn), [stack(x, 5) for x in args], (5, 3)
    text = lower_jit(fn, *args)
    (fwd,), (bwd,) = tk_calls(text, FWD_TARGET), tk_calls(text, BWD_TARGET)
    assert fwd.operand_types[0] == tensor_type((*lead, 2, 8, 4, 64), BF16)
    assert fwd.operand_types[1] == tensor_type((*lead, 2, 8, 2, 64), BF16)  # unmapped ones broadcast
    assert bwd.operand_types[1] == tensor_type((*lead, 2, 8, 2, 64), BF16)
    assert "stablehlo.while" not in text


def test_jit_of_grad_lowering_is_stable():
    """Lowering twice gives the same text (the spec is hashable and static)."""
    f = _grad_fn(jax_tk.attention, is_causal=True)
    assert lower_jit(f, *_abstract()) == lower_jit(f, *_abstract())



@pytest.mark.parametrize("mask_shape", [(B_, 4, T_, S_), (1, 1, T_, S_), (B_, 1, 1, S_)], ids=str)
def test_boolean_mask_lowers_to_kernels(lower, mask_shape):
    """A boolean mask reaches the kernels as its bits, uint32 [mask batch, mask heads, T, words of whole
    128-key blocks], and its block summary, int8 [.., 128-row blocks, 128-key blocks]; with segment ids the forward's tiles are the fixed grid's (no documents' tiles)."""
    mask = jax.ShapeDtypeStruct(mask_shape, jnp.bool_)
    ids_q, ids_kv = _ids((B_, T_)), _ids((B_, S_))
    fn = lambda q, k, v, m, qs, ks: jnp.sum(jax_tk.attention(q, k, v, mask=m, q_segment_ids=qs,
                                                             kv_segment_ids=ks).astype(F32))
    text = lower(jax.grad(fn, argnums=(0, 1, 2)), *_abstract(B_, T_, S_), mask, ids_q, ids_kv)
    (fwd,) = tk_calls(text, FWD_TARGET)
    (bwd,) = tk_calls(text, BWD_TARGET)
    bits = tensor_type((*mask_shape[:2], T_, 4), U32)
    summary = tensor_type((*mask_shape[:2], 1, 1), I8)
    assert fwd.operand_types[-4:] == [ORDER_FWD, bits, summary, NO_BIAS]
    assert bwd.operand_types[-4:] == [ORDER_BWD, bits, summary, NO_BIAS]


@pytest.mark.parametrize("bias_shape", [(B_, 4, T_, S_), (1, 1, T_, S_), (1, 4, 1, S_)], ids=str)
def test_bias_lowers_to_kernels(lower, bias_shape):
    """A bias reaches the kernels in the inputs' dtype, broadcast over rows and keys and padded to whole
    128 x 128 blocks, [bias batch, bias heads, 128, 128]; the backward returns the
    logits' gradient [B, H, 128, 128], summed in XLA to the bias's shape. With a soft cap the
    reference runs."""
    bias = jax.ShapeDtypeStruct(bias_shape, F32)
    fn = lambda q, k, v, b: jnp.sum(jax_tk.attention(q, k, v, b).astype(F32))
    text = lower(jax.grad(fn, argnums=(0, 1, 2, 3)), *_abstract(B_, T_, S_), bias)
    (fwd,) = tk_calls(text, FWD_TARGET)
    (bwd,) = tk_calls(text, BWD_TARGET)
    padded = tensor_type((*bias_shape[:2], 128, 128), BF16)
    assert fwd.operand_types[-1] == padded and bwd.operand_types[-1] == padded
    assert bwd.result_types[-1] == tensor_type((B_, 4, 128, 128), BF16)
    capped = lambda q, k, v, b: jnp.sum(jax_tk.attention(q, k, v, b, logits_soft_cap=5.0).astype(F32))
    assert tk_calls(lower(jax.grad(capped, argnums=(0, 1, 2, 3)), *_abstract(B_, T_, S_), bias)) == []


@pytest.mark.parametrize("deterministic", [False, True])
def test_block_order_operand(lower, deterministic):
    """With segment ids, both kernels get a block order, except the deterministic backward (its turns
    need each head's key blocks in order); the mma.sync variant gets none."""
    ids_q, ids_kv = _ids((B_, T_)), _ids((B_, S_))
    fn = lambda q, k, v, qs, ks: jnp.sum(jax_tk.attention(q, k, v, q_segment_ids=qs, kv_segment_ids=ks,
                                                          deterministic_backward=deterministic).astype(F32))
    text = lower(jax.grad(fn, argnums=(0, 1, 2)), *_abstract(B_, T_, S_), ids_q, ids_kv)
    (fwd,) = tk_calls(text, FWD_TARGET)
    (bwd,) = tk_calls(text, BWD_TARGET)
    assert fwd.operand_types[-4] == ORDER_FWD  # (then the mask's two and the bias)
    assert bwd.operand_types[-4] == (ABSENT if deterministic else ORDER_BWD)


@pytest.mark.parametrize("kernels", ["sm80", "sm86"])
def test_no_block_order_for_the_mma_sync_kernels(monkeypatch, kernels):
    """JAX_TK_KERNELS, read at trace time, is every call's variant attribute; the mma.sync kernels take
    no block order."""
    monkeypatch.setenv("JAX_TK_KERNELS", kernels)
    fn = lambda q, k, v, qs, ks: jnp.sum(jax_tk.attention(q, k, v, q_segment_ids=qs, kv_segment_ids=ks).astype(F32))
    text = lower_jit(jax.grad(fn, argnums=(0, 1, 2)), *_abstract(B_, T_, S_), _ids((B_, T_)), _ids((B_, S_)))
    (fwd,) = tk_calls(text, FWD_TARGET)
    (bwd,) = tk_calls(text, BWD_TARGET)
    assert fwd.operand_types[-4] == ABSENT and bwd.operand_types[-4] == ABSENT
    want = extension.contract("core")["VARIANT_SM80" if kernels == "sm80" else "VARIANT_SM86"]
    assert fwd.attr_int("variant") == want and bwd.attr_int("variant") == want
