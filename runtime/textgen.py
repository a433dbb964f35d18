"""tale-run's work as one call: `generate_text(artifact, prompt, RunOptions(...))` answers one prompt with the TALE
cache and returns the text and what the cache saved; `chat(artifact, turns, RunOptions(...))` answers a conversation
turn by turn, the cache kept across turns. What they print goes to an `Output` (none: nothing is printed).

Bad input raises UserError (one line: tale-run prints it as `error: ...`, exit code 2), checked before the model
loads where it can be. torch and transformers are imported by the calls, not by this module.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

from rich.console import Console

from . import console
from .console import UserError

SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits


@dataclass
class RunOptions:
    """tale-run's options (docs/runtime.md, "tale-run"); the defaults are its defaults."""

    system: str | None = None  # a system message (through the chat template)
    raw: bool | None = None  # True: no chat template; None: the template, raw text for a pretrained base model
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus sampling (temperature > 0)
    top_k: int = 0  # 0: all tokens
    repetition_penalty: float = 1.0  # 1: none
    stop: tuple[str, ...] = ()  # stop once the answer ends with one of these
    seed: int = 0  # sampling seed, 0 to 2**64-1
    compare_full: bool = False  # also answer with the full 16-bit cache (generate_text only)
    device: str = "auto"  # auto, cpu, cuda, cuda:1, ...
    dtype: str = "auto"  # auto, bf16, fp16 or fp32
    output_path: str = "auto"  # auto, fused or factored
    backend: str = "auto"  # decode attention backend (tale_runtime.backends)
    dynamic: bool = False  # on CUDA: the growing cache and eager steps instead of the static cache and CUDA graphs
    compile: bool = True  # on CUDA: torch.compile the step the CUDA graph replays
    overrides: dict = field(default_factory=dict)  # schedule overrides, as load(**overrides) takes them
    prefill_chunk: int | None = None  # prefill longer prompts in pieces of this many tokens (0: one piece)
    threads: int | None = None  # torch CPU threads
    tp: int = 1  # tensor parallelism over this many processes (torchrun)

    def check(self) -> None:
        """Refuse what no run can use, before anything loads."""
        if self.system is not None and self.raw:
            raise UserError("--system goes through the chat template: drop --raw")
        for name, v in (
            ("--temperature", self.temperature),
            ("--top-p", self.top_p),
            ("--repetition-penalty", self.repetition_penalty),
        ):
            if not math.isfinite(v):  # click's range check lets nan (and inf, for --temperature) through
                raise UserError(f"{name} must be a finite number, got {v}")
        if self.repetition_penalty <= 0:
            raise UserError(f"--repetition-penalty must be > 0 (1: none), got {self.repetition_penalty}")
        for name, v, lo, hi in (  # the command line's own range checks, for Python callers
            ("--max-new-tokens", self.max_new_tokens, 1, None),
            ("--temperature", self.temperature, 0, None),
            ("--top-p", self.top_p, 0, 1),
            ("--top-k", self.top_k, 0, None),
            ("--seed", self.seed, 0, SEED_MAX),
            ("--tp", self.tp, 1, None),
        ):
            if v < lo or (hi is not None and v > hi):
                raise UserError(f"{name} must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}")
        for s in self.stop:
            if not s:
                raise UserError("--stop is empty: give the text to stop at")
        if self.dtype not in ("auto", "bf16", "fp16", "fp32", "bfloat16", "float16", "float32"):
            raise UserError(f"--dtype must be one of bf16, fp16, fp32 or auto; got {self.dtype!r}")
        if self.output_path not in ("auto", "fused", "factored"):
            raise UserError(f"--output-path must be fused or factored (or auto); got {self.output_path!r}")
        if self.prefill_chunk is not None and self.prefill_chunk < 0:
            raise UserError(
                f"--prefill-chunk must be a whole number of tokens >= 0 (0: one piece), got {self.prefill_chunk}"
            )
        if self.threads is not None and self.threads < 1:
            raise UserError(f"--threads must be >= 1, got {self.threads}")


class Output:
    """Where tale-run writes: the answer on stdout (or, with as_json, one JSON object per answer and nothing
    else); notes and stats lines on stderr unless quiet. `silent`: nothing at all (a tensor-parallel rank other
    than 0, or a Python caller that only wants the returned result)."""

    def __init__(self, as_json: bool = False, quiet: bool = False, silent: bool = False, suffix: str = ""):
        # suffix: added to each stats line
        self.json, self.quiet, self.silent, self.suffix = as_json, quiet or silent, silent, suffix
        self.err = Console(stderr=True, soft_wrap=True, highlight=False, quiet=silent)

    @classmethod
    def for_ranks(cls, as_json: bool, quiet: bool, tp: int) -> Output:
        """Under tensor parallelism every rank runs the command; rank 0 alone prints the answer, notes and stats."""
        silent = tp > 1 and os.environ.get("RANK", "0") != "0"
        return cls(as_json, quiet, silent, f" | tensor parallel: {tp} ranks, cache bytes per rank" if tp > 1 else "")

    def note(self, msg: str) -> None:
        if not self.quiet:
            self.err.print(msg, style="dim", markup=False)

    def text(self, piece: str) -> None:
        if not self.json and not self.silent:
            sys.stdout.write(piece)
            sys.stdout.flush()

    def obj(self, obj: dict) -> None:
        if self.json and not self.silent:
            sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
            sys.stdout.flush()


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
            raise UserError(
                f"the artifact's chat template failed ({type(e).__name__}: {console.one_line(e)}); "
                "pass --raw to feed the prompt without it"
            ) from None
        return tok(text, add_special_tokens=False)["input_ids"]
    return tok(msgs[-1]["content"])["input_ids"]


def generate_text(artifact: str, prompt: str, opts: RunOptions | None = None, out: Output | None = None) -> dict:
    """Answer `prompt` from the artifact (a directory or Hub id) with the TALE cache; with opts.compare_full also
    with the full 16-bit cache. Returns {"model", "text", "stats"} (and "full", "same_text", "ratio_vs_full"):
    the object `tale-run --json` prints."""
    opts = opts or RunOptions()
    out = out or Output(silent=True)
    opts.check()
    if opts.tp > 1 and opts.compare_full:
        raise UserError("--compare-full runs on one process: not with --tp")
    m, tok, gen = _load(artifact, opts, out, chat=False)
    raw, ctx, sched = opts.raw, m.config.max_position_embeddings, m.tale_spec.schedule
    if raw is None and opts.system is None and base_model(m):
        raw = True
        out.note(
            "note: a pretrained (base) model: the prompt is fed as raw text, to continue (--template applies the chat template)"
        )
    ids = encode(tok, messages_of(prompt, opts.system), bool(raw))
    if not ids:
        raise UserError("the prompt encodes to no tokens")
    if len(ids) >= ctx:
        raise UserError(f"prompt is {len(ids)} tokens; the model's context is {ctx}")
    max_new_tokens = opts.max_new_tokens
    if len(ids) + max_new_tokens > ctx:
        max_new_tokens = ctx - len(ids)
        out.note(f"note: --max-new-tokens capped to {max_new_tokens} by the model's context ({ctx})")
    if sched.sinks + sched.residual >= len(ids) + max_new_tokens:
        out.note(
            f"note: the {sched.sinks} sink and {sched.residual} residual tokens kept at 16 bits cover all "
            f"{len(ids) + max_new_tokens} tokens of this run: nothing is compressed, so the measured ratio is 1.00x"
        )
    if opts.compare_full:
        out.text("[TALE cache]\n")
    answer, stats, _ = _answer(m, ids, max_new_tokens, gen, out, static=False if opts.dynamic else None)
    result = {"model": artifact, "text": answer, "stats": stats.as_dict()}
    if opts.compare_full:
        from transformers import DynamicCache

        out.text("[full 16-bit cache]\n")
        full, fstats, _ = _answer(m, ids, max_new_tokens, gen, out, cache=DynamicCache(config=m.config))
        result["full"] = {"text": full, "stats": fstats.as_dict()}
        result["same_text"] = full == answer
        result["ratio_vs_full"] = round(fstats.baseline_bytes / stats.cache_bytes, 4) if stats.cache_bytes else None
        out.note(
            f"{'same answer' if full == answer else 'the answers differ'} | TALE cache {stats.cache_bytes / 2**20:.2f} "
            f"MiB vs full 16-bit cache {fstats.baseline_bytes / 2**20:.2f} MiB: measured "
            f"{result['ratio_vs_full']:.2f}x smaller"
        )
    out.obj(result)
    return result


def chat(artifact: str, turns: Iterable[str], opts: RunOptions | None = None, out: Output | None = None) -> list[dict]:
    """Answer each user turn of `turns` (read as they are needed: a generator over standard input works) in one
    conversation through the chat template. The dynamic cache is kept while each turn's prompt (the template over
    the whole conversation) extends what it holds; otherwise the turn starts a fresh cache. Returns one
    {"turn", "text", "stats"} per turn, the objects `tale-run --chat --json` prints."""
    opts = opts or RunOptions()
    out = out or Output(silent=True)
    if opts.raw:
        raise UserError("--chat needs the chat template: drop --raw")
    if opts.compare_full:
        raise UserError("--compare-full answers one prompt: drop --chat")
    opts.check()
    if opts.tp > 1:
        raise UserError("--chat runs on one process: not with --tp")
    m, tok, gen = _load(artifact, opts, out, chat=True)
    from .load import new_cache

    msgs = [{"role": "system", "content": opts.system}] if opts.system else []
    ctx = m.config.max_position_embeddings
    cache, held = None, []  # the token ids the cache holds
    results = []
    for line in turns:
        msgs.append({"role": "user", "content": line})
        ids = encode(tok, msgs, raw=False)
        if len(ids) >= ctx:
            raise UserError(f"the conversation is {len(ids)} tokens; the model's context is {ctx}")
        if cache is None or len(ids) <= len(held) or ids[: len(held)] != held:
            cache, held = new_cache(m), []
        n = min(opts.max_new_tokens, ctx - len(ids))
        answer, stats, new = _answer(m, ids, n, gen, out, cache=cache)
        held = (ids + new)[: cache.get_seq_length()]  # the last new token was sampled, never fed
        msgs.append({"role": "assistant", "content": answer})
        results.append({"turn": len(results) + 1, "text": answer, "stats": stats.as_dict()})
        out.obj(results[-1])
    return results


def _load(artifact: str, opts: RunOptions, out: Output, chat: bool):
    """The model and tokenizer with the options' schedule, dtype and backend; the keyword arguments of
    tale_runtime.generate.generate that the options give."""
    dev = console.device(opts.device)
    if dev.type != "cuda":
        used = [f for f, on in (("--dynamic", opts.dynamic), ("--no-compile", not opts.compile)) if on]
        if used:
            out.note(
                f"note: {' and '.join(used)} only change(s) decoding on CUDA (static cache, CUDA graphs); "
                f"on {dev.type} decoding is dynamic and eager anyway"
            )

    import torch

    if opts.threads is not None:
        torch.set_num_threads(opts.threads)

    from .artifact import ArtifactError
    from .load import load
    from .schedule import ContextError

    try:
        m, tok = load(
            artifact,
            device=dev,
            dtype=None if opts.dtype == "auto" else getattr(torch, console.DTYPES[opts.dtype]),
            backend=opts.backend,
            tp_size=opts.tp,
            output_path=None if opts.output_path == "auto" else opts.output_path,
            **opts.overrides,
        )
    except ContextError as e:  # named as the flag that set it
        raise UserError(f"--{e.knob} {e.msg}") from None
    except (ArtifactError, ValueError) as e:
        raise UserError(str(e)) from None
    if opts.prefill_chunk is not None:
        from .model import set_prefill_chunk

        set_prefill_chunk(m, opts.prefill_chunk)
    if tok is None:
        raise UserError(f"{artifact}: the artifact has no tokenizer")
    if (chat or opts.system is not None) and not tok.chat_template:
        raise UserError(
            f"{'--chat' if chat else '--system'} needs a chat template, and the artifact's tokenizer has none"
        )
    if dev.type == "cuda" and not m.tale_spec.schedule.fast_path():
        out.note(
            "note: the GPU kernels do not read this schedule (key bands with keys before RoPE, per-token keys or "
            "3-bit latents): decoding through the torch reference on the dynamic cache, far slower "
            "(docs/performance.md)"
        )
    gen = dict(
        temperature=opts.temperature,
        top_p=opts.top_p,
        top_k=opts.top_k,
        repetition_penalty=opts.repetition_penalty,
        stop_strings=list(opts.stop) or None,
        seed=opts.seed,
        tokenizer=tok,
        compile=opts.compile,
    )
    return m, tok, gen


def _answer(m, ids, max_new_tokens, gen, out: Output, cache=None, static=None):
    """One answer, streamed (unless as_json), then its stats line; returns (text, stats, new token ids)."""
    from .generate import NonFiniteLogits, generate

    streamed = []

    def emit(piece: str) -> None:
        streamed.append(piece)
        out.text(piece)

    try:
        ids_out, stats = generate(
            m, ids, max_new_tokens=max_new_tokens, on_text=emit, cache=cache, static=static, **gen
        )
    except NonFiniteLogits:  # one line on stderr (a UserError); end the streamed text's line first
        out.text("\n")
        raise
    except KeyboardInterrupt as e:  # end the streamed line, then the stats of what was generated, then the message
        if streamed:
            out.text("\n")
        sys.stdout.flush()
        stats = getattr(e, "tale_stats", None)
        if stats is not None:
            out.note(stats.line() + " (interrupted)")
        raise
    out.text("\n")
    out.note(stats.line() + out.suffix)
    return "".join(streamed), stats, ids_out
