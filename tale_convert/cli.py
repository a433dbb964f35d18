"""`tale-convert`: the command line around tale_convert.convert. It parses its options into Options, checks them
(before the converter's imports, which take seconds) and makes that one call, printing through display.Display."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from tale_runtime import console

from . import ConvertError
from .bundled import MODELS
from .display import Display
from .options import Options, check_inputs

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


class Opt:
    """tale-convert's argument and options, declared once: run() takes them as its parameters."""

    model: str = typer.Argument(
        "smollm2",
        help="a bundled model (`smollm2`, the default; `gemma3-270m`), a checkpoint dir, or a Hub id owner/name",
    )
    out: str = typer.Option(..., "--out", "-o", help="artifact directory to write")
    group: Optional[int] = typer.Option(
        None,
        help=f"KV heads per latent group g (must divide the KV heads; default {D.group}, for a bundled model its own: "
        + ", ".join(f"{m.alias} {m.group}" for m in MODELS.values())
        + ")",
    )
    calib: Optional[list[Path]] = typer.Option(
        None, help="calibration .txt/.json/.jsonl/.parquet file (repeatable); default: the bundled CC0 corpus"
    )
    samples: int = typer.Option(D.samples, help="calibration sequences")
    seq_len: int = typer.Option(D.seq_len, help="tokens per calibration sequence")
    seed: int = typer.Option(D.seed, min=0, max=2**64 - 1, help="seed for sampling the calibration sequences")
    shrink: float = typer.Option(
        D.shrink, help="shrink the calibration covariance toward a scaled identity before whitening (0..1; 0: as is)"
    )
    rotate_latents: Optional[bool] = typer.Option(
        None,
        "--rotate-latents/--no-rotate-latents",
        help="rotate the latents by a Hadamard matrix in blocks of --value-group channels (same values, less "
        "quantization error; default: the preset's)",
    )
    device: str = typer.Option(D.device, help="where layers run: auto, cpu, cuda, cuda:1, ...")
    dtype: str = typer.Option(D.dtype, help="stored tensor dtype: bf16, fp16, fp32 or auto (the checkpoint's)")
    sinks: int = typer.Option(D.sinks, help="sink tokens kept at 16 bits (alpha)")
    preset: str = typer.Option(
        D.preset,
        help="schedule preset: lowrank (default; the most accurate per byte: middle keys before RoPE as 4-bit coefficients on a calibrated key basis per latent group, 3-bit full-rank latents), paper (the paper's: KIVI layout, 16-bit scales; the fastest GPU decode at long contexts) or tale (2-bit middle keys with the most important half of each head's channels at 3 bits, fp8 scales)",
    )
    target_ratio: Optional[float] = typer.Option(
        None,
        help="choose level-0 ranks per layer to meet this measured "
        "compression ratio at 1K tokens (least whitened energy lost)",
    )
    key_bands: Optional[str] = typer.Option(
        None,
        help="BITS:CHANNELS: the middle level's keys in two bands, the CHANNELS most important key channels of each "
        "KV head (calibration statistic) at BITS, e.g. 3:16",
    )
    key_basis: bool = typer.Option(
        False,
        "--key-basis",
        help="also fit the key basis that low-rank keys read (key_rank levels, with key_rope pre; "
        "key_basis.safetensors from the calibration keys)",
    )
    key_basis_blocks: Optional[str] = typer.Option(
        None,
        help="the key basis in blocks: joint (one over each layer's KV heads), group (one per latent group of --group "
        "KV heads: K/g times fewer multiply-adds to rebuild keys than joint, and tensor-parallel ranks need no "
        "exchange) or head (one per KV head); key ranks count coefficients per block (default: the preset's)",
    )
    recent: Optional[str] = typer.Option(
        None, help="share p of non-sink tokens at full rank (one per level above 0; default: the preset's)"
    )
    r0: Optional[float] = typer.Option(
        None, help="level-0 rank as a fraction of the latent rank R (default: the preset's)"
    )
    bits: Optional[str] = typer.Option(
        None, help="value bits per level, oldest first, e.g. 2,4 (default: the preset's)"
    )
    key_bits: Optional[str] = typer.Option(None, help="key bits per level (default: the preset's, or --bits)")
    key_group: int = typer.Option(D.key_group, help="tokens per key quantization group")
    value_group: Optional[int] = typer.Option(
        None, help="channels per latent quantization group (default: the preset's: 32, lowrank 64)"
    )
    residual: Optional[int] = typer.Option(None, help="16-bit residual tokens (default: the preset's)")
    policy: str = typer.Option(D.policy, help="level-0 rank per layer: uniform, energy, fisher or progressive")
    energy: float = typer.Option(D.energy, help="--policy energy: whitened spectral energy kept per layer at level 0")
    key_rank_policy: str = typer.Option(
        D.key_rank_policy,
        help="low-rank keys' coefficients per layer: uniform (the preset's everywhere) or energy (the same total, "
        "by the layers' calibration key energy)",
    )
    overwrite: bool = typer.Option(False, help="replace an existing artifact at --out")
    resume: bool = typer.Option(False, help="reuse the finished layers of an interrupted run with the same settings")
    shard_size: str = typer.Option(str(D.shard_size), help="max safetensors shard size, e.g. 2GB")
    as_json: bool = typer.Option(
        False, "--json", help="print one JSON object (the report) on stdout and nothing else; progress on stderr"
    )
    quiet: bool = typer.Option(False, "--quiet", "-q", help="print nothing but errors (and --json's object)")
    verbose: bool = typer.Option(False, "--verbose", "-v", help="the per-layer table in the report")


@app.command()
@console.options_from(Opt)
def run(context: typer.Context, **params) -> None:
    opts = _options(context.params)
    check_inputs(params["out"], opts)
    from .convert import convert  # torch and transformers: after the options are checked

    with Display(as_json=params["as_json"], quiet=params["quiet"], verbose=params["verbose"]) as show:
        report = convert(
            params["model"], Path(params["out"]), opts, on_layer=show.on_layer, log=show.log, warn=show.warn
        )
    show.report(report)


def _options(p: dict) -> Options:
    """The parsed command line as Options; --group defaults to a bundled model's own."""
    group = p["group"] if p["group"] is not None else MODELS[p["model"]].group if p["model"] in MODELS else D.group
    same = ("samples", "seq_len", "seed", "shrink", "rotate_latents", "device", "dtype", "sinks", "r0", "preset")
    same += ("target_ratio", "key_basis", "key_basis_blocks", "key_group", "value_group", "residual", "shard_size")
    same += ("overwrite", "resume", "policy", "energy", "key_rank_policy")
    recent = p["recent"]
    return Options(
        group=group,
        calib=p["calib"] or None,
        recent=None
        if recent is None
        else _numbers(recent, float, "--recent")
        if recent.strip()
        else (),  # "": one level
        bits=None if p["bits"] is None else _numbers(p["bits"], int, "--bits"),
        key_bits=None if p["key_bits"] is None else _numbers(p["key_bits"], int, "--key-bits"),
        key_bands=_bands(p["key_bands"]) if p["key_bands"] else None,
        **{k: p[k] for k in same},
    )


def main(argv: list[str] | None = None) -> None:
    """Console script entry: one-line errors, usage errors included."""
    console.run_app(app, argv, user_errors=(ConvertError,))
