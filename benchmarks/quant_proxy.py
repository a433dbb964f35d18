"""Fast proxy for choosing cache formats: per-layer attention-output error of quantized keys/latents.

Captures exact post-RoPE q, k and latents h of one held-out (dev) window through the runtime, then,
per layer and format, quantizes every non-sink token's key and latent the way a cache level would,
runs causal attention in latent space, maps it through O^r and reports the relative error of the
attention output (queries after `--from`) against the exact one. Seconds per format instead of
minutes per tale-eval run; use it to rank formats, then confirm the winners with tale-eval.

    python benchmarks/quant_proxy.py out/smollm2-tale --threads 1
"""

from __future__ import annotations

import argparse

import torch

from tale_runtime import load, new_cache
from tale_runtime.artifact import Level, Schedule
from tale_runtime.model import hadamard
from tale_runtime.quant import quantize


def capture(model, ids: torch.Tensor) -> list[tuple]:
    """(q [H,T,n], k [K,T,n], h [G,T,R]) per layer, exact, post-RoPE."""
    got = []

    def grab(q, k, h, layer, scaling):
        got.append((q[0].float(), k[0].float(), h[0].float()))
        from tale_runtime.cache import latent_attention

        return latent_attention(q, k, h, layer, scaling)

    for layer in model.model.layers:
        layer.self_attn.attention_fn = grab
    sched = model.tale_schedule
    exact = Schedule(
        sinks=1,
        levels=[Level(16, 16, None)],
        ranks=[[sched.ranks[0][-1]]] * len(sched.ranks),
        key_group=1,
        value_group=1,
        residual=1,
    )
    cache = new_cache(model, exact)
    with torch.inference_mode():
        model(ids[:, :1], past_key_values=cache)
        model(ids[:, 1:], past_key_values=cache)
    # prepend the first token's k and h from the cache sinks
    out = []
    for (q, k, h), lc in zip(got, cache.layers):
        out.append((q, torch.cat([lc.sink_k[0].float(), k], 1), torch.cat([lc.sink_h[0].float(), h], 1)))
    return out


def fq(x: torch.Tensor, bits: int, group: int, dim: int, meta: str) -> tuple[torch.Tensor, float]:
    """Quantize-dequantize [.., T, C]; returns (x', bits per number incl. scales/zeros)."""
    if bits == 16:
        return x, 16.0
    q = quantize(x.to(torch.bfloat16), bits, group, dim, meta)
    return q.dequantize(torch.float32), q.nbytes() * 8 / x.numel()


def attn_out(q, k, h, o_fused, scaling, g, sink, start):
    H, T, n = q.shape  # queries are positions 1 .. T of the T + 1 keys
    K = k.shape[0]
    rep = H // K
    logits = torch.einsum("kitn,kln->kitl", q.view(K, rep, T, n), k) * scaling
    mask = torch.ones(T, T + 1, dtype=torch.bool).tril(diagonal=1)
    logits = logits.masked_fill(~mask, float("-inf"))[..., start:, :]
    p = logits.softmax(-1).reshape(K // g, g * rep, T - start, T + 1)
    z = torch.einsum("cqtl,clr->tcqr", p, h).reshape(T - start, -1)  # [T', H*R]
    return z @ o_fused.float().T


def run_format(layers, model, fmt: dict, sink=4, start=128):
    errs, kb, vb = [], [], []
    for li, (q, k, h) in enumerate(layers):
        attn = model.model.layers[li].self_attn
        g, n = attn.g, attn.head_dim
        if fmt.get("rotate"):
            Q = hadamard(n, q.device, torch.float32)
            q, k = q @ Q, k @ Q
        r = fmt.get("rank", h.shape[-1])
        kk, hh = k.clone(), h.clone()
        T = k.shape[1]
        m = (T - sink) // 32 * 32
        sl = slice(sink, sink + m)
        if fmt["kaxis"] == "band":  # per-channel keys, bits per channel by importance E[q_c^2] * range_c^2
            kq = k[:, sl].clone()
            tot = 0.0
            for kh in range(k.shape[0]):
                rep = q.shape[0] // k.shape[0]
                qi = q[kh * rep : (kh + 1) * rep].pow(2).mean((0, 1))  # [n]
                kg = k[kh, sl].view(-1, 32, k.shape[-1])
                rng = (kg.amax(1) - kg.amin(1)).pow(2).mean(0)
                w = qi * rng
                b = torch.full((k.shape[-1],), fmt["bmin"])
                budget = int(fmt["kbits"] * k.shape[-1]) - int(b.sum())
                for _ in range(budget):  # greedy: the bit that removes the most error
                    gain = w / (2.0**b - 1).pow(2) - w / (2.0 ** (b + 1) - 1).pow(2)
                    gain[b >= fmt["bmax"]] = -1
                    b[gain.argmax()] += 1
                for bits in b.unique().tolist():
                    ch = (b == bits).nonzero().flatten()
                    xs = k[kh : kh + 1, sl][..., ch]
                    pad = (-len(ch)) % 8
                    xs = torch.nn.functional.pad(xs, (0, pad))
                    xq, _ = fq(xs.contiguous(), int(bits), 32, -2, fmt.get("kmeta", "16"))
                    kq[kh : kh + 1, :, ch] = xq[..., : len(ch)]
                    tot += (bits + {"16": 32, "8/16": 24, "8/8": 16}[fmt.get("kmeta", "16")] / 32) * len(ch)
            kbits = tot / (k.shape[0] * k.shape[-1])
        elif fmt["kaxis"] == "channel":
            kq, kbits = fq(k[:, sl], fmt["kbits"], 32, -2, fmt.get("kmeta", "16"))
        else:
            kq, kbits = fq(k[:, sl], fmt["kbits"], fmt.get("kcg", 64), -1, fmt.get("kmeta", "16"))
        kk[:, sl] = kq
        d = torch.ones(r)
        if "balance" in fmt:  # latents h = x A S^(a-1/2) (B = S^(1-a) V^T): channel variances s_i^(2a)
            sv = attn.tale.v_v.float().pow(2).sum(-1)[0, :r]  # whitened singular values s_i
            d = sv.pow(fmt["balance"] - 0.5)
        hq, vbits = fq((h[:, sl, :r] * d).contiguous(), fmt["vbits"], 32, -1, fmt.get("vmeta", "16"))
        hq = hq / d
        hh[:, sl] = 0
        hh[:, sl, :r] = hq
        ref = attn_out(q, k, h, attn.tale.o_fused, attn.scaling, g, sink, start)
        got = attn_out(q, kk, hh, attn.tale.o_fused, attn.scaling, g, sink, start)
        errs.append(((got - ref).norm() / ref.norm()).item())
        kb.append(kbits)
        vb.append(vbits * r / h.shape[-1])
    return errs, sum(kb) / len(kb), sum(vb) / len(vb)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--window", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tale_eval.perplexity import heldout_windows

    model, tok = load(args.artifact, device="cpu", dtype=torch.bfloat16)
    ids = heldout_windows(tok, args.ctx, args.window + 1)[args.window :]
    import os

    cached = f"/tmp/quant_proxy_{args.window}_{args.ctx}.pt"
    if os.path.exists(cached):
        layers = torch.load(cached)
    else:
        layers = capture(model, ids)
        torch.save(layers, cached)
    fmts = {
        "k2c v16": dict(kaxis="channel", kbits=2, vbits=16),
        "k3c v16": dict(kaxis="channel", kbits=3, vbits=16),
        "band 2.0 [1,4] v16": dict(kaxis="band", kbits=2.0, bmin=1, bmax=4, vbits=16),
        "band 2.5 [1,4] v16": dict(kaxis="band", kbits=2.5, bmin=1, bmax=4, vbits=16),
        "band 2.5 [2,4] v16": dict(kaxis="band", kbits=2.5, bmin=2, bmax=4, vbits=16),
        "band 3.0 [2,4] v16": dict(kaxis="band", kbits=3.0, bmin=2, bmax=4, vbits=16),
        "band 2.0 [1,4] 8/16 v16": dict(kaxis="band", kbits=2.0, bmin=1, bmax=4, vbits=16, kmeta="8/16"),
        "k16 v2 r96": dict(kaxis="channel", kbits=16, vbits=2, rank=96),
        "k16 v4 r64": dict(kaxis="channel", kbits=16, vbits=4, rank=64),
        "k16 v3 r64": dict(kaxis="channel", kbits=16, vbits=3, rank=64),
        "k16 v2 r128": dict(kaxis="channel", kbits=16, vbits=2, rank=128),
        "k16 v4 r32": dict(kaxis="channel", kbits=16, vbits=4, rank=32),
        "k16 v2 r192": dict(kaxis="channel", kbits=16, vbits=2),
    }
    print(f"{'format':24s} {'mean err':>8s} {'max err':>8s} {'key b/num':>9s} {'lat b/num(R)':>12s}  per layer")
    for name, f in fmts.items():
        errs, kb, vb = run_format(layers, model, f)
        print(
            f"{name:24s} {sum(errs) / len(errs):8.4f} {max(errs):8.4f} {kb:9.2f} {vb:12.2f}  "
            + " ".join(f"{e:.2f}" for e in errs)
        )


if __name__ == "__main__":
    main()
