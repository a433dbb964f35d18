"""The conversion pipeline end to end: source -> calibrate -> whiten -> fuse -> write."""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from tale_runtime import console, families
from tale_runtime.artifact import (
    FORMAT,
    MANIFEST,
    O_FUSED,
    TOOL_NAME,
    U_V,
    V_V,
    Schedule,
    hash_files,
    nominal_ratio,
    version_for,
    with_key_ranks,
    write_json,
)

from . import ConvertError, __version__, calibrate, rank_policy, resume, source, stats, write
from .card import render_card
from .fuse import fuse
from .options import BASIS_BLOCKS, Options, check_inputs  # noqa: F401  (tale_convert.convert.Options: the API name)
from .whiten import energy_kept, rotate_latents, whiten

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


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
    # per layer, per level: the low-rank keys' coefficients (Schedule.key_ranks) where they differ by layer, else None
    key_ranks: list[list[int]] | None = None


def convert(
    model: str | None,
    out: str | Path,
    opts: Options,
    on_layer: Callable[[LayerReport, int], None] | None = None,
    log: Callable[[str], None] = lambda s: None,
    warn: Callable[[str], None] | None = None,
) -> Report:
    """Convert MODEL into a TALE artifact at `out`. Raises ConvertError on bad input.

    Streams: each decoder layer's weights are read from the source shards, run on the device and
    written to the artifact's shards before the next layer is read, so host memory holds about one
    layer (plus the tokens), whatever the depth."""
    t0 = time.perf_counter()
    check_inputs(out, opts)
    _fixed_mmap_threshold()
    out = Path(out).expanduser().absolute()
    write.check_out(out, opts.overwrite)
    made = _make_parents(out.parent)  # the lock lives beside --out
    lock = write.OutLock(out)
    try:
        lock.acquire()
        write.check_out(out, opts.overwrite)  # again, now that no other tale-convert can write it
        return _convert_locked(model, out, opts, on_layer, log, warn or (lambda s: log(f"warning: {s}")), t0)
    finally:
        lock.release()
        for d in reversed(made):  # parents this run created and left empty (a refusal, an error)
            try:
                d.rmdir()
            except OSError:
                break


def _make_parents(d: Path) -> list[Path]:
    """mkdir -p, returning the directories it created, outermost first."""
    made = []
    while not d.exists() and d != d.parent:
        made.append(d)
        d = d.parent
    made.reverse()
    for x in made:
        try:
            x.mkdir()
        except FileExistsError:
            pass
        except OSError as e:
            raise ConvertError(console.environment_error(e) or f"cannot create {x}: {e.strerror}") from None
    return made


def _convert_locked(model, out: Path, opts: Options, on_layer, log, warn, t0) -> Report:
    shard_size = write.parse_size(opts.shard_size)
    if opts.samples < 1 or opts.seq_len < 2:
        raise ConvertError("--samples must be >= 1 and --seq-len >= 2")
    if not 0 <= opts.shrink <= 1:
        raise ConvertError(f"--shrink must be in [0, 1], got {opts.shrink:g}")

    src = source.resolve(model)
    config, arch = source.load_config(src, opts.group)
    schedule = opts.schedule(arch.latent_rank, arch.num_layers, arch.num_kv_heads, arch.head_dim)
    bands = opts.bands(arch.head_dim)
    if bands:
        b, c = bands
        if b not in (2, 3, 4, 8) or c < 8 or c % 8 or c >= arch.head_dim:
            raise ConvertError(
                f"--key-bands {b}:{c}: bits must be 2, 3, 4 or 8 and channels a multiple of 8 below the head dim {arch.head_dim}"
            )
        # a placeholder order until the factors exist (bytes do not depend on it: --target-ratio counts the bands)
        schedule = stats.with_key_bands(
            schedule, [[list(range(arch.head_dim))] * arch.num_kv_heads] * arch.num_layers, {0: bands}
        )
    window = families.config_window(config)
    if window and opts.seq_len > window:
        raise ConvertError(f"--seq-len {opts.seq_len} exceeds the model's sliding window {window}")
    context = getattr(config, "max_position_embeddings", None)
    if context and opts.seq_len > context:
        raise ConvertError(f"--seq-len {opts.seq_len} exceeds the model's context (max_position_embeddings {context})")
    for name, v in (("--sinks", schedule.sinks), ("--residual", schedule.residual)):
        if context and v >= context:  # every token would stay at 16 bits: a measured 1.00x
            raise ConvertError(
                f"{name} {v} is not below the model's context ({context} tokens): nothing would be compressed"
            )
    dtype = _dtype(opts.dtype, config)
    device = _device(opts.device)
    skeleton = source.skeleton(config)
    source.check_layout(skeleton, arch)
    ckpt = source.open_checkpoint(src, config, _source_tensors(skeleton))

    tokenizer = source.load_tokenizer(src)
    docs, calib_info = calibrate.load_documents(opts.calib)
    tokens = calibrate.sample_tokens(tokenizer, docs, opts.samples, opts.seq_len, opts.seed)
    log(f"calibration: {opts.samples} x {opts.seq_len} tokens from {calib_info['source']}")
    hidden = getattr(config, "hidden_size", 0)
    if tokens.numel() < hidden:
        warn(
            f"only {tokens.numel()} calibration tokens for hidden size {hidden}: the covariance of the value "
            "projection's input is rank-deficient, the whitening leans on its regularization and the 'energy kept' "
            f"figures are not meaningful; use at least {hidden} (--samples x --seq-len), better 10x that"
        )
    base_files = src.file_hashes()
    # Everything the factors depend on; a partial run is reused only if this matches exactly.
    settings = {
        "tool": __version__,
        "model": base_files,
        "group": arch.group_size,
        "shrink": opts.shrink,
        "latent_rotation": schedule.latent_rotation,
        "key_basis": schedule.key_blocks if opts.wants_basis() else 0,  # basis blocks fitted with each layer (0: none)
        "tokens": hashlib.sha256(tokens.numpy().tobytes()).hexdigest(),
    }

    tmp = write.tmp_dir(out)
    writer = None
    try:
        found = resume.find(out, settings) if opts.resume else None
        if found != tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        if found and found != tmp:
            os.replace(found, tmp)
        if opts.resume:
            log(f"resuming {found.name}" if found else "nothing to resume for these settings: starting afresh")
        for old in resume.leftovers(out):
            if old != tmp and (n := resume.finished(old)):
                same = resume.same_settings(old, settings)
                log(
                    f"note: {old} holds {n} finished layers of an interrupted conversion"
                    + ("; --resume reuses them" if same and not opts.resume else "")
                    + ("" if same else " with other settings; remove it once it is of no use")
                )
        partial = resume.Partial(tmp / resume.DIR, settings)
        entries = _plan(ckpt, arch, dtype)
        layout = [(e.name, str(e.dtype), e.shape) for e in entries]
        plan = hashlib.sha256(repr((shard_size, layout)).encode()).hexdigest()
        # the writer may lag one layer behind (it writes layer i while layer i+1 runs), not more
        layer_bytes = max(
            sum(e.nbytes for e in entries if e.name.startswith(_layer_prefix(i))) for i in range(arch.num_layers)
        )
        writer = write.ShardWriter(
            tmp,
            entries,
            shard_size,
            partial.shards(plan),
            on_shard=lambda f, h: partial.save_shard(plan, f, h),
            pending_bytes=layer_bytes,
        )
        blocks = schedule.key_blocks if opts.wants_basis() else 0
        layers = _stream(
            ckpt, skeleton, tokens, device, arch, schedule, partial, writer, dtype, on_layer, opts.shrink, blocks
        )
        if opts.policy != "uniform":
            schedule, layers = _rank_policy(opts, schedule, layers, src, tokens, arch, partial, log)
        if opts.key_rank_policy == "energy":
            schedule = _key_rank_policy(schedule, arch, partial, families.sliding_windows(skeleton), log)
        if opts.target_ratio:
            schedule, layers = _target_ratio(opts, schedule, layers, arch, partial, log)
        files = writer.close()
        write.copy_model_files(tmp, config, tokenizer, source.generation_config(src, config), dtype)
        if blocks:
            _write_key_basis(tmp, partial, arch.num_layers)
            log(f"key basis: {arch.num_layers} layers, {blocks} block{'s' if blocks > 1 else ''} each")
        manifest = _manifest(src, base_files, arch, schedule, layers, calib_info, opts, dtype, files)
        base_card = src.path / "README.md"
        (tmp / "README.md").write_text(render_card(manifest, base_card.read_text() if base_card.is_file() else None))
        manifest["files"] = hash_files(tmp)  # every file of the artifact, written last (artifact.verify_files)
        write_json(tmp / MANIFEST, manifest)
        shutil.rmtree(tmp / resume.DIR)
        if bands:
            _calibrated(tmp, manifest, bands, tokens, device, base_card, log)
        console.check_interrupted()  # never publish after a signal, wherever its KeyboardInterrupt went
        write.publish(tmp, out, opts.overwrite)
        for old in resume.leftovers(out):  # partial runs of these settings: superseded by the artifact
            if resume.same_settings(old, settings):
                shutil.rmtree(old, ignore_errors=True)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM turned into one by the console layer
        if writer:
            writer.abort()
        if tmp.is_dir() and (n := resume.finished(tmp)):
            log(f"interrupted: {n} finished layers kept in {tmp}; rerun with --resume to reuse them")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    except BaseException:
        if writer:
            writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Report(
        out,
        layers,
        manifest["nominal_ratio"],
        time.perf_counter() - t0,
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        schedule.key_ranks,
    )


def _calibrated(tmp: Path, manifest: dict, bands, tokens, device, base_card: Path, log) -> None:
    """The key bands' channel order, from the finished artifact run on calibration samples (float32, keys as the
    cache holds them), written into the schedule (then the card). The hashes follow."""
    from tale_runtime import load

    t = time.perf_counter()
    schedule = Schedule.from_dict(manifest["schedule"])
    # the basis is not read
    plain = replace(schedule, levels=[replace(lv, key_rank=0) for lv in schedule.levels], key_ranks=None)
    model, _ = load(tmp, device=str(device), dtype=torch.float32, schedule=plain)
    batches = [b.to(device) for b in tokens[:8].split(2)]
    order = stats.key_order(stats.key_importance(model, batches, schedule.key_group))
    del model
    schedule = stats.with_key_bands(schedule, order, {0: bands})
    schedule.validate(int(manifest["architecture"]["latent_rank"]), len(schedule.ranks))
    manifest["schedule"] = schedule.to_dict()
    card = base_card.read_text() if base_card.is_file() else None
    (tmp / "README.md").write_text(render_card(manifest, card))
    manifest["files"] = hash_files(tmp)
    write_json(tmp / MANIFEST, manifest)
    log(
        f"key bands ({bands[1]} channels per KV head at {bands[0]} bits in the middle): {time.perf_counter() - t:.0f} s"
    )


BASIS_SAMPLES = 16  # calibration sequences the key basis is fitted on (the first ones)


def _fit_key_basis(moments: stats.KeyMoments, blocks: int) -> dict[str, torch.Tensor]:
    """A layer's key basis from its streamed statistics, under resume.BASIS names: one joint block is written 2-D (as
    every reader since format 2.2 reads it), per-head blocks 3-D [K, n, n] (format 2.4)."""
    from tale_runtime import key_basis

    m2, mean, q2 = (t.cpu() for t in moments.result())
    w = key_basis.pair_mean(q2, moments.K, moments.n)
    enc, dec = key_basis.fit(m2, mean, w, blocks)
    if blocks == 1:
        enc, dec = enc[0], dec[0]
    # the energy rides along in the partial layer file only (resume.KEY_ENERGY): the artifact's basis file is unchanged
    out = dict(zip(resume.BASIS, (enc, dec, mean.float().contiguous())))
    return out | {resume.KEY_ENERGY: key_basis.energy(m2, mean, w, blocks).contiguous()}


def _write_key_basis(tmp: Path, partial, L: int) -> None:
    """key_basis.safetensors from the bases saved with each layer's factors, streamed one layer at a time (268 MB in
    all at Llama-3.1-8B shapes: never held whole)."""
    from tale_runtime import key_basis

    first = partial.load_basis(0)
    if set(first) != set(resume.BASIS):
        raise ConvertError("the partial conversion holds no key basis: rerun without --resume")
    entries = [
        write.Entry(name, first[k].dtype, tuple(first[k].shape))
        for i in range(L)
        for name, k in zip(key_basis.names(i), resume.BASIS)
    ]

    def tensors():
        for i in range(L):
            saved = partial.load_basis(i)
            yield from (saved[k] for k in resume.BASIS)

    write.stream_file(tmp / key_basis.FILE, entries, tensors())


def _manifest(src, base_files, arch, schedule, layers, calib_info, opts, dtype, files) -> dict:
    return {
        "format": FORMAT,
        "format_version": version_for(schedule),
        "tool": {"name": TOOL_NAME, "version": __version__},
        "base": {
            "id": src.id,
            "revision": src.revision,
            "license": src.license,
            "origin": src.origin,
            "instruct": src.instruct,
            "files": base_files,
        },
        "dtype": str(dtype).removeprefix("torch."),
        "architecture": arch.to_manifest(),
        "schedule": schedule.to_dict(),
        "svd": {
            "method": "svd-llm-whitened",
            "compute_dtype": "float64",
            "shrink": opts.shrink,
            "whitening_eps": [lr.eps for lr in layers],
        },
        "calibration": {
            **calib_info,
            "samples": opts.samples,
            "seq_len": opts.seq_len,
            "seed": opts.seed,
            "tokens": opts.samples * opts.seq_len,
        },
        "energy_kept": [lr.energy for lr in layers],
        "nominal_ratio": round(nominal_ratio(schedule, arch.head_dim, arch.group_size, arch.num_kv_heads), 4),
        "files": files,
    }


def _source_tensors(skeleton) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor the checkpoint must hold, in state_dict order; a tied head is
    the embedding (stored once, as transformers does)."""
    unique = {n for n, _ in skeleton.named_parameters()}  # drops tied duplicates
    every = {n for n, _ in skeleton.named_parameters(remove_duplicate=False)}
    return {n: tuple(t.shape) for n, t in skeleton.state_dict().items() if n in unique or n not in every}


def _layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def _split(names, L: int) -> tuple[list[str], list[list[str]], list[str]]:
    """Source tensor names: those before the layers (embeddings), per layer, after (norm, head)."""
    per = [[n for n in names if n.startswith(_layer_prefix(i))] for i in range(L)]
    inside = {n for p in per for n in p}
    first = min(list(names).index(p[0]) for p in per if p) if any(per) else len(names)
    head = [n for k, n in enumerate(names) if n not in inside and k < first]
    tail = [n for k, n in enumerate(names) if n not in inside and k >= first]
    return head, per, tail


VALUE_WEIGHTS = (".self_attn.v_proj.weight", ".self_attn.qkv_proj.weight")  # where W_V is (qkv_proj: its last rows)


def _plan(ckpt, arch, dtype) -> list[write.Entry]:
    """Every artifact tensor in order: the source's, each layer's TALE tensors right after its
    v_proj.weight (Phi-3: qkv_proj.weight), which is kept: the exact prefill uses it, DESIGN.md 4."""
    d, G, R, H = arch.hidden_size, arch.num_groups, arch.latent_rank, arch.num_heads
    entries = []
    for name, shape in ckpt.shapes.items():
        entries.append(write.Entry(name, dtype, shape))
        if name.endswith(VALUE_WEIGHTS):
            prefix = name[: name.rindex(".self_attn.") + len(".self_attn.")]
            entries += [
                write.Entry(prefix + U_V, dtype, (G, d, R)),
                write.Entry(prefix + V_V, dtype, (G, R, R)),
                write.Entry(prefix + O_FUSED, dtype, (d, H * R)),
            ]
    return entries


def _stream(
    ckpt, skeleton, tokens, device, arch, schedule, partial, writer, dtype, on_layer, shrink: float, blocks: int = 0
) -> list[LayerReport]:
    """One pass over the layers: read a layer's weights, run the calibration set through it on the
    device (accumulating the covariance of its v_proj input, and with `blocks` the key statistics of the key basis
    in that many blocks, fitted and saved with the layer's factors), whiten + factor its v_proj, write
    its artifact tensors, drop it.

    Resume: finished layers (factors in `partial`) are only replayed forward, and not even that
    once no later layer is missing; their tensors are rewritten only where their shard is not
    complete yet."""
    head, per_layer, tail = _split(list(ckpt.shapes), arch.num_layers)
    done = partial.done()
    missing = [i for i in range(arch.num_layers) if i not in done]
    stop = max(missing) + 1 if missing else 0
    ckpt_h = partial.load_hidden() if done and missing else None
    start = ckpt_h[0] if ckpt_h else 0
    hidden = rope = None
    if start < stop:
        rope = calibrate.rotary(skeleton, tokens.shape[1], device)
        if ckpt_h:
            hidden = ckpt_h[1].to(device)
        else:
            emb = next(n for n in head if n.endswith("embed_tokens.weight"))
            weight = torch.cat([c.to(device) for c in ckpt.chunks(emb, ckpt.dtype)])
            hidden = calibrate.embed(weight, tokens, families.embed_scale(skeleton))
    for name in head:
        _copy(ckpt, writer, name, dtype)

    def wanted(i: int) -> bool:
        return start <= i < stop or any(writer.needed(n) for n in per_layer[i])

    todo = [i for i in range(arch.num_layers) if wanted(i)]
    reports: list[LayerReport] = []
    saved = time.perf_counter()
    with ThreadPoolExecutor(1, thread_name_prefix="tale-read") as pool:  # reads layer i+1 while i runs
        reads = {todo[0]: pool.submit(ckpt.read, per_layer[todo[0]])} if todo else {}
        for i in range(arch.num_layers):
            console.check_interrupted()
            t = time.perf_counter()
            if i not in reads:
                f, seconds = partial.load_layer(i)
                reports.append(LayerReport(i, f.eps, [energy_kept(f.S, r) for r in schedule.ranks[i]], seconds, True))
                if on_layer:
                    on_layer(reports[-1], arch.num_layers)
                continue
            weights = reads.pop(i).result()
            if (nxt := next((j for j in todo if j > i), None)) is not None:
                reads[nxt] = pool.submit(ckpt.read, per_layer[nxt])
            f = None
            if start <= i < stop:
                layer = _materialize(skeleton.model.layers[i], weights, _layer_prefix(i), device)
                moments = (
                    stats.KeyMoments(arch.num_kv_heads, arch.head_dim, schedule.sinks, BASIS_SAMPLES)
                    if blocks
                    else None
                )
                hooks = moments.hook(layer.self_attn) if moments and i not in done else []
                try:
                    C = calibrate.run_layer(layer, hidden, rope[i], i, covariance=i not in done)
                    if C is not None:
                        W_V = families.value_weight(layer.self_attn, skeleton.config)  # [K n, d]
                        f = whiten(C, W_V.T, arch.group_size, arch.head_dim, shrink)
                        del C
                        if schedule.latent_rotation:
                            f = rotate_latents(f, schedule.latent_rotation)
                        basis = _fit_key_basis(moments, blocks) if moments else None
                        partial.save_layer(i, f, time.perf_counter() - t, basis)
                finally:
                    for h in hooks:
                        h.remove()
                    layer.to_empty(device="meta")  # frees the device copy; the skeleton stays
                if i + 1 < stop and time.perf_counter() - saved > resume.HIDDEN_EVERY_S:
                    partial.save_hidden(i + 1, hidden)
                    saved = time.perf_counter()
            reused = f is None
            if reused:
                f, seconds = partial.load_layer(i)
            if any(writer.needed(n) for n in per_layer[i]):
                _write_layer(writer, weights, per_layer[i], f, arch, dtype, device)
            del weights
            seconds = seconds if reused else time.perf_counter() - t
            reports.append(LayerReport(i, f.eps, [energy_kept(f.S, r) for r in schedule.ranks[i]], seconds, reused))
            if on_layer:
                on_layer(reports[-1], arch.num_layers)
    del hidden
    for name in tail:
        _copy(ckpt, writer, name, dtype)
    return reports


def _materialize(layer, weights: dict[str, torch.Tensor], prefix: str, device) -> torch.nn.Module:
    """The skeleton's layer with real float32 weights on the device (the math runs in float32
    whatever the checkpoint's dtype; the upcast is exact)."""
    layer.to_empty(device=device)
    layer.load_state_dict({n.removeprefix(prefix): w for n, w in weights.items()})
    return layer


def _write_layer(writer, weights, names, f, arch, dtype, device) -> None:
    """The layer's tensors in plan order. O^r is fused on the device: in float64 it is the one
    large product of the conversion (g times the size of W_O)."""
    for name in names:
        writer.write_tensor(name, weights[name].to(dtype))
        if name.endswith(VALUE_WEIGHTS):
            prefix = name[: name.rindex(".self_attn.") + len(".self_attn.")]
            W_O = weights[prefix + "o_proj.weight"]
            B = f.B.to(device)
            writer.write_tensor(prefix + U_V, f.A.to(dtype))
            writer.write_tensor(prefix + V_V, f.B.to(dtype))
            # transposed and cast on the device (same values as on the host; the host would copy twice)
            writer.write_tensor(
                prefix + O_FUSED, fuse(B, W_O.to(device).T.double(), arch.num_heads).T.to(dtype).contiguous()
            )


def _copy(ckpt, writer, name: str, dtype) -> None:
    """A tensor the artifact takes unchanged (cast to dtype), in row chunks: embeddings and head
    are the largest tensors of a model and never need to be whole in memory."""
    if writer.needed(name):
        for chunk in ckpt.chunks(name, dtype):
            writer.write_tensor(name, chunk)


def _rank_policy(opts, schedule, layers, src, tokens, arch, partial, log) -> tuple[Schedule, list[LayerReport]]:
    """Level-0 ranks from --policy, under the uniform schedule's budget (energy: a threshold instead);
    the layers' reported energy follows the new ranks."""
    spectra = [partial.load_layer(i)[0].S for i in range(arch.num_layers)]
    fisher = None
    if opts.policy == "fisher":
        log("fisher: gradients of the calibration loss w.r.t. v_proj (8 sequences, on the CPU, the whole model)")
        fisher = rank_policy.fisher_scores(source.load_model(src), list(tokens[:8].split(2)))
    ranks0 = rank_policy.level0_ranks(
        opts.policy,
        arch.latent_rank,
        arch.num_layers,
        schedule.value_group,
        schedule.ranks[0][0],
        spectra=spectra,
        energy=opts.energy,
        fisher=fisher,
    )
    schedule = rank_policy.apply(schedule, opts.policy, ranks0)
    layers = [replace(lr, energy=[energy_kept(S, r) for r in rs]) for lr, S, rs in zip(layers, spectra, schedule.ranks)]
    return schedule, layers


def _key_rank_policy(schedule: Schedule, arch, partial, windows, log) -> Schedule:
    """The low-rank keys' coefficients per layer by calibration key energy (--key-rank-policy energy): at each level
    with low-rank keys, its key_rank per layer on average within each kind of layer (global, or sliding through one
    window), multiples of 8 (of key_channel_group at per-token levels) that keep the most energy."""
    energies = [partial.load_key_energy(i) for i in range(arch.num_layers)]
    if any(e is None for e in energies):
        raise ConvertError("the partial conversion holds no key energy: rerun without --resume")
    rows = [list(schedule.layer_key_ranks(i)) for i in range(arch.num_layers)]
    total = sum(e.sum() for e in energies)
    for j, lv in enumerate(schedule.levels):
        if lv.key_rank:
            step = 8 if lv.key_axis == "channel" else schedule.key_channel_group
            try:
                ranks = rank_policy.key_ranks(energies, lv.key_rank, step, windows)
            except ValueError as e:
                raise ConvertError(f"--key-rank-policy energy: {e}") from None
            for row, r in zip(rows, ranks):
                row[j] = r
            kept = sum(e[:, :r].sum() for e, r in zip(energies, ranks)) / total
            flat = sum(e[:, : lv.key_rank].sum() for e in energies) / total
            log(f"key ranks at level {j} by energy: {kept:.4f} of the calibration key energy kept ({flat:.4f} uniform)")
    return with_key_ranks(schedule, rows)


def _target_ratio(opts, schedule, layers, arch, partial, log) -> tuple[Schedule, list[LayerReport]]:
    """Level-0 ranks per layer meeting --target-ratio (measured at 1K tokens) with the least whitened energy lost."""
    spectra = [partial.load_layer(i)[0].S for i in range(arch.num_layers)]
    fitted = rank_policy.fit_ranks(schedule, opts.target_ratio, arch, spectra)
    if fitted is None:
        best = rank_policy.measured_ratio(
            rank_policy.apply(schedule, "budget", [schedule.value_group] * arch.num_layers), arch
        )
        raise ConvertError(
            f"--target-ratio {opts.target_ratio:g} is out of reach of this schedule "
            f"(at most {best:.2f}x at 1K tokens); lower the bits or the recent share"
        )
    r0 = [rs[0] for rs in fitted.ranks]
    log(f"target ratio {opts.target_ratio:g}x: level-0 ranks {min(r0)}..{max(r0)} (mean {sum(r0) / len(r0):.0f})")
    layers = [replace(lr, energy=[energy_kept(S, r) for r in rs]) for lr, S, rs in zip(layers, spectra, fitted.ranks)]
    return fitted, layers


def _fixed_mmap_threshold(threshold: int = 1 << 20) -> None:
    """glibc raises its mmap threshold (up to 32 MB) each time a large block is freed; layer-sized
    tensors then come from the heap, which fragments: peak RSS grew by ~25 MB per layer (measured,
    CPU, 69 MB layers). A fixed threshold makes every tensor above 1 MB its own mapping, returned to
    the system when freed, so the peak stays flat in depth. The price is paid on CPU conversions,
    whose activation tensors then each take fresh page faults (a SmolLM2 conversion on a busy 2-core
    machine: 64 s system time of 225 s CPU); malloc_trim after each layer instead was measured
    cheaper but not flat (+54 MB from 3 to 12 layers of 30 MB). No-op without glibc."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, threshold)  # M_MMAP_THRESHOLD; also stops the dynamic adjustment
    except (OSError, AttributeError):
        pass


def _dtype(name: str, config) -> torch.dtype:
    if name == "auto":  # the checkpoint's own dtype
        name = str(getattr(config, "dtype", None) or "float32").removeprefix("torch.")
    if name not in DTYPES:
        raise ConvertError(f"unknown --dtype {name!r}: use bf16, fp16, fp32 or auto")
    return DTYPES[name]


def _device(name: str) -> torch.device:
    try:
        return console.check_device(name, "--device")  # the CLIs' rules: cpu:0 is the cpu, no CUDA is refused
    except ValueError as e:
        raise ConvertError(str(e)) from None
