"""The static cache (runtime/static_cache.py) holds exactly what the dynamic cache holds, step by step,
and gives the same tokens end to end (tiny random models, float32, CPU)."""

from dataclasses import replace

import pytest
import torch
import torch._dynamo.testing
from tale_helpers import grouped_schedule, talify, three_levels, tiny_model

from tale_runtime import families, new_cache
from tale_runtime import static_cache as sc
from tale_runtime.artifact import Level, Schedule
from tale_runtime.attention import latent_attention
from tale_runtime.generate import generate
from tale_runtime.key_basis import KeyBasis, fit
from tale_runtime.model import DynamicTaleLayer, TaleCache, cache_arg
from tale_runtime.quant import FP8, dequantize
from tale_runtime.static_cache import StaticTaleCache

K, n, G, R = 2, 16, 1, 32

SCHEDULES = {
    "paper": Schedule(ranks=[[16, 32]], key_group=8, value_group=8, residual=8),
    "three-levels": three_levels(sinks=2, residual=16),
    "exact": Schedule(
        levels=[Level(16, 16, None), Level(16, 16, 0.1)], ranks=[[32, 32]], key_group=8, value_group=8, residual=8
    ),
    # the tale preset's formats: key bands (3-bit high band), fp8 scales (keys 8/16, latents 8/8)
    "tale": grouped_schedule(
        [Level(2, 2, None, key_hi_bits=3, key_hi_channels=8), Level(4, 4, 0.1)],
        [[16, 32]],
        residual=8,
        key_meta="8/16",
        key_order=[[torch.randperm(n, generator=torch.Generator().manual_seed(h)).tolist() for h in range(K)]],
    ),
    "3bit-keys-fp8": Schedule(
        levels=[Level(2, 3, None), Level(4, 3, 0.2)],
        ranks=[[16, 32]],
        key_group=8,
        value_group=8,
        residual=8,
        key_meta="8/8",
        value_meta="8/16",
    ),
}


def contents(view, b: int) -> dict[int, tuple]:
    """Row b of a layer view: cache position -> (key bits, latent bits, rank, key [n] (or its coefficients [Kb, r]),
    latent [R], the RoPE tables (cos, sin) of keys held before RoPE or None)."""
    out = {}
    width = max(r.rank for r in view.regions)  # the latent width R (the sinks' rank)
    for r in view.regions:
        keys, lat = dequantize(r.keys, torch.float32), dequantize(r.lat, torch.float32)
        used = torch.arange(r.capacity) < r.length
        for slot in torch.nonzero(used & (r.pos[b] >= 0)).flatten().tolist():
            p = int(r.pos[b, slot])
            assert p not in out, f"position {p} cached twice"
            h = torch.zeros(width)
            h[: lat.shape[-1]] = lat[b, 0, slot]
            rope = None if r.rope is None else torch.stack([r.rope[0][b, slot], r.rope[1][b, slot]])
            out[p] = (r.keys.bits, r.lat.bits, r.rank, keys[b, :, slot], h, rope)
    return out


def assert_same(dyn: TaleCache, sta: StaticTaleCache, B: int) -> None:
    dv, sv = dyn.layers[0].view(), sta.layers[0].view()
    assert int(sv.next_pos) == dv.next_pos
    for b in range(B):
        d, s = contents(dv, b), contents(sv, b)
        assert d.keys() == s.keys()
        for p in d:
            assert d[p][:3] == s[p][:3], f"row {b} position {p}: level differs"
            assert torch.equal(d[p][3], s[p][3]) and torch.equal(d[p][4], s[p][4]), f"row {b} position {p}"
            assert (d[p][5] is None) == (s[p][5] is None), f"row {b} position {p}: keys before RoPE in one cache"
            assert d[p][5] is None or torch.equal(d[p][5], s[p][5]), f"row {b} position {p}: RoPE tables"
    assert sta.nbytes() == dyn.nbytes()


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("prompt,pad", [(40, 0), (3, 0), (70, 5)])
def test_holds_the_dynamic_caches_tokens_at_every_step(name, prompt, pad):
    """Same k, h into both caches: the same positions at the same level with bit-identical codes, through
    flushes, demotions (on the device: StaticTaleCache._move_at) and ring wrap-arounds (200 decode steps, magnitudes
    that move fp8 biases both ways), with and without left padding."""
    s, B, steps = SCHEDULES[name], 2, 200
    gen = torch.Generator().manual_seed(0)
    dyn = TaleCache(s, 1, K, n, G, R)
    sta = StaticTaleCache(s, 1, K, n, G, R, max_length=prompt + steps)
    k, h = torch.randn(B, K, prompt, n, generator=gen), torch.randn(B, G, prompt, R, generator=gen)
    valid = torch.ones(B, prompt, dtype=torch.bool)
    valid[1, :pad] = False
    for c in (dyn, sta):
        c.layers[0].append(k, h, valid)
    assert_same(dyn, sta, B)
    for t in range(steps):
        amp = 2.0 ** ((t // 11) % 3 - 1)  # magnitudes that move the fp8 biases: buffers re-biased both ways
        k, h = amp * torch.randn(B, K, 1, n, generator=gen), amp * torch.randn(B, G, 1, R, generator=gen)
        for c in (dyn, sta):
            c.layers[0].append(k, h)
        if t % 7 == 0 or t == steps - 1:
            assert_same(dyn, sta, B)
    # the rings are far smaller than max_length: the recent level holds about p * N tokens
    assert sta.caps[-1] < (prompt + steps) // 2


def lowrank(blocks: int) -> tuple[Schedule, KeyBasis]:
    """The lowrank preset's layout at tiny shapes: middle keys before RoPE as 4-bit coefficients (16 of the 32 joined
    channels, or 8 per head), 3-bit latents, fp8 scales and zeros, the newest tokens at 8 bits per token (residual 1);
    and a key basis of `blocks` blocks fitted to random keys."""
    s = Schedule(
        sinks=2,
        levels=[Level(3, 4, None, key_rank=16 // blocks), Level(4, 4, 0.1), Level(8, 8, 0.0, key_axis="token")],
        ranks=[[16, 32, 32]],
        key_group=8,
        value_group=8,
        residual=1,
        key_meta="8/8",
        value_meta="8/8",
        key_channel_group=n,
        key_rope="pre",
        key_blocks=blocks,
    )
    s.validate(R, 1)
    x = torch.randn(500, K * n, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    x = x @ torch.randn(K * n, K * n, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    return s, KeyBasis(*fit(x.T @ x / len(x), x.mean(0), None, blocks), x.mean(0).float(), K, n)


def rope_tables(B: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 100.0 ** (-torch.arange(0, n, 2).float() / n)
    ang = torch.arange(T).float()[:, None] * inv
    ang = torch.cat([ang, ang], -1)[None].expand(B, T, n)
    return ang.cos(), ang.sin()


@pytest.mark.parametrize("blocks,prompt,pad", [(1, 40, 0), (K, 3, 0), (K, 70, 5)])
def test_holds_the_dynamic_caches_low_rank_keys_at_every_step(blocks, prompt, pad):
    """The lowrank preset's levels (coefficients on a joint or per-head key basis, keys before RoPE with their
    tables, per-token newest keys, fp8 scales): the same positions at the same level with bit-identical codes and
    tables as the dynamic cache, through per-token flushes, demotions and ring wrap-arounds, batch 2 with left
    padding; attention over both views agrees."""
    (s, basis), B, steps = lowrank(blocks), 2, 100
    gen = torch.Generator().manual_seed(0)
    cos, sin = rope_tables(B, prompt + steps)
    dyn = TaleCache(s, 1, K, n, G, R, key_basis=[basis])
    sta = StaticTaleCache(s, 1, K, n, G, R, max_length=prompt + steps, key_basis=[basis])
    k, h = torch.randn(B, K, prompt, n, generator=gen), torch.randn(B, G, prompt, R, generator=gen)
    valid = torch.ones(B, prompt, dtype=torch.bool)
    valid[1, :pad] = False
    for c in (dyn, sta):
        c.layers[0].append(k, h, valid, rope=(cos[:, :prompt], sin[:, :prompt]))
    assert_same(dyn, sta, B)
    for t in range(prompt, prompt + steps):
        amp = 2.0 ** ((t // 11) % 3 - 1)  # magnitudes that move the fp8 biases: buffers re-biased both ways
        k, h = amp * torch.randn(B, K, 1, n, generator=gen), amp * torch.randn(B, G, 1, R, generator=gen)
        for c in (dyn, sta):
            c.layers[0].append(k, h, rope=(cos[:, t : t + 1], sin[:, t : t + 1]))
        if t % 9 == 0 or t == prompt + steps - 1:
            assert_same(dyn, sta, B)
    regions = [r for r in sta.layers[0].view().regions if r.basis is not None]
    assert len(regions) == 1 and regions[0].keys.shape[1] == blocks and regions[0].keys.shape[-1] == 16 // blocks
    assert int(regions[0].length) > 0 and sta.caps[-1] < (prompt + steps) // 2
    q, kn, hn = torch.randn(B, 4, 1, n, generator=gen), torch.randn(B, K, 1, n), torch.randn(B, G, 1, R)
    want = latent_attention(q, kn, hn, dyn.layers[0].view(), 0.25)
    assert (latent_attention(q, kn, hn, sta.layers[0].view(), 0.25) - want).abs().max() < 1e-5


def test_per_token_top_level_takes_each_decode_token_without_a_host_read(monkeypatch):
    """With a per-token top level and residual 1 (the lowrank preset) a decode step writes its token straight into the
    top level, fp8 biases on the device, so a CUDA graph can capture it: no host read inside the step (what a capture
    forbids), nor in the demotions after it (advance, as after a replay: slots and biases on the device, what a graph
    per demotion captures), and the codes are the dynamic cache's."""
    (s, basis), B, prompt, steps = lowrank(K), 2, 37, 70
    gen = torch.Generator().manual_seed(3)
    cos, sin = rope_tables(B, prompt + steps)
    dyn = TaleCache(s, 1, K, n, G, R, key_basis=[basis])
    sta = StaticTaleCache(s, 1, K, n, G, R, max_length=prompt + steps, key_basis=[basis])
    k, h = torch.randn(B, K, prompt, n, generator=gen), torch.randn(B, G, prompt, R, generator=gen)
    for c in (dyn, sta):
        c.layers[0].append(k, h, rope=(cos[:, :prompt], sin[:, :prompt]))
    assert sta.direct and sta.capturable()

    def no_host_read(*a, **kw):
        raise AssertionError("a host read inside a captured step")

    demoted = 0
    for t in range(prompt, prompt + steps):
        k, h = torch.randn(B, K, 1, n, generator=gen), torch.randn(B, G, 1, R, generator=gen)
        dyn.layers[0].append(k, h, rope=(cos[:, t : t + 1], sin[:, t : t + 1]))
        assert sta.capturable()
        with monkeypatch.context() as m:
            for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
                m.setattr(torch.Tensor, name, no_host_read)
            with sta.step(1, graph=True):
                sta.layers[0].update(k, h, rope=(cos[:, t : t + 1], sin[:, t : t + 1]))
            moved = sta.book.r[:]
            sta.advance()  # what the decoder runs after each replay
            demoted += sta.book.r != moved
        assert int(sta.lens[-1]) == 0  # the residual stays empty: the token went to the top level
    assert demoted >= 5
    assert_same(dyn, sta, B)


def test_device_writes_trace_as_whole_graphs(monkeypatch):
    """The top level's write and the demotions, which inductor compiles on CUDA (static_cache.fused), trace without a
    graph break (fullgraph: a break would fail here, not on a GPU) and keep the dynamic cache's codes."""
    counter = torch._dynamo.testing.CompileCounter()
    traced = {}

    def fused(fn, device, key=()):  # as sc.fused: a code object per key, so dynamo keeps the key's integers constant
        if (fn, key) not in traced:
            traced[fn, key] = torch.compile(sc.own_code(fn, len(traced)), backend=counter, fullgraph=True)
        return traced[fn, key]

    monkeypatch.setattr(sc, "fused", fused)
    torch._dynamo.reset()
    test_per_token_top_level_takes_each_decode_token_without_a_host_read(monkeypatch)
    assert counter.frame_count >= 3  # write_top, demote_at per level: traced, not skipped


def _run_modes(s, basis, mode: str, monkeypatch, prompt=70, steps=180, B=2, L=3, dev="cuda"):
    """Buffers of a 3-layer static cache on `dev` after a prompt and `steps` decode steps: `host` the uncompiled writes
    and host demotions (the reference), `eager` compiled writes and demotions on the device, `graph` those captured."""
    with monkeypatch.context() as m:
        if mode == "host":
            m.setattr(StaticTaleCache, "_on_device", lambda self, *a: False)
            m.setattr(sc, "fused", lambda fn, device, key=(): fn)
        gen = torch.Generator().manual_seed(0)
        s = replace(s, ranks=s.ranks * L, key_order=None if s.key_order is None else s.key_order * L)
        bases = (
            None
            if basis is None
            else [replace(basis, enc=basis.enc.to(dev), dec=basis.dec.to(dev), mean=basis.mean.to(dev))] * L
        )
        sta = StaticTaleCache(s, L, K, n, G, R, max_length=prompt + steps, key_basis=bases)
        sta.graph_error = "eager" if mode == "eager" else None
        pre = s.key_rope == "pre"
        cos, sin = (x.to(dev) for x in rope_tables(B, prompt + steps))
        valid = torch.ones(B, prompt, dtype=torch.bool, device=dev)
        valid[1, :3] = False
        for p in range(-1, steps):
            T, amp = (prompt, 1.0) if p < 0 else (1, 2.0 ** ((p // 11) % 3 - 1))
            t0 = 0 if p < 0 else prompt + p
            k = amp * torch.randn(B, K, T, n, generator=gen).to(dev)
            h = amp * torch.randn(B, G, T, R, generator=gen).to(dev)
            with sta.step(T):
                for layer in sta.layers:
                    tab = (cos[:, t0 : t0 + T], sin[:, t0 : t0 + T]) if pre else None
                    layer.update(k, h, valid if p < 0 else None, rope=tab)
        if mode == "graph" and s.levels[0].key_hi_bits == 0:  # key bands build their channel index on the host: eager
            assert sta.graph_error is None and any(g is not None for g in sta._moves.values())
        out = [x for layer in sta.layers for x in layer._tensors()] + sta.pos + sta._rope_tensors() + [sta.lens]
        out += [q.bias for layer in sta.layers for q in layer._qbufs() if q.meta != "16"]
        return [x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x.clone() for x in out]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and inductor's GPU kernels")
@pytest.mark.parametrize("name", ["lowrank-joint", "lowrank-per-head", "tale", "three-levels"])
def test_device_demotions_and_fused_writes_hold_the_host_paths_codes_on_cuda(name, monkeypatch):
    """On CUDA the demotions run as captured graphs and, with fp8 scales, the writes as inductor's kernels: the buffers
    are bit-identical to the uncompiled host path's, through demotions, ring wrap-arounds and moving biases."""
    s, basis = {"lowrank-joint": lowrank(1), "lowrank-per-head": lowrank(K)}.get(name, (SCHEDULES.get(name), None))
    want = _run_modes(s, basis, "host", monkeypatch)
    for mode in ("eager", "graph"):
        got = _run_modes(s, basis, mode, monkeypatch)
        assert all(torch.equal(a, b) for a, b in zip(want, got)), f"{name}: {mode} differs from the host path"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tale", "lowrank-joint"])
def test_inductor_compiles_the_device_writes_to_the_host_paths_codes(name, monkeypatch):
    """The device writes and demotions as inductor compiles them (here for the CPU; on CUDA `fused` does it) give the
    host path's codes: the fp8 rounding of rescaled scales is elementwise, nothing comes from the host and no dtype view
    of a result is taken (inductor on CUDA can't index one, and a capture can't copy from the host)."""
    s, basis = {"lowrank-joint": lowrank(1)}.get(name, (SCHEDULES.get(name), None))
    want = _run_modes(s, basis, "host", monkeypatch, steps=60, dev="cpu")

    made: dict = {}  # apart from fused's: these compile for the CPU
    monkeypatch.setattr(sc, "fused", lambda fn, device, key=(): sc.compiled(fn, key, made))
    # the CPU's eager indexing of fp8 goes through bytes; inside the compiled pieces, as on CUDA, it needs no view
    monkeypatch.setattr(
        sc, "_bytes", lambda t: t if t.dtype != FP8 or torch.compiler.is_compiling() else t.view(torch.uint8)
    )
    got = _run_modes(s, basis, "eager", monkeypatch, steps=60, dev="cpu")
    assert all(torch.equal(a, b) for a, b in zip(want, got)), f"{name}: compiled writes differ from the host path"


def test_static_low_rank_refusals():
    """What the static cache cannot hold is refused in one line: no key basis, a basis of other blocks, keys without
    their RoPE tables, and the CUDA kernel's fragment layout."""
    s, basis = lowrank(K)
    with pytest.raises(ValueError, match="static cache: layer 0: key_rank 8 needs the artifact's key basis"):
        StaticTaleCache(s, 1, K, n, G, R, max_length=50)
    with pytest.raises(ValueError, match="counts key_rank in 1 key basis block\\(s\\), the key basis has 2"):
        StaticTaleCache(replace(s, key_blocks=1), 1, K, n, G, R, max_length=50, key_basis=[basis])
    sta = StaticTaleCache(s, 1, K, n, G, R, max_length=50, key_basis=[basis])
    with pytest.raises(ValueError, match='key_rope "pre" needs the cos, sin'):
        sta.layers[0].append(torch.randn(1, K, 20, n), torch.randn(1, G, 20, R))
    with pytest.raises(ValueError, match="static cache layout 'frag'"):
        StaticTaleCache(s, 1, K, n, G, R, max_length=50, layout="frag", key_basis=[basis])


def padded_batch(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two random prompts of `length` tokens for model.generate, the second left-padded by 7: (ids, attention mask)."""
    ids = torch.randint(1, 320, (2, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[1, :7], mask[1, :7] = 0, 0
    return ids, mask


def test_generate_with_the_lowrank_preset_gives_the_dynamic_paths_tokens(tiny_model_dir, tmp_path):
    """A tiny model converted with --preset lowrank: model.generate over the static cache (batch 2, left padding)
    gives the dynamic cache's greedy tokens, and the decode loop the same tokens and bytes."""
    from conftest import TINY_OPTS

    from tale_convert.convert import Options, convert
    from tale_runtime import load

    out = tmp_path / "lr"
    convert(str(tiny_model_dir("llama")), out, Options(group=2, **dict(TINY_OPTS, preset="lowrank", residual=None)))
    tm, _ = load(out, device="cpu", dtype=torch.float32)
    assert tm.tale_spec.schedule.key_rope == "pre" and tm.tale_spec.schedule.levels[0].key_rank
    ids, mask = padded_batch(40, seed=3)
    kw = dict(attention_mask=mask, max_new_tokens=60, do_sample=False, pad_token_id=0)
    want = tm.generate(ids, **cache_arg(new_cache(tm)), **kw)
    cache = new_cache(tm, static=True)
    assert torch.equal(tm.generate(ids, **cache_arg(cache), **kw), want)
    assert cache.book.w[0] > 0  # the low-rank middle level was written
    a, sa = generate(tm, ids[0], max_new_tokens=40, static=False, eos_token_id=[])
    b, sb = generate(tm, ids[0], max_new_tokens=40, static=True, eos_token_id=[])
    assert a == b and sa.cache_bytes == sb.cache_bytes


@pytest.mark.parametrize("name", ["three-levels", "tale"])
def test_attention_over_both_views_agrees(name):
    s = SCHEDULES[name]
    gen = torch.Generator().manual_seed(1)
    dyn, sta = TaleCache(s, 1, K, n, G, R), StaticTaleCache(s, 1, K, n, G, R, max_length=160)
    k, h = torch.randn(1, K, 150, n, generator=gen), torch.randn(1, G, 150, R, generator=gen)
    for c in (dyn, sta):
        c.layers[0].append(k, h)
    q, kn, hn = torch.randn(1, 4, 1, n), torch.randn(1, K, 1, n), torch.randn(1, G, 1, R)
    for window in (None, 40):
        want = latent_attention(q, kn, hn, dyn.layers[0].view(), 0.25, window)
        got = latent_attention(q, kn, hn, sta.layers[0].view(), 0.25, window)
        assert (got - want).abs().max() < 1e-6


def test_chunk_too_long_for_the_residual_is_refused():
    s = SCHEDULES["paper"]
    sta = StaticTaleCache(s, 1, K, n, G, R, max_length=100)
    sta.layers[0].append(torch.randn(1, K, 40, n), torch.randn(1, G, 40, R))
    with pytest.raises(ValueError, match="do not fit in the residual"):
        sta.layers[0].append(torch.randn(1, K, 20, n), torch.randn(1, G, 20, R))


def ring_reference(tm) -> TaleCache:
    """A dynamic cache whose sliding-window layers keep every token exact (all in their sinks; attention masks by the
    window): what the static cache's rings hold, the global layers on the model's schedule."""
    cache = new_cache(tm)
    for i, w in enumerate(families.sliding_windows(tm)):
        if w is not None:
            old = cache.layers[i]
            exact = replace(old.s, sinks=1 << 30)
            cache.layers[i] = DynamicTaleLayer(exact, i, old.K, old.n, old.G, old.R, old.keep, old.basis, old.rope)
            cache.layers[i]._layer_idx = i
    return cache


def tale_model(arch: str, g: int, window: int | None = None):
    base = tiny_model(arch)
    if window:
        base.config.sliding_window = window
    tm = talify(base, g)
    from tale_runtime.load import tale_class

    tm.__class__ = tale_class(type(tm))
    return tm


@pytest.mark.parametrize("arch,g", [("llama", 2), ("qwen2", 4), ("mistral", 2), ("gemma3", 2), ("phi3", 1)])
def test_generate_gives_the_dynamic_paths_tokens(arch, g):
    """model.generate, batch 2 with left padding, greedy and beam search; Mistral and Gemma 3 with a sliding window
    (window 24), whose layers the static cache holds as exact rings: the dynamic path with those layers exact."""
    tm = tale_model(arch, g, 24 if arch == "mistral" else None)
    ids, mask = padded_batch(30, seed=3)
    kw = dict(attention_mask=mask, max_new_tokens=50, do_sample=False, pad_token_id=0)
    want = tm.generate(ids, **cache_arg(ring_reference(tm)), **kw)
    cache = new_cache(tm, static=True)
    assert torch.equal(tm.generate(ids, **cache_arg(cache), **kw), want)
    assert cache.max_length == 30 + 50 - 1  # sized for the call by TaleGenerationMixin (the last token is never cached)
    assert [layer.ring for layer in cache.layers] == [23 if w else None for w in families.sliding_windows(tm)]
    want = tm.generate(ids, num_beams=3, **cache_arg(ring_reference(tm)), **kw)
    assert torch.equal(tm.generate(ids, **cache_arg(new_cache(tm, static=True)), num_beams=3, **kw), want)


def test_sliding_layers_hold_a_ring_of_their_window():
    """Gemma 3's sliding layer (window W = 24) on the paper schedule: greedy tokens and logits of the static cache are
    the dynamic path's with that layer exact, batch 2 with a padded row, a prompt shorter than W then past three
    windows; token by token after a prompt longer than W, the sliding layer holds exactly the last W - 1 positions
    (its bytes: that many 16-bit keys and full-rank latents, constant once past W) while the global layer grows."""
    tm = tale_model("gemma3", 2)
    W = families.sliding_windows(tm)[0]
    assert W == 24 and families.sliding_windows(tm)[1] is None
    ids, mask = padded_batch(12, seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=3 * W, do_sample=False, pad_token_id=0)
    kw |= dict(output_logits=True, return_dict_in_generate=True)
    want = tm.generate(ids, **cache_arg(ring_reference(tm)), **kw)
    got = tm.generate(ids, **cache_arg(new_cache(tm, static=True)), **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert (torch.stack(got.logits) - torch.stack(want.logits)).abs().max() < 1e-4

    ids = torch.randint(1, 320, (1, 70), generator=torch.Generator().manual_seed(5))
    cache = new_cache(tm, static=True, max_length=70)
    slide, full = cache.layers
    K, n, G, R = cache.K, cache.n, cache.G, cache.R
    per_token = (K * n + G * R) * 4  # float32 keys and latents
    held = []
    with torch.no_grad():
        tm(ids[:, :30], **cache_arg(cache))
        for t in range(30, 70):
            kappa = cache.book.kappa
            (ring,) = slide.view().regions
            pos = ring.pos[0][torch.arange(ring.capacity) < ring.length]
            assert sorted(pos.tolist()) == list(range(kappa - W + 1, kappa)), kappa
            assert slide.nbytes() == (W - 1) * per_token
            held.append(full.nbytes())
            tm(ids[:, t : t + 1], **cache_arg(cache))
    assert held[-1] > held[0] and slide.capacity_nbytes() == (W - 1) * per_token
    assert cache.baseline_nbytes() == 2 * K * (W - 1 + 70) * n * 2


def test_ring_chunks_wrap_and_attend_as_every_token():
    """A sliding layer's ring (window 7: 6 slots) fed a prefill past it and chunks that wrap around it, batch 2 with
    a padded row: after each write it holds the last 6 positions (padding at -1), and attention over it, one new
    token or several, equals attention over every token exact with the window's mask."""
    s, B, W = replace(SCHEDULES["paper"], residual=16), 2, 7
    gen = torch.Generator().manual_seed(3)
    ref = TaleCache(replace(s, sinks=1 << 30), 1, K, n, G, R)
    sta = StaticTaleCache(s, 1, K, n, G, R, max_length=60, windows=[W])
    valid = torch.ones(B, 9, dtype=torch.bool)
    valid[1, :3] = False
    for T in (9, 1, 5, 1, 6, 1, 7, 2):  # chunks that fit the residual (16) of the global layers' bookkeeping
        kappa = sta.book.kappa if sta.book else 0
        k, h = torch.randn(B, K, T, n, generator=gen), torch.randn(B, G, T, R, generator=gen)
        q = torch.randn(B, 4, T, n, generator=gen)
        want = latent_attention(q, k, h, ref.layers[0].view(), 0.25, W)
        got = latent_attention(q, k, h, sta.layers[0].view(), 0.25, W) if kappa else want
        assert (got - want).abs().max() < 1e-6, kappa
        for c in (ref, sta):
            c.layers[0].append(k, h, valid if not kappa else None)
        kappa += T
        (ring,) = sta.layers[0].view().regions
        used = ring.pos[:, torch.arange(ring.capacity) < ring.length]
        held = range(max(0, kappa - W + 1), kappa)
        assert sorted(used[0].tolist()) == list(held), kappa
        assert sorted(used[1].tolist()) == sorted(p if p >= 3 else -1 for p in held), kappa


def tale_schedule(model) -> Schedule:
    """The tale preset's schedule for a tiny model: middle keys 2-bit with 8 of each head's channels at 3 bits,
    fp8 scales, r0 = R/2 (tale_runtime.schedule.PRESETS["tale"] at tiny groups)."""
    cfg = model.config
    L, nh, kv = cfg.num_hidden_layers, cfg.head_dim, cfg.num_key_value_heads
    g = torch.Generator().manual_seed(0)
    return Schedule(
        levels=[Level(2, 2, None, key_hi_bits=3, key_hi_channels=8), Level(4, 4, 0.1)],
        ranks=[[nh, 2 * nh]] * L,
        key_group=8,
        value_group=8,
        residual=8,
        key_meta="8/16",
        value_meta="8/8",
        key_order=[[torch.randperm(nh, generator=g).tolist() for _ in range(kv)] for _ in range(L)],
    )


@pytest.mark.parametrize("preset", ["paper", "tale"])
def test_decode_loop_static_equals_dynamic(preset):
    base = tiny_model("llama")
    tm = talify(base, 2, tale_schedule(base) if preset == "tale" else None)
    assert tm.tale_spec.schedule.fast_path()
    ids = torch.randint(1, 320, (30,), generator=torch.Generator().manual_seed(4))
    a, sa = generate(tm, ids, max_new_tokens=40, static=False, eos_token_id=[])
    b, sb = generate(tm, ids, max_new_tokens=40, static=True, eos_token_id=[])
    assert a == b and sa.cache_bytes == sb.cache_bytes and sa.baseline_bytes == sb.baseline_bytes


def test_batch_repeat_interleave_repeats_rows():
    s = SCHEDULES["paper"]
    sta = StaticTaleCache(s, 1, K, n, G, R, max_length=100)
    k, h = torch.randn(2, K, 50, n), torch.randn(2, G, 50, R)
    sta.layers[0].append(k, h)
    before = contents(sta.layers[0].view(), 1)
    sta.batch_repeat_interleave(3)
    v = sta.layers[0].view()
    assert v.regions[0].keys.data.shape[0] == 6
    after = contents(v, 4)
    assert before.keys() == after.keys() and all(torch.equal(before[p][3], after[p][3]) for p in before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize(
    "preset,arch", [("paper", "llama"), ("tale", "llama"), ("paper", "mistral"), ("paper", "gemma3")]
)
def test_cuda_graph_steps_equal_eager_steps(preset, arch):
    """generate() replays CUDA-graph decode steps over a static cache (TaleGenerationMixin): the same tokens
    as eager steps over the same cache type, and logits within float32 rounding (the captured step is DecodeStep,
    whose fused kernels round differently; tests/test_decode_step.py checks graph == compiled step exactly).
    Both presets: the tale preset's key bands and fp8 biases (device scalars) must survive capture and re-biasing
    between replays; runtime.generate takes this path for it by default (Schedule.fast_path). Mistral (window 24 on
    every layer) and Gemma 3 (a sliding layer, the model's own forward captured): the rings' device slots and lengths
    advance inside the graph, past the window."""
    from tale_runtime.decode import decoder_of, supports_step

    base = tiny_model(arch)
    if arch == "mistral":
        base.config.sliding_window = 24
    tm = talify(base, 2, tale_schedule(base) if preset == "tale" else None).cuda()
    assert tm.tale_spec.schedule.fast_path()
    ids = torch.randint(1, 320, (2, 30), generator=torch.Generator().manual_seed(5)).cuda()
    kw = dict(max_new_tokens=40, do_sample=False, output_logits=True, return_dict_in_generate=True)
    eager = tm.generate(ids, **cache_arg(new_cache(tm, static=True)), disable_compile=True, **kw)
    cache = new_cache(tm, static=True)
    graphed = tm.generate(ids, **cache_arg(cache), **kw)
    dec = decoder_of(tm, cache)
    assert cache.backend.name == "triton" and dec is not None and dec.graph is not None and dec.error is None
    assert torch.equal(graphed.sequences, eager.sequences)
    assert (dec.step is not None) == supports_step(tm) and dec.compile_error is None
    assert any(layer.ring for layer in cache.layers) == (arch != "llama")
    assert all(float((a - b).norm() / b.norm()) < 1e-4 for a, b in zip(graphed.logits, eager.logits))
    a, _ = generate(tm, ids[0], max_new_tokens=40, cache=ring_reference(tm), eos_token_id=[])  # eager, dynamic
    b, _ = generate(tm, ids[0], max_new_tokens=40, eos_token_id=[])  # on CUDA: static cache + CUDA graphs
    assert a == b


def test_windows_are_fixed_when_the_cache_is_made():
    """A sliding layer's ring is sized from the window the cache was made with: an update through another window, or
    windows that do not give each layer one (or None), are refused; a cache made without windows keeps every token
    and only counts the window in its baseline."""
    with pytest.raises(ValueError, match="windows must give each of the 2 layers"):
        StaticTaleCache(SCHEDULES["paper"], 2, K, n, G, R, max_length=50, windows=[8])
    with pytest.raises(ValueError, match="windows must give each of the 1 layers"):
        StaticTaleCache(SCHEDULES["paper"], 1, K, n, G, R, max_length=50, windows=[0])
    sta = StaticTaleCache(SCHEDULES["paper"], 1, K, n, G, R, max_length=50, windows=[8])
    with pytest.raises(ValueError, match="attends through a window of 9 tokens; the cache was made for 8"):
        with sta.step(20):
            sta.layers[0].update(torch.randn(1, K, 20, n), torch.randn(1, G, 20, R), window=9)
    sta = StaticTaleCache(SCHEDULES["paper"], 1, K, n, G, R, max_length=50)
    with sta.step(20):
        sta.layers[0].update(torch.randn(1, K, 20, n), torch.randn(1, G, 20, R), window=8)
    assert sta.layers[0].ring is None and len(sta.layers[0].view().regions) == 4
    assert sta.baseline_nbytes() == 2 * K * 7 * n * 2
