"""Low-rank keys (Level.key_rank): levels that hold the first r coefficients of the pre-RoPE keys on the artifact's
key basis (tale_runtime.key_basis), fitted by tale-convert --key-basis.

Checked: the fit inverts (enc dec = I) and orders directions by the query-weighted variance; at full rank and 16 bits a
model decodes like the base model (chunks, demotion between plain and low-rank levels); keys inside the kept subspace
read back exactly and outside it do not; low-rank keys quantize better per byte than plain ones when keys are low
rank (what the option is for); tale-convert writes a hashed basis that load() reads and verifies; refusals."""

import json
from dataclasses import replace

import pytest
import torch
from conftest import TINY_OPTS
from tale_helpers import exact_schedule, feed, talify, tiny_model
from test_runtime import decode_logits, ids_for, rel

from tale_convert.convert import Options, convert
from tale_convert.stats import key_moments
from tale_runtime import ArtifactError, load, new_cache
from tale_runtime.artifact import MANIFEST, Level, Schedule
from tale_runtime.attention import apply_rope, cached_keys
from tale_runtime.cache import RegionStore
from tale_runtime.key_basis import FILE, KeyBasis, fit, pair_mean
from tale_runtime.model import cache_arg

K, n, G, R = 2, 16, 1, 32


def low_rank(s: Schedule, *ranks: int) -> Schedule:
    return replace(s, key_rope="pre", levels=[replace(lv, key_rank=r) for lv, r in zip(s.levels, ranks)])


def fitted(model, batches) -> list[KeyBasis]:
    out = []
    for layer, (m2, mean, q2) in zip(model.model.layers, key_moments(model, batches)):
        a = layer.self_attn
        out.append(KeyBasis(*fit(m2, mean, pair_mean(q2, a.K, a.head_dim)), mean.float(), a.K, a.head_dim))
    return out


def test_fit_inverts_and_orders_by_query_weighted_variance():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 8, generator=g, dtype=torch.float64) * torch.tensor([5.0, 4, 3, 2, 1, 0.5, 0.2, 0.1])
    mean = torch.arange(8.0, dtype=torch.float64)
    x = x + mean
    m2 = x.T @ x / len(x)
    enc, dec = (t[0] for t in fit(m2, x.mean(0), None))  # one joint block
    torch.testing.assert_close(enc.double() @ dec.double(), torch.eye(8, dtype=torch.float64), atol=1e-5, rtol=0)
    var = ((x - x.mean(0)) @ enc.double()).var(0)
    assert (var[:-1] >= var[1:]).all() and var[0] > 20  # largest first, the mean taken out
    w = torch.ones(8)
    w[0] = 1e-6  # a channel the queries never read: truncation drops it first, despite its large variance

    def dropped(enc, dec):  # per-channel squared error of a rank-7 reconstruction
        mu = x.mean(0)
        return ((x - mu) @ enc[:, :7].double() @ dec[:7].double() + mu - x).pow(2).mean(0)

    e_w, e_plain = dropped(*(t[0] for t in fit(m2, x.mean(0), w))), dropped(enc, dec)
    assert e_w[0] > 20 and e_w[1:].max() < 0.05, e_w  # channel 0 (variance 25) dropped
    assert e_plain[0] < 1e-6 and e_plain[-1] > 0.005, e_plain  # unweighted: the smallest variance dropped
    assert torch.equal(pair_mean(torch.tensor([1.0, 2, 3, 4]), 1, 4), torch.tensor([2.0, 3, 2, 3]))


def test_per_head_blocks_are_the_diagonal_of_the_joint_statistics_and_round_trip():
    """blocks = K fits one basis per head from the diagonal blocks of the same second moment: keys rebuilt at full
    rank equal the input, each head's coefficients depend on its own channels only, and the file format holds
    either (2-D: one joint block, as first written; 3-D: blocks)."""
    torch.manual_seed(0)
    B, K, T, n = 2, 3, 5, 4
    x = torch.randn(400, K * n, dtype=torch.float64) @ torch.randn(K * n, K * n, dtype=torch.float64)
    m2, mean = x.T @ x / len(x), x.mean(0)
    k = torch.randn(B, K, T, n)
    for blocks in (1, K):
        enc, dec = fit(m2, mean, None, blocks)
        assert enc.shape == dec.shape == (blocks, K * n // blocks, K * n // blocks)
        bs = KeyBasis(enc, dec, mean.float(), K, n)
        c = bs.encode(k.double(), K * n // blocks)
        assert c.shape == (B, blocks, T, K * n // blocks)
        torch.testing.assert_close(bs.decode(c).float(), k, atol=1e-4, rtol=0)
    bump = k.clone()
    bump[:, 1] += 1.0  # head 1 moves: per head, only its coefficients do
    per_head = KeyBasis(*fit(m2, mean, None, K), mean.float(), K, n)
    moved = (per_head.encode(bump, 2) - per_head.encode(k, 2)).abs().amax((0, 2, 3))
    assert moved[1] > 0.1 and moved[0] == 0 and moved[2] == 0
    joint = KeyBasis(*(t[0] for t in fit(m2, mean, None)), mean.float(), K, n)  # 2-D, as the first files held
    assert joint.blocks == 1 and joint.enc.shape == (1, K * n, K * n)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_full_rank_16_bit_low_rank_keys_decode_like_the_base_model(arch):
    base = tiny_model(arch)
    L = base.config.num_hidden_layers
    s = exact_schedule(32, L)
    tm = talify(base, 2, s)
    C = tm.config.num_key_value_heads * tm.model.layers[0].self_attn.head_dim
    tm.tale_spec.key_basis = fitted(tm, [ids_for(40, seed=9)])
    ids = ids_for(60)
    with torch.no_grad():
        ref = base(ids).logits[:, 9:-1]
    for ranks in ((C, C), (C, 0)):  # the middle and recent level low-rank; the recent one plain (demotion converts)
        tm.tale_spec.schedule = low_rank(s, *ranks)
        assert rel(decode_logits(tm, ids, 10), ref) < 1e-4, ranks
        assert rel(decode_logits(tm, ids, 10, chunks=[9, 1, 13, 2, 25]), ref) < 1e-4, ranks
    kw = dict(max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():  # beam search reorders the coefficient stores and the shared rope table
        assert torch.equal(tm.generate(ids[:, :20], **cache_arg(new_cache(tm)), **kw), base.generate(ids[:, :20], **kw))
    tm.tale_spec.schedule = low_rank(s, 8, 8)  # truncation must show: the test can fail
    assert rel(decode_logits(tm, ids, 10), ref) > 1e-3


def tables(T: int):
    inv = 100.0 ** (-torch.arange(0, n, 2).float() / n)
    ang = torch.arange(T).float()[:, None] * inv
    ang = torch.cat([ang, ang], -1)[None]
    return ang.cos(), ang.sin()


def orthonormal(seed: int = 0) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(K * n, K * n, generator=torch.Generator().manual_seed(seed)))[0]


def keys_in_span(U: torch.Tensor, r: int, T: int, noise: float = 0.0, seed: int = 1) -> torch.Tensor:
    """Pre-RoPE keys [1, K, T, n]: a mean plus r coefficients on U's first r columns (plus isotropic noise)."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(T, r, generator=g) * torch.linspace(3, 1, r)
    x = 0.5 + c @ U[:, :r].T + noise * torch.randn(T, K * n, generator=g)
    return x.view(1, T, K, n).transpose(1, 2)


def fill(s: Schedule, basis: KeyBasis, k_pre: torch.Tensor, prefill: int) -> RegionStore:
    T = k_pre.shape[-2]
    cos, sin = tables(T)
    k_post = apply_rope(k_pre, cos, sin)
    h = torch.randn(1, G, T, R, generator=torch.Generator().manual_seed(2))
    c = RegionStore(s, 0, K, n, G, R, basis=basis)
    c.append(k_post[..., :prefill, :], h[..., :prefill, :], rope=(cos[:, :prefill], sin[:, :prefill]))
    for t in range(prefill, T):
        sl = slice(t, t + 1)
        c.append(k_post[..., sl, :], h[..., sl, :], rope=(cos[:, sl], sin[:, sl]))
    return c


def key_error(c: RegionStore, k_pre: torch.Tensor) -> float:
    cos, sin = tables(k_pre.shape[-2])
    k_post = apply_rope(k_pre, cos, sin)
    got, pos, _ = cached_keys(c.view(), torch.float32, 1, K, n, "cpu")
    want = k_post[..., pos[0], :]
    return ((got - want).norm() / want.norm()).item()


def test_keys_in_the_kept_span_read_back_exactly():
    U = orthonormal()
    basis = KeyBasis(U, U.T.contiguous(), torch.full((K * n,), 0.5), K, n)
    s = Schedule(
        sinks=2,
        levels=[Level(16, 16, None, key_rank=8), Level(16, 16, 0.25, key_rank=16)],
        ranks=[[32, 32]],
        key_group=8,
        value_group=8,
        residual=8,
        key_rope="pre",
    )
    k_pre = keys_in_span(U, 8, 90)
    c = fill(s, basis, k_pre, 37)
    assert [(r.keys.shape[1], r.keys.shape[-1]) for r in c.view().regions if r.basis is not None] == [(1, 8), (1, 16)]
    assert key_error(c, k_pre) < 1e-5
    assert key_error(fill(s, basis, keys_in_span(U, 12, 90), 37), keys_in_span(U, 12, 90)) > 0.05


def test_low_rank_keys_quantize_better_per_byte_when_keys_are_low_rank():
    """Keys of rank 8 in 32 joined channels (plus a little noise): 3-bit codes of 8 coefficients cost 3/8 of the
    bytes of 2-bit plain keys and err less than half as much (measured 0.096 against 0.219)."""
    U = orthonormal(3)
    k_pre = keys_in_span(U, 8, 98, noise=0.02)
    x = k_pre.transpose(1, 2).reshape(-1, K * n).double()
    enc, dec = fit(x.T @ x / len(x), x.mean(0), None)
    basis = KeyBasis(enc, dec, x.mean(0).float(), K, n)
    s = Schedule(sinks=2, levels=[Level(2, 2, None)], ranks=[[32]], key_group=8, value_group=8, residual=8)
    plain = fill(replace(s, key_rope="pre"), basis, k_pre, 98)
    lr = fill(low_rank(replace(s, levels=[Level(2, 3, None)]), 8), basis, k_pre, 98)
    kb = [sum(r.keys.nbytes() for r in c.view().regions if r.rope is not None) for c in (plain, lr)]
    assert kb[1] < 0.5 * kb[0], kb
    assert key_error(lr, k_pre) < 0.6 * key_error(plain, k_pre), (key_error(lr, k_pre), key_error(plain, k_pre))


def test_refusals_and_the_manifest_round_trip():
    s = exact_schedule(32, 2)
    with pytest.raises(Exception, match="needs key_rope 'pre'"):
        replace(s, levels=[replace(lv, key_rank=8) for lv in s.levels]).validate(32, 2)
    with pytest.raises(Exception, match="positive multiple of 8"):
        low_rank(s, 12, 0).validate(32, 2)
    assert "key_rank" not in json.dumps(s.to_dict())
    assert Schedule.from_dict(low_rank(s, 16, 0).to_dict()).levels[0].key_rank == 16
    assert low_rank(s, 16, 0).fast_path()  # the low-rank-key kernel reads it
    with pytest.raises(ValueError, match="layer 0: key_rank 16 needs the artifact's key basis"):
        RegionStore(low_rank(s, 16, 0), 0, K, n, G, R)
    U = orthonormal()
    with pytest.raises(ValueError, match="exceeds the key basis"):
        RegionStore(low_rank(s, 16, 0), 0, K, n, G, R, basis=KeyBasis(U[:, :8], U[:, :8].T, U[0], K, n))
    tm = talify(tiny_model("llama"), 2, low_rank(s, 16, 0))
    with pytest.raises(ValueError, match="needs the artifact's key basis"):
        new_cache(tm)
    from tale_eval.policies import Tale

    tm.tale_spec.schedule = s
    with pytest.raises(ValueError, match="schedule override: key_rank 16 needs the artifact's key basis"):
        Tale({"key_rope": "pre", "key_rank": [16, 0]}).resolve(tm)


def test_tale_convert_writes_a_verified_basis_that_load_reads(tiny_model_dir, tmp_path):
    out = tmp_path / "art"
    convert(str(tiny_model_dir("llama")), out, Options(group=2, key_basis=True, **TINY_OPTS))
    files = json.loads((out / MANIFEST).read_text())["files"]
    assert FILE in files
    model, _ = load(out, device="cpu", dtype=torch.float32, key_rope="pre", key_rank=[16, 0])
    C = model.config.num_key_value_heads * model.model.layers[0].self_attn.head_dim
    assert len(model.tale_spec.key_basis) == model.config.num_hidden_layers
    assert model.tale_spec.key_basis[0].enc.shape == (1, C, C)
    ids = ids_for(50)
    exact = dict(device="cpu", dtype=torch.float32, bits=16, ranks=1.0, key_rope="pre")
    full, _ = load(out, key_rank=C, **exact)
    with torch.no_grad():
        ref = full(ids).logits[:, 9:-1]  # the exact prefill of every position
    assert rel(decode_logits(full, ids, 10), ref) < 1e-4
    cut, _ = load(out, key_rank=8, **exact)
    assert rel(decode_logits(cut, ids, 10), ref) > 1e-3
    with pytest.raises(ArtifactError, match="low-rank keys: key_rank 16 needs the artifact's key basis"):  # no file
        plain_dir = tmp_path / "plain"
        convert(str(tiny_model_dir("llama")), plain_dir, Options(group=2, **TINY_OPTS))
        load(plain_dir, device="cpu", key_rope="pre", key_rank=[16, 0])
    from safetensors.torch import load_file, save_file

    from tale_runtime.artifact import hash_files, write_json

    good = (out / FILE).read_bytes()
    (out / FILE).write_bytes(good[:-1] + b"\0")
    with pytest.raises(ArtifactError):  # a changed byte: the checksum
        load(out, device="cpu")
    (out / FILE).write_bytes(good)
    t = load_file(out / FILE)
    t["layers.0.key_dec"] = t["layers.0.key_dec"][:, :-8].contiguous()
    save_file(t, out / FILE)
    m = json.loads((out / MANIFEST).read_text())
    m["files"] = hash_files(out)
    write_json(out / MANIFEST, m)
    with pytest.raises(ArtifactError, match="layer 0: key basis of shapes"):  # hashed, but the wrong shape
        load(out, device="cpu")
    (out / FILE).write_bytes(good)
    t = load_file(out / FILE)  # hashed and well-formed, but fewer directions than the schedule reads
    for i in range(model.config.num_hidden_layers):
        t[f"layers.{i}.key_enc"] = t[f"layers.{i}.key_enc"][:, :8].contiguous()
        t[f"layers.{i}.key_dec"] = t[f"layers.{i}.key_dec"][:8].contiguous()
    save_file(t, out / FILE)
    m["files"] = hash_files(out)
    write_json(out / MANIFEST, m)
    assert load(out, device="cpu", key_rope="pre", key_rank=[8, 0])[0].tale_spec.key_basis[0].enc.shape == (1, C, 8)
    with pytest.raises(ArtifactError, match="key_rank 16 exceeds the key basis \\(8 directions\\)"):
        load(out, device="cpu", key_rope="pre", key_rank=[16, 0])
    (out / FILE).write_bytes(good)
    t = load_file(out / FILE)  # well-formed blocks of whole heads (2 of 2 heads), but the schedule counts one block
    for i in range(model.config.num_hidden_layers):
        for name in (f"layers.{i}.key_enc", f"layers.{i}.key_dec"):
            x = t[name].view(-1, C, C)[0]  # one joint block, stored [C, C]
            t[name] = torch.stack([x[: C // 2, : C // 2], x[C // 2 :, C // 2 :]]).contiguous()
    save_file(t, out / FILE)
    m["files"] = hash_files(out)
    write_json(out / MANIFEST, m)
    with pytest.raises(ArtifactError, match="counts key_rank in 1 key basis block\\(s\\), the key basis has 2"):
        load(out, device="cpu", key_rope="pre", key_rank=[8, 0])


def test_key_bands_come_from_one_load_of_the_artifact_and_the_basis_from_the_layer_pass(
    tiny_model_dir, tmp_path, monkeypatch
):
    import tale_runtime

    loads, logs = [], []
    real = tale_runtime.load
    monkeypatch.setattr(tale_runtime, "load", lambda *a, **k: loads.append(a[0]) or real(*a, **k))
    out = tmp_path / "tb"
    convert(
        str(tiny_model_dir("llama")),
        out,
        Options(group=2, key_basis=True, **dict(TINY_OPTS, preset="tale")),
        log=logs.append,
    )
    assert len(loads) == 1, loads  # the bands' statistic reads keys as the cache holds them; the basis needs no load
    assert any(ln.startswith("key bands (") for ln in logs) and "key basis: 3 layers, 1 block each" in logs, logs
    model, _ = load(out, device="cpu", dtype=torch.float32)
    assert model.tale_spec.schedule.levels[0].key_hi_bits == 3 and model.tale_spec.key_basis is not None
    assert sorted(model.tale_spec.schedule.key_order[0][0]) == list(range(model.model.layers[0].self_attn.head_dim))
    assert model.tale_spec.schedule.key_order[0][0] != sorted(
        model.tale_spec.schedule.key_order[0][0]
    )  # calibrated, not 0..n


def test_the_lowrank_preset_converts_with_its_basis_and_holds_fewer_bytes(tiny_model_dir, tmp_path):
    """tale-convert --preset lowrank: the middle level's keys low-rank (7/24 of K n, on a basis per latent group), a
    key basis written without --key-basis, and a cache smaller than the paper preset's on the same tokens."""
    src = str(tiny_model_dir("llama"))
    out = tmp_path / "lr"
    convert(src, out, Options(group=2, **dict(TINY_OPTS, preset="lowrank", residual=None)))
    model, _ = load(out, device="cpu", dtype=torch.float32)
    s = model.tale_spec.schedule
    K = model.config.num_key_value_heads
    C = K * model.model.layers[0].self_attn.head_dim
    blocks = K // 2  # one per latent group of 2 KV heads
    kr = max(8, round(7 * C / blocks / 24 / 8) * 8)
    assert s.key_rope == "pre" and [lv.key_rank for lv in s.levels] == [kr, 0, 0] and s.key_blocks == blocks
    assert (out / FILE).is_file() and {b.blocks for b in model.tale_spec.key_basis} == {blocks}
    from tale_eval.policies import Tale  # tale-eval --frontier's default TALE points fit its 3 levels

    points = Tale.sweep(1024)[:4]  # the fifth takes latent groups of 64: wider than this model's R = 32
    assert [len(p.resolve(model).levels) for p in points] == [3] * 4
    card = (out / "README.md").read_text()
    assert f"4 ({kr} coefficients per 2 KV heads of {C // blocks})" in card and "key_basis.safetensors" in card
    convert(src, tmp_path / "p", Options(group=2, **TINY_OPTS))
    paper, _ = load(tmp_path / "p", device="cpu", dtype=torch.float32)
    ids = ids_for(200)
    sizes = []
    for m in (model, paper):
        cache = new_cache(m)
        feed(m, ids, cache, 150, 199)
        sizes.append(cache.nbytes())
    assert sizes[0] < sizes[1], sizes


def test_a_preset_with_per_level_key_layouts_refuses_another_level_count():
    """--preset lowrank --bits 2,4 would drop its low-rank middle keys and per-token tail: refused, not rewritten;
    presets whose levels are all plain per-channel keys take any level count."""
    from tale_convert.convert import ConvertError

    with pytest.raises(ConvertError, match="lowrank sets its per-level key layout for 3 levels; --bits gives 2"):
        Options(preset="lowrank", bits=(2, 4), recent=(0.1,)).schedule(64, 2, kv_heads=1, head_dim=64)
    s = Options(preset="lowrank", bits=(2, 4, 8), recent=(0.1, 0.0)).schedule(64, 2, kv_heads=3, head_dim=64)
    assert [lv.key_rank for lv in s.levels] == [56, 0, 0] and s.levels[-1].key_axis == "token"
    # its latents keep every channel, with scales per 64 channels where they divide R (the rank cut costs the most
    # per byte, docs/notes.md, "the latents at full rank"); else per 32; --value-group wins
    s = Options(preset="lowrank").schedule(192, 2, kv_heads=3, head_dim=64)
    assert s.ranks == [[192, 192, 192]] * 2 and s.value_group == 64 and s.latent_rotation == 32
    s = Options(preset="lowrank").schedule(96, 2, kv_heads=3, head_dim=32)
    assert s.ranks == [[96, 96, 96]] * 2 and s.value_group == s.latent_rotation == 32
    assert Options(preset="lowrank", value_group=16).schedule(192, 2, kv_heads=3, head_dim=64).value_group == 16
    assert Options(preset="paper").schedule(192, 2).value_group == 32
    # the preset's basis per latent group: joint where one group holds every KV head (SmolLM2 at --group 3), one
    # block per group of the same share of the joined keys otherwise (7/24 of 2 x 64 -> 40), per head at --group 1
    s = Options(group=3).schedule(192, 2, kv_heads=3, head_dim=64)
    assert Options().preset == "lowrank" and [lv.key_rank for lv in s.levels] == [56, 0, 0] and s.key_blocks == 1
    s = Options(group=2).schedule(256, 2, kv_heads=4, head_dim=64)
    assert [lv.key_rank for lv in s.levels] == [40, 0, 0] and s.key_blocks == 2
    assert Options(group=1).schedule(64, 2, kv_heads=3, head_dim=64).key_blocks == 3
    # per-head bases: the same share of the joined keys, counted per head (56 / 3 -> 16 of 64), in 3 blocks
    s = Options(preset="lowrank", key_basis_blocks="head").schedule(192, 2, kv_heads=3, head_dim=64)
    assert [lv.key_rank for lv in s.levels] == [16, 0, 0] and s.key_blocks == 3
    assert "key_blocks" in s.to_dict() and "key_blocks" not in Options(preset="lowrank").schedule(192, 2).to_dict()
    with pytest.raises(ConvertError, match="unknown --key-basis-blocks 'diag'"):
        Options(preset="lowrank", key_basis_blocks="diag").schedule(192, 2, kv_heads=3, head_dim=64)
    with pytest.raises(ConvertError, match="--key-basis-blocks shapes the key basis: add --key-basis"):
        Options(preset="paper", key_basis_blocks="head").schedule(192, 2, kv_heads=3, head_dim=64)
    s = Options(preset="paper", key_basis=True, key_basis_blocks="head").schedule(192, 2, kv_heads=3, head_dim=64)
    assert s.key_blocks == 3
    s = Options(preset="tale", bits=(2, 4, 4), recent=(0.1, 0.1)).schedule(64, 2)
    assert [lv.key_axis for lv in s.levels] == ["channel"] * 3 and not any(lv.key_rank for lv in s.levels)


def test_nominal_ratio_counts_key_bands_and_low_rank_keys():
    from tale_runtime.artifact import nominal_ratio

    lv = Level(2, 2, None)
    s = Schedule(sinks=0, levels=[lv], ranks=[[32]])  # n 16, g 2: 2*16 + 2*32/2 = 64 bits per token-head
    assert nominal_ratio(s, 16, 2) == pytest.approx(512 / 64)
    bands = replace(s, levels=[replace(lv, key_hi_bits=4, key_hi_channels=8)])  # keys 2*8 + 4*8 = 48
    assert nominal_ratio(bands, 16, 2) == pytest.approx(512 / 80)
    lr = replace(s, key_rope="pre", levels=[replace(lv, key_rank=8)])  # 8 coefficients at 2 bits serve 2 heads
    assert nominal_ratio(lr, 16, 2, kv_heads=2) == pytest.approx(512 / 40)
    per_head = replace(lr, key_blocks=2)  # 8 coefficients per head: twice the key bytes
    assert nominal_ratio(per_head, 16, 2, kv_heads=2) == pytest.approx(512 / 48)
    with pytest.raises(ValueError, match="needs kv_heads"):
        nominal_ratio(lr, 16, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel needs CUDA")
def test_low_rank_keys_on_cuda_match_the_cpu_with_kernels_on_and_off():
    """On CUDA "auto" gives low-rank keys to the low-rank-key kernel (float32 at head dim 16: triton-lowrank; the
    CUDA score pass reads head dim 128 in 16 bits), whose logits match the reference named; "triton" by name is
    refused; the reference matches the CPU run (float32)."""
    from dataclasses import replace as dc_replace

    from tale_runtime import new_cache, set_backend

    tm = talify(tiny_model("llama"), 2)
    tm.tale_spec.schedule = low_rank(tm.tale_spec.schedule, 16, 0)
    tm.tale_spec.key_basis = fitted(tm, [ids_for(40, seed=9)])
    ids = ids_for(90, seed=3)
    cpu = decode_logits(tm, ids, 60)
    tm = tm.cuda()
    tm.tale_spec.key_basis = [
        dc_replace(b, enc=b.enc.cuda(), dec=b.dec.cuda(), mean=b.mean.cuda()) for b in tm.tale_spec.key_basis
    ]
    set_backend(tm, "torch")
    off = decode_logits(tm, ids.cuda(), 60)
    set_backend(tm, "auto")
    assert new_cache(tm).backend.name == "triton-lowrank"
    assert rel(decode_logits(tm, ids.cuda(), 60), off) < 1e-3  # float32: the kernel's dots in float32
    with pytest.raises(ValueError, match="low-rank keys"):
        new_cache(tm, backend="triton")
    assert rel(off.cpu(), cpu) < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the note is about the GPU path")
def test_tale_run_on_cuda_decodes_lowrank_and_paper_with_a_kernel_and_no_note(tiny_model_dir, tmp_path):
    """A GPU kernel reads both presets (the lowrank one: the low-rank-key kernel), so tale-run takes the static cache
    for both and prints no note that it falls back to the torch reference."""
    from tale_helpers import invoke

    from tale_runtime.cli import main

    src = str(tiny_model_dir("llama"))
    convert(src, tmp_path / "lr", Options(group=2, **dict(TINY_OPTS, preset="lowrank", residual=None)))
    convert(src, tmp_path / "p", Options(group=2, **TINY_OPTS))
    notes = []
    for art in ("lr", "p"):
        r = invoke(main, [tmp_path / art, "--prompt", "hello", "--max-new-tokens", "3", "--device", "cuda", "--raw"])
        assert r.exit_code == 0, r.output
        notes.append("do not read this schedule" in r.stderr)
    assert notes == [False, False]


def test_per_head_key_rank_counts_codes_per_block_in_measured_bytes():
    """key_rank counts coefficients per basis block: a token at a per-head level holds K x key_rank codes. The cache's
    bytes, the dry-run count of tale-convert and tale-eval (cache.dry_run_nbytes) and the nominal ratio all count them
    so (against a count from the shapes alone)."""
    from tale_helpers import shapes

    from tale_runtime.artifact import nominal_ratio
    from tale_runtime.cache import dry_run_nbytes

    B, T, r, kb = 1, 64, 8, 4
    s = Schedule(sinks=0, levels=[Level(16, kb, None, key_rank=r)], ranks=[[R]], key_group=8, value_group=8)
    s = replace(s, residual=8, key_rope="pre", key_blocks=K)
    x = torch.randn(400, K * n, dtype=torch.float64)
    basis = KeyBasis(*fit(x.T @ x / 400, x.mean(0), None, K), x.mean(0).float(), K, n)
    assert basis.blocks == K
    c = fill(s, basis, torch.randn(B, K, T, n), T)
    held = c.lengths()["level0"]
    assert held == T and c.lengths()["residual"] == 0  # a prefill of whole key groups: all quantized
    keys = [r_.keys for r_ in c.view().regions if r_.basis is not None]
    assert len(keys) == 1 and keys[0].shape == (B, K, held, r)
    # codes: K blocks x r coefficients per token at kb bits; a float32 scale and zero per coefficient and key group
    want = B * K * (held * r * kb // 8 + 2 * 4 * (held // 8) * r)
    assert keys[0].nbytes() == want
    lat = B * G * held * R * 4  # 16-bit "latents" of a float32 cache: raw float32
    assert c.nbytes() == want + lat
    joint = replace(s, key_blocks=1)
    held_b, _ = dry_run_nbytes(s, shapes(K, n, G, R), [T], torch.float32)
    joint_b, _ = dry_run_nbytes(joint, shapes(K, n, G, R), [T], torch.float32)
    assert held_b - joint_b == (K - 1) * (held * r * kb // 8 + 2 * 4 * (held // 8) * r), (held_b, joint_b)
    with pytest.raises(ValueError, match="counts key_rank in 1 key basis block\\(s\\), the key basis has 2"):
        RegionStore(joint, 0, K, n, G, R, basis=basis)
    assert nominal_ratio(s, n, 1, K) == pytest.approx(32 * n / (kb * r * K / K + 16 * R))


def test_streamed_key_statistics_match_the_whole_model_and_a_per_head_file(tiny_model_dir, tmp_path):
    """tale-convert gathers the key statistics layer by layer inside its streaming pass: the basis it writes equals
    the one fitted from a whole-model pass over the same samples (the former way). --key-basis-blocks head writes
    it 3-D with key_blocks in the schedule, which a reader without the field (format 2.3) refuses in one line."""
    from tale_convert import calibrate
    from tale_convert.convert import BASIS_SAMPLES
    from tale_runtime.key_basis import load_file, names

    out = tmp_path / "ph"
    opts = Options(group=2, key_basis_blocks="head", **dict(TINY_OPTS, preset="lowrank", residual=None))
    convert(str(tiny_model_dir("llama")), out, opts)
    m = json.loads((out / MANIFEST).read_text())
    s = Schedule.from_dict(m["schedule"])
    Kt, nt = (m["architecture"][x] for x in ("num_kv_heads", "head_dim"))  # 4 x 16
    assert m["format_version"] == "2.4" and m["schedule"]["key_blocks"] == Kt == s.key_blocks
    model, tok = load(
        out, device="cpu", dtype=torch.float32, schedule=replace(s, levels=[replace(lv, key_rank=0) for lv in s.levels])
    )
    docs, _ = calibrate.load_documents(None)
    tokens = calibrate.sample_tokens(tok, docs, TINY_OPTS["samples"], TINY_OPTS["seq_len"], 0)
    from safetensors.torch import load_file as st_load

    file = st_load(out / FILE)
    moments = key_moments(model, tokens[:BASIS_SAMPLES].split(2), skip=s.sinks)
    for i, (m2, mean, q2) in enumerate(moments):
        enc, dec = fit(m2, mean, pair_mean(q2, Kt, nt), Kt)
        e, d, mu = (file[x] for x in names(i))
        assert e.shape == (Kt, nt, nt) and d.shape == (Kt, nt, nt)
        for r in (4, 8):  # eigenvectors are defined up to sign: compare the rank-r projections they make
            torch.testing.assert_close(e[:, :, :r] @ d[:, :r], enc[:, :, :r] @ dec[:, :r], atol=2e-4, rtol=0)
        torch.testing.assert_close(mu, mean.float(), atol=1e-5, rtol=1e-5)
    assert load_file(out, len(moments), Kt, nt, "cpu")[0].blocks == Kt
    lr, _ = load(out, device="cpu", dtype=torch.float32)
    assert lr.tale_spec.schedule.levels[0].key_rank == 8 and lr.tale_spec.key_basis[0].blocks == Kt
    ids = ids_for(40)
    assert decode_logits(lr, ids, 10).isfinite().all()

    class Older(Schedule):  # a reader of format 2.3: no key_blocks field
        pass

    Older.__dataclass_fields__ = {k: v for k, v in Schedule.__dataclass_fields__.items() if k != "key_blocks"}
    with pytest.raises(ArtifactError, match="schedule field 'key_blocks' is unknown to this reader"):
        Older.from_dict(m["schedule"])
