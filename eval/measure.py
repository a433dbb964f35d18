"""One policy, measured: decode-mode perplexity on each held-out text, the measured compression at
the end of the perplexity run, and pass-key retrieval. Shared by the table and --frontier."""

from __future__ import annotations

import math
import time

import torch

from . import passkey, perplexity
from .policies import Policy, reference_nbytes


def measure(
    model, tok, pol: Policy, texts: dict[str, torch.Tensor], prefill: int, chunk: int, samples: list[dict]
) -> dict:
    """texts: name -> [windows, ctx] token ids (one batch each, same shape). The ratio is the one of
    the first text's run (cache bytes depend on the call pattern only, the same for every text)."""
    t0 = time.perf_counter()
    row = {
        "policy": pol.name,
        "family": pol.family,
        "setting": pol.label(),
        "detail": pol.detail(model),
        "nominal": pol.nominal(model),
        "ppl": {},
    }
    pattern = None
    for name, ids in texts.items():
        pattern = perplexity.pattern(ids.shape[1], prefill, chunk)
        cache = pol.build(model, pattern)
        nll, count = perplexity.decode_nll(model, ids, cache, prefill, chunk)
        row["ppl"][name] = math.exp(nll / count)
        if "ratio" not in row:
            base = reference_nbytes(model, ids.shape[0], sum(pattern))
            row["ratio"] = base / pol.nbytes(cache)  # what the accelerator holds
            row["ratio_total"] = base / pol.total_nbytes(cache)  # with what a policy keeps in host memory
            row["tokens"] = count
    row["ranks"] = pol.ranks(model, pattern)
    if samples:
        task = passkey.run(model, tok, samples, pol)
        row.update(passkey=task["accuracy"], passkey_ratio=task["ratio"], passkey_answers=task["answers"])
    row["seconds"] = time.perf_counter() - t0
    return row


def add_deltas(rows: list[dict], ref: dict[str, float]) -> None:
    """delta (absolute) and delta_pct (percent) of each row's ppl against `ref`, per text."""
    for r in rows:
        r["delta"] = {t: p - ref[t] for t, p in r["ppl"].items()}
        r["delta_pct"] = {t: 100 * (p / ref[t] - 1) for t, p in r["ppl"].items()}
