#!/usr/bin/env bash
# ncu profile of the kernels matching KERNEL_REGEX in one attention call (scripts/ncu_probe.py, given
# PROBE_ARGS; PROBE=scripts/ncu_probe_gemm.py: one grouped or dense product): the report, its details
# page (throughput, pipes, warp stalls, ...) and the SASS with its stall samples.
#   scripts/ncu_profile.sh OUTDIR KERNEL_REGEX [PROBE_ARGS...]   (after a build into $JAX_TK_SITE,
#   default /tmp/jax_tk_site, e.g. by scripts/gpu_check.sh or scripts/ab_build.sh)
# e.g.  scripts/ncu_profile.sh /tmp/prof bwd_sm90_kernel --bwd --shape 8 2048 16 128 --causal
#       scripts/ncu_profile.sh /tmp/prof fwd_sm90 --documents 8
#       scripts/ncu_profile.sh /tmp/prof 'sdpa|fmha|flash' --impl cudnn
#       PROBE=scripts/ncu_probe_gemm.py scripts/ncu_profile.sh /tmp/prof ragged_sm90 --shape qwen --dist routed
#       PROBE=scripts/ncu_probe_linear.py scripts/ncu_profile.sh /tmp/prof 'wy_fwd|gdr_fwd' --shape 4x4k
# (a peer's package installed apart, e.g. with --target: JAX_TK_SITE="/tmp/jax_tk_site:DIR")
# (XLA's own products: a regex without "gemm", e.g. 'nvjet|sm90_xmma', and NCU_ARGS with --launch-skip
# past its autotuner's candidates.)
# NCU_ARGS replaces the default "--set full -c 1" (e.g. "--clock-control none --set full -c 2"; with
# --launch-skip N, give the probe --calls so that there are calls to skip).
set -uo pipefail
out=${1:?usage: scripts/ncu_profile.sh OUTDIR KERNEL_REGEX [ncu_probe.py args...]}
regex=${2:?usage: scripts/ncu_profile.sh OUTDIR KERNEL_REGEX [ncu_probe.py args...]}
shift 2
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH=${JAX_TK_SITE:-/tmp/jax_tk_site} XLA_PYTHON_CLIENT_PREALLOCATE=false
# shellcheck disable=SC2086
ncu -k "regex:$regex" ${NCU_ARGS:---set full -c 1} --import-source yes -f -o "$out/profile" \
  python3 -P "${PROBE:-$here/ncu_probe.py}" "$@" >"$out/ncu.log" 2>&1 || { tail -20 "$out/ncu.log"; exit 1; }
ncu -i "$out/profile.ncu-rep" --page details >"$out/details.txt" 2>&1
ncu -i "$out/profile.ncu-rep" --page source --csv --print-source sass >"$out/sass.csv" 2>&1
grep -E "Duration|Throughput|Pipe|Stall|Issue|Tensor|Bank|Eligible|Active Warps|Shared" "$out/details.txt" | head -60 || true  # (head's early exit)
