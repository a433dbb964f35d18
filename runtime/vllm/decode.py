"""Decode attention of the packed backend (packed.py): every decode row of a batch (one new token each) in one call,
over the rows' pages and, with sinks, their 16-bit sinks. On a CUDA device with tale_kernels installed it is the
Triton paged kernel (one launch for all rows, registered as the "paged_attention" op of tale_runtime.backends: the
runtime names no kernel module), elsewhere the torch reference over the same pages. No vLLM import: testable alone."""

from __future__ import annotations

import torch

from tale_runtime import backends
from tale_runtime.paged import PagedPool, Sinks, paged_attention_reference


def kernel_available(device: torch.device) -> bool:
    """Whether decode rows on `device` go to the Triton kernel: a CUDA device and the kernel's op registered."""
    return device.type == "cuda" and backends.op("paged_attention") is not None


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    h: torch.Tensor,
    pool: PagedPool,
    block_table: torch.Tensor,
    ctx: torch.Tensor,
    scale: float,
    sinks: Sinks | None = None,
    kernel: bool | None = None,
) -> torch.Tensor:
    """z [B, H, R] (float32) of B decode rows: q [B, H, n], the new tokens' post-RoPE keys k [B, K, n] and full-rank
    latents h [B, G, R] (attended exactly), block_table [B, max_pages] int32, ctx [B] cached tokens of each row (on
    q's device). kernel: None picks the Triton kernel where kernel_available; True asks for it (on the CPU under
    TRITON_INTERPRET=1: the tests), False the torch reference."""
    q, k, h = q[:, :, None], k[:, :, None], h[:, :, None]  # one new token: [B, heads, 1, c]
    use = kernel_available(q.device) if kernel is None else kernel
    pa = backends.op("paged_attention") if use else None
    if use and pa is None:
        raise RuntimeError("the Triton paged kernel is not installed (tale_kernels with Triton)")
    bt = block_table.to(torch.int32)
    if pa is None:
        z = paged_attention_reference(q, k, h, pool, bt, ctx, scale, sinks)
    elif sinks is None:
        z = pa.paged_latent_attention(q, k, h, pool, bt, ctx, scale)
    else:
        z = pa.paged_latent_attention_sinks(q, k, h, pool, bt, ctx, scale, sinks)
    return z[:, 0]
