"""keep="salient": the per-channel levels above level 0 keep the key groups the last queries attend to most.
Checked against independent recomputation on synthetic tokens: the same counts and bytes as recency, every
position cached once, the attended group kept where recency demotes it, attention equal to an exact cache
(also through a sliding window, which reads positions), quant.take against dequantize + index."""

import copy

import pytest
import torch

from tale_runtime.artifact import Level, Schedule
from tale_runtime.attention import key_mass, latent_attention
from tale_runtime.cache import RegionStore
from tale_runtime.quant import dequantize, quantize, quantize_bands, take

K, H, n, G, R = 2, 4, 16, 1, 32


def sched(bits=(2, 4), share=0.25, **kw) -> Schedule:
    kw = dict(sinks=2, key_group=8, value_group=8, residual=8) | kw
    return Schedule(levels=[Level(bits[0], bits[0], None), Level(bits[1], bits[1], share)], ranks=[[16, 32]], **kw)


def toks(T, seed, B=1):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, K, T, n, generator=g),
        torch.randn(B, G, T, R, generator=g),
        torch.randn(B, H, T, n, generator=g) * n**-0.5,
    )


def run(s, keep, k, h, q, prefill, step=1, window=None):
    c = RegionStore(s, 0, K, n, G, R, keep=keep)
    c.append(k[..., :prefill, :], h[..., :prefill, :], q=q[..., :prefill, :])
    for t in range(prefill, k.shape[-2], step):
        sl = slice(t, t + step)
        c.append(k[..., sl, :], h[..., sl, :], q=q[..., sl, :])
    return c


def positions(c):
    return sorted(torch.cat([r.pos[0] for r in c.view().regions]).tolist())


@pytest.mark.parametrize("prefill,step", [(70, 1), (3, 4), (90, 5)])
def test_salient_keeps_counts_bytes_and_every_position(prefill, step):
    s = sched()
    k, h, q = toks(150, 0)
    a, b = run(s, "recent", k, h, q, prefill, step), run(s, "salient", k, h, q, prefill, step)
    assert a.lengths() == b.lengths()
    assert a.nbytes() == b.nbytes()
    assert positions(b) == list(range(150))
    # membership differs somewhere (else the test would not exercise anything)
    assert a.levels[1].pos.tolist() != b.levels[1].pos.tolist()


def test_the_attended_group_stays_in_the_high_level():
    """Queries that look only at tokens 18..25 (one key group: groups start after the 2 sinks): recency
    demotes it, salient keeps it."""
    s = sched(share=0.2)
    T = 120
    k, h, _ = toks(T, 1)
    k[..., 18:26, 0] += 4.0  # the group stands out along channel 0 ...
    q = torch.zeros(1, H, T, n)
    q[..., 0] = 4.0  # ... which is all the queries look at
    b = run(s, "salient", k, h, q, prefill=40)
    a = run(s, "recent", k, h, q, prefill=40)
    assert set(range(18, 26)) <= set(b.levels[1].pos.tolist())
    assert not set(range(18, 26)) & set(a.levels[1].pos.tolist())
    # ... and its keys there are the 4-bit ones: the dequantized level-1 keys of those tokens match a 4-bit
    # quantization of the exact group
    i = b.levels[1].pos.tolist().index(18)
    got = dequantize(b.levels[1].keys)[..., i : i + 8, :]
    ref = dequantize(quantize(k[..., 18:26, :], 4, 8, dim=-2))
    torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("window", [None, 37])
def test_exact_levels_give_exact_attention_whatever_the_membership(window):
    """With 16-bit levels membership cannot change attention; a wrong `pos` would (sliding window, causality)."""
    s = sched(bits=(16, 16), share=0.3)
    s.ranks = [[32, 32]]
    T, P = 110, 60
    k, h, q = toks(T, 2)
    c = run(s, "salient", k, h, q, prefill=P, step=3)
    assert c.levels[1].pos.tolist() != sorted(c.levels[1].pos.tolist()) or c.levels[0].pos.tolist() != list(
        range(s.sinks, s.sinks + c.levels[0].length)
    )  # out of order somewhere
    kn, hn, qn = toks(2, 3)
    z = latent_attention(qn, kn, hn, c.view(), 1.0, window)
    # exact reference: all T cached tokens in order, then the new ones
    ref = RegionStore(sched(bits=(16, 16), share=0.3, sinks=T), 0, K, n, G, R)
    ref.ranks = [32, 32]
    ref.append(k, h)
    torch.testing.assert_close(z, latent_attention(qn, kn, hn, ref.view(), 1.0, window))


def test_key_mass_is_the_windows_softmax_mass():
    B, W, L = 2, 3, 10
    g = torch.Generator().manual_seed(4)
    q, keys = torch.randn(B, H, W, n, generator=g), torch.randn(B, K, L, n, generator=g)
    q_pos = torch.tensor([5, 7, 9])
    k_pos = torch.arange(L).expand(B, L).clone()
    k_pos[1, :2] = -1  # padding in row 1
    got = key_mass(q, q_pos, keys, k_pos)
    ref = torch.zeros(L)
    for b in range(B):
        for hh in range(H):
            for w in range(W):
                ok = (k_pos[b] >= 0) & (k_pos[b] <= q_pos[w])
                lg = keys[b, hh // (H // K)] @ q[b, hh, w]
                ref += torch.where(ok, lg, -torch.inf).softmax(-1)
    torch.testing.assert_close(got, ref)
    assert got[8:].sum() < ref.sum()  # keys 8, 9 are seen only by the last query
    assert got[:2].sum() > 0 and torch.isclose(got.sum(), torch.tensor(float(B * H * W)))


def test_take_equals_dequantize_then_index():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, K, 32, n, generator=g)
    idx = torch.tensor([16, 17, 18, 19, 20, 21, 22, 23, 0, 1, 2, 3, 4, 5, 6, 7])
    qk = quantize(x, 2, 8, dim=-2, meta="8/16")
    torch.testing.assert_close(dequantize(take(qk, idx)), dequantize(qk)[..., idx, :])
    qh = quantize(x, 4, 8, dim=-1)
    torch.testing.assert_close(dequantize(take(qh, idx[:5])), dequantize(qh)[..., idx[:5], :])
    order = [[list(range(n))] * K][0]
    hi = torch.tensor(order)[:, :8].sort(-1).values
    lo = torch.tensor(order)[:, 8:].sort(-1).values
    bands = quantize_bands(x, [(2, lo), (3, hi)], 8)
    torch.testing.assert_close(dequantize(take(bands, idx)), dequantize(bands)[..., idx, :])
    with pytest.raises(ValueError, match="whole key groups"):
        take(qk, torch.arange(4, 12))


def test_bad_keep_and_missing_queries():
    with pytest.raises(ValueError, match="keep must be"):
        RegionStore(sched(), 0, K, n, G, R, keep="oldest")
    c = RegionStore(sched(), 0, K, n, G, R, keep="salient")
    k, h, _ = toks(4, 6)
    with pytest.raises(ValueError, match="needs the queries"):
        c.append(k, h)


def test_through_the_model_exact_levels_match_and_static_refuses():
    """TaleAttention hands the queries to a salient cache: with exact levels the logits equal recency's (membership
    cannot matter), with compressed levels the membership differs; the static cache refuses keep="salient"."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from tale_helpers import exact_schedule, feed, talify, tiny_model

    from tale_runtime import new_cache

    tm = talify(tiny_model("llama"), 1)
    R, L = tm.tale_spec.arch.latent_rank, tm.config.num_hidden_layers
    ids = torch.randint(0, 200, (1, 70), generator=torch.Generator().manual_seed(7))

    def decode(schedule, keep):
        cache = new_cache(tm, schedule, keep=keep)
        return feed(tm, ids, cache, 40)[0], cache

    ex = exact_schedule(R, L, sinks=2)
    ex.levels[1].share = 0.3
    a, _ = decode(ex, "recent")
    b, cb = decode(ex, "salient")
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert cb.layers[0].q_obs.shape[-2] == ex.key_group
    comp = copy.deepcopy(tm.tale_spec.schedule)
    comp.levels[1].share = 0.3  # several groups in level 1, so there is a choice
    _, cr = decode(comp, "recent")
    _, cs = decode(comp, "salient")
    assert any(r.levels[1].pos.tolist() != s.levels[1].pos.tolist() for r, s in zip(cr.layers, cs.layers))
    with pytest.raises(ValueError, match="needs the dynamic cache"):
        new_cache(tm, keep="salient", static=True)
