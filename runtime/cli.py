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
    """tale-run's argument and options, declared once: run() takes them as its parameters."""

    model: str = typer.Argument(..., metavar="DIR_OR_REPO", help="TALE artifact directory or Hub repo id")
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="the prompt text")
    prompt_file: Optional[Path] = typer.Option(
        None, "--prompt-file", help="read the prompt from a file ('-': standard input)"
    )
    system: Optional[str] = typer.Option(None, "--system", help="a system message (through the chat template)")
    raw: Optional[bool] = typer.Option(
        None,
        "--raw/--template",
        help="--raw: no chat template, feed the prompt as it is; --template: through the tokenizer's chat template "
        "(default: the template, but raw text for a pretrained base model, which the artifact's manifest names)",
    )
    chat: bool = typer.Option(
        False, "--chat", help="interactive: one user turn per line of standard input, the cache kept across turns"
    )
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", min=1)
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy")
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0, help="nucleus sampling (temperature > 0)")
    top_k: int = typer.Option(0, "--top-k", min=0, help="sample among the k most likely tokens (0: all)")
    repetition_penalty: float = typer.Option(
        1.0, "--repetition-penalty", min=0.0, help="divide the logits of tokens already in the text (1: none)"
    )
    stop: Optional[list[str]] = typer.Option(
        None,
        "--stop",
        help="stop once the answer ends with STR (repeatable); backslash escapes are read: --stop '\\n\\n' stops at a "
        "blank line (a literal backslash: \\\\)",
    )
    seed: int = typer.Option(0, "--seed", min=0, max=SEED_MAX, help="sampling seed (0 to 2**64-1)")
    compare_full: bool = typer.Option(
        False, "--compare-full", help="also answer with the full 16-bit cache; print both and the measured ratio"
    )
    as_json: bool = typer.Option(False, "--json", help="one JSON object on stdout (text and figures), nothing else")
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no notes or stats on stderr; errors only")
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:1, ...")
    dtype: str = typer.Option(
        "auto", "--dtype", help="auto (bf16; fp32 on a CPU without bf16 instructions), bf16, fp16 or fp32"
    )
    output_path: str = typer.Option(
        "auto",
        "--output-path",
        help="auto (factored on a CPU in fp32, else fused), fused (O^r) or factored (B then W_O)",
    )
    backend: str = typer.Option(
        "auto",
        "--backend",
        help="decode attention: auto (the fastest that serves the cache), torch, triton, cuda, triton-lowrank, "
        "cuda-lowrank",
    )
    dynamic: bool = typer.Option(
        False, "--dynamic", help="growing cache, eager steps (default on CUDA: static cache, CUDA-graph decode)"
    )
    no_compile: bool = typer.Option(
        False, "--no-compile", help="CUDA-graph decode of the model's own forward, without torch.compile of the step"
    )
    sinks: Optional[str] = typer.Option(None, "--sinks", metavar="N", help="exact sink tokens (alpha)")
    recent: Optional[str] = typer.Option(
        None, "--recent", metavar="P[,P..]", help="share p of each level above the middle, oldest first"
    )
    r0: Optional[str] = typer.Option(
        None, "--r0", metavar="R", help="the middle level's rank: a fraction of full rank (0.5) or a rank (96)"
    )
    ranks: Optional[str] = typer.Option(
        None, "--ranks", metavar="R,R..", help="rank per level: fraction of full rank (0.5) or absolute (96)"
    )
    bits: Optional[str] = typer.Option(None, "--bits", metavar="B,B..", help="bits per level (latents and keys)")
    key_bits: Optional[str] = typer.Option(None, "--key-bits", metavar="B,B..", help="key bits per level")
    key_group: Optional[str] = typer.Option(None, "--key-group", metavar="N", help="tokens per key quantization group")
    value_group: Optional[str] = typer.Option(
        None, "--value-group", metavar="N", help="channels per latent quantization group"
    )
    residual: Optional[str] = typer.Option(None, "--residual", metavar="N", help="16-bit recent tail length")
    prefill_chunk: Optional[int] = typer.Option(
        None,
        "--prefill-chunk",
        metavar="N",
        help="prefill prompts longer than N tokens in pieces of N: the same result, far less activation memory at long "
        "contexts (default 4096; 0: in one piece)",
    )
    threads: Optional[int] = typer.Option(
        None, "--threads", metavar="N", help="torch CPU threads (default: torch's, one per core)"
    )
    tp: int = typer.Option(
        1, "--tp", min=1, help="tensor parallelism over N GPUs: run under torchrun --nproc-per-node N (docs/runtime.md)"
    )


@app.command()
@console.options_from(Opt)
def run(context: typer.Context, **params) -> None:
    """Generate from a TALE artifact, streaming the text; a stats line follows on stderr."""
    chat, prompt, prompt_file = params["chat"], params["prompt"], params["prompt_file"]
    if chat and (prompt is not None or prompt_file is not None):
        raise CliError("--chat reads its turns from standard input: drop --prompt/--prompt-file")
    text = None if chat else read_prompt(prompt, prompt_file)
    opts = _options(context.params)
    out = Output.for_ranks(params["as_json"], params["quiet"], params["tp"])
    if chat:
        textgen.chat(params["model"], _stdin_turns(out), opts, out)
    else:
        textgen.generate_text(params["model"], text, opts, out)


def _options(p: dict) -> RunOptions:
    """The parsed command line as RunOptions: text flags checked, --stop's escapes read, the schedule flags as
    load()'s overrides."""
    if p["system"] is not None:
        console.check_text(p["system"], "--system")
    stop = tuple(unescape(console.check_text(s, "--stop"), "--stop") for s in p["stop"] or [])
    knobs = ("sinks", "recent", "ranks", "bits", "key_bits", "key_group", "value_group", "residual", "r0")
    same = ("system", "raw", "max_new_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed")
    same += ("compare_full", "device", "dtype", "output_path", "backend", "dynamic", "prefill_chunk", "threads", "tp")
    return RunOptions(
        stop=stop,
        compile=not p["no_compile"],
        overrides=schedule_overrides(*(p[k] for k in knobs)),
        **{k: p[k] for k in same},
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
