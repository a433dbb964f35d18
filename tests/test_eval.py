"""tale-eval: harness identities on tiny models, byte accounting, budget matching, the pass-key
task data, the CLI on a tiny artifact, and (slow) a small run on the SmolLM2 artifact."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tale_helpers import byte_tokenizer, invoke, one_line_error, refusals, save_artifact, talify, tiny_model

from tale_calib import text_path
from tale_eval import caches, less_train, passkey, perplexity, policies
from tale_eval.attention import prepare
from tale_eval.cli import main
from tale_eval.frontier import FAMILIES
from tale_runtime.model import cache_arg

GROUP = {"llama": 2, "qwen2": 1, "mha": 2}


@pytest.fixture(scope="module")
def pair():
    """(base HF model, prepared TALE model) per arch, fp32; the TALE schedule has groups of 8."""
    made = {}

    def get(arch: str = "llama"):
        if arch not in made:
            base = tiny_model(arch)
            made[arch] = base, prepare(talify(base, GROUP[arch]))
        return made[arch]

    return get


def ids_of(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 320, (batch, length), generator=torch.Generator().manual_seed(seed))


def ppl(nll_count) -> float:
    nll, count = nll_count
    return math.exp(nll / count)


@pytest.mark.parametrize("arch", list(GROUP))
def test_eval_model_is_the_base_model(arch, pair):
    base, model = pair(arch)
    ids = ids_of(2, 40)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, base(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chunk", [1, 3])
def test_full_cache_decode_ppl_equals_a_plain_forward(chunk, pair):
    base, model = pair()
    ids = ids_of(2, 48)
    ref = ppl(perplexity.forward_nll(base, ids, prefill=10))
    nll, count = perplexity.decode_nll(model, ids, caches.full_cache(2), prefill=10, chunk=chunk)
    assert count == 2 * (48 - 11)
    assert math.exp(nll / count) == pytest.approx(ref, rel=1e-5)


def test_non_finite_logits_are_refused_not_scored(pair):
    """A decode call whose logits hold NaN (an overflow in the cache or attention) stops the measurement: a NaN
    perplexity must never reach a table."""
    from tale_runtime.generate import NonFiniteLogits

    _, model = pair()
    head = model.lm_head.weight
    saved = head[7].clone()
    try:
        with torch.no_grad():
            head[7] = float("nan")
        with pytest.raises(NonFiniteLogits, match="decode call at token 10"):
            perplexity.decode_nll(
                model, ids_of(1, 30), caches.full_cache(model.config.num_hidden_layers), prefill=10, chunk=3
            )
    finally:
        with torch.no_grad():
            head[7] = saved


# one compressing setting per registered family that fits the tiny models (head dim 16, groups of 8)
TINY_SETTINGS = {
    "full": policies.Full(),
    "tale": policies.Tale(),
    "kivi": policies.Kivi(2, 8, 8),
    "quanto": policies.Quanto(2, 16, 8),
    "hqq": policies.HQQ(2, 16, 8),
    "streaming": policies.Streaming(window=6),
    "palu": policies.Palu(16, 2),
    "less": policies.Less(window=6),
    "tailorkv": policies.TailorKV(1, 4, group=8, residual=8, recent=4),
}
# LESS's kernels for TINY_SETTINGS (window 6), trained small: once per module
TINY_LESS = less_train.Recipe(window=6, rank=4, hidden=16, steps=30, windows=2, length=128)


@pytest.fixture(scope="module")
def prepared(pair):
    """TINY_SETTINGS[family] after its offline step on the calibration text (a copy)."""
    from dataclasses import replace

    done = {}

    def get(family: str):
        if family not in done:
            _, model = pair()
            pol = replace(TINY_SETTINGS[family])
            if family == "less":
                pol.kernels = less_train.train(model, byte_tokenizer(), TINY_LESS, log=lambda *a: None)[0]
            else:
                pol.prepare(model, byte_tokenizer())
            done[family] = pol
        return done[family]

    return get


def test_every_registered_family_is_tested():
    assert set(TINY_SETTINGS) == set(policies.REGISTRY)
    assert all(f in policies.REGISTRY for f in FAMILIES)


def held_tensors(cache, skip: tuple[str, ...] = ()) -> list[torch.Tensor]:
    """Every tensor reachable from the cache's layers (tensor subclasses opened through
    __tensor_flatten__), except TALE's padding mask and the stores' token positions (bookkeeping, not cached
    data: positions follow from the region layout, and with keep="salient" one per moved key group would do),
    the CPU's working copies of what decode attention derived from the stores (`memo`, `_sink_memo`: freed with the
    cache, docs/runtime.md), LESS's kernels (weights, like the model's) and the attributes named in `skip`."""
    out, seen = [], set()
    skip = ("valid", "pos", "memo", "_sink_memo", "kernels", *skip)

    def walk(x):
        if isinstance(x, torch.Tensor):
            if hasattr(x, "__tensor_flatten__") and type(x) is not torch.Tensor:
                for name in x.__tensor_flatten__()[0]:
                    walk(getattr(x, name))
            elif id(x) not in seen:
                seen.add(id(x))
                out.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)
        elif hasattr(x, "__dict__") and not isinstance(x, type):
            for k, y in vars(x).items():
                if k not in skip:
                    walk(y)

    walk(cache.layers)
    return out


# quanto's QuantizedCache decodes the tiny model in over a minute of CPU time: make test-slow
@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=pytest.mark.slow) if f == "quanto" else f for f in TINY_SETTINGS]
)
def test_policy_builds_decodes_and_counts_the_bytes_it_holds(family, pair, prepared):
    if why := TINY_SETTINGS[family].missing():
        pytest.skip(why)
    pol = prepared(family)
    _, model = pair()
    ids = ids_of(2, 40)
    pattern = perplexity.pattern(40, 21, 1)  # a prefill of 21, then 18 decode steps of one token
    cache = pol.build(model, pattern)
    nll, count = perplexity.decode_nll(model, ids, cache, 21, 1)
    assert count == 2 * 18 and math.isfinite(nll)
    assert cache.get_seq_length() == 39
    held = sum(t.numel() * t.element_size() for t in held_tensors(cache))
    assert pol.total_nbytes(cache) == held > 0
    resident = sum(t.numel() * t.element_size() for t in held_tensors(cache, skip=("host_keys", "host_values")))
    assert pol.nbytes(cache) == resident  # on the accelerator: all but TailorKV's host copy
    if family == "tailorkv":
        assert resident < held
    full = 2 * 2 * 4 * 39 * 16 * 4 * 2  # layers x K+V x batch x heads x tokens x head dim x fp32
    assert policies.reference_nbytes(model, 2, 39) * 2 == full  # the reference is 16-bit
    if family != "full":
        assert pol.nbytes(cache) < full, "a compressing setting holds fewer bytes than the full fp32 cache"


@pytest.mark.parametrize("family", list(TINY_SETTINGS))
def test_policy_at_its_exact_setting_reproduces_the_full_cache(family, pair, prepared):
    if why := TINY_SETTINGS[family].missing():
        pytest.skip(why)
    pol = prepared(family)
    exact = pol.exact()
    if exact is None:
        pytest.skip(f"{family} has no lossless setting (transformers' QuantizedCache quantizes every prefill)")
    _, model = pair()
    ids = ids_of(2, 50)
    pattern = perplexity.pattern(50, 9, 3)
    ref = ppl(perplexity.decode_nll(model, ids, caches.full_cache(2), 9, 3))
    assert ppl(perplexity.decode_nll(model, ids, exact.build(model, pattern), 9, 3)) == pytest.approx(ref, rel=1e-5)
    lossy = ppl(perplexity.decode_nll(model, ids, pol.build(model, pattern), 9, 3))
    if family != "full":
        assert lossy != pytest.approx(ref, rel=1e-4)


@pytest.mark.parametrize("arch", list(GROUP))
def test_tale_at_exact_settings_equals_full(arch, pair):
    _, model = pair(arch)
    ids = ids_of(2, 60)
    pattern = perplexity.pattern(60, 12, 2)
    full, exact, tale = (policies.named(n) for n in ("full", "tale-exact", "tale"))
    p_full = ppl(perplexity.decode_nll(model, ids, full.build(model, pattern), 12, 2))
    assert ppl(perplexity.decode_nll(model, ids, exact.build(model, pattern), 12, 2)) == pytest.approx(p_full, rel=1e-5)
    assert ppl(perplexity.decode_nll(model, ids, tale.build(model, pattern), 12, 2)) != pytest.approx(p_full, rel=1e-3)


def test_missing_backend_is_named_with_its_extra(monkeypatch):
    monkeypatch.setattr(policies.Quanto, "modules", ("no_such_module_xyz.sub",))
    why = policies.Quanto().missing()
    assert "no_such_module_xyz" in why and "tale-kv[eval]" in why


def test_palu_values_are_low_rank_in_the_forward_pass_too(pair):
    """Palu at 16 bits equals the base model with W_V replaced by its rank-r factors A_r B_r."""
    base, model = pair()
    r = 8
    ids = ids_of(1, 30)
    lowrank = tiny_model("llama")
    for layer, ev in zip(lowrank.model.layers, model.model.layers):
        A, B = ev.self_attn.tale.tale.u_v, ev.self_attn.tale.tale.v_v  # [G, d, R], [G, R, R]
        W = torch.einsum("cdr,crs->dcs", A[..., :r], B[:, :r]).flatten(1)
        layer.self_attn.v_proj.weight.data = W.T.contiguous()
    ref = ppl(perplexity.forward_nll(lowrank, ids, prefill=6))
    pol = policies.Palu(r, key_bits=16, latent_bits=16)
    assert ppl(perplexity.decode_nll(model, ids, pol.build(model, [6]), 6, 4)) == pytest.approx(ref, rel=1e-5)
    with torch.no_grad():  # the prefill itself reads low-rank values (eager), unlike TALE's
        prefill = model(ids[:, :20], **cache_arg(pol.build(model, [20]))).logits
        torch.testing.assert_close(prefill, lowrank(ids[:, :20]).logits, rtol=1e-4, atol=1e-4)


def kivi_bytes(B, K, n, L, q, res, key_bits, value_bits, kg, vg, es, value_width=None, value_heads=None):
    """Independent count: packed codes + per-group scales and zero points + the 16-bit residual."""
    w, kv = value_width or n, value_heads or K
    keys = B * K * (q * n * key_bits // 8 + 2 * (q // kg) * n * es + res * n * es)
    values = B * kv * (math.ceil(q * w * value_bits / 8) + 2 * q * (w // vg) * es + res * w * es)
    return L * (keys + values)


def test_palu_refuses_a_rank_inside_a_rotation_block(pair, monkeypatch):
    """Rotated factors (tale-convert --rotate-latents) truncate exactly only at whole blocks."""
    from dataclasses import replace

    _, model = pair()
    monkeypatch.setattr(model.tale_spec, "schedule", replace(model.tale_spec.schedule, latent_rotation=8))
    assert policies.Palu(16, 2).ranks(model) == [16] * model.config.num_hidden_layers
    with pytest.raises(ValueError, match="rotated in blocks of 8"):
        policies.Palu(12, 2).ranks(model)


def test_kivi_and_palu_byte_accounting(pair):
    _, model = pair()
    L, K, n, G = 2, 4, 16, 2
    es = 4  # fp32 model: residual, scales and zero points are fp32
    for bits in (2, 4):
        pol = policies.Kivi(bits, 8, 8)
        cache = pol.build(model, [])
        with torch.no_grad():
            model(ids_of(2, 37), **cache_arg(cache))  # 32 quantized + 5 residual
            assert pol.nbytes(cache) == kivi_bytes(2, K, n, L, 32, 5, bits, bits, 8, 8, es)
            for t in range(3):  # the residual fills up (8) and is quantized
                model(ids_of(2, 1, seed=t), **cache_arg(cache))
            assert pol.nbytes(cache) == kivi_bytes(2, K, n, L, 40, 0, bits, bits, 8, 8, es)
    r = 16  # Palu: 4-bit latents [B, G, T, r], 2-bit keys
    pol = policies.Palu(r, 2)
    cache = pol.build(model, [])
    with torch.no_grad():
        model(ids_of(2, 37), **cache_arg(cache))
    assert pol.nbytes(cache) == kivi_bytes(2, K, n, L, 32, 5, 2, 4, 8, 8, es, value_width=r, value_heads=G)


def test_quantized_cache_bytes_are_its_codes_scales_and_residual(pair):
    """transformers' QuantizedCache (quanto): per group of `group` numbers one scale and one shift."""
    pol = policies.Quanto(2, 16, 8)
    if why := pol.missing():
        pytest.skip(why)
    _, model = pair()
    cache = pol.build(model, [])
    with torch.no_grad():
        model(ids_of(2, 37), **cache_arg(cache))  # the prefill is quantized whole, the residual is empty
        model(ids_of(2, 3), **cache_arg(cache))  # 3 residual tokens
    L, K, n, es = 2, 4, 16, 4
    q = 2 * K * 37 * n  # numbers quantized, per layer, keys (values the same)
    assert pol.nbytes(cache) == L * 2 * (q * 2 // 8 + 2 * (q // 16) * es + 2 * K * 3 * n * es)


def test_tale_dry_run_bytes_equal_a_real_run(pair):
    """The one dry-run count of a TALE cache's bytes (tale_runtime.cache.dry_run_nbytes: tale-convert --target-ratio,
    the model card's ratio, tale-eval's budget-matched baselines) equals what a real run's cache holds."""
    from tale_runtime.cache import dry_run_nbytes

    _, model = pair()
    pattern = perplexity.pattern(70, 20, 3)
    pol = policies.Tale()
    cache = pol.build(model, pattern)
    perplexity.decode_nll(model, ids_of(3, 70), cache, 20, 3)
    held, base = dry_run_nbytes(model.tale_spec.schedule, model.tale_spec.arch, pattern, model.dtype)
    assert pol.nbytes(cache) == 3 * held and cache.baseline_nbytes() == 3 * base
    assert policies.tale_nbytes(model, pol, pattern) == held


def test_streaming_and_palu_match_tale_bytes(pair):
    _, model = pair()
    s = model.tale_spec.schedule
    a = model.tale_spec.arch
    pattern = perplexity.pattern(200, 40, 4)
    pols = {"tale": policies.Tale(), "streaming": policies.Streaming(), "palu": policies.Palu(match_pattern=pattern)}
    ids = ids_of(2, 200)
    got = {}
    for name, pol in pols.items():
        cache = pol.build(model, pattern)
        perplexity.decode_nll(model, ids, cache, 40, 4)
        got[name] = pol.nbytes(cache)
    token = 2 * a.num_layers * 2 * a.num_kv_heads * a.head_dim * 4  # one token of the streaming cache (batch 2, fp32)
    assert got["tale"] - token < got["streaming"] <= got["tale"]
    vg = s.value_group  # Palu's total rank moves in quantization groups: it lands within half a group's bytes
    p = pols["palu"]
    group = 2 * (
        policies.palu_layer_bytes(model, p, 2 * vg, pattern) - policies.palu_layer_bytes(model, p, vg, pattern)
    )
    assert abs(got["palu"] - got["tale"]) <= group / 2
    ranks = p.ranks(model)
    assert all(r % s.value_group == 0 for r in ranks) and max(ranks) - min(ranks) <= s.value_group


def test_streaming_share_gives_the_same_ratio_at_every_length(pair):
    _, model = pair()
    pol = policies.Streaming(window=0.25)
    for n in (64, 128, 256):
        cache = pol.build(model, [n])
        with torch.no_grad():
            model(ids_of(1, n), **cache_arg(cache))
            model(ids_of(1, 1), **cache_arg(cache))  # eviction happens after a step's attention
        assert cache.layers[0].keys.shape[-2] == round(0.25 * n)
        held = 2 * round(0.25 * n)  # fp32 numbers held, in 16-bit units
        assert policies.reference_nbytes(model, 1, n + 1) / pol.nbytes(cache) == pytest.approx((n + 1) / held)


def test_streaming_attends_to_sinks_and_the_window(pair):
    """Chunked decode with eviction equals a full forward under the explicit StreamingLLM mask:
    a query in the chunk starting at c sees the sinks, the `window` tokens before c, and its chunk."""
    _, model = pair()
    N, P, T, s, w = 40, 10, 3, 2, 6
    ids = ids_of(1, N)
    cache = caches.sink_cache(2, s, w)
    with torch.no_grad():
        outs = [model(ids[:, :P], **cache_arg(cache)).logits]
        starts = list(range(P, N, T))
        for c in starts:
            outs.append(model(ids[:, c : c + T], **cache_arg(cache)).logits)
        got = torch.cat(outs, dim=1)
        q, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
        start = torch.where(q < P, 0, P + (q - P) // T * T)
        mask = (j <= q) & ((q < P) | (j < s) | (j >= start - w))
        ref = model(ids, attention_mask=mask[None, None]).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert cache.layers[0].keys.shape[-2] == s + w
    assert cache.nbytes() == 2 * 2 * 4 * (s + w) * 16 * 4


def test_passkey_samples_are_shipped_and_well_formed():
    shipped = passkey.load_samples()
    assert shipped == passkey.make_samples()  # rerun `python -m tale_eval.passkey` after changing the generator
    assert len({s["id"] for s in shipped}) == len(shipped) == len(passkey.LENGTHS) * len(passkey.DEPTHS)
    for s in shipped:
        p = s["prompt"]
        assert p.startswith(passkey.HEAD) and p.endswith(passkey.QUESTION)
        assert s["answer"].isdigit() and len(s["answer"]) == 5 and p.count(s["answer"]) == 3
        assert abs(p.index(s["answer"]) / len(p) - s["depth"]) < 0.1
    assert [s["id"] for s in passkey.load_samples(lengths=("2k",), depths=(0.5,))] == ["2k-d50"]
    assert passkey.first_number(" 60494. Remember") == "60494"
    assert passkey.first_number(" a key") is None


def test_heldout_windows_of_a_text_file(tmp_path):
    """A path reads the file's documents as the named texts are read (experiments/domain_shift.py evaluates
    calibration corpora so); a name that is neither a text nor a file is refused."""
    tok = byte_tokenizer()
    named = perplexity.heldout_windows(tok, 64, 3, "botchan")
    f = tmp_path / "copy.txt"
    f.write_text(text_path("botchan").read_text())
    assert torch.equal(perplexity.heldout_windows(tok, 64, 3, str(f)), named)
    f.write_text("first doc\n\n<|doc|>\n\nsecond doc")
    assert tok.decode(perplexity.heldout_windows(tok, 8, 2, str(f)).flatten()) == "first doc\n\nsecon"  # 16 byte tokens
    with pytest.raises(FileNotFoundError):
        perplexity.heldout_windows(tok, 64, 1, "nosuchtext")


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory):
    return save_artifact(talify(tiny_model("llama"), 2), tmp_path_factory.mktemp("eval") / "tale", byte_tokenizer())


def test_cli_on_a_tiny_artifact(tiny_artifact, tmp_path, capsys):
    out = tmp_path / "r.json"
    names = [n for n in policies.NAMED if policies.named(n).missing() is None]
    with pytest.raises(SystemExit) as e:
        opts = "--ctx 64 --windows 2 --prefill 16 --chunk 4 --dtype fp32 --passkey-lengths 1k --passkey-depths 0.5"
        opts += " --rank-policies energy,fisher,progressive --energy 0.5 --text dev,botchan"
        main([str(tiny_artifact), *opts.split(), "--policies", ",".join(names), "--json", str(out)])
    assert e.value.code == 0
    res = json.loads(out.read_text())
    rows = {r["policy"]: r for r in res["results"]}
    assert list(rows) == [policies.named(n).name for n in names] + ["tale/energy", "tale/fisher", "tale/progressive"]
    assert rows["full"]["delta"] == {"dev": 0, "botchan": 0}
    assert rows["full"]["ratio"] == pytest.approx(0.5)  # fp32 cache, 16-bit baseline
    for t in ("dev", "botchan"):
        assert rows["tale-exact"]["ppl"][t] == pytest.approx(rows["full"]["ppl"][t], rel=1e-5)
    assert rows["tale/fisher"]["detail"].startswith("fisher") and rows["tale/progressive"]["nominal"] > 1
    assert all(0 <= r["passkey"] <= 1 and len(r["passkey_answers"]) == 1 for r in rows.values())
    assert res["config"]["passkey_samples"] == 1 and res["config"]["texts"] == ["dev", "botchan"]
    assert "tale/progressive" in capsys.readouterr().out


@pytest.mark.slow  # every family through the CLI, and a plot
def test_cli_frontier_writes_a_table_and_a_plot(tiny_artifact, tmp_path, monkeypatch):
    monkeypatch.setenv("TALE_CACHE", str(tmp_path / "cache"))  # LESS trains its kernels there
    prefix = tmp_path / "docs" / "frontier"
    out = tmp_path / "r.json"
    fams = [f for f in FAMILIES if policies.REGISTRY[f].missing() is None and f not in ("quanto", "hqq")]
    with pytest.raises(SystemExit) as e:  # quanto/hqq groups of 64 do not fit the tiny head dim (16)
        main(
            [
                str(tiny_artifact),
                "--frontier",
                "--families",
                ",".join(fams),
                "--ctx",
                "64",
                "--prefill",
                "16",
                "--chunk",
                "4",
                "--dtype",
                "fp32",
                "--tale-variants",
                "-; key_bits=4/4,r0=0.5; bits=16/16,r0=1.0,key_bits=16/16",
                "--frontier-out",
                str(prefix),
                "--json",
                str(out),
            ]
        )
    assert e.value.code == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["family"] for r in rows][:4] == ["full", "tale", "tale", "tale"]
    assert {r["family"] for r in rows} == {"full", *fams}
    exact = rows[3]  # 16-bit, full rank: TALE equals the full cache
    assert exact["delta_pct"]["botchan"] == pytest.approx(0, abs=1e-3) and exact["setting"].startswith("bits=16/16")
    md = (prefix.with_suffix(".md")).read_text()
    assert md.count("\n| ") == len(rows) and "pass-key" in md  # the header, then one line per row
    assert len(list((tmp_path / "cache" / "less").glob("*.safetensors"))) == 1
    tkv = next(r for r in rows if r["family"] == "tailorkv")
    assert tkv["ratio_total"] < tkv["ratio"]  # the host copy counts in the total only
    png = prefix.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_cli_refuses_a_missing_backend_naming_the_extra(tiny_artifact, monkeypatch, capsys):
    monkeypatch.setattr(policies.HQQ, "modules", ("no_such_module_xyz",))
    with pytest.raises(SystemExit) as e:
        main([str(tiny_artifact), "--policies", "full,hqq4"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: hqq needs no_such_module_xyz") and "tale-kv[eval]" in err and "\n" not in err


def test_cli_schedule_flags_at_exact_settings_give_the_forward_ppl(tiny_artifact, tmp_path):
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit) as e:
        opts = "--ctx 64 --windows 2 --prefill 16 --dtype fp32 --policies tale --r0 1.0 --bits 16,16 --key-bits 16,16"
        main([str(tiny_artifact), *opts.split(), "--passkey-lengths", "", "--sinks", "2", "--json", str(out)])
    assert e.value.code == 0
    res = json.loads(out.read_text())
    (row,) = res["results"]
    assert res["config"]["delta_vs"] == "forward"
    assert row["delta"]["dev"] == pytest.approx(0, abs=1e-4 * row["ppl"]["dev"])
    assert row["detail"].startswith("uniform r0 32/32, bits 16/16, sinks 2") and res["config"]["schedule"]["sinks"] == 2


@refusals(
    {
        "--policies full,magic": "unknown policy 'magic'",
        "--rank-policies magic": "unknown rank policy",
        "--preset huge": "unknown --preset",
        "--passkey-depths 0.55": "no pass-key samples",
        "--ctx 100000": "held-out text 'dev' has",
        "--key-bits 5,4": "bits must be one of",
        "--energy 0": "--energy must be",
        "--text dev,moby": "unknown --text 'moby'",
        "--frontier --families tale,magic": "unknown family 'magic'",
        "--frontier --tale-variants r1=2": "bad TALE variant 'r1=2'",
        "--frontier --tale-variants bits=x/4": "is not a number",
        "--frontier --families tale --tale-variants bits=5/4": "bits must be one of",
        "--frontier --families tale --tale-variants key_meta=8-4": "key_meta must be",
        "--frontier --families tale --tale-variants key_hi=3/8": "need the calibration channel order",
        "--frontier --families tale --tale-variants key_hi=3": "key_hi takes BITS/CHANNELS",
        "--frontier --families tale --tale-variants keep=oldest": "keep must be one of",
    }
)
def test_cli_errors_are_one_line(args, fragment, tiny_artifact, tmp_path):
    # a case that wrongly ran writes its frontier under tmp_path, not docs/
    r = invoke(main, [tiny_artifact, "--dtype", "fp32", "--frontier-out", tmp_path / "frontier", *args])
    one_line_error(r, fragment)


def test_tale_variants_parse_scale_formats():
    from tale_eval.frontier import parse_variants

    got = parse_variants("-; key_bits=3/4,r0=0.34,key_meta=8-16,value_meta=8-8")
    assert got == [{}, {"key_bits": [3, 4], "r0": 0.34, "key_meta": "8/16", "value_meta": "8/8"}]
    got = parse_variants("recent=0.1/0,bits=2/4/8,key_axis=channel/channel/token,residual=1,keep=salient")
    assert got == [
        {"recent": [0.1, 0.0], "bits": [2, 4, 8], "key_axis": ["channel", "channel", "token"], "residual": 1}
        | {"keep": "salient"}
    ]


@pytest.mark.slow
def test_eval_smollm2(smollm2_artifact, tmp_path):
    out = tmp_path / "r.json"
    threads = torch.get_num_threads()
    try:  # one thread: on a busy 2-core machine two threads are several times slower, not faster
        with pytest.raises(SystemExit) as e:
            main(
                [
                    str(smollm2_artifact),
                    "--preset",
                    "ci",
                    "--ctx",
                    "256",
                    "--windows",
                    "1",
                    "--prefill",
                    "32",
                    "--passkey-depths",
                    "0.5",
                    "--retrieval-lengths",
                    "1k",
                    "--retrieval-tasks",
                    "niah_single",
                    "--policies",
                    "full,tale-exact,tale,kivi2,streaming,palu",
                    "--threads",
                    "1",
                    "--json",
                    str(out),
                ]
            )
    finally:
        torch.set_num_threads(threads)
    assert e.value.code == 0
    rows = {r["policy"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["full"]["passkey"] == 1 and rows["full"]["ratio"] == pytest.approx(1.0)
    assert rows["tale-exact"]["ppl"]["dev"] == pytest.approx(rows["full"]["ppl"]["dev"], rel=0.01)  # bf16: float noise
    assert rows["tale"]["ratio"] > 3.5
    assert rows["full"]["retrieval"] == 1 and rows["tale"]["retrieval_ratio"] > 3.5  # one 1K single-needle sample
    assert rows["streaming"]["ratio"] == pytest.approx(rows["tale"]["ratio"], rel=0.03)
    assert rows["palu"]["ratio"] == pytest.approx(rows["tale"]["ratio"], rel=0.1)
    # the paper's point, at the same measured compression: lazy TALE beats eager Palu
    assert rows["tale"]["ppl"]["dev"] < rows["palu"]["ppl"]["dev"]


def test_frontier_envelope_keeps_the_points_nothing_beats():
    from tale_eval.frontier import envelope

    pts = [(3.0, 1.0), (4.0, 5.0), (4.5, 2.0), (6.0, 9.0), (5.0, 12.0)]
    rows = [{"ratio": r, "delta_pct": {"a": d, "b": d}} for r, d in pts]
    assert [r["ratio"] for r in envelope(rows, ["a", "b"])] == [3.0, 4.5, 6.0]


def test_cli_json_to_stdout_and_quiet(tiny_artifact):
    """--json -: the object --json FILE writes, on stdout, and nothing else there; --quiet: no progress lines."""
    from tale_helpers import invoke

    args = [tiny_artifact, "--ctx", "64", "--windows", "2", "--prefill", "16", "--dtype", "fp32"]
    r = invoke(main, [*args, "--passkey-lengths", "", "--policies", "full,tale", "--json", "-", "--quiet"])
    assert r.exit_code == 0, r.stderr
    res = json.loads(r.stdout)
    assert [row["policy"] for row in res["results"]] == ["full", "tale"] and res["config"]["ctx"] == 64
    assert res["results"][1]["ratio"] > 1 and r.stderr == ""


def test_the_reference_holds_what_transformers_holds_in_sliding_layers():
    """Gemma 3 (a sliding layer of window 24 beside a global one): the 16-bit reference of every ratio counts the
    last window - 1 tokens of the sliding layer, as transformers' cache holds them and as the TALE cache's own
    baseline does; before the window fills, every token."""
    from tale_runtime import families, new_cache

    model = talify(tiny_model("gemma3"), 2)
    a = model.tale_spec.arch
    assert families.sliding_windows(model) == (24, None)
    per_token = 2 * a.num_kv_heads * a.head_dim * 2
    assert policies.reference_nbytes(model, 1, 20) == 2 * 20 * per_token
    assert policies.reference_nbytes(model, 1, 60) == (23 + 60) * per_token
    cache = new_cache(model)
    with torch.no_grad():
        model(ids_of(1, 60), **cache_arg(cache))
    assert cache.baseline_nbytes() == policies.reference_nbytes(model, 1, 60)


def test_prepared_model_keeps_each_layers_window():
    """The eval model's layers report the window each reads through (a global layer none): the reference of every
    measured ratio holds a sliding layer's window and every position of a global one (Gemma 3's config names one
    window for all its layers)."""
    from tale_runtime import families

    tm = talify(tiny_model("gemma3"), 2)
    want = families.sliding_windows(tm)
    assert None in want and any(w is not None for w in want), want
    assert families.sliding_windows(prepare(tm)) == want
