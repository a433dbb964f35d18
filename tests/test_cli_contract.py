"""The CLI contract on inputs a new user runs into (docs/errors.md): one line `error: ...` and exit code 2 for
bad input, nothing accepted silently, nothing written into an artifact, no file replaced without --overwrite, and
what an interrupt leaves. The Python API's argument checks are here too."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_OPTS
from hub_helpers import convert_tiny
from tale_helpers import interrupt_at_call, invoke, one_line_error, refusals

import tale_convert.cli as convert_cli
import tale_convert.push as push_cli
import tale_eval.cli as eval_cli
import tale_runtime.cli as run_cli
from tale_runtime.artifact import MANIFEST, hash_files, verify_files, write_json

BIN = Path(sys.executable).parent
TINY_ARGS = [a for k, v in TINY_OPTS.items() for a in (f"--{k.replace('_', '-')}", str(v))] + ["--group", "2"]
EVAL = ["--dtype", "fp32", "--threads", "1", "--ctx", "32", "--windows", "1", "--prefill", "8"]
EVAL += ["--passkey-lengths", "", "--policies", "full"]
RUN = ["--max-new-tokens", "3", "--dtype", "fp32"]


@pytest.fixture(scope="module")
def built(tiny_model_dir, tmp_path_factory):
    return convert_tiny(tiny_model_dir("llama"), tmp_path_factory.mktemp("contract") / "art")


@pytest.fixture
def art(built, tmp_path):
    return Path(shutil.copytree(built, tmp_path / "art"))


def rehash(art: Path) -> None:
    m = json.loads((art / MANIFEST).read_text())
    m["files"] = hash_files(art)
    write_json(art / MANIFEST, m)


def cli_env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "COLUMNS": "200", "NO_COLOR": "1"}
    env.pop("TALE_DEBUG", None)
    return env


# ---- tale-eval: where results are written -------------------------------------------------------------------
def test_eval_json_inside_the_artifact_is_refused(art):
    one_line_error(invoke(eval_cli.main, [art, *EVAL, "--json", art / "eval.json"]), "inside the TALE artifact")
    one_line_error(
        invoke(eval_cli.main, [art, *EVAL, "--frontier", "--frontier-out", art / "f"]), "inside the TALE artifact"
    )
    verify_files(art)  # nothing was added: it still loads


def test_eval_json_needs_overwrite_to_replace_a_file(art, tmp_path):
    out = tmp_path / "r.json"
    out.write_text("my results\n")
    one_line_error(invoke(eval_cli.main, [art, *EVAL, "--json", out]), "exists (pass --overwrite")
    assert out.read_text() == "my results\n"
    r = invoke(eval_cli.main, [art, *EVAL, "--json", out, "--overwrite"])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["results"][0]["policy"] == "full"
    assert not (tmp_path / "r.json.partial").exists()
    one_line_error(invoke(eval_cli.main, [art, *EVAL, "--json", ""]), "--json is empty")


@pytest.mark.parametrize("flag", ["--text", "--policies"])
def test_eval_empty_list_is_refused_not_the_default(art, flag):
    one_line_error(invoke(eval_cli.main, [art, *EVAL, flag, ""]), f"{flag} is empty")


def test_eval_sinks_covering_the_window_is_refused(art):
    one_line_error(invoke(eval_cli.main, [art, *EVAL, "--sinks", "32"]), "nothing would be compressed")


def test_eval_frontier_default_is_out_under_the_current_directory(art, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    args = [art, *EVAL[:-2], "--frontier", "--families", "kivi", "--ctx", "64", "--prefill", "16"]
    r = invoke(eval_cli.main, args)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "out" / "frontier.md").is_file() and (tmp_path / "out" / "frontier.png").is_file()
    assert list((tmp_path / "docs").iterdir()) == []
    one_line_error(invoke(eval_cli.main, args), "frontier.md exists (pass --overwrite")  # not replaced silently


def test_eval_interrupted_keeps_the_finished_rows(art, tmp_path, monkeypatch):
    import tale_eval.measure as measure_mod

    interrupt_at_call(monkeypatch, measure_mod, "measure", 2)
    out = tmp_path / "r.json"
    r = invoke(eval_cli.main, [art, *EVAL[:-1], "full,kivi2", "--json", out])
    assert r.exit_code == 130, r.output
    assert "1 finished row(s) of 2 kept in" in r.stderr and r.stderr.rstrip().endswith("interrupted (SIGINT)")
    rows = [json.loads(ln) for ln in (tmp_path / "r.json.partial").read_text().splitlines()]
    assert [row["policy"] for row in rows] == ["full"] and not out.exists()


# ---- tale-run: inputs that used to crash or pass silently --------------------------------------------------
@refusals(
    {
        "--temperature inf": "--temperature must be a finite number",
        "--temperature nan": "--temperature",
        "--temperature -1": "--temperature",
        "--top-p nan": "--top-p",
        f"--seed {2**64}": "--seed",
        "--seed -1": "--seed",
        "--sinks 512": "--sinks 512 is not below the model's context (512 tokens)",
        "--residual 1024": "--residual 1024 is not below the model's context",
    }
)
def test_run_refuses_out_of_range_numbers(art, args, fragment):
    one_line_error(invoke(run_cli.main, [art, "-p", "hi", *RUN, *args]), fragment)


def test_run_seed_up_to_64_bits_works(art):
    r = invoke(run_cli.main, [art, "-p", "hi", *RUN, "--temperature", "1", "--seed", str(2**64 - 1)])
    assert r.exit_code == 0, r.output


def test_run_says_when_nothing_is_compressed(art):
    r = invoke(run_cli.main, [art, "-p", "hi", *RUN, "--sinks", "100"])
    assert r.exit_code == 0, r.output
    assert "nothing is compressed, so the measured ratio is 1.00x" in r.stderr


def test_run_prompt_bytes_not_utf8(art):
    r = subprocess.run(
        [BIN / "tale-run", art, *RUN, "--prompt", os.fsdecode(b"caf\xe9")], capture_output=True, env=cli_env()
    )
    err = r.stderr.decode()
    assert r.returncode == 2 and err.count("\n") == 1, err
    assert err.startswith("error: --prompt: not valid UTF-8 text (byte 0xe9") and b"Traceback" not in r.stderr


def test_run_prompt_file_bom_is_stripped(art, tmp_path):
    plain, bom = tmp_path / "a.txt", tmp_path / "b.txt"
    plain.write_bytes(b"hello there")
    bom.write_bytes(b"\xef\xbb\xbfhello there")
    a, b = (invoke(run_cli.main, [art, "--prompt-file", f, *RUN]) for f in (plain, bom))
    assert a.exit_code == b.exit_code == 0, a.output + b.output
    assert a.stdout == b.stdout and a.stderr.split(",")[0] == b.stderr.split(",")[0]  # "prompt N tok"


@pytest.mark.parametrize(
    "template, fragment",
    [
        ("{{ raise_exception('Only user and assistant roles are supported') }}", "Only user and assistant roles"),
        ("{{ messages | no_such_filter }}", "no_such_filter"),
    ],
)
def test_run_broken_chat_template_suggests_raw(art, template, fragment):
    p = art / "tokenizer_config.json"
    cfg = json.loads(p.read_text())
    cfg["chat_template"] = template
    p.write_text(json.dumps(cfg))
    (art / "chat_template.jinja").unlink(missing_ok=True)
    rehash(art)
    r = invoke(run_cli.main, [art, "-p", "hi", *RUN])
    one_line_error(r, "pass --raw")
    assert fragment in r.stderr
    assert invoke(run_cli.main, [art, "-p", "hi", *RUN, "--raw"]).exit_code == 0


def test_run_cuda_only_flags_on_cpu_get_a_note(art):
    r = invoke(run_cli.main, [art, "-p", "hi", *RUN, "--device", "cpu", "--dynamic", "--no-compile"])
    assert r.exit_code == 0, r.output
    assert "note: --dynamic and --no-compile only change(s) decoding on CUDA" in r.stderr


def test_run_device_cpu_0_is_the_cpu(art):
    r = invoke(run_cli.main, [art, "-p", "hi", *RUN, "--device", "cpu:0"])
    assert r.exit_code == 0, r.output
    one_line_error(invoke(run_cli.main, [art, "-p", "hi", *RUN, "--device", "cpu:1"]), "one CPU device")


@pytest.mark.slow  # tale-run in a fresh process behind a pipe
def test_run_broken_pipe_exits_quietly(art):
    """`tale-run ... | head -c 1`: no traceback, no 'Exception ignored', the exit status of SIGPIPE."""
    cmd = f"'{BIN / 'tale-run'}' '{art}' -p hi --max-new-tokens 40 --dtype fp32 --temperature 1 --raw"
    r = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {cmd} 2>err.txt | head -c 1 >/dev/null; echo $?"],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=art.parent,
    )
    err = (art.parent / "err.txt").read_text()
    assert "Traceback" not in err and "Exception ignored" not in err and "error:" not in err, err
    assert r.stdout.strip() in ("0", "141"), r.stdout  # 0: it finished before head closed the pipe


def test_run_closed_stdout_is_one_line(art):
    cmd = f"'{BIN / 'tale-run'}' '{art}' -p hi --max-new-tokens 2 --dtype fp32 >&-"
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=cli_env())
    assert (
        r.returncode == 2
        and r.stderr == "error: standard output is closed: redirect it to a file or to /dev/null instead\n"
    )


def test_run_interrupted_ends_the_line_then_stats(art, monkeypatch):
    import tale_runtime.generate as gen

    interrupt_at_call(monkeypatch, gen, "_next_token", 3)
    r = invoke(run_cli.main, [art, "-p", "hi", "--max-new-tokens", "10", "--dtype", "fp32", "--raw"])
    assert r.exit_code == 130, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[-1] == "interrupted (SIGINT)"
    assert "generated 2 tok" in lines[-2] and lines[-2].endswith("(interrupted)"), r.stderr
    assert r.stdout.endswith("\n") or r.stdout == ""


# ---- tale-push ---------------------------------------------------------------------------------------------
def test_push_binary_readme_is_one_line(art):
    (art / "README.md").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    one_line_error(invoke(push_cli.main, [art, "alice/x", "--dry-run"]), "README.md: not UTF-8 text")


@pytest.mark.parametrize("rev", ["bad..name", "has space", "x.lock", "-x", "a:b", "/x", "x/"])
def test_push_invalid_branch_is_refused_before_upload(art, rev):
    one_line_error(
        invoke(push_cli.main, [art, "alice/x", "--revision", rev, "--token", "hf_fake"]), "invalid --revision"
    )


def test_push_quality_from_tale_eval_json(art, tmp_path):
    out = tmp_path / "r.json"
    assert invoke(eval_cli.main, [art, *EVAL[:-1], "full,kivi2", "--json", out]).exit_code == 0
    r = invoke(push_cli.main, [art, "alice/x", "--dry-run", "--quality", out])
    assert r.exit_code == 0, r.output
    assert "## Measured with tale-eval" in r.stdout and "| config." not in r.stdout
    assert "| full (16-bit K+V) | " in r.stdout and "| kivi2 (" in r.stdout and "x |" in r.stdout
    q = json.loads(out.read_text())
    q["results"][1]["ppl"]["dev"] = math.nan
    out.write_text(json.dumps(q))  # json writes NaN, and reads it back
    one_line_error(invoke(push_cli.main, [art, "alice/x", "--dry-run", "--quality", out]), "results[1].ppl.dev is nan")


# ---- tale-convert -------------------------------------------------------------------------------------------
def test_convert_few_calibration_tokens_warn(tiny_model_dir, tmp_path):
    r = invoke(convert_cli.main, [*TINY_ARGS, tiny_model_dir("llama"), "--out", tmp_path / "o", "--samples", "1"])
    assert r.exit_code == 0, r.output
    assert "warning: only 64 calibration tokens for hidden size 128" in r.stderr
    assert "not meaningful" in r.stderr and "not meaningful" in r.stdout  # the per-layer table's energy column


def test_convert_calib_directory_is_named_as_such(tiny_model_dir, tmp_path):
    r = invoke(convert_cli.main, [*TINY_ARGS, tiny_model_dir("llama"), "--out", tmp_path / "o", "--calib", tmp_path])
    one_line_error(r, "is a directory; give the files")


def test_convert_sinks_beyond_the_context_is_refused(tiny_model_dir, tmp_path):
    r = invoke(convert_cli.main, [*TINY_ARGS, tiny_model_dir("llama"), "--out", tmp_path / "o", "--sinks", "600"])
    one_line_error(r, "--sinks 600 is not below the model's context (512 tokens)")
    assert not (tmp_path / "o").exists()


# ---- the Python API: arguments checked at the entry ---------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_load_on_cuda_without_cuda_is_a_clear_error(built, monkeypatch):
    import importlib

    import tale_runtime

    load_mod = importlib.import_module("tale_runtime.load")  # the package exports a function of that name
    monkeypatch.setattr(load_mod, "resolve", lambda *a: pytest.fail("read the artifact before checking the device"))
    with pytest.raises(ValueError, match="CUDA is not available"):
        tale_runtime.load(built, device="cuda")


@pytest.mark.parametrize("name, want", [("bf16", torch.bfloat16), ("fp32", torch.float32), ("float16", torch.float16)])
def test_load_takes_the_clis_dtype_names(built, name, want):
    import tale_runtime

    model, _ = tale_runtime.load(built, device="cpu", dtype=name)
    assert next(model.parameters()).dtype == want
    with pytest.raises(ValueError, match="use bf16, fp16 or fp32"):
        tale_runtime.load(built, device="cpu", dtype="int8")


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(temperature=math.inf), dict(top_p=2.0)])
def test_generate_refuses_bad_sampling_arguments(built, kw):
    import tale_runtime
    from tale_runtime.generate import generate

    model, _ = tale_runtime.load(built, device="cpu", dtype="fp32")
    with pytest.raises(ValueError):
        generate(model, [1, 2, 3], max_new_tokens=2, **kw)


SWALLOWED = """
import os, signal, time, typer
from tale_runtime import console

app = typer.Typer()

class Finalized:
    def __del__(self):  # the signal lands here: Python ignores what a finalizer raises and goes on
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)

@app.command()
def main():
    Finalized()
    print("went on")

console.run_app(app)
"""


def test_a_signal_whose_interrupt_a_finalizer_swallowed_still_ends_as_an_interrupt():
    """SIGTERM raises KeyboardInterrupt where the process is; inside a finalizer Python prints it as 'Exception
    ignored' and goes on. The command still ends as interrupted (exit 143, one line), with no traceback."""
    p = subprocess.run([sys.executable, "-c", SWALLOWED], capture_output=True, text=True, timeout=120)
    assert p.returncode == 143, p.stderr
    assert p.stderr.strip() == "interrupted (SIGTERM)", p.stderr


WRAPPED = """
import os, signal, time, typer
from tale_runtime import console

app = typer.Typer()

@app.command()
def main():
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.2)
    except KeyboardInterrupt as e:  # what torch does when it lands while a sequence is converted
        raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'") from e

console.run_app(app)
"""


def test_a_signal_that_library_code_reported_as_another_error_still_ends_as_an_interrupt():
    """A signal's KeyboardInterrupt raised inside library code that turns it into another exception (torch: a
    ValueError) is still an interruption: exit 129, one line, not an internal error."""
    p = subprocess.run([sys.executable, "-c", WRAPPED], capture_output=True, text=True, timeout=120)
    assert p.returncode == 129, p.stderr
    assert p.stderr.strip() == "interrupted (SIGHUP)", p.stderr
