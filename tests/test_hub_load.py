"""Loading by Hub repo id: tale-push to a local fake Hub, then tale_runtime.load / tale-run by id,
online through the real snapshot_download and offline from the Hugging Face cache it filled."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from hub_helpers import FakeHub, convert_tiny, patch_hub
from typer.testing import CliRunner

from tale_convert import push
from tale_runtime import ArtifactError, load, new_cache, resolve
from tale_runtime.model import cache_arg

REPO = "alice/tiny-tale"
PROMPT = "The cache keeps"


@pytest.fixture(scope="module")
def art(tiny_model_dir, tmp_path_factory):
    return convert_tiny(tiny_model_dir("llama"), tmp_path_factory.mktemp("hubload") / "art")


@pytest.fixture
def hub(monkeypatch, tmp_path):
    h = FakeHub()
    patch_hub(monkeypatch, h, tmp_path / "hf-cache")
    yield h
    h.close()


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
