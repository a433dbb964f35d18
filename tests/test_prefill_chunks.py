"""The prefill in pieces (runtime/model.py chunked_prefill): a prompt longer than the model's prefill chunk runs each
decoder layer over pieces of it, with the same math as one piece (float32 on the CPU): every position's logits to
~1e-6, every tensor of the cache (codes, scales, positions, RoPE tables) equal, the same greedy tokens through
model.generate and tale_runtime.generate; and its peak memory per prompt token, measured by the same tracker as
benchmarks/prefill_memory.py, a fraction of one piece's."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tale_helpers import talify, tiny_model
from test_runtime import ids_for, left_pad, schedule_for

from tale_runtime import new_cache, set_prefill_chunk
from tale_runtime.artifact import Level
from tale_runtime.generate import generate
from tale_runtime.model import PREFILL_CHUNK, cache_arg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import prefill_memory  # noqa: E402  (the tracker of live tensor bytes)

T = 45  # pieces of 16: 16, 16, 13 (the last one short)


def state(obj, path: str = "cache", out: dict | None = None, seen: set | None = None) -> dict[str, torch.Tensor]:
    """Every tensor a cache holds, by where it sits (its layers, regions, quantized codes, positions, tables)."""
    out, seen = ({} if out is None else out), (set() if seen is None else seen)
    if isinstance(obj, torch.Tensor):
        out[path] = obj
    elif id(obj) in seen:
        return out
    elif isinstance(obj, (list, tuple)):
        seen.add(id(obj))
        for i, v in enumerate(obj):
            state(v, f"{path}[{i}]", out, seen)
    elif isinstance(obj, dict):
        seen.add(id(obj))
        for k, v in obj.items():
            state(v, f"{path}[{k!r}]", out, seen)
    elif type(obj).__module__.startswith("tale_runtime") and hasattr(obj, "__dict__"):
        seen.add(id(obj))
        for k, v in vars(obj).items():
            state(v, f"{path}.{k}", out, seen)
    return out


def same_cache(a, b) -> None:
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    assert len(sa) > 10
    for k in sa:
        x, y = sa[k], sb[k]
        assert x.shape == y.shape and x.dtype == y.dtype, k
        if x.is_floating_point():
            assert torch.allclose(x, y, rtol=1e-5, atol=1e-6), k
        else:
            assert torch.equal(x, y), k


@torch.no_grad()
def prefill(tm, ids, chunk: int, mask=None, **cache_kw):
    """All positions' logits [B, T, V] of one forward over a fresh cache, prefilled in pieces of `chunk` (0: one);
    checks that every layer ran every piece."""
    set_prefill_chunk(tm, chunk)
    cache = new_cache(tm, **cache_kw)
    seen = []
    hooks = [layer.mlp.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[1])) for layer in tm.model.layers]
    try:
        logits = tm(input_ids=ids, attention_mask=mask, **cache_arg(cache), use_cache=True, logits_to_keep=0).logits
    finally:
        for h in hooks:
            h.remove()
    T, L = ids.shape[1], tm.config.num_hidden_layers
    pieces = [min(chunk, T - s) for s in range(0, T, chunk)] if chunk else [T]
    assert seen == pieces * L
    return logits, cache


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


CASES = [
    ("llama", 2, False),
    ("llama", 2, True),
    ("qwen2", 4, False),  # a value bias, 3 query heads per KV head
    ("qwen3", 2, True),  # per-head q/k norms
    ("mistral", 2, False),  # a window of 12 under the prompt: the layers get a 4D mask, cut to each piece's rows
    ("gemma3", 2, True),  # a sliding layer (window 24, its own RoPE tables) and a global one; static: its ring
    ("phi3", 2, False),  # fused qkv and gate_up, partial rotary
]


@pytest.mark.parametrize("arch,g,static", CASES, ids=[f"{a}-{'static' if s else 'dynamic'}" for a, _, s in CASES])
def test_pieces_give_the_logits_and_the_cache_of_one_piece(arch, g, static):
    base = tiny_model(arch)
    if arch == "mistral":
        base.config.sliding_window = 12
    tm = talify(base, g)
    tm.tale_spec.schedule = schedule_for(tm, sinks=2)  # lossy: quantized levels, demotions
    ids = ids_for(T)
    kw = dict(static=True, max_length=T + 8) if static else {}
    one, c1 = prefill(tm, ids, 0, **kw)
    pieces, c2 = prefill(tm, ids, 16, **kw)
    assert rel(pieces, one) < 1e-6
    same_cache(c2, c1)
    # and the next steps read the same cache
    with torch.no_grad():
        nxt = one[:, -1:].argmax(-1)
        a = tm(input_ids=nxt, **cache_arg(c1), use_cache=True).logits
        b = tm(input_ids=nxt, **cache_arg(c2), use_cache=True).logits
    assert rel(b, a) < 1e-6


def test_pieces_with_key_rope_pre_salient_keys_and_a_rotation():
    """The RoPE tables (key_rope "pre"), the observation window of keep="salient" (the last key_group queries, which
    span two pieces here), and the Hadamard rotation of the keys: the same cache."""
    tm = talify(tiny_model("llama"), 2)
    levels = [Level(2, 2, None), Level(4, 4, 0.2), Level(8, 8, 0.2)]
    lossy = schedule_for(tm, sinks=2, levels=levels, ranks=[[16, 32, 32]] * 2)
    ids = ids_for(T)
    for sched, kw in (
        (replace(lossy, key_rope="pre"), {}),
        (replace(lossy, key_rope="pre"), dict(static=True, max_length=T)),
        (lossy, dict(keep="salient")),
        (replace(lossy, rotate="hadamard"), {}),
    ):
        tm.tale_spec.schedule = sched
        one, c1 = prefill(tm, ids, 0, **kw)
        pieces, c2 = prefill(tm, ids, 20 if kw.get("keep") else 16, **kw)  # 20 + 20 + 5: the window spans two
        assert rel(pieces, one) < 1e-6
        same_cache(c2, c1)


def test_left_padded_rows_in_pieces():
    """A left-padded batch: the 4D mask's rows per piece, the valid tokens from the whole mask."""
    tm = talify(tiny_model("llama"), 2)
    tm.tale_spec.schedule = schedule_for(tm, sinks=2)
    ids, mask = left_pad([ids_for(n, seed=n)[0] for n in (T, 30, 38)])
    for kw in ({}, dict(static=True, max_length=T)):
        one, c1 = prefill(tm, ids, 0, mask, **kw)
        pieces, c2 = prefill(tm, ids, 16, mask, **kw)
        real = mask.bool()
        assert rel(pieces[real], one[real]) < 1e-6
        same_cache(c2, c1)


@pytest.mark.parametrize("static", [False, True])
def test_generate_in_pieces_gives_the_same_tokens(static):
    """model.generate (HF's loop, the prefill a forward over the whole prompt) and tale_runtime.generate (tale-run's
    loop): the same greedy tokens and the same cache bytes as with the prefill in one piece."""
    tm = talify(tiny_model("llama"), 2)
    tm.tale_spec.schedule = schedule_for(tm, sinks=2)
    ids = ids_for(T)
    out, held = {}, {}
    for chunk in (0, 16):
        set_prefill_chunk(tm, chunk)
        cache = new_cache(tm, static=static)
        with torch.no_grad():
            out[chunk] = tm.generate(ids, **cache_arg(cache), max_new_tokens=12, do_sample=False, pad_token_id=0)
        held[chunk] = cache.nbytes()
        out[f"loop{chunk}"] = generate(tm, ids[0], max_new_tokens=12, static=static)[0]
    assert torch.equal(out[0], out[16]) and held[0] == held[16]
    assert out["loop0"] == out["loop16"] == out[0][0, T:].tolist()
    assert len(set(out[0][0, T:].tolist())) > 1


def test_prefill_chunk_knob():
    tm = talify(tiny_model("llama"), 2)
    assert PREFILL_CHUNK == 4096 and getattr(tm, "tale_prefill_chunk", PREFILL_CHUNK) == PREFILL_CHUNK
    for bad in (-1, 2.5, True, "16"):
        with pytest.raises(ValueError, match="prefill chunk must be a whole number"):
            set_prefill_chunk(tm, bad)
    # a prompt no longer than the chunk, and hidden states asked for: one piece (the layers' own forward)
    set_prefill_chunk(tm, 16)
    ids = ids_for(T)
    calls = []
    layer = tm.model.layers[0]
    layer.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[1]))
    for n, kw in ((16, {}), (T, dict(output_hidden_states=True)), (T, {})):
        calls.clear()
        with torch.no_grad():
            out = tm(input_ids=ids[:, :n], **cache_arg(new_cache(tm)), use_cache=True, **kw)
        assert calls == [n]  # the hook sees the layer's call (its pieces run inside it)
        if kw:
            assert len(out.hidden_states) == tm.config.num_hidden_layers + 1
    assert "forward" not in vars(layer)  # the pieces' forward is the call's only


# -- memory -----------------------------------------------------------------------------------------------------------

WIDE = dict(hidden_size=256, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=32)


def test_peak_bytes_per_prompt_token_stay_down():
    """The prefill's peak per prompt token (the tracker of benchmarks/prefill_memory.py, float32, 2 layers, 256 and
    512 tokens): in one piece every token holds a layer's whole-width temporaries (the norm's float32 copies, the
    MLP's activations: ~16 hidden states per token here); in pieces of 64 what grows with the prompt is one hidden
    state, one layer's exact keys, values and latents, the RoPE tables and the cache. The bound is those from the shapes, with 25%
    to spare; the one-piece peak must pass three times the pieces' (so this test can tell them apart)."""
    model = prefill_memory.build(2, torch.float32, WIDE, group=2, vocab=256)
    per = {}
    for chunk in (0, 64):
        set_prefill_chunk(model, chunk)
        a, b = (prefill_memory.prefill(model, n, static=True, model_names=False) for n in (256, 512))
        per[chunk] = prefill_memory.per_token(a, b)
    d, K, n, G, R = 256, 2, 32, 1, 64
    # the hidden state, one layer's keys, values and latents, the RoPE tables (cos, sin), in float32
    layer = (d + 2 * K * n + G * R + 2 * n) * 4
    bound = 1.25 * (layer + per[64]["held"])  # held after the call: the cache
    assert per[64]["peak"] < bound, (per[64]["peak"], bound)
    assert per[0]["peak"] > 3 * per[64]["peak"], (per[0]["peak"], per[64]["peak"])
