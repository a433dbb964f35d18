"""The fragment layout of the CUDA decode kernel (runtime/frag.py) on the CPU: a lossless permutation of the row
layout's bytes, and a static cache held in it keeps exactly the tokens of the dynamic cache (bf16, Llama-3.1-8B's
attention shapes per latent group: 4 KV heads of dim 128, the paper preset's ranks 256 / 512)."""

from dataclasses import replace

import pytest
import torch
from test_static_cache import assert_same, contents

from tale_runtime import frag, new_cache
from tale_runtime.artifact import Schedule
from tale_runtime.attention import latent_attention
from tale_runtime.model import TaleCache
from tale_runtime.quant import quantize
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
        lvl.put(16, keys, lat)
    with pytest.raises(ValueError, match="another format"):
        lvl.put(0, quantize(torch.randn(1, K, 32, n).bfloat16(), 4, 32, -2), lat)
    lvl.put(32, keys, lat)
    assert torch.equal(lvl.take_keys(32, 32).data, keys.data) and torch.equal(lvl.take_lat(32, 32).zero, lat.zero)


@pytest.mark.parametrize("prompt,pad", [(150, 0), (40, 7)])
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
    c = StaticTaleCache(s, 1, K, n, G, R, max_length=100, layout="frag")
    with pytest.raises(ValueError, match="layout 'frag' covers head dim 128"):
        c.layers[0].append(torch.randn(1, K, 40, n).bfloat16(), torch.randn(1, G, 40, R).bfloat16())
    assert c.book is None and not c.layers[0].is_initialized  # refused before anything was filled: refused again
    with pytest.raises(ValueError, match="layout 'frag' covers head dim 128"):
        c.layers[0].append(torch.randn(1, K, 40, n).bfloat16(), torch.randn(1, G, 40, R).bfloat16())
    with pytest.raises(ValueError, match="must be 'auto', 'row' or 'frag'"):
        StaticTaleCache(PAPER, 1, K, n, G, R, layout="mma")
    auto = StaticTaleCache(PAPER, 1, K, n, G, R, max_length=100, num_heads=16)  # auto: the CPU keeps rows
    auto.layers[0].append(torch.randn(1, K, 40, n).bfloat16(), torch.randn(1, G, 40, R).bfloat16())
    assert auto.layout == "row"


@pytest.mark.parametrize("kb,rank", [(2, 256), (4, 512)])
def test_triton_pack_kernels_match_the_torch_path(kb, rank):
    """tale_kernels.frag_pack (one launch per level and direction: the CUDA path of flushes and demotions) against
    the torch path: the same words and scale/zero entries from the same QTensors, written at slot 32 of a larger
    buffer, and back (CPU interpreter in CI, the GPU on CUDA)."""
    from tale_kernels import frag_pack

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(7)
    B, C = 2, 64
    keys = quantize(torch.randn(B, 2 * K, C, n, generator=gen).bfloat16(), kb, 32, -2)
    lat = quantize(torch.randn(B, 2 * G, C, rank, generator=gen).bfloat16(), kb, 32, -1)
    kc, km = frag.pack_keys(keys)  # CPU tensors: the torch path
    lc, lm = frag.pack_lat(lat)

    def to(q):
        return replace(q, data=q.data.to(dev), scale=q.scale.to(dev), zero=q.zero.to(dev))

    got_kc = torch.zeros(B, 2 * G, C + 32, 16 * kb, dtype=torch.int32, device=dev)
    got_km = torch.zeros(B, 2 * G, C // 32 + 1, 4, 32, 8, dtype=km.dtype, device=dev)
    frag_pack.pack_keys(to(keys), got_kc[:, :, 32:], got_km[:, :, 1:], slot0=32)
    assert torch.equal(got_kc[:, :, 32:].cpu(), kc) and torch.equal(got_km[:, :, 1:].cpu(), km)
    assert not got_kc[:, :, :32].any() and not got_km[:, :, :1].any()  # nothing written outside the view
    got_lc, got_lm = torch.zeros_like(lc, device=dev), torch.zeros_like(lm, device=dev)
    frag_pack.pack_lat(to(lat), got_lc, got_lm)
    assert torch.equal(got_lc.cpu(), lc) and torch.equal(got_lm.cpu(), lm)
    back = frag_pack.unpack_keys(kc.to(dev), km.to(dev), kb, km.dtype)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(back, (keys.data, keys.scale, keys.zero)))
    back = frag_pack.unpack_lat(lc.to(dev), lm.to(dev), kb, lm.dtype)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(back, (lat.data, lat.scale, lat.zero)))


def test_frag_rows_repeat_and_reorder_like_the_row_layout():
    """batch_repeat_interleave (HF's num_return_sequences) and reorder_cache (beam search) move the fragment
    buffers' rows like the row layout's: the same contents afterwards, then through more decode steps."""
    gen = torch.Generator().manual_seed(3)
    caches = [StaticTaleCache(PAPER, 1, K, n, G, R, max_length=400, layout=lay) for lay in ("frag", "row")]
    k, h = torch.randn(2, K, 150, n, generator=gen).bfloat16(), torch.randn(2, G, 150, R, generator=gen).bfloat16()
    for c in caches:
        c.layers[0].append(k, h)
        c.batch_repeat_interleave(2)  # rows 0, 0, 1, 1
        c.layers[0].reorder_cache(torch.tensor([3, 0, 2, 1]))
    for _ in range(70):
        k, h = torch.randn(4, K, 1, n, generator=gen).bfloat16(), torch.randn(4, G, 1, R, generator=gen).bfloat16()
        for c in caches:
            c.layers[0].append(k, h)
    f, r = (c.layers[0].view() for c in caches)
    for b in range(4):
        cf, cr = contents(f, b), contents(r, b)
        assert cf.keys() == cr.keys()
        assert all(torch.equal(cf[p][3], cr[p][3]) and torch.equal(cf[p][4], cr[p][4]) for p in cf)
    assert caches[0].nbytes() == caches[1].nbytes()


def test_kernel_dispatch_of_a_fragment_view(monkeypatch):
    """tale_kernels.latent_attention: a fragment-layout view goes to the CUDA kernel where mma_attention.supported
    says so, else to the torch reference (the Triton kernel does not read the layout); CPU: the routing only."""
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
    assert not mma_attention.supported(q, kn, hn, v)  # CPU tensors
    assert not attention.supported(q, kn, hn, v)  # the Triton kernel refuses the layout, even in the interpreter
    want = latent_attention(q, kn, hn, v, 0.1)
    assert torch.equal(attention.latent_attention(q, kn, hn, v, 0.1), want)
    monkeypatch.setattr(mma_attention, "supported", lambda *a: True)
    monkeypatch.setattr(mma_attention, "latent_attention", lambda *a, **k: "cuda kernel")
    assert attention.latent_attention(q, kn, hn, v, 0.1) == "cuda kernel"
    assert torch.equal(attention.latent_attention(q, kn, hn, v, 0.1, cuda=False), want)


def test_the_backend_named_and_the_layout_new_cache_picks(monkeypatch):
    """generate()'s stats name the backend that serves a cache; new_cache keeps rows unless tale_kernels' CUDA kernel
    is installed (the fragment layout would only make the torch reference unpack it at every step)."""
    import functools

    from tale_helpers import talify, tiny_model

    from tale_kernels import latent_attention as kernel_fn
    from tale_runtime.generate import attention_backend
    from tale_runtime.load import _cuda_kernel_installed

    tm = talify(tiny_model("llama"), 2)
    frag_cache = StaticTaleCache(PAPER, 1, K, n, G, R, max_length=100, layout="frag", num_heads=16)
    frag_cache.layout = "frag"
    assert not _cuda_kernel_installed(tm) and attention_backend(tm, frag_cache) == "torch reference (fragment layout)"
    for layer in tm.model.layers:
        layer.self_attn.attention_fn = kernel_fn
    assert _cuda_kernel_installed(tm)
    assert attention_backend(tm, frag_cache) == "torch reference (fragment layout)"  # no Hopper GPU here
    from tale_kernels import mma_attention

    monkeypatch.setattr(mma_attention, "available", lambda device: True)
    for heads, want in (
        (K, "cuda"),
        (4 * K, "cuda"),
        (5 * K, "cuda"),
        (8 * K, "cuda"),
        (4 * K + 1, "torch reference"),
        (K - 1, "torch reference"),
        (None, "torch reference"),  # a static cache built without num_heads
    ):
        frag_cache.num_heads = heads  # the kernel serves a whole number of query heads per KV head
        assert attention_backend(tm, frag_cache).startswith(want), heads
    monkeypatch.undo()
    assert attention_backend(tm, new_cache(tm, static=True)) == "triton kernel"
    for layer in tm.model.layers:
        layer.self_attn.attention_fn = functools.partial(kernel_fn, cuda=False)
    assert not _cuda_kernel_installed(tm)
    assert new_cache(tm, static=True).layout_arg == "row"
    with pytest.raises(ValueError, match="static cache's: pass static=True"):
        new_cache(tm, layout="frag")
