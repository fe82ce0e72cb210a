#!/usr/bin/env bash
# Build the working tree into $JAX_TK_SITE (default /tmp/jax_tk_site) and each tree of $AB_TREES into
# /tmp/<tree>, all at once; a build already there is kept if it was built from the same sources (a
# stamp of cc/, jax_tk/, CMakeLists.txt and pyproject.toml: a build left by an earlier run is reused only
# for the same sources, never timed in place of another tree). Logs: OUTDIR/build_*.log.
# Exits non-zero if a build failed (scripts/ab.sh calls it for the trees it times).
#   scripts/ab_build.sh OUTDIR
set -uo pipefail
out=${1:?usage: scripts/ab_build.sh OUTDIR}
mkdir -p "$out"
build() {  # tree target
  local stamp
  stamp=$(cd "$1" && find cc jax_tk CMakeLists.txt pyproject.toml -type f -not -name '*.pyc' | sort | xargs cat |
    sha1sum | cut -c1-40)-${JAX_TK_CUDA_ARCHS:-all}-${JAX_TK_TEST_KERNELS:-OFF}
  [ -d "$2/jax_tk" ] && [ "$(cat "$2/.jax_tk_src" 2>/dev/null)" = "$stamp" ] && return 0
  rm -rf "$2"  # (pip install --target keeps a package already there)
  (cd "$1" && CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16} JAX_TK_CUDA=ON \
    python3 -m pip install --no-build-isolation --no-deps --target "$2" .) >"$out/build_$(basename "$2").log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] && echo "$stamp" >"$2/.jax_tk_src"
  echo "build $1 -> $2 rc=$rc"
  return $rc
}
pids=()
build . "${JAX_TK_SITE:-/tmp/jax_tk_site}" & pids+=($!)
for tree in ${AB_TREES:-}; do build "$tree" "/tmp/$tree" & pids+=($!); done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
exit $rc
