#!/usr/bin/env bash
# A/B timing of builds on one GPU: the working tree (built by gpu_check.sh into $JAX_TK_SITE,
# default /tmp/jax_tk_site) against older trees, by default ab_old/ (e.g. `git archive REV | tar -x -C
# ab_old`; AB_TREES="ab_old ab_other" for several), each built here into /tmp/<tree>. Runs the command
# ROUNDS times with each build, alternating, and appends everything to OUTFILE (machines differ by a
# few percent: compare only within one such run).
#   scripts/ab.sh OUTFILE ROUNDS command...   e.g. scripts/ab.sh ab.log 2 python3 -P -m jax_tk.bench attention ...
# Each run of the command is stopped after AB_TIMEOUT seconds (default 120): a build that hangs costs
# that much, not the whole call. scripts/ab_build.sh builds all the trees at once beforehand.
set -uo pipefail
log=${1:?usage: scripts/ab.sh OUTFILE ROUNDS command...}
rounds=${2:?usage: scripts/ab.sh OUTFILE ROUNDS command...}
shift 2
sites=()
for tree in ${AB_TREES:-ab_old}; do
  if [ ! -d "/tmp/$tree/jax_tk" ]; then
    (cd "$tree" && CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16} JAX_TK_CUDA=ON \
      python3 -m pip install --no-build-isolation --no-deps --target "/tmp/$tree" . >"/tmp/$tree.build.log" 2>&1) ||
      { tail -30 "/tmp/$tree.build.log" >>"$log"; exit 1; }
  fi
  sites+=("/tmp/$tree")
done
sites+=("${JAX_TK_SITE:-/tmp/jax_tk_site}")
for ((r = 0; r < rounds; r++)); do
  for site in "${sites[@]}"; do
    echo "=== round $r: $site" >>"$log"
    PYTHONPATH="$site" timeout "${AB_TIMEOUT:-120}" "$@" >>"$log" 2>&1 || echo "rc=$? (124: timed out)" >>"$log"
  done
done
