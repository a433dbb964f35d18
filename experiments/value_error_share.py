"""Per layer on 1 x 1024 tokens of botchan (float32): the relative error of the values x A_r B_r against x A B at
r = R/2 and 7R/8 (the latents' rank cut on test text), and the attention block's share of the residual stream: the
mean over tokens of |what the block adds| / |the residual it is added to| (Gemma 3: after its post-attention norm).

    python experiments/value_error_share.py ARTIFACT
"""

import sys

import torch

from tale_calib import documents, text_path
from tale_runtime import load

torch.set_num_threads(1)
model, tok = load(sys.argv[1], device="cpu", dtype=torch.float32)
body = "\n\n".join(documents(text_path("botchan")))
ids = torch.tensor(tok(body, add_special_tokens=False).input_ids)[:1024][None]
got = {}
hooks = []
gemma = hasattr(model.model.layers[0], "post_attention_layernorm") and hasattr(
    model.model.layers[0], "pre_feedforward_layernorm"
)
for i, layer in enumerate(model.model.layers):
    at = layer.self_attn
    hooks.append(
        layer.register_forward_pre_hook(
            lambda m, a, kw, i=i: got.__setitem__(("res", i), (a[0] if a else kw["hidden_states"]).detach()),
            with_kwargs=True,
        )
    )
    hooks.append(
        at.register_forward_pre_hook(
            lambda m, a, kw, i=i: got.__setitem__(("x", i), (a[0] if a else kw["hidden_states"]).detach()),
            with_kwargs=True,
        )
    )
    mod = layer.post_attention_layernorm if gemma else at
    hooks.append(
        mod.register_forward_hook(
            lambda m, a, out, i=i: got.__setitem__(("add", i), (out[0] if isinstance(out, tuple) else out).detach())
        )
    )
with torch.inference_mode():
    model(ids, use_cache=False)
print(sys.argv[1])
print("layer  val-err r/2  val-err 7r/8  attn share")
for i, layer in enumerate(model.model.layers):
    at = layer.self_attn
    t = at.tale
    x = got[("x", i)][0, 4:]
    R = t.u_v.shape[-1]
    h = torch.einsum("td,cdr->ctr", x, t.u_v.float())
    v = torch.einsum("ctr,crs->cts", h, t.v_v.float())
    errs = []
    for r in (R // 2, 7 * R // 8):
        vr = torch.einsum("ctr,crs->cts", h[..., :r], t.v_v.float()[:, :r])
        errs.append(((vr - v).norm() / v.norm()).item())
    add, res = got[("add", i)][0, 4:], got[("res", i)][0, 4:]
    share = (add.norm(dim=-1) / res.norm(dim=-1)).mean().item()
    print(f"{i:5d} {errs[0]:10.3f} {errs[1]:12.3f} {share:11.3f}")
