"""lm-evaluation-harness with the TALE cache (tale_eval.lmeval, tale-eval --lm-eval) on a tiny converted model and
two local tasks over a jsonl file written here: no network, no downloaded data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
# lm-evaluation-harness end to end, tens of seconds a test (make test-slow)
pytestmark = pytest.mark.slow

from tale_helpers import invoke  # noqa: E402

from tale_eval.cli import main  # noqa: E402

GEN, MC = "tale_tiny_gen", "tale_tiny_mc"


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    """A generate_until task (greedy, 16 tokens; exact match) and a multiple-choice one (loglikelihood)
    over 6 documents of the bundled corpus, each prompt ~60-100 tokens of the tiny tokenizer."""
    from tale_calib import calib_paths, documents

    root = tmp_path_factory.mktemp("lm-tasks")
    text = " ".join(d for p in calib_paths() for d in documents(p))[:20000].split(". ")
    rows = [
        {
            "question": ". ".join(text[4 * i : 4 * i + 4])[:300],
            "answer": text[4 * i + 5][:20],
            "choices": [t[:30] for t in text[i : i + 3]],
            "label": i % 3,
        }
        for i in range(6)
    ]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = f"""dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "data.jsonl"}
  cache_dir: {root / "hf-datasets"}
test_split: test
doc_to_text: "{{{{question}}}}"
"""
    (root / "gen.yaml").write_text(
        f"task: {GEN}\n{data}output_type: generate_until\n"
        'doc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["<|endoftext|>"]\n  max_gen_toks: 16\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"  # a mean: no bootstrapped stderr (its process pool, forked here)
    )
    (root / "mc.yaml").write_text(
        f"task: {MC}\n{data}output_type: multiple_choice\n"
        'doc_to_choice: "{{choices}}"\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n'
    )
    return root


def _scores(results: dict, task: str) -> dict:
    return {k: v for k, v in results["results"][task].items() if "," in k}


def test_exact_cache_gives_the_base_models_scores_and_strings(tasks, converted, tiny_model_dir):
    """16 bits and full rank everywhere: `--model tale` (registered with lm_eval, knobs in model_args) scores and
    generates exactly what lm_eval's own `hf` model does on the base checkpoint, and every generate_until request
    went through a TALE cache."""
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    from tale_eval.lmeval import TaleLM

    assert get_model("tale") is TaleLM
    manager = TaskManager(include_path=str(tasks))
    kw = dict(tasks=[GEN, MC], task_manager=manager, log_samples=True, device="cpu")
    want = simple_evaluate(model="hf", model_args=f"pretrained={tiny_model_dir('llama')},dtype=float32", **kw)
    exact = "r0=1.0,bits=16/16,key_bits=16/16"
    lm = TaleLM(converted["llama"], device="cpu", dtype="float32", r0=1.0, bits="16/16", key_bits="16/16")
    got = simple_evaluate(model=lm, model_args=f"pretrained={converted['llama']},{exact}", **kw)
    for task in (GEN, MC):
        assert _scores(got, task) == _scores(want, task), task
        assert [s["resps"] for s in got["samples"][task]] == [s["resps"] for s in want["samples"][task]], task
    strings = [s["resps"][0][0] for s in got["samples"][GEN]]
    assert len(strings) == 6 and all(strings), strings  # 16 greedy tokens each: the comparison compared something
    report = lm.cache_report()
    assert report["generate_calls"] == 6 and report["nominal"] == 1.0
    assert report["schedule"]["levels"][0]["bits"] == 16 and report["schedule"]["ranks"][0][0] == 32


def test_cli_at_the_artifacts_schedule_writes_lm_evals_files_and_a_measured_ratio(tasks, converted, tmp_path):
    out = tmp_path / "lm-out"
    args = [converted["llama"], "--lm-eval", f"{tasks / 'gen.yaml'},{MC}", "--include-path", tasks]
    args += ["--lm-eval-out", out, "--dtype", "fp32", "--limit", 4, "--device", "cpu", "--json", tmp_path / "r.json"]
    r = invoke(main, args)
    assert r.exit_code == 0, r.stderr
    names = sorted(p.name.split("_20")[0] for p in out.iterdir())
    assert names == ["results", f"samples_{GEN}", f"samples_{MC}", "tale_cache.json"]
    results = json.loads(next(out.glob("results_*.json")).read_text())
    assert results["results"][GEN]["sample_len"] == 4 and "exact_match,none" in results["results"][GEN]
    samples = [json.loads(line) for line in next(out.glob(f"samples_{GEN}_*.jsonl")).read_text().splitlines()]
    assert len(samples) == 4 and all(s["resps"][0][0] for s in samples)
    cache = json.loads((out / "tale_cache.json").read_text())
    assert cache["generate_calls"] == 4  # one fresh cache per generate_until request; MC requests use none
    assert cache["ratio"] == cache["baseline_bytes"] / cache["cache_bytes"] > 1.5
    assert cache["schedule"]["levels"][0]["bits"] == 2  # the artifact's (paper preset)
    assert json.loads((tmp_path / "r.json").read_text())["tale_cache"] == cache
    assert "measured" in r.stderr and f"{cache['ratio']:.2f}x" in r.stderr
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging directory left

    again = invoke(main, args[:-2])  # the same output directory again
    assert again.exit_code == 2 and "exists (pass --overwrite" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1


def test_refusals(tasks, converted, tmp_path):
    art = converted["llama"]
    base = [art, "--include-path", tasks, "--device", "cpu"]
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep")
    cases = [
        ([*base, "--lm-eval", "no_such_task_xyz", "--lm-eval-out", tmp_path / "a"], "unknown lm-eval task"),
        ([*base, "--lm-eval", GEN, "--lm-eval-out", art / "results"], "inside the TALE artifact"),
        ([*base, "--lm-eval", GEN, "--lm-eval-out", art], "is the TALE artifact itself"),
        ([*base, "--lm-eval", GEN, "--lm-eval-out", user], "exists (pass --overwrite"),
        ([*base, "--lm-eval", GEN, "--lm-eval-out", user, "--overwrite"], "not an lm-eval run's (notes.txt)"),
        ([*base, "--lm-eval", GEN, "--lm-eval-out", tmp_path / "b", "--limit", 0], "--limit must be > 0"),
        ([*base, "--lm-eval", GEN, "--frontier"], "--frontier does not apply to --lm-eval"),
        ([art, "--limit", 4], "--limit applies to --lm-eval only"),
        ([*base, "--lm-eval", GEN, "--include-path", tmp_path / "none"], "--include-path"),
    ]
    for args, msg in cases:
        r = invoke(main, args)
        assert r.exit_code == 2, (args, r.stderr)
        assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert msg in r.stderr, (msg, r.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # nothing written by any refusal
    assert (user / "notes.txt").read_text() == "keep"


def test_run_lm_eval_is_the_clis_call(tasks, converted, tmp_path):
    """tale-eval --lm-eval parses its options into LmEvalOptions and calls tale_eval.run_lm_eval: the same scores
    and measured cache from Python."""
    from tale_eval import LmEvalOptions, run_lm_eval

    args = [converted["llama"], "--lm-eval", GEN, "--include-path", tasks, "--limit", 2, "--dtype", "fp32"]
    r = invoke(main, [*args, "--device", "cpu", "--lm-eval-out", tmp_path / "cli", "--json", "-", "--quiet"])
    assert r.exit_code == 0, r.stderr
    opts = LmEvalOptions(
        tasks=(GEN,), out=tmp_path / "py", limit=2, include_path=str(tasks), dtype="fp32", device="cpu", quiet=True
    )
    got = run_lm_eval(str(converted["llama"]), opts)
    cli = json.loads(r.stdout)
    assert _scores(cli, GEN) == _scores(got, GEN) and cli["tale_cache"] == got["tale_cache"]
