"""The converter's options (tale-convert's flags) and the schedule they make; no torch here, so that the CLI parses
and checks its options before the heavy imports."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tale_runtime import console
from tale_runtime.artifact import ArtifactError, Level, Schedule, rotation_fits, uniform_ranks
from tale_runtime.schedule import PRESETS, Preset

from . import ConvertError

BASIS_BLOCKS = ("joint", "group", "head")  # --key-basis-blocks
# what the optional knobs of an unknown --preset read as (the name itself is refused by Options.schedule)
_NO_PRESET = Preset(bits=(), key_bits=(), recent=(), r0=0.0, key_axis=(), residual=None, key_meta="", value_meta="")


@dataclass
class Options:
    group: int = 4
    calib: list[Path] | None = None  # None: the bundled corpus
    samples: int = 64
    seq_len: int = 512
    seed: int = 0
    shrink: float = 0.0  # covariance shrinkage before whitening (tale_convert.whiten.shrunk; 0: SVD-LLM as is)
    # None: the preset's; True: latents rotated in blocks of value_group channels (tale_convert.whiten.rotate_latents)
    rotate_latents: bool | None = None
    device: str = "auto"
    dtype: str = "bf16"  # of the stored tensors; "auto": the checkpoint's
    sinks: int = 4
    # None: from the preset (tale_runtime.schedule.PRESETS); explicit values override it
    recent: tuple[float, ...] | None = None  # share of each level above 0
    r0: float | None = None  # level-0 rank as a fraction of R
    bits: tuple[int, ...] | None = None  # value bits per level
    key_bits: tuple[int, ...] | None = None  # default: the preset's, or = bits when bits are given
    key_group: int = 32
    value_group: int | None = None  # channels per latent quantization group; None: the preset's (else 32)
    residual: int | None = None
    # "lowrank" (default): the most accurate per byte (low-rank keys before RoPE, full-rank 3-bit latents);
    # "paper": the paper's schedule (KIVI layout, 16-bit scales), the fastest GPU decode; "tale": 2-bit middle keys
    # with the most important half of each head's channels at 3 bits, which misses the demo's long-context answer
    # (docs/quality.md). The GPU fast path (static cache, CUDA graphs, a Triton or CUDA kernel) reads all three
    preset: str = "lowrank"
    target_ratio: float | None = None  # level-0 ranks per layer chosen to meet this measured ratio (1K tokens)
    # (bits, channels): the middle level's keys in two bands, per KV head the `channels` most important key
    # channels (calibration, tale_convert.stats) at `bits`; the artifact carries the order (format 2.1)
    key_bands: tuple[int, int] | None = None
    # the key basis of low-rank keys (Level.key_rank, tale_runtime.key_basis): key_basis.safetensors (format 2.2)
    key_basis: bool = False
    # the key basis in blocks (tale_runtime.key_basis): "joint" (one over the layer's KV heads), "head" (one per KV
    # head: key_rank then counts coefficients per head, format 2.4); None: the preset's, else joint
    key_basis_blocks: str | None = None
    shard_size: str | int = "2GB"
    overwrite: bool = False
    resume: bool = False
    policy: str = "uniform"  # rank policy (tale_convert.rank_policy): uniform, energy, fisher, progressive
    energy: float = 0.9  # energy policy: whitened spectral energy kept per layer at level 0
    # low-rank keys' coefficients per layer (tale_convert.rank_policy.key_ranks): uniform, or energy (the same total,
    # by each layer's calibration key energy; Schedule.key_ranks, format 2.5)
    key_rank_policy: str = "uniform"

    def latent_group(self, R: int) -> int:
        """Channels per latent quantization group: --value-group, else the preset's where it divides R (the latents
        of a KV group), else 32."""
        if self.value_group is not None:
            return self.value_group
        vg = self._preset().value_group
        return vg if R % vg == 0 else 32

    def bands(self, head_dim: int) -> tuple[int, int] | None:
        """(bits, channels per KV head) of the middle level's key bands: --key-bands, else the preset's
        (bits, share of the head dim, rounded to a multiple of 8 channels), else None."""
        if self.key_bands:
            return tuple(self.key_bands)
        p = self._preset().key_bands
        if not p:
            return None
        return p[0], max(8, round(p[1] * head_dim / 8) * 8)

    def wants_basis(self) -> bool:
        """Whether the artifact gets a key basis: --key-basis, or a preset with low-rank keys."""
        return self.key_basis or any(self._preset().key_rank)

    def blocks(self, kv_heads: int) -> int:
        """Blocks of the key basis (Schedule.key_blocks): 1 joint, kv_heads / group per latent group, kv_heads per
        head."""
        kind = self.key_basis_blocks or self._preset().key_basis_blocks
        if kind not in BASIS_BLOCKS:
            raise ConvertError(f"unknown --key-basis-blocks {kind!r}: use one of {', '.join(BASIS_BLOCKS)}")
        if self.key_basis_blocks and not self.wants_basis():
            raise ConvertError("--key-basis-blocks shapes the key basis: add --key-basis (or use --preset lowrank)")
        if kind == "group":
            return max(1, kv_heads // self.group)  # latent groups divide the KV heads (refused at load otherwise)
        return kv_heads if kind == "head" else 1

    def _preset(self) -> Preset:
        """The chosen preset (an unknown name: one with no optional knobs; schedule() refuses the name)."""
        return PRESETS.get(self.preset, _NO_PRESET)

    def _rotation_block(self, preset: Preset, R: int) -> int:
        """Channels per Hadamard block of the latents: the preset's (lowrank: 32), at most the latent group."""
        vg = self.latent_group(R)
        return min(vg if preset.rotation_block is None else preset.rotation_block, vg)

    def _rotate_latents(self, preset: Preset, R: int) -> bool:
        """Asked for: rotate (a block size that cannot follow is refused by the schedule); by the preset: only where
        its blocks fit (a power of two dividing R), else the SVD basis as it is."""
        if self.rotate_latents is not None:
            return self.rotate_latents
        return preset.rotate_latents and rotation_fits(self._rotation_block(preset, R), R)

    def schedule(self, R: int, num_layers: int, kv_heads: int = 1, head_dim: int | None = None) -> Schedule:
        """The schedule of the options; kv_heads x head_dim (the joined keys of a layer) sizes a preset's low-rank
        keys, per block of the key basis."""
        from . import rank_policy  # imports torch: not when the CLI parses its options

        if self.policy not in rank_policy.POLICIES:
            raise ConvertError(f"unknown --policy {self.policy!r}: use one of {', '.join(rank_policy.POLICIES)}")
        if not 0 < self.energy <= 1:
            raise ConvertError(f"--energy must be a fraction in (0, 1], got {self.energy}")
        if self.key_rank_policy not in rank_policy.KEY_RANK_POLICIES:
            raise ConvertError(
                f"unknown --key-rank-policy {self.key_rank_policy!r}: use one of "
                f"{', '.join(rank_policy.KEY_RANK_POLICIES)}"
            )
        if self.preset not in PRESETS:
            raise ConvertError(f"unknown --preset {self.preset!r}: use one of {', '.join(PRESETS)}")
        p = PRESETS[self.preset]
        # None: the preset's; anything given is checked, so --r0 0 is refused rather than read as unset
        bits = p.bits if self.bits is None else self.bits
        key_bits = self.key_bits if self.key_bits is not None else (p.key_bits if self.bits is None else bits)
        recent = p.recent if self.recent is None else self.recent
        r0 = p.r0 if self.r0 is None else self.r0
        if len(key_bits) != len(bits) or len(recent) != len(bits) - 1:
            n = len(bits)
            none = " (--recent= for none)" if n == 1 else ""
            raise ConvertError(f"{n} level(s) (--bits) need {n} --key-bits and {n - 1} --recent shares{none}")
        if not 0 < r0 <= 1:
            raise ConvertError(f"--r0 must be a fraction of R in (0, 1], got {r0}")
        axes, kr = p.key_axis, p.key_rank or (0,) * len(p.bits)  # kr: fractions of K n (0: plain)
        if len(axes) != len(bits):
            # per-level knobs other than plain per-channel keys cannot follow another level count
            if set(axes) != {"channel"} or any(kr):
                raise ConvertError(
                    f"--preset {self.preset} sets its per-level key layout for {len(axes)} levels; --bits gives "
                    f"{len(bits)}: give {len(axes)} levels or use --preset paper"
                )
            axes, kr = ["channel"] * len(bits), (0,) * len(bits)
        levels = [Level(b, kb, sh, key_axis=a) for b, kb, sh, a in zip(bits, key_bits, (None, *recent), axes)]
        blocks = self.blocks(kv_heads)
        for lv, f in zip(levels, kr):  # a fraction of the joined keys, split over the blocks
            lv.key_rank = max(8, round(f * kv_heads * (head_dim or 0) / blocks / 8) * 8) if f else 0
        vg = self.latent_group(R)
        ranks = uniform_ranks(R, num_layers, r0, vg, len(levels))
        n = R // self.group
        # the preset's residual fits its own levels; per-channel newest keys need at least one key group (KIVI)
        residual = self.residual or (p.residual if axes[-1] == "token" else None) or self.key_group
        schedule = Schedule(
            self.sinks,
            levels,
            ranks,
            self.key_group,
            vg,
            residual,
            key_meta=p.key_meta,
            value_meta=p.value_meta,
            key_channel_group=n,
            key_rope=p.key_rope,
            latent_rotation=self._rotation_block(p, R) if self._rotate_latents(p, R) else 0,
            key_blocks=blocks if self.wants_basis() else 1,
        )
        try:
            schedule.validate(R, num_layers)
        except ArtifactError as e:
            raise ConvertError(f"invalid schedule: {e}") from None
        if self.key_rank_policy != "uniform" and not any(lv.key_rank for lv in levels):
            raise ConvertError(
                f"--key-rank-policy {self.key_rank_policy} sets the low-rank keys' coefficients per layer: this "
                "schedule has no low-rank keys (use --preset lowrank)"
            )
        return schedule


def check_inputs(out: str | Path, opts: Options) -> None:
    """What can be checked before minutes of work: the place to write, the device, the numbers, the calibration
    files. tale_convert.convert checks them first; tale-convert checks them before it imports the converter."""
    if not str(out).strip():  # Path("") would be the current directory
        raise ConvertError("--out is empty: name the artifact directory to write")
    console.writable_dir(Path(out).expanduser(), "--out")
    console.device(opts.device)
    for name, v, least in (
        ("--samples", opts.samples, 1),
        ("--seq-len", opts.seq_len, 2),
        ("--sinks", opts.sinks, 0),
        ("--key-group", opts.key_group, 1),
        ("--value-group", opts.value_group, 1),
        ("--residual", opts.residual, 1),
        ("--group", opts.group, 1),
    ):
        if v is not None and v < least:  # None: the preset's
            raise ConvertError(f"{name} must be >= {least}, got {v}")
    if opts.preset not in PRESETS:
        raise ConvertError(f"unknown --preset {opts.preset!r}: use one of {', '.join(PRESETS)}")
    opts.blocks(1)  # an unknown --key-basis-blocks: refused now
    if opts.target_ratio is not None and opts.target_ratio <= 1:
        raise ConvertError(f"--target-ratio must be > 1 (a compression ratio), got {opts.target_ratio:g}")
    for f in opts.calib or []:
        f = Path(f)
        if f.is_dir():
            raise ConvertError(f"--calib {f}: is a directory; give the files (e.g. --calib {f}/a.txt, repeatable)")
        if f.is_file() and f.suffix.lower() != ".parquet":
            console.read_text(f, "--calib")  # empty, binary, not UTF-8: one line naming the file
    if opts.calib:
        from .calibrate import load_documents

        load_documents([Path(f) for f in opts.calib])  # parsed now (one-line errors), not after the model is loaded
