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
- bits = 16 means "not quantized": the tensor is kept as it is.

On CUDA, quantize / dequantize / requantize run tale_kernels' Triton kernels when Triton is
installed (same layout and results, up to rare one-step differences on rounding ties).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QTensor:
    data: torch.Tensor  # uint8 packed codes, or the raw tensor when bits == 16
    scale: torch.Tensor | None
    zero: torch.Tensor | None
    bits: int
    group: int
    dim: int  # -1 or -2: the dim quantization groups run along

    @property
    def shape(self) -> torch.Size:
        if self.bits == 16:
            return self.data.shape
        *lead, last = self.data.shape
        return torch.Size([*lead, last * 8 // self.bits])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.zero) if t is not None)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self, dtype)


_KERNELS = None


def _kernels(t: torch.Tensor):
    """tale_kernels.quant for CUDA tensors, or None (CPU tensor, or Triton missing)."""
    global _KERNELS
    if not t.is_cuda:
        return None
    if _KERNELS is None:
        try:
            from tale_kernels import quant as _KERNELS
        except ImportError:
            _KERNELS = False
    return _KERNELS or None


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes (any int dtype, values < 2^bits) along the last dim into uint8."""
    if bits == 8:
        return codes.to(torch.uint8)
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
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.uint8) * bits
    codes = (packed.unsqueeze(-2) >> shifts[:, None]) & ((1 << bits) - 1)  # [..., plane, byte]
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def _grouped(x: torch.Tensor, group: int, dim: int) -> torch.Tensor:
    """View x with `dim` split into (n_groups, group); returns the view and the reduce dim."""
    dim = dim % x.dim()
    size = x.shape[dim]
    if size % group:
        raise ValueError(f"size {size} along dim {dim} is not a multiple of the quantization group {group}")
    return x.reshape(*x.shape[:dim], size // group, group, *x.shape[dim + 1 :]), dim + 1


def quantize(x: torch.Tensor, bits: int, group: int, dim: int) -> QTensor:
    if bits == 16:
        return QTensor(x, None, None, 16, group, dim)
    if bits not in (2, 4, 8):
        raise ValueError(f"unsupported bit width {bits}")
    k = _kernels(x)
    if k and k.supports(x.shape, bits, group, dim, x):
        return k.quantize(x, bits, group, dim)
    xg, rd = _grouped(x.float(), group, dim)
    mn = xg.amin(dim=rd, keepdim=True)
    mx = xg.amax(dim=rd, keepdim=True)
    qmax = (1 << bits) - 1
    scale = (mx - mn) / qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((xg - mn) / safe).round_().clamp_(0, qmax).reshape(x.shape)
    return QTensor(
        pack(codes, bits), scale.squeeze(rd).to(x.dtype), mn.squeeze(rd).to(x.dtype), bits, group, dim
    )


def dequantize(q: QTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    if q.bits == 16:
        return q.data if dtype is None else q.data.to(dtype)
    k = _kernels(q.data)
    if k and k.supports(q.shape, q.bits, q.group, q.dim, q.data, q.scale):
        return k.dequantize(q, dtype)
    dtype = dtype or q.scale.dtype
    codes = unpack(q.data, q.bits).float()
    cg, rd = _grouped(codes, q.group, q.dim)
    x = cg * q.scale.float().unsqueeze(rd) + q.zero.float().unsqueeze(rd)
    return x.reshape(codes.shape).to(dtype)


def requantize(q: QTensor, bits: int, rank: int | None = None) -> QTensor:
    """Demotion: dequantize (to the source dtype), keep the first `rank` channels, quantize to `bits`.
    One pass on CUDA."""
    k = _kernels(q.data)
    shape = q.shape if rank is None else torch.Size([*q.shape[:-1], rank])
    if k and q.bits != 16 and k.supports(shape, bits, q.group, q.dim, q.data, q.scale):
        return k.requantize(q, bits, rank)
    x = dequantize(q)
    if rank is not None:
        x = x[..., :rank].contiguous()
    return quantize(x, bits, q.group, q.dim)


def cat(parts: list[QTensor]) -> QTensor:
    """Concatenate quantized tensors along the token dim (-2); groups never straddle parts."""
    a = parts[0]
    if a.bits == 16:
        return QTensor(torch.cat([p.data for p in parts], dim=-2), None, None, 16, a.group, a.dim)
    # keys (dim=-2) carry one scale row per token group, latents (dim=-1) one per token: both cat on -2
    return QTensor(
        torch.cat([p.data for p in parts], dim=-2),
        torch.cat([p.scale for p in parts], dim=-2),
        torch.cat([p.zero for p in parts], dim=-2),
        a.bits,
        a.group,
        a.dim,
    )


def split(q: QTensor, n_tokens: int) -> tuple[QTensor, QTensor]:
    """Split off the first n_tokens along the token dim (-2). For keys n_tokens must align to groups."""
    if q.bits == 16:
        return (QTensor(q.data[..., :n_tokens, :], None, None, 16, q.group, q.dim),
                QTensor(q.data[..., n_tokens:, :], None, None, 16, q.group, q.dim))
    srow = n_tokens
    if q.dim in (-2, q.data.dim() - 2):
        if n_tokens % q.group:
            raise ValueError(f"split at {n_tokens} does not align to key groups of {q.group}")
        srow = n_tokens // q.group

    def part(sl_d, sl_s):
        return QTensor(q.data[..., sl_d, :], q.scale[..., sl_s, :], q.zero[..., sl_s, :], q.bits, q.group, q.dim)

    return part(slice(0, n_tokens), slice(0, srow)), part(slice(n_tokens, None), slice(srow, None))
