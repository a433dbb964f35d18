"""Loading by Hub repo id: tale-push to a local fake Hub, then tale_runtime.load / tale-run by id,
online through the real snapshot_download and offline from the Hugging Face cache it filled."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from hub_helpers import converted_tiny, fake_hub
from typer.testing import CliRunner

from tale_convert import push
from tale_runtime import ArtifactError, load, new_cache, resolve
from tale_runtime.model import CACHE_KW, cache_arg

REPO = "alice/tiny-tale"
PROMPT = "The cache keeps"


art = converted_tiny("hubload")


@pytest.fixture
def hub(monkeypatch, tmp_path):
    yield from fake_hub(monkeypatch, tmp_path)


def publish(art, tmp_path, *args):
    local = shutil.copytree(art, tmp_path / "publish")
    r = CliRunner().invoke(push.app, [str(local), REPO, *args])
    assert r.exit_code == 0, r.output
    return local


def greedy(model, tok, n=6):
    """The Python usage of the model card, greedy."""
    inputs = tok(PROMPT, return_tensors="pt").to(model.device)
    out = model.generate(**inputs, **cache_arg(new_cache(model)), max_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_load_by_repo_id_round_trip(art, hub, tmp_path):
    local = publish(art, tmp_path)
    m_local, tok_local = load(local, device="cpu", dtype=torch.float32)
    m_hub, tok_hub = load(REPO, device="cpu", dtype=torch.float32)
    assert str(m_hub.tale_spec.path).startswith(str(tmp_path / "hf-cache" / "models--alice--tiny-tale" / "snapshots"))
    assert ("GET", f"/api/models/{REPO}/revision/main") in hub.requests
    a, b = m_local.state_dict(), m_hub.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert m_hub.tale_spec.schedule == m_local.tale_spec.schedule
    assert tok_hub.get_vocab() == tok_local.get_vocab()
    assert greedy(m_hub, tok_hub) == greedy(m_local, tok_local)


def test_offline_loads_from_the_cache(art, hub, tmp_path, monkeypatch):
    publish(art, tmp_path)
    online = resolve(REPO)
    hub.close()  # no Hub at all from here on
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    assert resolve(REPO) == online
    model, tok = load(REPO, device="cpu", dtype=torch.float32)
    assert tok is not None and model.tale_spec.manifest["files"]
    with pytest.raises(ArtifactError, match="not in the local cache"):
        resolve("alice/never-pushed")


def test_load_by_revision(art, hub, tmp_path):
    publish(art, tmp_path, "--revision", "dev")
    model, _ = load(REPO, revision="dev", device="cpu", dtype=torch.float32)
    assert model.tale_spec.manifest["nominal_ratio"] > 1
    with pytest.raises(ArtifactError, match="not a TALE artifact"):  # main holds only .gitattributes
        load(REPO, device="cpu")
    with pytest.raises(ArtifactError, match="no revision 'nope'"):
        resolve(REPO, revision="nope")


def test_unknown_repo_and_bad_ids(hub):
    with pytest.raises(ArtifactError, match="no such repo on the Hub"):
        resolve("alice/missing")
    with pytest.raises(ArtifactError, match="not a Hub repo id"):
        resolve("a/b/c")
    assert hub.requests == [("GET", "/api/models/alice/missing/revision/main")]


def test_tale_run_by_repo_id_offline(art, hub, tmp_path):
    """The user's path: HF_HUB_OFFLINE / HF_HUB_CACHE from the environment, tale-run REPO_ID."""
    publish(art, tmp_path)
    resolve(REPO)  # fill the cache, then go offline in a fresh process
    hub.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hf-cache"), HF_HOME=str(tmp_path / "hf-home"))
    cmd = [sys.executable, "-m", "tale_runtime.cli", REPO, "--prompt", "hi", "--max-new-tokens", "3", "--dtype", "fp32"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def _old_form(art, dest):
    """The artifact as converters before modeling_tale.py wrote it: the base's config.json, no module."""
    import json

    from tale_runtime import remote_code
    from tale_runtime.artifact import MANIFEST, hash_files, write_json

    old = shutil.copytree(art, dest)
    cfg = json.loads((old / "config.json").read_text())
    (old / "config.json").write_bytes(remote_code.dumps(remote_code.base_dict(cfg)))
    (old / remote_code.FILE).unlink()
    manifest = json.loads((old / MANIFEST).read_text())
    write_json(old / MANIFEST, {**manifest, "files": hash_files(old)})
    return old


def test_plain_transformers_with_trust_remote_code(art, hub, tmp_path, monkeypatch):
    """An artifact made before modeling_tale.py existed loads as before, and tale-push uploads it with the module:
    AutoModelForCausalLM + trust_remote_code gives the TALE model (same greedy tokens over a TALE cache as
    tale_runtime.load's); without the flag transformers refuses instead of loading the plain base model."""
    import transformers.dynamic_module_utils as dmu
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tale_runtime import TaleCache, remote_code

    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(tmp_path / "hf-modules"))
    old = _old_form(art, tmp_path / "old")
    m_old, tok = load(old, device="cpu", dtype=torch.float32)
    r = CliRunner().invoke(push.app, [str(old), REPO])
    assert r.exit_code == 0, r.output
    files = hub.files(REPO)
    assert files[remote_code.FILE] == remote_code.module_source()
    assert (
        b'"model_type": "tale"' in files["config.json"] and b'"tale_base_model_type": "llama"' in files["config.json"]
    )

    with pytest.raises(ValueError, match="trust_remote_code=True"):
        AutoModelForCausalLM.from_pretrained(REPO)
    model = AutoModelForCausalLM.from_pretrained(REPO, trust_remote_code=True, dtype=torch.float32)
    assert hasattr(model, "tale_spec") and model.device.type == "cpu" and model.dtype == torch.float32
    tok_hf = AutoTokenizer.from_pretrained(REPO, trust_remote_code=True)
    inputs = tok_hf(PROMPT, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out[CACHE_KW], TaleCache)  # generate's default cache is TALE's
    assert out.sequences[0, inputs["input_ids"].shape[1] :].tolist() == greedy(m_old, tok)
    card = files["README.md"].decode()  # the card's transformers snippet runs as it stands
    snippets = [b.split("```")[0] for b in card.split("```python\n")[1:]]
    assert "trust_remote_code=True" in snippets[0] and f'"{REPO}"' in snippets[0]
    printed = []
    exec(snippets[0].replace("max_new_tokens=64", "max_new_tokens=8"), {"print": printed.append})
    assert len(printed) == 1 and isinstance(printed[0], str)
    with pytest.raises(ValueError, match="not supported for a TALE artifact: quantization_config"):
        AutoModelForCausalLM.from_pretrained(REPO, trust_remote_code=True, quantization_config={"x": 1})


def test_the_module_names_the_package_when_it_is_missing(monkeypatch):
    from tale_runtime import remote_code

    monkeypatch.setitem(sys.modules, "tale_runtime.remote_code", None)  # import fails as if not installed
    with pytest.raises(
        ImportError, match=r"tale-kv package \(tale_runtime\), which is not on PyPI: install it from a checkout"
    ):
        exec(compile(remote_code.module_source(), "modeling_tale.py", "exec"), {"__name__": "modeling_tale"})
