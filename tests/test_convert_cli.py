"""tale-convert's command line: bad input is one `error:` line, exit code 2, and nothing left behind."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import TINY_OPTS, save_tiny

from tale_convert.cli import main
from tale_runtime.model import cache_arg

TINY_ARGS = [a for k, v in TINY_OPTS.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def run(argv, capsys) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what fixtures printed
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    cap = capsys.readouterr()
    return e.value.code, cap.out, cap.err


def assert_bad(argv, capsys, tmp_path, match: str, keep=()):
    before = {p.name for p in tmp_path.iterdir()}
    code, out, err = run(argv, capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and match in err, err
    assert "Traceback" not in err + out
    assert {p.name for p in tmp_path.iterdir()} == before  # no output dir, no temp sibling


@pytest.fixture
def llama(tiny_model_dir):
    return tiny_model_dir("llama")


def test_converts_and_reports(llama, tmp_path, capsys):
    code, out, err = run([llama, "--out", tmp_path / "new" / "tale", "--group", "2", *TINY_ARGS], capsys)
    assert code == 0, err
    assert "nominal ratio" in out and "peak RSS" in out and "energy kept at r0" in out
    assert (tmp_path / "new" / "tale" / "tale_config.json").is_file()  # parents are created


@pytest.mark.parametrize(
    "case",
    [
        "missing-path",
        "hub-offline",
        "unsupported-arch",
        "group-divides",
        "rank-exceeds-hidden",
        "calib-too-short",
        "calib-missing",
        "calib-no-text",
        "bad-bits",
        "bits-value",
        "bad-dtype",
        "bad-shard-size",
        "recent-count",
        "one-level-needs-no-recent",
        "r0-zero",
        "empty-bits",
        "lowrank-level-count",
        "key-basis-blocks",
        "sliding-window",
    ],
)
def test_bad_input(case, llama, tiny_model_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "tale"
    short = tmp_path / "short.txt"
    short.write_text("Too little text.")
    nojson = tmp_path / "c.jsonl"
    nojson.write_text('{"body": "no text field"}\n')
    gpt2 = tmp_path / "gpt2"
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(gpt2)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv, match = {
        "missing-path": (["./does/not/exist"], "model not found"),
        "hub-offline": (["nobody-xyz/no-such-model"], "nobody-xyz/no-such-model"),
        "unsupported-arch": ([gpt2], "unsupported architecture 'gpt2'"),
        "group-divides": ([llama, "--group", "3"], "must divide the number of KV heads (4)"),
        "rank-exceeds-hidden": ([tiny_model_dir("mha"), "--group", "4"], "latent rank 128 > hidden size 64"),
        "calib-too-short": ([llama, "--group", "2", "--calib", short], "calibration text too short"),
        "calib-missing": ([llama, "--group", "2", "--calib", tmp_path / "nope.txt"], "calibration file not found"),
        "calib-no-text": ([llama, "--group", "2", "--calib", nojson], "no 'text' field"),
        "bad-bits": ([llama, "--group", "2", "--bits", "2,x"], "--bits '2,x'"),
        "bits-value": ([llama, "--group", "2", "--bits", "5,4"], "bits must be one of"),
        "bad-dtype": ([llama, "--group", "2", "--dtype", "int8"], "unknown --dtype"),
        "bad-shard-size": ([llama, "--group", "2", "--shard-size", "lots"], "bad size"),
        "recent-count": ([llama, "--group", "2", "--recent", "0.1,0.2"], "2 level(s)"),
        "one-level-needs-no-recent": ([llama, "--group", "2", "--bits", "4"], "0 --recent shares (--recent= for none)"),
        "r0-zero": ([llama, "--group", "2", "--r0", "0"], "--r0 must be a fraction of R in (0, 1], got 0"),  # not unset
        "empty-bits": ([llama, "--group", "2", "--bits", ""], "--bits '': expected comma-separated numbers"),
        "lowrank-level-count": (
            [llama, "--group", "2", "--preset", "lowrank", "--bits", "2,4", "--recent", "0.1"],
            "--preset lowrank sets its per-level key layout for 3 levels; --bits gives 2",
        ),
        "key-basis-blocks": (
            [llama, "--group", "2", "--preset", "lowrank", "--key-basis-blocks", "diagonal"],
            "unknown --key-basis-blocks 'diagonal': use one of joint, group, head",
        ),
        "sliding-window": ([tiny_model_dir("mistral"), "--group", "2", "--seq-len", "300"], "sliding window 256"),
    }[case]
    assert_bad([*TINY_ARGS, "--out", out, *argv], capsys, tmp_path, match)  # the case's options come last: they win


def test_one_level_with_no_recent_shares(llama, tmp_path, capsys):
    """--recent= (empty): a single-level schedule (every non-sink token at the same rank and bits)."""
    code, out, err = run(
        [llama, "--out", tmp_path / "one", "--group", "2", *TINY_ARGS, "--bits", "4", "--recent="], capsys
    )
    assert code == 0, err
    from tale_runtime import load

    s = load(tmp_path / "one", device="cpu")[0].tale_spec.schedule
    assert [lv.bits for lv in s.levels] == [4] and [lv.share for lv in s.levels] == [None]


def test_calib_wrong_type(llama, tmp_path, capsys):
    csv = tmp_path / "data.csv"
    csv.write_text("text\nhello\n")
    assert_bad(
        [llama, "--group", "2", "--calib", csv, "--out", tmp_path / "tale", *TINY_ARGS],
        capsys,
        tmp_path,
        "unsupported type",
    )


def test_existing_output(llama, tmp_path, capsys):
    out = tmp_path / "tale"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_bad([llama, "--group", "2", "--out", out, *TINY_ARGS], capsys, tmp_path, "exists (pass --overwrite")
    # --overwrite only ever replaces a TALE artifact
    assert_bad(
        [llama, "--group", "2", "--out", out, "--overwrite", *TINY_ARGS], capsys, tmp_path, "not a TALE artifact"
    )
    assert (out / "keep.txt").read_text() == "mine"


def test_non_finite_activations(tiny_tok, tmp_path, capsys):
    def blow_up(model):
        model.model.layers[0].mlp.down_proj.weight.data.fill_(float("inf"))

    bad = save_tiny(tmp_path / "bad", "llama", tiny_tok, edit=blow_up)
    assert_bad(
        [bad, "--group", "2", "--out", tmp_path / "tale", *TINY_ARGS],
        capsys,
        tmp_path,
        "non-finite activations after layer 0",
    )


def test_usage_errors_are_one_line(tmp_path, capsys):
    code, _, err = run(["--out", tmp_path / "x", "--samples", "many"], capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
    code, _, err = run([], capsys)
    assert code == 2 and "--out" in err and err.count("\n") == 1


@pytest.mark.slow  # the installed script in a fresh process
def test_console_script(tmp_path):
    """The installed entry point, in a fresh process: no traceback reaches the user."""
    exe = [sys.executable, "-c", "from tale_convert.cli import main; main()"]
    p = subprocess.run([*exe, str(tmp_path / "missing"), "--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.startswith("error: model not found") and p.stderr.count("\n") == 1
    assert not list(tmp_path.iterdir())


def test_key_bands_write_the_calibration_order(llama, tmp_path, capsys):
    import json

    import torch

    from tale_runtime import load, new_cache
    from tale_runtime.quant import Bands

    out = tmp_path / "bands"
    code, stdout, err = run([llama, "--out", out, "--group", "2", "--key-bands", "3:8", *TINY_ARGS], capsys)
    assert code == 0, err
    m = json.loads((out / "tale_config.json").read_text())
    assert m["format_version"] == "2.4" and m["schedule"]["levels"][0]["key_hi_bits"] == 3  # no key_ranks: 2.4
    model, _ = load(out, device="cpu", dtype=torch.float32)
    s, cfg = model.tale_spec.schedule, model.config
    assert s.levels[0].key_hi_channels == 8 and len(s.key_order) == cfg.num_hidden_layers
    assert all(sorted(h) == list(range(cfg.head_dim)) for heads in s.key_order for h in heads)
    assert len(s.key_order[0]) == cfg.num_key_value_heads
    cache = new_cache(model)
    with torch.no_grad():
        model(torch.randint(1, 300, (1, 80)), **cache_arg(cache))
    assert isinstance(cache.layers[0].levels[0].keys, Bands)
    assert_bad([llama, "--out", tmp_path / "x", "--key-bands", "3:7", *TINY_ARGS], capsys, tmp_path, "--key-bands 3:7")
    assert_bad([llama, "--out", tmp_path / "x", "--key-bands", "3", *TINY_ARGS], capsys, tmp_path, "BITS:CHANNELS")


def test_shrink_is_recorded_and_checked(llama, tmp_path, capsys):
    import json

    out = tmp_path / "s"
    code, _, err = run([llama, "--out", out, "--group", "2", "--shrink", "0.2", *TINY_ARGS], capsys)
    assert code == 0, err
    assert json.loads((out / "tale_config.json").read_text())["svd"]["shrink"] == 0.2
    assert_bad([llama, "--out", tmp_path / "x", "--shrink", "1.5", *TINY_ARGS], capsys, tmp_path, "--shrink must be")


def test_rotated_latents_give_the_same_values(llama, tmp_path, capsys):
    """Rotated latents (every preset's default): the schedule says so (format 2.3), full-rank 16-bit latents decode as the unrotated artifact's
    (the values are the same), quantized ones differ (the rotation is what changes their error), and a rank that
    cuts inside a rotation block is refused."""
    import json

    import torch

    from tale_runtime import load, new_cache
    from tale_runtime.load import override_schedule

    plain, rot = tmp_path / "plain", tmp_path / "rot"
    for out, extra in ((plain, ["--no-rotate-latents"]), (rot, [])):  # rotated: the presets' default
        code, _, err = run([llama, "--out", out, "--group", "2", *extra, *TINY_ARGS], capsys)
        assert code == 0, err
    m = json.loads((rot / "tale_config.json").read_text())
    assert m["schedule"]["latent_rotation"] == TINY_OPTS["value_group"] and m["format_version"] == "2.4"
    assert "latent_rotation" not in json.loads((plain / "tale_config.json").read_text())["schedule"]
    ids = torch.randint(1, 300, (1, 70), generator=torch.Generator().manual_seed(0))

    def decode(path, exact: bool):
        model, _ = load(path, device="cpu", dtype=torch.float32)
        s, L = model.tale_spec.schedule, model.config.num_hidden_layers
        R = model.tale_spec.arch.latent_rank
        sched = override_schedule(s, R, L, ranks=1.0, bits=16, key_bits=16) if exact else s
        cache, out = new_cache(model, sched), []
        with torch.no_grad():
            model(ids[:, :40], **cache_arg(cache))
            for t in range(40, 70):
                out.append(model(ids[:, t : t + 1], **cache_arg(cache)).logits)
        return torch.cat(out, 1), model

    a, _ = decode(plain, exact=True)
    b, model = decode(rot, exact=True)
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(decode(plain, exact=False)[0], decode(rot, exact=False)[0], atol=1e-4)
    R = model.tale_spec.arch.latent_rank
    with pytest.raises(ValueError, match="rotation blocks"):
        override_schedule(model.tale_spec.schedule, R, model.config.num_hidden_layers, ranks=[12, R], bits=16)
    # latent groups that cannot be rotation blocks (48 channels of R = 192): the preset's default keeps the SVD basis,
    # asking for the rotation is refused in one line
    from tale_convert import ConvertError
    from tale_convert.convert import Options

    assert Options(group=3, value_group=48, preset="paper").schedule(192, 2).latent_rotation == 0
    assert Options(group=3, value_group=64, preset="paper").schedule(192, 2).latent_rotation == 64
    with pytest.raises(ConvertError, match="latent_rotation must be a power of two"):
        Options(group=3, value_group=48, rotate_latents=True, preset="paper").schedule(192, 2)
    # the lowrank preset rotates in blocks of 32 (at most its latent groups), whatever its scales' groups
    assert [Options(group=3, value_group=v).schedule(192, 2).latent_rotation for v in (64, 48, 16)] == [32, 32, 16]


def test_json_quiet_verbose_and_plain_progress(llama, tmp_path, capsys):
    """--json: one JSON object on stdout, progress one line per layer on stderr (not a terminal); --quiet: nothing;
    --verbose: the per-layer table, its cells whole however wide (no terminal: no 80-column cut)."""
    import json

    out = tmp_path / "j"
    code, stdout, err = run([llama, "--out", out, "--group", "2", *TINY_ARGS, "--json"], capsys)
    assert code == 0, err
    (line,) = stdout.splitlines()
    rep = json.loads(line)
    assert rep["out"] == str(out) and rep["nominal_ratio"] > 1 and rep["warnings"] == []
    assert [lr["index"] for lr in rep["layers"]] == [0, 1, 2] and all(
        0 < lr["energy_kept"][0] <= 1 for lr in rep["layers"]
    )
    assert [ln.split(":")[0] for ln in err.splitlines() if ln.startswith("layer ")] == [
        "layer 1/3",
        "layer 2/3",
        "layer 3/3",
    ]

    code, stdout, err = run([llama, "--out", out, "--group", "2", *TINY_ARGS, "--overwrite", "--quiet"], capsys)
    assert (code, stdout, err) == (0, "", "")

    args = [llama, "--out", out, "--group", "2", *TINY_ARGS, "--overwrite", "--verbose", "--samples", "1"]
    code, stdout, _ = run(args, capsys)
    header = next(ln for ln in stdout.splitlines() if "layer" in ln and "eps" in ln)
    assert "energy kept at r0 (not meaningful: too few calibration tokens)" in header and "time (s)" in header
    assert len(stdout.splitlines()) > 3 and "…" not in stdout


def test_bundled_model_whose_package_is_gone(llama, tmp_path, capsys, monkeypatch):
    """A bundled model's checkpoint cached on the machine, its package uninstalled since: one line naming the package
    to install, exit 2, nothing written."""
    import shutil
    from dataclasses import replace

    from tale_convert import bundled

    cache = tmp_path / "cache"
    shutil.copytree(llama, cache / "fake")
    (cache / "fake" / "SOURCE").write_text("a GGUF file")
    monkeypatch.setenv("TALE_CACHE", str(cache))
    fake = replace(bundled.GEMMA3_270M, subdir="fake", package="tale-no-such-package", assembler=None)
    monkeypatch.setitem(bundled.MODELS, "gemma3-270m", fake)
    work = tmp_path / "work"
    work.mkdir()
    assert_bad(
        ["gemma3-270m", "--out", work / "tale", "--group", "2", *TINY_ARGS],
        capsys,
        work,
        "pip install tale-no-such-package",
    )
