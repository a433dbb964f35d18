"""Loads a TALE artifact (token-adaptive low-rank KV-cache compression) with its compressed KV cache.

tale-convert and tale-push ship this file in every artifact as `modeling_tale.py`; the artifact's config.json names
it in `auto_map`, so that

    AutoModelForCausalLM.from_pretrained(path_or_repo, trust_remote_code=True)

returns the model `tale_runtime.load(path_or_repo)` returns, whose generate() decodes over the TALE cache. Without
trust_remote_code transformers refuses the artifact (its model_type "tale" is not one it knows) instead of loading
the base model with an ordinary 16-bit cache. Kept small on purpose: the loading itself is in the installed
tale-kv package (tale_runtime.remote_code.from_pretrained; installed from a checkout of the toolkit, it is not on
PyPI), so an artifact keeps working as the package moves on.
"""

from transformers import PretrainedConfig, PreTrainedModel

try:  # in a try block: transformers' import check would otherwise say "pip install tale_runtime"
    from tale_runtime.remote_code import from_pretrained as _tale_from_pretrained
except ImportError as e:
    raise ImportError(
        "this model is a TALE artifact: loading it needs the tale-kv package (tale_runtime), which is not on PyPI: "
        f"install it from a checkout of the TALE toolkit (pip install /path/to/tale-toolkit) ({e})"
    ) from None


class TaleConfig(PretrainedConfig):
    """The base model's config.json, with model_type "tale"; tale_base_model_type names the base's."""

    model_type = "tale"


class TaleForCausalLM(PreTrainedModel):
    """A factory: from_pretrained returns the base model class with TALE attention (tale_runtime.load)."""

    config_class = TaleConfig

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
        return _tale_from_pretrained(pretrained_model_name_or_path, *model_args, config=config, **kwargs)
