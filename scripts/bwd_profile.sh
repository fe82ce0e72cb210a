#!/usr/bin/env bash
# ncu profile of the Hopper backward's main kernel on plain non-causal attention (T = 16k, H = 16,
# D = 128): throughput sections, warp stalls and source counters.
#   scripts/bwd_profile.sh OUTDIR   (after a build into $JAX_TK_SITE, default /tmp/jax_tk_site)
set -uo pipefail
out=${1:?usage: scripts/bwd_profile.sh OUTDIR}
mkdir -p "$out"
export PYTHONPATH=${JAX_TK_SITE:-/tmp/jax_tk_site} XLA_PYTHON_CLIENT_PREALLOCATE=false NCU_PROBE=bwd
ncu -k regex:bwd_sm90_kernel -c 1 --set full --import-source yes -f -o "$out/bwd" python3 -P scripts/ncu_probe.py >"$out/ncu.log" 2>&1
ncu -i "$out/bwd.ncu-rep" --page details >"$out/details.txt" 2>&1
ncu -i "$out/bwd.ncu-rep" --page source --csv --print-source sass >"$out/sass.csv" 2>&1
grep -E "Throughput|Pipe|Stall|Issue|Tensor|Bank|Eligible|Active Warps|Shared" "$out/details.txt" | head -60
