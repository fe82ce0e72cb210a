#!/usr/bin/env bash
# ncu profiles of the masked Hopper kernels without and with segment ids on the same problem
# (scripts/seg_ncu.py): per mode (fwd, bwd) one report with both kernels, the details page and each
# kernel's SASS with its stall samples.
#   scripts/seg_profile.sh OUTDIR [B T]   (after a build into $JAX_TK_SITE, default /tmp/jax_tk_site;
#   SEG_MODES="bwd" for one mode)
set -uo pipefail
out=${1:?usage: scripts/seg_profile.sh OUTDIR [B T]}
shift
mkdir -p "$out"
export PYTHONPATH=${JAX_TK_SITE:-/tmp/jax_tk_site} XLA_PYTHON_CLIENT_PREALLOCATE=false
for mode in ${SEG_MODES:-fwd bwd}; do
  ncu --clock-control none -k "regex:${mode}_sm90_kernel" -c 2 --section SpeedOfLight --section WarpStateStats \
    --section SourceCounters --section InstructionStats --import-source yes -f -o "$out/$mode" \
    python3 -P scripts/seg_ncu.py "$mode" "$@" >"$out/ncu_$mode.log" 2>&1 || tail -20 "$out/ncu_$mode.log"
  ncu -i "$out/$mode.ncu-rep" --page details >"$out/details_$mode.txt" 2>&1
  ncu -i "$out/$mode.ncu-rep" --page source --csv --print-source sass >"$out/sass_$mode.csv" 2>&1
  grep -E "Duration|Executed Instructions |Stall|Issue Slot|Warp Cycles Per Issued" "$out/details_$mode.txt" | head -40
done
rm -f "$out"/*.ncu-rep
