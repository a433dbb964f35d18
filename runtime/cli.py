"""tale-run: generate from a TALE artifact with the compressed cache and report what it saved."""

from __future__ import annotations

import json
import math
import os
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


def base_model(m) -> bool:
    """Whether the artifact's manifest says its base is a pretrained model, not chat-tuned (base.instruct false;
    unknown for artifacts that do not say)."""
    base = m.tale_spec.manifest.get("base")
    return isinstance(base, dict) and base.get("instruct") is False


def messages_of(prompt: str, system: str | None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def encode(tok, prompt: str | list[dict], raw: bool) -> list[int]:
    """A prompt (or a chat's messages) -> token ids, through the tokenizer's chat template unless `raw`."""
    msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if not raw and tok.chat_template:
        try:
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja2's TemplateError (raise_exception, an unknown filter), ValueError, ...
            raise CliError(
                f"the artifact's chat template failed ({type(e).__name__}: {console.one_line(e)}); "
                "pass --raw to feed the prompt without it"
            ) from None
        return tok(text, add_special_tokens=False)["input_ids"]
    return tok(msgs[-1]["content"])["input_ids"]


class Output:
    """Where tale-run writes: the answer on stdout (or, with --json, one JSON object per answer and nothing
    else); notes and stats lines on stderr unless --quiet."""

    def __init__(self, as_json: bool, quiet: bool, silent: bool = False, suffix: str = ""):
        # silent: a tensor-parallel rank other than 0 prints nothing; suffix: added to each stats line
        self.json, self.quiet, self.silent, self.suffix = as_json, quiet or silent, silent, suffix

    def note(self, msg: str) -> None:
        if not self.quiet:
            err.print(msg, style="dim", markup=False)

    def text(self, piece: str) -> None:
        if not self.json and not self.silent:
            sys.stdout.write(piece)
            sys.stdout.flush()

    def obj(self, obj: dict) -> None:
        if self.json and not self.silent:
            sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
            sys.stdout.flush()


@app.command()
def run(
    model: str = typer.Argument(..., metavar="DIR_OR_REPO", help="TALE artifact directory or Hub repo id"),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="the prompt text"),
    prompt_file: Optional[Path] = typer.Option(
        None, "--prompt-file", help="read the prompt from a file ('-': standard input)"
    ),
    system: Optional[str] = typer.Option(None, "--system", help="a system message (through the chat template)"),
    raw: Optional[bool] = typer.Option(
        None,
        "--raw/--template",
        help="--raw: no chat template, feed the prompt as it is; --template: through the tokenizer's chat template "
        "(default: the template, but raw text for a pretrained base model, which the artifact's manifest names)",
    ),
    chat: bool = typer.Option(
        False, "--chat", help="interactive: one user turn per line of standard input, the cache kept across turns"
    ),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", min=1),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0, help="nucleus sampling (temperature > 0)"),
    top_k: int = typer.Option(0, "--top-k", min=0, help="sample among the k most likely tokens (0: all)"),
    repetition_penalty: float = typer.Option(
        1.0, "--repetition-penalty", min=0.0, help="divide the logits of tokens already in the text (1: none)"
    ),
    stop: Optional[list[str]] = typer.Option(
        None,
        "--stop",
        help="stop once the answer ends with STR (repeatable); backslash escapes are read: --stop '\\n\\n' stops at a "
        "blank line (a literal backslash: \\\\)",
    ),
    seed: int = typer.Option(0, "--seed", min=0, max=SEED_MAX, help="sampling seed (0 to 2**64-1)"),
    compare_full: bool = typer.Option(
        False, "--compare-full", help="also answer with the full 16-bit cache; print both and the measured ratio"
    ),
    as_json: bool = typer.Option(False, "--json", help="one JSON object on stdout (text and figures), nothing else"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no notes or stats on stderr; errors only"),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:1, ..."),
    dtype: str = typer.Option(
        "auto", "--dtype", help="auto (bf16; fp32 on a CPU without bf16 instructions), bf16, fp16 or fp32"
    ),
    output_path: str = typer.Option(
        "auto",
        "--output-path",
        help="auto (factored on a CPU in fp32, else fused), fused (O^r) or factored (B then W_O)",
    ),
    backend: str = typer.Option(
        "auto",
        "--backend",
        help="decode attention: auto (the fastest that serves the cache), torch, triton, cuda, triton-lowrank, "
        "cuda-lowrank",
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
    prefill_chunk: Optional[int] = typer.Option(
        None,
        "--prefill-chunk",
        metavar="N",
        help="prefill prompts longer than N tokens in pieces of N: the same result, far less activation memory at long "
        "contexts (default 4096; 0: in one piece)",
    ),
    threads: Optional[int] = typer.Option(
        None, "--threads", metavar="N", help="torch CPU threads (default: torch's, one per core)"
    ),
    tp: int = typer.Option(
        1, "--tp", min=1, help="tensor parallelism over N GPUs: run under torchrun --nproc-per-node N (docs/runtime.md)"
    ),
) -> None:
    """Generate from a TALE artifact, streaming the text; a stats line follows on stderr."""
    if chat:
        if prompt is not None or prompt_file is not None:
            raise CliError("--chat reads its turns from standard input: drop --prompt/--prompt-file")
        if raw:
            raise CliError("--chat needs the chat template: drop --raw")
        if compare_full:
            raise CliError("--compare-full answers one prompt: drop --chat")
        text = None
    else:
        text = read_prompt(prompt, prompt_file)
    if system is not None:
        console.check_text(system, "--system")
        if raw:
            raise CliError("--system goes through the chat template: drop --raw")
    for name, v in (("--temperature", temperature), ("--top-p", top_p), ("--repetition-penalty", repetition_penalty)):
        if not math.isfinite(v):  # click's range check lets nan (and inf, for --temperature) through
            raise CliError(f"{name} must be a finite number, got {v}")
    if repetition_penalty <= 0:
        raise CliError(f"--repetition-penalty must be > 0 (1: none), got {repetition_penalty}")
    stop = [unescape(console.check_text(s, "--stop"), "--stop") for s in stop or []]
    for s in stop:
        if not s:
            raise CliError("--stop is empty: give the text to stop at")
    overrides = schedule_overrides(sinks, recent, ranks, bits, key_bits, key_group, value_group, residual, r0)
    if dtype not in ("auto", "bf16", "fp16", "fp32", "bfloat16", "float16", "float32"):
        raise CliError(f"--dtype must be one of bf16, fp16, fp32 or auto; got {dtype!r}")
    if output_path not in ("auto", "fused", "factored"):
        raise CliError(f"--output-path must be fused or factored (or auto); got {output_path!r}")
    if prefill_chunk is not None and prefill_chunk < 0:
        raise CliError(f"--prefill-chunk must be a whole number of tokens >= 0 (0: one piece), got {prefill_chunk}")
    if threads is not None and threads < 1:
        raise CliError(f"--threads must be >= 1, got {threads}")
    if tp > 1 and (chat or compare_full):
        raise CliError(f"{'--chat' if chat else '--compare-full'} runs on one process: not with --tp")
    dev = console.device(device)
    # under tensor parallelism every rank runs this command; rank 0 alone prints the answer, notes and stats
    silent = tp > 1 and os.environ.get("RANK", "0") != "0"
    err.quiet = silent
    say = Output(as_json, quiet, silent, f" | tensor parallel: {tp} ranks, cache bytes per rank" if tp > 1 else "")
    if dev.type != "cuda":
        used = [f for f, on in (("--dynamic", dynamic), ("--no-compile", no_compile)) if on]
        if used:
            say.note(
                f"note: {' and '.join(used)} only change(s) decoding on CUDA (static cache, CUDA graphs); "
                f"on {dev.type} decoding is dynamic and eager anyway"
            )

    import torch

    if threads is not None:
        torch.set_num_threads(threads)

    from .artifact import ArtifactError
    from .load import load
    from .schedule import ContextError

    try:
        m, tok = load(
            model,
            device=dev,
            dtype=None if dtype == "auto" else getattr(torch, DTYPES[dtype]),
            backend=backend,
            tp_size=tp,
            output_path=None if output_path == "auto" else output_path,
            **overrides,
        )
    except ContextError as e:  # named as the flag that set it
        raise CliError(f"--{e.knob} {e.msg}") from None
    except (ArtifactError, ValueError) as e:
        raise CliError(str(e)) from None
    if prefill_chunk is not None:
        from .model import set_prefill_chunk

        set_prefill_chunk(m, prefill_chunk)
    if tok is None:
        raise CliError(f"{model}: the artifact has no tokenizer")
    if (chat or system is not None) and not tok.chat_template:
        raise CliError(
            f"{'--chat' if chat else '--system'} needs a chat template, and the artifact's tokenizer has none"
        )
    ctx = m.config.max_position_embeddings
    sched = m.tale_spec.schedule
    if dev.type == "cuda" and not sched.fast_path():
        say.note(
            "note: the GPU kernels do not read this schedule (key bands with keys before RoPE, per-token keys or "
            "3-bit latents): decoding through the torch reference on the dynamic cache, far slower "
            "(docs/performance.md)"
        )
    opts = dict(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        repetition_penalty=repetition_penalty,
        stop_strings=stop or None,
        seed=seed,
        tokenizer=tok,
        compile=not no_compile,
    )
    if chat:
        _chat(m, tok, system, max_new_tokens, opts, say)
        return

    if raw is None and system is None and base_model(m):
        raw = True
        say.note(
            "note: a pretrained (base) model: the prompt is fed as raw text, to continue (--template applies the chat template)"
        )
    ids = encode(tok, messages_of(text, system), bool(raw))
    if not ids:
        raise CliError("the prompt encodes to no tokens")
    if len(ids) >= ctx:
        raise CliError(f"prompt is {len(ids)} tokens; the model's context is {ctx}")
    if len(ids) + max_new_tokens > ctx:
        max_new_tokens = ctx - len(ids)
        say.note(f"note: --max-new-tokens capped to {max_new_tokens} by the model's context ({ctx})")
    if sched.sinks + sched.residual >= len(ids) + max_new_tokens:
        say.note(
            f"note: the {sched.sinks} sink and {sched.residual} residual tokens kept at 16 bits cover all "
            f"{len(ids) + max_new_tokens} tokens of this run: nothing is compressed, so the measured ratio is 1.00x"
        )
    if compare_full:
        say.text("[TALE cache]\n")
    answer, stats, _ = _answer(m, ids, max_new_tokens, opts, say, static=False if dynamic else None)
    result = {"model": model, "text": answer, "stats": stats.as_dict()}
    if compare_full:
        from transformers import DynamicCache

        say.text("[full 16-bit cache]\n")
        full, fstats, _ = _answer(m, ids, max_new_tokens, opts, say, cache=DynamicCache(config=m.config))
        result["full"] = {"text": full, "stats": fstats.as_dict()}
        result["same_text"] = full == answer
        result["ratio_vs_full"] = round(fstats.baseline_bytes / stats.cache_bytes, 4) if stats.cache_bytes else None
        say.note(
            f"{'same answer' if full == answer else 'the answers differ'} | TALE cache {stats.cache_bytes / 2**20:.2f} "
            f"MiB vs full 16-bit cache {fstats.baseline_bytes / 2**20:.2f} MiB: measured "
            f"{result['ratio_vs_full']:.2f}x smaller"
        )
    say.obj(result)


def _answer(m, ids, max_new_tokens, opts, say, cache=None, static=None):
    """One answer, streamed (unless --json), then its stats line; returns (text, stats, new token ids)."""
    from .generate import NonFiniteLogits, generate

    streamed = []

    def emit(piece: str) -> None:
        streamed.append(piece)
        say.text(piece)

    try:
        out, stats = generate(m, ids, max_new_tokens=max_new_tokens, on_text=emit, cache=cache, static=static, **opts)
    except NonFiniteLogits:  # one line on stderr (a UserError); end the streamed text's line first
        say.text("\n")
        raise
    except KeyboardInterrupt as e:  # end the streamed line, then the stats of what was generated, then the message
        if streamed:
            say.text("\n")
        sys.stdout.flush()
        stats = getattr(e, "tale_stats", None)
        if stats is not None:
            say.note(stats.line() + " (interrupted)")
        raise
    say.text("\n")
    say.note(stats.line() + say.suffix)
    return "".join(streamed), stats, out


def _chat(m, tok, system, max_new_tokens, opts, say) -> None:
    """Turns from stdin, one per line, until EOF (Ctrl-D). The dynamic cache is kept while each turn's prompt (the
    chat template over the whole conversation) extends what it holds; otherwise the turn starts a fresh cache."""
    from .load import new_cache

    interactive = sys.stdin.isatty()
    msgs = [{"role": "system", "content": system}] if system else []
    ctx = m.config.max_position_embeddings
    cache, held = None, []  # the token ids the cache holds
    turn = 0
    while True:
        if interactive:
            err.print("> ", end="")
        try:
            line = sys.stdin.readline()
        except UnicodeDecodeError as e:
            raise CliError(f"--chat: standard input is not UTF-8 text (byte {e.start} of the line)") from None
        if not line:  # EOF
            if interactive:
                err.print()
            return
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        console.check_text(line, "chat input")
        msgs.append({"role": "user", "content": line})
        ids = encode(tok, msgs, raw=False)
        if len(ids) >= ctx:
            raise CliError(f"the conversation is {len(ids)} tokens; the model's context is {ctx}")
        if cache is None or len(ids) <= len(held) or ids[: len(held)] != held:
            cache, held = new_cache(m), []
        n = min(max_new_tokens, ctx - len(ids))
        turn += 1
        answer, stats, out = _answer(m, ids, n, opts, say, cache=cache)
        held = (ids + out)[: cache.get_seq_length()]  # the last new token was sampled, never fed
        msgs.append({"role": "assistant", "content": answer})
        say.obj({"turn": turn, "text": answer, "stats": stats.as_dict()})


def main(argv: list[str] | None = None) -> None:
    """Console script entry: one-line errors, usage errors included (tale_runtime.console)."""
    console.run_app(app, argv)


if __name__ == "__main__":
    main()
