"""TailorKV (Yao et al. 2025): each layer is either quantization-friendly or sparsity-friendly, decided offline.

- Dense-preference score per layer, on the calibration text: P = n_q - sum over the last n_q queries of the top-k
  attention probabilities (averaged over windows and heads). A layer whose attention spreads out (large P) loses
  little to very low bit widths and much to top-k; the others the other way round.
- Quantization-friendly layers: KIVI at 1 bit (keys per channel, values per token) on the runtime's region store.
- Sparsity-friendly layers: the whole 16-bit cache is offloaded to host memory; the accelerator keeps the sinks and
  the recent tokens, and each step fetches, per query and KV head, the top-k tokens of the offloaded middle into a
  buffer. The top-k is exact here (scores over every offloaded key), an upper bound on an estimated selection.

Bytes: `nbytes()` counts what the accelerator holds (quantized layers; sinks, recent tokens and the last step's
fetched buffer of the offloaded layers), `total_nbytes()` adds the host copy.
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import CacheLayerMixin

from tale_convert.stats import calibration_batches
from tale_runtime.cache import RegionStore

from . import capture
from .caches import CountedCache, FullLayer, RegionLayer, region_schedule
from .sparse import partial_attention


@torch.inference_mode()
def dense_preference(q: torch.Tensor, k: torch.Tensor, scaling: float, n_q: int, topk: int) -> float:
    """P of one layer from its calibration q [N, H, T, n], k [N, K, T, n] (float32)."""
    N, H, T, n = q.shape
    K = k.shape[1]
    t0 = T - n_q
    qq = q[:, :, t0:].reshape(N, K, H // K, n_q, n)
    logits = torch.einsum("bkitn,bkln->bkitl", qq, k) * scaling  # [N, K, rep, n_q, T]
    future = torch.arange(T)[None, :] > torch.arange(t0, T)[:, None]  # [n_q, T]
    probs = logits.masked_fill(future, float("-inf")).softmax(-1)
    top = probs.topk(min(topk, T), dim=-1).values.sum(-1)  # [N, K, rep, n_q]
    return float(n_q - top.sum(-1).mean())


_SCORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {setting: scores}


def layer_scores(model, tok, n_q: int = 32, topk: int = 64, windows: int = 2, length: int = 1024) -> list[float]:
    """P per layer on the calibration text (computed once per model and setting in a process)."""
    known = _SCORES.setdefault(model, {})
    key = (str(model.dtype), n_q, topk, windows, length)
    if key not in known:
        scaling = model.model.layers[0].self_attn.tale.scaling
        data = capture.qkv(model, calibration_batches(tok, count=1, length=length, batch=windows))
        known[key] = [dense_preference(q, k, scaling, n_q, topk) for q, k, _ in data]
    return known[key]


def quantized_layers(scores: list[float], count: int) -> list[int]:
    """The `count` layers with the densest attention (largest P), in layer order."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return sorted(order[:count])


class LowBitLayer(RegionLayer):
    """KIVI on the runtime's region store at any width tale_runtime.quant packs, 1 bit included: the artifact's
    Schedule.validate (2-16 bits, what the decode kernels read) is not asked, the store itself takes any."""

    def __init__(self, bits: int, group: int, residual: int, heads: int, head_dim: int):
        CacheLayerMixin.__init__(self)
        s = region_schedule(bits, bits, head_dim, group, min(group, head_dim), residual)
        self.store = RegionStore(s, 0, heads, head_dim, heads, head_dim)


class OffloadLayer(FullLayer):
    """A sparsity-friendly layer: `keys`/`values` hold the sinks and the `recent` newest tokens (accelerator),
    `host_keys`/`host_values` the offloaded middle, `fetched_keys`/`fetched_values` the last step's top-k buffer."""

    def __init__(self, sinks: int, recent: int, topk: int, scaling: float):
        super().__init__()
        if recent < 1 or topk < 1:
            raise ValueError(f"TailorKV needs recent >= 1 and topk >= 1, got {recent} and {topk}")
        self.sinks, self.recent, self.topk, self.scaling = sinks, recent, topk, scaling
        self.host_keys: torch.Tensor | None = None  # [B, K, M, n]
        self.host_values: torch.Tensor | None = None
        self.fetched_keys: torch.Tensor | None = None  # [B, K, U, n]
        self.fetched_values: torch.Tensor | None = None

    def _fetch(self, q: torch.Tensor) -> torch.Tensor | None:
        """Top-k of the offloaded middle per query and KV head (by the attention probabilities summed over the KV
        head's query heads) into the fetched buffer; returns the per-query mask over the buffer [B, H, T, U]."""
        hk, hv = self.host_keys, self.host_values
        if hk is None or hk.shape[-2] == 0:
            self.fetched_keys = self.fetched_values = None
            return None
        B, H, T, n = q.shape
        K, M = hk.shape[1], hk.shape[-2]
        logits = torch.einsum("bkitn,bkmn->bkitm", q.float().view(B, K, H // K, T, n), hk.float()) * self.scaling
        score = logits.softmax(-1).sum(2)  # [B, K, T, M]
        k = min(self.topk, M)
        chosen = torch.zeros(B, K, T, M, dtype=torch.bool, device=q.device)
        chosen.scatter_(-1, score.topk(k, dim=-1).indices, True)
        union = chosen.any(2)  # [B, K, M]: what the step fetches
        U = int(union.sum(-1).max())
        slots = union.float().topk(U, dim=-1, sorted=False).indices.sort(-1).values  # [B, K, U] (pad: unchosen)
        live = union.gather(-1, slots)  # [B, K, U]: a padding slot holds a token no query asked for
        self.fetched_keys = hk.gather(2, slots[..., None].expand(B, K, U, n))
        self.fetched_values = hv.gather(2, slots[..., None].expand(B, K, U, n))
        per_query = chosen.gather(-1, slots[:, :, None].expand(B, K, T, U)) & live[:, :, None]
        return per_query[:, :, None].expand(B, K, H // K, T, U).reshape(B, H, T, U)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, H, T, n] over sinks, fetched top-k, recent tokens and the new k, v [B, K, T, n] (then cached)."""
        mask = self._fetch(q)
        if self.keys is None:
            held_k = held_v = held_mask = None
        elif mask is None:
            held_k, held_v, held_mask = self.keys, self.values, None
        else:
            s = self.sinks
            held_k = torch.cat([self.keys[..., :s, :], self.fetched_keys, self.keys[..., s:, :]], dim=-2)
            held_v = torch.cat([self.values[..., :s, :], self.fetched_values, self.values[..., s:, :]], dim=-2)
            B, H, T, _ = q.shape
            on = torch.ones(B, H, T, 1, dtype=torch.bool, device=q.device)
            held_mask = torch.cat([on.expand(B, H, T, s), mask, on.expand(B, H, T, self.keys.shape[-2] - s)], dim=-1)
        num, den, _ = partial_attention(q, k, v, held_k, held_v, self.scaling, held_mask)
        self.update(k, v)
        return (num / den[..., None]).to(q.dtype)

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states)
        s, r = self.sinks, self.recent
        if keys.shape[-2] > s + r:  # the tokens leaving the recent window go to the host
            out_k, out_v = keys[..., s:-r, :], values[..., s:-r, :]
            if self.host_keys is None:
                self.host_keys, self.host_values = out_k, out_v
            else:
                self.host_keys = torch.cat([self.host_keys, out_k], dim=-2)
                self.host_values = torch.cat([self.host_values, out_v], dim=-2)
            self.keys = torch.cat([keys[..., :s, :], keys[..., -r:, :]], dim=-2)
            self.values = torch.cat([values[..., :s, :], values[..., -r:, :]], dim=-2)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # the quantized layers' mask (attend builds its own): one mask serves every layer of the model
        return self.seen + query_length, 0

    def nbytes(self) -> int:
        held = (self.keys, self.values, self.fetched_keys, self.fetched_values)
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def host_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.host_keys, self.host_values) if t is not None)


class TailorCache(CountedCache):
    """RegionLayer (quantized) and OffloadLayer (sparse) layers; `nbytes` is what the accelerator holds."""

    def total_nbytes(self) -> int:
        return self.nbytes() + sum(layer.host_nbytes() for layer in self.layers if isinstance(layer, OffloadLayer))


def _check_bits(bits: int) -> None:
    from tale_runtime.quant import BITS

    if bits != 16 and bits not in BITS:
        raise ValueError(f"TailorKV bits must be one of {', '.join(map(str, BITS))} or 16, got {bits}")


def tailor_cache(
    quantized: list[int],
    layers: int,
    K: int,
    n: int,
    bits: int,
    group: int,
    residual: int,
    sinks: int,
    recent: int,
    topk: int,
    scaling: float,
) -> TailorCache:
    _check_bits(bits)
    return TailorCache(
        layers=[
            LowBitLayer(bits, group, residual, K, n) if i in quantized else OffloadLayer(sinks, recent, topk, scaling)
            for i in range(layers)
        ]
    )
