"""Fault run: bad inputs and faults through the installed console scripts, one subprocess each, and the
table of what they answered (docs/errors.md). tests/test_faults.py runs every case under pytest (CI);
`make errors` regenerates the table:

    OMP_NUM_THREADS=1 .venv/bin/python tests/faults.py [--out docs/errors.md] [--only SUBSTR]

Every case states what must happen: `refuse` (exit 2, stderr exactly one line `error: ...` with the given
fragment), `accept` (exit 0: things that used to fail and must work), `interrupt` (a signal mid-run: exit
128+N, and the clean-up the case checks) or `quiet` (a broken pipe: no output on stderr, exit 0 or 141). A case
may check more (nothing at --out, a README left untouched, a user's file still there). Counted: tracebacks,
"internal error" lines, silent accepts (exit 0 where a refusal was due), multi-line refusals, wrong exit codes,
data loss (a check that something the tool did not create was removed or changed, or an artifact made
unusable), failed checks. Tiny random models only (CPU, a few minutes); the full-disk and read-only cases mount
a small tmpfs in a private mount namespace (`unshare -m`, needs root), and are skipped with a note otherwise.

The converter's source checks (a TALE artifact as MODEL, a truncated shard, a missing tensor, --seq-len beyond the
context) are in `source_cases()`, the cases of the new-user trial in `trial_cases()`, run with the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC_COMMAND = "make errors  # OMP_NUM_THREADS=1 .venv/bin/python tests/faults.py"
BIN = Path(sys.executable).parent
TINY_ARGS = [  # the paper preset: the cases below name its levels (the slow model's, SIG_ARGS, take the default)
    "--preset",
    "paper",
    "--group",
    "2",
    "--samples",
    "8",
    "--seq-len",
    "64",
    "--dtype",
    "fp32",
    "--key-group",
    "8",
    "--value-group",
    "8",
    "--residual",
    "8",
]
# the slow model of the signal cases: about 1 s per layer on one CPU thread
SIG_ARGS = [
    "--group",
    "2",
    "--samples",
    "32",
    "--seq-len",
    "256",
    "--dtype",
    "fp32",
    "--key-group",
    "8",
    "--value-group",
    "8",
    "--residual",
    "8",
]


@dataclass
class Case:
    id: str
    group: str
    cmd: list[str]  # placeholders: {W} case dir, {MODEL} tiny checkpoint, {ART} fresh artifact copy, {SIG} slow model,
    # {LR} a fresh copy of a --preset lowrank artifact
    expect: str = "refuse"  # refuse | accept | interrupt
    fragment: str = ""  # must be in the error line (refuse) or in the output (accept/interrupt)
    setup: Callable[[Path], None] | None = None  # (case dir), run before the command
    check: Callable[[Path, subprocess.CompletedProcess], str | None] | None = None  # -> a problem, or None
    env: dict = field(default_factory=dict)
    signal_when: Callable[[Path], bool] | None = None  # interrupt: send `sig` (or run `act`) once this holds
    act: Callable[[Path], None] | None = None  # instead of a signal: what happens to the world mid-run
    runner: Callable[[Case, list[str], Path], subprocess.CompletedProcess] | None = None  # a custom way to run
    slow: bool = False  # tens of seconds (the slow model)
    sig: int = signal.SIGTERM
    root_only: bool = False  # needs `unshare -m` + mount
    logs: bool = False  # progress lines on stderr may precede the error line (a failure after the work)


# ---- setup helpers: each gets the case dir W, which holds ART (a fresh artifact copy) -------------------------
def art(w: Path) -> Path:
    return w / "art"


def edit_json(name: str, **kv):
    def f(w):
        p = art(w) / name
        d = json.loads(p.read_text())
        d.update(kv)
        p.write_text(json.dumps(d, indent=2))

    return f


def edit_manifest(fn):
    def f(w):
        p = art(w) / "tale_config.json"
        m = json.loads(p.read_text())
        fn(m)
        p.write_text(json.dumps(m, indent=2))

    return f


def rehash(*names):
    """Update the manifest's checksums of `names` (an attacker who edits the index and the manifest)."""

    def f(m, w):
        from tale_runtime.artifact import sha256_file

        for n in names:
            m["files"][n] = sha256_file(art(w) / n)

    return f


def delete(name: str):
    return lambda w: (art(w) / name).unlink()


def write(name: str, data: bytes | str, where: str = "w"):
    def f(w):
        p = (art(w) if where == "art" else w) / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data if isinstance(data, bytes) else data.encode())

    return f


def flip(name: str):
    def f(w):
        p = art(w) / name
        b = bytearray(p.read_bytes())
        b[len(b) // 2] ^= 1
        p.write_bytes(bytes(b))

    return f


def truncate(name: str):
    def f(w):
        p = art(w) / name
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])

    return f


def index_points_at(shard: str):
    def f(w):
        a = art(w)
        shutil.copy(a / "model-00001-of-00001.safetensors", a / shard)
        idx = json.loads((a / "model.safetensors.index.json").read_text())
        idx["weight_map"]["lm_head.weight"] = shard
        (a / "model.safetensors.index.json").write_text(json.dumps(idx))
        edit_manifest(lambda m: rehash("model.safetensors.index.json")(m, w))(w)

    return f


def steps(*fns):
    def f(w):
        for fn in fns:
            fn(w)

    return f


# ---- checks -----------------------------------------------------------------------------------------------
def nothing_at(rel: str):
    def f(w, p):
        out = w / rel
        left = [x.name for x in out.parent.glob(out.name + "*")] if out.parent.exists() else []
        return f"left behind: {left}" if left else None

    return f


def unchanged_art(w, p):
    from tale_runtime.artifact import verify_files

    try:
        verify_files(art(w))
    except Exception as e:  # the case's own edit is expected to remain; only the push must not add to it
        return None if "README.md" not in str(e) else f"artifact changed: {e}"
    return None


def readme_unchanged(w, p):
    before = (w / "README.before").read_bytes()
    return None if (art(w) / "README.md").read_bytes() == before else "README.md was rewritten"


def save_readme(w):
    shutil.copy(art(w) / "README.md", w / "README.before")


def tmp_state(expect_kept: bool):
    def f(w, p):
        tmps = list(w.glob("out.tmp-*"))
        if (w / "out").exists():
            return "a finished artifact appeared at --out"
        if expect_kept:
            if not tmps or not list((tmps[0] / ".partial").glob("layer_*.safetensors")):
                return "finished layers were not kept for --resume"
            return None
        return f"temp dir left with no finished layers: {[t.name for t in tmps]}" if tmps else None

    return f


def partial_layers(w: Path) -> int:
    return sum(len(list((t / ".partial").glob("layer_*.safetensors"))) for t in w.glob("out.tmp-*"))


def tmp_exists(w: Path) -> bool:
    return any(w.glob("out.tmp-*"))


def left_file_empty(w, p):
    f = w / "left.txt"
    return None if not f.exists() or not f.read_text().strip() else f"left on the small disk: {f.read_text().split()}"


# ---- the cases --------------------------------------------------------------------------------------------
def cases() -> list[Case]:
    C = []

    def add(id, group, cmd, fragment="", **kw):
        C.append(Case(id, group, cmd, fragment=fragment, **kw))

    cv = ["tale-convert", "{MODEL}", *TINY_ARGS]
    run = ["tale-run", "{ART}", "--prompt", "hi", "--max-new-tokens", "2", "--dtype", "fp32"]
    ev = [
        "tale-eval",
        "{ART}",
        "--dtype",
        "fp32",
        "--threads",
        "1",
        "--ctx",
        "32",
        "--windows",
        "1",
        "--prefill",
        "8",
        "--passkey-lengths",
        "",
        "--policies",
        "full",
    ]

    # usage errors: one line, exit 2, for all four
    g = "usage"
    add("convert-no-args", g, ["tale-convert"], "Missing option '--out'")
    add("convert-unknown-option", g, [*cv, "--out", "{W}/out", "--bogus"], "No such option: --bogus")
    add("convert-samples-not-int", g, [*cv, "--out", "{W}/out", "--samples", "many"], "Invalid value for '--samples'")
    add("convert-group-not-int", g, [*cv, "--out", "{W}/out", "--group", "two"], "Invalid value for '--group'")
    add("convert-out-no-value", g, ["tale-convert", "{MODEL}", "--out"], "requires an argument")
    add("run-no-args", g, ["tale-run"], "Missing argument 'DIR_OR_REPO'")
    add("run-unknown-option", g, [*run, "--bogus"], "No such option: --bogus")
    add("run-temperature-not-float", g, [*run, "--temperature", "hot"], "Invalid value for '--temperature'")
    add("run-top-p-out-of-range", g, [*run, "--top-p", "2"], "Invalid value for '--top-p'")
    add("run-max-new-tokens-0", g, [*run, "--max-new-tokens", "0"], "Invalid value for '--max-new-tokens'")
    add("push-no-args", g, ["tale-push"], "Missing argument 'ARTIFACT'")
    add("push-no-repo", g, ["tale-push", "{ART}"], "Missing argument 'REPO_ID'")
    add("push-unknown-option", g, ["tale-push", "{ART}", "alice/x", "--bogus"], "No such option: --bogus")
    add("eval-no-args", g, ["tale-eval"], "Missing argument 'artifact'")
    add("eval-unknown-option", g, [*ev, "--bogus"], "No such option: --bogus")
    add("eval-ctx-not-int", g, [*ev, "--ctx", "x"], "Invalid value for '--ctx'")
    add("eval-threads-not-int", g, [*ev, "--threads", "many"], "Invalid value for '--threads'")

    # tale-run: prompts, devices, schedule options
    g = "tale-run input"
    add(
        "run-binary-prompt-file",
        g,
        [*run[:2], "--prompt-file", "{W}/p.bin"],
        "binary file",
        setup=write("p.bin", b"\x00\x01\xffELF"),
    )
    add(
        "run-latin1-prompt-file",
        g,
        [*run[:2], "--prompt-file", "{W}/p.txt"],
        "not UTF-8",
        setup=write("p.txt", b"caf\xe9 au lait"),
    )
    add(
        "run-empty-prompt-file",
        g,
        [*run[:2], "--prompt-file", "{W}/p.txt"],
        "the file is empty",
        setup=write("p.txt", ""),
    )
    add(
        "run-blank-prompt-file",
        g,
        [*run[:2], "--prompt-file", "{W}/p.txt"],
        "the file is empty",
        setup=write("p.txt", " \n\t\n"),
    )
    add("run-prompt-file-is-dir", g, [*run[:2], "--prompt-file", "{W}"], "not a file")
    add("run-prompt-file-missing", g, [*run[:2], "--prompt-file", "{W}/nope.txt"], "no such file")
    add("run-empty-prompt", g, ["tale-run", "{ART}", "--prompt", ""], "--prompt is empty")
    add("run-prompt-and-file", g, [*run, "--prompt-file", "{W}/p.txt"], "exactly one of", setup=write("p.txt", "x"))
    add("run-no-prompt", g, ["tale-run", "{ART}"], "exactly one of --prompt and --prompt-file")
    add("run-prompt-too-long", g, ["tale-run", "{ART}", "--prompt", "word " * 600], "the model's context is 512")
    add("run-device-mps", g, [*run, "--device", "mps"], "--device mps: not supported")
    add("run-device-tpu", g, [*run, "--device", "tpu"], "unknown device")
    add("run-device-cuda-absent", g, [*run, "--device", "cuda"], "CUDA is not available")
    add("run-device-cuda-index", g, [*run, "--device", "cuda:7"], "CUDA is not available")
    add("run-value-group-0", g, [*run, "--value-group", "0"], "--value-group must be >= 1")
    add("run-value-group-0-ranks", g, [*run, "--value-group", "0", "--ranks", "0.5"], "--value-group must be >= 1")
    add("run-key-group-0", g, [*run, "--key-group", "0"], "--key-group must be >= 1")
    add("run-residual-0", g, [*run, "--residual", "0"], "--residual must be >= 1")
    add("run-sinks-negative", g, [*run, "--sinks", "-1"], "--sinks must be >= 0")
    add("run-bits-5", g, [*run, "--bits", "5"], "bits must be one of 2, 3, 4, 8, 16")
    add("run-bits-not-number", g, [*run, "--bits", "2,x"], "--bits: 'x' is not a whole number")
    add("run-key-bits-5", g, [*run, "--key-bits", "5"], "bits must be one of 2, 3, 4, 8, 16")
    add("run-ranks-1.5", g, [*run, "--ranks", "1.5"], "rank fraction 1.5 must lie in (0, 1]")
    add("run-ranks-0", g, [*run, "--ranks", "0"], "ranks")
    add("run-recent-over-1", g, [*run, "--recent", "2"], "recent share 2.0 must lie in [0, 1)")
    add("run-levels-without-bits", g, [*run, "--recent", "0.1,0.1"], "need bits for each level")
    add("run-key-group-vs-residual", g, [*run, "--key-group", "64"], "must be a positive multiple of key_group")
    add("run-dtype-int8", g, [*run, "--dtype", "int8"], "--dtype must be one of bf16, fp16, fp32")
    add("run-output-path", g, [*run, "--output-path", "both"], "--output-path must be fused or factored")
    add("run-missing-artifact", g, ["tale-run", "{W}/none", "--prompt", "hi"], "no such artifact directory")
    add("run-plain-dir", g, ["tale-run", "{W}", "--prompt", "hi"], "not a TALE artifact")
    add(
        "run-file-as-artifact",
        g,
        ["tale-run", "{W}/f.txt", "--prompt", "hi"],
        "not a directory",
        setup=write("f.txt", "x"),
    )
    add("run-base-model-as-artifact", g, ["tale-run", "{MODEL}", "--prompt", "hi"], "not a TALE artifact")
    add("run-hub-id-offline", g, ["tale-run", "nobody-xyz/none", "--prompt", "hi"], "nobody-xyz/none")
    add("run-top-p-0-sampling", g, [*run, "--temperature", "1", "--top-p", "0"], "generated 2 tok", expect="accept")
    add("run-backend-unknown", g, [*run, "--backend", "bogus"], "no attention backend 'bogus'")
    add(
        "run-backend-not-serving",
        g,
        [*run, "--backend", "triton"],
        "does not serve this model's caches",
        env={"TRITON_INTERPRET": "0"},  # the interpreter (as in CI's kernel tests) would serve CPU tensors
    )
    add("run-repetition-penalty-0", g, [*run, "--repetition-penalty", "0"], "--repetition-penalty must be > 0")
    add("run-stop-empty", g, [*run, "--stop", ""], "--stop is empty")
    add("run-tp-without-torchrun", g, [*run, "--tp", "2"], "start it with torchrun")
    add("run-system-with-raw", g, [*run, "--system", "be brief", "--raw"], "drop --raw")
    add("run-chat-with-prompt", g, [*run, "--chat"], "drop --prompt")
    add(
        "run-prompt-stdin-empty",
        g,
        ["sh", "-c", '"$@" < /dev/null', "sh", *run[:2], "--prompt-file", "-", *run[4:]],
        "standard input is empty",
    )

    # the artifact: every file hashed, only verified files read
    g = "artifact integrity"
    add("deleted-tokenizer-json", g, run, "tokenizer.json is missing", setup=delete("tokenizer.json"))
    add("deleted-config-json", g, run, "config.json is missing", setup=delete("config.json"))
    add(
        "deleted-generation-config", g, run, "generation_config.json is missing", setup=delete("generation_config.json")
    )
    add("deleted-chat-template", g, run, "is missing", setup=delete("tokenizer_config.json"))
    add(
        "deleted-index", g, run, "model.safetensors.index.json is missing", setup=delete("model.safetensors.index.json")
    )
    add(
        "deleted-shard",
        g,
        run,
        "model-00001-of-00001.safetensors is missing",
        setup=delete("model-00001-of-00001.safetensors"),
    )
    add("deleted-readme", g, run, "README.md is missing", setup=delete("README.md"))
    add("deleted-manifest", g, run, "no tale_config.json", setup=delete("tale_config.json"))
    add(
        "flipped-byte-in-shard",
        g,
        run,
        "checksum mismatch for model-00001-of-00001.safetensors",
        setup=flip("model-00001-of-00001.safetensors"),
    )
    add(
        "truncated-shard",
        g,
        run,
        "checksum mismatch for model-00001-of-00001.safetensors",
        setup=truncate("model-00001-of-00001.safetensors"),
    )
    add(
        "edited-rope-theta", g, run, "checksum mismatch for config.json", setup=edit_json("config.json", rope_theta=1.0)
    )
    add(
        "edited-max-positions",
        g,
        run,
        "checksum mismatch for config.json",
        setup=edit_json("config.json", max_position_embeddings=100000),
    )
    add(
        "edited-generation-config",
        g,
        run,
        "checksum mismatch for generation_config.json",
        setup=edit_json("generation_config.json", eos_token_id=7),
    )
    add(
        "edited-tokenizer-config",
        g,
        run,
        "checksum mismatch for tokenizer_config.json",
        setup=edit_json("tokenizer_config.json", model_max_length=8),
    )
    add("edited-readme", g, run, "checksum mismatch for README.md", setup=write("README.md", "# mine\n", "art"))
    add("stray-file", g, run, "notes.txt is not in the manifest", setup=write("notes.txt", "x", "art"))
    add(
        "stray-shard-in-subdir",
        g,
        run,
        "extra/x.safetensors is not in the manifest",
        setup=write("extra/x.safetensors", "x", "art"),
    )
    add(
        "index-names-extra-shard",
        g,
        run,
        "model-00002-of-00002.safetensors is not in the manifest",
        setup=index_points_at("model-00002-of-00002.safetensors"),
    )
    add(
        "index-names-hidden-shard",
        g,
        run,
        "which the manifest does not list",
        setup=index_points_at(".shadow.safetensors"),
    )
    add(
        "index-edited-not-rehashed",
        g,
        run,
        "checksum mismatch for model.safetensors.index.json",
        setup=edit_json("model.safetensors.index.json", metadata={"total_size": 1}),
    )
    add("manifest-files-empty", g, run, "lists no files", setup=edit_manifest(lambda m: m.update(files={})))
    add("manifest-files-list", g, run, "lists no files", setup=edit_manifest(lambda m: m.update(files=["x"])))
    add(
        "manifest-entry-removed",
        g,
        run,
        "tokenizer.json is not in the manifest",
        setup=edit_manifest(lambda m: m["files"].pop("tokenizer.json")),
    )
    add(
        "manifest-config-unlisted",
        g,
        run,
        "does not cover config.json",
        setup=edit_manifest(lambda m: m["files"].pop("config.json")),
    )
    add(
        "manifest-path-escape",
        g,
        run,
        "outside the artifact",
        setup=edit_manifest(lambda m: m["files"].update({"../../etc/passwd": "0" * 64})),
    )
    add("manifest-not-json", g, run, "corrupt manifest", setup=write("tale_config.json", "{oops", "art"))
    add(
        "manifest-format-1.0",
        g,
        run,
        "re-convert the model with tale-convert",
        setup=edit_manifest(lambda m: m.update(format_version="1.0")),
    )
    add("manifest-format-3.0", g, run, "upgrade tale-kv", setup=edit_manifest(lambda m: m.update(format_version="3.0")))
    add("manifest-not-tale", g, run, "not a TALE manifest", setup=edit_manifest(lambda m: m.update(format="gguf")))
    add(
        "manifest-no-architecture", g, run, "lacks 'architecture'", setup=edit_manifest(lambda m: m.pop("architecture"))
    )
    add(
        "manifest-schedule-bits-5",
        g,
        run,
        "bits must be one of",
        setup=edit_manifest(lambda m: m["schedule"]["levels"][0].update(bits=5)),
    )
    add(
        "eval-edited-config",
        g,
        [*ev],
        "checksum mismatch for config.json",
        setup=edit_json("config.json", rms_norm_eps=0.5),
    )
    add(
        "push-edited-config",
        g,
        ["tale-push", "{ART}", "alice/x", "--dry-run"],
        "checksum mismatch for config.json",
        setup=edit_json("config.json", rope_theta=1.0),
    )

    # tale-convert: source, options, calibration files, the place to write
    g = "tale-convert input"
    out = ["--out", "{W}/out"]
    chk = nothing_at("out")
    add("convert-missing-model", g, ["tale-convert", "{W}/nope", *TINY_ARGS, *out], "model not found", check=chk)
    add(
        "convert-model-is-file",
        g,
        ["tale-convert", "{W}/f.txt", *TINY_ARGS, *out],
        "not a model directory",
        setup=write("f.txt", "x"),
        check=chk,
    )
    add(
        "convert-dir-without-config",
        g,
        ["tale-convert", "{W}/d", *TINY_ARGS, *out],
        "no config.json",
        setup=write("d/x.txt", "x"),
        check=chk,
    )
    add(
        "convert-unsupported-arch",
        g,
        ["tale-convert", "{W}/gpt2", *TINY_ARGS, *out],
        "unsupported architecture",
        setup=write("gpt2/config.json", json.dumps({"model_type": "gpt2"})),
        check=chk,
    )
    add("convert-hub-offline", g, ["tale-convert", "nobody-xyz/none", *TINY_ARGS, *out], "nobody-xyz/none", check=chk)
    add("convert-group-3", g, [*cv, *out, "--group", "3"], "must divide the number of KV heads", check=chk)
    add("convert-group-0", g, [*cv, *out, "--group", "0"], "--group must be >= 1", check=chk)
    # calibration files that are not text: (id, file, its bytes, the error fragment)
    for id, name, data, fragment in (
        ("convert-empty-calib", "e.txt", "", "the file is empty"),
        ("convert-binary-calib", "b.txt", bytes(range(256)) * 4, "binary file"),
        ("convert-latin1-calib", "l.txt", b"caf\xe9 " * 100, "not UTF-8"),
        ("convert-malformed-jsonl", "m.jsonl", '{"text": "fine"}\n{"text": "broken\n', "line 2: not JSON"),
        ("convert-jsonl-no-text", "n.jsonl", '{"body": "x"}\n', "no 'text' field"),
        ("convert-json-not-records", "n.json", "[1, 2, 3]", "no 'text' field"),
        ("convert-calib-csv", "c.csv", "text\nhello\n", "unsupported type"),
    ):
        add(id, g, [*cv, *out, "--calib", "{W}/" + name], fragment, setup=write(name, data), check=chk)
    add("convert-calib-missing", g, [*cv, *out, "--calib", "{W}/none.txt"], "calibration file not found", check=chk)
    name = "s.txt"
    add("convert-calib-too-short", g, [*cv, *out, "--calib", "{W}/" + name], "calibration text too short",
        setup=write(name, "Too little text."), check=chk)  # fmt: skip
    add("convert-out-under-file", g, [*cv, "--out", "{W}/f/sub"], "is not a directory", setup=write("f", "x"))
    add("convert-out-is-file", g, [*cv, "--out", "{W}/f"], "exists and is not a directory", setup=write("f", "x"))
    add(
        "convert-out-exists",
        g,
        [*cv, "--out", "{W}/o"],
        "exists (pass --overwrite",
        setup=write("o/keep.txt", "x"),
        check=still_there("o/keep.txt", "x"),
    )
    add(
        "convert-overwrite-non-artifact",
        g,
        [*cv, "--out", "{W}/o", "--overwrite"],
        "not a TALE artifact",
        setup=write("o/keep.txt", "x"),
        check=still_there("o/keep.txt", "x"),
    )
    add("convert-out-in-proc", g, [*cv, "--out", "/proc/tale-out"], "/proc is not writable")
    add("convert-device-mps", g, [*cv, *out, "--device", "mps"], "--device mps: not supported", check=chk)
    add("convert-device-cuda", g, [*cv, *out, "--device", "cuda"], "CUDA is not available", check=chk)
    add("convert-samples-0", g, [*cv, *out, "--samples", "0"], "--samples must be >= 1", check=chk)
    add("convert-seq-len-1", g, [*cv, *out, "--seq-len", "1"], "--seq-len must be >= 2", check=chk)
    add("convert-value-group-0", g, [*cv, *out, "--value-group", "0"], "--value-group must be >= 1", check=chk)
    add("convert-bits-5", g, [*cv, *out, "--bits", "5,4"], "bits must be one of", check=chk)
    add("convert-bits-not-number", g, [*cv, *out, "--bits", "2,x"], "--bits '2,x'", check=chk)
    add("convert-recent-count", g, [*cv, *out, "--recent", "0.1,0.2"], "2 level(s)", check=chk)
    add("convert-dtype-int8", g, [*cv, *out, "--dtype", "int8"], "unknown --dtype", check=chk)
    add("convert-shard-size", g, [*cv, *out, "--shard-size", "lots"], "bad size", check=chk)
    add("convert-policy", g, [*cv, *out, "--policy", "magic"], "unknown --policy", check=chk)
    add("convert-energy-0", g, [*cv, *out, "--energy", "0"], "--energy must be", check=chk)
    add("convert-r0-0", g, [*cv, *out, "--r0", "0"], "--r0 must be", check=chk)
    add("convert-one-level-recent", g, [*cv, *out, "--bits", "4"], "(--recent= for none)", check=chk)
    add("convert-one-level", g, [*cv, *out, "--bits", "4", "--recent="], "nominal ratio", expect="accept")
    add(
        "convert-read-only-fs",
        g,
        ["sh", "-c", 'mount -t tmpfs -o ro,size=1m tmpfs {W}/ro && exec "$@"', "sh", *cv, "--out", "{W}/ro/tale"],
        "is not writable (Read-only file system)",
        root_only=True,
        setup=lambda w: (w / "ro").mkdir(),
    )
    add(
        "convert-full-disk",
        g,
        [
            "sh",
            "-c",
            'mount -t tmpfs -o size=256k tmpfs {W}/small && "$@"; rc=$?; ls -A {W}/small > {W}/left.txt; exit $rc',
            "sh",
            *cv,
            "--out",
            "{W}/small/tale",
        ],
        "no space left on the device",
        root_only=True,
        setup=lambda w: (w / "small").mkdir(),
        check=left_file_empty,
    )
    vol = ["sh", "-c", 'mount -t tmpfs -o {OPT} tmpfs {W}/vol && exec "$@"', "sh", *cv, "--out", "{W}/vol"]
    add(  # a volume (docker run -v): written in place, it cannot be renamed
        "convert-out-mount-point",
        g,
        [a.replace("{OPT}", "size=64m") for a in vol] + ["--overwrite"],
        "nominal ratio",
        expect="accept",
        root_only=True,
        setup=lambda w: (w / "vol").mkdir(),
    )
    add(
        "convert-out-read-only-mount-point",
        g,
        [a.replace("{OPT}", "ro,size=1m") for a in vol] + ["--overwrite"],
        "a mount point that is not writable",
        root_only=True,
        setup=lambda w: (w / "vol").mkdir(),
    )

    # signals during a conversion (the slow model): SIGTERM like Ctrl-C, SIGKILL then --resume
    g = "signals"
    sig = ["tale-convert", "{SIG}", *SIG_ARGS, "--out", "{W}/out"]
    add(
        "sigterm-before-any-layer",
        g,
        sig,
        "interrupted (SIGTERM)",
        expect="interrupt",
        signal_when=tmp_exists,
        check=tmp_state(False),
    )
    add(
        "sigterm-after-2-layers",
        g,
        sig,
        "rerun with --resume",
        expect="interrupt",
        signal_when=lambda w: partial_layers(w) >= 2,
        check=tmp_state(True),
    )
    add(
        "sigint-after-2-layers",
        g,
        sig,
        "rerun with --resume",
        expect="interrupt",
        sig=signal.SIGINT,
        signal_when=lambda w: partial_layers(w) >= 2,
        check=tmp_state(True),
    )
    add(
        "sighup-before-any-layer",
        g,
        sig,
        "interrupted (SIGHUP)",
        expect="interrupt",
        sig=signal.SIGHUP,
        signal_when=tmp_exists,
        check=tmp_state(False),
    )
    add(
        "sigkill-after-2-layers",
        g,
        sig,
        "",
        expect="interrupt",
        sig=signal.SIGKILL,
        signal_when=lambda w: partial_layers(w) >= 2,
        check=tmp_state(True),
    )

    # tale-eval: checked before the evaluation runs
    g = "tale-eval input"
    add("eval-json-missing-dir", g, [*ev, "--json", "{W}/no/such/dir/r.json"], "does not exist")
    add("eval-json-is-dir", g, [*ev, "--json", "{W}"], "is a directory")
    add("eval-json-in-proc", g, [*ev, "--json", "/proc/tale.json"], "not writable")
    add("eval-json-dev-full", g, [*ev, "--json", "/dev/full"], "no space left on the device", logs=True)
    add("eval-device-mps", g, [*ev, "--device", "mps"], "--device mps: not supported")
    add("eval-ctx-0", g, [*ev, "--ctx", "0"], "--ctx must be >= 1")
    add("eval-prefill-ge-ctx", g, [*ev, "--prefill", "32"], "must be smaller than --ctx")
    add("eval-threads-0", g, [*ev, "--threads", "0"], "--threads must be >= 1")
    add("eval-preset", g, [*ev, "--preset", "huge"], "unknown --preset")
    add("eval-policy", g, [*ev, "--policies", "full,magic"], "unknown policy 'magic'")
    add("eval-rank-policy", g, [*ev, "--rank-policies", "magic"], "unknown rank policy")
    add("eval-dtype", g, [*ev, "--dtype", "fp16"], "--dtype must be bf16 or fp32")
    add("eval-energy-0", g, [*ev, "--energy", "0"], "--energy must be")
    add("eval-passkey-depth", g, [*ev, "--passkey-lengths", "1k", "--passkey-depths", "0.55"], "no pass-key samples")
    add("eval-ctx-too-long", g, [*ev, "--ctx", "100000"], "0 windows of 100000")
    add("eval-missing-artifact", g, ["tale-eval", "{W}/none"], "no such artifact directory")

    # tale-push: everything checked locally, nothing printed before the error, local files never rewritten
    g = "tale-push"
    add("push-repo-id-no-owner", g, ["tale-push", "{ART}", "tiny"], "use 'owner/name'")
    add("push-repo-id-dots", g, ["tale-push", "{ART}", "alice/bad..name"], "invalid repo id")
    add("push-repo-id-three-parts", g, ["tale-push", "{ART}", "a/b/c"], "invalid repo id")
    add("push-missing-dir", g, ["tale-push", "{W}/none", "alice/x"], "not a directory")
    add("push-plain-dir", g, ["tale-push", "{W}", "alice/x"], "not a TALE artifact")
    add(
        "push-corrupt-shard",
        g,
        ["tale-push", "{ART}", "alice/x"],
        "checksum mismatch",
        setup=flip("model-00001-of-00001.safetensors"),
    )
    add(
        "push-stray-file",
        g,
        ["tale-push", "{ART}", "alice/x"],
        "notes.txt is not in the manifest",
        setup=write("notes.txt", "x", "art"),
    )
    add(
        "push-quality-bad-json",
        g,
        ["tale-push", "{ART}", "alice/x", "--dry-run", "--quality", "{W}/q.json"],
        "--quality",
        setup=write("q.json", "{1"),
    )
    add(
        "push-quality-missing",
        g,
        ["tale-push", "{ART}", "alice/x", "--dry-run", "--quality", "{W}/none.json"],
        "--quality",
    )
    add(
        "push-no-token",
        g,
        ["tale-push", "{ART}", "alice/x"],
        "no Hugging Face token",
        setup=save_readme,
        check=readme_unchanged,
    )
    add(
        "push-hub-unreachable",
        g,
        ["tale-push", "{ART}", "alice/x", "--token", "hf_fake"],
        "run the same command again",
        env={"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_DOWNLOAD_TIMEOUT": "2", "HF_HUB_ETAG_TIMEOUT": "2"},
        setup=save_readme,
        check=readme_unchanged,
    )
    add(
        "push-dry-run-edited-card",
        g,
        ["tale-push", "{ART}", "alice/x", "--dry-run"],
        "nothing was sent",
        expect="accept",
        setup=steps(write("README.md", "# my own notes\n", "art"), save_readme),
        check=readme_unchanged,
    )

    # low-rank keys: --preset lowrank and its key basis ({LR}: a fresh copy of a tale-convert --preset lowrank artifact;
    # setups reach it as art(w / "lr"))
    g = "low-rank keys"
    lr_run = ["tale-run", "{LR}", "--prompt", "hi", "--max-new-tokens", "2", "--dtype", "fp32"]
    add(
        "convert-lowrank-other-levels",
        g,
        [*cv, "--out", "{W}/out", "--preset", "lowrank", "--bits", "2,4", "--recent", "0.1"],
        "--preset lowrank sets its per-level key layout for 3 levels; --bits gives 2",
        check=nothing_at("out"),
    )
    add("lowrank-runs", g, lr_run, "generated 2 tok", expect="accept")
    add("lowrank-basis-deleted", g, lr_run, "key_basis.safetensors", setup=lambda w: delete(BASIS)(w / "lr"))
    add(
        "lowrank-basis-flipped",
        g,
        lr_run,
        "checksum mismatch for key_basis.safetensors",
        setup=lambda w: flip(BASIS)(w / "lr"),
    )
    add(
        "basis-copied-into-paper-artifact",
        g,
        run,
        "key_basis.safetensors is not in the manifest",
        setup=lambda w: shutil.copy(PATHS["LR"] / BASIS, art(w) / BASIS),
    )
    add(
        "lowrank-basis-narrow-rehashed",
        g,
        lr_run,
        "exceeds the key basis (4 directions)",
        setup=narrow_basis,
    )
    add(
        "eval-key-rank-without-basis",
        g,
        [
            *ev,
            "--frontier",
            "--families",
            "tale",
            "--tale-variants",
            "key_rope=pre,key_rank=16/0",
            "--frontier-out",
            "{W}/f",
        ],
        "key_rank 16 needs the artifact's key basis",
        check=nothing_at("f.md"),
    )
    add(
        "convert-key-basis-blocks-unknown",
        g,
        [*cv, "--key-basis", "--key-basis-blocks", "bogus", "--out", "{W}/out"],
        "unknown --key-basis-blocks",
        check=nothing_at("out"),
    )
    add(
        "convert-key-basis-blocks-without-basis",
        g,
        [*cv, "--key-basis-blocks", "head", "--out", "{W}/out"],
        "add --key-basis",
        check=nothing_at("out"),
    )
    add(
        "convert-key-rank-policy-unknown",
        g,
        [*cv, "--key-rank-policy", "bogus", "--out", "{W}/out"],
        "unknown --key-rank-policy",
        check=nothing_at("out"),
    )
    add(
        "convert-key-rank-policy-without-low-rank-keys",
        g,
        [*cv, "--key-rank-policy", "energy", "--out", "{W}/out"],
        "this schedule has no low-rank keys",
        check=nothing_at("out"),
    )
    add("lowrank-under-tp-without-torchrun", g, [*run[:1], "{LR}", *run[2:], "--tp", "2"], "start it with torchrun")
    return C


BASIS = "key_basis.safetensors"


def narrow_basis(w: Path) -> None:
    """The lowrank artifact's basis cut to 4 directions in every layer and re-hashed: well-formed, narrower than the
    8 coefficients per block its schedule reads."""
    from safetensors.torch import load_file, save_file

    f = art(w / "lr") / BASIS
    t = load_file(f)
    for name in list(t):
        if name.endswith("key_enc"):  # [(blocks,) dims, directions]
            t[name] = t[name][..., :4].contiguous()
        elif name.endswith("key_dec"):  # [(blocks,) directions, dims]
            t[name] = t[name][..., :4, :].contiguous()
    save_file(t, f)
    edit_manifest(lambda m: rehash(BASIS)(m, w / "lr"))(w / "lr")


# The converter's source checks.
def source_cases() -> list[Case]:
    cv = ["tale-convert"]
    chk = nothing_at("out")
    return [
        Case(
            "convert-tale-artifact-as-model",
            "tale-convert source",
            [*cv, "{ART}", *TINY_ARGS, "--out", "{W}/out"],
            fragment="TALE artifact",
            check=chk,
        ),
        Case(
            "convert-truncated-source-shard",
            "tale-convert source",
            [*cv, "{W}/m", *TINY_ARGS, "--out", "{W}/out"],
            fragment="model.safetensors",
            check=chk,
            setup=lambda w: _broken_model(w, "truncate"),
        ),
        Case(
            "convert-missing-source-tensor",
            "tale-convert source",
            [*cv, "{W}/m", *TINY_ARGS, "--out", "{W}/out"],
            fragment="missing",
            check=chk,
            setup=lambda w: _broken_model(w, "drop"),
        ),
        Case(
            "convert-seq-len-beyond-context",
            "tale-convert source",
            [*cv, "{MODEL}", *TINY_ARGS, "--seq-len", "4096", "--out", "{W}/out"],
            fragment="context",
            check=chk,
        ),
    ]


# ---- the cases of the new-user trial ---------------------------------------------------------------------------
def still_there(rel: str, text: str):
    """Data loss check: a file of the user's is still there, unchanged."""

    def f(w, p):
        q = w / rel
        return None if q.is_file() and q.read_text() == text else f"data loss: {rel} was removed or changed"

    return f


def only_there(rel: str, names: list[str]):
    def f(w, p):
        d = w / rel
        got = sorted(x.name for x in d.iterdir()) if d.is_dir() else None
        return None if got == sorted(names) else f"data loss: {rel} holds {got}, not {names}"

    return f


def artifact_ok(rel: str = "art", leftovers: bool = False):
    """Data loss check: the artifact at `rel` still verifies (nothing added to it, nothing removed)."""

    def f(w, p):
        from tale_runtime.artifact import verify_files

        try:
            verify_files(w / rel)
        except Exception as e:
            return f"data loss: {rel} no longer verifies ({e})"
        if leftovers:
            left = [x.name for x in w.iterdir() if x.name.startswith(f"{Path(rel).name}.")]
            return f"left behind: {left}" if left else None
        return None

    return f


def checks(*fns):
    def f(w, p):
        return "; ".join(m for fn in fns if (m := fn(w, p))) or None

    return f


def kept_new_artifact(w, p):
    from tale_runtime.artifact import verify_files

    kept = list(w.glob("out.new-*"))
    if len(kept) != 1:
        return f"the finished artifact was not kept beside --out: {[x.name for x in kept]}"
    verify_files(kept[0])
    return None


def make_user_dir(w: Path) -> None:
    (w / "out").mkdir()
    (w / "out" / "notes.txt").write_text("my notes\n")


def concurrent(case: Case, cmd: list[str], w: Path) -> subprocess.CompletedProcess:
    """The same conversion twice at once: the run that did not write the artifact is the one judged (refuse)."""
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(case.env))
        for _ in range(2)
    ]
    done = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    codes = sorted(c for c, _, _ in done)
    if codes == [0, 2]:
        code, out, err = next(d for d in done if d[0] == 2)
    else:  # both wrote (the silent replacement), or something else: judged as it is
        code, out, err = max(done, key=lambda d: d[0] != 0)
        err += f"\n[fault run: exit codes {codes}]"
    return subprocess.CompletedProcess(cmd, code, out, err)


def edit_template(template: str):
    def f(w):
        p = art(w) / "tokenizer_config.json"
        cfg = json.loads(p.read_text())
        cfg["chat_template"] = template
        p.write_text(json.dumps(cfg))
        (art(w) / "chat_template.jinja").unlink(missing_ok=True)
        edit_manifest(lambda m: rehash(*[x.name for x in art(w).iterdir() if x.name != "tale_config.json"])(m, w))(w)
        edit_manifest(lambda m: m["files"].pop("chat_template.jinja", None))(w)

    return f


EVAL_JSON = {
    "config": {"texts": ["dev"], "ctx": 512, "windows": 2, "prefill": 64, "dtype": "bf16", "delta_vs": "full"},
    "results": [
        {"policy": "full", "setting": "16-bit K+V", "ppl": {"dev": 12.0}, "delta_pct": {"dev": 0.0}, "ratio": 1.0},
        {"policy": "tale", "setting": "paper", "ppl": {"dev": 12.6}, "delta_pct": {"dev": 5.0}, "ratio": 5.47},
    ],
}


def same_prompt_tokens(w, p):
    """The BOM run saw the same prompt tokens as the plain prompt."""
    plain = subprocess.run(
        [str(BIN / "tale-run"), str(art(w)), "--prompt", "hello there", "--max-new-tokens", "2", "--dtype", "fp32"],
        capture_output=True,
        text=True,
        env=_env({}),
    )
    a, b = (x.split(",")[0] for x in (plain.stderr.strip().splitlines()[-1:] or [""]) + [p.stderr.strip()])
    return None if a == b and a.startswith("prompt ") else f"the BOM changed the prompt: {a!r} vs {b!r}"


def run_interrupted_cleanly(w, p):
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    if not p.stdout.endswith("\n"):
        return "the streamed text's line was not ended"
    if len(lines) < 2 or lines[-1] != "interrupted (SIGINT)" or "generated" not in lines[-2]:
        return f"no stats before the message: {lines[-2:]}"
    return None


def partial_rows(w, p):
    f = w / "r.json.partial"
    rows = f.read_text().splitlines() if f.is_file() else []
    return None if rows and not (w / "r.json").exists() else f"finished rows lost (partial: {len(rows)} rows)"


def trial_cases() -> list[Case]:
    C = []

    def add(id, group, cmd, fragment="", **kw):
        C.append(Case(id, group, cmd, fragment=fragment, **kw))

    cv = ["tale-convert", "{MODEL}", *TINY_ARGS]
    run = ["tale-run", "{ART}", "--prompt", "hi", "--max-new-tokens", "2", "--dtype", "fp32"]
    ev = ["tale-eval", "{ART}", "--dtype", "fp32", "--threads", "1", "--ctx", "32", "--windows", "1"]
    ev += ["--prefill", "8", "--passkey-lengths", "", "--policies", "full"]
    sig = ["tale-convert", "{SIG}", *SIG_ARGS, "--out", "{W}/out"]

    g = "data loss"
    add(
        "convert-two-at-once",
        g,
        [*cv, "--out", "{W}/out"],
        "",
        runner=concurrent,
        check=artifact_ok("out", leftovers=True),
    )
    add(
        "convert-dir-appears-at-out",
        g,
        sig,
        "appeared while converting",
        signal_when=tmp_exists,
        act=make_user_dir,
        check=checks(only_there("out", ["notes.txt"]), still_there("out/notes.txt", "my notes\n"), kept_new_artifact),
        slow=True,
    )
    add(
        "convert-dir-appears-at-out-overwrite",
        g,
        [*sig, "--overwrite"],
        "refusing to overwrite",
        signal_when=tmp_exists,
        act=make_user_dir,
        check=checks(only_there("out", ["notes.txt"]), still_there("out/notes.txt", "my notes\n"), kept_new_artifact),
        slow=True,
    )
    add(
        "convert-overwrite-artifact-with-user-file",
        g,
        [*cv, "--out", "{W}/art", "--overwrite"],
        "not part of the artifact (notes.txt)",
        setup=write("notes.txt", "mine", "art"),
        check=still_there("art/notes.txt", "mine"),
    )
    add(
        "convert-out-inside-artifact", g, [*cv, "--out", "{ART}/inner"], "inside the TALE artifact", check=artifact_ok()
    )
    add(
        "eval-json-inside-artifact",
        g,
        [*ev, "--json", "{ART}/eval.json"],
        "inside the TALE artifact",
        check=artifact_ok(),
    )
    add(
        "eval-frontier-out-inside-artifact",
        g,
        [*ev, "--frontier", "--frontier-out", "{ART}/frontier"],
        "inside the TALE artifact",
        check=artifact_ok(),
    )
    add(
        "eval-json-exists",
        g,
        [*ev, "--json", "{W}/r.json"],
        "exists (pass --overwrite",
        setup=write("r.json", "mine"),
        check=still_there("r.json", "mine"),
    )
    add(
        "eval-frontier-default-not-docs",
        g,
        ["sh", "-c", 'cd {W} && exec "$@"', "sh", *ev[:-2], "--frontier", "--families", "kivi", "--ctx", "64"],
        "wrote out/frontier.md",
        expect="accept",
        setup=write("docs/frontier.md", "tracked"),
        check=checks(
            still_there("docs/frontier.md", "tracked"),
            lambda w, p: None if (w / "out/frontier.md").is_file() else "no out/frontier.md",
        ),
    )
    add(
        "eval-interrupted-keeps-rows",
        g,
        [*ev[:-1], "full,kivi2,kivi4,streaming,palu,tale", "--ctx", "256", "--json", "{W}/r.json"],
        "kept in",
        expect="interrupt",
        sig=signal.SIGINT,
        signal_when=lambda w: (w / "r.json.partial").is_file() and (w / "r.json.partial").stat().st_size > 0,
        check=partial_rows,
        slow=True,
    )

    g = "internal errors"
    add("run-prompt-not-utf8", g, [*run[:2], "--prompt", os.fsdecode(b"caf\xe9"), *run[4:]], "not valid UTF-8")
    add("run-seed-65-bits", g, [*run, "--seed", str(2**64)], "--seed")
    add("convert-seed-65-bits", g, [*cv, "--out", "{W}/out", "--seed", str(2**64)], "--seed")
    add("convert-device-cpu-0", g, [*cv, "--out", "{W}/out", "--device", "cpu:0"], "nominal ratio", expect="accept")
    add(
        "run-chat-template-raises",
        g,
        run,
        "pass --raw",
        setup=edit_template("{{ raise_exception('Only user and assistant roles are supported') }}"),
    )
    add("run-chat-template-unknown-filter", g, run, "pass --raw", setup=edit_template("{{ messages | tojsonx }}"))
    add(
        "run-broken-pipe",
        g,
        ["bash", "-c", 'set -o pipefail; "$@" | head -c 1 >/dev/null', "bash", *run[:4], "--max-new-tokens", "300"]
        + ["--dtype", "fp32", "--raw", "--temperature", "1"],
        expect="quiet",
    )
    add("run-stdout-closed", g, ["bash", "-c", 'exec "$@" >&-', "bash", *run], "standard output is closed")
    add(
        "push-binary-readme",
        g,
        ["tale-push", "{ART}", "alice/x", "--dry-run"],
        "README.md: not UTF-8 text",
        setup=write("README.md", b"\x89PNG\r\n\x1a\n\x00\xff", "art"),
    )

    g = "accepted silently before"
    add("run-temperature-inf", g, [*run, "--temperature", "inf"], "--temperature must be a finite number")
    add("run-temperature-nan", g, [*run, "--temperature", "nan"], "--temperature")
    add("run-temperature-negative", g, [*run, "--temperature", "-1"], "--temperature")
    add("run-sinks-beyond-context", g, [*run, "--sinks", "512"], "nothing would be compressed")
    add("run-residual-beyond-context", g, [*run, "--residual", "1024"], "nothing would be compressed")
    add("run-recent-nan", g, [*run, "--recent", "nan"], "recent share nan is not a number")
    add("run-stop-unknown-escape", g, [*run, "--stop", "a\\q"], "--stop: unknown escape")
    add("run-threads-0", g, [*run, "--threads", "0"], "--threads must be >= 1")
    add(
        "run-ascii-stdout",
        g,
        [*run[:3], "fête", *run[4:]],
        "measured",
        expect="accept",
        env={"PYTHONIOENCODING": "ascii"},
    )
    add(
        "eval-lm-eval-offline",
        g,
        ["tale-eval", "{ART}", "--lm-eval", "hellaswag", "--limit", "2", "--lm-eval-out", "{W}/res"],
        "is not in the local datasets cache",
        env={"HF_HUB_OFFLINE": "1"},
    )
    add("run-sinks-cover-the-run", g, [*run, "--sinks", "100"], "nothing is compressed", expect="accept")
    add(
        "run-prompt-file-bom",
        g,
        [*run[:2], "--prompt-file", "{W}/p.txt", *run[4:]],
        "prompt",
        expect="accept",
        setup=write("p.txt", b"\xef\xbb\xbfhello there"),
        check=same_prompt_tokens,
    )
    add("run-cuda-flags-on-cpu", g, [*run, "--device", "cpu", "--dynamic"], "note: --dynamic", expect="accept")
    add("convert-out-empty", g, [*cv, "--out", ""], "--out is empty", check=lambda w, p: None)
    add("convert-sinks-beyond-context", g, [*cv, "--out", "{W}/out", "--sinks", "600"], "nothing would be compressed")
    add(
        "convert-few-calibration-tokens",
        g,
        [*cv, "--out", "{W}/out", "--samples", "1"],
        "warning: only 64 calibration tokens for hidden size 128",
        expect="accept",
    )
    add("push-revision-invalid", g, ["tale-push", "{ART}", "alice/x", "--revision", "bad..name"], "invalid --revision")
    add("push-revision-space", g, ["tale-push", "{ART}", "alice/x", "--revision", "my branch"], "invalid --revision")
    add("eval-text-empty", g, [*ev, "--text", ""], "--text is empty")
    add("eval-policies-empty", g, [*ev[:-2], "--policies", ""], "--policies is empty")
    add(
        "push-quality-eval-json",
        g,
        ["tale-push", "{ART}", "alice/x", "--dry-run", "--quality", "{W}/q.json"],
        "## Measured with tale-eval",
        expect="accept",
        setup=write("q.json", json.dumps(EVAL_JSON)),
        check=lambda w, p: (
            "config keys on the card"
            if "| config." in p.stdout or "| tale (paper) | 12.600 (+5.00%) | 5.47x |" not in p.stdout
            else None
        ),
    )
    add(
        "push-quality-nan",
        g,
        ["tale-push", "{ART}", "alice/x", "--dry-run", "--quality", "{W}/q.json"],
        "results[1].ppl.dev is nan",
        setup=write("q.json", json.dumps(EVAL_JSON).replace("12.6", "NaN")),
    )

    g = "misleading messages before"
    add("run-device-cpu-0", g, [*run, "--device", "cpu:0"], "generated", expect="accept")
    add("convert-calib-dir", g, [*cv, "--out", "{W}/out", "--calib", "{W}"], "is a directory; give the files")

    g = "interrupts"
    add(
        "run-sigint-mid-generation",
        g,
        [*run[:4], "--max-new-tokens", "400", "--dtype", "fp32", "--raw"],
        "(interrupted)",
        expect="interrupt",
        sig=signal.SIGINT,
        signal_when=lambda w: (w / "stdout.txt").is_file() and (w / "stdout.txt").stat().st_size > 0,
        check=run_interrupted_cleanly,
    )
    return C


def _broken_model(w: Path, how: str):
    from safetensors.torch import load_file, save_file

    m = shutil.copytree(PATHS["MODEL"], w / "m")
    f = m / "model.safetensors"
    if how == "truncate":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    else:
        t = load_file(f)
        t.pop(next(k for k in t if "v_proj" in k))
        save_file(t, f, metadata={"format": "pt"})


# ---- running --------------------------------------------------------------------------------------------------
PATHS: dict[str, Path] = {}


def all_cases() -> list[Case]:
    return cases() + source_cases() + trial_cases()


def build(work: Path) -> None:
    """The tiny checkpoint (tests/conftest.py), its artifact (through tale-convert) and the slow model."""
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import TINY, save_tiny, tiny_tokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    tok = tiny_tokenizer()
    PATHS["MODEL"] = save_tiny(work / "model", "llama", tok)
    TINY["sig"] = dict(
        model_type="llama",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=16,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
    )
    PATHS["SIG"] = save_tiny(work / "sig", "sig", tok)
    PATHS["ART"], PATHS["LR"] = work / "art", work / "lr"
    for out, extra in ((PATHS["ART"], []), (PATHS["LR"], ["--preset", "lowrank"])):
        p = subprocess.run(
            [str(BIN / "tale-convert"), str(PATHS["MODEL"]), *TINY_ARGS, *extra, "--out", str(out)],
            capture_output=True,
            text=True,
            env=_env({}),
        )
        if p.returncode:
            sys.exit(f"fault run: could not build the tiny artifact {out.name}: {p.stderr}")


def _env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TALE_DEBUG"))}
    home = Path(tempfile.gettempdir()) / "tale-fault-hf"
    env.update(
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_HOME=str(home),
        HF_HUB_DISABLE_TELEMETRY="1",
        PATH=f"{BIN}:{env.get('PATH', '')}",
        COLUMNS="200",
        NO_COLOR="1",
    )
    env.update(extra)
    if "HF_ENDPOINT" in extra:
        env.pop("HF_HUB_OFFLINE")
    return env


def run_case(case: Case, work: Path) -> dict:
    w = work / case.id
    w.mkdir()
    shutil.copytree(PATHS["ART"], w / "art")
    if any("{LR}" in a for a in case.cmd):
        shutil.copytree(PATHS["LR"], art(w / "lr"))
    subst = {"{W}": str(w), "{MODEL}": str(PATHS["MODEL"]), "{ART}": str(w / "art"), "{SIG}": str(PATHS["SIG"])}
    subst["{LR}"] = str(art(w / "lr"))

    def fill(s: str) -> str:
        for k, v in subst.items():
            s = s.replace(k, v)
        return s

    if case.setup:
        case.setup(w)
    cmd = [fill(a) for a in case.cmd]
    if case.root_only:
        cmd = ["unshare", "-m", "--propagation", "private", *cmd]
    t = time.perf_counter()
    if case.runner:
        p = case.runner(case, cmd, w)
    elif case.signal_when:
        # a background job inherits SIGINT ignored (and Python then keeps it so): give the case a terminal's default.
        # Output goes to files, which the condition may watch (tale-run: the first streamed text).
        with open(w / "stdout.txt", "w") as fo, open(w / "stderr.txt", "w") as fe:
            proc = subprocess.Popen(
                cmd,
                stdout=fo,
                stderr=fe,
                text=True,
                env=_env(case.env),
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )
            deadline = time.time() + 300
            while proc.poll() is None and not case.signal_when(w) and time.time() < deadline:
                time.sleep(0.02)
            sent = proc.poll() is None
            if sent:
                case.act(w) if case.act else proc.send_signal(case.sig)
            try:
                proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        p = subprocess.CompletedProcess(
            cmd, proc.returncode, (w / "stdout.txt").read_text(), (w / "stderr.txt").read_text()
        )
        if not sent:
            p.stderr += "\n[fault run: the process ended before the signal could be sent]"
    else:
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, env=_env(case.env), timeout=300)
        except subprocess.TimeoutExpired:
            p = subprocess.CompletedProcess(cmd, 124, "", "[fault run: timed out after 300 s]")
    seconds = time.perf_counter() - t
    return judge(case, p, w, seconds)


def judge(case: Case, p: subprocess.CompletedProcess, w: Path, seconds: float) -> dict:
    err = p.stderr.strip("\n")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    problems = []
    if "Traceback" in p.stderr + p.stdout:
        problems.append("traceback")
    if "internal error" in p.stderr:
        problems.append("internal error")
    if case.expect == "refuse":
        if p.returncode == 0:
            problems.append("silent accept")
        elif p.returncode != 2:
            problems.append(f"exit {p.returncode}")
        if case.logs:
            lines = lines[-1:] if any(ln.startswith("error: ") for ln in lines[:-1]) is False else lines
        if len(lines) != 1 or not lines[0].startswith("error: "):
            problems.append(f"{len(lines)} stderr lines")
        elif case.fragment not in lines[0]:
            problems.append(f"message lacks {case.fragment!r}")
    elif case.expect == "accept":
        if p.returncode != 0:
            problems.append(f"exit {p.returncode}")
        elif case.fragment and case.fragment not in p.stdout + p.stderr:
            problems.append(f"output lacks {case.fragment!r}")
    elif case.expect == "quiet":  # a broken pipe: like `cat`, nothing to say about it
        if p.returncode not in (0, 128 + signal.SIGPIPE):
            problems.append(f"exit {p.returncode}")
        if lines:
            problems.append(f"{len(lines)} stderr lines")
    else:  # interrupt
        want = 128 + case.sig if case.sig != signal.SIGKILL else -signal.SIGKILL
        if p.returncode != want:
            problems.append(f"exit {p.returncode}, expected {want}")
        if case.fragment and case.fragment not in p.stdout + p.stderr:
            problems.append(f"output lacks {case.fragment!r}")
    if case.check and (msg := case.check(w, p)):
        problems.append(msg)
    message = lines[-1] if lines else ""
    if case.expect == "accept" and p.returncode == 0:  # the line that shows it worked
        message = next((ln for ln in (p.stdout + p.stderr).splitlines() if case.fragment in ln), message)
    if case.expect == "interrupt":
        out = " ".join(p.stdout.split())
        message = " / ".join(x for x in (message, out[out.find("interrupted") :] if "interrupted:" in out else "") if x)
    return {
        "id": case.id,
        "group": case.group,
        "cmd": p.args,
        "code": p.returncode,
        "message": message,
        "expect": case.expect,
        "problems": problems,
        "seconds": seconds,
    }


def resume_after_kill(work: Path) -> dict:
    """After SIGKILL the temp dir stays (nothing can clean up); --resume must reuse its finished layers."""
    w = work / "sigkill-after-2-layers"
    cmd = [str(BIN / "tale-convert"), str(PATHS["SIG"]), *SIG_ARGS, "--out", str(w / "out"), "--resume"]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env({}))
    r = judge(
        Case(
            "resume-after-sigkill",
            "signals",
            [],
            expect="accept",
            fragment="(reused)",
            check=lambda w, p: None if (w / "out" / "tale_config.json").is_file() else "no artifact",
        ),
        p,
        w,
        time.perf_counter() - t,
    )
    r["message"] = f"{p.stdout.count('(reused)')} layers reused; " + (p.stdout.strip().splitlines() or [""])[-1]
    return r


def paths(s: str, work: Path) -> str:
    import re

    for key, name in (("MODEL", "$MODEL"), ("SIG", "$SLOW_MODEL")):  # whole path names only (not $W/sigterm-...)
        s = re.sub(re.escape(str(PATHS[key])) + r"(?![\w.-])", name, s)
    return s.replace(str(work), "$W").replace(str(BIN) + "/", "")


def shorten(args: list[str], work: Path) -> str:
    import shlex

    s = paths(" ".join(shlex.quote(a) if a else "''" for a in args), work)
    s = s.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")  # argv bytes that are not UTF-8
    for a in (" ".join(TINY_ARGS), " ".join(SIG_ARGS)):
        s = s.replace(a, "$TINY_OPTS")
    if len(s) > 200:
        s = s[:200] + " ..."
    return s


def write_doc(
    rows: list[dict],
    work: Path,
    path: Path,
    skipped: list[str],
    wall: float,
    not_run: list[str] = (),
    rerun: list[str] = (),
) -> dict:
    def count(kind):
        return sum(any(p == kind or p.startswith(kind) for p in r["problems"]) for r in rows)

    summary = {
        "cases": len(rows),
        "tracebacks": count("traceback"),
        "internal errors": count("internal error"),
        "silent accepts": count("silent accept"),
        "multi-line refusals": count_multi(rows),
        "wrong exit codes": count("exit"),
        "data loss": count("data loss"),
        "failed checks": sum(bool(r["problems"]) for r in rows),
    }
    line = ", ".join(f"{k} {v}" for k, v in summary.items())
    esc = lambda s: s.replace("|", "\\|").replace("\n", " ")  # noqa: E731
    out = [
        "# Errors and faults",
        "",
        "What the four CLIs (`tale-convert`, `tale-run`, `tale-push`, `tale-eval`) answer when something is wrong.",
        "",
        "## The contract",
        "",
        "- Anything a user can cause (bad options, unreadable or empty or binary files, a corrupt or edited",
        "  artifact, an unwritable or full disk, a missing device) ends in **one line** `error: ...` on stderr",
        "  naming the problem, and exit code **2**. Usage errors too (click's boxes are folded into one line).",
        "- A bug ends in one line `error: internal error: TYPE: message (set TALE_DEBUG=1 for the traceback)`,",
        "  exit code 1. `TALE_DEBUG=1` shows the traceback of any error instead.",
        "- SIGTERM and SIGHUP (timeout, kill, docker stop, Slurm) are handled like Ctrl-C: clean-up runs, then",
        "  `interrupted (SIGTERM)` and exit code 128 + signal (143). An interrupted conversion removes its temp",
        "  directory, or keeps its finished layers for `--resume` and says so. After SIGKILL nothing can clean up:",
        "  the temp directory `OUT.tmp-PID` stays, and `--resume` reuses it.",
        "- Checked before any work: the place to write (`--out`, `--json`), the device (`cpu`, `cuda`, `cuda:N`;",
        "  `mps` and others are refused), option ranges and consistency, prompt and calibration files.",
        "- Nothing half-written: a failed conversion leaves nothing at `--out`; `tale-push` never writes local",
        "  files (the card and its checksum go to the Hub from memory) and prints nothing before its error.",
        "- Nothing removed that the tool did not create, no artifact made unusable: `tale-convert` holds",
        "  `OUT.lock` (flock, with its pid) while it writes `--out`, so a second conversion to the same `--out` is",
        "  refused in one line; it publishes with a rename that never replaces anything (a directory that appeared",
        "  at `--out` meanwhile is left as it was, the new artifact kept beside it as `OUT.new-PID`), and",
        "  `--overwrite` replaces only an empty directory or a TALE artifact holding nothing but its own files.",
        "  `tale-eval --json` / `--frontier-out` are refused inside an artifact, and replace an existing file only",
        "  with `--overwrite`; the frontier goes to `out/frontier.md` under the current directory by default.",
        "- Nothing wrong accepted silently: non-finite or negative sampling values, seeds past 64 bits, sinks or",
        "  residuals covering the whole context, empty `--out` / `--text` / `--policies`, invalid branch names, NaN",
        "  figures for the card are refused; fewer calibration tokens than the hidden size get a warning, CUDA-only",
        "  flags on the CPU and runs whose sinks cover every token a note; a byte-order mark is not prompt text.",
        "- Interrupts keep what is finished: `tale-run` ends the streamed line and prints the stats of what it",
        "  generated before `interrupted (SIGINT)`; `tale-eval` appends each finished row to `FILE.partial`.",
        "  A broken pipe (`| head`) ends quietly with the status of SIGPIPE (141); a closed stdout is refused.",
        "",
        "The console layer is `runtime/console.py`, module `tale_runtime.console` (`run_app`, `UserError`, `device`, `read_text`,",
        "`writable_dir`, `writable_file`); the artifact checks are `tale_runtime.artifact.hash_files` and",
        "`verify_files` (docs/artifact.md): the manifest hashes every file of the artifact but itself, the loader",
        "refuses any file not listed, and reads only the shards the verified index names.",
        "",
        "## Fault run",
        "",
        "```bash",
        DOC_COMMAND,
        "```",
        "",
        f"**{line}** ({sum(r['seconds'] for r in rows) / 60:.0f} min of subprocesses on a shared, busy 2-core CPU "
        "machine, one per case, through the",
        "installed console scripts; `$MODEL` is a tiny random Llama, `$W` the case's directory holding a fresh",
        "copy of its tale-convert artifact `$W/art`, `$SLOW_MODEL` a 16-layer random Llama that converts in",
        "about 15 s, `$TINY_OPTS` the small converter settings of the tests).",
        "",
    ]
    if skipped:
        out += [f"Skipped (need root for `unshare -m`): {', '.join(skipped)}.", ""]
    if rerun:
        out += [
            f"{len(rows) - len(rerun)} rows are from one full run; {len(rerun)} failed there and are from a re-run "
            f"(`--rerun-failed`) after the fix of the harness or of the expected fragment: {', '.join(rerun)}.",
            "",
        ]
    if not_run:
        out += [f"Not run this time ({len(not_run)}, the run was cut short): {', '.join(not_run)}.", ""]
    for group in dict.fromkeys(r["group"] for r in rows):
        out += [f"### {group}", "", "| case | command | exit | message | verdict |", "|---|---|---|---|---|"]
        for r in (r for r in rows if r["group"] == group):
            code = r["code"] if r["code"] >= 0 else f"{r['code']} ({signal.Signals(-r['code']).name})"
            verdict = "; ".join(r["problems"]) or "ok"
            out.append(
                f"| {r['id']} | `{esc(shorten(r['cmd'], work))}` | {code} | {esc(paths(r['message'], work))} | {verdict} |"
            )
        out.append("")
    path.write_text("\n".join(out))
    return summary


def count_multi(rows):
    return sum(any(p.endswith("stderr lines") for p in r["problems"]) for r in rows)


def doc_only(args) -> None:
    rows, seen = {}, []
    for line in args.rows.read_text().splitlines():
        r = json.loads(line)
        seen.append(r["id"])
        rows[r["id"]] = r
    first = next(iter(rows.values()))
    work = Path(first["work"])
    PATHS.update(MODEL=work / "model", SIG=work / "sig", ART=work / "art")
    order = [c.id for c in all_cases()]
    order = (
        order[: order.index("sigkill-after-2-layers") + 1]
        + ["resume-after-sigkill"]
        + order[order.index("sigkill-after-2-layers") + 1 :]
    )
    done = [rows[i] for i in order if i in rows]
    for r in done:  # rows of a re-run lived in another work dir
        r["cmd"] = [a.replace(r["work"], str(work)) for a in r["cmd"]]
        r["message"] = r["message"].replace(r["work"], str(work))
    missing = [c.id for c in all_cases() if c.id not in rows]
    rerun = sorted({i for i in seen if seen.count(i) > 1})
    summary = write_doc(done, work, args.out, [], 0.0, not_run=missing, rerun=rerun)
    print(", ".join(f"{k} {v}" for k, v in summary.items()), f"(not run: {len(missing)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "errors.md")
    ap.add_argument("--only", default=None, help="run the cases whose id contains this (no doc written)")
    ap.add_argument(
        "--rows",
        type=Path,
        default=Path(tempfile.gettempdir()) / "tale-fault-rows.jsonl",
        help="every row is appended here as it is measured",
    )
    ap.add_argument(
        "--rerun-failed",
        action="store_true",
        help="keep the passing rows of --rows, run only the failed or missing cases, rewrite the doc",
    )
    ap.add_argument("--jobs", type=int, default=1, help="cases run at once (each is a subprocess)")
    ap.add_argument(
        "--doc-only",
        action="store_true",
        help="write the doc from the rows recorded in --rows (of the last run), running nothing",
    )
    args = ap.parse_args()
    if args.doc_only:
        return doc_only(args)
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="tale-fault-"))
    try:
        build(work)
        todo = all_cases()
        if args.only:
            todo = [c for c in todo if args.only in c.id]
        root = os.geteuid() == 0 and shutil.which("unshare")
        skipped = [c.id for c in todo if c.root_only and not root]
        kept = {}
        if args.rerun_failed and args.rows.is_file():
            for line in args.rows.read_text().splitlines():
                r = json.loads(line)
                r["cmd"] = [a.replace(r["work"], str(work)).replace(r["bin"], str(BIN)) for a in r["cmd"]]
                r["message"] = r["message"].replace(r["work"], str(work))
                kept[r["id"]] = r
            kept = {k: r for k, r in kept.items() if not r["problems"]}
        elif not args.only:
            args.rows.unlink(missing_ok=True)
        import threading
        from concurrent.futures import ThreadPoolExecutor

        lock = threading.Lock()

        def one(c: Case) -> list[dict]:
            if c.id in kept and (c.id != "sigkill-after-2-layers" or "resume-after-sigkill" in kept):
                return [kept[c.id]] + ([kept["resume-after-sigkill"]] if c.id == "sigkill-after-2-layers" else [])
            new = [run_case(c, work)]
            if c.id == "sigkill-after-2-layers":
                new.append(resume_after_kill(work))
            with lock:
                for r in new:
                    with open(args.rows, "a") as f:
                        f.write(json.dumps({**r, "work": str(work), "bin": str(BIN)}) + "\n")
                    print(
                        f"{r['id']:40s} exit {r['code']:4d} {r['seconds']:5.1f}s {'; '.join(r['problems']) or 'ok'}"
                        f"  | {paths(r['message'], work)[:110]}",
                        flush=True,
                    )
            return new

        with ThreadPoolExecutor(max(1, args.jobs)) as pool:  # independent subprocesses, each in its own dir
            rows = [r for new in pool.map(one, [c for c in todo if c.id not in skipped]) for r in new]
        if args.only:
            return
        reused = sum(r in kept.values() for r in rows)
        if reused:
            print(f"{reused} passing rows reused from {args.rows}")
        summary = write_doc(rows, work, args.out, skipped, time.perf_counter() - t0)
        print(", ".join(f"{k} {v}" for k, v in summary.items()))
        print(f"wrote {args.out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
