"""DecodeStep (runtime/decode.py): the decode step written out per layer, the code around TALE attention compiled.

On the CPU the compiled pieces are traced by dynamo with the "eager" backend (what inductor would get, without
its code generation): the step must give the model's own forward logits bit for bit, and one graph per piece must
serve every layer. On CUDA, the captured compiled step against eager steps (skipped without a GPU)."""

import pytest
import torch
from tale_helpers import talify, tiny_model

from tale_runtime import new_cache
from tale_runtime.artifact import Level, Schedule, uniform_ranks
from tale_runtime.decode import CudaGraphDecoder, DecodeStep, supports_step
from tale_runtime.model import cache_arg


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles its own models: without a reset, guards of earlier tests' models pile up on the same
    code objects until dynamo's recompile limit (8) fails a later test."""
    torch._dynamo.reset()


def _run(tm, step_fn, ids, mask, feed, max_length):
    """Prefill (batch 2, left padding) into a static cache, then teacher-forced decode steps -> logits [B, S, V]."""
    cache = new_cache(tm, static=True, max_length=max_length)
    with torch.inference_mode():
        tm(input_ids=ids, attention_mask=mask, **cache_arg(cache), use_cache=True)
        step = step_fn(tm, cache)
        pos = mask.sum(-1, keepdim=True)
        out = []
        for t in range(feed.shape[1]):
            out.append(step(feed[:, t : t + 1], pos).float().clone())
            pos += 1
    return torch.stack(out, 1)


def _forward(tm, cache):
    def step(ids, pos):
        return tm(input_ids=ids, position_ids=pos, **cache_arg(cache), use_cache=True).logits[:, -1]

    return step


def _inputs(device="cpu", steps=40):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 320, (2, 30), generator=gen)
    mask = torch.ones_like(ids)
    ids[1, :7], mask[1, :7] = 0, 0
    feed = torch.randint(1, 320, (2, steps), generator=gen)
    return ids.to(device), mask.to(device), feed.to(device)


@pytest.mark.parametrize(
    "arch,g,rotate",
    [("llama", 2, None), ("llama", 2, "hadamard"), ("qwen2", 4, None), ("mistral", 2, None), ("phi3", 1, None)],
)
def test_step_gives_the_forwards_logits(arch, g, rotate):
    """Through flushes and demotions (40 steps, residual 8), left padding, value bias (Qwen2), a sliding window
    (Mistral, 24 < prompt + steps), rotated keys, a fused qkv_proj with partial rotary (Phi-3): the same logits as the
    model's forward, bit for bit."""
    base = tiny_model(arch)
    if arch == "mistral":
        base.config.sliding_window = 24
    sched = None
    if rotate:
        sched = Schedule(
            ranks=uniform_ranks(32, 2, 0.5, value_group=8), key_group=8, value_group=8, residual=8, rotate=rotate
        )
    tm = talify(base, g, sched)
    assert supports_step(tm)
    ids, mask, feed = _inputs()
    want = _run(tm, _forward, ids, mask, feed, 80)
    got = _run(tm, lambda m, c: DecodeStep(m, c, backend="eager"), ids, mask, feed, 80)
    assert torch.equal(got, want)


def test_step_over_low_rank_keys_gives_the_forwards_logits():
    """The lowrank preset's layout on the static cache (keys before RoPE, whose tables the step hands the cache;
    low-rank middle keys on a fitted basis, per-token newest keys, fp8 scales, a residual of 1): the step gives the
    forward's logits bit for bit."""
    from test_key_rank import fitted

    s = Schedule(
        levels=[Level(3, 4, None, key_rank=24), Level(4, 4, 0.1), Level(8, 8, 0.0, key_axis="token")],
        ranks=[[16, 32, 32]] * 2,
        key_group=8,
        value_group=8,
        residual=1,
        key_meta="8/8",
        value_meta="8/8",
        key_channel_group=16,
        key_rope="pre",
    )
    tm = talify(tiny_model("llama"), 2, s)
    ids, mask, feed = _inputs(steps=12)  # a flush every step, a demotion from the per-token level every 8
    tm.tale_spec.key_basis = fitted(tm, [feed])
    want = _run(tm, _forward, ids, mask, feed, 42)
    got = _run(tm, lambda m, c: DecodeStep(m, c, backend="eager"), ids, mask, feed, 42)
    assert torch.equal(got, want)


def test_one_graph_per_piece_for_all_layers(monkeypatch):
    """Dynamo traces each piece once for all layers (their modules are graph inputs, not constants): embed,
    pre-attention (first layer, then the others with the pending MLP add), post-attention, head = 5 graphs for
    4 layers, and the graphs are whole (fullgraph=True would raise on a break)."""
    from tale_helpers import TINY
    from torch._dynamo.utils import counters

    monkeypatch.setitem(TINY["llama"], "num_hidden_layers", 4)
    tm = talify(tiny_model("llama"), 2)
    ids, mask, feed = _inputs(steps=10)
    torch._dynamo.reset()
    counters.clear()
    _run(tm, lambda m, c: DecodeStep(m, c, backend="eager"), ids, mask, feed, 50)
    assert len(tm.model.layers) == 4 and counters["stats"]["unique_graphs"] == 5


def test_warm_compiles_every_piece_and_leaves_the_cache_alone():
    """`warm` (what CudaGraphDecoder runs before the first step) traces all 5 graphs on the step's shapes, so the
    steps that follow compile nothing, and it neither reads nor writes the cache's contents or counts."""
    from torch._dynamo.utils import counters

    tm = talify(tiny_model("llama"), 2)
    ids, mask, feed = _inputs(steps=3)
    cache = new_cache(tm, static=True, max_length=40)
    with torch.inference_mode():
        tm(input_ids=ids, attention_mask=mask, **cache_arg(cache), use_cache=True)
        before = [t.clone() for t in cache_tensors(cache)]
        book = dict(vars(cache.book))
        torch._dynamo.reset()
        counters.clear()
        step = DecodeStep(tm, cache, backend="eager")
        pos = mask.sum(-1, keepdim=True)
        step.warm(feed[:, :1], pos)
        assert counters["stats"]["unique_graphs"] == 5
        assert dict(vars(cache.book)) == book
        assert all(torch.equal(a, b) for a, b in zip(before, cache_tensors(cache), strict=True))
        step(feed[:, :1], pos)
    assert counters["stats"]["unique_graphs"] == 5


def test_a_new_cache_of_the_same_model_compiles_nothing():
    """model.generate makes a cache per call: the second cache's DecodeStep reuses the first one's compiled pieces
    (compiled once per model and process), while another model compiles its own."""
    from torch._dynamo.utils import counters

    tm = talify(tiny_model("llama"), 2)
    ids, mask, feed = _inputs(steps=3)
    pos = mask.sum(-1, keepdim=True)
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    for model in (tm, tm, talify(tiny_model("llama", seed=1), 2)):
        cache = new_cache(model, static=True, max_length=40)
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=mask, **cache_arg(cache), use_cache=True)
            step = DecodeStep(model, cache, backend="eager")
            step.warm(feed[:, :1], pos)
            step(feed[:, :1], pos)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [5, 5, 10]


def test_many_models_in_one_process_each_compile():
    """Dynamo's recompile limit (8 graphs per code object) counts per DecodeStep, not per process: models of six
    shapes and dtypes in a row all compile (with the pieces shared, the fifth failed under fullgraph)."""
    for i, (arch, dtype) in enumerate(
        [(a, d) for a in ("llama", "mistral", "qwen2") for d in (torch.float32, torch.bfloat16)]
    ):
        tm = talify(tiny_model(arch, seed=i), 1 + i % 2).to(dtype)
        cache = new_cache(tm, static=True, max_length=20)
        ids = torch.randint(1, 100, (1, 8), generator=torch.Generator().manual_seed(i))
        with torch.inference_mode():
            tm(input_ids=ids, **cache_arg(cache), use_cache=True)
            DecodeStep(tm, cache, backend="eager").warm(ids[:, -1:], torch.tensor([[8]]))


def cache_tensors(cache):
    """Every tensor the static cache holds: its device counters and its layers' codes, scales and positions."""

    def walk(v):
        if isinstance(v, torch.Tensor):
            return [v]
        if isinstance(v, (list, tuple)):
            return [t for x in v for t in walk(x)]
        if hasattr(v, "__dataclass_fields__"):
            return [t for f in v.__dataclass_fields__ for t in walk(getattr(v, f))]
        return []

    out = walk([cache.lens, cache.next_pos, cache.res_slot])
    for layer in cache.layers:
        out += walk(list(vars(layer).values()))
    assert len(out) > 3 * len(cache.layers)  # the walk reached the layers' tensors
    return out


def test_unsupported_models_keep_the_forward():
    """A model without TALE attention, or whose layer is not Llama's (Gemma 3): DecodeStep refuses it,
    CudaGraphDecoder falls back to the model's forward."""
    assert not supports_step(talify(tiny_model("gemma3"), 2))
    base = tiny_model("llama")
    assert not supports_step(base)
    with pytest.raises(ValueError, match="Llama-style decoder layers"):
        DecodeStep(base, None)
    tm = talify(base, 2)
    cache = new_cache(tm, static=True, max_length=40)
    with torch.inference_mode():
        tm(input_ids=torch.ones(1, 5, dtype=torch.long), **cache_arg(cache), use_cache=True)
    assert CudaGraphDecoder(tm, cache).step is not None
    assert CudaGraphDecoder(tm, cache, compile=False).step is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled CUDA-graph steps need CUDA")
def test_compiled_graph_steps_match_eager_steps():
    """On CUDA (inductor): the captured compiled step replays exactly what the compiled step computes eagerly,
    and stays within float32 rounding of the model's forward, with the same greedy tokens."""
    tm = talify(tiny_model("llama"), 2).cuda()
    ids, mask, feed = _inputs("cuda")
    want = _run(tm, _forward, ids, mask, feed, 80)
    step = _run(tm, DecodeStep, ids, mask, feed, 80)
    decoders = []

    def graphed(m, c):
        decoders.append(CudaGraphDecoder(m, c))
        return decoders[-1]

    got = _run(tm, graphed, ids, mask, feed, 80)
    d = decoders[0]
    assert d.step is not None and d.compile_error is None and d.graph is not None and d.error is None
    assert torch.equal(got, step)
    assert float((got - want).norm() / want.norm()) < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))
