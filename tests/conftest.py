import os
import shutil
import subprocess
import sys
import tempfile

# Several test processes (pytest-xdist) share a GPU: each takes memory as it needs it instead of 75% of
# it up front (set before JAX starts its backends, below).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Without a GPU, XLA's CPU backend generates the code of the tests' programs with its older loop emitters
# rather than its MLIR fusion emitters (xla_cpu_use_fusion_emitters=false; the HLO passes, fusion and
# the partitioner, run as before). Compiling is most of a CPU run, and this takes about 60% off it: the
# whole suite 33.5 -> 22.8 minutes of CPU on 2 cores, the same tests passing. XLA reads XLA_FLAGS
# once, when its backend starts, and aborts on a flag it does not know; so the first process (pytest,
# or xdist's controller) asks a child Python, before this one starts JAX, whether this jaxlib knows the
# flag and runs on the CPU, and passes the answer on through the environment to the test processes and
# to subprocesses (the multi-device tests', the examples'), which then ask no more.
_CPU_FLAG = "--xla_cpu_use_fusion_emitters=false"
_PROBED = "JAX_TK_TESTS_XLA_FLAGS_PROBED"
if not os.environ.get(_PROBED):
    os.environ[_PROBED] = "1"
    _flags = (os.environ.get("XLA_FLAGS", "") + " " + _CPU_FLAG).strip()
    try:
        _probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"],
                                env=dict(os.environ, XLA_FLAGS=_flags, XLA_PYTHON_CLIENT_PREALLOCATE="false"),
                                capture_output=True, text=True, timeout=300)
        if _probe.returncode == 0 and _probe.stdout.split()[-1:] == ["cpu"]:
            os.environ["XLA_FLAGS"] = _flags
    except (OSError, subprocess.TimeoutExpired):
        pass

import jax  # noqa: E402
import pytest  # noqa: E402

# Float32 references mean float32: on GPUs, XLA's default matmul precision would use TF32 (about
# 1e-3 relative error), which the tests' 1e-5 comparisons with jax.nn (and the kernels' fp32
# references) must not see.
jax.config.update("jax_default_matmul_precision", "highest")


def _gpu_available() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


GPU = _gpu_available()

# Without a GPU the tests are mostly XLA's CPU compiles of small programs, whose LLVM code generation
# at the default optimization level takes most of the run (about a third less time without it, and
# the programs' sizes are small enough that running unoptimized code costs little). The HLO passes
# (fusion, the partitioner the sharding tests check) still run.
if not GPU:
    jax.config.update("jax_disable_most_optimizations", True)

# Without a GPU, a persistent compilation cache for this run only (a fresh folder, removed at its end,
# shared with the other test processes and the subprocesses through the environment): tests that
# compile the same program twice (an example's two paths that are one pure-JAX program off the GPU, the
# same reference in several tests) compile it once. Only programs that took a while to compile are
# kept: writing the many small ones costs about what reading them back saves.
_OWN_CACHE = None
if not GPU and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _OWN_CACHE = tempfile.mkdtemp(prefix="jax_tk_tests_compilation_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")
    jax.config.update("jax_compilation_cache_dir", _OWN_CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


def pytest_configure(config):
    # Registered here, not only in pyproject.toml, so that the tests also run outside the source tree
    # (e.g. against an installed wheel).
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and the compiled kernels (skipped otherwise)")
    config.addinivalue_line("markers", "slow: long-running (run first)")


def pytest_unconfigure(config):
    if _OWN_CACHE:  # (the process that made the cache: pytest, or xdist's controller)
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    # Long tests first (marked slow; a stable sort keeps the order otherwise): started late, one of
    # them would be the last test running while the other test processes wait with nothing to take.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if GPU:
        from jax_tk._core import extension

        if not extension.has_cuda_kernels():
            raise pytest.UsageError(
                "a CUDA GPU is present but jax_tk was built without its kernels: reinstall with nvcc"
            )
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
