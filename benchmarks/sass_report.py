"""Compile the decode kernels for sm_90 on a machine without a GPU: registers, spills, the SASS mix of the loop.

Uses the Triton of the environment (the venv has 3.9; the device runs 3.6, whose register counts differ by
a few %) with ptxas/cuobjdump from its wheel, at Llama-3.1-8B shapes (g = 4, rep = 4, head dim 128, groups
of 32), bf16, pointers and strides marked divisible by 16 as the JIT specializes them on real shapes.

    python benchmarks/sass_report.py keys 4 2 2      # kernel (keys | lat | onepass), warps, stages, bits
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
if which == "keys":
    k = build(
        S._keys_kernel,
        {"q_ptr": "*bf16", "lg_ptr": "*fp32", "k_ptr": "*u8", "ks_ptr": "*bf16", "kz_ptr": "*bf16", "p_ptr": "*i32"},
        dict(
            N=128,
            GS=4,
            REP=4,
            QGP=16,
            KG=32,
            WIN=False,
            NPP=False,
            DOT=tl.bfloat16,
            KBITS=bits,
            NPK=8 // bits if bits < 8 else 4,
            KW=4 * 128 * bits // 8 if bits < 8 else 128,
            KROWS=max(1, BT // 32),
            BT=BT,
            KDOT=True,
            LENP=False,
            KASM=True,
            TPP=4,
            QREG=QREG,
        ),
        warps,
        stages,
    )
elif which == "lat":
    P = 256 * bits // 8 if bits == 2 else 512 * bits // 8 if bits < 8 else 128
    k = build(
        S._lat_kernel,
        {
            "lg_ptr": "*fp32",
            "pm_ptr": "*fp32",
            "pl_ptr": "*fp32",
            "pacc_ptr": "*fp32",
            "rk_ptr": "*i32",
            "h_ptr": "*u8",
            "hs_ptr": "*bf16",
            "hz_ptr": "*bf16",
            "p_ptr": "*i32",
        },
        dict(
            GS=4,
            REP=4,
            QGP=16,
            VG=32,
            WIN=False,
            NPP=False,
            DOT=tl.bfloat16,
            HBITS=bits,
            RANK=256 if bits == 2 else 512,
            NPH=8 // bits if bits < 8 else 4,
            P=P,
            PP=P,
            BT=BT,
            HDOT=True,
            LENP=False,
            HASM=os.environ.get("HASM", "1") == "1",
        ),
        warps,
        stages,
    )
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
