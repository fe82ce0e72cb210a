#!/usr/bin/env bash
# Each kernel's duration (ncu gpu__time_duration) in one jitted gradient of attention, jax_tk and cuDNN,
# for the configurations given (default: the packed-documents baseline's shapes, B x T x H x D, causal
# or not): how the backward's time splits between its pre-pass, main kernel and dq pass. A
# configuration with `docs` (8 packed documents, jax_tk only; `fwd`: the forward alone) lists every
# kernel, the XLA ops that prepare the tiles and the input generation included.
#   scripts/kernel_times.sh OUTFILE ["B T H D [causal] [fwd] [docs]" ...]
set -uo pipefail
out=${1:?usage: scripts/kernel_times.sh OUTFILE [config ...]}
shift
mkdir -p "$(dirname "$out")"
configs=("$@")
[ ${#configs[@]} -eq 0 ] && configs=("8 2048 16 128" "1 6656 16 128" "8 2048 16 128 causal" "1 6656 16 128 causal")
for cfg in "${configs[@]}"; do
  impls="tk cudnn"
  all=0
  case " $cfg " in *" docs "*) impls=tk; all=1 ;; esac
  for impl in $impls; do
    echo "== $impl $cfg" >>"$out"
    # (into a file, not a pipe: a timed-out ncu can leave the profiled process behind holding the pipe
    # open, which once hung the whole call; it is killed below)
    # shellcheck disable=SC2086
    timeout -k 10 "${KT_TIMEOUT:-240}" ncu --csv --metrics gpu__time_duration.sum python3 -P scripts/kernel_times_probe.py \
      $impl $cfg >"$out.ncu" 2>/dev/null || echo "  (ncu rc=$?: 124 = timed out after ${KT_TIMEOUT:-240} s)" >>"$out"
    pkill -9 -f kernel_times_probe.py 2>/dev/null
    ALL=$all python3 -c '
import csv, os, re, sys
rows = [r for r in csv.reader(sys.stdin) if len(r) > 10]
if not rows:
    sys.exit("  (no kernels profiled)")
head, rows = rows[0], rows[1:]
name, unit, value = head.index("Kernel Name"), head.index("Metric Unit"), head.index("Metric Value")
for r in rows:
    k = r[name]
    if os.environ["ALL"] == "1" or "jax_tk" in k or "cudnn" in k:  # (else the attention kernels alone)
        short = re.sub(r"\(.*", "", re.sub(r"^void ", "", k)).split("::")[-1][:60]
        print(f"  {short:60s} {float(r[value].replace(",", "")):10.1f} {r[unit]}")
' <"$out.ncu" >>"$out" 2>&1
    rm -f "$out.ncu"
  done
done
cat "$out"
