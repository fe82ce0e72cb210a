#!/usr/bin/env bash
# On a machine with 2 GPUs (offline): build jax_tk, run the multi-GPU tests, then the multi-GPU figures,
# each against one GPU:
#   ring attention: 128k tokens over 2 GPUs against 64k on one (examples/multi_gpu.py --mode ring),
#   decode: the batch split over 2 GPUs against half of it on one (examples/generate.py --devices),
#   mixture of experts: the expert-parallel layer on 2 GPUs against one, bf16 and FP8 (examples/expert_parallel.py --bench --fp8).
#   scripts/multi_gpu_check.sh OUTDIR [pytest args...]
# Environment: MULTI_GPU_FIGURES=0 skips the figures; MULTI_GPU_TEST_TIMEOUT (default 300 s) bounds the tests,
# MULTI_GPU_FIGURE_TIMEOUT (default 240 s) each figure's run;
# JAX_TK_CUDA_ARCHS=90a builds for Hopper alone (faster).
# Logs: OUTDIR/build.log, OUTDIR/tests.log, OUTDIR/ring_{1,2}.log, OUTDIR/decode_{1,2}.log, OUTDIR/moe.log.
set -uo pipefail
out=${1:?usage: scripts/multi_gpu_check.sh OUTDIR [pytest args]}
shift
mkdir -p "$out"
site=${JAX_TK_SITE:-/tmp/jax_tk_site}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/env.log"

start=$(date +%s)
rm -rf "$site"
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-32} JAX_TK_CUDA=ON \
  python3 -m pip install --no-build-isolation --no-deps --target "$site" \
  ${JAX_TK_CUDA_ARCHS:+--config-settings=cmake.define.JAX_TK_CUDA_ARCHS=$JAX_TK_CUDA_ARCHS} . >"$out/build.log" 2>&1
rc=$?
echo "build rc=$rc in $(( $(date +%s) - start )) s" | tee -a "$out/build.log"
[ $rc -ne 0 ] && { tail -30 "$out/build.log"; exit $rc; }
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"

timeout -k 10 "${MULTI_GPU_TEST_TIMEOUT:-300}" python3 -P -m pytest -q -rs -p no:cacheprovider "$@" \
  tests/attention/test_multi_gpu.py tests/decode/test_decode_multi_gpu.py tests/gemm/test_gemm_multi_gpu.py \
  2>&1 | tee "$out/tests.log"
test_rc=${PIPESTATUS[0]}

if [ "${MULTI_GPU_FIGURES:-1}" = "1" ]; then
  figure() { timeout "${MULTI_GPU_FIGURE_TIMEOUT:-240}" python3 -P "$@"; }
  figure examples/multi_gpu.py --mode ring --seq 131072 --sp 2 --steps 10 >"$out/ring_2.log" 2>&1
  figure examples/multi_gpu.py --mode ring --seq 65536 --devices 1 --steps 10 >"$out/ring_1.log" 2>&1
  grep -hiE "tokens/s|error" "$out/ring_2.log" "$out/ring_1.log" | tail -4
  figure examples/generate.py --devices 2 --batch 64 --attention tk --no-check >"$out/decode_2.log" 2>&1
  figure examples/generate.py --devices 1 --batch 32 --attention tk --no-check >"$out/decode_1.log" 2>&1
  grep -h "tk:" "$out/decode_2.log" "$out/decode_1.log"
  figure examples/expert_parallel.py --bench --fp8 2>&1 | tee "$out/moe.log"
fi
exit $test_rc
