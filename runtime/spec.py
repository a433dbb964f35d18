"""What a loaded TALE model is, read once from its manifest: the architecture, the schedule, the key basis.

Built in one place (`load`) and carried by the model as `model.tale_spec`; the caches, generate,
eval and the model card read it instead of the manifest's dicts. A leaf module: it imports only the artifact's types
and the families' facts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from . import families
from .artifact import ArtifactError, Schedule


@dataclass(frozen=True)
class Arch:
    """Shapes of DESIGN.md 2: H query heads, K KV heads of head dim n, groups of g KV heads, G = K / g latent groups
    of full rank R = g n."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int  # H
    num_kv_heads: int  # K
    head_dim: int  # n
    group_size: int  # g
    num_groups: int  # G
    latent_rank: int  # R
    rotary_dim: int = 0  # channels of a head that RoPE rotates, the first ones (0: all; Phi-3's partial rotary: fewer)

    @classmethod
    def from_manifest(cls, manifest: dict, config=None) -> Arch:
        """The manifest's `architecture` block (config.json fills what older manifests lack); ArtifactError if it is
        incomplete or inconsistent."""
        a = manifest.get("architecture")
        if not isinstance(a, dict):
            raise ArtifactError("manifest lacks its architecture block")

        def get(key: str, cfg_key: str | None = None) -> int:
            v = a.get(key)
            if v is None and config is not None and cfg_key is not None:
                v = getattr(config, cfg_key, None)
            try:
                return int(v)
            except (TypeError, ValueError):
                raise ArtifactError(f"manifest architecture lacks {key}") from None

        g, R = get("group_size"), get("latent_rank")
        K, n = get("num_kv_heads", "num_key_value_heads"), get("head_dim", "head_dim")
        arch = cls(
            model_type=str(a.get("model_type") or getattr(config, "model_type", "")),
            num_layers=get("num_layers", "num_hidden_layers"),
            hidden_size=get("hidden_size", "hidden_size"),
            num_heads=get("num_heads", "num_attention_heads"),
            num_kv_heads=K,
            head_dim=n,
            group_size=g,
            num_groups=int(a.get("num_groups") or (K // g if g else 0)),
            latent_rank=R,
            rotary_dim=families.rotary_dim(config) if config is not None else 0,
        )
        if g <= 0 or K % g or arch.num_groups * g != K or R != g * n:
            raise ArtifactError(f"manifest architecture is inconsistent: K={K}, g={g}, G={arch.num_groups}, R={R}")
        if arch.num_heads % K:
            raise ArtifactError(f"manifest architecture: {arch.num_heads} query heads over {K} KV heads")
        return arch

    @classmethod
    def from_config(cls, config, group: int) -> Arch:
        """The shapes of a checkpoint's config at latent groups of `group` KV heads (what tale-convert writes; the
        converter checks the config first: source.check_config)."""
        K, n = config.num_key_value_heads, families.head_dim(config)
        return cls(
            model_type=config.model_type,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=K,
            head_dim=n,
            group_size=group,
            num_groups=K // group,
            latent_rank=group * n,
            rotary_dim=families.rotary_dim(config),
        )

    def per_rank(self, tp_size: int) -> Arch:
        """The shapes one rank of tensor parallelism holds: whole latent groups, H/N query, K/N KV heads, G/N groups."""
        if tp_size == 1:
            return self
        n = tp_size
        return replace(
            self, num_heads=self.num_heads // n, num_kv_heads=self.num_kv_heads // n, num_groups=self.num_groups // n
        )

    def to_manifest(self) -> dict:
        """The manifest's `architecture` block (from_manifest reads it back; rotary_dim comes from config.json)."""
        L, g, G, R = self.num_layers, self.group_size, self.num_groups, self.latent_rank
        return {
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "num_layers": L,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "group_size": g,
            "num_groups": G,
            "latent_rank": R,
            "layers": [{"g": g, "G": G, "R": R} for _ in range(L)],
        }


@dataclass
class TaleSpec:
    """A loaded model's TALE facts. `backend`: the attention backend new caches ask for ("auto": the fastest one
    that serves the cache, see tale_runtime.backends); `backend_config`: its tuning knobs (None: defaults)."""

    arch: Arch
    schedule: Schedule
    key_basis: list | None = None  # per layer a key_basis.KeyBasis, or None without low-rank keys
    manifest: dict = field(default_factory=dict)
    path: Path | None = None
    backend: str = "auto"
    backend_config: object | None = None
    tp: object | None = None  # tensor parallelism (runtime/tp.py TP: size, rank, mesh); None: one process

    @property
    def tp_size(self) -> int:
        return 1 if self.tp is None else self.tp.size

    def rank_arch(self) -> Arch:
        """The shapes this process holds and caches (the whole model's `arch` without tensor parallelism)."""
        return self.arch.per_rank(self.tp_size)

    def nominal_ratio(self, schedule: Schedule | None = None) -> float:
        """artifact.nominal_ratio of `schedule` (default: the model's) on this architecture."""
        from .artifact import nominal_ratio

        a = self.arch
        return nominal_ratio(schedule or self.schedule, a.head_dim, a.group_size, a.num_kv_heads)


@dataclass(frozen=True)
class CacheSpec:
    """What decides which attention backend serves a cache: its shapes, schedule, storage and device."""

    arch: Arch
    schedule: Schedule
    static: bool
    device: torch.device
    dtype: torch.dtype = torch.bfloat16
    # per layer, its attention's sliding window (None: a global layer); empty: none known. A static cache holds a
    # sliding layer as a 16-bit ring of its window (runtime/static_cache.py), not in TALE's levels
    windows: tuple[int | None, ...] = ()

    @property
    def sliding(self) -> bool:
        """Some layer attends through a sliding window."""
        return any(w is not None for w in self.windows)
