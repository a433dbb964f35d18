"""Schedule variants of one artifact on the test texts, as tale-eval's frontier measures them (1 x 1024 tokens,
prefill 128, chunk 8, bf16), with one extra knob tale-eval has no flag for: a key rank per layer at level 0
(`klayer=R0/R1/.../R29`, or `klayer=@FILE` naming a JSON list), made by giving each layer cache its own schedule.

    python experiments/tune_variants.py out/lr --text eb1911 --variants "-; key_rank=0/0/0,key_bits=16/4/8"

Prints one line per variant: measured ratio, ppl and delta against the full cache of the same run (or --ref PPL).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tale_eval import frontier, perplexity, policies
from tale_eval.attention import prepare
from tale_eval.measure import measure
from tale_runtime import load


@dataclass
class LayerKeyRanks(policies.Tale):
    """TALE with level 0's key rank set per layer (each layer cache gets a schedule copy)."""

    layer_ranks: list = field(default_factory=list)

    def label(self) -> str:
        return super().label() + f" klayer(mean {sum(self.layer_ranks) / len(self.layer_ranks):.1f})"

    def resolve(self, model):
        s = super().resolve(model)
        s = copy.deepcopy(s)
        s.levels[0].key_rank = max(self.layer_ranks)  # the validation sees the largest
        return s

    def build(self, model, pattern):
        cache = super().build(model, pattern)
        for layer, r in zip(cache.layers, self.layer_ranks):
            s = copy.deepcopy(layer.s)
            s.levels[0].key_rank = int(r)
            layer.s = s
        return cache


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--text", default="eb1911")
    ap.add_argument("--variants", default="-")
    ap.add_argument("--ref", default="", help="text=ppl,... of the full cache (skips its run)")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load(a.artifact, device="cpu", dtype=torch.bfloat16)
    prepare(model)
    texts = a.text.split(",")
    ids = {t: perplexity.heldout_windows(tok, a.ctx, 1, t) for t in texts}
    pols = []
    for part in a.variants.split(";"):
        kw, klayer = part.strip(), None
        if "klayer=" in kw:
            items = [x for x in kw.split(",") if not x.startswith("klayer=")]
            spec = next(x for x in kw.split(",") if x.startswith("klayer="))[len("klayer=") :]
            klayer = (
                json.loads(Path(spec[1:]).read_text()) if spec.startswith("@") else [int(x) for x in spec.split("/")]
            )
            kw = ",".join(items) or "-"
        ov = frontier.parse_variants(kw)[0]
        pols.append(policies.Tale(ov) if klayer is None else LayerKeyRanks(ov, layer_ranks=klayer))
    for p in pols:
        p.resolve(model)  # bad variants fail before any run
    ref = {}
    if a.ref:
        ref = {k: float(v) for k, v in (x.split("=") for x in a.ref.split(","))}
    else:
        r = measure(model, tok, policies.Full(), ids, a.prefill, a.chunk, [])
        ref = r["ppl"]
        print(f"full {json.dumps(ref)} {r['seconds']:.0f}s", flush=True)
    for p in pols:
        t0 = time.perf_counter()
        r = measure(model, tok, p, ids, a.prefill, a.chunk, [])
        d = " ".join(f"{t} {r['ppl'][t]:.3f} ({100 * (r['ppl'][t] / ref[t] - 1):+.2f}%)" for t in texts)
        line = f"{r['ratio']:.2f}x {d} | {p.label()} | {time.perf_counter() - t0:.0f}s"
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps({"label": p.label(), "ratio": r["ratio"], "ppl": r["ppl"], "ref": ref}) + "\n")


if __name__ == "__main__":
    main()
