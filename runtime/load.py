"""Load a tale-convert artifact (a directory or a Hub repo id) into a ready model."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from .artifact import ArtifactError, Schedule, read_manifest, schedule_of, verify_files
from .model import TaleAttention, TaleCache

SUPPORTED = ("llama", "mistral", "qwen2")


def resolve(path_or_id: str | os.PathLike, revision: str | None = None) -> Path:
    """A local artifact dir, or a Hub repo id fetched with snapshot_download (honours HF_HUB_OFFLINE and the cache)."""
    p = Path(path_or_id).expanduser()
    if p.exists():
        return p
    s = str(path_or_id)
    if s.startswith((".", "/", "~")) or s.count("/") != 1:
        raise ArtifactError(f"{s}: no such artifact directory (and not a Hub repo id 'owner/name')")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(s, revision=revision))
    except RepositoryNotFoundError:
        raise ArtifactError(f"{s}: no such repo on the Hub (or no access; log in or pass a token)") from None
    except LocalEntryNotFoundError:
        raise ArtifactError(f"{s}: not in the local cache and the Hub is unreachable (HF_HUB_OFFLINE set or no network)") from None
    except HfHubHTTPError as e:
        raise ArtifactError(f"{s}: download failed: {str(e).splitlines()[0]}") from None


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16


def load(
    path_or_id: str | os.PathLike,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    schedule: Schedule | None = None,
    verify: bool = True,
    revision: str | None = None,
    **overrides,
):
    """Return (model, tokenizer) with TALE attention in every layer.

    `schedule` replaces the artifact's; `overrides` replace single Schedule fields
    (sinks, key_group, value_group, residual, ...). The tokenizer is None if the artifact has none.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    root = resolve(path_or_id, revision)
    manifest = read_manifest(root)
    if verify:
        verify_files(root, manifest)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or default_dtype(device)

    config = AutoConfig.from_pretrained(root)
    if config.model_type not in SUPPORTED:
        raise ArtifactError(f"{root}: model_type {config.model_type!r} is not supported (only {', '.join(SUPPORTED)})")
    config._attn_implementation = "sdpa"
    arch = manifest["architecture"]
    g = int(arch["group_size"])

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    for i, layer in enumerate(model.model.layers):
        layer.self_attn = TaleAttention(layer.self_attn, config, i, g)

    state = {}
    index = root / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    for f in files:
        if not (root / f).is_file():
            raise ArtifactError(f"{root}: tensor file {f} is missing")
        with safe_open(root / f, framework="pt", device=str(device)) as st:
            for name in st.keys():
                state[name] = st.get_tensor(name).to(dtype)
    expected = set(model.state_dict().keys())
    tied = getattr(config, "tie_word_embeddings", False)
    missing = expected - set(state) - ({"lm_head.weight"} if tied else set())
    if missing:
        raise ArtifactError(f"{root}: artifact lacks {len(missing)} tensors, e.g. {sorted(missing)[0]}")
    unexpected = set(state) - expected
    if unexpected:
        raise ArtifactError(f"{root}: artifact has unexpected tensors, e.g. {sorted(unexpected)[0]}")
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.tie_weights()
    # non-persistent buffers (rotary inv_freq) were created on meta: rebuild them for real
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config, device=device)
    model.to(device).eval()

    sched = schedule or schedule_of(manifest)
    if overrides:
        sched = replace(sched, **overrides)
    sched.validate(int(arch["latent_rank"]), config.num_hidden_layers)
    model.tale_manifest = manifest
    model.tale_schedule = sched
    model.tale_path = root
    if device.type == "cuda":
        use_kernels(model)

    tok = None
    if any((root / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tok = AutoTokenizer.from_pretrained(root)
    return model, tok


def new_cache(model, schedule: Schedule | None = None) -> TaleCache:
    """A fresh TaleCache for `model` (pass as past_key_values to forward/generate)."""
    arch = model.tale_manifest["architecture"]
    cfg = model.config
    return TaleCache(
        schedule or model.tale_schedule,
        cfg.num_hidden_layers,
        cfg.num_key_value_heads,
        int(arch["head_dim"]),
        int(arch["num_groups"]),
        int(arch["latent_rank"]),
    )


def set_output_path(model, path: str) -> None:
    if path not in ("fused", "factored"):
        raise ValueError(f"output path must be 'fused' or 'factored', got {path!r}")
    for layer in model.model.layers:
        layer.self_attn.output_path = path


def use_kernels(model, enable: bool = True) -> bool:
    """Route decode attention through the Triton kernel (CUDA) or back to the torch reference."""
    from .cache import latent_attention

    fn = latent_attention
    if enable:
        try:
            from tale_kernels import latent_attention as kernel_fn  # noqa: F401
        except Exception:  # Triton missing or no kernel for this setup: keep the reference
            kernel_fn = None
        fn = kernel_fn or latent_attention
    for layer in model.model.layers:
        layer.self_attn.attention_fn = fn
    return fn is not latent_attention
