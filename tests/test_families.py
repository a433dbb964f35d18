"""Qwen3, Gemma 3 (text) and Phi-3 end to end (tale_runtime.families), from tiny random checkpoints through
tale-convert: at exact settings the TALE model gives the base model's greedy tokens and logits (dynamic and static
cache), the default schedule compresses, the calibration sees what the model sees, and what TALE does not support is
refused in one line with nothing written."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import TINY, TINY_GROUP, TINY_OPTS
from tale_helpers import exact_schedule, feed, talify, tiny_model
from test_convert_cli import TINY_ARGS, assert_bad

from tale_convert import calibrate, stats
from tale_runtime import ArtifactError, families, load, new_cache
from tale_runtime.artifact import read_manifest
from tale_runtime.model import cache_arg

FAMILIES = ["qwen3", "gemma3", "phi3"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def ids_for(T: int, B: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 320, (B, T), generator=torch.Generator().manual_seed(seed))  # both tiny vocabularies


def base_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("arch", FAMILIES)
def test_exact_settings_give_the_base_models_tokens_and_logits(arch, converted, tiny_model_dir):
    """r0 = R and 16 bits everywhere: the prefill is the base model's bit for bit, and 50 greedy steps (past Gemma 3's
    sliding window of 64) give its tokens and logits, over the dynamic and the static cache."""
    path = converted[arch]
    base = base_model(tiny_model_dir(arch))
    a = read_manifest(path)["architecture"]
    model, _ = load(path, device="cpu", dtype=torch.float32, schedule=exact_schedule(a["latent_rank"], a["num_layers"]))
    ids = ids_for(30)
    with torch.no_grad():
        assert torch.equal(model(ids, **cache_arg(new_cache(model))).logits, base(ids).logits)
    kw = dict(max_new_tokens=50, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    want = base.generate(ids, **kw)  # transformers' own cache
    for static in (False, True):
        got = model.generate(ids, **cache_arg(new_cache(model, static=static)), **kw)
        assert torch.equal(got.sequences, want.sequences), static
        assert rel(torch.stack(got.logits), torch.stack(want.logits)) < 1e-4, static


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_default_schedule_generates_and_compresses(arch, converted):
    model, _ = load(converted[arch], device="cpu", dtype=torch.float32)
    assert model.tale_spec.schedule.levels[0].bits == 2  # the paper preset
    for static in (False, True):
        cache = new_cache(model, static=static)
        out = model.generate(ids_for(60), **cache_arg(cache), max_new_tokens=100, do_sample=False, pad_token_id=0)
        assert out.shape == (1, 160)
        # against what transformers' cache holds (Gemma 3's sliding layer: its last 63 tokens). The dynamic cache
        # drops what a window cannot read; the static one holds the sliding layer's last 63 tokens exact, here in
        # float32 (twice the 16-bit baseline's bytes: only the global layer compresses)
        ratio = cache.baseline_nbytes() / cache.nbytes()
        assert ratio > (1.0 if static and arch == "gemma3" else 1.5), (static, ratio)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_the_lowrank_preset_decodes_alike_through_both_caches(arch, tiny_model_dir, tmp_path):
    """tale-convert's default preset (keys before RoPE, low-rank middle keys, 3-bit latents) on the families without
    sliding layers: the static cache (what generate() takes on a GPU) gives the dynamic cache's greedy tokens and
    logits, past demotions into the low-rank level. (Sliding layers differ by design: the static cache holds them
    as 16-bit rings of their window, the dynamic one compresses what the window still reads; Gemma 3's static cache
    is checked at exact settings above.)"""
    from tale_convert.convert import Options, convert

    path = tmp_path / "tale"
    convert(str(tiny_model_dir(arch)), path, Options(group=TINY_GROUP[arch], **(TINY_OPTS | {"preset": "lowrank"})))
    model, _ = load(path, device="cpu", dtype=torch.float32)
    assert model.tale_spec.schedule.levels[0].key_rank > 0
    kw = dict(max_new_tokens=40, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    outs = []
    for static in (False, True):
        cache = new_cache(model, static=static)
        outs.append(model.generate(ids_for(60), **cache_arg(cache), **kw))
        if not static:
            assert cache.baseline_nbytes() / cache.nbytes() > 1.5
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert rel(torch.stack(outs[1].logits), torch.stack(outs[0].logits)) < 1e-5


@pytest.mark.parametrize("arch", FAMILIES)
def test_calibration_sees_what_the_model_sees(arch, tiny_model_dir):
    """The converter's layer-by-layer pass (scaled embeddings, each layer's RoPE) reproduces the model's hidden states,
    so the covariance is taken over the inputs the value rows really see."""
    base = base_model(tiny_model_dir(arch))
    ids = ids_for(16, B=2)
    with torch.no_grad():
        want = base(ids, output_hidden_states=True).hidden_states
    hidden = calibrate.embed(base.model.embed_tokens.weight, ids, families.embed_scale(base))
    rope = calibrate.rotary(base, 16, torch.device("cpu"))
    assert rel(hidden, want[0]) < 1e-6
    for i, layer in enumerate(base.model.layers):
        calibrate.run_layer(layer, hidden, rope[i], i, covariance=False)
        if i + 1 < len(base.model.layers):  # the last entry of hidden_states is after the final norm
            assert rel(hidden, want[i + 1]) < 1e-5, i


def test_key_statistics_see_the_normed_keys():
    """key_moments (the key basis) reads keys after Qwen3's k_norm, before RoPE: what the cache holds before RoPE."""
    base = tiny_model("qwen3")
    tm = talify(base, 2)
    ids = ids_for(12, B=2)
    seen = []
    hook = base.model.layers[1].self_attn.k_norm.register_forward_hook(lambda m, a, out: seen.append(out))
    with torch.no_grad():
        base(ids)
    hook.remove()
    k = seen[0][:, 4:].flatten(0, 1).flatten(1).double()  # [B T, K n] without the sinks
    m2, mean, _ = stats.key_moments(tm, [ids], skip=4)[1]
    assert rel(mean, k.mean(0)) < 1e-6 and rel(m2, k.T @ k / len(k)) < 1e-6


@pytest.mark.parametrize("arch,g", [("gemma3", 2), ("phi3", 1)])
def test_keys_held_before_rope_reproduce_the_model(arch, g):
    """key_rope "pre" (the lowrank preset's keys) at exact settings decodes as the base model: Gemma 3's sliding and
    global layers rotate by their own bases, so each layer type keeps its own RoPE tables (the static cache holds its
    sliding layer as a ring of keys after RoPE, so its one set of tables is the global layers'); Phi-3 rotates half of
    each head (partial rotary), and only that half is undone and redone, over the dynamic and the static cache."""
    base = tiny_model(arch)
    tm = talify(base, g)
    a = tm.tale_spec.arch
    tm.tale_spec.schedule = replace(exact_schedule(a.latent_rank, a.num_layers), key_rope="pre")
    ids = ids_for(40)
    with torch.no_grad():
        ref = base(ids).logits[:, 11:-1]
    for static in (False, True):
        cache = new_cache(tm, static=static, max_length=40 if static else None)
        assert rel(feed(tm, ids, cache, 12)[:, :-1], ref) < 1e-4, static
        if static:  # its RoPE tables hold the rotated channels only
            assert cache.rope_width == a.rotary_dim == a.head_dim // (2 if arch == "phi3" else 1)
    cache = new_cache(tm)
    with torch.no_grad():
        tm(ids[:, :12], **cache_arg(cache))
    if arch == "gemma3":
        assert set(cache.ropes) == {"sliding_attention", "full_attention"}
        assert not torch.equal(cache.ropes["sliding_attention"].cos, cache.ropes["full_attention"].cos)
    else:
        assert cache.ropes[None].cos.shape[-1] == a.head_dim // 2 == a.rotary_dim


def _config_dir(tmp_path, name: str, config) -> str:
    d = tmp_path / name
    config.save_pretrained(d)
    return d


@pytest.mark.parametrize("case", ["other-family", "gemma2", "gemma3-multimodal"])
def test_unsupported_families_are_refused(case, tmp_path, capsys):
    from transformers import Gemma2Config, Gemma3Config, GPTNeoXConfig

    src, match = {
        "other-family": (
            GPTNeoXConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2),
            "unsupported architecture 'gpt_neox': supported families are llama, mistral, qwen2, qwen3, gemma3_text, phi3",
        ),
        "gemma2": (Gemma2Config(num_hidden_layers=1), "Gemma 2 (model_type 'gemma2') is not supported"),
        "gemma3-multimodal": (Gemma3Config(), "multimodal Gemma 3 checkpoint"),
    }[case]
    d = _config_dir(tmp_path, case, src)
    assert_bad([d, *TINY_ARGS, "--out", tmp_path / "out"], capsys, tmp_path, match)


def test_a_phi3_whose_fused_rows_do_not_match_its_config_is_refused(tiny_model_dir, tmp_path, capsys):
    import shutil

    src = shutil.copytree(tiny_model_dir("phi3"), tmp_path / "phi3")
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_key_value_heads"] = 3  # the checkpoint's qkv_proj holds (6 + 2*2) heads of 16 rows
    (src / "config.json").write_text(json.dumps(cfg))
    assert_bad(
        [src, *TINY_ARGS, "--group", "1", "--out", tmp_path / "out"],
        capsys,
        tmp_path,
        "fused model.layers.0.self_attn.qkv_proj.weight has 160 rows x 96; config.json implies (H + 2 K) n = "
        "(6 + 2*3) * 16 = 192 rows",
    )


def test_the_runtime_refuses_attention_soft_capping(converted, tmp_path):
    import shutil

    from tale_runtime.artifact import hash_files, write_json

    path = shutil.copytree(converted["gemma3"], tmp_path / "capped")
    cfg = json.loads((path / "config.json").read_text())
    cfg["attn_logit_softcapping"] = 50.0
    (path / "config.json").write_text(json.dumps(cfg))
    manifest = json.loads((path / "tale_config.json").read_text())
    manifest["files"] = hash_files(path)
    write_json(path / "tale_config.json", manifest)
    with pytest.raises(ArtifactError, match="soft-capping .* is not supported"):
        load(path, device="cpu")


def test_tiny_configs_are_the_families_they_stand_for():
    """The tiny checkpoints exercise what differs: q/k norms, query_pre_attn_scalar, two RoPE bases, partial rotary."""
    assert set(FAMILIES) <= set(TINY) and all(TINY_GROUP[a] for a in FAMILIES) and TINY_OPTS["seq_len"] <= 64
    g3 = tiny_model("gemma3")
    a = g3.model.layers[0].self_attn
    assert a.scaling == 24**-0.5 and a.sliding_window == 24 and g3.model.layers[1].self_attn.sliding_window is None
    assert families.rotary_dim(tiny_model("phi3").config) == 8
