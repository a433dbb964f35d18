"""The CUDA decode kernel (tale_kernels.mma_attention, kernels/cuda/latent_level.cu) alone, against the Triton kernel.

One template covers the paper preset's two levels: the 2-bit middle (2-bit keys, rank-256 latents at 2 bits) and the
4-bit recent level (4-bit keys, rank-512 latents at 4 bits). This script packs a random level of Llama-3.1-8B shapes
(8 KV heads, head dim 128, latent groups of 4 heads, key and value groups of 32) into the kernel's layout
(runtime/frag.py), checks the output against a float32 torch reference (every input dequantized from the same
codes), then times it (median of CUDA-graph replays, L2 flushed before each) next to the Triton kernel on a view of
the same level and size (`bench_decode.synth_view(..., only=...)`) and a device-to-device copy. The kernel is built
by tale_kernels.cuda_module (NVRTC or nvcc, once per option set) and launched through the driver API. The runtime's
own path (a StaticTaleCache in the fragment layout) is timed by `bench_decode.py --presets`.

    python benchmarks/bench_cuda_decode.py                  # check, then 32K / 128K / 512K at B=1 and 128K B=4
    TALE_CUDA_LINEINFO=1 ncu --set full --kernel-name tale_attn_k2l2 --launch-skip 2 --launch-count 1 \
        python benchmarks/bench_cuda_decode.py --ncu 524288 --variants 1:4      # a Nsight Compute profile of one launch
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

from tale_kernels import mma_attention as ma
from tale_runtime import frag
from tale_runtime.quant import QTensor
from tale_runtime.quant import pack as qpack

sys.path.insert(0, os.path.dirname(__file__))
import bench_decode as bd  # noqa: E402
import harness  # noqa: E402
from harness import pct  # noqa: E402
from harness import print_row as table_row  # noqa: E402

K, N, GS, KG, VG = 8, 128, 4, 32, 32
G, H = K // GS, 32
RANK = 256  # latent channels per CTA (the 2-bit level's rank; the 4-bit level's 512 in two halves)
SHIFT = 2.0**-8  # 16-bit scales/zeros of a bf16 cache are stored as float16 times 2^-8 (quant.meta_format)
# per level: (key bits, latent bits, latent rank, warps per CTA, the region index in bench_decode.region_lengths)
LEVELS = {"2bit": (2, 2, 256, 8, 1), "4bit": (4, 4, 512, 5, 2)}


def level_bytes(level: str) -> int:
    """Cache bytes per slot and latent group: keys, latent codes, latent scales/zeros."""
    return ma.LEVEL_BYTES[LEVELS[level][0]]


def triton_us(B: int, ctx: int, only: str | None = None) -> tuple[float, float]:
    """The Triton kernel on bench_decode's view of a ctx-token cache (or one region of it): (us, cache MB)."""
    import tale_kernels

    v = bd.synth_view(B, ctx, only=only)
    q, k, h = bd.new_token(B)
    return harness.timeit(lambda: tale_kernels.latent_attention(q, k, h, v, N**-0.5)), bd.view_bytes(v) / 1e6


def kernels(subn: int = 1, abatch: int = 4, src: str = ma.SRC) -> dict:
    """The compiled module ("mod") and per level: {level: (name, shared bytes, warps)}, the whole paper call's
    ("paper": both levels in one launch) and the merge's name."""
    opts = ("--use_fast_math", f"-DSUBN={subn}", f"-DABATCH={abatch}")
    opts += ("-lineinfo",) if os.environ.get("TALE_CUDA_LINEINFO") else ()
    mod = ma.module(options=opts, src=src)
    out = {"mod": mod, "combine": "tale_combine"}
    for level, (kb, lb, _, nw, _) in LEVELS.items():
        out[level] = (f"tale_attn_k{kb}l{lb}", ma.smem_bytes(kb, lb, nw), nw)
    out["paper"] = ("tale_attn_paper", ma.PAPER_SMEM, 8)
    return out


def pack(kcode, ks, kz, lcode, ls, lz, kb: int = 2, lb: int = 2):
    """Reference-layout tensors -> the kernel's four arrays (runtime/frag.py). kcode [B, K, L, 128] (codes), ks/kz
    [B, K, L/32, 128] (fp16, stored), lcode [B, G, L, R] (codes), ls/lz [B, G, L, R/32] (fp16, stored)."""
    keys = QTensor(qpack(kcode, kb), ks, kz, kb, KG, -2, "16", 1.0, SHIFT)
    lat = QTensor(qpack(lcode, lb), ls, lz, lb, VG, -1, "16", 1.0, SHIFT)
    return (*frag.pack_keys(keys), *frag.pack_lat(lat))


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


def runner_call(kern: dict, c: dict, S2: int, S4: int, window: int = 0, pdl: bool = False):
    """The whole call over random_call's cache `c` through mma_attention.launch: the levels' launch, then the merge
    launch (which also scores the 16-bit tail: here its sinks and residual as one segment, then the new token).
    Lengths and the new token's position travel as device tensors, as a static cache holds them."""
    q, tk, th, tpos = c["q"], c["tk"], c["th"], c["tpos"]
    dev = lambda v, dt=torch.int32: torch.tensor([v], dtype=dt, device="cuda")  # noqa: E731
    len2, len4, npos = dev(c["n2"]), dev(c["n4"]), dev(c["npos"], torch.int64)
    a2, a4 = c["packed"]
    lv2, lv4 = (*a2, c["pos2"], len2), (*a4, c["pos4"], len4)
    T = tk.shape[2]
    empty = tk[:, :, :0], th[:, :, :0], tpos[:, :0]
    tail = (
        (tk[:, :, : T - 1].contiguous(), th[:, :, : T - 1].contiguous(), tpos[:, : T - 1].contiguous()),
        empty,
        (tk[:, :, T - 1 :].contiguous(), th[:, :, T - 1 :].contiguous()),
    )
    return lambda: ma.launch(kern["mod"], q, lv2, lv4, tail, npos, window, N**-0.5, SHIFT, S2, S4, pdl)


def runner(kern: dict, level: str, arrays, q, B: int, L: int, S: int, parts: str = "both"):
    """One level alone: L used slots (the whole capacity), no padding, no window."""
    name, smem, nw = kern[level]
    mod = kern["mod"]
    rw = LEVELS[level][2]
    pos = torch.arange(L, dtype=torch.int32, device="cuda").expand(B, L).contiguous()
    ln = torch.tensor([L], dtype=torch.int32, device="cuda")
    npos = torch.tensor([L], dtype=torch.int64, device="cuda")
    po = torch.empty(B, H, S, rw, device="cuda")
    pm = torch.empty(B, H, S, device="cuda")
    pl = torch.empty(B, H, S, device="cuda")
    z = torch.empty(B, H, rw, device="cuda")
    qk = N**-0.5 * math.log2(math.e)

    def fn():
        if parts != "comb":
            args = (q, *arrays, po, pm, pl, G, L, S, rw, 1 / SHIFT, qk, pos, ln, npos, 0)
            mod.launch(name, (S, G * rw // RANK, B), 32 * nw, args, smem)
        if parts != "attn":
            mod.launch(kern["combine"], (B * H, rw // 64), 256, (po, pm, pl, z, S, rw, 1 / SHIFT))
        return z

    return fn


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
    harness.init_flush()
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
            for S2, S4 in {ma.splits(B, G, c["n2"], c["n4"], sms), (1, 1), (3, 2)}:
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
    bw = harness.copy_bandwidth()
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
            ts = {s: harness.timeit(runner(kern, lv, arrays, q, B, n, S)) for s, kern in variants.items()}
            best = min(ts.values())
            cells = [pct(t, mb, bw) for t in (tt, *ts.values())]
            table_row(f"{ctx // 1024}K", B, n, f"{mb:.1f}", *cells, f"{tt / best:.2f}x")
            kern = variants[min(ts, key=ts.get)]
            probes = {p: harness.timeit(runner(kern, lv, arrays, q, B, n, S, p)) for p in ("attn", "comb")}
            nw = LEVELS[lv][3]
            probes["attn, 1 block/warp"] = harness.timeit(runner(kern, lv, arrays, q, B, nw * S * 32, S, "attn"))
            x1 = torch.zeros(1, device="cuda")
            probes["floor: a 1-element kernel"] = harness.timeit(lambda x1=x1: torch.add(x1, 1, out=x1))
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
        S2, S4 = ma.splits(B, G, c["n2"], c["n4"], sms)
        ts = {s: harness.timeit(runner_call(k, c, S2, S4)) for s, k in variants.items()}
        for s, k in variants.items():
            ts[f"{s} pdl"] = harness.timeit(runner_call(k, c, S2, S4, pdl=True))
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
