"""Rank policies: how much latent rank each layer keeps at level 0 (Schedule.ranks[layer][0]).

- uniform: r0 = a fraction of R in every layer (the paper's default).
- energy: per layer, the smallest rank that keeps a fraction X of the whitened spectral energy
  (sum of squared whitened singular values over the layer's groups). A threshold: the budget follows.
- fisher: Palu-style; ranks proportional to each layer's Fisher information (the summed squared
  gradients of the calibration LM loss w.r.t. v_proj.weight), same average rank as uniform.
- progressive: LoRC-style; ranks fall linearly with depth (shallow layers keep more), same average.

Ranks are multiples of value_group in [value_group, R]. Levels above 0 keep the uniform schedule's
ranks, raised where needed so ranks never decrease over levels.

Key rank policies (tale-convert --key-rank-policy): how many key basis coefficients each layer keeps at the levels
with low-rank keys (Schedule.key_ranks).

- uniform: the preset's key rank in every layer.
- energy: the same total, moved to the layers whose keys hold more calibration energy (key_ranks).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from tale_runtime.artifact import Schedule
from tale_runtime.cache import call_pattern, dry_run_nbytes
from tale_runtime.spec import Arch

POLICIES = ("uniform", "energy", "fisher", "progressive")
KEY_RANK_POLICIES = ("uniform", "energy")


def singular_values(v_v: torch.Tensor) -> torch.Tensor:
    """Whitened singular values [G, R], descending, from an artifact's right factors B_c = S^(1/2) V^T
    ([G, R, R]): the squared singular values of B_c. Rotated latents (Q^T B, Q orthogonal) have the same ones,
    and a rank cut at whole rotation blocks keeps exactly the first r of them."""
    return torch.linalg.svdvals(v_v.double()).pow(2)


def energy_rank(S: torch.Tensor, keep: float, value_group: int) -> int:
    """Smallest multiple of value_group (<= R) whose leading singular values keep `keep` of the energy
    sum(s_i^2) of a layer (S: [G, R], descending per group)."""
    e = S.double().pow(2).sum(0)  # the rank is shared by the layer's groups: pool their energy
    frac = e.cumsum(0) / e.sum()
    R = S.shape[-1]
    r = int((frac < keep - 1e-12).sum()) + 1  # first rank reaching `keep`
    return min(R, -(-r // value_group) * value_group)


def budget_ranks(weights: list[float], R: int, value_group: int, total: int) -> list[int]:
    """Ranks proportional to `weights`, multiples of value_group in [value_group, R], summing to
    `total` (a multiple of value_group; e.g. layers * r0 for the uniform budget).

    The shares are clamp(lam * w, 1, R / value_group) quantization groups, with lam found by bisection
    so that they sum to the budget; then the largest remainders round to whole groups."""
    L, lo, hi = len(weights), 1, R // value_group
    units_total = total // value_group
    if not L * lo <= units_total <= L * hi:
        raise ValueError(f"rank budget {total} does not fit {L} layers with ranks in [{value_group}, {R}]")
    w = torch.tensor(weights, dtype=torch.float64)
    if not torch.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"rank weights must be finite, >= 0 and not all zero, got {weights}")
    w = w / w.max()
    a, b = 0.0, float(hi) / w[w > 0].min().item()  # sum is L*lo at a, L*hi at b
    for _ in range(200):
        lam = (a + b) / 2
        a, b = (lam, b) if (lam * w).clamp(lo, hi).sum() < units_total else (a, lam)
    units = (b * w).clamp(lo, hi)
    base = units.floor()
    rest = units_total - int(base.sum())
    for i in sorted(range(L), key=lambda i: (-(units[i] - base[i]).item(), i)):  # largest remainders first
        if rest <= 0:
            break
        if base[i] < hi:
            base[i] += 1
            rest -= 1
    return [int(u) * value_group for u in base]


def progressive_weights(num_layers: int, slope: float = 0.5) -> list[float]:
    """Linear in depth: 1 + slope at the first layer down to 1 - slope at the last (mean 1)."""
    if num_layers == 1:
        return [1.0]
    return [1 + slope * (1 - 2 * i / (num_layers - 1)) for i in range(num_layers)]


def fisher_scores(model, batches: list[torch.Tensor]) -> list[float]:
    """Per layer: sum over calibration batches of the squared gradients of the LM loss w.r.t. that
    layer's self_attn.v_proj.weight (Palu's Fisher information; Phi-3: the value rows of qkv_proj). `batches`: token
    ids [B, T]."""
    from tale_runtime import families

    fused = families.fused_qkv(model.config)
    attns = [layer.self_attn for layer in model.model.layers]
    weights = [a.qkv_proj.weight if fused else a.v_proj.weight for a in attns]
    first = sum(families.qkv_rows(model.config)[:2]) if fused else 0  # the value rows start here
    flags = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    scores = torch.zeros(len(weights), dtype=torch.float64)
    try:
        for w in weights:
            w.requires_grad_(True)
        for ids in batches:
            ids = ids.to(weights[0].device)
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            grads = torch.autograd.grad(loss, weights)
            scores += torch.stack([g[first:].double().pow(2).sum() for g in grads]).cpu()
    finally:
        for p, f in zip(model.parameters(), flags):
            p.requires_grad_(f)
    return scores.tolist()


def level0_ranks(
    policy: str,
    R: int,
    num_layers: int,
    value_group: int,
    r0: int,
    *,
    spectra: list[torch.Tensor] | None = None,
    energy: float | None = None,
    fisher: list[float] | None = None,
) -> list[int]:
    """Level-0 rank per layer. r0: the uniform rank (the budget of fisher and progressive).
    spectra (energy): per layer whitened singular values [G, R]; fisher: per layer Fisher scores."""
    if policy == "uniform":
        return [r0] * num_layers
    if policy == "energy":
        if spectra is None or energy is None:
            raise ValueError("the energy policy needs the whitened spectra and an energy fraction")
        if not 0 < energy <= 1:
            raise ValueError(f"energy fraction must lie in (0, 1], got {energy}")
        return [energy_rank(S, energy, value_group) for S in spectra]
    if policy == "fisher":
        if fisher is None:
            raise ValueError("the fisher policy needs per-layer Fisher scores")
        return budget_ranks(fisher, R, value_group, num_layers * r0)
    if policy == "progressive":
        return budget_ranks(progressive_weights(num_layers), R, value_group, num_layers * r0)
    raise ValueError(f"unknown rank policy {policy!r}: use one of {', '.join(POLICIES)}")


def key_ranks(energies: list[torch.Tensor], mean: int, step: int, kinds: list | None = None) -> list[int]:
    """Key basis coefficients per block for each layer: multiples of `step` in [step, the layer's directions], `mean`
    per layer on average, keeping the most calibration key energy. energies: per layer [Kb, nb], each block's
    coefficient energies largest first (tale_runtime.key_basis.energy); a rank r keeps the first r of every block.
    Greedy water-filling: from `step` everywhere, the next `step` coefficients go to the layer whose next `step`
    hold the most energy (summed over its blocks); each layer's gains only fall, so this keeps the most energy of any
    allocation of that total. kinds: per layer a label (its sliding window; None: a global layer); each kind keeps
    its own total, count x mean, since a coefficient costs other bytes in a layer that holds only a window of tokens."""
    kinds = [None] * len(energies) if kinds is None else list(kinds)
    if mean % step or mean < step:
        raise ValueError(f"the mean key rank {mean} is not a positive multiple of {step}")
    out = [step] * len(energies)
    for kind in dict.fromkeys(kinds):
        layers = [i for i, k in enumerate(kinds) if k == kind]
        cap = {i: energies[i].shape[-1] // step * step for i in layers}
        if any(mean > c for c in cap.values()):
            raise ValueError(f"the mean key rank {mean} exceeds a layer's key basis ({min(cap.values())} directions)")
        for _ in range((mean - step) * len(layers) // step):
            gain = {i: energies[i][:, out[i] : out[i] + step].sum().item() for i in layers if out[i] < cap[i]}
            best = max(gain, key=lambda i: (gain[i], -i))  # ties: the shallower layer
            out[best] += step
    return out


def apply(schedule: Schedule, policy: str, ranks0: list[int]) -> Schedule:
    """`schedule` with level-0 ranks `ranks0`; higher levels keep their ranks, raised to stay non-decreasing."""
    ranks = []
    for r, rs in zip(ranks0, schedule.ranks):
        row = [r]
        for x in rs[1:]:
            row.append(max(x, row[-1]))
        ranks.append(row)
    return replace(schedule, ranks=ranks, policy=policy)


# -- schedules under a byte budget (tale-convert --target-ratio) ----------------------------------------

REFERENCE = (1024, 128, 4)  # tokens, prefill, decode chunk: the context the ratio is measured at (tale-eval full)


def measured_ratio(
    schedule: Schedule, arch: Arch, reference: tuple[int, int, int] = REFERENCE, memo: dict | None = None
) -> float:
    """16-bit K+V bytes over the bytes a batch-1 TaleCache of `schedule` holds after `reference` = (tokens, prefill,
    decode chunk), all layers: tale_runtime.cache.dry_run_nbytes (`memo`: see there)."""
    held, base = dry_run_nbytes(schedule, arch, call_pattern(*reference), memo=memo)
    return base / held


def fit_ranks(
    schedule: Schedule, target: float, arch: Arch, spectra: list[torch.Tensor], min_rank: int | None = None
) -> Schedule | None:
    """`schedule` with per-layer level-0 ranks that meet `target` (measured_ratio >= target) while losing the
    least whitened spectral energy: start from the largest uniform rank that meets it, then give one more
    quantization group of rank at a time to the layer whose next group keeps the most energy (as a fraction
    of the layer's), while the target still holds. None if even `min_rank` everywhere misses the target."""
    vg = schedule.value_group
    min_rank = min_rank or vg
    L = len(schedule.ranks)
    memo: dict = {}

    def ratio(r0s):
        return measured_ratio(apply(schedule, schedule.policy, list(r0s)), arch, memo=memo)

    top = [rs[-1] for rs in schedule.ranks]
    r0 = next(
        (r for r in range(max(top) // vg * vg, min_rank - 1, -vg) if ratio([min(r, t) for t in top]) >= target), None
    )
    if r0 is None:
        return None
    ranks = [min(r0, t) for t in top]
    e = [S.double().pow(2).sum(0) for S in spectra]  # per layer: energy per rank index (groups pooled)

    def gain(i):
        return (e[i][ranks[i] : ranks[i] + vg].sum() / e[i].sum()).item()

    while True:
        for i in sorted((i for i in range(L) if ranks[i] + vg <= top[i]), key=lambda i: -gain(i)):
            trial = ranks[:]
            trial[i] += vg
            if ratio(trial) >= target:
                ranks = trial
                break
        else:
            return apply(schedule, "budget", ranks)
