#!/usr/bin/env bash
# A/B timing of builds on one GPU: the working tree (in $JAX_TK_SITE, default /tmp/jax_tk_site, as
# gpu_check.sh or scripts/ab_build.sh left it) against older trees, by default ab_old/ (e.g. `git archive REV | tar -x -C
# ab_old`; AB_TREES="ab_old ab_other" for several), each built into /tmp/<tree> by scripts/ab_build.sh
# (all at once, logs beside OUTFILE). Runs the command ROUNDS times with each build, alternating, and
# appends everything to OUTFILE (machines differ by a few percent: compare only within one such run).
# The command sees PYTHONPATH=<build>:<this repository>, so `python3 -P -m benchmarks` runs this tree's
# benchmark on each build's jax_tk.
#   scripts/ab.sh OUTFILE ROUNDS command...   e.g. scripts/ab.sh ab.log 2 python3 -P -m benchmarks attention ...
# Each run of the command is stopped after AB_TIMEOUT seconds (default 120): a build that hangs costs
# that much, not the whole call.
set -uo pipefail
log=${1:?usage: scripts/ab.sh OUTFILE ROUNDS command...}
rounds=${2:?usage: scripts/ab.sh OUTFILE ROUNDS command...}
shift 2
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$(dirname "$log")"
export AB_TREES=${AB_TREES:-ab_old}
"$(dirname "$0")/ab_build.sh" "$(dirname "$log")" >>"$log" || { tail -30 "$(dirname "$log")"/build_*.log >>"$log"; exit 1; }
sites=()
for tree in $AB_TREES; do sites+=("/tmp/$tree"); done
sites+=("${JAX_TK_SITE:-/tmp/jax_tk_site}")
for ((r = 0; r < rounds; r++)); do
  for site in "${sites[@]}"; do
    echo "=== round $r: $site" >>"$log"
    PYTHONPATH="$site:$root" timeout "${AB_TIMEOUT:-120}" "$@" >>"$log" 2>&1 || echo "rc=$? (124: timed out)" >>"$log"
  done
done
