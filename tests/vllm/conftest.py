"""Fixtures of the vLLM tests (make test-vllm, in .venv-vllm): a tiny random Llama and its TALE artifact.

vLLM's CPU attention takes head sizes from 32 up, so the model is tests/conftest.py's tiny Llama with head_dim 32,
built by the same save_tiny and converted with the same tiny converter options."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

# the engine on a small shared CPU: in this process (one engine at a time, the model reachable by apply_model),
# threads unpinned, a small cache
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

_spec = importlib.util.spec_from_file_location("tale_tests_conftest", Path(__file__).parents[1] / "conftest.py")
main_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(main_fixtures)

main_fixtures.TINY["llama32"] = dict(
    model_type="llama",
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return main_fixtures.save_tiny(tmp_path_factory.mktemp("tiny-llama32"), "llama32", main_fixtures.tiny_tokenizer())


@pytest.fixture(scope="session")
def tiny_artifact(tiny_llama, tmp_path_factory) -> Path:
    """group 1: each KV head's latent has the head's rank 32, so values keep vLLM's one head size (CPU attention)."""
    from tale_convert.convert import Options, convert

    out = tmp_path_factory.mktemp("art") / "tiny-llama32-tale"
    convert(str(tiny_llama), out, Options(group=1, **main_fixtures.TINY_OPTS))
    return out


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """Factory: converted(arch, group) -> (base checkpoint, artifact), arch in tests/conftest.py's TINY."""
    from tale_convert.convert import Options, convert

    tok = main_fixtures.tiny_tokenizer()
    built: dict = {}

    def make(arch: str, group: int) -> tuple[Path, Path]:
        if (arch, group) not in built:
            base = main_fixtures.save_tiny(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, tok)
            out = tmp_path_factory.mktemp("art") / f"{arch}-g{group}"
            convert(str(base), out, Options(group=group, **main_fixtures.TINY_OPTS))
            built[arch, group] = base, out
        return built[arch, group]

    return make
