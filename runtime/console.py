"""Console-script plumbing shared by the tale-* CLIs: every error is one `error: ...` line."""

from __future__ import annotations

import os
import sys

import typer


def fail(msg: str, code: int = 2) -> None:
    """Print a one-line error and leave the command with `code`."""
    print(f"error: {' '.join(str(msg).split())}", file=sys.stderr)
    raise typer.Exit(code)


def run_app(app: typer.Typer, argv: list[str] | None = None, *, internal_errors: bool = False) -> None:
    """Run a typer app as a console script; usage errors are one line too (click would print a box).

    internal_errors: also turn unexpected exceptions into one line, exit 1 (TALE_DEBUG=1 re-raises).
    """
    try:
        code = app(args=argv, standalone_mode=False)
    except typer.Exit as e:
        code = e.exit_code
    except typer.Abort:  # Ctrl-C
        print("aborted", file=sys.stderr)
        code = 130
    except typer.TyperException as e:  # usage errors
        print(f"error: {' '.join(e.format_message().split())}", file=sys.stderr)
        code = getattr(e, "exit_code", 2)
    except Exception as e:
        if not internal_errors or os.environ.get("TALE_DEBUG"):
            raise
        print(f"error: internal error: {type(e).__name__}: {e} (set TALE_DEBUG=1 for the traceback)", file=sys.stderr)
        code = 1
    sys.exit(code or 0)
