"""Low-rank keys' coefficients per layer (Schedule.key_ranks, format 2.5; tale-convert --key-rank-policy).

Checked: the field round-trips, is written only where the layers differ (then as format 2.5) and an older reader
refuses it by name; its validation errors are one line each; the nominal ratio, the dry-run byte count and the
caches' measured bytes count each layer's coefficients; the energy policy's water-filling keeps the most energy at
the uniform total within each kind of layer; a converted tiny model with `energy` holds other ranks per layer, decodes
(dynamic and static cache alike) and differs from the uniform conversion only in its schedule; uniform writes what it
wrote before, byte for byte."""

import json
from dataclasses import replace
from itertools import product

import pytest
import torch
from conftest import TINY_OPTS
from tale_helpers import feed
from test_runtime import decode_logits, ids_for

from tale_convert import rank_policy
from tale_convert.convert import ConvertError, Options, convert
from tale_runtime import ArtifactError, load, new_cache
from tale_runtime.artifact import MANIFEST, Level, Schedule, nominal_ratio, version_for, with_key_ranks
from tale_runtime.cache import RegionStore, call_pattern, dry_run_nbytes
from tale_runtime.key_basis import KeyBasis, missing
from tale_runtime.model import cache_arg
from tale_runtime.spec import Arch

K, n, G, R = 2, 16, 1, 32


def lowrank(key_ranks=None, key_rank: int = 16, layers: int = 3) -> Schedule:
    """The lowrank preset's layout at tiny shapes: low-rank middle keys, a plain recent level, per-token newest."""
    s = Schedule(
        sinks=2,
        levels=[Level(3, 4, None, key_rank=key_rank), Level(4, 4, 0.1), Level(8, 8, 0.0, key_axis="token")],
        ranks=[[R, R, R]] * layers,
        key_group=8,
        value_group=8,
        residual=1,
        key_channel_group=8,
        key_rope="pre",
    )
    return s if key_ranks is None else with_key_ranks(s, [[r, 0, 0] for r in key_ranks])


def test_key_ranks_round_trip_only_where_layers_differ_and_an_older_reader_refuses_them():
    s = lowrank([8, 24, 16])
    assert s.key_ranks == [[8, 0, 0], [24, 0, 0], [16, 0, 0]] and s.levels[0].key_rank == 16
    assert [s.key_rank(i, 0) for i in range(3)] == [8, 24, 16] and s.layer_key_ranks(1) == (24, 0, 0)
    s.validate(R, 3)
    d = s.to_dict()
    assert d["key_ranks"] == s.key_ranks and Schedule.from_dict(json.loads(json.dumps(d))) == s
    assert version_for(s) == "2.5"
    same = lowrank([24, 24, 24])  # equal ranks: the uniform schedule's fields, as 2.4 wrote them
    assert same.key_ranks is None and same.levels[0].key_rank == 24 and "key_ranks" not in same.to_dict()
    assert same == lowrank(key_rank=24) and version_for(same) == "2.4"

    class Older(Schedule):  # a reader of format 2.4: no key_ranks field
        pass

    Older.__dataclass_fields__ = {k: v for k, v in Schedule.__dataclass_fields__.items() if k != "key_ranks"}
    assert Older.from_dict(same.to_dict()).levels[0].key_rank == 24
    with pytest.raises(ArtifactError, match="^schedule field 'key_ranks' is unknown to this reader"):
        Older.from_dict(d)


@pytest.mark.parametrize(
    "rows, why",
    [
        ([[8, 0, 0], [24, 0, 0]], "key_ranks has 2 layers, model has 3"),
        ([[8, 0], [24, 0], [16, 0]], "layer 0: 2 key_ranks for 3 levels"),
        ([[8, 0, 0], [24, 8, 0], [16, 0, 0]], "layer 1: key_ranks [24, 8, 0] must be > 0 exactly where"),
        ([[8, 0, 0], [0, 0, 0], [16, 0, 0]], "layer 1: key_ranks [0, 0, 0] must be > 0 exactly where"),
        ([[8, 0, 0], [20, 0, 0], [16, 0, 0]], "layer 1: key_rank must be a positive multiple of 8, got 20"),
        ([[8, 0, 0], [-8, 0, 0], [16, 0, 0]], "layer 1: key_rank must be a positive multiple of 8, got -8"),
    ],
)
def test_key_ranks_are_validated_in_one_line(rows, why):
    with pytest.raises(ArtifactError, match="^" + why.replace("[", "\\[").replace("]", "\\]")) as e:
        replace(lowrank(), key_ranks=rows).validate(R, 3)
    assert "\n" not in str(e.value)


def test_per_token_levels_need_whole_channel_groups_and_each_layer_its_basis_directions():
    s = lowrank()
    s = replace(s, levels=[replace(s.levels[0], key_axis="token"), *s.levels[1:]], key_channel_group=16)
    s = replace(s, levels=[replace(lv, key_axis="token") for lv in s.levels])
    with pytest.raises(ArtifactError, match="^layer 2: key_rank 8 is not a multiple of key_channel_group 16$"):
        replace(s, key_ranks=[[16, 0, 0], [32, 0, 0], [8, 0, 0]]).validate(R, 3)
    s = lowrank([8, 24, 16])
    eye = torch.eye(K * n)
    bases = [KeyBasis(eye[:, :c], eye[:c], torch.zeros(K * n), K, n) for c in (8, 24, 16)]
    assert missing(s, bases) is None  # each layer's basis holds that layer's directions
    assert missing(s, bases[::-1]) == "key_rank 16 exceeds the key basis (8 directions)"  # layer 2
    RegionStore(s, 0, K, n, G, R, basis=bases[0])
    with pytest.raises(ValueError, match="^layer 1: key_rank 24 exceeds the key basis \\(8 directions\\)$"):
        RegionStore(s, 1, K, n, G, R, basis=bases[0])


def test_the_nominal_ratio_and_the_byte_counts_count_each_layers_coefficients():
    """Per-channel coefficient codes, scales and zeros grow linearly in the rank: ranks of mean 16 hold the bytes of
    16 everywhere, in the nominal ratio and in the dry run of the cache; other means do not."""
    arch = Arch("llama", 3, 64, 4, K, n, 2, G, R)
    flat, moved, fewer = lowrank(key_rank=16), lowrank([8, 24, 16]), lowrank([8, 8, 16], key_rank=8)
    pattern = call_pattern(300, 100, 4)
    assert nominal_ratio(moved, n, 2, K) == pytest.approx(nominal_ratio(flat, n, 2, K), rel=1e-12)
    assert nominal_ratio(fewer, n, 2, K) > nominal_ratio(flat, n, 2, K)
    # by hand, layer by layer: 32 n over the mean of each layer's bits per token and KV head
    per_layer = [
        sum(s * (lv.key_bits * kr / K if kr else lv.key_bits * n) + s * lv.bits * R / 2 for s, lv, kr in zip(
            fewer.shares(), fewer.levels, fewer.layer_key_ranks(i)))
        for i in range(3)
    ]  # fmt: skip
    assert nominal_ratio(fewer, n, 2, K) == pytest.approx(32 * n / (sum(per_layer) / 3), rel=1e-12)
    held = [dry_run_nbytes(s, arch, pattern)[0] for s in (flat, moved, fewer)]
    assert held[0] == held[1] > held[2], held


def test_energy_water_filling_keeps_the_most_energy_at_the_uniform_total():
    g = torch.Generator().manual_seed(0)
    e = [torch.rand(2, 32, generator=g).sort(-1, descending=True).values * s for s in (0.2, 1.0, 3.0, 0.5)]
    ranks = rank_policy.key_ranks(e, 16, 8)
    assert sum(ranks) == 4 * 16 and all(r % 8 == 0 and 8 <= r <= 32 for r in ranks)
    kept = lambda rs: sum(x[:, :r].sum().item() for x, r in zip(e, rs))  # noqa: E731
    best = max((rs for rs in product((8, 16, 24, 32), repeat=4) if sum(rs) == 64), key=kept)
    assert kept(ranks) == pytest.approx(kept(best)) and kept(ranks) > kept([16] * 4)
    assert ranks[2] > ranks[0]  # the layer with the most energy gets the most coefficients
    # each kind of layer (global, or sliding through one window) keeps its own total
    kinds = [512, None, 512, None]
    split = rank_policy.key_ranks(e, 16, 8, kinds)
    assert split[0] + split[2] == split[1] + split[3] == 32
    with pytest.raises(ValueError, match="mean key rank 40 exceeds a layer's key basis \\(32 directions\\)"):
        rank_policy.key_ranks(e, 40, 8)


def test_the_policy_needs_low_rank_keys_and_a_known_name():
    with pytest.raises(ConvertError, match="^unknown --key-rank-policy 'fisher': use one of uniform, energy$"):
        Options(key_rank_policy="fisher").schedule(192, 2, kv_heads=3, head_dim=64)
    with pytest.raises(ConvertError, match="--key-rank-policy energy sets the low-rank keys' coefficients per layer"):
        Options(preset="paper", key_rank_policy="energy").schedule(192, 2, kv_heads=3, head_dim=64)


def _files(d) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_an_energy_conversion_holds_other_ranks_per_layer_decodes_and_keeps_the_bytes(tiny_model_dir, tmp_path):
    """The tiny llama at --group 4 (one joint key basis of 64 directions, 16 coefficients by the preset): energy
    moves coefficients between its 3 layers at the same total; everything but the schedule (and the card that shows
    it) is the uniform conversion's, byte for byte; the default writes what --key-rank-policy uniform writes."""
    src = str(tiny_model_dir("llama"))
    opts = dict(TINY_OPTS, preset="lowrank", residual=None)
    logs: list[str] = []
    convert(src, tmp_path / "u", Options(group=4, **opts))
    convert(src, tmp_path / "u2", Options(group=4, key_rank_policy="uniform", **opts))
    report = convert(src, tmp_path / "e", Options(group=4, key_rank_policy="energy", **opts), log=logs.append)
    u, u2, e = (_files(tmp_path / x) for x in ("u", "u2", "e"))
    assert u == u2
    assert {k for k in u if u[k] != e[k]} == {MANIFEST, "README.md"} and set(u) == set(e)
    mu, me = (json.loads(x[MANIFEST]) for x in (u, e))
    assert mu["format_version"] == "2.4" and "key_ranks" not in mu["schedule"] and report.key_ranks is not None
    assert me["format_version"] == "2.5" and me["schedule"].pop("key_ranks") == report.key_ranks
    assert me["schedule"] == mu["schedule"] and me["nominal_ratio"] == mu["nominal_ratio"]
    ranks = [row[0] for row in report.key_ranks]
    assert len(set(ranks)) > 1 and sum(ranks) == 3 * 16 and all(r % 8 == 0 for r in ranks), ranks
    assert any(ln.startswith("key ranks at level 0 by energy:") for ln in logs), logs
    assert (
        f"Key coefficients per layer at level 0 (by calibration key energy): {', '.join(map(str, ranks))}."
        in (tmp_path / "e" / "README.md").read_text()
    )
    assert f"({min(ranks)}..{max(ranks)} (by layer, mean 16) coefficients" in (tmp_path / "e" / "README.md").read_text()

    ids = ids_for(60)
    models = [load(tmp_path / x, device="cpu", dtype=torch.float32)[0] for x in ("u", "e")]
    held = []
    for m in models:
        cache = new_cache(m)
        feed(m, ids, cache, 40, 59)
        held.append(cache.nbytes())
        level0 = [layer.levels[0].keys.shape[-1] for layer in cache.layers]  # coefficients per token, per layer
        assert level0 == [m.tale_spec.schedule.key_rank(i, 0) for i in range(3)]
    assert held[0] == held[1]  # the same total of coefficients: the same bytes
    s = models[1].tale_spec.schedule
    assert s.key_ranks is not None and [s.key_rank(i, 0) for i in range(3)] == ranks
    logits = decode_logits(models[1], ids, 20)
    assert logits.isfinite().all()
    static = new_cache(models[1], static=True, max_length=80)
    with torch.no_grad():
        models[1](ids[:, :40], **cache_arg(static))
        dyn = new_cache(models[1])
        models[1](ids[:, :40], **cache_arg(dyn))
        for t in range(40, 50):
            a = models[1](ids[:, t : t + 1], **cache_arg(static)).logits
            b = models[1](ids[:, t : t + 1], **cache_arg(dyn)).logits
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert [layer.keys[0].data.shape[1] for layer in static.layers] == [1] * 3  # one joint block per layer
    assert [layer.keys[0].data.shape[-1] * 8 // 4 for layer in static.layers] == ranks  # 4-bit codes, per layer
    # a key_rank override applies one count to every layer
    flat = load(tmp_path / "e", device="cpu", dtype=torch.float32, key_rank=[16, 0, 0])[0].tale_spec.schedule
    assert flat.key_ranks is None and flat.levels[0].key_rank == 16


def test_the_cuda_score_pass_is_asked_about_every_layers_coefficient_count():
    """The cuda-lowrank backend checks each layer's count (the kernels read it from each region's tensors): 8
    two-bit coefficients are half a word, which a uniform 16 never shows."""
    pytest.importorskip("triton")
    from tale_kernels.plugin import _cuda_lowrank_reason
    from tale_runtime.spec import CacheSpec

    arch = Arch("llama", 2, 1024, 8, 2, 128, 2, 1, 256)
    s = lowrank(key_rank=16, layers=2)
    s = replace(s, levels=[replace(s.levels[0], key_bits=2), *s.levels[1:]], key_group=32, key_meta="8/8")
    spec = CacheSpec(arch, s, True, torch.device("cuda"), torch.bfloat16)
    why = "8 coefficients at 2 bits (2/4/8 bits, packed rows of whole words)"
    assert _cuda_lowrank_reason(spec) != why
    assert _cuda_lowrank_reason(replace(spec, schedule=with_key_ranks(s, [[24, 0, 0], [8, 0, 0]]))) == why


def test_gemma3_global_and_sliding_layers_keep_their_own_totals(tiny_model_dir, tmp_path, monkeypatch):
    """The converter hands the policy each layer's sliding window (None: global): the tiny Gemma 3's one sliding and
    one global layer each keep the preset's count, so the schedule is the uniform one (format 2.4)."""
    seen = []
    real = rank_policy.key_ranks
    monkeypatch.setattr(
        rank_policy, "key_ranks", lambda e, m, s, kinds: seen.append(list(kinds)) or real(e, m, s, kinds)
    )
    report = convert(
        str(tiny_model_dir("gemma3")),
        tmp_path / "g",
        Options(group=2, key_rank_policy="energy", **dict(TINY_OPTS, preset="lowrank", residual=None)),
    )
    assert seen == [[64, None]] and report.key_ranks is None
    m = json.loads((tmp_path / "g" / MANIFEST).read_text())
    assert m["format_version"] == "2.4" and "key_ranks" not in m["schedule"]
