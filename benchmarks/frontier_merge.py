"""Merge `tale-eval --frontier --json` files of several processes (each with the same deterministic `full`
row) into one table and plot, as one run would write them (docs/quality.md, "The frontier").

    python benchmarks/frontier_merge.py docs/frontier a.json b1.json b2.json "c.json:key-bands artifact: "

FILE:PREFIX puts PREFIX before the settings of that file's rows (e.g. rows run on another artifact).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tale_eval import frontier


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: frontier_merge.py OUT FILE.json[:PREFIX] ...")
    out, rows, config, seconds = Path(argv[0]), [], None, 0.0
    for arg in argv[1:]:
        path, _, prefix = arg.partition(":")
        part = json.loads(Path(path).read_text())
        config = config or dict(part["config"])
        seconds += part["config"]["seconds"]
        res = part["results"]
        full = next(r for r in res if r["family"] == "full")
        if rows and full["ppl"] != rows[0]["ppl"]:
            sys.exit(f"error: {path}: its full row differs from the first file's (another artifact or preset?)")
        rows += [r | {"setting": prefix + r["setting"]} for r in res if not (rows and r["family"] == "full")]
    config["seconds"] = seconds
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(frontier.markdown(rows, config))
    frontier.plot(rows, config, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.png')}: {len(rows)} rows")


if __name__ == "__main__":
    main(sys.argv[1:])
