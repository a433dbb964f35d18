"""The CPU decode path: what the dynamic cache keeps between steps changes nothing, the factored output path (the
CPU's default in float32) picks the fused one's tokens, and the CPU's default dtype follows its bf16 instructions.

- Every level store keeps its RoPE tables, view positions and the torch reference's dequantized keys and latents for
  as long as it lives (cache.Store.memo): the logits of every decode step, across flushes and demotions, are the
  ones of a cache that dequantizes everything at every step, bit for bit.
- The factored output path (B then W_O) gives the fused one's (O^r) greedy tokens and logits to float32 rounding.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_OPTS
from tale_helpers import feed
from test_runtime import ids_for

import tale_runtime.cache as cache_mod
from tale_convert.convert import Options, convert
from tale_runtime import load, new_cache
from tale_runtime.load import default_dtype, default_output_path


@pytest.fixture(scope="module", params=["lowrank", "paper"])
def artifact(request, tiny_model_dir, tmp_path_factory):
    """A tiny Llama converted at the default preset (low-rank middle keys held before RoPE, a per-token 8-bit tail,
    fp8 scales) and at the paper's (plain per-channel keys after RoPE)."""
    out = tmp_path_factory.mktemp("cpu") / request.param
    opts = dict(TINY_OPTS, preset=request.param) | ({"residual": None} if request.param == "lowrank" else {})
    convert(str(tiny_model_dir("llama")), out, Options(group=2, **opts))
    return out


def steps(model, ids: torch.Tensor, prefix: int):
    """Prefill ids[:, :prefix], then feed the rest one token at a time: the logits of every step and the cache."""
    cache = new_cache(model)
    return feed(model, ids, cache, prefix), cache


def test_kept_levels_decode_bit_for_bit_as_recomputed_ones(artifact, monkeypatch):
    model, _ = load(artifact, device="cpu", dtype=torch.float32)
    ids = ids_for(160)  # 100 decode steps: many flushes and demotions (key groups of 8 tokens)
    kept, cache = steps(model, ids, 60)
    # the stores the last step read (the middle, at least, changes only at demotions) kept what it dequantized
    memos = [st.memo for layer in cache.layers for st in layer.levels if st is not None and st.length]
    assert sum(("keys", torch.float32) in m and ("lat", torch.float32) in m for m in memos) >= len(cache.layers)
    monkeypatch.setattr(cache_mod, "_on_cpu", lambda q: False)  # nothing kept: every step dequantizes every level
    fresh, cache = steps(model, ids, 60)
    assert not any(("keys", torch.float32) in st.memo for layer in cache.layers for st in layer.levels if st)
    assert torch.equal(kept, fresh)


def test_factored_output_gives_the_fused_tokens(artifact):
    fused, _ = load(artifact, device="cpu", dtype=torch.float32, output_path="fused")
    factored, _ = load(artifact, device="cpu", dtype=torch.float32)  # the CPU's default in float32
    assert factored.model.layers[0].self_attn.output_path == "factored"
    assert factored.model.layers[0].self_attn.tale.o_fused.numel() == 0  # O^r not even loaded
    ids = ids_for(120)
    a, _ = steps(fused, ids, 60)
    b, _ = steps(factored, ids, 60)
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_cpu_defaults(monkeypatch):
    cpu = torch.device("cpu")
    f32, bf16 = torch.float32, torch.bfloat16
    assert default_output_path(cpu, f32) == "factored" and default_output_path(cpu, bf16) == "fused"
    assert default_output_path(torch.device("cuda"), f32) == "fused"
    assert default_dtype(torch.device("cuda")) == torch.bfloat16
    for bf16, amx, isa, want in [
        (False, False, "AVX512", torch.float32),  # bf16 emulated: prefill several times slower than float32
        (True, False, "AVX512", torch.bfloat16),
        (False, True, "AVX512", torch.bfloat16),
        (True, False, "AVX2", torch.float32),  # PyTorch held to AVX2 (ATEN_CPU_CAPABILITY) does not use them
    ]:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=bf16: v, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda v=isa: v)
        assert default_dtype(cpu) == want, (bf16, amx, isa)
