"""Serve TALE artifacts with vLLM: out-of-tree model classes, registered through vLLM's general-plugin entry point.

Stage 1 (the default): keys and latents are held by vLLM's own paged cache in 16 bits; each KV head's value is its
group's latent cut to one rank per layer. The packed cache (stage 2, `engine_args(kv_cache=...)`): TALE's attention
backend (packed.py) holds one packed slot per token, layer and latent group in vLLM's paged cache (docs/serving.md).
Importing this package does not import vLLM.
"""

from __future__ import annotations

import os

# model_type -> (vLLM's class of the base model, the TALE class this plugin registers)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "TaleLlamaForCausalLM"),
    "mistral": ("MistralForCausalLM", "TaleMistralForCausalLM"),
    "qwen2": ("Qwen2ForCausalLM", "TaleQwen2ForCausalLM"),
    "qwen3": ("Qwen3ForCausalLM", "TaleQwen3ForCausalLM"),
    "phi3": ("Phi3ForCausalLM", "TalePhi3ForCausalLM"),
    "gemma3_text": ("Gemma3ForCausalLM", "TaleGemma3ForCausalLM"),
}
# the hf_config fields that carry the value rank and the packed cache's level into the model (hf_overrides; see
# engine_args)
VALUE_RANK = "tale_value_rank"
KV_CACHE = "tale_kv_cache"
EXACT_LAYERS = "tale_kv_exact_layers"
ROTATE = "tale_kv_rotate"
SINKS = "tale_kv_sinks"


def register() -> None:
    """The `vllm.general_plugins` entry point: vLLM calls it in every process it starts."""
    from vllm import ModelRegistry

    from . import config, packed

    config.register()
    packed.register()
    for _, tale in ARCHITECTURES.values():
        if tale not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(tale, f"tale_runtime.vllm.models:{tale}")


def engine_args(path: str | os.PathLike, value_rank: int | str = "full", **options) -> dict:
    """Keyword arguments of vllm.LLM (or EngineArgs) that serve the artifact at `path` with the TALE model class.

    Checked here, in the calling process, before vLLM starts an engine: the artifact (manifest, every file's sha256:
    tale_runtime.ArtifactError in one line) and the value rank (ValueError in one line, e.g. r != n on the CPU).
    value_rank and `options` (verify, kv_cache, exact_layers, rotate, sinks): those of source.open_artifact.
    """
    import inspect

    from vllm.platforms import current_platform

    from .source import check_backend, open_artifact

    src = open_artifact(path, value_rank, **options)
    check_backend(src, current_platform.is_cpu())
    bound = inspect.signature(open_artifact).bind(path, value_rank, **options)
    bound.apply_defaults()  # the packed cache's settings as open_artifact took them, its defaults included
    opts = bound.arguments
    overrides = {VALUE_RANK: value_rank}
    if opts["kv_cache"] is not None:
        overrides |= {
            KV_CACHE: opts["kv_cache"],
            EXACT_LAYERS: opts["exact_layers"],
            ROTATE: opts["rotate"],
            SINKS: src.sinks,
        }
    if not src.own_type:  # the base's config.json names the base class: name the TALE class instead
        overrides["architectures"] = [ARCHITECTURES[src.model_type][1]]
    return {"model": str(src.root), "hf_overrides": overrides}


def kv_bytes_per_token(llm) -> int:
    """The bytes an in-process vllm.LLM allocated for one token's keys and values, over all layers (its cache
    tensors): what its cache costs per token, to set beside PagedFormat's formula or a 16-bit cache."""
    block = llm.llm_engine.vllm_config.cache_config.block_size

    def per_token(model):
        from vllm.model_executor.layers.attention import Attention

        total = 0
        for m in model.modules():
            if isinstance(m, Attention):
                t = m.kv_cache[0] if isinstance(m.kv_cache, list | tuple) else m.kv_cache
                total += t.numel() * t.element_size() // (t.shape[0] * block)
        return total

    return llm.apply_model(per_token)[0]


def shutdown(llm) -> None:
    """End an in-process vllm.LLM and free what it held, so that another engine can start in the same process."""
    import gc

    from vllm.distributed import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
