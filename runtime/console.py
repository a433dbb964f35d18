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
import inspect
import os
import signal
import sys
import typing
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


def _on_unraisable(u) -> None:
    """Our KeyboardInterrupt raised inside a finalizer or callback that cannot pass it on (Python prints it as
    'Exception ignored' and goes on): stay quiet; `check_interrupted` raises it again at the next safe point."""
    if u.exc_type is KeyboardInterrupt and _received:
        return
    sys.__unraisablehook__(u)


def check_interrupted() -> None:
    """Raise KeyboardInterrupt when a signal arrived whose KeyboardInterrupt did not reach us (it was raised where
    Python ignores exceptions): long loops call this at safe points, and before anything is published."""
    if _received:
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
    sys.unraisablehook = _on_unraisable


def _quiet_libraries() -> None:
    """Library log lines (datasets' 'Failed to read file', transformers' notices) are not ours to show:
    they would make an error more than one line. The env vars are read when those libraries import."""
    if not debug():
        os.environ.setdefault("DATASETS_VERBOSITY", "critical")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def options_from(declarations: type):
    """Decorator for a typer command whose options are declared once, as the annotated attributes of one class
    (`name: type = typer.Option(...)`, in --help order): the command gets them as its parameters, after its own
    `context: typer.Context`, and is called with each of them by keyword (`def run(context, **params)`)."""

    def decorate(command):
        keyword = inspect.Parameter.POSITIONAL_OR_KEYWORD
        params = [inspect.Parameter("context", keyword, annotation=typer.Context)]
        for name, annotation in typing.get_type_hints(declarations).items():
            params.append(inspect.Parameter(name, keyword, default=getattr(declarations, name), annotation=annotation))
        command.__signature__ = inspect.Signature(params, return_annotation=None)
        # typer reads the types from the annotations as well as from the signature
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate


def run_app(app: typer.Typer, argv: list[str] | None = None, user_errors: tuple[type[BaseException], ...] = ()) -> None:
    """Run a typer app as a console script under the contract above.

    user_errors: exception types that mean bad input (one line, exit 2), besides UserError and
    tale_runtime.ArtifactError."""
    from .artifact import ArtifactError

    _received.clear()
    if not _stdio_ready():
        sys.exit(EXIT_USER)
    _lossy_stdio()
    install_signal_handlers()
    _quiet_libraries()
    _rich_broken_pipe()
    user_errors = (UserError, ArtifactError, *user_errors)
    try:
        code = app(args=argv, standalone_mode=False)  # typer returns typer.Exit's code, 130 for KeyboardInterrupt
        if code == 128 + signal.SIGINT:
            raise KeyboardInterrupt
        check_interrupted()  # a signal whose KeyboardInterrupt was swallowed on the way: still an interruption
    except typer.Exit as e:
        code = e.exit_code
    except (typer.Abort, KeyboardInterrupt):
        code = _interrupted()
    except SystemExit as e:  # click ends a broken pipe with exit 1 (its stdout wrapped to stay quiet): as below
        code = 128 + signal.SIGPIPE if type(sys.stdout).__name__ == "PacifyFlushWrapper" else e.code
    except BrokenPipeError:  # the reader of stdout went away (`| head`): stop quietly, as `cat` does
        _discard_stdout()
        code = 128 + signal.SIGPIPE
    except typer.TyperException as e:  # click usage errors: one line instead of a box
        print(f"error: {one_line(e.format_message())} (see --help)", file=sys.stderr)
        code = EXIT_USER
    except user_errors as e:
        if debug():
            raise
        print(f"error: {one_line(e)}", file=sys.stderr)
        code = EXIT_USER
    except UnicodeEncodeError as e:  # argv bytes that are not UTF-8 (surrogate escapes), wherever they went
        if debug() or "surrogates not allowed" not in str(e):
            raise
        print("error: an argument is not valid UTF-8 text (bytes from another encoding?)", file=sys.stderr)
        code = EXIT_USER
    except Exception as e:
        if _received:  # our KeyboardInterrupt raised inside library code that reported it as another error (torch
            # turns it into a ValueError while it converts a sequence): the signal is what ended the command
            code = _interrupted()
        elif debug():
            raise
        elif env := environment_error(e):
            print(f"error: {env}", file=sys.stderr)
            code = EXIT_USER
        else:
            print(
                f"error: internal error: {type(e).__name__}: {one_line(e)} (set TALE_DEBUG=1 for the traceback)",
                file=sys.stderr,
            )
            code = EXIT_BUG
    _exit(code)


def _interrupted() -> int:
    """The one line of an interruption, and its exit code (128 + the signal; Ctrl-C when none was recorded)."""
    sig = _received[0] if _received else signal.SIGINT
    print(f"interrupted ({signal.Signals(sig).name})", file=sys.stderr)
    return 128 + sig


def _exit(code) -> None:
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _discard_stdout()
        code = code or 128 + signal.SIGPIPE
    sys.exit(code or 0)


def _discard_stdout() -> None:
    """Point fd 1 at /dev/null, so the interpreter's last flush at exit cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _rich_broken_pipe() -> None:
    """rich ends the process with SystemExit(1) on a broken pipe; route it through run_app's handling instead."""
    from rich.console import Console

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    Console.on_broken_pipe = on_broken_pipe


def _stdio_ready() -> bool:
    """A closed stdout or stderr (`>&-`): hold its file descriptor with /dev/null, so that no file the command
    opens (a shard, the lock) gets descriptor 1 or 2 and receives our output; then refuse a closed stdout in one
    line (what the command prints would be lost). A closed stderr: errors go nowhere, the exit code still tells."""
    closed = []
    for fd in (1, 2):
        try:
            os.fstat(fd)
        except OSError:
            nfd = os.open(os.devnull, os.O_WRONLY)
            if nfd != fd:
                os.dup2(nfd, fd)
                os.close(nfd)
            closed.append(fd)
    if 2 in closed or sys.stderr is None:
        sys.stderr = open(2, "w", closefd=False)
    if 1 in closed or sys.stdout is None:
        print("error: standard output is closed: redirect it to a file or to /dev/null instead", file=sys.stderr)
        return False
    return True


def _lossy_stdio() -> None:
    """A stream whose encoding cannot hold some text (PYTHONIOENCODING=ascii, a C locale) prints '?' for it rather
    than ending the command with a UnicodeEncodeError mid-word."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure") and getattr(stream, "errors", None) == "strict":
            stream.reconfigure(errors="replace")


# -- checks before work -------------------------------------------------------------------------------------
def check_device(name, flag: str = "device"):
    """'auto' (or None), 'cpu', 'cuda', 'cuda:N' (or a torch.device) -> torch.device; anything else, or CUDA on a
    machine without it, raises ValueError naming `flag`. Shared by the CLIs and the Python API (load)."""
    import torch

    if name is None or (isinstance(name, str) and name.strip() in ("", "auto")):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"{flag} {name!r}: unknown device (use auto, cpu, cuda or cuda:N)") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{flag} {name}: not supported (TALE runs on cpu or cuda)")
    if dev.type == "cpu":
        if dev.index not in (None, 0):
            raise ValueError(f"{flag} {name}: there is one CPU device (use cpu)")
        return torch.device("cpu")  # safetensors and others take 'cpu', not 'cpu:0'
    if not torch.cuda.is_available():
        raise ValueError(f"{flag} {name}: CUDA is not available on this machine")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"{flag} {name}: only {torch.cuda.device_count()} CUDA device(s)")
    return dev


def device(name: str | None, flag: str = "--device"):
    """check_device for a CLI option: refused in one line (UserError)."""
    try:
        return check_device(name, flag)
    except ValueError as e:
        raise UserError(str(e)) from None


# the dtype names every CLI and load() accept
DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
}


def check_dtype(x, flag: str = "dtype"):
    """None, a torch floating dtype, or one of DTYPES' names ('bf16', 'fp16', 'fp32', 'bfloat16', 'torch.float16',
    ...) -> torch.dtype or None; anything else raises ValueError."""
    import torch

    if x is None or (isinstance(x, torch.dtype) and x in (torch.bfloat16, torch.float16, torch.float32)):
        return x
    if isinstance(x, str) and x.strip().lower().removeprefix("torch.") in DTYPES:
        return getattr(torch, DTYPES[x.strip().lower().removeprefix("torch.")])
    raise ValueError(f"{flag} {x!r}: use bf16, fp16 or fp32 (or torch.bfloat16, torch.float16, torch.float32)")


def check_text(value: str, flag: str) -> str:
    """A text argument that must be UTF-8 (a prompt, a commit message): argv bytes that are not UTF-8 arrive as
    surrogate escapes, which would fail later, deep inside a tokenizer or an HTTP library."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = value[e.start].encode("utf-8", "surrogateescape")
        raise UserError(f"{flag}: not valid UTF-8 text (byte 0x{bad.hex()} at character {e.start})") from None
    return value


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
        text = data.decode("utf-8").removeprefix("\ufeff")  # a byte-order mark (Windows editors) is not text
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


def inside_artifact(path: Path) -> Path | None:
    """The TALE artifact directory (one holding a tale_config.json manifest) that `path` would be written into,
    or None. A file added there makes the artifact unusable: its loader refuses files the manifest does not list."""
    from .artifact import MANIFEST

    p = Path(path).expanduser().absolute()
    for d in p.parents:
        if (d / MANIFEST).is_file():
            return d
    return None


def replaceable(path: Path) -> bool:
    """Whether a file we write may be replaced whole (written beside it, renamed over it): nothing there yet, or a
    regular file that is not a symlink. /dev/stdout (a symlink, to a regular file under `> file`), a pipe or a
    device is a stream: written to in place, never replaced."""
    path = Path(path).expanduser()
    if not path.exists():
        return not path.is_symlink()
    return path.is_file() and not path.is_symlink()


def writable_file(path: Path, flag: str, overwrite: bool = True) -> None:
    """A file we will write at the end: its directory exists and it can be opened for writing (tried now,
    a new file removed again), so results are not lost after the work. Never inside a TALE artifact; an existing
    file is replaced only with `overwrite`."""
    path = Path(path).expanduser()
    if str(path) in ("", "."):
        raise UserError(f"{flag} is empty: name the file to write")
    if art := inside_artifact(path):
        raise UserError(f"{flag} {path}: inside the TALE artifact {art} (it would no longer load); write it elsewhere")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise UserError(f"{flag} {path}: directory {parent} does not exist")
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a directory")
    existed = path.exists()
    if existed and not overwrite and replaceable(path):
        raise UserError(f"{flag} {path}: exists (pass --overwrite to replace it)")
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise UserError(f"{flag} {path}: not writable ({e.strerror})") from None
    if not existed:
        path.unlink(missing_ok=True)


# -- output: terminals, pipes and log files ----------------------------------------------------------------
WIDE = 1000  # columns of a console that is not a terminal: no table is cut or wrapped to fit 80


def rich_console(stderr: bool = False, quiet: bool = False):
    """A rich Console for a CLI's tables and lines. In a terminal: as rich sizes it. Elsewhere (a pipe, a file, CI
    logs): WIDE columns, so tables keep every cell whole and lines are not wrapped mid-record, and no colour codes.
    `quiet`: prints nothing (--quiet). Made per command, not at import: the terminal test reads the stream of the
    moment."""
    from rich.console import Console

    c = Console(stderr=stderr, soft_wrap=True, highlight=False, quiet=quiet)
    if not c.is_terminal:
        c = Console(stderr=stderr, soft_wrap=True, highlight=False, quiet=quiet, width=WIDE, no_color=True)
    return c


def print_json(obj: dict) -> None:
    """--json: the one JSON object a command writes on stdout (nothing else goes there)."""
    import json

    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
    sys.stdout.flush()
