"""The cache policies compared by tale-eval: one registry of dataclasses.

A policy is one setting of one method. Each one says
- `family` (registry key) and `knobs` (the fields --frontier sweeps),
- `build(model, pattern)`: a fresh cache for one run, given the run's call pattern (the tokens
  of each forward call; a budget-matched policy sizes itself from it),
- `nbytes(cache)`: the bytes of the tensors the cache really holds (codes, scales, zero points,
  sinks, 16-bit residual) on the accelerator; `total_nbytes(cache)` adds what it keeps in host memory,
- `prepare(model, tok)`: an offline step on the calibration text (LESS's kernels, TailorKV's layer split),
- `exact()`: the setting of the same method that must reproduce the full cache, where one exists,
- `sweep(ctx)`: the frontier points (classmethod).

External backends (transformers' QuantizedCache with optimum-quanto or HQQ) name the pip extra
that installs them; `missing()` says why one cannot run here.

Cache bytes depend on the call pattern, not on the tokens, so budgets are matched by filling
caches with zeros (dry runs): StreamingLLM's window and Palu's ranks can be sized to TALE's bytes.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch
from transformers.cache_utils import Cache

from tale_convert.rank_policy import budget_ranks
from tale_convert.stats import with_key_bands
from tale_runtime import Schedule, families, key_basis, new_cache
from tale_runtime.artifact import nominal_ratio
from tale_runtime.cache import KEEP, baseline_nbytes, dry_run_nbytes
from tale_runtime.schedule import override_schedule

from . import caches, less, less_train, tailorkv
from .names import NAMED


def reference_nbytes(model, batch: int, tokens: int) -> int:
    """16-bit K+V bytes that transformers' cache holds after `tokens` positions of `batch` rows, the reference of
    every ratio: every position, or in a sliding-window layer its last window - 1 (DynamicSlidingWindowLayer)."""
    a = model.tale_spec.arch
    return baseline_nbytes(batch, a.num_kv_heads, a.head_dim, tokens, families.sliding_windows(model))


@dataclass
class Policy:
    family: ClassVar[str] = ""
    knobs: ClassVar[tuple[str, ...]] = ()
    extra: ClassVar[str | None] = None  # the pip extra that installs an external backend
    modules: ClassVar[tuple[str, ...]] = ()  # modules the backend imports
    # the prefill is the base model's exact attention, only what the cache keeps differs: one prefill per prompt
    # can fill every such policy's cache (retrieval.py)
    exact_prefill: ClassVar[bool] = True

    @classmethod
    def missing(cls) -> str | None:
        """Why this policy cannot run here (a backend not installed), or None."""
        gone = [m for m in cls.modules if not _importable(m)]
        if gone:
            return f"{cls.family} needs {', '.join(gone)}: pip install 'tale-kv[{cls.extra}]'"
        return None

    @property
    def name(self) -> str:
        return self.family

    def label(self) -> str:
        """The setting, short (for tables and plots)."""
        return ", ".join(f"{k} {getattr(self, k)}" for k in self.knobs)

    def detail(self, model) -> str:
        return self.label()

    def build(self, model, pattern: list[int]) -> Cache:
        raise NotImplementedError

    def nbytes(self, cache: Cache) -> int:
        return cache.nbytes()

    def total_nbytes(self, cache: Cache) -> int:
        """Bytes held anywhere (accelerator and host memory)."""
        return self.nbytes(cache)

    def prepare(self, model, tok, log=print) -> None:
        """Offline work on the calibration text, once before the runs (nothing for most policies)."""

    def exact(self) -> Policy | None:
        return None

    def nominal(self, model) -> float | None:
        return None

    def ranks(self, model, pattern: list[int] | None = None) -> list[int] | None:
        """Per-layer level-0 (TALE) or value (Palu) ranks, for the JSON."""
        return None

    @classmethod
    def sweep(cls, ctx: int) -> list[Policy]:
        return [cls()]


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a missing parent package
        return False


@dataclass
class Full(Policy):
    family: ClassVar[str] = "full"

    def label(self) -> str:
        return "16-bit K+V"

    def build(self, model, pattern):
        return caches.full_cache(model.config.num_hidden_layers)

    def exact(self):
        return self


@dataclass
class Tale(Policy):
    """TALE: the artifact's schedule with `overrides` (tale_runtime.schedule.override_schedule keywords;
    `r0` is a fraction of R for level 0, the levels above at full rank). `schedule` replaces the
    artifact's outright (rank-policy rows, the exact setting)."""

    family: ClassVar[str] = "tale"
    knobs: ClassVar[tuple[str, ...]] = ("overrides",)
    overrides: dict = field(default_factory=dict)
    schedule: Schedule | None = None
    tag: str = ""  # row name suffix, e.g. 'exact' or a rank policy

    @property
    def name(self) -> str:
        return f"tale/{self.tag}" if self.tag else "tale"

    def label(self) -> str:
        if self.tag:
            return self.tag
        return (
            " ".join(
                f"{k}={'/'.join(map(str, v)) if isinstance(v, (list, tuple)) else v}" for k, v in self.overrides.items()
            )
            or "artifact schedule"
        )

    def resolve(self, model) -> Schedule:
        if self.schedule is not None:
            return self.schedule
        s = model.tale_spec.schedule
        if not self.overrides:
            return s
        kw = dict(self.overrides)
        if kw.pop("keep", "recent") not in KEEP:  # the cache's, not the schedule's
            raise ValueError(f"keep must be one of {', '.join(KEEP)}, got {self.overrides['keep']!r}")
        r0 = kw.pop("r0", None)
        key_hi = kw.pop("key_hi", None)
        a = model.tale_spec.arch
        n_levels = len(kw.get("bits") or []) or len(s.levels)
        s = override_schedule(
            s, a.latent_rank, a.num_layers, ranks=None if r0 is None else [r0] + [1.0] * (n_levels - 1), **kw
        )
        if key_hi is not None:  # the middle level's key bands, on the artifact's calibration order
            if len(key_hi) != 2:
                raise ValueError(f"key_hi takes BITS/CHANNELS, got {key_hi}")
            s = with_key_bands(s, s.key_order, {0: tuple(key_hi)})
            s.validate(a.latent_rank, a.num_layers)
        if why := key_basis.missing(s, model.tale_spec.key_basis):
            raise ValueError(f"schedule override: {why}")
        return s

    def detail(self, model) -> str:
        s, a = self.resolve(model), model.tale_spec.arch
        r0 = [rs[0] for rs in s.ranks]
        bits = "/".join(str(lv.bits) for lv in s.levels)
        key_bits = "/".join(str(lv.key_bits) for lv in s.levels)
        rr = f"{min(r0)}-{max(r0)}" if min(r0) != max(r0) else f"{r0[0]}"
        hi = s.levels[0]
        return (
            f"{s.policy} r0 {rr}/{a.latent_rank}, bits {bits}"
            + (f", key bits {key_bits}" if key_bits != bits else "")
            + (f" ({hi.key_hi_channels} channels/head at {hi.key_hi_bits})" if hi.key_hi_bits else "")
            + f", sinks {s.sinks}, groups {s.key_group}/{s.value_group}, residual {s.residual}"
            + (f", key ranks {min(kr)}-{max(kr)} by layer" if (kr := [max(row) for row in s.key_ranks or []]) else "")
        )

    def build(self, model, pattern):
        return new_cache(model, self.resolve(model), keep=self.overrides.get("keep", "recent"))

    def exact(self):
        return ExactTale(base=self)

    def nominal(self, model) -> float:
        a = model.tale_spec.arch
        return nominal_ratio(self.resolve(model), a.head_dim, a.group_size, a.num_kv_heads)

    def ranks(self, model, pattern: list[int] | None = None) -> list[int]:
        return [rs[0] for rs in self.resolve(model).ranks]

    @classmethod
    def sweep(cls, ctx: int) -> list[Policy]:
        return [cls(dict(o)) for o in TALE_SWEEP]


@dataclass
class ExactTale(Tale):
    """TALE with nothing compressed (16-bit, full rank): must equal the full cache."""

    base: Tale | None = None
    tag: str = "exact"

    @property
    def name(self) -> str:
        return "tale-exact"

    def resolve(self, model) -> Schedule:
        s = (self.base or Tale()).resolve(model)
        R = model.tale_spec.arch.latent_rank
        return replace(
            s,
            levels=[replace(lv, bits=16, key_bits=16, key_rank=0) for lv in s.levels],  # plain keys too
            key_ranks=None,
            ranks=[[R] * len(s.levels) for _ in s.ranks],
            policy="exact",
            key_rope="post",  # 16-bit keys after RoPE, as the full cache holds them (before it: bf16 rounding apart)
        )


# TALE frontier points: override_schedule keywords on the artifact's schedule (docs/quality.md)
TALE_SWEEP = (
    {},
    {"key_bits": 4},  # every level's keys at 4 bits
    {"r0": 1.0},
    {"r0": 0.25},
    {"key_group": 64, "value_group": 64, "residual": 64, "r0": 0.34},
)


@dataclass
class Kivi(Policy):
    """KIVI: keys per channel over `group` tokens, values per token over `group` channels (at most
    the head dim), `bits` bits, 16-bit residual of `residual` tokens; on the runtime's region store."""

    family: ClassVar[str] = "kivi"
    knobs: ClassVar[tuple[str, ...]] = ("bits", "group", "residual")
    bits: int = 2
    group: int = 32
    residual: int = 32

    @property
    def name(self) -> str:
        if (self.group, self.residual) == (32, 32):
            return f"kivi{self.bits}"
        return f"kivi{self.bits}/g{self.group}r{self.residual}"

    def build(self, model, pattern):
        a = model.tale_spec.arch
        return caches.kivi_cache(
            a.num_layers, a.num_kv_heads, a.head_dim, self.bits, self.group, min(self.group, a.head_dim), self.residual
        )

    def exact(self):
        return replace(self, bits=16)

    @classmethod
    def sweep(cls, ctx: int) -> list[Policy]:
        return [cls(4, 32, 32), cls(2, 32, 32), cls(2, 128, 128)]


@dataclass
class HFQuantized(Policy):
    """transformers' QuantizedCache with an external backend (real third-party code): the layer's
    own defaults for the axes (0, 0), `bits`, `group` (q_group_size), `residual` (residual_length).
    Bytes: the quantized tensors it holds (packed codes, scales, zero points or shifts) + its
    16-bit residual."""

    knobs: ClassVar[tuple[str, ...]] = ("bits", "group", "residual")
    extra: ClassVar[str | None] = "eval"
    backend: ClassVar[str] = ""
    bits: int = 4
    group: int = 64
    residual: int = 128

    @property
    def name(self) -> str:
        return f"{self.family}{self.bits}/g{self.group}r{self.residual}"

    def build(self, model, pattern):
        from transformers.cache_utils import QuantizedCache

        return QuantizedCache(
            self.backend, model.config, nbits=self.bits, q_group_size=self.group, residual_length=self.residual
        )

    def nbytes(self, cache) -> int:
        total = 0
        for layer in cache.layers:
            total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values) if t is not None)
            for q in (getattr(layer, "_quantized_keys", None), getattr(layer, "_quantized_values", None)):
                if q is not None:
                    total += sum(t.numel() * t.element_size() for t in self.quantized_tensors(q))
        return total

    @staticmethod
    def quantized_tensors(q) -> list[torch.Tensor]:
        raise NotImplementedError

    @classmethod
    def sweep(cls, ctx: int) -> list[Policy]:  # the same points for every backend: their rows compare
        return [cls(4, 64, 128), cls(2, 64, 128)]


@dataclass
class Quanto(HFQuantized):
    family: ClassVar[str] = "quanto"
    backend: ClassVar[str] = "quanto"
    modules: ClassVar[tuple[str, ...]] = ("optimum.quanto",)

    @staticmethod
    def quantized_tensors(q) -> list[torch.Tensor]:
        # WeightQBitsTensor: _data (a PackedTensor of uint8 codes), _scale, _shift
        return [q._data._data, q._scale, q._shift]


@dataclass
class HQQ(HFQuantized):
    family: ClassVar[str] = "hqq"
    backend: ClassVar[str] = "hqq"
    modules: ClassVar[tuple[str, ...]] = ("hqq",)

    @staticmethod
    def quantized_tensors(q) -> list[torch.Tensor]:
        codes, meta = q  # packed uint8 codes and their metadata dict
        return [codes, meta["scale"], meta["zero"]]


@dataclass
class Streaming(Policy):
    """StreamingLLM: `sinks` first tokens + the `window` most recent ones, the rest evicted. `window`:
    tokens (int), a share of the run's tokens (float, so every run length gets the same ratio), or
    None: TALE's bytes for the same run (`match`, the artifact's schedule by default)."""

    family: ClassVar[str] = "streaming"
    knobs: ClassVar[tuple[str, ...]] = ("window",)
    sinks: int = 4
    window: int | float | None = None
    match: Tale | None = None

    def label(self) -> str:
        if self.window is None:
            return "window: TALE's bytes"
        return f"window {self.window:.3g} of the tokens" if isinstance(self.window, float) else f"window {self.window}"

    def build(self, model, pattern):
        a = model.tale_spec.arch
        if self.window is None:
            w = sink_window(model, self.sinks, tale_nbytes(model, self.match or Tale(), pattern))
        elif isinstance(self.window, float):
            w = max(1, round(self.window * sum(pattern)) - self.sinks)
        else:
            w = self.window
        return caches.sink_cache(a.num_layers, self.sinks, w)

    def exact(self):
        return replace(self, window=1 << 30)

    @classmethod
    def sweep(cls, ctx: int) -> list[Policy]:
        return [cls(window=1 / r) for r in (3, 6, 12)]


@dataclass
class Palu(Policy):
    """Palu-style eager low rank: values (x A_r) B_r with the artifact's whitened factors, also in
    the prefill; the cache holds keys at `key_bits` (KIVI) and the rank-r latents at `latent_bits`
    per token over channel groups, on the runtime's region store. `rank`: one for every layer, or
    None: per-layer ranks whose bytes match TALE's (`match`) at `match_pattern`. Palu's own
    low-rank keys are not reproduced (they need a key whitening the artifact does not carry)."""

    family: ClassVar[str] = "palu"
    exact_prefill: ClassVar[bool] = False
    knobs: ClassVar[tuple[str, ...]] = ("rank", "key_bits")
    rank: int | None = None
    key_bits: int = 2
    latent_bits: int = 4
    match: Tale | None = None
    match_pattern: list[int] | None = None

    def label(self) -> str:
        r = "TALE's bytes" if self.rank is None else "R" if self.rank >= 1 << 30 else self.rank
        return f"rank {r}, keys {self.key_bits}-bit, latents {self.latent_bits}-bit"

    def ranks(self, model, pattern: list[int] | None = None) -> list[int] | None:
        """Per-layer value ranks (at most R); budget-matched ones at `match_pattern` (else `pattern`)."""
        a = model.tale_spec.arch
        if self.rank is not None:
            ranks = [min(self.rank, a.latent_rank)] * a.num_layers
        else:
            pattern = self.match_pattern or pattern
            if pattern is None:
                return None
            ranks = palu_ranks(model, self, tale_nbytes(model, self.match or Tale(), pattern), pattern)
        q = model.tale_spec.schedule.latent_rotation  # rotated factors truncate exactly only at whole blocks
        if q and any(r % q for r in ranks):
            raise ValueError(
                f"palu rank {ranks[0]}: the artifact's latents are rotated in blocks of {q}; use multiples"
            )
        return ranks

    def build(self, model, pattern):
        a, s = model.tale_spec.arch, model.tale_spec.schedule
        return caches.palu_cache(
            self.ranks(model, pattern),
            a.num_kv_heads,
            a.head_dim,
            a.num_groups,
            self.key_bits,
            self.latent_bits,
            s.key_group,
            s.value_group,
            palu_residual(s),
        )

    def exact(self):
        return replace(self, rank=1 << 30, key_bits=16, latent_bits=16)  # full rank R, 16-bit

    @classmethod
    def sweep(cls, ctx: int) -> list[Policy]:
        return [cls(192, 4), cls(192, 2), cls(64, 2)]


@dataclass
class Less(Policy):
    """LESS: a Λ-shaped cache (`sinks` + `window` recent tokens, 16-bit) plus a rank-`rank` state per layer and KV
    head absorbing every evicted pair through kernels trained on the calibration text (less_train.py; cached per
    model and recipe). `trained=False`: the same cache without the state (the sparse policy alone)."""

    family: ClassVar[str] = "less"
    exact_prefill: ClassVar[bool] = False
    knobs: ClassVar[tuple[str, ...]] = ("window",)
    sinks: int = 4
    window: int = 128
    rank: int = 8
    hidden: int = 32
    steps: int = 100
    trained: bool = True
    kernels: list | None = field(default=None, repr=False, compare=False)

    @property
    def name(self) -> str:
        return f"less/w{self.window}" if self.trained else f"less-sparse/w{self.window}"

    def label(self) -> str:
        return f"window {self.window}, rank {self.rank}" + ("" if self.trained else ", no state")

    def recipe(self) -> less_train.Recipe:
        return less_train.Recipe(
            sinks=self.sinks, window=self.window, rank=self.rank, hidden=self.hidden, steps=self.steps
        )

    def evicts_in_training(self) -> bool:
        r = self.recipe()
        return r.sinks + r.window + 1 < r.length

    def prepare(self, model, tok, log=print) -> None:
        if self.trained and self.evicts_in_training():
            self.kernels = less_train.kernels_for(model, tok, self.recipe(), log)

    def build(self, model, pattern):
        if self.trained and self.evicts_in_training() and self.kernels is None:
            raise ValueError("LESS needs its kernels: call prepare(model, tokenizer) first")
        t = model.model.layers[0].self_attn.tale
        return less.less_cache(self.sinks, self.window, self.kernels, t.scaling, model.tale_spec.arch.num_layers)

    def exact(self):
        return replace(self, window=1 << 30)  # nothing evicted

    @classmethod
    def sweep(cls, ctx: int) -> list[Policy]:
        return [cls(window=ctx // r - 4) for r in (6, 12)]  # StreamingLLM's 1/6 and 1/12 of the tokens


@dataclass
class TailorKV(Policy):
    """TailorKV: the `quant_layers` layers of densest attention on the calibration text (dense-preference score P
    over the last `n_q` queries, top-`score_topk`) hold KIVI at `bits` bits (`group`, `residual`); the others
    offload their 16-bit cache to host memory and attend to `sinks` + `recent` held tokens + the `topk` offloaded
    tokens fetched per query and KV head. `nbytes`: on the accelerator; `total_nbytes`: with the host copy."""

    family: ClassVar[str] = "tailorkv"
    exact_prefill: ClassVar[bool] = False
    knobs: ClassVar[tuple[str, ...]] = ("quant_layers", "topk")
    quant_layers: int = 2
    topk: int = 64
    bits: int = 1
    group: int = 32
    residual: int = 32
    sinks: int = 4
    recent: int = 32
    n_q: int = 32
    score_topk: int = 64
    scores: list | None = field(default=None, repr=False, compare=False)

    @property
    def name(self) -> str:
        return f"tailorkv/q{self.quant_layers}b{self.bits}k{self.topk}"

    def label(self) -> str:
        return f"{self.quant_layers} layers {self.bits}-bit, top-{self.topk}, recent {self.recent}"

    def prepare(self, model, tok, log=print) -> None:
        if self.scores is None:
            self.scores = tailorkv.layer_scores(model, tok, self.n_q, self.score_topk)

    def quantized(self) -> list[int]:
        if self.scores is None:
            raise ValueError("TailorKV needs its layer scores: call prepare(model, tokenizer) first")
        return tailorkv.quantized_layers(self.scores, self.quant_layers)

    def detail(self, model) -> str:
        q = self.quantized() if self.scores is not None else "?"
        return f"{self.label()}; quantized layers {q}"

    def build(self, model, pattern):
        a = model.tale_spec.arch
        t = model.model.layers[0].self_attn.tale
        return tailorkv.tailor_cache(
            self.quantized(),
            a.num_layers,
            a.num_kv_heads,
            a.head_dim,
            self.bits,
            self.group,
            self.residual,
            self.sinks,
            self.recent,
            self.topk,
            t.scaling,
        )

    def total_nbytes(self, cache) -> int:
        return cache.total_nbytes()

    def exact(self):
        return replace(self, bits=16, topk=1 << 30)  # 16-bit codes, every offloaded token fetched

    @classmethod
    def sweep(cls, ctx: int) -> list[Policy]:
        return [cls(2, 64), cls(2, 16), cls(8, 16)]


REGISTRY: dict[str, type[Policy]] = {
    c.family: c for c in (Full, Tale, Kivi, Quanto, HQQ, Streaming, Palu, Less, TailorKV)
}


def named(name: str) -> Policy:
    """A policy by its row name (NAMED); raises ValueError for an unknown one."""
    fixed = {
        "full": Full(),
        "tale": Tale(),
        "tale-exact": ExactTale(),
        "kivi2": Kivi(2),
        "kivi4": Kivi(4),
        "quanto2": Quanto(2),
        "quanto4": Quanto(4),
        "hqq2": HQQ(2),
        "hqq4": HQQ(4),
        "streaming": Streaming(),
        "palu": Palu(),
    }
    if name not in fixed:
        raise ValueError(f"unknown policy {name!r}: use {', '.join(NAMED)}")
    return fixed[name]


def palu_residual(s: Schedule) -> int:
    """Palu's 16-bit residual: the artifact's, where it holds whole key groups (KIVI's per-channel keys need one);
    else one key group (the lowrank preset's residual of 1 token keeps its newest keys per token instead)."""
    return s.residual if s.residual % s.key_group == 0 else s.key_group


def palu_layer_bytes(model, p: Palu, rank: int, pattern: list[int]) -> int:
    """Bytes of one batch-1 layer of Palu's cache at `rank` after the calls of `pattern` (a dry run with zeros)."""
    a, s = model.tale_spec.arch, model.tale_spec.schedule
    K, n, G = a.num_kv_heads, a.head_dim, a.num_groups
    layer = caches.palu_cache(
        [rank], K, n, G, p.key_bits, p.latent_bits, s.key_group, s.value_group, palu_residual(s)
    ).layers[0]
    for T in pattern:
        layer.update(torch.zeros(1, K, T, n, dtype=model.dtype), torch.zeros(1, G, T, rank, dtype=model.dtype))
    return layer.nbytes()


def palu_ranks(model, p: Palu, target: int, pattern: list[int]) -> list[int]:
    """Per-layer ranks (multiples of value_group) whose Palu cache bytes come closest to `target`.
    Bytes are affine in the rank; the total rank is spread evenly over the layers."""
    L, R, vg = model.tale_spec.arch.num_layers, model.tale_spec.arch.latent_rank, model.tale_spec.schedule.value_group
    lo, hi = palu_layer_bytes(model, p, vg, pattern), palu_layer_bytes(model, p, R, pattern)
    per_rank = (hi - lo) / (R - vg)
    mean = vg + (target / L - lo) / per_rank
    units = min(max(round(mean * L / vg), L), L * (R // vg))
    return budget_ranks([1.0] * L, R, vg, units * vg)


def sink_window(model, sinks: int, target: int) -> int:
    """Recent-window tokens such that sinks + window 16-bit tokens fit in `target` bytes."""
    a = model.tale_spec.arch
    per_token = a.num_layers * 2 * a.num_kv_heads * a.head_dim * torch.finfo(model.dtype).bits // 8
    return max(1, target // per_token - sinks)


def tale_nbytes(model, pol: Tale, pattern: list[int]) -> int:
    """Bytes a batch-1 TaleCache of `pol`'s schedule holds after the calls of `pattern`: the budget that Streaming and
    Palu match (tale_runtime.cache.dry_run_nbytes)."""
    return dry_run_nbytes(pol.resolve(model), model.tale_spec.arch, pattern, model.dtype)[0]
