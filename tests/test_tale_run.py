"""tale-run: the happy path and one-line errors (exit code 2, no traceback)."""

import json
import re

import pytest
from tale_helpers import byte_tokenizer, invoke, save_artifact, talify, tiny_model

from tale_runtime.cli import main

STATS = re.compile(
    r"prompt (\d+) tok, generated (\d+) tok, .* cache .* MiB vs 16-bit K\+V .* MiB: "
    r"measured ([\d.]+)x \(nominal ([\d.]+)x\)"
)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return save_artifact(talify(tiny_model("llama"), 2), tmp_path_factory.mktemp("run") / "tiny", byte_tokenizer())


def run(*args):
    return invoke(main, args)


def test_happy_path_streams_and_reports(artifact):
    r = run(artifact, "--prompt", "héllo", "--max-new-tokens", "12", "--dtype", "fp32")
    assert r.exit_code == 0, r.stderr
    m = STATS.search(r.stderr)
    # chat template: "<user>héllo<assistant>" is 23 bytes = 23 tokens
    assert m and (int(m[1]), int(m[2])) == (23, 12) and float(m[3]) > 1 and float(m[4]) > 1
    assert r.stdout.endswith("\n") and len(r.stdout) > 1


def test_raw_prompt_file_overrides_and_factored_path(artifact, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("abc")
    r = run(
        artifact,
        "--prompt-file",
        f,
        "--raw",
        "--max-new-tokens",
        "40",
        "--temperature",
        "0.7",
        "--top-p",
        "0.9",
        "--seed",
        "3",
        "--output-path",
        "factored",
        "--sinks",
        "2",
        "--recent",
        "0.1,0.1",
        "--bits",
        "2,4,8",
        "--key-bits",
        "4",
        "--ranks",
        "0.5,0.75,1.0",
        "--key-group",
        "8",
        "--value-group",
        "8",
        "--residual",
        "16",
    )
    assert r.exit_code == 0, r.stderr
    m = STATS.search(r.stderr)
    assert (int(m[1]), int(m[2])) == (3, 40)
    again = run(
        artifact,
        "--prompt-file",
        f,
        "--raw",
        "--max-new-tokens",
        "40",
        "--temperature",
        "0.7",
        "--top-p",
        "0.9",
        "--seed",
        "3",
        "--output-path",
        "fused",
        "--sinks",
        "2",
        "--recent",
        "0.1,0.1",
        "--bits",
        "2,4,8",
        "--key-bits",
        "4",
        "--ranks",
        "0.5,0.75,1.0",
        "--key-group",
        "8",
        "--value-group",
        "8",
        "--residual",
        "16",
    )
    assert again.stdout == r.stdout  # same seed, fused vs factored: same text


def break_manifest(path):
    (path / "tale_config.json").write_text("{not json")


def break_checksum(path):
    f = path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))


def bump_major(path):
    m = json.loads((path / "tale_config.json").read_text())
    m["format_version"] = "9.0"
    (path / "tale_config.json").write_text(json.dumps(m))


@pytest.mark.parametrize(
    "args,breakage,message",
    [
        (["--prompt", "  \n"], None, "--prompt is empty"),
        ([], None, "give exactly one of --prompt and --prompt-file"),
        (["--prompt", "x" * 600], None, "prompt is 617 tokens; the model's context is 512"),
        (["--prompt-file", "/nonexistent/p.txt"], None, "--prompt-file /nonexistent/p.txt: no such file"),
        (["--prompt", "hi"], "missing", "no such artifact directory"),
        (["--prompt", "hi"], break_manifest, "corrupt manifest"),
        (["--prompt", "hi"], break_checksum, "checksum mismatch"),
        (["--prompt", "hi"], bump_major, "format version '9.0' is not supported"),
        (["--prompt", "hi", "--bits", "5"], None, "bits must be one of 2, 3, 4, 8, 16; got 5"),
        (["--prompt", "hi", "--ranks", "0.5,x"], None, "--ranks: 'x' is not a number"),
        (["--prompt", "hi", "--sinks", "many"], None, "--sinks: 'many' is not a whole number"),
        (["--prompt", "hi", "--recent", "0.05,0.1"], None, "3 levels (from recent) need bits for each level"),
        (["--prompt", "hi", "--key-group", "64"], None, "residual (8) must be a positive multiple of key_group (64)"),
        (["--prompt", "hi", "--ranks", "1.5"], None, "rank fraction 1.5 must lie in (0, 1]"),
        (["--prompt", "hi", "--dtype", "int8"], None, "--dtype must be one of bf16, fp16, fp32"),
        (["--prompt", "hi", "--output-path", "both"], None, "--output-path must be fused or factored"),
        (["--prompt", "hi", "--device", "tpu"], None, "--device 'tpu': unknown device"),
    ],
)
def test_errors_are_one_line(artifact, tmp_path, args, breakage, message):
    path = artifact
    if breakage == "missing":
        path = tmp_path / "absent"
    elif breakage is not None:
        import shutil

        path = shutil.copytree(artifact, tmp_path / "broken")
        breakage(path)
    r = run(path, *args)
    assert r.exit_code == 2
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""


@pytest.mark.slow
def test_smollm2_cli_answers_paris(smollm2_artifact):
    r = run(smollm2_artifact, "--prompt", "What is the capital of France?", "--max-new-tokens", "24")
    assert r.exit_code == 0, r.stderr
    print(r.stdout, r.stderr)
    assert "Paris" in r.stdout and STATS.search(r.stderr)
