"""The command lines and Python snippets of README.md and docs/runtime.md, run as written on the bundled SmolLM2
artifact (`out/smollm2-tale` in the docs: the smollm2_artifact fixture), with few new tokens, and the figures the docs
quote for them checked. Every tale-* command line and Python block of those pages is run here or named in NOT_RUN
with the reason, so an example added to the docs is either tested or says why not."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from tale_helpers import invoke

from tale_runtime.cli import main as run_main

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/runtime.md")
ARTIFACT = "out/smollm2-tale"
MAX_NEW = 8  # tokens per command (a doc's own smaller --max-new-tokens is kept)

# what is not run, by a text the line or block holds
NOT_RUN = {
    "make ": "make demo and make test are the demo's and the test suite's own (tests/test_demo.py)",
    "meta-llama/": "a Hub checkpoint and a GPU",
    "llama8b-tale": "the Llama-3.1-8B artifact",
    "llama70b-tale": "a 70B artifact over several GPUs",
    "torchrun": "several processes over several GPUs (tests/test_tp.py runs tensor parallelism on the CPU)",
    "tale-eval out/smollm2-tale --preset ci": "minutes on a CPU (tests/test_eval.py runs tale-eval on tiny models)",
    "tale-push": "publishes to the Hub (tests/test_push.py runs it against a stand-in Hub)",
    "benchmarks/": "a benchmark (docs/performance.md)",
    "python - out/smollm2-tale 2048": "a 2K-token prompt: minutes of CPU prefill",
    "tp_size=": "several processes over several GPUs",
    "ctx2048.txt": "reads the 2K-token prompt the script before it writes",
}
# files the commands read, made in the working directory
FILES = {
    "long.txt": "The printing museum in Mainz keeps an archive of early type. " * 8,
    "notes.txt": "Gold is a chemical element with the symbol Au.\n\nIt is dense and soft.",
}


def blocks(page: str) -> list[tuple[str, str, int]]:
    """(language, text, first line number) of each fenced code block."""
    out, lang, body, start = [], None, [], 0
    for i, line in enumerate((ROOT / page).read_text().splitlines(), 1):
        if line.startswith("```"):
            if lang is None:
                lang, body, start = line[3:].strip() or "text", [], i + 1
            else:
                out.append((lang, "\n".join(body), start))
                lang = None
        elif lang is not None:
            body.append(line)
    return out


def not_run(text: str) -> str | None:
    return next((why for key, why in NOT_RUN.items() if key in text), None)


def command_lines() -> list[tuple[str, int, str]]:
    """(page, line, command) for every tale-* line of a shell block or a `$ ` line of an output block."""
    found = []
    for page in PAGES:
        for lang, text, start in blocks(page):
            for i, line in enumerate(text.splitlines()):
                cmd = line.removeprefix("$ ") if lang != "bash" else line
                if lang not in ("bash", "text") or (lang == "text" and not line.startswith("$ ")):
                    continue
                if re.search(r"(^|\| )tale-", cmd) or cmd.startswith(("make ", "torchrun", "python ")):
                    found.append((page, start + i, cmd))
    return found


def python_blocks() -> list[tuple[str, int, str]]:
    return [(page, start, text) for page in PAGES for lang, text, start in blocks(page) if lang == "python"]


def test_every_example_is_run_or_says_why_not():
    """The parser finds the examples this file runs (a change of the docs' layout must not make it find none)."""
    cmds = command_lines()
    run = [c for c in cmds if not not_run(c[2])]
    assert len(run) >= 11 and all("tale-run" in c for _, _, c in run), run
    assert len([b for b in python_blocks() if not not_run(b[2])]) >= 3


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, smollm2_artifact):
    d = tmp_path_factory.mktemp("docs")
    (d / "out").mkdir()
    (d / ARTIFACT).symlink_to(smollm2_artifact)
    for name, text in FILES.items():
        (d / name).write_text(text)
    return d


def _argv(cmd: str) -> tuple[list[str], str | None, bool]:
    """A doc's tale-run line -> (argv after `tale-run`, standard input, whether stdout is JSON for a `| jq`)."""
    cmd = re.sub(r"\s+#\s.*$", "", cmd).strip()  # a trailing comment
    stdin = None
    if m := re.match(r"cat (\S+) \| (.*)", cmd):
        stdin, cmd = (Path(m[1]).read_text(), m[2])
    jq = " | jq " in cmd
    cmd = cmd.split(" | jq ")[0]
    argv = shlex.split(cmd)
    assert argv[0] == "tale-run", cmd
    argv = [ARTIFACT if a == "DIR_OR_REPO" else a for a in argv[1:]]
    if "--chat" in argv:
        stdin = "Hi\n"
    if "--max-new-tokens" in argv:
        i = argv.index("--max-new-tokens") + 1
        argv[i] = str(min(int(argv[i]), MAX_NEW if "--compare-full" not in cmd else 16))
    else:
        argv += ["--max-new-tokens", str(MAX_NEW)]
    return argv, stdin, jq


@pytest.mark.slow
@pytest.mark.parametrize("where,cmd", [(f"{p}:{n}", c) for p, n, c in command_lines() if not not_run(c)])
def test_command_lines_run(where, cmd, workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    argv, stdin, jq = _argv(cmd)
    r = invoke(run_main, argv, input=stdin)
    assert r.exit_code == 0, f"{where}: {cmd}\n{r.stderr}"
    assert "error:" not in r.stderr and "Traceback" not in r.stderr
    if jq:
        assert json.loads(r.stdout)["text"]
    if "--compare-full" in argv and "chemical symbol" in cmd:  # docs/runtime.md quotes this run's output
        _check_compare_full(r)


def _check_compare_full(r) -> None:
    """docs/runtime.md's `--compare-full` example: its answers and measured ratio, as the page prints them."""
    text = (ROOT / "docs/runtime.md").read_text()
    quoted = text.split("--max-new-tokens 16 --compare-full\n", 1)[1].split("```", 1)[0].splitlines()
    assert r.stdout.splitlines() == [q for q in quoted if not q.startswith("(stderr)")]
    ratio = re.search(r"measured ([\d.]+)x smaller", quoted[-1])[1]
    assert f"measured {ratio}x smaller" in r.stderr.splitlines()[-1]
    assert (
        re.search(r"measured ([\d.]+)x \(nominal ([\d.]+)x\)", quoted[-3]).groups()
        == re.search(r"measured ([\d.]+)x \(nominal ([\d.]+)x\)", r.stderr).groups()
    )


def _run_python(src: str, ns: dict) -> str:
    src = src.replace('"cuda"', '"cuda"' if torch.cuda.is_available() else '"cpu"')
    src = re.sub(r"max_new_tokens=(\d+)", lambda m: f"max_new_tokens={min(int(m[1]), 20)}", src)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(src, "<docs>", "exec"), ns)
    return out.getvalue()


@pytest.mark.slow
def test_readme_python_prints_what_it_says(workdir, monkeypatch):
    """The README's snippet prints the answer and the figures quoted under it; the batch snippet after it runs in
    the same session (it reuses `model` and `tok`)."""
    monkeypatch.chdir(workdir)
    readme = blocks("README.md")
    i = next(i for i, (lang, _, _) in enumerate(readme) if lang == "python")
    snippet, quoted = readme[i][1], readme[i + 1]  # the block under "prints (...):"
    batch = next(b for lang, b, _ in readme[i + 2 :] if lang == "python")
    assert quoted[0] == "text"
    ns: dict = {}
    printed = _run_python(snippet, ns)
    assert printed.strip() == quoted[1].strip()
    out = _run_python(batch, ns)
    answers = eval(out)  # noqa: S307 (the list the snippet prints)
    assert len(answers) == 2 and "Paris" in answers[0]


@pytest.mark.slow
def test_runtime_python_api_runs(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    block = next(b for p, _, b in python_blocks() if p == "docs/runtime.md" and not not_run(b))
    ns: dict = {}
    printed = _run_python(block, ns)
    ratio = float(printed.splitlines()[0])  # print(cache.baseline_nbytes() / cache.nbytes())
    assert ratio > 1 and "measured" in printed.splitlines()[-1]


@pytest.mark.slow
def test_runtime_one_call_runs(workdir, monkeypatch):
    """docs/runtime.md's generate_text and chat block prints the answer and the ratio it quotes; the chat answers
    both turns."""
    monkeypatch.chdir(workdir)
    block = next(b for p, _, b in python_blocks() if p == "docs/runtime.md" and "generate_text(" in b)
    ns: dict = {}
    printed = _run_python(block, ns).splitlines()
    assert f"# {printed[0]}\n" in block and f"# {printed[1]}: measured" in block, printed  # as the comments say
    assert [t["turn"] for t in ns["turns"]] == [1, 2] and all(t["text"] for t in ns["turns"])


@pytest.mark.slow
def test_the_3x_setting_runs_where_the_docs_say(smollm2_paper_artifact, smollm2_artifact):
    """README's and docs/quality.md's 3x setting, `--bits 4,4 --r0 1.0`, is the paper preset's two levels; on the
    default three-level artifact it is refused in one line that says how many levels there are."""
    for page in ("README.md", "docs/quality.md"):
        assert "--preset paper --bits 4,4 --r0 1.0" in (ROOT / page).read_text()
    args = ["-p", "Hi", "--bits", "4,4", "--r0", "1.0", "--max-new-tokens", "2", "--json"]
    r = invoke(run_main, [smollm2_paper_artifact, *args])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["stats"]["nominal_ratio"] == pytest.approx(4.0)  # 4-bit keys and full-rank latents
    r = invoke(run_main, [smollm2_artifact, *args])
    assert r.exit_code == 2 and r.stderr.startswith("error: schedule override: bits has 2 values for 3 levels")
