"""Each CLI parses its options and makes one library call that Python can make too: on a tiny artifact the call
(tale_convert.convert, tale_runtime.generate_text and chat, tale_eval.evaluate) gives what the command prints."""

from __future__ import annotations

import json

import pytest
from conftest import TINY_OPTS
from hub_helpers import convert_tiny
from tale_helpers import invoke

import tale_convert
import tale_eval
import tale_runtime
from tale_convert.cli import main as convert_main
from tale_eval.cli import main as eval_main
from tale_runtime.artifact import read_manifest
from tale_runtime.cli import main as run_main

TIMINGS = ("seconds", "prefill_s", "decode_s", "first_step_s", "decode_tokens_per_s")


def _untimed(obj):
    """obj without its wall-clock figures, as JSON reads it back."""
    if isinstance(obj, dict):
        return {k: _untimed(v) for k, v in obj.items() if k not in TIMINGS}
    if isinstance(obj, list):
        return [_untimed(v) for v in obj]
    return obj


@pytest.fixture(scope="module")
def art(tiny_model_dir, tmp_path_factory):
    return convert_tiny(tiny_model_dir("llama"), tmp_path_factory.mktemp("api") / "art")


def test_convert_is_the_clis_call(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    args = [f"--{k.replace('_', '-')}" for k in TINY_OPTS]
    argv = [a for k, v in zip(args, TINY_OPTS.values()) for a in (k, str(v))] + ["--group", "2"]
    r = invoke(convert_main, [src, "--out", tmp_path / "cli", *argv, "--json", "--quiet"])
    assert r.exit_code == 0, r.stderr
    report = tale_convert.convert(str(src), tmp_path / "py", tale_convert.Options(group=2, **TINY_OPTS))
    cli = json.loads(r.stdout)
    assert cli["nominal_ratio"] == report.nominal_ratio
    assert [lr["energy_kept"] for lr in cli["layers"]] == [lr.energy for lr in report.layers]
    assert read_manifest(tmp_path / "cli") == read_manifest(tmp_path / "py")  # every file's sha256 among it


def test_generate_text_and_chat_are_the_clis_calls(art):
    opts = tale_runtime.RunOptions(max_new_tokens=4, dtype="fp32", system="Be brief.")
    argv = ["--max-new-tokens", "4", "--dtype", "fp32", "--system", "Be brief.", "--json"]
    r = invoke(run_main, [art, "-p", "hello", *argv])
    assert r.exit_code == 0, r.stderr
    got = tale_runtime.generate_text(str(art), "hello", opts)
    assert _untimed(json.loads(r.stdout)) == _untimed(json.loads(json.dumps(got)))
    assert got["text"] and got["stats"]["generated_tokens"] == 4

    r = invoke(run_main, [art, "--chat", *argv], input="hi\n\nhow are you\n")
    assert r.exit_code == 0, r.stderr
    turns = tale_runtime.chat(str(art), ["hi", "how are you"], opts)
    assert [_untimed(json.loads(line)) for line in r.stdout.splitlines()] == _untimed(turns)
    assert [t["turn"] for t in turns] == [1, 2]  # the blank line of standard input is no turn


def test_evaluate_is_the_clis_call(art):
    argv = ["--dtype", "fp32", "--threads", "1", "--ctx", "32", "--windows", "1", "--prefill", "8", "--chunk", "4"]
    argv += ["--passkey-lengths", "", "--policies", "full,tale,kivi2", "--sinks", "2", "--bits", "2,4"]
    r = invoke(eval_main, [art, *argv, "--json", "-", "--quiet"])
    assert r.exit_code == 0, r.stderr
    opts = tale_eval.EvalOptions(
        ctx=32,
        windows=1,
        prefill=8,
        chunk=4,
        passkey_lengths=(),
        policies=("full", "tale", "kivi2"),
        overrides=tale_eval.Overrides(sinks=2, bits=(2, 4)),
        dtype="fp32",
        threads=1,
        quiet=True,
    )
    got = tale_eval.evaluate(str(art), opts)
    assert _untimed(json.loads(r.stdout)) == _untimed(json.loads(json.dumps(got)))
    assert [row["policy"] for row in got["results"]] == ["full", "tale", "kivi2"]


def test_the_calls_refuse_what_the_clis_refuse(art, tmp_path):
    """Bad options: the same one-line message as the command's `error: ...` line, raised before any work."""
    with pytest.raises(tale_runtime.console.UserError, match="--repetition-penalty must be > 0"):
        tale_runtime.generate_text(str(art), "hi", tale_runtime.RunOptions(repetition_penalty=0))
    with pytest.raises(tale_runtime.console.UserError, match="--policies is empty"):
        tale_eval.evaluate(str(art), tale_eval.EvalOptions(policies=()))
    with pytest.raises(tale_convert.ConvertError, match="--samples must be >= 1, got 0"):
        tale_convert.convert("smollm2", tmp_path / "o", tale_convert.Options(samples=0))
    assert list(tmp_path.iterdir()) == []
    r = invoke(run_main, [art, "-p", "hi", "--repetition-penalty", "0"])
    assert r.exit_code == 2 and r.stderr.startswith("error: --repetition-penalty must be > 0")
