"""The console layer of the four tale-* CLIs (tale-convert, tale-run, tale-push, tale-eval).

One contract (docs/errors.md): anything a user can cause (bad options, bad files, a corrupt artifact,
an unwritable or full disk) ends in ONE line `error: ...` on stderr and exit code 2, usage errors
included; a bug ends in one line `error: internal error: ...` and exit code 1; TALE_DEBUG=1 shows the
traceback instead. SIGTERM (timeout, kill, docker stop, Slurm) is handled like Ctrl-C, so the
KeyboardInterrupt clean-up paths run; exit code 128 + signal number. The checks that let a command
refuse before any work (device, files to read, places to write) live here too, shared by all four.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from pathlib import Path

import typer

EXIT_USER = 2  # bad input or environment: the user can fix it
EXIT_BUG = 1  # internal error


class UserError(Exception):
    """A problem the user can fix: printed as one `error: ...` line, exit code 2."""


def debug() -> bool:
    return os.environ.get("TALE_DEBUG", "") not in ("", "0")


def one_line(msg: object) -> str:
    return " ".join(str(msg).split())


def fail(msg: str, code: int = EXIT_USER) -> None:
    """Print a one-line error and leave the command with `code`."""
    print(f"error: {one_line(msg)}", file=sys.stderr)
    raise typer.Exit(code)


# -- environment errors: what the disk or the OS refused -------------------------------------------------
_NO_SPACE = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)


def environment_error(e: BaseException) -> str | None:
    """The one-line message for an exception that is the environment's fault (full disk, no permission,
    read-only file system), or None. safetensors and other Rust/C++ writers raise their own types
    with the OS error in the text, hence the text match as well."""
    text = str(e)
    code = e.errno if isinstance(e, OSError) else None
    where = f" ({e.filename})" if isinstance(e, OSError) and e.filename else ""
    if code in _NO_SPACE or "No space left on device" in text or "os error 28" in text or "StorageFull" in text:
        return f"no space left on the device{where}: free some space or write somewhere else"
    if code in _DENIED or "Permission denied" in text or "Read-only file system" in text:
        return f"permission denied{where}: {e.strerror if code else one_line(text)}"
    return None


# -- signals ------------------------------------------------------------------------------------------------
_received: list[int] = []


def _on_signal(signum, frame) -> None:
    if _received:  # a second signal while cleaning up: let the clean-up finish
        return
    _received.append(signum)
    raise KeyboardInterrupt


def install_signal_handlers() -> None:
    """SIGTERM (and SIGHUP) raise KeyboardInterrupt like Ctrl-C, so `except KeyboardInterrupt` and
    `finally` blocks clean up (the converter removes its temp dir, or keeps finished layers for --resume)."""
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            try:
                signal.signal(sig, _on_signal)
            except ValueError:  # not the main thread (an embedding application): leave its handlers alone
                pass


def _quiet_libraries() -> None:
    """Library log lines (datasets' 'Failed to read file', transformers' notices) are not ours to show:
    they would make an error more than one line. The env vars are read when those libraries import."""
    if not debug():
        os.environ.setdefault("DATASETS_VERBOSITY", "critical")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def run_app(app: typer.Typer, argv: list[str] | None = None, user_errors: tuple[type[BaseException], ...] = ()) -> None:
    """Run a typer app as a console script under the contract above.

    user_errors: exception types that mean bad input (one line, exit 2), besides UserError and
    tale_runtime.ArtifactError."""
    from .artifact import ArtifactError

    _received.clear()
    install_signal_handlers()
    _quiet_libraries()
    user_errors = (UserError, ArtifactError, *user_errors)
    try:
        code = app(args=argv, standalone_mode=False)  # typer returns typer.Exit's code, 130 for KeyboardInterrupt
        if code == 128 + signal.SIGINT:
            raise KeyboardInterrupt
    except typer.Exit as e:
        code = e.exit_code
    except (typer.Abort, KeyboardInterrupt):
        sig = _received[0] if _received else signal.SIGINT
        print(f"interrupted ({signal.Signals(sig).name})", file=sys.stderr)
        code = 128 + sig
    except typer.TyperException as e:  # click usage errors: one line instead of a box
        print(f"error: {one_line(e.format_message())} (see --help)", file=sys.stderr)
        code = EXIT_USER
    except user_errors as e:
        if debug():
            raise
        print(f"error: {one_line(e)}", file=sys.stderr)
        code = EXIT_USER
    except Exception as e:
        if debug():
            raise
        env = environment_error(e)
        if env:
            print(f"error: {env}", file=sys.stderr)
            code = EXIT_USER
        else:
            print(
                f"error: internal error: {type(e).__name__}: {one_line(e)} (set TALE_DEBUG=1 for the traceback)",
                file=sys.stderr,
            )
            code = EXIT_BUG
    sys.exit(code or 0)


# -- checks before work -------------------------------------------------------------------------------------
def device(name: str | None, flag: str = "--device"):
    """'auto' (or None), 'cpu', 'cuda', 'cuda:N' -> torch.device; anything else is refused in one line."""
    import torch

    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"{flag} {name!r}: unknown device (use auto, cpu, cuda or cuda:N)") from None
    if dev.type not in ("cpu", "cuda"):
        raise UserError(f"{flag} {name}: not supported (TALE runs on cpu or cuda)")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"{flag} {name}: CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UserError(f"{flag} {name}: only {torch.cuda.device_count()} CUDA device(s)")
    return dev


def read_text(path: Path, flag: str) -> str:
    """A UTF-8 text file with something in it; a missing, unreadable, empty or binary file is refused."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{flag} {path}: no such file")
    if not path.is_file():
        raise UserError(f"{flag} {path}: not a file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot read it ({e.strerror})") from None
    if b"\0" in data:
        raise UserError(f"{flag} {path}: a binary file, expected UTF-8 text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{flag} {path}: not UTF-8 text (byte {e.start})") from None
    if not text.strip():
        raise UserError(f"{flag} {path}: the file is empty")
    return text


def _existing_ancestor(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def writable_dir(path: Path, flag: str) -> None:
    """A directory we may create (or replace) at `path`: its nearest existing ancestor is a directory in
    which we can create one. Tried for real (and removed): os.access says yes to root, and to /proc."""
    import tempfile

    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path}: exists and is not a directory")
    base = path.absolute().parent if path.exists() else _existing_ancestor(path)
    if not base.is_dir():
        raise UserError(f"{flag} {path}: {base} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".tale-probe-", dir=base))
    except OSError as e:
        raise UserError(f"{flag} {path}: {base} is not writable ({e.strerror})") from None


def writable_file(path: Path, flag: str) -> None:
    """A file we will write at the end: its directory exists and it can be opened for writing (tried now,
    a new file removed again), so results are not lost after the work."""
    path = Path(path).expanduser()
    parent = path.absolute().parent
    if not parent.is_dir():
        raise UserError(f"{flag} {path}: directory {parent} does not exist")
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a directory")
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise UserError(f"{flag} {path}: not writable ({e.strerror})") from None
    if not existed:
        path.unlink(missing_ok=True)
