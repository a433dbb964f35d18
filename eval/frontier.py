"""`tale-eval --frontier`: every policy swept over its knob(s), quality vs MEASURED compression.

Writes a markdown table (PATH.md) and a two-panel plot (PATH.png: decode-mode ppl delta vs
measured ratio, pass-key vs the ratio measured on the pass-key runs).
"""

from __future__ import annotations

from pathlib import Path

from .names import FAMILIES
from .policies import REGISTRY, Policy, Tale

# the families of a frontier, in plot order
# ci: a few points per family (about 1-2 min on one thread); full: FULL_SWEEP where it names the family, else
# Policy.sweep
CI_SWEEP = {
    "tale": [Tale(), Tale({"key_bits": [4, 4]}), Tale({"r0": 0.25})],
    "kivi": [REGISTRY["kivi"](4, 32, 32), REGISTRY["kivi"](2, 32, 32)],
    "quanto": [REGISTRY["quanto"](4, 64, 128), REGISTRY["quanto"](2, 64, 128)],
    "hqq": [REGISTRY["hqq"](4, 64, 128), REGISTRY["hqq"](2, 64, 128)],
    "streaming": [REGISTRY["streaming"](window=1 / 4), REGISTRY["streaming"](window=1 / 8)],
    "palu": [REGISTRY["palu"](192, 2), REGISTRY["palu"](64, 2)],
    "less": [REGISTRY["less"](window=60)],
    "tailorkv": [REGISTRY["tailorkv"](1, 16)],
}


# full: one or two points per family, so that `make frontier` fits in about an hour on one thread of a shared 2-core
# CPU (a row of both test texts and the pass-key samples takes minutes there); the points left out (2-bit quanto and
# HQQ, KIVI-2 at groups of 128, Palu at rank 64, StreamingLLM at 1/3, TailorKV with 8 one-bit layers) lost +40% or
# more, or sit where another family's point already measures the ratio
FULL_SWEEP = {
    "kivi": [REGISTRY["kivi"](4, 32, 32), REGISTRY["kivi"](2, 32, 32)],
    "quanto": [REGISTRY["quanto"](4, 64, 128)],
    "hqq": [REGISTRY["hqq"](4, 64, 128)],
    "streaming": [REGISTRY["streaming"](window=1 / r) for r in (6, 12)],
    "palu": [REGISTRY["palu"](192, 2)],
    "tailorkv": [REGISTRY["tailorkv"](2, 64), REGISTRY["tailorkv"](2, 16)],
}


def points(families: list[str], size: str, ctx: int, tale_variants: list[dict] | None) -> list[Policy]:
    """The sweep: per family its points at the run size `size` (tale-eval --preset); TALE's replaced by
    `tale_variants` when given."""
    out = []
    for f in families:
        if f == "tale" and tale_variants is not None:
            out += [Tale(v) for v in tale_variants]
        elif size == "ci":
            out += CI_SWEEP[f]
        elif f in FULL_SWEEP:
            out += FULL_SWEEP[f]
        else:
            out += REGISTRY[f].sweep(ctx)
    return out


def parse_variants(text: str) -> list[dict]:
    """'key_bits=4/4; r0=0.25,key_bits=4/4; -' -> override dicts ('-' or '' is the artifact schedule).
    Keys: sinks, recent, r0, bits, key_bits, key_group, value_group, residual, key_meta, value_meta ('16',
    '8-16', '8-8': scale/zero storage, written with '-' since '/' separates list items), key_hi (BITS/CHANNELS:
    the middle level's key bands, on an artifact with a key order; 0/0: none), key_axis (channel/token per level),
    keep (recent or salient: which key groups the levels above level 0 keep), key_rope (post or pre: the quantized
    levels' keys held after or before RoPE), key_rank (per level: low-rank keys on the artifact's key basis, 0: plain
    keys; needs key_rope=pre); lists with '/'."""
    ints = {"sinks", "key_group", "value_group", "residual"}
    lists = {"bits", "key_bits", "key_hi", "key_rank"}
    floats = {"r0", "recent"}
    metas = {"key_meta", "value_meta"}
    words = {"key_axis", "keep", "key_rope"}  # validated with the schedule / the cache
    out = []
    for part in text.split(";"):
        part = part.strip()
        v: dict = {}
        if part and part != "-":
            for kv in part.split(","):
                k, sep, val = (x.strip() for x in kv.partition("="))
                if not sep or k not in ints | lists | floats | metas | words:
                    raise ValueError(
                        f"bad TALE variant {kv.strip()!r}: use key=value with key one of "
                        f"{', '.join(sorted(ints | lists | floats | metas | words))}"
                    )
                try:
                    if k in metas:  # validated with the schedule (Schedule.validate)
                        v[k] = val.replace("-", "/")
                    elif k in words:
                        v[k] = val.split("/") if k == "key_axis" else val
                    elif k in lists:
                        v[k] = [int(x) for x in val.split("/")]
                    elif k in floats:
                        v[k] = [float(x) for x in val.split("/")] if "/" in val else float(val)
                    else:
                        v[k] = int(val)
                except ValueError:
                    raise ValueError(f"bad TALE variant {kv.strip()!r}: {val!r} is not a number") from None
        out.append(v)
    return out


def markdown(rows: list[dict], config: dict) -> str:
    texts = config["texts"]
    head = ["family", "setting", "ratio", "total"] + [f"ppl Δ {t}" for t in texts] + ["pass-key", "pk ratio", "s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---", "---"] + ["---:"] * (len(head) - 2)) + "|"]
    for r in rows:
        pk = "passkey" in r
        total = r.get("ratio_total", r["ratio"])
        cells = [r["family"], r["setting"].replace("|", "/"), f"{r['ratio']:.2f}x"]
        cells.append(f"{total:.2f}x" if abs(total - r["ratio"]) > 5e-3 else "")
        cells += [f"{r['delta_pct'][t]:+.2f}%" for t in texts]
        cells += [f"{r['passkey']:.0%}" if pk else "", f"{r['passkey_ratio']:.2f}x" if pk else ""]
        cells.append(f"{r['seconds']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    ref = ", ".join(f"{t} {config['ref_ppl'][t]:.3f}" for t in texts)
    lines.append("")
    lines.append(
        f"ratio: 16-bit K+V bytes / bytes the cache holds on the accelerator at the end of the perplexity run "
        f"(the plot's); total: the same with what it keeps in host memory (TailorKV's offloaded layers); ppl Δ: "
        f"decode-mode perplexity vs the full 16-bit cache ({ref}); {config['windows']} x {config['ctx']} tokens per text, "
        f"prefill {config['prefill']}, chunk {config['chunk']}, {config['dtype']}; pass-key: "
        f"{config['passkey_samples']} samples, exact match, pk ratio measured on those runs."
    )
    return "\n".join(lines) + "\n"


def envelope(rows: list[dict], texts) -> list[dict]:
    """The points no other point beats at an equal or higher ratio (mean ppl delta over the texts), by ratio."""
    out, best = [], float("inf")
    for r in sorted(rows, key=lambda r: -r["ratio"]):
        d = sum(r["delta_pct"][t] for t in texts) / len(texts)
        if d < best:
            out.append(r)
            best = d
    return out[::-1]


def plot(rows: list[dict], config: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    texts = config["texts"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.8))
    markers = dict(zip(FAMILIES, "o^sDvPXh"))
    styles = ["-", "--", ":"]
    for f in [f for f in FAMILIES if any(r["family"] == f for r in rows)]:
        rs = sorted((r for r in rows if r["family"] == f), key=lambda r: r["ratio"])
        best = envelope(rs, texts)
        color = None
        for i, t in enumerate(texts):  # every point; the line joins the family's best ones
            (line,) = a.plot(
                [r["ratio"] for r in best],
                [r["delta_pct"][t] for r in best],
                styles[i % 3],
                marker=markers.get(f, "o"),
                color=color,
                label=f if i == 0 else None,
                ms=5,
            )
            color = line.get_color()
            a.plot([r["ratio"] for r in rs], [r["delta_pct"][t] for r in rs], markers.get(f, "o"), color=color, ms=3)
        pk = sorted((r for r in rs if "passkey" in r), key=lambda r: r["passkey_ratio"])
        if pk:
            b.plot(
                [r["passkey_ratio"] for r in pk],
                [100 * r["passkey"] for r in pk],
                "-",
                marker=markers.get(f, "o"),
                color=color,
                label=f,
                ms=5,
            )
    a.set_xlabel("measured compression (x)")
    a.set_ylabel("decode ppl vs full cache (%)")
    a.set_yscale("symlog", linthresh=5)
    a.axhline(0, color="grey", lw=0.5)
    a.set_title("perplexity: " + ", ".join(f"{t} {s}" for t, s in zip(texts, ("solid", "dashed", "dotted"))))
    b.set_xlabel("measured compression on the pass-key runs (x)")
    b.set_ylabel("pass-key accuracy (%)")
    b.set_ylim(-5, 105)
    b.set_title(f"pass-key retrieval ({config['passkey_samples']} samples)")
    for ax in (a, b):
        ax.set_xlim(1, max(12.5, max(r["ratio"] for r in rows) + 0.5))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    model = config["model"] or config["artifact"]
    fig.suptitle(f"{model}, {config['dtype']}: quality vs measured KV-cache compression")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
