"""Decode-mode perplexity: prefill a prefix, then teacher-force the rest through the cache.

Every scored prediction is made by a decode call, so it reads the compressed past (with chunks
larger than 1, also the exact earlier tokens of its own chunk, as the runtime's multi-token path
does). The prefill's own prediction is not scored: it reads only exact states.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from tale_calib import TEST_FILES, documents, text_path
from tale_runtime.cache import call_pattern
from tale_runtime.generate import NonFiniteLogits
from tale_runtime.model import cache_arg


def heldout_windows(tokenizer, length: int, count: int, text: str = "dev") -> torch.Tensor:
    """The first `count` non-overlapping windows of `length` tokens of a held-out text
    (tale_calib.text_path: "dev" or a test text; or a path to a file of documents): [count, length]."""
    body = "\n\n".join(documents(text_path(text) if text in ("dev", *TEST_FILES) else Path(text)))
    ids = torch.tensor(tokenizer(body, add_special_tokens=False).input_ids)
    have = len(ids) // length
    if have < count:
        raise ValueError(f"the held-out text {text!r} has {len(ids)} tokens: {have} windows of {length}, not {count}")
    return ids[: count * length].view(count, length)


def pattern(length: int, prefill: int, chunk: int) -> list[int]:
    """Tokens per forward call (tale_runtime.cache.call_pattern), for a run that scores at least one decode call."""
    if not 0 < prefill < length - 1 or chunk < 1:
        raise ValueError(
            f"need 0 < prefill < length - 1 and chunk >= 1 (length {length}, prefill {prefill}, chunk {chunk})"
        )
    return call_pattern(length, prefill, chunk)


@torch.inference_mode()
def decode_nll(model, ids: torch.Tensor, cache: Cache, prefill: int, chunk: int) -> tuple[float, int]:
    """Summed NLL and count of the targets ids[:, prefill+1:], each predicted by a decode call."""
    ids = ids.to(model.device)
    model(ids[:, :prefill], **cache_arg(cache), use_cache=True, logits_to_keep=1)
    nll, count, s = 0.0, 0, prefill
    for T in pattern(ids.shape[1], prefill, chunk)[1:]:
        logits = model(ids[:, s : s + T], **cache_arg(cache), use_cache=True).logits
        target = ids[:, s + 1 : s + T + 1]
        nll += F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), reduction="sum").item()
        if not math.isfinite(nll):  # NaN would otherwise become a NaN perplexity in a table
            raise NonFiniteLogits(f"the decode call at token {s}")
        count += target.numel()
        s += T
    return nll, count


@torch.inference_mode()
def forward_nll(model, ids: torch.Tensor, prefill: int) -> tuple[float, int]:
    """The same targets scored by one plain forward pass without a cache."""
    ids = ids.to(model.device)
    logits = model(ids, use_cache=False).logits[:, prefill:-1]
    target = ids[:, prefill + 1 :]
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), reduction="sum").item(), target.numel()
