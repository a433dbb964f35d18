"""What decode attention reads of one layer's cache: a list of regions (DESIGN.md 4).

Every cache (the dynamic one in cache.py, a static one with preallocated buffers) hands attention
this view, so the torch reference, the Triton kernel and the benchmarks read one structure and
never reach into a cache's private fields. Attention is order-free over the cached tokens (softmax
sums), so regions may come in any order and a region may be a ring: masks come from `pos`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .key_basis import KeyBasis
from .quant import QTensor


@dataclass(frozen=True, eq=False)
class Rotary:
    """RoPE made from positions, for a cache that holds no tables: the slot at cache position p of row b is rotated by
    the angles (p - offset[b]) inv_freq, their cos and sin times `scaling` rounded to `dtype`, as transformers' rotary
    embedding makes them (offset: the row's left padding; generate's position_ids = cumsum(attention_mask) - 1).
    Serves a model whose RoPE depends on the position alone (families.rotary)."""

    inv_freq: torch.Tensor  # [n/2] float32
    scaling: float
    offset: torch.Tensor  # [B] int32
    dtype: torch.dtype  # the model's: its tables are rounded to it

    def tables(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, n] float32 at cache positions pos [B, T] (a slot without a position gets garbage: masked)."""
        ang = (pos - self.offset[:, None]).float()[..., None] * self.inv_freq.to(pos.device)
        emb = torch.cat((ang, ang), dim=-1)
        return (emb.cos() * self.scaling).to(self.dtype).float(), (emb.sin() * self.scaling).to(self.dtype).float()

    def repeat_interleave(self, repeats: int) -> Rotary:
        return Rotary(self.inv_freq, self.scaling, self.offset.repeat_interleave(repeats), self.dtype)


@dataclass
class Region:
    keys: QTensor  # [B, K, cap, n] post-RoPE keys (bits 16: the raw tensor), or pre-RoPE ones (see rope)
    lat: QTensor  # [B, G, cap, rank] latents h = x A, truncated to `rank`
    rank: int  # latent channels kept; z[..., rank:] gets nothing from this region
    pos: torch.Tensor  # [B, cap] int32: cache position of each slot; -1 = empty slot or padding
    length: int | torch.Tensor  # slots in use, a prefix of cap (an int, or a device tensor in a static cache)
    # keys held before RoPE (Schedule.key_rope "pre"): what rotates them as they are read, the (cos, sin) [B, cap, n]
    # tables of each slot, or a Rotary that makes them from the slots' positions
    rope: tuple[torch.Tensor, torch.Tensor] | Rotary | None = None
    # low-rank keys (the layer's Schedule.key_rank): `keys` holds [B, Kb, cap, r] coefficients on this basis (Kb =
    # basis.blocks: 1 joint, K per head), decoded before RoPE
    basis: KeyBasis | None = None
    # a dict that lives as long as the region's contents do (the dynamic cache's level stores on a CPU, cache.Store):
    # the torch reference keeps what it dequantizes there and reads it back at later steps; None: nothing kept
    memo: dict | None = None

    @property
    def capacity(self) -> int:
        return self.keys.shape[-2]


@dataclass
class LayerView:
    regions: list[Region]
    next_pos: int | torch.Tensor  # cache position of the first new token (same for every row)
