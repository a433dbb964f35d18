"""Baseline KV caches for the plain attention path (attention.EvalAttention), each counting its bytes.

- full: 16-bit keys and values (what transformers' DynamicCache holds).
- kivi: KIVI. Keys per channel over groups of `key_group` tokens, values per token over groups
  of `value_group` channels, at b bits; the newest tokens stay 16-bit until `residual` of them
  fill whole key groups (the same rule as TALE's residual).
- sink: StreamingLLM. The first `sinks` tokens plus a window of the most recent ones; the rest is
  evicted. Keys keep their original RoPE positions.
- palu: Palu-style low rank. Keys as KIVI; values cached as latents h = x A_r at 3 bits.

Quantized groups never change once written, so each layer keeps their dequantized copy for the
attention and counts the bytes of the packed form: real bit-packed codes + scales + zero points
(tale_runtime.quant) for 2/4/8 bits, and ceil(n*bits/8) bytes of codes + scales + zero points for
3 bits, which the packer does not support (simulated quantization, exact byte count).
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache, DynamicLayer

from tale_runtime.quant import quantize


def fake_quantize(x: torch.Tensor, bits: int, group: int, dim: int) -> tuple[torch.Tensor, int]:
    """Quantize and dequantize x (KIVI min/max, groups along `dim`); returns (dequantized, packed bytes)."""
    if bits == 16:
        return x, x.numel() * x.element_size()
    if bits in (2, 4, 8):
        q = quantize(x, bits, group, dim)
        return q.dequantize(x.dtype), q.nbytes()
    dim = dim % x.dim()
    xg = x.float().unflatten(dim, (x.shape[dim] // group, group))
    mn, mx = xg.amin(dim + 1, keepdim=True), xg.amax(dim + 1, keepdim=True)
    scale = (mx - mn) / ((1 << bits) - 1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((xg - mn) / safe).round_().clamp_(0, (1 << bits) - 1)
    # scales and zero points are stored in x's dtype, as tale_runtime.quant stores them
    deq = (codes * scale.to(x.dtype).float() + mn.to(x.dtype).float()).flatten(dim, dim + 1).to(x.dtype)
    return deq, math.ceil(x.numel() * bits / 8) + 2 * scale.numel() * x.element_size()


class CountedLayer(DynamicLayer):
    """A cache layer that tracks the tokens it has seen and the bytes it holds."""

    def __init__(self):
        super().__init__()
        self.seen = 0
        self.kv_shape: tuple[int, int, int] | None = None  # (batch, kv heads, head dim)

    def _see(self, key_states: torch.Tensor) -> bool:
        """Record new tokens; True at the first call (the prefill)."""
        first = not self.is_initialized
        if first:
            B, K, _, n = key_states.shape
            self.kv_shape = (B, K, n)
        self.seen += key_states.shape[-2]
        return first

    def get_seq_length(self) -> int:
        return self.seen

    def baseline_nbytes(self) -> int:
        """16-bit K+V bytes of every token seen."""
        if self.kv_shape is None:
            return 0
        B, K, n = self.kv_shape
        return 2 * B * K * self.seen * n * 2

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)


class FullLayer(CountedLayer):
    def update(self, key_states, value_states, *args, **kwargs):
        self._see(key_states)
        return super().update(key_states, value_states)


class QuantLayer(CountedLayer):
    """KIVI-style layer: quantized groups + a 16-bit residual (self.keys / self.values).
    Values may be latents (Palu): they are quantized per token over channel groups either way."""

    def __init__(self, key_bits: int, value_bits: int, key_group: int, value_group: int, residual: int):
        super().__init__()
        self.key_bits, self.value_bits = key_bits, value_bits
        self.key_group, self.value_group, self.residual = key_group, value_group, residual
        self.qk = self.qv = None  # dequantized copies of the quantized groups
        self.qbytes = 0

    def update(self, key_states, value_states, *args, **kwargs):
        first = self._see(key_states)
        if first:
            self.lazy_initialization(key_states, value_states)
            self.qk, self.qv = self.keys, self.values
            out = key_states, value_states  # the prefill attends to exact states (KIVI)
        else:
            out = (torch.cat([self.qk, self.keys, key_states], dim=-2),
                   torch.cat([self.qv, self.values, value_states], dim=-2))
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        n = self.keys.shape[-2]
        if n >= self.residual:  # quantize whole key groups, as if the tokens came one by one
            q = n // self.key_group * self.key_group
            k, kb = fake_quantize(self.keys[..., :q, :], self.key_bits, self.key_group, dim=-2)
            v, vb = fake_quantize(self.values[..., :q, :], self.value_bits, min(self.value_group, self.values.shape[-1]), dim=-1)
            self.qk, self.qv = torch.cat([self.qk, k], dim=-2), torch.cat([self.qv, v], dim=-2)
            self.qbytes += kb + vb
            self.keys, self.values = self.keys[..., q:, :], self.values[..., q:, :]
        return out

    def nbytes(self) -> int:
        return self.qbytes + super().nbytes()


class SinkLayer(CountedLayer):
    """StreamingLLM: keeps `sinks` first tokens and the `window` most recent ones."""

    def __init__(self, sinks: int, window: int):
        super().__init__()
        if window < 1:
            raise ValueError(f"StreamingLLM window must be >= 1 token, got {window}")
        self.sinks, self.window = sinks, window

    def update(self, key_states, value_states, *args, **kwargs):
        self._see(key_states)
        keys, values = super().update(key_states, value_states)
        if keys.shape[-2] > self.sinks + self.window:  # evict after this step's attention
            s, w = self.sinks, self.window
            self.keys = torch.cat([keys[..., :s, :], keys[..., -w:, :]], dim=-2)
            self.values = torch.cat([values[..., :s, :], values[..., -w:, :]], dim=-2)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # kv index j is at position j + offset: the new tokens land on their true positions, so the
        # causal mask among them is right; every kept past token precedes them.
        held = 0 if self.keys is None else self.keys.shape[-2]
        return held + query_length, self.seen - held


class CountedCache(Cache):
    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def baseline_nbytes(self) -> int:
        return sum(layer.baseline_nbytes() for layer in self.layers)


class PaluCache(CountedCache):
    """Holds per-layer value ranks: EvalAttention computes values from the rank-r latent (eager) and
    caches the latent instead of the values."""

    def __init__(self, layers: list[QuantLayer], ranks: list[int]):
        super().__init__(layers=layers)
        self.ranks = ranks


def full_cache(num_layers: int) -> CountedCache:
    return CountedCache(layers=[FullLayer() for _ in range(num_layers)])


def kivi_cache(num_layers: int, bits: int, key_group: int, value_group: int, residual: int) -> CountedCache:
    return CountedCache(layers=[QuantLayer(bits, bits, key_group, value_group, residual) for _ in range(num_layers)])


def sink_cache(num_layers: int, sinks: int, window: int) -> CountedCache:
    return CountedCache(layers=[SinkLayer(sinks, window) for _ in range(num_layers)])


def palu_cache(ranks: list[int], key_bits: int, latent_bits: int, key_group: int, value_group: int, residual: int) -> PaluCache:
    return PaluCache([QuantLayer(key_bits, latent_bits, key_group, value_group, residual) for _ in ranks], ranks)
