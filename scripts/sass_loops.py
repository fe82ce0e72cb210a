"""The loops of a kernel's SASS (cuobjdump -sass -fun NAME x.o > k.sass), no GPU needed: for each
backward branch, the instructions from its target to it, how many are HGMMA, spill loads/stores
(LDL/STL) and branches. The main loop of an attention kernel is the one with the HGMMAs of one step;
count the LDL/STL in it rather than ptxas's spill bytes (which move mostly on the producer side).
Usage: python scripts/sass_loops.py k.sass"""
import re
import sys

ins = []
for line in open(sys.argv[1]):
    m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
    if m:
        ins.append((int(m.group(1), 16), m.group(2).strip()))
at = {a: i for i, (a, _) in enumerate(ins)}
for i, (a, text) in enumerate(ins):
    m = re.search(r"BRA.*0x([0-9a-f]+)", text)
    if m and int(m.group(1), 16) < a:
        body = [t for _, t in ins[at.get(int(m.group(1), 16), 0):i + 1]]
        print(f"loop {int(m.group(1), 16):#x}-{a:#x}: {len(body)} instructions, "
              f"{sum('HGMMA' in t for t in body)} HGMMA, {sum('LDL' in t or 'STL' in t for t in body)} LDL/STL, "
              f"{sum('BRA' in t for t in body)} branches")
