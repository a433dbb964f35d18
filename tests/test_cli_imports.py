"""`--help` of every CLI starts without importing torch or transformers (they take seconds to import on a small CPU):
each console script runs as installed, under `python -X importtime`, which lists every module the process imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
HEAVY = ("torch", "transformers")


def imported(argv: list[str]) -> set[str]:
    """Top-level packages a command imports (from -X importtime's lines on stderr: `import time: ... | name`)."""
    r = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("import time:") and "|" in ln]
    assert lines, "python -X importtime wrote nothing"
    return {ln.rsplit("|", 1)[1].strip().split(".")[0] for ln in lines}


@pytest.mark.parametrize("tool", ["tale-eval", "tale-run", "tale-convert"])
def test_help_imports_no_torch(tool):
    mods = imported([str(BIN / tool), "--help"])
    assert "typer" in mods  # the listing works: the CLI's own imports are in it
    assert not mods & set(HEAVY), f"{tool} --help imports {sorted(mods & set(HEAVY))}"
