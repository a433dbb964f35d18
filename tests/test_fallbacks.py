"""No silent fallback: a decode step runs on the backend its cache names, or the user is told.

- Each kernel entry point (the Triton kernel, the low-rank-key kernel, the CUDA kernel) refuses a decode step it
  does not serve with a ValueError naming the kernel and why, instead of running the torch reference under its name;
  a chunk of several new tokens is the reference's by design.
- A backend refuses from the cache's spec what its kernel would refuse of the cache's calls (backends.choose).
- What only the call shows (AttentionBackend.declines: the queries' dtype) runs on the reference, warned about once
  and counted where the user reads the backend's name: generate's stats line, tale-run's stats line and --json.

Kernels run in Triton's interpreter on a CPU (kernel_tests), compiled on a GPU (make test-gpu); the CUDA kernel's
refusals are checked before any launch, so they run on a CPU.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pytest
import torch
from kernel_tests import CUDA, DEVICE, interpret, kernels  # noqa: F401  (interpret: autouse fixture)

attention, lra = kernels("attention", "lowrank_attention", kernel="_attn_kernel")
from tale_helpers import byte_tokenizer, invoke, save_artifact, talify, tiny_model  # noqa: E402
from tiny_configs import IN_MEMORY as TINY  # noqa: E402

from tale_kernels import mma_attention  # noqa: E402
from tale_runtime import backends, new_cache  # noqa: E402
from tale_runtime.artifact import Level, Schedule  # noqa: E402
from tale_runtime.attention import latent_attention as reference  # noqa: E402
from tale_runtime.cache import RegionStore  # noqa: E402
from tale_runtime.generate import generate  # noqa: E402
from tale_runtime.spec import Arch, CacheSpec  # noqa: E402
from tale_runtime.static_cache import StaticTaleCache  # noqa: E402

B, H, K, g, n = 1, 8, 4, 2, 32
G, R = K // g, g * n


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def spec(s: Schedule, static: bool = False) -> CacheSpec:
    return CacheSpec(Arch("llama", 1, 256, H, K, n, g, G, R), s, static, torch.device(DEVICE), torch.float32)


def filled(s: Schedule, static: bool = False, tokens: int = 100):
    c = (
        StaticTaleCache(s, 1, K, n, G, R, max_length=300, num_heads=H).layers[0]
        if static
        else RegionStore(s, 0, K, n, G, R)
    )
    gen = torch.Generator().manual_seed(0)
    c.append(
        torch.randn(B, K, tokens, n, generator=gen).to(DEVICE), torch.randn(B, G, tokens, R, generator=gen).to(DEVICE)
    )
    return c


def new_token(T: int = 1, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    return tuple(torch.randn(B, x, T, d, generator=gen).to(DEVICE, dtype) for x, d in ((H, n), (K, n), (G, R)))


def plain(**kw) -> Schedule:
    return Schedule(**{**dict(ranks=[[32, 64]], key_group=16, value_group=16, residual=16), **kw})


# -- the kernels' entry points ---------------------------------------------------------------------------------------


def test_triton_kernel_refuses_a_decode_step_it_does_not_serve():
    """3-bit latents: refused with the reason, which the triton backend gives for the cache's spec too (the cache
    never reaches the kernel); two new tokens: the reference's result, by design."""
    s = plain(levels=[Level(3, 4, None), Level(4, 4, 0.2)])
    c = filled(s)
    q, k, h = new_token()
    why = "3-bit latents are not read by this kernel"
    assert attention.supported(q, k, h, c) == why
    with pytest.raises(ValueError, match=f"^triton latent attention: {why}$"):
        attention.latent_attention(q, k, h, c, 0.2)
    with pytest.raises(ValueError, match=f"^attention backend 'triton' does not serve this cache: {why}$"):
        backends.choose(spec(s), "triton")
    q2, k2, h2 = new_token(2)
    assert torch.equal(attention.latent_attention(q2, k2, h2, c, 0.2), reference(q2, k2, h2, c.view(), 0.2))


@pytest.mark.skipif(CUDA, reason="CPU tensors reach a kernel only on a machine without a GPU")
def test_kernels_refuse_cpu_tensors_without_the_interpreter(monkeypatch):
    c = filled(plain())
    q, k, h = new_token()
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=r"^triton latent attention: CPU tensors \(it runs on CUDA, or on the CPU"):
        attention.latent_attention(q, k, h, c, 0.2)
    with pytest.raises(ValueError, match="^triton low-rank-key latent attention: CPU tensors without TRITON_INTERPRET"):
        lra.latent_attention_lowrank(q, k, h, c.view(), 0.2)


@pytest.mark.parametrize(
    "kw,why",
    [
        (dict(key_group=24, residual=24), "keys quantized in groups of 24 tokens (it reads power-of-two groups)"),
        (
            dict(value_group=24, ranks=[[48, 48]]),
            "latents quantized in groups of 24 channels (it reads power-of-two groups)",
        ),
        (dict(ranks=[[48, 64]]), "latent groups of 16 channels straddle the 12-channel planes of rank 48 at 2 bits"),
        (
            dict(
                levels=[Level(16, 16, None, key_hi_bits=8, key_hi_channels=8), Level(4, 4, 0.2)],
                key_order=[[list(range(n))] * K],
            ),
            "key bands beside 16-bit keys are not read by this kernel",
        ),
    ],
    ids=["key-group-24", "value-group-24", "groups-straddle-planes", "16-bit-key-bands"],
)
def test_triton_backend_refuses_from_the_spec_what_the_kernel_refuses(kw, why):
    """Formats the Triton kernel does not read, which its backend accepted before (and the kernel then ran the torch
    reference in its name): refused for the cache's spec with the kernel's own reason, so "auto" passes the cache
    to a backend that reads it."""
    s = plain(**kw)
    c = filled(s)
    q, k, h = new_token()
    assert attention.supported(q, k, h, c) == why
    assert backends.get("triton").supports(spec(s)) == why
    with pytest.raises(ValueError, match=f"^triton latent attention: {re.escape(why)}$"):
        attention.latent_attention(q, k, h, c, 0.2)


def test_triton_kernel_serves_a_static_cache_without_sinks():
    """A region of no capacity (a static cache's sinks at sinks=0) holds nothing to attend: the kernel reads the
    rest (it declined the whole view before, and the reference ran in its name)."""
    c = filled(plain(sinks=0), static=True)
    assert any(r.capacity == 0 for r in c.view().regions)
    q, k, h = new_token()
    assert attention.supported(q, k, h, c) is None
    z = attention.latent_attention(q, k, h, c.view(), 0.2)
    assert rel(z, reference(q, k, h, c.view(), 0.2)) < (5e-3 if CUDA else 1e-5)


def test_lowrank_kernel_refuses_a_decode_step_it_does_not_serve():
    """Key bands (the tale preset's), which the low-rank-key kernel does not read: refused with the reason, and by
    its backends for the spec; two new tokens: the reference's result."""
    s = plain(
        levels=[Level(2, 2, None, key_hi_bits=4, key_hi_channels=8), Level(4, 4, 0.2)], key_order=[[list(range(n))] * K]
    )
    c = filled(s)
    q, k, h = new_token()
    why = "keys are Bands, not a QTensor (key bands are not read here)"
    assert lra.supported(q, k, h, c.view()) == why
    with pytest.raises(ValueError, match=f"^triton low-rank-key latent attention: {re.escape(why)}$"):
        lra.latent_attention_lowrank(q, k, h, c.view(), 0.2)
    assert "key bands" in backends.get("triton-lowrank").supports(spec(s))
    q2, k2, h2 = new_token(2)
    want = reference(q2, k2, h2, c.view(), 0.2)
    assert torch.equal(lra.latent_attention_lowrank(q2, k2, h2, c.view(), 0.2), want)


def frag_cache():
    """A bf16 static cache in the CUDA kernel's fragment layout (the paper preset at Llama-3.1-8B's head dim, one
    latent group of 4 KV heads), on the CPU: the kernel's checks run before any launch."""
    s = Schedule(ranks=[[256, 512]], key_group=32, value_group=32, residual=32)
    c = StaticTaleCache(s, 1, 4, 128, 1, 512, max_length=300, layout="frag")
    gen = torch.Generator().manual_seed(5)
    c.layers[0].append(
        torch.randn(1, 4, 200, 128, generator=gen).bfloat16(), torch.randn(1, 1, 200, 512, generator=gen).bfloat16()
    )
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(1, 16, 1, 128, generator=gen).bfloat16()
    return (
        c,
        q,
        torch.randn(1, 4, 1, 128, generator=gen).bfloat16(),
        torch.randn(1, 1, 1, 512, generator=gen).bfloat16(),
    )


def test_cuda_kernel_refuses_a_decode_step_it_does_not_serve():
    """float32 queries over a fragment-layout cache: the CUDA kernel's entry point and the cuda backend's run refuse
    them (they ran the torch reference as the cuda kernel before); the backend declines them as a condition of the
    call, which the cache reports (next tests). Two new tokens: the reference's result."""
    c, q, k, h = frag_cache()
    v = c.layers[0].view()
    why = "float32 queries (it reads bfloat16)"
    assert mma_attention.supported(q.float(), k, h, v) == why
    with pytest.raises(ValueError, match=rf"^cuda latent attention: {re.escape(why)}$"):
        mma_attention.latent_attention(q.float(), k, h, v, 0.1)
    cuda = backends.get("cuda")
    with pytest.raises(ValueError, match=rf"^cuda latent attention: {re.escape(why)}$"):
        cuda(q.float(), k, h, v, 0.1)
    assert cuda.declines(q.float(), k, h, v) == "float32 queries (the kernel reads bfloat16)"
    if not CUDA:
        assert mma_attention.supported(q, k, h, v) == "CPU tensors (it runs on a GPU)"
        assert cuda.declines(q, k, h, v) == "a layer on cpu, where the kernel is not available"
    q2, k2, h2 = (t.expand(-1, -1, 2, -1) for t in (q, k, h))
    assert torch.equal(cuda(q2, k2, h2, v, 0.1), reference(q2, k2, h2, v, 0.1))


# -- what the user reads -----------------------------------------------------------------------------------------------


def test_a_declined_call_is_reported_beside_the_backend_name():
    """The cuda backend declines float32 queries: the cache runs them on the torch reference (the same tokens as the
    reference backend), warns once naming the backend and why, and generate's stats line and JSON count them."""
    tm = talify(tiny_model("llama"), 2)
    L = tm.config.num_hidden_layers
    ids = list(range(1, 30))
    want, _ = generate(tm, ids, max_new_tokens=5, cache=new_cache(tm, backend="torch"))
    cache = new_cache(tm, backend=backends.get("cuda"))  # a backend object is used as it is, spec unchecked
    with pytest.warns(UserWarning, match=r"^attention backend 'cuda': .* torch reference: float32 queries") as seen:
        out, stats = generate(tm, ids, max_new_tokens=5, cache=cache)
    assert len([w for w in seen if "attention backend" in str(w.message)]) == 1  # once, not per call
    assert out == want
    calls = L * (len(out) - 1)  # a call per layer and decode step; the prefill is no decode call
    why = "float32 queries (the kernel reads bfloat16)"
    assert (stats.attention_calls, stats.attention_reference) == (calls, {why: calls})
    assert stats.line().endswith(
        f"| attention: cuda kernel ({calls} of {calls} decode calls ran the torch reference: {why})"
    )
    d = stats.as_dict()
    assert (d["attention"], d["attention_calls"], d["attention_reference"]) == ("cuda kernel", calls, {why: calls})
    # a second generation over the same cache counts its own calls (two fed tokens: a chunk, no decode call)
    more, again = generate(tm, ids + out + [7], max_new_tokens=3, cache=cache)
    calls = L * (len(more) - 1)
    assert (again.attention_calls, again.attention_reference) == (calls, {why: calls})


def test_the_stats_line_names_the_reference_calls_in_the_backends_name():
    from tale_runtime.generate import GenStats

    why = "float32 queries (the kernel reads bfloat16)"
    st = GenStats(10, 33, 0.1, 1.0, 100, 400, 4.0, "cuda kernel (fragment layout)", 64, {why: 2})
    assert st.line().endswith(
        f"| attention: cuda kernel (fragment layout; 2 of 64 decode calls ran the torch reference: {why})"
    )
    st = GenStats(10, 33, 0.1, 1.0, 100, 400, 4.0, "triton kernel", 64, {why: 2, "a layer on cuda:1, where ...": 1})
    assert st.line().endswith(
        f"| attention: triton kernel (3 of 64 decode calls ran the torch reference: {why} (2 calls); "
        "a layer on cuda:1, where ... (1 call))"
    )
    assert GenStats(10, 33, 0.1, 1.0, 100, 400, 4.0, "triton kernel", 64).line().endswith("| attention: triton kernel")


@dataclass(frozen=True)
class OddSteps(backends.AttentionBackend):
    """A test backend that declines the decode calls at odd cache positions (a condition of the call) and serves the
    others with the reference."""

    name: str = "odd-steps"
    label: str = "odd-steps kernel"

    def declines(self, q, k_new, h_new, view):
        return "an odd position (test)" if int(view.next_pos) % 2 else None

    def run(self, q, k_new, h_new, view, scaling, window):
        return backends.TORCH.run(q, k_new, h_new, view, scaling, window)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return save_artifact(
        talify(tiny_model("llama"), 2), tmp_path_factory.mktemp("fallbacks") / "tiny", byte_tokenizer()
    )


def test_tale_run_shows_reference_calls_beside_the_backend(artifact, monkeypatch):
    """tale-run's stats line (stderr) and --json name the backend and how many decode calls ran the reference, why."""
    from tale_runtime.cli import main

    backends.registered()  # the plugins first: the test backend is added beside them
    monkeypatch.setitem(backends._REG.backends, OddSteps.name, OddSteps())
    args = [artifact, "--prompt", "hi", "--max-new-tokens", "6", "--dtype", "fp32", "--device", "cpu"]
    args += ["--backend", "odd-steps"]
    with pytest.warns(UserWarning, match="^attention backend 'odd-steps': .*: an odd position"):
        r = invoke(main, [*args, "--json"])
    assert r.exit_code == 0, r.stderr
    st = json.loads(r.stdout)["stats"]
    L = TINY["llama"]["num_hidden_layers"]
    positions = range(st["prompt_tokens"], st["prompt_tokens"] + st["generated_tokens"] - 1)
    odd = L * sum(p % 2 for p in positions)
    assert st["attention"] == "odd-steps kernel" and st["attention_calls"] == L * len(positions)
    assert odd and st["attention_reference"] == {"an odd position (test)": odd}
    with pytest.warns(UserWarning, match="^attention backend 'odd-steps'"):
        r = invoke(main, args)
    assert r.exit_code == 0, r.stderr
    note = f"attention: odd-steps kernel ({odd} of {L * len(positions)} decode calls ran the torch reference: an odd position (test))"
    assert note in r.stderr


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_graph_replays_count_their_reference_calls():
    """On a GPU generate replays a CUDA graph per decode step: the calls captured once are counted at every replay."""

    @dataclass(frozen=True)
    class Declining(backends.AttentionBackend):
        name: str = "declining"
        label: str = "declining kernel"

        def declines(self, q, k_new, h_new, view):
            return "every call (test)"

        def run(self, q, k_new, h_new, view, scaling, window):
            raise AssertionError("a declined call reached run")

    tm = talify(tiny_model("llama"), 2).to("cuda")
    L = tm.config.num_hidden_layers
    cache = new_cache(tm, static=True, max_length=60, backend=Declining())
    out, stats = generate(tm, list(range(1, 30)), max_new_tokens=12, cache=cache)
    calls = L * (len(out) - 1)
    assert stats.attention_calls == calls and stats.attention_reference == {"every call (test)": calls}
    from tale_runtime.decode import decoder_of

    dec = decoder_of(tm, cache)
    assert dec is not None and dec.graph is not None  # the steps were replays
    assert (dec.step_calls.calls, dec.step_calls.reference) == (L, {"every call (test)": L})  # one replay's calls
