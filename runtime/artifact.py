"""The TALE artifact: tensor names, the manifest (tale_config.json) and its checks.

Shared by the converter (writes) and the runtime (reads); see DESIGN.md section 6.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

MANIFEST = "tale_config.json"
FORMAT = "tale"
# major.minor: readers reject another major (2.0: every file hashed, v_proj.weight kept; 2.1: key bands,
# schedule fields a 2.0 reader refuses by name, written only when used; 2.2: key_basis.safetensors and
# Level.key_rank, which older readers refuse by name)
# 2.3: the schedule field latent_rotation (latents rotated in blocks at conversion), written only when used
# 2.4: the schedule field key_blocks (a key basis per KV head, 3-D in key_basis.safetensors), written only when used
# 2.5: the schedule field key_ranks (low-rank keys' coefficients per layer), written only when they differ by layer;
# an artifact without it is written as 2.4 (version_for), byte for byte what the 2.4 converter wrote
FORMAT_VERSION = "2.5"
TOOL_NAME = "tale-kv"

# Per-layer tensor names (prefix: the attention module, e.g. "model.layers.3.self_attn.")
U_V = "tale.u_v"  # [G, d, R]   A_c: whitened left factor (x A_c = latent)
V_V = "tale.v_v"  # [G, R, R]   B_c: right factor (latent B_c = values of group c)
O_FUSED = "tale.o_fused"  # [d, H*R] nn.Linear layout of O^r = vstack_q B_{c(q),j(q)} O_q


class ArtifactError(ValueError):
    """A TALE artifact is missing, malformed, corrupt or of an unknown version."""


@dataclass
class Level:
    """One fidelity level. Levels are ordered oldest-first: level 0 is the middle
    (lowest rank/bits), the last level holds the most recent tokens."""

    bits: int  # latent (value) bits
    key_bits: int  # key bits
    share: float | None  # fraction of non-sink tokens kept at this level (None for level 0: the rest)
    # "channel": keys per channel over key_group tokens (KIVI); "token": per token over key_channel_group
    # channels (no token groups, so no 16-bit residual is needed; pairs with rotate="hadamard", QuaRot-style)
    key_axis: str = "channel"
    # > 0: keys in two channel bands: per KV head the `key_hi_channels` most important channels
    # (Schedule.key_order, a calibration statistic) at `key_hi_bits`, the others at `key_bits`
    key_hi_bits: int = 0
    key_hi_channels: int = 0
    # > 0: keys held as their first `key_rank` coefficients per block of the artifact's key basis (before RoPE; one
    # block joins the layer's KV heads, or one per head: Schedule.key_blocks, tale_runtime.key_basis); needs
    # key_rope "pre". A token holds key_blocks x key_rank codes. With Schedule.key_ranks the layers hold their own
    # counts (read Schedule.key_rank(layer, level)): this one then marks the level and is their mean
    key_rank: int = 0


@dataclass
class Schedule:
    """The rank/bit schedule. `ranks[layer][level]` is the latent rank kept at that level."""

    sinks: int = 4
    levels: list[Level] = field(
        default_factory=lambda: [Level(bits=2, key_bits=2, share=None), Level(bits=4, key_bits=4, share=0.1)]
    )
    ranks: list[list[int]] = field(default_factory=list)
    key_group: int = 32  # tokens per key quantization group (keys: per channel over token groups)
    value_group: int = 32  # channels per latent quantization group (latents: per token over channel groups)
    residual: int = 32  # the 16-bit tail: once it holds `residual` tokens they are quantized (a multiple of key_group)
    policy: str = "uniform"
    key_meta: str = "16"  # key scale/zero storage (tale_runtime.quant.META): "16", "8/16" or "8/8"
    value_meta: str = "16"  # latent scale/zero storage
    key_channel_group: int = 64  # channels per key group at levels with key_axis "token"
    rotate: str = "none"  # "hadamard": q and k are rotated by a normalized Hadamard matrix after RoPE (q.k unchanged)
    # "pre": quantized levels hold keys before RoPE (KVQuant: a channel keeps its scale across a token group
    # instead of rotating through it), RoPE is applied as they are read; sinks and the 16-bit tail stay exact
    key_rope: str = "post"
    # per layer, per KV head: the head's key channels, most important first (E[q_c^2] E[range_c^2] over
    # the calibration corpus, tale_convert.stats); read by levels with key_hi_bits
    key_order: list[list[list[int]]] | None = None
    # > 0: the latent channels were rotated at conversion by a normalized Hadamard matrix in blocks of this many
    # (A Q, Q^T B: the same values, latents spread evenly over each quantization group); a rank cut inside a block
    # would mix truncated channels in, so every rank must be a multiple of it
    latent_rotation: int = 0
    # blocks of the artifact's key basis (how it was written, not a knob): 1 joins every KV head of a layer, K is one
    # per head; each holds key_rank coefficients per token at levels with low-rank keys
    key_blocks: int = 1
    # per layer, per level: the coefficients per key basis block that layer holds at that level (0 where the level
    # has plain keys); None: every layer holds its level's key_rank. Written only when the layers differ
    # (tale-convert --key-rank-policy energy)
    key_ranks: list[list[int]] | None = None

    def key_rank(self, layer: int, level: int) -> int:
        """The coefficients per key basis block that `layer` holds at `level` (0: plain keys): the one place that
        reads a level's key rank for a layer."""
        if self.key_ranks is not None:
            return self.key_ranks[layer][level]
        return self.levels[level].key_rank

    def layer_key_ranks(self, layer: int) -> tuple[int, ...]:
        """key_rank(layer, level) of every level, oldest first: what a layer's cache quantizes its keys with."""
        return tuple(self.key_rank(layer, i) for i in range(len(self.levels)))

    def max_key_rank(self, layer: int | None = None) -> int:
        """The most coefficients per block any level of `layer` (None: of any layer) holds; 0: no low-rank keys."""
        layers = range(len(self.key_ranks)) if layer is None and self.key_ranks is not None else [layer or 0]
        return max((r for i in layers for r in self.layer_key_ranks(i)), default=0)

    def unit(self, level: int) -> int:
        """Tokens a level's key groups span: stores of that level hold multiples of it."""
        return self.key_group if self.levels[level].key_axis == "channel" else 1

    def plain_layout(self) -> bool:
        """The KIVI layout of format 1.x: 2/4/8/16 bits, per-channel keys, 16-bit scales and zeros, no bands."""
        return self.key_meta == self.value_meta == "16" and all(
            lv.key_axis == "channel" and {lv.bits, lv.key_bits} <= {2, 4, 8, 16} and not lv.key_hi_bits
            for lv in self.levels
        )

    def fast_path(self) -> bool:
        """Whether a GPU decode kernel reads every level of it, so that decoding on CUDA takes the static cache and
        CUDA-graph steps: the paper kernels (keys after RoPE per channel at 2/3/4/8/16 bits, whole or in bands;
        latents at 2/4/8/16 bits; the paper and tale presets), or the low-rank-key kernel (keys before RoPE, low-rank
        keys, per-token keys, 3-bit latents; no key bands: the lowrank preset). Only key bands together with one of
        those are read by the torch reference alone."""
        paper = self.key_rope == "post" and all(lv.key_axis == "channel" and lv.bits != 3 for lv in self.levels)
        return paper or not any(lv.key_hi_bits for lv in self.levels)

    def validate(self, R: int, num_layers: int | None = None) -> None:
        if self.sinks < 0:
            raise ArtifactError(f"sinks must be >= 0, got {self.sinks}")
        if not self.levels:
            raise ArtifactError("schedule needs at least one level")
        if self.levels[0].share is not None:
            raise ArtifactError("level 0 takes the remaining tokens: its share must be null")
        shares = [lv.share for lv in self.levels[1:]]
        if any(s is None or not (0.0 <= s <= 1.0) for s in shares) or sum(shares) > 1.0 + 1e-9:
            raise ArtifactError(f"level shares must lie in [0, 1] and sum to <= 1, got {shares}")
        for lv in self.levels:
            for b in (lv.bits, lv.key_bits):
                if b not in (2, 3, 4, 8, 16):
                    raise ArtifactError(f"bits must be one of 2, 3, 4, 8, 16; got {b}")
            if lv.key_axis not in ("channel", "token"):
                raise ArtifactError(f"key_axis must be 'channel' or 'token', got {lv.key_axis!r}")
        for lv in self.levels:
            if lv.key_hi_bits:
                if lv.key_hi_bits not in (2, 3, 4, 8) or lv.key_axis != "channel":
                    raise ArtifactError(f"key bands need per-channel keys and key_hi_bits 2, 3, 4 or 8, got {lv}")
                if lv.key_hi_channels < 8 or lv.key_hi_channels % 8:
                    raise ArtifactError(f"key_hi_channels must be a positive multiple of 8, got {lv.key_hi_channels}")
                if self.key_order is None:
                    raise ArtifactError("key bands (key_hi_bits) need the calibration channel order key_order")
        if self.key_order is not None:
            if num_layers is not None and len(self.key_order) != num_layers:
                raise ArtifactError(f"key_order has {len(self.key_order)} layers, model has {num_layers}")
            for li, heads in enumerate(self.key_order):
                if any(sorted(h) != list(range(len(h))) for h in heads):
                    raise ArtifactError(f"layer {li}: key_order must list each head's channels once")
        if self.key_blocks < 1:
            raise ArtifactError(f"key_blocks must be >= 1, got {self.key_blocks}")
        for lv in self.levels:
            if lv.key_rank:
                self._check_key_rank(lv, lv.key_rank, "")
                if self.key_rope != "pre" or lv.key_hi_bits:
                    raise ArtifactError("key_rank (low-rank keys) needs key_rope 'pre' and no key bands")
        if self.key_ranks is not None:
            if num_layers is not None and len(self.key_ranks) != num_layers:
                raise ArtifactError(f"key_ranks has {len(self.key_ranks)} layers, model has {num_layers}")
            for li, krs in enumerate(self.key_ranks):
                if len(krs) != len(self.levels):
                    raise ArtifactError(f"layer {li}: {len(krs)} key_ranks for {len(self.levels)} levels")
                for kr, lv in zip(krs, self.levels):
                    if bool(kr) != bool(lv.key_rank):  # the level's key_rank says which levels hold coefficients
                        raise ArtifactError(
                            f"layer {li}: key_ranks {krs} must be > 0 exactly where a level has key_rank"
                        )
                    if kr:
                        self._check_key_rank(lv, kr, f"layer {li}: ")
        axes = [lv.key_axis for lv in self.levels]
        if "token" in axes and "channel" in axes[axes.index("token") :]:
            raise ArtifactError("levels with per-token keys must be the newest ones (per-channel levels first)")
        for name in ("key_meta", "value_meta"):
            if getattr(self, name) not in ("16", "8/16", "8/8"):
                raise ArtifactError(f"{name} must be '16', '8/16' or '8/8', got {getattr(self, name)!r}")
        if self.rotate not in ("none", "hadamard"):
            raise ArtifactError(f"rotate must be 'none' or 'hadamard', got {self.rotate!r}")
        if self.key_rope not in ("post", "pre"):
            raise ArtifactError(f"key_rope must be 'post' or 'pre', got {self.key_rope!r}")
        if self.key_rope == "pre" and self.rotate != "none":
            raise ArtifactError(
                "key_rope 'pre' quantizes keys before RoPE: it does not combine with a rotation after it"
            )
        if self.key_channel_group < 1 or self.key_channel_group % 8:
            raise ArtifactError(f"key_channel_group must be a positive multiple of 8, got {self.key_channel_group}")
        if self.key_group < 1 or self.value_group < 1:
            raise ArtifactError("key_group and value_group must be >= 1")
        u = self.unit(len(self.levels) - 1)
        if self.residual < u or self.residual % u:
            raise ArtifactError(f"residual ({self.residual}) must be a positive multiple of key_group ({u})")
        if num_layers is not None and len(self.ranks) != num_layers:
            raise ArtifactError(f"ranks has {len(self.ranks)} layers, model has {num_layers}")
        for li, rs in enumerate(self.ranks):
            if len(rs) != len(self.levels):
                raise ArtifactError(f"layer {li}: {len(rs)} ranks for {len(self.levels)} levels")
            if any(not (1 <= r <= R) for r in rs) or list(rs) != sorted(rs):
                raise ArtifactError(f"layer {li}: ranks {rs} must be non-decreasing in [1, {R}]")
            for r, lv in zip(rs, self.levels):
                if lv.bits < 16 and r % self.value_group:
                    raise ArtifactError(f"layer {li}: rank {r} is not a multiple of value_group {self.value_group}")
                if lv.bits == 3 and r % 8:
                    raise ArtifactError(f"layer {li}: 3-bit latents need ranks that are multiples of 8, got {r}")
        if q := self.latent_rotation:
            if not rotation_fits(q, R):
                raise ArtifactError(f"latent_rotation must be a power of two >= 2 dividing R={R}, got {q}")
            for li, rs in enumerate(self.ranks):
                if any(r % q for r in rs):
                    raise ArtifactError(
                        f"layer {li}: ranks {rs} cut inside the latents' rotation blocks of {q} (use multiples of {q})"
                    )

    def _check_key_rank(self, lv: Level, r: int, where: str) -> None:
        if not isinstance(r, int) or r < 0 or r % 8:
            raise ArtifactError(f"{where}key_rank must be a positive multiple of 8, got {r}")
        if lv.key_axis == "token" and r % self.key_channel_group:
            raise ArtifactError(f"{where}key_rank {r} is not a multiple of key_channel_group {self.key_channel_group}")

    def to_dict(self) -> dict:
        """Fields added in format 2.1 (key bands) and later (key_rope) are written only when used, so older readers
        read the rest (and refuse, in one line, a schedule that uses them)."""
        d = asdict(self)
        if d["key_order"] is None:
            del d["key_order"]
        if d["key_rope"] == "post":  # written only when used
            del d["key_rope"]
        if not d["latent_rotation"]:
            del d["latent_rotation"]
        if d["key_blocks"] == 1:
            del d["key_blocks"]
        if d["key_ranks"] is None:
            del d["key_ranks"]
        for lv in d["levels"]:
            if not lv["key_hi_bits"]:
                del lv["key_hi_bits"], lv["key_hi_channels"]
            if not lv["key_rank"]:
                del lv["key_rank"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Schedule:
        """Missing fields take their defaults (older manifests); unknown ones are refused."""
        d = dict(d)
        known = set(cls.__dataclass_fields__)
        level_known = set(Level.__dataclass_fields__)
        unknown = sorted(set(d) - known) + sorted({k for lv in d.get("levels", []) for k in lv} - level_known)
        if unknown:
            raise ArtifactError(f"schedule field {unknown[0]!r} is unknown to this reader (tale-kv); upgrade tale-kv")
        d["levels"] = [Level(**lv) for lv in d["levels"]]
        return cls(**d)

    def shares(self) -> list[float]:
        rest = 1.0 - sum(lv.share for lv in self.levels[1:])
        return [rest] + [lv.share for lv in self.levels[1:]]


def version_for(schedule: Schedule) -> str:
    """The format_version an artifact of this schedule is written with: 2.5 only where it holds key_ranks (the one
    2.5 field), else 2.4, which every reader since 2.4 reads as before."""
    return FORMAT_VERSION if schedule.key_ranks is not None else "2.4"


def rotation_fits(block: int, R: int) -> bool:
    """Whether latents of rank R can be rotated in Hadamard blocks of `block` channels (Schedule.latent_rotation):
    a power of two >= 2 dividing R."""
    return block >= 2 and not block & (block - 1) and R % block == 0


def uniform_ranks(
    R: int, num_layers: int, r0_frac: float = 0.5, value_group: int = 32, n_levels: int = 2
) -> list[list[int]]:
    """Paper default: level 0 keeps r0 = r0_frac * R (schedule.round_rank), others full R."""
    from .schedule import round_rank

    return [[round_rank(r0_frac, R, value_group)] + [R] * (n_levels - 1) for _ in range(num_layers)]


def with_key_ranks(schedule: Schedule, key_ranks: list[list[int]]) -> Schedule:
    """`schedule` with the low-rank keys' coefficients per layer and level (0 at levels with plain keys): key_ranks
    where the layers differ (format 2.5), else each level's key_rank, so that equal ranks write what a uniform
    schedule writes. Levels with low-rank keys keep their key_rank (the mean the ranks were allocated from)."""
    rows = [list(map(int, krs)) for krs in key_ranks]
    if all(r == rows[0] for r in rows):
        levels = [replace(lv, key_rank=r) for lv, r in zip(schedule.levels, rows[0])] if rows else schedule.levels
        return replace(schedule, levels=levels, key_ranks=None)
    return replace(schedule, key_ranks=rows)


def nominal_ratio(schedule: Schedule, head_dim: int, group: int, kv_heads: int | None = None) -> float:
    """16-bit K+V bits per token-head over TALE's, ignoring sinks and scales (DESIGN.md 1).

    Per token and KV head a level costs key_bits*n + bits*rank/g (a group latent serves g heads); key bands
    key_hi_bits on key_hi_channels of the n; low-rank keys key_bits*key_rank*key_blocks/K (the coefficients of the
    key_blocks blocks serve the layer's K = kv_heads heads), with each layer's key_rank. Bits are averaged over
    layers.
    """
    n = head_dim
    if kv_heads is None and any(lv.key_rank for lv in schedule.levels):
        raise ValueError("the nominal ratio of low-rank keys (key_rank) needs kv_heads")

    def keys(lv: Level, key_rank: int) -> float:
        if key_rank:
            return lv.key_bits * key_rank * schedule.key_blocks / kv_heads
        return lv.key_bits * (n - lv.key_hi_channels) + lv.key_hi_bits * lv.key_hi_channels

    layers = schedule.ranks or [[group * n] * len(schedule.levels)]
    per_layer = []
    for li, rs in enumerate(layers):
        krs = schedule.layer_key_ranks(li)
        bits = sum(
            s * (keys(lv, kr) + lv.bits * r / group)
            for s, lv, r, kr in zip(schedule.shares(), schedule.levels, rs, krs)
        )
        per_layer.append(bits)
    return 32 * n / (sum(per_layer) / len(per_layer))


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_manifest(path: str | Path) -> dict:
    """Read and check tale_config.json of an artifact directory (no checksum pass)."""
    root = Path(path)
    mf = root / MANIFEST
    if not root.is_dir():
        raise ArtifactError(f"{root}: not a directory (expected a TALE artifact)")
    if not mf.is_file():
        raise ArtifactError(f"{root}: no {MANIFEST}; not a TALE artifact (run tale-convert first)")
    try:
        m = json.loads(mf.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{mf}: corrupt manifest ({e.msg} at line {e.lineno})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ArtifactError(f"{mf}: not a TALE manifest (format != {FORMAT!r})")
    ver = str(m.get("format_version", ""))
    major = ver.split(".")[0]
    ours = FORMAT_VERSION.split(".")[0]
    if major.isdigit() and int(major) < int(ours):
        raise ArtifactError(
            f"{root}: an artifact of format {ver}, from an older tale-kv; this one reads "
            f"{FORMAT_VERSION}: re-convert the model with tale-convert"
        )
    if major != ours:
        raise ArtifactError(
            f"{mf}: format version {ver!r} is not supported by this reader ({FORMAT_VERSION}); upgrade tale-kv"
        )
    for key in ("architecture", "schedule", "files"):
        if key not in m:
            raise ArtifactError(f"{mf}: manifest lacks {key!r}")
    return m


def artifact_files(path: str | Path) -> list[str]:
    """Every file of an artifact directory but the manifest, as sorted POSIX paths relative to it.
    Hidden paths (.gitattributes of a Hub snapshot, .partial of a conversion, editor files) are not part of
    it: nothing reads them and tale-push does not upload them. Symlinks are followed (Hub snapshots)."""
    root = Path(path)
    names = []
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file() or rel.as_posix() == MANIFEST:
            continue
        names.append(rel.as_posix())
    return sorted(names)


def hash_files(path: str | Path) -> dict[str, str]:
    """{file: sha256} of every artifact file (artifact_files): the manifest's "files". The converter
    calls it last, once everything else is written."""
    root = Path(path)
    return {name: sha256_file(root / name) for name in artifact_files(root)}


def verify_files(path: str | Path, manifest: dict | None = None, skip: tuple[str, ...] = ()) -> set[str]:
    """Check the artifact against manifest["files"]: every listed file present with its sha256, and no
    other file (an unlisted file could be read unverified). Returns the verified names; the loader
    reads only those. `skip`: names not checked (tale-push rehashes the README.md it regenerates)."""
    root = Path(path)
    m = manifest or read_manifest(root)
    files = m.get("files")
    if not isinstance(files, dict) or not files or not all(isinstance(v, str) for v in files.values()):
        raise ArtifactError(f"{root}: the manifest lists no files to verify (corrupt or edited {MANIFEST})")
    for name in files:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ArtifactError(f"{root}: the manifest names {name!r}, outside the artifact")
    if "config.json" not in files:
        raise ArtifactError(f"{root}: the manifest does not cover config.json (corrupt or edited {MANIFEST})")
    unlisted = sorted(set(artifact_files(root)) - set(files) - set(skip))
    if unlisted:
        raise ArtifactError(
            f"{root}: {unlisted[0]} is not in the manifest (not part of the artifact: remove it, or re-convert)"
        )
    for name, digest in files.items():
        if name in skip:
            continue
        f = root / name
        if not f.is_file():
            raise ArtifactError(f"{root}: {name} is missing (incomplete artifact: re-download or re-convert)")
        if sha256_file(f) != digest:
            raise ArtifactError(f"{root}: checksum mismatch for {name} (file corrupt or modified)")
    return set(files) - set(skip)


def schedule_of(manifest: dict) -> Schedule:
    return Schedule.from_dict(manifest["schedule"])


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def ceil_share(p: float, n: int) -> int:
    """ceil(p*n) robust to float noise (0.1*30 must give 3, not 4)."""
    return int(math.ceil(p * n - 1e-9))
