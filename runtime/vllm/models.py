"""The model classes the plugin registers (ARCHITECTURES): vLLM's Llama with TaleAttention in every layer,
weights read from the artifact (source.py) instead of vLLM's directory reader. Mistral, Qwen2, Qwen3 and Phi-3
checkpoints have the Llama layer (Qwen2: with q, k, v biases; Qwen3: with an RMSNorm over each head's queries and keys
before RoPE: TaleAttention adds them; Phi-3: fused q/k/v and gate/up weights, which source.py hands over unfused, and
RoPE on part of each head, which vLLM's get_rope reads from the config), so all five use it. Gemma 3 keeps vLLM's own
Gemma 3 layer with TaleAttention in it."""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from vllm.platforms import current_platform

from . import EXACT_LAYERS, KV_CACHE, ROTATE, SINKS, VALUE_RANK, source
from .attention import FORMATS, RANKS, TaleAttention, gemma3_attention


def _prepare(vllm_config: VllmConfig) -> source.Source:
    """The checked artifact of the engine's model, and on its hf_config what TaleAttention reads per layer (value
    ranks, packed formats, sinks), set before the layers are built."""
    config = vllm_config.model_config.hf_config
    # checked again in every process that builds the model: it reads the files itself
    src = source.open_artifact(
        vllm_config.model_config.model,
        getattr(config, VALUE_RANK, "full"),
        kv_cache=getattr(config, KV_CACHE, None),
        exact_layers=getattr(config, EXACT_LAYERS, 1),
        rotate=getattr(config, ROTATE, "hadamard"),
        sinks=getattr(config, SINKS, None),
    )
    source.check_backend(src, current_platform.is_cpu())
    setattr(config, RANKS, list(src.ranks))
    dtype = vllm_config.model_config.dtype
    setattr(config, FORMATS, [src.paged_format(i, dtype) for i in range(src.arch.num_layers)])
    if src.bits is not None:
        from .packed import SINK_TOKENS

        setattr(config, SINK_TOKENS, src.sinks)
    return src


class _ArtifactWeights:
    """Before the vLLM model class in the bases: its load_weights fed from the artifact (self.tale_source)."""

    tale_source: source.Source

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # vLLM's reader of the directory is not iterated: the artifact is read through its manifest and checksums
        del weights
        return super().load_weights(source.tensors(self.tale_source))


class TaleLlamaForCausalLM(_ArtifactWeights, LlamaForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        src = _prepare(vllm_config)
        layer = functools.partial(LlamaDecoderLayer, attn_layer_type=TaleAttention)
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer)
        self.tale_source = src


class TaleMistralForCausalLM(TaleLlamaForCausalLM):
    pass


class TaleQwen2ForCausalLM(TaleLlamaForCausalLM):
    pass


class TaleQwen3ForCausalLM(TaleLlamaForCausalLM):
    pass


class TalePhi3ForCausalLM(TaleLlamaForCausalLM):
    pass


class TaleGemma3ForCausalLM(_ArtifactWeights, Gemma3ForCausalLM):
    """vLLM's Gemma 3 (its norms around attention and the MLP, scaled embeddings) with TaleAttention in every layer:
    Gemma3DecoderLayer builds its attention by the module name Gemma3Attention, which points at TaleAttention's
    Gemma constructor while the layers are built."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        from vllm.model_executor.models import gemma3

        src = _prepare(vllm_config)
        original, gemma3.Gemma3Attention = gemma3.Gemma3Attention, gemma3_attention
        try:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        finally:
            gemma3.Gemma3Attention = original
        self.tale_source = src
