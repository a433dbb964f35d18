"""The two-pass decode attention (kernels/attention_split.py) against the torch reference.

Same set-up as test_kernels.py (interpreter on CPU, compiled on CUDA), whose helpers and cases
it reuses; every check draws fresh random inputs.
"""

# ruff: noqa: I001  (test_kernels first: it sets TRITON_INTERPRET before triton is imported)
from __future__ import annotations

import pytest
import torch

from test_kernels import CASES, CUDA, DEVICE, FORMATS, TOL, _grow, format_schedule, held_meta, layer_cache, rel

import tale_kernels  # noqa: E402
from tale_kernels import attention, attention_split  # noqa: E402
from tale_runtime.cache import latent_attention as ref_attention  # noqa: E402
from tale_runtime.quant import Bands, QTensor  # noqa: E402
from tale_runtime.regions import LayerView, Region  # noqa: E402

# bf16 caches store float16 metadata, which the two passes decline (test_split_declines_float16_metadata)
DTYPES = [torch.float32, torch.float16]

# odd lengths, padding, tiny splits, MHA, rep 3, the CUDA-core path, a prompt inside the sinks, groups of 32
SPLIT_CASES = ["gqa-g2-pad-splits", "gqa-g4-small-splits", "mha-g1", "rep3-g2", "rank8", "prompt-in-sinks", "group32"]


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SPLIT_CASES)
def test_split_matches_reference(case, dtype):
    B, H, K, g, n, L0, pad, kw = CASES[case]
    kw = dict(kw)
    group = kw.pop("group", 16)
    c = layer_cache(B, H, K, g, n, L0, dtype, pad=pad, group=group)
    G, R = K // g, g * n
    assert attention_split.supported_split(c)
    for step in range(3):  # decode steps: regions fill, flush and demote in between
        q = torch.randn(B, H, 1, n, device=DEVICE, dtype=dtype)
        k = torch.randn(B, K, 1, n, device=DEVICE, dtype=dtype)
        h = torch.randn(B, G, 1, R, device=DEVICE, dtype=dtype)
        # query planes reloaded per tile or held; regions launched together, the biggest alone, or each alone
        opts = {"k_tiles": 1 + step, "q_regs": step == 1, "solo": (0, 1, 4)[step]}
        z = tale_kernels.latent_attention(q, k, h, c, n**-0.5, split=opts, **kw)
        assert z.shape == (B, 1, H, R) and z.dtype == torch.float32
        want = ref_attention(q, k, h, c, n**-0.5)
        assert rel(z, want) < TOL[dtype]
        c.append(k, h)


def test_split_logits_are_the_masked_scores():
    """The first pass alone: log2-domain scores of every cached slot, -inf where masked (padding, window)."""
    dtype = torch.float32
    c = layer_cache(2, 8, 4, 2, 32, 90, dtype, pad=[0, 7])
    c.window = 50
    q = torch.randn(2, 8, 1, 32, device=DEVICE, dtype=dtype)
    k = torch.randn(2, 4, 1, 32, device=DEVICE, dtype=dtype)
    h = torch.randn(2, 2, 1, 64, device=DEVICE, dtype=dtype)
    v = c.view()
    lg = attention_split.latent_attention_split(q, k, h, v, 0.25, logits_only=True)
    off = 0
    for r in v.regions:
        keys = ref_quant_keys(r)  # [B, K, L, n]
        L = r.length
        s = torch.einsum("bhn,bhtn->bht", q[:, :, 0].float(), keys.repeat_interleave(2, dim=1).float()) * 0.25
        s = s * 1.4426950408889634
        pos = r.pos[:, :L]
        ok = (pos >= 0) & (v.next_pos - pos < 50)
        want = torch.where(ok[:, None, :], s, float("-inf"))
        got = lg[:, :, off : off + L]
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        fin = torch.isfinite(want)
        # compiled float32 dots run in TF32 (as in the one-pass kernel): TOL is 5e-3 on CUDA, 1e-5 interpreted
        assert not fin.any() or rel(got[fin], want[fin]) < TOL[dtype]
        off += r.capacity
    assert (~torch.isfinite(lg)).any() and torch.isfinite(lg).any()


def ref_quant_keys(r):
    from tale_runtime.quant import dequantize

    keys = r.keys.data if r.keys.bits == 16 else dequantize(r.keys)
    return keys[:, :, : r.length]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_sliding_window_and_static_view(dtype):
    """Windows, and a static-cache-like view (NaN past the lengths, device lengths and next_pos,
    regions reversed, one empty region)."""
    c = layer_cache(2, 8, 4, 2, 64, 150, dtype, pad=[0, 9])
    q, k, h = (
        torch.randn(2, 8, 1, 64, device=DEVICE, dtype=dtype),
        torch.randn(2, 4, 1, 64, device=DEVICE, dtype=dtype),
        torch.randn(2, 2, 1, 128, device=DEVICE, dtype=dtype),
    )
    for window in (40, 7):
        c.window = window
        z = tale_kernels.latent_attention(q, k, h, c, 0.125, split=True, split_tokens=32)
        assert rel(z, ref_attention(q, k, h, c, 0.125)) < TOL[dtype]
    c.window = None
    v = c.view()
    regions = []
    for r in v.regions:
        pos = torch.cat([r.pos, torch.full((2, 32), -1, dtype=torch.int32, device=DEVICE)], dim=-1)
        length = torch.tensor([r.length], dtype=torch.int32, device=DEVICE)
        regions.append(Region(_grow(r.keys, 32, float("nan")), _grow(r.lat, 32, float("nan")), r.rank, pos, length))
    e = regions[0]
    regions.append(
        Region(e.keys, e.lat, e.rank, torch.full_like(e.pos, -1), torch.zeros(1, dtype=torch.int32, device=DEVICE))
    )
    view = LayerView(regions[::-1], torch.tensor(v.next_pos, dtype=torch.int32, device=DEVICE), None)
    assert attention.supported(q, k, h, view)
    z = tale_kernels.latent_attention(q, k, h, view, 0.125, split={"k_tiles": 2})
    assert torch.isfinite(z).all()
    assert rel(z, ref_attention(q, k, h, c, 0.125)) < TOL[dtype]
    # more regions than one launch takes (NREG = 4): two launches per pass
    view = LayerView(view.regions + view.regions[:2], view.next_pos, None)
    assert len(view.regions) > attention.NREG
    z = tale_kernels.latent_attention(q, k, h, view, 0.125, split={"solo": 0})
    assert rel(z, ref_attention(q, k, h, view, 0.125)) < TOL[dtype]


def test_split_falls_back_to_one_pass_for_other_formats(monkeypatch):
    """Key bands, fp8 scales/zeros and 3-bit keys are not read by the two passes: supported_split declines any
    view holding such a region (one is enough) and latent_attention(split=...) runs the one-pass kernel, which
    matches the reference; plain views still take the two passes."""
    B, H, K, g, n = 1, 4, 2, 2, 32
    G, R = K // g, g * n
    calls = []
    two_pass = attention_split.latent_attention_split
    monkeypatch.setattr(
        attention_split, "latent_attention_split", lambda *a, **kw: calls.append(1) or two_pass(*a, **kw)
    )
    plain = layer_cache(B, H, K, g, n, 60, torch.float32).view()
    q = torch.randn(B, H, 1, n, device=DEVICE)
    k = torch.randn(B, K, 1, n, device=DEVICE)
    h = torch.randn(B, G, 1, R, device=DEVICE)
    z = tale_kernels.latent_attention(q, k, h, plain, n**-0.5, split=True)
    assert calls and rel(z, ref_attention(q, k, h, plain, n**-0.5)) < TOL[torch.float32]
    seen = set()
    for fmt in FORMATS:
        v = layer_cache(B, H, K, g, n, 60, torch.float32, sched=format_schedule(fmt, n, K, R)).view()
        odd = [r for r in v.regions if not (isinstance(r.keys, QTensor) and r.keys.plain and r.lat.plain)]
        assert odd
        for r in odd:
            seen |= {"bands"} if isinstance(r.keys, Bands) else set()
            parts = r.keys.parts if isinstance(r.keys, Bands) else [r.keys]
            seen |= {"3-bit" for p in parts if p.bits == 3} | {"fp8" for t in (*parts, r.lat) if t.meta != "16"}
            view = LayerView(plain.regions + [r], v.next_pos)
            assert attention.supported(q, k, h, view) and not attention_split.supported_split(view)
            calls.clear()
            z = tale_kernels.latent_attention(q, k, h, view, n**-0.5, split={"k_tiles": 2})
            assert not calls and rel(z, ref_attention(q, k, h, view, n**-0.5)) < TOL[torch.float32]
    assert seen == {"bands", "3-bit", "fp8"}


def test_split_declines_float16_metadata():
    """A bf16 cache's float16 scales/zeros (quant.meta_format) would be rounded to bf16 by the two passes' bf16
    operands: supported_split declines them and latent_attention(split=True) runs the one-pass kernel. The same
    values held in bf16 metadata are read by the two passes (compiled runs: the interpreter has no bf16 dots)."""
    bf = torch.bfloat16
    c = layer_cache(1, 8, 4, 2, 64, 100, bf)
    q, k, h = (torch.randn(1, 8, 1, 64, device=DEVICE, dtype=bf), torch.randn(1, 4, 1, 64, device=DEVICE, dtype=bf),
               torch.randn(1, 2, 1, 128, device=DEVICE, dtype=bf))  # fmt: skip
    v = c.view()
    assert attention.supported(q, k, h, v) and not attention_split.supported_split(v)
    one_pass = tale_kernels.latent_attention(q, k, h, v, 0.125, split_tokens=32)
    assert torch.equal(tale_kernels.latent_attention(q, k, h, v, 0.125, split=True, split_tokens=32), one_pass)
    vb = held_meta(v, bf, 1.0)
    assert attention_split.supported_split(vb)
    if CUDA:
        z = tale_kernels.latent_attention(q, k, h, vb, 0.125, split=True)
        assert rel(z, ref_attention(q, k, h, vb, 0.125)) < 2e-2
