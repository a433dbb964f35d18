"""What a new user runs into: the Python API validating as the CLIs do, tale-run's defaults and flags, outputs that
are streams or mount points, leftovers of interrupted conversions, and plain transformers' ways of loading and
saving a TALE model. Tiny models: seconds each."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_GROUP, TINY_OPTS
from tale_helpers import byte_tokenizer, invoke, save_artifact, talify, tiny_model

import tale_runtime
from tale_runtime.artifact import MANIFEST
from tale_runtime.cli import main as run_main


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return save_artifact(talify(tiny_model("llama"), 2), tmp_path_factory.mktemp("paths") / "tiny", byte_tokenizer())


def run(*args):
    return invoke(run_main, args)


def one_line(r, text: str) -> None:
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith(f"error: {text}") and r.stderr.count("\n") == 1, r.stderr


# -- the Python API validates as the CLI -------------------------------------------------------------------
@pytest.mark.parametrize("knob", ["sinks", "residual"])
def test_load_refuses_what_the_cli_refuses(artifact, knob):
    """load(sinks=10**9) compressed nothing (ratio 1.0) where tale-run refused it: one validator, in load()."""
    with pytest.raises(ValueError, match=rf"^{knob} \d+ is not below the model's context \(512 tokens\)"):
        tale_runtime.load(artifact, **{knob: 10**6})
    one_line(run(artifact, "-p", "hi", f"--{knob}", "100000"), f"--{knob} 100000 is not below the model's context")


def test_recent_nan_is_named(artifact):
    with pytest.raises(ValueError, match=r"recent share nan is not a number$"):
        tale_runtime.load(artifact, recent=[float("nan")])
    one_line(run(artifact, "-p", "hi", "--recent", "nan"), "schedule override: recent share nan is not a number")


def test_changing_the_levels_says_how_many_the_artifact_has(artifact):
    """The tiny artifact has 2 levels; --recent 0.05,0.1 asks for 3 without --bits."""
    r = run(artifact, "-p", "hi", "--recent", "0.05,0.1")
    one_line(r, "schedule override: 3 levels (from recent) need bits for each level (3 values)")
    assert "the artifact has 2 levels" in r.stderr


# -- tale-run ----------------------------------------------------------------------------------------------------
def test_stop_reads_backslash_escapes(artifact, monkeypatch):
    """--stop "\\n\\n" as bash passes it (backslash, n) stops at a blank line, not at the literal characters."""
    from tale_runtime import generate as gen

    seen = []
    real = gen.generate

    def spy(*a, stop_strings=None, **kw):
        seen.append(stop_strings)
        return real(*a, stop_strings=stop_strings, **kw)

    monkeypatch.setattr(gen, "generate", spy)
    r = run(artifact, "-p", "hi", "--max-new-tokens", "2", "--dtype", "fp32", "--stop", "\\n\\n", "--stop", "a\\\\b")
    assert r.exit_code == 0, r.stderr
    assert seen == [["\n\n", "a\\b"]]
    one_line(run(artifact, "-p", "hi", "--stop", "x\\q"), "--stop: unknown escape \\q")


def test_threads(artifact):
    before = torch.get_num_threads()
    try:
        r = run(artifact, "-p", "hi", "--max-new-tokens", "1", "--dtype", "fp32", "--threads", "1")
        assert r.exit_code == 0, r.stderr
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    one_line(run(artifact, "-p", "hi", "--threads", "0"), "--threads must be >= 1, got 0")


def test_a_base_model_gets_raw_text(artifact, tmp_path):
    """A pretrained model (the manifest's base.instruct false) continues the prompt as raw text, with a note;
    --template still applies the chat template. The byte tokenizer: 'héllo' is 6 tokens, '<user>héllo<assistant>'
    23."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(artifact, base)
    m = json.loads((base / MANIFEST).read_text())
    m["base"] = {"id": "someone/tiny-base", "instruct": False}
    (base / MANIFEST).write_text(json.dumps(m))
    prompts = {}
    for name, art, extra in (("instruct", artifact, []), ("base", base, []), ("template", base, ["--template"])):
        r = run(art, "-p", "héllo", "--max-new-tokens", "1", "--dtype", "fp32", "--json", *extra)
        assert r.exit_code == 0, r.stderr
        prompts[name] = json.loads(r.stdout)["stats"]["prompt_tokens"]
        assert ("pretrained (base) model" in r.stderr) == (name == "base")
    assert prompts == {"instruct": 23, "base": 6, "template": 23}


def test_instruct_recorded_at_conversion(tiny_model_dir, tmp_path):
    import shutil

    from tale_convert.bundled import GEMMA3_270M, SMOLLM2
    from tale_convert.convert import Options, convert
    from tale_convert.source import instruct_of

    assert (GEMMA3_270M.instruct, SMOLLM2.instruct) == (False, True)
    assert [instruct_of(n) for n in ("Llama-3.1-8B-Instruct", "gemma-3-270m-it", "Qwen3-8B-Base", "Llama-3.1-8B")] == [
        True,
        True,
        False,
        None,
    ]
    src = tmp_path / "tiny-base"
    shutil.copytree(tiny_model_dir("llama"), src)
    convert(str(src), tmp_path / "art", Options(group=TINY_GROUP["llama"], **TINY_OPTS))
    assert json.loads((tmp_path / "art" / MANIFEST).read_text())["base"]["instruct"] is False


def test_a_missing_local_path_is_not_looked_up_on_the_hub(artifact, tmp_path, monkeypatch):
    """out/smollm2-tal (a typo) next to out/: refused at once as a local path, never asked of the Hub."""
    import huggingface_hub

    def no_hub(*a, **kw):
        raise AssertionError("asked the Hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    one_line(run("out/tiny-tal", "-p", "hi"), "out/tiny-tal: no such artifact directory (out/ has no tiny-tal)")


def test_an_ascii_terminal_gets_no_traceback(artifact):
    """PYTHONIOENCODING=ascii: text it cannot encode prints as '?', the command ends normally."""
    env = dict(os.environ, PYTHONIOENCODING="ascii", OMP_NUM_THREADS="1")
    code = "from tale_runtime.cli import main; main()"
    args = [str(artifact), "-p", "fête ✓", "--max-new-tokens", "4", "--dtype", "fp32", "--raw", "--compare-full"]
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.startswith("[TALE cache]\n") and "[full 16-bit cache]" in r.stdout


# -- outputs: streams, mount points, leftovers -------------------------------------------------------------------
def test_eval_json_through_a_symlink_writes_the_stream(artifact, tmp_path):
    """--json /dev/stdout --overwrite with stdout redirected to a file: /dev/stdout is a symlink to that regular file.
    The JSON goes through it; the symlink is never replaced by a file of its own."""
    from tale_eval.cli import main as eval_main

    target = tmp_path / "captured.json"
    target.write_text("")
    link = tmp_path / "stdout"
    link.symlink_to(target)
    args = [artifact, "--ctx", "64", "--windows", "1", "--prefill", "16", "--dtype", "fp32", "--passkey-lengths", ""]
    r = invoke(eval_main, [*args, "--policies", "full", "--json", link, "--overwrite", "--quiet"])
    assert r.exit_code == 0, r.stderr
    assert link.is_symlink() and json.loads(target.read_text())["results"][0]["policy"] == "full"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["captured.json", "stdout"]  # no .partial, no temp file


def _convert(src, out, log=None, **opts):
    from tale_convert.convert import Options, convert

    return convert(str(src), out, Options(group=TINY_GROUP["llama"], **{**TINY_OPTS, **opts}), log=log or print)


def test_convert_into_a_mount_point_writes_in_place(tiny_model_dir, tmp_path, monkeypatch):
    """--out VOL --overwrite, VOL a mount point (an empty volume): it cannot be renamed or removed, so the artifact
    is written inside it; a read-only one is refused before any work."""
    from tale_convert import ConvertError, write

    vol = tmp_path / "vol"
    vol.mkdir()
    (vol / "lost+found").mkdir()  # a fresh file system's: kept
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == vol or real_ismount(p))

    def no_rename(*a):
        raise OSError(16, "Device or resource busy")  # what renaming a mount point gets

    monkeypatch.setattr(write, "_rename_noreplace", no_rename)
    for _ in range(2):  # into the empty volume, then over the artifact it holds
        _convert(tiny_model_dir("llama"), vol, overwrite=True)
        assert (vol / MANIFEST).is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["vol"]
        assert not [p for p in vol.iterdir() if ".tmp-" in p.name] and (vol / "lost+found").is_dir()
        tale_runtime.load(vol)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == vol else real_access(p, mode))
    with pytest.raises(ConvertError, match=r"a mount point that is not writable"):
        _convert(tiny_model_dir("llama"), vol, overwrite=True)


def test_interrupted_conversions_are_mentioned_and_cleared(tiny_model_dir, tmp_path, monkeypatch):
    """An interrupted run keeps its finished layers in OUT.tmp-PID: the next run names it, and once the artifact is
    written a partial run of the same settings is removed; --resume leaves none behind either."""
    from tale_convert import write

    out = tmp_path / "art"
    real = write.copy_model_files  # called once every layer is done

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(write, "copy_model_files", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _convert(tiny_model_dir("llama"), out)
    left = [p for p in tmp_path.iterdir() if p.name.startswith("art.tmp-")]
    assert len(left) == 1
    left = [left[0].rename(tmp_path / "art.tmp-999999")]  # as another process left it (this one's is its own)
    monkeypatch.setattr(write, "copy_model_files", real)
    lines = []
    _convert(tiny_model_dir("llama"), out, log=lines.append)
    assert any(str(left[0]) in s and "--resume reuses them" in s for s in lines), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]

    monkeypatch.setattr(write, "copy_model_files", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _convert(tiny_model_dir("llama"), out, overwrite=True)
    next(tmp_path.glob("art.tmp-*")).rename(tmp_path / "art.tmp-999999")
    monkeypatch.setattr(write, "copy_model_files", real)
    lines = []
    _convert(tiny_model_dir("llama"), out, log=lines.append, overwrite=True, resume=True)
    assert any("resuming art.tmp-" in s for s in lines), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


# -- plain transformers -------------------------------------------------------------------------------------------
def test_save_pretrained_writes_the_tale_artifact(converted, tmp_path):
    """model.save_pretrained(d) wrote the base model (a plain LlamaForCausalLM on a 16-bit cache at reload): it now
    writes the artifact, which reloads as TALE through transformers too; what it cannot write is refused."""
    from transformers import AutoModelForCausalLM

    art = converted["llama"]
    model, _ = tale_runtime.load(art)
    d = tmp_path / "saved"
    model.save_pretrained(d)
    assert sorted(p.name for p in d.iterdir()) == sorted(p.name for p in art.iterdir())
    again = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True)
    assert hasattr(again, "tale_spec") and again.tale_spec.schedule == model.tale_spec.schedule
    with pytest.raises(ValueError, match=r"exists and is not an empty directory"):
        model.save_pretrained(d)
    changed, _ = tale_runtime.load(art, sinks=2)
    with pytest.raises(ValueError, match=r"schedule was overridden at load"):
        changed.save_pretrained(tmp_path / "other")
    assert not (tmp_path / "other").exists()


def test_pipeline_takes_a_tale_model_quietly(converted, monkeypatch):
    """pipeline() logged "The model 'TaleLlamaForCausalLM' is not supported for text-generation" and ~200 names."""
    from transformers import pipeline
    from transformers.pipelines import base

    logged = []
    monkeypatch.setattr(base.logger, "error", lambda msg, *a, **kw: logged.append(msg))
    pipe = pipeline("text-generation", model=str(converted["llama"]), trust_remote_code=True)
    out = pipe("hello", max_new_tokens=2, do_sample=False)
    assert out[0]["generated_text"].startswith("hello")
    assert not logged


@pytest.mark.parametrize("attn", ["eager", "flash_attention_2"])
def test_attn_implementation_is_not_ignored(converted, attn):
    """AutoModelForCausalLM moves attn_implementation onto the config before the artifact's code sees it."""
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match=rf"attn_implementation='{attn}'"):
        AutoModelForCausalLM.from_pretrained(converted["llama"], trust_remote_code=True, attn_implementation=attn)


def test_lm_eval_offline_says_what_is_missing_at_once(artifact, tmp_path, monkeypatch):
    """Offline, a task whose dataset is not cached: one line before the model loads, not a minute of retries."""
    pytest.importorskip("lm_eval")
    import time

    import datasets
    from huggingface_hub import constants

    from tale_eval.cli import main as eval_main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    t = time.perf_counter()
    r = invoke(eval_main, [artifact, "--lm-eval", "hellaswag", "--limit", "2", "--lm-eval-out", tmp_path / "res"])
    one_line(r, "--lm-eval hellaswag: its dataset Rowan/hellaswag is not in the local datasets cache")
    assert "dataset_path" in r.stderr and time.perf_counter() - t < 60
    assert not (tmp_path / "res").exists()


def test_the_gguf_bar_follows_the_progress_switch(capfd):
    """tale-convert --quiet (and its progress, which replaces transformers' bars) turns transformers' bars off;
    the GGUF loader's bar, which does not ask that switch, printed anyway while a bundled model was rebuilt."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging

    from tale_convert.bundled import SMOLLM2, gguf_tensors

    gguf = SMOLLM2.gguf_file()
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        capfd.readouterr()
        state = gguf_tensors(gguf, model)
    finally:
        if was:
            logging.enable_progress_bar()
    assert "model.embed_tokens.weight" in state
    assert "GGUF" not in capfd.readouterr().err


@pytest.mark.slow
def test_the_bundled_gemma3_is_run_as_a_base_model(gemma3_artifact):
    """Gemma 3 270M is the pretrained model: its artifact says so, and tale-run continues the prompt as raw text
    (the chat template made it answer "What is the chemical symbol for silver?")."""
    from transformers import AutoTokenizer

    assert json.loads((gemma3_artifact / MANIFEST).read_text())["base"]["instruct"] is False
    prompt = "The chemical symbol for gold is"
    r = run(gemma3_artifact, "-p", prompt, "--max-new-tokens", "3", "--dtype", "fp32", "--json")
    assert r.exit_code == 0, r.stderr
    assert "pretrained (base) model" in r.stderr
    tok = AutoTokenizer.from_pretrained(gemma3_artifact)
    out = json.loads(r.stdout)
    assert out["stats"]["prompt_tokens"] == len(tok(prompt)["input_ids"]) and "Au" in out["text"]
