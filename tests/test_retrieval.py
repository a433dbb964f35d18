"""Long-context retrieval (tale_eval.retrieval): the generated tasks (deterministic, at the requested length, the
needle at the requested depth, the answers planted), RULER's scoring, the shared prefill (the same answers and
bytes as each policy's own prefill) and tale-eval's retrieval table on a tiny artifact."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from tale_helpers import byte_tokenizer, invoke, save_artifact, talify, tiny_model

from tale_eval import policies, retrieval
from tale_eval.attention import prepare
from tale_eval.cli import main
from tale_runtime.model import cache_arg

NIAH = [f for f in retrieval.FAMILIES if f.startswith("niah")]


def tokens(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False).input_ids)


@pytest.mark.parametrize("family", retrieval.FAMILIES)
def test_tasks_are_deterministic_for_a_seed(family, tiny_tok):
    a = retrieval.make_sample(family, tiny_tok, 2048, 3)
    assert a == retrieval.make_sample(family, tiny_tok, 2048, 3)
    assert a["prompt"] != retrieval.make_sample(family, tiny_tok, 2048, 3, seed=1)["prompt"]
    assert a["prompt"] != retrieval.make_sample(family, tiny_tok, 2048, 4)["prompt"]


@pytest.mark.parametrize("length", [1024, 4096])
@pytest.mark.parametrize("family", retrieval.FAMILIES)
def test_prompts_fill_the_requested_length(family, length, tiny_tok):
    s = retrieval.make_sample(family, tiny_tok, length, 0)
    budget = length - retrieval.NEW_TOKENS[family]  # the answer fits in the length too
    slack = 48 if family == "cwe" else 12  # cut at a word; CWE: at a word of 3 entries
    assert budget - slack <= tokens(tiny_tok, s["prompt"]) <= budget
    assert s["length"] == length and s["max_new_tokens"] == retrieval.NEW_TOKENS[family]


@pytest.mark.parametrize("index", range(6))
def test_the_needle_lands_at_the_requested_depth(index, tiny_tok):
    s = retrieval.make_sample("niah_single", tiny_tok, 4096, index)
    assert s["depth"] == retrieval.depth_of(index) and 0.05 <= s["depth"] <= 0.95
    start, end = s["context"]
    at = s["prompt"].index(s["needles"][0])
    before = tokens(tiny_tok, s["prompt"][start:at])
    frac = before / tokens(tiny_tok, s["prompt"][start:end])
    assert frac == pytest.approx(s["depth"], abs=0.03)  # at the sentence end nearest to the depth


@pytest.mark.parametrize("family", NIAH + ["vt"])
def test_the_answers_are_planted_once_and_in_order(family, tiny_tok):
    s = retrieval.make_sample(family, tiny_tok, 2048, 1)
    p = s["prompt"]
    start, end = s["context"]
    for needle in s["needles"]:
        assert p.count(needle) == 1 and start <= p.index(needle) < end
    for a in s["answers"]:
        assert a in p[start:end]
    ask = {"niah_single": 1, "niah_multikey": 1, "vt": retrieval.HOPS + 1}.get(family, retrieval.NEEDLES)
    assert len(s["answers"]) == ask
    if family == "vt":  # the chain reads in order along the text, from the value to the last variable
        at = [p.index(n) for n in s["needles"]]
        value = p[end:].split("assigned the value ")[1].split()[0]
        assert at == sorted(at) and s["needles"][0].endswith(f"= {value}.")


def test_cwe_asks_for_the_most_common_words(tiny_tok):
    s = retrieval.make_sample("cwe", tiny_tok, 2048, 0)
    start, end = s["context"]
    entries = s["prompt"][start:end].split()[1::2]  # "1. word 2. word ..."
    counts = Counter(entries)
    top = {w for w, _ in counts.most_common(retrieval.COMMON)}
    assert set(s["answers"]) == top and len(top) == retrieval.COMMON
    assert min(counts[w] for w in top) > max(c for w, c in counts.items() if w not in top)


def test_ruler_string_match_all():
    assert retrieval.score(" 5696202.", ["5696202"]) == 1.0
    assert retrieval.score(" 5696203.", ["5696202"]) == 0.0
    assert retrieval.score(" 1234567 and 7654321", ["1234567", "7654321", "1111111", "2222222"]) == 0.5
    assert retrieval.score("VAR abcde", ["ABCDE"]) == 1.0  # case-insensitive, as RULER


def test_lengths_and_refusals(tiny_tok):
    assert retrieval.parse_length("4k") == 4096 and retrieval.parse_length("600") == 600
    with pytest.raises(ValueError, match="unknown retrieval length"):
        retrieval.parse_length("4x")
    with pytest.raises(ValueError, match="cannot hold"):
        retrieval.make_sample("niah_multiquery", tiny_tok, 64, 0)
    with pytest.raises(ValueError, match="unknown retrieval task"):
        retrieval.make_sample("qa", tiny_tok, 1024, 0)


@pytest.fixture(scope="module")
def tiny():
    return prepare(talify(tiny_model("llama"), 2)), byte_tokenizer()


def test_a_shared_prefill_gives_each_policy_its_own_prefills_answers(tiny):
    model, tok = tiny
    samples = retrieval.make_samples(tok, (600,), ("niah_single", "vt"), 1)
    pols = [policies.named(n) for n in ("full", "tale", "tale-exact", "kivi2", "streaming", "palu")]
    pols = [p for p in pols if p.missing() is None]
    shared = retrieval.run(model, tok, samples, pols, log=lambda *_: None, share=True)
    own = retrieval.run(model, tok, samples, pols, log=lambda *_: None, share=False)
    for p, a, b in zip(pols, shared, own):
        assert [x["output"] for x in a["answers"]] == [x["output"] for x in b["answers"]], p.name
        assert a["ratio"] == b["ratio"] and a["tasks"] == b["tasks"]
    full, tale, exact = shared[:3]
    assert [x["output"] for x in exact["answers"]] == [x["output"] for x in full["answers"]]
    assert tale["ratio"] > 1.5 and full["ratio"] == pytest.approx(0.5)  # fp32 cache, 16-bit baseline


def test_a_policys_prefill_is_replayed_into_its_cache(tiny):
    """The replayed TALE cache holds what a TALE prefill leaves: the same bytes and the same next logits."""
    model, tok = tiny
    ids = tok(retrieval.make_sample("niah_single", tok, 400, 0)["prompt"], return_tensors="pt").input_ids
    pol = policies.named("tale")
    own = pol.build(model, [ids.shape[1], 1])
    rec = retrieval._Recorder(model)
    with torch.inference_mode():
        model(ids, **cache_arg(policies.caches.full_cache(2)), use_cache=True)
    rec.remove()
    replayed = pol.build(model, [ids.shape[1], 1])
    retrieval.replay_prefill(model, replayed, rec.calls)
    with torch.inference_mode():
        model(ids, **cache_arg(own), use_cache=True)
        nxt = ids[:, -1:]
        a = model(nxt, **cache_arg(own), use_cache=True).logits
        b = model(nxt, **cache_arg(replayed), use_cache=True).logits
    assert own.nbytes() == replayed.nbytes() and own.get_seq_length() == replayed.get_seq_length()
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory):
    return save_artifact(talify(tiny_model("llama"), 2), tmp_path_factory.mktemp("rt") / "tale", byte_tokenizer())


def test_cli_retrieval_table(tiny_artifact, tmp_path):
    out = tmp_path / "r.json"
    args = [tiny_artifact, "--ctx", "64", "--windows", "1", "--prefill", "16", "--dtype", "fp32"]
    args += ["--passkey-lengths", "", "--policies", "full,tale-exact,tale,kivi2,streaming,palu"]
    args += ["--retrieval-lengths", "600", "--retrieval-tasks", "niah_single,vt", "--retrieval-samples", "2"]
    r = invoke(main, [*args, "--json", out])
    assert r.exit_code == 0, r.stderr
    assert "long-context retrieval: 2 sample(s) per task" in r.stdout and "retention" in r.stdout
    res = json.loads(out.read_text())
    rows = {x["policy"]: x for x in res["results"]}
    assert res["config"]["retrieval_samples"] == 4 and res["config"]["retrieval_lengths"] == [600]
    for x in rows.values():
        assert set(x["retrieval_tasks"]) == {"600/niah_single", "600/vt"} and len(x["retrieval_answers"]) == 4
        assert 0 <= x["retrieval"] <= 1 and x["retrieval_ratio"] > 0
    assert rows["tale-exact"]["retrieval_answers"] == rows["full"]["retrieval_answers"]
    assert rows["tale"]["retrieval_ratio"] > 1.5


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--retrieval-tasks", "qa"], "unknown retrieval task 'qa'"),
        (["--retrieval-lengths", "4x"], "unknown retrieval length '4x'"),
        (["--retrieval-lengths", "64"], "cannot hold"),
        (["--retrieval-lengths", "600", "--retrieval-samples", "0"], "--retrieval-samples must be >= 1"),
    ],
)
def test_cli_retrieval_refusals(tiny_artifact, extra, message):
    args = [tiny_artifact, "--ctx", "64", "--windows", "1", "--prefill", "16", "--passkey-lengths", ""]
    r = invoke(main, [*args, "--policies", "full", *extra])
    assert r.exit_code == 2 and message in r.stderr
