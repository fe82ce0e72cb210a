"""The peers: other libraries' kernels that the benchmark times beside jax_tk, each imported only when
a run asks for it (FlashAttention-3's library alone is 110 MB).

========  ======================  =========================  ==================================================
provider  pip install             module                     what is timed
========  ======================  =========================  ==================================================
fa3       flash-attn3-jax         flash_attn3_jax            attention: ``flash_mha``, ``flash_mha_varlen``;
                                                             decode: ``flash_mha_with_kvcache``
tokamax   tokamax                 tokamax                    attention: ``dot_product_attention(...,
                                                             implementation="mosaic")``; ragged_dot:
                                                             ``ragged_dot(..., implementation="mosaic")``
jla       jax-linear-attention    jla.ops.mosaic_gpu         attention: ``attention.flash_attention``;
                                                             ragged_dot: ``ragged_dot.ragged_dot``, with
                                                             --dtype fp8 ``ragged_dot_fp8.ragged_dot_fp8``;
                                                             linear_attention:
                                                             ``gated_delta_rule.gated_delta_rule``,
                                                             ``scalar_gate.simple_gla``
========  ======================  =========================  ==================================================

Not timed: FLA's Triton kernels (``fla-core``, PyTorch), another peer of the linear-attention op.

A peer whose package does not import is recorded as skipped, "unavailable: ..." (with the error and
the pip name), and so is one that imports on a machine without a CUDA GPU. tokamax imports the
``xprof`` package for its own benchmarking helper only (``tokamax.benchmarking``, which this benchmark
does not use): where xprof is not installed, a stub package stands in for it (README.md beside this
file says how); without either, tokamax is "unavailable" and the note says so.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import os
from types import ModuleType

import jax.numpy as jnp

from benchmarks.harness import Skip, Unavailable, cuda_capability, short_error


@dataclasses.dataclass(frozen=True)
class Peer:
    name: str  # the provider's name on the command line
    pip: str  # the distribution to install
    module: str  # its top-level module


PEERS = {
    "fa3": Peer("fa3", "flash-attn3-jax", "flash_attn3_jax"),
    "tokamax": Peer("tokamax", "tokamax", "tokamax"),
    "jla": Peer("jla", "jax-linear-attention", "jla"),
}


def installed(name: str) -> bool:
    """Whether the peer's module can be found (without importing it)."""
    try:
        return importlib.util.find_spec(PEERS[name].module) is not None
    except (ImportError, ValueError):  # ValueError: a module in sys.modules without a spec
        return False


def installed_peers(names) -> list[str]:
    """Those of ``names`` that are installed, in order."""
    return [n for n in names if installed(n)]


def versions() -> str:
    """The installed peers' versions, e.g. "flash-attn3-jax 0.2.3, tokamax 0.0.17" ("" for none)."""
    out = []
    for peer in PEERS.values():
        try:
            out.append(f"{peer.pip} {importlib.metadata.version(peer.pip)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join(out)


def _import(module: str) -> ModuleType:
    return importlib.import_module(module)


def load(name: str, module: str | None = None) -> tuple[ModuleType, str]:
    """Imports ``module`` (default the peer's top-level module) of peer ``name``; returns it and the
    CUDA compute capability ("9.0"; "" where jax does not say). Raises Unavailable where it does not
    import or there is no CUDA GPU: every peer here runs on NVIDIA GPUs only."""
    peer = PEERS[name]
    module = module or peer.module
    try:
        mod = _import(module)
    except Exception as e:  # noqa: BLE001 - ImportError, or a CUDA library that does not load
        hint = ""
        if isinstance(e, ImportError) and (getattr(e, "name", "") or "").split(".")[0] == "xprof":
            hint = ("; tokamax imports xprof for its own benchmarking helper only: pip install xprof, or put "
                    "a stub package on PYTHONPATH (see benchmarks/README.md)")
        raise Unavailable(f"{module} does not import (pip install {peer.pip}): {short_error(e, 160)}{hint}") from None
    cc = cuda_capability()
    if cc is None:
        raise Unavailable(f"{module} needs a CUDA GPU")
    return mod, cc


FA3_HEAD_DIMS = (128,)  # what the PyPI wheel of flash-attn3-jax compiles (0.2.3: hdim128 only)


def fa3_head_dims() -> tuple[int, ...]:
    """Head dims the installed FlashAttention-3 supports: FA3_HEAD_DIMS, or JAX_TK_FA3_HEAD_DIMS
    (comma-separated) for a build from source with more."""
    env = os.environ.get("JAX_TK_FA3_HEAD_DIMS", "")
    return tuple(int(x) for x in env.replace(" ", ",").split(",") if x) or FA3_HEAD_DIMS


def fa3(cfg) -> ModuleType:
    """The ``flash_attn3_jax`` module for a configuration (its ``head_dim``, ``dtype``, ``jnp_dtype``);
    Unavailable without the package or a CUDA GPU, Skip off Hopper and for head dims and dtypes the
    build does not take."""
    mod, cc = load("fa3")
    if cc and not cc.startswith("9"):
        raise Skip(f"FlashAttention-3's kernels are built for sm90 (Hopper), this GPU is sm{cc}")
    if cfg.head_dim not in fa3_head_dims():
        raise Skip(f"head_dim {cfg.head_dim}: the flash_attn3_jax build has {fa3_head_dims()} "
                   "(JAX_TK_FA3_HEAD_DIMS for a source build)")
    if cfg.jnp_dtype not in (jnp.bfloat16, jnp.float16):
        raise Skip(f"dtype {cfg.dtype}: FlashAttention-3 takes bf16 or fp16")
    return mod
