"""Rank policies (tale_convert.rank_policy): valid schedules, budgets, behaviour on known inputs, and
`tale-convert --policy` end to end on a tiny checkpoint."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_GROUP, TINY_OPTS
from tale_helpers import grouped_schedule, shapes, talify, tiny_model

from tale_convert import ConvertError, rank_policy
from tale_convert.convert import Options, convert
from tale_convert.whiten import energy_kept
from tale_eval.attention import prepare
from tale_runtime import load
from tale_runtime.artifact import Schedule, nominal_ratio, read_manifest, schedule_of, uniform_ranks
from tale_runtime.schedule import PRESETS
from tale_runtime.spec import Arch


def check(ranks: list[int], R: int, vg: int) -> None:
    assert all(r % vg == 0 and vg <= r <= R for r in ranks), ranks


def test_energy_rank_on_a_synthetic_spectrum():
    # two groups; squared singular values 2^-i: the pooled energy kept at rank r is 1 - 2^-r (nearly)
    R, vg = 32, 4
    s = torch.tensor([2.0 ** (-i / 2) for i in range(R)])
    S = torch.stack([s, s])
    for keep in (0.5, 0.9, 0.99, 0.999):
        r = rank_policy.energy_rank(S, keep, vg)
        assert r % vg == 0
        assert energy_kept(S, r) >= keep
        assert r == vg or energy_kept(S, r - vg) < keep  # the smallest such multiple
    assert rank_policy.energy_rank(S, 1.0, vg) == R
    # a flat spectrum needs a rank proportional to the energy
    assert rank_policy.energy_rank(torch.ones(1, R), 0.5, vg) == 16


def test_singular_values_from_factors():
    torch.manual_seed(0)
    G, R = 2, 12
    # float64 inputs: the check is exact to float64 rounding, not to float32's (which failed at 1.9e-7)
    S = torch.rand(G, R, dtype=torch.float64).sort(descending=True).values + 0.1
    V = torch.linalg.qr(torch.randn(G, R, R, dtype=torch.float64)).Q
    B = S.sqrt()[..., None] * V.transpose(-1, -2)  # B_c = S^1/2 V^T
    torch.testing.assert_close(rank_policy.singular_values(B), S.double())
    Q = torch.block_diag(*[torch.linalg.qr(torch.randn(4, 4, dtype=torch.float64)).Q] * 3)  # rotated latents
    torch.testing.assert_close(rank_policy.singular_values(Q.T @ B), S.double())


def test_budget_ranks_proportional_bounded_and_exact():
    R, vg, L, r0 = 64, 8, 6, 32
    w = [1, 2, 3, 4, 5, 6]
    ranks = rank_policy.budget_ranks(w, R, vg, L * r0)
    check(ranks, R, vg)
    assert sum(ranks) == L * r0
    assert ranks == sorted(ranks)  # more weight, no less rank
    # one dominant layer is clamped at R, the rest share what is left evenly
    ranks = rank_policy.budget_ranks([1000, 1, 1, 1, 1, 1], R, vg, L * r0)
    assert ranks[0] == R and sum(ranks) == L * r0 and max(ranks[1:]) - min(ranks[1:]) <= vg
    # zero weight still gets one quantization group
    assert rank_policy.budget_ranks([0, 1], R, vg, 2 * r0)[0] == vg
    assert rank_policy.budget_ranks([1] * L, R, vg, L * r0) == [r0] * L
    with pytest.raises(ValueError, match="does not fit"):
        rank_policy.budget_ranks([1, 1], R, vg, 3 * R)
    with pytest.raises(ValueError, match="weights"):
        rank_policy.budget_ranks([0, 0], R, vg, 2 * r0)


def test_progressive_keeps_the_budget_and_falls_with_depth():
    R, vg, L, r0 = 192, 32, 30, 96
    ranks = rank_policy.level0_ranks("progressive", R, L, vg, r0)
    check(ranks, R, vg)
    assert sum(ranks) == L * r0
    assert ranks == sorted(ranks, reverse=True) and ranks[0] > r0 > ranks[-1]


def test_apply_gives_a_valid_schedule():
    R, L, vg = 64, 4, 8
    s = Schedule(ranks=uniform_ranks(R, L, 0.5, value_group=vg), value_group=vg, key_group=8, residual=8)
    ranks0 = rank_policy.level0_ranks("fisher", R, L, vg, 32, fisher=[1.0, 4.0, 2.0, 1.0])
    out = rank_policy.apply(s, "fisher", ranks0)
    out.validate(R, L)
    assert out.policy == "fisher" and [rs[0] for rs in out.ranks] == ranks0
    assert all(rs[1] == R for rs in out.ranks) and s.policy == "uniform"  # the input is not modified
    # a 3-level schedule stays non-decreasing when level 0 outgrows level 1
    s3 = Schedule(
        levels=[*s.levels[:1], *s.levels[1:], s.levels[1]],
        ranks=[[16, 24, R]] * L,
        value_group=vg,
        key_group=8,
        residual=8,
    )
    s3.levels[1].share = 0.05
    assert rank_policy.apply(s3, "energy", [8, 32, 64, 16]).ranks == [[8, 24, R], [32, 32, R], [64, 64, R], [16, 24, R]]


def test_level0_ranks_errors():
    with pytest.raises(ValueError, match="unknown rank policy"):
        rank_policy.level0_ranks("magic", 64, 2, 8, 32)
    with pytest.raises(ValueError, match="spectra"):
        rank_policy.level0_ranks("energy", 64, 2, 8, 32)
    with pytest.raises(ValueError, match="Fisher"):
        rank_policy.level0_ranks("fisher", 64, 2, 8, 32)


def test_fisher_scores_are_squared_v_proj_gradients():
    base = tiny_model("llama")
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))
    scores = rank_policy.fisher_scores(base, [ids[:1], ids[1:]])
    expect = torch.zeros(len(base.model.layers), dtype=torch.float64)
    for b in (ids[:1], ids[1:]):
        base.zero_grad()
        for layer in base.model.layers:
            layer.self_attn.v_proj.weight.requires_grad_(True)
        base(input_ids=b, labels=b).loss.backward()
        expect += torch.stack([layer.self_attn.v_proj.weight.grad.double().pow(2).sum() for layer in base.model.layers])
    torch.testing.assert_close(torch.tensor(scores, dtype=torch.float64), expect, rtol=1e-4, atol=0)
    # the eval model (W_V rebuilt as A B from a TALE model) gives the same scores
    tale_scores = rank_policy.fisher_scores(prepare(talify(tiny_model("llama"), 2)), [ids[:1], ids[1:]])
    torch.testing.assert_close(torch.tensor(tale_scores), torch.tensor(scores), rtol=1e-3, atol=0)


@pytest.mark.parametrize("name", ["energy", "fisher", "progressive"])
def test_convert_with_policy(name, tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    opts = Options(group=TINY_GROUP["llama"], policy=name, energy=0.8, **TINY_OPTS)
    convert(str(src), tmp_path / name, opts)
    m = read_manifest(tmp_path / name)
    s = schedule_of(m)
    R, L = m["architecture"]["latent_rank"], m["architecture"]["num_layers"]
    s.validate(R, L)
    r0 = uniform_ranks(R, L, PRESETS[opts.preset].r0, s.value_group)[0][0]
    ranks0 = [rs[0] for rs in s.ranks]
    assert s.policy == name
    model, _ = load(tmp_path / name, dtype=torch.float32)
    spectra = [rank_policy.singular_values(layer.self_attn.tale.v_v) for layer in model.model.layers]
    if name == "energy":  # recomputed from the artifact's factors: the same ranks
        assert ranks0 == [rank_policy.energy_rank(S, 0.8, s.value_group) for S in spectra]
    else:
        assert sum(ranks0) == L * r0
    for e, S, rs in zip(m["energy_kept"], spectra, s.ranks):  # the manifest's energy follows the new ranks
        assert e == pytest.approx([energy_kept(S, r) for r in rs], abs=1e-4)


def test_convert_rejects_bad_policy_before_work(tiny_model_dir, tmp_path):
    with pytest.raises(ConvertError, match="unknown --policy"):
        convert(str(tiny_model_dir("llama")), tmp_path / "x", Options(group=2, policy="magic", **TINY_OPTS))
    with pytest.raises(ConvertError, match="--energy"):
        convert(
            str(tiny_model_dir("llama")), tmp_path / "x", Options(group=2, policy="energy", energy=1.5, **TINY_OPTS)
        )


def test_measured_ratio_is_what_a_cache_holds():
    from tale_runtime.artifact import Level
    from tale_runtime.cache import RegionStore

    K, n, G, R = 2, 16, 1, 32
    s = grouped_schedule(
        [Level(2, 3, None), Level(4, 4, 0.1, key_axis="token")],
        [[16, 32], [8, 32]],
        residual=1,
        key_channel_group=16,
        key_meta="8/16",
    )
    ref = (300, 40, 4)
    held = base = 0
    for rs in s.ranks:
        c = RegionStore(s, 0, K, n, G, R)
        c.ranks = rs
        for T in [40] + [4] * 64 + [3]:
            c.append(torch.randn(1, K, T, n, dtype=torch.bfloat16), torch.randn(1, G, T, R, dtype=torch.bfloat16))
        held, base = held + c.nbytes(), base + c.baseline_nbytes()
    assert rank_policy.measured_ratio(s, shapes(K, n, G, R, 2), ref) == pytest.approx(base / held, rel=1e-12)


def test_fit_ranks_meets_the_target_and_spends_the_budget_on_energy():
    from tale_runtime.artifact import Level

    K, n, G, R, L = 2, 16, 1, 32, 4
    s = Schedule(
        levels=[Level(2, 2, None), Level(4, 4, 0.1)],
        ranks=uniform_ranks(R, L, 0.5, 8),
        key_group=8,
        value_group=8,
        residual=8,
    )
    # layer 2's spectrum is flat (rank matters), the others fall off fast
    spectra = [torch.tensor([[2.0**-i for i in range(R)]]) for _ in range(L)]
    spectra[2] = torch.ones(1, R)
    a = shapes(K, n, G, R, L)
    hi = rank_policy.measured_ratio(rank_policy.apply(s, "x", [8] * L), a)
    target = rank_policy.measured_ratio(rank_policy.apply(s, "x", [16, 16, 24, 16]), a)  # uniform 16 + one group
    fit = rank_policy.fit_ranks(s, target, a, spectra)
    ranks0 = [rs[0] for rs in fit.ranks]
    assert rank_policy.measured_ratio(fit, a) >= target
    check(ranks0, R, 8)
    assert ranks0 == [16, 16, 24, 16]  # the extra group goes to the flat spectrum
    for i in range(L):  # maximal: one more group anywhere misses the target
        more = ranks0[:]
        if more[i] + 8 <= R:
            more[i] += 8
            assert rank_policy.measured_ratio(rank_policy.apply(s, "x", more), a) < target
    assert rank_policy.fit_ranks(s, hi * 1.5, a, spectra) is None


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_makes_a_valid_schedule(name):
    """Each tale-convert --preset, at the tiny Llama's shapes and at Llama-3.1-8B's, gives a schedule that validates,
    reads back from its manifest form unchanged, compresses, and has a GPU decode kernel (the README's preset table
    names one for every preset)."""
    for g, K, n, L in ((2, 4, 16, 3), (4, 8, 128, 32)):  # group, KV heads, head dim, layers
        s = Options(group=g, preset=name).schedule(g * n, L, K, n)
        s.validate(g * n, L)
        assert Schedule.from_dict(s.to_dict()) == s
        assert nominal_ratio(s, n, g, K) > 2, (g, nominal_ratio(s, n, g, K))
        assert s.fast_path(), g


def test_presets_and_target_ratio_end_to_end(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    paper = Options(group=TINY_GROUP["llama"], **TINY_OPTS)
    s = paper.schedule(32, 3)
    assert [(lv.bits, lv.key_bits, lv.share, lv.key_axis) for lv in s.levels] == [
        (2, 2, None, "channel"),
        (4, 4, 0.1, "channel"),
    ]
    assert s.plain_layout() and s.ranks[0] == [16, 32]
    opts = Options(group=TINY_GROUP["llama"], target_ratio=4.0, **dict(TINY_OPTS, preset="tale"))
    convert(str(src), tmp_path / "t", opts)
    m = read_manifest(tmp_path / "t")
    st = schedule_of(m)
    assert st.policy == "budget"
    # the tale preset's key bands: half of each KV head's channels at 3 bits, in the calibration order
    n = m["architecture"]["head_dim"]
    assert (st.levels[0].key_hi_bits, st.levels[0].key_hi_channels) == (3, n // 2)
    assert any(h != list(range(n)) for heads in st.key_order for h in heads)  # not the placeholder
    assert rank_policy.measured_ratio(st, Arch.from_manifest(m)) >= 4.0
    with pytest.raises(ConvertError, match="out of reach"):
        convert(str(src), tmp_path / "u", Options(group=TINY_GROUP["llama"], target_ratio=40.0, **TINY_OPTS))
    assert not (tmp_path / "u").exists()
