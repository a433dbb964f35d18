"""vLLM serving with TALE's packed cache (stage 2) on the CPU, end to end: a --group 2 artifact of the tiny Llama (two
KV heads share one latent group: one slot per token and layer holds both keys and the group's latent).

At 16 bits the slots hold the post-RoPE keys and full-rank latents exactly: the greedy tokens are the base model's.
At 4 bits the oracle is tale_runtime on the same artifact with the same one-level schedule (every token at 4-bit
per-token keys and latents, keys after a Hadamard rotation, no sinks, each token quantized once it has attended as a
new token: residual 1)."""

from __future__ import annotations

import pytest
import torch
from conftest import ENGINE, PROMPTS, VLLM, greedy, kv_bytes_per_token, main_fixtures, shutdown

import tale_runtime.vllm as tale_vllm
from tale_runtime.paged import PagedFormat

pytest.importorskip(VLLM)  # vLLM itself, not this test directory
import vllm  # noqa: E402

STEPS = 12


@pytest.fixture(scope="module")
def artifact_g2(tiny_llama, tmp_path_factory):
    from tale_convert.convert import Options, convert

    out = tmp_path_factory.mktemp("art") / "tiny-llama32-g2"
    convert(str(tiny_llama), out, Options(group=2, **main_fixtures.TINY_OPTS))
    return out


def packed_run(art, kv_cache: str, sinks: int = 0):
    """Greedy tokens, top-5 log-probabilities per step, KV bytes per token and the prompts' token ids of the packed
    engine."""
    llm = vllm.LLM(**tale_vllm.engine_args(art, kv_cache=kv_cache, exact_layers=0, sinks=sinks), **ENGINE)
    try:
        tokens, logprobs = greedy(llm, max_tokens=STEPS, logprobs=5)
        prompt_ids = [llm.get_tokenizer()(p).input_ids for p in PROMPTS]
        return tokens, logprobs, kv_bytes_per_token(llm), prompt_ids
    finally:
        shutdown(llm)


def slot_formats(art, bits: int, exact_layers: int = 0) -> list[PagedFormat]:
    from tale_runtime.vllm import source

    src = source.open_artifact(art, kv_cache=f"k{bits}v{bits}", exact_layers=exact_layers)
    return [src.paged_format(i, torch.float32) for i in range(src.arch.num_layers)]


def oracle_logprobs(art, prompt_ids: list[int], tokens: list[int], bits: int = 4, sinks: int = 0) -> torch.Tensor:
    """tale_runtime's log-probabilities [steps, vocab] along `tokens` (teacher-forced), one per-token level."""
    import tale_runtime
    from tale_runtime.load import new_cache

    model, _ = tale_runtime.load(
        art,
        device="cpu",
        dtype=torch.float32,
        sinks=sinks,
        recent=[],
        bits=bits,
        ranks=1.0,  # every latent at full rank R, as the engine's value rank "full"
        key_axis="token",
        rotate="hadamard",
        key_channel_group=32,
        value_group=32,
        residual=1,
    )
    cache = new_cache(model)
    out = []
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids]), past_key_values=cache).logits[0, -1]
        for t in tokens:
            out.append(logits.log_softmax(-1))
            logits = model(torch.tensor([[t]]), past_key_values=cache).logits[0, -1]
    return torch.stack(out)


def test_packed_16bit_slots_give_the_base_models_tokens(artifact_g2, base_run, capsys):
    base_tokens, base_bytes = base_run
    tokens, _, got, _ = packed_run(artifact_g2, "k16v16")
    assert tokens == base_tokens
    want = sum(f.slot_bytes for f in slot_formats(artifact_g2, 16))  # per layer G = 1 slot (K = 2 heads, g = 2)
    with capsys.disabled():
        print(f"\npacked 16-bit: KV bytes/token {got} (fp32), base {base_bytes}")
    assert got == want == base_bytes  # one latent of R = 2n per two KV heads: the base's K*n values per token


@pytest.mark.parametrize("sinks", [0, 4])
def test_packed_4bit_follows_tale_runtime(artifact_g2, base_run, capsys, sinks):
    """sinks = 4: the first 4 tokens of each request at 16 bits in the sinks buffer (the shortest prompt's sinks are
    partly generated tokens), as tale_runtime's sinks."""
    base_tokens, base_bytes = base_run
    tokens, logprobs, got, prompt_ids = packed_run(artifact_g2, "k4v4", sinks)
    fmts = slot_formats(artifact_g2, 4)
    assert got == sum(f.slot_bytes for f in fmts)
    a = main_fixtures.TINY["llama32"]
    L, K, n = a["num_hidden_layers"], a["num_key_value_heads"], a["head_dim"]
    bf16 = L * 2 * K * n * 2
    bf16_packed = sum(PagedFormat(f.head_dim, f.group, f.rank, 4, 4, f.key_group, f.lat_group).slot_bytes for f in fmts)

    worst, same_oracle, same_base, off_exact = 0.0, 0, 0, 0.0
    for ids, toks, lps, base in zip(prompt_ids, tokens, logprobs, base_tokens):
        want = oracle_logprobs(artifact_g2, ids, toks, sinks=sinks)
        exact = oracle_logprobs(artifact_g2, ids, toks, bits=16)
        for step, top in enumerate(lps):
            top_ids = list(top)
            got_lp = torch.tensor([top[i].logprob for i in top_ids])
            worst = max(worst, (got_lp - want[step, top_ids]).abs().max().item())
            off_exact = max(off_exact, (got_lp - exact[step, top_ids]).abs().max().item())
        same_oracle += toks == [int(x) for x in want.argmax(-1)]
        same_base += sum(x == y for x, y in zip(toks, base))
    with capsys.disabled():
        print(
            f"\npacked k4v4, {sinks} sinks: KV bytes/token {got} (fp32 cache; vLLM's fp32 base {base_bytes}: {base_bytes / got:.2f}x); "
            f"at bf16 {bf16_packed} vs vLLM's bf16 cache {bf16}: {bf16 / bf16_packed:.2f}x; max |log-prob - "
            f"tale_runtime| {worst:.2e} over {len(PROMPTS)} x {STEPS} steps (top 5; vs 16-bit tokens {off_exact:.2e}); "
            f"greedy argmax = tale_runtime's "
            f"in {same_oracle}/{len(PROMPTS)} prompts; tokens = base model's {same_base}/{len(PROMPTS) * STEPS}"
        )
    assert worst < 1e-4  # the same arithmetic up to float32 rounding
    assert off_exact > 1e-2  # and the 4-bit tokens are not read back exact
    assert same_oracle == len(PROMPTS)
    assert same_base >= len(PROMPTS) * STEPS * 3 // 4  # 4-bit keys and latents: the greedy tokens mostly stay


def test_packed_layers_between_16bit_ones(converted, capsys):
    """exact_layers=1 (the default): the first and last layer hold 16-bit slots, the middle one 8-bit slots; vLLM
    keeps both sizes in one engine, and the tokens read back follow the base model's closely but not exactly."""
    base, art = converted("llama32x3", 2)
    llm = vllm.LLM(model=str(base), **ENGINE)
    try:
        base_tokens, base_lps = greedy(llm, max_tokens=STEPS, logprobs=5)
    finally:
        shutdown(llm)
    llm = vllm.LLM(**tale_vllm.engine_args(art, kv_cache="k8v8"), **ENGINE)
    try:
        tokens, lps = greedy(llm, max_tokens=STEPS, logprobs=5)
        got = kv_bytes_per_token(llm)
    finally:
        shutdown(llm)
    fmts = slot_formats(art, 8, exact_layers=1)
    assert [(f.key_bits, f.lat_bits) for f in fmts] == [(16, 16), (8, 8), (16, 16)]
    assert got == sum(f.slot_bytes for f in fmts) == 512 + 160 + 512
    assert tokens == base_tokens
    diff = max(
        abs(a[t].logprob - b[t].logprob) for ra, rb in zip(lps, base_lps) for a, b in zip(ra, rb) for t in a if t in b
    )
    with capsys.disabled():
        print(f"\npacked k8v8 between 16-bit layers: KV bytes/token {got}; max |log-prob - base| {diff:.2e}")
    assert 0 < diff < 1e-2
