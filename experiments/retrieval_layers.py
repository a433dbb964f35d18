"""RULER retrieval at one length through tale-eval's own functions (retrieval.make_samples and retrieval.run: one
exact prefill per prompt shared by every row), the full cache against TALE schedule variants, with a variant
optionally on some layers only (tale-eval has no per-layer knob). VARIANTS: ';'-separated, in --tale-variants
syntax ('-': the artifact's schedule; 'exact': tale-exact), each optionally suffixed '@global' or '@sliding': the
override on those layers, the artifact's schedule on the others. Prints score, retention against the full cache and
the measured ratio (against what transformers' cache holds, as tale-eval counts it) per row, and each answer.

    python experiments/retrieval_layers.py ARTIFACT DTYPE LENGTH SAMPLES FAMILIES VARIANTS [JSON]
    python experiments/retrieval_layers.py out/gemma3-tale bf16 4k 3 niah_single "-;exact;key_rank=0/0/0@global"
"""

import json
import sys
from dataclasses import dataclass

import torch

from tale_eval import frontier, policies, retrieval
from tale_runtime import families, load, new_cache

torch.set_num_threads(1)
path, dtype, length, n, fams, variants = sys.argv[1:7]
out = sys.argv[7] if len(sys.argv) > 7 else None


@dataclass
class OnLayers(policies.Tale):
    """The override on the global (window None) or the sliding layers only; the artifact's schedule elsewhere."""

    where: str = "global"

    def build(self, model, pattern):
        base = new_cache(model, model.tale_spec.schedule)
        # the other cache's layers of one type share its RoPE tables among themselves (every such layer is swapped)
        other = new_cache(model, self.resolve(model))
        for i, w in enumerate(families.sliding_windows(model)):
            if (w is None) == (self.where == "global"):
                base.layers[i] = other.layers[i]
        return base


model, tok = load(path, device="cpu", dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
pols, names = [policies.Full()], ["full"]
for v in variants.split(";"):
    v = v.strip()
    body, _, where = v.partition("@")
    if where not in ("", "global", "sliding"):
        raise SystemExit(f"bad layer set {where!r}: use @global or @sliding")
    if body == "exact":
        pols.append(policies.ExactTale())
    elif where:
        pols.append(OnLayers(frontier.parse_variants(body)[0], where=where))
    else:
        pols.append(policies.Tale(frontier.parse_variants(body)[0]))
    names.append(v)
samples = retrieval.make_samples(tok, (retrieval.parse_length(length),), tuple(fams.split(",")), int(n))
res = retrieval.run(model, tok, samples, pols, log=lambda s: print(s, flush=True))
rows = []
for name, r in zip(names, res):
    kept = r["score"] / res[0]["score"] if res[0]["score"] else float("nan")
    print(f"{name:45s} score {100 * r['score']:5.1f}  retention {100 * kept:4.0f}%  ratio {r['ratio']:.2f}x")
    for a in r["answers"]:
        print(f"    {a['id']}: {a['output']!r} {a['score']:.2f}")
    rows.append(dict(variant=name, score=r["score"], tasks=r["tasks"], ratio=r["ratio"], answers=r["answers"]))
if out:
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)
