"""Triton quantize / dequantize / requantize for the layout of runtime/quant.py.

Asymmetric min/max; keys (dim=-2) per channel over groups of tokens, latents (dim=-1) per token
over groups of channels; codes packed along the last dim in planes (element c of a row of nb
bytes in byte c % nb at bit offset (c // nb) * bits); scale and zero in 16 bits per meta_format (bfloat16
sources: float16 times 2^-8, MSH).
A program takes a tile of whole groups (keys: group tokens x all channels; latents: some
tokens x all channels).

`requantize` is the demotion step in one pass: read packed codes, dequantize (rounded to the
source dtype, like the torch path), truncate to the first `rank` channels, requantize to
`bits`. Divisions are IEEE (div_rn), rounding is half to even, the dequantization multiplies
then adds (no FMA): the same arithmetic as the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tale_runtime.quant import QTensor, meta_format

from ._common import TL_DTYPE, is_pow2, pow2, runnable


@triton.jit
def _load_tile(
    x_ptr,
    xs_ptr,
    xz_ptr,
    s_xa,
    s_xd,
    s_xt,
    s_sa,
    s_sd,
    s_st,
    L,
    ch,
    cm,
    NB_IN,
    IN_BITS: tl.constexpr,
    GROUP: tl.constexpr,
    KEYS: tl.constexpr,
    BT: tl.constexpr,
    SRC: tl.constexpr,
    ROUND: tl.constexpr,
    MSH: tl.constexpr,
):
    """The program's tile (grid (token tiles, D, A) over the input viewed as [A, D, L, C]): float32 [BT, W] of the
    channels `ch` [W] (mask `cm`), raw (IN_BITS 16) or dequantized (rounded to SRC if ROUND; scale and zero stored
    times MSH), with its first token t0, its tokens t [BT] and the program's d, a. Packed codes and their scales are
    gathered per element: any channel order in, whatever the input's plane layout (NB_IN bytes per row)."""
    t0 = tl.program_id(0) * BT
    d = tl.program_id(1).to(tl.int64)
    a = tl.program_id(2).to(tl.int64)
    xoff = a * s_xa + d * s_xd
    soff = a * s_sa + d * s_sd
    t = t0 + tl.arange(0, BT)
    m = (t < L)[:, None] & cm[None, :]
    if IN_BITS == 16:
        x = tl.load(x_ptr + xoff + t[:, None] * s_xt + ch[None, :], mask=m, other=0.0).to(tl.float32)
    else:
        byte = ch % NB_IN
        shift = (ch // NB_IN) * IN_BITS
        b = tl.load(x_ptr + xoff + t[:, None] * s_xt + byte[None, :], mask=m, other=0).to(tl.int32)
        code = ((b >> shift[None, :]) & ((1 << IN_BITS) - 1)).to(tl.float32)
        if KEYS:  # per channel over token groups
            off = soff + (t // GROUP)[:, None] * s_st + ch[None, :]
        else:  # per token over channel groups
            off = soff + t[:, None] * s_st + (ch // GROUP)[None, :]
        sc = tl.load(xs_ptr + off, mask=m, other=0.0).to(tl.float32)
        zr = tl.load(xz_ptr + off, mask=m, other=0.0).to(tl.float32)
        if MSH != 1.0:  # a power of two: exact
            sc = sc * (1.0 / MSH)
            zr = zr * (1.0 / MSH)
        x = code * sc + zr
        if ROUND:
            x = x.to(SRC).to(tl.float32)
    return x, t0, t, d, a


@triton.jit
def _quant_kernel(
    x_ptr, xs_ptr, xz_ptr, s_xa, s_xd, s_xt, s_sa, s_sd, s_st,  # the input (_load_tile)
    o_ptr, os_ptr, oz_ptr, s_oa, s_od, s_ot, s_osa, s_osd, s_ost,  # the codes, scales and zeros out
    L, NB, NB_IN,
    IN_BITS: tl.constexpr, OUT_BITS: tl.constexpr, GROUP: tl.constexpr, KEYS: tl.constexpr, BT: tl.constexpr,
    NBP: tl.constexpr, SRC: tl.constexpr, IN_MSH: tl.constexpr, MDT: tl.constexpr, MSH: tl.constexpr,
):  # fmt: skip
    """Quantize a tile of whole groups (the input's scale/zero stored times IN_MSH, the output's in MDT times MSH).
    Columns run in the output's plane order, padded: column u = (plane u // NBP, byte u % NBP) holds channel (u // NBP) * NB + u % NBP, so the
    packing is a reshape and a shifted sum; latent groups never straddle planes (NB % GROUP == 0)."""
    PER: tl.constexpr = 8 // OUT_BITS
    CP: tl.constexpr = PER * NBP
    u = tl.arange(0, CP)
    jj = u % NBP
    ch = (u // NBP) * NB + jj
    cm = jj < NB
    x, t0, t, d, a = _load_tile(
        x_ptr, xs_ptr, xz_ptr, s_xa, s_xd, s_xt, s_sa, s_sd, s_st, L, ch, cm, NB_IN, IN_BITS, GROUP, KEYS, BT, SRC,
        True, IN_MSH,
    )  # fmt: skip
    QMAX: tl.constexpr = (1 << OUT_BITS) - 1
    tm = t < L
    if KEYS:  # per channel over GROUP tokens
        ROWS: tl.constexpr = BT // GROUP
        x3 = tl.reshape(x, (ROWS, GROUP, CP))
        mn = tl.min(x3, axis=1)
        scale = tl.math.div_rn(tl.max(x3, axis=1) - mn, QMAX * 1.0)
        safe = tl.where(scale > 0, scale, 1.0)
        v = tl.math.div_rn(x3 - mn[:, None, :], safe[:, None, :])
        r = t0 // GROUP + tl.arange(0, ROWS)
        soff = a * s_osa + d * s_osd + r[:, None] * s_ost + ch[None, :]
        sm = (r * GROUP < L)[:, None] & cm[None, :]
    else:  # per token over GROUP channels
        NG: tl.constexpr = CP // GROUP
        x3 = tl.reshape(x, (BT, NG, GROUP))
        mn = tl.min(x3, axis=2)
        scale = tl.math.div_rn(tl.max(x3, axis=2) - mn, QMAX * 1.0)
        safe = tl.where(scale > 0, scale, 1.0)
        v = tl.math.div_rn(x3 - mn[:, :, None], safe[:, :, None])
        u0 = tl.arange(0, NG) * GROUP  # first column of each group slot
        gch = (u0 // NBP) * NB + u0 % NBP
        soff = a * s_osa + d * s_osd + t[:, None] * s_ost + (gch // GROUP)[None, :]
        sm = tm[:, None] & (u0 % NBP < NB)[None, :]
    tl.store(os_ptr + soff, (scale * MSH).to(MDT), mask=sm)
    tl.store(oz_ptr + soff, (mn * MSH).to(MDT), mask=sm)
    # round half to even (as torch.round) by the 1.5 * 2^23 trick, after the clamp
    v = tl.minimum(tl.maximum(v, 0.0), QMAX * 1.0)
    v = (v + 12582912.0) - 12582912.0
    codes = tl.reshape(v, (BT, CP)).to(tl.int32)
    if OUT_BITS == 8:
        packed = codes.to(tl.uint8)
    else:
        shifts = tl.arange(0, PER) * OUT_BITS
        packed = tl.sum(tl.reshape(codes, (BT, PER, NBP)) << shifts[None, :, None], axis=1).to(tl.uint8)
    cb = tl.arange(0, NBP)
    tl.store(
        o_ptr + a * s_oa + d * s_od + t[:, None] * s_ot + cb[None, :], packed, mask=tm[:, None] & (cb < NB)[None, :]
    )


@triton.jit
def _dequant_kernel(
    x_ptr, xs_ptr, xz_ptr, s_xa, s_xd, s_xt, s_sa, s_sd, s_st,  # the input (_load_tile)
    o_ptr, s_oa, s_od, s_ot,  # the values out
    L, C, NB_IN,
    IN_BITS: tl.constexpr, GROUP: tl.constexpr, KEYS: tl.constexpr, BT: tl.constexpr, CP: tl.constexpr,
    MSH: tl.constexpr, OUT: tl.constexpr,
):  # fmt: skip
    ch = tl.arange(0, CP)
    x, t0, t, d, a = _load_tile(
        x_ptr, xs_ptr, xz_ptr, s_xa, s_xd, s_xt, s_sa, s_sd, s_st, L, ch, ch < C, NB_IN, IN_BITS, GROUP, KEYS, BT, OUT,
        False, MSH,
    )  # fmt: skip
    tl.store(
        o_ptr + a * s_oa + d * s_od + t[:, None] * s_ot + ch[None, :],
        x.to(OUT),
        mask=(t < L)[:, None] & (ch < C)[None, :],
    )


def _as4d(t: torch.Tensor) -> torch.Tensor:
    """[..., L, C] -> [A, D, L, C] (a view where the strides allow), last dim contiguous."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    while t.dim() < 4:
        t = t.unsqueeze(0)
    return t.reshape(-1, *t.shape[-3:]) if t.dim() > 4 else t


def _keys(dim: int, ndim: int) -> bool:
    return dim % ndim == ndim - 2


def _tile(keys: bool, group: int, CP: int) -> int:
    """Tokens per program: about 4K elements, whole key groups."""
    bt = max(1, 4096 // CP)
    return max(group, bt // group * group) if keys else min(bt, 64)


def supports(shape: torch.Size, bits: int, group: int, dim: int, *tensors: torch.Tensor) -> bool:
    """Cases the kernels cover; everything else (including invalid input) goes to the torch path,
    which raises the usual errors."""
    if bits not in (2, 4, 8) or not is_pow2(group) or len(shape) < 2 or not runnable(*tensors):
        return False
    if any(t.is_floating_point() and t.dtype not in TL_DTYPE for t in tensors):
        return False
    L, C = shape[-2], shape[-1]
    if L == 0 or C * bits % 8 or (8 // bits) * pow2(C * bits // 8) > 8192:
        return False
    if _keys(dim, len(shape)):
        return L % group == 0 and group <= 1024
    # latent groups must not straddle the planes of the packed layout
    return dim % len(shape) == len(shape) - 1 and (C * bits // 8) % group == 0


def _launch_quant(
    src: QTensor | torch.Tensor, C: int, bits: int, group: int, keys: bool, dtype: torch.dtype
) -> QTensor:
    """Quantize src (a tensor, or a QTensor to requantize) of source dtype `dtype`."""
    raw = isinstance(src, torch.Tensor)
    mdt, msh = meta_format(dtype)
    x = _as4d(src if raw else src.data)
    xs = x if raw else _as4d(src.scale)
    xz = x if raw else _as4d(src.zero)
    A, D, L = x.shape[:3]
    dev = x.device
    out = torch.empty(A, D, L, C * bits // 8, device=dev, dtype=torch.uint8)
    sshape = (A, D, L // group, C) if keys else (A, D, L, C // group)
    scale = torch.empty(sshape, device=dev, dtype=mdt)
    zero = torch.empty(sshape, device=dev, dtype=mdt)
    NB, NBP = C * bits // 8, pow2(C * bits // 8)
    BT = _tile(keys, group, (8 // bits) * NBP)
    _quant_kernel[(triton.cdiv(L, BT), D, A)](
        x,
        xs,
        xz,
        *x.stride()[:3],
        *xs.stride()[:3],
        out,
        scale,
        zero,
        *out.stride()[:3],
        *scale.stride()[:3],
        L,
        NB,
        1 if raw else x.shape[-1],
        IN_BITS=16 if raw else src.bits,
        OUT_BITS=bits,
        GROUP=group,
        KEYS=keys,
        BT=BT,
        NBP=NBP,
        SRC=TL_DTYPE[dtype],
        IN_MSH=1.0 if raw else src.shift,
        MDT=TL_DTYPE[mdt],
        MSH=msh,
        num_warps=4,
        **_no_fma(dev),
    )
    lead = (src if raw else src.data).shape[:-2]
    return QTensor(
        out.view(*lead, L, -1),
        scale.view(*lead, *sshape[-2:]),
        zero.view(*lead, *sshape[-2:]),
        bits,
        group,
        -2 if keys else -1,
        shift=msh,
    )


def _no_fma(dev: torch.device) -> dict:
    """The torch path multiplies then adds (two roundings); keep the GPU from fusing them."""
    return {"enable_fp_fusion": False} if dev.type == "cuda" else {}


def quantize(x: torch.Tensor, bits: int, group: int, dim: int) -> QTensor:
    """Same result as tale_runtime.quant.quantize (bits 2, 4, 8; see supports)."""
    if x.dtype not in TL_DTYPE:
        raise TypeError(f"quantize: unsupported dtype {x.dtype}")
    return _launch_quant(x, x.shape[-1], bits, group, _keys(dim, x.dim()), x.dtype)


def requantize(q: QTensor, bits: int, rank: int | None = None) -> QTensor:
    """dequantize -> keep the first `rank` channels (latents) -> quantize to `bits`, in one pass."""
    C = q.shape[-1] if rank is None else rank
    return _launch_quant(q, C, bits, q.group, _keys(q.dim, q.data.dim()), q.source_dtype)


def dequantize(q: QTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Same result as tale_runtime.quant.dequantize for a packed QTensor."""
    dtype = dtype or q.source_dtype
    keys = _keys(q.dim, q.data.dim())
    x, xs, xz = _as4d(q.data), _as4d(q.scale), _as4d(q.zero)
    A, D, L = x.shape[:3]
    C = q.shape[-1]
    out = torch.empty(A, D, L, C, device=x.device, dtype=dtype)
    CP = pow2(C)
    BT = _tile(keys, q.group, CP)
    _dequant_kernel[(triton.cdiv(L, BT), D, A)](
        x,
        xs,
        xz,
        *x.stride()[:3],
        *xs.stride()[:3],
        out,
        *out.stride()[:3],
        L,
        C,
        x.shape[-1],
        IN_BITS=q.bits,
        GROUP=q.group,
        KEYS=keys,
        BT=BT,
        CP=CP,
        MSH=q.shift,
        OUT=TL_DTYPE[dtype],
        num_warps=4,
        **_no_fma(x.device),
    )
    return out.view(*q.data.shape[:-1], C)
