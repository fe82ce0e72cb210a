"""What the tests share: the repository's root, random inputs, relative errors, poisoned buffers and
the 8-device subprocess for multi-device tests on CPU. (tests/conftest.py puts this folder on sys.path.)"""
import math
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_tk._core import extension

REPO = pathlib.Path(__file__).resolve().parents[1]
F32 = jnp.float32
# For tests of the kernel path's operands (lowering for CUDA, workspace shapes): they need the formulas of
# the compiled extension, which a source tree that was never built lacks (every op then runs its reference).
needs_extension = pytest.mark.skipif(not extension.available(),
                                     reason="needs the compiled extension jax_tk._tk (pip install -e .)")


def randn(rng, shape, dtype):
    """Standard normal values in ``dtype``, rounded on the host (no eager device op to compile per
    shape). Never zeros or ones."""
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(jnp.dtype(dtype)))


def attention_inputs(seed, b, t, s, n, kh, d, dtype, cotangents=False, cotangent_dtype=None, dv=None):
    """q ``[b, t, n, d]``, k ``[b, s, kh, d]`` and v ``[b, s, kh, dv]`` (``dv`` default ``d``) in ``dtype``;
    with ``cotangents``, also dout ``[b, t, n, dv]`` and dlse ``[b, n, t]`` (in ``cotangent_dtype``,
    default ``dtype``)."""
    dv = d if dv is None else dv
    rng = np.random.default_rng(seed)
    arrays = [randn(rng, (b, t, n, d), dtype), randn(rng, (b, s, kh, d), dtype), randn(rng, (b, s, kh, dv), dtype)]
    if cotangents:
        ct = cotangent_dtype or dtype
        arrays += [randn(rng, (b, t, n, dv), ct), randn(rng, (b, n, t), ct)]
    return tuple(arrays)


def rel_err(x, ref, floor=0.0):
    """norm(x - ref) / norm(ref), in float64. The denominator is at least ``floor`` times the norm of a
    tensor of ones of the same size, so that a reference that is zero analytically (dq when every
    query row sees exactly one key) compares its rounding noise against a small absolute scale; with
    ``floor=0`` an all-zero reference gives the absolute error."""
    x, ref = np.asarray(x).astype(np.float64), np.asarray(ref).astype(np.float64)
    assert x.shape == ref.shape, (x.shape, ref.shape)
    num, den = np.linalg.norm(x - ref), max(np.linalg.norm(ref), floor * math.sqrt(ref.size))
    return num / den if den > 0 else num


def sink_attention_oracle(q, k, v, visible, scale, sinks):
    """(out, lse) in float32, densely, with attention sinks: each head's sink is one more logit column of
    every row, whose weight is dropped from the output. q ``[B, T, N, D]``, k and v ``[B, S, K, D]``
    (grouped heads repeated), visible ``[B, T, S]`` booleans (the caller's masking rule), sinks ``[N]``."""
    b, t, n, _ = q.shape
    g = n // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    logits = jnp.einsum("btnd,bsnd->bnts", q, k, precision="highest") * scale
    logits = jnp.where(visible[:, None], logits, -1e30)  # (an empty row's key weights are exp(-1e30 - sink) = 0)
    full = jnp.concatenate([jnp.broadcast_to(sinks[None, :, None, None], (b, n, t, 1)), logits], axis=-1)
    lse = jax.nn.logsumexp(full, axis=-1)
    out = jnp.einsum("bnts,bsnd->btnd", jnp.exp(full - lse[..., None])[..., 1:], v, precision="highest")
    return out, lse


def nan(shape, dtype):
    """A poisoned buffer: outputs aliased to it must all be written."""
    return jnp.full(shape, jnp.nan, dtype)


# Multi-device tests on CPU: XLA fixes the number of CPU devices when its backend starts, which another
# test module has already done in this process; a module that needs 8 devices reruns itself in a fresh
# Python with them (run_in_subprocess) unless this process already has them (have_devices).
N_DEVICES = 8
CHILD_ENV = "JAX_TK_MULTIDEVICE_CHILD"


# The child imports the jax_tk this process imported: an editable install's import redirect (a
# meta-path finder) would otherwise send a checkout's tests (e.g. a git worktree's) to the installed
# tree. Its compiled modules, where an editable install keeps them in its build folder (found only
# through that redirect), are loaded from the files this process loaded.
def _loaded_extensions() -> dict:
    import jax_tk

    package = pathlib.Path(jax_tk.__file__).resolve().parent
    names = ("jax_tk._tk", "jax_tk._tk_tests")
    files = {n: getattr(sys.modules.get(n), "__file__", None) for n in names}
    # (those beside the package's sources are found the usual way)
    return {n: f for n, f in files.items() if f and pathlib.Path(f).resolve().parent != package}


_CHILD = (
    "import sys, importlib.util; "
    "sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != 'ScikitBuildRedirectingFinder']; "
    f"sys.path.insert(0, {str(pathlib.Path(__import__('jax_tk').__file__).resolve().parents[1])!r}); "
    f"exts = {_loaded_extensions()!r}\n"
    "for name, path in exts.items():\n"
    "    spec = importlib.util.spec_from_file_location(name, path); m = importlib.util.module_from_spec(spec)\n"
    "    sys.modules[name] = m; spec.loader.exec_module(m)\n"
    "import pytest; sys.argv[0] = 'pytest'; sys.exit(pytest.main(sys.argv[1:]))"
)


def have_devices() -> bool:
    return jax.default_backend() == "cpu" and jax.device_count() >= N_DEVICES


def cuda_devices() -> list:
    """This process's CUDA devices ([] without any)."""
    try:
        return jax.devices("cuda")
    except RuntimeError:
        return []


def load_example(filename: str, module_name: str):
    """examples/<filename> imported as module ``module_name`` (once; registered in sys.modules, where
    dataclasses look their module up; examples/ on sys.path for the examples' own imports)."""
    import importlib.util

    if module_name in sys.modules:
        return sys.modules[module_name]
    if str(REPO / "examples") not in sys.path:
        sys.path.insert(0, str(REPO / "examples"))
    spec = importlib.util.spec_from_file_location(module_name, REPO / "examples" / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def collectives(hlo_text: str) -> set:
    """The collective ops named in a compiled HLO text."""
    return set(re.findall(r"\b(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)", hlo_text))


def run_in_subprocess(path):
    if os.environ.get(CHILD_ENV):
        raise AssertionError(f"the {N_DEVICES}-device subprocess did not get {N_DEVICES} CPU devices")
    # The child runs the file's tests itself, one after another, without pytest-xdist's processes
    # (pyproject.toml's addopts, "-n auto", cleared): each of those would start JAX and collect the file
    # again, and the test processes of this run already keep every core busy.
    run_file_in_child(path, f"--xla_force_host_platform_device_count={N_DEVICES}", JAX_PLATFORMS="cpu",
                      pytest_args=("-o", "addopts="), **{CHILD_ENV: "1"})


def multi_device_tests(path):
    """For a test file whose tests need N_DEVICES CPU devices: ``test_in_subprocess, needs_devices =
    multi_device_tests(__file__)``. Where this process lacks the devices, test_in_subprocess reruns the
    file in a child that has them (run_in_subprocess); where it has them, the tests marked
    needs_devices run here."""
    here = have_devices()

    @pytest.mark.slow  # (a whole file's tests: run first, see tests/conftest.py)
    @pytest.mark.skipif(here, reason="this process has the devices: the tests run here")
    def test_in_subprocess():
        run_in_subprocess(path)

    return test_in_subprocess, pytest.mark.skipif(not here, reason=f"runs in the {N_DEVICES}-device subprocess")


def child_env(xla_flags: str, **env_updates) -> dict:
    """This process's environment for a child Python: ``xla_flags`` added to XLA_FLAGS, ``env_updates`` set."""
    env = dict(os.environ, **env_updates)
    env["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags).strip()
    return env


def run_file_in_child(path, xla_flags: str, pytest_args=(), **env_updates):
    """Runs the test file ``path`` in a fresh Python with ``xla_flags`` added to XLA_FLAGS (which XLA
    reads once, when its backend starts), ``pytest_args`` on its pytest's command line and
    ``env_updates`` in its environment (one of them tells the child's tests that they are in it);
    fails with the child's output if a test there fails, else returns the end of that output (pytest's
    summary)."""
    env = child_env(xla_flags, **env_updates)
    safe_path = ["-P"] if getattr(sys.flags, "safe_path", False) else []  # as this process was run
    cmd = [sys.executable, *safe_path, "-c", _CHILD, "-q", "-p", "no:cacheprovider", *pytest_args, str(path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    tail = "\n".join(proc.stdout.splitlines()[-60:])
    print(tail)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{tail}\n{proc.stderr[-3000:]}"
    return tail


def scan_step(implementation=None, page_table=None):
    """A lax.scan body of a decoding loop over (query, new key/value) per step, carrying (key cache,
    value cache, lengths): append the new token's key and value (the same array for both), attend.
    ``page_table``: the caches are paged pools."""
    import jax_tk

    def step(carry, x):
        kc, vc, lens = carry
        q, new = x
        kc = jax_tk.decode.update_kv_cache(kc, new, lens, page_table=page_table)
        vc = jax_tk.decode.update_kv_cache(vc, new, lens, page_table=page_table)
        lens = lens + 1
        return (kc, vc, lens), jax_tk.decode.attention(q, kc, vc, lens, page_table=page_table,
                                                       implementation=implementation)

    return step


def seen_rows(t, s, mask=None, **visibility):
    """[batch or 1, t, heads or 1]: whether each query row sees at least one key under the masking
    options of ``jax_tk.attention.reference.visibility`` and a rank-4 boolean ``mask`` (jax.nn gives a
    row that sees none the mean of V, jax_tk 0: comparisons with jax.nn leave those rows out)."""
    from jax_tk.attention import reference

    vis = reference.visibility(t, s, **visibility)[:, None]  # [b, 1, t, s]
    if mask is not None:
        vis = vis & mask
    return jnp.swapaxes(vis.any(axis=-1), 1, 2)
