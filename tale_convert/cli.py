"""`tale-convert`: the command line around tale_convert.convert."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tale_runtime import console
from tale_runtime.schedule import PRESETS

from . import ConvertError
from .bundled import MODELS
from .options import Options

app = typer.Typer(
    add_completion=False, pretty_exceptions_enable=False, help="Convert a Llama-family checkpoint into a TALE artifact."
)
D = Options()


def _numbers(s: str, kind, flag: str) -> tuple:
    try:
        return tuple(kind(x) for x in s.split(","))
    except ValueError:
        raise ConvertError(f"{flag} {s!r}: expected comma-separated numbers, e.g. 2,4") from None


def _bands(s: str) -> tuple[int, int]:
    b, sep, c = s.partition(":")
    if not sep or not b.strip().isdigit() or not c.strip().isdigit():
        raise ConvertError(f"--key-bands {s!r}: expected BITS:CHANNELS, e.g. 3:16")
    return int(b), int(c)


@app.command()
def run(
    model: str = typer.Argument(
        "smollm2",
        help="a bundled model (`smollm2`, the default; `gemma3-270m`), a checkpoint dir, or a Hub id owner/name",
    ),
    out: str = typer.Option(..., "--out", "-o", help="artifact directory to write"),
    group: Optional[int] = typer.Option(
        None,
        help=f"KV heads per latent group g (must divide the KV heads; default {D.group}, for a bundled model its own: "
        + ", ".join(f"{m.alias} {m.group}" for m in MODELS.values())
        + ")",
    ),
    calib: Optional[list[Path]] = typer.Option(
        None, help="calibration .txt/.json/.jsonl/.parquet file (repeatable); default: the bundled CC0 corpus"
    ),
    samples: int = typer.Option(D.samples, help="calibration sequences"),
    seq_len: int = typer.Option(D.seq_len, help="tokens per calibration sequence"),
    seed: int = typer.Option(D.seed, min=0, max=2**64 - 1, help="seed for sampling the calibration sequences"),
    shrink: float = typer.Option(
        D.shrink, help="shrink the calibration covariance toward a scaled identity before whitening (0..1; 0: as is)"
    ),
    rotate_latents: Optional[bool] = typer.Option(
        None,
        "--rotate-latents/--no-rotate-latents",
        help="rotate the latents by a Hadamard matrix in blocks of --value-group channels (same values, less "
        "quantization error; default: the preset's)",
    ),
    device: str = typer.Option(D.device, help="where layers run: auto, cpu, cuda, cuda:1, ..."),
    dtype: str = typer.Option(D.dtype, help="stored tensor dtype: bf16, fp16, fp32 or auto (the checkpoint's)"),
    sinks: int = typer.Option(D.sinks, help="sink tokens kept at 16 bits (alpha)"),
    preset: str = typer.Option(
        D.preset,
        help="schedule preset: lowrank (default; the most accurate per byte: middle keys before RoPE as 4-bit coefficients on a calibrated key basis per latent group, 3-bit full-rank latents), paper (the paper's: KIVI layout, 16-bit scales; the fastest GPU decode at long contexts) or tale (2-bit middle keys with the most important half of each head's channels at 3 bits, fp8 scales)",
    ),
    target_ratio: Optional[float] = typer.Option(
        None,
        help="choose level-0 ranks per layer to meet this measured "
        "compression ratio at 1K tokens (least whitened energy lost)",
    ),
    key_bands: Optional[str] = typer.Option(
        None,
        help="BITS:CHANNELS: the middle level's keys in two bands, the CHANNELS most important key channels of each "
        "KV head (calibration statistic) at BITS, e.g. 3:16",
    ),
    key_basis: bool = typer.Option(
        False,
        "--key-basis",
        help="also fit the key basis that low-rank keys read (key_rank levels, with key_rope pre; "
        "key_basis.safetensors from the calibration keys)",
    ),
    key_basis_blocks: Optional[str] = typer.Option(
        None,
        help="the key basis in blocks: joint (one over each layer's KV heads), group (one per latent group of --group "
        "KV heads: K/g times fewer multiply-adds to rebuild keys than joint, and tensor-parallel ranks need no "
        "exchange) or head (one per KV head); key ranks count coefficients per block (default: the preset's)",
    ),
    recent: Optional[str] = typer.Option(
        None, help="share p of non-sink tokens at full rank (one per level above 0; default: the preset's)"
    ),
    r0: Optional[float] = typer.Option(
        None, help="level-0 rank as a fraction of the latent rank R (default: the preset's)"
    ),
    bits: Optional[str] = typer.Option(
        None, help="value bits per level, oldest first, e.g. 2,4 (default: the preset's)"
    ),
    key_bits: Optional[str] = typer.Option(None, help="key bits per level (default: the preset's, or --bits)"),
    key_group: int = typer.Option(D.key_group, help="tokens per key quantization group"),
    value_group: Optional[int] = typer.Option(
        None, help="channels per latent quantization group (default: the preset's: 32, lowrank 64)"
    ),
    residual: Optional[int] = typer.Option(None, help="16-bit residual tokens (default: the preset's)"),
    policy: str = typer.Option(D.policy, help="level-0 rank per layer: uniform, energy, fisher or progressive"),
    energy: float = typer.Option(D.energy, help="--policy energy: whitened spectral energy kept per layer at level 0"),
    overwrite: bool = typer.Option(False, help="replace an existing artifact at --out"),
    resume: bool = typer.Option(False, help="reuse the finished layers of an interrupted run with the same settings"),
    shard_size: str = typer.Option(str(D.shard_size), help="max safetensors shard size, e.g. 2GB"),
    as_json: bool = typer.Option(
        False, "--json", help="print one JSON object (the report) on stdout and nothing else; progress on stderr"
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="print nothing but errors (and --json's object)"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="the per-layer table in the report"),
) -> None:
    if group is None:
        group = MODELS[model].group if model in MODELS else D.group
    opts = Options(
        group=group,
        calib=calib or None,
        samples=samples,
        seq_len=seq_len,
        seed=seed,
        shrink=shrink,
        rotate_latents=rotate_latents,
        device=device,
        dtype=dtype,
        sinks=sinks,
        recent=None
        if recent is None
        else _numbers(recent, float, "--recent")
        if recent.strip()
        else (),  # "": one level
        r0=r0,
        bits=None if bits is None else _numbers(bits, int, "--bits"),
        preset=preset,
        target_ratio=target_ratio,
        key_bands=_bands(key_bands) if key_bands else None,
        key_basis=key_basis,
        key_basis_blocks=key_basis_blocks,
        key_bits=None if key_bits is None else _numbers(key_bits, int, "--key-bits"),
        key_group=key_group,
        value_group=value_group,
        residual=residual,
        shard_size=shard_size,
        overwrite=overwrite,
        resume=resume,
        policy=policy,
        energy=energy,
    )
    if not out.strip():  # Path("") would be the current directory
        raise ConvertError("--out is empty: name the artifact directory to write")
    out = Path(out)
    check_inputs(out, opts)
    from .convert import convert  # torch and transformers: after the options are checked

    _quiet_libraries()
    # stdout: progress and report (with --json: the JSON object only, progress on stderr); stderr: warnings, errors
    report_to = console.rich_console(quiet=quiet or as_json)
    progress_to = console.rich_console(stderr=True, quiet=quiet) if as_json else report_to
    err_to = console.rich_console(stderr=True, quiet=quiet)
    warned: list[str] = []

    def warn(msg: str) -> None:
        warned.append(msg)
        err_to.print(f"warning: {msg}", markup=False)

    if progress_to.is_terminal:  # a live bar, rewritten in place
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=progress_to,
            transient=True,
        ) as progress:
            task = progress.add_task("calibrating + factorizing layers", total=None)

            def on_layer(lr, total):
                progress.update(task, total=total, advance=1)

            report = convert(model, out, opts, on_layer=on_layer, log=lambda s: progress.console.print(s), warn=warn)
    else:  # a pipe or a log file: one whole line per event, as it happens

        def on_layer(lr, total):
            reused = " (reused)" if lr.reused else ""
            progress_to.print(
                f"layer {lr.index + 1}/{total}: energy kept at r0 {lr.energy[0]:.4f}, {lr.seconds:.1f} s{reused}",
                markup=False,
            )

        report = convert(
            model, out, opts, on_layer=on_layer, log=lambda s: progress_to.print(s, markup=False), warn=warn
        )
    few = any("calibration tokens" in w for w in warned)
    _summary(report_to, report, few_tokens=few, verbose=verbose)
    if as_json:
        console.print_json(_report_dict(report, warned))


def _report_dict(report, warnings: list[str]) -> dict:
    return {
        "out": str(report.out),
        "nominal_ratio": report.nominal_ratio,
        "seconds": round(report.seconds, 3),
        "peak_rss_bytes": report.peak_rss,
        "peak_device_bytes": report.peak_device,
        "layers": [
            {
                "index": lr.index,
                "energy_kept": lr.energy,
                "eps": lr.eps,
                "seconds": round(lr.seconds, 3),
                "reused": lr.reused,
            }
            for lr in report.layers
        ],
        "warnings": warnings,
    }


def check_inputs(out: Path, opts: Options) -> None:
    """What can be checked before minutes of work: the place to write, the device, the calibration files."""
    console.writable_dir(out, "--out")
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
        if f.is_dir():
            raise ConvertError(f"--calib {f}: is a directory; give the files (e.g. --calib {f}/a.txt, repeatable)")
        if f.is_file() and f.suffix.lower() != ".parquet":
            console.read_text(f, "--calib")  # empty, binary, not UTF-8: one line naming the file
    if opts.calib:
        from .calibrate import load_documents

        load_documents(opts.calib)  # parsed now (one-line errors), not after the model is loaded


def _quiet_libraries() -> None:
    """Their tqdm bars and info logs would interleave with ours on stderr."""
    import transformers

    try:  # optional: only --calib .parquet uses it
        import datasets

        datasets.disable_progress_bars()
        if not console.debug():  # datasets logs a failed read at ERROR level before raising it
            datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    except ImportError:
        pass
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def _summary(to, report, few_tokens: bool = False, verbose: bool = False) -> None:
    """The report: one line on the energy kept (the per-layer table with --verbose), where it went, what it cost."""
    caveat = " (not meaningful: too few calibration tokens)" if few_tokens else ""
    if verbose:
        t = Table(title="per layer")
        for col in ("layer", "energy kept at r0" + caveat, "whitening eps", "time (s)"):
            t.add_column(col, justify="right")
        for lr in report.layers:
            seconds = f"{lr.seconds:.1f}" + (" (reused)" if lr.reused else "")
            t.add_row(str(lr.index), f"{lr.energy[0]:.4f}", f"{lr.eps:g}", seconds)
        to.print(t)
    elif report.layers:
        e = [lr.energy[0] for lr in report.layers]
        low = min(range(len(e)), key=e.__getitem__)
        to.print(
            f"energy kept at r0{caveat}: mean {sum(e) / len(e):.4f}, lowest {e[low]:.4f} (layer "
            f"{report.layers[low].index}) over {len(e)} layers; --verbose shows each layer",
            markup=False,
        )
    dev = f", device peak {report.peak_device / 2**30:.2f} GiB" if report.peak_device is not None else ""
    to.print(
        f"wrote {report.out}\nnominal ratio {report.nominal_ratio:.2f}x, total {report.seconds:.1f} s, "
        f"peak RSS {report.peak_rss / 2**30:.2f} GiB{dev}",
        markup=False,
    )


def main(argv: list[str] | None = None) -> None:
    """Console script entry: one-line errors, usage errors included."""
    console.run_app(app, argv, user_errors=(ConvertError,))
