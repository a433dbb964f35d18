"""experiments/frontier_merge.py reads a frontier table back (the record when the JSON files of earlier runs are
gone): the table it reads writes out again unchanged, merged JSON rows join it, and a JSON measured against
another full cache is refused."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tale_eval import frontier

# each test runs the script in a fresh process that imports torch and matplotlib (make test-slow)
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CONFIG = dict(texts=["a", "b"], ref_ppl={"a": 31.71666, "b": 20.24781}, windows=1, ctx=1024, prefill=128, chunk=8)
CONFIG |= dict(dtype="bf16", passkey_samples=3, seconds=10.0, model="tiny", artifact="art")


def row(family, setting, ratio, da, db, pk=None, s=5.0):
    r = dict(family=family, setting=setting, ratio=ratio, delta_pct={"a": da, "b": db}, seconds=s)
    return r | ({"passkey": pk, "passkey_ratio": ratio * 1.05} if pk is not None else {})


def merge(tmp_path, *files):
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "experiments" / "frontier_merge.py"), str(out), *map(str, files)]
    return subprocess.run(cmd, capture_output=True, text=True), out.with_suffix(".md")


def test_a_table_reads_back_and_takes_new_rows(tmp_path):
    rows = [row("full", "16-bit K+V", 1.0, 0.0, 0.0, 1.0), row("tale", "x=1|y", 6.4412, 4.711, 7.76, 2 / 3)]
    rows.append(row("kivi", "bits 2", 4.7, 25.7, 17.88))  # no pass-key cells
    table = tmp_path / "t.md"
    table.write_text(frontier.markdown(rows, CONFIG))
    full = dict(rows[0], ppl={"a": 31.71666, "b": 20.24781})
    new = tmp_path / "new.json"
    new.write_text(json.dumps({"config": CONFIG, "results": [full, row("tale", "key_rope=pre", 6.02, 4.1, 5.2, 1.0)]}))
    res, out = merge(tmp_path, table, new)
    assert res.returncode == 0, res.stderr
    want = frontier.markdown(
        [rows[0], rows[1] | {"setting": "x=1/y"}, rows[2], json.loads(new.read_text())["results"][1]], CONFIG
    )
    assert out.read_text() == want
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"config": CONFIG | {"ref_ppl": {"a": 30.0, "b": 20.24781}}, "results": [full]}))
    res, _ = merge(tmp_path, table, bad)
    assert res.returncode != 0 and "differs from the table's" in res.stderr
    notes = tmp_path / "notes.md"
    notes.write_text("# notes\n\nno table here\n")
    res, _ = merge(tmp_path, notes, new)
    assert res.returncode != 0 and "not a frontier table" in res.stderr and "Traceback" not in res.stderr


def test_the_rows_of_a_stopped_run_join_with_deltas_against_its_full_row(tmp_path):
    ppl = {"a": 31.71666, "b": 20.24781}
    full = row("full", "16-bit K+V", 1.0, 0.0, 0.0, 1.0) | {"ppl": ppl}
    done = tmp_path / "done.json"
    done.write_text(json.dumps({"config": CONFIG, "results": [full, row("kivi", "bits 4", 3.0, 0.8, 0.7, 1.0)]}))
    less = row("less", "window 166", 5.74, 0.0, 0.0, 0.0) | {"ppl": {"a": 2 * ppl["a"], "b": ppl["b"] * 1.1}}
    partial = tmp_path / "stopped.json.partial"
    partial.write_text("\n".join(json.dumps({k: v for k, v in r.items() if k != "delta_pct"}) for r in (full, less)))
    res, out = merge(tmp_path, done, partial)
    assert res.returncode == 0, res.stderr
    cells = [line for line in out.read_text().splitlines() if line.startswith("| less ")]
    assert len(cells) == 1 and "+100.00%" in cells[0] and "+10.00%" in cells[0]
    assert out.read_text().count("| full ") == 1
    res, _ = merge(tmp_path, partial)  # no finished run: no settings for the table's footer
    assert res.returncode != 0 and "finished FILE.json or a table" in res.stderr
    other = tmp_path / "other.json.partial"
    other.write_text(json.dumps(full | {"ppl": {"a": 31.768, "b": 20.190}}))
    res, _ = merge(tmp_path, done, other)
    assert res.returncode != 0 and "differs from the first file's" in res.stderr
