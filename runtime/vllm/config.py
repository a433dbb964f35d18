"""The artifact's config.json as vLLM reads it.

An artifact's config.json says model_type "tale" (tale_runtime.remote_code: plain transformers then refuses it
without trust_remote_code, instead of loading the base model). vLLM reads config.json through transformers'
AutoConfig before it picks a model class: registered for "tale", this class hands it the base model's config (the
base's model_type, fields and defaults) naming the TALE model class of that family as the architecture, so
`vllm serve ARTIFACT` needs no override and no remote code.
"""

from __future__ import annotations

from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

from tale_runtime.remote_code import MODEL_TYPE, base_dict

from . import ARCHITECTURES


class TaleServedConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        base = base_dict(config_dict)
        family = base.get("model_type")
        if family not in ARCHITECTURES:
            raise ValueError(
                f"a TALE artifact of model_type {family!r}: the vLLM plugin serves {', '.join(ARCHITECTURES)}"
            )
        out = CONFIG_MAPPING[family].from_dict(base, **kwargs)  # (config, unused kwargs) when asked for them
        config = out[0] if isinstance(out, tuple) else out
        config.architectures = [ARCHITECTURES[family][1]]
        return out


def register() -> None:
    if MODEL_TYPE not in CONFIG_MAPPING:
        AutoConfig.register(MODEL_TYPE, TaleServedConfig)
