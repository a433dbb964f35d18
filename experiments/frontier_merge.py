"""Merge `tale-eval --frontier --json` files of several processes (each with the same deterministic `full`
row) into one table and plot, as one run would write them (docs/quality.md, "The frontier").

    python experiments/frontier_merge.py docs/frontier a.json b1.json b2.json "c.json:key-bands artifact: "

FILE:PREFIX puts PREFIX before the settings of that file's rows (e.g. rows run on another artifact). A FILE.md is a
table this script (or tale-eval) wrote, read back as rows at its printed precision: the record of earlier runs whose
JSON files are gone; it goes first, and its full cache's ppl (the footer) must match the JSON files' to 3 decimals.

    python experiments/frontier_merge.py docs/frontier docs/frontier.md new.json

A FILE.json.partial holds the finished rows of a run that was stopped (JSON lines, its full row first): they join
with deltas against that full row; the table's settings come from a finished FILE.json of the same call, else from
the footer of the table given first.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from tale_eval import frontier
from tale_eval.measure import add_deltas


def table_rows(path: Path) -> tuple[list[dict], dict[str, float]]:
    """Rows of a frontier.markdown table (values as printed) and the full cache's ppl per text from its footer."""
    lines = path.read_text().splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")] if lines else []
    if head[:3] != ["family", "setting", "ratio"] or len(lines) < 3:
        sys.exit(f"error: {path}: not a frontier table (its first line is not frontier.markdown's header)")
    texts = [c.removeprefix("ppl Δ ") for c in head if c.startswith("ppl Δ ")]
    rows = []
    for line in lines[2:]:
        if not line.startswith("| "):
            break
        c = dict(zip(head, (x.strip() for x in line.strip().strip("|").split(" | "))))
        row = {"family": c["family"], "setting": c["setting"], "ratio": float(c["ratio"].rstrip("x"))}
        if c.get("total"):  # host memory counted too (tables before this column have none)
            row["ratio_total"] = float(c["total"].rstrip("x"))
        row["delta_pct"] = {t: float(c[f"ppl Δ {t}"].rstrip("%")) for t in texts}
        if c["pass-key"]:
            row["passkey"] = float(c["pass-key"].rstrip("%")) / 100
            row["passkey_ratio"] = float(c["pk ratio"].rstrip("x"))
        row["seconds"] = float(c["s"])
        rows.append(row)
    foot = re.search(r"full 16-bit cache \(([^)]*\))", lines[-1])
    ref = dict(re.findall(r"(\w+) (\d+\.\d+)[,)]", foot.group(1))) if foot else {}
    if set(ref) != set(texts) or not rows or rows[0]["family"] != "full":
        sys.exit(f"error: {path}: not a frontier table (texts {texts}, footer {ref})")
    return rows, {t: float(v) for t, v in ref.items()}


def table_settings(path: Path, ref: dict[str, float]) -> dict | None:
    """The run settings printed in a frontier table's footer (frontier.markdown), or None."""
    m = re.search(
        r"(\d+) x (\d+) tokens per text, prefill (\d+), chunk (\d+), (\w+); pass-key: (\d+) samples",
        path.read_text().splitlines()[-1],
    )
    if not m:
        return None
    windows, ctx, prefill, chunk, dtype, samples = m.groups()
    return dict(
        texts=list(ref),
        ref_ppl=ref,
        windows=int(windows),
        ctx=int(ctx),
        prefill=int(prefill),
        chunk=int(chunk),
        dtype=dtype,
        passkey_samples=int(samples),
        model=None,
        artifact=path.stem,
    )


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: frontier_merge.py OUT FILE.json[:PREFIX] ...")
    out, rows, config, seconds, table_ref = Path(argv[0]), [], None, 0.0, None
    for arg in argv[1:]:
        path, _, prefix = arg.partition(":")
        if path.endswith(".md"):
            if rows:
                sys.exit(f"error: {path}: a table goes first")
            rows, table_ref = table_rows(Path(path))
            seconds += sum(r["seconds"] for r in rows)
            continue
        if path.endswith(".partial"):
            part = {"config": None, "results": [json.loads(x) for x in Path(path).read_text().splitlines() if x]}
            full = next((r for r in part["results"] if r["family"] == "full"), None)
            if full is None:
                sys.exit(f"error: {path}: no full row among its finished rows")
            add_deltas(part["results"], full["ppl"])
            part["config"] = {"ref_ppl": full["ppl"], "seconds": sum(r["seconds"] for r in part["results"])}
        else:
            part = json.loads(Path(path).read_text())
        if table_ref is not None:
            got = {t: round(v, 3) for t, v in part["config"]["ref_ppl"].items()}
            if got != table_ref:
                sys.exit(f"error: {path}: its full row ({got}) differs from the table's ({table_ref})")
        if not path.endswith(".partial"):
            config = config or dict(part["config"])
        seconds += part["config"]["seconds"]
        res = part["results"]
        full = next(r for r in res if r["family"] == "full")
        if rows and "ppl" in rows[0] and full["ppl"] != rows[0]["ppl"]:
            sys.exit(f"error: {path}: its full row differs from the first file's (another artifact or preset?)")
        rows += [r | {"setting": prefix + r["setting"]} for r in res if not (rows and r["family"] == "full")]
    if config is None and table_ref is not None:  # the settings as the table's footer prints them
        config = table_settings(Path(argv[1]), table_ref)
    if config is None:
        sys.exit("error: the table's settings come from a finished FILE.json or a table: give one")
    config["seconds"] = seconds
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(frontier.markdown(rows, config))
    frontier.plot(rows, config, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.png')}: {len(rows)} rows")


if __name__ == "__main__":
    main(sys.argv[1:])
