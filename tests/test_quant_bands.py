"""Key bands (tale_runtime.quant.Bands): per KV head, the most important key channels (a calibration
order, tale_convert.stats) at more bits than the rest; the cache, the schedule fields and the statistic."""

import pytest
import torch
from tale_helpers import talify, tiny_model

from tale_runtime import new_cache
from tale_runtime.artifact import ArtifactError, Level, Schedule
from tale_runtime.cache import RegionStore, band_index
from tale_runtime.model import cache_arg
from tale_runtime.quant import Bands, cat, dequantize, quantize, quantize_bands, requantize, split

K, n, G, R = 2, 16, 1, 32


def orders(layers: int = 1, seed: int = 0, heads: int = K, dim: int = n) -> list:
    """A random key channel order per layer and KV head (Schedule.key_order)."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randperm(dim, generator=g).tolist() for _ in range(heads)] for _ in range(layers)]


def keys(T: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, K, T, n, generator=g) * (1 + 4 * torch.rand(1, K, 1, n, generator=g))).bfloat16()


@pytest.mark.parametrize("meta", ["16", "8/16"])
def test_equal_bands_are_the_plain_format_exactly(meta):
    """Per-channel quantization is independent per channel: any split into bands of the same bits
    dequantizes to exactly what one QTensor gives, and holds the same code bytes."""
    x = keys()
    hi, lo = band_index(orders()[0], 8)
    b = quantize_bands(x, [(2, lo), (2, hi)], 16, meta)
    q = quantize(x, 2, 16, -2, meta)
    if meta == "16":
        assert torch.equal(dequantize(b), dequantize(q))
    else:  # fp8 scales carry one bias per stored tensor: the parts' own biases may differ from the whole's
        assert torch.allclose(dequantize(b, torch.float32), dequantize(q, torch.float32), atol=0.05)
    assert b.nbytes() == q.nbytes() + (4 if meta != "16" else 0)  # one more fp8 bias (two parts, one tensor)


def test_bands_round_trip_bytes_and_error():
    x = keys()
    order = orders()[0]
    hi, lo = band_index(order, 8)
    assert torch.equal(torch.cat([hi, lo], 1).sort(1).values, torch.arange(n).expand(K, n))
    b = quantize_bands(x, [(2, lo), (4, hi)], 16)
    assert b.shape == x.shape and b.bits == (2, 4) and not b.plain
    # bytes: 8 channels at 2 bits + 8 at 4 bits, one 16-bit scale + zero per channel and group of 16 tokens
    codes = K * 64 * 8 * (2 + 4) // 8
    meta = 2 * K * (64 // 16) * n * 2
    assert b.nbytes() == codes + meta
    err = (dequantize(b, torch.float32) - x.float()).abs()
    hi_mask = torch.zeros(K, n, dtype=torch.bool).scatter_(1, hi, True)[None, :, None, :].expand_as(x)
    assert err[hi_mask].max() < err[~hi_mask].max() / 2  # the high band is finer
    # cat / split keep the bands and the values
    a, c = split(b, 32)
    assert isinstance(a, Bands) and a.shape[-2] == 32 and torch.equal(dequantize(cat([a, c])), dequantize(b))
    # demotion to a plain level: dequantize, then quantize
    r = requantize(b, 2)
    assert not isinstance(r, Bands) and torch.equal(dequantize(r), dequantize(quantize(dequantize(b), 2, 16, -2)))


def banded(**kw) -> Schedule:
    """A schedule whose level 0 holds its keys in two bands (2 and 3 bits, key_order: orders()); `kw` replaces any
    field."""
    levels = [Level(2, 2, None, key_hi_bits=3, key_hi_channels=8), Level(4, 4, 0.2)]
    kw = dict(sinks=2, levels=levels, ranks=[[8, 32]], key_group=8, value_group=8, residual=8, key_order=orders()) | kw
    return Schedule(**kw)


def test_banded_schedule_checks_and_manifest_round_trip():
    s = banded()
    s.validate(R, 1)
    assert not s.plain_layout()
    assert Schedule.from_dict(s.to_dict()) == s
    plain = Schedule(ranks=[[16, 32]])
    d = plain.to_dict()  # fields of format 2.1 are written only when used: a 2.0 reader reads the rest
    assert "key_order" not in d and "key_hi_bits" not in d["levels"][0]
    with pytest.raises(ArtifactError, match="need the calibration channel order"):
        banded(key_order=None).validate(R, 1)
    with pytest.raises(ArtifactError, match="multiple of 8"):
        Schedule(
            levels=[Level(2, 2, None, key_hi_bits=3, key_hi_channels=4), Level(4, 4, 0.2)],
            ranks=[[8, 32]],
            key_group=8,
            value_group=8,
            residual=8,
            key_order=orders(),
        ).validate(R, 1)
    with pytest.raises(ArtifactError, match="each head's channels once"):
        banded(key_order=[[[0] * n] * K]).validate(R, 1)
    with pytest.raises(ValueError, match="key_order is not"):
        RegionStore(banded(), 0, K + 1, n, G, R)


def test_banded_cache_holds_bands_and_counts_their_bytes():
    s = banded()
    k = keys(120)
    h = torch.randn(1, G, 120, R, generator=torch.Generator().manual_seed(1)).bfloat16()
    c = RegionStore(s, 0, K, n, G, R)
    c.append(k[..., :50, :], h[..., :50, :])
    for t in range(50, 120):
        c.append(k[..., t : t + 1, :], h[..., t : t + 1, :])
    st0 = c.levels[0]
    assert isinstance(st0.keys, Bands) and st0.keys.bits == (2, 3) and st0.length % 8 == 0
    ln = c.lengths()
    assert sum(ln.values()) == 120
    # every cached tensor, walked independently of nbytes()
    st1 = c.levels[1]
    qts = [*st0.keys.parts, st0.lat, st1.keys, st1.lat]
    held = [t for q in qts for t in (q.data, q.scale, q.zero)] + [c.sink_k, c.sink_h, c.res_k, c.res_h]
    assert c.nbytes() == sum(t.numel() * t.element_size() for t in held if t is not None)
    # the middle keys (demoted from the 4-bit level) carry 2/3-bit error, the high band less
    ref = k[..., 2 : 2 + st0.length, :].float()
    err = (dequantize(st0.keys, torch.float32) - ref).pow(2)
    hi, _ = band_index(s.key_order[0], 8)
    m = torch.zeros(K, n, dtype=torch.bool).scatter_(1, hi, True)[None, :, None, :].expand_as(err)
    rel = lambda mask: (err[mask].sum() / ref.pow(2)[mask].sum()).sqrt().item()  # noqa: E731
    assert rel(m) < rel(~m) < 0.5


def test_bands_decode_through_the_model():
    """16-bit low band, 8-bit high band, full rank: close to the base model, not equal (it compresses)."""
    base = tiny_model("llama")
    L, nh, Rr = base.config.num_hidden_layers, base.config.head_dim, 2 * base.config.head_dim
    s = banded(
        levels=[Level(16, 16, None, key_hi_bits=8, key_hi_channels=8), Level(16, 16, 0.1)],
        ranks=[[Rr, Rr]] * L,
        key_order=orders(L, heads=base.config.num_key_value_heads, dim=nh),
    )
    tm = talify(base, 2, s)
    ids = torch.randint(1, 320, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = base(ids).logits
        cache = new_cache(tm)
        tm(ids[:, :12], **cache_arg(cache))
        got = torch.cat([tm(ids[:, t : t + 1], **cache_arg(cache)).logits for t in range(12, 40)], 1)
    assert isinstance(cache.layers[0].levels[0].keys, Bands)
    # 8-bit high band: close to exact, not exact
    err = ((got - ref[:, 12:]).norm() / ref[:, 12:].norm()).item()
    assert 0 < err < 2e-2


def test_overrides_keep_the_bands_and_their_order():
    from tale_runtime.load import override_schedule

    s = override_schedule(banded(), R, 1, ranks=[16, 32], key_meta="8/16")
    assert s.levels[0].key_hi_bits == 3 and s.key_order == banded().key_order and s.ranks == [[16, 32]]


def test_key_importance_matches_the_base_models_own_q_and_k():
    """stats.key_importance on a TALE model = E[q_c^2] E[range_c^2] of the post-RoPE q and k that the base
    model's own attention receives (captured through transformers' attention interface)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tale_convert.stats import key_importance, key_order

    base = tiny_model("llama")
    got = []

    def capture(module, q, k, v, mask, **kw):  # q [B, H, T, n], k [B, K, T, n] after RoPE
        got.append((module.layer_idx, q.double(), k.double()))
        return sdpa_attention_forward(module, q, k, v, mask, **kw)

    AttentionInterface.register("tale_capture", capture)
    ids = torch.randint(1, 320, (2, 33), generator=torch.Generator().manual_seed(0))
    base.config._attn_implementation = "tale_capture"
    with torch.no_grad():
        base(ids)
    base.config._attn_implementation = "sdpa"
    tm = talify(base, 2)
    imp = key_importance(tm, [ids], key_group=8)
    for i, q, k in got:
        q, k = q[:, :, 1:], k[:, :, 1:]  # the statistic sees the decode call's tokens (the first is prefill)
        K, n = k.shape[1], k.shape[-1]
        q2 = q.reshape(2, K, -1, 32, n).pow(2).mean((0, 2, 3))
        kg = k.reshape(2, K, 4, 8, n)
        r2 = (kg.amax(3) - kg.amin(3)).pow(2).mean((0, 2))
        assert torch.allclose(imp[i], q2 * r2, rtol=1e-4)
    order = key_order(imp)
    assert imp[0][0, order[0][0][0]] == imp[0][0].max() and imp[0][0, order[0][0][-1]] == imp[0][0].min()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_bands_on_cuda_match_the_cpu():
    """On CUDA the banded cache must hold the same codes as on the CPU (2-bit low band through the Triton
    quantizer, 3-bit high band through torch) and decode to the same logits (the kernel reads the bands)."""
    from tale_runtime import set_backend

    x = keys(T=96)
    hi, lo = band_index(orders()[0], 8)
    cpu = dequantize(quantize_bands(x, [(2, lo), (3, hi)], 16, "8/16"))
    gpu = dequantize(quantize_bands(x.cuda(), [(2, lo.cuda()), (3, hi.cuda())], 16, "8/16"))
    assert torch.equal(cpu, gpu.cpu())

    base = tiny_model("llama")
    L, nh = base.config.num_hidden_layers, base.config.head_dim
    s = banded(
        levels=[Level(2, 2, None, key_hi_bits=4, key_hi_channels=8), Level(4, 4, 0.1)],
        ranks=[[nh, 2 * nh]] * L,
        key_order=orders(L, heads=base.config.num_key_value_heads, dim=nh),
    )
    ids = torch.randint(1, 320, (1, 48), generator=torch.Generator().manual_seed(0))
    out = {}
    for dev, kernel in (("cpu", False), ("cuda", False), ("cuda", True)):
        tm = talify(base, 2, s).to(dev)
        set_backend(tm, "triton" if kernel else "torch")
        i = ids.to(dev)
        with torch.no_grad():
            cache = new_cache(tm)
            tm(i[:, :12], **cache_arg(cache))
            logits = [tm(i[:, t : t + 1], **cache_arg(cache)).logits for t in range(12, 48)]
        out[dev, kernel] = torch.cat(logits, 1).cpu()
        assert isinstance(cache.layers[0].levels[0].keys, Bands)

    def rel(a, b):
        return ((out[a] - out[b]).norm() / out[b].norm()).item()

    # the same codes: the GPU's torch reference gives the CPU's logits to float32 rounding (H100: 2.7e-7); the
    # kernel against that reference within its float32 tolerance on CUDA (test_kernels.TOL: 5e-3 per call; H100:
    # 5.9e-4 on the logits, 3.4e-4 without bands), same greedy tokens
    assert rel(("cuda", False), ("cpu", False)) < 1e-5
    assert rel(("cuda", True), ("cuda", False)) < 5e-3
    assert torch.equal(out["cuda", True].argmax(-1), out["cpu", False].argmax(-1))
