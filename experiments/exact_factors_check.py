"""The exact setting (16-bit, full rank) in float32: decode logits (prefill 128, chunks of 8, as tale-eval) against the
base model's forward pass over 1 x 1024 tokens of botchan, per span of positions (a wrong sliding window shows past
position 512). MODE `artifact`: the artifact's factors as stored (bf16: A B is not W_V exactly); `identity`: u_v =
W_V^T, v_v = I, O^r = W_O (one KV head per group: the same math with exact factors), which isolates the runtime.

    python experiments/exact_factors_check.py ARTIFACT MODE
"""

import sys
from dataclasses import replace

import torch
import torch.nn.functional as F

from tale_calib import documents, text_path
from tale_runtime import load, new_cache
from tale_runtime.model import cache_arg

torch.set_num_threads(1)
mode = sys.argv[2]
model, tok = load(sys.argv[1], device="cpu", dtype=torch.float32)
a = model.tale_spec.arch
if mode == "identity":
    for layer in model.model.layers:
        at = layer.self_attn
        at.tale.u_v.data = at.v_proj.weight.data.T[None].clone()
        at.tale.v_v.data = torch.eye(a.latent_rank)[None].clone()
        at.tale.o_fused.data = at.o_proj.weight.data.clone()
body = "\n\n".join(documents(text_path("botchan")))
ids = torch.tensor(tok(body, add_special_tokens=False).input_ids)[:1024][None]
s = model.tale_spec.schedule
ex = replace(
    s,
    levels=[replace(lv, bits=16, key_bits=16) for lv in s.levels],
    ranks=[[a.latent_rank] * len(s.levels) for _ in s.ranks],
)
with torch.inference_mode():
    ref = model(ids, use_cache=False).logits[0].double()
    cache = new_cache(model, ex)
    outs = [model(ids[:, :128], **cache_arg(cache)).logits[0, -1:]]
    for t in range(128, 1023, 8):
        outs.append(model(ids[:, t : t + 8], **cache_arg(cache)).logits[0])
got = torch.cat(outs)[: 1024 - 127].double()
r = ref[127:]
for lo, hi in ((0, 100), (100, 385), (385, 500), (500, 700), (700, 897)):
    d = (got[lo:hi] - r[lo:hi]).norm() / r[lo:hi].norm()
    print(f"{mode} positions {lo + 127}-{hi + 127}: rel err {d:.2e}")
tg = ids[0, 128:]
print(mode, "nll ref", F.cross_entropy(r[: len(tg)], tg).item(), "tale", F.cross_entropy(got[: len(tg)], tg).item())
