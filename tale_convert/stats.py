"""Calibration statistics of the cached keys: the channel order that key bands read (Schedule.key_order).

A key channel c quantized per channel over a group of tokens errs by up to range_c / (2^b - 1) / 2,
and moves a logit by q_c times that: its weight is E[q_c^2] E[range_c^2] (queries of the KV head's
group, ranges over groups of `key_group` tokens), measured on the keys as the cache holds them (after
RoPE, and after the Hadamard rotation when the schedule rotates). Levels with `key_hi_bits` give the
first `key_hi_channels` of each head's order more bits (docs/notes.md, "key bands").
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from tale_runtime import families
from tale_runtime.artifact import Level, Schedule
from tale_runtime.backends import TORCH, AttentionBackend
from tale_runtime.model import cache_arg


@dataclass(frozen=True)
class _Observe(AttentionBackend):
    """The torch reference, handing every call's new queries and keys (as cached) to `see(layer, q, k)` first. Layers
    attend in order within a forward pass, so the call count tells the layer."""

    name: str = "observe"
    label: str = "torch reference"
    layers: int = 1
    see: object = None
    calls: list = field(default_factory=lambda: [0])

    def __call__(self, q, k_new, h_new, view, scaling, window=None):
        self.see(self.calls[0] % self.layers, q, k_new)
        self.calls[0] += 1
        return TORCH.run(q, k_new, h_new, view, scaling, window)


@torch.inference_mode()
def key_importance(model, batches: list[torch.Tensor], key_group: int = 32) -> list[torch.Tensor]:
    """Per layer [K, n] float64: E[q_c^2] * E[range_c^2] over the calibration `batches` ([B, T] ids)."""
    from tale_runtime import new_cache

    layers = model.model.layers
    q2 = [0.0] * len(layers)
    r2 = [0.0] * len(layers)
    nq = [0] * len(layers)
    nr = [0] * len(layers)

    def see(i: int, q: torch.Tensor, k: torch.Tensor) -> None:  # q [B, H, T, n], k [B, K, T, n]: new tokens, as cached
        B, H, T, n = q.shape
        K = k.shape[1]
        qf = q.double().view(B, K, H // K, T, n)
        q2[i] = q2[i] + qf.pow(2).sum((0, 2, 3))
        nq[i] += B * (H // K) * T
        m = T // key_group * key_group
        kg = k[:, :, :m].double().reshape(B, K, m // key_group, key_group, n)
        r2[i] = r2[i] + (kg.amax(3) - kg.amin(3)).pow(2).sum((0, 2))
        nr[i] += B * (m // key_group)

    s = model.tale_spec.schedule
    R = max(rs[-1] for rs in s.ranks)
    exact = Schedule(  # nothing compressed: the statistic sees exact keys (rotated as the schedule rotates them)
        sinks=1,
        levels=[Level(16, 16, None)],
        ranks=[[R]] * len(s.ranks),
        key_group=1,
        value_group=1,
        residual=1,
        rotate=s.rotate,
    )
    observe = _Observe(layers=len(layers), see=see)
    for ids in batches:
        cache = new_cache(model, exact, backend=observe)
        model(ids[:, :1], **cache_arg(cache))  # the exact prefill does not call attention
        model(ids[:, 1:], **cache_arg(cache))
    return [(a / c) * (b / d) for a, c, b, d in zip(q2, nq, r2, nr)]


def key_order(importance: list[torch.Tensor]) -> list[list[list[int]]]:
    """Per layer, per KV head: channels by importance, most important first (Schedule.key_order)."""
    return [imp.argsort(dim=-1, descending=True, stable=True).tolist() for imp in importance]


def with_key_bands(schedule: Schedule, order: list[list[list[int]]], bands: dict[int, tuple[int, int]]) -> Schedule:
    """`schedule` with key bands: bands[level] = (key_hi_bits, key_hi_channels) per KV head."""
    levels = [
        replace(lv, key_hi_bits=bands[i][0], key_hi_channels=bands[i][1]) if i in bands else lv
        for i, lv in enumerate(schedule.levels)
    ]
    return replace(schedule, levels=levels, key_order=order)


def calibration_batches(tok, count: int = 4, length: int = 512, batch: int = 2) -> list[torch.Tensor]:
    """Fixed windows of the bundled calibration corpus (never the held-out texts), spread over it."""
    from tale_calib import calib_paths, documents

    text = "\n\n".join(d for p in calib_paths() for d in documents(p))
    ids = torch.tensor(tok(text, add_special_tokens=False).input_ids)
    wins = ids[: len(ids) // length * length].view(-1, length)
    pick = torch.linspace(0, len(wins) - 1, count * batch).round().long()
    return list(wins[pick].split(batch))


def pre_rope(attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries [B, T, H, n] and keys [B, T, K, n] of x [B, T, d] before RoPE, as the attention module makes them:
    TaleAttention's own, or in the converter's layer pass the family's module (a fused qkv_proj split, Qwen3's and
    Gemma 3's per-head norms applied)."""
    if hasattr(attn, "pre_rope"):
        q, k, _ = attn.pre_rope(x)
        return q, k
    B, T, _ = x.shape
    n = attn.head_dim
    if hasattr(attn, "qkv_proj"):
        hq, hk, _ = families.qkv_rows(attn.config)
        q, k = attn.qkv_proj(x)[..., : hq + hk].split([hq, hk], -1)
    else:
        q, k = attn.q_proj(x), attn.k_proj(x)
    q, k = q.view(B, T, -1, n), k.view(B, T, -1, n)
    if getattr(attn, "q_norm", None) is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q, k


class KeyMoments:
    """One layer's key statistics, accumulated from a hook on its attention module's input: the second moment and the
    mean of the keys before RoPE, all KV heads joined ([K n, K n], [K n]), and the per-channel second moments of the
    queries before RoPE, averaged over each KV head's query heads ([K n]), float64. The first `skip` tokens of each
    sequence are left out (sinks stay exact); only the first `rows` sequences a hook sees count (None: all), so a
    pass over more calibration samples gathers the same statistics."""

    def __init__(self, K: int, n: int, skip: int = 4, rows: int | None = None):
        self.K, self.n, self.skip, self.rows = K, n, skip, rows
        self.m2 = self.m1 = self.q2 = 0.0
        self.count = 0
        self.seen = 0  # sequences the hook has seen

    def full(self) -> bool:
        return self.rows is not None and self.seen >= self.rows

    def add(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """q [b, T, H, n] and k [b, T, K, n] before RoPE."""
        keep = q.shape[0] if self.rows is None else max(0, min(q.shape[0], self.rows - self.seen))
        self.seen += q.shape[0]
        if not keep:
            return
        k = k[:keep, self.skip :].double().flatten(0, 1).flatten(1)  # [tokens, K n]
        self.m2 = self.m2 + k.T @ k
        self.m1 = self.m1 + k.sum(0)
        self.count += len(k)
        q = q[:keep, self.skip :].double().flatten(0, 1)  # [tokens, H, n]
        self.q2 = self.q2 + q.pow(2).view(len(q), self.K, -1, self.n).mean(2).sum(0).flatten()

    def hook(self, attn) -> list:
        """A hook on an attention module's input (remove it when done): its queries and keys before RoPE."""

        def pre(mod, args, kwargs):
            if not self.full():
                self.add(*pre_rope(attn, kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]))

        return [attn.register_forward_pre_hook(pre, with_kwargs=True)]

    def result(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.count:
            raise ValueError("no calibration tokens reached the key statistics (sequences shorter than the sinks?)")
        return self.m2 / self.count, self.m1 / self.count, self.q2 / self.count


@torch.inference_mode()
def key_moments(
    model, batches: list[torch.Tensor], skip: int = 4
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer of a loaded model: KeyMoments over the calibration `batches` ([B, T] ids), from one forward pass of
    the whole model (tale-convert gathers the same statistics layer by layer, inside its streaming pass)."""
    moments, hooks = [], []
    try:
        for layer in model.model.layers:
            a = layer.self_attn
            moments.append(KeyMoments(a.K, a.head_dim, skip))
            hooks += moments[-1].hook(a)
        for ids in batches:
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return [m.result() for m in moments]
