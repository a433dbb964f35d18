"""`make demo`: its prompts are the bundled ones, and (slow) SmolLM2 answers both at the default
schedule, the long one from a fact that sits in the compressed middle of the TALE cache."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import tale_calib

ROOT = Path(__file__).resolve().parents[1]


def test_the_makefile_demo_uses_the_bundled_prompts():
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^PROMPT \?= (.*)$", make, re.M).group(1) == tale_calib.DEMO_PROMPT
    long = re.search(r"^LONG_PROMPT \?= (.*)$", make, re.M).group(1)
    assert (ROOT / long).resolve() == (tale_calib.ROOT / tale_calib.DEMO_LONG_PROMPT).resolve()
    assert re.search(r"^demo: convert run run-long$", make, re.M)


def test_the_long_prompt_plants_one_fact_in_its_middle():
    text = (tale_calib.ROOT / tale_calib.DEMO_LONG_PROMPT).read_text()
    assert text.count(tale_calib.DEMO_FACT) == 1 and text.count(tale_calib.DEMO_LONG_ANSWER) == 1
    assert 0.3 < text.index(tale_calib.DEMO_FACT) / len(text) < 0.7
    assert 7000 < len(text) < 11000  # about 2K SmolLM2 tokens


def _answer(model, tok, prompt: str, max_new_tokens: int):
    from tale_runtime import new_cache
    from tale_runtime.generate import generate
    from tale_runtime.textgen import encode

    ids = encode(tok, prompt, raw=False)
    cache = new_cache(model)
    out, stats = generate(model, ids, max_new_tokens=max_new_tokens, tokenizer=tok, cache=cache)
    return ids, tok.decode(out, skip_special_tokens=True), cache, stats


@pytest.mark.slow
def test_demo_answers_at_the_default_schedule(smollm2_artifact):
    from tale_runtime import load

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tok = load(smollm2_artifact, device="cpu", dtype=torch.bfloat16)
        s = model.tale_spec.schedule  # the lowrank preset: low-rank keys on one basis block (--group 3: all KV heads)
        assert s.key_rope == "pre" and s.levels[0].key_rank and s.key_blocks == 1
        _, short, _, _ = _answer(model, tok, tale_calib.DEMO_PROMPT, 10)
        assert f" {tale_calib.DEMO_ANSWER}" in short, short

        prompt = (tale_calib.ROOT / tale_calib.DEMO_LONG_PROMPT).read_text()
        ids, long, cache, stats = _answer(model, tok, prompt, 22)  # the answer restates the question first
    finally:
        torch.set_num_threads(threads)
    assert tale_calib.DEMO_LONG_ANSWER in long, long
    assert stats.ratio > 4
    # the fact's tokens lie in level 0, the compressed middle (after the sinks, before the recent levels)
    fact = tok(" " + tale_calib.DEMO_FACT, add_special_tokens=False).input_ids[1:-1]
    start = next(i for i in range(len(ids)) if ids[i : i + len(fact)] == fact)
    regions = cache.layers[0].lengths()
    level0 = (regions["sinks"], regions["sinks"] + regions["level0"])
    assert level0[0] <= start and start + len(fact) <= level0[1], (start, regions)
