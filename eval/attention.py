"""One model for every cache policy: a TALE model whose attention layers also run as the base model's.

EvalAttention wraps a runtime TaleAttention, which already runs TALE over a TALE cache and the base model's attention
over any other cache (or none: the cache stores what its policy stores). With a PaluCache the values are eager low
rank: v = (x A_r) B_r also in the forward pass, and the cache holds the rank-r latents. A cache layer with an
`attend(q, k, v)` method (LESS, TailorKV's offloaded layers) computes its layer's attention itself.
"""

from __future__ import annotations

from torch import nn

from tale_runtime.model import TaleAttention

from .caches import CountedCache, PaluCache


class EvalAttention(nn.Module):
    def __init__(self, tale: TaleAttention):
        super().__init__()
        self.tale = tale
        self.v_proj = tale.v_proj  # the original W_V, where tale_convert.rank_policy's Fisher scores look for it
        self.qkv_proj = tale.qkv_proj  # Phi-3's fused projection holds it instead

    @property
    def sliding_window(self):
        """The wrapped layer's window (families.layer_window reads it: without it every layer of Gemma 3 would take
        the config's window, and the ratios' reference would hold only a window of its global layers)."""
        return self.tale.sliding_window

    def forward(
        self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, cache=None, **kwargs
    ):
        cache = cache if cache is not None else past_key_values  # transformers >= 5.24 passes `cache`
        t = self.tale
        layer = cache.layers[t.layer_idx] if isinstance(cache, CountedCache) else None
        if hasattr(layer, "attend"):  # a layer with its own attention (LESS, TailorKV's offloaded layers)
            q, k = t.qk(hidden_states, *position_embeddings)
            B, T, _ = hidden_states.shape
            v = t.v_proj(hidden_states).view(B, T, -1, t.head_dim).transpose(1, 2)
            out = layer.attend(q, k, v)  # [B, H, T, n]
            return t.o_proj(out.transpose(1, 2).reshape(B, T, -1)), None
        if not isinstance(cache, PaluCache):  # TALE caches, the base model's caches, none: the runtime's attention
            return t(hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        # eager low rank (Palu): v = (x A_r) B_r in the forward pass too; the cache holds the rank-r latents
        q, k = t.qk(hidden_states, *position_embeddings)
        r = cache.ranks[t.layer_idx]
        h = t.latents(hidden_states)[..., :r]
        k, h = cache.update(k, h, t.layer_idx)
        v = t.values(nn.functional.pad(h, (0, t.R - r)))
        return t.attend_exact(q, k, v, attention_mask, **kwargs)


def prepare(model):
    """Wrap every TaleAttention of a loaded TALE model (in place); returns the model."""
    for layer in model.model.layers:
        if isinstance(layer.self_attn, TaleAttention):
            layer.self_attn = EvalAttention(layer.self_attn)
    return model
