"""The CUDA decode kernel (tale_kernels.mma_attention) on static caches in the fragment layout: against the torch
reference on the same cache, and end to end (greedy tokens with the kernel on and off, inside CUDA graphs). Needs a
Hopper GPU and NVRTC or nvcc; the layout itself is tested on the CPU (test_frag.py, test_cuda_layout.py)."""

from dataclasses import replace

import pytest
import torch
from tale_helpers import talify

from tale_runtime import backends, new_cache
from tale_runtime.artifact import Schedule
from tale_runtime.attention import latent_attention as reference
from tale_runtime.generate import generate
from tale_runtime.spec import Arch, CacheSpec
from tale_runtime.static_cache import StaticTaleCache

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = pytest.mark.skipif(not HOPPER, reason="the CUDA decode kernel runs on Hopper GPUs")

K, n, G, R, H = 8, 128, 2, 512, 32  # Llama-3.1-8B's attention, group 4 (Llama-3.1-70B's: H = 64)
PAPER = Schedule(ranks=[[256, 512]], key_group=32, value_group=32, residual=32)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def poison():
    """NaN into the memory the caching allocator hands out next: an output the kernel leaves unwritten shows."""
    x = torch.full((64 << 20,), float("nan"), device="cuda")
    del x


def filled(B: int, prompt: int, steps: int, pad: int = 0, max_extra: int = 64, seed: int = 0, heads: int = H):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cuda = backends.get("cuda")
    c = StaticTaleCache(PAPER, 1, K, n, G, R, max_length=prompt + steps + max_extra, num_heads=heads, backend=cuda)
    valid = torch.ones(B, prompt, dtype=torch.bool, device="cuda")
    valid[-1, :pad] = False
    k = torch.randn(B, K, prompt, n, device="cuda", generator=gen).bfloat16() * 2
    h = torch.randn(B, G, prompt, R, device="cuda", generator=gen).bfloat16()
    c.layers[0].append(k, h, valid)
    for _ in range(steps):
        c.layers[0].append(
            torch.randn(B, K, 1, n, device="cuda", generator=gen).bfloat16() * 2,
            torch.randn(B, G, 1, R, device="cuda", generator=gen).bfloat16(),
        )
    return c, gen


# query heads per KV head: 1 (Llama-2-7B), 2, 4 (Llama-3.1-8B), 5 (Qwen2.5-14B), 7 (Qwen2.5-7B), 8 (Llama-3.1-70B),
# 16 (Llama-3.1-405B)
@pytest.mark.parametrize("heads", [K, 2 * K, 4 * K, 5 * K, 7 * K, 8 * K, 16 * K])
@pytest.mark.parametrize(
    "B,prompt,steps,pad,window",
    [
        (1, 3000, 0, 0, None),
        (1, 1000, 77, 0, None),
        (4, 5003, 45, 0, None),
        (3, 2500, 33, 700, None),
        (2, 4100, 20, 0, 1500),
        (16, 300, 9, 0, None),
        (1, 5, 3, 0, None),
        (1, 40, 1, 0, None),
    ],
)
def test_matches_the_reference(B, prompt, steps, pad, window, heads):
    """Fresh random caches after a prefill and decode steps (flushes, demotions, odd residual lengths), batch 1 to 16,
    left padding, sliding windows, levels still empty: within 5e-3 of the float32 reference on the same bytes."""
    from tale_kernels import latent_attention, mma_attention

    c, gen = filled(B, prompt, steps, pad, heads=heads)
    assert c.layout == "frag"
    layer = c.layers[0]
    v = layer.view()
    q = torch.randn(B, heads, 1, n, device="cuda", generator=gen).bfloat16()
    kn = torch.randn(B, K, 1, n, device="cuda", generator=gen).bfloat16() * 2
    hn = torch.randn(B, G, 1, R, device="cuda", generator=gen).bfloat16()
    assert mma_attention.supported(q, kn, hn, v) is None
    want = reference(q, kn, hn, v, n**-0.5, window)
    for pdl in (False, True):
        poison()
        got = mma_attention.latent_attention(q, kn, hn, v, n**-0.5, window, pdl=pdl)
        assert torch.isfinite(got).all() and rel(got, want) <= 5e-3, (pdl, rel(got, want))
    poison()
    assert c.backend.name == "cuda"  # new_cache chose it; the cache's own call runs it
    assert rel(c.attend(0, q, kn, hn, n**-0.5, window), want) <= 5e-3
    # the fragment layout is not the Triton kernel's: it refuses the call, it does not run the reference in its name
    with pytest.raises(ValueError, match="^triton latent attention: a view in the CUDA kernel's fragment layout$"):
        latent_attention(q, kn, hn, v, n**-0.5, window)


def test_not_taken_where_it_does_not_apply():
    """A call the kernel does not serve is refused with its reason; float32 queries, which the cache's spec cannot
    show, reach the reference through the cache, which warns and counts them for the stats line."""
    from tale_kernels import mma_attention

    c, gen = filled(1, 200, 0)
    v = c.layers[0].view()
    q = torch.randn(1, H, 1, n, device="cuda").bfloat16()
    kn, hn = torch.randn(1, K, 1, n, device="cuda").bfloat16(), torch.randn(1, G, 1, R, device="cuda").bfloat16()
    assert mma_attention.supported(q, kn, hn, v) is None
    assert mma_attention.supported(q.float(), kn, hn, v) == "float32 queries (it reads bfloat16)"
    with pytest.raises(ValueError, match=r"^cuda latent attention: float32 queries \(it reads bfloat16\)$"):
        c.backend(q.float(), kn, hn, v, n**-0.5)
    assert c.backend.declines(q.float(), kn, hn, v) == "float32 queries (the kernel reads bfloat16)"
    assert c.backend.declines(q, kn, hn, v) is None
    with pytest.warns(UserWarning, match="'cuda'.*torch reference: float32 queries"):
        z = c.attend(0, q.float(), kn, hn, n**-0.5)
    assert torch.equal(z, reference(q.float(), kn, hn, v, n**-0.5))
    c.attend(0, q, kn, hn, n**-0.5)
    assert (
        c.reference_calls.note()
        == "1 of 2 decode calls ran the torch reference: float32 queries (the kernel reads bfloat16)"
    )
    q2 = q.expand(1, H, 2, n)
    assert mma_attention.supported(q2, kn, hn, v) == "2 new tokens (the kernel decodes one)"
    row = StaticTaleCache(PAPER, 1, K, n, G, R, max_length=300, layout="row", num_heads=H)
    row.layers[0].append(
        torch.randn(1, K, 200, n, device="cuda").bfloat16(), torch.randn(1, G, 200, R, device="cuda").bfloat16()
    )
    assert row.layout == "row"
    assert mma_attention.supported(q, kn, hn, row.layers[0].view()).startswith("a view that is not a fragment-layout")
    why = mma_attention.supported(q[:, : 3 * K + 1], kn, hn, v)
    assert why == f"{3 * K + 1} query heads over {K} KV heads (a whole number per KV head)"
    spec = CacheSpec(Arch("llama", 1, 4096, 3 * K + 1, K, n, 4, G, R), PAPER, True, torch.device("cuda"))
    assert backends.choose(spec).name == "triton" and "whole number" in backends.get("cuda").supports(spec)
    assert backends.choose(replace(spec, arch=replace(spec.arch, num_heads=4 * K))).name == "cuda"


def model_of_shapes(heads: int):
    """Two decoder layers of Llama-3.1-8B's attention shapes (8 KV heads of 128 channels) with `heads` query heads
    (32 as in Llama-3.1-8B, 64 as in -70B; tiny MLP and vocabulary), as a bf16 TALE model with the paper preset at
    groups of 32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "llama",
        hidden_size=640,  # a multiple of every head count tested (8, 32, 40, 64)
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=K,
        head_dim=n,
        vocab_size=320,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
    sched = Schedule(ranks=[[256, 512]] * 2, key_group=32, value_group=32, residual=32)
    return talify(base, 4, sched).to(device="cuda", dtype=torch.bfloat16)


def same_until_a_tie(out, ref, prompt: int) -> None:
    """Greedy tokens equal to the reference's, row by row, up to a step where the reference itself sits on a tie (its
    top two logits within 2 bf16 steps: random models fall into such loops); logits close at every step before."""
    for b in range(ref.sequences.shape[0]):
        diff = (out.sequences[b, prompt:] != ref.sequences[b, prompt:]).nonzero()
        end = int(diff[0]) if len(diff) else len(ref.logits)
        for i in range(end):
            assert rel(out.logits[i][b], ref.logits[i][b]) < 1e-2, (b, i)
        if end < len(ref.logits):
            top = ref.logits[end][b].float().topk(2).values
            ulp = 2.0 ** (torch.floor(torch.log2(top[0].abs())) - 7)
            assert float(top[0] - top[1]) <= 2 * float(ulp), f"row {b} differs at step {end} without a tie"


@pytest.mark.parametrize("heads", [K, 4 * K, 5 * K, 8 * K])
def test_greedy_tokens_with_the_kernel_on_and_off(monkeypatch, heads):
    """generate() on a static cache: CUDA graphs over the CUDA kernel (fragment layout), the same cache type with the
    torch reference, and the Triton kernel on the row layout give the same tokens (up to ties of the reference)."""
    from tale_kernels import mma_attention
    from tale_runtime.decode import decoder_of
    from tale_runtime.model import cache_arg

    calls, kernel = [], mma_attention.latent_attention
    monkeypatch.setattr(mma_attention, "latent_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    tm = model_of_shapes(heads)
    tm.lm_head.weight.data *= 8  # peaked logits: fewer exact ties in bf16
    ids = torch.randint(1, 320, (2, 700), generator=torch.Generator().manual_seed(3)).cuda()
    kw = dict(max_new_tokens=80, do_sample=False, output_logits=True, return_dict_in_generate=True)

    def run(layout: str, backend: str):
        cache = new_cache(tm, static=True, backend=backend, layout=layout)
        out = tm.generate(ids, attention_mask=torch.ones_like(ids), **cache_arg(cache), **kw)
        assert cache.layout == layout and cache.backend.name == backend
        return out, cache

    on, cache = run("frag", "cuda")
    assert calls, "the CUDA kernel was not used"
    dec = decoder_of(tm, cache)
    assert dec is not None and dec.graph is not None and dec.error is None
    off, _ = run("frag", "torch")
    triton, _ = run("row", "triton")
    same_until_a_tie(on, off, ids.shape[1])
    same_until_a_tie(triton, off, ids.shape[1])
    assert (on.sequences == off.sequences).float().mean() > 0.9
    _, stats = generate(tm, ids[0].tolist(), max_new_tokens=4)
    assert stats.attention == "cuda kernel (fragment layout)"
