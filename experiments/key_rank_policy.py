"""Low-rank keys' coefficients per layer by calibration key energy (tale-convert --key-rank-policy energy) against the
same count in every layer, on SmolLM2 (--group 3: one joint key basis of 192 directions per layer), at the lowrank
preset's share of the joined keys (7/24 of K n: 56) and below it (6/24: 48).

    python experiments/key_rank_policy.py convert --work out/krp     # out/krp/e56, out/krp/e48
    python experiments/key_rank_policy.py dev --work out/krp         # dev text (5 x 1024 tokens), every variant
    python experiments/key_rank_policy.py loo --work out/krp         # three calibration domains left out
    python experiments/key_rank_policy.py report --work out/krp --names full,k56-uniform,k56-energy

`convert`: the default conversion (tale-convert smollm2 --group 3) with --key-rank-policy energy, at the preset's 7/24
and at 6/24 (the preset's key share replaced for that run; the tensors and the key basis are the same in both, and
the same as the uniform conversion's: only the schedule differs). Variants (experiments/search/key_rank_policy.json):
uniform at 56 and 48 coefficients are `key_rank` overrides of e56 (one count in every layer); energy at 56 is e56 as
converted, energy at 48 is e48 as converted. `dev`: experiments/tale_search.py on the dev text (calib/
corpus_heldout.txt, never calibrated on), prefill 128, chunk 8, with the full 16-bit cache in the same run. `loo`: per
domain L of --domains (experiments/eight_search.py's selection domains), the same two conversions calibrated on the
other five corpora, then the variants on L's own text (4 x 1024 tokens). `report`:
the --names variants on both test texts (4 x 1024 tokens each, the preset table's windows): run once, after the
choice.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = HERE / "search" / "key_rank_policy.json"
ENV = os.environ | {"OMP_NUM_THREADS": "1"}
SHARES = {"e56": 7 / 24, "e48": 6 / 24}  # the preset's key share of K n, per artifact
ON = {"k48-energy": "e48"}  # the variant's artifact (default e56: the same tensors, the energy ranks at 56)


def convert(out: Path, share: float, calib: list[Path] | None = None) -> None:
    """tale-convert smollm2 --group 3 --key-rank-policy energy [--calib ...], the lowrank preset's key share set to
    `share`."""
    if (out / "tale_config.json").is_file():
        return
    from tale_convert import Options
    from tale_convert import convert as run
    from tale_runtime import schedule

    schedule.PRESETS["lowrank"] = replace(schedule.PRESETS["lowrank"], key_rank=(share, 0, 0))
    report = run("smollm2", out, Options(group=3, calib=calib, key_rank_policy="energy"), log=print)
    print(out, "key ranks:", [row[0] for row in report.key_ranks or []], flush=True)


def search(art: Path, text: str, out: Path, windows: int, names: list[str], variants: Path = VARIANTS) -> None:
    """tale_search.py for the `names` (of `variants`) that `out` does not hold yet (eight_search's, rows appended)."""
    from eight_search import run_search

    run_search(art, variants, text, out, windows, names)


def table(work: Path, texts: list[str], names: list[str]) -> None:
    """Measured ratio and ppl delta against the full cache (run on e56: both artifacts hold the same tensors)."""
    rows = {}
    for t in texts:
        for f in sorted(work.glob(f"*-{t}.jsonl")):
            for r in map(json.loads, f.read_text().splitlines()):
                rows[t, r["name"]] = r
    print("| variant | ratio | " + " | ".join(f"ppl Δ {t}" for t in texts) + " |")
    print("|---|---:|" + "---:|" * len(texts))
    for n in names:
        if n == "full":
            continue
        cells = [
            f"{100 * (rows[t, n]['ppl'] / rows[t, 'full']['ppl'] - 1):+.2f}%" if (t, n) in rows else "-" for t in texts
        ]
        ratio = next((rows[t, n]["ratio"] for t in texts if (t, n) in rows), float("nan"))
        print(f"| {n} | {ratio:.2f}x | " + " | ".join(cells) + " |")


def main() -> None:
    if sys.argv[1:2] == ["convert-one"]:  # OUT SHARE CALIB (the loo stage's conversions)
        convert(Path(sys.argv[2]), float(sys.argv[3]), [Path(sys.argv[4])])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("stage", choices=["convert", "dev", "loo", "report"])
    ap.add_argument("--domains", default="corpus_dialogue,corpus_instructional,corpus_science")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--names", default=None, help="comma list of variants (default: all)")
    ap.add_argument("--dev-windows", type=int, default=5)
    ap.add_argument("--test-windows", type=int, default=4)
    a = ap.parse_args()
    names = a.names.split(",") if a.names else list(json.loads(VARIANTS.read_text()))
    if a.stage == "convert":
        for art, share in SHARES.items():
            convert(a.work / art, share)
        return
    if a.stage == "loo":
        import tale_calib

        sys.path.insert(0, str(HERE))
        from domain_shift import corpus_jsonl

        domains = a.domains.split(",")
        for d in domains:
            rest = [p for p in tale_calib.calib_paths() if p.stem != d]
            calib = corpus_jsonl(rest, a.work / d / "calib.jsonl")
            for art, share in SHARES.items():
                subprocess.run(  # a process per conversion: each sets the preset's share for its own run
                    [sys.executable, __file__, "convert-one", str(a.work / d / art), str(share), str(calib)],
                    check=True,
                    env=ENV,
                )
            text = str(next(p for p in tale_calib.calib_paths() if p.stem == d))
            for art in SHARES:
                mine = [x for x in names if ON.get(x, "e56") == art and (x != "full" or art == "e56")]
                if mine:
                    search(a.work / d / art, text, a.work / d / f"{art}-{d}.jsonl", 4, mine)
        for d in domains:
            table(a.work / d, [d], names)
        return
    texts = ["dev"] if a.stage == "dev" else ["botchan", "eb1911"]
    windows = a.dev_windows if a.stage == "dev" else a.test_windows
    for t in texts:
        for art in SHARES:  # each variant on its artifact; the full cache once, on e56
            mine = [x for x in names if ON.get(x, "e56") == art and (x != "full" or art == "e56")]
            if mine:
                search(a.work / art, t, a.work / f"{art}-{t}.jsonl", windows, mine)
    table(a.work, texts, names)


if __name__ == "__main__":
    main()
