set -x
export JAX_TK_CUDA_ARCHS=90a
JAX_TK_TESTS=0 scripts/gpu_check.sh $OUT/a > $OUT/a_build.log 2>&1 || { tail -30 $OUT/a_build.log; exit 1; }
export PYTHONPATH=/tmp/jax_tk_site XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_autotune_level=0
timeout 280 python3 -P -m pytest -q -n 12 -p no:cacheprovider tests/core tests/decode/test_decode_kernels_gpu.py tests/decode/test_decode_vmap.py tests/attention/test_kernels_gpu.py > $OUT/tests.log 2>&1
tail -15 $OUT/tests.log
unset XLA_FLAGS XLA_PYTHON_CLIENT_PREALLOCATE
for d in 64 128; do PYTHONPATH=/tmp/jax_tk_site:$PWD timeout 150 python3 -P -m benchmarks attention --features sinks --d $d --modes fwd,bwd --providers jax_tk --timer cupti --png none --out $OUT/b$d > $OUT/bench$d.log 2>&1; grep -v "^#" $OUT/bench$d.log | tail -12; done
