"""experiments/key_rank_policy.py's comparison on Gemma 3 270M (--group 1: one key basis of 256 directions per layer;
15 sliding layers, window 512, and 3 global ones, each kind balanced on its own): --key-rank-policy energy against
the same count in every layer, at the lowrank preset's share of the keys (7/24 of K n: 72) and below it (6/24: 64),
on the dev text only.

    python experiments/key_rank_policy_gemma.py convert --work out/krpg   # out/krpg/uniform, e72, e64
    python experiments/key_rank_policy_gemma.py dev --work out/krpg       # dev text (5 x 1024 tokens)

`convert`: tale-convert gemma3-270m (the default, uniform) and with --key-rank-policy energy at the preset's 7/24 and
at 6/24 (the preset's key share replaced for that run, in a process of its own). `dev`: experiments/tale_search.py
on the dev text (calib/corpus_heldout.txt), prefill 128, chunk 8, the full 16-bit cache in the same run as the
uniform rows: full, k72-uniform (the default as converted) and k64-uniform (a `key_rank` override of it) on
`uniform`, k72-energy on e72, k64-energy on e64 (experiments/search/key_rank_policy_gemma.json).
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
sys.path.insert(0, str(HERE))
from key_rank_policy import search, table  # noqa: E402

VARIANTS = HERE / "search" / "key_rank_policy_gemma.json"
ENV = os.environ | {"OMP_NUM_THREADS": "1"}
ARTS = {"uniform": None, "e72": 7 / 24, "e64": 6 / 24}  # the preset's key share of K n (None: uniform, the preset's)
ON = {"k72-energy": "e72", "k64-energy": "e64"}  # the variant's artifact (default: uniform)


def convert(out: Path, share: float | None) -> None:
    """tale-convert gemma3-270m [--key-rank-policy energy, the lowrank preset's key share set to `share`]."""
    if (out / "tale_config.json").is_file():
        return
    from tale_convert import Options
    from tale_convert import convert as run
    from tale_runtime import schedule

    opts = Options(group=1)  # tale-convert's default for gemma3-270m (one KV head)
    if share is not None:
        schedule.PRESETS["lowrank"] = replace(schedule.PRESETS["lowrank"], key_rank=(share, 0, 0))
        opts = Options(group=1, key_rank_policy="energy")
    report = run("gemma3-270m", out, opts, log=print)
    print(out, "key ranks:", [row[0] for row in report.key_ranks or []], flush=True)


def main() -> None:
    if sys.argv[1:2] == ["convert-one"]:  # OUT SHARE|-
        convert(Path(sys.argv[2]), None if sys.argv[3] == "-" else float(sys.argv[3]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("stage", choices=["convert", "dev"])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--windows", type=int, default=5)
    a = ap.parse_args()
    names = list(json.loads(VARIANTS.read_text()))
    if a.stage == "convert":
        for art, share in ARTS.items():  # a process per conversion: each sets the preset's share for its own run
            arg = "-" if share is None else str(share)
            subprocess.run([sys.executable, __file__, "convert-one", str(a.work / art), arg], check=True, env=ENV)
        return
    for art in ARTS:
        mine = [x for x in names if ON.get(x, "uniform") == art]
        search(a.work / art, "dev", a.work / f"{art}-dev.jsonl", a.windows, mine, VARIANTS)
    table(a.work, ["dev"], names)


if __name__ == "__main__":
    main()
