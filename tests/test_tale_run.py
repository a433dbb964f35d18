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


def test_prefill_in_pieces_gives_the_same_answer(artifact, monkeypatch):
    """--prefill-chunk 8 prefills the 23-token prompt in pieces (every layer's forward sees 8, 8, 7 rows): the same
    greedy text and cache bytes as in one piece (--prefill-chunk 0)."""
    from tale_runtime import model as runtime_model

    pieces = []
    real = runtime_model._layer_in_pieces

    def spy(layer, size, *a, **kw):
        pieces.append(size)
        return real(layer, size, *a, **kw)

    monkeypatch.setattr(runtime_model, "_layer_in_pieces", spy)
    out = {}
    for chunk in ("8", "0"):
        pieces.clear()
        r = run(artifact, "--prompt", "héllo", "--max-new-tokens", "12", "--dtype", "fp32", "--prefill-chunk", chunk)
        assert r.exit_code == 0, r.stderr
        out[chunk] = (r.stdout, STATS.search(r.stderr).groups())  # tokens in and out, the measured ratio
        assert pieces == ([8] * 2 if chunk == "8" else [])  # the tiny model's 2 layers, in pieces of 8 or not at all
    assert out["8"] == out["0"]


def test_raw_prompt_file_overrides_and_factored_path(artifact, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("abc")
    # sampling, every schedule override and the output path: factored, then fused with the same seed
    opts = "--raw --max-new-tokens 40 --temperature 0.7 --top-p 0.9 --seed 3 --sinks 2 --recent 0.1,0.1"
    opts += " --bits 2,4,8 --key-bits 4 --ranks 0.5,0.75,1.0 --key-group 8 --value-group 8 --residual 16"
    r = run(artifact, "--prompt-file", f, *opts.split(), "--output-path", "factored")
    assert r.exit_code == 0, r.stderr
    m = STATS.search(r.stderr)
    assert (int(m[1]), int(m[2])) == (3, 40)
    again = run(artifact, "--prompt-file", f, *opts.split(), "--output-path", "fused")
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
        (["--prompt", "hi", "--prefill-chunk", "-4"], None, "--prefill-chunk must be a whole number of tokens >= 0"),
        (["--prompt", "hi", "--prefill-chunk", "4k"], None, "Invalid value for '--prefill-chunk'"),
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


def _json(r) -> dict:
    assert r.exit_code == 0, r.stderr
    (line,) = r.stdout.splitlines()  # one JSON object, nothing else on stdout
    return json.loads(line)


def test_json_quiet_stdin_system_and_sampling_options(artifact):
    args = ["--prompt-file", "-", "--max-new-tokens", "8", "--dtype", "fp32", "--json", "--quiet"]
    sampled = ["--temperature", "0.9", "--top-k", "5", "--top-p", "0.9", "--repetition-penalty", "1.3", "--seed", "1"]
    r = invoke(main, [artifact, *args, "--system", "be brief", *sampled], input="héllo")
    out = _json(r)
    assert r.stderr == ""  # --quiet: no notes, no stats line
    s = out["stats"]
    # "<system>be brief<user>héllo<assistant>": 39 bytes = 39 tokens of the byte tokenizer
    assert (s["prompt_tokens"], s["generated_tokens"]) == (39, 8) and s["ratio"] > 1 and out["text"]
    again = _json(invoke(main, [artifact, *args, "--system", "be brief", *sampled], input="héllo"))
    assert again["text"] == out["text"]  # the same seed, the same text
    assert invoke(main, [artifact, *args], input="").stderr.startswith(
        "error: --prompt-file -: standard input is empty"
    )
    bad = invoke(main, [artifact, "-p", "x", "--system", "s", "--raw"])
    assert bad.exit_code == 2 and bad.stderr.startswith("error: --system goes through the chat template")


def test_stop_strings_end_the_answer(artifact):
    base = [artifact, "-p", "héllo", "--max-new-tokens", "24", "--dtype", "fp32", "--json"]
    full = _json(invoke(main, base))["text"]
    stop = next(c for c in full[2:] if c.isascii() and c.isprintable())  # a whole token of the byte tokenizer
    cut = _json(invoke(main, [*base, "--stop", "never there", "--stop", stop]))["text"]
    assert cut == full[: full.index(stop) + len(stop)] and len(cut) < len(full)  # kept, as model.generate keeps it


def test_compare_full_at_exact_settings_gives_the_same_answer(artifact):
    """16-bit latents and keys at full rank: TALE decodes as the full cache does (DESIGN.md 5), so the answers are
    identical, and the ratio is what each cache really holds."""
    exact = ["--bits", "16,16", "--ranks", "1.0"]
    out = _json(
        invoke(
            main,
            [artifact, "-p", "héllo", "--max-new-tokens", "12", "--dtype", "fp32", "--json", "--compare-full", *exact],
        )
    )
    assert out["same_text"] and out["full"]["text"] == out["text"] and out["full"]["stats"]["generated_tokens"] == 12
    assert out["ratio_vs_full"] == pytest.approx(
        out["full"]["stats"]["baseline_bytes"] / out["stats"]["cache_bytes"], rel=1e-3
    )
    r = invoke(main, [artifact, "-p", "héllo", "--max-new-tokens", "12", "--dtype", "fp32", "--compare-full"])
    assert r.exit_code == 0 and r.stdout.startswith("[TALE cache]\n") and "\n[full 16-bit cache]\n" in r.stdout
    assert "smaller" in r.stderr.splitlines()[-1]


def test_chat_keeps_the_cache_across_turns(artifact):
    """One token per answer: the cache then holds exactly turn 1's prompt (the answer's token was sampled, never
    fed), which turn 2's prompt (the template over the whole conversation) extends, whatever the token was."""
    args = [artifact, "--chat", "--max-new-tokens", "1", "--dtype", "fp32", "--json"]
    r = invoke(main, args, input="hi\n\nand then?\n")
    assert r.exit_code == 0, r.stderr
    turns = [json.loads(line) for line in r.stdout.splitlines()]
    assert [t["turn"] for t in turns] == [1, 2]
    first, second = turns[0]["stats"], turns[1]["stats"]
    assert first["reused_tokens"] == 0 and second["reused_tokens"] == first["prompt_tokens"]
    assert second["prompt_tokens"] >= first["prompt_tokens"] + len("<user>and then?<assistant>")
    r = invoke(main, args, input="")
    assert (r.exit_code, r.stdout) == (0, "")  # EOF at once: a clean end
    assert invoke(main, [artifact, "--chat", "-p", "x"]).stderr.startswith("error: --chat reads its turns")


def test_stats_speed_leaves_out_the_first_graph_step():
    """On a GPU the first decode step compiles and captures the CUDA graph: the speed is of the steps after it, and the
    stats line says what the first one took."""
    from tale_runtime.generate import GenStats

    plain = GenStats(10, 5, 0.5, 4.0, 100, 400, 4.0)
    assert plain.decode_tokens_per_s == 1.0 and "after a first step" not in plain.line()
    graphed = GenStats(10, 5, 0.5, 4.0, 100, 400, 4.0, first_step_s=3.0)
    assert graphed.decode_tokens_per_s == 3.0  # 3 steps in the 1.0 s after the first
    assert "decode 3.0 tok/s after a first step of 3.00 s (compile, CUDA graph capture)" in graphed.line()
    assert graphed.as_dict()["first_step_s"] == 3.0
    two = GenStats(10, 6, 0.5, 4.0, 100, 400, 4.0, first_step_s=3.0, first_steps=2)  # an eager step, then the capture
    assert two.decode_tokens_per_s == 3.0 and "decode 3.0 tok/s after the first 2 steps of 3.00 s" in two.line()
