"""Leave-one-domain-out: how a schedule's loss grows on text of a style the calibration did not cover.

For each calibration corpus L (calib/corpus_*.txt), convert SmolLM2 with the other five (`--preset PRESET`),
then measure decode-mode ppl on L's own text with experiments/tale_search.py for every variant of VARIANTS.json
("full" is the 16-bit cache). The same variants on the artifact calibrated with all six corpora, on the same
windows, are the in-domain control. Neither the dev text nor the test texts are read: a selection made on this
table uses only calibration text.

    python experiments/domain_shift.py VARIANTS.json --work /tmp/loo --preset lowrank --jobs 2
    python experiments/domain_shift.py VARIANTS.json --work /tmp/loo-s01 --convert-args "--shrink 0.1"

Writes WORK/DOMAIN/{loo,in}.jsonl (a re-run adds only the variants they lack) and prints a markdown table (delta against "full" on the same windows).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import tale_calib

HERE = Path(__file__).resolve().parent


def convert(out: Path, calib: list[Path] | None, preset: str, extra: list[str]) -> None:
    if (out / "tale_config.json").is_file():
        return
    cmd = ["tale-convert", "smollm2", "--group", "3", "--preset", preset, "--out", str(out), "--overwrite", *extra]
    for f in calib or []:
        cmd += ["--calib", str(f)]
    subprocess.run(cmd, check=True, env=os.environ | {"OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)


def corpus_jsonl(files: list[Path], out: Path) -> Path:
    """The documents of `files` (one record each), as tale-convert --calib reads them."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for p in files:
            for d in tale_calib.documents(p):
                f.write(json.dumps({"text": d}) + "\n")
    return out


def search(art: Path, variants: str, text: Path, out: Path, windows: int) -> subprocess.Popen | None:
    """tale_search.py for the variants that `out` does not hold yet (rows are appended)."""
    todo = [n for n in json.loads(Path(variants).read_text()) if n not in rows(out)]
    if not todo:
        return None
    cmd = [sys.executable, str(HERE / "tale_search.py"), str(art), variants, "--out", str(out), "--threads", "1"]
    cmd += ["--no-passkey", "--windows", str(windows), "--text", str(text), "--only", ",".join(todo)]
    return subprocess.Popen(cmd, env=os.environ | {"OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)


def rows(path: Path) -> dict[str, dict]:
    return {r["name"]: r for r in map(json.loads, path.read_text().splitlines())} if path.is_file() else {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("variants")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--preset", default="lowrank")
    ap.add_argument(
        "--convert-args", default="", help="more tale-convert options for every conversion, e.g. '--shrink 0.1'"
    )
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", default=None, help="comma list of corpora (file stems), default all six")
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--left-out-only", action="store_true", help="skip the in-domain control (its artifact and rows)")
    args = ap.parse_args()
    corpora = tale_calib.calib_paths()
    if args.only:
        corpora = [p for p in corpora if p.stem in args.only.split(",")]
    work = args.work
    full_art = work / "all"
    if not args.table_only:
        extra = args.convert_args.split()
        if not args.left_out_only:
            convert(full_art, None, args.preset, extra)
        jobs: list[tuple[Path, Path, Path]] = []  # (artifact, text, rows file)
        for L in corpora:
            rest = [p for p in tale_calib.calib_paths() if p != L]
            art = work / L.stem / "art"
            convert(art, [corpus_jsonl(rest, work / L.stem / "calib.jsonl")], args.preset, extra)
            jobs.append((art, L, work / L.stem / "loo.jsonl"))
            if not args.left_out_only:
                jobs.append((full_art, L, work / L.stem / "in.jsonl"))
        running: list[subprocess.Popen] = []
        for art, L, out in jobs:
            while len(running) >= args.jobs:
                running.pop(0).wait()
            p = search(art, args.variants, L, out, args.windows)
            if p:
                running.append(p)
        for p in running:
            p.wait()
    names = list(json.loads(Path(args.variants).read_text()))
    cols = [n for n in names if n != "full"]
    print("| left-out corpus | calibration | " + " | ".join(cols) + " |")
    print("|---|---|" + "---:|" * len(cols))
    ratio: dict[str, list[float]] = {n: [] for n in cols}
    delta: dict[tuple[str, str], list[float]] = {}
    for L in corpora:
        for kind, label in (("in", "all six (in-domain)"), ("loo", "the other five")):
            r = rows(work / L.stem / f"{kind}.jsonl")
            if "full" not in r:
                continue
            cells = []
            for n in cols:
                if n in r:
                    d = 100 * (r[n]["ppl"] / r["full"]["ppl"] - 1)
                    delta.setdefault((kind, n), []).append(d)
                    ratio[n].append(r[n]["ratio"])
                    cells.append(f"{d:+.2f}%")
                else:
                    cells.append("-")
            print(f"| {L.stem.removeprefix('corpus_')} | {label} | " + " | ".join(cells) + " |")

    def summary(label: str, kind: str, f) -> None:
        cells = [f"{f(delta[kind, n]):+.2f}%" if delta.get((kind, n)) else "-" for n in cols]
        print(f"| **{label}** | | " + " | ".join(cells) + " |")

    summary("mean, in-domain", "in", lambda v: sum(v) / len(v))
    summary("mean, left out", "loo", lambda v: sum(v) / len(v))
    summary("worst, left out", "loo", max)
    print(
        "| **ratio** (mean) | | " + " | ".join(f"{sum(v) / len(v):.2f}x" if v else "-" for v in ratio.values()) + " |"
    )


if __name__ == "__main__":
    main()
