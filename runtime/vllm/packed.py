"""TALE's packed cache in vLLM's paged cache (stage 2, docs/serving.md): an attention backend whose cache per layer
holds one tale_runtime.paged slot per token and latent group, at one level (key bits, latent bits, rank) per layer.

vLLM sees G cache "heads" per layer, each cell `PagedFormat.slot_bytes` bytes (the spec's num_head_slots and
state_content_bytes, as vLLM's TurboQuant backend packs a token's key and value into one slot). The layer hands the
backend the post-RoPE keys [T, K, n] and the full-rank latents [T, G, R] of its new tokens; the backend packs them into
their slots (write_slots, vLLM's slot_mapping) and returns z [T, H, R] per query head, so the layer's fused O^R
applies: cached tokens add to their first r channels, the new tokens (exact, causal among themselves) to all R. Decode
rows go through decode.decode_attention in one call (the Triton paged kernel on CUDA, else the torch reference),
prefill rows one by one through the same latent attention over their pages (tale_runtime.attention.latent_attention).

Sinks (TALE's first `alpha` tokens at 16 bits): each layer keeps a side buffer [rows, alpha, K, n] of keys and
[rows, alpha, G, R] of full-rank latents, rows = vLLM's max_num_seqs, a request's row keyed by its first page
(sinks.SinkRows says why that is safe). The sinks are written there as well as into their slots; attention reads a
request's positions below alpha from its row and its pages from position alpha on, in one softmax.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from tale_runtime.attention import latent_attention
from tale_runtime.paged import PagedFormat, PagedPool, Sinks, paged_view, write_slots

from .decode import decode_attention
from .sinks import SinkRows

NAME = "TALE_PACKED"
# set on the hf_config by the model class: the sinks each request keeps at 16 bits (0: none)
SINK_TOKENS = "tale_sink_tokens"


def register() -> None:
    """Name the backend in vLLM's registry (vLLM's Attention layer looks its backend up by name)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if NAME not in AttentionBackendEnum.__members__:
        register_backend(NAME, f"{__name__}.TalePackedBackend")


@dataclass
class PackedMetadata(AttentionMetadata):
    num_actual_tokens: int
    query_start_loc: list[int]  # [B + 1] on the host: rows are taken one by one
    seq_lens: list[int]  # [B] cached + new tokens of each row after this step
    block_table: torch.Tensor  # [B, max_pages] int32
    slot_mapping: torch.Tensor  # [N] page * page_size + offset (negative: padding)
    # the rows of one new token each: batch rows [D], their tokens [D] and cached tokens [D] (on the device)
    decode_rows: torch.Tensor | None = None
    decode_tokens: torch.Tensor | None = None
    decode_ctx: torch.Tensor | None = None
    decode_pages: int = 1  # block-table columns the decode rows read (their longest context's pages)
    # sinks: alpha tokens per request in `sink_rows` rows; each request's row [B] (-1: none, its sinks read from
    # the pages) and its positions read from the row, sink_first [B] = min(alpha, cached) (0 without a row); the
    # new tokens below alpha: their indices [W] and where they go in a layer's buffer viewed [rows * alpha, ...]
    alpha: int = 0
    sink_rows: int = 0
    sink_row: torch.Tensor | None = None
    sink_first: torch.Tensor | None = None
    sink_write_tokens: torch.Tensor | None = None
    sink_write_at: torch.Tensor | None = None


class PackedMetadataBuilder(AttentionMetadataBuilder[PackedMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.alpha = int(getattr(vllm_config.model_config.hf_config, SINK_TOKENS, 0) or 0)
        if self.alpha > kv_cache_spec.block_size:  # a request's sinks must lie in its first page (sinks.py)
            raise ValueError(f"{self.alpha} sinks do not fit a page of {kv_cache_spec.block_size} tokens")
        # one row per request vLLM runs at once; every builder of the engine assigns rows alike (same batches)
        self.rows = SinkRows(vllm_config.scheduler_config.max_num_seqs, self.alpha) if self.alpha else None
        self.device, self.page_size = device, kv_cache_spec.block_size

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False):
        m = common_attn_metadata
        B = m.num_reqs
        return packed_metadata(
            m.num_actual_tokens,
            m.query_start_loc_cpu[: B + 1].tolist(),
            m.seq_lens[:B].tolist(),  # exact (the host copy is an upper bound under speculative decoding)
            m.block_table_tensor[:B],
            m.slot_mapping[: m.num_actual_tokens],
            self.page_size,
            self.device,
            self.rows,
        )


def packed_metadata(
    num_actual_tokens: int,
    qsl: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    page_size: int,
    device,
    rows: SinkRows | None = None,
) -> PackedMetadata:
    """A step's metadata, once for every layer: which rows decode, and with sinks each request's row and the new
    tokens below alpha."""
    meta = PackedMetadata(num_actual_tokens, qsl, seq_lens, block_table, slot_mapping)
    B = len(seq_lens)
    new = [qsl[i + 1] - qsl[i] for i in range(B)]
    ctx = [s - t for s, t in zip(seq_lens, new)]
    decode = [i for i in range(B) if new[i] == 1]
    if decode:
        meta.decode_rows = torch.tensor(decode, device=device)
        meta.decode_tokens = torch.tensor([qsl[i] for i in decode], device=device)
        meta.decode_ctx = torch.tensor([ctx[i] for i in decode], dtype=torch.int32, device=device)
        meta.decode_pages = max(1, -(-max(ctx[i] for i in decode) // page_size))
    if rows is None or not B:
        return meta
    A = rows.alpha
    row_of = rows.assign(block_table[:, 0].cpu().numpy(), np.array(ctx)).tolist()
    tokens, at = [], []
    for i, row in enumerate(row_of):
        if row >= 0 and ctx[i] < A:  # this step writes the request's positions ctx .. alpha - 1 (as far as it goes)
            w = min(new[i], A - ctx[i])
            tokens += range(qsl[i], qsl[i] + w)
            at += range(row * A + ctx[i], row * A + ctx[i] + w)
    meta.alpha, meta.sink_rows = A, rows.rows
    meta.sink_row = torch.tensor(row_of, device=device)
    first = [min(A, c) if r >= 0 else 0 for r, c in zip(row_of, ctx)]
    meta.sink_first = torch.tensor(first, dtype=torch.int32, device=device)
    meta.sink_write_tokens = torch.tensor(tokens, dtype=torch.long, device=device)
    meta.sink_write_at = torch.tensor(at, dtype=torch.long, device=device)
    return meta


class TalePackedBackend(AttentionBackend):
    """The packed backend of one slot format; `for_format` makes the class of each format a layer uses."""

    fmt: ClassVar[PagedFormat | None] = None
    forward_includes_kv_cache_update: bool = True  # the slots are written in forward, from the exact k and h
    accept_output_buffer: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls():
        return TalePackedImpl

    @staticmethod
    def get_builder_cls():
        return PackedMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # per layer [pages, page_size, G, slot_bytes]: the layout of tale_runtime.paged's pool
        return (KVCacheLayout.LBNHC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def customize_spec(cls, spec):
        """G cache heads of slot_bytes each per token, whatever the layer's K and head sizes."""
        if cls.fmt is None or spec.state_content_bytes is not None:
            return spec
        return replace(spec, num_head_slots=spec.num_kv_heads // cls.fmt.group, state_content_bytes=cls.fmt.slot_bytes)

    @classmethod
    @functools.cache
    def for_format(cls, fmt: PagedFormat) -> type[TalePackedBackend]:
        """The backend class of one slot format (one per format, shared by the layers that use it)."""
        return type(f"TalePackedBackend_k{fmt.key_bits}_v{fmt.lat_bits}_r{fmt.rank}", (cls,), {"fmt": fmt})


class TalePackedImpl(AttentionImpl[PackedMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        fmt: PagedFormat | None = None,
    ) -> None:
        if fmt is None:
            raise ValueError("the TALE packed backend needs its slot format (fmt=)")
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap is not None:
            raise ValueError("the TALE packed backend has no ALiBi, sliding window or logit soft cap")
        if kv_sharing_target_layer_name is not None:
            raise ValueError("the TALE packed backend does not share caches between layers")
        if kv_cache_dtype != "auto":
            raise ValueError(
                f"the TALE packed cache sets its own bits (kv_cache=...): --kv-cache-dtype {kv_cache_dtype}"
            )
        self.num_heads, self.head_size, self.scale = num_heads, head_size, scale
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.fmt = fmt
        self.num_groups = self.num_kv_heads // fmt.group
        self.latent_rank = fmt.group * head_size  # R: the width of the new tokens' latents and of z
        self.sink_k = self.sink_h = None  # the sinks buffer, made at the first step that has sinks

    def forward(
        self,
        layer,
        query: torch.Tensor,  # [T, H, n]
        key: torch.Tensor,  # [T, K, n] post-RoPE
        value: torch.Tensor,  # [T, K, n] holding the latents [T, G, R] (G R = K n)
        kv_cache: torch.Tensor,  # [pages, G, page_size, slot_bytes] (any dtype: its bytes are the slots)
        attn_metadata: PackedMetadata | None,
        output: torch.Tensor | None = None,  # [T * g, H, n] holding z [T, H, R]
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        H, K, G, n, R = self.num_heads, self.num_kv_heads, self.num_groups, self.head_size, self.latent_rank
        z_out = output.view(-1, H, R)
        if attn_metadata is None:  # the profiling run: no cache yet
            return output.fill_(0)
        N = attn_metadata.num_actual_tokens
        z_out[N:].zero_()
        if N == 0:
            return output
        pages = kv_cache.view(torch.uint8).transpose(1, 2)  # [pages, page_size, G, slot_bytes]
        if not pages.is_contiguous():
            raise RuntimeError(f"TALE packed cache: vLLM gave a non-contiguous page layout {tuple(kv_cache.stride())}")
        pool = PagedPool(pages, self.fmt)
        q, k, h = query[:N], key[:N].view(N, K, n), value[:N].reshape(N, G, R)
        write_slots(pool, attn_metadata.slot_mapping, k, h)
        meta = attn_metadata
        if meta.alpha:
            self._write_sinks(meta, k, h)

        S, qsl, bt = pool.page_size, meta.query_start_loc, meta.block_table
        for i, seq_len in enumerate(meta.seq_lens):
            s, e = qsl[i], qsl[i + 1]
            if e - s > 1:  # a prompt (or a chunk of one): its tokens attend to the pages before it and to each other
                ctx = seq_len - (e - s)
                sel = torch.tensor([i], device=q.device)
                view = paged_view(
                    pool, bt[i : i + 1, : max(1, -(-ctx // S))], torch.tensor([ctx]), self._sinks(meta, sel)
                )
                z = latent_attention(_heads(q[s:e]), _heads(k[s:e]), _heads(h[s:e]), view, self.scale)
                z_out[s:e] = z[0].to(z_out.dtype)
        if meta.decode_rows is not None:
            t, bt = meta.decode_tokens, bt[meta.decode_rows, : meta.decode_pages]
            z = decode_attention(q[t], k[t], h[t], pool, bt, meta.decode_ctx, self.scale, self._sinks(meta, t, True))
            z_out[t] = z.to(z_out.dtype)
        return output

    def _write_sinks(self, meta: PackedMetadata, k: torch.Tensor, h: torch.Tensor) -> None:
        """The new tokens below alpha into this layer's sinks buffer (at the model's dtype: TALE's exact sinks)."""
        if self.sink_k is None:
            A, dev = meta.alpha, k.device
            self.sink_k = torch.zeros(meta.sink_rows, A, *k.shape[1:], dtype=k.dtype, device=dev)
            self.sink_h = torch.zeros(meta.sink_rows, A, *h.shape[1:], dtype=h.dtype, device=dev)
        t = meta.sink_write_tokens
        if t.numel():
            self.sink_k.view(-1, *k.shape[1:])[meta.sink_write_at] = k[t]
            self.sink_h.view(-1, *h.shape[1:])[meta.sink_write_at] = h[t]

    def _sinks(self, meta: PackedMetadata, sel: torch.Tensor, by_token: bool = False) -> Sinks | None:
        """The sinks of batch rows `sel` (or of the decode rows, when `sel` are their tokens) as tale_runtime.paged
        reads them: keys [B, K, alpha, n], latents [B, G, alpha, R]."""
        if not meta.alpha:
            return None
        rows = meta.decode_rows if by_token else sel
        row = meta.sink_row[rows].clamp(min=0)  # -1 (none): first = 0, so the row read is masked out
        return Sinks(self.sink_k[row].transpose(1, 2), self.sink_h[row].transpose(1, 2), meta.sink_first[rows])


def _heads(x: torch.Tensor) -> torch.Tensor:
    """[T, heads, c] -> [1, heads, T, c]."""
    return x.transpose(0, 1)[None]
