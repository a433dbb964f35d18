"""tale_runtime.generate's decode loop: the greedy token read in one number, the graph decoder's branch (a stand-in
decoder on the CPU: CUDA graphs need a GPU), and the cache holding exactly the generated sequence."""

import importlib

import pytest
import torch
from tale_helpers import byte_tokenizer, talify, tiny_model

import tale_runtime.generate as gen
from tale_runtime import new_cache
from tale_runtime.load import _GraphedCall
from tale_runtime.model import cache_arg


def _reference(tm, prompt: list[int], n: int, static: bool, stop: set[int] = frozenset()) -> list[int]:
    """Greedy decoding step by step: the argmax of each step's logits as float32, the token fed as a new tensor."""
    cache = new_cache(tm, static=static, max_length=len(prompt) + n if static else None)
    ids = torch.tensor([prompt])
    out = []
    with torch.inference_mode():
        logits = tm(input_ids=ids, **cache_arg(cache), use_cache=True).logits
        while True:
            out.append(int(logits[0, -1].float().argmax()))
            if out[-1] in stop or len(out) == n:
                return out
            logits = tm(input_ids=torch.tensor([[out[-1]]]), **cache_arg(cache), use_cache=True).logits


@pytest.fixture(scope="module")
def models():
    tm = talify(tiny_model("llama"), 2)
    return {torch.float32: tm, torch.bfloat16: talify(tiny_model("llama", dtype=torch.bfloat16), 2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_greedy_tokens_are_each_steps_float32_argmax(models, dtype, static):
    """The loop reads the argmax in the logits' own dtype and feeds the token through a reused buffer: the same tokens
    as the float32 argmax fed as a new tensor each step, on both caches (eager steps on the CPU)."""
    tm = models[dtype]
    assert next(tm.parameters()).dtype == dtype
    prompt = torch.randint(1, 320, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    out, _ = gen.generate(tm, prompt, max_new_tokens=24, static=static, eos_token_id=[])
    assert out == _reference(tm, prompt, 24, static)
    assert len(set(out)) > 1  # not one token repeated: the comparison reads the logits


def test_greedy_refuses_non_finite_logits():
    for bad in (float("nan"), float("inf"), -float("inf")):
        for dtype in (torch.float32, torch.bfloat16):
            with pytest.raises(gen.NonFiniteLogits, match="generated token 3"):
                gen._next_token(torch.tensor([0.0, bad, 1.0], dtype=dtype), 0.0, 1.0, None, step=2, procs=[])
    assert gen._next_token(torch.tensor([0.0, 2.0, 2.0, 1.0], dtype=torch.bfloat16), 0.0, 1.0, None, procs=[]) == 1


class StandInDecoder:
    """What CudaGraphDecoder promises generate(), run as the model's forward: ids and positions read through static
    buffers, logits [B, V] in one buffer overwritten by the next call, `graph` set at the second step (the real
    decoder runs its first step eagerly and captures at the second)."""

    def __init__(self, model, cache):
        self.model, self.cache = model, cache
        self.ids = self.pos = self.logits = self.graph = self.error = None
        self.positions: list[int] = []

    def __call__(self, ids, position_ids):
        if self.ids is None:
            self.ids, self.pos = torch.empty_like(ids), torch.empty_like(position_ids)
        self.ids.copy_(ids)
        self.pos.copy_(position_ids)
        self.positions.append(int(self.pos[0]))
        assert int(self.pos[0]) == self.cache.get_seq_length()  # the token goes where the cache ends
        kw = dict(position_ids=self.pos, use_cache=True, logits_to_keep=1)
        logits = self.model(input_ids=self.ids, **cache_arg(self.cache), **kw).logits[:, -1]
        if self.logits is None:
            self.logits = torch.empty_like(logits)
        self.logits.copy_(logits)
        if len(self.positions) == 2:
            self.graph = "captured"
        return self.logits


def test_graph_decoder_branch(models, monkeypatch):
    """The loop's CUDA-graph branch: the same tokens and text as eager steps over the same cache type; a stop token ends
    it without a step past it (the cache holds prompt + generated - 1 tokens, as a chat's next turn needs); the first
    steps' time covers the steps up to the graph's first replay."""
    tm, tok = models[torch.float32], byte_tokenizer()
    prompt = torch.randint(1, 256, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    free, _ = gen.generate(tm, prompt, max_new_tokens=20, static=True, eos_token_id=[])
    decoders = []

    def graph_decoder(model, cache, compile=True):
        decoders.append(StandInDecoder(model, cache))
        return decoders[-1]

    monkeypatch.setattr(gen, "_graphs", lambda device: True)
    monkeypatch.setattr(gen, "graph_decoder", graph_decoder)
    pieces = []
    out, stats = gen.generate(
        tm, prompt, max_new_tokens=20, static=True, eos_token_id=[], tokenizer=tok, on_text=pieces.append
    )
    assert out == free and "".join(pieces) == tok.decode(out, skip_special_tokens=True)
    assert decoders[0].positions == list(range(30, 30 + 19))
    assert stats.first_steps == 2 and 0 < stats.first_step_s <= stats.decode_s
    assert "after the first 2 steps of" in stats.line()

    eos = free[7]
    stop = free.index(eos)
    cache = new_cache(tm, static=True, max_length=50)
    out, stats = gen.generate(tm, prompt, max_new_tokens=20, cache=cache, eos_token_id=eos)
    assert out == free[: stop + 1] and len(decoders[-1].positions) == stop
    assert cache.get_seq_length() == 30 + len(out) - 1


def test_model_generate_graphed_call(models, monkeypatch):
    """model.generate's decode steps through _GraphedCall (CUDA-graph replays on CUDA, a stand-in decoder here), over
    a static cache larger than the call needs (as bench_generate.py sizes them): the same sequences and logits as
    eager steps; the output around the decoder's logits buffer is built once and handed
    out again while the decoder returns that buffer."""
    tm = models[torch.float32]
    ids = torch.randint(1, 320, (1, 30), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=16, do_sample=False, output_logits=True, return_dict_in_generate=True)
    eager = tm.generate(ids, **cache_arg(new_cache(tm, static=True)), **kw)
    decoders, outputs = [], []

    def graph_decoder(model, cache, compile=True):  # made once per cache, like the real one
        if not decoders or decoders[-1].cache is not cache:
            decoders.append(StandInDecoder(model, cache))
        return decoders[-1]

    def call(self, *a, **k):
        outputs.append(real(self, *a, **k))
        return outputs[-1]

    real = _GraphedCall.__call__
    monkeypatch.setattr(importlib.import_module("tale_runtime.load"), "graph_decoder", graph_decoder)
    monkeypatch.setattr(_GraphedCall, "__call__", call)
    monkeypatch.setattr(type(tm), "_valid_auto_compile_criteria", lambda self, model_kwargs, config: True)
    graphed = tm.generate(ids, **cache_arg(new_cache(tm, static=True, max_length=64)), **kw)  # larger than needed
    assert len(decoders) == 1 and len(outputs) == 15
    assert torch.equal(graphed.sequences, eager.sequences) and len(set(graphed.sequences[0, 30:].tolist())) > 1
    assert all(torch.equal(a, b) for a, b in zip(graphed.logits, eager.logits))
    assert len({id(o) for o in outputs}) == 1 and outputs[0].logits.data_ptr() == decoders[0].logits.data_ptr()
