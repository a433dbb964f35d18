"""Sinks beside the paged cache (tale_runtime.paged.Sinks): the torch reference against a float64 attention, the Triton
paged kernel with sinks (Triton's interpreter on the CPU) against the reference, the vLLM backend's decode dispatch
(tale_runtime.vllm.decode, no vLLM needed), and the rows of the sinks buffer (tale_runtime.vllm.sinks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_tests import DEVICE, interpret, kernels  # noqa: F401  (interpret: autouse fixture)

(pa,) = kernels("paged_attention", kernel="_paged_kernel")

from tale_runtime import paged  # noqa: E402
from tale_runtime.vllm.decode import decode_attention, kernel_available  # noqa: E402
from tale_runtime.vllm.sinks import SinkRows  # noqa: E402

G, g, REP, N, R, RANK, A = 2, 2, 2, 16, 32, 16, 4  # as tests/test_paged_attention.py, 4 sinks
K, H = G * g, G * g * REP
SMALL = pa.PagedConfig(block_t=32, split_tokens=32)


def case(lengths, firsts, page_size, kb=4, hb=4, seed=0):
    """Pages in random order (0xFF where never written: NaN scales), every token of each sequence written to its
    slots (the sinks too, as the backend writes them), 16-bit sinks beside them, and the float64 attention over what
    each row should read: its sinks below first[b], its dequantized slots from first[b] on, the new token."""
    gen = torch.Generator().manual_seed(seed)
    f = paged.PagedFormat(N, g, RANK, kb, hb, key_group=8, lat_group=8, dtype=torch.float32)
    B = len(lengths)
    need = [-(-n // page_size) for n in lengths]
    pool = paged.new_pool(f, sum(need) + 2, page_size, G, DEVICE)
    pool.data.fill_(0xFF)
    bt = torch.full((B, max(need) + 1), 10**6, dtype=torch.int32)
    order = torch.randperm(pool.data.shape[0], generator=gen)
    q = torch.randn(B, H, 1, N, generator=gen)
    kn, hn = torch.randn(B, K, 1, N, generator=gen), torch.randn(B, G, 1, R, generator=gen)
    sk, sh = torch.full((B, K, A, N), float("nan")), torch.full((B, G, A, R), float("nan"))  # unused: NaN
    want = []
    for b, n in enumerate(lengths):
        bt[b, : need[b]] = order[: need[b]].int()
        order = order[need[b] :]
        slots = (bt[b, : need[b]].long()[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:n]
        k = torch.randn(n, K, N, generator=gen) * 2 + 0.5
        h = torch.randn(n, G, R, generator=gen)
        k[:1] *= 4  # a sink that stands out: its exact value matters
        paged.write_slots(pool, slots.to(DEVICE), k.to(DEVICE), h.to(DEVICE))
        fb = firsts[b]
        sk[b, :, :fb], sh[b, :, :fb] = k[:fb].transpose(0, 1), h[:fb].transpose(0, 1)
        kq, hq = paged.read_slots(pool, slots.to(DEVICE)) if n else (k, h[..., :RANK])
        keys = torch.cat([k[:fb], kq.cpu()[fb:], kn[b, :, 0][None]]).double()  # [L, K, N]
        lat = torch.cat([h[:fb], torch.nn.functional.pad(hq.cpu()[fb:], (0, R - RANK)), hn[b, :, 0][None]]).double()
        m = torch.arange(H) // REP
        p = (torch.einsum("hn,lhn->hl", q[b, :, 0].double(), keys[:, m]) * N**-0.5).softmax(-1)
        want.append(torch.einsum("hl,lhr->hr", p, lat[:, m // g]))
    sinks = paged.Sinks(sk.to(DEVICE), sh.to(DEVICE), torch.tensor(firsts, dtype=torch.int32, device=DEVICE))
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    return (q.to(DEVICE), kn.to(DEVICE), hn.to(DEVICE), pool, bt.to(DEVICE), lens, sinks), torch.stack(want)


# rows: a long one, one shorter than the sinks, an empty one, and one whose sinks are read from the pages (no row)
LENGTHS, FIRSTS = [45, 3, 0, 30], [A, 3, 0, 0]


@pytest.mark.parametrize("page_size", [8, 2])  # the sinks in one page, or over two
def test_reference_with_sinks_equals_float64(page_size):
    args, want = case(LENGTHS, FIRSTS, page_size)
    z = paged.paged_attention_reference(*args[:6], N**-0.5, args[6])
    torch.testing.assert_close(z[:, 0].double().cpu(), want, rtol=1e-5, atol=1e-5)
    # without the sinks the same pages give another result: the 16-bit sinks are what differs
    plain = paged.paged_attention_reference(*args[:6], N**-0.5)
    assert (plain[0] - z[0]).abs().max() > 1e-3 and torch.equal(plain[3], z[3])


@pytest.mark.parametrize("page_size,kb,hb", [(8, 4, 4), (2, 2, 4), (64, 16, 16)])
def test_kernel_with_sinks_matches_reference(page_size, kb, hb):
    args, _ = case(LENGTHS, FIRSTS, page_size, kb, hb, seed=page_size)
    ref = paged.paged_attention_reference(*args[:6], N**-0.5, args[6])
    z = pa.paged_latent_attention_sinks(*args[:6], N**-0.5, args[6], SMALL)
    assert torch.isfinite(z).all()
    assert ((z - ref).norm() / ref.norm()).item() < 1e-5


def test_decode_dispatch_kernel_equals_reference(monkeypatch):
    """The backend's decode function on fake pages: the kernel (forced; the CPU has no CUDA) equals the reference,
    with and without sinks; left to choose on the CPU it takes the reference."""
    (q, kn, hn, pool, bt, lens, sinks), _ = case(LENGTHS, FIRSTS, 8)
    calls = []
    for name in ("paged_latent_attention", "paged_latent_attention_sinks"):
        fn = getattr(pa, name)
        monkeypatch.setattr(pa, name, lambda *a, fn=fn, name=name, **kw: calls.append(name) or fn(*a, **kw))
    args = (q[:, :, 0], kn[:, :, 0], hn[:, :, 0], pool, bt, lens, N**-0.5)
    for s in (None, sinks):
        z = decode_attention(*args, sinks=s, kernel=True)
        ref = decode_attention(*args, sinks=s, kernel=False)
        assert z.shape == (len(LENGTHS), H, R)
        assert ((z - ref).norm() / ref.norm()).item() < 1e-5
    assert calls == ["paged_latent_attention", "paged_latent_attention_sinks"]
    assert not kernel_available(q.device) or DEVICE == "cuda"
    decode_attention(*args, sinks=sinks)
    assert len(calls) == (3 if DEVICE == "cuda" else 2)


def test_sink_rows_follow_first_pages():
    rows = SinkRows(3, A)
    # three new requests (nothing cached): three rows; the same step asked again (another layer group): the same
    got = rows.assign(np.array([10, 20, 30]), np.array([0, 0, 0]))
    assert sorted(got.tolist()) == [0, 1, 2]
    assert rows.assign(np.array([10, 20, 30]), np.array([0, 0, 0])).tolist() == got.tolist()
    # decode steps find them by first page, in any batch order
    assert rows.assign(np.array([30, 10]), np.array([7, 5])).tolist() == [got[2], got[0]]
    # a fourth request: no free row; the least recently used one not in this batch goes (20's, unused since)
    r4 = rows.assign(np.array([40, 30, 10]), np.array([0, 8, 6]))
    assert r4.tolist() == [got[1], got[2], got[0]]
    # 20 is gone: a request that still had it reads its sinks from the pages (-1), never another's row
    assert rows.assign(np.array([20]), np.array([9])).tolist() == [-1]
    # a prefix-cache hit on a first page that has a row (cached tokens, same page): that row
    assert rows.assign(np.array([40]), np.array([16])).tolist() == [got[1]]
    # a page never seen with cached tokens (sinks skipped by a prefix hit whose row went): none
    assert rows.assign(np.array([50]), np.array([16])).tolist() == [-1]
    # every row held by this batch: a new request gets none rather than another's
    assert rows.assign(np.array([40, 30, 10, 60]), np.array([1, 1, 1, 0])).tolist() == [got[1], got[2], got[0], -1]
