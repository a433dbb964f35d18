"""The rank/bit schedule's knobs in one place: tale-convert's presets (`PRESETS`, typed `Preset`s), the one
rank-rounding rule, and the overrides that tale-run's flags, `load(**overrides)` and tale-eval's variants apply to an
artifact's schedule.

Schedule and Level themselves are the artifact's (artifact.py: they are written into the manifest). The four CLIs
share one flag vocabulary for these knobs: --sinks, --recent, --r0, --bits, --key-bits, --key-group, --value-group,
--residual.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .artifact import ArtifactError, Level, Schedule


def round_rank(fraction: float, R: int, value_group: int) -> int:
    """The rank a fraction of the full rank R keeps: rounded down to a whole quantization group, at least one group,
    at most R (the rule of every preset, policy and override)."""
    return min(R, max(value_group, int(fraction * R + 1e-9) // value_group * value_group))


@dataclass(frozen=True)
class Preset:
    """One tale-convert --preset: the schedule knobs, per level oldest first, that tale_convert.options.Options turns
    (with the explicit options over them) into the artifact's Schedule."""

    bits: tuple[int, ...]  # latent bits per level
    key_bits: tuple[int, ...]  # key bits per level
    recent: tuple[float, ...]  # share of each level above the middle
    r0: float  # the middle level's latent rank, a fraction of R
    key_axis: tuple[str, ...]  # per level: keys quantized per "channel" (KIVI) or per "token"
    residual: int | None  # the 16-bit residual where the newest keys are per token; None: one key group
    key_meta: str  # scale/zero formats (Schedule.key_meta, value_meta)
    value_meta: str
    value_group: int = 32  # channels per latent quantization group (where it divides R; else 32)
    key_bands: tuple[int, float] | None = None  # (bits, share of the head dim) of the middle level's key bands
    key_rope: str = "post"  # keys quantized after RoPE, or "pre": before it, rotated as they are read
    key_rank: tuple[float, ...] = ()  # per level, a fraction of the joined key dim K n (0: plain keys); (): none
    key_basis_blocks: str = "joint"  # the key basis of low-rank keys: "joint", "group" or "head"
    rotation_block: int | None = None  # channels per Hadamard block of the latents (None: the latent group)
    rotate_latents: bool = False  # latents rotated in blocks where the blocks fit R


_PAPER = Preset(
    bits=(2, 4),
    key_bits=(2, 4),
    recent=(0.1,),
    r0=0.5,
    key_axis=("channel", "channel"),
    residual=None,
    key_meta="16",
    value_meta="16",
    rotate_latents=True,
)

# tale-convert --preset
PRESETS: dict[str, Preset] = {
    # the paper's: alpha 4, p 0.1, r0 = R/2, 2-bit middle, 4-bit recent, KIVI layout with 16-bit scales/zeros
    "paper": _PAPER,
    # the best measured per byte on SmolLM2 (docs/notes.md, "key bands"; dev text): 2-bit middle keys with
    # the most important half of each KV head's key channels at 3 bits, r0 = R/2, fp8 scales
    "tale": replace(
        _PAPER,
        key_meta="8/16",
        value_meta="8/8",
        key_bands=(3, 0.5),  # (bits, share of the head dim): 32 of 64 channels per KV head at 3 bits
    ),
    # low-rank keys (docs/notes.md, "low-rank keys before RoPE"): the middle level's keys before RoPE as 7/24 of the
    # joined key dim (56 of 192 on SmolLM2) in coefficients on the calibrated key basis at 4 bits, 3-bit latents at
    # full rank with scales per 64 channels, a recent level of 5% at 4 bits, fp8 scales and zeros, newest tokens at 8
    # bits per token. Where the bytes go (docs/notes.md, "where the lowrank schedule loses on eb1911"): on text the
    # calibration did not cover the latents' rank cut is the largest loss and the cheapest to buy back per byte; the
    # latents keep every channel, paid for by half their scales and 16 fewer key coefficients (over 4 windows of each
    # test text: 6.10x at +0.85% / +1.49%, where r0 5R/6, 72 coefficients and scales per 32 channels gave 6.03x at
    # +0.88% / +2.03%: docs/notes.md, "the latents at full rank"). The low-rank-key kernel reads it on CUDA
    # (docs/kernels.md). Every preset rotates its latents (docs/notes.md, "rotated latents")
    "lowrank": Preset(
        bits=(3, 4, 8),
        key_bits=(4, 4, 8),
        recent=(0.05, 0.0),
        r0=1.0,
        value_group=64,
        key_axis=("channel", "channel", "token"),
        residual=1,
        key_meta="8/8",
        value_meta="8/8",
        key_rope="pre",
        key_rank=(7 / 24, 0, 0),  # per level, a fraction of the joined key dim K n (0: plain keys)
        # a basis per latent group of g KV heads: joint where g = K (SmolLM2 at its --group 3, where the quality above
        # was measured); on Llama-3.1-8B shapes (g = 4, K = 8) half the joint basis' rebuild work (docs/kernels.md)
        key_basis_blocks="group",
        # latents rotated in Hadamard blocks of 32 channels, quantized with scales per 64: over 4 windows of each test
        # text 6.10x at +0.85% / +1.49%; rotated in blocks of 64 (the scales' groups), +0.29% / +2.28%
        # (docs/notes.md, "the latents' rotation blocks")
        rotation_block=32,
        rotate_latents=True,
    ),
}


def override_schedule(
    base: Schedule,
    R: int,
    num_layers: int,
    *,
    sinks: int | None = None,
    recent: float | list[float] | None = None,
    ranks: float | int | list[float | int] | None = None,
    bits: int | list[int] | None = None,
    key_bits: int | list[int] | None = None,
    key_group: int | None = None,
    value_group: int | None = None,
    residual: int | None = None,
    key_axis: str | list[str] | None = None,
    key_meta: str | None = None,
    value_meta: str | None = None,
    key_channel_group: int | None = None,
    rotate: str | None = None,
    key_rope: str | None = None,
    key_rank: int | list[int] | None = None,
    r0: float | int | None = None,
) -> Schedule:
    """`base` (the artifact's schedule) with some knobs replaced; raises ValueError if the result is invalid.

    recent: the share p of each level above level 0, oldest first (one float: the paper's two levels).
    ranks: one per level or one for all, a fraction of R (float, rounded down to value_group) or a rank
      (int); the same for every layer.
    bits: one per level or one for all, for latents and keys; key_bits then replaces the key bits only.
    key_axis: "channel" or "token" per level (or one for all); key_rank: per level (or one for all), 0 for plain
      keys, the same in every layer (an artifact's key ranks per layer, Schedule.key_ranks, are kept only when
      neither key_rank nor the number of levels changes); key_meta, value_meta, key_channel_group, rotate, key_rope: see Schedule.
    r0: level 0's rank in every layer (a fraction of R or a rank, as `ranks`), the other levels keep theirs: what
      --r0 sets in every CLI (`ranks` sets every level's).
    Changing the number of levels needs `bits`; without `ranks`, level 0 keeps its ranks, the others get R.
    """
    if r0 is not None and ranks is not None:
        raise ValueError("schedule override: give r0 (level 0) or ranks (every level), not both")
    n_old = len(base.levels)
    shares = None if recent is None else _listify(recent)
    for p in shares or []:
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:  # nan fails both comparisons
            what = "is not a number" if p != p else "must lie in [0, 1)"  # NaN named as such
            raise ValueError(f"schedule override: recent share {p} {what}")
    n = n_old if shares is None else len(shares) + 1
    if n != n_old and bits is None:
        raise ValueError(
            f"schedule override: {n} levels (from recent) need bits for each level ({n} values); the artifact has "
            f"{n_old} levels, so {n_old - 1} recent share(s) keep its bits"
        )
    levels = [replace(lv) for lv in base.levels] if n == n_old else [Level(16, 16, None) for _ in range(n)]
    if shares is not None:
        for lv, p in zip(levels[1:], shares):
            lv.share = float(p)
    if bits is not None:
        for lv, b in zip(levels, _per_level("bits", bits, n)):
            lv.bits = lv.key_bits = int(b)
    if key_bits is not None:
        for lv, b in zip(levels, _per_level("key_bits", key_bits, n)):
            lv.key_bits = int(b)
    if key_axis is not None:
        for lv, a in zip(levels, _per_level("key_axis", key_axis, n)):
            lv.key_axis = a
    if key_rank is not None:
        for lv, r in zip(levels, _per_level("key_rank", key_rank, n)):
            lv.key_rank = int(r)

    vg = base.value_group if value_group is None else value_group
    if ranks is not None:
        rs = [_rank(r, R, vg) for r in _per_level("ranks", ranks, n)]
        layer_ranks = [list(rs) for _ in range(num_layers)]
    elif n != n_old:
        layer_ranks = [[rs[0]] + [R] * (n - 1) for rs in base.ranks]
    else:
        layer_ranks = [list(rs) for rs in base.ranks]
    if r0 is not None:
        layer_ranks = [[_rank(r0, R, vg)] + rs[1:] for rs in layer_ranks]

    sched = Schedule(
        sinks=base.sinks if sinks is None else sinks,
        levels=levels,
        ranks=layer_ranks,
        key_group=base.key_group if key_group is None else key_group,
        value_group=vg,
        residual=base.residual if residual is None else residual,
        policy=base.policy if ranks is None and r0 is None else "uniform",
        key_meta=base.key_meta if key_meta is None else key_meta,
        value_meta=base.value_meta if value_meta is None else value_meta,
        key_channel_group=base.key_channel_group if key_channel_group is None else key_channel_group,
        rotate=base.rotate if rotate is None else rotate,
        key_rope=base.key_rope if key_rope is None else key_rope,
        key_order=base.key_order,  # the artifact's calibration statistic (levels with key bands read it)
        latent_rotation=base.latent_rotation,  # how the artifact's factors were written: not a knob
        key_blocks=base.key_blocks,  # how the artifact's key basis was written: not a knob
        key_ranks=base.key_ranks if key_rank is None and n == n_old else None,
    )
    try:
        sched.validate(R, num_layers)
    except ArtifactError as e:
        raise ValueError(f"schedule override: {e}") from None
    return sched


def _listify(v) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _per_level(name: str, v, n: int) -> list:
    vs = _listify(v)
    if len(vs) == 1:
        vs = vs * n
    if len(vs) != n:
        raise ValueError(
            f"schedule override: {name} has {len(vs)} values for {n} levels (one per level, oldest first, or one for all)"
        )
    return vs


def _rank(r: float | int, R: int, value_group: int) -> int:
    """A rank override: a fraction of R (float, rounded by round_rank) or a rank (int, kept: validate checks it)."""
    if isinstance(r, float):
        if not 0.0 < r <= 1.0:
            raise ValueError(f"schedule override: rank fraction {r} must lie in (0, 1]")
        return round_rank(r, R, value_group)
    return int(r)


class ContextError(ValueError):
    """A schedule knob (`knob`: "sinks", "residual") that leaves nothing to compress in the model's context."""

    def __init__(self, knob: str, msg: str):
        super().__init__(f"{knob} {msg}")
        self.knob, self.msg = knob, msg


def check_context(sched: Schedule, context: int) -> None:
    """Sinks or a residual as long as the model's context leave nothing to compress: refused by load() (so by every
    CLI and the Python API alike)."""
    for name, v in (("sinks", sched.sinks), ("residual", sched.residual)):
        if v >= context:
            raise ContextError(
                name, f"{v} is not below the model's context ({context} tokens): nothing would be compressed"
            )
