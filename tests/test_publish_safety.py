"""tale-convert's write/publish path: nothing it did not create is ever removed or replaced.

- two conversions to one --out at once: one writes the artifact, the other is refused in one line (the lock
  `<out>.lock` beside the output), whichever order they reach it in;
- a directory that appears at --out while a conversion runs survives untouched, and the new artifact is kept
  beside it under a name the error line gives;
- --overwrite replaces only an empty directory or a TALE artifact holding nothing but its own files;
- the lock file goes away on every exit path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_OPTS
from tale_helpers import invoke

import tale_convert.cli as convert_cli
import tale_convert.write as write
from tale_runtime.artifact import MANIFEST, verify_files

TINY_ARGS = [a for k, v in TINY_OPTS.items() for a in (f"--{k.replace('_', '-')}", str(v))] + ["--group", "2"]
BIN = Path(sys.executable).parent


def convert(model, out, *extra):
    return invoke(convert_cli.main, [*TINY_ARGS, model, "--out", out, *extra])


def one_error_line(r, fragment: str) -> None:
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert fragment in r.stderr, r.stderr
    assert "Traceback" not in r.output and "internal error" not in r.output


def no_lock_left(out: Path) -> None:
    assert not out.with_name(out.name + ".lock").exists()


@pytest.mark.slow  # two conversions in processes of their own
def test_two_conversions_to_one_out_at_once(tiny_model_dir, tmp_path):
    """Two real processes started together: exactly one succeeds; the other exits 2 with one line, refused by the
    lock (it started while the first ran) or by the existing --out (the first had finished); a valid artifact."""
    out = tmp_path / "same"
    cmd = [str(BIN / "tale-convert"), str(tiny_model_dir("llama")), *TINY_ARGS, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    env.pop("TALE_DEBUG", None)
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in "ab"]
    results = [(p.wait(timeout=600), *p.communicate()) for p in procs]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], results
    _, _, err = next(r for r in results if r[0] == 2)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "is writing" in lines[0] or "exists (pass --overwrite" in lines[0], err
    assert "Traceback" not in err
    verify_files(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["same"]  # no temp dir, no lock, no second artifact


def test_a_running_conversion_holds_the_lock(tiny_model_dir, tmp_path):
    """The refusal itself, deterministically: --out locked by another conversion (here: a lock the test holds)."""
    out = tmp_path / "art"
    with write.OutLock(out):
        r = convert(tiny_model_dir("llama"), out)
        one_error_line(r, f"another tale-convert (pid {os.getpid()}) is writing {out}")
        assert not out.exists()
    no_lock_left(out)
    r = convert(tiny_model_dir("llama"), out)  # released: the next one converts
    assert r.exit_code == 0, r.output
    verify_files(out)
    no_lock_left(out)


def test_a_stale_lock_is_taken_over(tiny_model_dir, tmp_path):
    """A lock file left by a process that died (SIGKILL: nothing could remove it) does not block the next run."""
    out = tmp_path / "art"
    out.with_name("art.lock").write_text("999999999\n")
    r = convert(tiny_model_dir("llama"), out)
    assert r.exit_code == 0, r.output
    verify_files(out)
    no_lock_left(out)


def test_a_file_of_the_user_named_like_the_lock_is_left_alone(tiny_model_dir, tmp_path):
    out = tmp_path / "art"
    mine = out.with_name("art.lock")
    mine.write_text("my notes\n")
    one_error_line(convert(tiny_model_dir("llama"), out), "is not a lock file of tale-convert")
    assert mine.read_text() == "my notes\n" and not out.exists()


def appear_during_conversion(monkeypatch, out: Path, files: dict[str, str]):
    """Create `out` (with `files`) while the conversion runs: after its start-time checks, before publishing."""
    real = write.copy_model_files

    def copy_model_files(*a, **k):
        out.mkdir()
        for name, text in files.items():
            (out / name).write_text(text)
        return real(*a, **k)

    monkeypatch.setattr(write, "copy_model_files", copy_model_files)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_directory_made_at_out_during_the_conversion_survives(tiny_model_dir, tmp_path, monkeypatch, overwrite):
    out = tmp_path / "art"
    appear_during_conversion(monkeypatch, out, {"notes.txt": "my notes\n"})
    r = convert(tiny_model_dir("llama"), out, *(["--overwrite"] if overwrite else []))
    kept = out.with_name(f"art.new-{os.getpid()}")
    one_error_line(r, f"the new artifact is at {kept}")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert (out / "notes.txt").read_text() == "my notes\n"
    verify_files(kept)  # the finished work is not thrown away
    no_lock_left(out)
    assert not list(tmp_path.glob("*.tmp-*"))


def test_an_empty_directory_made_at_out_is_not_replaced_without_overwrite(tiny_model_dir, tmp_path, monkeypatch):
    """rename(2) silently replaces an empty directory: publishing must not."""
    out = tmp_path / "art"
    appear_during_conversion(monkeypatch, out, {})
    one_error_line(convert(tiny_model_dir("llama"), out), "appeared while converting")
    assert out.is_dir() and not any(out.iterdir())


def test_overwrite_replaces_an_artifact_but_not_files_added_to_it(tiny_model_dir, tmp_path):
    out = tmp_path / "art"
    assert convert(tiny_model_dir("llama"), out).exit_code == 0
    before = (out / MANIFEST).read_bytes()
    r = convert(tiny_model_dir("llama"), out, "--overwrite", "--seed", "1")
    assert r.exit_code == 0, r.output
    verify_files(out)
    assert (out / MANIFEST).read_bytes() != before
    (out / "notes.txt").write_text("mine\n")
    one_error_line(convert(tiny_model_dir("llama"), out, "--overwrite"), "not part of the artifact (notes.txt)")
    assert (out / "notes.txt").read_text() == "mine\n"
    no_lock_left(out)


def test_out_empty_or_current_directory_is_refused(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    one_error_line(convert(tiny_model_dir("llama"), ""), "--out is empty")
    one_error_line(convert(tiny_model_dir("llama"), ".", "--overwrite"), "is the current directory")
    assert list(tmp_path.iterdir()) == []


def test_out_inside_an_artifact_is_refused(tiny_model_dir, tmp_path):
    out = tmp_path / "art"
    assert convert(tiny_model_dir("llama"), out).exit_code == 0
    one_error_line(convert(tiny_model_dir("llama"), out / "inner"), "inside the TALE artifact")
    verify_files(out)


def test_parents_it_created_are_removed_after_a_refusal(tiny_model_dir, tmp_path):
    out = tmp_path / "a" / "b" / "art"
    one_error_line(convert(tiny_model_dir("llama"), out, "--group", "3"), "must divide")
    assert list(tmp_path.iterdir()) == []
