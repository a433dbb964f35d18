"""Per layer, the decode-step attention output of TALE caches against the full cache on one RULER prompt: the prompt
is prefilled once with the full cache (each attention layer's inputs recorded, as tale-eval's shared prefill does),
each TALE cache is filled from those inputs, then every layer attends once from the full cache's first decode step's
own inputs, so each layer's error is its cache's alone (not carried from the layers below). Prints the relative
error per layer ('G': a global layer), the logits' relative error of one chained decode step, the measured ratio and
the greedy answer. VARIANTS as experiments/retrieval_layers.py ('@global' / '@sliding' too; no 'exact': write
`bits=16/16/16,key_rank=0/0/0,key_rope=post`).

    python experiments/decode_layer_error.py ARTIFACT DTYPE LENGTH FAMILY INDEX VARIANTS [NEW_TOKENS]
    python experiments/decode_layer_error.py out/gemma3-tale fp32 4k niah_single 0 "-;key_rank=0/0/0;key_rank=128/0/0"
"""

import sys
import time

import torch

from tale_eval import caches, frontier, retrieval
from tale_runtime import families, load, new_cache
from tale_runtime.model import cache_arg

torch.set_num_threads(1)
path, dtype, length, family, index, variants = sys.argv[1:7]
steps = int(sys.argv[7]) if len(sys.argv) > 7 else 12
model, tok = load(path, device="cpu", dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
spec, windows = model.tale_spec, families.sliding_windows(model)
L = spec.arch.num_layers
s = retrieval.make_sample(family, tok, retrieval.parse_length(length), int(index))
ids = tok(s["prompt"], return_tensors="pt").input_ids
print(f"{s['id']}: {ids.shape[1]} tokens, answers {s['answers']}", flush=True)


def make_cache(v):
    from tale_eval.policies import Tale

    body, _, where = v.partition("@")
    sched = Tale(frontier.parse_variants(body)[0]).resolve(model)
    if not where:
        return new_cache(model, sched)
    base, other = new_cache(model, spec.schedule), new_cache(model, sched)
    for i, w in enumerate(windows):
        if (w is None) == (where == "global"):
            base.layers[i] = other.layers[i]
    return base


def greedy(cache, first):
    out = [int(first)]
    for _ in range(steps - 1):
        out.append(int(model(torch.tensor([[out[-1]]]), **cache_arg(cache), use_cache=True).logits[0, -1].argmax()))
    return tok.decode(out, skip_special_tokens=True)


with torch.inference_mode():
    t0 = time.time()
    rec = retrieval._Recorder(model)
    full = caches.full_cache(L)
    nxt = model(ids, **cache_arg(full), use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
    rec.remove()
    calls, ins, outs, hooks = rec.calls, [], [], []
    for layer in model.model.layers:
        hooks.append(layer.self_attn.register_forward_pre_hook(lambda m, a, k: ins.append((a, k)), with_kwargs=True))
        hooks.append(layer.self_attn.register_forward_hook(lambda m, a, o: outs.append(o[0].float())))
    ref_logits = model(nxt, **cache_arg(full), use_cache=True).logits[0, -1].float()
    for h in hooks:
        h.remove()
    text = greedy(full, ref_logits.argmax()) if steps > 1 else ""
    text = tok.decode([int(nxt)]) + text
    print(f"full: {text!r} score {retrieval.score(text, s['answers']):.2f} ({time.time() - t0:.0f} s)", flush=True)
    for v in variants.split(";"):
        t0 = time.time()
        cache = make_cache(v.strip())
        retrieval.replay_prefill(model, cache, calls)
        errs = []
        for i, layer in enumerate(model.model.layers):
            a, k = ins[i]
            k = dict(k, past_key_values=cache) | ({"cache": cache} if "cache" in k else {})
            o = layer.self_attn(*a, **k)[0].float()
            errs.append(((o - outs[i]).norm() / outs[i].norm()).item())
        ratio = cache.baseline_nbytes() / cache.nbytes()
        cache = make_cache(v.strip())  # chained: a fresh cache, one decode step through every layer, then greedy
        retrieval.replay_prefill(model, cache, calls)
        logits = model(nxt, **cache_arg(cache), use_cache=True).logits[0, -1].float()
        lerr = ((logits - ref_logits).norm() / ref_logits.norm()).item()
        text = tok.decode([int(nxt)]) + (greedy(cache, logits.argmax()) if steps > 1 else "")
        per = " ".join(f"{e:.3f}" + ("G" if windows[i] is None else "") for i, e in enumerate(errs))
        print(f"[{v}] measured {ratio:.2f}x, logits rel. error {lerr:.3f} ({time.time() - t0:.0f} s)", flush=True)
        print(f"    attention output rel. error per layer: {per}", flush=True)
        print(f"    answer {text!r} score {retrieval.score(text, s['answers']):.2f}", flush=True)
