#!/usr/bin/env bash
# Build jax_tk on a GPU machine (offline) and run every GPU test, plus the benchmark when asked.
#   scripts/gpu_check.sh OUTDIR [pytest args...]
# Environment: JAX_TK_BENCH=1 also runs the attention benchmark (JAX_TK_BENCH=OP: `python -m benchmarks OP`,
# e.g. linear_attention); JAX_TK_BENCH_ARGS passes options;
# JAX_TK_SANITIZE=1 runs compute-sanitizer (memcheck, racecheck, synccheck) on the kernels
# (JAX_TK_SANITIZE_OPS="decode gemm" picks the drivers, default all);
# JAX_TK_EXAMPLE=1 times examples/train_gpt.py (GPU preset, JAX_TK_EXAMPLE_STEPS steps, default 150)
# with each attention: jax_tk, cuDNN and XLA;
# JAX_TK_TESTS=0 skips the tests; JAX_TK_TEST_PROCS sets the number of parallel test processes (default 12);
# JAX_TK_TEST_TIMEOUT stops the tests after that many seconds (default 420: a kernel that hangs).
# Logs: OUTDIR/build.log, OUTDIR/tests.log, OUTDIR/junit.xml, OUTDIR/sanitizer*.log,
# OUTDIR/example_*.log (+ loss curves), OUTDIR/bench.log (+ csv/png).
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUTDIR [pytest args]}
shift
mkdir -p "$out"
site=${JAX_TK_SITE:-/tmp/jax_tk_site}
export PYTHONUNBUFFERED=1

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
  git rev-parse HEAD 2>/dev/null || true
} 2>&1 | tee "$out/env.log"

# The standalone sanitizer drivers (below), one per kernel family, build alongside the package.
sanitized=(${JAX_TK_SANITIZE_OPS:-attention gemm decode linear_attention})
if [ "${JAX_TK_SANITIZE:-0}" = "1" ]; then
  sanitizer_builds=()
  for op in "${sanitized[@]}"; do
    nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=sm_80 \
      --expt-relaxed-constexpr -lineinfo -Icc "cc/tests/standalone/${op}_sanitize.cu" cc/$op/*.cu \
      -o "$out/${op}_sanitize" >"$out/sanitizer_build_$op.log" 2>&1 &
    sanitizer_builds+=($!)
  done
fi
start=$(date +%s)
rm -rf "$site"  # pip --target keeps a package already there: always install this tree's build
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16} JAX_TK_CUDA=ON JAX_TK_TEST_KERNELS=ON \
  python3 -m pip install --no-build-isolation --no-deps --target "$site" . >"$out/build.log" 2>&1
rc=$?
echo "build rc=$rc in $(( $(date +%s) - start )) s" | tee -a "$out/build.log"
if [ $rc -ne 0 ]; then tail -50 "$out/build.log"; exit $rc; fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"

# python3 -P: do not put the source tree first on sys.path, so the built jax_tk (with its
# extension modules) in $site is the one imported.
python3 -P -c "import jax_tk, sys; assert jax_tk.has_cuda_kernels(), 'no kernels'; print('jax_tk from', jax_tk.__file__)" || exit 1
# Tests compile many small XLA programs: run them in parallel processes (pytest-xdist) when it is
# there, each taking GPU memory as needed instead of 75% of it up front.
par=()
if python3 -c "import xdist" 2>/dev/null; then par=(-n "${JAX_TK_TEST_PROCS:-12}"); export XLA_PYTHON_CLIENT_PREALLOCATE=false; fi
test_rc=0
if [ "${JAX_TK_TESTS:-1}" = "1" ]; then
  # No autotuning of XLA's own GEMMs: most of the tests' time would go to it, and they check results only.
  # (-k 10: pytest-xdist's workers may outlive a TERM: KILL them 10 s after it.)
  # (-v: each test's outcome is logged as it ends, so the counts below hold even where the run is cut
  # off: runs on a GPU have reached 100% and then not printed their summary before the timeout.)
  XLA_FLAGS="--xla_gpu_autotune_level=0 ${XLA_FLAGS:-}" \
    timeout -k 10 "${JAX_TK_TEST_TIMEOUT:-420}" python3 -P -m pytest -v -rs -p no:cacheprovider "${par[@]}" --junitxml="$out/junit.xml" "$@" tests >"$out/tests.log" 2>&1
  test_rc=$?
  # (a test's line: "[gw3] [ 12%] PASSED tests/...::name" with xdist, "tests/...::name PASSED [ 12%]" without)
  count() { grep -cE "(\] $1 [^ ]+::|::[^ ]+ $1( |$))" "$out/tests.log"; }
  echo "tests rc=$test_rc: $(count PASSED) passed, $(count FAILED) failed, $(count ERROR) errors, $(count SKIPPED) skipped" |
    tee -a "$out/tests.log"
  grep -E "(\] (FAILED|ERROR) [^ ]+::|::[^ ]+ (FAILED|ERROR)( |$))" "$out/tests.log" | head -30
  tail -3 "$out/tests.log"
  if grep -q "needs 2 CUDA GPUs" "$out/tests.log"; then
    echo "note: the multi-GPU tests were skipped (one GPU here): scripts/multi_gpu_check.sh runs them on 2" |
      tee -a "$out/tests.log"
  fi
fi

if [ "${JAX_TK_EXAMPLE:-0}" = "1" ]; then
  for attn in tk cudnn xla; do
    python3 -P examples/train_gpt.py --attention $attn --steps "${JAX_TK_EXAMPLE_STEPS:-150}" \
      --log-every 50 --eval-every 0 --save-every 0 --sample-len 200 --no-progress \
      --out "$out/example_$attn" >"$out/example_$attn.log" 2>&1
    echo "example --attention $attn rc=$?: $(grep -E '^throughput' "$out/example_$attn.log")" | tee -a "$out/example.log"
  done
fi

if [ "${JAX_TK_SANITIZE:-0}" = "1" ]; then
  # compute-sanitizer on a standalone driver of the kernels (no JAX in the process: memcheck on a
  # JAX process crashed), small odd shapes, every variant, one cudaMalloc per buffer.
  for i in "${!sanitized[@]}"; do
    op=${sanitized[$i]}
    if ! wait "${sanitizer_builds[$i]}"; then
      echo "$op sanitizer driver build failed" | tee -a "$out/sanitizer.log"
      continue
    fi
    for tool in memcheck racecheck synccheck; do
      timeout "${JAX_TK_SANITIZE_TIMEOUT:-150}" compute-sanitizer --tool $tool --error-exitcode 3 "$out/${op}_sanitize" \
        >"$out/sanitizer_${op}_$tool.log" 2>&1
      echo "compute-sanitizer $tool ($op) rc=$?" | tee -a "$out/sanitizer.log"
      grep -E "(ERROR|RACECHECK) SUMMARY|FAIL" "$out/sanitizer_${op}_$tool.log" | tail -4 | tee -a "$out/sanitizer.log"
    done
  done
fi

if [ "${JAX_TK_BENCH:-0}" != "0" ]; then
  bench_op=${JAX_TK_BENCH/#1/attention}
  # (the benchmark is this tree's benchmarks/, after the build on the path)
  PYTHONPATH="$PYTHONPATH:$(pwd)" python3 -P -m benchmarks "$bench_op" --out "$out" ${JAX_TK_BENCH_ARGS:-} 2>&1 | tee "$out/bench.log"
fi
exit $test_rc
