#!/usr/bin/env bash
# Build the working tree into $JAX_TK_SITE (default /tmp/jax_tk_site) and each tree of $AB_TREES into
# /tmp/<tree>, all at once; a build already there is kept. Logs: OUTDIR/build_*.log. Exits non-zero if
# a build failed (scripts/ab.sh calls it for the trees it times).
#   scripts/ab_build.sh OUTDIR
set -uo pipefail
out=${1:?usage: scripts/ab_build.sh OUTDIR}
mkdir -p "$out"
build() {  # tree target
  [ -d "$2/jax_tk" ] && return 0
  (cd "$1" && CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16} JAX_TK_CUDA=ON \
    python3 -m pip install --no-build-isolation --no-deps --target "$2" .) >"$out/build_$(basename "$2").log" 2>&1
  local rc=$?
  echo "build $1 -> $2 rc=$rc"
  return $rc
}
pids=()
build . "${JAX_TK_SITE:-/tmp/jax_tk_site}" & pids+=($!)
for tree in ${AB_TREES:-}; do build "$tree" "/tmp/$tree" & pids+=($!); done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
exit $rc
