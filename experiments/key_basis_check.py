"""Whether an artifact's key basis fits long prompts: per layer, the truncation error of one RULER prompt's pre-RoPE
keys at the given key ranks (RMS weighted by that prompt's own query second moments, pair-averaged as the basis is
fitted), with the artifact's basis and with one refitted from a plain forward pass of the loaded model on 16
calibration windows of 512 tokens (tale_convert.stats.key_moments; the converter streams the same statistics layer by
layer), and the relative difference of the two key means. Equal columns: the conversion's statistics are right;
small errors: the prompt's keys lie where the calibration keys did.

    python experiments/key_basis_check.py ARTIFACT LENGTH FAMILY INDEX RANKS
    python experiments/key_basis_check.py out/gemma3-tale 4k niah_single 0 72,128
"""

import sys

import torch

from tale_convert import stats
from tale_eval import retrieval
from tale_runtime import families, key_basis, load

torch.set_num_threads(1)
path, length, family, index, ranks = sys.argv[1:6]
ranks = [int(r) for r in ranks.split(",")]
model, tok = load(path, device="cpu", dtype=torch.float32)
spec, windows = model.tale_spec, families.sliding_windows(model)
s = retrieval.make_sample(family, tok, retrieval.parse_length(length), int(index))
ids = tok(s["prompt"], return_tensors="pt").input_ids

with torch.inference_mode():
    moments = stats.key_moments(model, stats.calibration_batches(tok, count=8, length=512, batch=2))
    keys, queries, hooks = {}, {}, []
    for i, layer in enumerate(model.model.layers):

        def pre(mod, args, kwargs, i=i):
            q, k = stats.pre_rope(mod, kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])
            keys[i], queries[i] = k[0, spec.schedule.sinks :].flatten(1).double(), q[0, spec.schedule.sinks :].double()

        hooks.append(layer.self_attn.register_forward_pre_hook(pre, with_kwargs=True))
    model(ids, logits_to_keep=1)
    for h in hooks:
        h.remove()

print(f"{s['id']}: {ids.shape[1]} tokens; key truncation error (query-weighted RMS) at key_rank {ranks}")
for i, art in enumerate(spec.key_basis):
    m2, mean, q2 = moments[i]
    K, n, Kb = art.heads, art.head_dim, art.blocks
    enc, dec = key_basis.fit(m2, mean, key_basis.pair_mean(q2, K, n), Kb)
    q = queries[i]
    w = key_basis.pair_mean(q.pow(2).view(len(q), K, -1, n).mean(2).mean(0).flatten(), K, n)
    k = keys[i]
    cells = []
    for name, E, D, mu in (("artifact", art.enc, art.dec, art.mean), ("refit", enc, dec, mean)):
        E, D, mu = E.double(), D.double(), mu.double()
        x = (k - mu).view(len(k), Kb, -1)
        for r in ranks:
            kr = mu + torch.einsum("tjr,jrn->tjn", torch.einsum("tjn,jnr->tjr", x, E[:, :, :r]), D[:, :r]).flatten(1)
            err = ((((kr - k) ** 2) * w).sum() / ((k**2) * w).sum()).sqrt()
            cells.append(f"{name}@{r} {err.item():.3f}")
    dm = (art.mean.double() - mean.double()).norm() / mean.double().norm()
    print(f"layer {i:2d}{'G' if windows[i] is None else ' '} " + "  ".join(cells) + f"  mean diff {dm.item():.3f}")
