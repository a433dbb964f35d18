"""The tiny random configs of the tests, in one table.

CHECKPOINT: the models saved to disk and converted through tale-convert (conftest.save_tiny, the fault run), with the
tiny tokenizer's 512-token vocabulary. IN_MEMORY: the same families as tale_helpers.tiny_model builds them for TALE
models made without the converter: a 320-token vocabulary and, where a test's numbers depend on it, other sizes.
"""

# Tiny configs: GQA with several groups (llama), one group (mistral, sliding window config),
# value bias and rep=3 (qwen2), MHA with tied embeddings (mha).
CHECKPOINT = {
    "llama": dict(
        model_type="llama",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
    ),
    "mistral": dict(
        model_type="mistral",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=256,
    ),
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
    ),
    "mha": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        tie_word_embeddings=True,
    ),
    # per-head q/k norms before RoPE
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
    ),
    # q/k norms, scaling 1/sqrt(query_pre_attn_scalar), a sliding layer (local RoPE base) then a global one (scaled
    # global RoPE), scaled tied embeddings; the window covers the calibration sequences (tale-convert requires it)
    "gemma3": dict(
        model_type="gemma3_text",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    ),
    # fused qkv_proj and gate_up_proj, RoPE on half of each head
    "phi3": dict(
        model_type="phi3",
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        partial_rotary_factor=0.5,
        pad_token_id=0,
    ),
}

# (the in-memory models predate the checkpoints' sizes; tests' thresholds were set on these)
_IN_MEMORY_CHANGES = {
    "llama": dict(num_hidden_layers=2),
    "mistral": dict(head_dim=16, sliding_window=None),
    "qwen2": dict(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=4),
    "mha": dict(hidden_size=128, intermediate_size=256, tie_word_embeddings=False),
    "gemma3": dict(sliding_window=24),  # a window the short test sequences pass
}
IN_MEMORY = {
    name: {**cfg, "vocab_size": 320, "max_position_embeddings": 512, **_IN_MEMORY_CHANGES.get(name, {})}
    for name, cfg in CHECKPOINT.items()
}
