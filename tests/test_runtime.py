"""TALE models end to end (DESIGN.md 5 identities, HF generate, the decode loop, loading).

Tiny random models are turned into TALE models in memory (tests/tale_helpers.py); the slow
tests use the real SmolLM2-135M artifact."""

import json
import math

import pytest
import torch
from tale_helpers import byte_tokenizer, exact_schedule, feed, save_artifact, talify, tiny_model

from tale_runtime import ArtifactError, load, new_cache, set_output_path
from tale_runtime.artifact import Level, Schedule, hash_files, nominal_ratio, uniform_ranks
from tale_runtime.cache import RegionStore
from tale_runtime.generate import TextStream, generate
from tale_runtime.load import default_dtype, override_schedule
from tale_runtime.model import cache_arg

CASES = [
    ("llama", 1),
    ("llama", 2),
    ("llama", 4),
    ("mistral", 2),
    ("qwen2", 2),
    ("qwen2", 4),
    ("mha", 2),
    ("qwen3", 2),
    ("gemma3", 2),
    ("phi3", 2),
]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def ids_for(T: int, B: int = 1, seed: int = 0) -> torch.Tensor:
    """Random prompts without token 0, the pad id given to generate (it infers masks from it)."""
    return torch.randint(1, 320, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def decode_logits(tm, ids: torch.Tensor, prefix: int, chunks: list[int] | None = None) -> torch.Tensor:
    """Prefill ids[:, :prefix] into a new cache, then feed the rest in `chunks` (default: one token at a time);
    return the logits of every position from prefix - 1 on."""
    return feed(tm, ids, new_cache(tm), prefix, chunks=chunks)[:, :-1]


def schedule_for(tm, **kw) -> Schedule:
    L, R = tm.config.num_hidden_layers, tm.tale_spec.arch.latent_rank
    kw = dict(ranks=uniform_ranks(R, L, 0.5, value_group=8), key_group=8, value_group=8, residual=8) | kw
    return Schedule(**kw)


def with_schedule(tm, sched: Schedule):
    tm.tale_spec.schedule = sched
    return tm


@pytest.mark.parametrize("arch,g", CASES, ids=[f"{a}-g{g}" for a, g in CASES])
def test_exact_settings_reproduce_the_original_model(arch, g):
    base = tiny_model(arch)
    ids = ids_for(48)
    with torch.no_grad():
        ref = base(ids).logits[:, 11:-1]
    R = g * base.model.layers[0].self_attn.head_dim
    L = base.config.num_hidden_layers
    # r0 = R and 16 bits everywhere: 36 decode steps through flushes and demotions (past Gemma 3's window of 24)
    tm = talify(base, g, exact_schedule(R, L))
    assert rel(decode_logits(tm, ids, 12), ref) < 1e-4
    # paper-style lossy schedule, but alpha >= kappa: every token is a sink
    tm.tale_spec.schedule = schedule_for(tm, sinks=48)
    assert rel(decode_logits(tm, ids, 12), ref) < 1e-4
    # the same lossy schedule with 4 sinks does compress: the test can tell
    tm.tale_spec.schedule = schedule_for(tm)
    assert rel(decode_logits(tm, ids, 12), ref) > 1e-3


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_sliding_window_layers_keep_their_window(arch):
    """Token by token and in chunks (tale-eval's decode calls: chunks of 8), well past the window: Mistral's on every
    layer; Gemma 3's sliding layer (window 24, local RoPE base) beside its global one."""
    base = tiny_model(arch)
    if arch == "mistral":
        base.config.sliding_window = 12  # Mistral reads the window from the config at every forward
    ids = ids_for(66)
    with torch.no_grad():
        ref = base(ids).logits[:, 9:-1]
    R = 2 * base.model.layers[0].self_attn.head_dim
    tm = talify(base, 2, exact_schedule(R, base.config.num_hidden_layers))
    assert rel(decode_logits(tm, ids, 10), ref) < 1e-4
    assert rel(decode_logits(tm, ids, 10, chunks=[7, 1, 20, 10, 18]), ref) < 1e-4
    assert rel(decode_logits(tm, ids, 10, chunks=[8] * 7), ref) < 1e-4


def test_sliding_window_layers_hold_only_their_window(monkeypatch):
    """Gemma 3's sliding layer (window 24) on a lossy schedule, 66 tokens: its levels keep no key group that no later
    query reads, so it holds fewer bytes than the global layer beside it, the same attention as a cache that keeps
    everything, and its 16-bit baseline is what transformers' cache holds there (the last window - 1 tokens)."""
    base = tiny_model("gemma3")
    tm = talify(base, 2)
    tm.tale_spec.schedule = schedule_for(tm, sinks=2, levels=[Level(4, 4, None), Level(4, 4, 0.25)])
    ids = ids_for(66)
    layers = tm.model.layers
    W = layers[0].self_attn.sliding_window
    assert W == 24 and layers[1].self_attn.sliding_window is None
    cache = new_cache(tm)
    feed(tm, ids, cache, 30)
    slide, full = cache.layers
    cut = slide.kappa - W
    for i, st in enumerate(slide.levels):  # every group a later query can still read
        if st is not None and st.length:
            assert bool((st.pos.view(-1, tm.tale_spec.schedule.unit(i)) > cut).any(-1).all()), i
    held = sum(st.length for st in slide.levels if st is not None)
    assert held < W + 2 * tm.tale_spec.schedule.key_group < sum(st.length for st in full.levels if st is not None)
    assert slide.nbytes() < full.nbytes()
    K, n = tm.config.num_key_value_heads, layers[0].self_attn.head_dim
    assert slide.baseline_nbytes() == 2 * K * (W - 1) * n * 2 and full.baseline_nbytes() == 2 * K * 66 * n * 2
    # the same decode over caches that keep every token (eviction off): the same logits
    with torch.no_grad():
        got = decode_logits(tm, ids, 30)
        monkeypatch.setattr(RegionStore, "_evict", lambda self: None)
        want = decode_logits(tm, ids, 30)
    assert rel(got, want) < 1e-6


@pytest.mark.parametrize("arch,g", [("llama", 2), ("llama", 4), ("qwen2", 2), ("mha", 1)])
def test_fused_and_factored_outputs_agree(arch, g):
    tm = talify(tiny_model(arch), g)  # lossy default schedule
    ids = ids_for(40, B=2)
    set_output_path(tm, "fused")
    fused = decode_logits(tm, ids, 10)
    set_output_path(tm, "factored")
    factored = decode_logits(tm, ids, 10)
    assert rel(factored, fused) < 1e-5
    with pytest.raises(ValueError, match="fused"):
        set_output_path(tm, "both")


@pytest.mark.parametrize("arch,g", [("llama", 2), ("qwen2", 4)])
def test_chunks_after_a_prefix_match_token_by_token(arch, g):
    base = tiny_model(arch)
    R, L = g * base.config.head_dim, base.config.num_hidden_layers
    tm = talify(base, g, exact_schedule(R, L))
    ids = ids_for(50)
    with torch.no_grad():
        ref = base(ids).logits[:, 9:-1]
    one_by_one = decode_logits(tm, ids, 10)
    chunked = decode_logits(tm, ids, 10, chunks=[9, 1, 1, 13, 2, 14])
    assert rel(chunked, one_by_one) < 1e-5 and rel(chunked, ref) < 1e-4


def left_pad(rows: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r) :] = r
        mask[i, T - len(r) :] = 1
    return ids, mask


@torch.no_grad()
def hf_greedy(model, ids, mask=None, cache=None, n=24):
    out = model.generate(
        ids,
        attention_mask=mask,
        **cache_arg(cache),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )
    return out[:, ids.shape[1] :]


def test_hf_generate_greedy_equals_the_original_model_at_exact_settings():
    base = tiny_model("llama")
    tm = talify(base, 2, exact_schedule(32, 2))
    ids = ids_for(20)
    assert torch.equal(hf_greedy(tm, ids, cache=new_cache(tm)), hf_greedy(base, ids))


def test_left_padded_generate_equals_the_original_model_at_exact_settings():
    """A left-padded batch through model.generate: at exact settings the TALE model gives the base model's tokens.
    transformers passes position_ids (padding-aware) only to a forward whose signature names them: the TALE class
    keeps its model's signature."""
    import inspect

    base = tiny_model("llama")
    tm = talify(base, 2, exact_schedule(32, 2))
    assert inspect.signature(tm.forward).parameters.keys() == inspect.signature(base.forward).parameters.keys()
    ids = ids_for(20).expand(2, -1).clone()
    mask = torch.ones_like(ids)
    ids[1, :6], mask[1, :6] = 0, 0
    assert torch.equal(hf_greedy(tm, ids, mask, cache=new_cache(tm)), hf_greedy(base, ids, mask))


def test_the_cache_goes_by_the_installed_releases_name_and_nothing_warns():
    """transformers 5.24 renamed past_key_values to cache (the old name warns until 5.40): generate() and a forward
    with a cache under cache_arg's name raise no deprecation warning, and TALE attention reads the cache under either
    name (load()'s generate hooks are checked by tale-run and the demo, which warn on neither release)."""
    import warnings

    from tale_runtime.model import CACHE_KW

    tm = talify(tiny_model("llama"), 2)
    ids = ids_for(40)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        hf_greedy(tm, ids, cache=new_cache(tm), n=6)
        tm(ids, **cache_arg(new_cache(tm)))
    attn = tm.model.layers[0].self_attn
    x = torch.randn(1, 40, tm.config.hidden_size)
    pe = tm.model.rotary_emb(x, torch.arange(40)[None])
    outs = []
    for name in ("cache", "past_key_values"):
        c = new_cache(tm)
        attn(x, pe, None, **{name: c})
        outs.append(attn(x[:, -1:], tuple(t[:, -1:] for t in pe), None, **{name: c})[0])  # a decode step on it
        assert c.layers[0].kappa == 41, name  # the cache was read and filled under this name
    assert torch.equal(*outs) and CACHE_KW in ("cache", "past_key_values")


def test_left_padded_batch_gives_the_single_row_tokens():
    base = tiny_model("qwen2")
    rows = [ids_for(T, seed=T)[0] for T in (23, 9, 16)]
    ids, mask = left_pad(rows)
    # exact settings: every row, whatever its padding
    tm = talify(base, 2, exact_schedule(32, 2))
    batch = hf_greedy(tm, ids, mask, new_cache(tm))
    for i, r in enumerate(rows):
        assert torch.equal(batch[i], hf_greedy(tm, r[None], cache=new_cache(tm))[0]), i
    # lossy settings: the most padded row sees exactly its single-row regions (sinks, groups)
    tm = talify(base, 2)
    batch = hf_greedy(tm, ids, mask, new_cache(tm))
    assert torch.equal(batch[1], hf_greedy(tm, rows[1][None], cache=new_cache(tm))[0])


@torch.no_grad()
def test_hf_generate_sampling_is_seeded_and_exact():
    base = tiny_model("llama")
    tm = talify(base, 4, exact_schedule(64, 2))
    ids = ids_for(15)

    def sample(model, cache, seed):
        torch.manual_seed(seed)
        return model.generate(
            ids,
            **cache_arg(cache),
            max_new_tokens=30,
            min_new_tokens=30,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            pad_token_id=0,
        )

    assert torch.equal(sample(tm, new_cache(tm), 7), sample(base, None, 7))
    lossy = talify(base, 4)
    assert torch.equal(sample(lossy, new_cache(lossy), 3), sample(lossy, new_cache(lossy), 3))


@torch.no_grad()
def test_beam_search_reorders_the_cache():
    base = tiny_model("llama")
    tm = talify(base, 2, exact_schedule(32, 2))
    ids = ids_for(14)
    kw = dict(max_new_tokens=12, num_beams=3, do_sample=False, pad_token_id=0)
    assert torch.equal(tm.generate(ids, **cache_arg(new_cache(tm)), **kw), base.generate(ids, **kw))


# -- the decode loop (tale_runtime.generate) ------------------------------------------


def test_generate_loop_matches_hf_generate_and_reports_stats():
    tm = talify(tiny_model("llama"), 2)
    ids = ids_for(30)
    out, stats = generate(tm, ids[0].tolist(), max_new_tokens=40)
    cache = new_cache(tm)
    assert out == hf_greedy(tm, ids, cache=cache, n=40)[0].tolist()
    assert (stats.prompt_tokens, stats.generated_tokens) == (30, 40)
    # the loop's cache holds prompt + generated - 1 tokens, like HF's
    assert stats.cache_bytes == cache.nbytes() and stats.baseline_bytes == cache.baseline_nbytes()
    assert stats.baseline_bytes == 2 * 2 * 2 * 4 * (30 + 40 - 1) * 16  # K+V, 2 bytes, 2 layers, 4 KV heads
    assert stats.ratio == pytest.approx(stats.baseline_bytes / stats.cache_bytes)
    assert stats.nominal_ratio == pytest.approx(nominal_ratio(tm.tale_spec.schedule, tm.tale_spec.arch.head_dim, 2))
    assert "measured" in stats.line() and "nominal" in stats.line()
    assert stats.attention == "torch reference" and stats.line().endswith("attention: torch reference")


def test_generate_loop_sampling():
    tm = talify(tiny_model("mistral"), 2)
    prompt = ids_for(20)[0].tolist()
    a, _ = generate(tm, prompt, max_new_tokens=30, temperature=1.0, seed=5)
    b, _ = generate(tm, prompt, max_new_tokens=30, temperature=1.0, seed=5)
    c, _ = generate(tm, prompt, max_new_tokens=30, temperature=1.0, seed=6)
    greedy, _ = generate(tm, prompt, max_new_tokens=30)
    nucleus, _ = generate(tm, prompt, max_new_tokens=30, temperature=1.0, top_p=1e-6, seed=5)
    assert a == b and a != c
    assert nucleus == greedy  # a vanishing nucleus keeps only the top token


def test_generate_loop_stops_at_eos():
    tm = talify(tiny_model("llama"), 2)
    prompt = ids_for(12)[0].tolist()
    free, _ = generate(tm, prompt, max_new_tokens=20)
    eos = free[5]
    stop = free.index(eos)
    out, stats = generate(tm, prompt, max_new_tokens=20, eos_token_id=eos)
    assert out == free[: stop + 1] and stats.generated_tokens == stop + 1
    with pytest.raises(ValueError, match="empty prompt"):
        generate(tm, [], max_new_tokens=5)


def test_text_stream_holds_back_split_characters():
    tok = byte_tokenizer()
    text = "héllo wörld 😀 日本\nnext line ✓"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text.encode())  # one token per byte: characters span tokens
    s = TextStream(tok)
    pieces = [s.push(i) for i in ids] + [s.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    emoji_end = len("héllo wörld 😀".encode()) - 1
    assert pieces[emoji_end] == "😀" and pieces[emoji_end - 1] == ""


def test_generate_loop_streams_its_text():
    tm = talify(tiny_model("llama"), 2)
    tok = byte_tokenizer()
    pieces = []
    out, _ = generate(
        tm, tok("bonjour")["input_ids"], max_new_tokens=60, tokenizer=tok, on_text=pieces.append, eos_token_id=-1
    )
    assert "".join(pieces) == tok.decode(out, skip_special_tokens=True)


# -- loading and schedule overrides ---------------------------------------------------


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory):
    tm = talify(tiny_model("qwen2"), 2)
    return tm, save_artifact(tm, tmp_path_factory.mktemp("art") / "tiny", byte_tokenizer())


def test_load_reproduces_the_in_memory_model(tiny_artifact):
    tm, path = tiny_artifact
    model, tok = load(path, device="cpu", dtype=torch.float32, output_path="fused")  # the in-memory model's path
    assert tok is not None and model.tale_spec.schedule == tm.tale_spec.schedule
    ids = ids_for(30)
    assert torch.equal(decode_logits(model, ids, 10), decode_logits(tm, ids, 10))
    auto, _ = load(path, device="cpu")  # the CPU's default dtype (bf16 with bf16 instructions, else float32)
    want = default_dtype(torch.device("cpu"))
    assert auto.dtype == want and auto.model.layers[0].self_attn.tale.u_v.dtype == want


def test_generate_without_a_cache_gets_a_tale_cache(tmp_path):
    tm = talify(tiny_model("llama"), 2)
    model, _ = load(save_artifact(tm, tmp_path / "a"), device="cpu", dtype=torch.float32)
    ids = ids_for(20)
    with_cache = hf_greedy(model, ids, cache=new_cache(model))
    assert torch.equal(hf_greedy(model, ids), with_cache)


def test_a_dynamic_cache_runs_the_base_model():
    """transformers' DynamicCache given to a TALE model is the 16-bit baseline: the base model's tokens and logits,
    over several forward passes (TALE attention fills it as the base model would)."""
    from transformers import DynamicCache

    base = tiny_model("llama")
    tm = talify(base, 2)
    ids = ids_for(20)
    want = hf_greedy(base, ids, cache=DynamicCache(config=base.config))
    got = hf_greedy(tm, ids, cache=DynamicCache(config=tm.config))
    assert torch.equal(got, want)
    assert not torch.equal(got, hf_greedy(tm, ids))  # the TALE cache (default) decodes differently here
    with torch.no_grad():
        caches = [DynamicCache(config=m.config) for m in (base, tm)]
        for m, c in zip((base, tm), caches):
            m(ids, **cache_arg(c))
        step = ids[:, -1:]
        a, b = (m(step, **cache_arg(c)).logits for m, c in zip((base, tm), caches))
    torch.testing.assert_close(b, a)
    assert caches[1].get_seq_length() == ids.shape[1] + 1


def copy_artifact(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def edit_json(path, **changes):
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))


@pytest.mark.parametrize(
    "breakage,message",
    [
        ("missing", "no such artifact directory"),
        ("no_manifest", "not a TALE artifact"),
        ("bad_json", "corrupt manifest"),
        ("major", "format version '9.0' is not supported"),
        ("checksum", "checksum mismatch for model.safetensors"),
        ("shard", "model.safetensors is missing"),
        ("model_type", "model_type 'gpt2' is not supported"),
        ("schedule", "bits must be one of"),
    ],
)
def test_load_errors_are_clear(tiny_artifact, tmp_path, breakage, message):
    path = copy_artifact(tiny_artifact[1], tmp_path / "a")
    mf = path / "tale_config.json"
    if breakage == "missing":
        path = tmp_path / "nothing-here"
    elif breakage == "no_manifest":
        mf.unlink()
    elif breakage == "bad_json":
        mf.write_text(mf.read_text()[:-20])
    elif breakage == "major":
        edit_json(mf, format_version="9.0")
    elif breakage == "checksum":
        data = bytearray((path / "model.safetensors").read_bytes())
        data[-1] ^= 1
        (path / "model.safetensors").write_bytes(bytes(data))
    elif breakage == "shard":
        (path / "model.safetensors").unlink()
    elif breakage == "model_type":
        edit_json(path / "config.json", model_type="gpt2")
        m = json.loads(mf.read_text())  # with its checksum updated too (else: checksum mismatch for config.json)
        m["files"] = hash_files(path)
        mf.write_text(json.dumps(m))
    elif breakage == "schedule":
        m = json.loads(mf.read_text())
        m["schedule"]["levels"][0]["bits"] = 5
        mf.write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match=message) as e:
        load(path, device="cpu")
    assert "\n" not in str(e.value)


def test_schedule_overrides():
    base = Schedule(ranks=uniform_ranks(64, 3, 0.5, value_group=16), key_group=16, value_group=16, residual=16)
    s = override_schedule(base, 64, 3, sinks=8, recent=0.2, bits=[2, 8], key_bits=4, ranks=[0.25, 1.0])
    assert s.sinks == 8 and s.levels[1].share == 0.2
    assert [(lv.bits, lv.key_bits) for lv in s.levels] == [(2, 4), (8, 4)]
    assert s.ranks == [[16, 64]] * 3
    three = override_schedule(base, 64, 3, recent=[0.1, 0.05], bits=[2, 4, 8])
    assert [lv.share for lv in three.levels] == [None, 0.1, 0.05]
    assert three.ranks == [[32, 64, 64]] * 3  # level 0 keeps its rank, the new levels full rank
    assert override_schedule(base, 64, 3, ranks=[32, 48]).ranks == [[32, 48]] * 3
    assert override_schedule(base, 64, 3, ranks=0.3).ranks == [[16, 16]] * 3  # rounded down to value groups
    assert base.levels[1].share == 0.1  # the base is not modified
    for bad, msg in [
        (dict(bits=5), "bits must be one of"),
        (dict(recent=[0.1, 0.1]), "need bits for each level"),
        (dict(bits=[2, 4, 8]), "bits has 3 values for 2 levels"),
        (dict(ranks=[1.5, 1.0]), r"rank fraction 1.5 must lie in \(0, 1\]"),
        (dict(ranks=[40, 64]), "not a multiple of value_group"),
        (dict(ranks=[64, 32]), "non-decreasing"),
        (dict(recent=0.7, bits=[2, 4]), None),
        (dict(recent=[0.7, 0.6], bits=[2, 4, 8]), "sum to <= 1"),
        (dict(key_group=32), "multiple of key_group"),
        (dict(sinks=-1), "sinks must be >= 0"),
    ]:
        if msg is None:
            override_schedule(base, 64, 3, **bad)
            continue
        with pytest.raises(ValueError, match=msg):
            override_schedule(base, 64, 3, **bad)


def test_load_applies_overrides(tiny_artifact):
    _, path = tiny_artifact
    model, _ = load(path, device="cpu", sinks=2, recent=[0.1, 0.1], bits=[2, 4, 8], ranks=[0.5, 0.75, 1.0])
    s = model.tale_spec.schedule
    assert s.sinks == 2 and len(s.levels) == 3 and s.ranks[0] == [16, 24, 32]
    assert len(new_cache(model).layers[0].levels) == 3
    with pytest.raises(ValueError, match="schedule override"):
        load(path, device="cpu", bits=5)


# -- the real model -------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_answers_paris(smollm2_artifact):
    from tale_runtime.textgen import encode

    model, tok = load(smollm2_artifact, device="cpu")  # the CPU's defaults
    out, stats = generate(
        model, encode(tok, "What is the capital of France?", raw=False), max_new_tokens=24, tokenizer=tok
    )
    text = tok.decode(out, skip_special_tokens=True)
    print(f"\nanswer: {text!r}\n{stats.line()}")
    assert "Paris" in text
    assert math.isclose(stats.nominal_ratio, model.tale_spec.manifest["nominal_ratio"], rel_tol=1e-3)


def test_a_transformers_release_past_the_tested_ones_is_refused(tmp_path, monkeypatch):
    """transformers 5.24 renamed the cache argument (the runtime passes and reads either name); a later release
    could drop the TALE cache silently, so load() refuses it in one line before reading anything."""
    import transformers

    from tale_runtime.console import UserError
    from tale_runtime.load import check_transformers

    check_transformers()  # the one installed (pyproject pins it below 5.25)
    for v in ("5.25.0", "5.30.1", "6.0.0.dev0"):
        with pytest.raises(UserError, match=f"transformers {v} is newer than the releases .*<5.25'"):
            check_transformers(v)
    check_transformers("5.23.0")
    check_transformers("5.24.0")
    check_transformers("5.17.0")
    for v in ("5.2.0", "5.16.1", "4.57.0"):
        with pytest.raises(UserError, match=f"transformers {v} is older than the releases .*>=5.17,<5.25'"):
            check_transformers(v)
    monkeypatch.setattr(transformers, "__version__", "5.25.0")
    with pytest.raises(UserError, match="renamed past_key_values to cache"):
        load(tmp_path / "nothing-here")  # refused before the path is looked at


def test_generate_refuses_a_static_cache_too_small_and_a_cache_it_cannot_continue():
    """A static cache sized below prompt + max_new_tokens is refused before anything runs (its levels are sized for
    max_length); a TALE cache that already holds the prompt's tokens is refused (one line), one whose prompt extends
    what it holds continues it: at exact settings the same tokens as one generate over the whole sequence."""
    tm = talify(tiny_model("llama"), 2, exact_schedule(32, 2))
    ids = ids_for(20)
    with pytest.raises(ValueError, match="static cache holds 30 tokens per row; this call caches 67"):
        hf_greedy(tm, ids, cache=new_cache(tm, static=True, max_length=30), n=48)
    c = new_cache(tm)
    first = torch.cat([ids, hf_greedy(tm, ids, cache=c, n=5)], 1)
    with pytest.raises(ValueError, match="already holds 24 tokens and the prompt has 20"):
        hf_greedy(tm, ids, cache=c, n=5)
    assert c.get_seq_length() == 24  # the refused call wrote nothing
    more = torch.cat([first, ids_for(3)], 1)
    assert torch.equal(hf_greedy(tm, more, cache=c, n=5), hf_greedy(tm, more, cache=new_cache(tm), n=5))
