"""Where a schedule's cache error enters attention, per layer: keys against latents, Gemma 3 270M against SmolLM2.

Captures the exact post-RoPE queries, keys and latents of one test window (1 x CTX tokens of botchan) through the
runtime, then per layer quantizes the middle tokens (after the 4 sinks, in whole groups of 32) the way a cache level
would: keys per channel over 32 tokens, latents per token over 32 channels after the rank cut, and reports for the
queries after the prefill (position 128 on), under the layer's own sliding window:

- `logit`: RMS of the attention-logit error q . (k' - k) * scaling (keys quantized at 2 or 4 bits, and at 2 bits after
  a Hadamard rotation of q and k, schedule.rotate), and `spread`: the RMS of the logits around their per-query mean
  (what that error is measured against);
- `out`: relative error of the attention output (through O^r) with only the keys, only the latents, or both
  quantized: which part of the cache costs what, layer by layer.

    python experiments/key_error_screen.py ARTIFACT [--ctx 1024] [--threads 1]

A screen, not a result: decode-mode perplexity (tale-eval) decides.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from tale_calib import documents, text_path
from tale_runtime import load, new_cache
from tale_runtime.artifact import Level, Schedule
from tale_runtime.backends import TORCH, AttentionBackend
from tale_runtime.model import cache_arg, hadamard
from tale_runtime.quant import quantize

SINKS, START = 4, 128


def capture(model, ids: torch.Tensor) -> list[tuple]:
    """(q [H, T-1, n] of positions 1.., k [K, T, n], h [G, T, R]) per layer, exact, post-RoPE, float32."""
    got = []

    @dataclass(frozen=True)
    class Grab(AttentionBackend):
        name: str = "grab"
        label: str = "torch reference"

        def __call__(self, q, k, h, view, scaling, window=None):
            got.append((q[0].float(), k[0].float(), h[0].float()))
            return TORCH.run(q, k, h, view, scaling, window)

    R = model.tale_spec.arch.latent_rank
    L = model.tale_spec.arch.num_layers
    exact = Schedule(sinks=1, levels=[Level(16, 16, None)], ranks=[[R]] * L, key_group=1, value_group=1, residual=1)
    cache = new_cache(model, exact, backend=Grab())
    with torch.inference_mode():
        model(ids[:, :1], **cache_arg(cache))
        model(ids[:, 1:], **cache_arg(cache))
    return [
        (q, torch.cat([lc.sink_k[0].float(), k], 1), torch.cat([lc.sink_h[0].float(), h], 1))
        for (q, k, h), lc in zip(got, cache.layers)
    ]


def fq(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Quantize-dequantize in bf16 as the cache stores it, groups of 32 along `dim`."""
    return x if bits == 16 else quantize(x.to(torch.bfloat16), bits, 32, dim).dequantize(torch.float32)


def middle(k: torch.Tensor, h: torch.Tensor, key_bits: int, bits: int, rank: int):
    """k, h with the middle tokens (after the sinks, whole groups of 32) as a cache level holds them."""
    T = k.shape[1]
    sl = slice(SINKS, SINKS + (T - SINKS) // 32 * 32)
    k2, h2 = k.clone(), h.clone()
    k2[:, sl] = fq(k[:, sl].contiguous(), key_bits, -2)
    h2[:, sl] = 0
    h2[:, sl, :rank] = fq(h[:, sl, :rank].contiguous(), bits, -1)
    return k2, h2


def attention(q, k, h, o_fused, scaling, window):
    """Output [T', d] and logits [K, rep, T', T] of queries at positions 1.. (from START) over keys 0..T-1."""
    H, Tq, n = q.shape
    K, T = k.shape[:2]
    G = h.shape[0]
    rep = H // K
    logits = torch.einsum("kitn,kln->kitl", q.view(K, rep, Tq, n), k) * scaling
    qpos, kpos = torch.arange(1, T)[:, None], torch.arange(T)[None]
    see = kpos <= qpos
    if window is not None:
        see &= qpos - kpos < window
    logits = logits.masked_fill(~see, float("-inf"))[:, :, START:]
    p = logits.softmax(-1).reshape(G, H // G, Tq - START, T)
    z = torch.einsum("cqtl,clr->tcqr", p, h).reshape(Tq - START, -1)
    return z @ o_fused.float().T, logits, see[START:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load(args.artifact, device="cpu", dtype=torch.float32)
    body = "\n\n".join(documents(text_path("botchan")))
    ids = torch.tensor(tok(body, add_special_tokens=False).input_ids)[: args.ctx][None]
    layers = capture(model, ids)
    R = model.tale_spec.arch.latent_rank
    r0 = model.tale_spec.schedule.ranks[0][0]
    print(f"{args.artifact}: R {R}, paper middle: keys 2 bits, latents rank {r0} at 2 bits; botchan 1 x {args.ctx}")
    print(
        "layer window |q| |k|  spread logit(k2) logit(k4) logit(k2 hadamard) | out: k2 k4 lat(r0,2b) lat(R,2b) "
        "lat(r0,16b) both"
    )
    for i, (q, k, h) in enumerate(layers):
        attn = model.model.layers[i].self_attn
        win, sc, o = attn.sliding_window, attn.scaling, attn.tale.o_fused
        ref, lg, see = attention(q, k, h, o, sc, win)
        m = see.expand_as(lg)
        centred = (lg - lg.masked_fill(~m, 0).sum(-1, keepdim=True) / m.sum(-1, keepdim=True)).masked_fill(~m, 0)
        spread = (centred.pow(2).sum() / m.sum()).sqrt().item()
        row = [f"{i:5d} {str(win):6s} {q.norm(dim=-1).mean():5.1f} {k.norm(dim=-1).mean():5.1f} {spread:6.2f}"]
        for kb in (2, 4):
            k2, _ = middle(k, h, kb, 16, R)
            _, lg2, _ = attention(q, k2, h, o, sc, win)
            row.append(f"{((lg2 - lg).masked_fill(~m, 0).pow(2).sum() / m.sum()).sqrt().item():9.3f}")
        Qh = hadamard(k.shape[-1], k.device, torch.float32)  # schedule.rotate "hadamard": q Q . k Q = q . k
        k2, _ = middle(k @ Qh, h, 2, 16, R)
        _, lg2, _ = attention(q @ Qh, k2, h, o, sc, win)
        row.append(f"{((lg2 - lg).masked_fill(~m, 0).pow(2).sum() / m.sum()).sqrt().item():9.3f}")
        outs = []
        for kb, vb, r in ((2, 16, R), (4, 16, R), (16, 2, r0), (16, 2, R), (16, 16, r0), (2, 2, r0)):
            k2, h2 = middle(k, h, kb, vb, r)
            got = attention(q, k2, h2, o, sc, win)[0]
            outs.append(f"{((got - ref).norm() / ref.norm()).item():.3f}")
        print(" ".join(row) + " | " + " ".join(outs))


if __name__ == "__main__":
    main()
