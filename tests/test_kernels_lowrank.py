"""The low-rank-key decode kernel (tale_kernels.lowrank_attention) against the torch reference.

Views of the `lowrank` preset's layout (sinks and tail after RoPE at 16 bits; a middle level of low-rank key
coefficients before RoPE; plain levels before RoPE per channel and per token; fp8 or 16-bit scales) built with
runtime/quant.py on random data, and a real TaleCache of a tiny model filled through prefill and decode steps.
RoPE comes from transformers' LlamaRotaryEmbedding with llama3 rope scaling, read from the regions' tables or
computed in the kernel. On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, as tests/test_kernels.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import pytest
import torch
from kernel_tests import CUDA, DEVICE, interpret, kernels  # noqa: F401  (interpret: autouse fixture)

(lra,) = kernels("lowrank_attention", kernel="_lr_kernel")

from tale_runtime.attention import apply_rope  # noqa: E402
from tale_runtime.attention import latent_attention as ref_attention  # noqa: E402
from tale_runtime.key_basis import KeyBasis  # noqa: E402
from tale_runtime.quant import quantize  # noqa: E402
from tale_runtime.regions import LayerView, Region, Rotary  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def rotary(n: int, scaling: bool = True, device=DEVICE):
    """transformers' LlamaRotaryEmbedding of a config with llama3 rope scaling (or none)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rs = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    rs["original_max_position_embeddings"] = 64  # small, so short test positions cross the scaled bands
    kw = dict(rope_scaling=dict(rs, rope_theta=500000.0)) if scaling else {}
    cfg = LlamaConfig(hidden_size=n * 2, num_attention_heads=2, head_dim=n, max_position_embeddings=4096, **kw)
    rot = LlamaRotaryEmbedding(cfg).to(device)
    assert rot.rope_type == ("llama3" if scaling else "default")
    return rot


def tables(rot, pos: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, L, n] float32 of rope positions pos [B, L] (as the cache stores them: the model's tables in its
    dtype, read back in float32)."""
    x = torch.zeros(1, dtype=dtype, device=pos.device)
    cos, sin = rot(x, pos.clamp_min(0).long())
    return cos.float(), sin.float()


class Layout:
    """One test cache layout: the lowrank preset's by default."""

    def __init__(self, B=1, H=8, K=2, G=1, n=32, r=24, r0=None, lens=(4, 70, 24, 16, 3), pad=None, dtype=torch.float32):
        self.B, self.H, self.K, self.G, self.n, self.r, self.dtype = B, H, K, G, n, r, dtype
        self.R = (K // G) * n
        self.r0 = r0 or (2 * self.R // 3) // 8 * 8
        self.lens, self.pad = lens, pad or [0] * B


def make_view(
    lay: Layout,
    rot,
    *,
    kinds=None,
    extra=0,
    tensor_len=False,
    meta="8/8",
    lat_bits=3,
    lat_group=8,
    coef_bits=4,
    coef_group=8,
    blocks=1,
    seed=0,
):
    """A LayerView: sinks (16-bit, after RoPE) | low-rank coefficients (coef_bits, before RoPE; lay.r per block of a
    basis of `blocks` blocks: 1 joint, K / g per latent group, K per head) | 4-bit keys before RoPE per channel |
    8-bit keys before RoPE per token | 16-bit tail after RoPE, lengths lay.lens (0: empty, dropped); each region `extra` unused slots (NaN
    inside, pos -1)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, K, G, n, R, dt = lay.B, lay.K, lay.G, lay.n, lay.R, lay.dtype
    C = K * n

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(DEVICE)

    nb = C // blocks
    enc = torch.linalg.qr(torch.randn(blocks, nb, nb, generator=g))[0] * 2.0
    basis = KeyBasis(enc.to(DEVICE), torch.linalg.inv(enc).to(DEVICE), rnd(C, s=0.5), K, n)
    kinds = kinds or ["sink", "lowrank", "chan4", "tok8", "tail"]
    regions, p0 = [], 0
    for kind, used in zip(kinds, lay.lens):
        cap = used + extra
        if kind in ("lowrank", "chan4"):
            kg = coef_group if kind == "lowrank" else 8
            cap = -(-cap // kg) * kg  # whole key groups
        pos = torch.full((B, cap), -1, dtype=torch.int32, device=DEVICE)
        pos[:, :used] = torch.arange(p0, p0 + used, dtype=torch.int32, device=DEVICE)
        for b, pb in enumerate(lay.pad):
            pos[b][pos[b] < pb] = -1
        p0 += used
        if used == 0:
            continue
        rpos = pos - torch.tensor(lay.pad, device=DEVICE, dtype=torch.int32)[:, None]  # rope positions
        cos, sin = tables(rot, rpos, dt)
        k_pre = rnd(B, K, cap, n, s=2.0)
        rank = R if kind in ("sink", "tail", "chan4") else lay.r0
        h = rnd(B, G, cap, R)[..., :rank].contiguous().to(dt)
        if kind in ("sink", "tail"):
            keys = quantize(apply_rope(k_pre, cos, sin).to(dt), 16, 1, -2)
            lat, rope, bs = quantize(h, 16, 1, -1), None, None
        elif kind == "lowrank":
            coef = rnd(B, blocks, cap, lay.r, s=3.0).to(dt)
            keys = quantize(coef, coef_bits, coef_group, -2, meta)
            lat, rope, bs = quantize(h, lat_bits, lat_group, -1, meta), (cos, sin), basis
        elif kind == "chan4":
            keys = quantize(k_pre.to(dt), 4, 8, -2, meta)
            lat, rope, bs = quantize(h, 4, 8, -1, meta), (cos, sin), None
        else:  # tok8
            keys = quantize(k_pre.to(dt), 8, 8, -1, meta)
            lat, rope, bs = quantize(h, 8, 8, -1, meta), (cos, sin), None
        if extra:  # unused slots: garbage that must not leak in
            if kind == "lowrank":  # the scales of token groups that hold no token
                keys.scale[..., -(-used // coef_group) :, :] = float("nan")
            if keys.bits == 16:
                keys.data[..., used:, :] = float("nan")
            if lat.bits == 16:
                lat.data[..., used:, :] = float("nan")
            else:
                lat.scale[..., used:, :] = float("nan")
        length = torch.tensor([used], dtype=torch.int32, device=DEVICE) if tensor_len else used
        regions.append(Region(keys, lat, rank, pos, length, rope, bs))
    npos = torch.tensor(p0, dtype=torch.int32, device=DEVICE) if tensor_len else p0
    return LayerView(regions, npos)


def new_token(lay: Layout, rot, seed=1):
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, H, K, G, n, R, dt = lay.B, lay.H, lay.K, lay.G, lay.n, lay.R, lay.dtype
    q = torch.randn(B, H, 1, n, generator=g).to(DEVICE, dt)
    k = torch.randn(B, K, 1, n, generator=g).to(DEVICE, dt)
    h = torch.randn(B, G, 1, R, generator=g).to(DEVICE, dt)
    return q, k, h


def check(lay: Layout, tol=None, rope_modes=("tables", "kernel"), **kw):
    rot = rotary(lay.n)
    window = kw.pop("window", None)  # an argument of attention, not part of the view
    view = make_view(lay, rot, **kw)
    q, k, h = new_token(lay, rot)
    scaling = lay.n**-0.5
    ref = ref_attention(q.float(), k.float(), h.float(), view, scaling, window)
    assert lra.supported(q, k, h, view) is None, lra.supported(q, k, h, view)
    tol = tol or (1e-4 if lay.dtype == torch.float32 else 5e-3)
    for mode in rope_modes:
        rope = None if mode == "tables" else rot
        # blocks of several heads: the group's heads rebuilt in one dot, or head by head; per head: head by head
        for fused in (True, False) if kw.get("blocks", 1) < lay.K else (True,):
            z = lra.latent_attention_lowrank(
                q, k, h, view, scaling, window, rope=rope, split_tokens=32, fused_heads=fused
            )
            assert z.shape == ref.shape and torch.isfinite(z).all()
            e = rel(z, ref)
            assert e <= tol, (mode, fused, e)
    return view


@pytest.mark.parametrize("B", [1, 4])
def test_lowrank_preset_layout(B):
    check(Layout(B=B, pad=[0, 3, 5, 9][:B]))


@pytest.mark.parametrize(
    "launch",
    [
        dict(two_pass=False),  # scores, softmax and latents in one program per tile
        dict(score_heads=False),  # a score program per KV head
        dict(score_block=32, score_tokens=32),  # 32-slot score tiles, one per program
        # blocks of several heads scored by latent groups (per head: as before)
        dict(score_groups=True, score_block=32),
        dict(score_groups=False, coef_chunk=16, score_warps=4),  # blocks of several heads scored head by head
    ],
)
def test_launch_variants(launch):
    """Every way the kernel can split its work gives the reference's result (a joint basis, one per latent group of
    2 heads and one per head over 4 KV heads, 3-bit latents read by sub-planes, left padding, a window, device
    lengths, unused slots)."""
    rot = rotary(32)
    for blocks, r in ((1, 24), (2, 16), (4, 8)):
        lay = Layout(B=2, H=8, K=4, G=2, r=r, pad=[0, 5], lens=(4, 70, 24, 9, 3))
        view = make_view(lay, rot, blocks=blocks, extra=3, tensor_len=True)
        q, k, h = new_token(lay, rot)
        ref = ref_attention(q.float(), k.float(), h.float(), view, lay.n**-0.5, 50)
        z = lra.latent_attention_lowrank(q, k, h, view, lay.n**-0.5, 50, rope=rot, split_tokens=32, **launch)
        assert rel(z, ref) <= 1e-4, (blocks, launch, rel(z, ref))


@pytest.mark.parametrize("H,K,G", [(4, 4, 2), (8, 2, 1), (16, 2, 2), (16, 2, 1)])  # GQA ratios 1, 4, 8
def test_gqa_ratios(H, K, G):
    check(Layout(H=H, K=K, G=G, lens=(4, 37, 9, 5, 2)))


@pytest.mark.parametrize("n,r", [(64, 16), (64, 48), (128, 80)])
def test_head_dims_and_key_ranks(n, r):
    check(Layout(H=4, K=2, G=1, n=n, r=r, lens=(4, 33, 8, 3, 1)))


def test_odd_ranks_and_two_bit_codes():
    """A key rank that is no multiple of the coefficient chunk, 2-bit coefficients and latents, 16-bit scales."""
    check(Layout(r=20, lens=(3, 41, 0, 7, 5)), coef_bits=2, lat_bits=2, meta="16")
    check(Layout(r=40, lens=(0, 19, 11, 0, 0)), coef_bits=8, lat_bits=4, meta="8/16")


def test_empty_levels_sliding_window_device_lengths_and_unused_slots():
    lay = Layout(B=2, pad=[0, 6], lens=(8, 64, 0, 9, 4))
    check(lay, window=40, extra=5, tensor_len=True)
    check(Layout(lens=(4, 0, 16, 0, 1)))


@pytest.mark.parametrize("B", [1, 4])
def test_per_head_basis(B):
    """One basis block per KV head: coefficients [B, K, cap, r_h], each head rebuilt from its own."""
    check(Layout(B=B, r=12, pad=[0, 3, 5, 9][:B]), blocks=2)


@pytest.mark.parametrize("coef_bits,blocks", [(4, 1), (4, 2), (2, 2), (8, 1)])
def test_coefficients_in_tile_groups(coef_bits, blocks):
    """Coefficients quantized over groups of 32 tokens (the preset's; a 32-slot tile lies in one group): the kernel
    loads each packed row once and dequantizes it plane by plane. Token groups that hold no token have NaN scales; rows are padded."""
    r = (48 if coef_bits == 8 else 24) if blocks == 1 else 12  # 8-bit 48: rows of 48 bytes, two 32-byte chunks
    lay = Layout(B=2, r=r, pad=[0, 5], lens=(4, 70, 9, 3, 2))
    check(lay, coef_bits=coef_bits, coef_group=32, blocks=blocks, extra=7, window=60, rope_modes=("kernel",))


def test_per_head_basis_gqa_window_device_lengths_and_bf16():
    lay = Layout(B=2, H=16, K=4, G=2, r=10, pad=[0, 6], lens=(8, 45, 0, 9, 4))
    check(lay, blocks=4, window=40, extra=5, tensor_len=True, rope_modes=("kernel",))
    lay = Layout(B=2, H=8, K=2, G=1, n=64, r=24, pad=[0, 2], lens=(4, 75, 16, 8, 3), dtype=torch.bfloat16)
    check(lay, blocks=2, rope_modes=("tables",))


@pytest.mark.parametrize("B", [1, 3])
def test_basis_per_latent_group(B):
    """One basis block per latent group (the lowrank preset's): 4 KV heads in 2 groups of 2, each group's heads
    rebuilt from its own coefficients; and blocks of 2 heads under groups of 4 (two blocks per program)."""
    check(Layout(B=B, H=8, K=4, G=2, r=16, pad=[0, 3, 7][:B], lens=(4, 66, 12, 9, 2)), blocks=2, window=50)
    check(Layout(B=2, H=8, K=4, G=1, r=16, pad=[0, 4], lens=(4, 41, 8, 3, 1)), blocks=2, rope_modes=("kernel",))


def test_basis_blocks_the_kernel_refuses():
    """Blocks of whole heads run (3 blocks over 6 KV heads); 4 blocks over 6 heads straddle heads, and coefficients
    that do not match the basis' blocks are refused with the reason."""
    lay = Layout(H=12, K=6, G=3, r=8, lens=(4, 20, 8, 0, 2))
    rot = rotary(lay.n)
    q, k, h = new_token(lay, rot)
    view = make_view(lay, rot, blocks=3)
    assert lra.supported(q, k, h, view) is None
    b = view.regions[1].basis
    nb = lay.K * lay.n // 4
    eye = torch.eye(nb, device=b.enc.device).expand(4, nb, nb)
    view.regions[1] = replace(view.regions[1], basis=KeyBasis(eye, eye, b.mean, lay.K, lay.n))
    assert "a key basis of 4 blocks for 6 KV heads" in lra.supported(q, k, h, view)
    lay = Layout(H=8, K=4, G=2, r=8, lens=(4, 20, 8, 0, 2))
    q, k, h = new_token(lay, rot)
    per_head = make_view(lay, rot, blocks=4)
    assert lra.supported(q, k, h, per_head) is None
    joint_coef = make_view(lay, rot, blocks=1).regions[1].keys  # [B, 1, cap, r] against a basis of 4 blocks
    per_head.regions[1] = replace(per_head.regions[1], keys=joint_coef)
    assert "low-rank keys of shape" in lra.supported(q, k, h, per_head)


def test_bf16():
    check(Layout(B=2, H=8, K=2, G=1, n=64, r=40, pad=[0, 2], lens=(4, 75, 16, 8, 3), dtype=torch.bfloat16))


def test_bf16_16_bit_scales():
    check(Layout(n=64, r=32, dtype=torch.bfloat16), meta="16", lat_bits=4)


def test_basis_columns_fit_float16_whatever_their_range():
    """dec goes to the tensor cores in float16 (16-bit caches) as columns scaled by powers of two, undone exactly."""
    K, n, C = 2, 16, 32
    dec = torch.randn(C, K * n)
    dec[:, 3] *= 2.0**40  # a channel the queries barely read: key_basis.fit divides it by a tiny weight
    dec[:, 20] *= 2.0**-30
    bs = KeyBasis(torch.zeros(K * n, C), dec, torch.randn(K * n), K, n)
    lo, hi, rows = lra._basis_on(bs, n // 2, "cpu", torch.float16)
    assert lo.shape == hi.shape == (1, C, K * n // 2)
    assert lo.abs().max() <= 1 and hi.abs().max() <= 1 and torch.isfinite(lo).all() and torch.isfinite(hi).all()
    back = torch.stack([lo[0].float() * rows[2], hi[0].float() * rows[3]], 1)  # [C, 2, K n / 2]: per head lo | hi
    want = dec.view(C, K, 2, n // 2).transpose(1, 2).reshape(C, 2, K * n // 2)
    assert ((back - want).abs() / want.abs().amax(0)).max() <= 2**-11  # float16's rounding, per column's range
    assert torch.equal(rows[:2].flatten(), bs.mean.view(K, 2, n // 2).transpose(0, 1).flatten())
    # one block per head: block j's columns are head j's, rows still per head across the layer
    per = KeyBasis(torch.zeros(K, n, n), dec.view(C, K, n)[:n].transpose(0, 1).contiguous(), bs.mean, K, n)
    lo, hi, rows = lra._basis_on(per, n // 2, "cpu", torch.float16)
    assert lo.shape == hi.shape == (K, n, n // 2)
    back = torch.cat([lo.float() * rows[2].view(K, 1, n // 2), hi.float() * rows[3].view(K, 1, n // 2)], -1)
    assert ((back - per.dec).abs() / per.dec.abs().amax(1, keepdim=True)).max() <= 2**-11


def test_without_rope_scaling_and_supported_reasons():
    lay = Layout(lens=(4, 30, 8, 0, 2))
    rot = rotary(lay.n, scaling=False)
    view = make_view(lay, rot)
    q, k, h = new_token(lay, rot)
    ref = ref_attention(q, k, h, view, 0.2)
    assert rel(lra.latent_attention_lowrank(q, k, h, view, 0.2, rope=rot), ref) < 1e-4
    inv = (rot.inv_freq, rot.attention_scaling)
    assert rel(lra.latent_attention_lowrank(q, k, h, view, 0.2, rope=inv), ref) < 1e-4
    q2, k2, h2 = (t.expand(-1, -1, 2, -1) for t in (q, k, h))  # two new tokens: the reference's by design
    assert lra.supported(q2, k2, h2, view) == "2 new tokens (the kernel decodes one)"
    assert torch.equal(lra.latent_attention_lowrank(q2, k2, h2, view, 0.2), ref_attention(q2, k2, h2, view, 0.2))
    half = (rot.inv_freq[: lay.n // 4], 1.0)
    assert "inv_freq" in lra.supported(q, k, h, view, rope=half)
    # a region's own Rotary serves like a given rotary; one of the wrong size or dtype is refused with the reason
    B = q.shape[0]
    own = [replace(r, rope=Rotary(rot.inv_freq, rot.attention_scaling, torch.zeros(B, dtype=torch.int32, device=q.device), q.dtype)) if r.rope is not None else r for r in view.regions]  # fmt: skip
    assert rel(lra.latent_attention_lowrank(q, k, h, LayerView(own, view.next_pos), 0.2), ref) < 1e-4
    for bad in (
        Rotary(rot.inv_freq[: lay.n // 4], 1.0, own[1].rope.offset, q.dtype),
        replace(own[1].rope, dtype=torch.float16),
    ):
        odd = LayerView([replace(r, rope=bad) if r.rope is not None else r for r in view.regions], view.next_pos)
        why = lra.supported(q, k, h, odd)
        assert why.startswith("a Rotary of ")
        with pytest.raises(ValueError, match=f"^triton low-rank-key latent attention: {re.escape(why)}$"):
            lra.latent_attention_lowrank(q, k, h, odd, 0.2)


@pytest.mark.parametrize("static, per_layer", [(False, False), (True, False), (False, True), (True, True)])
def test_real_cache_through_a_tiny_model(static, per_layer):
    """A tiny llama talified with the lowrank preset's schedule (a random key basis), filled by a left-padded
    prefill and decode steps through the model; the kernel as the attention backend matches the reference. The
    dynamic cache's regions carry RoPE tables, the static cache's a Rotary (the kernel computes RoPE from it).
    per_layer: the middle level's coefficients per layer (Schedule.key_ranks, 16 and 32): the kernel takes each
    region's count from its tensors."""
    from tale_helpers import grouped_schedule, talify, tiny_model

    from tale_runtime import backends, new_cache
    from tale_runtime.artifact import Level, with_key_ranks
    from tale_runtime.model import cache_arg

    base = tiny_model("llama")
    cfg = base.config
    K, n, L = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    R = 2 * n
    levels = [
        Level(3, 4, None, key_rank=24),
        Level(4, 4, 0.1),
        Level(8, 8, 0.0, key_axis="token"),
    ]
    s = grouped_schedule(
        levels, [[16, R, R]] * L, sinks=4, residual=8, key_channel_group=8, key_meta="8/8", key_rope="pre"
    )
    if per_layer:
        s = with_key_ranks(s, [[16 * (1 + i % 2), 0, 0] for i in range(L)])
    tm = talify(base, 2, s).to(DEVICE)
    g = torch.Generator().manual_seed(3)
    bases = []
    for _ in range(L):
        enc = torch.linalg.qr(torch.randn(K * n, K * n, generator=g))[0]
        bases.append(KeyBasis(enc.to(DEVICE), enc.T.contiguous().to(DEVICE), torch.zeros(K * n, device=DEVICE), K, n))
    tm.tale_spec.key_basis = bases
    rot = tm.model.rotary_emb
    calls = []

    @dataclass(frozen=True)
    class Checked(backends.AttentionBackend):  # the kernel's z drives generation, checked at every call
        name: str = "checked"
        label: str = "checked"

        def run(self, q, k, h, view, scaling, window):
            # no host sync here: a static cache's steps are CUDA graphs, whose replays refill these error tensors
            ref = ref_attention(q, k, h, view, scaling, window)
            assert lra.supported(q, k, h, view) is None, lra.supported(q, k, h, view)
            for rope in (rot, None):
                z = lra.latent_attention_lowrank(q, k, h, view, scaling, window, rope=rope, split_tokens=16)
                calls.append((z.float() - ref.float()).norm() / ref.float().norm())
            return z

    ids = torch.randint(0, cfg.vocab_size, (2, 50), generator=g).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    with torch.no_grad():  # a failed capture is an error here (pyproject's filterwarnings)
        cache = new_cache(tm, backend=Checked(), static=static, max_length=60 if static else None)
        tm.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, **cache_arg(cache))
    from tale_runtime.decode import decoder_of

    dec = decoder_of(tm, cache) if static and CUDA else None
    steps = 2 if dec is not None and dec.graph is not None else 3  # a captured step runs Python once, then replays
    regions = cache.layers[0].view().regions
    kinds = {(r.basis is not None, r.rope is not None, r.keys.bits) for r in regions}
    assert all(isinstance(r.rope, Rotary) == static for r in regions if r.rope is not None)
    assert (True, True, 4) in kinds and (False, True, 8) in kinds and (False, False, 16) in kinds, kinds
    errs = [e.item() for e in calls]
    assert len(errs) == 2 * L * steps and max(errs) < 1e-4, errs
    counts = [{r.keys.shape[-1] for r in layer.view().regions if r.basis is not None} for layer in cache.layers]
    assert counts == [{s.key_rank(i, 0)} for i in range(L)], counts


def test_registered_as_a_named_backend():
    """The runtime finds the kernel as the "triton-lowrank" backend, which "auto" picks on a GPU for the caches no
    other kernel reads (keys before RoPE here) and never elsewhere, and a cache made with it gives the reference's
    attention over its own view."""
    from tale_helpers import talify, tiny_model

    from tale_runtime import backends, new_cache
    from tale_runtime.artifact import Level, Schedule
    from tale_runtime.model import cache_arg
    from tale_runtime.spec import CacheSpec

    b = backends.get("triton-lowrank")
    base = tiny_model("llama")
    L, nh, K = base.config.num_hidden_layers, base.config.head_dim, base.config.num_key_value_heads
    s = Schedule(
        sinks=2,
        levels=[Level(4, 4, None), Level(4, 4, 0.2)],
        ranks=[[nh, 2 * nh]] * L,
        key_group=8,
        value_group=8,
        residual=8,
        key_rope="pre",
    )
    tm = talify(base, 2, s).to(DEVICE)
    arch = tm.tale_spec.rank_arch()
    cuda = torch.device("cuda")
    for sched, want in ((s, b), (replace(s, key_rope="post"), backends.get("triton"))):
        assert backends.choose(CacheSpec(arch, sched, False, cuda)) is want  # on a GPU: the first that reads it
    assert backends.choose(CacheSpec(arch, s, False, torch.device("cpu"))) is backends.TORCH  # elsewhere: torch
    cache = new_cache(tm, backend="triton-lowrank")
    assert cache.backend is b
    ids = torch.randint(1, 320, (1, 40), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        tm(ids, **cache_arg(cache))
        gen = torch.Generator().manual_seed(1)
        q = torch.randn(1, tm.config.num_attention_heads, 1, nh, generator=gen).to(DEVICE)
        k = torch.randn(1, K, 1, nh, generator=gen).to(DEVICE)
        h = torch.randn(1, K // 2, 1, 2 * nh, generator=gen).to(DEVICE)
        want = ref_attention(q, k, h, cache.layers[0].view(), nh**-0.5)
        assert rel(cache.attend(0, q, k, h, nh**-0.5), want) < 1e-4


# -- the score pass in CUDA (kernels/lowrank_score.py): head dim 128, bf16/fp16, on a GPU

CUDA_SCORE_CASES = [
    # (B, H, K, G, blocks, r, coef_bits, meta, dtype, pad, window, rope scaling)
    (1, 16, 4, 1, 1, 96, 4, "8/8", torch.bfloat16, None, None, True),  # a basis per group of 4 (the preset's)
    (4, 16, 4, 1, 1, 96, 4, "8/8", torch.bfloat16, [0, 3, 17, 40], 150, True),  # left padding, a window
    (16, 8, 4, 2, 2, 48, 4, "8/8", torch.float16, [3 * i for i in range(16)], None, False),  # per group of 2, fp16
    (2, 32, 4, 1, 1, 64, 2, "16", torch.bfloat16, [0, 5], None, True),  # GQA 8, 2-bit codes, 16-bit scales
    (2, 4, 4, 4, 4, 40, 8, "8/8", torch.bfloat16, [0, 7], None, True),  # GQA 1, per head, 8-bit codes
    (1, 16, 4, 1, 1, 152, 4, "8/8", torch.bfloat16, None, None, True),  # the 8B shape's coefficient count
]


@pytest.mark.skipif(not CUDA, reason="the CUDA score pass needs a GPU")
@pytest.mark.parametrize("case", CUDA_SCORE_CASES)
def test_cuda_score_pass(case):
    """The score pass in CUDA gives the reference's result within 5e-3 and agrees with the Triton score pass, with
    RoPE computed and from the tables, odd lengths, unused slots (NaN scales), device lengths."""
    from tale_kernels import lowrank_score

    B, H, K, G, blocks, r, bits, meta, dt, pad, window, scaled = case
    lay = Layout(B=B, H=H, K=K, G=G, n=128, r=r, lens=(4, 397, 40, 17, 5), pad=pad, dtype=dt)
    rot = rotary(128, scaling=scaled)
    view = make_view(lay, rot, blocks=blocks, coef_bits=bits, coef_group=32, meta=meta, extra=7, tensor_len=B > 1)
    lowr = next(x for x in view.regions if x.basis is not None)
    assert (
        lowrank_score.reason(torch.empty(1, 1, 1, 128, dtype=dt, device="cuda"), lowr.keys, H // K, K // blocks, K)
        is None
    )
    q, k, h = new_token(lay, rot)
    ref = ref_attention(q.float(), k.float(), h.float(), view, 128**-0.5, window)
    for rope in (rot, None):
        zc = lra.latent_attention_lowrank(q, k, h, view, 128**-0.5, window, rope=rope, score_cuda=True)
        zt = lra.latent_attention_lowrank(q, k, h, view, 128**-0.5, window, rope=rope, score_cuda=False)
        assert torch.isfinite(zc).all()
        assert rel(zc, ref) <= 5e-3, (rope is None, rel(zc, ref))
        assert rel(zc, zt) <= 5e-3, (rope is None, rel(zc, zt))


# -- the latent pass in CUDA (kernels/lowrank_latent.py): rank 512, 3-bit latents in groups of 64, on a GPU

CUDA_LATENT_CASES = [
    # (B, H, K, G, meta, dtype, pad, window)
    (1, 16, 4, 1, "8/8", torch.bfloat16, None, None),  # Llama-3.1-8B's latent group (the preset's)
    (4, 16, 4, 1, "8/8", torch.bfloat16, [0, 3, 17, 40], 150),  # left padding, a window
    (2, 8, 4, 1, "16", torch.float16, [0, 5], None),  # GQA 2 (8 of 16 rows), 16-bit scales, fp16
    (3, 32, 8, 2, "8/8", torch.bfloat16, [0, 9, 1], None),  # two latent groups
]


@pytest.mark.skipif(not CUDA, reason="the CUDA latent pass needs a GPU")
@pytest.mark.parametrize("case", CUDA_LATENT_CASES)
def test_cuda_latent_pass(case, monkeypatch):
    """Both CUDA passes give the reference's result within 5e-3 and agree with the Triton latent launch, with odd
    lengths, unused slots (NaN scales), padding, windows, device lengths, and splits that hold no slot."""
    from tale_kernels import lowrank_latent

    B, H, K, G, meta, dt, pad, window = case
    lay = Layout(B=B, H=H, K=K, G=G, n=128, r=96, r0=512, lens=(4, 397, 40, 17, 5), pad=pad, dtype=dt)
    rot = rotary(128)
    view = make_view(lay, rot, blocks=G, coef_bits=4, coef_group=32, meta=meta, extra=7, tensor_len=B > 1, lat_group=64)
    lowr = next(x for x in view.regions if x.basis is not None)
    sc = torch.empty(B, H, lowr.capacity, device="cuda")
    q, k, h = new_token(lay, rot)
    assert lowrank_latent.reason(q, lowr.lat, lowr.rank, H // G, sc, lowr.pos) is None
    ref = ref_attention(q.float(), k.float(), h.float(), view, 128**-0.5, window)
    for split in (None, 64, 1000):  # the default splits, one tile each, one split (the others empty)
        kw = dict(rope=rot, score_cuda=True, split_tokens=split)
        monkeypatch.setattr(lowrank_latent, "VARIANT", "cuda")
        zc = lra.latent_attention_lowrank(q, k, h, view, 128**-0.5, window, **kw)
        monkeypatch.setattr(lowrank_latent, "VARIANT", "triton")
        zt = lra.latent_attention_lowrank(q, k, h, view, 128**-0.5, window, **kw)
        assert torch.isfinite(zc).all()
        assert rel(zc, ref) <= 5e-3, (split, rel(zc, ref))
        assert rel(zc, zt) <= 5e-3, (split, rel(zc, zt))


def test_cuda_latent_pass_refusals():
    """Latents the CUDA latent pass does not read are refused with the reason, before any device is asked."""
    from tale_kernels import lowrank_latent

    lay = Layout(B=1, H=16, K=4, G=1, n=128, r=96, r0=256, lens=(4, 40, 8, 8, 3))
    view = make_view(lay, rotary(128), lat_group=32)
    lowr = next(x for x in view.regions if x.basis is not None)
    q = torch.empty(1, 16, 1, 128, device=DEVICE)
    sc = torch.empty(1, 16, lowr.capacity, device=DEVICE)
    assert "rank 256" in lowrank_latent.reason(q, lowr.lat, lowr.rank, 16, sc, lowr.pos)
    lay = Layout(B=1, H=16, K=4, G=1, n=128, r=96, r0=512, lens=(4, 40, 8, 8, 3))
    for bits, group, qg, why in ((4, 64, 16, "3-bit"), (3, 64, 32, "at most 16"), (3, 8, 16, "groups of 64")):
        view = make_view(lay, rotary(128), lat_bits=bits, lat_group=group)
        lowr = next(x for x in view.regions if x.basis is not None)
        assert why in lowrank_latent.reason(q, lowr.lat, lowr.rank, qg, sc, lowr.pos)


@pytest.mark.skipif(not CUDA, reason="the CUDA score pass needs a GPU")
def test_cuda_score_pass_refusals():
    """What the CUDA score pass does not read is refused with its reason, and score_cuda=True raises it."""
    from tale_kernels import lowrank_score

    lay = Layout(B=1, H=8, K=2, G=1, n=32, r=24)
    rot = rotary(32)
    view = make_view(lay, rot)
    lowr = next(x for x in view.regions if x.basis is not None)
    q, k, h = new_token(lay, rot)
    assert "head dim 32" in lowrank_score.reason(q, lowr.keys, 4, 2, 2)
    with pytest.raises(ValueError, match="CUDA score pass cannot read"):
        lra.latent_attention_lowrank(q, k, h, view, 32**-0.5, rope=rot, score_cuda=True)
