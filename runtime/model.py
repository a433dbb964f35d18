"""TALE attention for the decoder layers of the supported families (tale_runtime.families) and the HF-compatible
TaleCache.

Prefill (empty cache): exact q, k, v through the original projections (v_proj kept in the
artifact), exact attention through the model's own attention function (SDPA/flash), output
through the original W_O: bit-identical to the base model; then the prompt is cached as
keys + latents h = x A by region. A prompt longer than the model's prefill chunk runs each decoder
layer over pieces of it in turn (chunked_prefill): the same exact attention, a fraction of the memory.
Later calls (decode, or chunks after a prefix): attention over the compressed cache plus the
new exact tokens, summed in latent space, output through O^r (fused) or B then W_O
(factored). Values are never reconstructed per cached token.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.attention.bias as attn_bias
from packaging.version import Version
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import families
from .artifact import Schedule
from .attention import apply_rope
from .backends import TORCH, AttentionBackend
from .cache import CacheStep, RegionStore, RopeTables, TransformersCacheLayer
from .spec import CacheSpec
from .static_cache import StaticTaleCache

# transformers 5.24 renamed the cache argument of forward() and generate(), and the output field, from
# past_key_values to cache (the old name is deprecated until 5.40): the runtime passes and reads the installed one
CACHE_KW = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def cache_arg(cache) -> dict:
    """The keyword that hands `cache` to forward()/generate() in the installed transformers."""
    return {CACHE_KW: cache}


_HADAMARD: dict = {}


def hadamard(n: int, device, dtype) -> torch.Tensor:
    """Normalized Sylvester-Hadamard matrix [n, n] (n a power of two): orthogonal and symmetric."""
    key = (n, str(device), dtype)
    if key not in _HADAMARD:
        H = torch.ones(1, 1, dtype=torch.float64)
        while H.shape[0] < n:
            H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
        _HADAMARD[key] = (H / n**0.5).to(device=device, dtype=dtype)
    return _HADAMARD[key]


def rotation(cache, n: int, device) -> torch.Tensor | None:
    """The cache's key rotation Q [n, n] float32 (schedule.rotate == "hadamard"), else None."""
    return hadamard(n, device, torch.float32) if cache.schedule.rotate == "hadamard" else None


def rotate(t: torch.Tensor, Q: torch.Tensor | None) -> torch.Tensor:
    """t Q in t's dtype (q Q . k Q = q . k: only the cached keys and the decode queries change)."""
    return t if Q is None else (t.float() @ Q).to(t.dtype)


class DynamicTaleLayer(RegionStore, TransformersCacheLayer):
    """One layer of TaleCache: a RegionStore (the tokens) that transformers sees as a cache layer (length, mask sizes,
    update); the static cache's counterpart is static_cache.StaticTaleLayer."""

    def __init__(self, *args, **kwargs):
        TransformersCacheLayer.__init__(self)
        RegionStore.__init__(self, *args, **kwargs)

    def update(self, key_states, value_states, valid=None, queries=None, rope=None, window=None):
        """transformers' cache-layer update, as TALE caches it: post-RoPE keys [B, K, T, n] and the latents
        h = x A [B, G, T, R] of T new exact tokens (`append`; `window`: the layer's sliding window); returns them
        unchanged (attention over the cached tokens reads view(), the new ones are passed to it apart)."""
        self.append(key_states, value_states, valid, queries, rope, window)
        return key_states, value_states

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.rope.__init__()  # the shared tables: every layer resets with the cache (idempotent)
        RegionStore.__init__(
            self, self.s, self._layer_idx, self.K, self.n, self.G, self.R, self.keep, self.basis, self.rope
        )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: pick batch rows of every region."""
        if self.valid is None:
            return

        def pick(t):
            return None if t is None else t.index_select(0, beam_idx.to(t.device))

        # the rope tables are the cache's, shared by its layers: TaleCache.reorder_cache picks their rows once
        self.sink_k, self.sink_h, self.res_k, self.res_h, self.valid = map(
            pick, (self.sink_k, self.sink_h, self.res_k, self.res_h, self.valid)
        )
        for i, st in enumerate(self.levels):
            if st is not None:
                keys, lat = (
                    replace(q, data=pick(q.data), scale=pick(q.scale), zero=pick(q.zero)) for q in (st.keys, st.lat)
                )
                self.levels[i] = replace(st, keys=keys, lat=lat)

    @property
    def is_initialized(self) -> bool:  # HF asks; we have state once a token is cached
        return self.valid is not None

    @is_initialized.setter
    def is_initialized(self, value) -> None:
        pass


class TaleCache(CacheStep, Cache):
    """The TALE cache for a whole model: one DynamicTaleLayer per decoder layer; `backend` serves its decode attention."""

    def __init__(
        self,
        schedule: Schedule,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_groups: int,
        latent_rank: int,
        keep: str = "recent",
        key_basis: list | None = None,
        backend: AttentionBackend = TORCH,
        rope_types: list | None = None,
    ):
        layers = []
        # key_rope "pre": one table of RoPE per position for all layers of a type (rope_types[i], families.rope_types:
        # Gemma 3's sliding and global layers rotate by different bases; None: one table for all layers)
        types = rope_types or [None] * num_layers
        self.ropes = {t: RopeTables() for t in dict.fromkeys(types)}
        for i in range(num_layers):
            basis = None if key_basis is None else key_basis[i]
            rope = self.ropes[types[i]]
            layer = DynamicTaleLayer(schedule, i, num_kv_heads, head_dim, num_groups, latent_rank, keep, basis, rope)
            layer._layer_idx = i
            layers.append(layer)
        super().__init__(layers=layers)
        self.schedule = schedule
        self.backend = backend

    @classmethod
    def from_spec(
        cls,
        spec: CacheSpec,
        *,
        keep: str = "recent",
        key_basis: list | None = None,
        backend: AttentionBackend = TORCH,
        rope_types: list | None = None,
    ) -> TaleCache:
        """The dynamic cache a CacheSpec describes: its schedule and the shapes of its arch (windows come with each
        update)."""
        a = spec.arch
        shapes = (a.num_layers, a.num_kv_heads, a.head_dim, a.num_groups, a.latent_rank)
        return cls(spec.schedule, *shapes, keep=keep, key_basis=key_basis, backend=backend, rope_types=rope_types)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def baseline_nbytes(self) -> int:
        return sum(layer.baseline_nbytes() for layer in self.layers)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        for rope in self.ropes.values():
            rope.reorder(beam_idx)


TALE_CACHES = (TaleCache, StaticTaleCache)


class TaleWeights(nn.Module):
    """Holds the artifact's tensors under the names of DESIGN.md 6 (`self_attn.tale.*`)."""

    def __init__(self, G: int, d: int, R: int, H: int, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.u_v = nn.Parameter(torch.empty(G, d, R, **kw), requires_grad=False)
        self.v_v = nn.Parameter(torch.empty(G, R, R, **kw), requires_grad=False)
        self.o_fused = nn.Parameter(torch.empty(d, H * R, **kw), requires_grad=False)

    def forward(self, z: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The fused output z O^r (+ bias): [B, T, H*R] -> [B, T, d]. Under tensor parallelism z and O^r hold this
        rank's heads, so the result is a partial sum: the TP plan's all-reduce on this module completes it."""
        out = nn.functional.linear(z, self.o_fused)
        return out if bias is None else out + bias


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's part of a parameter transformers' TP plan made a DTensor (a plain tensor: itself). For the
    base model's weights read outside their module's forward (the value bias, W_O in the constant bias term)."""
    return t.to_local() if t is not None and hasattr(t, "to_local") else t


class TaleAttention(nn.Module):
    def __init__(self, orig: nn.Module, config, layer_idx: int, group: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.head_dim = orig.head_dim
        self.H = config.num_attention_heads
        self.K = config.num_key_value_heads
        self.g = group
        self.G = self.K // group
        self.R = group * self.head_dim
        self.scaling = orig.scaling  # Gemma 3: query_pre_attn_scalar^-1/2
        self.is_causal = True
        self.attention_dropout = 0.0
        self.num_key_value_groups = self.H // self.K
        self.sliding_window = families.layer_window(orig, config)
        # Phi-3: one fused qkv_proj (split here, as transformers does); the others: q_proj, k_proj, v_proj
        self.qkv_proj = getattr(orig, "qkv_proj", None) if families.fused_qkv(config) else None
        self.q_proj, self.k_proj = getattr(orig, "q_proj", None), getattr(orig, "k_proj", None)
        self.o_proj = orig.o_proj
        # Qwen3, Gemma 3: RMSNorm over each head's queries and keys, before RoPE (the cache holds the normed keys)
        self.q_norm, self.k_norm = getattr(orig, "q_norm", None), getattr(orig, "k_norm", None)
        w = families.value_weight(orig, config)
        self.tale = TaleWeights(self.G, config.hidden_size, self.R, self.H, dtype=w.dtype, device=w.device)
        # The original value projection (weight and Qwen2's bias) serves the exact prefill
        # (DESIGN.md 4). A value bias passes through latent attention unchanged (softmax weights
        # sum to 1), so later calls add it after attention.
        self.v_proj = getattr(orig, "v_proj", None)
        self.output_path = "fused"  # or "factored"
        self.pieces: _Pieces | None = None  # set while chunked_prefill runs this layer over pieces of the prompt
        self.tp_size, self.tp_rank = 1, 0

    def shard_heads(self, tp_size: int, rank: int) -> None:
        """Count this rank's heads and groups (tensor parallelism: whole latent groups per rank, runtime/tp.py)."""
        self.H, self.K, self.G = self.H // tp_size, self.K // tp_size, self.G // tp_size
        self.tp_size, self.tp_rank = tp_size, rank

    def _split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Phi-3's fused projection [B, T, (H + 2K) n] -> this rank's q [B, T, H n], k and v [B, T, K n]. transformers'
        plan gathers qkv_proj's output whole on every rank: under TP each takes its own heads' columns of each part."""
        N, r, n = self.tp_size, self.tp_rank, self.head_dim
        q, k, v = qkv.split([N * self.H * n, N * self.K * n, N * self.K * n], -1)
        if N == 1:
            return q, k, v
        qs, ks = self.H * n, self.K * n
        return q[..., r * qs : (r + 1) * qs], k[..., r * ks : (r + 1) * ks], v[..., r * ks : (r + 1) * ks]

    @property
    def v_bias(self) -> torch.Tensor | None:
        """The value bias (Qwen2), this rank's part under TP; None without one (Phi-3 has no v_proj)."""
        return None if self.v_proj is None or self.v_proj.bias is None else local(self.v_proj.bias)

    # -- projections --------------------------------------------------------------------

    def latents(self, x: torch.Tensor) -> torch.Tensor:
        """h = x A per group: [B, T, d] -> [B, G, T, R]."""
        return torch.einsum("btd,cdr->bctr", x, self.tale.u_v)

    def values(self, h: torch.Tensor) -> torch.Tensor:
        """v = h B (+ bias): [B, G, T, R] -> [B, K, T, n]."""
        B, G, T, _ = h.shape
        v = torch.einsum("bctr,crs->bcts", h, self.tale.v_v)  # [B, G, T, g*n]
        v = v.view(B, G, T, self.g, self.head_dim).permute(0, 1, 3, 2, 4).reshape(B, self.K, T, self.head_dim)
        if self.v_bias is not None:
            v = v + self.v_bias.view(1, self.K, 1, self.head_dim)
        return v

    def _bias_heads(self) -> torch.Tensor | None:
        """The value bias per query head, concat_q b_{m(q)}: [H*n] (this rank's heads under TP)."""
        if self.v_bias is None:
            return None
        b = self.v_bias.view(self.K, 1, self.head_dim)
        return b.expand(self.K, self.H // self.K, self.head_dim).reshape(-1)

    def output(self, z: torch.Tensor) -> torch.Tensor:
        """z [B, T, H, R] (latent attention output) -> [B, T, d]. Under TP z holds this rank's heads; the all-reduce of
        the TP plan's entry for self.tale (fused) or o_proj (factored) sums the ranks' parts."""
        B, T = z.shape[:2]
        dtype = self.o_proj.weight.dtype
        b = self._bias_heads()  # softmax weights sum to 1: the value bias passes through attention unchanged
        if self.output_path == "fused":
            bias = None if b is None else nn.functional.linear(b[None], local(self.o_proj.weight))[0]  # b . W_O
            out = self.tale(z.reshape(B, T, -1).to(dtype), bias)
            return out if self.o_proj.bias is None else out + local(self.o_proj.bias)
        rep = self.H // self.K
        zz = z.view(B, T, self.G, self.g, rep, self.R).to(dtype)
        vv = self.tale.v_v.view(self.G, self.R, self.g, self.head_dim)
        y = torch.einsum("btcjir,crjn->btcjin", zz, vv).reshape(B, T, self.H * self.head_dim)
        return self.o_proj(y if b is None else y + b)

    # -- forward ------------------------------------------------------------------------

    def pre_rope(self, x: torch.Tensor, values: bool = False):
        """Queries [B, T, H, n] and keys [B, T, K, n] of x [B, T, d] before RoPE (after the per-head norms), and the
        exact values [B, T, K, n] if `values` (else None)."""
        B, T, _ = x.shape
        if self.qkv_proj is not None:
            q, k, v = self._split_qkv(self.qkv_proj(x))
            v = v if values else None
        else:
            q, k = self.q_proj(x), self.k_proj(x)
            v = self.v_proj(x) if values else None
        q, k = q.view(B, T, -1, self.head_dim), k.view(B, T, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, None if v is None else v.view(B, T, -1, self.head_dim)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, values: bool = False):
        """Post-RoPE queries [B, H, T, n], keys [B, K, T, n] and, if `values`, exact values [B, K, T, n] (else None)."""
        q, k, v = self.pre_rope(x, values)
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        return q, k, None if v is None else v.transpose(1, 2)

    def qk(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-RoPE queries [B, H, T, n] and keys [B, K, T, n] of x [B, T, d]."""
        q, k, _ = self.project(x, cos, sin)
        return q, k

    def exact(self, hidden_states, q, k, attention_mask, cache=None, v=None, **kwargs):
        """The base model's attention, bit for bit: v = x W_V with the original projection, the model's attention
        function, output through W_O. `cache`: any transformers cache (e.g. DynamicCache, the 16-bit baseline) stores k
        and v. `v`: the exact values if already projected."""
        if v is None:
            v = self.pre_rope(hidden_states, values=True)[2].transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        return self.attend_exact(q, k, v, attention_mask, **kwargs)

    def attend_exact(self, q, k, v, attention_mask, **kwargs):
        """q [B, H, T, n] over k, v [B, K, L, n] through the model's attention function, output through W_O."""
        B, _, T, _ = q.shape
        attn = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
        if attn is None:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward as attn
        out, weights = attn(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(B, T, -1).contiguous()), weights

    def forward(
        self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, cache=None, **kwargs
    ):
        cache = cache if cache is not None else past_key_values  # transformers >= 5.24 passes `cache`
        base = not isinstance(cache, TALE_CACHES)  # no cache, or a transformers one: the base model
        prefill = not base and cache.get_seq_length(self.layer_idx) == 0
        q, k, v = self.project(hidden_states, *position_embeddings, values=base or prefill)
        if base:
            return self.exact(hidden_states, q, k, attention_mask, cache, v, **kwargs)

        Q = rotation(cache, self.head_dim, k.device)
        if prefill and self.pieces is not None:
            return self.prefill_piece(hidden_states, q, k, v, attention_mask, cache, Q, **kwargs)
        q_c, k_c = rotate(q, Q), rotate(k, Q)
        # what a cache layer may read besides keys and latents: the queries (keep="salient") and the RoPE tables
        # the keys were rotated by (keys held before RoPE)
        extra = dict(queries=q_c * self.scaling, rope=position_embeddings, window=self.sliding_window)
        if prefill:  # exact prefill; h = x A only fills the cache
            out, weights = self.exact(hidden_states, q, k, attention_mask, None, v, **kwargs)
            B, T, _ = hidden_states.shape
            valid = _valid_from_mask(attention_mask, B, T, hidden_states.device)
            cache.update(k_c, self.latents(hidden_states), self.layer_idx, valid=valid, **extra)
            return out, weights
        h = self.latents(hidden_states)
        z = cache.attend(self.layer_idx, q_c, k_c, h, self.scaling, self.sliding_window)
        cache.update(k_c, h, self.layer_idx, **extra)
        return self.output(z), None

    def prefill_piece(self, x, q, k, v, attention_mask, cache, Q, **kwargs):
        """One piece (positions start .. start + t - 1) of a prefill in pieces (chunked_prefill): its queries
        [B, H, t, n] attend over the exact keys and values of every token up to its last, which this layer holds for
        the whole prompt until its last piece, output through W_O. The last piece caches the whole prompt at once,
        as a prefill in one piece does (same keys, latents, valid tokens and last queries)."""
        p = self.pieces
        B, _, t, _ = q.shape
        s, e = p.start, p.start + t
        if p.k is None:  # [B, K, T, n] keys after RoPE and values, [B, G, T, R] latents
            p.k, p.v = (k.new_empty(B, k.shape[1], p.T, k.shape[-1]) for _ in range(2))
            p.h = x.new_empty(B, self.G, p.T, self.R)
        p.k[:, :, s:e], p.v[:, :, s:e] = k, v
        p.h[:, :, s:e] = self.latents(x)
        keys, values = p.k[:, :, :e], p.v[:, :, :e]
        if attention_mask is None and s > 0:
            out = self.o_proj(_causal_below(q, keys, values, self.scaling).transpose(1, 2).reshape(B, t, -1))
        else:  # the first piece (square causal), or the rows of a 4D mask (padding, sliding windows)
            out, _ = self.attend_exact(q, keys, values, attention_mask, **kwargs)
        # keep="salient" reads the prompt's last key_group queries (RegionStore.append)
        W = cache.schedule.key_group
        qs = rotate(q[..., -W:, :], Q) * self.scaling
        p.q = qs if p.q is None else torch.cat([p.q, qs], -2)[..., -W:, :]
        if e == p.T:
            extra = dict(queries=p.q, rope=p.rope, window=self.sliding_window)
            cache.update(rotate(p.k, Q), p.h, self.layer_idx, valid=p.valid, **extra)
            p.k = p.v = p.h = None
        return out, None


# -- the prefill in pieces -----------------------------------------------------------------------------------------

# Prompts longer than this many tokens are prefilled in pieces of this many (set_prefill_chunk; 0: in one piece). A
# piece's temporaries are the whole-width ones of a decoder layer (~100-200 KiB per token at Llama-3.1-70B widths over
# 4 GPUs): 4096 tokens keep them under 1 GiB, and each piece's matmuls large.
PREFILL_CHUNK = 4096
# SDPA's enable_gqa (K/V heads read by several query heads without copies) appeared in torch 2.5
_GQA = Version(torch.__version__).release[:2] >= (2, 5)


def _causal_below(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the queries q [B, H, t, n] of the last t positions over the keys and values k, v
    [B, K, e, n] of positions 0 .. e - 1: [B, H, t, n]. SDPA with torch's lower-right causal bias: on CUDA its flash
    kernel (16-bit), which reads each KV head for its query heads and makes no mask; where flash does not apply
    (float32 on CUDA) the memory-efficient kernel, which needs as many KV heads as query heads; the CPU makes the
    [t, e] mask."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1 and q.is_cuda:
        from torch.backends.cuda import SDPAParams, can_use_flash_attention

        if not can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, True)):
            k, v, rep = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), 1
    causal = attn_bias.causal_lower_right(q.shape[-2], k.shape[-2])
    return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=scale, enable_gqa=rep > 1)


def set_prefill_chunk(model, tokens: int) -> None:
    """Prefill prompts of more than `tokens` tokens in pieces of `tokens` (0: every prompt in one piece)."""
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise ValueError(f"prefill chunk must be a whole number of tokens >= 0 (0: off), got {tokens!r}")
    model.tale_prefill_chunk = tokens


@dataclass
class _Pieces:
    """A decoder layer's prefill in pieces: the prompt's length, its valid tokens [B, T] and RoPE tables, where the
    current piece starts, and what the layer holds until its last piece (TaleAttention.prefill_piece)."""

    T: int
    valid: torch.Tensor | None
    rope: tuple[torch.Tensor, torch.Tensor]
    start: int = 0
    k: torch.Tensor | None = None  # [B, K, T, n] every token's key after RoPE
    v: torch.Tensor | None = None  # [B, K, T, n] and exact value
    h: torch.Tensor | None = None  # [B, G, T, R] latents
    q: torch.Tensor | None = None  # [B, H, <= key_group, n] the last queries, rotated and scaled


@contextmanager
def chunked_prefill(model, cache, T: int, kwargs: dict):
    """A forward of `model` over T new tokens and `cache` (kwargs: the forward's), with the prefill in pieces where it
    applies: an empty TALE cache, a prompt of more than the model's prefill chunk (set_prefill_chunk, default
    PREFILL_CHUNK), SDPA attention, no hidden states or attention weights asked for, and a mask that is None or 4D.

    Each decoder layer then runs over the prompt a piece at a time (its own forward over the piece's rows, RoPE
    tables and mask rows), writing each piece's output over its input: a row's output depends on its own input and
    on the exact keys and values of the rows before it, which the layer's attention holds for the whole prompt until
    its last piece (TaleAttention.prefill_piece). The final norm runs by pieces the same way. So what a prefill holds
    beyond the cache is one hidden state per token, one layer's exact keys, values and latents, and one piece's
    temporaries, instead of a layer's whole-width temporaries for every token. The same math as one piece: row by row
    the same operations, each query over the same keys."""
    size = getattr(model, "tale_prefill_chunk", PREFILL_CHUNK)
    cfg = model.config
    asked = any(kwargs.get(k, getattr(cfg, k, False)) for k in ("output_hidden_states", "output_attentions"))
    layers = model.model.layers
    if (
        not size
        or T <= size
        or not _GQA
        or asked
        or cache.get_seq_length() != 0
        or cfg._attn_implementation != "sdpa"
        or not all(isinstance(layer.self_attn, TaleAttention) for layer in layers)
    ):
        yield
        return
    user = kwargs.get("inputs_embeds")  # the caller's tensor: never written over
    norm = getattr(model.model, "norm", None)
    patched = [*layers, *([norm] if norm is not None else [])]
    for layer in layers:
        layer.forward = partial(_layer_in_pieces, layer, size, user)
    if norm is not None:
        norm.forward = partial(_rows_in_pieces, norm, size, user)
    try:
        yield
    finally:
        for m in patched:
            del m.forward  # the class's forward again


def _layer_in_pieces(layer, size: int, user, hidden_states, *args, **kwargs):
    """A decoder layer's forward over hidden_states [B, T, d] in pieces of `size` rows (chunked_prefill); the
    layer's own forward where its arguments are not the ones known here."""
    forward = type(layer).forward.__get__(layer)
    x, mask, rope, pos = (
        hidden_states,
        *(kwargs.get(k) for k in ("attention_mask", "position_embeddings", "position_ids")),
    )
    B, T = x.shape[:2]
    known = ("attention_mask", "position_ids")
    if (
        args
        or rope is None
        or any(isinstance(v, torch.Tensor) for k, v in kwargs.items() if k not in known)
        or (mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-2] != T))
    ):
        return forward(x, *args, **kwargs)
    out = torch.empty_like(x) if x is user else x
    attn = layer.self_attn
    attn.pieces = _Pieces(T, _valid_from_mask(mask, B, T, x.device), rope)
    try:
        for s in range(0, T, size):
            e = min(T, s + size)
            kw = dict(kwargs, position_embeddings=tuple(r[:, s:e] for r in rope))
            if pos is not None:
                kw["position_ids"] = pos[..., s:e]
            if mask is not None:  # the piece's rows, over the keys up to its last
                kw["attention_mask"] = mask[:, :, s:e, : mask.shape[-1] - T + e]
            attn.pieces.start = s
            out[:, s:e] = forward(x[:, s:e], **kw)  # rows s:e are read by this piece only
    finally:
        attn.pieces = None
    return out


def _rows_in_pieces(module, size: int, user, x):
    """A row-wise module (the final norm) over x [B, T, d] in pieces of `size` rows, written over x."""
    forward = type(module).forward.__get__(module)
    out = torch.empty_like(x) if x is user else x
    for s in range(0, x.shape[1], size):
        out[:, s : s + size] = forward(x[:, s : s + size])
    return out


def _valid_from_mask(mask, B: int, T: int, device) -> torch.Tensor | None:
    """Real (non-padding) key positions from the prefill mask (bool: True=attend; float: 0=attend).

    The last query (a real token: padding is on the left) sees every real key, except, in a sliding-window layer, those
    out of its window: those see themselves (the diagonal). A padding query whose row a mask fix unmasked entirely also
    sees its successor, which no causal row does, so its diagonal does not count."""
    if mask is None or not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return None
    m = mask[:, 0, -T:, -T:]  # [B, T, T]
    see = m if m.dtype == torch.bool else m == 0
    own = see.diagonal(dim1=1, dim2=2)  # [B, T]: query j sees key j
    ahead = torch.nn.functional.pad(see.diagonal(offset=1, dim1=1, dim2=2), (0, 1))  # query j sees key j + 1
    valid = see[:, -1] | (own & ~ahead)
    return valid.expand(B, T).to(device)
