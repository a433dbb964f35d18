"""Fixtures of the vLLM tests (make test-vllm, in .venv-vllm): a tiny random Llama and its TALE artifact.

vLLM's CPU attention takes head sizes from 32 up, so the model is tests/conftest.py's tiny Llama with head_dim 32,
built by the same save_tiny and converted with the same tiny converter options."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from tale_runtime.vllm import kv_bytes_per_token, shutdown  # noqa: F401  (the engine tests import them from here)

# the engine on a small shared CPU: in this process (one engine at a time, the model reachable by apply_model),
# threads unpinned, a small cache
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# what the engine tests import-or-skip: `import vllm` alone finds this directory as a namespace package where vLLM is
# not installed (tests/ is on sys.path), so they ask for a module only vLLM has
VLLM = "vllm.v1.attention.backend"

_spec = importlib.util.spec_from_file_location("tale_tests_conftest", Path(__file__).parents[1] / "conftest.py")
main_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(main_fixtures)

# llama at two layers, with 4 heads of 32 (2 KV heads)
main_fixtures.TINY["llama32"] = dict(
    main_fixtures.TINY["llama"], num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32
)
# three layers: the middle one packed between two 16-bit ones (slots of two sizes in one engine)
main_fixtures.TINY["llama32x3"] = dict(main_fixtures.TINY["llama32"], num_hidden_layers=3)
# Qwen3 (per-head q/k norms, randomized by save_tiny) and Phi-3 (fused qkv_proj and gate_up_proj, RoPE on half of
# each head) at the same sizes
main_fixtures.TINY["qwen3_32"] = dict(main_fixtures.TINY["llama32"], model_type="qwen3")
main_fixtures.TINY["phi3_32"] = dict(
    main_fixtures.TINY["llama32"], model_type="phi3", partial_rotary_factor=0.5, pad_token_id=0
)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return main_fixtures.save_tiny(tmp_path_factory.mktemp("tiny-llama32"), "llama32", main_fixtures.tiny_tokenizer())


@pytest.fixture(scope="session")
def tiny_artifact(tiny_llama, tmp_path_factory) -> Path:
    """group 1: each KV head's latent has the head's rank 32, so values keep vLLM's one head size (CPU attention). At
    tale-convert's default preset (lowrank: its key basis ships in the artifact; vLLM's pages hold plain keys)."""
    return default_artifact(tiny_llama, tmp_path_factory.mktemp("art") / "tiny-llama32-tale")


def default_artifact(base: Path, out: Path) -> Path:
    """`base` converted at group 1 with tale-convert's default preset (the tiny converter options otherwise)."""
    from tale_convert.convert import Options, convert

    opts = {k: v for k, v in main_fixtures.TINY_OPTS.items() if k not in ("preset", "residual")}
    convert(str(base), out, Options(group=1, **opts))
    assert (out / "key_basis.safetensors").is_file()
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


PROMPTS = [
    "The",
    "Once upon a time there was",
    "The capital of France is a city that many people visit every year because",
    "In the beginning the printing museum had only one press, and the code that opened its archive was",
]
ENGINE = dict(dtype="float32", max_model_len=128, enforce_eager=True, max_num_seqs=4, seed=0)


def greedy(llm, prompts=PROMPTS, max_tokens: int = 12, logprobs: int | None = None):
    """Greedy token ids per prompt (and, with `logprobs`, vLLM's top log-probabilities of each step)."""
    import vllm

    params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    tokens = [list(o.token_ids) for o in outs]
    return tokens if logprobs is None else (tokens, [o.logprobs for o in outs])


@pytest.fixture(scope="session")
def base_run(tiny_llama):
    """The base model under vLLM: greedy tokens of PROMPTS and KV bytes per token."""
    import vllm

    llm = vllm.LLM(model=str(tiny_llama), **ENGINE)
    out = greedy(llm), kv_bytes_per_token(llm)
    shutdown(llm)
    return out
