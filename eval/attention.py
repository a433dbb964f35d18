"""One model for every cache policy: a TALE model whose attention layers also run as the base model's.

EvalAttention wraps a runtime TaleAttention. With a TaleCache it is TALE, untouched. With any other
cache (or none) it is the base model's attention: v = x W_V with the original v_proj the artifact
keeps (the runtime's exact prefill uses it too), exact attention through the model's attention
function, and the cache stores what its policy stores. With a PaluCache the values are eager low
rank: v = (x A_r) B_r also in the forward pass, and the cache holds the rank-r latents.
"""

from __future__ import annotations

from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from tale_runtime.model import TaleAttention, TaleCache, apply_rope

from .caches import PaluCache


class EvalAttention(nn.Module):
    def __init__(self, tale: TaleAttention):
        super().__init__()
        self.tale = tale
        self.v_proj = tale.v_proj  # the original W_V, where tale_convert.policy's Fisher scores look for it

    def forward(
        self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, cache=None, **kwargs
    ):
        past_key_values = cache if cache is not None else past_key_values  # transformers >= 5.24 passes `cache`
        t = self.tale
        if isinstance(past_key_values, TaleCache):
            return t(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        B, T, _ = hidden_states.shape
        q = t.q_proj(hidden_states).view(B, T, -1, t.head_dim).transpose(1, 2)
        k = t.k_proj(hidden_states).view(B, T, -1, t.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(past_key_values, PaluCache):
            r = past_key_values.ranks[t.layer_idx]
            h = t.latents(hidden_states)[..., :r]
            k, h = past_key_values.update(k, h, t.layer_idx)
            v = t.values(nn.functional.pad(h, (0, t.R - r)))
        else:
            v = self.v_proj(hidden_states).view(B, T, -1, t.head_dim).transpose(1, 2)
            if past_key_values is not None:
                k, v = past_key_values.update(k, v, t.layer_idx)
        attn = ALL_ATTENTION_FUNCTIONS.get_interface(t.config._attn_implementation, None)
        if attn is None:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward as attn
        out, weights = attn(t, q, k, v, attention_mask, dropout=0.0, scaling=t.scaling, **kwargs)
        return t.o_proj(out.reshape(B, T, -1).contiguous()), weights


def prepare(model):
    """Wrap every TaleAttention of a loaded TALE model (in place); returns the model."""
    for layer in model.model.layers:
        if isinstance(layer.self_attn, TaleAttention):
            layer.self_attn = EvalAttention(layer.self_attn)
    return model
