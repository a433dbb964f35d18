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


@dataclass
class Region:
    keys: QTensor  # [B, K, cap, n] post-RoPE keys (bits 16: the raw tensor), or pre-RoPE ones (see rope)
    lat: QTensor  # [B, G, cap, rank] latents h = x A, truncated to `rank`
    rank: int  # latent channels kept; z[..., rank:] gets nothing from this region
    pos: torch.Tensor  # [B, cap] int32: cache position of each slot; -1 = empty slot or padding
    length: int | torch.Tensor  # slots in use, a prefix of cap (an int, or a device tensor in a static cache)
    # keys held before RoPE (Schedule.key_rope "pre"): the (cos, sin) [B, cap, n] that rotate them as they are read
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    # low-rank keys (Level.key_rank): `keys` holds [B, blocks, cap, r] coefficients on this basis, decoded before RoPE
    basis: KeyBasis | None = None

    @property
    def capacity(self) -> int:
        return self.keys.shape[-2]


@dataclass
class LayerView:
    regions: list[Region]
    next_pos: int | torch.Tensor  # cache position of the first new token (same for every row)
