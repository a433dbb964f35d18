"""TALE attention over vLLM's paged cache (stage 1: keys and latents in 16 bits, in vLLM's own cache and kernels).

Per layer the cache holds, for every KV head, the post-RoPE key (head size n) and, as the value, the latent
h = x A_c of the head's group cut to rank r (head size r; the g heads of a group hold the same latent). vLLM's
attention then returns per query head z_q = sum_t s_qt h_t[:r], and o_proj, which holds O^r cut to those ranks, maps
concat_q z_q to the hidden size (DESIGN.md 4: no value is reconstructed per cached token). At r = R (full rank) this
is the base model's attention up to rounding; the prefill is not the base model's bit for bit, as tale_runtime's is.

With the packed cache (a slot format per layer: FORMATS) the "v" rows are each group's latent once at full rank R and
the attention is TALE's packed backend (packed.py), which returns z [T, H, R] for O^R whole.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import CacheConfig, get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType

from tale_runtime import families

from . import ROTATE

# set on the hf_config by the model class before its layers are built: the value rank of each layer, and the packed
# cache's slot format of each layer (stage 2; absent or None: stage 1)
RANKS = "tale_ranks"
FORMATS = "tale_paged_formats"


def diffkv_backend(head_size: int, head_size_v: int):
    """The attention backend for values narrower or wider than keys: FLASH_ATTN_DIFFKV where it runs, else
    TRITON_ATTN_DIFFKV (the choice vLLM's MiMo-V2 makes), or the one asked for with --attention-backend. Both hold
    one value head size per process (a class attribute), hence one value rank for all layers (source.open_artifact)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    requested = get_current_vllm_config().attention_config.backend
    if requested is not None and requested.name.endswith("_DIFFKV"):
        enum = requested
    else:
        fa = AttentionBackendEnum.FLASH_ATTN_DIFFKV.get_class()
        ok = fa.is_supported_on_current_device(head_size=head_size, head_size_v=head_size_v, has_sinks=False)
        enum = AttentionBackendEnum.FLASH_ATTN_DIFFKV if ok else AttentionBackendEnum.TRITON_ATTN_DIFFKV
    backend = enum.get_class()
    backend.set_head_size_v(head_size_v)
    return backend


class TaleAttention(nn.Module):
    """Takes the arguments of vLLM's LlamaAttention (LlamaDecoderLayer builds it)."""

    def __init__(
        self,
        config,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        max_position_embeddings: int = 8192,
        quant_config: QuantizationConfig | None = None,
        bias: bool = False,
        bias_o_proj: bool = False,
        cache_config: CacheConfig | None = None,
        prefix: str = "",
        attn_type: str = AttentionType.DECODER,
    ) -> None:
        super().__init__()
        if quant_config is not None:
            raise ValueError("TALE artifacts are served unquantized (vLLM weight quantization is not supported)")
        layer = extract_layer_index(prefix)
        bias = bias or config.model_type == "qwen2"  # Qwen2's q, k, v projections have biases
        tp = get_tensor_model_parallel_world_size()
        n = getattr(config, "head_dim", None) or hidden_size // num_heads
        r = getattr(config, RANKS)[layer]
        fmt = (getattr(config, FORMATS, None) or [None] * (layer + 1))[layer]
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)  # fewer KV heads than ranks: each rank holds a copy of one
        backend, extra = None, {}
        if fmt is None and r != n:
            backend = diffkv_backend(n, r)
        elif fmt is not None:
            # packed cache: the "v" rows are each group's latent at full rank R = g n, G R = K n rows, so vLLM's
            # value head size is n; the output z [T, H, R] goes through O^R whole (the slot keeps the first r)
            from .packed import TalePackedBackend

            if tp > 1:
                raise ValueError("the TALE packed cache runs without tensor parallelism (not yet split by groups)")
            r = fmt.group * n
            backend, extra = TalePackedBackend.for_format(fmt), {"fmt": fmt}
        self.packed = fmt is not None
        self.head_dim = n
        # per-token key scales: a Hadamard rotation spreads the few large key channels over all of them (QuaRot)
        self.rotate = self.packed and getattr(config, ROTATE, "hadamard") == "hadamard"
        self.q_size, self.k_size = self.num_heads * n, self.num_kv_heads * n
        self.h_size = self.num_kv_heads * (n if self.packed else r)
        self.z_size = self.num_heads * r

        # q and k as the base model's; the "v" rows are the latent projection A_c[:, :r] per KV head (source.py)
        self.qkv_proj = QKVParallelLinear(
            hidden_size,
            n,
            num_heads,
            num_kv_heads,
            bias=bias,
            prefix=f"{prefix}.qkv_proj",
            v_head_size=n if self.packed else r,
        )
        # O^r cut to rank r: [H*r] -> d; a value bias reaches the output as a constant, hence the o_proj bias
        self.o_proj = RowParallelLinear(num_heads * r, hidden_size, bias=bias or bias_o_proj, prefix=f"{prefix}.o_proj")
        # an RMSNorm over each head's queries and keys before RoPE (the artifact's q_norm, k_norm; Gemma's scales by
        # 1 + weight)
        self.q_norm = self.k_norm = None
        if config.model_type in families.QK_NORM:
            from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

            norm = GemmaRMSNorm if config.model_type == "gemma3_text" else RMSNorm
            self.q_norm, self.k_norm = norm(n, eps=config.rms_norm_eps), norm(n, eps=config.rms_norm_eps)
        types = getattr(config, "layer_types", None)
        rope = getattr(config, "rope_parameters", None)
        if config.model_type in families.ROPE_PER_LAYER_TYPE:  # Gemma 3: a local base on the sliding layers
            rope = rope[types[layer]]
        self.rotary_emb = get_rope(n, max_position=max_position_embeddings, rope_parameters=rope, is_neox_style=True)
        sliding = None
        if types and types[layer] == "sliding_attention":
            sliding = config.sliding_window
        self.attn = Attention(
            self.num_heads,
            n,
            getattr(config, "query_pre_attn_scalar", n) ** -0.5,  # Gemma 3's scale, n^-1/2 elsewhere
            num_kv_heads=self.num_kv_heads,
            cache_config=cache_config,
            per_layer_sliding_window=sliding,
            attn_type=attn_type,
            prefix=f"{prefix}.attn",
            attn_backend=backend,
            head_size_v=n if self.packed else r,
            **extra,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)  # [T, (H + K) n + K r] on this rank
        q, k, h = qkv.split([self.q_size, self.k_size, self.h_size], dim=-1)
        if self.q_norm is not None:  # per head: [T, heads * n] -> [T, heads, n]
            n = self.head_dim
            q = self.q_norm(q.reshape(-1, self.num_heads, n)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.num_kv_heads, n)).view(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        if self.rotate:  # [T, heads * n] -> per head x Q
            from tale_runtime.model import hadamard

            Q, n = hadamard(self.head_dim, q.device, torch.float32), self.head_dim
            q = (q.view(-1, self.num_heads, n).float() @ Q).to(q.dtype).view(q.shape)
            k = (k.view(-1, self.num_kv_heads, n).float() @ Q).to(k.dtype).view(k.shape)
        # [T, H r]: per query head its latent output z_q (packed: r = R)
        z = self.attn(q, k, h, output_shape=torch.Size((q.shape[0], self.z_size)))
        out, _ = self.o_proj(z)  # [T, d]
        return out


def gemma3_attention(
    config,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_position_embeddings: int,
    cache_config: CacheConfig | None = None,
    quant_config: QuantizationConfig | None = None,
    attn_logits_soft_cap: float | None = None,
    prefix: str = "",
) -> TaleAttention:
    """TaleAttention built with the arguments vLLM's Gemma3DecoderLayer gives its Gemma3Attention."""
    if attn_logits_soft_cap is not None:
        raise ValueError("attention logit soft-capping is not supported by TALE")
    del head_dim  # config.head_dim
    return TaleAttention(
        config,
        hidden_size,
        num_heads,
        num_kv_heads,
        max_position_embeddings,
        quant_config=quant_config,
        bias=config.attention_bias,
        cache_config=cache_config,
        prefix=prefix,
    )
