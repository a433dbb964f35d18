"""Prototype CUDA decode kernel for the 2-bit level (issue #10), against the Triton kernel and SDPA in one run.

benchmarks/cuda_decode/latent_2bit.cu holds the kernel (design notes at its top); this script packs a random
2-bit level of Llama-3.1-8B shapes (8 KV heads, head dim 128, latent groups of 4 heads, rank 256, key and value
groups of 32) into the kernel's layout, checks the output against a float32 torch reference (every input
dequantized from the same codes), then times it (median of CUDA-graph replays, L2 flushed before each) next to
the Triton kernel on a 2-bit-only view of the same size (`bench_decode.synth_view(..., only="2bit")`) and a
device-to-device copy. It needs CuPy and nvcc (the device image has both); nothing here is imported by the
runtime.

    python benchmarks/bench_cuda_decode.py                  # check, then 32K / 128K / 512K at B=1 and 128K B=4
    TALE_CUDA_LINEINFO=1 ncu --set full --kernel-name tale_2bit_attn --launch-skip 2 --launch-count 1 \
        python benchmarks/bench_cuda_decode.py --ncu 524288 --variants 1:1:4      # the profile of docs/kernels.md
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_decode as bd  # noqa: E402

SRC = os.path.join(os.path.dirname(__file__), "cuda_decode", "latent_2bit.cu")
K, N, GS, RANK, KG, VG = 8, 128, 4, 256, 32, 32
G, H = K // GS, 32
SHIFT = 2.0**-8  # 16-bit scales/zeros of a bf16 cache are stored as float16 times 2^-8 (quant.meta_format)
BLK_BYTES = 4096 + 2048 + 2048 + 1024  # per 32 slots and latent group: key codes, key meta, latent codes, latent meta


def kernels(subn: int, kchains: int = 1, abatch: int = 4):
    import cupy

    code = open(SRC).read()
    opts = ("-O3", "--use_fast_math", f"-DSUBN={subn}", f"-DKCHAINS={kchains}", f"-DABATCH={abatch}", "-std=c++17")
    opts += ("-lineinfo",) if os.environ.get("TALE_CUDA_LINEINFO") else ()
    attn = cupy.RawKernel(code, "tale_2bit_attn", options=opts, backend="nvcc")
    comb = cupy.RawKernel(code, "tale_2bit_combine", options=opts, backend="nvcc")
    smem = 8 * (2 * BLK_BYTES + 8192 + 128) + 8704
    attn.max_dynamic_shared_size_bytes = smem
    return attn, comb, smem


# -- the kernel's layout (see the .cu header) -------------------------------------------------------------------


def _key_index() -> torch.Tensor:
    """[32 words, 16 positions] -> index h * 128 + channel of the code at bits 2 * pos of that word."""
    idx = torch.empty(32, 16, dtype=torch.long)
    for t in range(4):
        for j in range(8):
            for pos in range(16):
                e, q8 = pos // 8, pos % 8
                ci, r = (q8 // 4) * 2 + (q8 % 4) // 2, q8 % 2
                head, ch = t // 2 + 2 * r, 4 * (4 * j + ci) + 2 * (t % 2) + e
                idx[8 * t + j, pos] = head * 128 + ch
    return idx


def _lat_index() -> torch.Tensor:
    """[512 words, 16 positions] -> index slot * 256 + channel within a 32-slot block."""
    idx = torch.empty(512, 16, dtype=torch.long)
    for qd in range(4):
        for lane in range(32):
            n, t = lane // 4, lane % 4
            for e4 in range(4):
                w = 4 * qd + e4
                for pos in range(16):
                    el, q8 = pos // 8, pos % 8
                    nto, f = q8 // 4, q8 % 4
                    kc, r = f // 2, f % 2
                    ch, slot = 8 * (2 * w + nto) + n, 16 * kc + 8 * r + 2 * t + el
                    idx[(qd * 32 + lane) * 4 + e4, pos] = slot * 256 + ch
    return idx


def _words(codes: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """codes [..., M] (0..3) gathered by idx [W, 16] into int32 words [..., W]."""
    g = codes[..., idx.to(codes.device)].long()  # [..., W, 16]
    sh = (2 * torch.arange(16, device=codes.device)).long()
    w = (g << sh).sum(-1)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def pack(kcode, ks, kz, lcode, ls, lz):
    """Reference-layout tensors -> the kernel's four arrays. kcode [B, K, L, 128], ks/kz [B, K, L/32, 128] (fp16,
    stored), lcode [B, G, L, 256], ls/lz [B, G, L, 8] (fp16, stored)."""
    B, _, L, _ = kcode.shape
    nb = L // 32
    kflat = kcode.view(B, G, GS, L, N).permute(0, 1, 3, 2, 4).reshape(B, G, L, GS * N)
    kc = _words(kflat, _key_index())  # [B, G, L, 32]
    # odd slots: each thread's two 16-byte halves swapped (bank-conflict-free loads)
    sw = torch.tensor(
        [8 * t + 4 * (1 - jh) + jj for t in range(4) for jh in range(2) for jj in range(4)], device=kc.device
    )
    kc[:, :, 1::2] = kc[:, :, 1::2][..., sw]
    km = torch.cat(
        [t.view(B, G, GS, nb, 32, 4).permute(0, 1, 3, 2, 4, 5) for t in (ks, kz)], -1
    )  # [B, G, nb, 4, 32, 8]
    # quad c of head h stored at c ^ ((2h + c // 16) & 7): the A build's 8 distinct addresses hit distinct banks
    src = torch.tensor([[c ^ ((2 * h + c // 16) & 7) for c in range(32)] for h in range(GS)], device=km.device)
    km = km.gather(4, src.argsort(-1).view(1, 1, 1, GS, 32, 1).expand_as(km)).contiguous()
    lflat = lcode.view(B, G, nb, 32 * RANK)
    lc = _words(lflat, _lat_index())  # [B, G, nb, 512]
    slots = torch.tensor(
        [
            [[16 * kc_ + 2 * t, 16 * kc_ + 2 * t + 1, 16 * kc_ + 2 * t + 8, 16 * kc_ + 2 * t + 9] for t in range(4)]
            for kc_ in range(2)
        ],
        device=ls.device,
    )  # [2, 4, 4]
    parts = []
    for t in (ls, lz):
        x = t.view(B, G, nb, 32, 8).permute(0, 1, 2, 4, 3)  # [B, G, nb, cg, 32 slots]
        parts.append(x[..., slots])  # [B, G, nb, cg, 2, 4, 4]
    lm = torch.cat(parts, -1).contiguous()  # [B, G, nb, 8, 2, 4, 8]
    return kc.contiguous(), km, lc.contiguous(), lm


def random_level(B: int, L: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    d = "cuda"
    kcode = torch.randint(0, 4, (B, K, L, N), device=d, generator=gen, dtype=torch.uint8)
    lcode = torch.randint(0, 4, (B, G, L, RANK), device=d, generator=gen, dtype=torch.uint8)

    def meta(shape):
        s = torch.rand(shape, device=d, generator=gen) * 0.2 + 0.05
        z = torch.randn(shape, device=d, generator=gen) * 0.2 - s * 1.5
        return (s * SHIFT).half(), (z * SHIFT).half()

    ks, kz = meta((B, K, L // 32, N))
    ls, lz = meta((B, G, L, RANK // VG))
    q = torch.randn(B, H, N, device=d, generator=gen).bfloat16()
    return q, kcode, ks, kz, lcode, ls, lz


def reference(q, kcode, ks, kz, lcode, ls, lz) -> torch.Tensor:
    """float32 attention of the 2-bit level alone: z [B, H, 256]."""
    B, _, L, _ = kcode.shape
    sk = (ks.float() / SHIFT).repeat_interleave(KG, 2)
    zk = (kz.float() / SHIFT).repeat_interleave(KG, 2)
    keys = kcode.float() * sk + zk  # [B, K, L, N]
    sl = (ls.float() / SHIFT).repeat_interleave(VG, -1)
    zl = (lz.float() / SHIFT).repeat_interleave(VG, -1)
    lat = lcode.float() * sl + zl  # [B, G, L, R]
    qf = q.float().view(B, K, H // K, N)
    logits = torch.einsum("bkrn,bkln->bkrl", qf, keys).reshape(B, H, L) * N**-0.5
    p = logits.softmax(-1).view(B, G, H // G, L)
    return torch.einsum("bgrl,bglc->bgrc", p, lat).reshape(B, H, RANK)


def runner(kern, arrays, q, B: int, L: int, S: int, parts: str = "both"):
    import cupy
    import numpy as np

    attn, comb, smem = kern
    kc, km, lc, lm = arrays
    po = torch.empty(B, H, S, RANK, device="cuda")
    pm = torch.empty(B, H, S, device="cuda")
    pl = torch.empty(B, H, S, device="cuda")
    z = torch.empty(B, H, RANK, device="cuda")
    qk = np.float32(N**-0.5 * math.log2(math.e))

    def fn():
        with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            if parts != "comb":
                attn(
                    (S, G, B),
                    (256,),
                    (
                        q.data_ptr(),
                        kc.data_ptr(),
                        km.data_ptr(),
                        lc.data_ptr(),
                        lm.data_ptr(),
                        po.data_ptr(),
                        pm.data_ptr(),
                        pl.data_ptr(),
                        np.int32(G),
                        np.int32(L),
                        np.int32(S),
                        np.float32(1 / SHIFT),
                        qk,
                    ),
                    shared_mem=smem,
                )
            if parts != "attn":
                comb(
                    (B * H, RANK // 64),
                    (256,),
                    (po.data_ptr(), pm.data_ptr(), pl.data_ptr(), z.data_ptr(), np.int32(S), np.float32(1 / SHIFT)),
                )
        return z

    return fn


def splits_for(B: int, L: int, sms: int) -> int:
    return max(1, min(L // 32 // 8, round(sms / (B * G))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="32768,131072,524288")
    ap.add_argument(
        "--variants",
        default="1:1:4,1:2:4,0:1:4",
        help="subn:kchains:abatch,... (subn 1: codes read as "
        "fp16 subnormals, 0: 1024 + code with the offset from one more mma; kchains: key-score HMMA chains; "
        "abatch: pieces of the query-scale build whose loads are issued together)",
    )
    ap.add_argument("--no-triton", action="store_true")
    ap.add_argument(
        "--ncu",
        type=int,
        metavar="CTX",
        help="no checks or timings: run the first variant's main kernel "
        "4 times at context CTX, batch 1 (a target for `ncu --launch-skip 2 --launch-count 1`)",
    )
    a = ap.parse_args()
    torch.manual_seed(0)
    bd.FLUSH = torch.empty(64 << 20, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    variants = {v: kernels(*map(int, v.split(":"))) for v in a.variants.split(",")}
    if a.ncu:
        n2 = bd.region_lengths(a.ncu)[1] // 32 * 32
        data = random_level(1, n2, seed=1)
        fn = runner(next(iter(variants.values())), pack(*data[1:]), data[0], 1, n2, splits_for(1, n2, sms), "attn")
        for _ in range(4):
            fn()
        torch.cuda.synchronize()
        return 0
    ok = True
    # correctness: small and real lengths, batch 1 and 3, against the float32 reference
    for B, L in ((1, 2048), (3, 4096), (1, 40960)):
        data = random_level(B, L, seed=B * 7 + L)
        arrays = pack(*data[1:])
        ref = reference(*data)
        for s, kern in variants.items():
            for S in (1, splits_for(B, L, sms), 3):
                bd.poison()
                got = runner(kern, arrays, data[0], B, L, S)().clone()
                e = bd.rel(got, ref)
                good = e <= 5e-3 and bool(torch.isfinite(got).all())
                ok &= good
                print(f"check subn={s} B={B} L={L} S={S}: rel err {e:.2e} {'ok' if good else 'FAIL'}", flush=True)
    if not ok:
        print("correctness failed: no timings", flush=True)
        return 1
    bw = bd.copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    print(
        "| context | B | 2-bit slots | MB | Triton 2-bit us (% copy) | "
        + " | ".join(f"CUDA {s} us (% copy)" for s in variants)
        + " | best speedup |"
    )
    print("|---|---|---|---|---|" + "---|" * len(variants) + "---|")
    rows = [(1, int(c)) for c in a.contexts.split(",")] + [(4, 131072)]
    for B, ctx in rows:
        n2 = bd.region_lengths(ctx)[1] // 32 * 32
        mb = B * G * n2 * 288 / 1e6
        pct = lambda t, mb=mb: f"{t:.1f} ({mb * 1e6 / (t * 1e-6) / 1e9 / bw * 100:.0f}%)"  # noqa: E731
        if a.no_triton:
            tt = float("nan")
        else:
            import tale_kernels

            v = bd.synth_view(B, ctx, only="2bit")
            qn, kn, hn = bd.new_token(B)
            tt = bd.timeit(lambda q=qn, k=kn, h=hn, v=v: tale_kernels.latent_attention(q, k, h, v, N**-0.5))
            del v
        data = random_level(B, n2, seed=1)
        arrays = pack(*data[1:])
        data = data[:1]
        ts = {}
        for s, kern in variants.items():
            S = splits_for(B, n2, sms)
            ts[s] = bd.timeit(runner(kern, arrays, data[0], B, n2, S))
        best = min(ts.values())
        print(
            f"| {ctx // 1024}K | {B} | {n2} | {mb:.1f} | {pct(tt)} | "
            + " | ".join(pct(t) for t in ts.values())
            + f" | {tt / best:.2f}x |",
            flush=True,
        )
        kern = variants[min(ts, key=ts.get)]
        S = splits_for(B, n2, sms)
        probes = {p: bd.timeit(runner(kern, arrays, data[0], B, n2, S, p)) for p in ("attn", "comb")}
        one = runner(kern, arrays, data[0], B, 8 * S * 32, S, "attn")  # one block per warp: the fixed cost
        probes["attn, 1 block/warp"] = bd.timeit(one)
        x1 = torch.zeros(1, device="cuda")
        probes["floor: a 1-element kernel"] = bd.timeit(lambda x1=x1: torch.add(x1, 1, out=x1))
        print("    probes (best variant): " + ", ".join(f"{k} {v:.1f} us" for k, v in probes.items()), flush=True)
        del arrays
    return 0


if __name__ == "__main__":
    sys.exit(main())
