"""The real model: the SmolLM2-135M-Instruct checkpoint and its TALE artifact (--preset paper, g=3),
checked from the written files against the base model."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tale_convert.bundled import SMOLLM2
from tale_runtime.artifact import O_FUSED, U_V, V_V, Schedule, read_manifest, verify_files

pytestmark = pytest.mark.slow
L, H, K, n, d, g = 30, 9, 3, 64, 576, 3
R = g * n


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def base(smollm2_path):
    return load_file(smollm2_path / "model.safetensors")


@pytest.fixture(scope="module")
def art(smollm2_paper_artifact):
    m = read_manifest(smollm2_paper_artifact)
    out = {}
    for f in (f for f in m["files"] if f.endswith(".safetensors")):  # the manifest hashes every file
        out.update(load_file(smollm2_paper_artifact / f))
    return out


def test_checkpoint(smollm2_path, base):
    from transformers import AutoConfig, AutoTokenizer

    c = AutoConfig.from_pretrained(smollm2_path)
    got = (c.model_type, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size)
    assert got == ("llama", L, H, K, n, d)
    assert c.tie_word_embeddings and "lm_head.weight" not in base
    assert {t.dtype for t in base.values()} == {torch.bfloat16}
    assert getattr(c, "quantization_config", None) is None
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_manifest(smollm2_paper_artifact):
    m = read_manifest(smollm2_paper_artifact)
    verify_files(smollm2_paper_artifact, m)
    a = m["architecture"]
    assert (a["group_size"], a["num_groups"], a["latent_rank"], a["num_layers"]) == (g, 1, R, L)
    s = Schedule.from_dict(m["schedule"])
    assert s.ranks == [[R // 2, R]] * L and s.sinks == 4
    bits = 0.9 * (2 * n + 2 * 96 / g) + 0.1 * (4 * n + 4 * R / g)  # per token and KV head (DESIGN.md 1)
    assert m["nominal_ratio"] == pytest.approx(32 * n / bits, abs=1e-4)
    assert m["base"]["id"] == SMOLLM2.hub_id and m["base"]["license"] == "apache-2.0"
    assert any(f.endswith(".gguf") for f in m["base"]["files"])
    assert (m["calibration"]["samples"], m["calibration"]["seq_len"]) == (64, 512)
    assert all(0.5 < e0 < 1 for e0, _ in m["energy_kept"])
    assert (smollm2_paper_artifact / "README.md").read_text().startswith(f"---\nbase_model: {SMOLLM2.hub_id}\n")


def test_factors_reproduce_base_weights(art, base):
    """bf16 storage: the products match to bf16 precision."""
    for i in range(L):
        p = f"model.layers.{i}.self_attn."
        A, B, Of = art[p + U_V][0].double(), art[p + V_V][0].double(), art[p + O_FUSED].double()
        assert rel(A @ B, base[p + "v_proj.weight"].T) < 1e-2
        Wo = base[p + "o_proj.weight"].T.double()
        for q in range(H):
            j = (q // (H // K)) % g
            assert rel(Of.T[q * R : (q + 1) * R], B[:, j * n : (j + 1) * n] @ Wo[q * n : (q + 1) * n]) < 1e-2


def test_whitening_beats_plain_svd_on_heldout_text(art, base, smollm2_path, smollm2_paper_artifact):
    """Truncated to r0, the whitened factors lose less of X W_V than plain SVD of W_V, where X are
    v_proj inputs of held-out text (not in the calibration set) through the base model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tale_calib import documents, heldout_path

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    ids = tok("\n\n".join(documents(heldout_path())), return_tensors="pt").input_ids[:, :1024]
    X = {}
    hooks = [
        layer.self_attn.v_proj.register_forward_pre_hook(lambda mod, a, i=i: X.__setitem__(i, a[0][0].double()))
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    r = read_manifest(smollm2_paper_artifact)["schedule"]["ranks"][0][0]
    ratios = []
    for i in range(L):
        p = f"model.layers.{i}.self_attn."
        W = base[p + "v_proj.weight"].T.double()
        A, B = art[p + U_V][0].double(), art[p + V_V][0].double()
        U, S, Vh = torch.linalg.svd(W, full_matrices=False)
        whitened = (X[i] @ (W - A[:, :r] @ B[:r])).norm()
        plain = (X[i] @ (W - U[:, :r] * S[:r] @ Vh[:r])).norm()
        ratios.append(float(whitened / plain))
    assert max(ratios) < 0.9, ratios  # measured: 0.49 .. 0.78
    assert sum(ratios) / L < 0.8, ratios
