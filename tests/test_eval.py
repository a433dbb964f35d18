"""tale-eval: harness identities on tiny models, byte accounting, budget matching, the pass-key
task data, the CLI on a tiny artifact, and (slow) a small run on the SmolLM2 artifact."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tale_helpers import byte_tokenizer, save_artifact, talify, tiny_model

from tale_eval import caches, passkey, perplexity, policies
from tale_eval.attention import prepare
from tale_eval.cli import main

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


@pytest.mark.parametrize("arch", list(GROUP))
def test_tale_at_exact_settings_equals_full(arch, pair):
    _, model = pair(arch)
    ids = ids_of(2, 60)
    pattern = perplexity.pattern(60, 12, 2)
    full, exact, tale = policies.build(model, ["full", "tale-exact", "tale"], model.tale_schedule, pattern)
    p_full = ppl(perplexity.decode_nll(model, ids, full.new_cache(pattern), 12, 2))
    assert ppl(perplexity.decode_nll(model, ids, exact.new_cache(pattern), 12, 2)) == pytest.approx(p_full, rel=1e-5)
    assert ppl(perplexity.decode_nll(model, ids, tale.new_cache(pattern), 12, 2)) != pytest.approx(p_full, rel=1e-3)


def test_caches_at_lossless_settings_equal_full(pair):
    _, model = pair()
    R = model.tale_manifest["architecture"]["latent_rank"]
    ids = ids_of(2, 50)
    ref = ppl(perplexity.decode_nll(model, ids, caches.full_cache(2), 9, 3))
    for cache in (caches.kivi_cache(2, 16, 8, 8, 8), caches.sink_cache(2, 4, 100),
                  caches.palu_cache([R, R], 16, 16, 8, 8, 8)):
        assert ppl(perplexity.decode_nll(model, ids, cache, 9, 3)) == pytest.approx(ref, rel=1e-5), type(cache)


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
    cache = caches.palu_cache([r, r], 16, 16, 8, 8, 8)
    assert ppl(perplexity.decode_nll(model, ids, cache, 6, 4)) == pytest.approx(ref, rel=1e-5)
    with torch.no_grad():  # the prefill itself reads low-rank values (eager), unlike TALE's
        prefill = model(ids[:, :20], past_key_values=caches.palu_cache([r, r], 16, 16, 8, 8, 8)).logits
        torch.testing.assert_close(prefill, lowrank(ids[:, :20]).logits, rtol=1e-4, atol=1e-4)


def kivi_bytes(B, K, n, L, q, res, key_bits, value_bits, kg, vg, es, value_width=None, value_heads=None):
    """Independent count: packed codes + per-group scales and zero points + the 16-bit residual."""
    w, kv = value_width or n, value_heads or K
    keys = B * K * (q * n * key_bits // 8 + 2 * (q // kg) * n * es + res * n * es)
    values = B * kv * (math.ceil(q * w * value_bits / 8) + 2 * q * (w // vg) * es + res * w * es)
    return L * (keys + values)


def test_kivi_and_palu_byte_accounting(pair):
    _, model = pair()
    L, K, n, G = 2, 4, 16, 2
    es = 4  # fp32 model: residual, scales and zero points are fp32
    for bits in (2, 4):
        cache = caches.kivi_cache(L, bits, 8, 8, 8)
        with torch.no_grad():
            model(ids_of(2, 37), past_key_values=cache)  # 32 quantized + 5 residual
            assert cache.nbytes() == kivi_bytes(2, K, n, L, 32, 5, bits, bits, 8, 8, es)
            for t in range(3):  # the residual fills up (8) and is quantized
                model(ids_of(2, 1, seed=t), past_key_values=cache)
            assert cache.nbytes() == kivi_bytes(2, K, n, L, 40, 0, bits, bits, 8, 8, es)
        assert cache.baseline_nbytes() == 2 * 2 * K * 40 * n * 2 * L
    r = 16  # Palu: 3-bit latents [B, G, T, r] (simulated, counted as packed), 2-bit keys
    cache = caches.palu_cache([r, r], 2, 3, 8, 8, 8)
    with torch.no_grad():
        model(ids_of(2, 37), past_key_values=cache)
    assert cache.nbytes() == kivi_bytes(2, K, n, L, 32, 5, 2, 3, 8, 8, es, value_width=r, value_heads=G)


def test_fake_quantize_3bit_levels():
    x = torch.linspace(-1, 1, 64).view(2, 32)
    deq, nbytes = caches.fake_quantize(x, 3, 8, dim=-1)
    assert nbytes == 64 * 3 // 8 + 2 * 8 * 4
    for g in deq.view(-1, 8):
        assert len(g.unique()) <= 8
    assert (deq - x).abs().max() <= (2 / 63 * 7) / 7 / 2 + 1e-6  # half a step of each group's range


def test_tale_dry_run_bytes_equal_a_real_run(pair):
    _, model = pair()
    pattern = perplexity.pattern(70, 20, 3)
    cache = policies.build(model, ["tale"], model.tale_schedule, pattern)[0].new_cache(pattern)
    perplexity.decode_nll(model, ids_of(3, 70), cache, 20, 3)
    assert cache.nbytes() == 3 * policies.tale_bytes(model, model.tale_schedule, pattern)


def test_streaming_and_palu_match_tale_bytes(pair):
    _, model = pair()
    s = model.tale_schedule
    d = policies.Dims.of(model)
    pattern = perplexity.pattern(200, 40, 4)
    tale, stream, palu = policies.build(model, ["tale", "streaming", "palu"], s, pattern)
    ids = ids_of(2, 200)
    got = {}
    for pol in (tale, stream, palu):
        cache = pol.new_cache(pattern)
        perplexity.decode_nll(model, ids, cache, 40, 4)
        got[pol.name] = cache.nbytes()
    token = 2 * d.layers * 2 * d.K * d.n * 4  # one token of the streaming cache (batch 2, fp32)
    assert got["tale"] - token < got["streaming"] <= got["tale"]
    vg = s.value_group  # Palu's total rank moves in quantization groups: it lands within half a group's bytes
    group = 2 * (policies.palu_layer_bytes(d, s, 2 * vg, pattern) - policies.palu_layer_bytes(d, s, vg, pattern))
    assert abs(got["palu"] - got["tale"]) <= group / 2
    ranks = policies.palu_ranks(d, s, policies.tale_bytes(model, s, pattern), pattern)
    assert all(r % s.value_group == 0 for r in ranks) and max(ranks) - min(ranks) <= s.value_group


def test_streaming_attends_to_sinks_and_the_window(pair):
    """Chunked decode with eviction equals a full forward under the explicit StreamingLLM mask:
    a query in the chunk starting at c sees the sinks, the `window` tokens before c, and its chunk."""
    _, model = pair()
    N, P, T, s, w = 40, 10, 3, 2, 6
    ids = ids_of(1, N)
    cache = caches.sink_cache(2, s, w)
    with torch.no_grad():
        outs = [model(ids[:, :P], past_key_values=cache).logits]
        starts = list(range(P, N, T))
        for c in starts:
            outs.append(model(ids[:, c : c + T], past_key_values=cache).logits)
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


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory):
    return save_artifact(talify(tiny_model("llama"), 2), tmp_path_factory.mktemp("eval") / "tale", byte_tokenizer())


def test_cli_on_a_tiny_artifact(tiny_artifact, tmp_path, capsys):
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit) as e:
        main([str(tiny_artifact), "--ctx", "64", "--windows", "2", "--prefill", "16", "--chunk", "4", "--dtype", "fp32",
              "--passkey-lengths", "1k", "--passkey-depths", "0.5", "--rank-policies", "energy,fisher,progressive",
              "--energy", "0.5", "--policies", ",".join(policies.BASELINES), "--json", str(out)])
    assert e.value.code == 0
    res = json.loads(out.read_text())
    rows = {r["policy"]: r for r in res["results"]}
    assert list(rows) == [*policies.BASELINES, "tale/energy", "tale/fisher", "tale/progressive"]
    assert rows["full"]["delta"] == 0 and rows["full"]["ratio"] == pytest.approx(0.5)  # fp32 cache, 16-bit baseline
    assert rows["tale-exact"]["ppl"] == pytest.approx(rows["full"]["ppl"], rel=1e-5)
    assert rows["tale/fisher"]["detail"].startswith("fisher") and rows["tale/progressive"]["nominal"] > 1
    assert all(0 <= r["passkey"] <= 1 and len(r["passkey_answers"]) == 1 for r in rows.values())
    assert res["config"]["passkey_samples"] == 1
    assert "tale/progressive" in capsys.readouterr().out


def test_cli_schedule_flags_at_exact_settings_give_the_forward_ppl(tiny_artifact, tmp_path):
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit) as e:
        main([str(tiny_artifact), "--ctx", "64", "--windows", "2", "--prefill", "16", "--dtype", "fp32",
              "--passkey-lengths", "", "--policies", "tale", "--r0", "1.0", "--bits", "16,16", "--key-bits", "16,16",
              "--sinks", "2", "--json", str(out)])
    assert e.value.code == 0
    res = json.loads(out.read_text())
    (row,) = res["results"]
    assert res["config"]["delta_vs"] == "forward" and row["delta"] == pytest.approx(0, abs=1e-4 * row["ppl"])
    assert row["detail"] == "uniform r0 32/32, bits 16/16, sinks 2" and res["config"]["schedule"]["sinks"] == 2


@pytest.mark.parametrize("args, msg", [
    (["--policies", "full,magic"], "unknown policy 'magic'"),
    (["--rank-policies", "magic"], "unknown rank policy"),
    (["--preset", "huge"], "unknown --preset"),
    (["--passkey-depths", "0.55"], "no pass-key samples"),
    (["--ctx", "100000"], "held-out corpus has"),
    (["--key-bits", "3,4"], "bits must be one of"),
    (["--energy", "0"], "--energy must be"),
])
def test_cli_errors_are_one_line(args, msg, tiny_artifact, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(tiny_artifact), "--dtype", "fp32", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and msg in err and "\n" not in err


@pytest.mark.slow
def test_eval_smollm2(smollm2_artifact, tmp_path):
    out = tmp_path / "r.json"
    threads = torch.get_num_threads()
    try:  # one thread: on a busy 2-core machine two threads are several times slower, not faster
        with pytest.raises(SystemExit) as e:
            main([str(smollm2_artifact), "--preset", "ci", "--ctx", "256", "--windows", "1", "--prefill", "32",
                  "--passkey-depths", "0.5", "--policies", "full,tale-exact,tale,kivi2,streaming,palu",
                  "--threads", "1", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert e.value.code == 0
    rows = {r["policy"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["full"]["passkey"] == 1 and rows["full"]["ratio"] == pytest.approx(1.0)
    assert rows["tale-exact"]["ppl"] == pytest.approx(rows["full"]["ppl"], rel=0.01)  # bf16: float noise only
    assert rows["tale"]["ratio"] > 3.5
    assert rows["streaming"]["ratio"] == pytest.approx(rows["tale"]["ratio"], rel=0.03)
    assert rows["palu"]["ratio"] == pytest.approx(rows["tale"]["ratio"], rel=0.1)
    # the paper's point, at the same measured compression: lazy TALE beats eager Palu
    assert rows["tale"]["ppl"] < rows["palu"]["ppl"]
