"""tale-run: generate from a TALE artifact with the compressed cache and report what it saved."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from . import console, textgen
from .textgen import SEED_MAX, Output, RunOptions

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, help=__doc__)


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


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "0": "\0"}


def unescape(text: str, flag: str) -> str:
    """Backslash escapes in a flag's text: a shell passes "\\n\\n" as backslash-n twice, which no answer ends with.
    \\n, \\t, \\r, \\0, \\\\ and \\uXXXX are read; any other backslash is refused rather than guessed at."""
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        nxt = text[i + 1 : i + 2]
        if nxt in ESCAPES:
            out.append(ESCAPES[nxt])
            i += 2
        elif nxt == "u" and len(h := text[i + 2 : i + 6]) == 4 and all(x in "0123456789abcdefABCDEF" for x in h):
            out.append(chr(int(h, 16)))
            i += 6
        else:
            raise CliError(
                f"{flag}: unknown escape {text[i : i + 2]} (\\n, \\t, \\r, \\0, \\uXXXX; \\\\ for a backslash)"
            )
    return "".join(out)


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    if (prompt is None) == (prompt_file is None):
        raise CliError("give exactly one of --prompt and --prompt-file")
    if prompt_file is not None and str(prompt_file) == "-":
        return read_stdin("--prompt-file -")
    if prompt_file is not None:
        return console.read_text(prompt_file, "--prompt-file")  # refuses empty and binary files, drops a BOM
    console.check_text(prompt, "--prompt")
    if not prompt.strip():
        raise CliError("--prompt is empty")
    return prompt


def read_stdin(flag: str) -> str:
    """All of standard input as UTF-8 text (a pipe, a here-document); empty or binary input is refused."""
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
    if b"\0" in data:
        raise CliError(f"{flag}: standard input is binary, expected UTF-8 text")
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise CliError(f"{flag}: standard input is not UTF-8 text (byte {e.start})") from None
    if not text.strip():
        raise CliError(f"{flag}: standard input is empty")
    return text


class Opt:
    """tale-run's argument and options, declared once: run() reads as the list of its parameters."""

    model = typer.Argument(..., metavar="DIR_OR_REPO", help="TALE artifact directory or Hub repo id")
    prompt = typer.Option(None, "--prompt", "-p", help="the prompt text")
    prompt_file = typer.Option(None, "--prompt-file", help="read the prompt from a file ('-': standard input)")
    system = typer.Option(None, "--system", help="a system message (through the chat template)")
    raw = typer.Option(
        None,
        "--raw/--template",
        help="--raw: no chat template, feed the prompt as it is; --template: through the tokenizer's chat template "
        "(default: the template, but raw text for a pretrained base model, which the artifact's manifest names)",
    )
    chat = typer.Option(
        False, "--chat", help="interactive: one user turn per line of standard input, the cache kept across turns"
    )
    max_new_tokens = typer.Option(256, "--max-new-tokens", min=1)
    temperature = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy")
    top_p = typer.Option(1.0, "--top-p", min=0.0, max=1.0, help="nucleus sampling (temperature > 0)")
    top_k = typer.Option(0, "--top-k", min=0, help="sample among the k most likely tokens (0: all)")
    repetition_penalty = typer.Option(
        1.0, "--repetition-penalty", min=0.0, help="divide the logits of tokens already in the text (1: none)"
    )
    stop = typer.Option(
        None,
        "--stop",
        help="stop once the answer ends with STR (repeatable); backslash escapes are read: --stop '\\n\\n' stops at a "
        "blank line (a literal backslash: \\\\)",
    )
    seed = typer.Option(0, "--seed", min=0, max=SEED_MAX, help="sampling seed (0 to 2**64-1)")
    compare_full = typer.Option(
        False, "--compare-full", help="also answer with the full 16-bit cache; print both and the measured ratio"
    )
    as_json = typer.Option(False, "--json", help="one JSON object on stdout (text and figures), nothing else")
    quiet = typer.Option(False, "--quiet", "-q", help="no notes or stats on stderr; errors only")
    device = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:1, ...")
    dtype = typer.Option(
        "auto", "--dtype", help="auto (bf16; fp32 on a CPU without bf16 instructions), bf16, fp16 or fp32"
    )
    output_path = typer.Option(
        "auto",
        "--output-path",
        help="auto (factored on a CPU in fp32, else fused), fused (O^r) or factored (B then W_O)",
    )
    backend = typer.Option(
        "auto",
        "--backend",
        help="decode attention: auto (the fastest that serves the cache), torch, triton, cuda, triton-lowrank, "
        "cuda-lowrank",
    )
    dynamic = typer.Option(
        False, "--dynamic", help="growing cache, eager steps (default on CUDA: static cache, CUDA-graph decode)"
    )
    no_compile = typer.Option(
        False, "--no-compile", help="CUDA-graph decode of the model's own forward, without torch.compile of the step"
    )
    sinks = typer.Option(None, "--sinks", metavar="N", help="exact sink tokens (alpha)")
    recent = typer.Option(
        None, "--recent", metavar="P[,P..]", help="share p of each level above the middle, oldest first"
    )
    r0 = typer.Option(
        None, "--r0", metavar="R", help="the middle level's rank: a fraction of full rank (0.5) or a rank (96)"
    )
    ranks = typer.Option(
        None, "--ranks", metavar="R,R..", help="rank per level: fraction of full rank (0.5) or absolute (96)"
    )
    bits = typer.Option(None, "--bits", metavar="B,B..", help="bits per level (latents and keys)")
    key_bits = typer.Option(None, "--key-bits", metavar="B,B..", help="key bits per level")
    key_group = typer.Option(None, "--key-group", metavar="N", help="tokens per key quantization group")
    value_group = typer.Option(None, "--value-group", metavar="N", help="channels per latent quantization group")
    residual = typer.Option(None, "--residual", metavar="N", help="16-bit recent tail length")
    prefill_chunk = typer.Option(
        None,
        "--prefill-chunk",
        metavar="N",
        help="prefill prompts longer than N tokens in pieces of N: the same result, far less activation memory at long "
        "contexts (default 4096; 0: in one piece)",
    )
    threads = typer.Option(None, "--threads", metavar="N", help="torch CPU threads (default: torch's, one per core)")
    tp = typer.Option(
        1, "--tp", min=1, help="tensor parallelism over N GPUs: run under torchrun --nproc-per-node N (docs/runtime.md)"
    )


@app.command()
def run(
    context: typer.Context,
    model: str = Opt.model,
    prompt: Optional[str] = Opt.prompt,
    prompt_file: Optional[Path] = Opt.prompt_file,
    system: Optional[str] = Opt.system,
    raw: Optional[bool] = Opt.raw,
    chat: bool = Opt.chat,
    max_new_tokens: int = Opt.max_new_tokens,
    temperature: float = Opt.temperature,
    top_p: float = Opt.top_p,
    top_k: int = Opt.top_k,
    repetition_penalty: float = Opt.repetition_penalty,
    stop: Optional[list[str]] = Opt.stop,
    seed: int = Opt.seed,
    compare_full: bool = Opt.compare_full,
    as_json: bool = Opt.as_json,
    quiet: bool = Opt.quiet,
    device: str = Opt.device,
    dtype: str = Opt.dtype,
    output_path: str = Opt.output_path,
    backend: str = Opt.backend,
    dynamic: bool = Opt.dynamic,
    no_compile: bool = Opt.no_compile,
    sinks: Optional[str] = Opt.sinks,
    recent: Optional[str] = Opt.recent,
    r0: Optional[str] = Opt.r0,
    ranks: Optional[str] = Opt.ranks,
    bits: Optional[str] = Opt.bits,
    key_bits: Optional[str] = Opt.key_bits,
    key_group: Optional[str] = Opt.key_group,
    value_group: Optional[str] = Opt.value_group,
    residual: Optional[str] = Opt.residual,
    prefill_chunk: Optional[int] = Opt.prefill_chunk,
    threads: Optional[int] = Opt.threads,
    tp: int = Opt.tp,
) -> None:
    """Generate from a TALE artifact, streaming the text; a stats line follows on stderr."""
    if chat and (prompt is not None or prompt_file is not None):
        raise CliError("--chat reads its turns from standard input: drop --prompt/--prompt-file")
    text = None if chat else read_prompt(prompt, prompt_file)
    opts = _options(context.params)
    out = Output.for_ranks(as_json, quiet, tp)
    if chat:
        textgen.chat(model, _stdin_turns(out), opts, out)
    else:
        textgen.generate_text(model, text, opts, out)


def _options(p: dict) -> RunOptions:
    """The parsed command line as RunOptions: text flags checked, --stop's escapes read, the schedule flags as
    load()'s overrides."""
    if p["system"] is not None:
        console.check_text(p["system"], "--system")
    stop = tuple(unescape(console.check_text(s, "--stop"), "--stop") for s in p["stop"] or [])
    knobs = ("sinks", "recent", "ranks", "bits", "key_bits", "key_group", "value_group", "residual", "r0")
    return RunOptions(
        system=p["system"],
        raw=p["raw"],
        max_new_tokens=p["max_new_tokens"],
        temperature=p["temperature"],
        top_p=p["top_p"],
        top_k=p["top_k"],
        repetition_penalty=p["repetition_penalty"],
        stop=stop,
        seed=p["seed"],
        compare_full=p["compare_full"],
        device=p["device"],
        dtype=p["dtype"],
        output_path=p["output_path"],
        backend=p["backend"],
        dynamic=p["dynamic"],
        compile=not p["no_compile"],
        overrides=schedule_overrides(*(p[k] for k in knobs)),
        prefill_chunk=p["prefill_chunk"],
        threads=p["threads"],
        tp=p["tp"],
    )


def _stdin_turns(out: Output):
    """The chat's user turns: one per line of standard input, until EOF (Ctrl-D); blank lines skipped."""
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            out.err.print("> ", end="")
        try:
            line = sys.stdin.readline()
        except UnicodeDecodeError as e:
            raise CliError(f"--chat: standard input is not UTF-8 text (byte {e.start} of the line)") from None
        if not line:  # EOF
            if interactive:
                out.err.print()
            return
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        console.check_text(line, "chat input")
        yield line


def main(argv: list[str] | None = None) -> None:
    """Console script entry: one-line errors, usage errors included (tale_runtime.console)."""
    console.run_app(app, argv)


if __name__ == "__main__":
    main()
