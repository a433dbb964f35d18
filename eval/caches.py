"""Baseline KV-cache layers for the plain attention path (attention.EvalAttention).

- FullLayer: 16-bit keys and values (what transformers' DynamicCache holds).
- RegionLayer: keys and values (KIVI) or value latents (Palu) held by the runtime's own region
  store (tale_runtime.cache.RegionStore with one level and no sinks): keys per channel over
  groups of `key_group` tokens, values per token over groups of `value_group` channels, real bit
  packing (tale_runtime.quant), and the 16-bit residual flushed by the runtime's rule. So KIVI and
  TALE share one implementation of quantization, grouping and flushing.
- SinkLayer: StreamingLLM. The first `sinks` tokens plus a window of the most recent ones; the
  rest is evicted. Keys keep their original RoPE positions.

transformers' own QuantizedCache (optimum-quanto and HQQ backends) is used as it is (policies.py).
Every layer here counts the tokens it has seen (get_seq_length) and the bytes it holds (nbytes).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from tale_runtime.artifact import Level, Schedule
from tale_runtime.cache import RegionStore
from tale_runtime.quant import dequantize


class FullLayer(DynamicLayer):
    def __init__(self):
        super().__init__()
        self.seen = 0

    def update(self, key_states, value_states, *args, **kwargs):
        self.seen += key_states.shape[-2]
        return super().update(key_states, value_states)

    def get_seq_length(self) -> int:
        return self.seen

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)


class SinkLayer(FullLayer):
    """StreamingLLM: keeps `sinks` first tokens and the `window` most recent ones."""

    def __init__(self, sinks: int, window: int):
        super().__init__()
        if window < 1:
            raise ValueError(f"StreamingLLM window must be >= 1 token, got {window}")
        self.sinks, self.window = sinks, window

    def update(self, key_states, value_states, *args, **kwargs):
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


def region_schedule(
    key_bits: int, value_bits: int, rank: int, key_group: int, value_group: int, residual: int
) -> Schedule:
    """One level, no sinks: KIVI's layout in the runtime's terms (rank = the value/latent width)."""
    return Schedule(
        sinks=0,
        levels=[Level(bits=value_bits, key_bits=key_bits, share=None)],
        ranks=[[rank]],
        key_group=key_group,
        value_group=value_group,
        residual=residual,
        policy="kivi",
    )


class RegionLayer(CacheLayerMixin):
    """A KIVI layer on the runtime's region store. `value_states` are values [B, K, T, n] (KIVI) or
    latents [B, G, T, r] (Palu): either way quantized per token over channel groups.

    update() returns the dequantized past plus the new exact states, so a call's own tokens (the
    prefill, a decode chunk) attend to each other exactly, as in KIVI and in the TALE runtime."""

    is_compileable = False
    is_sliding = False

    def __init__(self, schedule: Schedule, heads: int, head_dim: int, value_heads: int, value_width: int):
        super().__init__()
        schedule.validate(value_width, 1)
        self.store = RegionStore(schedule, 0, heads, head_dim, value_heads, value_width)

    def lazy_initialization(self, key_states, value_states) -> None:  # the store creates its regions
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        dt = key_states.dtype
        past = (
            []
            if self.store.valid is None
            else [(dequantize(r.keys, dt), dequantize(r.lat, dt)) for r in self.store.view().regions]
        )  # position order
        self.store.append(key_states, value_states)
        if not past:
            return key_states, value_states
        return (
            torch.cat([k for k, _ in past] + [key_states], dim=-2),
            torch.cat([v for _, v in past] + [value_states], dim=-2),
        )

    def get_seq_length(self) -> int:
        return self.store.kappa

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.store.kappa + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> int:
        return self.store.nbytes()

    @property
    def is_initialized(self) -> bool:
        return self.store.valid is not None

    @is_initialized.setter
    def is_initialized(self, value) -> None:
        pass


class CountedCache(Cache):
    """A cache of FullLayer / SinkLayer / RegionLayer: bytes held, summed over layers."""

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


class PaluCache(CountedCache):
    """Holds per-layer value ranks: EvalAttention computes values from the rank-r latent (eager) and
    caches the latent instead of the values."""

    def __init__(self, layers: list[RegionLayer], ranks: list[int]):
        super().__init__(layers=layers)
        self.ranks = ranks


def full_cache(num_layers: int) -> CountedCache:
    return CountedCache(layers=[FullLayer() for _ in range(num_layers)])


def kivi_cache(
    num_layers: int, K: int, n: int, bits: int, key_group: int, value_group: int, residual: int
) -> CountedCache:
    s = region_schedule(bits, bits, n, key_group, value_group, residual)
    return CountedCache(layers=[RegionLayer(s, K, n, K, n) for _ in range(num_layers)])


def sink_cache(num_layers: int, sinks: int, window: int) -> CountedCache:
    return CountedCache(layers=[SinkLayer(sinks, window) for _ in range(num_layers)])


def palu_cache(
    ranks: list[int],
    K: int,
    n: int,
    G: int,
    key_bits: int,
    latent_bits: int,
    key_group: int,
    value_group: int,
    residual: int,
) -> PaluCache:
    layers = [
        RegionLayer(region_schedule(key_bits, latent_bits, r, key_group, value_group, residual), K, n, G, r)
        for r in ranks
    ]
    return PaluCache(layers, ranks)
