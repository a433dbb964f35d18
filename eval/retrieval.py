"""Long-context retrieval: RULER's synthetic task families, generated locally from a seed and a tokenizer.

Families (RULER's templates and defaults, Hsieh et al. 2024):
- `niah_single`: one needle "One of the special magic numbers for {key} is: {value}." in the haystack, asked for.
- `niah_multikey`: four needles with different keys; one of them asked for (the others distract).
- `niah_multivalue`: four needles with the same key; all four values asked for.
- `niah_multiquery`: four needles with different keys; all four asked for at once.
- `vt`: variable tracking, one chain of four hops ("VAR ABCDE = 12345", "VAR FGHIJ = VAR ABCDE", ...) spread
  over the haystack; every variable holding the value asked for.
- `cwe`: common-word extraction, a numbered list of words where ten appear 30 times (fewer below 4K tokens) and
  the others 3 times; the ten asked for.

Keys are adjective-noun pairs, values 7-digit numbers (RULER's `words`/`numbers` needles). Haystacks are the
held-out DEV text (`tale_calib.heldout_path()`, never used for calibration, never a test text), cycled from a
random document; CWE's words are that text's own words. A sample's prompt, with the answer prefix, fills
`length - NEW_TOKENS[family]` tokens of the given tokenizer, cut at a word to within a few tokens (the DEV text
repeats past ~6K SmolLM2 tokens); needles sit at the sentence end nearest to their depth in the haystack. Scoring is RULER's `string_match_all`: the share of the
expected answers found (case-insensitive) in the generated text.

The prompt is prefilled exactly (every policy but Palu), then the answer is generated greedily through the
cache, so it has to be read back from compressed entries. Policies whose prefill is exact share one prefill per
sample: the prefill runs once with the full cache, and each policy's cache is filled from the recorded inputs of
every attention layer (its projections only: the attention itself and the MLPs are not recomputed).
"""

from __future__ import annotations

import random
import re
from functools import lru_cache

import torch

from tale_calib import documents, heldout_path
from tale_runtime.model import cache_arg

from . import caches
from .names import RETRIEVAL_FAMILIES
from .policies import Policy, reference_nbytes

FAMILIES = RETRIEVAL_FAMILIES
NEW_TOKENS = {  # greedy tokens generated per sample (RULER: 128 for NIAH, 30 for VT, 120 for CWE; shorter here)
    "niah_single": 16,
    "niah_multikey": 16,
    "niah_multivalue": 48,
    "niah_multiquery": 48,
    "vt": 32,
    "cwe": 64,
}
NEEDLES = 4  # needles of the multi-key / multi-value / multi-query families (RULER's default)
HOPS = 4  # variable tracking: assignments after the first
COMMON, COMMON_FREQ, RARE_FREQ = 10, 30, 3  # CWE (RULER's defaults at 4K and above)

NIAH_HEAD = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n"
)
NIAH_NEEDLE = "One of the special magic numbers for {key} is: {value}."
NIAH_QUESTION = (
    "\nWhat are all the special magic numbers for {query} mentioned in the provided text?"
    " The special magic numbers for {query} mentioned in the provided text are"
)
VT_HEAD = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_QUESTION = (
    "\nQuestion: Find all variables that are assigned the value {value} in the text above. Answer: According to "
    "the chain(s) of variable assignment in the text above, {count} variables are assigned the value {value}, "
    "they are:"
)
CWE_HEAD = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n"
)
CWE_QUESTION = (
    "\nQuestion: What are the {count} most common words in the above list? Answer: The top {count} words that "
    "appear most often in the list are:"
)

ADJECTIVES = (
    "amber ancient bitter brave brisk calm clever crooked dusty eager faint fierce gentle gloomy hollow humble "
    "icy jolly lazy lucky mellow misty narrow noisy odd pale proud quiet rapid rusty silent sly sour steep "
    "swift tame tidy vivid wary wicked"
).split()
NOUNS = (
    "anchor badger barrel beacon bison bramble candle canyon cedar comet copper falcon ferry fiddle garnet "
    "harbor hazel jackal kettle lantern ledger magpie marble meadow otter pebble pigeon quarry raven saddle "
    "spindle thistle timber trumpet tunnel velvet walnut willow"
).split()
LENGTHS = {"1k": 1024, "2k": 2048, "4k": 4096, "8k": 8192}


def parse_length(s: str) -> int:
    """Tokens of a retrieval length: 1k, 2k, 4k, 8k or a number of tokens."""
    if s in LENGTHS:
        return LENGTHS[s]
    if s.isdigit() and int(s) > 0:
        return int(s)
    raise ValueError(f"unknown retrieval length {s!r}: use {', '.join(LENGTHS)} or a number of tokens")


def length_name(tokens: int) -> str:
    return next((k for k, v in LENGTHS.items() if v == tokens), str(tokens))


def depth_of(index: int) -> float:
    """The needle depth of the index-th sample: spread over 0.05 .. 0.95 for any number of samples."""
    return round(0.05 + 0.9 * ((0.5 + index * 0.6180339887) % 1.0), 3)


@lru_cache(maxsize=1)
def _docs() -> tuple[str, ...]:
    return tuple(" ".join(d.split()) for d in documents(heldout_path()))  # one line per document


@lru_cache(maxsize=1)
def _vocabulary() -> tuple[str, ...]:
    """The DEV text's distinct words of 4+ letters (lowercase), in order of first appearance, but the template's."""
    template = set(re.findall(r"[a-z]+", (CWE_HEAD + CWE_QUESTION).lower()))  # an echo of the question scores 0
    words = (w.lower() for w in re.findall(r"[A-Za-z]+", " ".join(_docs())))
    return tuple(w for w in dict.fromkeys(words) if len(w) >= 4 and w not in template)


def _haystack(rng: random.Random, chars: int) -> str:
    docs, i = _docs(), rng.randrange(len(_docs()))
    text = ""
    while len(text) < chars:
        text += (" " if text else "") + docs[i % len(docs)]
        i += 1
    return text


def _insert(hay: str, needles: list[str], depths: list[float]) -> str:
    """The needles placed at the sentence end nearest to each depth (a fraction of hay's characters)."""
    ends = [0] + [m.end() for m in re.finditer(r"[.!?][\"')]?(?= )", hay)]
    cuts = [min(ends, key=lambda e: abs(e - d * len(hay))) for d in depths]
    out, last = [], 0
    for cut, needle in sorted(zip(cuts, needles), key=lambda x: x[0]):
        out += [hay[last:cut], " " + needle + " " if cut else needle + " "]
        last = cut
    out.append(hay[last:].lstrip())
    return "".join(out).strip()


def _fit(count, build, budget: int, hi: int):
    """The largest n in [0, hi] whose build(n) holds at most `budget` tokens (count: tokens of a prompt)."""
    lo = 0
    if count(build(0)) > budget:
        raise ValueError(f"a retrieval prompt of {budget} tokens cannot hold the task's template and needles")
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(build(mid)) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _key(rng: random.Random, taken: set[str]) -> str:
    while True:
        k = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if k not in taken:
            taken.add(k)
            return k


def _number(rng: random.Random, taken: set[str], digits: int = 7) -> str:
    while True:
        v = str(rng.randrange(10 ** (digits - 1), 10**digits))
        if v not in taken:
            taken.add(v)
            return v


def _query(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def make_sample(family: str, tokenizer, length: int, index: int, seed: int = 0) -> dict:
    """The index-th sample of a family at `length` tokens: deterministic for (family, length, index, seed) and the
    tokenizer. Keys: id, family, length, depth, prompt, answers, context (the haystack's [start, end) characters in
    the prompt), needles (the planted sentences, in the order of `depths`), depths, max_new_tokens."""
    if family not in FAMILIES:
        raise ValueError(f"unknown retrieval task {family!r}: use {', '.join(FAMILIES)}")
    rng = random.Random(f"{family}/{length}/{index}/{seed}")
    budget = length - NEW_TOKENS[family]

    def count(prompt: str) -> int:
        return len(tokenizer(prompt, add_special_tokens=False).input_ids)

    depth = depth_of(index)
    if family == "cwe":
        return _cwe(rng, count, length, budget, index, seed)
    taken_k, taken_v = set(), set()
    if family == "vt":
        names = set()
        while len(names) < HOPS + 1:
            names.add("".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)))
        names = rng.sample(sorted(names), HOPS + 1)
        value = _number(rng, taken_v, 5)
        needles = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        depths = [round(0.05 + 0.9 * i / HOPS, 3) for i in range(HOPS + 1)]  # in order along the text
        head, question, answers = VT_HEAD, VT_QUESTION.format(value=value, count=HOPS + 1), names
        depth = depths[0]
    else:
        n = 1 if family == "niah_single" else NEEDLES
        keys = [_key(rng, taken_k)] * n if family == "niah_multivalue" else [_key(rng, taken_k) for _ in range(n)]
        values = [_number(rng, taken_v) for _ in range(n)]
        needles = [NIAH_NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)]
        if n == 1:
            depths = [depth]
        else:  # spread over the text, starting at the sample's depth; the order of the keys is random
            depths = [round(0.05 + ((depth - 0.05 + i * 0.9 / n) % 0.9), 3) for i in range(n)]
        if family == "niah_multikey":
            asked = [0]  # the needle at the sample's depth; the others have other keys
        else:
            asked = list(range(n))
        query = _query([keys[i] for i in asked] if family != "niah_multivalue" else keys[:1])
        head, question = NIAH_HEAD, NIAH_QUESTION.format(query=query)
        answers = [values[i] for i in asked]
    hay = _haystack(rng, 8 * length)
    spaces = [m.start() for m in re.finditer(" ", hay)]

    def build(words: int) -> str:
        return head + _insert(hay[: spaces[words - 1]] if words else "", needles, depths) + question

    words = _fit(count, build, budget, len(spaces))
    context = _insert(hay[: spaces[words - 1]] if words else "", needles, depths)
    return {
        "id": f"{family}-{length_name(length)}-{index}",
        "family": family,
        "length": length,
        "depth": depth,
        "prompt": head + context + question,
        "answers": answers,
        "context": [len(head), len(head) + len(context)],
        "needles": needles,
        "depths": depths,
        "max_new_tokens": NEW_TOKENS[family],
    }


def _cwe(rng: random.Random, count, length: int, budget: int, index: int, seed: int) -> dict:
    vocab = list(_vocabulary())
    rng.shuffle(vocab)
    common, rare_pool = vocab[:COMMON], vocab[COMMON:]
    freq = COMMON_FREQ if length >= 4096 else max(RARE_FREQ + 2, COMMON_FREQ * length // 4096)

    def build(rare: int) -> str:
        w = [x for x in common for _ in range(freq)] + [x for x in rare_pool[:rare] for _ in range(RARE_FREQ)]
        random.Random(f"cwe-order/{length}/{index}/{seed}/{rare}").shuffle(w)
        return CWE_HEAD + " ".join(f"{i + 1}. {x}" for i, x in enumerate(w)) + CWE_QUESTION.format(count=COMMON)

    rare = _fit(count, build, budget, len(rare_pool))
    # a word more reshuffles the list, so the count is not quite monotone in it: try the next few too
    rare = max((n for n in range(rare, min(rare + 4, len(rare_pool)) + 1) if count(build(n)) <= budget), default=rare)
    prompt = build(rare)
    return {
        "id": f"cwe-{length_name(length)}-{index}",
        "family": "cwe",
        "length": length,
        "depth": None,
        "prompt": prompt,
        "answers": common,
        "context": [len(CWE_HEAD), len(prompt) - len(CWE_QUESTION.format(count=COMMON))],
        "needles": [],
        "depths": [],
        "max_new_tokens": NEW_TOKENS["cwe"],
    }


def make_samples(
    tokenizer, lengths: tuple[int, ...], families: tuple[str, ...] = FAMILIES, samples: int = 1, seed: int = 0
) -> list[dict]:
    """Round by round (every family's i-th sample before any (i+1)-th): a run cut short is still balanced."""
    return [make_sample(f, tokenizer, n, i, seed) for n in lengths for i in range(samples) for f in families]


def score(output: str, answers: list[str]) -> float:
    """RULER's string_match_all: the share of the answers found in the output, case-insensitive."""
    out = output.lower()
    return sum(a.lower() in out for a in answers) / len(answers)


class _Recorder:
    """Records the inputs of every attention layer during one forward (forward pre-hooks)."""

    def __init__(self, model):
        self.calls: list[tuple[tuple, dict]] = []
        self.hooks = [
            layer.self_attn.register_forward_pre_hook(self._hook, with_kwargs=True) for layer in model.model.layers
        ]

    def _hook(self, module, args, kwargs):
        self.calls.append((args, dict(kwargs)))

    def remove(self):
        for h in self.hooks:
            h.remove()


def _skip_attention(q, k, v, attention_mask, **kwargs):
    return None, None


@torch.inference_mode()
def replay_prefill(model, cache, calls: list[tuple[tuple, dict]]) -> None:
    """Fills `cache` as a prefill would, from the recorded inputs of each attention layer: each layer projects its
    keys, values and latents and writes them, its attention output (the same for every such policy) is skipped."""
    for layer, (args, kwargs) in zip(model.model.layers, calls):
        attn = layer.self_attn
        kwargs = dict(kwargs, past_key_values=cache) | ({"cache": cache} if "cache" in kwargs else {})
        attn.tale.attend_exact = _skip_attention  # the instance's, over the class's method
        try:
            attn(*args, **kwargs)
        finally:
            del attn.tale.attend_exact


@torch.inference_mode()
def _greedy(model, first: torch.Tensor, cache, steps: int) -> list[int]:
    """`steps` greedy tokens through the cache, from the prefill's last logits `first` [1, vocab]."""
    nxt, out = first.argmax(-1, keepdim=True), []
    for i in range(steps):
        out.append(int(nxt))
        if i + 1 < steps:
            nxt = model(nxt, **cache_arg(cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    return out


@torch.inference_mode()
def run(
    model, tokenizer, samples: list[dict], pols: list[Policy], log=print, share: bool = True, on_sample=None
) -> list[dict]:
    """Every sample through every policy: per policy {score, tasks ("LENGTH/FAMILY" -> mean score), ratio, answers}.

    Policies with an exact prefill share one prefill per sample (`share`): the prompt runs once with the full
    cache, its last logits give the first token, and each policy's cache is filled from the recorded layer inputs
    (replay_prefill). The others prefill on their own. `on_sample(sample, per_policy)`: called after each sample
    with each policy's output, score and bytes (cache, 16-bit baseline)."""
    acc = [{"scores": {}, "cache": 0, "base": 0, "answers": []} for _ in pols]
    for s in samples:
        ids = tokenizer(s["prompt"], return_tensors="pt").input_ids.to(model.device)
        T, steps = ids.shape[1], s["max_new_tokens"]
        pattern = [T] + [1] * (steps - 1)
        shared = None
        line, done = [], {}
        for pol, a in zip(pols, acc):
            cache = pol.build(model, pattern)
            if share and pol.exact_prefill:
                if shared is None:
                    rec = _Recorder(model)
                    try:
                        logits = model(
                            ids,
                            **cache_arg(caches.full_cache(model.tale_spec.arch.num_layers)),
                            use_cache=True,
                            logits_to_keep=1,
                        )
                    finally:
                        rec.remove()
                    shared = logits.logits[:, -1], rec.calls
                replay_prefill(model, cache, shared[1])
                first = shared[0]
            else:
                first = model(ids, **cache_arg(cache), use_cache=True, logits_to_keep=1).logits[:, -1]
            out = _greedy(model, first, cache, steps)
            text = tokenizer.decode(out, skip_special_tokens=True)
            sc = score(text, s["answers"])
            a["scores"].setdefault(f"{length_name(s['length'])}/{s['family']}", []).append(sc)
            base = reference_nbytes(model, 1, sum(pattern))
            nbytes = pol.nbytes(cache)
            a["cache"] += nbytes
            a["base"] += base
            a["answers"].append({"id": s["id"], "tokens": T, "output": text, "score": sc})
            line.append(f"{pol.name} {sc:.2f}")
            done[pol.name] = {"output": text, "score": sc, "bytes": nbytes, "base": base}
        log(f"retrieval {s['id']} ({T} tokens): " + ", ".join(line))
        if on_sample:
            on_sample(s, done)
    res = []
    for a in acc:
        tasks = {k: sum(v) / len(v) for k, v in a["scores"].items()}
        res.append(
            {
                "score": sum(tasks.values()) / len(tasks) if tasks else 0.0,
                "tasks": tasks,
                "samples": len(samples),
                "ratio": a["base"] / a["cache"] if a["cache"] else float("nan"),
                "answers": a["answers"],
            }
        )
    return res
