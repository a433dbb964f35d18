"""The packages import one way: tale_convert and tale_eval may import tale_runtime, never the reverse; the runtime
imports no kernel module (tale_kernels registers itself as a backend); the converter imports nothing of tale_eval.
Read from the sources (every import statement, function-local ones included), not from a running process."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package -> its source directory (pyproject.toml's package-dir)
DIRS = {"tale_runtime": "runtime", "tale_convert": "tale_convert", "tale_eval": "eval", "tale_kernels": "kernels"}
NEVER = {
    "tale_runtime": {"tale_convert", "tale_eval", "tale_kernels"},
    "tale_convert": {"tale_eval", "tale_kernels"},
    "tale_kernels": {"tale_convert", "tale_eval"},
}


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("package", list(NEVER))
def test_imports_point_one_way(package):
    files = sorted((ROOT / DIRS[package]).rglob("*.py"))
    assert files
    wrong = {f.relative_to(ROOT).as_posix(): sorted(imported_packages(f) & NEVER[package]) for f in files}
    assert not {f: w for f, w in wrong.items() if w}, f"{package} imports what imports it"
