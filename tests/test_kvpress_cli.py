"""`tale-eval --kvpress` where kvpress is not installed (the main venv): one line naming `make kvpress-env`, exit code
2, nothing written, before anything loads. The presses themselves are tested in kvpress's venv (tests/kvpress)."""

from __future__ import annotations

import pytest
from tale_helpers import invoke

from tale_eval.cli import main
from tale_eval.kvpress_baselines import available


@pytest.mark.skipif(available(), reason="kvpress is installed here")
def test_kvpress_without_kvpress_is_refused_first(tmp_path):
    out = tmp_path / "r.json"
    # no such artifact and a bad ratio: the missing kvpress is the one error reported
    r = invoke(main, [tmp_path / "no-artifact", "--kvpress", "snapkv:2", "--json", out])
    assert r.exit_code == 2
    assert r.stderr.strip().splitlines() == [f"error: {_missing()}"]
    assert "make kvpress-env" in r.stderr and not r.stdout
    assert list(tmp_path.iterdir()) == []


def _missing() -> str:
    from tale_eval.kvpress_baselines import MISSING

    return MISSING
