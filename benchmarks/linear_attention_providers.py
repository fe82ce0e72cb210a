"""Linear-attention providers: jax_tk and its peers, each as a ``harness.Provider`` for one
``linear_attention.LinearAttentionConfig``, and the float32 reference the results are checked against.

Every provider's ``fn`` takes the benchmark's inputs as they are, ``(q, k, v, g, beta)`` for
``gated_delta_rule`` and ``(q, k, v, g)`` for ``simple_gla`` (q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``
in bf16; g, beta ``[B, T, HV]`` float32), with the scale ``K ** -0.5`` passed explicitly, no initial
state and ``output_final_state=False`` (a training step), and returns the output ``o`` ``[B, T, HV, V]``
(the first element of the ``(o, final_state)`` pair every provider returns). The gated delta rule runs
with ``use_qk_l2norm=True`` (Qwen3-Next's layer: q and k normalized over K inside the op).

- ``jax_tk``: ``jax_tk.linear_attention.<op>(..., implementation=None)``, jax_tk's default path (while
  the CUDA kernels are not built, the chunked XLA path: then the same program as ``xla``);
- ``xla``: ``jax_tk.linear_attention.<op>(..., implementation="xla")``, the chunked XLA path (chunks of
  64 tokens, matrix products inside a chunk, a ``lax.scan`` over chunks), float32 arithmetic;
- ``jla``: jax-linear-attention's Pallas Mosaic GPU kernels (Hopper),
  ``jla.ops.mosaic_gpu.gated_delta_rule.gated_delta_rule`` and
  ``jla.ops.mosaic_gpu.scalar_gate.simple_gla``. They take our layout as it is (q, k ``[B, T, Hk, K]``,
  v ``[B, T, H, V]``, g and beta ``[B, T, H]``, g the natural-log decay, the same keywords ``scale``,
  ``initial_state``, ``output_final_state``, ``use_qk_l2norm``) and return ``(o, final_state or
  None)``, so nothing is adapted. Skipped with the reason where their own ``unsupported_reason``
  rejects the call (sm_90 only; bf16/fp16; K, V in {64, 128}; at most 65535 chunks per grid).

A peer whose package is missing, or that finds no CUDA GPU, is recorded as skipped, "unavailable: ..."
(``peers.load``).

The check: the output (``fwd``) or the gradients (``bwd``) on batch 0 against the chunked XLA path
run in float32 on float32 copies of the inputs (the token-by-token ``implementation="reference"`` is
too slow for T = 32k).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from benchmarks import harness, peers
from benchmarks.harness import Provider, Skip

GDR, GLA = "gated_delta_rule", "simple_gla"
OPS = (GDR, GLA)
JLA_MODULES = {GDR: "jla.ops.mosaic_gpu.gated_delta_rule", GLA: "jla.ops.mosaic_gpu.scalar_gate"}


def _op_fn(op: str, scale: float, call):
    """``fn(q, k, v, g[, beta]) -> o`` for ``call(q, k, v, g[, beta], **keywords) -> (o, state)``."""
    kw = dict(scale=scale, output_final_state=False)
    if op == GDR:
        return lambda q, k, v, g, beta: call(q, k, v, g, beta, use_qk_l2norm=True, **kw)[0]
    return lambda q, k, v, g: call(q, k, v, g, **kw)[0]


def _jax_tk_call(op: str, implementation):
    import jax_tk.linear_attention as la

    return functools.partial(getattr(la, op), implementation=implementation)


def _jax_tk_provider(cfg) -> Provider:
    return Provider("jax_tk", _op_fn(cfg.op, cfg.scale, _jax_tk_call(cfg.op, None)), cfg.scale,
                    note=f"linear_attention.{cfg.op}(implementation=None)")


def _xla_provider(cfg) -> Provider:
    return Provider("xla", _op_fn(cfg.op, cfg.scale, _jax_tk_call(cfg.op, "xla")), cfg.scale,
                    note=f"linear_attention.{cfg.op}(implementation='xla'): the chunked XLA path")


def _jla_provider(cfg) -> Provider:
    mod, _ = peers.load("jla", JLA_MODULES[cfg.op])
    spec = lambda shape, dtype=cfg.jnp_dtype: jax.ShapeDtypeStruct(shape, dtype)
    q, v, gate = spec(cfg.shape_qk), spec(cfg.shape_v), spec(cfg.shape_gate, jnp.float32)
    options = dict(scale=cfg.scale, output_final_state=False)
    if cfg.op == GDR:
        options["use_qk_l2norm"] = True
    # (both modules hold scalar_gate's unsupported_reason; the K = 256 path of gated_delta_rule is not used here)
    reason = mod.unsupported_reason(q, q, v, (gate,) * (2 if cfg.op == GDR else 1), options, delta=cfg.op == GDR)
    if reason is not None:
        raise Skip(f"{JLA_MODULES[cfg.op]}: {reason}")
    return Provider("jla", _op_fn(cfg.op, cfg.scale, getattr(mod, cfg.op)), cfg.scale,
                    note=f"{JLA_MODULES[cfg.op]}.{cfg.op}")


FACTORIES = {"jax_tk": _jax_tk_provider, "xla": _xla_provider, "jla": _jla_provider}
PROVIDERS = tuple(FACTORIES)


def make_provider(name: str, cfg) -> Provider:
    return harness.factory(FACTORIES, name)(cfg)


# ----------------------------------------------------------------------------------------------
# The float32 reference on batch 0
# ----------------------------------------------------------------------------------------------


def _batch0_f32(args):
    return tuple(x[:1].astype(jnp.float32) for x in args)


@functools.partial(jax.jit, static_argnames=("op", "scale"))
def _reference_out(args, *, op, scale):
    return _reference_fn(op, scale)(*_batch0_f32(args))


def _reference_fn(op: str, scale: float):
    return _op_fn(op, scale, _jax_tk_call(op, "xla"))


@functools.partial(jax.jit, static_argnames=("op", "scale"))
def _reference_grads(args, dout, *, op, scale):
    _, vjp = jax.vjp(_reference_fn(op, scale), *_batch0_f32(args))
    return vjp(dout[:1].astype(jnp.float32))


def check_fwd(cfg, provider: Provider, args, out) -> float:
    ref = _reference_out(tuple(args), op=cfg.op, scale=cfg.scale)
    return harness.rel_err([out[:1]], [ref])


def check_bwd(cfg, provider: Provider, args, dout, grads) -> float:
    """The gradients w.r.t. every input (q, k, v, g and beta), batch 0 (the batches are independent)."""
    ref = _reference_grads(tuple(args), dout, op=cfg.op, scale=cfg.scale)
    return harness.rel_err([g[:1] for g in grads], ref)
