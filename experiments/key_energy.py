"""Per-layer key energy on the artifact's key basis, and key ranks per layer chosen from it at a fixed total.

On windows of the calibration corpus (never the test texts), each layer's pre-RoPE keys are encoded on all of its
key basis directions (weighted by the queries' second moments, so a coefficient's energy is its share of the logits'
variance); the energy a rank r drops is the sum past r. Two rules at the same total rank as a uniform RANK:
  greedy   the next 8 directions go to the layer whose next 8 hold the most energy (least total dropped energy)
  relative the layers keep the same fraction of their own energy (bisection on the fraction)

    python experiments/key_energy.py out/lr --rank 80 --out out/klayer
writes out/klayer-greedy.json and out/klayer-relative.json (lists of 30 ranks) and prints the spectra's summary.
"""

from __future__ import annotations

import argparse
import json

import torch

from tale_convert.stats import calibration_batches, pre_rope
from tale_runtime import load


@torch.inference_mode()
def spectra(model, tok, count: int) -> torch.Tensor:
    """[layers, C] mean squared coefficient per basis direction (most important first)."""
    bases = model.tale_spec.key_basis
    attns = [layer.self_attn for layer in model.model.layers]
    acc = [torch.zeros(b.directions, dtype=torch.float64) for b in bases]
    n = [0]
    hooks = []
    for i, attn in enumerate(attns):

        def pre(mod, args, kwargs, i=i, attn=attn):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            _, k = pre_rope(attn, x)  # [B, T, K, n]
            c = bases[i].encode(k[:, 4:].float().transpose(1, 2), bases[i].directions)  # [B, 1, T, C]
            acc[i] += c.double().pow(2).sum((0, 1, 2))
            if i == 0:
                n[0] += c.shape[0] * c.shape[2]

        hooks.append(attn.register_forward_pre_hook(pre, with_kwargs=True))
    for b in calibration_batches(tok, count=count, length=512, batch=2):
        model(b, use_cache=False)
    for h in hooks:
        h.remove()
    return torch.stack(acc) / n[0]


def greedy(e: torch.Tensor, total: int, step: int = 8, lo: int = 8) -> list[int]:
    L, C = e.shape
    r = [lo] * L
    blocks = e.view(L, C // step, step).sum(-1)  # energy of each block of `step` directions
    while sum(r) < total:
        gain = torch.tensor([blocks[i, r[i] // step].item() if r[i] < C else -1.0 for i in range(L)])
        r[int(gain.argmax())] += step
    return r


def relative(e: torch.Tensor, total: int, step: int = 8, lo: int = 8) -> list[int]:
    L, C = e.shape
    frac = e.cumsum(-1) / e.sum(-1, keepdim=True)

    def ranks(f: float) -> list[int]:
        out = []
        for i in range(L):
            r = int((frac[i] < f).sum().item()) + 1
            out.append(min(C, max(lo, -(-r // step) * step)))
        return out

    a, b = 0.0, 1.0
    for _ in range(60):
        m = (a + b) / 2
        if sum(ranks(m)) <= total:
            a = m
        else:
            b = m
    r = ranks(a)
    # spend what is left on the layers with the most energy in their next block
    blocks = e.view(L, C // step, step).sum(-1)
    while sum(r) + step <= total:
        gain = torch.tensor([blocks[i, r[i] // step].item() if r[i] < C else -1.0 for i in range(L)])
        r[int(gain.argmax())] += step
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--rank", type=int, default=80)
    ap.add_argument("--count", type=int, default=4)
    ap.add_argument("--out", default="out/klayer")
    a = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load(a.artifact, device="cpu", dtype=torch.float32)
    e = spectra(model, tok, a.count)
    torch.save(e, a.out + "-spectra.pt")
    L = e.shape[0]
    tot = e.sum(-1)
    drop = e[:, a.rank :].sum(-1)
    for i in range(L):
        print(f"layer {i:2d}: energy {tot[i]:.3e}, dropped at {a.rank}: {drop[i]:.3e} ({100 * drop[i] / tot[i]:.1f}%)")
    for name, rule in (("greedy", greedy), ("relative", relative)):
        r = rule(e, a.rank * L)
        d = sum(e[i, r[i] :].sum().item() for i in range(L))
        print(f"{name}: {r} (sum {sum(r)}), dropped {d:.3e} against uniform {drop.sum():.3e}")
        with open(f"{a.out}-{name}.json", "w") as f:
            json.dump(r, f)


if __name__ == "__main__":
    main()
