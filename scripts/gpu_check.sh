#!/usr/bin/env bash
# Build jax_tk on a GPU machine (offline) and run every GPU test, plus the benchmark when asked.
#   scripts/gpu_check.sh OUTDIR [pytest args...]
# Environment: JAX_TK_BENCH=1 also runs the attention benchmark; JAX_TK_BENCH_ARGS passes options;
# JAX_TK_SANITIZE=1 runs compute-sanitizer memcheck and racecheck on a small attention check.
# Logs: OUTDIR/build.log, OUTDIR/tests.log, OUTDIR/junit.xml, OUTDIR/bench.log (+ csv/png).
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

start=$(date +%s)
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16} JAX_TK_CUDA=ON \
  python3 -m pip install --no-build-isolation --no-deps --target "$site" . >"$out/build.log" 2>&1
rc=$?
echo "build rc=$rc in $(( $(date +%s) - start )) s" | tee -a "$out/build.log"
if [ $rc -ne 0 ]; then tail -50 "$out/build.log"; exit $rc; fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"

# python3 -P: do not put the source tree first on sys.path, so the built jax_tk (with its
# extension modules) in $site is the one imported.
python3 -P -c "import jax_tk, sys; assert jax_tk.has_cuda_kernels(), 'no kernels'; print('jax_tk from', jax_tk.__file__)" || exit 1
python3 -P -m pytest -q -rs -p no:cacheprovider --junitxml="$out/junit.xml" "$@" tests 2>&1 | tee "$out/tests.log"
test_rc=${PIPESTATUS[0]}

if [ "${JAX_TK_SANITIZE:-0}" = "1" ]; then  # memcheck and racecheck on tiny shapes; one cudaMalloc
  # per buffer (platform allocator) so that memcheck sees the bounds of each
  for tool in memcheck racecheck; do
    XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool $tool --error-exitcode 3 --target-processes all \
      python3 -P scripts/attention_check.py --small >"$out/sanitizer_$tool.log" 2>&1
    echo "compute-sanitizer $tool rc=$?" | tee -a "$out/sanitizer.log"
    grep -E "ERROR SUMMARY|Error" "$out/sanitizer_$tool.log" | tail -3 | tee -a "$out/sanitizer.log"
  done
fi

if [ "${JAX_TK_BENCH:-0}" = "1" ]; then
  python3 -P -m jax_tk.bench attention --out "$out" ${JAX_TK_BENCH_ARGS:-} 2>&1 | tee "$out/bench.log"
fi
exit $test_rc
