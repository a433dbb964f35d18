"""2-bit latents on a Lloyd-Max code table instead of the uniform min/max grid, measured as tale_search.py measures
the schedules (decode-mode ppl, measured ratio): the same arguments, one JSON line per variant.

    python experiments/lloyd_latents.py out/smollm2-tale VARIANTS.json --out rows.jsonl --threads 1 --only L2-k48 ...

Every 2-bit latent group (per token over `value_group` channels, fp8 scale/zero: the `lowrank` preset's layout) is
stored as its mean and standard deviation (fp8, the same bytes as the zero and scale they replace) and four codes
that pick mu + sigma * (-1.510, -0.453, 0.453, 1.510): the least-squared-error 4-level quantizer of a Gaussian, whose
levels are the means of their cells, so its error has no sign per channel, unlike a clipped uniform grid
(docs/notes.md, "clipped latent ranges"). Rotated latents are near Gaussian per group; on Gaussian groups of 64 the
table has half the uniform grid's squared error (printed at the start). The cache's quantize and dequantize are
replaced in this process only (the runtime and the GPU kernels read the affine grid): an experiment, not a format.
LLOYD_EXACT=1 keeps the mean and deviation in float32 (a diagnostic: the measured ratio then counts their bytes).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch

from tale_runtime import quant as Q

LEVELS = torch.tensor([-1.5104, -0.4528, 0.4528, 1.5104])
EDGES = torch.tensor([-0.9816, 0.0, 0.9816])
_quantize, _dequantize = Q.quantize, Q.dequantize
EXACT = os.environ.get("LLOYD_EXACT") == "1"


def _ours(bits: int, dim: int, meta: str) -> bool:
    return bits == 2 and dim == -1 and meta == "8/8"


def quantize(x, bits, group, dim, meta="16", device_bias=False):
    if not _ours(bits, dim, meta):
        return _quantize(x, bits, group, dim, meta, device_bias)
    xg, rd = Q._grouped(x.float(), group, dim)
    mu = xg.mean(dim=rd, keepdim=True)
    sd = xg.std(dim=rd, keepdim=True, unbiased=False)
    top = torch.maximum(sd.amax(), mu.abs().amax()).item()
    bias = 2.0 ** math.floor(math.log2(112.0 / top)) if top > 0 else 1.0
    sd_s, mu_s = (sd * bias).to(Q.FP8), (mu * bias).to(Q.FP8)
    if EXACT:  # a diagnostic: mean and deviation kept in float32 (the measured ratio then counts their bytes)
        bias, sd_s, mu_s = 1.0, sd, mu
    sdf, muf = sd_s.float() / bias, mu_s.float() / bias
    z = (xg - muf) / torch.where(sdf > 0, sdf, torch.ones_like(sdf))
    codes = torch.bucketize(z, EDGES.to(z.device)).to(torch.float32).reshape(x.shape)
    return Q.QTensor(Q.pack(codes, 2), sd_s.squeeze(rd), mu_s.squeeze(rd), 2, group, dim, meta, bias, 1.0)


def dequantize(q, dtype=None):
    if not isinstance(q, Q.QTensor) or not _ours(q.bits, q.dim, q.meta):
        return _dequantize(q, dtype)
    codes = Q.unpack(q.data, 2).long()
    cg, rd = Q._grouped(codes, q.group, q.dim)
    sd, mu = q.meta_float(q.scale).unsqueeze(rd), q.meta_float(q.zero).unsqueeze(rd)
    x = mu + sd * LEVELS.to(sd.device)[cg]
    return x.reshape(codes.shape).to(dtype or q.source_dtype)


def install() -> None:
    """Replace quantize/dequantize wherever the runtime and eval imported them by name."""
    for mod in list(sys.modules.values()):
        for name, old, new in (("quantize", _quantize, quantize), ("dequantize", _dequantize, dequantize)):
            if getattr(mod, name, None) is old:
                setattr(mod, name, new)


def gaussian_check() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=g) * 3.0 + 1.0
    for name, qf, dqf in (("uniform", _quantize, _dequantize), ("lloyd", quantize, dequantize)):
        y = dqf(qf(x, 2, 64, -1, "8/8"), torch.float32)
        err = ((y - x) ** 2).sum() / ((x - x.mean(-1, keepdim=True)) ** 2).sum()
        bias = (y - x).mean(0).abs().mean() / x.std()
        print(f"2-bit {name}: relative squared error {err:.4f}, mean error per channel {bias:.4f} sd", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import tale_search  # noqa: E402

    gaussian_check()
    install()
    tale_search.main()
