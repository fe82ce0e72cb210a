#!/usr/bin/env bash
# A/B candidate builds against a baseline and test the fastest, in one run on a GPU machine:
#   AB_BASE=ab_main AB_TREES="ab_x ab_y" [AB_ROUNDS=2] [AB_MIN=1.007] scripts/ab_pick.sh OUTDIR bench-args...
# e.g. ... scripts/ab_pick.sh /tmp/o --d 128 --seq 2k,4k,8k,16k --causal false --modes bwd
#
# AB_BASE and AB_TREES are source trees in the repository root (`git archive REV | tar -x -C ab_x`);
# the working tree is a candidate too. Steps:
#   1. builds them all at once, 90a only, without the test kernels (scripts/ab_build.sh);
#   2. runs `python -m benchmarks attention --providers jax_tk,cudnn --no-check --png none
#      bench-args` AB_ROUNDS times per build, builds alternating (scripts/ab.sh), into OUTDIR/bench.log;
#   3. scores each candidate by its mean speed over the baseline's, row by row, over every jax_tk row
#      of every round (OUTDIR/pick.txt);
#   4. if the best scores at least AB_MIN, runs JAX_TK_SANITIZE=1 scripts/gpu_check.sh OUTDIR/check in
#      its tree (a full build and the whole GPU suite), so that the build that won is the one tested.
# Exits 0 when no candidate is good enough (nothing tested), else with gpu_check.sh's status.
set -uo pipefail
mkdir -p "${1:?usage: scripts/ab_pick.sh OUTDIR bench-args...}"
out=$(cd "$1" && pwd)  # (absolute: the tests run in the chosen tree)
shift
base=${AB_BASE:?set AB_BASE to the baseline tree}
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"  # (the trees are relative to the repository root)
export JAX_TK_CUDA_ARCHS=90a JAX_TK_TEST_KERNELS=OFF
AB_TREES="$base ${AB_TREES:-}" AB_TIMEOUT=${AB_TIMEOUT:-150} "$here/scripts/ab.sh" "$out/bench.log" "${AB_ROUNDS:-2}" \
  python3 -P -m benchmarks attention --providers jax_tk,cudnn --no-check --png none --out "$out/bench" "$@"
python3 - "$out/bench.log" "/tmp/$base" "${AB_MIN:-1.007}" >"$out/pick.txt" <<'PY'
import collections, re, sys
log, base, least = sys.argv[1], sys.argv[2], float(sys.argv[3])
ms = collections.defaultdict(lambda: collections.defaultdict(list))  # build -> row -> [ms]
build = None
for line in open(log):
    m = re.match(r"=== round \d+: (\S+)", line)
    if m:
        build = m.group(1)
    m = re.match(r"\s+(\d+)\s+(True|False)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+) \|\s+([\d.]+) \(", line)
    if m and build:
        ms[build][m.groups()[:6]].append(float(m.group(7)))
if base not in ms:
    sys.exit(f"no timings of the baseline {base}")
score = {}
for b, rows in ms.items():
    pairs = [(t0, t1) for row, ts in rows.items() for t0, t1 in zip(ms[base].get(row, []), ts)]
    score[b] = sum(t0 / t1 for t0, t1 in pairs) / max(len(pairs), 1)
    print(f"{b}: mean speed over the baseline {score[b]:.4f} ({len(pairs)} rows)")
best = max((b for b in score if b != base), key=score.get, default=None)
print("PICK", best if best and score[best] >= least else "none")
PY
cat "$out/pick.txt"
pick=$(awk '/^PICK/{print $2}' "$out/pick.txt")
[ -z "$pick" ] || [ "$pick" = none ] && exit 0
site=${JAX_TK_SITE:-/tmp/jax_tk_site}
if [ "$pick" = "$site" ]; then dir=$here; else dir=$here/$(basename "$pick"); fi
echo "testing $dir" | tee -a "$out/pick.txt"
unset JAX_TK_CUDA_ARCHS JAX_TK_TEST_KERNELS
cd "$dir" && JAX_TK_SANITIZE=1 scripts/gpu_check.sh "$out/check"
