"""KIVI-style asymmetric min/max quantization with real bit packing (torch reference).

Layout (the Triton kernels in tale_kernels use exactly this one):
- Values are quantized in groups of `group` consecutive elements along `dim`
  (keys: dim=-2, tokens; latents: dim=-1, channels). `scale` and `zero` (the group
  minimum) have that dim divided by `group`, in the source dtype.
- Codes q = round((x - zero) / scale) in [0, 2^bits - 1] are packed along the LAST
  dim into uint8 in planes: with C elements and nb = C * bits / 8 bytes per row, element c
  sits in byte c % nb at bit offset (c // nb) * bits. Plane i (bits i*b..) of the row's bytes
  holds the contiguous elements i*nb .. i*nb + nb - 1, so a kernel gets a contiguous channel
  block from one shift and mask of the loaded bytes (no interleaving; docs/kernels.md).
- bits = 3 is bit-sliced: the low 2 bits of the C codes packed as above at 2 bits (C / 4 bytes), then
  the high bit at 1 bit (C / 8 bytes), so the packed last dim is last_dim * 3 / 8 (last_dim a multiple
  of 8). Channels s*C/8 .. (s+1)*C/8 - 1 ("sub-plane" s) are then bits 2 (s // 2) of low-byte half s % 2
  and bit s of the high bytes: constant shifts, as for 2/4 bits. The decode kernel reads 3-bit keys
  (not latents); quantize / dequantize run in torch.
- bits = 16 means "not quantized": the tensor is kept as it is.
- meta: how scale and zero are stored ("scale/zero"). "16": both in the source dtype (KIVI; 32
  bits per group, i.e. 1 bit per number at groups of 32). "8/16": the scale as float8_e4m3fn
  (rounded up so the group's range stays covered), the zero in the source dtype. "8/8": both fp8;
  the zero is rounded down and the scale computed from the stored zero, so codes never clip. fp8
  values are stored times `bias`, a power of two per tensor that puts its largest scale/zero near
  e4m3's top (448/4), so e4m3's 3 mantissa bits serve every magnitude; cat re-biases exactly. (The zero, a group minimum, needs 16 bits where groups sit far from 0: per-channel keys.)
  16-bit scales/zeros of a bfloat16 tensor are stored as float16 times `shift` = 2^-8 (meta_format): the same
  bytes with 3 more mantissa bits, and the decode kernel's float16 tensor-core operands (which carry bf16 values
  times 2^-8) read them as they are. float16 holds them for |x| < 1.6e7 (beyond: inf, so NaN downstream); below
  2^-6 they are float16 subnormals, at most 7.6e-6 off (coarser than bf16's rounding only below 2^-8).

Bands (keys only, per channel over token groups): the channels of each KV head split into sets, each
quantized at its own bit width (the most important channels by a calibration statistic get more bits).
Each set is an ordinary QTensor over the gathered channels [..., c_i]; `index` [K, c_i] says which.
Quantizing channels per channel is independent across channels, so bands with equal bits dequantize
exactly like one QTensor. The decode kernel reads up to two bands per region (each scored against the
query's channels of that band); quantize / dequantize run in torch.

On CUDA, quantize / dequantize / requantize run tale_kernels' Triton kernels when Triton is
installed (same layout and results, up to rare one-step differences on rounding ties).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch


@dataclass
class QTensor:
    data: torch.Tensor  # uint8 packed codes, or the raw tensor when bits == 16
    scale: torch.Tensor | None
    zero: torch.Tensor | None
    bits: int
    group: int
    dim: int  # -1 or -2: the dim quantization groups run along
    meta: str = "16"  # scale/zero storage, see META
    # fp8 formats: scale (and fp8 zero) are stored times this power of two; a static cache's buffers hold it as a
    # one-element float32 device tensor (a captured CUDA graph then reads the current value)
    bias: float | torch.Tensor = 1.0
    shift: float = 1.0  # 16-bit scale/zero stored times this power of two (meta_format)

    @property
    def shape(self) -> torch.Size:
        if self.bits == 16:
            return self.data.shape
        *lead, last = self.data.shape
        return torch.Size([*lead, last * 8 // self.bits])

    @property
    def plain(self) -> bool:
        """The layout tale_kernels reads: 2/4/8 bits (or 16), 16-bit scale and zero (meta_format)."""
        return self.bits in (2, 4, 8, 16) and self.meta == "16"

    def nbytes(self) -> int:
        fp8_bias = 4 if self.meta != "16" else 0  # one float32 per tensor
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.zero) if t is not None) + fp8_bias

    @property
    def source_dtype(self) -> torch.dtype:
        """The dtype dequantize returns by default: the source's where the metadata tells it, else float32."""
        if self.bits == 16:
            return self.data.dtype
        if self.shift != 1.0:
            return torch.bfloat16
        return self.zero.dtype if self.zero.dtype != FP8 else torch.float32

    def meta_float(self, t: torch.Tensor) -> torch.Tensor:
        """Its scale or zero `t` as the float32 values they stand for."""
        return t.float() / (self.bias if t.dtype == FP8 else self.shift)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self, dtype)


@dataclass
class Bands:
    """Keys [..., K, T, n] in channel bands: parts[i] holds, per KV head k, channels index[i][k] (sorted)."""

    parts: list[QTensor]  # [..., K, T, c_i] each
    index: list[torch.Tensor]  # [K, c_i] int64 each
    n: int  # channels per head

    @property
    def shape(self) -> torch.Size:
        return torch.Size([*self.parts[0].shape[:-1], self.n])

    @property
    def bits(self) -> tuple[int, ...]:
        return tuple(p.bits for p in self.parts)

    @property
    def plain(self) -> bool:
        return False

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)  # index: shared by every token of the layer, not cached data

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        xs = [p.dequantize(dtype) for p in self.parts]
        out = xs[0].new_empty(self.shape)
        for x, idx in zip(xs, self.index):
            out.scatter_(-1, _expand(idx, x), x)
        return out


def _expand(idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """index [K, c] -> [..., K, T, c] to gather/scatter the last dim of x [..., K, T, *]."""
    K, c = idx.shape
    lead = x.shape[:-3]
    return idx.to(x.device)[..., None, :].expand(*lead, K, x.shape[-2], c)


def quantize_bands(
    x: torch.Tensor, bands: list[tuple[int, torch.Tensor]], group: int, meta: str = "16", device_bias: bool = False
) -> Bands:
    """x [..., K, T, n] -> Bands: per (bits, index [K, c]) the channels index[k] of head k, per channel
    over `group` tokens (dim -2). The index sets must partition each head's channels."""
    parts = [
        quantize(x.gather(-1, _expand(idx, x)).contiguous(), bits, group, -2, meta, device_bias) for bits, idx in bands
    ]
    return Bands(parts, [idx for _, idx in bands], x.shape[-1])


META = ("16", "8/16", "8/8")
BITS = (1, 2, 3, 4, 8)
FP8 = torch.float8_e4m3fn

META_SHIFT = 2.0**-8


def meta_format(dtype: torch.dtype, meta: str = "16") -> tuple[torch.dtype, float]:
    """(dtype, shift) of the 16-bit scales and zeros of a `dtype` tensor: bfloat16 ones in float16 times 2^-8. The
    shift is the QTensor's: 1 for `meta` "8/8", which stores no 16-bit ones."""
    if dtype != torch.bfloat16:
        return dtype, 1.0
    return torch.float16, (META_SHIFT if meta != "8/8" else 1.0)


def _kernels(t: torch.Tensor):
    """The registered "quant" op (tale_runtime.backends: Triton quantize/pack) for CUDA tensors, or None."""
    if not t.is_cuda:
        return None
    from .backends import op

    return op("quant")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes (any int dtype, values < 2^bits) along the last dim into uint8."""
    if bits == 8:
        return codes.to(torch.uint8)
    if bits == 3:
        return _pack3(codes)
    per = 8 // bits
    *lead, last = codes.shape
    if last % per:
        raise ValueError(f"last dim {last} is not a multiple of {per} (needed to pack {bits}-bit codes)")
    c = codes.to(torch.uint8).reshape(*lead, per, last // per)  # [..., plane, byte]
    shifts = torch.arange(per, device=codes.device, dtype=torch.uint8)[:, None] * bits
    return (c << shifts).sum(dim=-2, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack: uint8 [..., m] -> uint8 codes [..., m * 8 / bits]."""
    if bits == 8:
        return packed
    if bits == 3:
        return _unpack3(packed)
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.uint8) * bits
    codes = (packed.unsqueeze(-2) >> shifts[:, None]) & ((1 << bits) - 1)  # [..., plane, byte]
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def _pack3(codes: torch.Tensor) -> torch.Tensor:
    last = codes.shape[-1]
    if last % 8:
        raise ValueError(f"last dim {last} is not a multiple of 8 (needed to pack 3-bit codes)")
    c = codes.to(torch.uint8)
    return torch.cat([pack(c & 3, 2), pack(c >> 2, 1)], dim=-1)  # [..., C/4 low | C/8 high]


def _unpack3(packed: torch.Tensor) -> torch.Tensor:
    lo, hi = packed.split([packed.shape[-1] * 2 // 3, packed.shape[-1] // 3], dim=-1)
    return unpack(lo, 2) | (unpack(hi, 1) << 2)


def _fp8_round(x: torch.Tensor, up: bool) -> torch.Tensor:
    """x (float32) -> the nearest float8_e4m3fn at or above (up) / at or below x, saturating at +-448. Float ops
    only (no table, nothing from the host, no dtype views): inductor fuses it, and a CUDA graph captures it."""
    y = x.clamp(-448.0, 448.0)
    r = y.to(FP8).float()  # the nearest value: on the wrong side of y, the directed one is its neighbour
    a = r.abs()
    m, e = torch.frexp(a)  # a = m * 2^e, m in [0.5, 1): binade e - 1, 3 mantissa bits, subnormals below 2^-6
    away = torch.exp2((torch.maximum(e - 1, torch.full_like(e, -6)) - 3).float())  # the gap to |r|'s next above
    toward = torch.exp2((torch.maximum(e - 1 - (m == 0.5).int(), torch.full_like(e, -6)) - 3).float())  # below
    away = torch.where(a == 0, 2.0**-9, away)
    if up:
        moved, wrong = r + torch.where(r >= 0, away, toward), r < y
    else:
        moved, wrong = r - torch.where(r > 0, toward, away), r > y
    return torch.where(wrong, moved, r).to(FP8)


def _grouped(x: torch.Tensor, group: int, dim: int) -> torch.Tensor:
    """View x with `dim` split into (n_groups, group); returns the view and the reduce dim."""
    dim = dim % x.dim()
    size = x.shape[dim]
    if size % group:
        raise ValueError(f"size {size} along dim {dim} is not a multiple of the quantization group {group}")
    return x.reshape(*x.shape[:dim], size // group, group, *x.shape[dim + 1 :]), dim + 1


def quantize(x: torch.Tensor, bits: int, group: int, dim: int, meta: str = "16", device_bias: bool = False) -> QTensor:
    """device_bias: an fp8 format's bias stays a 0-d float32 tensor on x's device (the same value, no host read: what a
    captured CUDA graph can run)."""
    if bits == 16:
        return QTensor(x, None, None, 16, group, dim)
    if bits not in BITS:
        raise ValueError(f"unsupported bit width {bits}")
    if meta not in META:
        raise ValueError(f"unsupported scale/zero format {meta!r}: use one of {', '.join(META)}")
    k = _kernels(x)
    if meta == "16" and bits != 3 and k and k.supports(x.shape, bits, group, dim, x):
        return k.quantize(x, bits, group, dim)
    xg, rd = _grouped(x.float(), group, dim)
    mn = xg.amin(dim=rd, keepdim=True)
    mx = xg.amax(dim=rd, keepdim=True)
    qmax = (1 << bits) - 1
    mdt, shift = meta_format(x.dtype, meta)
    if meta == "16":
        scale_s, zero = ((mx - mn) / qmax * shift).to(mdt), (mn * shift).to(mdt)
        scale = (mx - mn) / qmax
        bias = 1.0
    else:
        top = torch.maximum((mx - mn).amax() / qmax, mn.abs().amax() if meta == "8/8" else mn.new_zeros(()))
        if device_bias:  # float64 as the host's math.log2 of the float32 top
            t64 = top.double()
            bias = torch.where(t64 > 0, torch.exp2(torch.floor(torch.log2(112.0 / t64))), 1.0).float()
        else:
            bias = 2.0 ** math.floor(math.log2(112.0 / top.item())) if top > 0 else 1.0
        zero = (mn * shift).to(mdt) if meta == "8/16" else _fp8_round(mn * bias, up=False)
        mn = zero.float() / (shift if meta == "8/16" else bias)  # codes against the stored zero and scale: none clip
        scale_s = _fp8_round((mx - mn).clamp_min(0) / qmax * bias, up=True)
        scale = scale_s.float() / bias
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((xg - mn) / safe).round_().clamp_(0, qmax).reshape(x.shape)
    return QTensor(pack(codes, bits), scale_s.squeeze(rd), zero.squeeze(rd), bits, group, dim, meta, bias, shift)


def dequantize(q: QTensor | Bands, dtype: torch.dtype | None = None) -> torch.Tensor:
    if isinstance(q, Bands):
        return q.dequantize(dtype)
    if q.bits == 16:
        return q.data if dtype is None else q.data.to(dtype)
    k = _kernels(q.data)
    if q.plain and k and k.supports(q.shape, q.bits, q.group, q.dim, q.data, q.scale):
        return k.dequantize(q, dtype)
    dtype = dtype or q.source_dtype
    scale, zero = q.meta_float(q.scale), q.meta_float(q.zero)
    codes = unpack(q.data, q.bits).float()
    cg, rd = _grouped(codes, q.group, q.dim)
    x = cg * scale.unsqueeze(rd) + zero.unsqueeze(rd)
    return x.reshape(codes.shape).to(dtype)


def requantize(
    q: QTensor,
    bits: int,
    rank: int | None = None,
    *,
    group: int | None = None,
    dim: int | None = None,
    meta: str | None = None,
    device_bias: bool = False,
) -> QTensor:
    """Demotion: dequantize, keep the first `rank` channels, quantize to `bits` (by default with q's
    group, dim and meta; a level may use another layout). One pass on CUDA for the plain layout. device_bias: as
    quantize's."""
    if isinstance(q, Bands):
        x = q.dequantize()
        x = x if rank is None else x[..., :rank].contiguous()
        g, d = group or q.parts[0].group, -2 if dim is None else dim
        return quantize(x, bits, g, d, meta or q.parts[0].meta, device_bias)
    group, dim, meta = group or q.group, q.dim if dim is None else dim, meta or q.meta
    k = _kernels(q.data)
    shape = q.shape if rank is None else torch.Size([*q.shape[:-1], rank])
    same = group == q.group and dim == q.dim and meta == "16" and bits != 3
    if same and q.plain and k and k.supports(shape, bits, q.group, q.dim, q.data, q.scale):
        return k.requantize(q, bits, rank)
    x = dequantize(q)
    if rank is not None:
        x = x[..., :rank].contiguous()
    return quantize(x, bits, group, dim, meta, device_bias)


def cat(parts: list[QTensor | Bands]) -> QTensor | Bands:
    """Concatenate quantized tensors along the token dim (-2); groups never straddle parts."""
    a = parts[0]
    if isinstance(a, Bands):  # the same bands (a layer's index) in every part
        return Bands([cat([p.parts[i] for p in parts]) for i in range(len(a.parts))], a.index, a.n)
    if a.bits == 16:
        return QTensor(torch.cat([p.data for p in parts], dim=-2), None, None, 16, a.group, a.dim)
    if any(p.shift != a.shift for p in parts):
        raise ValueError("cat: parts store their scales/zeros in different formats")
    bias = min(p.bias for p in parts)
    parts = [_rebias(p, bias) for p in parts]
    # keys (dim=-2) carry one scale row per token group, latents (dim=-1) one per token: both cat on -2
    return replace(
        a,
        data=torch.cat([p.data for p in parts], dim=-2),
        scale=torch.cat([p.scale for p in parts], dim=-2),
        zero=torch.cat([p.zero for p in parts], dim=-2),
        bias=bias,
    )


def _rebias(q: QTensor, bias: float) -> QTensor:
    """q's fp8 scale (and fp8 zero) stored times `bias` instead (a smaller power of two: exact unless a
    value falls below e4m3's subnormals, where scales round up and zeros down, as in quantize)."""
    if q.bias == bias:
        return q
    return rescaled(q, bias)


def rescaled(q: QTensor, bias: float | torch.Tensor) -> QTensor:
    """_rebias without its shortcut: `bias` may be a device scalar (no host read; a bias it already has gives the
    same bits back)."""
    f = bias / q.bias
    scale = _fp8_round(q.scale.float() * f, up=True)
    zero = _fp8_round(q.zero.float() * f, up=False) if q.zero.dtype == FP8 else q.zero
    return replace(q, scale=scale, zero=zero, bias=bias)


def take(q: QTensor | Bands, tokens: torch.Tensor) -> QTensor | Bands:
    """The tokens at indices `tokens` [T'] along the token dim (-2), in that order. For keys quantized over
    token groups the indices must cover whole groups (runs of `group` consecutive aligned tokens)."""
    if isinstance(q, Bands):
        return Bands([take(p, tokens) for p in q.parts], q.index, q.n)
    tokens = tokens.to(q.data.device)
    data = q.data.index_select(-2, tokens)
    if q.bits == 16:
        return QTensor(data, None, None, 16, q.group, q.dim)
    rows = tokens
    if q.dim in (-2, q.data.dim() - 2):
        runs = tokens.view(-1, q.group) if tokens.numel() % q.group == 0 else None
        if (
            runs is None
            or (runs[:, 0] % q.group).any()
            or (runs - runs[:, :1] != torch.arange(q.group, device=runs.device)).any()
        ):
            raise ValueError(f"take: tokens do not form whole key groups of {q.group}")
        rows = runs[:, 0] // q.group
    return replace(q, data=data, scale=q.scale.index_select(-2, rows), zero=q.zero.index_select(-2, rows))


def split(q: QTensor | Bands, n_tokens: int) -> tuple[QTensor | Bands, QTensor | Bands]:
    """Split off the first n_tokens along the token dim (-2). For keys n_tokens must align to groups."""
    if isinstance(q, Bands):
        halves = [split(p, n_tokens) for p in q.parts]
        return Bands([a for a, _ in halves], q.index, q.n), Bands([b for _, b in halves], q.index, q.n)
    if q.bits == 16:
        return (
            QTensor(q.data[..., :n_tokens, :], None, None, 16, q.group, q.dim),
            QTensor(q.data[..., n_tokens:, :], None, None, 16, q.group, q.dim),
        )
    srow = n_tokens
    if q.dim in (-2, q.data.dim() - 2):
        if n_tokens % q.group:
            raise ValueError(f"split at {n_tokens} does not align to key groups of {q.group}")
        srow = n_tokens // q.group

    def part(sl_d, sl_s):
        return replace(q, data=q.data[..., sl_d, :], scale=q.scale[..., sl_s, :], zero=q.zero[..., sl_s, :])

    return part(slice(0, n_tokens), slice(0, srow)), part(slice(n_tokens, None), slice(srow, None))
