"""Pass-key retrieval: a number hidden at some depth of a long held-out text, asked for at the end.

The samples are generated deterministically from the bundled held-out corpus and shipped in
tale_calib/tasks/passkey.jsonl (`python -m tale_eval.passkey` rewrites it). A policy prefills the
prompt (exact attention), then generates greedily through its cache: the answer has to be read
back from the compressed cache. Score: exact match of the first number generated.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import torch

import tale_calib
from tale_calib import documents, heldout_path
from tale_runtime.model import cache_arg

from .names import PASSKEY_DEPTHS as DEPTHS
from .names import PASSKEY_LENGTHS as LENGTHS
from .policies import Policy, reference_nbytes

TASKS = Path(tale_calib.__file__).parent / "tasks" / "passkey.jsonl"
HEAD = "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. The pass key is {key}. "
QUESTION = "\n\nWhat is the pass key? The pass key is"


def haystack(docs: list[str], first: int, chars: int) -> str:
    """Documents from `first` on (cycling), cut at the last sentence end before `chars` characters."""
    text, i = "", first
    while len(text) < chars:
        text += ("\n\n" if text else "") + docs[i % len(docs)]
        i += 1
    return text[: text.rfind(".", 0, chars) + 1]


def make_samples(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    docs = documents(heldout_path())
    out = []
    for length, chars in LENGTHS.items():
        for depth in DEPTHS:
            key = str(rng.randrange(10000, 100000))
            hay = haystack(docs, rng.randrange(len(docs)), chars)
            cut = hay.rfind(". ", 0, int(depth * len(hay))) + 1  # after a sentence
            prompt = HEAD + hay[:cut] + NEEDLE.format(key=key) + hay[cut:].lstrip() + QUESTION
            out.append(
                {
                    "id": f"{length}-d{round(depth * 100):02d}",
                    "length": length,
                    "depth": depth,
                    "prompt": prompt,
                    "answer": key,
                }
            )
    return out


def load_samples(
    path: Path = TASKS, lengths: tuple[str, ...] | None = None, depths: tuple[float, ...] | None = None
) -> list[dict]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [
        r
        for r in rows
        if (lengths is None or r["length"] in lengths)
        and (depths is None or any(abs(r["depth"] - d) < 1e-9 for d in depths))
    ]


def first_number(text: str) -> str | None:
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


@torch.inference_mode()
def run(model, tokenizer, samples: list[dict], policy: Policy, max_new_tokens: int = 8) -> dict:
    """Greedy answers through the policy's cache; accuracy and the measured ratio at the end."""
    correct, cache_bytes, base_bytes, answers = 0, 0, 0, []
    for s in samples:
        ids = tokenizer(s["prompt"], return_tensors="pt").input_ids.to(model.device)
        pattern = [ids.shape[1]] + [1] * (max_new_tokens - 1)
        cache = policy.build(model, pattern)
        logits = model(ids, **cache_arg(cache), use_cache=True, logits_to_keep=1).logits
        out = []
        for i in range(max_new_tokens):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            out.append(int(nxt))
            if i + 1 < max_new_tokens:
                logits = model(nxt, **cache_arg(cache), use_cache=True).logits
        text = tokenizer.decode(out, skip_special_tokens=True)
        ok = first_number(text) == s["answer"]
        correct += ok
        cache_bytes += policy.nbytes(cache)
        base_bytes += reference_nbytes(model, 1, sum(pattern))
        answers.append({"id": s["id"], "tokens": ids.shape[1], "output": text, "correct": ok})
    return {
        "accuracy": correct / len(samples),
        "correct": correct,
        "samples": len(samples),
        "ratio": base_bytes / cache_bytes,
        "answers": answers,
    }


if __name__ == "__main__":
    TASKS.parent.mkdir(exist_ok=True)
    TASKS.write_text("".join(json.dumps(r) + "\n" for r in make_samples()))
    print(f"wrote {TASKS}")
