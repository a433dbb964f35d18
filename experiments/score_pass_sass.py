"""The CUDA score pass of low-rank keys (kernels/lowrank_score.py) compiled for sm_90a without a GPU: registers,
spills and shared memory of a build, its tile loop's length and instruction mix, and the loops inside it (each
body's length and its key instructions), to weigh a change to the per-tile work before a GPU times it (docs/notes.md,
"the wgmma score pass profiled"). Builds through kernels/cuda_module.py (NVRTC or nvcc), SASS by the Triton wheel's
cuobjdump.

    python experiments/score_pass_sass.py                   # the lowrank preset's format at 8B shapes, the wgmma build
    python experiments/score_pass_sass.py --cut 4           # the mma.sync build, 4 KV heads per CTA
    python experiments/score_pass_sass.py --kc 144 --bits 2 --ktg 16 --rep 8
"""

import argparse
import collections
import os
import subprocess
import tempfile

from sass_common import BRA, OP

from tale_kernels import cuda_module, lowrank_score

KEY = ("HGMMA", "HMMA", "MUFU", "LDGSTS", "HFMA2", "F2FP", "LDS", "STS", "BAR")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cut", default="wg", help='"wg" (wgmma, Hopper) or KV heads per CTA on mma.sync (4, 2, 1)')
    ap.add_argument("--kc", type=int, default=152, help="coefficients per basis block row")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--ktg", type=int, default=64, help="slots per scale group")
    ap.add_argument("--meta16", action="store_true", help="16-bit scales and zeros (default fp8)")
    ap.add_argument("--rep", type=int, default=4, help="query heads per KV head")
    a = ap.parse_args()
    t = lowrank_score.WG if a.cut == "wg" else lowrank_score.Tiling(int(a.cut))
    opts = lowrank_score.build_options(a.kc, a.bits, a.ktg, not a.meta16, a.rep, t)
    cubin = cuda_module.compile_cubin(t.src, opts, arch="sm_90a")
    bd = os.path.join(os.path.dirname(__import__("triton").__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([f"{bd}/cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout
        text = subprocess.run([f"{bd}/cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
    print(f"{os.path.basename(t.src)} {' '.join(opts)}")
    print(" ".join(x for x in res.split() if x.startswith(("REG:", "STACK:", "SHARED:", "LOCAL:"))))
    ops = [(int(at, 16), op) for at, op in OP.findall(text)]
    loops = [(int(to, 16), int(at, 16)) for at, to in BRA.findall(text) if int(to, 16) < int(at, 16)]
    outer = max(((s, e) for s, e in loops if any(op in ("HGMMA", "HMMA") and s <= x <= e for x, op in ops)),
                key=lambda se: se[1] - se[0])  # fmt: skip
    body = [op for x, op in ops if outer[0] <= x <= outer[1]]
    mix = collections.Counter(body)
    print(f"tile loop: {len(body)} instructions; {', '.join(f'{k} {v}' for k, v in mix.most_common(14))}")
    for s, e in sorted(lp for lp in loops if outer[0] <= lp[0] and lp[1] < outer[1]):
        inner = collections.Counter(op for x, op in ops if s <= x <= e)
        keys = ", ".join(f"{k} {inner[k]}" for k in KEY if inner[k])
        print(f"  loop at +{(s - outer[0]) // 16:5d}: {sum(inner.values()):4d} instructions  {keys}")


if __name__ == "__main__":
    main()
