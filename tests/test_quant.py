"""KIVI quantization and bit packing (tale_runtime.quant): error bounds, layout, round trips."""

from dataclasses import replace

import pytest
import torch

from tale_runtime.quant import cat, dequantize, meta_format, pack, quantize, split, unpack


def _expand(t: torch.Tensor, group: int, dim: int) -> torch.Tensor:
    """Per-group tensor (scale/zero) -> one value per element."""
    return t.repeat_interleave(group, dim=dim)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dim,group", [(-2, 8), (-1, 16)])
def test_error_at_most_half_a_step(bits, dim, group):
    torch.manual_seed(bits)
    x = torch.randn(2, 3, 32, 64) * torch.rand(1, 3, 1, 64) * 5  # channels of very different ranges
    q = quantize(x, bits, group, dim)
    err = (dequantize(q) - x).abs()
    half_step = _expand(q.scale, group, dim) / 2
    assert (err <= half_step * (1 + 1e-5) + 1e-6).all()
    # min and max of each group are representable exactly (codes 0 and 2^bits - 1)
    assert torch.allclose(dequantize(q).amax(), x.amax(), atol=1e-5)
    assert torch.allclose(dequantize(q).amin(), x.amin(), atol=1e-5)


def test_group_layout_keys_per_channel_latents_per_token():
    torch.manual_seed(0)
    k = torch.randn(1, 2, 16, 8)  # [B, K, L, n], groups of 4 tokens per channel
    qk = quantize(k, 4, 4, dim=-2)
    assert qk.data.shape == (1, 2, 16, 4) and qk.scale.shape == (1, 2, 4, 8)
    grp = k[0, 1, 4:8, 5]  # token group 1, channel 5 of head 1
    assert torch.allclose(qk.zero[0, 1, 1, 5], grp.min())
    assert torch.allclose(qk.scale[0, 1, 1, 5], (grp.max() - grp.min()) / 15)

    h = torch.randn(1, 2, 5, 32)  # [B, G, L, r], groups of 8 channels per token
    qh = quantize(h, 2, 8, dim=-1)
    assert qh.data.shape == (1, 2, 5, 8) and qh.scale.shape == (1, 2, 5, 4)
    grp = h[0, 0, 3, 16:24]
    assert torch.allclose(qh.zero[0, 0, 3, 2], grp.min())
    assert torch.allclose(qh.scale[0, 0, 3, 2], (grp.max() - grp.min()) / 3)
    assert qh.shape == h.shape and qk.shape == k.shape


def test_constant_group_is_exact():
    x = torch.full((1, 1, 8, 4), 0.37)
    assert torch.equal(dequantize(quantize(x, 2, 8, dim=-2)), x)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_round_trip(bits):
    torch.manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (3, 5, 64), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 64 * bits // 8)
    assert torch.equal(unpack(packed, bits), codes)


def test_pack_bit_order():
    # element i of a byte sits at bit offset (i % per_byte) * bits
    assert pack(torch.tensor([1, 2, 3, 0]), 2).tolist() == [1 | 2 << 2 | 3 << 4 | 0 << 6]
    assert pack(torch.tensor([0xA, 0x5]), 4).tolist() == [0x5A]
    with pytest.raises(ValueError, match="multiple"):
        pack(torch.zeros(3, dtype=torch.uint8), 2)


def test_sixteen_bits_is_identity():
    x = torch.randn(2, 4, 8, dtype=torch.bfloat16)
    q = quantize(x, 16, 8, dim=-1)
    assert q.data is x and q.scale is None and q.nbytes() == x.numel() * 2
    assert torch.equal(dequantize(q), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_scales_follow_meta_format_and_count_in_nbytes(dtype):
    """16-bit scales/zeros keep float32/float16 sources' dtype; bfloat16 ones are float16 times 2^-8: they stand
    for the group's (max - min) / 3 and min to float16's precision (2^-11), 8x finer than bfloat16 would, and stay
    finite for values far beyond float16's range."""
    torch.manual_seed(0)
    x = (torch.randn(1, 2, 32, 16) * torch.logspace(-2, 6 if dtype == torch.bfloat16 else 3, 16)).to(dtype)
    q = quantize(x, 2, 32, dim=-2)
    mdt, shift = meta_format(dtype)
    assert (q.scale.dtype, q.zero.dtype, q.shift) == (mdt, mdt, shift)
    assert (mdt, shift) == ((torch.float16, 2.0**-8) if dtype == torch.bfloat16 else (dtype, 1.0))
    xf = x.float()
    want_s, want_z = (xf.amax(-2, keepdim=True) - xf.amin(-2, keepdim=True)) / 3, xf.amin(-2, keepdim=True)
    tol = 2.0**-24 if dtype == torch.float32 else 2.0**-11
    for got, want in ((q.meta_float(q.scale), want_s), (q.meta_float(q.zero), want_z)):
        assert torch.isfinite(got).all()
        assert ((got - want).abs() <= want.abs() * tol).all()
    out = dequantize(q)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert ((out.float() - xf).abs() <= want_s * 0.5 * 1.01 + xf.abs() * 2.0**-7).all()  # half a step (+ rounding)
    # 2-bit codes + one 16-bit scale and zero per channel per 32 tokens
    assert q.nbytes() == 2 * 32 * 16 // 4 + 2 * (2 * 16 * mdt.itemsize)


def test_cat_refuses_mixed_scale_formats():
    """Parts of one tensor must store their 16-bit scales/zeros alike: bf16 metadata (shift 1) next to the float16
    times 2^-8 of quantize would be read at the wrong scale, so cat refuses; split halves keep the format."""
    q = quantize(torch.randn(1, 2, 32, 16, dtype=torch.bfloat16), 4, 16, dim=-2)
    a, b = split(q, 16)
    assert a.shift == b.shift == q.shift == 2.0**-8 and torch.equal(dequantize(cat([a, b])), dequantize(q))
    old = replace(b, scale=b.meta_float(b.scale).bfloat16(), zero=b.meta_float(b.zero).bfloat16(), shift=1.0)
    with pytest.raises(ValueError, match="different formats"):
        cat([a, old])


def test_split_and_cat_are_exact():
    torch.manual_seed(0)
    k = quantize(torch.randn(1, 2, 24, 8), 4, 8, dim=-2)
    a, b = split(k, 16)
    assert a.shape[-2] == 16 and b.shape[-2] == 8
    assert torch.equal(dequantize(cat([a, b])), dequantize(k))
    with pytest.raises(ValueError, match="align"):
        split(k, 12)  # inside a key group
    h = quantize(torch.randn(1, 2, 10, 16), 2, 8, dim=-1)
    a, b = split(h, 3)  # latents are per token: any split point
    assert torch.equal(dequantize(cat([a, b])), dequantize(h))


def test_size_not_multiple_of_group_raises():
    with pytest.raises(ValueError, match="multiple of the quantization group"):
        quantize(torch.randn(1, 1, 10, 8), 2, 8, dim=-2)
