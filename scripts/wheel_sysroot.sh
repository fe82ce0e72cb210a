#!/usr/bin/env bash
# Prepare the old-glibc toolchain that scripts/build_wheel.sh compiles the wheel's host code with:
# Debian 11 (bullseye)'s g++-10, glibc 2.31 and libstdc++ (GCC 10), unpacked into a sysroot.
#   scripts/wheel_sysroot.sh [DIR]      (DIR: default build/wheel-sysroot; prints DIR when done)
# Why: a shared object built against the build machine's glibc references the newest symbol
# versions of that glibc (GLIBC_2.34 and up for pthread_*, dlopen, ... on any glibc >= 2.34), and
# its libstdc++ requires the libstdc++ of the build machine's GCC: the wheel would then install only
# on systems as new as the build machine. Built against glibc 2.31 and GCC 10's libstdc++
# (GLIBCXX_3.4.28), the wheel is manylinux_2_31: Ubuntu 20.04, Debian 11, RHEL 9 and newer.
# Why bullseye's own GCC rather than this machine's with --sysroot: a newer GCC's libstdc++ (shared
# or static) was itself built against a newer glibc and carries newer GLIBC/GLIBCXX symbol versions
# (__libc_single_threaded, GLIBCXX_3.4.30, ...); GCC 10 and its libstdc++ were built against glibc 2.31.
# GCC 10 is also the oldest host compiler with which nvcc accepts -std=c++20.
# How: apt-get, with a private configuration and state under DIR/.apt (the machine's apt setup and
# dpkg database are not touched, nothing is installed), resolves g++-10's dependencies in bullseye
# and downloads them; dpkg-deb -x unpacks them into DIR. No chroot, no root needed. The compiler
# runs from DIR directly (GCC finds its own parts relative to its binary) and is given
# --sysroot=DIR by the wrappers DIR/bin/gcc and DIR/bin/g++; it uses this machine's binutils (as, ld,
# ar: bullseye's are left out, they need their own shared libraries) and cc1plus's libraries (libisl23, libmpc3,
# libmpfr6, libgmp10, libzstd1: present wherever a GCC 10-12 is installed).
# Needs: apt-get and dpkg-deb (Debian or Ubuntu), network to the Debian mirror, and Debian's archive
# keyring (/usr/share/keyrings/debian-archive-keyring.gpg; on Ubuntu: apt install debian-archive-keyring).
# Environment: JAX_TK_DEBIAN_MIRROR (default http://deb.debian.org/debian).
# Idempotent: a finished DIR (DIR/.done) is left as it is; delete DIR to rebuild it.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build/wheel-sysroot}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
if [ -f "$dir/.done" ]; then echo "$dir"; exit 0; fi

mirror=${JAX_TK_DEBIAN_MIRROR:-http://deb.debian.org/debian}
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
[ -r "$keyring" ] || { echo "error: $keyring missing (apt install debian-archive-keyring)" >&2; exit 1; }
# The packages: the compiler; glibc's headers and libraries come with it (libstdc++-10-dev -> libc6-dev).
pkgs=(g++-10 libc6-dev linux-libc-dev libstdc++-10-dev libgcc-10-dev)

a=$dir/.apt
mkdir -p "$a/lists/partial" "$a/archives/partial" "$a/etc/preferences.d" "$a/etc/apt.conf.d"
: >"$a/status"   # an empty dpkg database: apt resolves the whole dependency closure
cat >"$a/sources.list" <<EOF
deb [signed-by=$keyring] $mirror bullseye main
deb [signed-by=$keyring] $mirror bullseye-updates main
deb [signed-by=$keyring] ${mirror%/debian}/debian-security bullseye-security main
EOF
aptopts=(-o "Dir::Etc::sourcelist=$a/sources.list" -o Dir::Etc::sourceparts=-
         -o "Dir::Etc::preferencesparts=$a/etc/preferences.d" -o "Dir::Etc::parts=$a/etc/apt.conf.d"
         -o "Dir::State::lists=$a/lists" -o "Dir::State::status=$a/status"
         -o "Dir::Cache=$a/cache" -o "Dir::Cache::archives=$a/archives"
         -o APT::Architecture=amd64 -o APT::Architectures::=amd64
         -o APT::Install-Recommends=false -o Debug::NoLocking=true -o APT::Sandbox::User=root)
echo "== bullseye package lists ($mirror)" >&2
apt-get "${aptopts[@]}" -q update >&2
echo "== downloading ${pkgs[*]} and their dependencies" >&2
apt-get "${aptopts[@]}" -q -y --download-only install "${pkgs[@]}" >&2
# Not bullseye's binutils (ar, as, ld: the compiler's dependencies): they need their own shared
# libraries, which this machine's loader does not look for in DIR; this machine's binutils are used.
for deb in "$a"/archives/*.deb; do
  case $(basename "$deb") in binutils*|libbinutils*|libctf*) continue ;; esac
  dpkg-deb -x "$deb" "$dir"
done

# Absolute symlinks inside the sysroot (e.g. usr/lib/x86_64-linux-gnu/libm.so, libgcc_s.so) point
# into this machine's / when followed from outside: make them relative to DIR.
find "$dir" -path "$a" -prune -o -type l -lname '/*' -print | while read -r link; do
  target=$(readlink "$link")
  ln -sfn "$(realpath -m --relative-to="$(dirname "$link")" "$dir$target")" "$link"
done

# The wrappers nvcc and CMake use as the host compiler. bullseye's gcc-10 is configured with
# --with-sysroot=/ so that --sysroot moves all its header and library paths into DIR.
mkdir -p "$dir/bin"
for tool in gcc g++; do
  cat >"$dir/bin/$tool" <<EOF
#!/bin/sh
# bullseye's $tool-10 with its headers and libraries from this sysroot (scripts/wheel_sysroot.sh)
exec "$dir/usr/bin/x86_64-linux-gnu-$tool-10" --sysroot="$dir" "\$@"
EOF
  chmod +x "$dir/bin/$tool"
done
# Probe: the compiler runs here and links a C++ program against the sysroot's glibc and libstdc++.
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
printf '#include <string>\n#include <cstdio>\nint main() { std::string s = "ok"; std::puts(s.c_str()); }\n' >"$probe/p.cc"
"$dir/bin/g++" -std=c++20 -O2 "$probe/p.cc" -o "$probe/p"
"$dir/bin/g++" --version | head -1 >&2
touch "$dir/.done"
echo "$dir"
