"""The model families TALE converts and runs, and what differs between them around the attention layer.

A leaf module (config objects and modules in, facts out): the converter, the loader and the attention layer ask it
instead of testing model types themselves.

| family        | what differs from Llama                                                                      |
|---------------|----------------------------------------------------------------------------------------------|
| mistral       | a sliding window on every layer (config.sliding_window)                                      |
| qwen2         | biases on q/k/v; optional sliding layers (use_sliding_window, layer_types)                   |
| qwen3         | per-head RMSNorm of queries and keys (q_norm, k_norm) before RoPE                            |
| gemma3_text   | q_norm/k_norm, scaling query_pre_attn_scalar^-1/2, sliding and global layers with their own   |
|               | RoPE base, scaled tied embeddings, pre/post-feedforward norms (inside transformers' layer)   |
| phi3          | one fused qkv_proj (rows: queries, keys, values) and gate_up_proj; partial rotary            |
"""

from __future__ import annotations

import torch

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3")
FUSED_QKV = ("phi3",)  # one qkv_proj whose rows are H n queries, K n keys, K n values
# the families whose decoder layer is Llama's (norm, attention, residual; norm, MLP, residual): DecodeStep writes it out
LLAMA_LAYER = ("llama", "mistral", "qwen2", "qwen3", "phi3")
# the families with an RMSNorm over each head's queries and keys before RoPE (q_norm, k_norm; Gemma's scales by 1 + w)
QK_NORM = ("qwen3", "gemma3_text")
# the families whose layer types have RoPE tables of their own (Gemma 3: local base on sliding layers, global on full)
ROPE_PER_LAYER_TYPE = ("gemma3_text",)


def supported_list() -> str:
    return ", ".join(SUPPORTED)


def unsupported(config, raw: dict | None = None) -> str | None:
    """Why TALE cannot take a model of this config (one line), or None. `raw`: config.json as read (a multimodal
    Gemma 3 shows itself there by its vision config and architectures); config None: judge the family from `raw`
    alone, before transformers is asked to build a config it may not know."""
    raw = raw or {}
    mt = raw.get("model_type") if config is None else getattr(config, "model_type", None)
    if config is None and mt in SUPPORTED:
        return None
    if mt == "gemma2":
        return (
            "Gemma 2 (model_type 'gemma2') is not supported: its attention logits are soft-capped, which TALE's "
            f"decode attention does not apply; supported families: {supported_list()}"
        )
    if mt == "gemma3":
        archs = raw.get("architectures") or getattr(config, "architectures", None) or []
        if raw.get("vision_config") is not None or any("ConditionalGeneration" in a for a in archs):
            return (
                "multimodal Gemma 3 checkpoint (model_type 'gemma3' with a vision tower) is not supported: TALE "
                "converts the text-only Gemma 3 models (model_type 'gemma3_text', e.g. gemma-3-1b, gemma-3-270m)"
            )
        return (
            "a 'gemma3' config without a vision tower: save its language model as Gemma3ForCausalLM "
            "(model_type 'gemma3_text') and convert that"
        )
    if mt not in SUPPORTED:
        return f"unsupported architecture {mt!r}: supported families are {supported_list()}"
    if getattr(config, "attn_logit_softcapping", None):
        return (
            f"attention logit soft-capping (attn_logit_softcapping {config.attn_logit_softcapping}) is not "
            "supported: TALE's decode attention does not apply it"
        )
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention (use_bidirectional_attention) is not supported: TALE caches causal LMs"
    factor = rotary_factor(config)
    if not 0 < factor <= 1:
        return f"partial_rotary_factor {factor} is not in (0, 1]"
    n = head_dim(config)
    if int(n * factor) % 2:
        return f"partial_rotary_factor {factor} rotates {int(n * factor)} of {n} channels: RoPE needs an even count"
    return None


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rotary_factor(config) -> float:
    """The share of each head's channels RoPE rotates (Phi-3's partial_rotary_factor; 1 elsewhere)."""
    params = getattr(config, "rope_parameters", None) or {}
    f = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    return float(f if f is not None else getattr(config, "partial_rotary_factor", None) or 1.0)


def rotary_dim(config) -> int:
    """Channels of a head that RoPE rotates (the first ones, as transformers' partial rotary does)."""
    return int(head_dim(config) * rotary_factor(config))


def fused_qkv(config) -> bool:
    return getattr(config, "model_type", None) in FUSED_QKV


def qkv_rows(config) -> tuple[int, int, int]:
    """Rows of a fused qkv_proj: queries, keys, values (H n, K n, K n)."""
    n = head_dim(config)
    return config.num_attention_heads * n, config.num_key_value_heads * n, config.num_key_value_heads * n


def value_weight(attn, config) -> torch.Tensor:
    """W_V of an attention module [K n, d] (nn.Linear layout): v_proj's weight, or the value rows of qkv_proj."""
    if fused_qkv(config):
        hq, hk, _ = qkv_rows(config)
        return attn.qkv_proj.weight[hq + hk :]
    return attn.v_proj.weight


def rope_types(config) -> list[str | None]:
    """Per layer, the layer type whose RoPE tables it reads (None: the model has one RoPE for all layers)."""
    L = config.num_hidden_layers
    if getattr(config, "model_type", None) in ROPE_PER_LAYER_TYPE:
        return list(config.layer_types[:L])
    return [None] * L


# RoPE types whose frequencies follow the sequence's length (transformers' dynamic_rope_update), not the position alone
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def rotary(model) -> tuple[torch.Tensor, float] | None:
    """(inv_freq [n/2] float32, attention_scaling) of the RoPE the model's global layers apply, where it rotates whole
    heads by the position alone (any scaling folded into inv_freq: linear, llama3, yarn); None otherwise (a
    "dynamic" or "longrope" RoPE, a partial rotary, a model without transformers' rotary_emb)."""
    rot = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rot is None or rotary_dim(model.config) != head_dim(model.config):
        return None
    kind, prefix = getattr(rot, "rope_type", None), ""
    if isinstance(kind, dict):  # per layer type (Gemma 3): the global layers' (sliding ones are held after RoPE)
        kind, prefix = kind.get("full_attention"), "full_attention_"
    inv, scaling = getattr(rot, prefix + "inv_freq", None), getattr(rot, prefix + "attention_scaling", None)
    if kind is None or kind in LENGTH_DEPENDENT_ROPE or not isinstance(inv, torch.Tensor) or scaling is None:
        return None
    return inv.float(), float(scaling)


def layer_window(attn, config) -> int | None:
    """The sliding window an attention module reads through (None: a global layer): the module's own (Qwen2/3 and
    Gemma 3 mark sliding layers on it, TaleAttention keeps it), else the config's (Mistral and Phi-3: every layer)."""
    w = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(config, "sliding_window", None)
    return int(w) if w else None


def sliding_windows(model) -> tuple[int | None, ...]:
    """Per decoder layer, the sliding window its attention reads through (layer_window; None: a global layer)."""
    return tuple(layer_window(layer.self_attn, model.config) for layer in model.model.layers)


def config_window(config) -> int | None:
    """The window if any layer attends through one, from the config alone (before a model is built: tale-convert's
    calibration runs plain causal attention, so its sequences must fit in it)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None:
        return window if "sliding_attention" in types else None
    if config.model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
        return None
    return window


def embed_scale(model) -> float | None:
    """The factor the model's embedding layer multiplies token embeddings by (Gemma's scaled embedding: sqrt of the
    hidden size, from transformers' module), else None."""
    return getattr(model.model.embed_tokens, "scalar_embed_scale", None)
