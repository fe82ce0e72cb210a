#!/usr/bin/env bash
# A/B timing of two builds on one GPU: the working tree (built by gpu_check.sh into $JAX_TK_SITE,
# default /tmp/jax_tk_site) against an older tree in ab_old/ (e.g. `git archive REV | tar -x -C ab_old`),
# built here into /tmp/old. Runs the command ROUNDS times with each build, alternating, and appends
# everything to OUTFILE (machines differ by a few percent: compare only within one such run).
#   scripts/ab.sh OUTFILE ROUNDS command...   e.g. scripts/ab.sh ab.log 2 python3 -P -m jax_tk.bench attention ...
set -uo pipefail
log=${1:?usage: scripts/ab.sh OUTFILE ROUNDS command...}
rounds=${2:?usage: scripts/ab.sh OUTFILE ROUNDS command...}
shift 2
new=${JAX_TK_SITE:-/tmp/jax_tk_site}
if [ ! -d /tmp/old/jax_tk ]; then
  (cd ab_old && CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16} JAX_TK_CUDA=ON \
    python3 -m pip install --no-build-isolation --no-deps --target /tmp/old . >/tmp/old_build.log 2>&1) ||
    { tail -30 /tmp/old_build.log >>"$log"; exit 1; }
fi
for ((r = 0; r < rounds; r++)); do
  for side in old new; do
    site=/tmp/old
    [ $side = new ] && site=$new
    echo "=== round $r: $side ($site)" >>"$log"
    PYTHONPATH="$site" "$@" >>"$log" 2>&1
  done
done
