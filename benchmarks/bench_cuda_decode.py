"""Prototype CUDA decode kernels for TALE's quantized levels (issue #10), against the Triton kernel in one run.

benchmarks/cuda_decode/latent_level.cu holds the kernel (design notes at its top), one template for the paper
preset's two levels: the 2-bit middle (2-bit keys, rank-256 latents at 2 bits) and the 4-bit recent level (4-bit
keys, rank-512 latents at 4 bits). This script packs a random level of Llama-3.1-8B shapes (8 KV heads, head dim
128, latent groups of 4 heads, key and value groups of 32) into the kernel's layout, checks the output against a
float32 torch reference (every input dequantized from the same codes), then times it (median of CUDA-graph
replays, L2 flushed before each) next to the Triton kernel on a view of the same level and size
(`bench_decode.synth_view(..., only=...)`) and a device-to-device copy. It needs nvcc (on the device image;
cuda_decode/launch.py compiles once per option set and launches through the driver API); nothing here is imported
by the runtime.

    python benchmarks/bench_cuda_decode.py                  # check, then 32K / 128K / 512K at B=1 and 128K B=4
    TALE_CUDA_LINEINFO=1 ncu --set full --kernel-name tale_attn_k2l2 --launch-skip 2 --launch-count 1 \
        python benchmarks/bench_cuda_decode.py --ncu 524288 --variants 1:4      # the profile of docs/kernels.md
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_decode as bd  # noqa: E402

SRC = os.path.join(os.path.dirname(__file__), "cuda_decode", "latent_level.cu")
K, N, GS, KG, VG = 8, 128, 4, 32, 32
G, H = K // GS, 32
RANK = 256  # latent channels per CTA (the 2-bit level's rank; the 4-bit level's 512 in two halves)
SHIFT = 2.0**-8  # 16-bit scales/zeros of a bf16 cache are stored as float16 times 2^-8 (quant.meta_format)
# per level: (key bits, latent bits, latent rank, warps per CTA, the region index in bench_decode.region_lengths)
LEVELS = {"2bit": (2, 2, 256, 8, 1), "4bit": (4, 4, 512, 5, 2)}


def key_bytes(kb: int) -> int:
    """Key bytes per slot and latent group: codes, then fp16 scale and zero per channel and key group."""
    return GS * N * kb // 8 + GS * N * 4 // KG


def level_bytes(level: str) -> int:
    """Cache bytes per slot and latent group: keys, latent codes, latent scales/zeros."""
    kb, lb, rank, _, _ = LEVELS[level]
    return key_bytes(kb) + rank * lb // 8 + rank // VG * 4


def smem_bytes(kb: int, lb: int, nw: int) -> int:
    """Dynamic shared memory of a CTA of nw warps (the .cu's Cfg::SMEM): per warp two stages (a 32-slot block's
    codes and scales/zeros of 256 latent channels, and its 32 positions), the A tile and its zero rows; the query."""
    stage = 32 * key_bytes(kb) + 32 * RANK * lb // 8 + 32 * RANK // VG * 4 + 128
    return nw * (2 * stage + 8192 + 128) + 8704


def pct(t: float, mb: float, bw: float) -> str:
    """Microseconds and the share of the copy bandwidth `bw` (GB/s) that moving `mb` MB in them is."""
    return f"{t:.1f} ({mb * 1e6 / (t * 1e-6) / 1e9 / bw * 100:.0f}%)"


def triton_us(B: int, ctx: int, only: str | None = None) -> tuple[float, float]:
    """The Triton kernel on bench_decode's view of a ctx-token cache (or one region of it): (us, cache MB)."""
    import tale_kernels

    v = bd.synth_view(B, ctx, only=only)
    q, k, h = bd.new_token(B)
    return bd.timeit(lambda: tale_kernels.latent_attention(q, k, h, v, N**-0.5)), bd.view_bytes(v) / 1e6


def kernels(subn: int = 1, abatch: int = 4, src: str = SRC) -> dict:
    """The compiled module ("mod") and per kernel: {level: (name, shared bytes, warps)}, the whole paper call's
    ("paper": both levels in one launch) and the two merges' names."""
    from cuda_decode.launch import Module

    opts = ("--use_fast_math", f"-DSUBN={subn}", f"-DABATCH={abatch}")
    opts += ("-lineinfo",) if os.environ.get("TALE_CUDA_LINEINFO") else ()
    mod = Module(src, opts)
    out = {"mod": mod, "combine": "tale_combine", "combine_paper": "tale_combine_paper"}
    for level, (kb, lb, _, nw, _) in LEVELS.items():
        smem = smem_bytes(kb, lb, nw)
        name = f"tale_attn_k{kb}l{lb}"
        mod.function(name, smem)
        out[level] = (name, smem, nw)
    smem = max(out[lv][1] for lv in LEVELS)
    mod.function("tale_attn_paper", smem)
    out["paper"] = ("tale_attn_paper", smem, 8)
    return out


# -- the kernel's layout (see the .cu header) -------------------------------------------------------------------


def _fields(bits: int, q: int) -> tuple[int, int, int]:
    """Field q of a 16-bit half (bits * q .. ): (byte, field in byte, fields per byte)."""
    fb = 8 // bits
    return q // fb, q % fb, fb


def _key_index(kb: int) -> torch.Tensor:
    """[kb * 16 words, 32 / kb fields] -> index h * 128 + channel of the code at bits kb * field of that word
    (logical word order: thread t's words t * 4 kb .. ; fields 16 / kb .. are the high half)."""
    kw, nf = 4 * kb, 16 // kb
    idx = torch.empty(4 * kw, 2 * nf, dtype=torch.long)
    for t in range(4):
        for j in range(kw):
            for pos in range(2 * nf):
                e, q = pos // nf, pos % nf
                byte, fi, fb = _fields(kb, q)
                ci, r = byte * (fb // 2) + fi // 2, fi % 2
                head, ch = t // 2 + 2 * r, 4 * ((8 // kb) * j + ci) + 2 * (t % 2) + e
                idx[kw * t + j, pos] = head * 128 + ch
    return idx


def _lat_index(lb: int) -> torch.Tensor:
    """[lb * 256 words, 32 / lb fields] -> index slot * 256 + channel within a 32-slot block of 256 channels."""
    lw, nf = 8 * lb, 16 // lb
    idx = torch.empty(32 * lw, 2 * nf, dtype=torch.long)
    for lane in range(32):
        n, t = lane // 4, lane % 4
        for w in range(lw):
            for pos in range(2 * nf):
                el, q = pos // nf, pos % nf
                byte, fi, _ = _fields(lb, q)
                if lb == 2:
                    nt, kc, r = 2 * w + byte, fi // 2, fi % 2
                else:
                    nt, kc, r = w, byte, fi
                ch, slot = 8 * nt + n, 16 * kc + 8 * r + 2 * t + el
                idx[((w // 4) * 32 + lane) * 4 + w % 4, pos] = slot * 256 + ch
    return idx


def _words(codes: torch.Tensor, idx: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., M] gathered by idx [W, 32 / bits] into int32 words [..., W] (field f at bits * f)."""
    g = codes[..., idx.to(codes.device)].long()  # [..., W, fields]
    sh = (bits * torch.arange(idx.shape[1], device=codes.device)).long()
    w = (g << sh).sum(-1)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def pack(kcode, ks, kz, lcode, ls, lz, kb: int = 2, lb: int = 2):
    """Reference-layout tensors -> the kernel's four arrays. kcode [B, K, L, 128] (codes), ks/kz [B, K, L/32, 128]
    (fp16, stored), lcode [B, G, L, R] (codes), ls/lz [B, G, L, R/32] (fp16, stored); R = 256 halves per CTA."""
    B, _, L, _ = kcode.shape
    nb, R = L // 32, lcode.shape[-1]
    halves = R // RANK
    kflat = kcode.view(B, G, GS, L, N).permute(0, 1, 3, 2, 4).reshape(B, G, L, GS * N)
    kc = _words(kflat, _key_index(kb), kb)  # [B, G, L, 16 kb]
    # 16-byte quads of thread t's words, swizzled against bank conflicts: 2-bit quad u at u ^ (slot & 1),
    # 4-bit at u ^ (2 (slot & 1) + t // 2)
    kw = 4 * kb
    for par in (0, 1):
        sw = [
            kw * t + 4 * ((u ^ (par if kb == 2 else 2 * par + t // 2)) % (kw // 4)) + jj
            for t in range(4)
            for u in range(kw // 4)
            for jj in range(4)
        ]
        inv = torch.tensor(sw, device=kc.device).argsort()
        kc[:, :, par::2] = kc[:, :, par::2][..., inv]
    km = torch.cat(
        [t.view(B, G, GS, nb, 32, 4).permute(0, 1, 3, 2, 4, 5) for t in (ks, kz)], -1
    )  # [B, G, nb, 4, 32, 8]
    # quad c of head h stored at c ^ ((2h + c // 16) & 7): the A build's 8 distinct addresses hit distinct banks
    src = torch.tensor([[c ^ ((2 * h + c // 16) & 7) for c in range(32)] for h in range(GS)], device=km.device)
    km = km.gather(4, src.argsort(-1).view(1, 1, 1, GS, 32, 1).expand_as(km)).contiguous()
    # latents: per (batch, group, half of 256 channels, block)
    lflat = lcode.view(B, G, nb, 32, halves, RANK).permute(0, 1, 4, 2, 3, 5).reshape(B, G, halves, nb, 32 * RANK)
    lc = _words(lflat, _lat_index(lb), lb)
    slots = torch.tensor(
        [
            [[16 * kc_ + 2 * t, 16 * kc_ + 2 * t + 1, 16 * kc_ + 2 * t + 8, 16 * kc_ + 2 * t + 9] for t in range(4)]
            for kc_ in range(2)
        ],
        device=ls.device,
    )  # [2, 4, 4]
    parts = []
    for t in (ls, lz):
        x = t.view(B, G, nb, 32, halves, 8).permute(0, 1, 4, 2, 5, 3)  # [B, G, halves, nb, cg, 32 slots]
        parts.append(x[..., slots])  # [B, G, halves, nb, cg, 2, 4, 4]
    lm = torch.cat(parts, -1).contiguous()  # [B, G, halves, nb, 8, 2, 4, 8]
    return kc.contiguous(), km, lc.contiguous(), lm


def random_level(B: int, L: int, level: str = "2bit", seed: int = 0, device: str = "cuda"):
    kb, lb, rank, _, _ = LEVELS[level]
    gen = torch.Generator(device=device).manual_seed(seed)
    kcode = torch.randint(0, 1 << kb, (B, K, L, N), device=device, generator=gen, dtype=torch.uint8)
    lcode = torch.randint(0, 1 << lb, (B, G, L, rank), device=device, generator=gen, dtype=torch.uint8)

    def meta(shape, bits):
        s = torch.rand(shape, device=device, generator=gen) * 0.4 / ((1 << bits) - 1) + 0.05
        z = torch.randn(shape, device=device, generator=gen) * 0.2 - s * ((1 << bits) - 1) / 2
        return (s * SHIFT).half(), (z * SHIFT).half()

    ks, kz = meta((B, K, L // 32, N), kb)
    ls, lz = meta((B, G, L, rank // VG), lb)
    q = torch.randn(B, H, N, device=device, generator=gen).bfloat16()
    return q, kcode, ks, kz, lcode, ls, lz


def dequantize(kcode, ks, kz, lcode, ls, lz) -> tuple[torch.Tensor, torch.Tensor]:
    """A level's keys [B, K, L, N] and latents [B, G, L, R] in float32."""
    sk = (ks.float() / SHIFT).repeat_interleave(KG, 2)
    zk = (kz.float() / SHIFT).repeat_interleave(KG, 2)
    sl = (ls.float() / SHIFT).repeat_interleave(VG, -1)
    zl = (lz.float() / SHIFT).repeat_interleave(VG, -1)
    return kcode.float() * sk + zk, lcode.float() * sl + zl


def attend(q, keys, lat, valid=None) -> torch.Tensor:
    """float32 decode attention in latent space: z [B, H, R]; valid [B, L] masks slots out."""
    B, _, L, _ = keys.shape
    qf = q.float().view(B, K, H // K, N)
    logits = torch.einsum("bkrn,bkln->bkrl", qf, keys).reshape(B, H, L) * N**-0.5
    if valid is not None:
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    p = logits.softmax(-1).view(B, G, H // G, L)
    return torch.einsum("bgrl,bglc->bgrc", p, lat).reshape(B, H, lat.shape[-1])


def reference(q, kcode, ks, kz, lcode, ls, lz) -> torch.Tensor:
    """float32 attention of one level alone: z [B, H, R]."""
    return attend(q, *dequantize(kcode, ks, kz, lcode, ls, lz))


# -- the whole paper-preset call: sinks | 2-bit level | 4-bit level | residual, and the new token -----------------


def random_call(B: int, ctx: int, seed: int = 0, device: str = "cuda", pad=None, extra: int = 0):
    """A cache of ctx tokens per row as the kernel reads it: dict with q, the two levels (codes and scales, capacity
    used + `extra` slots), their positions pos2 / pos4 [B, capacity] and used lengths n2 / n4, the tail (16-bit
    sinks, residual and the new token: keys tk [B, K, T, N], latents th [B, G, T, 512], positions tpos [B, T]) and
    npos (the new token's position). `pad[b]` leading positions of row b are padding (-1)."""
    sinks, n2, n4, res = bd.region_lengths(ctx)
    lv2 = random_level(B, n2 + extra, "2bit", seed, device)
    lv4 = random_level(B, n4 + extra, "4bit", seed + 1, device)
    gen = torch.Generator(device=device).manual_seed(seed + 2)
    T = sinks + res + 1
    tk = (torch.randn(B, K, T, N, device=device, generator=gen) * 0.5).bfloat16()
    th = (torch.randn(B, G, T, 512, device=device, generator=gen) * 0.3).bfloat16()

    def positions(start: int, used: int, cap: int) -> torch.Tensor:
        p = torch.full((B, cap), -1, dtype=torch.int32, device=device)
        p[:, :used] = torch.arange(start, start + used, dtype=torch.int32, device=device)
        return p

    pos2, pos4 = positions(sinks, n2, n2 + extra), positions(sinks + n2, n4, n4 + extra)
    tpos = torch.cat([positions(0, sinks, sinks), positions(sinks + n2 + n4, res, res), positions(ctx, 1, 1)], 1)
    for b, pb in enumerate(pad or []):
        for p in (pos2, pos4, tpos):
            p[b][(p[b] >= 0) & (p[b] < pb)] = -1
    return dict(
        q=lv2[0], lv2=lv2[1:], lv4=lv4[1:], tk=tk, th=th, pos2=pos2, pos4=pos4, tpos=tpos, n2=n2, n4=n4, npos=ctx
    )


def reference_call(c: dict, window: int = 0) -> torch.Tensor:
    n2, n4 = c["n2"], c["n4"]
    k2, h2 = dequantize(*c["lv2"])
    k4, h4 = dequantize(*c["lv4"])
    h2 = torch.nn.functional.pad(h2, (0, 512 - h2.shape[-1]))  # the 2-bit level's rank 256 of 512
    keys = torch.cat([k2[:, :, :n2], k4[:, :, :n4], c["tk"].float()], 2)
    lat = torch.cat([h2[:, :, :n2], h4[:, :, :n4], c["th"].float()], 2)
    pos = torch.cat([c["pos2"][:, :n2], c["pos4"][:, :n4], c["tpos"]], 1)
    valid = (pos >= 0) & ((c["npos"] - pos < window) if window > 0 else True)
    return attend(c["q"], keys, lat, valid)


def call_splits(B: int, n2: int, n4: int, sms: int) -> tuple[int, int]:
    """Splits of the two levels so that their CTAs share one wave in proportion to the bytes they read (the 4-bit
    level's keys twice)."""
    b2, b4 = n2 * level_bytes("2bit"), n4 * (level_bytes("4bit") + key_bytes(LEVELS["4bit"][0]))
    f2 = b2 / max(b2 + b4, 1)
    s2 = max(1, min(max(n2 // 32 // 8, 1), round(sms * f2 / (B * G))))
    s4 = max(1, min(max(n4 // 32 // 5, 1), round(sms * (1 - f2) / (B * 2 * G))))
    return s2, s4


def runner_call(kern: dict, c: dict, S2: int, S4: int, window: int = 0, pdl: bool = False):
    """The whole call over random_call's cache `c`: the levels' launch, then the merge launch (which also scores the
    16-bit tail). Lengths and the new token's position travel as device tensors, as a static cache holds them."""
    name, smem, _ = kern["paper"]
    mod = kern["mod"]
    q, tk, th = c["q"], c["tk"], c["th"]
    a2, a4 = c["packed"]
    B, T = q.shape[0], tk.shape[2]
    cap2, cap4 = c["pos2"].shape[1], c["pos4"].shape[1]
    St = S2 + S4
    po = torch.empty(B, H, St, 512, device="cuda")
    pm = torch.empty(B, H, St, device="cuda")
    pl = torch.empty(B, H, St, device="cuda")
    z = torch.empty(B, H, 512, device="cuda")
    dev = lambda v: torch.tensor([v], dtype=torch.int32, device="cuda")  # noqa: E731
    len2, len4, npos = dev(c["n2"]), dev(c["n4"]), dev(c["npos"])
    qk = N**-0.5 * math.log2(math.e)
    a1 = (q, *a2, *a4, po, pm, pl, G, cap2, S2, cap4, S4, 1 / SHIFT, qk, c["pos2"], len2, c["pos4"], len4, npos, window)
    a3 = (po, pm, pl, q, tk, th, z, St, S2, T, G, 1 / SHIFT, qk, c["tpos"], npos, window)
    grid = (S2 * G + S4 * 2 * G) * B

    def fn():
        mod.launch(name, grid, 256, a1, smem)
        mod.launch(kern["combine_paper"], (B * H, 8), 256, a3, pdl=pdl)
        return z

    return fn


def runner(kern: dict, level: str, arrays, q, B: int, L: int, S: int, parts: str = "both"):
    """One level alone: L used slots (the whole capacity), no padding, no window."""
    name, smem, nw = kern[level]
    mod = kern["mod"]
    rw = LEVELS[level][2]
    pos = torch.arange(L, dtype=torch.int32, device="cuda").expand(B, L).contiguous()
    ln = torch.tensor([L], dtype=torch.int32, device="cuda")
    po = torch.empty(B, H, S, rw, device="cuda")
    pm = torch.empty(B, H, S, device="cuda")
    pl = torch.empty(B, H, S, device="cuda")
    z = torch.empty(B, H, rw, device="cuda")
    qk = N**-0.5 * math.log2(math.e)

    def fn():
        if parts != "comb":
            args = (q, *arrays, po, pm, pl, G, L, S, rw, 1 / SHIFT, qk, pos, ln, ln, 0)
            mod.launch(name, (S, G * rw // RANK, B), 32 * nw, args, smem)
        if parts != "attn":
            mod.launch(kern["combine"], (B * H, rw // 64), 256, (po, pm, pl, z, S, rw, 1 / SHIFT))
        return z

    return fn


def table_row(*cells) -> None:
    print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


def splits_for(B: int, L: int, level: str, sms: int) -> int:
    halves = LEVELS[level][2] // RANK
    return max(1, min(L // 32 // LEVELS[level][3], round(sms / (B * G * halves))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="32768,131072,524288")
    ap.add_argument("--levels", default="2bit,4bit")
    ap.add_argument(
        "--variants",
        default="1:4,0:4",
        help="subn:abatch,... (subn 1: codes read as fp16 subnormals, 0: 1024 + code with the offset from one more "
        "mma; abatch: pieces of the query-scale build whose loads are issued together); PATH=subn:abatch compiles "
        "another source file",
    )
    ap.add_argument("--no-triton", action="store_true")
    ap.add_argument("--call", action="store_true", help="also time the whole paper call against Triton and SDPA")
    ap.add_argument(
        "--ncu",
        type=int,
        metavar="CTX",
        help="no checks or timings: run the first level's and variant's main kernel 4 times at context CTX, batch "
        "1 (a target for `ncu --launch-skip 2 --launch-count 1`)",
    )
    a = ap.parse_args()
    torch.manual_seed(0)
    bd.FLUSH = torch.empty(64 << 20, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # a variant "PATH=subn:abatch..." compiles another source (an older version, for an A/B in one process)
    variants = {
        v: kernels(*map(int, v.split("=")[-1].split(":")), **({"src": v.split("=")[0]} if "=" in v else {}))
        for v in a.variants.split(",")
    }
    levels = [x for x in a.levels.split(",") if x]
    if a.ncu:
        lv = levels[0]
        n = bd.region_lengths(a.ncu)[LEVELS[lv][4]] // 32 * 32
        data = random_level(1, n, lv, seed=1)
        arrays = pack(*data[1:], *LEVELS[lv][:2])
        fn = runner(next(iter(variants.values())), lv, arrays, data[0], 1, n, splits_for(1, n, lv, sms), "attn")
        for _ in range(4):
            fn()
        torch.cuda.synchronize()
        return 0
    ok = True
    # correctness: small and real lengths, batch 1 and 3, against the float32 reference
    for lv in levels:
        for B, L in ((1, 2048), (3, 4096), (1, 40960)):
            data = random_level(B, L, lv, seed=B * 7 + L)
            arrays = pack(*data[1:], *LEVELS[lv][:2])
            ref = reference(*data)
            for s, kern in variants.items():
                for S in (1, splits_for(B, L, lv, sms), 3):
                    bd.poison()
                    got = runner(kern, lv, arrays, data[0], B, L, S)().clone()
                    e = bd.rel(got, ref)
                    good = e <= 5e-3 and bool(torch.isfinite(got).all())
                    ok &= good
                    print(f"check {lv} {s} B={B} L={L} S={S}: rel err {e:.2e} {'ok' if good else 'FAIL'}", flush=True)
    # the whole paper call: both levels in one launch, the 16-bit tail in the merge; left padding, sliding windows,
    # capacities past the used lengths (lengths and the position on the device)
    cases = [
        (1, 8192, None, 0, 0),
        (3, 20000, [0, 1000, 5000], 64, 6000),
        (1, 131072, None, 64, 4096),
        (2, 131072, [0, 70000], 0, 0),
    ]
    for B, ctx, pad, extra, window in cases:
        c = random_call(B, ctx, seed=ctx + B, pad=pad, extra=extra)
        ref = reference_call(c, window)
        c["packed"] = pack(*c["lv2"], 2, 2), pack(*c["lv4"], 4, 4)
        for s, kern in variants.items():
            for S2, S4 in {call_splits(B, c["n2"], c["n4"], sms), (1, 1), (3, 2)}:
                for pdl in (False, True):
                    bd.poison()
                    got = runner_call(kern, c, S2, S4, window, pdl)().clone()
                    e = bd.rel(got, ref)
                    good = e <= 5e-3 and bool(torch.isfinite(got).all())
                    ok &= good
                    print(
                        f"check call {s} B={B} ctx={ctx} pad={pad} extra={extra} window={window} S={S2},{S4} "
                        f"pdl={pdl}: rel err {e:.2e} {'ok' if good else 'FAIL'}",
                        flush=True,
                    )
    if not ok:
        print("correctness failed: no timings", flush=True)
        return 1
    bw = bd.copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    if a.call:
        whole_call(variants, a, bw, sms)
    for lv in levels:
        print(
            f"\n| context | B | {lv} slots | MB | Triton {lv} us (% copy) | "
            + " | ".join(f"CUDA {s} us (% copy)" for s in variants)
            + " | best speedup |"
        )
        print("|---|---|---|---|---|" + "---|" * len(variants) + "---|")
        rows = [(1, int(c)) for c in a.contexts.split(",")] + [(4, 131072)]
        for B, ctx in rows:
            n = bd.region_lengths(ctx)[LEVELS[lv][4]] // 32 * 32
            mb = B * G * n * level_bytes(lv) / 1e6
            tt = float("nan") if a.no_triton else triton_us(B, ctx, lv)[0]
            data = random_level(B, n, lv, seed=1)
            arrays = pack(*data[1:], *LEVELS[lv][:2])
            q = data[0]
            del data
            S = splits_for(B, n, lv, sms)
            ts = {s: bd.timeit(runner(kern, lv, arrays, q, B, n, S)) for s, kern in variants.items()}
            best = min(ts.values())
            cells = [pct(t, mb, bw) for t in (tt, *ts.values())]
            table_row(f"{ctx // 1024}K", B, n, f"{mb:.1f}", *cells, f"{tt / best:.2f}x")
            kern = variants[min(ts, key=ts.get)]
            probes = {p: bd.timeit(runner(kern, lv, arrays, q, B, n, S, p)) for p in ("attn", "comb")}
            nw = LEVELS[lv][3]
            probes["attn, 1 block/warp"] = bd.timeit(runner(kern, lv, arrays, q, B, nw * S * 32, S, "attn"))
            x1 = torch.zeros(1, device="cuda")
            probes["floor: a 1-element kernel"] = bd.timeit(lambda x1=x1: torch.add(x1, 1, out=x1))
            print("    probes (best variant): " + ", ".join(f"{k} {v:.1f} us" for k, v in probes.items()), flush=True)
            del arrays
    return 0


def whole_call(variants: dict, a, bw: float, sms: int) -> None:
    """The whole paper-preset call (all regions and the new token) against the Triton kernel and SDPA."""
    print(
        "\n| context | B | cache MB | Triton us (% copy) | "
        + " | ".join(f"CUDA {s}{f} us (% copy)" for f in ("", " pdl") for s in variants)
        + " | SDPA bf16 us | CUDA vs Triton | CUDA vs SDPA |"
    )
    print("|---|---|---|---|" + "---|" * (2 * len(variants)) + "---|---|---|")
    rows = [(1, int(c)) for c in a.contexts.split(",")] + [(4, 131072)]
    for B, ctx in rows:
        tt, mb = triton_us(B, ctx)
        ts_sdpa, _ = bd.best_sdpa(B, ctx)
        c = random_call(B, ctx, seed=1)
        c["packed"] = pack(*c.pop("lv2"), 2, 2), pack(*c.pop("lv4"), 4, 4)
        S2, S4 = call_splits(B, c["n2"], c["n4"], sms)
        ts = {s: bd.timeit(runner_call(k, c, S2, S4)) for s, k in variants.items()}
        for s, k in variants.items():
            ts[f"{s} pdl"] = bd.timeit(runner_call(k, c, S2, S4, pdl=True))
        best = min(ts.values())
        table_row(
            f"{ctx // 1024}K",
            B,
            f"{mb:.1f}",
            *[pct(t, mb, bw) for t in (tt, *ts.values())],
            f"{ts_sdpa:.1f}",
            f"{tt / best:.2f}x",
            f"{ts_sdpa / best:.2f}x",
        )
        del c


if __name__ == "__main__":
    sys.exit(main())
