"""Cache formats beyond plain KIVI: 3-bit codes, fp8 scales/zeros, per-token keys, the Hadamard rotation
of q and k (tale_runtime.quant, cache, model), and how schedules carrying them are read."""

import pytest
import torch
import torch.utils._pytree as pytree
from tale_helpers import talify, tiny_model

from tale_runtime import new_cache
from tale_runtime.artifact import ArtifactError, Level, Schedule, uniform_ranks
from tale_runtime.cache import RegionStore
from tale_runtime.model import cache_arg, hadamard
from tale_runtime.quant import FP8, _fp8_round, cat, dequantize, pack, quantize, requantize, split, unpack


def test_3bit_pack_round_trip_and_size():
    codes = torch.randint(0, 8, (2, 3, 5, 24), generator=torch.Generator().manual_seed(0))
    packed = pack(codes, 3)
    assert packed.shape == (2, 3, 5, 9) and packed.dtype == torch.uint8  # 24 codes in 9 bytes
    assert torch.equal(unpack(packed, 3), codes.to(torch.uint8))
    with pytest.raises(ValueError, match="multiple of 8"):
        pack(codes[..., :20], 3)


def test_3bit_layout_is_bit_sliced():
    """Low 2 bits planar at 2 bits (C/4 bytes), then the high bit planar at 1 bit (C/8 bytes): channel
    s*C/8 + j (sub-plane s) sits in low byte (s % 2)*C/8 + j at bit 2*(s // 2) and in high byte j at bit s,
    the constant shifts the decode kernel reads (kernels/attention.py)."""
    C, nb1 = 64, 8
    codes = torch.randint(0, 8, (4, C), generator=torch.Generator().manual_seed(3))
    p = pack(codes, 3).to(torch.int32)
    for ch in range(C):
        s, j = divmod(ch, nb1)
        lo = (p[:, (s % 2) * nb1 + j] >> (2 * (s // 2))) & 3
        hi = (p[:, 2 * nb1 + j] >> s) & 1
        assert torch.equal(lo | (hi << 2), codes[:, ch].to(torch.int32)), ch


def fp8_values() -> torch.Tensor:
    """Every finite float8_e4m3fn value, sorted, one zero (float32)."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    return v[torch.isfinite(v)].unique()


def test_fp8_rounding_is_directed():
    x = torch.randn(4000, generator=torch.Generator().manual_seed(1)) * torch.logspace(-4, 2, 4000)
    up, down = _fp8_round(x, up=True), _fp8_round(x, up=False)
    assert up.dtype == down.dtype == FP8
    assert (up.float() >= x).all() and (down.float() <= x).all()
    # adjacent representable values: nothing of e4m3 lies strictly between them
    table = fp8_values()
    between = ((table[None] > down.float()[:, None]) & (table[None] < up.float()[:, None])).any(1)
    assert not between.any()


@pytest.mark.parametrize("meta", ["16", "8/16", "8/8"])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("dim,group", [(-2, 8), (-1, 16)])
def test_every_format_stays_within_half_a_step(meta, bits, dim, group):
    torch.manual_seed(bits)
    x = (torch.randn(2, 3, 32, 64) * torch.rand(1, 3, 1, 64) + torch.randn(1, 3, 1, 64)).to(torch.bfloat16)
    # "16" stores scale and zero rounded to x's dtype: its exact bound holds in float32 (test_quant)
    xe = x.float() if meta == "16" else x
    qe = quantize(xe, bits, group, dim, meta)
    scale = qe.scale.float() / qe.bias
    got = dequantize(qe, torch.float32)
    half = scale.repeat_interleave(group, dim=dim) / 2
    assert ((got - x.float()).abs() <= half * (1 + 1e-3) + 1e-6).all()
    q = quantize(x, bits, group, dim, meta)
    # bytes: packed codes + one scale and one zero per group, in their storage dtypes
    groups = x.numel() // group
    meta_bytes = {"16": 4, "8/16": 3, "8/8": 2}[meta]
    assert q.nbytes() == x.numel() * bits // 8 + groups * meta_bytes + (4 if meta != "16" else 0)  # + the fp8 bias
    # a requantize without changes keeps the layout; cat/split keep the format
    a, b = split(q, 16)
    assert cat([a, b]).meta == meta and torch.equal(dequantize(cat([a, b])), dequantize(q))
    assert requantize(q, bits).meta == meta


def test_requantize_changes_layout():
    x = torch.randn(1, 2, 32, 16)
    q = quantize(x, 4, 16, dim=-1)  # per token
    r = requantize(q, 2, group=8, dim=-2, meta="8/16")  # -> per channel over 8 tokens, fp8 scales
    assert r.dim == -2 and r.group == 8 and r.scale.shape == (1, 2, 4, 16) and r.scale.dtype == FP8
    assert torch.allclose(dequantize(r), dequantize(quantize(dequantize(q), 2, 8, -2, "8/16")))


K, n, G, R = 2, 16, 1, 32


def mixed(**kw) -> Schedule:
    """Middle: 2-bit per-channel keys, fp8 scales; recent: 4-bit per-token keys, so no residual is needed."""
    kw = (
        dict(sinks=3, key_group=8, value_group=8, residual=1, key_channel_group=8, key_meta="8/16", value_meta="8/8")
        | kw
    )
    return Schedule(levels=[Level(2, 3, None), Level(4, 4, 0.2, key_axis="token")], ranks=[[8, 32]], **kw)


def test_mixed_key_axes_keep_the_region_invariants():
    s = mixed()
    s.validate(R, 1)
    g = torch.Generator().manual_seed(0)
    k, h = torch.randn(1, K, 200, n, generator=g), torch.randn(1, G, 200, R, generator=g)
    c = RegionStore(s, 0, K, n, G, R)
    c.append(k[..., :37, :], h[..., :37, :])  # prefill: not a multiple of the key group
    for t in range(37, 200):
        c.append(k[..., t : t + 1, :], h[..., t : t + 1, :])
        ln = c.lengths()
        assert sum(ln.values()) == t + 1 and ln["residual"] == 0  # everything quantized at once
        assert ln["level0"] % 8 == 0  # per-channel level: whole token groups
        N = t + 1 - 3
        assert abs(ln["level1"] - -(-N // 5)) < 8
    st0, st1 = c.levels
    assert st0.keys.dim == -2 and st0.keys.bits == 3 and st0.keys.meta == "8/16"
    assert st1.keys.dim == -1 and st1.keys.group == 8 and st1.lat.meta == "8/8"
    # the oldest middle group came down through the per-token level: its error is that of 3-bit keys
    deq = dequantize(st0.keys, torch.float32)
    ref = k[..., 3 : 3 + st0.length, :]
    assert ((deq - ref).norm() / ref.norm()).item() < 0.25


def test_token_axis_levels_must_be_newest_and_formats_are_checked():
    bad = Schedule(
        levels=[Level(2, 2, None, key_axis="token"), Level(4, 4, 0.1)],
        ranks=[[16, 32]],
        key_group=8,
        value_group=8,
        residual=8,
    )
    with pytest.raises(ArtifactError, match="newest"):
        bad.validate(R, 1)
    with pytest.raises(ArtifactError, match="key_meta"):
        mixed(key_meta="4/4").validate(R, 1)
    with pytest.raises(ArtifactError, match="rotate"):
        mixed(rotate="random").validate(R, 1)
    assert not mixed().plain_layout() and Schedule(ranks=[[16, 32]]).plain_layout()


def test_schedule_from_older_and_newer_manifests():
    old = {
        "sinks": 4,
        "levels": [{"bits": 2, "key_bits": 2, "share": None}, {"bits": 4, "key_bits": 4, "share": 0.1}],
        "ranks": [[96, 192]],
        "key_group": 32,
        "value_group": 32,
        "residual": 32,
        "policy": "uniform",
    }
    s = Schedule.from_dict(old)  # fields added since take their defaults: the plain layout
    assert s.plain_layout() and s.rotate == "none" and s.levels[1].key_axis == "channel"
    assert Schedule.from_dict(mixed().to_dict()) == mixed()
    with pytest.raises(ArtifactError, match="'key_codebook' is unknown"):
        Schedule.from_dict(old | {"key_codebook": "nf4"})


def test_hadamard_is_orthogonal():
    Q = hadamard(64, "cpu", torch.float64)
    assert torch.allclose(Q @ Q.T, torch.eye(64, dtype=torch.float64), atol=1e-12)


def test_rotation_leaves_exact_decoding_unchanged_and_the_prefill_bit_identical():
    base = tiny_model("llama")
    L, Rr = base.config.num_hidden_layers, 2 * base.config.head_dim
    exact = Schedule(
        sinks=2,
        levels=[Level(16, 16, None), Level(16, 16, 0.1, key_axis="token")],
        ranks=[[Rr, Rr]] * L,
        key_group=8,
        value_group=8,
        residual=1,
        rotate="hadamard",
        key_channel_group=16,
    )
    tm = talify(base, 2, exact)
    ids = torch.randint(1, 320, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = base(ids).logits
        cache = new_cache(tm)
        pre = tm(ids[:, :12], **cache_arg(cache)).logits
        out = [tm(ids[:, t : t + 1], **cache_arg(cache)).logits for t in range(12, 40)]
    assert torch.equal(
        pre,
        talify(base, 2, exact_plain(exact))(
            ids[:, :12], **cache_arg(new_cache(talify(base, 2, exact_plain(exact))))
        ).logits,
    )
    got = torch.cat(out, 1)
    assert ((got - ref[:, 12:]).norm() / ref[:, 12:].norm()).item() < 1e-4
    # the cached keys are the rotated ones
    k0 = cache.layers[0].levels[0]
    assert k0 is not None
    # a lossy rotated schedule does compress (the test can tell)
    lossy = Schedule(
        sinks=2,
        levels=[Level(2, 2, None), Level(4, 4, 0.1, key_axis="token")],
        ranks=uniform_ranks(Rr, L, 0.5, 8),
        key_group=8,
        value_group=8,
        residual=1,
        rotate="hadamard",
        key_channel_group=16,
    )
    tm.tale_spec.schedule = lossy
    with torch.no_grad():
        cache = new_cache(tm)
        tm(ids[:, :12], **cache_arg(cache))
        got = torch.cat([tm(ids[:, t : t + 1], **cache_arg(cache)).logits for t in range(12, 40)], 1)
    assert ((got - ref[:, 12:]).norm() / ref[:, 12:].norm()).item() > 1e-3


def exact_plain(s: Schedule) -> Schedule:
    from dataclasses import replace

    return replace(s, rotate="none")


@pytest.mark.parametrize("meta", ["8/16", "8/8"])
def test_cat_rebiases_fp8_parts_exactly(meta):
    g = torch.Generator().manual_seed(3)
    a = quantize(torch.randn(1, 2, 8, 32, generator=g) * 50, 4, 16, -1, meta)
    b = quantize(torch.randn(1, 2, 8, 32, generator=g) * 0.5, 4, 16, -1, meta)
    assert a.bias < b.bias
    c = cat([a, b])
    assert c.bias == a.bias
    assert torch.equal(dequantize(c)[..., :8, :], dequantize(a)) and torch.equal(
        dequantize(c)[..., 8:, :], dequantize(b)
    )


@pytest.mark.parametrize("up", [True, False])
def test_fp8_rounding_reads_nothing_from_the_host(up):
    """Traced as a compiled write traces it, every value of the directed fp8 rounding lives on the input's device: a
    CUDA graph capturing its first call copies nothing from the host (which a capture cannot do), and the result is
    the nearest fp8 value on its side, saturating at +-448 (the table of every finite e4m3 value, searched)."""
    devices = []

    def record(gm, example_inputs):
        values = [n.meta.get("example_value") for n in gm.graph.nodes]
        devices.extend(v.device.type for v in pytree.tree_leaves(values) if isinstance(v, torch.Tensor))
        return gm

    torch._dynamo.reset()
    torch.compile(lambda x: _fp8_round(x, up), backend=record, fullgraph=True)(torch.empty(64, device="meta"))
    assert devices and set(devices) == {"meta"}, devices
    table = fp8_values()
    mids = (table[1:] + table[:-1]) / 2
    x = torch.cat([table, mids, table + 1e-6, table - 1e-6, torch.tensor([0.0, -0.0, 500.0, -500.0, 1e-30, -1e-30])])
    i = torch.searchsorted(table, x, right=not up) - (0 if up else 1)
    assert torch.equal(_fp8_round(x, up).float(), table[i.clamp(0, len(table) - 1)])
