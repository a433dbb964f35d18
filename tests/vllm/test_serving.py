"""vLLM serving of a TALE artifact on the CPU (stage 1: keys and latents in vLLM's 16-bit paged cache).

One engine per model, shared by the module's tests: the base model's greedy tokens are taken first (conftest.base_run,
once per session), then the TALE engine starts (in this process, one at a time)."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import ENGINE, PROMPTS, VLLM, default_artifact, greedy, kv_bytes_per_token, main_fixtures, shutdown

import tale_runtime.vllm as tale_vllm
from tale_runtime.artifact import ArtifactError

pytest.importorskip(VLLM)  # vLLM itself, not this test directory
import vllm  # noqa: E402


@pytest.fixture(scope="module")
def tale_llm(tiny_artifact, base_run):
    llm = vllm.LLM(**tale_vllm.engine_args(tiny_artifact), **ENGINE)
    yield llm
    shutdown(llm)


def test_tale_model_class_serves_the_artifact(tale_llm):
    names = tale_llm.apply_model(lambda m: type(m).__name__)
    assert names == ["TaleLlamaForCausalLM"]


def test_full_rank_greedy_tokens_equal_the_base_model(tale_llm, base_run):
    base_tokens, _ = base_run
    assert len({len(tale_llm.get_tokenizer()(p).input_ids) for p in PROMPTS}) == len(PROMPTS)  # different lengths
    assert greedy(tale_llm) == base_tokens


FAMILIES = [
    ("qwen3_32", "TaleQwen3ForCausalLM"),
    ("phi3_32", "TalePhi3ForCausalLM"),
    ("gemma3", "TaleGemma3ForCausalLM"),
]


@pytest.mark.parametrize("arch,cls", FAMILIES)
def test_other_families_full_rank_greedy_tokens_equal_the_base_model(tmp_path, arch, cls):
    """Qwen3's per-head q/k norms before RoPE (in TaleAttention); Phi-3's fused qkv_proj and gate_up_proj handed to
    vLLM's Llama layer unfused, and its RoPE over half of each head; Gemma 3's own layer with TaleAttention in it (its
    scale, (1 + w) norms, a sliding layer with a local RoPE base, a global one): at full rank the base model's greedy
    tokens under vLLM (vLLM's own class of the family; two engines, one after the other)."""
    base = main_fixtures.save_tiny(tmp_path / arch, arch, main_fixtures.tiny_tokenizer())
    llm = vllm.LLM(model=str(base), **ENGINE)
    want = greedy(llm)
    shutdown(llm)
    llm = vllm.LLM(**tale_vllm.engine_args(default_artifact(base, tmp_path / f"{arch}-tale")), **ENGINE)
    try:
        assert llm.apply_model(lambda m: type(m).__name__) == [cls]
        assert greedy(llm) == want
    finally:
        shutdown(llm)


def test_kv_bytes_per_token(tale_llm, base_run, tiny_artifact, capsys):
    _, base = base_run
    tale = kv_bytes_per_token(tale_llm)
    a = json.loads((tiny_artifact / "tale_config.json").read_text())["architecture"]
    L, K, n = a["num_layers"], a["num_kv_heads"], a["head_dim"]
    bf16 = L * 2 * K * n * 2  # the base model's 16-bit keys and values
    with capsys.disabled():  # shown without -s
        print(f"\nKV bytes/token: TALE {tale}, base {base} (fp32 cache), bf16 base {bf16}: base/TALE {base / tale:.2f}")
    # group 1, full rank: the value of a head is its latent of rank n, so the cache is the base model's
    assert tale == base == L * 2 * K * n * 4


def test_corrupt_artifact_refused_in_one_line(tiny_artifact, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_artifact, bad)
    shard = sorted(bad.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-8] + b"\0" * 8)  # the last bytes of a tensor changed
    with pytest.raises(ArtifactError, match=rf"checksum mismatch for {shard.name} \(file corrupt or modified\)") as e:
        tale_vllm.engine_args(bad)
    assert "\n" not in str(e.value)


def test_non_tale_directory_refused_in_one_line(tiny_llama):
    with pytest.raises(ArtifactError, match=r"not a TALE artifact") as e:
        tale_vllm.engine_args(tiny_llama)
    assert "\n" not in str(e.value)
