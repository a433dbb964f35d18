"""Decode attention of one layer over a PAGED TALE cache (tale_kernels.paged_attention) on Llama-3.1-8B shapes, against
the contiguous Triton kernel at the same bits (tale_kernels.attention over one row-layout region) and SDPA over a
16-bit cache.

Shapes: 32 query / 8 KV heads, head dim 128, latent groups of 4 KV heads (G = 2, R = 512), latents cached at rank
256; keys and latents at the same bits with 16-bit scale and zero per 32 channels (paged: per token; contiguous: keys
per channel over 32 tokens, the same bytes). Pages are handed out in random order. Each row first checks the paged
kernel against the float32 reference over the same pages (relative error <= 5e-3), then times CUDA-graph replays
with L2 flushed (harness.timeit). Exit status 1 when a check fails.

    python3 benchmarks/bench_paged.py                 # GPU: 32K and 128K, batch 1 and 4, pages of 16 and 64
    python3 benchmarks/bench_paged.py --dry           # CPU, Triton's interpreter, tiny shapes: the checks only
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

if "--dry" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import harness
import torch

TOL = 5e-3


def shapes(dry: bool) -> dict:
    if dry:  # the same structure, CPU-sized
        return dict(H=8, K=4, n=32, g=2, r=32, group=16)
    return dict(H=32, K=8, n=128, g=4, r=256, group=32)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def build(s: dict, L: int, B: int, bits: tuple[int, int], dev: str, dt: torch.dtype, seed: int = 0):
    """The new token and L cached tokens per sequence (keys after RoPE, latents), random."""
    from tale_runtime.paged import PagedFormat

    g, n, K = s["g"], s["n"], s["K"]
    G = K // g
    fmt = PagedFormat(n, g, s["r"], bits[0], bits[1], s["group"], s["group"], dt)
    gen = torch.Generator(dev).manual_seed(seed)
    k = torch.randn(B, L, K, n, device=dev, dtype=dt, generator=gen)
    h = torch.randn(B, L, G, g * n, device=dev, dtype=dt, generator=gen)
    q = torch.randn(B, s["H"], 1, n, device=dev, dtype=dt, generator=gen)
    kn = torch.randn(B, K, 1, n, device=dev, dtype=dt, generator=gen)
    hn = torch.randn(B, G, 1, g * n, device=dev, dtype=dt, generator=gen)
    return fmt, k, h, (q, kn, hn)


def paged_cache(fmt, k, h, page_size: int, seed: int = 0):
    """The tokens written into a pool whose pages are handed out in random order: (pool, block table, lengths)."""
    from tale_runtime.paged import new_pool, write_slots

    B, L = k.shape[:2]
    dev = k.device
    per = -(-L // page_size)
    pool = new_pool(fmt, B * per + 1, page_size, h.shape[2], dev)
    order = torch.randperm(B * per + 1, generator=torch.Generator().manual_seed(seed))[: B * per].to(dev)
    bt = order.view(B, per).to(torch.int32)
    for b in range(B):
        slots = (bt[b].long()[:, None] * page_size + torch.arange(page_size, device=dev)).reshape(-1)[:L]
        for i in range(0, L, 1 << 15):  # quantize in chunks (bounded memory)
            write_slots(pool, slots[i : i + (1 << 15)], k[b, i : i + (1 << 15)], h[b, i : i + (1 << 15)])
    return pool, bt, torch.full((B,), L, dtype=torch.int32, device=dev)


def contiguous_view(fmt, k, h):
    """The same tokens as one row-layout region, as the contiguous kernel reads it (keys per channel over token
    groups, latents per token over channel groups)."""
    from tale_runtime.quant import quantize
    from tale_runtime.regions import LayerView, Region

    B, L = k.shape[:2]
    keys = quantize(k.transpose(1, 2).contiguous(), fmt.key_bits, fmt.key_group, -2)
    lat = quantize(h[..., : fmt.rank].transpose(1, 2).contiguous(), fmt.lat_bits, fmt.lat_group, -1)
    pos = torch.arange(L, device=k.device, dtype=torch.int32).expand(B, L).contiguous()
    return LayerView([Region(keys, lat, fmt.rank, pos, L)], next_pos=L)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true", help="CPU, Triton's interpreter, tiny shapes: the checks only")
    ap.add_argument("--contexts", default=None, help="comma-separated cached tokens (default 32768,131072)")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--page-sizes", default="16,64")
    ap.add_argument("--bits", default="2/2,4/4", help="key/latent bits, comma-separated (2, 4, 8, 16)")
    ap.add_argument("--out", default=None, help="also write the markdown table here (rewritten after every row)")
    args = ap.parse_args()

    from tale_kernels import attention
    from tale_kernels.paged_attention import PagedConfig, paged_latent_attention
    from tale_runtime.paged import paged_attention_reference

    dry = args.dry
    if not dry and not torch.cuda.is_available():
        print("error: no CUDA device (use --dry for the CPU check)", file=sys.stderr)
        return 2
    dev = "cpu" if dry else "cuda"
    dt = torch.float16 if dry else torch.bfloat16  # the interpreter gets bf16 wrong in the exponent trick
    s = shapes(dry)
    contexts = [int(x) for x in (args.contexts or ("48,208" if dry else "32768,131072")).split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    pages = [int(x) for x in args.page_sizes.split(",")]
    bits = [tuple(int(b) for b in x.split("/")) for x in args.bits.split(",")]
    cfg = PagedConfig(block_t=32, split_tokens=64) if dry else PagedConfig()
    env = "CPU, Triton interpreter (--dry: checks only)" if dry else harness.device_name()
    print(env, flush=True)
    if not dry:
        harness.init_flush(device=dev)
    scale = s["n"] ** -0.5
    header = ["bits k/h", "context", "batch", "page size", "paged us", "contiguous us", "ratio", "SDPA bf16 us",
              "rel. error"]  # fmt: skip
    rows, ok = [], True
    for kv in bits:
        for L in contexts:
            for B in batches:
                try:
                    fmt, k, h, (q, kn, hn) = build(s, L, B, kv, dev, dt)
                    view = contiguous_view(fmt, k, h)
                    if why := attention.supported(q, kn, hn, view):
                        raise RuntimeError(f"the contiguous kernel refuses this view: {why}")
                    call = (q, kn, hn, view, scale)
                    t_cont = float("nan") if dry else harness.timeit(lambda a=call: attention.latent_attention(*a))
                    del view, call
                    t_sdpa, be = (float("nan"), "") if dry else harness.best_sdpa(B, s["H"], s["K"], s["n"], L, dt)
                    for ps in pages:
                        pool, bt, ln = paged_cache(fmt, k, h, ps)
                        z = paged_latent_attention(q, kn, hn, pool, bt, ln, scale, cfg)
                        err = rel(z, paged_attention_reference(q, kn, hn, pool, bt, ln, scale))
                        good = err <= TOL and bool(torch.isfinite(z).all())
                        ok &= good
                        t_pg = float("nan")
                        if not dry:
                            call = (q, kn, hn, pool, bt, ln, scale, cfg)
                            t_pg = harness.timeit(lambda a=call: paged_latent_attention(*a))
                        row = [f"{kv[0]}/{kv[1]}", f"{L // 1024}K" if L >= 1024 else L, B, ps, harness.fmt(t_pg),
                               harness.fmt(t_cont), harness.fmt(t_pg / t_cont, 2), f"{harness.fmt(t_sdpa)} {be}".strip(),
                               f"{err:.1e}" + ("" if good else " FAIL")]  # fmt: skip
                        rows.append(row)
                        harness.print_row(*row)
                        if args.out:
                            with open(args.out, "w") as fh:
                                fh.write(f"{env}\n\n" + harness.table(header, rows))
                        del pool
                    del k, h
                except Exception:
                    traceback.print_exc()
                    ok = False
                if not dry:
                    torch.cuda.empty_cache()
    print()
    print(f"{env}; `python3 {' '.join(sys.argv)}`")
    print(harness.table(header, rows))
    print("CHECKS", "PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
