"""tale-push: publish a TALE artifact to the Hugging Face Hub, with its model card.

The artifact is checked (manifest + sha256 of every file) before anything touches the network. The
model card (README.md), config.json and modeling_tale.py as this tale-kv ships them (tale_runtime.remote_code:
what lets plain transformers load the artifact) are made in memory and uploaded with a manifest whose checksums
match them: the local artifact is never modified, so a failed push leaves it as it was. Files are
sent with huggingface_hub's create_commit. Hub commits are atomic: a failed commit leaves the repo as
it was.

Artifacts of LARGE_BYTES and more are pushed tensors first and the manifest last (two commits), so
the manifest only appears once every tensor it lists is on the Hub; re-running skips files the Hub
already has.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx2
import typer
from huggingface_hub import CommitOperationAdd, HfApi, get_token
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, HFValidationError, filter_repo_objects, validate_repo_id
from rich.filesize import decimal
from rich.table import Table

from tale_runtime import console, remote_code
from tale_runtime.artifact import MANIFEST, ArtifactError, read_manifest, verify_files

from .card import MARKER, base_model_id, complete_metadata, render_card

LARGE_BYTES = 4 * 2**30
IGNORE = [".*", "*/.*"]  # hidden files and folders (editor, OS, tool state)
INDEX = "model.safetensors.index.json"

app = typer.Typer(
    add_completion=False, pretty_exceptions_enable=False, help="Publish a TALE artifact to the Hugging Face Hub."
)


class PushError(console.UserError):
    """Printed as one line `error: ...`, exit code 2."""


@dataclass
class Plan:
    root: Path
    repo_id: str
    manifest: dict  # as uploaded: README.md's checksum is the card's
    card: str  # README.md as it will be uploaded
    files: list[tuple[str, int]]  # (path in repo, bytes), the files written from memory at their new size
    tensors: list[str]  # tensor files + index: the first commit of a large push
    # config.json and modeling_tale.py as this tale-kv ships them (an older artifact has the base's config.json)
    hub: dict[str, bytes] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(size for _, size in self.files)

    def content(self, name: str) -> bytes | Path:
        """What is uploaded as `name`: the card, the manifest, config.json and modeling_tale.py from memory, every
        other file from disk."""
        if name in self.hub:
            return self.hub[name]
        if name == "README.md":
            return self.card.encode()
        if name == MANIFEST:
            return (json.dumps(self.manifest, indent=2) + "\n").encode()  # as artifact.write_json writes it
        return self.root / name


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
        verify_files(root, manifest, skip=("README.md",))  # the card is rendered afresh and rehashed below
    except ArtifactError as e:
        raise PushError(str(e)) from None
    card = _card(root, manifest, repo_id, _quality(quality))
    hub = remote_code.hub_files(root)  # config.json is verified: it parses
    sums = {n: hashlib.sha256(b).hexdigest() for n, b in [("README.md", card.encode()), *hub.items()]}
    manifest = {**manifest, "files": {**manifest["files"], **sums}}
    names = filter_repo_objects(
        (p.relative_to(root).as_posix() for p in sorted(root.rglob("*")) if p.is_file()),
        ignore_patterns=IGNORE + DEFAULT_IGNORE_PATTERNS,
    )
    p = Plan(root, repo_id, manifest, card, [], [], hub)
    memory = {"README.md", MANIFEST, *hub}
    names = sorted(set(names) | memory)
    p.files = [(n, len(p.content(n)) if n in memory else (root / n).stat().st_size) for n in names]
    p.tensors = [n for n, _ in p.files if n.endswith(".safetensors") or n == INDEX]
    return p


def _quality(path: Path | None) -> dict | None:
    if path is None:
        return None
    try:
        q = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PushError(f"--quality {path}: cannot read a JSON object ({e})") from None
    if not isinstance(q, dict):
        raise PushError(f"--quality {path}: expected a JSON object of metrics")
    if bad := _not_finite(q):
        raise PushError(f"--quality {path}: {bad} is {q_value(q, bad)}, not a measured figure (fix or drop it)")
    return q


def _not_finite(x, at: str = "") -> str | None:
    """The dotted key of the first NaN or infinite number in `x` (JSON parsers accept NaN and Infinity)."""
    if isinstance(x, float) and not math.isfinite(x):
        return at or "the value"
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
    for k, v in items:
        if bad := _not_finite(v, f"{at}[{k}]" if isinstance(k, int) else f"{at}.{k}" if at else str(k)):
            return bad
    return None


def q_value(q, dotted: str) -> str:
    import re

    x = q
    for part in re.findall(r"[^.\[\]]+", dotted):
        x = x[int(part)] if isinstance(x, list) else x[part]
    return str(x)


# git's rules for a branch name (git check-ref-format --branch), which the Hub applies to revisions
_BAD_REF = ("..", "@{", "//", "/.", ".lock/")


def check_revision(revision: str) -> None:
    bad = (
        not revision
        or revision == "@"
        or revision.startswith(("/", "-", "."))
        or revision.endswith(("/", ".", ".lock"))
        or any(s in revision + "/" for s in _BAD_REF)
        or any(c in revision for c in " ~^:?*[\\")
        or any(ord(c) < 32 or ord(c) == 127 for c in revision)
    )
    if bad:
        raise PushError(
            f"invalid --revision {revision!r}: not a valid branch name (no spaces, '..', '~^:?*[\\', "
            "control characters, leading '-' or '.', trailing '/', '.' or '.lock')"
        )
    console.check_text(revision, "--revision")


def _card(root: Path, manifest: dict, repo_id: str, quality: dict | None) -> str:
    """A generated card (or none) is rendered afresh, carrying over its license/tags/language;
    a card the user wrote (no MARKER) is kept, only its metadata completed."""
    readme = root / "README.md"
    old = None
    if readme.is_file():
        data = readme.read_bytes()
        try:
            old = data.decode("utf-8").removeprefix("\ufeff")
        except UnicodeDecodeError as e:
            old = None
            why = f"not UTF-8 text (byte {e.start})"
        else:
            why = "a binary file" if "\0" in old else None
        if why:
            raise PushError(
                f"{readme}: {why}; the model card must be text: restore the generated one (re-convert) or write "
                "your own card there"
            )
    if old is not None and MARKER not in old:
        return complete_metadata(old, manifest)
    return render_card(manifest, base_card=old, quality=quality, repo_id=repo_id)


def show(to, p: Plan, revision: str, private: bool, large: bool) -> None:
    table = Table(title=f"would upload to {p.repo_id} ({revision})", title_justify="left")
    table.add_column("file")
    table.add_column("size", justify="right")
    for name, size in p.files:
        table.add_row(name, decimal(size))
    table.add_row("total", decimal(p.total), style="bold")
    to.print(table)
    how = "tensors first, then the rest" if large else "one commit"
    to.print(f"{'private' if private else 'public'} repo, {how}; nothing was sent (dry run).")
    if to.is_terminal:
        to.rule("README.md")
    else:  # a rule would span the whole (wide) line
        to.print("--- README.md ---")
    to.print(p.card, markup=False, highlight=False, soft_wrap=True)  # the exact text, unwrapped


def _result(p: Plan, revision: str, private: bool, large: bool, url: str | None) -> dict:
    """--json's object."""
    return {
        "repo_id": p.repo_id,
        "revision": revision,
        "dry_run": url is None,
        "url": url,
        "private": private,
        "large": large,
        "files": [{"name": n, "bytes": size} for n, size in p.files],
        "total_bytes": p.total,
        **({"card": p.card} if url is None else {}),
    }


def upload(api: HfApi, p: Plan, revision: str, private: bool, message: str, large: bool) -> str:
    api.create_repo(p.repo_id, repo_type="model", private=private, exist_ok=True)
    if revision != "main":
        api.create_branch(p.repo_id, repo_type="model", branch=revision, exist_ok=True)
    names = [n for n, _ in p.files]
    batches = (
        [(p.tensors, f"{message} (tensors)"), ([n for n in names if n not in p.tensors], message)]
        if large
        else [(names, message)]
    )
    info = None
    for batch, msg in batches:
        ops = [CommitOperationAdd(path_in_repo=n, path_or_fileobj=p.content(n)) for n in batch]
        info = api.create_commit(p.repo_id, ops, commit_message=msg, repo_type="model", revision=revision)
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
        return (
            f"no write access to {repo_id} (403 Forbidden{said}); use a token with write permission on that namespace"
        )
    return f"the Hub refused the push ({status}{said})"


@app.command()
def push(
    artifact: Path = typer.Argument(..., metavar="ARTIFACT", help="TALE artifact directory (tale-convert output)."),
    repo_id: str = typer.Argument(..., metavar="REPO_ID", help="Hub repo id, owner/name. Created if missing."),
    revision: str = typer.Option(
        "main", "--revision", "--branch", help="Branch to push to; created from main if missing."
    ),
    commit_message: str | None = typer.Option(None, "--commit-message", "-m", help="Commit message."),
    private: bool = typer.Option(
        False, "--private", help="Create the repo private (an existing repo keeps its visibility)."
    ),
    token: str | None = typer.Option(
        None, "--token", help="Hub token with write access. Default: HF_TOKEN, then the cached login."
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="List the files and print the card; no network, nothing written."
    ),
    large: bool | None = typer.Option(
        None,
        "--large/--single-commit",
        show_default=False,
        help=f"Tensors first, manifest last (default: from {decimal(LARGE_BYTES)}).",
    ),
    quality: Path | None = typer.Option(
        None, "--quality", help="JSON object of measured figures for the card (e.g. from tale-eval)."
    ),
    as_json: bool = typer.Option(
        False,
        "--json",
        help="Print one JSON object (files, sizes, the commit URL; the card on a dry run), nothing else.",
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing but errors (and --json's object)."),
) -> None:
    """Check ARTIFACT, render its model card (README.md) and upload both to REPO_ID; local files are not changed."""
    check_revision(revision)
    if commit_message is not None:
        console.check_text(commit_message, "--commit-message")
    p = plan(artifact, repo_id, quality)
    large = p.total >= LARGE_BYTES if large is None else large
    out = console.rich_console(quiet=quiet or as_json)
    if dry_run:
        show(out, p, revision, private, large)
        if as_json:
            console.print_json(_result(p, revision, private, large, None))
        return
    token = token or get_token()
    if not token:
        raise PushError("no Hugging Face token: pass --token, set HF_TOKEN or run `hf auth login`")
    if quiet or not sys.stderr.isatty():  # tqdm's bars redraw with \r: noise in a log, and not errors
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    base = base_model_id(p.manifest) or "a local model"
    message = commit_message or f"Upload TALE artifact of {base} with tale-push"
    try:
        url = upload(HfApi(token=token), p, revision, private, message, large)
    except HfHubHTTPError as e:
        raise PushError(hub_error(e, repo_id, revision)) from None
    except (httpx2.TransportError, OSError) as e:  # OSError: also what hf_xet raises
        raise PushError(
            f"upload to {repo_id} failed ({type(e).__name__}: {console.one_line(e)}); each Hub commit "
            "is atomic, so no commit is half-written: run the same command again to finish"
        ) from None
    out.print(f"pushed {artifact} -> {url}", highlight=False)
    if revision == "main":
        out.print(f'run it: tale-run {repo_id} --prompt "Hello"', highlight=False)
    else:
        out.print(f'load it: tale_runtime.load("{repo_id}", revision="{revision}")', highlight=False)
    if as_json:
        console.print_json(_result(p, revision, private, large, url))


def main(argv: list[str] | None = None) -> None:
    """Console script entry: one-line errors, usage errors included (tale_runtime.console)."""
    console.run_app(app, argv)
