"""kvpress's presses as tale-eval baselines (tale_eval.kvpress_baselines, `tale-eval --kvpress`), in kvpress's own venv
(make test-kvpress): a tiny random Llama converted to an artifact, its base model rebuilt from the artifact's tensors,
every press through kvpress itself. Skipped where kvpress is not installed (the main venv: tests/test_kvpress_cli.py
checks the refusal there)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("kvpress.presses")  # `kvpress` alone would find this directory (tests/ is on sys.path)

from tale_helpers import byte_tokenizer, invoke, one_line_error, refusals, save_artifact, talify, tiny_model  # noqa: E402

from tale_eval import kvpress_baselines as kp  # noqa: E402
from tale_eval import retrieval  # noqa: E402
from tale_eval.cli import main  # noqa: E402

EVERY = ["snapkv:0.5", "expected_attention:0.5", "streaming_llm:0.5", "knorm:0.5", "tova:0.5", "pyramidkv:0.5"]
EVERY += ["kvzip:0.5", "kvzip:0.75", "snapkv:3x"]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return save_artifact(talify(tiny_model("llama"), 2), tmp_path_factory.mktemp("kvpress") / "tale", byte_tokenizer())


@pytest.fixture(scope="module")
def base(artifact):
    return kp.base_model(artifact, torch.bfloat16)


def samples(tok, n=1):
    return retrieval.make_samples(tok, (600,), ("niah_single", "vt"), n)


def test_the_base_model_is_the_artifacts_base(artifact):
    """The artifact's tensors without TALE's factors: the plain model the artifact was made from, logit for logit."""
    model, _ = kp.base_model(artifact, torch.float32)
    ref = tiny_model("llama")
    ids = torch.randint(1, 250, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)


def test_a_press_at_ratio_0_is_the_full_cache(base):
    model, tok = base
    specs = [kp.Spec(None)] + kp.parse("snapkv:0,kvzip:0,expected_attention:0")
    res = kp.retrieval_run(model, tok, samples(tok), specs, log=lambda *_: None)
    full = res[0]
    for r in res[1:]:
        assert [a["output"] for a in r["answers"]] == [a["output"] for a in full["answers"]]
        assert r["ratio"] == full["ratio"] == pytest.approx(1.0) and r["kept_ratio"] == full["kept_ratio"]


def test_presses_compress_and_their_answers_are_scored(base):
    """SnapKV at 0.5 holds about half the prompt (bf16: 16-bit bytes, so the ratio is the tokens'); KVzip holds every
    entry and masks half (kept > held); the Nx target lands on N; every answer is scored by RULER's match."""
    model, tok = base
    specs = [kp.Spec(None)] + kp.parse("snapkv:0.5,kvzip:0.5,streaming_llm:4x")
    ss = samples(tok)
    res = kp.retrieval_run(model, tok, ss, specs, log=lambda *_: None)
    full, snap, kvzip, stream = res
    assert 1.8 < snap["ratio"] == snap["kept_ratio"] < 2.0 and snap["compression_ratio"] == 0.5
    assert kvzip["ratio"] == pytest.approx(1.0) and 1.8 < kvzip["kept_ratio"] < 2.0
    assert stream["ratio"] == pytest.approx(4.0, rel=0.01) and 0.75 < stream["compression_ratio"] < 0.8
    for r in res:
        assert set(r["tasks"]) == {"600/niah_single", "600/vt"}
        for s, a in zip(ss, r["answers"]):
            assert a["score"] == retrieval.score(a["output"], s["answers"]) and a["output"]
        assert r["score"] == pytest.approx(sum(r["tasks"].values()) / 2)
    assert snap["answers"] != full["answers"] or kvzip["answers"] != full["answers"]  # compression changes something


def test_a_shared_prefill_gives_each_press_its_own_prefills_answers(base):
    """The fan-out of one prefill to every press's hook, and KVzip's one scoring pass for its ratios, give what each
    press gives under its own context manager."""
    model, tok = base
    specs = [kp.Spec(None)] + kp.parse(",".join(EVERY))
    ss = samples(tok)
    shared = kp.retrieval_run(model, tok, ss, specs, log=lambda *_: None, share=True)
    own = kp.retrieval_run(model, tok, ss, specs, log=lambda *_: None, share=False)
    for s, a, b in zip(specs, shared, own):
        assert [x["output"] for x in a["answers"]] == [x["output"] for x in b["answers"]], s.name
        assert (a["ratio"], a["kept_ratio"], a["compression_ratio"]) == (
            b["ratio"],
            b["kept_ratio"],
            b["compression_ratio"],
        )


def test_decode_mode_perplexity_through_a_press(base):
    """The press compresses the prefill, the chunks are scored through it; at ratio 0 the full cache's nll."""
    model, tok = base
    ids = {"dev": torch.randint(1, 250, (2, 160), generator=torch.Generator().manual_seed(1))}
    specs = [kp.Spec(None)] + kp.parse("snapkv:0,snapkv:0.75,kvzip:0.75")
    rows = kp.measure(model, tok, specs, ids, 128, 8, [], True, lambda *_: None)  # SnapKV's window: 64 tokens
    full, zero, snap, kvzip = rows
    assert zero["ppl"] == full["ppl"] and full["ratio"] == pytest.approx(1.0)
    assert snap["ppl"] != full["ppl"] and snap["ratio"] == pytest.approx(159 / (32 + 31), rel=0.01)
    assert kvzip["ratio"] == pytest.approx(1.0) and kvzip["kept_ratio"] > 1.5 and kvzip["nominal"] == pytest.approx(4)


def test_cli_kvpress_table_and_json(artifact, tmp_path):
    out = tmp_path / "k.json"
    args = [artifact, "--ctx", "160", "--windows", "1", "--prefill", "128", "--passkey-lengths", ""]
    args += ["--retrieval-lengths", "400", "--retrieval-tasks", "niah_single", "--kvpress", "snapkv:0.5,kvzip:2x"]
    r = invoke(main, [*args, "--json", out])
    assert r.exit_code == 0, r.stderr
    assert "retention" in r.stdout and "kvpress cr" in r.stdout and "kvpress 0.5" in r.stdout
    res = json.loads(out.read_text())
    rows = {x["policy"]: x for x in res["results"]}
    assert list(rows) == ["full", "snapkv:0.5", "kvzip:2x"] and res["config"]["kvpress"]["kvpress"].startswith("0.5")
    assert rows["snapkv:0.5"]["retrieval_ratio"] > 1.5 and rows["kvzip:2x"]["retrieval_kept_ratio"] > 1.9
    assert rows["full"]["retrieval_ratio"] == pytest.approx(1.0) and rows["snapkv:0.5"]["nominal"] == 2.0
    assert not (tmp_path / "k.json.partial").exists()


@refusals(
    {
        "--kvpress h2o:0.5": "unknown press 'h2o'",
        "--kvpress snapkv:1.5": "bad ratio '1.5'",
        "--kvpress snapkv": "needs a ratio",
        "--kvpress snapkv:0.5,snapkv:0.5": "given twice",
        "--kvpress snapkv:0.5 --policies tale": "--policies does not apply to --kvpress",
        "--kvpress snapkv:0.5 --frontier": "--frontier does not apply to --kvpress",
        "--kvpress expected_attention:2x,snapkv:0.5": "--prefill must be above 64 (got 64",
    }
)
def test_cli_kvpress_refusals(artifact, args, fragment):
    one_line_error(invoke(main, [artifact, "--passkey-lengths", "", *args]), fragment)
