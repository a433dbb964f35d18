"""Resolve MODEL to a local checkpoint directory, load it, and check TALE can convert it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from tale_runtime.artifact import sha256_file

from . import ConvertError, smollm2

SUPPORTED = ("llama", "mistral", "qwen2")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "README.md"]


@dataclass
class Source:
    path: Path  # local checkpoint directory
    id: str  # Hub id, or the absolute local path
    revision: str | None  # Hub commit, None when local
    license: str | None
    origin: str | None = None  # how a non-Hub checkpoint was made (the GGUF alias)

    def file_hashes(self) -> dict[str, str]:
        """sha256 of the weight files, keyed by name. Hub blobs are named by their sha256 already."""
        out = {}
        files = sorted(f for f in self.path.iterdir() if f.name.endswith(WEIGHT_SUFFIXES))
        if self.origin:
            files.append(smollm2.gguf_path())
        for f in files:
            blob = f.resolve()
            known = blob.parent.name == "blobs" and re.fullmatch(r"[0-9a-f]{64}", blob.name)
            out[f.name] = blob.name if known else sha256_file(f)
        return out


@dataclass
class Arch:
    model_type: str
    d: int  # hidden size
    H: int  # query heads
    K: int  # KV heads
    n: int  # head dim
    L: int  # layers
    g: int  # KV heads per group

    @property
    def G(self) -> int:
        return self.K // self.g

    @property
    def R(self) -> int:
        return self.g * self.n

    def to_manifest(self) -> dict:
        return {
            "model_type": self.model_type,
            "hidden_size": self.d,
            "num_layers": self.L,
            "num_heads": self.H,
            "num_kv_heads": self.K,
            "head_dim": self.n,
            "group_size": self.g,
            "num_groups": self.G,
            "latent_rank": self.R,
            "layers": [{"g": self.g, "G": self.G, "R": self.R} for _ in range(self.L)],
        }


def resolve(model: str | None) -> Source:
    """MODEL: `smollm2` (the default), a local checkpoint directory, or a Hub id `owner/name`."""
    if model in (None, "", smollm2.ALIAS):
        try:
            path = smollm2.smollm2_dir()
        except FileNotFoundError as e:
            raise ConvertError(str(e)) from None
        origin = (path / "SOURCE").read_text().strip()
        return Source(path, smollm2.HUB_ID, None, "apache-2.0", origin=f"{origin}, dequantized to bf16")
    p = Path(model).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise ConvertError(f"{model}: not a model directory (no config.json)")
        return Source(p.resolve(), str(p.resolve()), None, _license(p))
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ConvertError(f"model not found: {model} (no such directory, and not a Hub id 'owner/name')")
    return _download(model)


def _download(hub_id: str) -> Source:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        path = Path(snapshot_download(hub_id, allow_patterns=HUB_PATTERNS))
    except RepositoryNotFoundError:
        raise ConvertError(f"{hub_id}: no such model on the Hub (or no access: log in or pass a token)") from None
    except LocalEntryNotFoundError:
        raise ConvertError(f"{hub_id}: not in the local cache and the Hub is unreachable") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ConvertError(f"{hub_id}: download failed: {(str(e) or type(e).__name__).splitlines()[0]}") from None
    return Source(path, hub_id, path.name, _license(path))


def _license(path: Path) -> str | None:
    card = path / "README.md"
    if not card.is_file():
        return None
    m = re.search(r"\A---\n.*?^license:\s*(\S+)\s*$.*?^---", card.read_text(errors="replace"), re.M | re.S)
    return m.group(1).strip("'\"") if m else None


def load_config(src: Source, group: int):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(src.path)
    except (OSError, ValueError, KeyError) as e:
        raise ConvertError(f"{src.id}: cannot read config.json: {str(e).splitlines()[0]}") from None
    return config, check_config(config, group)


def check_config(config, group: int) -> Arch:
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED:
        raise ConvertError(f"unsupported architecture {mt!r}: tale-convert handles {', '.join(SUPPORTED)}")
    if getattr(config, "quantization_config", None):
        raise ConvertError("quantized checkpoints are not supported: convert the full-precision model")
    H, K, d = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
    n = getattr(config, "head_dim", None) or d // H
    if H % K:
        raise ConvertError(f"num_attention_heads {H} is not a multiple of num_key_value_heads {K}")
    if group < 1 or K % group:
        raise ConvertError(f"--group {group} must divide the number of KV heads ({K})")
    if group * n > d:
        raise ConvertError(f"--group {group} gives latent rank {group * n} > hidden size {d}: use a smaller group")
    return Arch(mt, d, H, K, n, config.num_hidden_layers, group)


def load_model(src: Source):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(src.path, dtype="auto", attn_implementation="sdpa")
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ConvertError(f"{src.id}: cannot load the model: {str(e).splitlines()[0]}") from None
    return model.eval().requires_grad_(False)


def load_tokenizer(src: Source):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(src.path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConvertError(f"{src.id}: cannot load the tokenizer: {str(e).splitlines()[0]}") from None
    return tok


def check_layout(model, arch: Arch) -> None:
    """The converter relies on this module layout; a model that differs is refused, not guessed at."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or len(layers) != arch.L or not hasattr(model.model, "rotary_emb"):
        raise ConvertError("unsupported model layout: expected model.model.layers and model.model.rotary_emb")
    want = {"q_proj": (arch.H * arch.n, arch.d), "k_proj": (arch.K * arch.n, arch.d),
            "v_proj": (arch.K * arch.n, arch.d), "o_proj": (arch.d, arch.H * arch.n)}
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None or not isinstance(getattr(layer, "input_layernorm", None), torch.nn.Module):
            raise ConvertError(f"unsupported attention layout in layer {i}: expected self_attn and input_layernorm")
        for name, shape in want.items():
            lin = getattr(attn, name, None)
            if not isinstance(lin, torch.nn.Linear) or tuple(lin.weight.shape) != shape:
                raise ConvertError(f"unsupported attention layout in layer {i}: {name} is not a Linear {shape}")


def sliding_window(config) -> int | None:
    """The window if any layer attends through one (calibration uses plain causal attention)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None:
        return window if "sliding_attention" in types else None
    if config.model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
        return None
    return window
