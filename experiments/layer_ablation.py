"""Decode-mode perplexity (float32, 1 x 1024 tokens, prefill 128, chunk 8) with a lossy schedule on some layers only,
the others at the exact setting: which layers cost the loss. SETS: comma list of none, all, global, sliding, first6,
mid6, last6, early (layers 0-1), rest (2-17).

    python experiments/layer_ablation.py ARTIFACT TEXT "bits=16/16,key_bits=16/16" global,sliding
"""

import math
import sys
import time
from dataclasses import replace

import torch

from tale_eval.frontier import parse_variants
from tale_eval.perplexity import decode_nll, heldout_windows
from tale_eval.policies import Tale
from tale_runtime import load, new_cache

torch.set_num_threads(1)
model, tok = load(sys.argv[1], device="cpu", dtype=torch.float32)
text = sys.argv[2]
lossy = Tale(parse_variants(sys.argv[3])[0]).resolve(model)
R = model.tale_spec.arch.latent_rank
ex = replace(
    lossy,
    levels=[replace(lv, bits=16, key_bits=16) for lv in lossy.levels],
    ranks=[[R] * len(lossy.levels) for _ in lossy.ranks],
)
types = model.config.layer_types
L = len(types)
sets = {
    "none": [],
    "all": list(range(L)),
    "global": [i for i in range(L) if types[i] == "full_attention"],
    "sliding": [i for i in range(L) if types[i] != "full_attention"],
    "first6": list(range(6)),
    "early": [0, 1],
    "rest": list(range(2, 18)),
    "mid6": list(range(6, 12)),
    "last6": list(range(12, 18)),
}
ids = heldout_windows(tok, 1024, 1, text)
for name in sys.argv[4].split(","):
    t0 = time.time()
    cache = new_cache(model, ex)
    for i in sets[name]:  # these layers lossy
        layer = cache.layers[i]
        layer.s = lossy
        layer.reset()
    nll, n = decode_nll(model, ids, cache, 128, 8)
    print(f"{text} lossy on {name}: ppl {math.exp(nll / n):.3f} ({time.time() - t0:.0f} s)", flush=True)
