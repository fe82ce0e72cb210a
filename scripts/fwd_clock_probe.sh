#!/usr/bin/env bash
# ncu, clocks left as they are: the forward kernels of jax_tk and cuDNN at T = 2k and 16k (D = 128,
# non-causal, B*T = 16k, H = 16): duration, SM clock, instructions, issue and tensor-pipe activity.
#   scripts/fwd_clock_probe.sh OUTDIR   (after a build into $JAX_TK_SITE, default /tmp/jax_tk_site)
set -uo pipefail
out=${1:?usage: scripts/fwd_clock_probe.sh OUTDIR}
mkdir -p "$out"
export PYTHONPATH=${JAX_TK_SITE:-/tmp/jax_tk_site} XLA_PYTHON_CLIENT_PREALLOCATE=false
metrics=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__cycles_elapsed.max,sm__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed
for impl in tk cudnn; do
  for bt in "8 2048" "1 16384"; do
    echo "== $impl B T = $bt" | tee -a "$out/clock.txt"
    ncu --clock-control none -k regex:'fwd_sm90|sdpa|fprop|flash|fmha' --metrics $metrics python3 -P scripts/kernel_times_probe.py $impl ${bt% *} ${bt#* } 16 128 fwd 2>&1 |
      grep -E "^\s+[a-z_]+__|^  [A-Za-z_].*\(" | tee -a "$out/clock.txt"
  done
done
