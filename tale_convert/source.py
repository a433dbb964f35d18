"""Resolve MODEL to a local checkpoint directory, check TALE can convert it, and read its
weights lazily (a layer at a time) from the safetensors shards."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tale_runtime import families
from tale_runtime.artifact import MANIFEST, sha256_file
from tale_runtime.spec import Arch

from . import ConvertError
from .bundled import DEFAULT, MODELS

SUPPORTED = families.SUPPORTED
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "README.md"]


@dataclass
class Source:
    path: Path  # local checkpoint directory
    id: str  # Hub id, or the absolute local path
    revision: str | None  # Hub commit, None when local
    license: str | None
    origin: str | None = None  # how a non-Hub checkpoint was made (the GGUF alias)
    bundled: str | None = None  # the alias of a bundled model (tale_convert.bundled), whose GGUF file is hashed too
    instruct: bool | None = None  # chat-tuned (True), pretrained (False), unknown (None): instruct_of

    def file_hashes(self) -> dict[str, str]:
        """sha256 of the weight files, keyed by name. Hub blobs are named by their sha256 already."""
        files = sorted(f for f in self.path.iterdir() if f.name.endswith(WEIGHT_SUFFIXES))

        def digest(f: Path) -> str:
            blob = f.resolve()
            known = blob.parent.name == "blobs" and re.fullmatch(r"[0-9a-f]{64}", blob.name)
            return blob.name if known else sha256_file(f)

        # hashlib releases the GIL: the shards of a big local checkpoint hash in parallel
        with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
            out = dict(zip((f.name for f in files), pool.map(digest, files)))
        if self.bundled:
            try:  # the manifest names the GGUF file by the digest its package records
                out.update(MODELS[self.bundled].gguf_hashes())
            except FileNotFoundError as e:  # the package is gone while its rebuilt checkpoint stays cached
                raise ConvertError(str(e)) from None
        return out


def resolve(model: str | None) -> Source:
    """MODEL: a bundled model's alias (`smollm2`, the default; `gemma3-270m`), a local checkpoint directory, or a
    Hub id `owner/name`."""
    if model in (None, "") or model in MODELS:
        b = MODELS[model or DEFAULT]
        try:
            path = b.path()
        except FileNotFoundError as e:
            raise ConvertError(str(e)) from None
        origin = (path / "SOURCE").read_text().strip()
        origin = f"{origin}, dequantized to bf16"
        return Source(path, b.hub_id, None, b.license, origin=origin, bundled=b.alias, instruct=b.instruct)
    p = Path(model).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise ConvertError(f"{model}: not a model directory (no config.json)")
        return Source(p.resolve(), str(p.resolve()), None, _license(p), instruct=instruct_of(p.name))
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ConvertError(f"model not found: {model} (no such directory, and not a Hub id 'owner/name')")
    if p.parent.is_dir():  # checkpoints/llama: shaped like a Hub id, but its directory is here; a typo, not the Hub
        raise ConvertError(f"model not found: {model} (no such directory: {p.parent}/ has no {p.name})")
    return _download(model)


def instruct_of(name: str) -> bool | None:
    """Whether a model, by its name, is chat-tuned (True: Instruct, -it, Chat), pretrained (False: -Base, -pt) or
    unknown (None). Recorded in the manifest (base.instruct): tale-run feeds a pretrained model raw text."""
    n = name.lower()
    if re.search(r"instruct|chat|-it\b|[-_]sft\b|[-_]dpo\b", n):
        return True
    if re.search(r"[-_]base\b|[-_]pt\b", n):
        return False
    return None


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
    return Source(path, hub_id, path.name, _license(path), instruct=instruct_of(hub_id.split("/")[-1]))


def _license(path: Path) -> str | None:
    card = path / "README.md"
    if not card.is_file():
        return None
    m = re.search(r"\A---\n.*?^license:\s*(\S+)\s*$.*?^---", card.read_text(errors="replace"), re.M | re.S)
    return m.group(1).strip("'\"") if m else None


def load_config(src: Source, group: int):
    from transformers import AutoConfig

    if (src.path / MANIFEST).is_file():  # its config.json says model_type "tale": say what it is, not that
        raise ConvertError(f"{src.id} is already a TALE artifact ({MANIFEST}): convert the original checkpoint")
    try:
        raw = json.loads((src.path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConvertError(f"{src.id}: cannot read config.json: {str(e).splitlines()[0]}") from None
    # an unsupported family is refused before transformers is asked to build its config (it may not know it)
    if why := families.unsupported(None, raw if isinstance(raw, dict) else {}):
        raise ConvertError(why)
    try:
        config = AutoConfig.from_pretrained(src.path, trust_remote_code=False)  # never a prompt about custom code
    except (OSError, ValueError, KeyError) as e:
        raise ConvertError(f"{src.id}: cannot read config.json: {str(e).splitlines()[0]}") from None
    return config, check_config(config, group)


def check_config(config, group: int) -> Arch:
    if why := families.unsupported(config):
        raise ConvertError(why)
    if getattr(config, "quantization_config", None):
        raise ConvertError("quantized checkpoints are not supported: convert the full-precision model")
    H, K, d = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
    n = families.head_dim(config)
    if H % K:
        raise ConvertError(f"num_attention_heads {H} is not a multiple of num_key_value_heads {K}")
    if group < 1 or K % group:
        raise ConvertError(f"--group {group} must divide the number of KV heads ({K})")
    if group * n > d:
        raise ConvertError(f"--group {group} gives latent rank {group * n} > hidden size {d}: use a smaller group")
    return Arch.from_config(config, group)


def load_model(src: Source):
    """The whole model in host memory: only --policy fisher needs it (gradients through every layer)."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(src.path, dtype="auto", attn_implementation="sdpa")
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ConvertError(f"{src.id}: cannot load the model: {str(e).splitlines()[0]}") from None
    return model.eval().requires_grad_(False)


def generation_config(src: Source, config):
    """generation_config.json, or what transformers derives from config.json without one."""
    from transformers import GenerationConfig

    if (src.path / "generation_config.json").is_file():
        try:
            return GenerationConfig.from_pretrained(src.path)
        except (OSError, ValueError) as e:
            raise ConvertError(f"{src.id}: cannot read generation_config.json: {str(e).splitlines()[0]}") from None
    return GenerationConfig.from_model_config(config)


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
    if layers is None or len(layers) != arch.num_layers or not hasattr(model.model, "rotary_emb"):
        raise ConvertError("unsupported model layout: expected model.model.layers and model.model.rotary_emb")
    d, H, K, n = arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim
    if families.fused_qkv(model.config):
        want = {"qkv_proj": ((H + 2 * K) * n, d)}
    else:
        want = {"q_proj": (H * n, d), "k_proj": (K * n, d), "v_proj": (K * n, d)}
    want["o_proj"] = (d, H * n)
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None or not isinstance(getattr(layer, "input_layernorm", None), torch.nn.Module):
            raise ConvertError(f"unsupported attention layout in layer {i}: expected self_attn and input_layernorm")
        for name, shape in want.items():
            lin = getattr(attn, name, None)
            if not isinstance(lin, torch.nn.Linear) or tuple(lin.weight.shape) != shape:
                raise ConvertError(f"unsupported attention layout in layer {i}: {name} is not a Linear {shape}")


def skeleton(config):
    """The model on the meta device (no memory): tensor names, shapes and order, and the module
    code that calibration runs one layer at a time."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


INDEX = "model.safetensors.index.json"
IGNORED = re.compile(r".*\.rotary_emb\.inv_freq")  # a buffer some old checkpoints store; transformers drops it
CHUNK_BYTES = 256 << 20  # big pass-through tensors (embeddings, head) are read in row chunks of this size


@dataclass
class Checkpoint:
    """The source weights, read lazily: only safetensors headers are parsed up front.

    Each read opens its shard and closes it again, so the memory map (which counts towards RSS
    once touched) never outlives one layer."""

    files: dict[str, Path]  # tensor name -> shard
    shapes: dict[str, tuple[int, ...]]
    dtype: torch.dtype  # what transformers' from_pretrained(dtype="auto") would load it as

    def read(self, names: list[str], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for shard in dict.fromkeys(self.files[n] for n in names):
            with safe_open(shard, "pt") as st:
                for n in names:
                    if self.files[n] == shard:
                        out[n] = st.get_tensor(n).to(device=device, dtype=self.dtype)
        return out

    def chunks(self, name: str, dtype: torch.dtype) -> Iterator[torch.Tensor]:
        """`name` cast to `dtype` in row chunks of about CHUNK_BYTES (its bytes in order)."""
        shape = self.shapes[name]
        row = max(1, torch.Size(shape[1:]).numel()) * torch.finfo(self.dtype).bits // 8
        step = max(1, CHUNK_BYTES // row)
        for a in range(0, shape[0] if shape else 1, step):
            with safe_open(self.files[name], "pt") as st:
                t = st.get_slice(name)[a : a + step] if shape else st.get_tensor(name)
            yield t.to(self.dtype).to(dtype)


def open_checkpoint(src: Source, config, expected: dict[str, tuple[int, ...]]) -> Checkpoint:
    """Index the safetensors shards of `src` and check them against `expected` (name -> shape from
    config.json) before any work: truncated shards, missing/unexpected tensors, wrong shapes, and a
    TALE artifact passed as the source are all refused."""
    root = src.path
    if (root / MANIFEST).is_file():
        raise ConvertError(f"{src.id} is already a TALE artifact ({MANIFEST}): convert the original checkpoint")
    index = root / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ConvertError(f"{index}: corrupt safetensors index") from None
    else:
        weight_map = None
        shards = sorted(f.name for f in root.glob("*.safetensors"))
        if not shards:
            bins = sorted(f.name for f in root.iterdir() if f.name.endswith((".bin", ".pt", ".pth")))
            what = f"only {bins[0]}" if bins else "no weight files"
            raise ConvertError(
                f"{src.id}: no *.safetensors weights ({what}); tale-convert streams safetensors "
                "checkpoints only (save the model with save_pretrained(safe_serialization=True))"
            )
    files: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for name in shards:
        f = root / name
        if not f.is_file():
            raise ConvertError(f"{src.id}: shard {name} is missing (incomplete download?)")
        try:
            with safe_open(f, "pt") as st:
                for k in st.keys():
                    sl = st.get_slice(k)
                    files[k], shapes[k] = f, tuple(sl.get_shape())
                    dtypes[k] = _DTYPES.get(sl.get_dtype(), torch.uint8)
        except (SafetensorError, OSError) as e:
            raise ConvertError(
                f"{src.id}: shard {name} is unreadable, truncated or partially downloaded ({e})"
            ) from None
    if weight_map is not None:
        wrong = [k for k, v in weight_map.items() if files.get(k) != root / v]
        if wrong:
            raise ConvertError(f"{index.name} does not match the shards: {wrong[0]} is not in {weight_map[wrong[0]]}")
    for k in [k for k in files if IGNORED.fullmatch(k)]:
        del files[k], shapes[k]
    tale = [k for k in files if ".tale." in k]
    no_v = not any(k.endswith((".v_proj.weight", ".qkv_proj.weight")) for k in files) and any(
        k.endswith("q_proj.weight") for k in files
    )
    if tale or no_v:
        raise ConvertError(
            f"{src.id} looks like a TALE artifact ({tale[0] if tale else 'no v_proj.weight'}): "
            "convert the original checkpoint"
        )
    tied = getattr(config, "tie_word_embeddings", False)
    if tied and "lm_head.weight" not in expected:
        files.pop("lm_head.weight", None)  # stored although tied: transformers ignores it too
        shapes.pop("lm_head.weight", None)
    missing = [k for k in expected if k not in files]
    unexpected = [k for k in files if k not in expected]
    if missing:
        raise ConvertError(f"{src.id}: {len(missing)} tensors that config.json implies are missing, e.g. {missing[0]}")
    if unexpected:
        raise ConvertError(f"{src.id}: {len(unexpected)} tensors that config.json does not know, e.g. {unexpected[0]}")
    for k, shape in expected.items():
        if shapes[k] != tuple(shape) and k.endswith(".qkv_proj.weight"):
            H, K, n = config.num_attention_heads, config.num_key_value_heads, families.head_dim(config)
            raise ConvertError(
                f"{src.id}: fused {k} has {shapes[k][0]} rows x {shapes[k][1]}; config.json implies (H + 2 K) n = "
                f"({H} + 2*{K}) * {n} = {shape[0]} rows (queries, keys, values) x {shape[1]}"
            )
        if shapes[k] != tuple(shape):
            raise ConvertError(f"{src.id}: tensor {k} has shape {list(shapes[k])}, config.json implies {list(shape)}")
    order = list(expected)  # state_dict order: the artifact is written in it
    return Checkpoint(
        {k: files[k] for k in order}, {k: shapes[k] for k in order}, _load_dtype(config, dtypes, expected)
    )


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _load_dtype(config, dtypes: dict[str, torch.dtype], expected) -> torch.dtype:
    """As from_pretrained(dtype="auto"): config.json's dtype, else the first floating tensor's."""
    d = getattr(config, "dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d.removeprefix("torch."), None)
    if isinstance(d, torch.dtype) and d.is_floating_point:
        return d
    return next((dtypes[k] for k in expected if dtypes[k].is_floating_point), torch.float32)
