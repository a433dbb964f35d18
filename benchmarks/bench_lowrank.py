"""What the low-rank-key schedule (tale-convert --preset lowrank) costs on a GPU today: one decode-attention call over
one layer's dynamic cache, Llama-3.1-8B shapes, bf16. The Triton kernel does not read low-rank keys yet, so that
schedule runs the torch reference; timed against the paper schedule through the kernel and through the same
reference, and SDPA over the uncompressed cache, in the same run. Medians of CUDA-event timings (L2 not flushed); the
eager kernel rows include the host's launch time, the graph rows do not (the decode step replays graphs).

    PYTHONPATH=/tmp/pk python3 benchmarks/bench_lowrank.py --contexts 8192,32768
"""

from __future__ import annotations

import argparse

import torch
from harness import median_us

from tale_convert.policy import PRESETS
from tale_runtime.artifact import Level, Schedule, uniform_ranks
from tale_runtime.attention import apply_rope, latent_attention
from tale_runtime.cache import TaleLayerCache
from tale_runtime.key_basis import KeyBasis

H, K, n, g = 32, 8, 128, 4
G, R = K // g, g * n


def schedules() -> dict[str, Schedule]:
    paper = Schedule(ranks=[[R // 2, R]])
    lowrank = Schedule(  # the preset's knobs at these shapes (key rank 5/12 of K n, rounded to 8)
        levels=[Level(3, 4, None, key_rank=424), Level(4, 4, 0.1), Level(8, 8, 0.0, key_axis="token")],
        ranks=uniform_ranks(R, 1, PRESETS["lowrank"]["r0"], 32, 3),
        residual=1,
        key_meta="8/8",
        value_meta="8/8",
        key_channel_group=n,
        key_rope="pre",
    )
    return {"paper": paper, "lowrank": lowrank}


def tables(L: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 500000.0 ** (-torch.arange(0, n, 2, device=dev).float() / n)
    ang = torch.arange(L, device=dev).float()[:, None] * inv
    ang = torch.cat([ang, ang], -1)[None]
    return ang.cos().bfloat16(), ang.sin().bfloat16()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    import tale_kernels

    dev, bf = torch.device("cuda"), torch.bfloat16
    B = args.batch
    gen = torch.Generator(device=dev).manual_seed(0)
    Q = torch.linalg.qr(torch.randn(K * n, K * n, device=dev, generator=gen))[0]
    basis = KeyBasis(Q, Q.T.contiguous(), torch.zeros(K * n, device=dev), K, n)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; H {H}, K {K}, n {n}, g {g}, R {R}, B {B}, bf16")
    print("| context | cache | path | us | vs paper kernel (graph) | cache MB |")
    print("|---|---|---|---:|---:|---:|")
    for L in (int(x) for x in args.contexts.split(",")):
        k = torch.randn(B, K, L + 1, n, device=dev, generator=gen).to(bf)
        h = torch.randn(B, G, L + 1, R, device=dev, generator=gen).to(bf)
        q = torch.randn(B, H, 1, n, device=dev, generator=gen).to(bf)
        cos, sin = tables(L + 1, dev)
        k = apply_rope(k, cos.expand(B, -1, -1), sin.expand(B, -1, -1))
        rows = {}
        for name, s in schedules().items():
            c = TaleLayerCache(s, 0, K, n, G, R, basis=basis if name == "lowrank" else None)
            rope = {"rope": (cos[:, :L].expand(B, -1, -1), sin[:, :L].expand(B, -1, -1))} if s.key_rope == "pre" else {}
            c.append(k[..., :L, :], h[..., :L, :], **rope)
            view = c.view()
            args_ = (q, k[..., L:, :], h[..., L:, :], view, n**-0.5)
            mb = c.nbytes() / 1e6
            ref = latent_attention(*args_)
            rows[(name, "torch reference")] = (median_us(latent_attention, *args_), mb)
            if tale_kernels.supported(q, k[..., L:, :], h[..., L:, :], view):
                out = tale_kernels.latent_attention(*args_)
                err = ((out - ref).norm() / ref.norm()).item()
                assert err < 5e-3, (name, err)
                rows[(name, "Triton kernel")] = (median_us(tale_kernels.latent_attention, *args_), mb)
                graph = torch.cuda.CUDAGraph()  # the launch as the decode step replays it: no host time
                with torch.cuda.graph(graph):
                    tale_kernels.latent_attention(*args_)
                rows[(name, "Triton kernel, CUDA graph")] = (median_us(graph.replay), mb)
        kk = k.repeat_interleave(H // K, 1)
        vv = torch.randn_like(kk)
        sdpa = median_us(torch.nn.functional.scaled_dot_product_attention, q, kk, vv)
        base = rows[("paper", "Triton kernel, CUDA graph")][0]
        for (name, path), (us, mb) in rows.items():
            print(f"| {L // 1024}K | {name} | {path} | {us:.1f} | {us / base:.2f}x | {mb:.1f} |")
        print(
            f"| {L // 1024}K | 16-bit | SDPA (repeated KV heads) | {sdpa:.1f} | {sdpa / base:.2f}x | "
            f"{2 * B * K * L * n * 2 / 1e6:.1f} |"
        )


if __name__ == "__main__":
    main()
