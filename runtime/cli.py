"""tale-run: generate from a TALE artifact with the compressed cache and report what it saved."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from . import console

DTYPES = console.DTYPES
SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, help=__doc__)
err = Console(stderr=True, soft_wrap=True, highlight=False)


CliError = console.UserError  # one `error: ...` line, exit code 2 (tale_runtime.console.run_app)


def _numbers(name: str, text: str | None, kind: type) -> list | None:
    """'2,4' -> [2, 4]. For ranks, '0.5' is a fraction of R and '96' a rank."""
    if text is None:
        return None
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            out.append(float(part) if kind is float or (kind is None and "." in part) else int(part))
        except ValueError:
            raise CliError(f"--{name}: {part!r} is not a {'number' if kind is not int else 'whole number'}") from None
    return out


def schedule_overrides(sinks, recent, ranks, bits, key_bits, key_group, value_group, residual, r0=None) -> dict:
    """CLI strings -> keyword overrides for tale_runtime.load (validated there)."""
    ov = {
        "sinks": _numbers("sinks", sinks, int),
        "recent": _numbers("recent", recent, float),
        "ranks": _numbers("ranks", ranks, None),
        "r0": _numbers("r0", r0, None),
        "bits": _numbers("bits", bits, int),
        "key_bits": _numbers("key-bits", key_bits, int),
        "key_group": _numbers("key-group", key_group, int),
        "value_group": _numbers("value-group", value_group, int),
        "residual": _numbers("residual", residual, int),
    }
    for name in ("sinks", "key_group", "value_group", "residual", "r0"):
        if ov[name] is not None:
            if len(ov[name]) != 1:
                raise CliError(f"--{name.replace('_', '-')} takes one value")
            ov[name] = ov[name][0]
            least = 0 if name == "sinks" else 1
            if name == "r0" and isinstance(ov[name], float):
                least = 0.0
            if ov[name] < least:
                raise CliError(f"--{name.replace('_', '-')} must be >= {least}, got {ov[name]}")
    return {k: v for k, v in ov.items() if v is not None}


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    if (prompt is None) == (prompt_file is None):
        raise CliError("give exactly one of --prompt and --prompt-file")
    if prompt_file is not None:
        return console.read_text(prompt_file, "--prompt-file")  # refuses empty and binary files, drops a BOM
    console.check_text(prompt, "--prompt")
    if not prompt.strip():
        raise CliError("--prompt is empty")
    return prompt


def encode(tok, prompt: str, raw: bool) -> list[int]:
    if not raw and tok.chat_template:
        try:
            text = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # jinja2's TemplateError (raise_exception, an unknown filter), ValueError, ...
            raise CliError(
                f"the artifact's chat template failed ({type(e).__name__}: {console.one_line(e)}); "
                "pass --raw to feed the prompt without it"
            ) from None
        return tok(text, add_special_tokens=False)["input_ids"]
    return tok(prompt)["input_ids"]


@app.command()
def run(
    model: str = typer.Argument(..., metavar="DIR_OR_REPO", help="TALE artifact directory or Hub repo id"),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="the prompt text"),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", help="read the prompt from a file"),
    raw: bool = typer.Option(False, "--raw", help="no chat template: feed the prompt as it is"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", min=1),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0, help="nucleus sampling (temperature > 0)"),
    seed: int = typer.Option(0, "--seed", min=0, max=SEED_MAX, help="sampling seed (0 to 2**64-1)"),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:1, ..."),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16, fp16 or fp32"),
    output_path: str = typer.Option("fused", "--output-path", help="fused (O^r) or factored (B then W_O)"),
    backend: str = typer.Option(
        "auto", "--backend", help="decode attention: auto (the fastest that serves the cache), torch, triton, cuda"
    ),
    dynamic: bool = typer.Option(
        False, "--dynamic", help="growing cache, eager steps (default on CUDA: static cache, CUDA-graph decode)"
    ),
    no_compile: bool = typer.Option(
        False, "--no-compile", help="CUDA-graph decode of the model's own forward, without torch.compile of the step"
    ),
    sinks: Optional[str] = typer.Option(None, "--sinks", metavar="N", help="exact sink tokens (alpha)"),
    recent: Optional[str] = typer.Option(
        None, "--recent", metavar="P[,P..]", help="share p of each level above the middle, oldest first"
    ),
    r0: Optional[str] = typer.Option(
        None, "--r0", metavar="R", help="the middle level's rank: a fraction of full rank (0.5) or a rank (96)"
    ),
    ranks: Optional[str] = typer.Option(
        None, "--ranks", metavar="R,R..", help="rank per level: fraction of full rank (0.5) or absolute (96)"
    ),
    bits: Optional[str] = typer.Option(None, "--bits", metavar="B,B..", help="bits per level (latents and keys)"),
    key_bits: Optional[str] = typer.Option(None, "--key-bits", metavar="B,B..", help="key bits per level"),
    key_group: Optional[str] = typer.Option(None, "--key-group", metavar="N", help="tokens per key quantization group"),
    value_group: Optional[str] = typer.Option(
        None, "--value-group", metavar="N", help="channels per latent quantization group"
    ),
    residual: Optional[str] = typer.Option(None, "--residual", metavar="N", help="16-bit recent tail length"),
) -> None:
    """Generate from a TALE artifact, streaming the text; a stats line follows on stderr."""
    text = read_prompt(prompt, prompt_file)
    for name, v in (("--temperature", temperature), ("--top-p", top_p)):
        if not math.isfinite(v):  # click's range check lets nan (and inf, for --temperature) through
            raise CliError(f"{name} must be a finite number, got {v}")
    overrides = schedule_overrides(sinks, recent, ranks, bits, key_bits, key_group, value_group, residual, r0)
    if dtype not in ("bf16", "fp16", "fp32", "bfloat16", "float16", "float32"):
        raise CliError(f"--dtype must be one of bf16, fp16, fp32; got {dtype!r}")
    if output_path not in ("fused", "factored"):
        raise CliError(f"--output-path must be fused or factored; got {output_path!r}")
    dev = console.device(device)
    if dev.type != "cuda":
        used = [f for f, on in (("--dynamic", dynamic), ("--no-compile", no_compile)) if on]
        if used:
            err.print(
                f"note: {' and '.join(used)} only change(s) decoding on CUDA (static cache, CUDA graphs); "
                f"on {dev.type} decoding is dynamic and eager anyway",
                style="dim",
            )

    import torch

    from .artifact import ArtifactError
    from .generate import NonFiniteLogits, generate
    from .load import load, set_output_path

    try:
        m, tok = load(model, device=dev, dtype=getattr(torch, DTYPES[dtype]), backend=backend, **overrides)
    except (ArtifactError, ValueError) as e:
        raise CliError(str(e)) from None
    if tok is None:
        raise CliError(f"{model}: the artifact has no tokenizer")
    ids = encode(tok, text, raw)
    if not ids:
        raise CliError("the prompt encodes to no tokens")
    ctx = m.config.max_position_embeddings
    if len(ids) >= ctx:
        raise CliError(f"prompt is {len(ids)} tokens; the model's context is {ctx}")
    if len(ids) + max_new_tokens > ctx:
        max_new_tokens = ctx - len(ids)
        err.print(f"note: --max-new-tokens capped to {max_new_tokens} by the model's context ({ctx})", style="dim")
    sched = m.tale_spec.schedule
    for name, v in (("--sinks", overrides.get("sinks")), ("--residual", overrides.get("residual"))):
        if v is not None and v >= ctx:
            raise CliError(f"{name} {v} is not below the model's context ({ctx} tokens): nothing would be compressed")
    if sched.sinks + sched.residual >= len(ids) + max_new_tokens:
        err.print(
            f"note: the {sched.sinks} sink and {sched.residual} residual tokens kept at 16 bits cover all "
            f"{len(ids) + max_new_tokens} tokens of this run: nothing is compressed, so the measured ratio is 1.00x",
            style="dim",
        )
    set_output_path(m, output_path)
    if dev.type == "cuda" and not m.tale_spec.schedule.fast_path():
        err.print(
            "note: the GPU kernels do not read this schedule (keys before RoPE, low-rank keys, "
            "per-token keys or 3-bit latents): decoding through the torch reference on the dynamic cache, far slower "
            "(docs/performance.md)",
            style="dim",
        )

    streamed = []

    def emit(piece: str) -> None:
        streamed.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()

    try:
        _, stats = generate(
            m,
            ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            tokenizer=tok,
            on_text=emit,
            static=False if dynamic else None,
            compile=not no_compile,
        )
    except NonFiniteLogits:  # one line on stderr (a UserError); end the streamed text's line first
        sys.stdout.write("\n")
        raise
    except KeyboardInterrupt as e:  # end the streamed line, then the stats of what was generated, then the message
        if streamed:
            sys.stdout.write("\n")
        sys.stdout.flush()
        stats = getattr(e, "tale_stats", None)
        if stats is not None:
            err.print(stats.line() + " (interrupted)", style="dim", markup=False)
        raise
    sys.stdout.write("\n")
    sys.stdout.flush()
    err.print(stats.line(), style="dim", markup=False)


def main(argv: list[str] | None = None) -> None:
    """Console script entry: one-line errors, usage errors included (tale_runtime.console)."""
    console.run_app(app, argv)


if __name__ == "__main__":
    main()
