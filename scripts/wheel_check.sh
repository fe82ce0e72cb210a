#!/usr/bin/env bash
# On a GPU machine: build the binary wheel (scripts/build_wheel.sh --offline), install it into a fresh
# target with no CUDA compiler on the PATH, and run the test suite against that install from a copy of
# tests/ outside the source tree (the test-kernel tests skip: user wheels leave them out).
#   scripts/wheel_check.sh OUTDIR [pytest args]
# Logs: OUTDIR/wheel_build.log, OUTDIR/wheel_tests.log. JAX_TK_WHEEL_SITE: where to install it (default: a
# temporary folder). JAX_TK_WHEEL=FILE checks that wheel (built elsewhere) instead of building one.
set -uo pipefail
out=${1:?usage: scripts/wheel_check.sh OUTDIR [pytest args]}
shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONUNBUFFERED=1
house=$(mktemp -d) site=${JAX_TK_WHEEL_SITE:-$(mktemp -d)} tree=$(mktemp -d)
rm -rf "$site"/jax_tk*
start=$(date +%s)
if [ -n "${JAX_TK_WHEEL:-}" ]; then
  cp "$JAX_TK_WHEEL" "$house/" || exit 1
  echo "wheel given: $(cd "$house" && ls jax_tk-*.whl)" | tee "$out/wheel_build.log"
else
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16} "$root/scripts/build_wheel.sh" --offline "$house" \
    >"$out/wheel_build.log" 2>&1 || { tail -40 "$out/wheel_build.log"; exit 1; }
  echo "wheel built in $(( $(date +%s) - start )) s: $(cd "$house" && ls jax_tk-*.whl)" | tee -a "$out/wheel_build.log"
fi
# PATH without any folder that holds nvcc
nocuda=$(echo "$PATH" | tr : '\n' | while read -r d; do [ -x "$d/nvcc" ] || echo "$d"; done | paste -sd: -)
env PATH="$nocuda" sh -c 'command -v nvcc' && { echo "nvcc still on the PATH"; exit 1; }
python3 -m pip install -q --no-index --no-deps --target "$site" "$house"/jax_tk-*.whl || exit 1
cp -r "$root/tests" "$root/examples" "$root/benchmarks" "$tree/"
cd "$tree"
env PATH="$nocuda" PYTHONPATH="$site" python3 -P -c \
  "import jax_tk; assert jax_tk.has_cuda_kernels(); print('jax_tk from', jax_tk.__file__)" | tee -a "$out/wheel_tests.log" || exit 1
par=()
if python3 -c "import xdist" 2>/dev/null; then par=(-n "${JAX_TK_TEST_PROCS:-12}"); export XLA_PYTHON_CLIENT_PREALLOCATE=false; fi
env PATH="$nocuda" PYTHONPATH="$site" XLA_FLAGS="--xla_gpu_autotune_level=0 ${XLA_FLAGS:-}" \
  timeout -k 10 "${JAX_TK_TEST_TIMEOUT:-420}" python3 -P -m pytest -q -rs -p no:cacheprovider "${par[@]}" "$@" tests 2>&1 |
  tee -a "$out/wheel_tests.log"
exit "${PIPESTATUS[0]}"
