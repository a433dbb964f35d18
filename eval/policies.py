"""The cache policies compared by tale-eval, on one prepared model (attention.prepare).

Each policy makes a fresh cache for a run. A run is described by its call pattern: the number
of tokens of each forward call (the prefill, then decode steps or chunks). Cache bytes depend on
the pattern, not on the tokens, so budgets are matched by filling caches with zeros (dry runs):
StreamingLLM's window and Palu's ranks are sized so that their bytes match TALE's at the end of
the same pattern.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from transformers.cache_utils import Cache

from tale_convert.policy import budget_ranks
from tale_runtime import Schedule, new_cache
from tale_runtime.artifact import nominal_ratio

from . import caches

BASELINES = ("full", "tale-exact", "tale", "kivi2", "kivi4", "streaming", "palu")
PALU_BITS = 3  # Palu's latent bits (simulated quantization, bytes counted as packed 3-bit)


@dataclass
class Policy:
    name: str
    detail: str
    new_cache: Callable[[list[int]], Cache]  # the run's call pattern -> a fresh cache
    nominal: float | None = None  # TALE's nominal ratio (no sinks, scales, zero points, residual)
    ranks: list[int] | None = None  # per-layer level-0 (TALE) or value (Palu) ranks


@dataclass
class Dims:
    layers: int
    K: int  # KV heads
    n: int  # head dim
    G: int  # latent groups
    g: int  # KV heads per group
    R: int  # latent rank
    dtype: torch.dtype

    @classmethod
    def of(cls, model) -> "Dims":
        arch = model.tale_manifest["architecture"]
        return cls(model.config.num_hidden_layers, model.config.num_key_value_heads, int(arch["head_dim"]),
                   int(arch["num_groups"]), int(arch["group_size"]), int(arch["latent_rank"]), model.dtype)


def exact_schedule(s: Schedule, R: int) -> Schedule:
    """TALE with nothing compressed (16-bit, full rank): must equal the full cache."""
    levels = [replace(lv, bits=16, key_bits=16) for lv in s.levels]
    return replace(s, levels=levels, ranks=[[R] * len(levels) for _ in s.ranks], policy="exact")


def tale_bytes(model, schedule: Schedule, pattern: list[int]) -> int:
    """Bytes of a batch-1 TaleCache after the calls of `pattern` (a dry run with zeros)."""
    d = Dims.of(model)
    cache = new_cache(model, schedule)
    for T in pattern:
        k = torch.zeros(1, d.K, T, d.n, dtype=d.dtype)
        h = torch.zeros(1, d.G, T, d.R, dtype=d.dtype)
        for layer in cache.layers:
            layer.append(k, h)
    return cache.nbytes()


def palu_layer_bytes(d: Dims, s: Schedule, rank: int, pattern: list[int]) -> int:
    layer = caches.palu_cache([rank], s.levels[0].key_bits, PALU_BITS, s.key_group, s.value_group, s.residual).layers[0]
    for T in pattern:
        layer.update(torch.zeros(1, d.K, T, d.n, dtype=d.dtype), torch.zeros(1, d.G, T, rank, dtype=d.dtype))
    return layer.nbytes()


def palu_ranks(d: Dims, s: Schedule, target: int, pattern: list[int]) -> list[int]:
    """Per-layer ranks (multiples of value_group) whose Palu cache bytes come closest to `target`.
    Bytes are affine in the rank; the total rank is spread evenly over the layers."""
    vg = s.value_group
    lo, hi = palu_layer_bytes(d, s, vg, pattern), palu_layer_bytes(d, s, d.R, pattern)
    per_rank = (hi - lo) / (d.R - vg)
    mean = vg + (target / d.layers - lo) / per_rank
    units = min(max(round(mean * d.layers / vg), d.layers), d.layers * (d.R // vg))
    return budget_ranks([1.0] * d.layers, d.R, vg, units * vg)


def sink_window(d: Dims, sinks: int, target: int) -> int:
    """Recent-window tokens such that sinks + window 16-bit tokens fit in `target` bytes."""
    per_token = d.layers * 2 * d.K * d.n * torch.finfo(d.dtype).bits // 8
    return max(1, target // per_token - sinks)


def tale_policy(model, name: str, schedule: Schedule) -> Policy:
    d = Dims.of(model)
    r0 = [rs[0] for rs in schedule.ranks]
    bits = "/".join(str(lv.bits) for lv in schedule.levels)
    key_bits = "/".join(str(lv.key_bits) for lv in schedule.levels)
    detail = (f"{schedule.policy} r0 {min(r0)}-{max(r0)}" if min(r0) != max(r0) else f"{schedule.policy} r0 {r0[0]}") \
        + f"/{d.R}, bits {bits}" + (f", key bits {key_bits}" if key_bits != bits else "") + f", sinks {schedule.sinks}"
    return Policy(name, detail, lambda pattern: new_cache(model, schedule), nominal_ratio(schedule, d.n, d.g), r0)


def build(model, names: list[str], schedule: Schedule, match_pattern: list[int],
          rank_schedules: dict[str, Schedule] | None = None) -> list[Policy]:
    """Policies by name (BASELINES), in order, plus one TALE row per rank schedule ('tale/<policy>').

    StreamingLLM and Palu match TALE's bytes (`schedule`): Palu's ranks once, at `match_pattern`;
    StreamingLLM's window per run (a window is a token count, so it must follow the run's length)."""
    d = Dims.of(model)
    s = schedule
    out = []
    for name in names:
        if name == "full":
            out.append(Policy(name, "16-bit K+V", lambda p: caches.full_cache(d.layers)))
        elif name == "tale":
            out.append(tale_policy(model, name, s))
        elif name == "tale-exact":
            out.append(tale_policy(model, name, exact_schedule(s, d.R)))
        elif name in ("kivi2", "kivi4"):
            b = int(name[-1])
            out.append(Policy(name, f"{b}-bit K+V, groups {s.key_group}/{s.value_group}, residual {s.residual}",
                              lambda p, b=b: caches.kivi_cache(d.layers, b, s.key_group, s.value_group, s.residual)))
        elif name == "streaming":
            def sink(pattern):
                return caches.sink_cache(d.layers, s.sinks, sink_window(d, s.sinks, tale_bytes(model, s, pattern)))
            out.append(Policy(name, f"sinks {s.sinks} + recent window, bytes = TALE's", sink))
        elif name == "palu":
            ranks = palu_ranks(d, s, tale_bytes(model, s, match_pattern), match_pattern)
            rr = f"{min(ranks)}-{max(ranks)}" if min(ranks) != max(ranks) else f"{ranks[0]}"
            kb = s.levels[0].key_bits
            out.append(Policy(name, f"eager rank {rr}/{d.R} @ {PALU_BITS}-bit, keys {kb}-bit",
                              lambda p: caches.palu_cache(ranks, kb, PALU_BITS, s.key_group, s.value_group, s.residual),
                              ranks=ranks))
        else:
            raise ValueError(f"unknown policy {name!r}: use {', '.join(BASELINES)}")
    for pol, sched in (rank_schedules or {}).items():
        out.append(tale_policy(model, f"tale/{pol}", sched))
    return out
