#!/usr/bin/env bash
# ncu profile (clocks left as they are) of the Hopper forward on plain non-causal attention at T = 2k
# (B = 8, H = 16, D = 128): throughput sections, warp stalls and the SASS with its stall samples.
#   scripts/fwd_profile.sh OUTDIR [B T]   (after a build into $JAX_TK_SITE, default /tmp/jax_tk_site)
set -uo pipefail
out=${1:?usage: scripts/fwd_profile.sh OUTDIR [B T]}
b=${2:-8} t=${3:-2048}
mkdir -p "$out"
export PYTHONPATH=${JAX_TK_SITE:-/tmp/jax_tk_site} XLA_PYTHON_CLIENT_PREALLOCATE=false
ncu --clock-control none -k regex:fwd_sm90_kernel -c 1 --set full --import-source yes -f -o "$out/fwd" \
  python3 -P scripts/kernel_times_probe.py tk "$b" "$t" 16 128 fwd >"$out/ncu.log" 2>&1
ncu -i "$out/fwd.ncu-rep" --page details >"$out/details.txt" 2>&1
ncu -i "$out/fwd.ncu-rep" --page source --csv --print-source sass >"$out/sass.csv" 2>&1
grep -E "Throughput|Pipe|Stall|Issue|Tensor|Bank|Eligible|Active Warps|Shared|Duration" "$out/details.txt" | head -60
