"""Decode attention over a cache's region view, summed in latent space (DESIGN.md 4): the torch reference.

Every backend (tale_runtime.backends) has this signature, `(q, k_new, h_new, view, scaling, window) -> z [B, T, H, R]`,
and reads the cache only through `regions.LayerView`, so it works on the dynamic cache (cache.py) and on the static
one (static_cache.py, fixed capacities, lengths on the device: no host sync, capturable in a CUDA graph).
"""

from __future__ import annotations

import torch

from .quant import dequantize
from .regions import LayerView, Rotary


def latent_attention(
    q: torch.Tensor, k_new: torch.Tensor, h_new: torch.Tensor, view, scaling: float, window: int | None = None
) -> torch.Tensor:
    """Attention of T new queries over the cached (compressed) tokens plus the T new exact tokens
    (causal among themselves), summed in latent space. Returns z [B, T, H, R] with
    z_q = sum_t s_{q,t} pad_R(h_t[:r_t]) (DESIGN.md 4). Computed in float32.

    q: [B, H, T, n]; k_new: [B, K, T, n]; h_new: [B, G, T, R]; view: a LayerView (or a layer cache with
    .view()); window: a sliding-window layer's (a query sees keys less than `window` positions back). Every region is read over its whole capacity and masked (slot >= length or pos < 0), so
    shapes do not depend on how full the cache is.
    """
    if not isinstance(view, LayerView):
        view = view.view()
    B, H, T, n = q.shape
    K, G, R = k_new.shape[1], h_new.shape[1], h_new.shape[-1]
    rep, g = H // K, K // G
    f32, dev = torch.float32, q.device
    regions = view.regions
    keys, pos, oks = cached_keys(view, f32, B, K, n, dev, tail=k_new.to(f32))  # [B, K, Lc + T, n]
    Lc = keys.shape[-2] - T
    old = (pos >= 0)[:, None, :].expand(B, T, Lc)  # [B, T, Lc]
    t = torch.arange(T, device=dev)
    new = (t[:, None] >= t[None, :]).expand(B, T, T)  # causal among the new tokens
    if window is not None:
        back = (view.next_pos + t)[None, :, None] - pos[:, None, :]  # [B, T, Lc]
        old = old & (back < window)
        new = new & ((t[:, None] - t[None, :]) < window)
    mask = torch.cat([old, new], dim=-1)  # [B, T, Lc + T]

    qf = q.to(f32).view(B, K, rep, T, n)
    logits = torch.einsum("bkitn,bkln->bkitl", qf, keys) * scaling
    logits = logits.masked_fill(~mask[:, None, None], float("-inf"))
    probs = logits.softmax(dim=-1).view(B, G, g * rep, T, Lc + T)
    z = torch.zeros(B, G, g * rep, T, R, dtype=f32, device=dev)
    start = 0
    # latents of unused slots are zeroed: whatever they hold (even NaN) must not leak in through p = 0
    lats = [
        _kept(r, ("lat", f32), lambda r=r, ok=ok: dequantize(r.lat, f32).masked_fill(~ok[:, None, :, None], 0.0))
        for r, ok in zip(regions, oks)
    ]
    for h in lats + [h_new.to(f32)]:
        L, r = h.shape[-2], h.shape[-1]
        z[..., :r] += torch.einsum("bcqtl,bclr->bcqtr", probs[..., start : start + L], h)
        start += L
    return z.permute(0, 3, 1, 2, 4).reshape(B, T, H, R)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, n] rotated by RoPE tables cos, sin [B, T, r] (sin negated: the inverse rotation). r < n: partial
    rotary (Phi-3's partial_rotary_factor), the first r channels rotate and the others pass, as in transformers."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        rot, rest = x[..., :r], x[..., r:]
        return torch.cat([rot * cos.unsqueeze(1) + rotate_half(rot) * sin.unsqueeze(1), rest], dim=-1)
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def cached_keys(view: LayerView, dtype, B: int, K: int, n: int, device, tail: torch.Tensor | None = None):
    """Every region's keys dequantized, [B, K, Lc, n], their positions [B, Lc] (int64; -1: an unused slot,
    i.e. at or past the region's length, empty, or padding) and each region's used-slot mask [B, cap]. `tail`
    [B, K, T, n]: keys put after the cached ones in the same tensor (the new tokens': one copy, not two)."""
    regions = view.regions
    # a slot counts if it is below the region's length and has a position (-1: empty or padding)
    oks = [
        _kept(r, "ok", lambda r=r: (r.pos >= 0) & (torch.arange(r.capacity, device=device) < r.length)) for r in regions
    ]
    if not regions:
        keys = torch.zeros(B, K, 0, n, dtype=dtype, device=device) if tail is None else tail
        return keys, torch.zeros(B, 0, dtype=torch.long, device=device), []
    keys = [_kept(r, ("keys", dtype), lambda r=r: _post_rope(_keys(r, dtype), r)) for r in regions]
    keys = torch.cat(keys + ([] if tail is None else [tail]), dim=-2)
    pos = [_kept(r, "pos", lambda r=r, ok=ok: r.pos.long().masked_fill(~ok, -1)) for r, ok in zip(regions, oks)]
    return keys, torch.cat(pos, dim=-1), oks


def _kept(r, key, make):
    """make(), or what it gave for this region before (Region.memo: kept while the region's contents live)."""
    if getattr(r, "memo", None) is None:  # a FragRegion keeps nothing
        return make()
    if key not in r.memo:
        r.memo[key] = make()
    return r.memo[key]


def _keys(r, dtype) -> torch.Tensor:
    """A region's keys dequantized, [B, K, cap, n] (low-rank ones decoded from their coefficients)."""
    k = dequantize(r.keys, dtype)
    return k if r.basis is None else r.basis.decode(k)


def _post_rope(k: torch.Tensor, r) -> torch.Tensor:
    """Region r's dequantized keys after RoPE: held before it (Schedule.key_rope "pre"), rotated as read."""
    if r.rope is None:
        return k
    cos, sin = r.rope.tables(r.pos) if isinstance(r.rope, Rotary) else r.rope
    return apply_rope(k, cos.to(k.dtype), sin.to(k.dtype))


def key_mass(q: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Attention mass each key receives from a window of queries (SnapKV's observation window), summed over
    batch rows, heads and queries: [L] float32. Causal by position (a query at p sees keys at <= p); keys at
    position -1 get nothing.

    q: [B, H, W, n] post-RoPE queries already times the attention scaling; q_pos: [W] their positions;
    keys: [B, K, L, n]; k_pos: [B, L] int64.
    """
    B, H, W, n = q.shape
    K = keys.shape[1]
    f32 = torch.float32
    logits = torch.einsum("bkiwn,bkln->bkiwl", q.to(f32).view(B, K, H // K, W, n), keys.to(f32))
    see = (k_pos[:, None, :] >= 0) & (k_pos[:, None, :] <= q_pos.to(k_pos.device)[None, :, None])  # [B, W, L]
    logits = logits.masked_fill(~see[:, None, None], float("-inf"))
    probs = logits.softmax(dim=-1).nan_to_num(0.0)  # a query that sees nothing (all padding) adds nothing
    return probs.sum(dim=(0, 1, 2, 3))
