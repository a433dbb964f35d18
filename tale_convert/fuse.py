"""The fused output matrix O^r (DESIGN.md 3.4): one matmul maps the per-head latent sums to
the hidden size, so values are never reconstructed per cached token."""

from __future__ import annotations

import torch


def fuse(B: torch.Tensor, W_O: torch.Tensor, num_heads: int) -> torch.Tensor:
    """B: [G, R, R] right factors; W_O: [H*n, d] output projection (row-vector layout).

    Returns O^r = vstack_q B_{c(q),j(q)} O_q, shape [H*R, d]: query head q reads KV head
    m = q // rep, which is slot j = m % g of group c = m // g."""
    G, R, _ = B.shape
    n = W_O.shape[0] // num_heads
    g = R // n
    rep = num_heads // (G * g)
    W_O = W_O.to(B)
    blocks = []
    for q in range(num_heads):
        c, j = divmod(q // rep, g)
        blocks.append(B[c, :, j * n : (j + 1) * n] @ W_O[q * n : (q + 1) * n])
    return torch.cat(blocks)
