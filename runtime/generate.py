"""A plain decode loop over a TALE cache: greedy or sampled, streaming text, with cache statistics.

On CUDA it uses the static cache and replays each decode step as a CUDA graph (runtime/decode.py);
elsewhere, or with static=False, the dynamic cache and eager steps.
Sampling options go through transformers' logits processors and stop strings through its StopStringCriteria.
For batches or beam search use `model.generate(..., **cache_arg(new_cache(model)))`.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch

from .backends import ReferenceCalls
from .console import UserError
from .decode import graph_decoder
from .load import new_cache
from .model import TaleCache, cache_arg
from .static_cache import StaticTaleCache


@dataclass
class GenStats:
    prompt_tokens: int
    generated_tokens: int
    prefill_s: float  # the prompt's forward pass (it yields the first new token)
    decode_s: float  # every later forward pass
    cache_bytes: int  # TaleCache.nbytes(): every cached tensor
    baseline_bytes: int  # 16-bit K+V of the same tokens
    nominal_ratio: float | None  # artifact.nominal_ratio of the schedule: no sinks, scales, zeros, residual
    attention: str = ""  # the decode attention backend (cache.backend_name)
    # decode attention calls (one per layer and step) and, per reason, those the backend handed to the torch
    # reference (cache.reference_calls: a condition of the call its cache's spec could not show)
    attention_calls: int = 0
    attention_reference: dict[str, int] = field(default_factory=dict)
    reused_tokens: int = 0  # prompt tokens the cache held already (a chat's earlier turns): not prefilled again
    # the first decode steps of a CUDA-graph decoder, up to its first replay, part of decode_s: they compile the step
    # (once per model and process), run one step eagerly and capture the graph (once per cache); the speed is of the
    # steps after them
    first_step_s: float = 0.0
    first_steps: int = 1  # how many decode steps first_step_s covers

    @property
    def decode_tokens_per_s(self) -> float:
        steps, s = self.generated_tokens - 1, self.decode_s
        if self.first_step_s and steps > self.first_steps:
            steps, s = steps - self.first_steps, s - self.first_step_s
        return steps / s if steps > 0 and s > 0 else 0.0

    @property
    def ratio(self) -> float:
        return self.baseline_bytes / self.cache_bytes if self.cache_bytes else 0.0

    def as_dict(self) -> dict:
        """The figures of line(), for --json."""
        return {
            **asdict(self),
            "ratio": round(self.ratio, 4),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
        }

    def line(self) -> str:
        nominal = f"{self.nominal_ratio:.2f}x" if self.nominal_ratio else "n/a"
        speed = f"{self.decode_tokens_per_s:.1f} tok/s" if self.generated_tokens > 1 else "n/a"
        if self.first_step_s and self.generated_tokens > self.first_steps + 1:
            first = "a first step" if self.first_steps == 1 else f"the first {self.first_steps} steps"
            speed += f" after {first} of {self.first_step_s:.2f} s (compile, CUDA graph capture)"
        reused = f" ({self.reused_tokens} reused from the cache)" if self.reused_tokens else ""
        return (
            f"prompt {self.prompt_tokens} tok{reused}, generated {self.generated_tokens} tok, "
            f"prefill {self.prefill_s:.2f} s, decode {speed} | "
            f"cache {_mib(self.cache_bytes)} vs 16-bit K+V {_mib(self.baseline_bytes)}: "
            f"measured {self.ratio:.2f}x (nominal {nominal})"
            + (f" | attention: {self.attention_named()}" if self.attention else "")
        )

    def attention_named(self) -> str:
        """The backend's name, with how many decode calls it handed to the torch reference and why, if any:
        'cuda kernel (fragment layout; 2 of 64 decode calls ran the torch reference: float32 queries ...)'."""
        note = ReferenceCalls(self.attention_calls, Counter(self.attention_reference)).note()
        if not note:
            return self.attention
        return f"{self.attention[:-1]}; {note})" if self.attention.endswith(")") else f"{self.attention} ({note})"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


class TextStream:
    """Incremental detokenization: emits the text of each new token once it is complete.

    Decodes the tokens since the last newline together (so tokenizers that merge spaces or
    bytes across tokens come out right) and holds back a trailing U+FFFD: a multi-byte
    character split over byte-level tokens is emitted only when its last byte arrives.
    """

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.printed = 0

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\n"):
            out = text[self.printed :]
            self.ids, self.printed = [], 0
            return out
        if text.endswith("\ufffd"):
            return ""
        out = text[self.printed :]
        self.printed = len(text)
        return out

    def flush(self) -> str:
        """The held-back rest (an incomplete character at the end of generation)."""
        text = self.tok.decode(self.ids, skip_special_tokens=True) if self.ids else ""
        out = text[self.printed :]
        self.ids, self.printed = [], 0
        return out


def eos_ids(model, tokenizer) -> set[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


class NonFiniteLogits(UserError):
    """A forward pass gave inf or NaN logits: a number format overflowed on the way (e.g. float16 key scales or
    the CUDA kernel's fp16 query-times-scale operand past 65504). Refused, because argmax would pick a token
    anyway and the run would look fine; the CLIs print it in one line with exit code 2 (the user can change the
    dtype or the backend)."""

    def __init__(self, where: str):
        super().__init__(
            f"the logits of {where} are not finite (inf or NaN): a number format overflowed in the cache or "
            "attention; try --dtype fp32 or another attention backend"
        )


def processors(
    temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, repetition_penalty: float = 1.0
) -> list[Callable]:
    """transformers' logits processors for these options, in the order its generate() applies them (penalty, then
    the sampling warpers); each maps (ids [1, L], scores [1, V]) -> scores."""
    from transformers.generation import (
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    out: list[Callable] = []
    if repetition_penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    if temperature > 0:
        if temperature != 1.0:
            out.append(TemperatureLogitsWarper(temperature))
        if top_k > 0:
            out.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:  # top_p 0 keeps the top token (min_tokens_to_keep=1)
            out.append(TopPLogitsWarper(top_p))
    return out


def _next_token(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    gen: torch.Generator | None,
    step: int = 0,
    procs: list[Callable] | None = None,
    ids: torch.Tensor | None = None,
) -> int:
    """logits [V] -> token id: greedy at temperature 0, else sampled after transformers' processors (`procs`,
    default: `processors(temperature, top_p)`; `ids` [1, L]: the sequence so far, for a repetition penalty), which
    read the logits as float32. Non-finite logits are refused (NonFiniteLogits); greedy without processors reads the
    token and the check in one device-to-host copy of one number, and on a GPU never copies the row."""
    if procs is None:
        procs = processors(temperature, top_p)
    if temperature <= 0 and not procs:
        # argmax in the logits' own dtype on a GPU (float32 holds every bfloat16/float16 value: the same index); the
        # CPU reduces bfloat16 more slowly than float32, by more than the conversion costs
        if logits.device.type == "cpu":
            logits = logits.float()
        tok = int(torch.where(torch.isfinite(logits).all(), logits.argmax(), -1))  # -1: not finite
        if tok < 0:
            raise NonFiniteLogits(f"generated token {step + 1}")
        return tok
    logits = logits.float()
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteLogits(f"generated token {step + 1}")
    scores = logits[None]
    for p in procs:
        scores = p(ids, scores)
    if temperature <= 0:
        return int(scores[0].argmax())
    return int(torch.multinomial(scores[0].softmax(-1), 1, generator=gen))


def _graphs(device: torch.device) -> bool:
    """Whether decode steps over a static cache replay a CUDA graph (graph_decoder) on this device."""
    return device.type == "cuda"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def generate(
    model,
    input_ids: torch.Tensor | list[int],
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    tokenizer=None,
    on_text: Callable[[str], None] | None = None,
    cache: TaleCache | StaticTaleCache | None = None,
    eos_token_id: int | list[int] | None = None,
    static: bool | None = None,
    compile: bool = True,
    top_k: int = 0,
    repetition_penalty: float = 1.0,
    stop_strings: list[str] | None = None,
) -> tuple[list[int], GenStats]:
    """Generate from one prompt into `cache`; stop at EOS or after max_new_tokens. Greedy at temperature 0,
    else sampling (nucleus if top_p < 1) seeded by `seed`.

    Without `cache`: a StaticTaleCache for prompt + max_new_tokens tokens when `static` (default: on CUDA),
    whose decode steps replay one CUDA graph, else a TaleCache. Both give the same tokens, but for sliding-window
    layers, which the static cache holds exact (a ring of the window, docs/runtime.md). `compile`: the graph
    holds DecodeStep (torch.compile of the code around attention, runtime/decode.py), else the model's forward.

    `top_k`, `repetition_penalty`: transformers' logits processors (`processors`); `stop_strings`: stop once the
    text ends with one of them (transformers' StopStringCriteria; needs `tokenizer`; the string is kept, as
    model.generate keeps it). A `cache` that already holds tokens continues them: `input_ids` is then the whole
    sequence, of which the cache holds a prefix (a chat's earlier turns), and only the rest is fed.

    `on_text` receives the decoded text as it grows (needs `tokenizer`). Returns the new token
    ids (EOS included if reached) and the statistics.
    """
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if not (isinstance(top_p, (int, float)) and 0 <= top_p <= 1):
        raise ValueError(f"top_p must lie in [0, 1], got {top_p!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a whole number >= 1, got {max_new_tokens!r}")
    if not (isinstance(top_k, int) and top_k >= 0):
        raise ValueError(f"top_k must be a whole number >= 0 (0: no limit), got {top_k!r}")
    if not (
        isinstance(repetition_penalty, (int, float)) and math.isfinite(repetition_penalty) and repetition_penalty > 0
    ):
        raise ValueError(f"repetition_penalty must be a finite number > 0 (1: none), got {repetition_penalty!r}")
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need the tokenizer")
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
    if ids.shape[1] == 0:
        raise ValueError("empty prompt")
    device = next(model.parameters()).device
    ids = ids.to(device)
    if cache is None:
        if static is None:  # the static cache + CUDA graphs, where the Triton kernel reads every level
            static = device.type == "cuda" and model.tale_spec.schedule.fast_path()
        cache = new_cache(model, static=static, max_length=ids.shape[1] + max_new_tokens if static else None)
    held = cache.get_seq_length()
    calls = cache.reference_calls.copy() if isinstance(cache, (TaleCache, StaticTaleCache)) else None
    if held >= ids.shape[1]:
        raise ValueError(f"the cache holds {held} tokens; the sequence to continue has {ids.shape[1]}")
    graphed = isinstance(cache, StaticTaleCache) and _graphs(device)
    stop = (
        eos_ids(model, tokenizer) if eos_token_id is None else set(torch.as_tensor(eos_token_id).reshape(-1).tolist())
    )
    gen = None
    if temperature > 0 and seed is not None:
        gen = torch.Generator(device=device).manual_seed(seed)
    stream = TextStream(tokenizer) if on_text is not None else None
    procs = processors(temperature, top_p, top_k, repetition_penalty)
    stopper = None
    if stop_strings:
        from transformers.generation import StopStringCriteria

        stopper = StopStringCriteria(tokenizer, list(stop_strings))
    seq = ids if repetition_penalty != 1.0 or stopper else None  # [1, L]: what the processors and stop strings read

    out: list[int] = []
    first_s, first_steps = 0.0, 0
    t0 = time.perf_counter()
    logits = model(input_ids=ids[:, held:], **cache_arg(cache), use_cache=True, logits_to_keep=1).logits
    _sync(device)
    prefill_s = time.perf_counter() - t0
    decoder = graph_decoder(model, cache, compile=compile) if graphed else None
    pos = torch.full((1, 1), ids.shape[1], dtype=torch.long, device=device)
    step = torch.empty((1, 1), dtype=torch.long, device=device)  # [1, 1]: the token fed next
    t1 = time.perf_counter()
    try:
        while len(out) < max_new_tokens:
            # the GPU idles from here (the token's device-to-host copy waits for the step) until the next step is
            # launched: only what decides whether to feed the token runs in between, the rest after the launch
            tok = _next_token(logits[0, -1], temperature, top_p, gen, len(out), procs, seq)
            out.append(tok)
            if seq is not None:
                seq = torch.cat([seq, seq.new_tensor([[tok]])], 1)
            done = tok in stop or len(out) == max_new_tokens or (stopper is not None and bool(stopper(seq, None)[0]))
            if not done:  # never a step past the last token: the cache holds exactly the sequence (chat turns)
                step.fill_(tok)  # a kernel with the token as its argument: no host-to-device copy to wait for
                if decoder is not None:
                    logits = decoder(step, pos)[:, None]
                    pos += 1
                    if not first_steps and (decoder.graph is not None or decoder.error):
                        # the steps before the first replay: compile, an eager warm-up step, the graph's capture
                        _sync(device)
                        first_s, first_steps = time.perf_counter() - t1, len(out)
                else:
                    logits = model(input_ids=step, **cache_arg(cache), use_cache=True, logits_to_keep=1).logits
            if stream is not None and tok not in stop and (text := stream.push(tok)):
                on_text(text)
            if done:
                break
    except KeyboardInterrupt as e:  # Ctrl-C mid-generation: tale-run prints the stats of what was generated
        e.tale_stats = _stats(model, cache, ids.shape[1], len(out), prefill_s, time.perf_counter() - t1, held, calls)
        raise
    _sync(device)
    decode_s = time.perf_counter() - t1 if len(out) > 1 else 0.0
    if stream is not None and (text := stream.flush()):
        on_text(text)
    stats = _stats(model, cache, ids.shape[1], len(out), prefill_s, decode_s, held, calls)
    if not (decode_s and first_steps):
        return out, stats
    return out, replace(stats, first_step_s=first_s, first_steps=first_steps)


def _stats(
    model, cache, prompt: int, generated: int, prefill_s: float, decode_s: float, held: int = 0, calls=None
) -> GenStats:
    """`calls`: the cache's reference_calls before this generation (its stats count this generation's calls only)."""
    if not isinstance(cache, (TaleCache, StaticTaleCache)):  # transformers' cache (the full 16-bit baseline)
        full = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)
        half = sum(t.numel() * 2 for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)
        base = "full cache (base attention)"
        return GenStats(prompt, generated, prefill_s, decode_s, full, half, None, base, reused_tokens=held)
    mine = cache.reference_calls.since(calls) if calls is not None else cache.reference_calls
    return GenStats(
        prompt_tokens=prompt,
        generated_tokens=generated,
        prefill_s=prefill_s,
        decode_s=decode_s,
        cache_bytes=cache.nbytes(),
        baseline_bytes=cache.baseline_nbytes(),
        nominal_ratio=model.tale_spec.nominal_ratio(cache.schedule),
        attention=cache.backend_name,
        attention_calls=mine.calls,
        attention_reference=dict(mine.reference),
        reused_tokens=held,
    )
