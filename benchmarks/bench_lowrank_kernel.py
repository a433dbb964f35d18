"""Decode attention of one layer over a `lowrank`-preset cache on Llama-3.1-8B shapes: the low-rank-key kernel
(tale_kernels.lowrank_attention) against the float32 torch reference, then timed against cuDNN/flash SDPA over a
16-bit cache of the same length and the Triton kernel of kernels/attention.py over the paper preset's cache.

Shapes: 32 query heads, 8 KV heads, head dim 128, latent groups of 4 KV heads (R = 512). The lowrank preset's
layout (tale_convert/policy.py): 4 sinks and no 16-bit tail after RoPE; the middle level (90%) as key coefficients
before RoPE at rank 432 (5/12 of K n = 1024, rounded up to 16) or 160, 4 bits per coefficient over groups of 32
tokens, 3-bit latents at r0 = 320 (2R/3 rounded down to the value group); the recent 10% as 4-bit keys before RoPE
per channel over 32 tokens with 4-bit full-rank latents; the last < 32 tokens as 8-bit keys per token over 64
channels with 8-bit latents; fp8 scales and zeros ("8/8") everywhere. RoPE: Llama-3.1's (theta 5e5, llama3
scaling) computed in the kernel from the rotary's inv_freq ("kernel"), or read from the regions' tables ("tables").
Random codes and metadata (real weights cannot travel), bf16. Times: medians of CUDA-graph replays with L2 flushed
before each (benchmarks/bench_decode.py's timeit); the torch reference runs eagerly.

    python benchmarks/bench_lowrank_kernel.py                  # check, then the table (32K, 128K; B = 1, 4)
    python benchmarks/bench_lowrank_kernel.py --dry            # CPU, Triton's interpreter, small shapes: check only
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

DRY = "--dry" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import bench_decode as bd  # noqa: E402

from tale_kernels import attention as kattn  # noqa: E402
from tale_kernels import lowrank_attention as lra  # noqa: E402
from tale_runtime.attention import latent_attention as ref_attention  # noqa: E402
from tale_runtime.key_basis import KeyBasis  # noqa: E402
from tale_runtime.quant import FP8, QTensor, meta_format  # noqa: E402
from tale_runtime.regions import LayerView, Region  # noqa: E402

H, K, N, GS = 32, 8, 128, 4
G, R = K // GS, GS * N
R0, KG, VG, KCG = 320, 32, 32, 64
DEV = "cpu" if DRY else "cuda"
DT = torch.bfloat16
BIAS = 64.0


def rotary(device):
    """Llama-3.1-8B's rotary embedding (transformers), llama3 rope scaling."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rs = dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
        rope_theta=500000.0,
    )
    kw = dict(
        hidden_size=H * N, num_attention_heads=H, num_key_value_heads=K, head_dim=N, max_position_embeddings=131072
    )
    try:
        cfg = LlamaConfig(rope_scaling=rs, **kw)
    except TypeError:
        cfg = LlamaConfig(rope_parameters=rs, **kw)
    rot = LlamaRotaryEmbedding(cfg).to(device)
    assert rot.rope_type == "llama3", rot.rope_type
    return rot


def qrand(lead, cap, used, C, bits, group, dim, meta="8/8", spread=1.0) -> QTensor:
    """Random packed codes with random scales/zeros (fp8 times BIAS for "8/8"); slots past `used` hold NaN."""
    if bits == 16:
        x = torch.randn(*lead, cap, C, device=DEV, dtype=DT) * spread
        x[..., used:, :] = float("nan")
        return QTensor(x, None, None, 16, group, dim)
    packed = C * bits // 8
    data = torch.randint(0, 256, (*lead, cap, packed), dtype=torch.uint8, device=DEV)
    sshape = (*lead, cap // group, C) if dim == -2 else (*lead, cap, C // group)
    qmax = (1 << bits) - 1
    scale = (torch.rand(sshape, device=DEV) * 0.2 + 0.05) * spread * 15 / qmax
    zero = torch.randn(sshape, device=DEV) * 0.3 * spread - scale * qmax / 2
    if meta == "8/8":
        s, z = (scale * BIAS).to(FP8), (zero * BIAS).to(FP8)
        return QTensor(data, s, z, bits, group, dim, "8/8", BIAS)
    mdt, shift = meta_format(DT)
    return QTensor(data, (scale * shift).to(mdt), (zero * shift).to(mdt), bits, group, dim, shift=shift)


def lengths(L: int) -> tuple[int, int, int, int]:
    """(sinks, low-rank middle, 4-bit recent, 8-bit newest) of L cached tokens."""
    n = L - 4
    l2 = n % KG
    l1 = -(-(n // 10) // KG) * KG
    return 4, n - l1 - l2, l1, l2


def basis(seed: int = 0) -> KeyBasis:
    g = torch.Generator().manual_seed(seed)
    C = K * N
    enc = torch.linalg.qr(torch.randn(C, C, generator=g))[0]
    w = torch.linspace(4.0, 0.5, C)  # leading directions carry more of the keys
    return KeyBasis(
        (enc / w).to(DEV), (w[:, None] * enc.T).contiguous().to(DEV), torch.randn(C, generator=g).to(DEV), K, N
    )


def lowrank_view(B: int, L: int, kr: int, rot, pad=None, tables: bool = False, lat_bits: int = 3) -> LayerView:
    """A LayerView of the lowrank preset's layout over L positions per row (pad[b]: leading padding of row b)."""
    pad = pad or [0] * B
    bs = basis()
    regions, p0 = [], 0
    for kind, used in zip(("sink", "lowrank", "chan4", "tok8"), lengths(L)):
        cap = used
        pos = torch.arange(p0, p0 + used, dtype=torch.int32, device=DEV).repeat(B, 1)
        for b, pb in enumerate(pad):
            pos[b][pos[b] < pb] = -1
        p0 += used
        if used == 0:
            continue
        rope = None
        if tables and kind != "sink":
            rp = (pos - torch.tensor(pad, device=DEV, dtype=torch.int32)[:, None]).clamp_min(0).long()
            cos, sin = rot(torch.zeros(1, device=DEV, dtype=DT), rp)
            rope = (cos.float(), sin.float())
        elif kind != "sink":  # the kernel computes them; the reference needs the tables
            rope = "kernel"
        if kind == "sink":
            keys, lat, rank, b_ = (
                qrand((B, K), cap, used, N, 16, 1, -2),
                qrand((B, G), cap, used, R, 16, 1, -1),
                R,
                None,
            )
        elif kind == "lowrank":
            keys = qrand((B, 1), cap, used, kr, 4, KG, -2, spread=2.0)
            lat, rank, b_ = qrand((B, G), cap, used, R0, lat_bits, VG, -1), R0, bs
        elif kind == "chan4":
            keys, lat, rank, b_ = (
                qrand((B, K), cap, used, N, 4, KG, -2),
                qrand((B, G), cap, used, R, 4, VG, -1),
                R,
                None,
            )
        else:
            keys, lat, rank, b_ = (
                qrand((B, K), cap, used, N, 8, KCG, -1),
                qrand((B, G), cap, used, R, 8, VG, -1),
                R,
                None,
            )
        regions.append(Region(keys, lat, rank, pos, used, rope, b_))
    return LayerView(regions, L, None)


def with_tables(view: LayerView, rot, pad) -> LayerView:
    """The view with every "kernel" rope marker replaced by the tables (what the reference reads)."""
    B = view.regions[0].pos.shape[0]
    off = torch.tensor(pad or [0] * B, device=DEV, dtype=torch.int32)[:, None]
    regs = []
    for r in view.regions:
        if r.rope == "kernel":
            cos, sin = rot(torch.zeros(1, device=DEV, dtype=DT), (r.pos - off).clamp_min(0).long())
            r = Region(r.keys, r.lat, r.rank, r.pos, r.length, (cos.float(), sin.float()), r.basis)
        regs.append(r)
    return LayerView(regs, view.next_pos, view.window)


def new_token(B: int):
    return (
        torch.randn(B, H, 1, N, device=DEV, dtype=DT),
        torch.randn(B, K, 1, N, device=DEV, dtype=DT),
        torch.randn(B, G, 1, R, device=DEV, dtype=DT),
    )


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check(rot, cases) -> bool:
    ok = True
    for B, L, kr, pad, window in cases:
        view = with_tables(lowrank_view(B, L, kr, rot, pad), rot, pad)
        view.window = window
        q, k, h = new_token(B)
        ref = ref_attention(q.float(), k.float(), h.float(), view, N**-0.5)
        why = lra.supported(q, k, h, view)
        for mode in ("tables", "kernel"):
            z = lra.latent_attention_lowrank(q, k, h, view, N**-0.5, rope=None if mode == "tables" else rot)
            e = rel(z, ref)
            good = why is None and e <= 5e-3 and bool(torch.isfinite(z).all())
            ok &= good
            print(
                f"check B={B} L={L} rank={kr} pad={pad} window={window} rope={mode}: rel {e:.2e} {'ok' if good else 'FAIL'}"
            )
    if not DRY:  # a CUDA-graph replay on fresh inputs of the same buffers
        B, L = 2, 5000
        view = with_tables(lowrank_view(B, L, 432, rot), rot, None)
        q, k, h = new_token(B)
        gr, out = bd.graphed(lambda: lra.latent_attention_lowrank(q, k, h, view, N**-0.5, rope=rot))
        q.copy_(torch.randn_like(q))
        gr.replay()
        e = rel(out, ref_attention(q.float(), k.float(), h.float(), view, N**-0.5))
        print(f"check CUDA-graph replay B={B} L={L}: rel {e:.2e} {'ok' if e <= 5e-3 else 'FAIL'}")
        ok &= e <= 5e-3
    return ok


def kernel_view(view: LayerView) -> LayerView:
    """Regions marked "kernel" keep no tables: the kernel computes RoPE (its `supported` reads rope only as a flag)."""
    regs = []
    for r in view.regions:
        if r.rope == "kernel":
            marker = torch.empty(0, device=DEV)
            r = Region(r.keys, r.lat, r.rank, r.pos, r.length, (marker, marker), r.basis)
        regs.append(r)
    return LayerView(regs, view.next_pos, view.window)


def safe_time(fn) -> float:
    try:
        return bd.timeit(fn)
    except Exception as e:  # a failed configuration shows as nan, the run goes on
        print(f"  timing failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        torch.cuda.synchronize()
        return float("nan")


def time_row(rot, B: int, L: int, ranks, ref_too: bool, kw: dict) -> dict:
    row = {"L": L, "B": B}
    q, k, h = new_token(B)
    for kr in ranks:
        v = kernel_view(lowrank_view(B, L, kr, rot))
        row[f"lowrank r={kr}"] = safe_time(
            lambda v=v: lra.latent_attention_lowrank(q, k, h, v, N**-0.5, rope=rot, **kw)
        )
        del v
    v = lowrank_view(B, L, ranks[0], rot, tables=True)
    row[f"lowrank r={ranks[0]} tables"] = safe_time(lambda v=v: lra.latent_attention_lowrank(q, k, h, v, N**-0.5, **kw))
    if ref_too:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            ref_attention(q, k, h, v, N**-0.5)
        torch.cuda.synchronize()
        row["torch reference (lowrank)"] = (time.perf_counter() - t0) / 3 * 1e6
    del v
    pv = bd.synth_view(B, L)
    row["paper preset, Triton kernel"] = safe_time(lambda pv=pv: kattn.latent_attention(q, k, h, pv, N**-0.5))
    del pv
    t, name = bd.best_sdpa(B, L)
    row[f"SDPA bf16 ({name})"] = t
    row["_sdpa"] = t
    torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry", action="store_true")
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--ranks", default="432,160")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument(
        "--sweep",
        default="32x32x4x2x0,32x32x8x2x1,32x64x8x2x1,64x32x8x2x1,32x32x8x4x1,32x32x4x4x1,32x32x8x8x1,64x64x8x4x1",
        help="block_t x coef_chunk x num_warps x waves x fused_heads (1/0), swept at 32K B=1; the table takes the fastest",
    )
    a = ap.parse_args()
    torch.manual_seed(0)
    if DRY:
        global H, K, N, GS, G, R, R0, KG, VG, KCG
        H, K, N, GS, G, R, R0, KG, VG, KCG = 8, 4, 32, 2, 2, 64, 40, 8, 8, 16
    rot = rotary(DEV)
    if DRY:
        ok = check(rot, [(1, 203, 40, None, None), (2, 150, 24, [0, 5], 100)])
        print("dry check", "ok" if ok else "FAILED")
        return 0 if ok else 1
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    import transformers
    import triton

    print(f"triton {triton.__version__}  transformers {transformers.__version__}")
    bd.FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    ok = True
    if not a.no_check:
        cases = [(1, 4099, 432, None, None), (4, 3001, 160, [0, 3, 17, 40], None), (1, 33000, 432, None, None)]
        cases += [(4, 2051, 432, [0, 0, 5, 9], 700), (1, 131073, 160, None, None)]
        ok = check(rot, cases)
        print("check", "ok" if ok else "FAILED")
    ranks = [int(x) for x in a.ranks.split(",")]
    best = (float("inf"), {})
    if a.sweep:  # kernel options at 32K, B = 1, rank ranks[0]
        q, k, h = new_token(1)
        v = kernel_view(lowrank_view(1, 32768, ranks[0], rot))
        for cfg in a.sweep.split(","):
            bt, kc, w, wv, fh = (int(x) for x in cfg.split("x"))
            kw = dict(block_t=bt, coef_chunk=kc, num_warps=w, waves=float(wv), fused_heads=bool(fh))
            t = safe_time(lambda kw=kw: lra.latent_attention_lowrank(q, k, h, v, N**-0.5, rope=rot, **kw))
            print(f"sweep L=32768 B=1 r={ranks[0]} {kw}: {t:.1f} us", flush=True)
            if t < best[0]:
                best = (t, kw)
        del v
    print(f"table with kernel options {best[1] or 'default'}")
    rows = []
    for L in (int(x) for x in a.contexts.split(",")):
        for B in (int(x) for x in a.batches.split(",")):
            rows.append(time_row(rot, B, L, ranks, ref_too=True, kw=best[1]))
            print(rows[-1], flush=True)
    cols = [c for c in rows[0] if c not in ("L", "B", "_sdpa")]
    print(f"\nOne layer's decode attention, Llama-3.1-8B shapes, bf16, {torch.cuda.get_device_name()} (us; x = / SDPA)")
    print("| L | B | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for r in rows:
        cells = [f"{r[c]:.1f} ({r[c] / r['_sdpa']:.2f}x)" for c in cols]
        print(f"| {r['L']} | {r['B']} | " + " | ".join(cells) + " |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
