"""A local fake of the Hugging Face Hub HTTP API (127.0.0.1 only), and a tiny converted artifact.

The fake implements just what tale-push and snapshot_download call, so the real
huggingface_hub client code runs end to end: create repo/branch, preupload (every file is
"regular", i.e. sent inline in the commit, so no LFS/Xet storage is needed), commit (ndjson),
repo info, tree listing, and resolve (HEAD/GET). Users: "alice" owns the namespace `alice`;
tokens `hf_write` (write) and `hf_read` (read only).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

TOKENS = {"hf_write": "write", "hf_read": "read"}
USER = "alice"
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    private: bool
    branches: dict[str, str] = field(default_factory=dict)  # name -> commit sha
    trees: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit sha -> {path: content}
    log: list[dict] = field(default_factory=list)  # commits: message, revision, files

    def commit(self, branch: str, files: dict[str, bytes], message: str) -> str:
        parent = self.branches.get(branch)
        sha = hashlib.sha1(f"{parent}{message}{len(self.trees)}".encode()).hexdigest()
        self.trees[sha] = {**self.trees.get(parent, {}), **files}
        self.branches[branch] = sha
        self.log.append({"message": message, "revision": branch, "files": sorted(files)})
        return sha

    def resolve(self, rev: str) -> str | None:
        return self.branches.get(rev) or (rev if rev in self.trees else None)


class FakeHub:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self.drop: set[str] = set()  # endpoint names whose connection is closed without an answer
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def files(self, repo_id: str, rev: str = "main") -> dict[str, bytes]:
        repo = self.repos[repo_id]
        return repo.trees[repo.resolve(rev)]


ROUTES = [
    ("POST", "create", r"/api/repos/create"),
    ("POST", "branch", r"/api/models/(?P<repo>[^/]+/[^/]+)/branch/(?P<rev>[^/]+)"),
    ("POST", "preupload", r"/api/models/(?P<repo>[^/]+/[^/]+)/preupload/(?P<rev>[^/]+)"),
    ("POST", "commit", r"/api/models/(?P<repo>[^/]+/[^/]+)/commit/(?P<rev>[^/]+)"),
    ("POST", "validate", r"/api/validate-yaml"),
    ("GET", "info", r"/api/models/(?P<repo>[^/]+/[^/]+)/revision/(?P<rev>[^/]+)"),
    ("GET", "tree", r"/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)"),
    ("GET", "resolve", r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)"),
    ("HEAD", "resolve", r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)"),
]


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, **extra):
        self.status, self.message, self.code, self.extra = status, message, code, extra


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep test output clean
            pass

        def do_GET(self):
            self._dispatch("GET")

        def do_HEAD(self):
            self._dispatch("HEAD")

        def do_POST(self):
            self._dispatch("POST")

        def _dispatch(self, method):
            url = urlsplit(self.path)
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            hub.requests.append((method, url.path))
            for m, name, pattern in ROUTES:  # noqa: B007 (name: the route found, used after the loop)
                match = re.fullmatch(pattern, url.path)
                if m == method and match:
                    break
            else:
                return self._send(404, {"error": f"no route {method} {url.path}"})
            if name in hub.drop:
                self.close_connection = True  # the client sees the server vanish mid-request
                return
            args = {k: unquote(v) for k, v in match.groupdict().items()}
            try:
                status, payload, headers = getattr(self, f"_{name}")(body, parse_qs(url.query), **args)
            except HubError as e:
                return self._send(e.status, {"error": e.message, **e.extra}, {"X-Error-Code": e.code} if e.code else {})
            self._send(status, payload, headers)

        def _send(self, status, payload, headers=None):
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            if not isinstance(payload, bytes):
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        # ---- auth and lookup
        def _writer(self, namespace: str):
            auth = self.headers.get("Authorization", "")
            role = TOKENS.get(auth.removeprefix("Bearer ").strip())
            if role is None:
                raise HubError(401, "Invalid credentials in Authorization header")
            if role != "write" or namespace != USER:
                raise HubError(403, f"You don't have the rights to write to {namespace}")

        def _repo(self, repo_id: str) -> Repo:
            if repo_id not in hub.repos:
                raise HubError(404, "Repository not found", "RepoNotFound")
            return hub.repos[repo_id]

        def _commit_of(self, repo: Repo, rev: str) -> str:
            sha = repo.resolve(rev)
            if sha is None:
                raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
            return sha

        # ---- endpoints
        def _create(self, body, query):
            req = json.loads(body)
            repo_id = f"{req['organization'] or USER}/{req['name']}"
            self._writer(repo_id.split("/")[0])
            if repo_id in hub.repos:
                raise HubError(409, "You already created this model repo", url=f"{hub.url}/{repo_id}")
            repo = hub.repos[repo_id] = Repo(private=req.get("visibility") == "private")
            repo.commit("main", {".gitattributes": GITATTRIBUTES}, "initial commit")
            return 200, {"url": f"{hub.url}/{repo_id}", "name": repo_id}, {}

        def _branch(self, body, query, repo, rev):
            self._writer(repo.split("/")[0])
            r = self._repo(repo)
            if rev in r.branches:
                raise HubError(409, "Reference already exists")
            start = (json.loads(body) if body else {}).get("startingPoint", "main")
            r.branches[rev] = self._commit_of(r, start)
            return 200, {}, {}

        def _preupload(self, body, query, repo, rev):
            self._writer(repo.split("/")[0])
            r = self._repo(repo)
            tree = r.trees[self._commit_of(r, rev)]
            files = [
                {
                    "path": f["path"],
                    "uploadMode": "regular",
                    "shouldIgnore": False,
                    "oid": git_sha1(tree[f["path"]]) if f["path"] in tree else None,
                }
                for f in json.loads(body)["files"]
            ]
            return 200, {"files": files, "commitOid": r.branches.get(rev)}, {}

        def _commit(self, body, query, repo, rev):
            self._writer(repo.split("/")[0])
            r = self._repo(repo)
            self._commit_of(r, rev)
            lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
            header = next(x["value"] for x in lines if x["key"] == "header")
            files = {}
            for x in lines:
                if x["key"] == "file":
                    files[x["value"]["path"]] = base64.b64decode(x["value"]["content"])
                elif x["key"] != "header":
                    raise HubError(400, f"fake hub: unsupported commit operation {x['key']}")
            sha = r.commit(rev, files, header["summary"])
            return 200, {"commitUrl": f"{hub.url}/{repo}/commit/{sha}", "commitOid": sha}, {}

        def _validate(self, body, query):
            return 200, {"errors": [], "warnings": []}, {}

        def _info(self, body, query, repo, rev):
            r = self._repo(repo)
            sha = self._commit_of(r, rev)
            siblings = [{"rfilename": p} for p in sorted(r.trees[sha])]
            return 200, {"id": repo, "modelId": repo, "sha": sha, "private": r.private, "siblings": siblings}, {}

        def _tree(self, body, query, repo, rev):
            r = self._repo(repo)
            tree = r.trees[self._commit_of(r, rev)]
            return (
                200,
                [{"type": "file", "path": p, "size": len(c), "oid": git_sha1(c)} for p, c in sorted(tree.items())],
                {},
            )

        def _resolve(self, body, query, repo, rev, path):
            r = self._repo(repo)
            sha = self._commit_of(r, rev)
            if path not in r.trees[sha]:
                raise HubError(404, "Entry not found", "EntryNotFound")
            data = r.trees[sha][path]
            return 200, data, {"X-Repo-Commit": sha, "ETag": f'"{git_sha1(data)}"'}

    return Handler


def patch_hub(monkeypatch, hub: FakeHub, cache: Path, token: str | None = "hf_write") -> None:
    """Point huggingface_hub at the fake (it reads HF_ENDPOINT etc. at import, hence the constants),
    with an empty cache and no token but `token` (never the machine's own login)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(cache / "no-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(cache / "no-stored-tokens"))
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    if token:
        monkeypatch.setenv("HF_TOKEN", token)


def convert_tiny(base: Path, out: Path) -> Path:
    """A real tale-convert artifact (about 2 MB) of a tiny checkpoint (conftest's tiny_model_dir)."""
    from tale_convert.convert import Options, convert

    convert(
        str(base),
        out,
        Options(group=2, samples=4, seq_len=64, dtype="fp32", key_group=8, value_group=8, residual=8, preset="paper"),
    )
    return out


def fake_hub(monkeypatch, tmp_path: Path):
    """A FakeHub that huggingface_hub talks to for one test (the body of the tests' `hub` fixtures)."""
    h = FakeHub()
    patch_hub(monkeypatch, h, tmp_path / "hf-cache")
    yield h
    h.close()


def converted_tiny(name: str):
    """A module-scoped fixture: the tiny Llama converted once per test module."""

    @pytest.fixture(scope="module")
    def fixture(tiny_model_dir, tmp_path_factory):
        return convert_tiny(tiny_model_dir("llama"), tmp_path_factory.mktemp(name) / "art")

    return fixture
