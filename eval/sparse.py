"""Attention of new queries over a held subset of past tokens plus the new tokens, as unnormalized sums.

The eviction baselines that add something outside the softmax (LESS's low-rank state) or pick a subset per query
(TailorKV's top-k tokens) need the numerator and denominator before they are divided, on a known scale:
    num = sum_j exp(l_j - m) v_j,  den = sum_j exp(l_j - m),  m = max_j l_j
over the allowed j, l_j = scaling q.k_j. Computed in float32. Every held token precedes the new ones; the new ones
are causal among themselves; no padding (tale-eval's batches are full windows).
"""

from __future__ import annotations

import torch


def partial_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_held: torch.Tensor | None,
    v_held: torch.Tensor | None,
    scaling: float,
    held_mask: torch.Tensor | None = None,
    new_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, H, T, n]; k_new, v_new [B, K, T, n]; k_held, v_held [B, K, L, n] or None; held_mask [B, H, T, L] (True:
    attended) or None (all); new_mask [T, T]: which new tokens each query sees (None: causal; it must keep the
    diagonal). Returns num [B, H, T, n], den [B, H, T], m [B, H, T] (float32)."""
    B, H, T, n = q.shape
    K = k_new.shape[1]
    f32 = torch.float32
    if k_held is None:
        k_held = v_held = k_new.new_zeros(B, K, 0, n)
    L = k_held.shape[-2]
    keys = torch.cat([k_held, k_new], dim=-2).to(f32)  # [B, K, L + T, n]
    vals = torch.cat([v_held, v_new], dim=-2).to(f32)
    qf = q.to(f32).view(B, K, H // K, T, n)
    logits = torch.einsum("bkitn,bkln->bkitl", qf, keys) * scaling  # [B, K, rep, T, L + T]
    t = torch.arange(T, device=q.device)
    causal = (t[:, None] >= t[None, :] if new_mask is None else new_mask).expand(B, H, T, T)
    held = torch.ones(B, H, T, L, dtype=torch.bool, device=q.device) if held_mask is None else held_mask
    allowed = torch.cat([held, causal], dim=-1).view(B, K, H // K, T, L + T)
    logits = logits.masked_fill(~allowed, float("-inf"))
    m = logits.amax(dim=-1, keepdim=True)  # finite: a query always sees itself
    p = torch.exp(logits - m)
    num = torch.einsum("bkitl,bkln->bkitn", p, vals)
    return num.reshape(B, H, T, n), p.sum(-1).reshape(B, H, T), m.reshape(B, H, T)
