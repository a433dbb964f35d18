"""The score pass of a low-rank-key region in CUDA: the rebuild of every slot's keys from its coefficient codes as a
tensor-core GEMM against the basis held in shared memory, RoPE computed from the model's rotary, and the dot with the
query heads, written as float32 scores [B, H, cap] for the latent pass of kernels/lowrank_attention.py. Two builds:
kernels/cuda/lowrank_score.cu (mma.sync) and, on Hopper, kernels/cuda/lowrank_score_wg.cu (wgmma); `tiling(...)`
picks the build and the CTA's cut (`Tiling`).

`reason(...)` says why a region cannot take it (None: it can); `scores(...)` launches it. One build per
configuration (coefficients, bits, token group, scale format, the CTA's cut, GQA, dtype), cached on disk by
kernels/cuda_module.py. Graph-safe: the length may be a device scalar, the grid comes from the capacity.
"""

from __future__ import annotations

import os
from functools import cache
from typing import NamedTuple

import torch

from tale_runtime.quant import FP8, QTensor

from .cuda_module import dequant_bias, device_scalar, loaded

SRC = os.path.join(os.path.dirname(__file__), "cuda", "lowrank_score.cu")
SRC_WG = os.path.join(os.path.dirname(__file__), "cuda", "lowrank_score_wg.cu")  # the rebuild on wgmma (sm_90a)
CSTR = 72  # cos/sin row stride in words (the .cu's CSTR)


class Tiling(NamedTuple):
    """How one CTA of the score pass is cut: HPC KV heads of one basis block on mma.sync (lowrank_score.cu, 2 warps
    per head), or wg: lowrank_score_wg.cu, one warpgroup of 2 KV heads rebuilding on wgmma (Hopper). 64-slot tiles."""

    hpc: int  # KV heads per CTA, of one basis block
    wg: bool = False

    @property
    def threads(self) -> int:
        return 128 if self.wg else 64 * self.hpc

    @property
    def src(self) -> str:
        return SRC_WG if self.wg else SRC


WG = Tiling(2, wg=True)
BT = 64  # slots per tile (the .cu's BT)


def smem_bytes(kc: int, bits: int, ktg: int, meta8: bool, rep: int, t: Tiling) -> int:
    """Dynamic shared memory of one CTA (the .cu's SMEM; its build asserts the two agree)."""
    ngt = BT // ktg if ktg < BT else 1
    mb = 1 if meta8 else 2
    stage = BT * kc * bits // 8 + 2 * ngt * kc * mb  # codes, scales, zeros
    if t.wg:
        kcp = (kc + 16) // 16 * 16  # the coefficients and the means' constant one
        return 256 * kcp * 2 + BT * kcp * 2 + stage + 2 * ngt * kcp * 2 + 16
    kcp = -(-kc // 16) * 16
    return (
        kcp * (t.hpc * 128 + 8) * 2  # basis columns
        + BT * (kcp + 8) * 2  # coefficient tile
        + BT * CSTR * 4  # cos/sin
        + t.hpc * (BT // 16) * 8 * ((rep + 1) // 2) * 16  # the halves of the dot
        + stage
        + BT * 4  # stage: positions
        + 2 * ngt * kcp * 2  # fp16 scales, zeros
        + (0 if kc < kcp else 2 * t.hpc * 64 * 4)  # column means, where the GEMM's padding row does not hold them
    )


@cache
def _smem_limit(device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024)


def tiling(
    hpb: int, K: int, kc: int, bits: int, ktg: int, meta8: bool, rep: int, limit: int, hopper: bool = False
) -> Tiling | None:
    """The CTA's cut for coefficients of this format, or None where no cut's basis columns fit `limit` bytes of
    shared memory: on Hopper, basis blocks of an even number of KV heads, the wgmma build (WG: 168 against 190 us
    for the score launch at 128K batch 1, 8B shapes, H100); else the mma.sync build with the most KV heads of one
    block (4, 2 or 1) that fit. TALE_LR_SCORE_TILE="wg" or "hpc" (an mma.sync cut of at most that many heads)
    overrides it, for timing the cuts against each other."""
    for hpc in (4, 2, 1):
        t = Tiling(hpc)
        if hpb % hpc == 0 and K % hpc == 0 and smem_bytes(kc, bits, ktg, meta8, rep, t) <= limit:
            break
    else:
        return None
    wg = hopper and hpb % 2 == 0 and K % 2 == 0 and smem_bytes(kc, bits, ktg, meta8, rep, WG) <= limit
    env = os.environ.get("TALE_LR_SCORE_TILE")
    if env and env != "wg":
        return Tiling(min(int(env), t.hpc))
    return WG if wg else t


@cache  # asked at every decode call: the answer does not change within a process
def available(device: torch.device) -> str | None:
    """None when the CUDA score pass can be built and run on `device`, else why not."""
    if device.type != "cuda":
        return "not a CUDA device"
    if not torch.cuda.is_available():
        return "no CUDA device on this machine"
    if torch.cuda.get_device_capability(device)[0] < 8:
        return "needs sm_80 or later (mma.sync m16n8k16, cp.async)"
    from .cuda_module import compiler

    if compiler() is None:
        return "neither NVRTC nor nvcc found"
    return None


def format_reason(
    device: torch.device, n: int, dtype, rep: int, hpb: int, K: int, kc: int, bits: int, ktg: int, meta: str
) -> str | None:
    """Why the CUDA score pass cannot read coefficients of this format (kc per basis block of hpb of the K KV heads,
    `bits` per code, scales over `ktg` tokens in `meta`) at head dim n in `dtype`, or None: what the cuda-lowrank
    backend asks of a cache's spec and `reason` of a region. The device is asked last (shapes first: a spec may name
    a GPU this machine lacks)."""
    if n != 128 or dtype not in (torch.bfloat16, torch.float16):
        return f"head dim {n} in {dtype} (it reads head dim 128 in bf16 or fp16)"
    if rep > 8:
        return f"{rep} query heads per KV head (at most 8)"
    if bits not in (2, 4, 8) or (kc * bits // 8) % 4:
        return f"{kc} coefficients at {bits} bits (2/4/8 bits, packed rows of whole words)"
    if not (ktg in (16, 32) or ktg % 64 == 0):  # whole groups in a tile, or whole tiles in a group
        return f"token groups of {ktg} (16, 32 or a multiple of 64)"
    if meta not in ("8/8", "16"):
        return f"scale/zero format {meta!r} (fp8 '8/8' or 16-bit)"
    if why := available(device):
        return why
    if tiling(hpb, K, kc, bits, ktg, meta == "8/8", rep, _smem_limit(device)) is None:
        return f"a basis block of {kc} coefficients does not fit shared memory"
    return None


def reason(q: torch.Tensor, keys: QTensor, rep: int, hpb: int, K: int, tables=None) -> str | None:
    """Why a low-rank region with coefficients `keys` [B, Kb, cap, KC] cannot take the CUDA score pass, or None.
    tables: the region's (cos, sin) [B, cap, 128] where RoPE comes from them, None where it is computed."""
    if type(keys) is not QTensor or keys.dim % 4 != 2:
        return "coefficients not a QTensor quantized per coefficient over token groups"
    kc, meta = keys.shape[-1], keys.meta
    if why := format_reason(q.device, q.shape[-1], q.dtype, rep, hpb, K, kc, keys.bits, keys.group, meta):
        return why
    if tables is not None:
        cos, sin = tables
        if cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.stride() != sin.stride():
            return "RoPE tables not float32 of one layout"
        if cos.stride(-1) != 1:
            return "RoPE tables not contiguous per slot"
    meta8 = meta == "8/8"
    if keys.scale.dtype != (FP8 if meta8 else torch.float16):
        return f"scales in {keys.scale.dtype} (fp8 e4m3 for '8/8', float16 for '16')"
    mb = 1 if meta8 else 2
    if any(s % 4 for s in keys.data.stride()[:3]) or keys.data.stride(-1) != 1 or keys.data.data_ptr() % 4:
        return "packed rows not word-aligned"
    sc, zr = keys.scale, keys.zero
    if sc.stride() != zr.stride() or sc.stride(-1) != 1 or any((s * mb) % 4 for s in sc.stride()[:3]):
        return "scales/zeros not word-aligned"
    if sc.data_ptr() % 4 or zr.data_ptr() % 4 or (kc * mb) % 4:
        return "scales/zeros not word-aligned"
    return None


def build_options(
    kc: int, bits: int, ktg: int, meta8: bool, rep: int, t: Tiling, bf16: bool = True, rsc: bool = False, tables=False
) -> tuple[str, ...]:
    """The .cu's -D configuration: coefficients per row, code bits, slots per scale group, fp8 scales, query heads
    per KV head, the CTA's cut, bf16 queries and cos/sin, the rotary's attention scaling, cos/sin from tables; and
    the shared memory the launch gives, which the build checks against its own layout."""
    flags = dict(KC=kc, KBITS=bits, KTG=ktg, META8=meta8, REP=rep, HPC=t.hpc)
    flags.update(Q_BF16=bf16, RDT_BF16=bf16, RSC=rsc, ROPE_TAB=tables)
    flags.update(SMEM_LAUNCH=smem_bytes(kc, bits, ktg, meta8, rep, t))
    return tuple(f"-D{k}={int(v)}" for k, v in flags.items())


def scores(
    q: torch.Tensor,  # [B, H, 1, 128]
    qk: float,  # scaling * log2 e
    keys: QTensor,  # coefficient codes [B, Kb, cap, KC]
    pos: torch.Tensor,  # int32 [B, cap]
    length,  # int or one-element device tensor
    roff: torch.Tensor,  # int32 [B]
    invf: torch.Tensor,  # float32 [64]
    rsc: float,
    dec_lo: torch.Tensor,  # [Kb, C, K 64] fp16 (lowrank_attention._basis_on)
    dec_hi: torch.Tensor,
    rows: torch.Tensor,  # [4, K 64] float32
    hpb: int,
    out: torch.Tensor,  # float32 [B, H, cap]
    tables=None,  # (cos, sin) float32 [B, cap, 128]: RoPE from them instead of the rotary
    waves: float = 1.0,
) -> None:
    """Write the scores of every slot below `length` into `out` (slots at or past it untouched)."""
    B, H, _, _ = q.shape
    K = rows.shape[1] // 64
    rep = H // K
    cap = pos.shape[1]
    kc, ktg, bits = keys.shape[-1], keys.group, keys.bits
    meta8 = keys.meta == "8/8"
    dev = q.device
    limit = _smem_limit(dev)
    t = tiling(hpb, K, kc, bits, ktg, meta8, rep, limit, torch.cuda.get_device_capability(dev) == (9, 0))
    smem = smem_bytes(kc, bits, ktg, meta8, rep, t)
    opts = build_options(kc, bits, ktg, meta8, rep, t, q.dtype == torch.bfloat16, rsc != 1.0, tables is not None)
    mod = loaded(t.src, opts, dev)
    fn = "tale_lr_score"
    mod.function(fn, smem)
    ctas = K // t.hpc
    per_sm = max(1, limit // max(smem, 1))
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    nsplit = max(1, min(-(-cap // BT), round(waves * sms * per_sm / (B * ctas))))
    len_p, len_v = device_scalar(length, pos)
    bias_p, inv_v = dequant_bias(keys, pos)
    data, sc, zr = keys.data, keys.scale, keys.zero
    mod.launch(
        fn,
        (nsplit, ctas, B),
        t.threads,
        (
            q,
            q.stride(0),
            q.stride(1),
            float(qk),
            pos,
            pos.stride(0),
            len_p,
            len_v,
            cap,
            roff,
            invf,
            float(rsc),
            *(tables if tables is not None else (invf, invf)),
            *(tables[0].stride()[:2] if tables is not None else (0, 0)),
            data,
            data.stride(0),
            data.stride(1),
            data.stride(2),
            sc,
            zr,
            sc.stride(0),
            sc.stride(1),
            sc.stride(2),
            bias_p,
            float(inv_v),
            dec_lo,
            dec_hi,
            dec_lo.stride(0),
            dec_lo.stride(1),
            rows,
            rows.shape[1],
            hpb,
            out,
            out.stride(0),
            out.stride(1),
            nsplit,
        ),
        shared=smem,
    )
