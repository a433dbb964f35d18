"""Compile the decode kernels for sm_90 on a machine without a GPU: registers, spills, the SASS mix of the loop.

Uses the Triton of the environment (the venv has 3.9; the device runs 3.6, whose register counts differ by
a few %) with ptxas/cuobjdump from its wheel, at Llama-3.1-8B shapes (g = 4, rep = 4, head dim 128, groups
of 32), bf16, pointers and strides marked divisible by 16 as the JIT specializes them on real shapes.

    python benchmarks/sass_report.py keys 4 2 2      # kernel (keys | lat | keysall | latall | onepass), warps,
                                                     # stages, bits (ignored by the *all kinds), [slots per tile]
    QREG=1 python benchmarks/sass_report.py keys 4 2 2 ; HASM=0 python benchmarks/sass_report.py lat 8 2 4

Writes OUTDIR/<args>.sass (OUTDIR: $SASS_OUT or /tmp) and prints registers, stack, shared memory, the
instruction mix and the loop bounds (backward branches); instructions per tile = loop bytes / 16.
"""

import collections
import os
import re
import subprocess
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import tale_kernels.attention as A
import tale_kernels.attention_split as S


def build(fn, ptrs, cst, warps, stages):
    sig, cx = {}, {}
    for i, nm in enumerate(fn.arg_names):
        if nm in cst:
            sig[nm] = "constexpr"
            cx[(i,)] = cst[nm]
        elif nm in ptrs:
            sig[nm] = ptrs[nm]
        elif nm == "qk_scale":
            sig[nm] = "fp32"
        else:
            sig[nm] = "i64" if nm.startswith("s_") else "i32"
    # what the JIT specializes on real shapes: pointers and strides divisible by 16
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, nm in enumerate(fn.arg_names)
        if nm not in cst and (nm in ptrs or nm.startswith("s_") or nm in ("lg_off", "n_slots", "H", "slot0"))
    }
    return triton.compile(
        ASTSource(fn, sig, cx, attrs),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=warps, num_stages=stages),
    )


def report(name, k):
    bd = os.path.dirname(triton.__file__) + "/backends/nvidia/bin/"
    out = os.environ.get("SASS_OUT", "/tmp")
    cub = f"{out}/{name}.cubin"
    open(cub, "wb").write(k.asm["cubin"])
    res = subprocess.run([bd + "cuobjdump", "-res-usage", cub], capture_output=True, text=True).stdout
    sass = subprocess.run([bd + "cuobjdump", "-sass", cub], capture_output=True, text=True).stdout
    open(f"{out}/{name}.sass", "w").write(sass)
    print(
        name, "shared", k.metadata.shared, [ln.strip().split(" CONSTANT")[0] for ln in res.splitlines() if "REG" in ln]
    )
    ops = re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T] )?([A-Z0-9_]+)", sass, re.M)
    print("  instructions", len(ops), "mix", collections.Counter(op for _, op in ops).most_common(12))
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T] )?BRA (0x[0-9a-f]+)", sass):
        at, to = int(m.group(1), 16), int(m.group(2), 16)
        if to < at:
            bars = sum(1 for a, op in ops if op == "BAR" and to <= int(a, 16) <= at)
            print(f"  loop {to:#x}..{at:#x}: {(at - to) // 16} instructions, {bars} barriers")


QREG = os.environ.get("QREG", "0") == "1"
which, warps, stages, bits = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
BT = int(sys.argv[5]) if len(sys.argv) > 5 else 64
name = "_".join(sys.argv[1:])
KEYS_T = ("i32", "i32", "i32", "*u8", "i32", "i32", "i32", "*bf16", "*bf16", "i32", "i32", "i32", "*i32", "i32", "i32")
LAT_T = KEYS_T


def region_cfg(kind, b):
    """Constexprs of one region at these shapes: keys (KBITS, NPK, KW, KROWS, BT, KDOT, LENP, KASM, TPP) or
    latents (HBITS, RANK, NPH, P, PP, HDOT, LENP, HASM); b = 16 for the sinks / residual, rank 256 at 2 bits."""
    if kind == "keys":
        npk = 8 // b if b < 8 else 4
        return (b, npk, 128 if b >= 8 else 4 * 128 * b // 8, max(1, BT // 32), BT, True, False, b < 8, 4)
    rank = 256 if b == 2 else 512
    nph, p = (8 // b, rank * b // 8) if b < 8 else (4, rank // 4)
    return (b, rank, nph, p, p, True, False, b < 8 and os.environ.get("HASM", "1") == "1")


def region_kernel(kind, bits_list):
    regs_t = tuple(KEYS_T if kind == "keys" else LAT_T for _ in bits_list)
    cfg = tuple(region_cfg(kind, b) for b in bits_list)
    # divisibility of the pointers and strides of every region (paths into the tuple argument)
    ridx = (9 if kind == "keys" else 13,)
    div = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    if kind == "keys":
        fn = S._keys_kernel
        ptrs = {"q_ptr": "*bf16", "lg_ptr": "*fp32"}
        cst = dict(N=128, GS=4, REP=4, QGP=16, KG=32, WIN=False, NPP=False, DOT=tl.bfloat16, QREG=QREG)
    else:
        fn = S._lat_kernel
        ptrs = {"lg_ptr": "*fp32", "pm_ptr": "*fp32", "pl_ptr": "*fp32", "pacc_ptr": "*fp32", "rk_ptr": "*i32"}
        cst = dict(GS=4, REP=4, QGP=16, VG=32, WIN=False, NPP=False, DOT=tl.bfloat16, BT=BT)
    cst.update(CFG=cfg, NR=len(bits_list))
    sig, cx, attrs = {}, {}, {}
    for i, nm in enumerate(fn.arg_names):
        if nm in cst:
            sig[nm] = "constexpr"
            cx[(i,)] = cst[nm]
        elif nm == "regs":
            sig[nm] = regs_t
            for j in range(len(bits_list)):
                for d in div:
                    attrs[(*ridx, j, d)] = [["tt.divisibility", 16]]
        elif nm in ptrs:
            sig[nm] = ptrs[nm]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif nm == "qk_scale":
            sig[nm] = "fp32"
        else:
            sig[nm] = "i32"
            if nm.startswith("s_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(
        ASTSource(fn, sig, cx, attrs),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=warps, num_stages=stages),
    )


if which in ("keys", "lat"):
    k = region_kernel(which, [bits])
elif which in ("keysall", "latall"):  # the paper schedule's view in one launch: sinks, 2-bit, 4-bit, residual
    k = region_kernel(which[:-3], [16, 2, 4, 16])
else:
    ptrs = {"q_ptr": "*bf16", "pm_ptr": "*fp32", "pl_ptr": "*fp32", "pacc_ptr": "*fp32", "rk_ptr": "*i32"}
    cst = dict(N=128, GS=4, REP=4, QGP=16, KG=32, VG=32, WIN=False, NPP=False, NREG=1, DOT=tl.bfloat16, QLOOP=True)
    P = 256 * bits // 8 if bits == 2 else 512 * bits // 8
    for j in range(4):
        ptrs.update(
            {
                f"k{j}": "*u8",
                f"ks{j}": "*bf16",
                f"kz{j}": "*bf16",
                f"h{j}": "*u8",
                f"hs{j}": "*bf16",
                f"hz{j}": "*bf16",
                f"pos{j}": "*i32",
            }
        )
        cst.update(
            {
                f"KBITS{j}": bits,
                f"HBITS{j}": bits,
                f"RANK{j}": 256 if bits == 2 else 512,
                f"NPK{j}": 8 // bits,
                f"KW{j}": 4 * 128 * bits // 8,
                f"KROWS{j}": 2,
                f"NPH{j}": 8 // bits,
                f"P{j}": P,
                f"PP{j}": P,
                f"BT{j}": 64,
                f"KDOT{j}": True,
                f"HDOT{j}": True,
                f"LENP{j}": False,
                f"KASM{j}": bits == 2,
                f"HASM{j}": bits == 2,
            }
        )
    k = build(A._attn_kernel, ptrs, cst, warps, stages)
report(name, k)
