"""Evaluate several TALE schedules on one loaded model with tale-eval's own functions (decode-mode ppl on
the dev text calib/corpus_heldout.txt, measured ratio, pass-key), one JSON line per variant.

    python experiments/tale_search.py out/smollm2-tale VARIANTS.json --out rows.jsonl --threads 1

VARIANTS.json: {"name": {override_schedule kwargs}, ...}; "ranks0": [per-layer level-0 ranks] sets ranks per
layer; "key_bands": {"LEVEL": [hi_bits, hi_channels]} adds key bands, the channel order computed from the
calibration corpus (tale_convert.stats, as tale-convert --key-bands writes it). The full preset's windows (5 x 1024, prefill 128, chunk 4: --windows, --ctx, --prefill, --chunk) and all 18 pass-key samples by default.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from tale_convert import stats
from tale_eval import passkey, perplexity, policies
from tale_eval.attention import prepare
from tale_runtime import load
from tale_runtime.load import override_schedule


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("variants")
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default=None, help="comma list of variant names")
    ap.add_argument("--no-passkey", action="store_true")
    ap.add_argument("--no-ppl", action="store_true")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=4)
    ap.add_argument("--text", default="dev", help="dev, a test text, or a path (documents as in calib/)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    variants = json.loads(Path(args.variants).read_text())
    if args.only:
        variants = {k: variants[k] for k in args.only.split(",")}
    model, tok = load(args.artifact, device="cpu", dtype=torch.bfloat16)
    order = model.tale_spec.schedule.key_order  # an artifact converted with --key-bands carries it
    # else computed on the runtime's own attention, before prepare()
    if order is None and any("key_bands" in kw for kw in variants.values()):
        t = time.perf_counter()
        order = stats.key_order(
            stats.key_importance(model, stats.calibration_batches(tok), model.tale_spec.schedule.key_group)
        )
        print(f"key order from the calibration corpus: {time.perf_counter() - t:.0f} s", flush=True)
    prepare(model)
    R = model.tale_spec.arch.latent_rank
    base = model.tale_spec.schedule
    ids = perplexity.heldout_windows(tok, args.ctx, args.windows, args.text)
    samples = [] if args.no_passkey else passkey.load_samples()
    pattern = perplexity.pattern(args.ctx, args.prefill, args.chunk)
    for name, kw in variants.items():
        kw = dict(kw)
        ranks0 = kw.pop("ranks0", None)
        bands = kw.pop("key_bands", None)
        keep = kw.pop("keep", "recent")
        sched = override_schedule(base, R, len(base.ranks), **kw)
        if ranks0:
            sched.ranks = [[r0] + rs[1:] for r0, rs in zip(ranks0, sched.ranks)]
        if bands:
            sched = stats.with_key_bands(sched, order, {int(lv): tuple(v) for lv, v in bands.items()})
        sched.validate(R, len(base.ranks))
        pol = policies.Full() if name == "full" else policies.Tale({"keep": keep}, schedule=sched, tag=name)
        t = time.perf_counter()
        row = {
            "name": name,
            "kw": kw
            | ({"ranks0": ranks0} if ranks0 else {})
            | ({"key_bands": bands} if bands else {})
            | ({"keep": keep} if keep != "recent" else {}),
        }
        if not args.no_ppl:
            cache = pol.build(model, pattern)
            nll, count = perplexity.decode_nll(model, ids, cache, args.prefill, args.chunk)
            ratio = policies.reference_nbytes(model, ids.shape[0], sum(pattern)) / pol.nbytes(cache)
            row.update(ppl=math.exp(nll / count), ratio=ratio)
        if samples:
            task = passkey.run(model, tok, samples, pol)
            row.update(passkey=task["accuracy"], passkey_ratio=task["ratio"])
        row["seconds"] = time.perf_counter() - t
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
