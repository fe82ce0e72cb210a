"""Compare the machine code of two builds of the same kernels, per function, with no GPU: for a
refactor that must not change the generated code (or to see exactly where it does).

  python scripts/sass_compare.py BASE.cubin NEW.cubin [--filter STR] [--diff STR] [--context N]

Each argument is anything cuobjdump reads (a cubin, an object file, a fatbin). For example:
  nvcc -std=c++20 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -Icc -cubin \
       -o /tmp/new.cubin cc/attention/fwd_sm90.cu

Per function (matched by name, with the hash of anonymous namespaces taken out, since it depends on
the file's contents) it prints:
  regs, stack     registers and stack frame bytes (cuobjdump -res-usage; stack > 0 means spills)
  instrs          instructions, padding NOPs at the end left out
  LDL, STL        local-memory loads and stores (spill traffic, counted in the code)
  hot             instructions of each innermost loop that holds HGMMAs (the main loops), '+'-joined
  text            'same' if the instructions are identical once addresses are taken out (branch
                  targets written relative to the branch, in instructions), else the number of
                  lines of a diff between them
  sched           'same' if moreover every instruction's scheduling bits (stall cycles, yield,
                  dependency barriers, reuse flags: the top 23 bits of the encoding) are the same
--diff STR prints the diff of the functions whose name contains STR; --filter STR keeps only those.
Exit status 0 if every function is present in both and its text is the same, 1 otherwise.
cuobjdump comes from $CUOBJDUMP, PATH, $CUDA_HOME/bin, or the pip package nvidia-cuda-cuobjdump.
"""
import argparse
import difflib
import glob
import os
import re
import shutil
import subprocess
import sys

BRANCHES = re.compile(r"^(?:@!?U?P\w+\s+)?(BRA|BRX|BSSY|CALL|JMP|JMX|SSY|PBK|PCNT|WARPSYNC)\b")  # (address operands)
LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\*\s*(0x[0-9a-f]{16})\s*\*/")
ENCODING_HI = re.compile(r"^\s*/\*\s*(0x[0-9a-f]{16})\s*\*/\s*$")


def cuobjdump():
    for c in [os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump"),
              os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump")]:
        if c and os.path.isfile(c):
            return c
    for root in sys.path:  # the pip package nvidia-cuda-cuobjdump
        for c in glob.glob(os.path.join(root, "nvidia", "*", "bin", "cuobjdump")):
            return c
    sys.exit("cuobjdump not found: set CUOBJDUMP, or pip install nvidia-cuda-cuobjdump")


def normalize_names(names):
    """Mangled name -> readable key: demangled (anonymous namespaces then print without the hash of
    the file's contents that their mangled names carry), shortened."""
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    except OSError:
        out = [re.sub(r"_GLOBAL__N__[0-9a-f]+_\d+_\w+?_[0-9a-f]{8}", "_GLOBAL__N_", n) for n in names]
    keys = {}
    for n, d in zip(names, out):
        d = re.sub(r"\([^()]*\)$", "", d.replace("(anonymous namespace)::", ""))
        d = re.sub(r"^void ", "", d)
        keys[n] = d.replace("__nv_bfloat16", "bf16").replace("__half", "half")
    return keys


class Function:
    def __init__(self):
        self.ins = []  # (address, text, scheduling bits)
        self.regs = self.stack = None

    def instructions(self):  # without the trailing padding
        ins = list(self.ins)
        while ins and ins[-1][1] == "NOP":
            ins.pop()
        if ins and re.fullmatch(r"BRA 0x[0-9a-f]+", ins[-1][1]) and int(ins[-1][1].split()[-1], 16) == ins[-1][0]:
            ins.pop()  # the self-loop after EXIT
        return ins

    def text(self):
        out = []
        for i, (a, t, _) in enumerate(self.instructions()):
            if BRANCHES.match(t):
                t = re.sub(r"0x([0-9a-f]+)", lambda m: f".{(int(m.group(1), 16) - a) // 16:+d}", t)
            out.append(t)
        return out

    def sched(self):
        return [s for _, _, s in self.instructions()]

    def loops(self):
        """(instructions, LDL + STL) of each innermost loop that holds HGMMAs."""
        ins = self.instructions()
        index = {a: i for i, (a, _, _) in enumerate(ins)}
        # (after the last EXIT: out-of-line code, e.g. the retry loops of mbarrier waits, whose jumps
        # back into the body are not loops)
        end = max([i for i, (_, t, _) in enumerate(ins) if re.match(r"(@!?U?P\w+\s+)?EXIT\b", t)], default=len(ins))
        spans = []
        for i, (a, t, _) in enumerate(ins[:end]):
            m = re.search(r"\bBRA\b.*0x([0-9a-f]+)", t)
            if m and int(m.group(1), 16) < a and int(m.group(1), 16) in index:
                lo = index[int(m.group(1), 16)]
                if any("HGMMA" in x for _, x, _ in ins[lo:i + 1]):
                    spans.append((lo, i))
        inner = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
        return [(hi - lo + 1, sum(bool(re.match(r"(@\S+\s+)?(LDL|STL)", t)) for _, t, _ in ins[lo:hi + 1]))
                for lo, hi in sorted(inner)]

    def count(self, op):
        return sum(bool(re.match(rf"(@!?U?P\w+\s+)?{op}\b", t)) for _, t, _ in self.instructions())


def read(path, tool):
    funcs, cur, last = {}, None, None
    sass = subprocess.run([tool, "-sass", path], check=True, capture_output=True, text=True).stdout
    res = subprocess.run([tool, "-res-usage", path], check=True, capture_output=True, text=True).stdout
    keys = normalize_names(re.findall(r"Function : (\S+)", sass) + re.findall(r"Function (\S+):", res))
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = funcs.setdefault(keys[m.group(1)], Function())
            continue
        m = LINE.match(line)
        if m and cur is not None:
            last = (int(m.group(1), 16), m.group(2).strip())
            continue
        m = ENCODING_HI.match(line)
        if m and cur is not None and last is not None:
            cur.ins.append((*last, int(m.group(1), 16) >> 41))
            last = None
    name = None
    for line in res.splitlines():
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            name = keys[m.group(1)]
            continue
        m = re.search(r"REG:(\d+) STACK:(\d+)", line)
        if m and name in funcs:
            funcs[name].regs, funcs[name].stack = int(m.group(1)), int(m.group(2))
    return funcs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base")
    ap.add_argument("new")
    ap.add_argument("--filter", default="")
    ap.add_argument("--diff", default=None)
    ap.add_argument("--context", type=int, default=3)
    args = ap.parse_args()
    tool = cuobjdump()
    a, b = read(args.base, tool), read(args.new, tool)
    names = sorted(set(a) | set(b))
    names = [n for n in names if args.filter in n or args.filter in n]
    ok = True
    rows = [("function", "regs", "stack", "instrs", "LDL", "STL", "hot", "text", "sched")]

    def pair(x, y):
        return str(x) if x == y else f"{x}->{y}"

    for n in names:
        if n not in a or n not in b:
            rows.append((n, "only in " + ("base" if n in a else "new"), "", "", "", "", "", "", ""))
            ok = False
            continue
        fa, fb = a[n], b[n]
        ta, tb = fa.text(), fb.text()
        diff = list(difflib.unified_diff(ta, tb, "base", "new", n=args.context, lineterm=""))
        same = ta == tb
        ok &= same
        hot = lambda f: "+".join(f"{i}" + (f"({s} LDL/STL)" if s else "") for i, s in f.loops()) or "-"
        rows.append((n, pair(fa.regs, fb.regs), pair(fa.stack, fb.stack), pair(len(ta), len(tb)),
                     pair(fa.count("LDL"), fb.count("LDL")), pair(fa.count("STL"), fb.count("STL")),
                     pair(hot(fa), hot(fb)), "same" if same else f"{len(diff)} lines",
                     "same" if same and fa.sched() == fb.sched() else "differs"))
        if args.diff is not None and (args.diff in n or args.diff in n) and not same:
            print(f"--- {n}")
            print("\n".join(diff))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
