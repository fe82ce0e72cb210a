#!/usr/bin/env bash
# Profile of the packed-documents forward: timings (feature_probe rows plain full, one segment,
# 8 documents) and an ncu source-level stall profile of the documents kernel.
#   scripts/docs_profile.sh OUTDIR   (after a build into $JAX_TK_SITE, default /tmp/jax_tk_site)
set -uo pipefail
out=${1:?usage: scripts/docs_profile.sh OUTDIR}
mkdir -p "$out"
export PYTHONPATH=${JAX_TK_SITE:-/tmp/jax_tk_site} XLA_PYTHON_CLIENT_PREALLOCATE=false
PROBE_ROWS=${PROBE_ROWS:-4,5,6} python3 -P scripts/feature_probe.py 2>&1 | grep -E "TF/s" | tee "$out/probe.log"
ncu -k regex:fwd_sm90 --launch-skip 2 -c 1 --section WarpStateStats --section SourceCounters \
  --section ComputeWorkloadAnalysis --import-source yes -f -o "$out/docs" python3 -P scripts/ncu_probe.py >"$out/ncu.log" 2>&1
ncu -i "$out/docs.ncu-rep" --page details >"$out/details.txt" 2>&1
ncu -i "$out/docs.ncu-rep" --page source --csv --print-source sass >"$out/sass.csv" 2>&1
grep -E "Warp Cycles|Stall|Issue|Tensor|Pipe" "$out/details.txt" | head -40
