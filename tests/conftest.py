"""Shared fixtures.

- tiny_model_dir(arch): a tiny random checkpoint directory (config, safetensors, tokenizer) of
  each supported architecture, built offline once per session.
- smollm2_path: the real SmolLM2-135M-Instruct checkpoint (built once per machine, cached).
- smollm2_artifact: SmolLM2 converted at tale-convert's default schedule (the lowrank preset) and --group 3, once per
  machine (cached under TALE_CACHE, keyed by the converter settings and sources); smollm2_paper_artifact: the same at
  --preset paper.
- gemma3_path, gemma3_artifact: the same for Gemma 3 270M (bundled GGUF, --group 1).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

# tests/vllm runs in vLLM's own venv (make test-vllm); the main suite has no vLLM (tests/ is on sys.path, so
# tests/vllm itself is found as a namespace package: only a module with a file counts)
_vllm = importlib.util.find_spec("vllm")
collect_ignore = [] if _vllm is not None and _vllm.origin not in (None, "namespace") else ["vllm"]
# tests/kvpress runs in kvpress's venv (make test-kvpress); likewise left out where kvpress is not installed
_kvpress = importlib.util.find_spec("kvpress")
if _kvpress is None or _kvpress.origin in (None, "namespace"):
    collect_ignore.append("kvpress")

# Without a GPU the Triton kernels are tested in Triton's CPU interpreter, which must be chosen
# before anything imports triton (transformers and torch may, during collection).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist workers (make test): one CPU thread each, the CLIs they start included, or the workers oversubscribe
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

from tiny_configs import CHECKPOINT as TINY  # noqa: E402  (a data module: imports nothing)

TINY_GROUP = {"llama": 2, "mistral": 2, "qwen2": 1, "mha": 2, "qwen3": 2, "gemma3": 2, "phi3": 1}
TINY_VOCAB = 512
EOS = "<|endoftext|>"
# Converter options that fit the tiny models (latent ranks 16..64) and run in about a second.
# the paper preset's plain layout (the tests of other presets override it: dict(TINY_OPTS, preset=...))
TINY_OPTS = dict(samples=8, seq_len=64, dtype="fp32", key_group=8, value_group=8, residual=8, preset="paper")


def tiny_tokenizer():
    """A byte-level BPE tokenizer trained on the bundled corpus, with a chat template: no network."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tale_calib import calib_paths, documents

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS],
        show_progress=False,
    )
    t.train_from_iterator([d for p in calib_paths() for d in documents(p)], trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token=EOS)
    tok.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return tok


def save_tiny(path: Path, arch: str, tokenizer, seed: int = 0, edit=None) -> Path:
    """Save a random-init tiny model of `arch`; `edit(model)` may change weights first."""
    from tale_helpers import random_model  # imports transformers: not before TRITON_INTERPRET is set above

    eos = tokenizer.eos_token_id
    model = random_model(
        TINY[arch], seed, vocab_size=TINY_VOCAB, max_position_embeddings=512, eos_token_id=eos, bos_token_id=eos
    )
    if edit:
        edit(model)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if arch == "llama":  # a base model card: its license must reach the artifact's card
        (path / "README.md").write_text("---\nlicense: mit\n---\n# tiny llama\n")
    return path


@pytest.fixture(scope="session")
def tiny_tok():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tok):
    """Factory: tiny_model_dir(arch) -> checkpoint dir, arch in TINY (llama, mistral, qwen2, mha, qwen3, gemma3, phi3)."""
    built: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in built:
            built[arch] = save_tiny(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, tiny_tok)
        return built[arch]

    return make


class _Converted(dict):
    """arch -> an fp32 conversion of the tiny model of `arch` (TINY_OPTS, TINY_GROUP), made at the first use."""

    def __init__(self, tiny_model_dir, tmp_path_factory):
        super().__init__()
        self.src, self.tmp = tiny_model_dir, tmp_path_factory

    def __missing__(self, arch: str) -> Path:
        from tale_convert.convert import Options, convert

        path = self.tmp.mktemp(f"art-{arch}") / "tale"
        convert(str(self.src(arch)), path, Options(group=TINY_GROUP[arch], **TINY_OPTS))
        self[arch] = path
        return path


@pytest.fixture(scope="session")
def converted(tiny_model_dir, tmp_path_factory):
    """converted[arch]: the tiny model of `arch` converted once per session (test_convert.py, test_families.py)."""
    return _Converted(tiny_model_dir, tmp_path_factory)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from tale_convert.bundled import SMOLLM2

    return SMOLLM2.path()


def _artifact_key(opts) -> str:
    """Changes whenever the artifact could: settings, converter sources, calibration corpus."""
    import tale_calib
    import tale_convert

    h = hashlib.sha256(json.dumps(asdict(opts), sort_keys=True, default=str).encode())
    conv, calib = Path(tale_convert.__file__).parent, Path(tale_calib.__file__).parent
    sources = sorted(conv.glob("*.py")) + sorted(calib.glob("*"))
    for f in sources:
        if f.is_file() and f.name not in ("push.py", "card.py"):  # neither changes the tensors
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def _bundled_artifact(alias: str, **opts) -> Path:
    """A bundled model converted at tale-convert's defaults (its own --group) or `opts`, built once per machine."""
    from tale_convert.bundled import MODELS, cache_root
    from tale_convert.convert import Options, convert

    opts = Options(**{"group": MODELS[alias].group, **opts})
    tag = f"{alias}-g{opts.group}"
    root = cache_root() / "artifacts"
    out = root / f"{tag}-{_artifact_key(opts)}"
    if (out / "tale_config.json").is_file():
        with contextlib.suppress(OSError):  # in use: the clean-up below spares builds used within the hour
            os.utime(out)
        return out
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{tag}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent sessions: one converts, the others reuse
        if not (out / "tale_config.json").is_file():
            convert(alias, out, opts)
            # older builds (other sources/settings), unless a session used one within the hour (it may still read it)
            for stale in root.glob(f"{tag}-*"):
                if stale != out and stale.is_dir() and time.time() - stale.stat().st_mtime > 3600:
                    shutil.rmtree(stale, ignore_errors=True)
    return out


@pytest.fixture(scope="session")
def smollm2_artifact(smollm2_path) -> Path:
    """SmolLM2-135M-Instruct as a TALE artifact: tale-convert's defaults (the lowrank preset), --group 3, built once
    per machine."""
    return _bundled_artifact("smollm2")


@pytest.fixture(scope="session")
def smollm2_paper_artifact(smollm2_path) -> Path:
    """SmolLM2-135M-Instruct at --preset paper (the paper's schedule, whose bytes the tests count), --group 3."""
    return _bundled_artifact("smollm2", preset="paper")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    from tale_convert.bundled import GEMMA3_270M

    return GEMMA3_270M.path()


@pytest.fixture(scope="session")
def gemma3_artifact(gemma3_path) -> Path:
    """Gemma 3 270M as a TALE artifact: tale-convert's defaults, --group 1 (one KV head), built once per machine, but
    calibrated on 8 x 256 tokens instead of 64 x 512 (a sixteenth of the time: the tests check the pipeline, not
    the quality; docs/quality.md measures the default conversion)."""
    return _bundled_artifact("gemma3-270m", samples=8, seq_len=256)
