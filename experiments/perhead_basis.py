"""A copy of an artifact with a per-KV-head key basis (format 2.4), for comparing with its joined one (docs/notes.md,
"joint or per-head key basis on the test texts").

    python experiments/perhead_basis.py out/lr-joint out/lr-head   # a copy of SRC with the per-head basis

What `tale-convert --key-basis-blocks head` writes, without converting again: the factors do not depend on the key
basis, so the copy keeps them and refits only the basis, per head, on the diagonal blocks of the same key statistics
(tale_convert.stats.key_moments over the converter's first calibration samples, through the artifact in float32: for
a bf16 checkpoint converted to bf16 the weights the converter's layer pass ran). Low-rank levels keep the share of
the joined keys, split over the heads and rounded as the converter rounds it (80 of 192 -> 24 per head of 64). The
copy's manifest is rewritten (schedule, format version, nominal ratio, hashes).
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from tale_convert import calibrate, stats
from tale_convert.convert import BASIS_SAMPLES
from tale_runtime import key_basis, load
from tale_runtime.artifact import FORMAT_VERSION, MANIFEST, Schedule, hash_files, nominal_ratio, write_json


def main(src: Path, dst: Path) -> None:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    manifest = json.loads((dst / MANIFEST).read_text())
    s = Schedule.from_dict(manifest["schedule"])
    if s.key_blocks != 1:
        raise SystemExit(f"{src}: the key basis is already in {s.key_blocks} blocks")
    plain = replace(s, levels=[replace(lv, key_rank=0) for lv in s.levels])
    model, tok = load(dst, device="cpu", dtype=torch.float32, schedule=plain)
    cal = manifest["calibration"]
    docs, _ = calibrate.load_documents(None)
    tokens = calibrate.sample_tokens(tok, docs, cal["samples"], cal["seq_len"], cal["seed"])  # the converter's
    a = model.model.layers[0].self_attn
    K, n = a.K, a.head_dim
    tensors = {}
    for i, (m2, mean, q2) in enumerate(stats.key_moments(model, tokens[:BASIS_SAMPLES].split(2), skip=s.sinks)):
        enc, dec = key_basis.fit(m2, mean, key_basis.pair_mean(q2, K, n), K)  # [K, n, n] each
        e, d, m = key_basis.names(i)
        tensors[e], tensors[d], tensors[m] = enc, dec, mean.float().contiguous()
    save_file(tensors, str(dst / key_basis.FILE))
    levels = [replace(lv, key_rank=max(8, round(lv.key_rank / K / 8) * 8) if lv.key_rank else 0) for lv in s.levels]
    s = replace(s, levels=levels, key_blocks=K)
    arch = manifest["architecture"]
    manifest["schedule"] = s.to_dict()
    manifest["format_version"] = FORMAT_VERSION
    manifest["nominal_ratio"] = round(nominal_ratio(s, n, int(arch["group_size"]), K), 4)
    manifest["files"] = hash_files(dst)
    write_json(dst / MANIFEST, manifest)
    print(f"wrote {dst}: key ranks {[lv.key_rank for lv in levels]} per head of {n}, {K} heads")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
