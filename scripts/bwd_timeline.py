"""A timeline of the Hopper backward's thread blocks, no JAX: builds cc/tests/standalone/bwd_timeline.cu
against a copy of cc/attention/bwd_sm90.cu with %globaltimer stamps added at fixed places
(each block's start, its barriers, K/V in, the first S^T, the loop's end, dK/dV in shared memory, its
end), runs it on each configuration and prints the means per block and the gaps between blocks on an
SM. The stamps go in by text: if the kernel's code at a place changed, this stops and names it.

    python3 scripts/bwd_timeline.py OUTDIR ["B T H [causal]" ...]   (default: 8 2048 16, 1 6656 16)

What it showed first (`c45db19`, H100, B = 8, T = 2k): 6.7 us per block from the loop's end to its
last dK/dV store (registers to global memory pair by pair), about 4 steps; `066278e` sends them by TMA.
"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL = os.path.join(ROOT, "cc/attention/bwd_sm90.cu")

STAMP = """__device__ unsigned long long bwd_timeline_buf[1 << 16][8];  // per block: 7 stamps and the SM
__device__ __forceinline__ void stamp(int k) {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  bwd_timeline_buf[blockIdx.x][k] = t;
}
"""
SM = ("  if (threadIdx.x == 0) {\n    stamp(0);\n    unsigned sm_id;\n"
      "    asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(sm_id));\n    bwd_timeline_buf[blockIdx.x][7] = sm_id;\n  }\n")
EXTRA_S = "  warpgroup::wait<0>();  // the extra S^T\n"
# (place in the kernel, what replaces it): each place must be found once.
EDITS = [
    ("namespace {\n", "namespace {\n" + STAMP),
    ("  const Params &p = a.p;\n", "  const Params &p = a.p;\n" + SM),
    ("    fence_barrier_init();\n  }\n  __syncthreads();\n",
     "    fence_barrier_init();\n  }\n  __syncthreads();\n  if (threadIdx.x == 0) stamp(1);\n"),
    ("    wait(sm.kv_full, 0);\n", "    wait(sm.kv_full, 0);\n    if (threadIdx.x == 0) stamp(2);\n"),
    ("    warpgroup::wait<0>();  // S^T is ready (issued at the end of the last step)\n",
     "    warpgroup::wait<0>();  // S^T is ready (issued at the end of the last step)\n"
     "    if (it == 0 && threadIdx.x == 0) stamp(3);\n"),
    (EXTRA_S, "  if (threadIdx.x == 0) stamp(4);\n" + EXTRA_S),
    ("  arrive(sm.kv_out);\n", "  arrive(sm.kv_out);\n  if (threadIdx.x == 0) stamp(5);\n"),
    ("      bulk_wait_read<0>();  // (the writes are done by the kernel's end)\n",
     "      bulk_wait_read<0>();  // (the writes are done by the kernel's end)\n      stamp(6);\n"),
]
READER = """
namespace jax_tk::attention {
cudaError_t bwd_trace_read(unsigned long long *host, size_t blocks) {
  return cudaMemcpyFromSymbol(host, bwd_timeline_buf, blocks * 8 * sizeof(unsigned long long));
}
}  // namespace jax_tk::attention
"""


def instrumented(src: str) -> str:
    for place, new in EDITS:
        if src.count(place) != 1:
            sys.exit(f"bwd_timeline.py: the kernel's code changed at:\n{place}")
        src = src.replace(place, new)
    return src + READER


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else sys.exit(__doc__)
    configs = sys.argv[2:] or ["8 2048 16", "1 6656 16"]
    os.makedirs(out, exist_ok=True)
    kernel = os.path.join(out, "bwd_sm90_timeline.cu")
    with open(KERNEL) as f, open(kernel, "w") as g:
        g.write(instrumented(f.read()))
    exe = os.path.join(out, "bwd_timeline")
    cc = os.path.join(ROOT, "cc")
    subprocess.run(["nvcc", "--threads", "4", "-std=c++20", "-gencode=arch=compute_90a,code=sm_90a",
                    "--expt-relaxed-constexpr", f"-I{cc}", f"-I{cc}/kernels/attention",
                    os.path.join(cc, "tests/standalone/bwd_timeline.cu"), kernel,
                    os.path.join(cc, "attention/fwd_sm90.cu"), "-o", exe], check=True)
    for c in configs:
        subprocess.run([exe, *c.split()], check=True)


if __name__ == "__main__":
    main()
