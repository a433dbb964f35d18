"""The error contract of the four CLIs (docs/errors.md), as one table of bad inputs.

Every case runs a console-script entry point in-process and must end with exit code 2 and exactly one
stderr line `error: ...` containing its fragment: no traceback, no "internal error", nothing on stdout
before it, nothing left at --out. Fast: a tiny random checkpoint and its real tale-convert artifact.
The fault run (tests/faults.py, tests/test_faults.py, `make errors`) runs a larger table through the installed
scripts.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import TINY_OPTS
from hub_helpers import convert_tiny
from tale_helpers import invoke

import tale_convert.cli as convert_cli
import tale_convert.push as push_cli
import tale_eval.cli as eval_cli
import tale_runtime.cli as run_cli
from tale_runtime import console
from tale_runtime.artifact import MANIFEST, hash_files, verify_files, write_json

MAINS = {"convert": convert_cli.main, "run": run_cli.main, "push": push_cli.main, "eval": eval_cli.main}
TINY_ARGS = [a for k, v in TINY_OPTS.items() for a in (f"--{k.replace('_', '-')}", str(v))] + ["--group", "2"]


@pytest.fixture(scope="module")
def built(tiny_model_dir, tmp_path_factory):
    return convert_tiny(tiny_model_dir("llama"), tmp_path_factory.mktemp("errors") / "art")


@dataclass
class Ctx:
    tmp: Path
    model: Path  # the tiny checkpoint
    art: Path  # a fresh copy of its artifact, free to break
    out: Path  # where a conversion would write

    def file(self, name: str, data: bytes | str) -> Path:
        p = self.tmp / name
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
        return p


def edit_manifest(ctx, fn):
    m = json.loads((ctx.art / MANIFEST).read_text())
    fn(m)
    write_json(ctx.art / MANIFEST, m)


def on_run(setup, fragment):
    """A broken artifact case: `setup` breaks it, a plain tale-run must fail naming `fragment`."""
    return "run", setup, lambda c: [c.art, "-p", "hi"], fragment


def edit_json(ctx, name, fn):
    p = ctx.art / name
    d = json.loads(p.read_text())
    fn(d)
    p.write_text(json.dumps(d))


def extra_shard(ctx):
    """An index naming a second shard that is not in the manifest (the old bypass: loaded unverified)."""
    shutil.copy(ctx.art / "model-00001-of-00001.safetensors", ctx.art / "model-00002-of-00002.safetensors")
    edit_json(
        ctx,
        "model.safetensors.index.json",
        lambda d: d["weight_map"].update({"lm_head.weight": "model-00002-of-00002.safetensors"}),
    )
    edit_manifest(
        ctx,
        lambda m: m["files"].__setitem__(
            "model.safetensors.index.json", hash_files(ctx.art)["model.safetensors.index.json"]
        ),
    )


def index_to_unlisted(ctx):
    """The same with the extra shard hidden from the listing: the loader must still not read it."""
    shutil.copy(ctx.art / "model-00001-of-00001.safetensors", ctx.art / ".shadow.safetensors")
    edit_json(
        ctx, "model.safetensors.index.json", lambda d: d["weight_map"].update({"lm_head.weight": ".shadow.safetensors"})
    )
    edit_manifest(
        ctx,
        lambda m: m["files"].__setitem__(
            "model.safetensors.index.json", hash_files(ctx.art)["model.safetensors.index.json"]
        ),
    )


def flip_byte(path: Path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


# id: (cli, setup(ctx) -> None, argv(ctx) -> list, fragment). The registry of bad inputs, by class.
CASES = {
    # --- usage errors: one line instead of click's box
    "convert-unknown-option": ("convert", None, lambda c: [c.model, "--out", c.out, "--bogus"], "No such option"),
    "convert-missing-out": ("convert", None, lambda c: [c.model], "Missing option '--out'"),
    "convert-not-an-int": (
        "convert",
        None,
        lambda c: [c.model, "--out", c.out, "--samples", "many"],
        "Invalid value for '--samples'",
    ),
    "run-missing-arg": ("run", None, lambda c: [], "Missing argument"),
    "run-not-a-float": (
        "run",
        None,
        lambda c: [c.art, "-p", "hi", "--temperature", "hot"],
        "Invalid value for '--temperature'",
    ),
    "run-top-p-range": ("run", None, lambda c: [c.art, "-p", "hi", "--top-p", "2"], "--top-p"),
    "push-missing-repo": ("push", None, lambda c: [c.art], "Missing argument 'REPO_ID'"),
    "eval-unknown-option": ("eval", None, lambda c: [c.art, "--nope"], "No such option"),
    # --- tale-run: bad prompts and options
    "run-binary-prompt": (
        "run",
        None,
        lambda c: [c.art, "--prompt-file", c.file("p.bin", b"\x00\xff\x10abc")],
        "binary file",
    ),
    "run-not-utf8-prompt": ("run", None, lambda c: [c.art, "--prompt-file", c.file("p.txt", b"caf\xe9")], "not UTF-8"),
    "run-empty-prompt-file": ("run", None, lambda c: [c.art, "--prompt-file", c.file("p.txt", " \n")], "empty"),
    "run-prompt-file-is-dir": ("run", None, lambda c: [c.art, "--prompt-file", c.tmp], "not a file"),
    "run-device-mps": ("run", None, lambda c: [c.art, "-p", "hi", "--device", "mps"], "--device mps: not supported"),
    "run-device-unknown": ("run", None, lambda c: [c.art, "-p", "hi", "--device", "gpu0"], "unknown device"),
    "run-value-group-0": (
        "run",
        None,
        lambda c: [c.art, "-p", "hi", "--value-group", "0"],
        "--value-group must be >= 1",
    ),
    "run-value-group-0-ranks": (
        "run",
        None,
        lambda c: [c.art, "-p", "hi", "--value-group", "0", "--ranks", "0.5"],
        "--value-group must be >= 1",
    ),
    "run-key-group-0": ("run", None, lambda c: [c.art, "-p", "hi", "--key-group", "0"], "--key-group must be >= 1"),
    "run-sinks-negative": ("run", None, lambda c: [c.art, "-p", "hi", "--sinks", "-1"], "--sinks must be >= 0"),
    # --- artifact integrity: every file hashed, only verified files read
    "run-deleted-tokenizer": on_run(lambda c: (c.art / "tokenizer.json").unlink(), "tokenizer.json is missing"),
    "run-edited-rope-theta": on_run(
        lambda c: edit_json(c, "config.json", lambda d: d.update(rope_theta=1.0)), "checksum mismatch for config.json"
    ),
    "run-edited-chat-template": on_run(
        lambda c: edit_json(c, "tokenizer_config.json", lambda d: d.update(model_max_length=7)),
        "checksum mismatch for tokenizer_config.json",
    ),
    "run-edited-generation-config": on_run(
        lambda c: edit_json(c, "generation_config.json", lambda d: d.update(eos_token_id=3)),
        "checksum mismatch for generation_config.json",
    ),
    "run-edited-readme": on_run(
        lambda c: (c.art / "README.md").write_text("# mine\n"), "checksum mismatch for README.md"
    ),
    "run-corrupt-shard": on_run(
        lambda c: flip_byte(c.art / "model-00001-of-00001.safetensors"),
        "checksum mismatch for model-00001-of-00001.safetensors",
    ),
    "run-index-extra-shard": on_run(extra_shard, "model-00002-of-00002.safetensors is not in the manifest"),
    "run-index-hidden-shard": on_run(index_to_unlisted, "which the manifest does not list"),
    "run-empty-files": on_run(lambda c: edit_manifest(c, lambda m: m.update(files={})), "lists no files"),
    "run-unlisted-file": on_run(
        lambda c: edit_manifest(c, lambda m: m["files"].pop("tokenizer.json")), "tokenizer.json is not in the manifest"
    ),
    "run-stray-file": on_run(lambda c: (c.art / "notes.txt").write_text("x"), "notes.txt is not in the manifest"),
    "run-path-escape": on_run(
        lambda c: edit_manifest(c, lambda m: m["files"].update({"../x": "0" * 64})), "outside the artifact"
    ),
    "run-old-format": on_run(
        lambda c: edit_manifest(c, lambda m: m.update(format_version="1.0")), "re-convert the model with tale-convert"
    ),
    "run-future-format": on_run(
        lambda c: edit_manifest(c, lambda m: m.update(format_version="3.0")), "upgrade tale-kv"
    ),
    "eval-edited-config": (
        "eval",
        lambda c: edit_json(c, "config.json", lambda d: d.update(rms_norm_eps=0.5)),
        lambda c: [c.art, "--dtype", "fp32"],
        "checksum mismatch for config.json",
    ),
    # --- tale-convert: validation before work
    "convert-empty-calib": (
        "convert",
        None,
        lambda c: [c.model, "--out", c.out, "--calib", c.file("e.txt", "")],
        "the file is empty",
    ),
    "convert-binary-calib": (
        "convert",
        None,
        lambda c: [c.model, "--out", c.out, "--calib", c.file("b.txt", bytes(range(256)))],
        "binary file",
    ),
    "convert-malformed-jsonl": (
        "convert",
        None,
        lambda c: [c.model, "--out", c.out, "--calib", c.file("m.jsonl", '{"text": "a"}\n{"text": \n')],
        "line 2: not JSON",
    ),
    "convert-jsonl-no-text": (
        "convert",
        None,
        lambda c: [c.model, "--out", c.out, "--calib", c.file("n.jsonl", '{"body": "a"}\n')],
        "no 'text' field",
    ),
    "convert-out-under-file": (
        "convert",
        None,
        lambda c: [c.model, "--out", c.file("f", "x") / "sub"],
        "is not a directory",
    ),
    "convert-out-is-file": (
        "convert",
        None,
        lambda c: [c.model, "--out", c.file("f2", "x")],
        "exists and is not a directory",
    ),
    "convert-device-mps": (
        "convert",
        None,
        lambda c: [c.model, "--out", c.out, "--device", "mps"],
        "--device mps: not supported",
    ),
    "convert-samples-0": (
        "convert",
        None,
        lambda c: [c.model, "--out", c.out, "--samples", "0"],
        "--samples must be >= 1",
    ),
    "convert-value-group-0": (
        "convert",
        None,
        lambda c: [c.model, "--out", c.out, "--value-group", "0"],
        "--value-group must be >= 1",
    ),
    # --- tale-eval: validation before work
    "eval-json-missing-dir": ("eval", None, lambda c: [c.art, "--json", c.tmp / "no" / "r.json"], "does not exist"),
    "eval-json-is-dir": ("eval", None, lambda c: [c.art, "--json", c.tmp], "is a directory"),
    "eval-device-mps": ("eval", None, lambda c: [c.art, "--device", "mps"], "--device mps: not supported"),
    "eval-ctx-0": ("eval", None, lambda c: [c.art, "--ctx", "0"], "--ctx must be >= 1"),
    "eval-prefill-ge-ctx": (
        "eval",
        None,
        lambda c: [c.art, "--ctx", "32", "--prefill", "32"],
        "must be smaller than --ctx",
    ),
    # --- tale-push: checked locally, nothing printed before the error
    "push-bad-repo-id": ("push", None, lambda c: [c.art, "no-owner"], "use 'owner/name'"),
    "push-corrupt": (
        "push",
        lambda c: flip_byte(c.art / "config.json"),
        lambda c: [c.art, "alice/x", "--dry-run"],
        "checksum mismatch for config.json",
    ),
    "push-stray-file": (
        "push",
        lambda c: (c.art / "notes.txt").write_text("x"),
        lambda c: [c.art, "alice/x"],
        "notes.txt is not in the manifest",
    ),
    "push-bad-quality": ("push", None, lambda c: [c.art, "alice/x", "--quality", c.file("q.json", "[1")], "--quality"),
}


@pytest.fixture
def ctx(built, tiny_model_dir, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    return Ctx(work, tiny_model_dir("llama"), Path(shutil.copytree(built, tmp_path / "art")), tmp_path / "out" / "tale")


def run_case(cli, argv):
    extra = TINY_ARGS if cli == "convert" else []
    return invoke(MAINS[cli], [*extra, *argv])  # the case's options come last: they win


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line(case, ctx, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("TALE_DEBUG", raising=False)
    cli, setup, argv, fragment = CASES[case]
    if setup:
        setup(ctx)
    r = run_case(cli, argv(ctx))
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert fragment in r.stderr, r.stderr
    assert "Traceback" not in r.output and "internal error" not in r.output
    assert r.stdout == ""  # nothing before the error (tale-push used to print "checking ...")
    assert not ctx.out.parent.exists() or not any(ctx.out.parent.iterdir())  # nothing half-written


def test_nucleus_keeps_the_top_token(built):
    from tale_runtime.generate import _next_token

    logits = torch.tensor([0.0, 3.0, 1.0])
    gen = torch.Generator().manual_seed(0)
    assert all(_next_token(logits, 1.0, 0.0, gen) == 1 for _ in range(20))
    r = invoke(
        run_cli.main,
        [built, "-p", "hi", "--temperature", "1", "--top-p", "0", "--max-new-tokens", "3", "--dtype", "fp32"],
    )
    assert r.exit_code == 0, r.output
    assert "generated 3 tok" in r.stderr


@pytest.mark.parametrize("how", ["run greedy", "run sampling", "eval"])
def test_non_finite_logits_end_the_run_in_one_line(built, monkeypatch, how):
    """inf/NaN logits (a number format overflowed in the cache or attention) are refused, greedy or sampling, and
    by tale-eval: argmax would otherwise pick a token and the run would look fine, and a perplexity would be NaN."""
    import importlib

    load_mod = importlib.import_module("tale_runtime.load")  # the package exports a function of that name
    real = load_mod.load

    def poisoned(*a, **k):
        m, tok = real(*a, **k)
        with torch.no_grad():
            m.lm_head.weight[3] = float("nan")
        return m, tok

    monkeypatch.setattr(load_mod, "load", poisoned)  # tale-eval and tale-run import it as they start
    if how == "eval":
        argv = [built, "--dtype", "fp32", "--ctx", "32", "--windows", "1", "--prefill", "8", "--passkey-lengths", ""]
        r = invoke(eval_cli.main, [*argv, "--policies", "full", "--threads", "1"])
        start = "error: the logits of the decode call at token 8 are not finite"
    else:
        t = "0" if how == "run greedy" else "1"
        r = invoke(run_cli.main, [built, "-p", "hi", "--temperature", t, "--max-new-tokens", "3"])
        start = "error: the logits of generated token 1 are not finite"
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith(start), r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.output


def test_unmodified_artifact_verifies_every_file(built):
    names = verify_files(built)
    assert {
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "README.md",
        "model.safetensors.index.json",
        "model-00001-of-00001.safetensors",
    } <= names
    assert MANIFEST not in names and all(not n.startswith(".") for n in names)
    assert names == set(hash_files(built))


def test_disk_full_is_one_line_and_leaves_nothing(ctx, monkeypatch):
    import tale_convert.write as write

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(ctx.out))

    monkeypatch.setattr(write.ShardWriter, "_open", full)  # the background writer's first shard
    r = run_case("convert", [ctx.model, "--out", ctx.out])
    assert r.exit_code == 2 and r.stderr.startswith("error: no space left on the device"), r.output
    assert r.stderr.count("\n") == 1
    assert not ctx.out.exists() and not list(ctx.out.parent.glob("*.tmp-*"))
    assert not list(ctx.out.parent.parent.glob(".tale-probe-*"))  # the writability probe is removed again


def test_safetensors_disk_full_text_is_recognised():
    from safetensors import SafetensorError

    e = SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space" })')
    assert console.environment_error(e).startswith("no space left")
    assert console.environment_error(PermissionError(errno.EACCES, "Permission denied", "/x")).startswith("permission")
    assert console.environment_error(RuntimeError("shape mismatch")) is None


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_unwritable_out_is_refused_before_work(ctx):
    ro = ctx.tmp / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        r = run_case("convert", [ctx.model, "--out", ro / "tale"])
        assert r.exit_code == 2 and "is not writable" in r.stderr and r.stderr.count("\n") == 1, r.output
    finally:
        ro.chmod(0o755)


@pytest.mark.parametrize("at_layer", [0, 2])
def test_sigterm_is_handled_like_ctrl_c(at_layer, ctx, monkeypatch):
    """SIGTERM during conversion: the KeyboardInterrupt clean-up runs (no temp dir without finished layers;
    finished layers kept for --resume), exit code 143."""
    import tale_convert.calibrate as calibrate

    real, calls = calibrate.run_layer, []

    def run_layer(*a, **k):
        calls.append(1)
        if len(calls) == at_layer + 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setattr(calibrate, "run_layer", run_layer)
    old = signal.getsignal(signal.SIGTERM)
    try:
        r = run_case("convert", [ctx.model, "--out", ctx.out])
    finally:
        signal.signal(signal.SIGTERM, old)
    assert r.exit_code == 128 + signal.SIGTERM and "interrupted (SIGTERM)" in r.stderr, r.output
    assert "Traceback" not in r.output and not ctx.out.exists()
    left = list(ctx.out.parent.glob("*.tmp-*"))
    if at_layer == 0:
        assert left == []  # nothing finished: nothing kept
    else:
        assert len(left) == 1 and "--resume" in r.stdout
        monkeypatch.setattr(calibrate, "run_layer", real)
        r = run_case("convert", [ctx.model, "--out", ctx.out, "--resume"])
        assert r.exit_code == 0 and "(reused)" in r.stdout, r.output
        verify_files(ctx.out)


def test_internal_error_is_one_line_exit_1_and_tale_debug_shows_it(ctx, monkeypatch):
    # the CLI imports convert() from the module once the options are checked (the package exports a function of
    # that name)
    convert_mod = importlib.import_module("tale_convert.convert")

    def bug(*a, **k):
        raise RuntimeError("a bug\nover two lines")

    monkeypatch.setattr(convert_mod, "convert", bug)
    monkeypatch.delenv("TALE_DEBUG", raising=False)
    r = run_case("convert", [ctx.model, "--out", ctx.out])
    assert (
        r.exit_code == 1
        and r.stderr
        == "error: internal error: RuntimeError: a bug over two lines (set TALE_DEBUG=1 for the traceback)\n"
    )
    monkeypatch.setenv("TALE_DEBUG", "1")
    with pytest.raises(RuntimeError, match="a bug"):
        MAINS["convert"]([*TINY_ARGS, str(ctx.model), "--out", str(ctx.out)])
    with pytest.raises(console.UserError, match="no such artifact"):  # user errors too: the traceback says where
        MAINS["run"]([str(ctx.tmp / "absent"), "-p", "hi"])
