"""A schedule beyond 8x chosen on development data only, then reported (not tuned) on the test texts, on calibration
domains left out of the calibration and on RULER retrieval at 4K.

Stages (each appends to WORK, a re-run adds only what is missing):

    python experiments/eight_search.py dev ART VARIANTS.json --work out/eight          # dev text, every variant
    python experiments/eight_search.py loo ART VARIANTS.json --work out/eight --domains corpus_dialogue,...
    python experiments/eight_search.py choose ART VARIANTS.json --work out/eight --domains corpus_dialogue,...
    python experiments/eight_search.py report ART VARIANTS.json --work out/eight --names base,NAME \\
        --domains corpus_encyclopedic,...                                         # test texts, report domains
    python experiments/eight_search.py retrieval ART VARIANTS.json --work out/eight --names base,NAME

`dev`: experiments/tale_search.py on the dev text (calib/corpus_heldout.txt, never calibrated on), --dev-windows x
1024 tokens, prefill 128, chunk 8, with "full" (the 16-bit cache) in the same run. `loo`: per domain L, a default
conversion calibrated on the other five corpora (experiments/domain_shift.py's), then the same on L's own text
(--loo-windows windows; --convert-args: more tale-convert options for these conversions, e.g. the --samples /
--seq-len of an artifact calibrated otherwise). `choose` prints the table and applies the rule, fixed before any test
text is read: the highest measured dev ratio among the variants within --limit on the dev text less --margin and within
--limit on every left-out selection domain. `report`: the --names variants on both test texts (4 x 1024 tokens each,
prefill 128, chunk 8: the windows of docs/quality.md's preset table) and on the --domains left out (not used by
`choose`).
`retrieval`: experiments/retrieval_layers.py at 4K (--samples per family, the NIAH families by default: the full
cache scores 0 on VT and CWE at 4K on SmolLM2) with the --names variants against the full cache.
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
sys.path.insert(0, str(HERE))
from domain_shift import convert, corpus_jsonl, rows  # noqa: E402

ENV = os.environ | {"OMP_NUM_THREADS": "1"}
R = 192  # SmolLM2 at --group 3: the latent rank of a group (3 KV heads x 64)


def run_search(art: Path, variants: Path, text: str, out: Path, windows: int, names: list[str]) -> None:
    """tale_search.py for the `names` that `out` does not hold yet (one process, rows appended)."""
    todo = [n for n in names if n not in rows(out)]
    if not todo:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(HERE / "tale_search.py"), str(art), str(variants), "--out", str(out), "--threads", "1"]
    cmd += ["--no-passkey", "--windows", str(windows), "--chunk", "8", "--text", text, "--only", ",".join(todo)]
    subprocess.run(cmd, check=True, env=ENV)


def domain_text(stem: str) -> Path:
    return next(p for p in tale_calib.calib_paths() if p.stem == stem)


def loo_artifact(work: Path, stem: str, extra: list[str] | None = None) -> Path:
    """The default conversion calibrated on every corpus but `stem` (domain_shift.py's layout); `extra`: more
    tale-convert options (e.g. --samples / --seq-len: those of the artifact under test)."""
    rest = [p for p in tale_calib.calib_paths() if p.stem != stem]
    art = work / stem / "art"
    convert(art, [corpus_jsonl(rest, work / stem / "calib.jsonl")], "lowrank", extra or [])
    return art


def delta(r: dict, name: str) -> float | None:
    return 100 * (r[name]["ppl"] / r["full"]["ppl"] - 1) if name in r and "full" in r else None


def variant_string(kw: dict) -> str:
    """A variants-file entry in tale-eval's --tale-variants syntax (what retrieval_layers.py reads)."""
    parts = []
    for k, v in kw.items():
        if k == "r0" and isinstance(v, int):
            v = round(v / R + 5e-4, 3)  # a rank as the fraction that rounds to it (128: 0.667)
        if k in ("key_meta", "value_meta"):
            v = v.replace("/", "-")
        parts.append(f"{k}={'/'.join(str(x) for x in v) if isinstance(v, list) else v}")
    return ",".join(parts) or "-"


def choose(work: Path, names: list[str], domains: list[str], limit: float, margin: float) -> str | None:
    dev = rows(work / "dev.jsonl")
    loo = {d: rows(work / d / "loo.jsonl") for d in domains}
    short = [d.removeprefix("corpus_") for d in domains]
    print("| variant | ratio (dev) | Δ dev | " + "".join(f"Δ {s} (left out) | " for s in short) + "worst |")
    print("|---|---:|---:|" + "---:|" * (len(domains) + 1))
    best = None
    for n in names:
        if n == "full" or n not in dev:
            continue
        d = delta(dev, n)
        ds = [delta(loo[x], n) for x in domains]
        cells = [f"{x:+.2f}%" if x is not None else "-" for x in ds]
        known = [x for x in ds if x is not None]
        worst = max(known) if known else None
        ok = d <= limit - margin and len(known) == len(domains) and (worst is None or worst <= limit)
        print(
            f"| {n} | {dev[n]['ratio']:.2f}x | {d:+.2f}% | "
            + "".join(c + " | " for c in cells)
            + f"{'' if worst is None else f'{worst:+.2f}%'}{' ok' if ok else ''} |"
        )
        if ok and (best is None or dev[n]["ratio"] > dev[best]["ratio"]):
            best = n
    print(f"\nchosen (largest dev ratio within the rule): {best}")
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("stage", choices=["dev", "loo", "choose", "report", "retrieval"])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("variants", type=Path)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--domains", default="corpus_dialogue,corpus_instructional,corpus_science")
    ap.add_argument(
        "--convert-args",
        default="",
        help="more tale-convert options for the left-out conversions (loo, report), e.g. '--samples 73 --seq-len 512'",
    )
    ap.add_argument("--names", default=None, help="comma list of variants (default: all of VARIANTS.json)")
    ap.add_argument("--dev-windows", type=int, default=5)
    ap.add_argument("--loo-windows", type=int, default=4)
    ap.add_argument("--test-windows", type=int, default=4)
    ap.add_argument("--limit", type=float, default=3.0, help="ppl delta in percent")
    ap.add_argument("--margin", type=float, default=0.0, help="headroom on the dev text, in points")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--families", default="niah_single,niah_multikey,niah_multivalue,niah_multiquery")
    a = ap.parse_args()
    variants = json.loads(a.variants.read_text())
    names = a.names.split(",") if a.names else list(variants)
    domains = a.domains.split(",") if a.domains else []
    with_full = ["full"] + [n for n in names if n != "full"]
    if a.stage == "dev":
        run_search(a.artifact, a.variants, "dev", a.work / "dev.jsonl", a.dev_windows, with_full)
    elif a.stage == "loo":
        for d in domains:
            art = loo_artifact(a.work, d, a.convert_args.split())
            run_search(art, a.variants, str(domain_text(d)), a.work / d / "loo.jsonl", a.loo_windows, with_full)
    elif a.stage == "choose":
        choose(a.work, names, domains, a.limit, a.margin)
    elif a.stage == "report":
        for t in ("botchan", "eb1911"):
            run_search(a.artifact, a.variants, t, a.work / f"{t}.jsonl", a.test_windows, with_full)
        for d in domains:
            art = loo_artifact(a.work, d, a.convert_args.split())
            run_search(art, a.variants, str(domain_text(d)), a.work / d / "loo.jsonl", a.loo_windows, with_full)
        texts = {t: rows(a.work / f"{t}.jsonl") for t in ("botchan", "eb1911")}
        texts |= {d.removeprefix("corpus_"): rows(a.work / d / "loo.jsonl") for d in domains}
        print("| variant | ratio (botchan) | " + " | ".join(f"Δ {t}" for t in texts) + " |")
        print("|---|---:|" + "---:|" * len(texts))
        for n in names:
            if n == "full":
                continue
            cells = [f"{delta(r, n):+.2f}%" if n in r else "-" for r in texts.values()]
            print(f"| {n} | {texts['botchan'][n]['ratio']:.2f}x | " + " | ".join(cells) + " |")
    else:
        out = a.work / "retrieval-4k.json"
        specs = ";".join(variant_string(variants[n]) for n in names if n != "full")
        cmd = [sys.executable, str(HERE / "retrieval_layers.py"), str(a.artifact), "bf16", "4k", str(a.samples)]
        cmd += [a.families, specs, str(out)]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env=ENV)


if __name__ == "__main__":
    main()
