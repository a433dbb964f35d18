"""tale-push: publish a TALE artifact to the Hugging Face Hub, with its model card.

The artifact is checked (manifest + sha256 of every tensor file) before anything touches the
network, README.md is (re)written as a model card, then the folder is uploaded with
huggingface_hub. Hub commits are atomic: a failed commit leaves the repo as it was.

Artifacts of LARGE_BYTES and more are pushed tensors first and the manifest last. A long upload
may land in several commits (huggingface_hub commits big folders in batches, and re-running
skips what is already there), so the manifest only appears once every tensor it lists is on
the Hub; readers check those tensors' sha256 anyway.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx2
import typer
from huggingface_hub import HfApi, get_token
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, HFValidationError, filter_repo_objects, validate_repo_id
from rich.console import Console
from rich.filesize import decimal
from rich.table import Table

from tale_runtime.artifact import ArtifactError, read_manifest, verify_files

from .card import MARKER, base_model_id, complete_metadata, render_card

LARGE_BYTES = 4 * 2**30
IGNORE = [".*", "*/.*"]  # hidden files and folders (editor, OS, tool state)
INDEX = "model.safetensors.index.json"

app = typer.Typer(add_completion=False, help="Publish a TALE artifact to the Hugging Face Hub.")
out = Console()
err = Console(stderr=True)


class PushError(Exception):
    """Printed as one line `error: ...`, exit code 2."""


@dataclass
class Plan:
    root: Path
    repo_id: str
    manifest: dict
    card: str  # README.md as it will be uploaded
    files: list[tuple[str, int]]  # (path in repo, bytes), README.md at its new size
    tensors: list[str]  # tensor files + index: the first commit of a large push

    @property
    def total(self) -> int:
        return sum(size for _, size in self.files)


def check_repo_id(repo_id: str) -> None:
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise PushError(f"invalid repo id {repo_id!r}: {e}") from None
    if repo_id.count("/") != 1:
        raise PushError(f"invalid repo id {repo_id!r}: use 'owner/name' (tale-run loads it by that id)")


def plan(root: Path, repo_id: str, quality: Path | None = None) -> Plan:
    """Everything the push will do, computed locally: no network, nothing written."""
    check_repo_id(repo_id)
    try:
        manifest = read_manifest(root)
        verify_files(root, manifest)
    except ArtifactError as e:
        raise PushError(str(e)) from None
    if not (root / "config.json").is_file():
        raise PushError(f"{root}: config.json is missing (incomplete artifact; re-run tale-convert)")
    card = _card(root, manifest, repo_id, _quality(quality))
    names = filter_repo_objects(
        (p.relative_to(root).as_posix() for p in sorted(root.rglob("*")) if p.is_file()),
        ignore_patterns=IGNORE + DEFAULT_IGNORE_PATTERNS,
    )
    files = [(n, (root / n).stat().st_size) for n in names if n != "README.md"]
    files.append(("README.md", len(card.encode())))
    tensors = [n for n, _ in files if n in manifest["files"] or n == INDEX]
    return Plan(root, repo_id, manifest, card, sorted(files), tensors)


def _quality(path: Path | None) -> dict | None:
    if path is None:
        return None
    try:
        q = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PushError(f"--quality {path}: cannot read a JSON object ({e})") from None
    if not isinstance(q, dict):
        raise PushError(f"--quality {path}: expected a JSON object of metrics")
    return q


def _card(root: Path, manifest: dict, repo_id: str, quality: dict | None) -> str:
    """A generated card (or none) is rendered afresh, carrying over its license/tags/language;
    a card the user wrote (no MARKER) is kept, only its metadata completed."""
    readme = root / "README.md"
    old = readme.read_text(encoding="utf-8") if readme.is_file() else None
    if old is not None and MARKER not in old:
        return complete_metadata(old, manifest)
    return render_card(manifest, base_card=old, quality=quality, repo_id=repo_id)


def show(p: Plan, revision: str, private: bool, large: bool) -> None:
    table = Table(title=f"would upload to {p.repo_id} ({revision})", title_justify="left")
    table.add_column("file")
    table.add_column("size", justify="right")
    for name, size in p.files:
        table.add_row(name, decimal(size))
    table.add_row("total", decimal(p.total), style="bold")
    out.print(table)
    how = "tensors first, then the rest" if large else "one commit"
    out.print(f"{'private' if private else 'public'} repo, {how}; nothing was sent (dry run).")
    out.rule("README.md")
    out.print(p.card, markup=False, highlight=False, soft_wrap=True)  # the exact text, unwrapped


def write_card(p: Plan) -> None:
    readme = p.root / "README.md"
    try:
        if not readme.is_file() or readme.read_text(encoding="utf-8") != p.card:
            readme.write_text(p.card, encoding="utf-8")
    except OSError as e:
        raise PushError(f"cannot write the model card {readme}: {e.strerror}") from None


def upload(api: HfApi, p: Plan, revision: str, private: bool, message: str, large: bool) -> str:
    api.create_repo(p.repo_id, repo_type="model", private=private, exist_ok=True)
    if revision != "main":
        api.create_branch(p.repo_id, repo_type="model", branch=revision, exist_ok=True)
    # fresh pattern lists: upload_folder extends ignore_patterns in place
    common = dict(repo_id=p.repo_id, repo_type="model", folder_path=p.root, revision=revision)
    if large:
        api.upload_folder(**common, allow_patterns=list(p.tensors), commit_message=f"{message} (tensors)")
        info = api.upload_folder(**common, ignore_patterns=IGNORE + p.tensors, commit_message=message)
    else:
        info = api.upload_folder(**common, ignore_patterns=list(IGNORE), commit_message=message)
    return info.commit_url


def hub_error(e: HfHubHTTPError, repo_id: str, revision: str) -> str:
    if isinstance(e, RevisionNotFoundError):
        return f"revision {revision!r} not found in {repo_id}"
    if isinstance(e, RepositoryNotFoundError):
        return f"{repo_id}: repo not found or not visible to this token"
    status = e.response.status_code if e.response is not None else None
    said = (e.server_message or str(e)).strip().splitlines()
    said = f": {said[0]}" if said else ""
    if status == 401:
        return f"the Hub rejected the token (401 Unauthorized{said}); log in again (`hf auth login`) or pass --token"
    if status == 403:
        return f"no write access to {repo_id} (403 Forbidden{said}); use a token with write permission on that namespace"
    return f"the Hub refused the push ({status}{said})"


@app.command()
def push(
    artifact: Path = typer.Argument(..., metavar="ARTIFACT", help="TALE artifact directory (tale-convert output)."),
    repo_id: str = typer.Argument(..., metavar="REPO_ID", help="Hub repo id, owner/name. Created if missing."),
    revision: str = typer.Option("main", "--revision", "--branch",
                                 help="Branch to push to; created from main if missing."),
    commit_message: str | None = typer.Option(None, "--commit-message", "-m", help="Commit message."),
    private: bool = typer.Option(False, "--private",
                                 help="Create the repo private (an existing repo keeps its visibility)."),
    token: str | None = typer.Option(None, "--token",
                                     help="Hub token with write access. Default: HF_TOKEN, then the cached login."),
    dry_run: bool = typer.Option(False, "--dry-run",
                                 help="List the files and print the card; no network, nothing written."),
    large: bool | None = typer.Option(None, "--large/--single-commit", show_default=False,
                                      help=f"Tensors first, manifest last (default: from {decimal(LARGE_BYTES)})."),
    quality: Path | None = typer.Option(None, "--quality",
                                        help="JSON object of measured figures for the card (e.g. from tale-eval)."),
) -> None:
    """Check ARTIFACT, write its model card (README.md) and upload it to REPO_ID."""
    try:
        err.print(f"checking {artifact} ...", highlight=False)
        p = plan(artifact, repo_id, quality)
        large = p.total >= LARGE_BYTES if large is None else large
        if dry_run:
            show(p, revision, private, large)
            return
        token = token or get_token()
        if not token:
            raise PushError("no Hugging Face token: pass --token, set HF_TOKEN or run `hf auth login`")
        write_card(p)
        base = base_model_id(p.manifest) or "a local model"
        message = commit_message or f"Upload TALE artifact of {base} with tale-push"
        try:
            url = upload(HfApi(token=token), p, revision, private, message, large)
        except HfHubHTTPError as e:
            raise PushError(hub_error(e, repo_id, revision)) from None
        except (httpx2.TransportError, OSError) as e:  # OSError: also what hf_xet raises
            raise PushError(f"upload to {repo_id} failed ({type(e).__name__}: {e}); each Hub commit is atomic, "
                            "so no commit is half-written: run the same command again to finish") from None
    except PushError as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    out.print(f"pushed {artifact} -> {url}", highlight=False)
    if revision == "main":
        out.print(f'run it: tale-run {repo_id} --prompt "Hello"', highlight=False)
    else:
        out.print(f'load it: tale_runtime.load("{repo_id}", revision="{revision}")', highlight=False)


def main() -> None:
    app()
