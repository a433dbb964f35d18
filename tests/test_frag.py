"""The fragment layout of the CUDA decode kernel (runtime/frag.py) on the CPU: a lossless permutation of the row
layout's bytes, and a static cache held in it keeps exactly the tokens of the dynamic cache (bf16, Llama-3.1-8B's
attention shapes per latent group: 4 KV heads of dim 128, the paper preset's ranks 256 / 512)."""

import os
import re
from dataclasses import replace

import pytest
import torch
from test_static_cache import assert_same

from tale_runtime import backends, frag, new_cache, set_backend
from tale_runtime.artifact import Schedule
from tale_runtime.attention import latent_attention
from tale_runtime.model import TaleCache
from tale_runtime.quant import quantize
from tale_runtime.spec import Arch, CacheSpec
from tale_runtime.static_cache import StaticTaleCache

K, n, G, R = 4, 128, 1, 512
PAPER = Schedule(ranks=[[256, 512]], key_group=32, value_group=32, residual=32)


@pytest.mark.parametrize("kb", [2, 4])
def test_tables_are_permutations(kb):
    for t, size in (
        (frag.key_table(kb)[0], 512),
        (frag.key_table(kb)[1], 512),
        (frag.lat_table(kb), 8192),
        (frag.key_meta_table(), 1024),
        (frag.lat_meta_table(), 512),
    ):
        assert torch.equal(t.flatten().sort().values, torch.arange(size))
    assert not torch.equal(frag.key_table(kb)[0], frag.key_table(kb)[1])  # the parity swizzle moves words


@pytest.mark.parametrize("kb,rank", [(2, 256), (4, 512)])
def test_pack_unpack_round_trip(kb, rank):
    gen = torch.Generator().manual_seed(kb)
    B, C = 2, 96
    keys = quantize(torch.randn(B, 2 * K, C, n, generator=gen).bfloat16(), kb, 32, -2)
    lat = quantize(torch.randn(B, 2 * G, C, rank, generator=gen).bfloat16(), kb, 32, -1)
    kc, km = frag.pack_keys(keys)
    lc, lm = frag.pack_lat(lat)
    assert kc.shape == (B, 2 * G, C, 16 * kb) and lc.shape == (B, 2 * G, rank // 256, C // 32, 256 * kb)
    k2, l2 = frag.unpack_keys(kc, km, keys), frag.unpack_lat(lc, lm, lat)
    for a, b in ((k2, keys), (l2, lat)):
        assert torch.equal(a.data, b.data) and torch.equal(a.scale, b.scale) and torch.equal(a.zero, b.zero)
    # the words really are permuted: a word of the first slot differs from the row layout's bytes read as int32
    assert not torch.equal(kc[0, 0, 0], keys.data[0, :K, 0].reshape(-1).view(torch.int32))


def test_level_refuses_partial_blocks():
    lvl = frag.FragLevel.empty(1, G, 64, 2, 2, 256, torch.bfloat16, "cpu")
    keys = quantize(torch.randn(1, K, 32, n).bfloat16(), 2, 32, -2)
    lat = quantize(torch.randn(1, G, 32, 256).bfloat16(), 2, 32, -1)
    with pytest.raises(ValueError, match="not whole blocks"):
        lvl.write_slots(16, keys, lat)
    with pytest.raises(ValueError, match="another format"):
        lvl.write_slots(0, quantize(torch.randn(1, K, 32, n).bfloat16(), 4, 32, -2), lat)
    lvl.write_slots(32, keys, lat)
    assert torch.equal(lvl.take_keys(32, 32).data, keys.data) and torch.equal(lvl.take_lat(32, 32).zero, lat.zero)


# the 150-token prompt: 140 steps of three caches through every demotion, over half a minute of CPU (make test-slow)
@pytest.mark.parametrize("prompt,pad", [pytest.param(150, 0, marks=pytest.mark.slow), (40, 7)])
def test_frag_static_cache_holds_the_dynamic_caches_tokens(prompt, pad):
    """Through flushes, demotions (4-bit rank 512 -> 2-bit rank 256) and ring wrap-arounds: the same codes."""
    B, steps = 2, 140
    gen = torch.Generator().manual_seed(0)
    dyn = TaleCache(PAPER, 1, K, n, G, R)
    sta = StaticTaleCache(PAPER, 1, K, n, G, R, max_length=prompt + steps, layout="frag")
    row = StaticTaleCache(PAPER, 1, K, n, G, R, max_length=prompt + steps, layout="row")
    k = torch.randn(B, K, prompt, n, generator=gen).bfloat16()
    h = torch.randn(B, G, prompt, R, generator=gen).bfloat16()
    valid = torch.ones(B, prompt, dtype=torch.bool)
    valid[1, :pad] = False
    for c in (dyn, sta, row):
        c.layers[0].append(k, h, valid)
    assert sta.layout == "frag" and sta.layers[0].frag and not sta.layers[0].keys
    assert_same(dyn, sta, B)
    for t in range(steps):
        k, h = torch.randn(B, K, 1, n, generator=gen).bfloat16(), torch.randn(B, G, 1, R, generator=gen).bfloat16()
        for c in (dyn, sta, row):
            c.layers[0].append(k, h)
        if t % 29 == 0 or t == steps - 1:
            assert_same(dyn, sta, B)
    q, kn, hn = (
        torch.randn(B, 16, 1, n).bfloat16(),
        torch.randn(B, K, 1, n).bfloat16(),
        torch.randn(B, G, 1, R).bfloat16(),
    )
    # the torch reference reads the fragment layout (unpacked) exactly as the row layout of the same cache
    assert row.layout == "row"
    assert torch.equal(
        latent_attention(q, kn, hn, row.layers[0].view(), 0.1), latent_attention(q, kn, hn, sta.layers[0].view(), 0.1)
    )


def test_frag_layout_refused_where_it_does_not_fit():
    s = Schedule(ranks=[[128, 512]], key_group=32, value_group=32, residual=32)
    with pytest.raises(ValueError, match="layout 'frag': the fragment layout holds the paper preset's levels"):
        StaticTaleCache(s, 1, K, n, G, R, max_length=100, layout="frag")
    with pytest.raises(ValueError, match="must be 'row' or 'frag'"):
        StaticTaleCache(PAPER, 1, K, n, G, R, layout="mma")
    c = StaticTaleCache(PAPER, 1, K, n, G, R, max_length=100, layout="frag")
    with pytest.raises(ValueError, match="holds bfloat16 caches"):
        c.layers[0].append(torch.randn(1, K, 40, n), torch.randn(1, G, 40, R))
    assert c.book is None and not c.layers[0].is_initialized  # refused before anything was filled
    plain = StaticTaleCache(PAPER, 1, K, n, G, R, max_length=100, num_heads=16)  # the reference's default: rows
    plain.layers[0].append(torch.randn(1, K, 40, n).bfloat16(), torch.randn(1, G, 40, R).bfloat16())
    assert plain.layout == "row"


def test_the_kernels_refuse_what_they_do_not_read():
    """A decode step a kernel does not serve is refused with its reason, not run on the torch reference in the kernel's
    name: the CUDA kernel refuses a fragment view of CPU tensors, the Triton kernel any fragment view (in the
    interpreter; CPU tensors without it), and the cuda backend object runs the CUDA kernel's entry point. A chunk of
    two tokens is the reference's by design."""
    from tale_kernels import attention, mma_attention

    sta = StaticTaleCache(PAPER, 1, K, n, G, R, max_length=300, layout="frag")
    gen = torch.Generator().manual_seed(5)
    sta.layers[0].append(
        torch.randn(1, K, 200, n, generator=gen).bfloat16(), torch.randn(1, G, 200, R, generator=gen).bfloat16()
    )
    v = sta.layers[0].view()
    q, kn, hn = (
        torch.randn(1, 16, 1, n).bfloat16(),
        torch.randn(1, K, 1, n).bfloat16(),
        torch.randn(1, G, 1, R).bfloat16(),
    )
    assert mma_attention.supported(q, kn, hn, v) == "CPU tensors (it runs on a GPU)"
    with pytest.raises(ValueError, match=r"^cuda latent attention: CPU tensors \(it runs on a GPU\)$"):
        mma_attention.latent_attention(q, kn, hn, v, 0.1)
    with pytest.raises(ValueError, match=r"^cuda latent attention: CPU tensors"):
        backends.get("cuda")(q, kn, hn, v, 0.1)
    if os.environ.get("TRITON_INTERPRET") == "1":
        why = "a view in the CUDA kernel's fragment layout"
    else:
        why = "CPU tensors (it runs on CUDA, or on the CPU under TRITON_INTERPRET=1)"
    assert attention.supported(q, kn, hn, v) == why
    with pytest.raises(ValueError, match=f"^triton latent attention: {re.escape(why)}$"):
        attention.latent_attention(q, kn, hn, v, 0.1)
    q2, k2, h2 = (t.expand(-1, -1, 2, -1) for t in (q, kn, hn))
    want = latent_attention(q2, k2, h2, v, 0.1)
    assert torch.equal(mma_attention.latent_attention(q2, k2, h2, v, 0.1), want)
    assert torch.equal(attention.latent_attention(q2, k2, h2, v, 0.1), want)
    assert torch.equal(backends.get("cuda")(q2, k2, h2, v, 0.1), want)


def spec_of(heads, schedule=PAPER, static=True, device="cuda", dtype=torch.bfloat16):
    return CacheSpec(Arch("llama", 1, 2048, heads, K, n, 4, G, R), schedule, static, torch.device(device), dtype)


def test_the_backend_is_chosen_once_from_the_cache_spec(monkeypatch):
    """backends.choose: on a GPU the fastest backend that serves the cache (the CUDA kernel for paper-preset static
    caches of a whole number of query heads per KV head on Hopper, else the Triton kernel, else the low-rank-key
    kernel, else the reference); on
    the CPU the reference; a named backend that does not serve the cache is refused with its reason. new_cache hands
    the choice to the cache, whose layout follows from it, and generate()'s stats name it."""
    from tale_helpers import talify, tiny_model

    from tale_kernels import mma_attention

    monkeypatch.setattr(mma_attention, "available", lambda device: True)
    for heads, want in ((K, "cuda"), (4 * K, "cuda"), (5 * K, "cuda"), (8 * K, "cuda"), (4 * K + 1, "triton")):
        assert backends.choose(spec_of(heads)).name == want, heads
    assert backends.choose(spec_of(16, static=False)).name == "triton"  # the CUDA kernel reads static caches only
    assert backends.choose(spec_of(16, dtype=torch.float32)).name == "triton"
    lowrank = replace(PAPER, key_rope="pre")  # keys before RoPE: only the low-rank-key kernel reads them
    assert backends.choose(spec_of(16, lowrank, static=False)).name == "triton-lowrank"
    assert backends.choose(spec_of(16, lowrank, device="cpu")).name == "torch"
    assert backends.choose(spec_of(16, device="cpu")).name == "torch"
    with pytest.raises(ValueError, match="'cuda' does not serve this cache: reads static caches only"):
        backends.choose(spec_of(16, static=False), "cuda")
    with pytest.raises(ValueError, match="no attention backend 'flash'"):
        backends.choose(spec_of(16), "flash")
    monkeypatch.setattr(mma_attention, "available", lambda device: False)
    assert backends.choose(spec_of(16)).name == "triton"
    assert "Hopper" in backends.reasons(spec_of(16))["cuda"]
    monkeypatch.setattr(mma_attention, "available", lambda device: True)
    sliding = replace(spec_of(16), windows=(24, None))  # its static cache holds the sliding layer as a 16-bit ring
    assert backends.choose(sliding).name == "triton" and "16-bit ring" in backends.reasons(sliding)["cuda"]
    monkeypatch.undo()

    tm = talify(tiny_model("llama"), 2)  # CPU: the reference, rows
    c = new_cache(tm, static=True)
    assert c.backend.name == "torch" and c.layout == "row" and c.backend_name == "torch reference"
    if os.environ.get("TRITON_INTERPRET") != "1":  # a GPU machine: the kernels run on CUDA tensors only
        with pytest.raises(ValueError, match="needs a CUDA device"):
            new_cache(tm, static=True, backend="triton")
        return
    c = new_cache(tm, static=True, backend="triton")  # the interpreter: by name only
    assert c.backend.name == "triton" and c.layout == "row" and c.backend_name == "triton kernel"
    with pytest.raises(ValueError, match="static cache's: pass static=True"):
        new_cache(tm, layout="frag")
    from tale_runtime.generate import generate

    set_backend(tm, "triton")
    _, stats = generate(tm, list(range(1, 40)), max_new_tokens=3, static=True)
    assert stats.attention == "triton kernel"
    with pytest.raises(ValueError, match="no attention backend"):
        set_backend(tm, "flash")
    monkeypatch.delenv("TRITON_INTERPRET")  # no GPU, no interpreter: refused when named, not at the first generate
    with pytest.raises(ValueError, match="'triton' does not serve this model's caches: needs a CUDA device"):
        set_backend(tm, "triton")
