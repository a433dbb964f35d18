"""The packed backend's attention (tale_runtime.vllm.packed) on one layer's pages, without an engine: a mixed batch of
decode rows, a chunk of a prompt and a whole prompt against a float64 attention over the tokens the pages hold
(dequantized) plus the new exact ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import VLLM

from tale_runtime.paged import PagedFormat, new_pool, read_slots

pytest.importorskip(VLLM)  # vLLM itself, not this test directory


def reference(q, k_old, h_old, k_new, h_new, scale, g):
    """One row: q [T, H, n]; cached k_old [C, K, n], h_old [C, G, <= R]; new k_new [T, K, n], h_new [T, G, R] ->
    z [T, H, R] in float64, the new tokens causal among themselves."""
    T, H, n = q.shape
    K, R = k_new.shape[1], h_new.shape[-1]
    C = k_old.shape[0]
    k = torch.cat([k_old, k_new]).double()  # [C + T, K, n]
    h = torch.cat([torch.nn.functional.pad(h_old, (0, R - h_old.shape[-1])), h_new]).double()  # [C + T, G, R]
    m = torch.arange(H) // (H // K)  # the KV head of each query head
    logits = torch.einsum("thn,lhn->thl", q.double(), k[:, m]) * scale
    allowed = torch.arange(C + T)[None, :] <= (C + torch.arange(T))[:, None]  # [T, C + T]
    p = logits.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
    return torch.einsum("thl,lhr->thr", p, h[:, m // g])


@pytest.mark.parametrize("alpha", [0, 4])
def test_mixed_batch_equals_float64_reference(alpha):
    """Two steps through the backend: the earlier tokens of three requests as prompts, then a mixed batch. With
    sinks (alpha = 4) each request's first 4 tokens are read back exact from the sinks buffer, the others from their
    4-bit slots."""
    from tale_runtime.vllm.packed import TalePackedImpl, packed_metadata
    from tale_runtime.vllm.sinks import SinkRows

    torch.manual_seed(0)
    H, K, n, g, r, S = 4, 4, 32, 2, 48, 4  # G = 2 latent groups of R = 64, slots keep rank 48
    G, R = K // g, g * n
    fmt = PagedFormat(n, g, r, key_bits=4, lat_bits=4, key_group=32, lat_group=8, dtype=torch.float32)
    pool = new_pool(fmt, num_pages=16, page_size=S, num_groups=G)
    # rows: a decode after 6 cached tokens, a prompt's second chunk of 3 after 5, a whole prompt of 4, a decode after 9
    cached, new = [6, 5, 0, 9], [1, 3, 4, 1]
    pages = torch.randperm(16)
    table = torch.full((4, 4), -7, dtype=torch.int32)  # entries past a row's pages hold anything
    at = 0
    for i, L in enumerate(c + t for c, t in zip(cached, new)):
        need = -(-L // S)
        table[i, :need] = pages[at : at + need].int()
        at += need

    def slots(i, pos):
        return table[i, pos // S].long() * S + pos % S

    impl = TalePackedImpl(H, n, n**-0.5, K, fmt=fmt)
    cache = pool.data.transpose(1, 2).view(torch.float32)  # vLLM's per-layer view [pages, G, page_size, C]
    rows = SinkRows(8, alpha) if alpha else None

    def step(batch, counts, q, k, h):
        """One forward of rows `batch` (their counts of new tokens) after what they hold; returns z [T, H, R]."""
        qsl = [0]
        for t in counts:
            qsl.append(qsl[-1] + t)
        T = q.shape[0]  # two padding rows past qsl[-1], as vLLM pads a batch
        lens = [held[i] + t for i, t in zip(batch, counts)]
        mapping = torch.cat([slots(i, held[i] + torch.arange(t)) for i, t in zip(batch, counts)])
        meta = packed_metadata(qsl[-1], qsl, lens, table[batch], mapping, S, "cpu", rows)
        out = torch.full((T * g, H, n), float("nan"))  # the layer's output buffer: [T, H, R] through O^R
        impl.forward(None, q, k, h.view(T, K, n), cache, meta, out)
        for i, t in zip(batch, counts):
            held[i] += t
        return out.view(T, H, R), qsl, mapping

    held = [0, 0, 0, 0]
    first = [0, 1, 3]  # what earlier steps wrote: three prompts
    old_k = [torch.randn(cached[i], K, n) for i in range(4)]
    old_h = [torch.randn(cached[i], G, R) for i in range(4)]
    T0 = sum(cached)
    step(first, [cached[i] for i in first], torch.randn(T0 + 2, H, n), *(
        torch.cat([x[i] for i in first] + [torch.randn(2, *x[0].shape[1:])]) for x in (old_k, old_h)
    ))  # fmt: skip
    old = []
    for i, c in enumerate(cached):  # as the backend reads them: sinks exact, the rest dequantized (latents[:r])
        kq, hq = read_slots(pool, slots(i, torch.arange(c))) if c else (old_k[i], old_h[i][..., :r])
        a = min(alpha, c)
        old.append((torch.cat([old_k[i][:a], kq[a:]]), torch.cat([old_h[i][:a], pad(hq[a:], R)])))

    N, T = sum(new), sum(new) + 2
    q, k, h = torch.randn(T, H, n), torch.randn(T, K, n), torch.randn(T, G, R)
    z, qsl, mapping = step([0, 1, 2, 3], new, q, k, h)
    for i in range(4):
        s, e = qsl[i], qsl[i + 1]
        want = reference(q[s:e], old[i][0], old[i][1], k[s:e], h[s:e], n**-0.5, g)
        torch.testing.assert_close(z[s:e].double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(z[N:], torch.zeros_like(z[N:]))  # padding rows
    # the new tokens are in their slots now, quantized like the cached ones (4 bits: within a quantization step)
    k_back, h_back = read_slots(pool, mapping)
    assert (k_back - k[:N]).abs().max() < 0.5 and (h_back - h[:N, :, :r]).abs().max() < 0.5
    assert (k_back - k[:N]).abs().max() > 0  # and quantized
    if alpha:  # the whole prompt's first 4 tokens are in its row now, exact
        row = rows.assign(table[[2], 0].numpy(), np.array([4]))[0]
        assert torch.equal(impl.sink_k[row], k[qsl[2] : qsl[2] + 4]) and torch.equal(
            impl.sink_h[row], h[qsl[2] : qsl[3]]
        )


def pad(x, R):
    return torch.nn.functional.pad(x, (0, R - x.shape[-1]))


def test_spec_is_g_slots_of_the_format():
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from tale_runtime.vllm.packed import TalePackedBackend

    fmt = PagedFormat(32, 2, 64, key_bits=4, lat_bits=2, dtype=torch.bfloat16)
    backend = TalePackedBackend.for_format(fmt)
    assert TalePackedBackend.for_format(fmt) is backend  # one class per format
    spec = backend.customize_spec(FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=32, dtype=torch.bfloat16))
    # a slot: g = 2 key rows of 16 code bytes + 4 scale + 4 zero bytes (fp16), rank 64 at 2 bits: 16 + 4 + 4
    assert fmt.slot_bytes == 64
    assert (spec.num_heads, spec.page_size_bytes) == (2, 16 * 2 * 64)
