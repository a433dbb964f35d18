"""The fault run (tests/faults.py, the table of docs/errors.md) under pytest: every case through the installed
console scripts, one subprocess each, and none may show a traceback, an internal error, a silent accept, a
multi-line refusal, a wrong exit code or data loss (a file of the user's removed or changed, an artifact made
unusable). Every case is marked slow (`make test-slow`): a subprocess each, most of an hour of CPU time in all.
`make errors` runs the same cases and rewrites docs/errors.md."""

from __future__ import annotations

import os
import shutil

import faults
import pytest

CASES = faults.all_cases()
ROOT = os.geteuid() == 0 and shutil.which("unshare") is not None


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    w = tmp_path_factory.mktemp("faults")
    faults.build(w)
    return w


def test_case_ids_are_unique():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_fault_case(case, work):
    if case.root_only and not ROOT:
        pytest.skip("needs root for `unshare -m`")
    rows = [faults.run_case(case, work)]
    if case.id == "sigkill-after-2-layers":  # the only case that needs another: --resume after SIGKILL
        rows.append(faults.resume_after_kill(work))
    for r in rows:
        assert not r["problems"], f"{r['id']}: {'; '.join(r['problems'])} | exit {r['code']} | {r['message']}"
