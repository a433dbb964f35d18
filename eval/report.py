"""What tale-eval prints: a progress line per finished row, the side-by-side table and the retrieval table."""

from __future__ import annotations


def log_row(log, row: dict, samples) -> None:
    log(
        f"{row['policy']} ({row['setting']}): ppl "
        + ", ".join(f"{v:.3f}" for v in row["ppl"].values())
        + f", {row['ratio']:.2f}x"
        + (f", pass-key {row['passkey']:.0%}" if samples else "")
        + f" ({row['seconds']:.0f} s)"
    )


def table(to, rows: list[dict], config: dict) -> None:
    from rich.table import Table

    texts = config["texts"]
    t = Table(
        title=f"{config['model'] or config['artifact']}: decode-mode ppl, {config['windows']} x {config['ctx']} "
        f"tokens of {', '.join(texts)} (prefill {config['prefill']}, chunk {config['chunk']}), {config['dtype']}"
    )
    kv = "kvpress" in config  # kvpress's rows: the entries kept, and kvpress's own ratio in place of the nominal
    cols = [
        "policy",
        *[c for tx in texts for c in (f"ppl {tx}", "delta")],
        "compr.",
        *(["kept", "kvpress"] if kv else ["nominal"]),
        "pass-key",
        "pk compr.",
    ]
    for col in cols:
        t.add_column(col, justify="left" if col == "policy" else "right", no_wrap=True)
    for r in rows:
        task = "passkey" in r
        name = r["policy"] if not config["frontier"] or r["family"] == "full" else f"{r['family']}: {r['setting']}"
        t.add_row(
            name,
            *[c for tx in texts for c in (f"{r['ppl'][tx]:.3f}", f"{r['delta_pct'][tx]:+.2f}%")],
            f"{r['ratio']:.2f}x",
            *([f"{r['kept_ratio']:.2f}x"] if kv else []),
            f"{r['nominal']:.2f}x" if r["nominal"] else "",
            f"{r['passkey']:.0%}" if task else "",
            f"{r['passkey_ratio']:.2f}x" if task else "",
        )
    to.print(t)
    for r in rows:
        to.print(f"  {r['policy']}: {r['detail']}", markup=False)
    to.print(
        f"compr.: 16-bit K+V bytes of the same tokens / bytes held by the cache (codes, scales, zero points, "
        f"sinks, residual), measured at the end of the run; pass-key: {config['passkey_samples']} samples, "
        f"exact match; {config['seconds']:.0f} s"
    )
    if kv:
        to.print(KVPRESS_NOTE.format(**config["kvpress"]))


KVPRESS_NOTE = (
    "kvpress {kvpress} (transformers {transformers}, torch {torch}): the presses compress the prompt at the prefill "
    "(the perplexity run: its --prefill tokens), later tokens are appended uncompressed; kept: 16-bit K+V bytes / "
    "bytes of the entries the attention still reads (KVzip masks entries and holds them: kept > compr.); kvpress: "
    "its own accounting, 1 / (1 - compression_ratio) on the prompt (cr: the share of the prompt's KV pairs pruned)"
)


def retrieval_table(to, rows: list[dict], config: dict) -> None:
    """Per task family and length, the mean score (RULER's string_match_all, %); the full cache's mean beside each
    row, so that `retention` (the row's mean over the full cache's) reads as what the compression kept."""
    from rich.table import Table

    tasks = list(rows[0]["retrieval_tasks"])
    full = next((r for r in rows if r["policy"] == "full"), None)
    per = config["retrieval_samples"] // max(1, len(tasks))
    t = Table(title=f"long-context retrieval: {per} sample(s) per task, {config['dtype']}")
    kv = "kvpress" in config
    cols = ["policy", *[c.replace("niah_", "") for c in tasks], "score", "full", "retention", "rt compr."]
    cols += ["kept", "kvpress cr"] if kv else []
    for col in cols:
        t.add_column(col, justify="left" if col == "policy" else "right", no_wrap=True)
    for r in rows:
        ref = full["retrieval"] if full else None
        t.add_row(
            r["policy"],
            *[f"{100 * r['retrieval_tasks'][k]:.0f}" for k in tasks],
            f"{100 * r['retrieval']:.1f}",
            f"{100 * ref:.1f}" if ref is not None else "",
            f"{100 * r['retrieval'] / ref:.0f}%" if ref else "",
            f"{r['retrieval_ratio']:.2f}x",
            *([f"{r['retrieval_kept_ratio']:.2f}x", f"{r['retrieval_compression_ratio']:.3f}"] if kv else []),
        )
    to.print(t)
    to.print(
        "retrieval: RULER's string_match_all (share of the expected answers in the greedy output), mean over samples "
        "per task, then over tasks; rt compr.: measured on those runs"
    )
