"""Which shared-memory layout and descriptor convention wgmma reads as we mean it, and how fast the low-rank score
pass's GEMM runs on it (GPU, sm_90a): experiments/wgmma_probe.cu per (layout, descriptor offsets, imm-trans-b),
its D against torch on a few tiles, then the fastest correct build timed over the score pass's tiles at 128K batch 1
(8B shapes: 2 latent groups x 2048 tiles of 64 slots, 160 coefficients, 512 columns per group), with and without
the tile loads (REPS), against cuBLAS on the same product.

    python3 experiments/wgmma_probe.py               # the table of builds, then the timing
    python3 experiments/wgmma_probe.py --tiles 4096 --kp 160
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import subprocess
import sys

import torch

from tale_kernels.cuda_module import Module

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wgmma_probe.cu")
HDR = os.path.join(os.path.dirname(SRC), "..", "kernels", "cuda")
HDR_KEY = hashlib.sha256(
    b"".join(open(os.path.join(HDR, h), "rb").read() for h in ("wgmma.cuh", "ptx.cuh"))
).hexdigest()[:12]
NWG = 2  # warpgroups per CTA: 512 columns, a latent group's 4 KV heads


def build(kp: int, layout: int, swap: int, trans_b: int, reps: int = 1) -> Module:
    opts = (
        f"-DNWG={NWG}",
        f"-DKP={kp}",
        f"-DLAYOUT={layout}",
        f"-DSWAP={swap}",
        f"-DTRANS_B={trans_b}",
        f"-DREPS={reps}",
        f"-I{HDR}",  # wgmma.cuh: the score pass' own wgmma
        f"-DHDR_KEY={HDR_KEY}",  # its headers' hash: the cubin cache keys on the source's own folder only
    )
    mod = Module(SRC, opts)
    mod.function("probe", smem(kp))
    return mod


def smem(kp: int) -> int:
    return (64 + NWG * 256) * kp * 2


def run(mod: Module, a: torch.Tensor, b: torch.Tensor, write: bool, grid: int) -> torch.Tensor:
    T, _, kp = a.shape
    nt = b.shape[1]
    out = torch.empty(T, 64, nt, device="cuda") if write else torch.empty(grid * NWG * 128, device="cuda")
    mod.launch("probe", grid, NWG * 128, (a, b, out, T, int(write)), shared=smem(kp))
    return out


def check(kp: int, layout: int, swap: int, tb: int) -> float:
    """One build's relative error against torch on 6 tiles (nan where the build or its launch fails)."""
    torch.manual_seed(0)
    a = torch.randn(6, 64, kp, device="cuda").half()
    b = torch.randn(kp, NWG * 256, device="cuda").half()
    ref = a.float() @ b.float()
    try:
        d = run(build(kp, layout, swap, tb), a, b, True, 3)
        torch.cuda.synchronize()
        return ((d - ref).norm() / ref.norm()).item()
    except Exception as ex:  # a build or launch the hardware refuses is a row too
        print(f"  ({type(ex).__name__}: {str(ex)[:120]})", file=sys.stderr)
        return float("nan")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kp", type=int, default=160)
    ap.add_argument("--tiles", type=int, default=4096)
    ap.add_argument("--check", type=int, nargs=3, metavar=("LAYOUT", "SWAP", "TB"), help=argparse.SUPPRESS)
    a_ = ap.parse_args()
    if a_.check:  # a child process: a build that faults takes its CUDA context with it, not the parent's
        print(check(a_.kp, *a_.check))
        return 0
    torch.manual_seed(0)
    kp, nt = a_.kp, NWG * 256
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print("| layout | descriptor offsets | imm-trans-b | rel. error |\n|---|---|---:|---:|")
    good = []
    for layout, swap, tb in itertools.product((1, 2), (0, 1), (0, 1)):
        cmd = [sys.executable, __file__, "--kp", str(kp), "--check", str(layout), str(swap), str(tb)]
        out = subprocess.run(cmd, capture_output=True, text=True).stdout.split()
        err = float(out[-1]) if out else float("nan")
        names = ("K-adjacent cores", "row-group-adjacent cores")
        print(f"| {names[layout - 1]} | {'exchanged' if swap else 'LBO along K, SBO along rows'} | {tb} | {err:.2e} |")
        if err < 1e-3:
            good.append((layout, swap, tb))
    if not good:
        print("no build is correct")
        return 1
    layout, swap, tb = good[0]
    T = a_.tiles
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    A = torch.randn(T, 64, kp, device="cuda").half()
    b = torch.randn(kp, nt, device="cuda").half()
    flop = 2 * T * 64 * kp * nt

    def timed(fn, n=20) -> float:
        fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n):
            fn()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / n * 1e3  # us

    print(f"\nbuild {good[0]}: {T} tiles of [64, {kp}] x [{kp}, {nt}], {sms} CTAs")
    for reps in (1, 4):
        mod = build(kp, layout, swap, tb, reps)
        us = timed(lambda mod=mod: run(mod, A, b, False, sms))
        print(f"wgmma, k-loop x{reps} per tile load: {us:.1f} us, {reps * flop / us / 1e6:.0f} TFLOP/s")
    A2 = A.view(T * 64, kp)
    us = timed(lambda: A2 @ b)
    print(f"cuBLAS [{T * 64}, {kp}] x [{kp}, {nt}] (its output written: {T * 64 * nt * 2 / 1e6:.0f} MB): {us:.1f} us, "
          f"{flop / us / 1e6:.0f} TFLOP/s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
