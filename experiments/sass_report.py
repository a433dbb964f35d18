"""Compile the decode kernels for sm_90 on a machine without a GPU: registers, spills, the SASS mix of the loop.

Uses the Triton of the environment (the venv has 3.9; the device runs 3.6, whose register counts differ by
a few %) with ptxas/cuobjdump from its wheel, at Llama-3.1-8B shapes (g = 4, rep = 4, head dim 128, groups
of 32), bf16, pointers and strides marked divisible by 16 as the JIT specializes them on real shapes.

    python experiments/sass_report.py keys 4 2 2      # kernel (keys | lat | keysall | latall | onepass | onepassall
                                                     # | onepasstale), warps,
                                                     # stages, bits (ignored by the *all kinds), [slots per tile]
    QREG=1 python experiments/sass_report.py keys 4 2 2 ; HASM=0 python experiments/sass_report.py lat 8 2 4
    ASM=2,3,4 python experiments/sass_report.py onepasstale 4 2 3  # the widths the one-pass kernel unpacks in PTX
    DOT=bf16 python experiments/sass_report.py onepass 4 2 2  # one-pass operands in bf16 (default fp16, as
                                                             # latent_attention on caches of float16 metadata)
    CM=0 python experiments/sass_report.py onepass 4 2 2      # latents row-major (default: channel-major, as the
                                                             # static cache holds them)

Writes OUTDIR/<args>.sass and .ttgir (OUTDIR: $SASS_OUT or /tmp; the TTGIR shows which loads the software
pipeline turned into cp.async) and prints registers, stack, shared memory, the
instruction mix and the loop bounds (backward branches); instructions per tile = loop bytes / 16.
"""

import collections
import os
import sys

import torch
import triton
import triton.language as tl
from sass_common import POINTER_TYPES, sass
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import tale_kernels.attention as A


def report(name, k):
    res, _, ops, loops = sass(k, name)
    print(
        name, "shared", k.metadata.shared, [ln.strip().split(" CONSTANT")[0] for ln in res.splitlines() if "REG" in ln]
    )
    print("  instructions", len(ops), "mix", collections.Counter(op for _, op in ops).most_common(12))
    for to, at in loops:
        bars = sum(1 for a, op in ops if op == "BAR" and to <= int(a, 16) <= at)
        print(f"  loop {to:#x}..{at:#x}: {(at - to) // 16} instructions, {bars} barriers")


def plain_arg(i, nm, ptrs, sig, attrs):
    """A pointer of `ptrs` (divisible by 16), the float `qk_scale`, or an int32 (strides `s_*` divisible by 16)."""
    if nm in ptrs:
        sig[nm] = ptrs[nm]
        attrs[(i,)] = [["tt.divisibility", 16]]
    elif nm == "qk_scale":
        sig[nm] = "fp32"
    else:
        sig[nm] = "i32"
        if nm.startswith("s_"):
            attrs[(i,)] = [["tt.divisibility", 16]]


def compile_sm90(fn, sig, cx, attrs):
    return triton.compile(
        ASTSource(fn, sig, cx, attrs),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=warps, num_stages=stages),
    )


def onepass_kernel(which, bits):
    """Compile _attn_kernel with the runtime/constexpr tuples that latent_attention builds for a CPU copy of the
    benchmark's view (bench_decode.synth_view / preset_schedule), typed as the JIT would type them."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    import bench_decode as bd

    bd.DEV = "cpu"
    torch.manual_seed(0)
    L, B = 4096, 1
    if which == "onepasstale":
        from tale_runtime.static_cache import StaticTaleCache

        c = StaticTaleCache(bd.preset_schedule("tale"), 1, bd.K, bd.N, bd.G, bd.R, max_length=L + 64)
        c.layers[0].append(torch.randn(B, bd.K, L, bd.N, dtype=bd.DT), torch.randn(B, bd.G, L, bd.R, dtype=bd.DT))
        v = bd.channel_major(c.layers[0].view(), CM)
        regions = [max(v.regions, key=lambda r: r.capacity)]
    else:
        only = None if which == "onepassall" else f"{bits}bit"
        regions = bd.channel_major(bd.synth_view(B, L, only=only), CM).regions
    q = torch.randn(B, bd.H, 1, bd.N, dtype=bd.DT if BF16 else torch.float16)  # as latent_attention passes it
    args = [A._region_args(r, q, bd.REP, bd.N, bd.GS, bd.KG, 64, 64, ASM, 1.0 if BF16 else 2.0**-8) for r in regions]
    while len(args) < A.NREG:
        args.append(args[0])

    def ty(v):
        if isinstance(v, torch.Tensor):
            return POINTER_TYPES[v.dtype]
        return "fp32" if isinstance(v, float) else "i32"

    fn = A._attn_kernel
    ptrs = {"pm_ptr": "*fp32", "pl_ptr": "*fp32", "pacc_ptr": "*fp32", "rk_ptr": "*i32", "np_arg": "i32"}
    cst = dict(
        GS=bd.GS,
        REP=bd.REP,
        QGP=16,
        KG=bd.KG,
        VG=bd.VG,
        WIN=False,
        NPP=False,
        NREG=len(regions),
        DOT=tl.bfloat16 if BF16 else tl.float16,
        QLOOP=True,
    )
    sig, cx, attrs = {}, {}, {}
    for i, nm in enumerate(fn.arg_names):
        if nm in cst:
            sig[nm], cx[(i,)] = "constexpr", cst[nm]
        elif nm.startswith("CT"):
            sig[nm], cx[(i,)] = "constexpr", args[int(nm[2:])][1]
        elif nm.startswith("RT"):
            rt = args[int(nm[2:])][0]
            sig[nm] = tuple(ty(v) for v in rt)
            for j, v in enumerate(rt):  # what the JIT specializes: pointers and ints divisible by 16
                if isinstance(v, torch.Tensor) or (isinstance(v, int) and v % 16 == 0 and v):
                    attrs[(i, j)] = [["tt.divisibility", 16]]
        else:
            plain_arg(i, nm, ptrs, sig, attrs)
    return compile_sm90(fn, sig, cx, attrs)


QREG = os.environ.get("QREG", "0") == "1"
CM = os.environ.get("CM", "1") == "1"  # onepass: latents channel-major (the static cache's layout); CM=0 row-major
BF16 = os.environ.get("DOT", "fp16") == "bf16"  # the one-pass kernel's dot operands (latent_attention's `dot`)
ASM = tuple(int(b) for b in os.environ.get("ASM", "2,4").split(",") if b)  # widths on the PTX unpack (onepass*)
KINDS = ("keys", "lat", "keysall", "latall", "onepass", "onepassall", "onepasstale")
if len(sys.argv) < 5 or sys.argv[1] not in KINDS or not all(a.isdigit() for a in sys.argv[2:]):
    print(f"usage: sass_report.py {{{'|'.join(KINDS)}}} WARPS STAGES BITS [SLOTS]", file=sys.stderr)
    sys.exit(2)
which, warps, stages, bits = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
BT = int(sys.argv[5]) if len(sys.argv) > 5 else 64
name = "_".join(sys.argv[1:])
KEYS_T = ("i32", "i32", "i32", "*u8", "i32", "i32", "i32", "*bf16", "*bf16", "i32", "i32", "i32", "*i32", "i32", "i32")
LAT_T = KEYS_T


def region_cfg(kind, b):
    """Constexprs of one region at these shapes: keys (KBITS, NPK, KW, KROWS, BT, KDOT, LENP, KASM, TPP, KMETA) or
    latents (HBITS, RANK, NPH, P, PP, HDOT, LENP, HASM, HMETA); b = 16 for the sinks / residual, rank 256 at 2 bits;
    metadata in bf16 (META 0, as KEYS_T types it)."""
    if kind == "keys":
        npk = 8 // b if b < 8 else 4
        return (b, npk, 128 if b >= 8 else 4 * 128 * b // 8, max(1, BT // 32), BT, True, False, b < 8, 4, 0)
    rank = 256 if b == 2 else 512
    nph, p = (8 // b, rank * b // 8) if b < 8 else (4, rank // 4)
    return (b, rank, nph, p, p, True, False, b < 8 and os.environ.get("HASM", "1") == "1", 0)


def region_kernel(kind, bits_list):
    import tale_kernels.attention_split as S  # the split kernels this kind compiles (no longer in tale_kernels)

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
        else:
            plain_arg(i, nm, ptrs, sig, attrs)
    return compile_sm90(fn, sig, cx, attrs)


if which in ("keys", "lat"):
    k = region_kernel(which, [bits])
elif which in ("keysall", "latall"):  # the paper schedule's view in one launch: sinks, 2-bit, 4-bit, residual
    k = region_kernel(which[:-3], [16, 2, 4, 16])
else:  # the one-pass kernel over the benchmark's view: "onepass" one level (bits 2 / 4), "onepassall" the paper
    # schedule's four regions; "onepasstale" the tale preset's middle level (bands 3/2 bits, fp8 scales)
    k = onepass_kernel(which, bits)
report(name, k)
