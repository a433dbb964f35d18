"""Triton kernels (tale_kernels) against the torch reference (tale_runtime).

On a CUDA machine the kernels run compiled on the GPU; elsewhere they run in Triton's CPU
interpreter (TRITON_INTERPRET=1 is set before triton is first imported), on small shapes.
Every check draws fresh random inputs.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from kernel_tests import CUDA, DEVICE, interpret, kernels  # noqa: F401  (interpret: autouse fixture)

attention, quant = kernels("attention", "quant", kernel="_attn_kernel")
import triton  # noqa: E402
from tale_helpers import talify, tiny_model  # noqa: E402

import tale_kernels  # noqa: E402
from tale_kernels import TritonConfig  # noqa: E402
from tale_runtime import new_cache, set_backend  # noqa: E402
from tale_runtime import quant as ref_quant  # noqa: E402
from tale_runtime.artifact import Level, Schedule, uniform_ranks  # noqa: E402
from tale_runtime.attention import latent_attention as ref_attention  # noqa: E402
from tale_runtime.cache import RegionStore  # noqa: E402
from tale_runtime.model import cache_arg  # noqa: E402
from tale_runtime.regions import LayerView, Region  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def same_quant(a, b, bits: int) -> None:
    """Equal packed codes, scales and zeros. On the GPU a code may differ by one step where the
    value sits on a rounding tie (GPU division); at most 0.1% of them."""
    assert a.data.shape == b.data.shape and a.scale.shape == b.scale.shape and a.data.dtype == torch.uint8
    assert (a.bits, a.group, a.dim) == (b.bits, b.group, b.dim)
    ca = ref_quant.unpack(a.data.cpu(), bits).int()
    cb = ref_quant.unpack(b.data.cpu(), bits).int()
    if CUDA:
        diff = (ca - cb).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() <= 1e-3
        torch.testing.assert_close(a.scale.cpu(), b.scale.cpu(), rtol=1e-2, atol=0)
        torch.testing.assert_close(a.zero.cpu(), b.zero.cpu(), rtol=1e-2, atol=0)
    else:
        assert torch.equal(ca, cb)
        assert torch.equal(a.scale.cpu(), b.scale.cpu()) and torch.equal(a.zero.cpu(), b.zero.cpu())


DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantize_and_dequantize_match_torch(bits, dtype):
    # keys [B, K, L, n] per channel over token groups; latents [B, G, L, r] per token over channel groups.
    # The keys come transposed from [B, L, K, n] as in the model (non-contiguous).
    k = torch.randn(2, 40, 3, 64, device=DEVICE, dtype=dtype).transpose(1, 2) * 3
    h = torch.randn(2, 2, 21, 128, device=DEVICE, dtype=dtype) + 1
    for x, group, dim in ((k, 8, -2), (h, 16, -1)):
        assert quant.supports(x.shape, bits, group, dim, x)
        q = quant.quantize(x, bits, group, dim)
        r = ref_quant.quantize(x.cpu(), bits, group, dim)
        same_quant(q, r, bits)
        # dequantize the reference codes both ways
        rq = replace(r, data=r.data.to(DEVICE), scale=r.scale.to(DEVICE), zero=r.zero.to(DEVICE))
        for dt in (None, torch.float32):
            torch.testing.assert_close(
                quant.dequantize(rq, dt).cpu(), ref_quant.dequantize(r, dt), rtol=1e-6, atol=1e-6
            )


def test_packed_layout_is_planar_and_shared():
    """Element c of a row of nb bytes sits in byte c % nb at bit (c // nb) * bits, in the torch
    pack and the Triton quantize alike; latent groups that would straddle planes go to torch."""
    codes = torch.arange(16).remainder(4).reshape(1, 16)
    packed = ref_quant.pack(codes, 2)  # nb = 4
    assert packed.shape == (1, 4)
    assert all(((packed[0, c % 4] >> (c // 4 * 2)) & 3).item() == codes[0, c].item() for c in range(16))
    x = torch.randn(1, 1, 3, 64, device=DEVICE)
    assert torch.equal(quant.quantize(x, 2, 16, -1).data.cpu(), ref_quant.quantize(x.cpu(), 2, 16, -1).data)
    h = torch.randn(1, 1, 3, 96, device=DEVICE)
    assert not quant.supports(h.shape, 2, 32, -1, h)  # 24 bytes per row: groups of 32 would straddle planes
    assert ref_quant.quantize(h, 2, 32, -1).shape == h.shape  # the torch path still packs it


if CUDA:
    import triton.language as tl

    from tale_kernels._common import plane, plane3, plane3_asm, plane_asm

    @triton.jit
    def _unpack_both(b_ptr, s_ptr, z_ptr, plain_ptr, asm_ptr, I: tl.constexpr, BITS: tl.constexpr, M: tl.constexpr):
        r = tl.arange(0, M)[:, None] * M + tl.arange(0, M)[None, :]
        byts = tl.load(b_ptr + r)
        out = plain_ptr.dtype.element_ty
        tl.store(plain_ptr + r, plane(byts, I, BITS, out))
        tl.store(asm_ptr + r, plane_asm(byts, tl.load(s_ptr + r), tl.load(z_ptr + r), I, BITS, out))

    @triton.jit
    def _unpack3_both(lo_ptr, hi_ptr, s_ptr, z_ptr, plain_ptr, asm_ptr, I: tl.constexpr, M: tl.constexpr):
        r = tl.arange(0, M)[:, None] * M + tl.arange(0, M)[None, :]
        lo, hi = tl.load(lo_ptr + r), tl.load(hi_ptr + r)
        out = plain_ptr.dtype.element_ty
        tl.store(plain_ptr + r, plane3(lo, hi, I, out))
        tl.store(asm_ptr + r, plane3_asm(lo, hi, tl.load(s_ptr + r), tl.load(z_ptr + r), I, out))


@pytest.mark.skipif(not CUDA, reason="inline PTX runs compiled only")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits", [2, 4])
def test_ptx_unpack_matches_plain_path(bits, dtype):
    """The inline-PTX unpack (4 codes per register, exponent trick on 16-bit pairs) gives, for
    every plane of random bytes, the plain path's codes bit for bit, and code * scale + zero
    rounded once (what fma.rn computes) bit for bit."""
    M = 64
    byts = torch.randint(0, 256, (M, M), dtype=torch.uint8, device=DEVICE)
    codes = ref_quant.unpack(byts.cpu(), bits).double()  # [M, M * 8 / bits]: plane i = columns i*M ..
    sign = torch.where(torch.rand(M, M) < 0.5, -1.0, 1.0)
    s = (torch.rand(M, M) * 0.2 + 0.05).to(dtype)
    z = ((torch.rand(M, M) * 0.5 + 0.25) * sign).to(dtype)
    for i in range(8 // bits):
        plain, got = torch.empty(M, M, dtype=dtype, device=DEVICE), torch.empty(M, M, dtype=dtype, device=DEVICE)
        one, zero = torch.ones(M, M, dtype=dtype, device=DEVICE), torch.zeros(M, M, dtype=dtype, device=DEVICE)
        _unpack_both[(1,)](byts, one, zero, plain, got, I=i, BITS=bits, M=M)
        c = codes[:, i * M : (i + 1) * M]
        assert torch.equal(plain.cpu().double(), c) and torch.equal(got.cpu().double(), c)
        _unpack_both[(1,)](byts, s.to(DEVICE), z.to(DEVICE), plain, got, I=i, BITS=bits, M=M)
        exact = c * s.double() + z.double()
        assert torch.equal(exact.float().double(), exact)  # exact in float32: one rounding to 16 bits below
        want = exact.float().to(dtype)
        assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16)), f"plane {i}"


@pytest.mark.skipif(not CUDA, reason="inline PTX runs compiled only")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_ptx_unpack_of_3bit_codes_matches_the_layout(dtype):
    """The 3-bit PTX unpack of sub-plane i (low half i % 2 of the bit-sliced row, high bits) against the codes that
    runtime/quant.py packed: both paths give the codes bit for bit, and the PTX path code * scale + zero rounded
    once."""
    M = 64
    codes = torch.randint(0, 8, (M, 8 * M), dtype=torch.uint8)  # rows of 8M codes: sub-plane i = columns i*M ..
    packed = ref_quant.pack(codes, 3)  # [M, 3M]: low half A, low half B, high bits (M bytes each)
    lo_a, lo_b, hi = (packed[:, j * M : (j + 1) * M].contiguous().to(DEVICE) for j in range(3))
    sign = torch.where(torch.rand(M, M) < 0.5, -1.0, 1.0)
    s = (torch.rand(M, M) * 0.2 + 0.05).to(dtype)
    z = ((torch.rand(M, M) * 0.5 + 0.25) * sign).to(dtype)
    for i in range(8):
        plain, got = torch.empty(M, M, dtype=dtype, device=DEVICE), torch.empty(M, M, dtype=dtype, device=DEVICE)
        one, zero = torch.ones(M, M, dtype=dtype, device=DEVICE), torch.zeros(M, M, dtype=dtype, device=DEVICE)
        lo = lo_a if i % 2 == 0 else lo_b
        c = codes[:, i * M : (i + 1) * M].double()
        _unpack3_both[(1,)](lo, hi, one, zero, plain, got, I=i, M=M)
        assert torch.equal(plain.cpu().double(), c) and torch.equal(got.cpu().double(), c), f"sub-plane {i}"
        _unpack3_both[(1,)](lo, hi, s.to(DEVICE), z.to(DEVICE), plain, got, I=i, M=M)
        want = (c * s.double() + z.double()).float().to(dtype)
        assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16)), f"sub-plane {i}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_requantize_is_the_demotion_step(dtype):
    """4-bit full-rank latents -> first r0 channels at 2 bits; 4-bit keys -> 2-bit keys; one pass each."""
    k = torch.randn(1, 2, 64, 32, device=DEVICE, dtype=dtype)
    h = torch.randn(1, 2, 19, 128, device=DEVICE, dtype=dtype)
    for x, group, dim, rank in ((k, 16, -2, None), (h, 16, -1, 64)):
        r4 = ref_quant.quantize(x.cpu(), 4, group, dim)
        q4 = replace(r4, data=r4.data.to(DEVICE), scale=r4.scale.to(DEVICE), zero=r4.zero.to(DEVICE))
        got = quant.requantize(q4, 2, rank)
        want = ref_quant.dequantize(r4)
        if rank is not None:
            want = want[..., :rank].contiguous()
        same_quant(got, ref_quant.quantize(want, 2, group, dim), 2)


def layer_cache(B, H, K, g, n, L0, dtype, sched=None, pad=None, r0=0.5, group=16):
    G, R = K // g, g * n
    s = sched or Schedule(
        ranks=uniform_ranks(R, 1, r0, value_group=group), key_group=group, value_group=group, residual=group
    )
    c = RegionStore(s, 0, K, n, G, R)
    valid = None
    if pad:
        valid = torch.ones(B, L0, dtype=torch.bool, device=DEVICE)
        for i, p in enumerate(pad):
            valid[i, :p] = False
    c.append(
        torch.randn(B, K, L0, n, device=DEVICE, dtype=dtype) * 2,
        torch.randn(B, G, L0, R, device=DEVICE, dtype=dtype),
        valid,
    )
    return c


# bfloat16: the 5e-3 bound, met by the float16 operands bf16 caches get by default (float16 metadata)
TOL = {torch.float32: 5e-3 if CUDA else 1e-5, torch.float16: 5e-3, torch.bfloat16: 5e-3}

# (B, H, K, g, n, prompt, pad, kwargs): GQA and MHA, g = 1/2/4, rep = 3, odd lengths, left
# padding (long enough to move the sinks out of the combine launch), tiny splits (many partials,
# lengths not a multiple of the split), heads of 16 and ranks below 16 (the CUDA-core path),
# empty or absent regions (a prompt that fits in the sinks).
CASES = {
    "gqa-g2": (1, 8, 4, 2, 64, 101, None, {}),
    "gqa-g2-pad-splits": (2, 8, 4, 2, 64, 77, [0, 5], dict(split_tokens=32)),
    "gqa-g4-small-splits": (2, 8, 4, 4, 16, 130, [3, 0], dict(split_tokens=16, block_t=16)),
    "mha-g1": (2, 4, 4, 1, 32, 50, None, dict(split_tokens=48)),
    "rep3-g2": (1, 6, 2, 2, 32, 45, None, {}),
    "rank8": (1, 4, 2, 1, 16, 29, None, dict(group=8)),
    "prompt-in-sinks": (1, 8, 4, 2, 32, 3, None, {}),
    "long-left-padding": (2, 8, 4, 2, 32, 340, [0, 300], {}),
    "group32": (2, 8, 4, 2, 64, 203, [0, 11], dict(group=32, split_tokens=64)),
    "query-planes-per-tile": (2, 8, 4, 2, 64, 150, [0, 5], dict(q_in_loop=True)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_decode_attention_matches_reference(case, dtype):
    B, H, K, g, n, L0, pad, kw = CASES[case]
    kw = dict(kw)
    group = kw.pop("group", 16)
    c = layer_cache(B, H, K, g, n, L0, dtype, pad=pad, group=group)
    G, R = K // g, g * n
    seen = set()
    for _ in range(3):  # decode steps: regions fill, flush and demote in between
        q = torch.randn(B, H, 1, n, device=DEVICE, dtype=dtype)
        k = torch.randn(B, K, 1, n, device=DEVICE, dtype=dtype)
        h = torch.randn(B, G, 1, R, device=DEVICE, dtype=dtype)
        assert attention.supported(q, k, h, c) is None  # the kernel serves it (else the call is refused)
        z = tale_kernels.latent_attention(q, k, h, c, n**-0.5, config=TritonConfig(**kw))
        assert z.shape == (B, 1, H, R) and z.dtype == torch.float32
        assert rel(z, ref_attention(q, k, h, c, n**-0.5)) < TOL[dtype]
        seen.add(tuple(c.lengths().values()))
        c.append(k, h)
    assert len(seen) > 1 or L0 < 4


@pytest.mark.parametrize("rows", ["few", "many"])
def test_both_combine_launches_match_reference(rows, monkeypatch):
    """The combine's two launch shapes (attention._combine_launch: by rows B * H against the SM count), each forced
    on the same many-split cache: both must merge the partials exactly as the reference attends."""
    dtype = DTYPES[0]
    c = layer_cache(2, 8, 4, 2, 64, 203, dtype, pad=[0, 11], group=32)
    sms = 10**6 if rows == "few" else 1
    monkeypatch.setattr(attention, "_num_sms", lambda dev: sms)
    want = {"few": 128, "many": 64}[rows]
    assert attention._combine_launch(16, sms)["BS"] == want
    q = torch.randn(2, 8, 1, 64, device=DEVICE, dtype=dtype)
    k = torch.randn(2, 4, 1, 64, device=DEVICE, dtype=dtype)
    h = torch.randn(2, 2, 1, 128, device=DEVICE, dtype=dtype)
    z = tale_kernels.latent_attention(q, k, h, c, 0.125, config=TritonConfig(split_tokens=16))
    assert rel(z, ref_attention(q, k, h, c, 0.125)) < TOL[dtype]


def held_meta(v: LayerView, dt: torch.dtype, shift: float) -> LayerView:
    """v with every 16-bit scale and zero held in `dt` times `shift` instead (e.g. bf16 metadata, the old format)."""

    def f(t):
        if t.bits == 16:
            return t
        return replace(
            t, scale=(t.meta_float(t.scale) * shift).to(dt), zero=(t.meta_float(t.zero) * shift).to(dt), shift=shift
        )

    return LayerView([Region(f(r.keys), f(r.lat), r.rank, r.pos, r.length) for r in v.regions], v.next_pos)


def _bf16_step(L0=150, scale=(2.0, 1.0)):
    """A bf16 cache (keys x scale[0], latents x scale[1]) and one decode step's inputs, g = 2, n = 64."""
    B, H, K, g, n = 2, 8, 4, 2, 64
    c = layer_cache(B, H, K, g, n, L0, torch.bfloat16, pad=[0, 5], group=32)
    G, R = K // g, g * n
    for r in c.view().regions:  # scaled after quantization: scales, zeros and 16-bit parts alike
        for t, _ in attention._key_parts(r.keys):
            for x in (t.scale, t.zero) if t.bits != 16 else (t.data,):
                x.mul_(scale[0])
        for x in (r.lat.scale, r.lat.zero) if r.lat.bits != 16 else (r.lat.data,):
            x.mul_(scale[1])
    q = torch.randn(B, H, 1, n, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(B, K, 1, n, device=DEVICE, dtype=torch.bfloat16) * scale[0]
    h = torch.randn(B, G, 1, R, device=DEVICE, dtype=torch.bfloat16) * scale[1]
    return c, q, k, h, n**-0.5


@pytest.mark.skipif(not CUDA, reason="the interpreter's bfloat16 dots overflow (numpy has no bfloat16)")
def test_float16_operands_round_finer_than_bfloat16():
    """A bfloat16 cache's default operands, float16 (dequantized keys, latents, queries and probabilities enter the
    dots as float16, shifted by 2^-8), are closer to the float32 reference than bfloat16 ones are on the same cache
    with bfloat16 metadata (each against its own reference)."""
    c, q, k, h, s = _bf16_step()
    v = c.view()
    vb = held_meta(v, torch.bfloat16, 1.0)
    e16 = rel(tale_kernels.latent_attention(q, k, h, v, s), ref_attention(q, k, h, v, s))
    e_bf = rel(tale_kernels.latent_attention(q, k, h, vb, s), ref_attention(q, k, h, vb, s))
    assert e16 < e_bf / 2, (e16, e_bf)


def test_dot_option_is_checked():
    c, q, k, h, s = _bf16_step(L0=40)
    with pytest.raises(ValueError, match="dot must be"):
        tale_kernels.latent_attention(q, k, h, c, s, config=TritonConfig(dot=torch.int8))


def test_bfloat16_values_beyond_float16_range():
    """dot=float16: keys and latents of a bfloat16 cache far past float16's largest value (65504) still come out
    right: the 2^-8 shift keeps them in range (without it they overflow to inf and the output is NaN)."""
    c, q, k, h, s = _bf16_step(scale=(3e4, 2e5))
    want = ref_attention(q, k, h, c, s * 1e-4)  # logits of a usual size: the keys' scale undone in the scaling
    got = tale_kernels.latent_attention(q, k, h, c, s * 1e-4, config=TritonConfig(dot=torch.float16))
    assert torch.isfinite(got).all() and want.abs().max() > 1e5
    assert rel(got, want) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sliding_window_matches_reference(dtype):
    """Sliding-window layers (Mistral, Qwen2): slots more than `window` positions back are masked."""
    c = layer_cache(2, 8, 4, 2, 64, 150, dtype, pad=[0, 9])
    G, R = 2, 128
    for window in (40, 100, 7):
        q, k, h = (
            torch.randn(2, 8, 1, 64, device=DEVICE, dtype=dtype),
            torch.randn(2, 4, 1, 64, device=DEVICE, dtype=dtype),
            torch.randn(2, G, 1, R, device=DEVICE, dtype=dtype),
        )
        z = tale_kernels.latent_attention(q, k, h, c, 0.125, window, config=TritonConfig(split_tokens=32))
        want = ref_attention(q, k, h, c, 0.125, window)
        assert rel(z, want) < TOL[dtype]
        assert rel(ref_attention(q, k, h, c, 0.125), want) > 0.05  # the window matters here
        c.append(k, h)


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.float16, torch.bfloat16] if CUDA else []), ids=str)
def test_sliding_layers_ring_matches_reference(dtype):
    """A sliding layer of the static cache: one 16-bit region, a ring of W - 1 = 19 slots (filling, then wrapped:
    positions out of slot order), padding at -1 in one row, device length and next_pos; kernel == reference with the
    window, step after step, and the window matters."""
    from tale_runtime.static_cache import StaticTaleCache

    K, n, G, R, W = 2, 16, 1, 32, 20
    gen = torch.Generator().manual_seed(4)
    s = Schedule(ranks=[[16, 32]], key_group=8, value_group=8, residual=8)
    sta = StaticTaleCache(s, 1, K, n, G, R, max_length=60, windows=[W])

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    valid = torch.ones(2, 12, dtype=torch.bool, device=DEVICE)
    valid[1, :5] = False
    layer = sta.layers[0]
    layer.append(rnd(2, K, 12, n), rnd(2, G, 12, R), valid)
    for t in range(12, 36, 3):
        v = layer.view()
        assert len(v.regions) == 1 and v.regions[0].capacity == W - 1
        q, k, h = rnd(2, 4, 1, n), rnd(2, K, 1, n), rnd(2, G, 1, R)
        assert attention.supported(q, k, h, v) is None
        z, want = tale_kernels.latent_attention(q, k, h, v, 0.25, W), ref_attention(q, k, h, v, 0.25, W)
        assert rel(z, want) < TOL[dtype], t
        for _ in range(3):
            layer.append(rnd(2, K, 1, n), rnd(2, G, 1, R))
    assert rel(ref_attention(q, k, h, v, 0.25, 10), want) > 0.05  # a shorter window reads fewer of its tokens


def _grow(t, extra: int, garbage: float):
    """t with `extra` more slots (token dim -2) holding garbage: NaN values/scales, random codes."""

    def cat(x, rows):
        if x.dtype == torch.uint8:
            tail = torch.randint(0, 256, (*x.shape[:-2], rows, x.shape[-1]), dtype=torch.uint8, device=x.device)
        else:
            tail = torch.full((*x.shape[:-2], rows, x.shape[-1]), garbage, dtype=x.dtype, device=x.device)
        return torch.cat([x, tail], dim=-2)

    if t.bits == 16:
        return ref_quant.QTensor(cat(t.data, extra), None, None, 16, t.group, t.dim)
    srows = extra // t.group if t.dim in (-2, t.data.dim() - 2) else extra
    return replace(t, data=cat(t.data, extra), scale=cat(t.scale, srows), zero=cat(t.zero, srows))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_view_with_capacity_device_lengths_and_any_order(dtype):
    """A static-cache-like view: capacities past the lengths with NaN in the unused slots (pos -1),
    lengths and next_pos as device tensors, regions in reverse order, one region empty."""
    c = layer_cache(2, 8, 4, 2, 64, 130, dtype, pad=[3, 0])
    v = c.view()
    regions = []
    for r in v.regions:
        extra = 32
        pos = torch.cat([r.pos, torch.full((2, extra), -1, dtype=torch.int32, device=DEVICE)], dim=-1)
        regions.append(
            Region(
                _grow(r.keys, extra, float("nan")),
                _grow(r.lat, extra, float("nan")),
                r.rank,
                pos,
                torch.tensor([r.length], dtype=torch.int32, device=DEVICE),
            )
        )
    empty = regions[1]
    regions.append(
        Region(
            empty.keys,
            empty.lat,
            empty.rank,
            torch.full_like(empty.pos, -1),
            torch.zeros(1, dtype=torch.int32, device=DEVICE),
        )
    )
    view = LayerView(regions[::-1], torch.tensor(v.next_pos, dtype=torch.int32, device=DEVICE))
    q, k, h = (
        torch.randn(2, 8, 1, 64, device=DEVICE, dtype=dtype),
        torch.randn(2, 4, 1, 64, device=DEVICE, dtype=dtype),
        torch.randn(2, 2, 1, 128, device=DEVICE, dtype=dtype),
    )
    assert attention.supported(q, k, h, view) is None
    z = tale_kernels.latent_attention(q, k, h, view, 0.125, config=TritonConfig(split_tokens=32))
    want = ref_attention(q, k, h, c, 0.125)
    assert torch.isfinite(z).all()
    assert rel(ref_attention(q, k, h, view, 0.125), want) < 1e-5  # the oracle reads the view alike
    assert rel(z, want) < TOL[dtype]


@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_channel_major_latents_read_like_row_major(dtype, group):
    """Packed latents stored channel-major (slots contiguous, as the static cache allocates them) are read in place
    (CT flag HT, a channel byte's stride as s_ht) and give what the row-major copy gives: 2-bit rank 64 and 4-bit
    rank 128, value groups of 16 (whole groups per plane) and 32 (the 2-bit planes inside one group), left padding."""
    c = layer_cache(2, 8, 4, 2, 64, 150, dtype, pad=[0, 7], group=group)
    v = c.view()
    q, k, h = (
        torch.randn(2, 8, 1, 64, device=DEVICE, dtype=dtype),
        torch.randn(2, 4, 1, 64, device=DEVICE, dtype=dtype),
        torch.randn(2, 2, 1, 128, device=DEVICE, dtype=dtype),
    )

    def cm(t):  # the same codes, channel-major
        d = t.data.transpose(-1, -2).contiguous().transpose(-1, -2)
        return t if t.bits >= 8 else replace(t, data=d)

    view = LayerView([replace(r, lat=cm(r.lat)) for r in v.regions], v.next_pos)
    packed = [r for r in view.regions if r.lat.bits < 8]
    assert {r.lat.bits for r in packed} == {2, 4} and all(r.lat.data.stride(-2) == 1 for r in packed)
    assert all(attention._region_args(r, q, 4, 64, 2, group, 64, 1, ())[1][14] for r in packed)  # read in place
    assert attention.supported(q, k, h, view) is None
    z = tale_kernels.latent_attention(q, k, h, view, 0.125, config=TritonConfig(split_tokens=32))
    assert (
        rel(z, tale_kernels.latent_attention(q, k, h, v, 0.125, config=TritonConfig(split_tokens=32))) < 1e-5
    )  # k order may differ
    assert rel(z, ref_attention(q, k, h, v, 0.125)) < TOL[dtype]


def test_static_cache_holds_packed_latents_channel_major():
    from tale_runtime.static_cache import StaticTaleCache

    s = Schedule(ranks=uniform_ranks(128, 1, 0.5, value_group=16), key_group=8, value_group=16, residual=8)
    layer = StaticTaleCache(s, 1, 4, 64, 2, 128, max_length=300).layers[0]  # capacities of 8k slots
    layer.append(torch.randn(1, 4, 200, 64, device=DEVICE), torch.randn(1, 2, 200, 128, device=DEVICE))
    lat = [r.lat for r in layer.view().regions if r.lat.bits < 8]
    assert lat and all(t.data.stride(-2) == 1 and t.data.stride(-1) % 16 == 0 for t in lat)  # aligned rows
    assert any(t.data.stride(-1) > t.data.shape[-2] for t in lat)  # a capacity padded to it
    fp8 = StaticTaleCache(replace(s, value_meta="8/8"), 1, 4, 64, 2, 128, max_length=300).layers[0]
    fp8.append(torch.randn(1, 4, 200, 64, device=DEVICE), torch.randn(1, 2, 200, 128, device=DEVICE))
    assert all(r.lat.data.stride(-1) == 1 for r in fp8.view().regions)  # fp8 latent scales: row-major (faster)


def test_bfloat16_cache_metadata_formats():
    """A bf16 cache stores its 16-bit scales/zeros as float16 times 2^-8 (quant.meta_format). The kernel reads them
    as float16 operands by default (the result of dot=torch.float16), converts them for dot=torch.bfloat16, reads
    the same values held in bf16 (hand-built tensors) too, and declines float16 ones without the shift."""
    bf = torch.bfloat16
    c = layer_cache(1, 8, 4, 2, 64, 100, bf)
    q, k, h = (torch.randn(1, 8, 1, 64, device=DEVICE, dtype=bf), torch.randn(1, 4, 1, 64, device=DEVICE, dtype=bf),
               torch.randn(1, 2, 1, 128, device=DEVICE, dtype=bf))  # fmt: skip
    v = c.view()
    packed = [t for r in v.regions for t in (r.keys, r.lat) if t.bits != 16]
    assert packed and all((t.scale.dtype, t.zero.dtype, t.shift) == (torch.float16,) * 2 + (2.0**-8,) for t in packed)
    want = ref_attention(q, k, h, v, 0.2)
    z = tale_kernels.latent_attention(q, k, h, v, 0.2)
    assert torch.equal(z, tale_kernels.latent_attention(q, k, h, v, 0.2, config=TritonConfig(dot=torch.float16)))
    assert rel(z, want) < 5e-3
    with pytest.raises(ValueError, match="round this cache's float16 scales"):
        tale_kernels.latent_attention(q, k, h, v, 0.2, config=TritonConfig(dot=bf))
    vb = held_meta(v, bf, 1.0)
    assert attention.supported(q, k, h, vb) is None
    if CUDA:  # the interpreter has no bfloat16 dots (test_float16_operands_round_finer_than_bfloat16)
        assert rel(tale_kernels.latent_attention(q, k, h, vb, 0.2), ref_attention(q, k, h, vb, 0.2)) < 2e-2
    why = attention.supported(q, k, h, held_meta(v, torch.float16, 1.0))
    assert (
        why == "key scales/zeros of format '16' in torch.float16/torch.float16 (shift 1.0) for torch.bfloat16 queries"
    )


def test_refuses_formats_it_does_not_read():
    """Scales in another dtype (e.g. a future 8-bit/fp8 metadata format), or a QTensor subclass: the kernel refuses
    the decode step with the reason, it does not run the reference in its name."""
    c = layer_cache(1, 8, 4, 2, 64, 100, torch.float32)
    q, k, h = (
        torch.randn(1, 8, 1, 64, device=DEVICE),
        torch.randn(1, 4, 1, 64, device=DEVICE),
        torch.randn(1, 2, 1, 128, device=DEVICE),
    )
    assert attention.supported(q, k, h, c) is None
    v = c.view()
    lv = next(i for i, r in enumerate(v.regions) if r.lat.bits != 16)
    r = v.regions[lv]
    odd = ref_quant.QTensor(r.lat.data, r.lat.scale.half(), r.lat.zero.half(), r.lat.bits, r.lat.group, r.lat.dim)
    v.regions[lv] = Region(r.keys, odd, r.rank, r.pos, r.length)
    why = "latent scales/zeros of format '16' in torch.float16/torch.float16 (shift 1.0) for torch.float32 queries"
    assert attention.supported(q, k, h, v) == why
    with pytest.raises(ValueError, match=f"^triton latent attention: {re.escape(why)}$"):
        tale_kernels.latent_attention(q, k, h, v, 0.2)

    class Other(ref_quant.QTensor):
        pass

    v.regions[lv] = Region(
        r.keys, Other(r.lat.data, r.lat.scale, r.lat.zero, r.lat.bits, r.lat.group, r.lat.dim), r.rank, r.pos, r.length
    )
    assert attention.supported(q, k, h, v) == "a QTensor subclass in a region"


@pytest.mark.parametrize("bits", [(8, 8), (16, 4), (4, 16)])
def test_other_bit_widths_and_exact_levels(bits):
    kb, vb = bits
    s = Schedule(
        levels=[Level(vb, kb, None), Level(16, 16, 0.25)], ranks=[[32, 64]], key_group=16, value_group=16, residual=16
    )
    c = layer_cache(1, 8, 4, 2, 32, 90, torch.float32, sched=s)
    args = (
        torch.randn(1, 8, 1, 32, device=DEVICE),
        torch.randn(1, 4, 1, 32, device=DEVICE),
        torch.randn(1, 2, 1, 64, device=DEVICE),
        c,
        0.2,
    )
    assert rel(tale_kernels.latent_attention(*args), ref_attention(*args)) < TOL[torch.float32]


def test_prefill_chunks_run_the_reference_decode_steps_the_kernel(monkeypatch):
    """A chunk of several new tokens is the reference's by design (the backend signature takes T tokens, the kernel
    decodes one); a decode step runs the kernel, and one it cannot serve (CPU tensors without the interpreter) is
    refused with the reason."""
    c = layer_cache(1, 8, 4, 2, 16, 40, torch.float32)
    q, k, h = (
        torch.randn(1, 8, 2, 16, device=DEVICE),
        torch.randn(1, 4, 2, 16, device=DEVICE),
        torch.randn(1, 2, 2, 32, device=DEVICE),
    )
    assert attention.supported(q, k, h, c) == "2 new tokens (the kernel decodes one)"
    assert torch.equal(tale_kernels.latent_attention(q, k, h, c, 0.25), ref_attention(q, k, h, c, 0.25))
    q, k, h = q[:, :, :1], k[:, :, :1], h[:, :, :1]
    assert attention.supported(q, k, h, c) is None
    if not CUDA:  # CPU tensors use the kernel only when the interpreter is asked for
        monkeypatch.delenv("TRITON_INTERPRET")
        why = "CPU tensors (it runs on CUDA, or on the CPU under TRITON_INTERPRET=1)"
        assert attention.supported(q, k, h, c) == why
        with pytest.raises(ValueError, match=re.escape(f"triton latent attention: {why}")):
            tale_kernels.latent_attention(q, k, h, c, 0.25)
        assert not quant.supports(k.shape, 2, 1, -2, k)


@pytest.mark.slow  # whole generations in Triton's interpreter: minutes on a CPU (compiled: make test-gpu)
@pytest.mark.parametrize("arch,g,preset", [("llama", 2, "paper"), ("qwen2", 1, "paper"), ("llama", 2, "tale")])
def test_generation_with_kernels_matches_reference(arch, g, preset):
    """Greedy decoding of a tiny TALE model: same tokens and close logits, kernels on vs off."""
    base = tiny_model(arch)
    sched = None  # the paper's: r0 = R/2, 2/4 bits, groups of 8
    if preset == "tale":
        from test_static_cache import tale_schedule

        sched = tale_schedule(base)
    tm = talify(base, g, sched).to(DEVICE)
    ids = torch.randint(1, 320, (2, 21), generator=torch.Generator().manual_seed(1)).to(DEVICE)

    @torch.no_grad()
    def greedy(steps=6):
        cache, x, toks, logits = new_cache(tm), ids, [], []
        assert cache.backend.name == tm.tale_spec.backend
        for _ in range(steps):
            out = tm(x, **cache_arg(cache)).logits[:, -1]
            x = out.argmax(-1, keepdim=True)
            toks.append(x)
            logits.append(out)
        return torch.cat(toks, 1), torch.stack(logits, 1)

    set_backend(tm, "torch")
    t_ref, l_ref = greedy()
    set_backend(tm, "triton")
    t_k, l_k = greedy()
    assert torch.equal(t_k, t_ref)
    assert rel(l_k, l_ref) < (5e-3 if CUDA else 1e-4)
    if preset == "paper":  # the backend's config reaches every call; a config of another backend is refused
        set_backend(tm, "triton", TritonConfig(dot=torch.float16))
        assert new_cache(tm).backend.config == TritonConfig(dot=torch.float16)
        t16, l16 = greedy()
        assert torch.equal(t16, t_ref) and rel(l16, l_ref) < (5e-3 if CUDA else 1e-4)
        with pytest.raises(ValueError, match="takes no configuration"):
            set_backend(tm, "torch", TritonConfig())
        with pytest.raises(ValueError, match="needs a backend name"):
            set_backend(tm, "auto", TritonConfig())


@pytest.mark.skipif(not CUDA, reason="the kernels serve caches on CUDA only")
def test_load_on_cuda_chooses_the_kernel(tmp_path):
    from tale_helpers import save_artifact

    from tale_runtime import load

    save_artifact(talify(tiny_model("llama"), 2), tmp_path / "art")
    model, _ = load(tmp_path / "art", device="cuda", dtype=torch.float32)
    assert new_cache(model).backend.name == "triton"
    ids = torch.randint(1, 320, (1, 40), generator=torch.Generator().manual_seed(2)).cuda()

    @torch.no_grad()
    def logits():
        cache = new_cache(model)
        model(ids[:, :30], **cache_arg(cache))
        return torch.cat([model(ids[:, t : t + 1], **cache_arg(cache)).logits for t in range(30, 40)], 1)

    got = logits()
    set_backend(model, "torch")
    want = logits()
    assert torch.equal(got.argmax(-1), want.argmax(-1)) and rel(got, want) < 5e-3


# -- the formats of the tale preset: key bands, fp8 scales/zeros, 3-bit keys -------------------------------


def format_schedule(name: str, n: int, K: int, R: int, group: int = 16) -> Schedule:
    """Two-level schedules in the formats beyond the plain layout (the tale preset's and neighbours)."""
    g = torch.Generator().manual_seed(7)
    order = [[torch.randperm(n, generator=g).tolist() for _ in range(K)]]
    lv, meta = {
        # the tale preset: half of each head's key channels at 3 bits, the rest at 2; fp8 scales
        "bands-3/2-fp8": (
            [Level(2, 2, None, key_hi_bits=3, key_hi_channels=n // 2), Level(4, 4, 0.25)],
            ("8/16", "8/8"),
        ),
        "bands-4/2": ([Level(2, 2, None, key_hi_bits=4, key_hi_channels=8), Level(4, 4, 0.25)], ("16", "16")),
        "bands-8/3-fp8": ([Level(2, 3, None, key_hi_bits=8, key_hi_channels=8), Level(4, 8, 0.25)], ("8/8", "8/16")),
        "3bit-keys-fp8": ([Level(2, 3, None), Level(4, 3, 0.25)], ("8/8", "8/8")),
        "fp8-plain": ([Level(2, 2, None), Level(4, 4, 0.25)], ("8/16", "8/16")),
    }[name]
    return Schedule(
        levels=lv,
        ranks=uniform_ranks(R, 1, 0.5, value_group=group),
        key_group=group,
        value_group=group,
        residual=group,
        key_meta=meta[0],
        value_meta=meta[1],
        key_order=order,
    )


FORMATS = ["bands-3/2-fp8", "bands-4/2", "bands-8/3-fp8", "3bit-keys-fp8", "fp8-plain"]


# every format in float32, the tale preset's in every dtype (the interpreter is slow: about 15 s a case)
FORMAT_CASES = [(f, torch.float32) for f in FORMATS] + [("bands-3/2-fp8", d) for d in DTYPES if d != torch.float32]


@pytest.mark.parametrize("fmt,dtype", FORMAT_CASES, ids=str)
def test_formats_beyond_the_plain_layout_match_reference(fmt, dtype):
    """Banded keys (each band scored against the query's gathered channels at its own bits), fp8 scales and
    zeros (divided by the tensor's bias) and 3-bit keys: the kernel runs (supported) and matches the reference
    over three decode steps (flush and demotion into the bands in between), with left padding, in a view
    mixing these regions with 16-bit ones and with a plain cache's regions (more than one launch)."""
    B, H, K, g, n = 2, 8, 4, 2, 64
    G, R = K // g, g * n
    c = layer_cache(B, H, K, g, n, 150, dtype, sched=format_schedule(fmt, n, K, R), pad=[0, 7])
    plain = layer_cache(B, H, K, g, n, 90, dtype, pad=[0, 7])
    kinds = set()
    for step in range(3):
        q = torch.randn(B, H, 1, n, device=DEVICE, dtype=dtype)
        k = torch.randn(B, K, 1, n, device=DEVICE, dtype=dtype)
        h = torch.randn(B, G, 1, R, device=DEVICE, dtype=dtype)
        v = c.view()
        kinds |= {
            (type(r.keys).__name__, r.keys.bits, r.keys.meta if hasattr(r.keys, "meta") else "") for r in v.regions
        }
        mixed = LayerView(v.regions + plain.view().regions[::-1], v.next_pos)
        # the mixed view also with the opt-in 3-bit PTX unpack (compiled runs; the interpreter takes the plain path)
        for view, kw in ((v, dict(split_tokens=32, q_in_loop=step != 1)), (mixed, {}), (mixed, dict(asm=(2, 3, 4)))):
            assert attention.supported(q, k, h, view) is None
            z = tale_kernels.latent_attention(q, k, h, view, n**-0.5, config=TritonConfig(**kw))
            assert rel(z, ref_attention(q, k, h, view, n**-0.5)) < TOL[dtype]
        c.append(k, h)
    want_bands = fmt.startswith("bands")
    assert any(kind[0] == "Bands" for kind in kinds) == want_bands  # the level under test was read


def test_fp8_bias_is_read():
    """The kernel divides fp8 scales by the tensor's bias: the same codes and stored scales with another bias
    give another (the reference's) result, also when the bias is a device scalar (static caches)."""
    B, H, K, g, n = 1, 8, 4, 2, 32
    c = layer_cache(B, H, K, g, n, 120, torch.float32, sched=format_schedule("fp8-plain", n, K, 2 * n))
    q, k, h = (
        torch.randn(B, H, 1, n, device=DEVICE),
        torch.randn(B, K, 1, n, device=DEVICE),
        torch.randn(B, 1 * K // g, 1, 2 * n, device=DEVICE),
    )
    v = c.view()
    i = next(j for j, r in enumerate(v.regions) if r.keys.bits != 16)
    r = v.regions[i]
    z0 = tale_kernels.latent_attention(q, k, h, v, n**-0.5)
    for bias in (r.keys.bias * 2, torch.tensor(r.keys.bias * 2, device=DEVICE)):
        keys, lat = replace(r.keys, bias=bias), replace(r.lat, bias=bias)
        v.regions[i] = Region(keys, lat, r.rank, r.pos, r.length)
        assert attention.supported(q, k, h, v) is None
        z = tale_kernels.latent_attention(q, k, h, v, n**-0.5)
        want = ref_attention(q, k, h, v, n**-0.5)
        assert rel(z, want) < TOL[torch.float32] and rel(z, z0) > 1e-2


def test_static_cache_of_the_tale_preset_matches_reference():
    """The static cache's view of the tale preset (bands with a device index, fp8 biases as device scalars,
    capacities past the lengths, device lengths and next_pos): kernel == reference through flushes and
    demotions, and the kernel reads a bias changed in place (what a captured graph sees after a re-bias)."""
    from test_static_cache import SCHEDULES

    from tale_runtime.static_cache import StaticTaleCache

    s = SCHEDULES["tale"]
    K, n, G, R = 2, 16, 1, 32
    gen = torch.Generator().manual_seed(2)
    sta = StaticTaleCache(s, 1, K, n, G, R, max_length=140)
    sta.layers[0].append(
        torch.randn(2, K, 90, n, generator=gen).to(DEVICE), torch.randn(2, G, 90, R, generator=gen).to(DEVICE)
    )
    layer = sta.layers[0]
    bands = layer.keys[0]
    assert isinstance(bands, ref_quant.Bands) and all(isinstance(p.bias, torch.Tensor) for p in bands.parts)
    for _ in range(12):
        v = layer.view()
        q = torch.randn(2, 4, 1, n, generator=gen).to(DEVICE)
        k, h = torch.randn(2, K, 1, n, generator=gen).to(DEVICE), torch.randn(2, G, 1, R, generator=gen).to(DEVICE)
        assert attention.supported(q, k, h, v) is None
        z = tale_kernels.latent_attention(q, k, h, v, 0.25)
        assert rel(z, ref_attention(q, k, h, v, 0.25)) < TOL[torch.float32]
        layer.append(k, h)
    lat = layer.lat[0]
    lat.bias.mul_(2)  # in place: the same view, another bias
    z2 = tale_kernels.latent_attention(q, k, h, v, 0.25)
    assert rel(z2, ref_attention(q, k, h, v, 0.25)) < TOL[torch.float32] and rel(z2, z) > 1e-3
