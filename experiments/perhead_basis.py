"""A per-KV-head key basis, for comparing with the joined one (docs/notes.md, "A per-head key basis").

    python experiments/perhead_basis.py out/smollm2-lr out/smollm2-lrph   # a copy of SRC with the per-head basis

Each head gets its own query-weighted directions (tale_runtime.key_basis.fit on its diagonal block of the joined
statistics, from the same calibration samples as tale-convert --key-basis); the basis is block-diagonal, directions
interleaved by head (coefficient j K + h is head h's direction j), so the first r coefficients are r/K of each head
and the runtime reads it unchanged. The copy is re-hashed.
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
from tale_runtime import key_basis, load
from tale_runtime.artifact import MANIFEST, Schedule, hash_files, write_json


def main(src: Path, dst: Path, samples: int = 64, seq_len: int = 512, seed: int = 0) -> None:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    manifest = json.loads((dst / MANIFEST).read_text())
    s = Schedule.from_dict(manifest["schedule"])
    plain = replace(s, levels=[replace(lv, key_rank=0) for lv in s.levels])
    model, tok = load(dst, device="cpu", dtype=torch.float32, schedule=plain)
    docs, _ = calibrate.load_documents(None)
    tokens = calibrate.sample_tokens(tok, docs, samples, seq_len, seed)  # tale-convert's defaults
    tensors = {}
    for i, (m2, mean, q2) in enumerate(stats.key_moments(model, tokens[:16].split(2), skip=s.sinks)):
        a = model.model.layers[i].self_attn
        K, n = a.K, a.head_dim
        w = key_basis.pair_mean(q2, K, n)
        enc, dec = torch.zeros(K * n, K * n), torch.zeros(K * n, K * n)
        for h in range(K):
            sl, cols = slice(h * n, (h + 1) * n), torch.arange(n) * K + h
            enc[sl, cols], dec[cols, sl] = key_basis.fit(m2[sl, sl], mean[sl], w[sl])
        e, d, m = key_basis.names(i)
        tensors[e], tensors[d], tensors[m] = enc, dec, mean.float().contiguous()
    save_file(tensors, str(dst / key_basis.FILE))
    manifest["files"] = hash_files(dst)
    write_json(dst / MANIFEST, manifest)
    print(f"wrote {dst}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
