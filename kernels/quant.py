"""Triton quantize / dequantize / requantize for the layout of runtime/quant.py.

Asymmetric min/max; keys (dim=-2) per channel over groups of tokens, latents (dim=-1) per token
over groups of channels; codes packed along the last dim, element i of a byte at bit offset
(i % per_byte) * bits; scale and zero in the source dtype. A program takes a tile of whole
groups (keys: group tokens x all channels; latents: some tokens x all channels).

`requantize` is the demotion step in one pass: read packed codes, dequantize (rounded to the
source dtype, like the torch path), truncate to the first `rank` channels, requantize to
`bits`. Divisions are IEEE (div_rn), rounding is half to even, the dequantization multiplies
then adds (no FMA): the same arithmetic as the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tale_runtime.quant import QTensor

from ._common import TL_DTYPE, is_pow2, pow2, runnable, unpack


@triton.jit
def _load_x(x_ptr, xs_ptr, xz_ptr, xoff, soff_a, s_xt, s_st, t0, L, C,
            IN_BITS: tl.constexpr, GROUP: tl.constexpr, KEYS: tl.constexpr,
            BT: tl.constexpr, CP: tl.constexpr, SRC: tl.constexpr, ROUND: tl.constexpr):
    """A [BT, CP] tile in float32: raw (IN_BITS 16) or dequantized (and rounded to SRC if ROUND)."""
    t = t0 + tl.arange(0, BT)
    tm = t < L
    ch = tl.arange(0, CP)
    if IN_BITS == 16:
        x = tl.load(x_ptr + xoff + t[:, None] * s_xt + ch[None, :], mask=tm[:, None] & (ch < C)[None, :],
                    other=0.0).to(tl.float32)
    else:
        x = _dequant(x_ptr, xs_ptr, xz_ptr, xoff, soff_a, s_xt, s_st, t0, L, C, IN_BITS, GROUP, KEYS, BT, CP, SRC, ROUND)
    return x


@triton.jit
def _dequant(x_ptr, xs_ptr, xz_ptr, xoff, soff_a, s_xt, s_st, t0, L, C,
             IN_BITS: tl.constexpr, GROUP: tl.constexpr, KEYS: tl.constexpr,
             BT: tl.constexpr, CP: tl.constexpr, SRC: tl.constexpr, ROUND: tl.constexpr):
    t = t0 + tl.arange(0, BT)
    tm = t < L
    ch = tl.arange(0, CP)
    cb = tl.arange(0, CP * IN_BITS // 8)
    byts = tl.load(x_ptr + xoff + t[:, None] * s_xt + cb[None, :],
                   mask=tm[:, None] & (cb < C * IN_BITS // 8)[None, :], other=0)
    codes = unpack(byts, IN_BITS, tl.float32)
    if KEYS:
        ROWS: tl.constexpr = BT // GROUP
        r = t0 // GROUP + tl.arange(0, ROWS)
        m = (r * GROUP < L)[:, None] & (ch < C)[None, :]
        off = soff_a + r[:, None] * s_st + ch[None, :]
        sc = tl.load(xs_ptr + off, mask=m, other=0.0).to(tl.float32)
        zr = tl.load(xz_ptr + off, mask=m, other=0.0).to(tl.float32)
        x = tl.reshape(codes, (ROWS, GROUP, CP)) * sc[:, None, :] + zr[:, None, :]
    else:
        NG: tl.constexpr = CP // GROUP
        gi = tl.arange(0, NG)
        m = tm[:, None] & (gi < C // GROUP)[None, :]
        off = soff_a + t[:, None] * s_st + gi[None, :]
        sc = tl.load(xs_ptr + off, mask=m, other=0.0).to(tl.float32)
        zr = tl.load(xz_ptr + off, mask=m, other=0.0).to(tl.float32)
        x = tl.reshape(codes, (BT, NG, GROUP)) * sc[:, :, None] + zr[:, :, None]
    x = tl.reshape(x, (BT, CP))
    if ROUND:
        x = x.to(SRC).to(tl.float32)
    return x


@triton.jit
def _quant_kernel(
    x_ptr, xs_ptr, xz_ptr, s_xa, s_xd, s_xt, s_sa, s_sd, s_st,
    o_ptr, os_ptr, oz_ptr, s_oa, s_od, s_ot, s_osa, s_osd, s_ost,
    L, C,
    IN_BITS: tl.constexpr, OUT_BITS: tl.constexpr, GROUP: tl.constexpr, KEYS: tl.constexpr,
    BT: tl.constexpr, CP: tl.constexpr, SRC: tl.constexpr,
):
    t0 = tl.program_id(0) * BT
    d = tl.program_id(1).to(tl.int64)
    a = tl.program_id(2).to(tl.int64)
    x = _load_x(x_ptr, xs_ptr, xz_ptr, a * s_xa + d * s_xd, a * s_sa + d * s_sd, s_xt, s_st, t0, L, C,
                IN_BITS, GROUP, KEYS, BT, CP, SRC, True)
    QMAX: tl.constexpr = (1 << OUT_BITS) - 1
    t = t0 + tl.arange(0, BT)
    tm = t < L
    ch = tl.arange(0, CP)
    if KEYS:  # per channel over GROUP tokens
        ROWS: tl.constexpr = BT // GROUP
        x3 = tl.reshape(x, (ROWS, GROUP, CP))
        mn = tl.min(x3, axis=1)
        scale = tl.math.div_rn(tl.max(x3, axis=1) - mn, QMAX * 1.0)
        safe = tl.where(scale > 0, scale, 1.0)
        v = tl.math.div_rn(x3 - mn[:, None, :], safe[:, None, :])
        r = t0 // GROUP + tl.arange(0, ROWS)
        soff = a * s_osa + d * s_osd + r[:, None] * s_ost + ch[None, :]
        sm = (r * GROUP < L)[:, None] & (ch < C)[None, :]
    else:  # per token over GROUP channels
        NG: tl.constexpr = CP // GROUP
        x3 = tl.reshape(x, (BT, NG, GROUP))
        mn = tl.min(x3, axis=2)
        scale = tl.math.div_rn(tl.max(x3, axis=2) - mn, QMAX * 1.0)
        safe = tl.where(scale > 0, scale, 1.0)
        v = tl.math.div_rn(x3 - mn[:, :, None], safe[:, :, None])
        gi = tl.arange(0, NG)
        soff = a * s_osa + d * s_osd + t[:, None] * s_ost + gi[None, :]
        sm = tm[:, None] & (gi < C // GROUP)[None, :]
    tl.store(os_ptr + soff, scale.to(SRC), mask=sm)
    tl.store(oz_ptr + soff, mn.to(SRC), mask=sm)
    # round half to even (as torch.round) by the 1.5 * 2^23 trick, after the clamp
    v = tl.minimum(tl.maximum(v, 0.0), QMAX * 1.0)
    v = (v + 12582912.0) - 12582912.0
    codes = tl.reshape(v, (BT, CP)).to(tl.int32)
    PER: tl.constexpr = 8 // OUT_BITS
    if OUT_BITS == 8:
        packed = codes.to(tl.uint8)
    else:
        shifts = tl.arange(0, PER) * OUT_BITS
        packed = tl.sum(tl.reshape(codes, (BT, CP // PER, PER)) << shifts[None, None, :], axis=2).to(tl.uint8)
    cb = tl.arange(0, CP // PER)
    tl.store(o_ptr + a * s_oa + d * s_od + t[:, None] * s_ot + cb[None, :], packed,
             mask=tm[:, None] & (cb < C // PER)[None, :])


@triton.jit
def _dequant_kernel(
    x_ptr, xs_ptr, xz_ptr, s_xa, s_xd, s_xt, s_sa, s_sd, s_st,
    o_ptr, s_oa, s_od, s_ot,
    L, C,
    IN_BITS: tl.constexpr, GROUP: tl.constexpr, KEYS: tl.constexpr,
    BT: tl.constexpr, CP: tl.constexpr, SRC: tl.constexpr, OUT: tl.constexpr,
):
    t0 = tl.program_id(0) * BT
    d = tl.program_id(1).to(tl.int64)
    a = tl.program_id(2).to(tl.int64)
    x = _load_x(x_ptr, xs_ptr, xz_ptr, a * s_xa + d * s_xd, a * s_sa + d * s_sd, s_xt, s_st, t0, L, C,
                IN_BITS, GROUP, KEYS, BT, CP, SRC, False)
    t = t0 + tl.arange(0, BT)
    ch = tl.arange(0, CP)
    tl.store(o_ptr + a * s_oa + d * s_od + t[:, None] * s_ot + ch[None, :], x.to(OUT),
             mask=(t < L)[:, None] & (ch < C)[None, :])


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
    if L == 0 or C * bits % 8 or pow2(C) > 8192:
        return False
    if _keys(dim, len(shape)):
        return L % group == 0 and group <= 1024
    return dim % len(shape) == len(shape) - 1 and C % group == 0


def _launch_quant(src: QTensor | torch.Tensor, C: int, bits: int, group: int, keys: bool, dtype: torch.dtype) -> QTensor:
    raw = isinstance(src, torch.Tensor)
    x = _as4d(src if raw else src.data)
    xs = x if raw else _as4d(src.scale)
    xz = x if raw else _as4d(src.zero)
    A, D, L = x.shape[:3]
    dev = x.device
    out = torch.empty(A, D, L, C * bits // 8, device=dev, dtype=torch.uint8)
    sshape = (A, D, L // group, C) if keys else (A, D, L, C // group)
    scale = torch.empty(sshape, device=dev, dtype=dtype)
    zero = torch.empty(sshape, device=dev, dtype=dtype)
    CP = pow2(C)
    BT = _tile(keys, group, CP)
    _quant_kernel[(triton.cdiv(L, BT), D, A)](
        x, xs, xz, x.stride(0), x.stride(1), x.stride(2), xs.stride(0), xs.stride(1), xs.stride(2),
        out, scale, zero, out.stride(0), out.stride(1), out.stride(2),
        scale.stride(0), scale.stride(1), scale.stride(2),
        L, C,
        IN_BITS=16 if raw else src.bits, OUT_BITS=bits, GROUP=group, KEYS=keys, BT=BT, CP=CP, SRC=TL_DTYPE[dtype],
        num_warps=4, **_no_fma(dev),
    )
    lead = (src if raw else src.data).shape[:-2]
    return QTensor(out.view(*lead, L, -1), scale.view(*lead, *sshape[-2:]), zero.view(*lead, *sshape[-2:]),
                   bits, group, -2 if keys else -1)


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
    return _launch_quant(q, C, bits, q.group, _keys(q.dim, q.data.dim()), q.scale.dtype)


def dequantize(q: QTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Same result as tale_runtime.quant.dequantize for a packed QTensor."""
    dtype = dtype or q.scale.dtype
    keys = _keys(q.dim, q.data.dim())
    x, xs, xz = _as4d(q.data), _as4d(q.scale), _as4d(q.zero)
    A, D, L = x.shape[:3]
    C = q.shape[-1]
    out = torch.empty(A, D, L, C, device=x.device, dtype=dtype)
    CP = pow2(C)
    BT = _tile(keys, q.group, CP)
    _dequant_kernel[(triton.cdiv(L, BT), D, A)](
        x, xs, xz, x.stride(0), x.stride(1), x.stride(2), xs.stride(0), xs.stride(1), xs.stride(2),
        out, out.stride(0), out.stride(1), out.stride(2),
        L, C,
        IN_BITS=q.bits, GROUP=q.group, KEYS=keys, BT=BT, CP=CP, SRC=TL_DTYPE[q.scale.dtype], OUT=TL_DTYPE[dtype],
        num_warps=4, **_no_fma(x.device),
    )
    return out.view(*q.data.shape[:-1], C)
