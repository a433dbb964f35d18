"""The artifact as plain transformers sees it: config.json with model_type "tale" and an auto_map naming the
artifact's own modeling_tale.py (this package's modeling_tale.py, copied), and what that module calls.

    AutoModelForCausalLM.from_pretrained(path_or_repo, trust_remote_code=True)  -> tale_runtime.load's model
    AutoModelForCausalLM.from_pretrained(path_or_repo)                          -> ValueError: trust_remote_code

model_type "tale" is what makes transformers refuse without trust_remote_code: with the base's model_type
("llama") and an auto_map it would silently load the base class, whose generate() uses an ordinary 16-bit cache.
The base's model_type and architectures are kept beside it (tale_base_model_type, tale_base_architectures); the
runtime reads the base config back (base_config). Artifacts written before this keep the base's config.json and
load as before; tale-push upgrades what it uploads.
"""

from __future__ import annotations

import json
from pathlib import Path

MODEL_TYPE = "tale"
FILE = "modeling_tale.py"
ARCHITECTURES = ["TaleForCausalLM"]
AUTO_MAP = {"AutoConfig": "modeling_tale.TaleConfig", "AutoModelForCausalLM": "modeling_tale.TaleForCausalLM"}
BASE_TYPE = "tale_base_model_type"
BASE_ARCHITECTURES = "tale_base_architectures"

# from_pretrained keywords that only say where the files come from, or that transformers adds itself
_HUB_KEYS = ("revision", "cache_dir", "token", "local_files_only", "force_download")
_IGNORED = (
    "trust_remote_code",
    "code_revision",
    "adapter_kwargs",
    "_commit_hash",
    "_from_auto",
    "_from_pipeline",
    "proxies",
    "use_safetensors",
    "low_cpu_mem_usage",
    "subfolder",
)
# what tale_runtime.load takes besides device and dtype
_LOAD_KEYS = (
    "verify",
    "backend",
    "backend_config",
    "sinks",
    "recent",
    "r0",
    "ranks",
    "bits",
    "key_bits",
    "key_group",
    "value_group",
    "residual",
    "key_axis",
    "key_meta",
    "value_meta",
    "key_channel_group",
    "rotate",
    "key_rope",
    "key_rank",
)


def is_tale(d: dict) -> bool:
    return d.get("model_type") == MODEL_TYPE


def base_dict(d: dict) -> dict:
    """config.json's dict -> the base model's (an old artifact's is the base's already)."""
    if not is_tale(d):
        return d
    out = {k: v for k, v in d.items() if k not in (BASE_TYPE, BASE_ARCHITECTURES, "auto_map", "architectures")}
    out["model_type"] = d.get(BASE_TYPE)
    if d.get(BASE_ARCHITECTURES):
        out["architectures"] = d[BASE_ARCHITECTURES]
    return out


def tale_dict(d: dict) -> dict:
    """The base's config dict -> the artifact's (model_type "tale", auto_map); idempotent."""
    base = base_dict(d)
    return {
        **base,
        "model_type": MODEL_TYPE,
        "architectures": ARCHITECTURES,
        "auto_map": AUTO_MAP,
        BASE_TYPE: base.get("model_type"),
        BASE_ARCHITECTURES: base.get("architectures"),
    }


def dumps(d: dict) -> bytes:
    """As transformers writes config.json (PreTrainedConfig.to_json_string)."""
    return (json.dumps(d, indent=2, sort_keys=True) + "\n").encode()


def module_source() -> bytes:
    return Path(__file__).with_name(FILE).read_bytes()


def hub_files(root: Path) -> dict[str, bytes]:
    """config.json and modeling_tale.py as an artifact ships them, from the artifact at `root` (old or new)."""
    d = json.loads((Path(root) / "config.json").read_text())
    return {"config.json": dumps(tale_dict(d)), FILE: module_source()}


def write_hub_files(root: Path) -> None:
    """Turn the base's config.json at `root` into the artifact's and add modeling_tale.py (tale-convert)."""
    for name, data in hub_files(root).items():
        (Path(root) / name).write_bytes(data)


def base_config(root: Path):
    """The base model's transformers config from the artifact's config.json (old or new); ValueError if its
    model_type is missing or unknown to transformers."""
    from transformers import CONFIG_MAPPING

    d = base_dict(json.loads((Path(root) / "config.json").read_text()))
    kind = d.get("model_type")
    if kind not in CONFIG_MAPPING:
        raise ValueError(f"model_type {kind!r} is not one transformers knows")
    return CONFIG_MAPPING[kind].from_dict(d)


def from_pretrained(pretrained_model_name_or_path, *model_args, config=None, **kwargs):
    """What modeling_tale.TaleForCausalLM.from_pretrained (AutoModelForCausalLM with trust_remote_code) calls:
    tale_runtime.load's model, with from_pretrained's conventions: dtype "auto" (the default) is the stored dtype,
    no device_map loads on the CPU, device_map="auto" on the GPU if there is one ("cuda", "cuda:1", {"": "cuda"}
    name one device; TALE does not split a model over devices). TALE's schedule overrides and `backend` pass
    through to load; any other keyword is refused rather than ignored."""
    import torch
    from transformers import GenerationConfig

    from .console import check_dtype
    from .load import load

    if model_args:
        raise TypeError(f"TALE artifacts take no positional model arguments, got {len(model_args)}")
    hub = {k: kwargs.pop(k) for k in _HUB_KEYS if k in kwargs}
    for k in _IGNORED:
        kwargs.pop(k, None)
    dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None) or "auto"
    device_map = kwargs.pop("device_map", None)
    attn = kwargs.pop("attn_implementation", None)
    if attn is None and config is not None:  # AutoModelForCausalLM hands it over on the config, not as a keyword
        attn = getattr(config, "_attn_implementation_internal", None)
    if attn not in (None, "sdpa"):
        raise ValueError(f"attn_implementation={attn!r}: TALE attention prefills with SDPA and decodes over its cache")
    overrides = {k: kwargs.pop(k) for k in _LOAD_KEYS if k in kwargs}
    if kwargs:
        raise ValueError(f"not supported for a TALE artifact: {', '.join(sorted(kwargs))}")

    path = Path(str(pretrained_model_name_or_path)).expanduser()
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(str(pretrained_model_name_or_path), **hub))
    if dtype == "auto":
        stored = getattr(config, "dtype", None) if config is not None else None
        dtype = stored if stored is not None else torch.bfloat16
    model, _ = load(path, device=_device(device_map), dtype=check_dtype(dtype, "dtype"), **overrides)
    model.config._name_or_path = str(pretrained_model_name_or_path)
    if (path / "generation_config.json").is_file():  # verified by load with the rest (manifest "files")
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model


def _device(device_map):
    if device_map is None:
        return "cpu"
    if isinstance(device_map, dict):
        devices = set(device_map.values())
        if len(devices) != 1:
            raise ValueError("device_map: a TALE model runs on one device; name it (device_map='cuda:0')")
        device_map = devices.pop()
    if isinstance(device_map, int):
        return f"cuda:{device_map}"
    return device_map  # "auto", "cpu", "cuda", "cuda:N", torch.device: checked by load
