"""Schedule.key_rope "pre": quantized levels hold keys before RoPE (KVQuant) and rotate them as they are read.

Checked: at 16 bits the model decodes like the base model (so the tables line up with every cached key: chunks,
left padding, beam search); a cache with keep="salient" (order-free levels) reads the same keys as the post-RoPE
cache at 16 bits; keys whose channels are steady before RoPE quantize with far less error than after it (what the
option is for); refusals and the manifest round trip."""

from dataclasses import replace

import pytest
import torch
from tale_helpers import TINY, exact_schedule, feed, random_model, talify, tiny_model
from test_runtime import decode_logits, hf_greedy, ids_for, left_pad, rel

from tale_runtime import ArtifactError, new_cache
from tale_runtime.artifact import Level, Schedule
from tale_runtime.attention import apply_rope, cached_keys, latent_attention
from tale_runtime.cache import RegionStore
from tale_runtime.model import cache_arg


def pre(s: Schedule) -> Schedule:
    return replace(s, key_rope="pre")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_16_bit_levels_before_rope_decode_like_the_base_model(arch):
    base = tiny_model(arch)
    tm = talify(base, 2, pre(exact_schedule(32, 2)))
    ids = ids_for(60)
    with torch.no_grad():
        ref = base(ids).logits[:, 9:-1]
    assert rel(decode_logits(tm, ids, 10), ref) < 1e-4
    assert rel(decode_logits(tm, ids, 10, chunks=[9, 1, 13, 2, 25]), ref) < 1e-4


def test_left_padded_rows_and_beams_read_their_own_rotations():
    base = tiny_model("llama")
    rows = [ids_for(T, seed=T)[0] for T in (23, 9, 16)]
    ids, mask = left_pad(rows)
    tm = talify(base, 2, pre(exact_schedule(32, 2)))
    batch = hf_greedy(tm, ids, mask, new_cache(tm))
    for i, r in enumerate(rows):
        assert torch.equal(batch[i], hf_greedy(base, r[None])[0]), i
    lossy = talify(base, 2)
    lossy.tale_spec.schedule = pre(lossy.tale_spec.schedule)
    batch = hf_greedy(lossy, ids, mask, new_cache(lossy))
    assert torch.equal(batch[1], hf_greedy(lossy, rows[1][None], cache=new_cache(lossy))[0])
    kw = dict(max_new_tokens=12, num_beams=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(tm.generate(ids[:1], **cache_arg(new_cache(tm)), **kw), base.generate(ids[:1], **kw))


K, H, n, G, R = 2, 4, 16, 1, 32


def tables(T: int, B: int = 1, base: float = 100.0):
    inv = base ** (-torch.arange(0, n, 2).float() / n)
    ang = torch.arange(T).float()[:, None] * inv  # [T, n/2]
    ang = torch.cat([ang, ang], -1)[None].expand(B, T, n)
    return ang.cos(), ang.sin()


def fill(s: Schedule, k_post, h, q, cos, sin, prefill: int, keep="recent") -> RegionStore:
    c = RegionStore(s, 0, K, n, G, R, keep=keep)
    c.append(
        k_post[..., :prefill, :], h[..., :prefill, :], q=q[..., :prefill, :], rope=(cos[:, :prefill], sin[:, :prefill])
    )
    for t in range(prefill, k_post.shape[-2]):
        sl = slice(t, t + 1)
        c.append(k_post[..., sl, :], h[..., sl, :], q=q[..., sl, :], rope=(cos[:, sl], sin[:, sl]))
    return c


def tokens(T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k_pre = torch.randn(1, K, T, n, generator=g)
    h = torch.randn(1, G, T, R, generator=g)
    q = torch.randn(1, H, T, n, generator=g) * n**-0.5
    return k_pre, h, q


@pytest.mark.parametrize("keep", ["recent", "salient"])
def test_keys_read_back_at_16_bits_are_the_post_rope_keys(keep):
    s = Schedule(
        sinks=2,
        levels=[Level(16, 16, None), Level(16, 16, 0.25)],
        ranks=[[32, 32]],
        key_group=8,
        value_group=8,
        residual=8,
    )
    T = 90
    k_pre, h, q = tokens(T)
    cos, sin = tables(T)
    k_post = apply_rope(k_pre, cos, sin)
    a = fill(s, k_post, h, q, cos, sin, 37, keep)
    b = fill(pre(s), k_post, h, q, cos, sin, 37, keep)
    assert any(r.rope is not None for r in b.view().regions) and all(r.rope is None for r in a.view().regions)
    ka, pa, _ = cached_keys(a.view(), torch.float32, 1, K, n, "cpu")
    kb, pb, _ = cached_keys(b.view(), torch.float32, 1, K, n, "cpu")
    assert torch.equal(pa, pb)
    torch.testing.assert_close(kb, ka, atol=1e-5, rtol=1e-5)
    qn, kn, hn = q[..., -1:, :], k_post[..., -1:, :], h[..., -1:, :]
    torch.testing.assert_close(latent_attention(qn, kn, hn, b, 0.25), latent_attention(qn, kn, hn, a, 0.25))


def test_steady_channels_before_rope_quantize_far_better():
    """Keys that are a per-channel constant plus small noise before RoPE: after RoPE every channel rotates
    through its group of tokens, so per-channel 2-bit groups must span the whole circle."""
    s = Schedule(sinks=2, levels=[Level(2, 2, None)], ranks=[[32]], key_group=8, value_group=8, residual=8)
    T = 98
    _, h, q = tokens(T)
    g = torch.Generator().manual_seed(1)
    k_pre = 3 * torch.randn(1, K, 1, n, generator=g) + 0.05 * torch.randn(1, K, T, n, generator=g)
    cos, sin = tables(T)
    k_post = apply_rope(k_pre, cos, sin)
    err = {}
    for name, sch in (("post", s), ("pre", pre(s))):
        c = fill(sch, k_post, h, q, cos, sin, T)
        got, pos, _ = cached_keys(c.view(), torch.float32, 1, K, n, "cpu")
        err[name] = ((got - k_post[..., pos[0], :]).norm() / k_post.norm()).item()
    assert err["pre"] < err["post"] / 3, err


def test_refusals_and_the_manifest_round_trip():
    s = exact_schedule(32, 2)
    with pytest.raises(ArtifactError, match="key_rope must be"):
        replace(s, key_rope="before").validate(32, 2)
    with pytest.raises(ArtifactError, match="does not combine"):
        replace(s, key_rope="pre", rotate="hadamard").validate(32, 2)
    assert "key_rope" not in s.to_dict()
    assert Schedule.from_dict(pre(s).to_dict()).key_rope == "pre"
    assert pre(s).fast_path() and s.fast_path()  # the low-rank-key kernel reads keys before RoPE, without bands:
    banded = replace(s, levels=[replace(lv, key_hi_bits=4) for lv in s.levels])
    assert banded.fast_path() and not pre(banded).fast_path()
    tm = talify(tiny_model("llama"), 2, pre(s))
    # the static cache keeps pre-RoPE keys with their RoPE tables (equal to the dynamic cache: test_static_cache)
    assert new_cache(tm, static=True, max_length=64).schedule.key_rope == "pre"
    c = RegionStore(pre(s), 0, K, n, G, R)
    with pytest.raises(ValueError, match="needs the cos, sin"):
        c.append(torch.zeros(1, K, 3, n), torch.zeros(1, G, 3, R))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel needs CUDA")
def test_keys_before_rope_go_to_the_low_rank_key_kernel():
    """On CUDA a key_rope "pre" model's caches get the low-rank-key kernel (it rotates the stored keys as it reads
    them; the other kernels would read them as post-RoPE ones): the reference's logits and tokens."""
    from tale_runtime import new_cache, set_backend
    from tale_runtime.generate import generate

    tm = talify(tiny_model("llama"), 2)
    tm.tale_spec.schedule = pre(tm.tale_spec.schedule)
    tm = tm.cuda()
    ids = torch.randint(1, 320, (1, 90), generator=torch.Generator().manual_seed(3)).cuda()
    set_backend(tm, "torch")
    ref = decode_logits(tm, ids, 60)
    set_backend(tm, "auto")
    assert new_cache(tm).backend.name == "triton-lowrank"
    assert rel(decode_logits(tm, ids, 60), ref) < 1e-3  # float32: the kernel's dots in float32
    a, _ = generate(tm, ids[0], max_new_tokens=20, eos_token_id=[])
    set_backend(tm, "torch")
    b, _ = generate(tm, ids[0], max_new_tokens=20, eos_token_id=[])
    assert a == b


def test_the_layers_of_a_cache_share_one_rope_table():
    """Every layer sees the same positions: one table per cache (not one per layer), extended once per span."""
    from tale_runtime.cache import RopeTables

    tm = talify(tiny_model("llama"), 2, pre(exact_schedule(32, 2)))
    cache = new_cache(tm)
    feed(tm, ids_for(40), cache, 30)
    assert all(layer.rope is cache.ropes[None] for layer in cache.layers)
    assert cache.ropes[None].length == 40 == cache.layers[1].kappa
    cache.reset()
    assert cache.ropes[None].length == 0 and all(layer.rope is cache.ropes[None] for layer in cache.layers)
    t = RopeTables()
    cos = torch.ones(1, 4, n)
    t.extend(cos, cos, 0)
    t.extend(cos[:, :2], cos[:, :2], 2)  # already there (another layer's span): kept as it is
    assert t.length == 4
    with pytest.raises(RuntimeError, match="rope tables hold 4 positions"):
        t.extend(cos, cos, 6)


def _generate_logits(model, ids, mask, cache, n: int = 20) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, **cache_arg(cache), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    return torch.stack(out.logits, 1)


def _tables_cache(model, **kw):
    """A static cache made to store RoPE tables (as for a model whose RoPE the cache cannot make itself)."""
    cache = new_cache(model, static=True, **kw)
    cache._rotary_args = None
    return cache


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_a_static_cache_makes_the_models_rotation_from_positions(arch):
    """A static cache of a model whose RoPE depends on the position alone stores no tables: its regions carry a
    Rotary that makes the model's very tables, so generate (left padding, demotions) gives the same logits bit for bit
    as a cache that stores them, in fewer bytes."""
    base = tiny_model(arch)
    lossy = talify(base, 2)
    lossy.tale_spec.schedule = pre(lossy.tale_spec.schedule)
    ids, mask = left_pad([ids_for(T, seed=T)[0] for T in (37, 9, 20)])
    made = new_cache(lossy, static=True, max_length=80)
    got = _generate_logits(lossy, ids, mask, made)
    stored = _tables_cache(lossy, max_length=80)
    want = _generate_logits(lossy, ids, mask, stored)
    assert made.rotary is not None and made.rope == [] and stored.rotary is None and stored.rope
    assert torch.equal(made.rotary.offset, torch.tensor([0, 28, 17], dtype=torch.int32))
    assert torch.equal(got, want)
    regions = [r for r in made.layers[-1].view().regions if r.rope is not None]  # a global layer (Gemma 3: the last)
    assert regions and all(r.rope is made.rotary for r in regions)
    assert made.capacity_nbytes() < stored.capacity_nbytes()


@pytest.mark.parametrize("shift_from", [0, 1])
def test_positions_that_do_not_follow_the_cache_fall_back_to_tables(shift_from):
    """position_ids of its own (here shifted by 5, from the prefill or from a later chunk) are not what the
    Rotary makes: the cache then stores tables, those of the chunks it already holds included, and decodes exactly
    as a cache that stored them from the start."""
    base = tiny_model("llama")
    lossy = talify(base, 2)
    lossy.tale_spec.schedule = pre(lossy.tale_spec.schedule)
    ids = ids_for(60)
    pos = torch.arange(60)[None] + torch.tensor([0, 5])[(torch.arange(60) >= (24 if shift_from else 0)).long()]
    out = []
    for cache in (new_cache(lossy, static=True, max_length=60), _tables_cache(lossy, max_length=60)):
        logits = []
        with torch.no_grad():
            for a, b in [(0, 24), (24, 28), *((t, t + 1) for t in range(28, 60))]:
                step = lossy(ids[:, a:b], position_ids=pos[:, a:b], **cache_arg(cache)).logits[:, -1]
                logits.append(step)
        out.append(torch.stack(logits))
        assert cache.rotary is None and cache.rope
    assert torch.equal(out[0], out[1])


def test_the_rotary_a_cache_can_make_itself():
    """families.rotary: the inv_freq and scaling of the global layers' RoPE where it depends on the position alone;
    None for a partial rotary (Phi-3) and for RoPE whose frequencies follow the length ("dynamic")."""
    from tale_runtime import families

    llama = tiny_model("llama")
    inv, scaling = families.rotary(llama)
    assert torch.equal(inv, llama.model.rotary_emb.inv_freq.float()) and scaling == 1.0
    gemma = tiny_model("gemma3")  # a sliding layer (local base) and a global one (linear scaling by 8)
    inv, scaling = families.rotary(gemma)
    assert torch.equal(inv, gemma.model.rotary_emb.full_attention_inv_freq.float())
    assert not torch.equal(inv, gemma.model.rotary_emb.sliding_attention_inv_freq.float())
    assert families.rotary(tiny_model("phi3")) is None
    dynamic = random_model(TINY["llama"], rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert dynamic.model.rotary_emb.rope_type == "dynamic" and families.rotary(dynamic) is None
