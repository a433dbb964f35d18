"""The paged decode kernel (tale_kernels.paged_attention) against the torch reference over the same pages
(tale_runtime.paged), and the slot format's round trip. On the CPU the kernel runs in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from kernel_tests import CUDA, DEVICE, interpret, kernels  # noqa: F401  (interpret: autouse fixture)

(pa,) = kernels("paged_attention", kernel="_paged_kernel")

from tale_runtime import paged  # noqa: E402
from tale_runtime.quant import dequantize, quantize  # noqa: E402

# tiny shapes: G = 2 latent groups of g = 2 KV heads, 2 query heads per KV head, head dim 16, R = 32, rank 16
G, g, REP, N, R, RANK = 2, 2, 2, 16, 32, 16
K, H = G * g, G * g * REP
# float32 caches: the interpreter's arithmetic is the reference's up to summation order; compiled, the kernel is
# 2.4e-4 to 5.5e-4 off the float32 reference on an H100 at every bit width (16/16 included), as the contiguous
# kernels' float32 tolerance on CUDA allows (tests/test_kernels.py TOL)
F32 = 2e-3 if CUDA else 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def fmt(kb: int, hb: int, dtype=torch.float32) -> paged.PagedFormat:
    return paged.PagedFormat(N, g, RANK, kb, hb, key_group=8, lat_group=8, dtype=dtype)


def case(f: paged.PagedFormat, lengths: list[int], page_size: int, seed: int = 0, garbage: bool = True):
    """A pool whose pages are handed out in random order (non-contiguous, interleaved between sequences), the
    sequences' tokens written through write_slots, block-table entries past a sequence's pages out of range, and
    every byte never written 0xFF (NaN scales): none of it may reach the result."""
    gen = torch.Generator().manual_seed(seed)
    B = len(lengths)
    need = [-(-n // page_size) for n in lengths]
    num_pages = sum(need) + 3
    pool = paged.new_pool(f, num_pages, page_size, G, DEVICE)
    if garbage:
        pool.data.fill_(0xFF)
    max_pages = max(need) + 1
    bt = torch.full((B, max_pages), 10**6, dtype=torch.int32)
    order = torch.randperm(num_pages, generator=gen)
    for i in range(max(need)):  # page i of every sequence, then page i + 1: pages interleave
        for b in range(B):
            if i < need[b]:
                bt[b, i] = order[0]
                order = order[1:]
    for b, n in enumerate(lengths):
        slots = (bt[b, : need[b]].long()[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:n]
        k = torch.randn(n, K, N, generator=gen) * 2 + 0.5  # keys off zero: scales and zeros both matter
        h = torch.randn(n, G, R, generator=gen)
        paged.write_slots(pool, slots.to(DEVICE), k.to(DEVICE), h.to(DEVICE))
    q = torch.randn(B, H, 1, N, generator=gen).to(DEVICE, f.dtype)
    kn = torch.randn(B, K, 1, N, generator=gen).to(DEVICE, f.dtype)
    hn = torch.randn(B, G, 1, R, generator=gen).to(DEVICE, f.dtype)
    return q, kn, hn, pool, bt.to(DEVICE), torch.tensor(lengths, dtype=torch.int32, device=DEVICE)


SMALL = pa.PagedConfig(block_t=32, split_tokens=32)  # several splits per sequence at these lengths


@pytest.mark.parametrize("kb,hb", [(2, 2), (4, 4), (8, 8), (16, 16), (2, 4), (4, 16)])
def test_kernel_matches_reference_float32(kb, hb):
    """float32 caches: within F32 of the reference (the interpreter: up to summation order). Page size 8 (a tile spans
    4 pages) and 64 (a tile lies in one page), odd lengths, a partial last page, an empty sequence."""
    f = fmt(kb, hb)
    for ps, lengths in ((8, [45, 3, 0, 70]), (64, [129, 1])):
        q, kn, hn, pool, bt, ln = case(f, lengths, ps, seed=kb * 10 + hb)
        z = pa.paged_latent_attention(q, kn, hn, pool, bt, ln, N**-0.5, SMALL)
        ref = paged.paged_attention_reference(q, kn, hn, pool, bt, ln, N**-0.5)
        assert z.shape == (len(lengths), 1, H, R) and torch.isfinite(z).all()
        assert rel(z, ref) < F32, (kb, hb, ps)
        assert (z[..., RANK:] - ref[..., RANK:]).abs().max() < F32  # past the rank: the new token only


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kb,hb", [(2, 2), (4, 4)])
def test_kernel_matches_reference_16bit(dtype, kb, hb):
    """16-bit caches dequantize in float16 operands (bfloat16: times 2^-8, as the contiguous kernel does)."""
    q, kn, hn, pool, bt, ln = case(fmt(kb, hb, dtype), [77, 16, 5], 16, seed=3)
    z = pa.paged_latent_attention(q, kn, hn, pool, bt, ln, N**-0.5, SMALL)
    ref = paged.paged_attention_reference(q, kn, hn, pool, bt, ln, N**-0.5)
    assert rel(z, ref) < 3e-3


def test_lengths_read_on_the_device():
    """The lengths are read by the kernel, not the host: the same tensors changed in place give the reference at
    the new lengths (what a replayed CUDA graph sees), and the default split count agrees with small splits."""
    q, kn, hn, pool, bt, ln = case(fmt(2, 2), [90, 40], 8, seed=5)
    z0 = pa.paged_latent_attention(q, kn, hn, pool, bt, ln, N**-0.5)
    ln.copy_(torch.tensor([33, 7], dtype=torch.int32))
    z1 = pa.paged_latent_attention(q, kn, hn, pool, bt, ln, N**-0.5)
    ref1 = paged.paged_attention_reference(q, kn, hn, pool, bt, ln, N**-0.5)
    assert rel(z1, ref1) < F32 and rel(z0, z1) > 1e-2


@pytest.mark.parametrize("kb,hb", [(2, 2), (4, 8), (16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_read_round_trip(kb, hb, dtype):
    """Tokens written into pages (in scattered slots) and read back equal quantize -> dequantize of the same tokens,
    bit for bit; slots not named (and negative slot ids) are not touched."""
    f = fmt(kb, hb, dtype)
    pool = paged.new_pool(f, 6, 8, G, DEVICE)
    pool.data.fill_(0x5A)
    k = torch.randn(11, K, N, device=DEVICE).to(dtype)
    h = torch.randn(11, G, R, device=DEVICE).to(dtype)
    slots = torch.tensor([41, 3, 17, 0, 8, 47, 22, 30, 9, 12, 35], device=DEVICE)
    paged.write_slots(pool, torch.cat([slots, torch.tensor([-1], device=DEVICE)]), torch.cat([k, k[:1]]),
                      torch.cat([h, h[:1]]))  # fmt: skip
    kr, hr = paged.read_slots(pool, slots)
    assert torch.equal(kr, dequantize(quantize(k, kb, 8, -1), dtype))
    assert torch.equal(hr, dequantize(quantize(h[..., :RANK].contiguous(), hb, 8, -1), dtype))
    untouched = torch.ones(6 * 8, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert (pool.data.view(-1, G, f.slot_bytes)[untouched.to(DEVICE)] == 0x5A).all()


def test_slot_bytes():
    """Bytes per token and latent group: g (n kb / 8 + 4 n / gk) + r b / 8 + 4 r / gv (16-bit scale and zero),
    padded to 16; Llama-3.1-8B shapes (g = 4, n = 128, r = 256, groups of 32)."""
    assert paged.PagedFormat(128, 4, 256, 2, 2).slot_bytes == 4 * (32 + 16) + 64 + 32 == 288
    assert paged.PagedFormat(128, 4, 256, 4, 4).slot_bytes == 4 * (64 + 16) + 128 + 32 == 480
    assert paged.PagedFormat(128, 4, 256, 16, 16).slot_bytes == 4 * 256 + 512


def test_refusals():
    with pytest.raises(ValueError, match="key bits"):
        paged.PagedFormat(N, g, RANK, 3, 2)
    with pytest.raises(ValueError, match="straddles"):
        paged.PagedFormat(N, 4, 48, 2, 2, key_group=8, lat_group=8)  # 2-bit latents of rank 48: planes of 12 channels
    q, kn, hn, pool, bt, ln = case(fmt(2, 2), [9], 8, garbage=False)
    with pytest.raises(ValueError, match="block table"):
        pa.paged_latent_attention(q, kn, hn, pool, bt.long(), ln, 1.0)
    with pytest.raises(ValueError, match="do not fit"):
        pa.paged_latent_attention(q[:, :, :, :8], kn, hn, pool, bt, ln, 1.0)
