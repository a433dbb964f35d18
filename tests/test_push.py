"""tale-push against a local fake of the Hub (tests/hub_helpers.py): the real huggingface_hub
upload code runs, only 127.0.0.1 is reached."""

from __future__ import annotations

import hashlib
import json
import shutil
from types import SimpleNamespace

import pytest
import yaml
from hub_helpers import converted_tiny, fake_hub
from huggingface_hub import HfApi, ModelCard
from rich.filesize import decimal
from tale_helpers import invoke

from tale_convert import push as push_mod
from tale_convert.card import MARKER, measured_ratio, render_card
from tale_runtime.artifact import MANIFEST, read_manifest

REPO = "alice/tiny-tale"


built = converted_tiny("push")


@pytest.fixture
def art(built, tmp_path):
    """A fresh copy per test, without the converter's card (tale-push renders one)."""
    a = shutil.copytree(built, tmp_path / "art")
    (a / "README.md").unlink()
    return a


@pytest.fixture
def hub(monkeypatch, tmp_path):
    yield from fake_hub(monkeypatch, tmp_path)


@pytest.fixture
def uploads(monkeypatch):
    """Records create_commit's arguments (files by path in the repo), then lets the real call run."""
    calls = []
    real = HfApi.create_commit

    def spy(self, repo_id, operations, **kw):
        calls.append(dict(repo_id=repo_id, files=sorted(op.path_in_repo for op in operations), **kw))
        return real(self, repo_id, operations, **kw)

    monkeypatch.setattr(HfApi, "create_commit", spy)
    return calls


def tale_push(*args):
    return invoke(push_mod.main, args)


def snapshot(path):
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def assert_error(result, text):
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and text in lines[-1], result.stderr
    assert "Traceback" not in result.output


def test_dry_run_lists_files_and_card_without_network(art, hub):
    r = tale_push(art, REPO, "--dry-run", "--private")
    assert r.exit_code == 0, r.output
    local = {p.name: p.stat().st_size for p in art.iterdir()}
    assert {"config.json", "model-00001-of-00001.safetensors", MANIFEST, "tokenizer.json"} <= set(local)
    for name, size in local.items():
        assert any(name in line and decimal(size) in line for line in r.stdout.splitlines()), (name, r.stdout)
    card = render_card(read_manifest(art), repo_id=REPO)
    assert any("README.md" in line and decimal(len(card.encode())) in line for line in r.stdout.splitlines())
    assert card.strip().splitlines()[-1] in r.stdout and "library_name: tale-kv" in r.stdout
    assert "private repo, one commit" in r.stdout
    assert hub.requests == []
    assert not (art / "README.md").exists()  # a dry run writes nothing


def test_dry_run_needs_no_token(art, hub, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    assert tale_push(art, REPO, "--dry-run").exit_code == 0


def test_push_uploads_artifact_and_card(art, hub, uploads):
    before = snapshot(art)
    r = tale_push(art, REPO)
    assert r.exit_code == 0, r.output
    assert f"tale-run {REPO}" in r.stdout
    assert snapshot(art) == before  # the card is rendered in memory: no local file is written
    remote = hub.files(REPO)
    assert set(remote) - {".gitattributes"} == set(before) | {"README.md"}
    assert all(remote[k] == v for k, v in before.items() if k != MANIFEST)
    # the uploaded manifest is the local one with the checksum of the uploaded card
    m_local, m_remote = json.loads(before[MANIFEST]), json.loads(remote[MANIFEST])
    assert m_remote["files"]["README.md"] == hashlib.sha256(remote["README.md"]).hexdigest()
    assert {**m_remote, "files": {**m_remote["files"], "README.md": m_local["files"]["README.md"]}} == m_local
    assert uploads == [
        dict(
            repo_id=REPO,
            files=sorted(set(before) | {"README.md"}),
            repo_type="model",
            revision="main",
            commit_message="Upload TALE artifact of a local model with tale-push",
        )
    ]
    assert not hub.repos[REPO].private
    card = ModelCard(remote["README.md"].decode())
    assert card.data.library_name == "tale-kv" and MARKER in card.text
    assert f'load("{REPO}")' in card.text


def test_pushed_artifact_loads_verified(art, hub, tmp_path):
    """What was uploaded passes the loader's checks: every file hashed, the card's checksum included."""
    from tale_runtime.artifact import verify_files

    assert tale_push(art, REPO).exit_code == 0
    down = tmp_path / "down"
    for name, data in hub.files(REPO).items():
        (down / name).parent.mkdir(parents=True, exist_ok=True)
        (down / name).write_bytes(data)
    assert "README.md" in verify_files(down)


def test_push_to_branch_with_message(art, hub, uploads, tmp_path):
    r = tale_push(art, REPO, "--revision", "dev", "-m", "first cut", "--private")
    assert r.exit_code == 0, r.output
    repo = hub.repos[REPO]
    assert repo.private and set(repo.branches) == {"main", "dev"}
    assert MANIFEST in hub.files(REPO, "dev") and MANIFEST not in hub.files(REPO, "main")
    assert [c["message"] for c in repo.log] == ["initial commit", "first cut"]
    assert uploads[0]["revision"] == "dev" and uploads[0]["commit_message"] == "first cut"
    # the branch exists now: a second push reuses it and only commits what changed (the card, its checksum)
    q = tmp_path / "q.json"
    q.write_text('{"ppl": 12.5}')
    assert tale_push(art, REPO, "--revision", "dev", "-m", "card", "--quality", q).exit_code == 0
    assert repo.log[-1] == {"message": "card", "revision": "dev", "files": ["README.md", MANIFEST]}


def test_file_outside_the_manifest_is_refused(art, hub):
    (art / "extra.txt").write_text("notes")  # the loader would refuse the pushed repo: so does tale-push
    assert_error(tale_push(art, REPO), "extra.txt is not in the manifest")
    assert hub.requests == []


def test_large_push_commits_tensors_before_manifest(art, hub, uploads):
    r = tale_push(art, REPO, "--large")
    assert r.exit_code == 0, r.output
    tensors = ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    assert uploads[0]["files"] == tensors
    assert MANIFEST in uploads[1]["files"] and not set(tensors) & set(uploads[1]["files"])
    first, second = hub.repos[REPO].log[1:]
    assert first["files"] == tensors and first["message"].endswith("(tensors)")
    assert MANIFEST in second["files"] and "README.md" in second["files"]
    assert not set(tensors) & set(second["files"])


def test_large_is_chosen_by_size(art, hub, uploads, monkeypatch):
    monkeypatch.setattr(push_mod, "LARGE_BYTES", 1000)
    assert tale_push(art, REPO).exit_code == 0
    assert len(uploads) == 2 and uploads[0]["commit_message"].endswith("(tensors)")


def test_hidden_files_are_not_uploaded(art, hub):
    (art / ".DS_Store").write_text("x")
    (art / "notes").mkdir()
    (art / "notes" / ".swp").write_text("x")
    assert tale_push(art, REPO).exit_code == 0
    assert not any(name.endswith((".DS_Store", ".swp")) for name in hub.files(REPO))


def test_user_card_is_kept_with_metadata_completed(art, hub):
    (art / "README.md").write_text("---\nlicense: mit\n---\n# My notes\n\nHand-written.\n")
    assert tale_push(art, REPO).exit_code == 0
    card = ModelCard(hub.files(REPO)["README.md"].decode())
    assert "Hand-written." in card.text and MARKER not in card.text
    assert card.data.license == "mit" and card.data.library_name == "tale-kv"
    assert {"tale", "kv-cache-compression", "text-generation"} <= set(card.data.tags)


def test_generated_card_is_regenerated_for_the_repo(built, art, hub):
    shutil.copy(built / "README.md", art / "README.md")  # the converter's card: base license, placeholder id
    assert MARKER in (art / "README.md").read_text()
    assert tale_push(art, REPO, "--quality", _quality(art)).exit_code == 0
    card = ModelCard(hub.files(REPO)["README.md"].decode())
    assert card.data.license == "mit"  # from the base model's card, through the manifest
    assert f"tale-run {REPO}" in card.text and "OWNER/NAME" not in card.text
    assert "| measured_ratio | 5.5 |" in card.text


def _quality(art):
    p = art.parent / "quality.json"
    p.write_text('{"measured_ratio": 5.5}')
    return p


def test_card_front_matter(art):
    m = read_manifest(art)
    m["base"] = {"id": "HuggingFaceTB/SmolLM2-135M-Instruct", "revision": "abc123"}
    m["measured"] = {"ratio": 4.91234, "ppl": {"base": 12.0, "tale": 12.3}}
    base = "---\nlicense: apache-2.0\nlanguage: [en]\ntags: [safetensors, onnx, chat]\n---\n# SmolLM2\n"
    card = render_card(m, base_card=base, quality={"ppl": {"tale": 12.25}}, repo_id=REPO)
    front = yaml.safe_load(card.split("---\n")[1])
    assert front == {
        "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "language": ["en"],
        "library_name": "tale-kv",
        "license": "apache-2.0",
        "pipeline_tag": "text-generation",
        "tags": ["tale", "kv-cache-compression", "text-generation", "llama", "safetensors", "chat"],
    }
    assert ModelCard(card).data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "| 0 | oldest (middle) | 0.9 | 16 / 32 | 2 | 2 |" in card
    assert "| 1 | most recent | 0.1 | 32 / 32 | 4 | 4 |" in card
    # the card leads with the measured ratio (a 1K-token cache's own bytes), the nominal one comes later, unstressed
    measured = f"**KV cache {measured_ratio(m):.2f}x smaller than 16-bit at 1K tokens**"
    assert "first 4 tokens" in card and f"16 bits: {m['nominal_ratio']:.2f}x (the levels' bits alone" in card
    assert card.index(measured) < card.index("## Cache schedule") and f"**{m['nominal_ratio']:.2f}x**" not in card
    assert 1 < measured_ratio(m) < m["nominal_ratio"]
    assert "| ratio | 4.912 |" in card and "| ppl.base | 12 |" in card and "| ppl.tale | 12.25 |" in card
    assert (
        "pip install /path/to/tale-toolkit" in card
        and "not on PyPI" in card
        and f"tale-run {REPO} --prompt" in card
        and "base revision `abc123`" in card
    )


def test_card_of_a_local_base(art, tiny_model_dir):
    m = read_manifest(art)  # converted from a local directory
    card = render_card(m)
    front = ModelCard(card).data
    assert front.base_model is None and front.license == "mit"  # the base README's license
    assert str(tiny_model_dir("llama")) not in card  # no local absolute paths in a public card
    assert "## Measured" not in card and "OWNER/NAME" in card
    del m["base"]["license"]
    assert ModelCard(render_card(m)).data.license == "other"
    prev = "---\nlicense: llama3.1\nlanguage: [de]\ntags: [tale, facebook, gguf]\n---\n# old card\n"
    again = ModelCard(render_card(m, base_card=prev)).data  # a previous card's metadata carries over
    assert again.license == "llama3.1" and again.language == ["de"]
    assert again.tags == ["tale", "kv-cache-compression", "text-generation", "llama", "facebook"]


# ---- errors: one line, exit 2, nothing sent where the problem is local


def test_missing_token(art, hub, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    assert_error(tale_push(art, REPO), "no Hugging Face token")
    assert hub.requests == []


def test_rejected_token(art, hub):
    assert_error(tale_push(art, REPO, "--token", "hf_bogus"), "rejected the token (401")
    assert REPO not in hub.repos


@pytest.mark.parametrize("repo,token", [("bob/tiny-tale", "hf_write"), (REPO, "hf_read")])
def test_no_write_permission(art, hub, repo, token):
    assert_error(tale_push(art, repo, "--token", token), f"no write access to {repo} (403")
    assert repo not in hub.repos


@pytest.mark.parametrize(
    "repo,text",
    [("alice/bad..name", "invalid repo id"), ("a/b/c", "invalid repo id"), ("tiny-tale", "use 'owner/name'")],
)
def test_malformed_repo_id(art, hub, repo, text):
    assert_error(tale_push(art, repo), text)
    assert hub.requests == []


def test_corrupt_artifact_is_refused_before_any_network_call(art, hub):
    shard = art / "model-00001-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(data)
    assert_error(tale_push(art, REPO), "checksum mismatch for model-00001-of-00001.safetensors")
    assert hub.requests == []


def test_missing_dir_and_non_artifact(art, hub, tmp_path):
    assert_error(tale_push(tmp_path / "nope", REPO), "not a directory")
    assert_error(tale_push(tmp_path, REPO), "not a TALE artifact")
    (art / "config.json").unlink()
    assert_error(tale_push(art, REPO), "config.json is missing")
    assert hub.requests == []


def test_network_failure_mid_upload(art, hub, monkeypatch):
    monkeypatch.setattr("huggingface_hub.utils._http.time", SimpleNamespace(sleep=lambda s: None))  # no backoff waits
    hub.drop = {"commit"}
    before = snapshot(art)
    assert_error(tale_push(art, REPO), "failed (RemoteProtocolError")
    assert snapshot(art) == before  # a failed push changes no local file
    assert hub.repos[REPO].log == [{"message": "initial commit", "revision": "main", "files": [".gitattributes"]}]
    hub.drop = set()  # the network is back: the same command finishes the job
    assert tale_push(art, REPO).exit_code == 0
    assert MANIFEST in hub.files(REPO)


@pytest.mark.slow
def test_dry_run_of_smollm2(smollm2_artifact, hub):
    r = tale_push(smollm2_artifact, REPO, "--dry-run")
    assert r.exit_code == 0, r.output
    assert hub.requests == []
    card = r.stdout.split("--- README.md ---\n", 1)[1]  # after the file table, the card as it would be uploaded
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and front["license"] == "apache-2.0"
    # the lowrank preset at --group 3: R = 3 * 64 at full rank, 56 key coefficients (7/24 of the 3 heads' 192 dims)
    assert "| 0 | oldest (middle) | 0.95 | 192 / 192 | 3 | 4 (56 coefficients of 192) |" in card
    assert "| 1 | level 1 | 0.05 | 192 / 192 | 4 | 4 |" in card and "key_basis.safetensors" in card


def test_json_and_quiet(art, hub):
    r = tale_push(art, REPO, "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    (line,) = r.stdout.splitlines()  # one JSON object, the card inside it
    d = json.loads(line)
    assert d["dry_run"] and d["url"] is None and d["repo_id"] == REPO and "library_name: tale-kv" in d["card"]
    assert {"modeling_tale.py", "config.json", MANIFEST, "README.md"} <= {f["name"] for f in d["files"]}
    assert d["total_bytes"] == sum(f["bytes"] for f in d["files"]) and hub.requests == []
    r = tale_push(art, REPO, "--quiet")
    assert (r.exit_code, r.stdout, r.stderr) == (0, "", "")
    assert MANIFEST in hub.files(REPO)
    d = json.loads(tale_push(art, REPO, "--json", "--quiet").stdout)
    assert not d["dry_run"] and REPO in d["url"] and "card" not in d
