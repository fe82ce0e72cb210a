#!/usr/bin/env bash
# Build jax_tk on a GPU machine (offline) and run every GPU test, plus the benchmark when asked.
#   scripts/gpu_check.sh OUTDIR [pytest args and test paths (tests/...)...]
# Environment: JAX_TK_BENCH=1 also runs the attention benchmark (JAX_TK_BENCH=OP: `python -m benchmarks OP`,
# e.g. linear_attention); JAX_TK_BENCH_ARGS passes options;
# JAX_TK_SANITIZE=1 runs compute-sanitizer (memcheck, racecheck, synccheck) on the kernels
# (JAX_TK_SANITIZE_OPS="decode gemm" picks the drivers, default all; JAX_TK_SANITIZE_TIMEOUT stops
# each tool after that many seconds, default 300);
# JAX_TK_EXAMPLE=1 times examples/train_gpt.py (GPU preset, JAX_TK_EXAMPLE_STEPS steps, default 150)
# with each attention: jax_tk, cuDNN and XLA;
# JAX_TK_TESTS=0 skips the tests; JAX_TK_TEST_PROCS sets the number of parallel test processes (default 12);
# JAX_TK_TEST_TIMEOUT stops the tests after that many seconds (default 420: a kernel that hangs).
# Logs: OUTDIR/build*.log, OUTDIR/tests.log, OUTDIR/junit.xml, OUTDIR/sanitizer*.log,
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

# compute-sanitizer on a standalone driver of the kernels (no JAX in the process: memcheck on a
# JAX process crashed), small odd shapes, every variant, one cudaMalloc per buffer. Each family's driver
# builds and its three tools run side by side, beside the tests: they check results, not time.
sanitize() {  # op
  local bin=${TMPDIR:-/tmp}/jax_tk_sanitize; mkdir -p "$bin"
  nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=sm_80 \
    --expt-relaxed-constexpr -lineinfo -Icc "cc/tests/standalone/$1_sanitize.cu" cc/$1/*.cu \
    -o "$bin/$1_sanitize" >"$out/sanitizer_build_$1.log" 2>&1 ||
    { echo "$1 sanitizer driver build failed" | tee -a "$out/sanitizer.log"; return 1; }
  for tool in memcheck racecheck synccheck; do
    (timeout "${JAX_TK_SANITIZE_TIMEOUT:-300}" compute-sanitizer --tool $tool --error-exitcode 3 "$bin/$1_sanitize" \
      >"$out/sanitizer_$1_$tool.log" 2>&1
    echo "compute-sanitizer $tool ($1) rc=$? (124: timed out)" | tee -a "$out/sanitizer.log"
    grep -E "(ERROR|RACECHECK) SUMMARY|FAIL" "$out/sanitizer_$1_$tool.log" | tail -4 | tee -a "$out/sanitizer.log") &
  done
  wait
}
sanitizer_runs=()
if [ "${JAX_TK_SANITIZE:-0}" = "1" ]; then
  for op in ${JAX_TK_SANITIZE_OPS:-attention gemm decode linear_attention}; do sanitize "$op" & sanitizer_runs+=($!); done
fi

start=$(date +%s)
# (scripts/ab_build.sh keeps a build of the same sources already in $site, e.g. one that a profile
# ran on just before)
JAX_TK_TEST_KERNELS=ON JAX_TK_SITE="$site" AB_TREES= "$(dirname "$0")/ab_build.sh" "$out" >"$out/build.log" 2>&1
rc=$?
echo "build rc=$rc in $(( $(date +%s) - start )) s" | tee -a "$out/build.log"
if [ $rc -ne 0 ]; then tail -50 "$out"/build_*.log; exit $rc; fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"

# python3 -P: do not put the source tree first on sys.path, so the built jax_tk (with its
# extension modules) in $site is the one imported.
python3 -P -c "import jax_tk, sys; assert jax_tk.has_cuda_kernels(), 'no kernels'; print('jax_tk from', jax_tk.__file__)" || exit 1
# Tests compile many small XLA programs: run them in parallel processes (pytest-xdist) when it is
# there, each taking GPU memory as needed instead of 75% of it up front.
par=()
if python3 -c "import xdist" 2>/dev/null; then par=(-n "${JAX_TK_TEST_PROCS:-12}"); export XLA_PYTHON_CLIENT_PREALLOCATE=false; fi
test_rc=0
# Arguments that start with "tests" pick the test paths (default: all of tests/); the rest go to pytest.
paths=() opts=()
for a in "$@"; do case $a in tests*) paths+=("$a") ;; *) opts+=("$a") ;; esac; done
[ ${#paths[@]} -gt 0 ] || paths=(tests)
if [ "${JAX_TK_TESTS:-1}" = "1" ]; then
  # No autotuning of XLA's own GEMMs: most of the tests' time would go to it, and they check results only.
  # (-k 10: pytest-xdist's workers may outlive a TERM: KILL them 10 s after it.)
  # (-v: each test's outcome is logged as it ends, so the counts below hold even where the run is cut
  # off: runs on a GPU have reached 100% and then not printed their summary before the timeout.)
  XLA_FLAGS="--xla_gpu_autotune_level=0 ${XLA_FLAGS:-}" \
    timeout -k 10 "${JAX_TK_TEST_TIMEOUT:-420}" python3 -P -m pytest -v -rs -p no:cacheprovider "${par[@]}" --junitxml="$out/junit.xml" "${opts[@]}" "${paths[@]}" >"$out/tests.log" 2>&1
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

# (the sanitizers done before anything is timed: the example and the benchmark)
for pid in "${sanitizer_runs[@]}"; do wait "$pid"; done

if [ "${JAX_TK_EXAMPLE:-0}" = "1" ]; then
  for attn in tk cudnn xla; do
    python3 -P examples/train_gpt.py --attention $attn --steps "${JAX_TK_EXAMPLE_STEPS:-150}" \
      --log-every 50 --eval-every 0 --save-every 0 --sample-len 200 --no-progress \
      --out "$out/example_$attn" >"$out/example_$attn.log" 2>&1
    echo "example --attention $attn rc=$?: $(grep -E '^throughput' "$out/example_$attn.log")" | tee -a "$out/example.log"
  done
fi

if [ "${JAX_TK_BENCH:-0}" != "0" ]; then
  bench_op=${JAX_TK_BENCH/#1/attention}
  # (the benchmark is this tree's benchmarks/, after the build on the path)
  PYTHONPATH="$PYTHONPATH:$(pwd)" python3 -P -m benchmarks "$bench_op" --out "$out" ${JAX_TK_BENCH_ARGS:-} 2>&1 | tee "$out/bench.log"
fi
exit $test_rc
