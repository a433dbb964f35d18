"""The conversion pipeline end to end: source -> calibrate -> whiten -> fuse -> write."""

from __future__ import annotations

import functools
import hashlib
import os
import re
import resource
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from tale_runtime.artifact import (FORMAT, FORMAT_VERSION, MANIFEST, O_FUSED, TOOL_NAME, U_V, V_V, ArtifactError, Level,
                                   Schedule, nominal_ratio, uniform_ranks, write_json)

from . import ConvertError, __version__
from . import calibrate, resume, source, write
from . import policy as rank_policy
from .card import render_card
from .fuse import fuse
from .whiten import energy_kept, whiten

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


@dataclass
class Options:
    group: int = 4
    calib: list[Path] | None = None  # None: the bundled corpus
    samples: int = 64
    seq_len: int = 512
    seed: int = 0
    device: str = "auto"
    dtype: str = "bf16"  # of the stored tensors; "auto": the checkpoint's
    sinks: int = 4
    # None: from the preset (tale_convert.policy.PRESETS); explicit values override it
    recent: tuple[float, ...] | None = None  # share of each level above 0
    r0: float | None = None  # level-0 rank as a fraction of R
    bits: tuple[int, ...] | None = None  # value bits per level
    key_bits: tuple[int, ...] | None = None  # default: the preset's, or = bits when bits are given
    key_group: int = 32
    value_group: int = 32
    residual: int | None = None
    preset: str = "tale"  # "tale": the best schedule measured per byte (docs/quality.md); "paper": the paper's
    target_ratio: float | None = None  # level-0 ranks per layer chosen to meet this measured ratio (1K tokens)
    shard_size: str | int = "2GB"
    overwrite: bool = False
    resume: bool = False
    policy: str = "uniform"  # rank policy (tale_convert.policy): uniform, energy, fisher, progressive
    energy: float = 0.9  # energy policy: whitened spectral energy kept per layer at level 0

    def schedule(self, R: int, num_layers: int) -> Schedule:
        if self.policy not in rank_policy.POLICIES:
            raise ConvertError(f"unknown --policy {self.policy!r}: use one of {', '.join(rank_policy.POLICIES)}")
        if not 0 < self.energy <= 1:
            raise ConvertError(f"--energy must be a fraction in (0, 1], got {self.energy}")
        if self.preset not in rank_policy.PRESETS:
            raise ConvertError(f"unknown --preset {self.preset!r}: use one of {', '.join(rank_policy.PRESETS)}")
        p = rank_policy.PRESETS[self.preset]
        bits = self.bits or p["bits"]
        key_bits = self.key_bits or (self.bits if self.bits else p["key_bits"])
        recent = self.recent or p["recent"]
        r0 = self.r0 or p["r0"]
        if len(key_bits) != len(bits) or len(recent) != len(bits) - 1:
            n = len(bits)
            raise ConvertError(f"{n} levels (--bits) need {n} --key-bits and {n - 1} --recent shares")
        if not 0 < r0 <= 1:
            raise ConvertError(f"--r0 must be a fraction of R in (0, 1], got {r0}")
        axes = p["key_axis"] if len(p["key_axis"]) == len(bits) else ["channel"] * len(bits)
        levels = [Level(b, kb, sh, key_axis=a) for b, kb, sh, a in zip(bits, key_bits, (None, *recent), axes)]
        ranks = uniform_ranks(R, num_layers, r0, self.value_group, len(levels))
        n = R // self.group
        # the preset's residual fits its own levels; per-channel newest keys need at least one key group (KIVI)
        residual = self.residual or (p["residual"] if axes[-1] == "token" else None) or self.key_group
        schedule = Schedule(self.sinks, levels, ranks, self.key_group, self.value_group, residual,
                            key_meta=p["key_meta"], value_meta=p["value_meta"], key_channel_group=n)
        try:
            schedule.validate(R, num_layers)
        except ArtifactError as e:
            raise ConvertError(f"invalid schedule: {e}") from None
        return schedule


@dataclass
class LayerReport:
    index: int
    eps: float
    energy: list[float]  # whitened energy kept at each level's rank
    seconds: float
    reused: bool


@dataclass
class Report:
    out: Path
    layers: list[LayerReport] = field(default_factory=list)
    nominal_ratio: float = 0.0
    seconds: float = 0.0
    peak_rss: int = 0  # bytes, this process
    peak_device: int | None = None  # bytes, CUDA only


def convert(model: str | None, out: str | Path, opts: Options,
            on_layer: Callable[[LayerReport, int], None] | None = None,
            log: Callable[[str], None] = lambda s: None) -> Report:
    """Convert MODEL into a TALE artifact at `out`. Raises ConvertError on bad input."""
    t0 = time.perf_counter()
    out = Path(out).expanduser().absolute()
    write.check_out(out, opts.overwrite)
    shard_size = write.parse_size(opts.shard_size)
    if opts.samples < 1 or opts.seq_len < 2:
        raise ConvertError("--samples must be >= 1 and --seq-len >= 2")

    src = source.resolve(model)
    config, arch = source.load_config(src, opts.group)
    schedule = opts.schedule(arch.R, arch.L)
    window = source.sliding_window(config)
    if window and opts.seq_len > window:
        raise ConvertError(f"--seq-len {opts.seq_len} exceeds the model's sliding window {window}")
    dtype = _dtype(opts.dtype, config)
    device = _device(opts.device)

    tokenizer = source.load_tokenizer(src)
    docs, calib_info = calibrate.load_documents(opts.calib)
    tokens = calibrate.sample_tokens(tokenizer, docs, opts.samples, opts.seq_len, opts.seed)
    log(f"calibration: {opts.samples} x {opts.seq_len} tokens from {calib_info['source']}")
    base_files = src.file_hashes()
    # Everything the factors depend on; a partial run is reused only if this matches exactly.
    settings = {"tool": __version__, "model": base_files, "group": arch.g,
                "tokens": hashlib.sha256(tokens.numpy().tobytes()).hexdigest()}

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    found = resume.find(out, settings) if opts.resume else None
    if found != tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    if found and found != tmp:
        os.replace(found, tmp)
    if opts.resume:
        log(f"resuming {found.name}" if found else "nothing to resume for these settings: starting afresh")
    partial = None
    try:
        partial = resume.Partial(tmp / resume.DIR, settings)
        log(f"loading {src.id}")
        hf = source.load_model(src)
        source.check_layout(hf, arch)
        layers = _factorize(hf, tokens, device, arch, schedule, partial, on_layer)
        if opts.policy != "uniform":
            schedule, layers = _rank_policy(opts, schedule, layers, hf, tokens, arch, partial, log)
        if opts.target_ratio:
            schedule, layers = _target_ratio(opts, schedule, layers, arch, partial, log)

        entries = _entries(hf, arch, dtype, partial, device)
        files = write.write_tensors(tmp, entries, shard_size)
        write.copy_model_files(tmp, config, tokenizer, hf.generation_config, dtype)
        manifest = _manifest(src, base_files, arch, schedule, layers, calib_info, opts, dtype, files)
        write_json(tmp / MANIFEST, manifest)
        base_card = src.path / "README.md"
        (tmp / "README.md").write_text(render_card(manifest, base_card.read_text() if base_card.is_file() else None))
        shutil.rmtree(tmp / resume.DIR)
        write.publish(tmp, out)
    except KeyboardInterrupt:
        if partial and partial.done():
            log(f"interrupted: {len(partial.done())} finished layers kept in {tmp}; rerun with --resume to reuse them")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Report(out, layers, manifest["nominal_ratio"], time.perf_counter() - t0,
                  resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)


def _manifest(src, base_files, arch, schedule, layers, calib_info, opts, dtype, files) -> dict:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tool": {"name": TOOL_NAME, "version": __version__},
        "base": {"id": src.id, "revision": src.revision, "license": src.license, "origin": src.origin,
                 "files": base_files},
        "dtype": str(dtype).removeprefix("torch."),
        "architecture": arch.to_manifest(),
        "schedule": schedule.to_dict(),
        "svd": {"method": "svd-llm-whitened", "compute_dtype": "float64", "whitening_eps": [lr.eps for lr in layers]},
        "calibration": {**calib_info, "samples": opts.samples, "seq_len": opts.seq_len, "seed": opts.seed,
                        "tokens": opts.samples * opts.seq_len},
        "energy_kept": [lr.energy for lr in layers],
        "nominal_ratio": round(nominal_ratio(schedule, arch.n, arch.g), 4),
        "files": files,
    }


def _factorize(hf, tokens, device, arch, schedule, partial, on_layer) -> list[LayerReport]:
    """Stream the calibration set through the layers; whiten + factor each layer's v_proj.

    Layers already in `partial` are only replayed forward, and not even that once no later
    layer is missing."""
    done = partial.done()
    missing = [i for i in range(arch.L) if i not in done]
    stop = max(missing) + 1 if missing else 0
    ckpt = partial.load_hidden() if done and missing else None
    start = ckpt[0] if ckpt else 0
    hidden = None
    if start < stop:
        hidden = ckpt[1].to(device) if ckpt else calibrate.embed(hf, tokens, device)
        rope = calibrate.rotary(hf, tokens.shape[1], device)
    reports: dict[int, LayerReport] = {}
    saved = time.perf_counter()
    for i in range(start, stop):
        t = time.perf_counter()
        layer = hf.model.layers[i]
        C = calibrate.run_layer(layer, hidden, rope, i, covariance=i not in done)
        if C is not None:
            f = whiten(C, layer.self_attn.v_proj.weight.T, arch.g, arch.n)
            del C
            partial.save_layer(i, f, time.perf_counter() - t)
            energy = [energy_kept(f.S, r) for r in schedule.ranks[i]]
            reports[i] = LayerReport(i, f.eps, energy, time.perf_counter() - t, False)
            if on_layer:
                on_layer(reports[i], arch.L)
        if i + 1 < stop and time.perf_counter() - saved > resume.HIDDEN_EVERY_S:
            partial.save_hidden(i + 1, hidden)
            saved = time.perf_counter()
    del hidden
    for i in sorted(set(range(arch.L)) - set(reports)):
        f, seconds = partial.load_layer(i)
        reports[i] = LayerReport(i, f.eps, [energy_kept(f.S, r) for r in schedule.ranks[i]], seconds, True)
        if on_layer:
            on_layer(reports[i], arch.L)
    return [reports[i] for i in range(arch.L)]


def _rank_policy(opts, schedule, layers, hf, tokens, arch, partial, log) -> tuple[Schedule, list[LayerReport]]:
    """Level-0 ranks from --policy, under the uniform schedule's budget (energy: a threshold instead);
    the layers' reported energy follows the new ranks."""
    spectra = [partial.load_layer(i)[0].S for i in range(arch.L)]
    fisher = None
    if opts.policy == "fisher":
        log("fisher: gradients of the calibration loss w.r.t. v_proj (8 sequences, on the CPU)")
        fisher = rank_policy.fisher_scores(hf.to("cpu"), list(tokens[:8].split(2)))
    ranks0 = rank_policy.level0_ranks(opts.policy, arch.R, arch.L, schedule.value_group, schedule.ranks[0][0],
                                      spectra=spectra, energy=opts.energy, fisher=fisher)
    schedule = rank_policy.apply(schedule, opts.policy, ranks0)
    layers = [replace(lr, energy=[energy_kept(S, r) for r in rs]) for lr, S, rs in zip(layers, spectra, schedule.ranks)]
    return schedule, layers


def _target_ratio(opts, schedule, layers, arch, partial, log) -> tuple[Schedule, list[LayerReport]]:
    """Level-0 ranks per layer meeting --target-ratio (measured at 1K tokens) with the least whitened energy lost."""
    spectra = [partial.load_layer(i)[0].S for i in range(arch.L)]
    fitted = rank_policy.fit_ranks(schedule, opts.target_ratio, (arch.K, arch.n, arch.G, arch.R), spectra)
    if fitted is None:
        best = rank_policy.measured_ratio(rank_policy.apply(schedule, "budget", [schedule.value_group] * arch.L),
                                          arch.K, arch.n, arch.G, arch.R)
        raise ConvertError(f"--target-ratio {opts.target_ratio:g} is out of reach of this schedule "
                           f"(at most {best:.2f}x at 1K tokens); lower the bits or the recent share")
    r0 = [rs[0] for rs in fitted.ranks]
    log(f"target ratio {opts.target_ratio:g}x: level-0 ranks {min(r0)}..{max(r0)} (mean {sum(r0) / len(r0):.0f})")
    layers = [replace(lr, energy=[energy_kept(S, r) for r in rs]) for lr, S, rs in zip(layers, spectra, fitted.ranks)]
    return fitted, layers


def _entries(hf, arch, dtype, partial, device) -> list[write.Entry]:
    """Base tensors in state_dict order, each layer's v_proj.weight replaced by the TALE tensors.
    Tied weights are written once (as transformers does). O^r is fused on the device: in float64
    it is the one large product of the conversion (g times the size of W_O)."""
    factors = functools.lru_cache(maxsize=1)(lambda i: partial.load_layer(i)[0])
    size = torch.finfo(dtype).bits // 8
    d, G, R, H = arch.d, arch.G, arch.R, arch.H
    entries, seen = [], set()
    for name, t in hf.state_dict().items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        m = re.fullmatch(r"(.*\.layers\.(\d+)\.self_attn\.)v_proj\.weight", name)
        if not m:
            entries.append(write.Entry(name, t.numel() * size, lambda t=t: t.to(dtype)))
            continue
        prefix, i = m.group(1), int(m.group(2))
        W_O = hf.model.layers[i].self_attn.o_proj.weight

        def o_fused(i=i, W_O=W_O):
            return fuse(factors(i).B.to(device), W_O.to(device).T.double(), H).T.to("cpu", dtype)

        entries += [
            write.Entry(prefix + U_V, G * d * R * size, lambda i=i: factors(i).A.to(dtype)),
            write.Entry(prefix + V_V, G * R * R * size, lambda i=i: factors(i).B.to(dtype)),
            write.Entry(prefix + O_FUSED, d * H * R * size, o_fused),
        ]
    return entries


def _dtype(name: str, config) -> torch.dtype:
    if name == "auto":  # the checkpoint's own dtype
        name = str(getattr(config, "dtype", None) or "float32").removeprefix("torch.")
    if name not in DTYPES:
        raise ConvertError(f"unknown --dtype {name!r}: use bf16, fp16, fp32 or auto")
    return DTYPES[name]


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConvertError(f"unknown --device {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConvertError(f"--device {name}: CUDA is not available")
    return device
