"""The latent pass of a low-rank-key region in CUDA (kernels/cuda/lowrank_latent.cu): over the scores the score pass
wrote, per split and latent group, the online softmax and the products with the slots' 3-bit latents on tensor
cores, written as kernels/attention.py's partials (m, l, acc, rank) for its combine. It replaces the Triton kernel's
latent launch (kernels/lowrank_attention.py, phase 2) where `reason` says it can read the region.

One build per configuration (rank, scale format, query rows per group, window), cached on disk by
kernels/cuda_module.py. Graph-safe: the length and next position may be device scalars; the grid is the caller's
splits.
"""

from __future__ import annotations

import os

import torch

from tale_runtime.quant import FP8, QTensor

from .cuda_module import dequant_bias, device_scalar, loaded
from .lowrank_score import available

SRC = os.path.join(os.path.dirname(__file__), "cuda", "lowrank_latent.cu")
BT = 64  # slots per tile (the .cu's BT)
RANK = 512  # the one rank it is built for
# which kernel runs the latent pass of a low-rank region where the CUDA passes are asked for: "cuda" (this one,
# where it reads the region) or "triton" (the Triton kernel's latent launch: benchmarks compare the two)
VARIANT = os.environ.get("TALE_LR_LATENT", "cuda")


def smem_bytes() -> int:
    """Dynamic shared memory of one CTA (the .cu's SMEM)."""
    rstr = RANK * 3 // 8 + 16
    return 2 * BT * rstr + 16 * 72 * 2 + 8 * 4 * 4 * 16 + 16 * 8 * 4


def reason(q: torch.Tensor, lat: QTensor, rank: int, qg: int, scores: torch.Tensor, pos: torch.Tensor) -> str | None:
    """Why the CUDA latent pass cannot read a region with latents `lat` [B, G, cap, rank] for groups of `qg` query
    heads over `scores` [B, H, cap] float32, or None."""
    if type(lat) is not QTensor or lat.bits != 3 or lat.dim % 4 != 3:
        return "latents not 3-bit codes quantized per slot over channel groups"
    if rank != RANK or lat.group != RANK // 8:
        return f"rank {rank} in channel groups of {lat.group} (it reads rank {RANK} in groups of {RANK // 8})"
    if qg > 16:
        return f"{qg} query heads per latent group (at most 16)"
    if lat.meta not in ("8/8", "16"):
        return f"scale/zero format {lat.meta!r} (fp8 '8/8' or 16-bit)"
    if lat.scale.dtype != (FP8 if lat.meta == "8/8" else torch.float16):
        return f"scales in {lat.scale.dtype}"
    if why := available(q.device):
        return why
    if torch.cuda.get_device_capability(q.device) < (8, 9):
        return "needs sm_89 or later (fp8 conversions)"
    d, s, z = lat.data, lat.scale, lat.zero
    if d.stride(-1) != 1 or any(x % 16 for x in d.stride()[:3]) or d.data_ptr() % 16:
        return "packed latent rows not 16-byte aligned"
    if s.stride() != z.stride() or s.stride(-1) != 1 or s.stride(-2) % 2 or s.data_ptr() % 4 or z.data_ptr() % 4:
        return "scales/zeros not aligned per pair of groups"
    if scores.stride(-1) != 1 or any(x % 4 for x in scores.stride()[:2]) or scores.data_ptr() % 16:
        return "scores not 16-byte aligned per row"
    if pos.stride(-1) != 1 or pos.stride(0) % 4 or pos.data_ptr() % 16:
        return "positions not 16-byte aligned per row"
    return None


def latents(
    scores: torch.Tensor,  # float32 [B, H, cap]
    pos: torch.Tensor,  # int32 [B, cap]
    length,  # int or one-element device tensor
    next_pos,  # int or one-element device tensor
    window: int | None,
    lat: QTensor,  # [B, G, cap, 512] 3-bit
    qg: int,  # query heads per latent group
    partials: tuple,  # (pm, pl, pacc, rk): kernels/attention.py's _partials
    slot0: int,
    n_slots: int,
    ns: int,
) -> None:
    """Write splits slot0 .. slot0 + ns - 1 of the partials: the latent pass over every valid slot below `length`."""
    B, H, cap = scores.shape
    G = lat.data.shape[1]
    dev = scores.device
    meta8 = lat.meta == "8/8"
    opts = tuple(f"-D{k}={int(v)}" for k, v in dict(RANK=RANK, META8=meta8, QG=qg, WIN=window is not None).items())
    mod = loaded(SRC, opts, dev)
    mod.function("tale_lr_latent", smem_bytes())

    bias_p, inv_v = dequant_bias(lat, pos)
    pm, pl, pacc, rk = partials
    d, s, z = lat.data, lat.scale, lat.zero
    mod.launch(
        "tale_lr_latent",
        (ns, G, B),
        256,
        (
            scores,
            scores.stride(0),
            scores.stride(1),
            pos,
            pos.stride(0),
            *device_scalar(length, pos),
            cap,
            *device_scalar(next_pos, pos),
            0 if window is None else int(window),
            d,
            d.stride(0),
            d.stride(1),
            d.stride(2),
            s,
            z,
            s.stride(0),
            s.stride(1),
            s.stride(2),
            bias_p,
            float(inv_v),
            pm,
            pl,
            pacc,
            pacc.stride(2),
            rk,
            slot0,
            n_slots,
            H,
            ns,
        ),
        shared=smem_bytes(),
    )
