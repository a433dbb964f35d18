"""Post-RoPE queries, keys and values of every attention layer over a few token windows (full attention, no cache):
the offline data of LESS's kernels and of TailorKV's layer scores."""

from __future__ import annotations

import weakref

import torch

from .attention import EvalAttention

_LAST: dict = {}  # the latest capture: LESS and TailorKV read the same calibration windows in one run


@torch.no_grad()  # not inference_mode: LESS trains on these tensors
def qkv(model, batches: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer (q [N, H, T, n], k [N, K, T, n], v [N, K, T, n]) float32 over the windows of `batches` ([B, T] ids,
    N = their rows in all), from a model prepared by attention.prepare. A new list (the tensors are shared with the
    next call on the same model and ids)."""
    key = (str(model.dtype), tuple(tuple(b.flatten().tolist()) for b in batches))
    same = _LAST.get("model") is not None and _LAST["model"]() is model  # a weak reference: ids are reused
    if not same or _LAST.get("key") != key:
        _LAST.clear()
        _LAST.update(model=weakref.ref(model), key=key, data=_qkv(model, batches))
    return list(_LAST["data"])


def _qkv(model, batches: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    layers = [layer.self_attn for layer in model.model.layers]
    if not all(isinstance(a, EvalAttention) for a in layers):
        raise TypeError("capture.qkv needs a model prepared by tale_eval.attention.prepare")
    got: list[list[tuple[torch.Tensor, ...]]] = [[] for _ in layers]
    hooks = []

    def hook(i):
        def pre(mod, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            pe = kwargs.get("position_embeddings") or args[1]
            t = mod.tale
            q, k = t.qk(x, *pe)
            B, T, _ = x.shape
            v = t.v_proj(x).view(B, T, -1, t.head_dim).transpose(1, 2)
            got[i].append((q.float(), k.float(), v.float()))

        return pre

    try:
        for i, a in enumerate(layers):
            hooks.append(a.register_forward_pre_hook(hook(i), with_kwargs=True))
        for ids in batches:
            model(ids.to(model.device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [tuple(torch.cat(parts, dim=0) for parts in zip(*per)) for per in got]
